//! Parsers and checks for the examples' command lines, in one place so that
//! every bad value gets the same clear answer (with the valid range) before
//! anything runs.

use std::fs::OpenOptions;
use std::io::Write;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use pfrag::account::Limits;
use pfrag::dma::MAX_IOTLB_ENTRIES;

/// Bytes in `mib` MiB, or an error naming the largest value accepted.
pub fn mib(what: &str, mib: u64) -> Result<u64, String> {
    mib.checked_mul(1 << 20)
        .ok_or_else(|| format!("{what} {mib} MiB is out of range (0..={})", u64::MAX >> 20))
}

/// `MIN,PRESSURE,MAX` in MiB, with `MIN <= PRESSURE <= MAX`.
pub fn mem_limits(s: &str) -> Result<Limits, String> {
    let v: Vec<u64> = s
        .split(',')
        .map(|x| {
            x.trim()
                .parse::<u64>()
                .map_err(|_| format!("'{x}' is not a number of MiB"))
        })
        .collect::<Result<_, _>>()?;
    match v[..] {
        [min, pressure, max] if min <= pressure && pressure <= max => Ok(Limits {
            min: mib("MIN", min)?,
            pressure: mib("PRESSURE", pressure)?,
            max: mib("MAX", max)?,
        }),
        _ => Err("expected MIN,PRESSURE,MAX in MiB with MIN <= PRESSURE <= MAX".into()),
    }
}

/// The largest cost-model figure accepted, in ns: the software IOMMU's
/// own bound ([`pfrag::dma::MAX_COST_NS`]).
pub use pfrag::dma::MAX_COST_NS;

/// The wire rates accepted, in Gbit/s: from 1 Mbit/s, at which the largest
/// TSO packet still leaves in a few seconds, to 10 Tbit/s.
pub const LINE_RATE_GBIT: RangeInclusive<f64> = 0.001..=10_000.0;

/// The most packets (or warm-up packets) one configuration may send: a
/// run of that many finishes in hours, not never.
pub const MAX_PACKETS: u64 = 1_000_000_000;

/// A cost-model figure in ns: a finite number in 0..=[`MAX_COST_NS`].
pub fn ns(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of ns"))?;
    if (0.0..=MAX_COST_NS).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s} ns is out of range (0..={MAX_COST_NS})"))
    }
}

/// A wire rate in Gbit/s, parsed and checked by [`line_rate`].
pub fn gbit(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of Gbit/s"))?;
    line_rate(v).map_err(|_| rate_error(s.trim()))
}

/// Checks a wire rate in Gbit/s: a number in [`LINE_RATE_GBIT`]. The one
/// rule for every line rate, from a command line or a configuration.
pub fn line_rate(g: f64) -> Result<f64, String> {
    if LINE_RATE_GBIT.contains(&g) {
        Ok(g)
    } else {
        Err(rate_error(g))
    }
}

fn rate_error(g: impl std::fmt::Display) -> String {
    format!(
        "line rate {g} Gbit/s is out of range ({}..={})",
        LINE_RATE_GBIT.start(),
        LINE_RATE_GBIT.end()
    )
}

/// Packets per configuration: 1..=[`MAX_PACKETS`].
pub fn packets(s: &str) -> Result<u64, String> {
    count(s, 1)
}

/// Warm-up packets per configuration: 0..=[`MAX_PACKETS`].
pub fn warmup(s: &str) -> Result<u64, String> {
    count(s, 0)
}

fn count(s: &str, min: u64) -> Result<u64, String> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a whole number"))?;
    if (min..=MAX_PACKETS).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is out of range ({min}..={MAX_PACKETS})"))
    }
}

/// TX ring descriptors: a multiple of 8 in 8..=4096.
pub fn ring(s: &str) -> Result<u16, String> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a whole number"))?;
    if (8..=4096).contains(&v) && v.is_multiple_of(8) {
        Ok(v as u16)
    } else {
        Err(format!("{v} is out of range (a multiple of 8 in 8..=4096)"))
    }
}

/// IOTLB entries of the software IOMMU: 1..=MAX_IOTLB_ENTRIES.
pub fn iotlb_entries(s: &str) -> Result<usize, String> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a whole number"))?;
    if (1..=MAX_IOTLB_ENTRIES as u64).contains(&v) {
        Ok(v as usize)
    } else {
        Err(format!("{v} is out of range (1..={MAX_IOTLB_ENTRIES})"))
    }
}

/// Chunk orders: a list (0,2,4) or a range (0-4), each in 0..=Order::MAX.
pub fn orders(s: &str) -> Result<Vec<u32>, String> {
    let mut v = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: u32 = a.parse().map_err(|_| format!("bad order '{part}'"))?;
        let b: u32 = b.parse().map_err(|_| format!("bad order '{part}'"))?;
        if a > b {
            return Err(format!(
                "the range '{part}' runs high to low: write it {b}-{a}"
            ));
        }
        if b > pfrag::Order::MAX {
            return Err(format!(
                "orders must lie in 0..={} ('{part}')",
                pfrag::Order::MAX
            ));
        }
        v.extend(a..=b);
    }
    distinct("--orders", &v)?;
    Ok(v)
}

/// Whether a long run shows its progress as plain lines on stderr rather
/// than a bar: when `no_progress` asks for it, or when stderr is not a
/// terminal (a log or a pipe, where no bar would be drawn).
pub fn plain_progress(no_progress: bool) -> bool {
    use std::io::IsTerminal;
    no_progress || !std::io::stderr().is_terminal()
}

/// Refuses a list that names a value twice (`flag` is the option's name):
/// each value is a run of its own, and two runs of one configuration
/// could not be told apart in the rows, the CSV or the ratios.
pub fn distinct<T: PartialEq + std::fmt::Debug>(flag: &str, values: &[T]) -> Result<(), String> {
    for (i, v) in values.iter().enumerate() {
        if values[..i].contains(v) {
            return Err(format!(
                "{flag} names {v:?} twice: each value is one run, so list it once"
            ));
        }
    }
    Ok(())
}

/// Checks, before any run, that `path` can be written: opens it for
/// writing, creating it if missing, without changing what it holds.
/// Returns whether it was created.
pub fn output(path: &Path) -> Result<bool, String> {
    let existed = path.exists();
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map(|_| !existed)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Checks the output files before any run: the CSV and the SVG are not the
/// same file, and both can be written (until both can, neither is
/// changed: a file this call created is removed again). Then the CSV's
/// header is written (and flushed), and a byte is written to the SVG (and
/// flushed) and the SVG emptied again, so that a full disk fails here, not
/// after the run. A run that ends in an error leaves the SVG empty and the
/// CSV with its header.
pub fn outputs(csv: Option<&Path>, columns: &[String], svg: Option<&Path>) -> Result<(), String> {
    if let (Some(c), Some(s)) = (csv, svg) {
        if normalized(c) == normalized(s) {
            return Err(format!(
                "--csv {} and --svg {} are the same file",
                c.display(),
                s.display()
            ));
        }
    }
    let mut created = Vec::new();
    for p in [csv, svg].into_iter().flatten() {
        match output(p) {
            Ok(new) => created.extend(new.then_some(p)),
            Err(e) => {
                for c in created {
                    let _ = std::fs::remove_file(c);
                }
                return Err(e);
            }
        }
    }
    if let Some(c) = csv {
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new().write(true).truncate(true).open(c)?;
            writeln!(f, "{}", columns.join(","))?;
            f.flush()?;
            f.sync_data().or(Ok(()))
        };
        write().map_err(|e| format!("cannot write {}: {e}", c.display()))?;
    }
    if let Some(s) = svg {
        let probe = || -> std::io::Result<()> {
            let mut f = OpenOptions::new().write(true).truncate(true).open(s)?;
            f.write_all(b"\n")?;
            f.flush()?;
            // Emptied by opening it again (a device ignores `set_len`).
            OpenOptions::new().write(true).truncate(true).open(s)?;
            Ok(())
        };
        probe().map_err(|e| format!("cannot write {}: {e}", s.display()))?;
    }
    Ok(())
}

/// `path` with its directory resolved (symbolic links, `.` and `..`),
/// whether or not the file exists yet.
fn normalized(path: &Path) -> PathBuf {
    if let Ok(p) = path.canonicalize() {
        return p;
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match (dir.canonicalize(), path.file_name()) {
        (Ok(d), Some(name)) => d.join(name),
        _ => path.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_listed_twice_is_refused_with_its_flag() {
        assert_eq!(orders("0-2,4").unwrap(), [0, 1, 2, 4]);
        let e = orders("0-2,1").unwrap_err();
        assert!(e.contains("--orders names 1 twice"), "{e}");
        distinct("--flows", &[200, 1000]).unwrap();
        let e = distinct("--flows", &[200, 1000, 200]).unwrap_err();
        assert!(e.contains("--flows names 200 twice"), "{e}");
    }

    #[test]
    fn mem_limits_overflowing_mib_is_refused_with_the_range() {
        let e = mem_limits("1,2,17592186044416").unwrap_err();
        assert!(e.contains("out of range (0..=17592186044415)"), "{e}");
        assert_eq!(mem_limits("1,2,3").unwrap().max, 3 << 20);
        assert!(mem_limits("3,2,1").is_err());
        assert!(mib("threshold", 17592186044416).is_err());
    }

    #[test]
    fn cost_ns_must_be_finite_and_not_negative() {
        for bad in ["NaN", "inf", "-1", "x"] {
            assert!(ns(bad).is_err(), "{bad}");
        }
        assert_eq!(ns("200").unwrap(), 200.0);
    }

    #[test]
    fn line_rate_must_be_positive_and_finite() {
        for bad in ["0", "-5", "NaN", "inf", "fast"] {
            assert!(gbit(bad).is_err(), "{bad}");
        }
        assert_eq!(gbit("100").unwrap(), 100.0);
    }

    #[test]
    fn ring_names_its_real_range() {
        let e = ring("1000000").unwrap_err();
        assert!(e.contains("8..=4096"), "{e}");
        assert!(ring("12").is_err());
        assert_eq!(ring("16").unwrap(), 16);
    }

    #[test]
    fn iotlb_entries_zero_and_huge_are_refused() {
        assert!(iotlb_entries("0").unwrap_err().contains("1..="));
        assert!(iotlb_entries("100000000000000").is_err());
        assert_eq!(iotlb_entries("128").unwrap(), 128);
    }

    #[test]
    fn unwritable_output_is_refused_before_running() {
        assert!(output(Path::new("/nonexistent-dir/x.csv")).is_err());
        let p = std::env::temp_dir().join("pfrag-cli-output-test.csv");
        assert!(output(&p).is_ok());
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn a_line_rate_too_slow_to_finish_or_absurdly_fast_is_refused_with_the_range() {
        let e = gbit("1e-300").unwrap_err();
        assert!(e.contains("1e-300") && e.contains("0.001..=10000"), "{e}");
        assert!(gbit("1e6").is_err());
        assert_eq!(gbit("0.001").unwrap(), 0.001);
    }

    #[test]
    fn packets_that_cannot_finish_are_refused() {
        let e = packets("18446744073709551615").unwrap_err();
        assert!(e.contains("1..=1000000000"), "{e}");
        assert!(packets("0").is_err());
        assert_eq!(packets("20000").unwrap(), 20_000);
        assert!(warmup("18446744073709551615").unwrap_err().contains("0..="));
        assert_eq!(warmup("0").unwrap(), 0);
    }

    #[test]
    fn cost_ns_large_enough_to_overflow_the_arithmetic_is_refused() {
        let e = ns("1e308").unwrap_err();
        assert!(e.contains("0..=1000000"), "{e}");
        assert_eq!(ns("1000000").unwrap(), 1e6);
    }

    #[test]
    fn the_csv_and_svg_must_be_different_files() {
        let dir = std::env::temp_dir();
        let csv = dir.join("pfrag-cli-same.out");
        let svg = dir.join(".").join("pfrag-cli-same.out");
        let e = outputs(Some(&csv), &["a".into()], Some(&svg)).unwrap_err();
        assert!(e.contains("same file"), "{e}");
        let other = dir.join("pfrag-cli-other.svg");
        outputs(Some(&csv), &["a".into(), "b".into()], Some(&other)).unwrap();
        assert_eq!(std::fs::read_to_string(&csv).unwrap(), "a,b\n");
        std::fs::remove_file(csv).unwrap();
        std::fs::remove_file(other).unwrap();
    }

    #[test]
    fn a_refused_output_leaves_the_other_as_it_was() {
        let dir = std::env::temp_dir();
        let svg = dir.join(format!("pfrag-cli-keep-{}.svg", std::process::id()));
        std::fs::write(&svg, "kept").unwrap();
        let bad = Path::new("/nonexistent-dir/x.csv");
        assert!(outputs(Some(bad), &["a".into()], Some(&svg)).is_err());
        assert_eq!(std::fs::read_to_string(&svg).unwrap(), "kept");
        // A file the call created is removed when the other is refused.
        let new = dir.join(format!("pfrag-cli-new-{}.csv", std::process::id()));
        let _ = std::fs::remove_file(&new);
        let bad_svg = Path::new("/nonexistent-dir/x.svg");
        assert!(outputs(Some(&new), &["a".into()], Some(bad_svg)).is_err());
        assert!(!new.exists());
        std::fs::remove_file(svg).unwrap();
    }

    #[test]
    fn a_csv_on_a_full_disk_fails_before_the_run() {
        if Path::new("/dev/full").exists() {
            let e = outputs(Some(Path::new("/dev/full")), &["a".into()], None).unwrap_err();
            assert!(e.contains("/dev/full"), "{e}");
        }
    }

    #[test]
    fn an_svg_on_a_full_disk_fails_before_the_run_and_is_left_empty() {
        if Path::new("/dev/full").exists() {
            let e = outputs(None, &[], Some(Path::new("/dev/full"))).unwrap_err();
            assert!(e.contains("/dev/full"), "{e}");
        }
        let svg = std::env::temp_dir().join(format!("pfrag-cli-probe-{}.svg", std::process::id()));
        std::fs::write(&svg, "old").unwrap();
        outputs(None, &[], Some(&svg)).unwrap();
        assert_eq!(std::fs::read_to_string(&svg).unwrap(), "");
        std::fs::remove_file(svg).unwrap();
    }

    #[test]
    fn a_range_of_orders_written_high_to_low_is_refused_as_such() {
        let e = orders("4-2").unwrap_err();
        assert!(e.contains("'4-2'") && e.contains("2-4"), "{e}");
        let e = orders("0-12").unwrap_err();
        assert!(e.contains("0..=9") && e.contains("'0-12'"), "{e}");
    }
}
