//! pfrag beside its peers, in one run on one core: the frag fast path
//! against DPDK's `rte_mempool` and `rte_pktmbuf`, the `ixgbe-driver`
//! crate's `MemPool` and a `crossbeam_queue::ArrayQueue` free list; the TX
//! queue on the null device against `dpdk-testpmd` txonly on `net_null`.
//! Every in-process row is timed by one harness ([`bench`](mod@bench)). The `peers`
//! example prints the table ([`Table`]) and, last, the summary line
//! ([`Table::summary`]).

pub mod bench;
pub mod dpdk;
pub mod local;
pub mod run;
pub mod tx;

use bench::Timing;

/// Which comparison a row belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// One object out and back.
    Single,
    /// 32 objects out and back, per object.
    Bulk,
    /// Small frames on a null device, per packet.
    Txonly,
    /// 64 KB TSO packets, the driver's time per packet.
    Tso,
}

impl Group {
    fn name(self) -> &'static str {
        match self {
            Group::Single => "single",
            Group::Bulk => "bulk",
            Group::Txonly => "txonly",
            Group::Tso => "tso",
        }
    }
}

/// One row: who, what, and the timing (or why it was skipped).
#[derive(Clone, Debug)]
pub struct Row {
    /// The comparison it belongs to.
    pub group: Group,
    /// The implementation: `pfrag`, `dpdk`, `ixgbe-driver`, `crossbeam`.
    pub who: &'static str,
    /// What was measured.
    pub what: String,
    /// Nanoseconds per object or packet over every round it ran in, or
    /// the reason it did not run.
    pub result: Result<Timing, String>,
    /// Whether this is the pfrag row the group's ratios refer to.
    pub reference: bool,
    /// Its timing in each round, in round order, `None` in a round it
    /// failed in: a ratio takes two rows' samples of the rounds both ran
    /// in only ([`paired`]).
    pub rounds: Vec<Option<Timing>>,
}

/// The samples of `a` and `b` in the rounds both ran in, each side's
/// merged; `None` if either failed for good (a pfrag row that failed in
/// any round), they never ran in the same round, or they do not have the
/// same number of rounds. A ratio of rows
/// measured in different rounds would mix the machine's drift between
/// rounds into it.
pub fn paired(a: &Row, b: &Row) -> Option<(Timing, Timing)> {
    // Rows of one table ran in as many rounds; two that did not cannot
    // be paired round by round.
    if a.result.is_err() || b.result.is_err() || a.rounds.len() != b.rounds.len() {
        return None;
    }
    a.rounds
        .iter()
        .zip(&b.rounds)
        .filter_map(|(x, y)| Some((x.as_ref()?, y.as_ref()?)))
        .fold(None, |acc: Option<(Timing, Timing)>, (x, y)| {
            Some(match acc {
                Some((p, q)) => (p.merged(x), q.merged(y)),
                None => (x.clone(), y.clone()),
            })
        })
}

/// The table of one run.
#[derive(Clone, Debug, Default)]
pub struct Table {
    /// The rows, in print order.
    pub rows: Vec<Row>,
    /// The txonly ratios of each round on its own (testpmd runs in every
    /// round, beside pfrag's rows), in round order; empty for a table that
    /// is not a run's.
    pub rounds: Vec<Txonly>,
    /// Peers' rows that failed in a round ([`note_failures`](Self::note_failures)):
    /// the row's index and the round and reason. Those that ran in another
    /// round are printed with the spread ([`merge`](Self::merge) kept
    /// their other samples); a row that failed in every round says why
    /// itself.
    pub failures: Vec<(usize, String)>,
}

/// The txonly ratios C, D and E of the summary: pfrag's packets per second
/// over testpmd's, 64 B frames (the driver's own time, the whole loop with
/// the IOMMU off, the whole loop under a strict IOMMU); `None` where
/// either side did not run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Txonly {
    /// C: the driver's own time.
    pub driver: Option<f64>,
    /// D: the whole loop, IOMMU off.
    pub off: Option<f64>,
    /// E: the whole loop, strict IOMMU.
    pub strict: Option<f64>,
}

impl Table {
    /// Adds a row.
    pub fn push(
        &mut self,
        group: Group,
        who: &'static str,
        what: impl Into<String>,
        result: Result<Timing, String>,
        reference: bool,
    ) {
        self.rows.push(Row {
            group,
            who,
            what: what.into(),
            rounds: vec![result.as_ref().ok().cloned()],
            result,
            reference,
        });
    }

    /// Adds the repetitions of `other`, a later round of the same rows,
    /// row by row, and its [`rounds`](Self::rounds) and
    /// [`failures`](Self::failures) after this table's. A pfrag row that
    /// failed in either round keeps the failure (its loop is wrong). A
    /// peer's row that failed in one round but ran in another keeps the
    /// samples it has: a peer's run can fail for reasons of its own
    /// (testpmd's start, a deadline), and its other rounds still measured
    /// it.
    pub fn merge(&mut self, other: Table) -> Result<(), String> {
        if self.rows.len() != other.rows.len() {
            return Err(format!(
                "rounds differ: {} rows, then {}",
                self.rows.len(),
                other.rows.len()
            ));
        }
        // Row by row, the same measurement: samples of two would mix.
        let same = |a: &Row, b: &Row| (a.group, a.who, &a.what) == (b.group, b.who, &b.what);
        if let Some((a, b)) = self.rows.iter().zip(&other.rows).find(|(a, b)| !same(a, b)) {
            return Err(format!(
                "rounds differ: row \"{} {} {}\", then \"{} {} {}\"",
                a.group.name(),
                a.who,
                a.what,
                b.group.name(),
                b.who,
                b.what
            ));
        }
        for (a, b) in self.rows.iter_mut().zip(other.rows) {
            let peer = a.who != "pfrag";
            a.rounds.extend(b.rounds);
            a.result = match (&a.result, b.result) {
                (Ok(x), Ok(y)) => Ok(x.merged(&y)),
                (Ok(x), Err(_)) if peer => Ok(x.clone()),
                (Err(_), Ok(y)) if peer => Ok(y),
                (Err(e), _) => Err(e.clone()),
                (_, Err(e)) => Err(e),
            };
        }
        self.rounds.extend(other.rounds);
        self.failures.extend(other.failures);
        Ok(())
    }

    /// Notes every peer's row that failed in this table, a round's, as
    /// failed in round `round` (counted from 1).
    pub fn note_failures(&mut self, round: usize) {
        for (i, r) in self.rows.iter().enumerate() {
            if let (true, Err(e)) = (r.who != "pfrag", &r.result) {
                self.failures.push((i, format!("round {round}: {e}")));
            }
        }
    }

    /// The pfrag row a group's ratios refer to.
    fn reference(&self, g: Group) -> Option<&Row> {
        self.rows.iter().find(|r| r.group == g && r.reference)
    }

    /// The table as text: ns per object or packet (median, min–max over
    /// the repetitions), Mpps, and each row's time as a multiple of the
    /// group's pfrag row (above 1: pfrag is faster), both rows' samples
    /// of the rounds both ran in ([`paired`]).
    pub fn render(&self) -> String {
        let mut s = format!(
            "{:<7} {:<13} {:<58} {:>8} {:>17} {:>7} {:>9}\n",
            "group", "who", "what", "ns", "ns min-max", "Mpps", "x pfrag"
        );
        for r in &self.rows {
            let head = format!("{:<7} {:<13} {:<58}", r.group.name(), r.who, r.what);
            match &r.result {
                Ok(t) => {
                    let x = match self.reference(r.group).and_then(|p| paired(r, p)) {
                        Some((t, p)) => format!("{:.2}", t.median / p.median),
                        None => "-".into(),
                    };
                    s += &format!(
                        "{head} {:>8.2} {:>17} {:>7.1} {:>9}\n",
                        t.median,
                        format!("{:.2}-{:.2}", t.min, t.max),
                        t.mops(),
                        x
                    );
                }
                Err(why) => s += &format!("{head} skipped: {why}\n"),
            }
        }
        s
    }

    /// pfrag / DPDK for a group, against the DPDK row `what` names, with
    /// its spread (as [`ns_ratio`]). `inverse` gives the ratio of rates
    /// (packets per second) instead of times.
    fn ratio(&self, g: Group, what: &str, inverse: bool) -> (String, String, String) {
        let (p, d) = (self.reference(g), self.row(g, "dpdk", what));
        if inverse {
            ns_ratio(d, p)
        } else {
            ns_ratio(p, d)
        }
    }

    /// The ratios with their spread, one line per comparison.
    pub fn spread(&self) -> String {
        let line = |name: &str, (m, range, best): (String, String, String)| {
            format!("{name}: {m} (spread {range}; fastest repetitions {best})\n")
        };
        line(
            "pfrag/dpdk ns per object, single",
            self.ratio(Group::Single, MEMPOOL_SINGLE, false),
        ) + &line(
            "pfrag/dpdk ns per object, bulk against rte_mempool",
            self.ratio(Group::Bulk, MEMPOOL_BULK, false),
        ) + &line(
            "pfrag/dpdk ns per object, bulk against rte_pktmbuf",
            self.ratio(Group::Bulk, MBUF_BULK, false),
        ) + &line(
            "pfrag/dpdk packets per second, txonly",
            self.ratio(Group::Txonly, run::TESTPMD, true),
        ) + &line(
            "virtio/82576 format, the driver's ns per 64 B frame",
            self.format_ratio(),
        ) + &self.by_round()
            + &self.partial_failures()
    }

    /// One line per round a peer's row failed in while it ran in others.
    fn partial_failures(&self) -> String {
        self.failures
            .iter()
            .filter_map(|(i, why)| {
                let r = self.rows.get(*i).filter(|r| r.result.is_ok())?;
                Some(format!(
                    "{} {}: failed in {why}; its other rounds are kept\n",
                    r.who, r.what
                ))
            })
            .collect()
    }

    /// One line of the txonly ratios round by round, if the table has
    /// rounds: how much of the summary's spread is the machine's drift
    /// between rounds.
    fn by_round(&self) -> String {
        if self.rounds.is_empty() {
            return String::new();
        }
        let each: Vec<String> = self
            .rounds
            .iter()
            .map(|t| {
                let [d, o, s] = [t.driver, t.off, t.strict].map(two_places);
                format!("{d}/{o}/{s}")
            })
            .collect();
        format!(
            "pfrag/dpdk packets per second by round (driver/off/strict): {}\n",
            each.join(", ")
        )
    }

    /// The driver's time per 64 B frame in the virtio-net format over the
    /// same in the 82576's, with its spread (as [`ratio`](Self::ratio)).
    fn format_ratio(&self) -> (String, String, String) {
        ns_ratio(
            self.row(Group::Txonly, "pfrag", TX_VIRTIO),
            self.row(Group::Txonly, "pfrag", TX_DRIVER),
        )
    }

    /// The last line: `peers: single pfrag/dpdk=A bulk pfrag/mbuf=B
    /// txonly-driver pfrag/dpdk=C txonly-off pfrag/dpdk=D txonly-strict
    /// pfrag/dpdk=E`. A and B are ratios of ns per object (lower is better
    /// for pfrag): one frag against `rte_mempool` get+put, a burst against
    /// `rte_pktmbuf_alloc_bulk`+`free_bulk` per mbuf. C, D and E are ratios
    /// of packets per second against testpmd txonly (higher is better): 64
    /// B frames, the driver's own time, then the whole loop on the null
    /// device with the IOMMU off, then strict. Each is a ratio of medians
    /// of the two rows' repetitions in the rounds both ran in
    /// ([`paired`]), the rounds the line by round shows.
    pub fn summary(&self) -> String {
        let t = self.txonly();
        let mbuf = self.ratio(Group::Bulk, MBUF_BULK, false).0;
        format!(
            "peers: single pfrag/dpdk={} bulk pfrag/mbuf={mbuf} txonly-driver pfrag/dpdk={} txonly-off pfrag/dpdk={} txonly-strict pfrag/dpdk={}",
            self.ratio(Group::Single, MEMPOOL_SINGLE, false).0,
            two_places(t.driver),
            two_places(t.off),
            two_places(t.strict),
        )
    }

    /// The txonly ratios at the medians of the repetitions of the rounds
    /// both sides ran in ([`paired`]).
    pub fn txonly(&self) -> Txonly {
        let testpmd = self.row(Group::Txonly, "dpdk", run::TESTPMD);
        let tx = |what: &str| {
            let (d, p) = paired(testpmd?, self.row(Group::Txonly, "pfrag", what)?)?;
            Some(d.ratio(&p).0)
        };
        Txonly {
            driver: tx(TX_DRIVER),
            off: tx(TX_OFF),
            strict: tx(TX_STRICT),
        }
    }

    /// The first row of `who` in group `g` whose description starts with
    /// `what`.
    fn row(&self, g: Group, who: &str, what: &str) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.group == g && r.who == who && r.what.starts_with(what))
    }
}

/// A ratio with two decimals, or `n/a` where a side did not run.
fn two_places(r: Option<f64>) -> String {
    r.map_or("n/a".into(), |r| format!("{r:.2}"))
}

/// `a` over `b` in ns, over the rounds both ran in ([`paired`]): the
/// median ratio, its range, and the ratio of the fastest repetitions, or
/// `n/a` when either did not run.
fn ns_ratio(a: Option<&Row>, b: Option<&Row>) -> (String, String, String) {
    match a.zip(b).and_then(|(a, b)| paired(a, b)) {
        Some((a, b)) => {
            let (m, lo, hi) = a.ratio(&b);
            (
                format!("{m:.2}"),
                format!("{lo:.2}-{hi:.2}"),
                format!("{:.2}", a.min / b.min),
            )
        }
        _ => ("n/a".into(), "n/a".into(), "n/a".into()),
    }
}

/// pfrag's txonly rows: the whole loop with a strict IOMMU (the group's
/// reference), with the IOMMU off, and the driver's time alone.
pub const TX_STRICT: &str = "TX 64 B frames, strict IOMMU, null device model";
/// See [`TX_STRICT`].
pub const TX_OFF: &str = "TX 64 B frames, IOMMU off, null device model";
/// See [`TX_STRICT`].
pub const TX_DRIVER: &str = "TX 64 B frames, the driver's time alone";
/// The driver's time alone, in the virtio-net format (strict IOMMU).
pub const TX_VIRTIO: &str = "TX 64 B frames, virtio format, driver's time";
/// DPDK's burst row that a frag burst is compared with.
pub const MBUF_BULK: &str = "rte_pktmbuf_alloc_bulk + free_bulk";
/// DPDK's single-object row that a frag is compared with (A).
pub const MEMPOOL_SINGLE: &str = "rte_mempool_get + put, cache 256";
/// DPDK's bulk row of `rte_mempool`.
pub const MEMPOOL_BULK: &str = "rte_mempool_get_bulk + put_bulk";

#[cfg(test)]
mod tests;
