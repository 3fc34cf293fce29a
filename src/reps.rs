//! Repetitions: every configuration runs several times, interleaved round
//! robin with the others so that drift of the machine hits all of them
//! alike; each is reported as its median with the spread, and ratios are
//! taken per repetition (the same round of two configurations) before
//! their median and spread.

use std::io::Write;

use crate::run::Row;

/// The median and range of some repeated figure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// The median (the mean of the middle two for an even count).
    pub median: f64,
    /// The least value.
    pub min: f64,
    /// The greatest value.
    pub max: f64,
    /// The distribution-free 95 % confidence interval of the median
    /// ([`median_ci95`]); `None` for fewer than 6 values, where none
    /// reaches 95 %.
    pub ci95: Option<(f64, f64)>,
}

impl Spread {
    /// The spread of `v`; `None` when `v` is empty or holds a NaN.
    pub fn of(v: &[f64]) -> Option<Spread> {
        if v.is_empty() || v.iter().any(|x| x.is_nan()) {
            return None;
        }
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: s[0],
            max: s[n - 1],
            ci95: median_ci95(n).map(|(lo, hi)| (s[lo], s[hi])),
        })
    }

    /// Whether the confidence interval lies wholly on one side of `x`:
    /// the median differs from `x` significantly (at 5 %). `None` without
    /// an interval.
    pub fn differs_from(&self, x: f64) -> Option<bool> {
        self.ci95.map(|(lo, hi)| x < lo || x > hi)
    }
}

/// The ranks (0-based, in sorted order) bounding a 95 % confidence
/// interval for the median of `n` values, from the order statistics
/// alone (no assumption on the distribution): the `k`-th smallest and
/// the `k`-th largest for the largest `k` with P(B < k) <= 2.5 %, where B
/// is Binomial(n, 1/2), so that the interval covers the median with
/// probability at least 95 %. For 25 values, the 8th and the 18th.
/// `None` for fewer than 6 values.
pub fn median_ci95(n: usize) -> Option<(usize, usize)> {
    // P(B = i) for i = 0, 1, ..., summed while the tail stays within 2.5 %;
    // kept as a logarithm, since 2^-n underflows past n = 1074.
    let mut ln_p = -(n as f64) * std::f64::consts::LN_2;
    let mut tail = 0.0;
    let mut k = 0;
    while k < n / 2 && tail + ln_p.exp() <= 0.025 {
        tail += ln_p.exp();
        ln_p += ((n - k) as f64).ln() - ((k + 1) as f64).ln();
        k += 1;
    }
    (k > 0).then(|| (k - 1, n - k))
}

/// One row for the repetitions `reps` of one configuration: the median
/// repetition's row (by ns per packet) with `ns_per_pkt`, `gbit_s` and
/// `driver_ns_per_pkt` replaced by their medians and their ranges filled
/// in, `faults` summed over the repetitions, `bytes_verified` the least
/// any repetition verified and `bytes_sent` the most any sent (so that no
/// repetition's loss is hidden behind the median's, nor behind another
/// repetition's: [`Row::problems`] of the summary sees it). `None` for no
/// repetitions.
pub fn summarise(reps: &[Row]) -> Option<Row> {
    let ns = Spread::of(&reps.iter().map(|r| r.ns_per_pkt).collect::<Vec<_>>())?;
    let gbit = Spread::of(&reps.iter().map(|r| r.gbit_s).collect::<Vec<_>>())?;
    let mut order: Vec<&Row> = reps.iter().collect();
    order.sort_by(|a, b| a.ns_per_pkt.total_cmp(&b.ns_per_pkt));
    let mut out = order[(order.len() - 1) / 2].clone();
    out.reps = reps.len();
    out.ns_per_pkt = ns.median;
    out.ns_per_pkt_min = ns.min;
    out.ns_per_pkt_max = ns.max;
    out.gbit_s = gbit.median;
    out.gbit_s_min = gbit.min;
    out.gbit_s_max = gbit.max;
    out.faults = reps.iter().map(|r| r.faults).sum();
    out.bytes_verified = reps.iter().map(|r| r.bytes_verified).min()?;
    out.bytes_sent = reps.iter().map(|r| r.bytes_sent).max()?;
    let driver: Option<Vec<f64>> = reps.iter().map(|r| r.driver_ns_per_pkt).collect();
    if let Some(d) = driver.as_deref().and_then(Spread::of) {
        out.driver_ns_per_pkt = Some(d.median);
        out.driver_ns_per_pkt_min = Some(d.min);
        out.driver_ns_per_pkt_max = Some(d.max);
    }
    let device: Option<Vec<f64>> = reps.iter().map(|r| r.device_ns_per_pkt).collect();
    if let Some(d) = device.as_deref().and_then(Spread::of) {
        out.device_ns_per_pkt = Some(d.median);
    }
    Some(out)
}

/// `f(a[i]) / f(b[i])` for each repetition `i` (the same round of both),
/// summarised; `None` if the two do not have the same repetitions, or any
/// repetition lacks the figure or has 0 for a denominator (leaving it out
/// would choose the rounds).
pub fn ratio(a: &[Row], b: &[Row], f: impl Fn(&Row) -> Option<f64>) -> Option<Spread> {
    Spread::of(&ratios(a, b, f)?)
}

/// The per-repetition ratios that [`ratio`] summarises.
fn ratios(a: &[Row], b: &[Row], f: impl Fn(&Row) -> Option<f64>) -> Option<Vec<f64>> {
    if a.len() != b.len() {
        return None;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| match (f(x), f(y)) {
            (Some(x), Some(y)) if y != 0.0 => Some(x / y),
            _ => None,
        })
        .collect()
}

/// The two-sided p-value of the exact sign test that the median of `v`
/// is `x`: with the `n` values of `v`, of which `k` lie on the rarer side
/// or equal `x`, twice P(B <= k) for B ~ Binomial(n, 1/2), at most 1. A
/// value equal to `x` counts on the side that keeps `x` in, as the
/// order statistics count it: this is the test [`Spread::ci95`] inverts,
/// and the interval leaves `x` out exactly when this is at most 0.05.
/// `None` for no values, or if `v` or `x` holds a NaN.
pub fn sign_test_p(v: &[f64], x: f64) -> Option<f64> {
    if v.is_empty() || x.is_nan() || v.iter().any(|y| y.is_nan()) {
        return None;
    }
    let n = v.len();
    let below = v.iter().filter(|&&y| y < x).count();
    let above = v.iter().filter(|&&y| y > x).count();
    let k = below.min(above) + (n - below - above);
    // P(B = i) for i = 0..=k, kept as a logarithm as in `median_ci95`.
    let mut ln_p = -(n as f64) * std::f64::consts::LN_2;
    let mut tail = 0.0;
    for i in 0..=k {
        tail += ln_p.exp();
        ln_p += ((n - i) as f64).ln() - ((i + 1) as f64).ln();
    }
    Some((2.0 * tail).min(1.0))
}

/// How many of the hypotheses with p-values `ps` Holm's step-down
/// procedure rejects at the family-wise level `alpha`: the smallest p
/// against `alpha / m`, the next against `alpha / (m - 1)`, and so on,
/// stopping at the first that exceeds its bound. The chance that
/// any true hypothesis is rejected stays within `alpha`, however the
/// tests depend on each other.
pub fn holm_rejections(ps: &[f64], alpha: f64) -> usize {
    let mut s = ps.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len();
    s.iter()
        .enumerate()
        .take_while(|&(i, &p)| p <= alpha / (m - i) as f64)
        .count()
}

/// A job of a sweep, repeated: its label and, per repetition, its rows (a
/// multi-queue run gives a total row first, then one per queue).
pub type JobRows = (String, Vec<Vec<Row>>);

/// One summary row ([`summarise`]) per row a job's repetitions `reps`
/// produced: the total row's, then each queue's.
pub fn summaries(reps: &[Vec<Row>]) -> Vec<Row> {
    let n = reps.first().map_or(0, Vec::len);
    (0..n)
        .filter_map(|k| {
            let ks: Vec<Row> = reps.iter().filter_map(|r| r.get(k).cloned()).collect();
            summarise(&ks)
        })
        .collect()
}

/// The total rows, one per repetition, of the job whose total row is
/// `is`.
fn totals(per_job: &[JobRows], is: impl Fn(&Row) -> bool) -> Option<Vec<Row>> {
    let (_, reps) = per_job
        .iter()
        .find(|j| j.1.first().and_then(|r| r.first()).is_some_and(&is))?;
    Some(reps.iter().filter_map(|r| r.first().cloned()).collect())
}

/// Prints the order sweep's ratios of the same run, for each of `orders`
/// and `mss`, each taken per repetition ([`ratio`]) and shown as median
/// (min–max): persistent (strict IOMMU) against per-frag in Gbit/s (and in
/// CPU per Gbit if `cpu_per_gbit`, with a line rate), against the IOMMU
/// off, against the `limit` ceiling, and in driver ns against the IOMMU
/// off; a line per order (and MSS) that ran persistent with any of them.
///
/// Each line's verdict ("differs from 1") is that comparison's own, at
/// 5 %. With many of them some are bound to differ by chance, so a last
/// line counts how many differ once all the comparisons with an interval
/// are taken together ([`family_line`]).
pub fn print_ratios(
    out: &mut impl Write,
    per_job: &[JobRows],
    orders: &[u32],
    mss: &[u16],
    cpu_per_gbit: bool,
) {
    let gbit = |r: &Row| Some(r.gbit_s);
    let driver = |r: &Row| r.driver_ns_per_pkt;
    let cpu = |r: &Row| r.cpu_ns_per_gbit;
    let mut ps = Vec::new();
    for (o, m) in orders.iter().flat_map(|o| mss.iter().map(move |m| (o, m))) {
        let get = |p: &str, i: &str| {
            totals(per_job, |r| {
                r.order == o.to_string() && r.policy == p && r.iommu == i && r.mss == *m
            })
        };
        let Some(persistent) = get("persistent", "strict") else {
            continue;
        };
        let mut parts = Vec::new();
        let mut add = |name: &str, v: Option<Vec<f64>>| {
            let Some((v, s)) = v.and_then(|v| Spread::of(&v).map(|s| (v, s))) else {
                return;
            };
            parts.push(format!("{name} {}", ratio_text(&s)));
            if s.ci95.is_some() {
                ps.extend(sign_test_p(&v, 1.0));
            }
        };
        let pf = get("per-frag", "strict");
        let off = get("persistent", "off");
        let lim = totals(per_job, |r| r.policy == "limit");
        add(
            "persistent/per-frag",
            pf.as_ref().and_then(|b| ratios(&persistent, b, gbit)),
        );
        if cpu_per_gbit {
            add(
                "CPU per Gbit persistent/per-frag",
                pf.as_ref().and_then(|b| ratios(&persistent, b, cpu)),
            );
        }
        add(
            "persistent/off",
            off.as_ref().and_then(|b| ratios(&persistent, b, gbit)),
        );
        add(
            "persistent/limit",
            lim.and_then(|b| ratios(&persistent, &b, gbit)),
        );
        add(
            "driver ns persistent/off",
            off.as_ref().and_then(|b| ratios(&persistent, b, driver)),
        );
        if !parts.is_empty() {
            let mss = if mss.len() > 1 {
                format!(" mss {m}")
            } else {
                String::new()
            };
            let _ = writeln!(out, "order {o}{mss}: {}", parts.join(", "));
        }
    }
    if let Some(line) = family_line(&ps) {
        let _ = writeln!(out, "{line}");
    }
}

/// The line that takes the comparisons with p-values `ps` (sign tests,
/// [`sign_test_p`]) together: how many differ from 1 under Holm's
/// procedure at a family-wise 5 % ([`holm_rejections`]), against how many
/// did alone. `None` for fewer than two comparisons.
pub fn family_line(ps: &[f64]) -> Option<String> {
    if ps.len() < 2 {
        return None;
    }
    let alone = ps.iter().filter(|&&p| p <= 0.05).count();
    let together = holm_rejections(ps, 0.05);
    Some(format!(
        "all {} comparisons with an interval together (sign tests, Holm, family-wise 5%): \
         {together} differ from 1 ({alone} alone)",
        ps.len()
    ))
}

/// A ratio's median, range and, with enough repetitions, its 95 %
/// confidence interval and whether it differs from 1 significantly.
fn ratio_text(s: &Spread) -> String {
    let mut t = format!("{:.2}x ({:.2}–{:.2}", s.median, s.min, s.max);
    if let Some((lo, hi)) = s.ci95 {
        let verdict = if s.differs_from(1.0) == Some(true) {
            "differs from 1"
        } else {
            "not different from 1"
        };
        t += &format!("; 95% CI {lo:.2}–{hi:.2}, {verdict}");
    }
    t + ")"
}

#[cfg(test)]
mod tests {
    /// A summary row shows every repetition's faults and the least bytes
    /// verified, not the median repetition's: one faulted repetition of
    /// three is not a clean row.
    #[test]
    fn a_summary_keeps_a_faulted_repetition() {
        let rep = |ns: f64, faults: u64, verified: u64| Row {
            ns_per_pkt: ns,
            gbit_s: 1.0,
            faults,
            bytes_verified: verified,
            ..Row::default()
        };
        let s = summarise(&[rep(100.0, 0, 900), rep(200.0, 0, 900), rep(300.0, 7, 800)]).unwrap();
        assert_eq!((s.faults, s.bytes_verified), (7, 800));
    }

    use super::*;

    /// A summary's `bytes_sent` and `bytes_verified` show any
    /// repetition's shortfall: one repetition that verified 50 bytes fewer
    /// than it sent is not hidden behind another that sent fewer.
    #[test]
    fn a_summary_keeps_a_repetition_short_of_its_bytes() {
        let rep = |ns: f64, sent: u64, verified: u64| Row {
            ns_per_pkt: ns,
            gbit_s: 1.0,
            bytes_sent: sent,
            bytes_verified: verified,
            ..Row::default()
        };
        let sound = summarise(&[rep(1.0, 950, 950), rep(2.0, 950, 950)]).unwrap();
        assert!(sound.problems().is_empty(), "{:?}", sound.problems());
        let s = summarise(&[rep(1.0, 1000, 950), rep(2.0, 950, 950), rep(3.0, 950, 950)]).unwrap();
        assert!(!s.problems().is_empty(), "a short repetition passed: {s:?}");
    }

    /// Ratios pair repetitions of the same rounds: two lists of different
    /// lengths are not rounds of one run, and give no ratio.
    #[test]
    fn ratios_of_unequal_repetitions_are_refused() {
        let a = [row(1.0, 2.0, 1.0), row(1.0, 9.0, 1.0), row(1.0, 4.0, 1.0)];
        assert!(ratio(&a, &a[..2], |r| Some(r.gbit_s)).is_none());
        assert!(ratio(&a[..2], &a, |r| Some(r.gbit_s)).is_none());
        assert!(ratio(&a, &a, |r| Some(r.gbit_s)).is_some());
    }

    fn row(ns: f64, gbit: f64, driver: f64) -> Row {
        Row {
            ns_per_pkt: ns,
            gbit_s: gbit,
            driver_ns_per_pkt: Some(driver),
            packets: ns as u64,
            ..Row::default()
        }
    }

    #[test]
    fn spread_takes_the_median_and_the_range() {
        let s = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Spread::of(&[4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
        assert!(Spread::of(&[]).is_none());
        assert!(Spread::of(&[1.0, f64::NAN]).is_none());
    }

    #[test]
    fn the_median_interval_follows_the_binomial_order_statistics() {
        // Fewer than 6 values: even min..max covers the median with less
        // than 95 % (1 - 2 / 2^5 = 93.75 % for 5).
        assert_eq!(median_ci95(5), None);
        assert_eq!(median_ci95(0), None);
        // 6 values: min..max covers it with 96.9 %.
        assert_eq!(median_ci95(6), Some((0, 5)));
        // Textbook values: n = 10 -> 2nd and 9th; n = 25 -> 8th and 18th;
        // n = 100 -> 40th and 61st (1-based).
        assert_eq!(median_ci95(10), Some((1, 8)));
        assert_eq!(median_ci95(25), Some((7, 17)));
        assert_eq!(median_ci95(100), Some((39, 60)));
        // Past 2^-1074, where a plain 2^-n underflows to 0: 1-based 505th
        // and 571st for 1,075 values; 956th and 1,045th for 2,000.
        assert_eq!(median_ci95(1075), Some((504, 570)));
        assert_eq!(median_ci95(2000), Some((955, 1044)));
        let v: Vec<f64> = (1..=25).map(f64::from).collect();
        let s = Spread::of(&v).unwrap();
        assert_eq!(s.ci95, Some((8.0, 18.0)));
        assert_eq!(s.differs_from(7.5), Some(true));
        assert_eq!(s.differs_from(13.0), Some(false));
        assert_eq!(Spread::of(&[1.0, 2.0]).unwrap().differs_from(9.0), None);
    }

    #[test]
    fn summarise_keeps_the_median_repetition_and_the_spread() {
        let reps = [
            row(300.0, 1.0, 30.0),
            row(100.0, 3.0, 10.0),
            row(200.0, 2.0, 20.0),
        ];
        let s = summarise(&reps).unwrap();
        assert_eq!(s.reps, 3);
        assert_eq!(
            (s.ns_per_pkt, s.ns_per_pkt_min, s.ns_per_pkt_max),
            (200.0, 100.0, 300.0)
        );
        assert_eq!((s.gbit_s, s.gbit_s_min, s.gbit_s_max), (2.0, 1.0, 3.0));
        assert_eq!(s.driver_ns_per_pkt, Some(20.0));
        assert_eq!(s.driver_ns_per_pkt_min, Some(10.0));
        assert_eq!(s.driver_ns_per_pkt_max, Some(30.0));
        // The other columns are the median repetition's.
        assert_eq!(s.packets, 200);
        assert!(summarise(&[]).is_none());
    }

    #[test]
    fn ratios_are_taken_per_repetition() {
        let a = [row(1.0, 2.0, 1.0), row(1.0, 9.0, 1.0), row(1.0, 4.0, 1.0)];
        let b = [row(1.0, 1.0, 1.0), row(1.0, 3.0, 1.0), row(1.0, 4.0, 1.0)];
        let r = ratio(&a, &b, |r| Some(r.gbit_s)).unwrap();
        // 2/1, 9/3, 4/4: not the ratio of the medians (4/3).
        assert_eq!((r.median, r.min, r.max), (2.0, 1.0, 3.0));
        let zero = [row(1.0, 0.0, 1.0)];
        assert!(ratio(&a[..1], &zero, |r| Some(r.gbit_s)).is_none());
    }

    /// The sweep's ratios, per order, from the total rows of the same
    /// repetitions; a queue's row is not a total.
    #[test]
    fn ratios_are_printed_per_order() {
        let at = |policy: &str, iommu: &str, gbit: f64| Row {
            order: "3".into(),
            policy: policy.into(),
            iommu: iommu.into(),
            mss: 1448,
            gbit_s: gbit,
            ..Row::default()
        };
        let job = |policy: &str, iommu: &str, g: [f64; 2]| -> JobRows {
            let reps = g
                .iter()
                .map(|&x| vec![at(policy, iommu, x), at(policy, iommu, 99.0)]);
            (policy.into(), reps.collect())
        };
        let per_job = [
            job("persistent", "strict", [4.0, 6.0]),
            job("per-frag", "strict", [2.0, 2.0]),
        ];
        let mut out = Vec::new();
        print_ratios(&mut out, &per_job, &[2, 3], &[1448], false);
        let out = String::from_utf8(out).unwrap();
        assert_eq!(out, "order 3: persistent/per-frag 2.50x (2.00–3.00)\n");
        assert_eq!(summaries(&per_job[0].1).len(), 2);
    }
    #[test]
    fn the_sign_test_counts_the_values_on_each_side() {
        let p = |v: &[f64]| sign_test_p(v, 1.0).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        // Six above 1: 2 / 2^6. Five: 2 / 2^5, never below 5 %.
        assert!(close(p(&[2.0; 6]), 0.03125));
        assert!(close(p(&[0.5; 5]), 0.0625));
        // One of eight below: 2 * (1 + 8) / 2^8.
        assert!(close(
            p(&[0.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]),
            18.0 / 256.0
        ));
        // Three on each side: 2 * (1 + 6 + 15 + 20) / 64 > 1, so 1.
        assert_eq!(p(&[0.5, 0.6, 0.7, 1.5, 1.6, 1.7]), 1.0);
        // A value equal to the median tested counts on the side that
        // keeps it in, as the interval counts it: two of eight at 1 and
        // six above are 2 * (1 + 8 + 28) / 2^8, and the interval [1, 2]
        // holds 1. Left out, six of six above would have said 3 %.
        let tied = [1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0];
        assert!(close(p(&tied), 74.0 / 256.0));
        assert_eq!(Spread::of(&tied).unwrap().differs_from(1.0), Some(false));
        assert_eq!(p(&[1.0, 1.0]), 1.0);
        assert_eq!(sign_test_p(&[], 1.0), None);
        assert_eq!(sign_test_p(&[f64::NAN, 2.0], 1.0), None);
    }

    proptest::proptest! {
        /// The interval and the test are one decision: the interval
        /// leaves 1 out exactly when the test's p is at most 5 %, values
        /// equal to 1 among the others or not.
        #[test]
        fn the_interval_leaves_out_what_the_sign_test_rejects(
            v in proptest::collection::vec(
                proptest::prop_oneof![0.5f64..0.999, 1.001f64..2.0], 6..80),
            ties in 0usize..6,
        ) {
            // Some values equal to 1 as well, where they fall.
            let mut v = v;
            for i in 0..ties {
                v.insert(i * 7 % v.len(), 1.0);
            }
            let s = Spread::of(&v).unwrap();
            let p = sign_test_p(&v, 1.0).unwrap();
            proptest::prop_assert_eq!(s.differs_from(1.0), Some(p <= 0.05), "p {}", p);
        }
    }

    #[test]
    fn holm_compares_each_p_with_a_bound_that_grows_as_it_goes() {
        // Bounds 0.0125, 0.0167, 0.025, 0.05: the second stops it.
        assert_eq!(holm_rejections(&[0.5, 0.02, 0.01, 0.03], 0.05), 1);
        assert_eq!(holm_rejections(&[0.01, 0.012, 0.02, 0.04], 0.05), 4);
        assert_eq!(holm_rejections(&[0.02, 0.03], 0.05), 2);
        assert_eq!(holm_rejections(&[0.03, 0.04], 0.05), 0);
        assert_eq!(holm_rejections(&[], 0.05), 0);
    }

    /// With intervals, the sweep's ratios end with the line that takes
    /// them together; a ratio that differs alone may not differ then.
    #[test]
    fn ratios_with_intervals_end_with_their_family_line() {
        let at = |policy: &str, order: &str, gbit: f64| Row {
            order: order.into(),
            policy: policy.into(),
            iommu: "strict".into(),
            mss: 1448,
            gbit_s: gbit,
            ..Row::default()
        };
        // Order 2: six rounds all above (p 0.031, alone it differs);
        // order 3: 8 rounds all above (p 0.0078).
        let job = |policy: &str, order: &str, g: &[f64]| -> JobRows {
            let reps = g.iter().map(|&x| vec![at(policy, order, x)]);
            (format!("{policy} {order}"), reps.collect())
        };
        let per_job = [
            job("persistent", "2", &[3.0; 6]),
            job("per-frag", "2", &[2.0; 6]),
            job("persistent", "3", &[3.0; 8]),
            job("per-frag", "3", &[2.0; 8]),
        ];
        let mut out = Vec::new();
        print_ratios(&mut out, &per_job, &[2, 3], &[1448], false);
        let out = String::from_utf8(out).unwrap();
        let last = out.lines().last().unwrap();
        assert!(
            out.contains(
                "order 2: persistent/per-frag 1.50x (1.50–1.50; 95% CI 1.50–1.50, differs from 1)"
            ),
            "{out}"
        );
        // 0.0078 <= 0.025, then 0.031 <= 0.05: both hold.
        assert_eq!(
            last,
            "all 2 comparisons with an interval together (sign tests, Holm, family-wise 5%): \
             2 differ from 1 (2 alone)"
        );
        assert_eq!(
            family_line(&[0.031, 0.031, 0.5]).unwrap(),
            "all 3 comparisons with an interval together (sign tests, Holm, family-wise 5%): \
             0 differ from 1 (2 alone)"
        );
        assert_eq!(family_line(&[0.01]), None);
    }
}
