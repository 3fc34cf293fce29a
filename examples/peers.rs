//! pfrag beside DPDK 22.11, the `ixgbe-driver` crate and a crossbeam free
//! list, in one run, pinned to one core, with one timing harness: `--reps`
//! repetitions of a loop calibrated to `--target-ms`, in each of
//! `--rounds` rounds over every row; each row reports the median and the
//! spread (min-max) of all its repetitions.
//!
//! ```text
//! cargo run --release --example peers
//! cargo run --release --example peers -- --reps 11 --cpu 1 --testpmd-samples 3
//! ```
//!
//! Rows: pfrag's frag cache (one frag; 32 frags in one bulk call; 32 single
//! refills), its TX queue on the null device (64 B frames with a strict
//! IOMMU, with it off, and the driver's time alone; the driver's time per
//! 64 KB TSO packet with a strict IOMMU and with it off); DPDK's
//! `rte_mempool` (single and bulk, lcore cache 256), `rte_pktmbuf`
//! (alloc/free, single and bulk) and `dpdk-testpmd` txonly on `net_null`;
//! `ixgbe-driver`'s `MemPool`; a `crossbeam_queue::ArrayQueue` free list.
//! DPDK's rows run when the lab was built with `libdpdk` (`pkg-config
//! libdpdk`) and `dpdk-testpmd` is on the PATH; otherwise they are printed
//! as skipped with the reason. testpmd runs in every round too
//! (`--testpmd-samples` periods of `--testpmd-period` seconds, after one of
//! warm-up), beside the txonly rows it is compared with, so that a drift
//! of the machine's speed between rounds reaches both sides; the line
//! `pfrag/dpdk packets per second by round` gives C, D and E round by
//! round.
//!
//! The last line has the form
//! `peers: single pfrag/dpdk=A bulk pfrag/mbuf=B txonly-driver pfrag/dpdk=C txonly-off pfrag/dpdk=D txonly-strict pfrag/dpdk=E`:
//! A and B are ratios of ns per object (lower is better for pfrag): one
//! frag against `rte_mempool` get+put, a burst of 32 against
//! `rte_pktmbuf_alloc_bulk`+`free_bulk` per mbuf; C, D and E are ratios of
//! packets per second against testpmd txonly (higher is better): 64 B
//! frames, the driver's own time, the whole loop on the null device with
//! the IOMMU off, and with a strict IOMMU.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pfrag_lab::peers::bench::{self, Harness};
use pfrag_lab::peers::dpdk;
use pfrag_lab::peers::run::{run, Settings};

/// pfrag's fast path and TX queue beside DPDK and other peers.
#[derive(Parser, Debug)]
#[command(version, allow_negative_numbers = true)]
struct Args {
    /// Repetitions of each timed loop per round.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u16).range(1..=1000))]
    reps: u16,
    /// Rounds over every row (the machine's drift hits all rows alike);
    /// each row reports the median and spread of all its repetitions.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
    rounds: u16,
    /// Wall time of one repetition, in milliseconds.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    target_ms: u64,
    /// The CPU every timed loop is pinned to (testpmd forwards on it too).
    #[arg(long, default_value_t = 1)]
    cpu: usize,
    /// testpmd's statistics period, in seconds.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=60))]
    testpmd_period: u64,
    /// testpmd samples per round (after one period of warm-up): testpmd
    /// runs in every round, beside the txonly rows it is compared with.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=100))]
    testpmd_samples: u16,
    /// Leave DPDK out (its rows print as skipped).
    #[arg(long)]
    no_dpdk: bool,
    /// Internal: run DPDK's loops in this process and print them.
    #[arg(long, hide = true)]
    dpdk_child: bool,
}

fn main() -> ExitCode {
    let a = Args::parse();
    let h = Harness {
        reps: usize::from(a.reps),
        target: Duration::from_millis(a.target_ms),
    };
    if a.dpdk_child {
        return match dpdk::child_main(&h, a.cpu) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Err(e) = bench::pin(a.cpu) {
        eprintln!("error: --cpu {}: {e}", a.cpu);
        return ExitCode::from(2);
    }
    let settings = Settings {
        harness: h,
        rounds: usize::from(a.rounds),
        cpu: a.cpu,
        testpmd_period: Duration::from_secs(a.testpmd_period),
        testpmd_samples: usize::from(a.testpmd_samples),
        no_dpdk: a.no_dpdk,
    };
    let tab = match run(&settings) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}", tab.render());
    println!();
    print!("{}", tab.spread());
    println!("{}", tab.summary());
    let failed: Vec<_> = tab
        .rows
        .iter()
        .filter(|r| r.who == "pfrag" && r.result.is_err())
        .collect();
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("error: {} pfrag rows failed", failed.len());
        ExitCode::FAILURE
    }
}
