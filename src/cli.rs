//! Parsers and checks for the examples' command lines, in one place so that
//! every bad value gets the same clear answer (with the valid range) before
//! anything runs.

use std::fs::OpenOptions;
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

/// A cost-model figure in ns: a finite number >= 0.
pub fn ns(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of ns"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("{s} ns is not a finite number >= 0"))
    }
}

/// A wire rate in Gbit/s: a finite number > 0.
pub fn gbit(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of Gbit/s"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("{s} Gbit/s is not a finite number > 0"))
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
        if a > b || b > pfrag::Order::MAX {
            return Err(format!(
                "orders must lie in 0..={} ('{part}')",
                pfrag::Order::MAX
            ));
        }
        v.extend(a..=b);
    }
    Ok(v)
}

/// Checks, before any run, that `path` can be written: creates (or
/// truncates) it. A run that ends in an error leaves it empty.
pub fn output(path: &Path) -> Result<PathBuf, String> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map(|_| path.to_path_buf())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
