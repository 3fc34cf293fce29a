//! The one timing loop every peer is measured with: calibrate a loop to
//! about `target` wall time, run it `reps` times, report the median and
//! the spread of nanoseconds per operation. The loop body is a closure
//! that runs `iters` iterations itself (a DPDK loop runs in C), so the
//! harness's own per-call cost is spread over the whole loop.

use std::time::{Duration, Instant};

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// Nanoseconds per operation over the repetitions of one measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// The median repetition.
    pub median: f64,
    /// The fastest repetition.
    pub min: f64,
    /// The slowest repetition.
    pub max: f64,
    /// How many repetitions.
    pub reps: usize,
    /// Every repetition, sorted.
    pub samples: Vec<f64>,
}

impl Timing {
    /// A timing from per-repetition figures (at least one).
    pub fn from_samples(mut ns: Vec<f64>) -> Timing {
        assert!(!ns.is_empty(), "a timing needs at least one sample");
        ns.sort_by(f64::total_cmp);
        let n = ns.len();
        let median = if n % 2 == 1 {
            ns[n / 2]
        } else {
            (ns[n / 2 - 1] + ns[n / 2]) / 2.0
        };
        Timing {
            median,
            min: ns[0],
            max: ns[n - 1],
            reps: n,
            samples: ns,
        }
    }

    /// The repetitions of both timings together (rounds of one run).
    pub fn merged(&self, other: &Timing) -> Timing {
        Timing::from_samples(self.samples.iter().chain(&other.samples).copied().collect())
    }

    /// Millions of operations per second at the median.
    pub fn mops(&self) -> f64 {
        1e3 / self.median
    }

    /// `self / other` at the medians, with the widest spread the
    /// repetitions allow: `(median, low, high)`.
    pub fn ratio(&self, other: &Timing) -> (f64, f64, f64) {
        (
            self.median / other.median,
            self.min / other.max,
            self.max / other.min,
        )
    }
}

/// The harness's settings.
#[derive(Clone, Copy, Debug)]
pub struct Harness {
    /// Repetitions of each measurement.
    pub reps: usize,
    /// Wall time one repetition aims at.
    pub target: Duration,
}

impl Default for Harness {
    /// Seven repetitions of about 20 ms.
    fn default() -> Harness {
        Harness {
            reps: 7,
            target: Duration::from_millis(20),
        }
    }
}

impl Harness {
    /// Times `run(iters)`, which performs `iters` iterations of
    /// `ops_per_iter` operations each: nanoseconds per operation.
    pub fn time(&self, ops_per_iter: u64, mut run: impl FnMut(u64)) -> Timing {
        self.time_excluding(ops_per_iter, |i| {
            run(i);
            Duration::ZERO
        })
    }

    /// [`time`](Self::time) of a loop that reports time to leave out (a
    /// device model run inline, say): `run(iters)` returns it.
    pub fn time_excluding(
        &self,
        ops_per_iter: u64,
        mut run: impl FnMut(u64) -> Duration,
    ) -> Timing {
        let iters = self.calibrate(&mut |i| {
            run(i);
        });
        let ns = (0..self.reps.max(1))
            .map(|_| {
                let t = Instant::now();
                let skip = run(iters);
                let el = t.elapsed().saturating_sub(skip);
                el.as_nanos() as f64 / (iters * ops_per_iter) as f64
            })
            .collect();
        Timing::from_samples(ns)
    }

    /// [`time`](Self::time) of a loop that can fail: after the first
    /// error the loop is not run again, and the error is returned.
    pub fn try_time<E>(
        &self,
        ops_per_iter: u64,
        mut run: impl FnMut(u64) -> Result<(), E>,
    ) -> Result<Timing, E> {
        self.try_time_excluding(ops_per_iter, |i| run(i).map(|()| Duration::ZERO))
    }

    /// [`time_excluding`](Self::time_excluding) of a loop that can fail,
    /// as [`try_time`](Self::try_time).
    pub fn try_time_excluding<E>(
        &self,
        ops_per_iter: u64,
        mut run: impl FnMut(u64) -> Result<Duration, E>,
    ) -> Result<Timing, E> {
        let mut err = None;
        let t = self.time_excluding(ops_per_iter, |i| {
            if err.is_some() {
                return Duration::ZERO;
            }
            run(i).unwrap_or_else(|e| {
                err = Some(e);
                Duration::ZERO
            })
        });
        err.map_or(Ok(t), Err)
    }

    /// Iterations that take about `target`: doubled from 16 until a loop
    /// takes a tenth of it, then scaled.
    fn calibrate(&self, run: &mut impl FnMut(u64)) -> u64 {
        let target = self.target.as_nanos().max(1) as f64;
        let mut iters = 16u64;
        loop {
            let t = Instant::now();
            run(iters);
            let el = t.elapsed().as_nanos() as f64;
            if el >= target / 10.0 || iters >= 1 << 40 {
                return ((iters as f64 * target / el.max(1.0)) as u64).max(1);
            }
            iters *= 2;
        }
    }
}

/// A CPU the calling thread cannot be pinned to, with the CPUs it may run
/// on.
#[derive(Debug, thiserror::Error)]
#[error("cannot pin to CPU {cpu} ({errno}): this process may run on CPUs {usable}")]
pub struct PinError {
    /// The CPU asked for.
    pub cpu: usize,
    /// What the OS said.
    pub errno: nix::Error,
    /// The CPUs the process may run on, as ranges (`0-3,6`).
    pub usable: String,
}

/// Pins the calling thread to `cpu`, so that every peer runs on the same
/// core; if the CPU is not usable, says which are.
pub fn pin(cpu: usize) -> Result<(), PinError> {
    let mut set = CpuSet::new();
    set.set(cpu)
        .and_then(|()| sched_setaffinity(Pid::from_raw(0), &set))
        .map_err(|errno| PinError {
            cpu,
            errno,
            usable: usable_cpus(),
        })
}

/// The CPUs the calling thread may run on, as ranges (`0-3,6`), or `?`
/// if the OS does not say.
fn usable_cpus() -> String {
    let Ok(set) = sched_getaffinity(Pid::from_raw(0)) else {
        return "?".into();
    };
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect();
    cpu_ranges(&cpus)
}

/// Ascending CPU numbers as ranges of consecutive ones (`0-3,6`).
fn cpu_ranges(cpus: &[usize]) -> String {
    let ranges: Vec<String> = cpus
        .chunk_by(|a, b| *b == a + 1)
        .map(|run| match run {
            [one] => one.to_string(),
            [first, .., last] => format!("{first}-{last}"),
            [] => unreachable!("chunk_by yields no empty run"),
        })
        .collect();
    ranges.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_are_written_as_ranges_of_consecutive_ones() {
        assert_eq!(cpu_ranges(&[0, 1, 2, 3, 6]), "0-3,6");
        assert_eq!(cpu_ranges(&[1]), "1");
        assert_eq!(cpu_ranges(&[0, 2, 3, 5]), "0,2-3,5");
        assert_eq!(cpu_ranges(&[]), "");
    }

    #[test]
    fn a_cpu_that_cannot_be_pinned_is_refused_with_the_usable_ones() {
        let e = pin(usize::MAX).unwrap_err().to_string();
        assert!(e.contains(&format!("CPU {}", usize::MAX)), "{e}");
        let usable = e.split("may run on CPUs ").nth(1).unwrap_or("");
        assert!(usable.starts_with(|c: char| c.is_ascii_digit()), "{e}");
    }

    #[test]
    fn median_and_spread_of_samples() {
        let t = Timing::from_samples(vec![3.0, 1.0, 2.0, 10.0, 2.5]);
        assert_eq!((t.median, t.min, t.max, t.reps), (2.5, 1.0, 10.0, 5));
        let even = Timing::from_samples(vec![4.0, 1.0, 2.0, 3.0]);
        assert_eq!(even.median, 2.5);
        let both = t.merged(&even);
        assert_eq!(
            (both.reps, both.min, both.max, both.median),
            (9, 1.0, 10.0, 2.5)
        );
    }

    #[test]
    fn ratio_spread_brackets_the_median_ratio() {
        let a = Timing::from_samples(vec![2.0, 2.2, 2.4]);
        let b = Timing::from_samples(vec![4.0, 4.4, 4.8]);
        let (m, lo, hi) = a.ratio(&b);
        assert!((m - 0.5).abs() < 1e-12);
        assert!(lo <= m && m <= hi);
        assert!((lo - 2.0 / 4.8).abs() < 1e-12 && (hi - 2.4 / 4.0).abs() < 1e-12);
    }

    #[test]
    fn harness_divides_by_iterations_and_operations() {
        // A loop whose cost is known in iterations, not time: count them.
        let mut total = 0u64;
        let h = Harness {
            reps: 3,
            target: Duration::from_millis(1),
        };
        let t = h.time(4, |iters| {
            for _ in 0..iters {
                total = std::hint::black_box(total + 1);
            }
        });
        assert_eq!(t.reps, 3);
        assert!(t.min > 0.0 && t.min <= t.median && t.median <= t.max);
        assert!(total > 16, "calibration and repetitions ran the loop");
    }

    #[test]
    fn a_failing_loop_returns_its_first_error_and_stops() {
        let h = Harness {
            reps: 3,
            target: Duration::from_millis(1),
        };
        let mut calls = 0;
        let r = h.try_time(1, |_| {
            calls += 1;
            Err::<(), u32>(calls)
        });
        assert_eq!(r, Err(1));
        assert_eq!(calls, 1);
    }
}
