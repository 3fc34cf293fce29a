//! pfrag beside DPDK 22.11, the `ixgbe-driver` crate and a crossbeam free
//! list, in one run, pinned to one core, with one timing harness: the
//! median of `--reps` repetitions of a loop calibrated to `--target-ms`.
//!
//! ```text
//! cargo run --release --example peers
//! cargo run --release --example peers -- --reps 11 --cpu 1 --testpmd-samples 5
//! ```
//!
//! Rows: pfrag's frag cache (one frag; 32 frags in one bulk call; 32 single
//! refills), its TX queue on the null device (64 B frames; the driver's
//! time per 64 KB TSO packet with a strict IOMMU and with it off); DPDK's
//! `rte_mempool` (single and bulk, lcore cache 256), `rte_pktmbuf`
//! (alloc/free, single and bulk) and `dpdk-testpmd` txonly on `net_null`;
//! `ixgbe-driver`'s `MemPool`; a `crossbeam_queue::ArrayQueue` free list.
//! DPDK's rows run when the lab was built with `libdpdk` (`pkg-config
//! libdpdk`) and `dpdk-testpmd` is on the PATH; otherwise they are printed
//! as skipped with the reason.
//!
//! The last line has the form
//! `peers: single pfrag/dpdk=X.XX bulk pfrag/dpdk=Y.YY txonly pfrag/dpdk=Z.ZZ`:
//! ratios of ns per object (lower is better for pfrag), then of packets
//! per second (higher is better).

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pfrag_lab::peers::bench::{self, Harness};
use pfrag_lab::peers::{dpdk, local, tx, Group, Table};

/// pfrag's fast path and TX queue beside DPDK and other peers.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Repetitions of each timed loop (the median is reported).
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u16).range(1..=1000))]
    reps: u16,
    /// Wall time of one repetition, in milliseconds.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    target_ms: u64,
    /// The CPU every timed loop is pinned to (testpmd forwards on it too).
    #[arg(long, default_value_t = 1)]
    cpu: usize,
    /// testpmd's statistics period, in seconds.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=60))]
    testpmd_period: u64,
    /// testpmd samples (after one period of warm-up).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
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
        eprintln!("error: cannot pin to CPU {}: {e}", a.cpu);
        return ExitCode::from(2);
    }
    let tab = measure(&a, &h);
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

fn measure(a: &Args, h: &Harness) -> Table {
    let mut t = Table::default();
    let e = |r: Result<bench::Timing, pfrag::Error>| r.map_err(|e| e.to_string());
    let skip = |why: &str| Err::<bench::Timing, String>(why.to_string());
    let (s, b) = (local::SINGLE_LEN, local::BULK_LEN);

    eprintln!("timing pfrag and the Rust peers...");
    t.push(
        Group::Single,
        "pfrag",
        format!("FragCache::refill({s}) + complete, order 4"),
        e(local::pfrag_single(h)),
        true,
    );
    t.push(
        Group::Bulk,
        "pfrag",
        format!("refill_bulk({b}, 32) + complete_burst, per frag"),
        e(local::pfrag_bulk(h)),
        true,
    );
    t.push(
        Group::Bulk,
        "pfrag",
        format!("32 x refill({b}) + complete_burst, per frag"),
        e(local::pfrag_burst_of_singles(h)),
        false,
    );
    t.push(
        Group::Single,
        "crossbeam",
        "ArrayQueue free list pop + push",
        Ok(local::array_queue(h, 1)),
        false,
    );
    t.push(
        Group::Bulk,
        "crossbeam",
        "ArrayQueue free list 32 pops + 32 pushes",
        Ok(local::array_queue(h, local::BURST)),
        false,
    );
    t.push(
        Group::Single,
        "ixgbe-driver",
        "MemPool alloc_pkt + drop",
        local::ixgbe_mempool(h, 1),
        false,
    );
    t.push(
        Group::Bulk,
        "ixgbe-driver",
        "MemPool 32 x alloc_pkt + drop",
        local::ixgbe_mempool(h, local::BURST),
        false,
    );

    eprintln!("timing pfrag's TX queue on the null device...");
    t.push(
        Group::Txonly,
        "pfrag",
        "TX 64 B frames, strict IOMMU, null device model",
        tx::small_frames(h, false),
        true,
    );
    t.push(
        Group::Txonly,
        "pfrag",
        "TX 64 B frames, the driver's time alone",
        tx::small_frames(h, true),
        false,
    );
    match tx::tso(h) {
        Ok((strict, off)) => {
            t.push(
                Group::Tso,
                "pfrag",
                "TX 64 KB TSO driver time, strict IOMMU",
                Ok(strict),
                true,
            );
            t.push(
                Group::Tso,
                "pfrag",
                "TX 64 KB TSO driver time, IOMMU off",
                Ok(off),
                false,
            );
        }
        Err(why) => t.push(
            Group::Tso,
            "pfrag",
            "TX 64 KB TSO driver time",
            Err(why),
            true,
        ),
    }

    let child = if a.no_dpdk {
        Err("--no-dpdk".to_string())
    } else {
        eprintln!("timing DPDK (a child process)...");
        dpdk::run_child(h, a.cpu)
    };
    let row = |key: &str| match &child {
        Ok(rows) => rows
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, t)| Ok(*t))
            .unwrap_or_else(|| skip("missing from the child's output")),
        Err(why) => skip(why),
    };
    t.push(
        Group::Single,
        "dpdk",
        "rte_mempool_get + put, cache 256",
        row("mempool_single"),
        false,
    );
    t.push(
        Group::Bulk,
        "dpdk",
        "rte_mempool_get_bulk + put_bulk (32), per object",
        row("mempool_bulk"),
        false,
    );
    t.push(
        Group::Single,
        "dpdk",
        "rte_pktmbuf_alloc + free",
        row("pktmbuf_single"),
        false,
    );
    t.push(
        Group::Bulk,
        "dpdk",
        "rte_pktmbuf_alloc_bulk + free_bulk (32), per mbuf",
        row("pktmbuf_bulk"),
        false,
    );

    let pmd = if a.no_dpdk {
        skip("--no-dpdk")
    } else {
        eprintln!("running dpdk-testpmd txonly...");
        let main = if a.cpu == 0 { 1 } else { 0 };
        dpdk::testpmd(
            main,
            a.cpu,
            Duration::from_secs(a.testpmd_period),
            usize::from(a.testpmd_samples),
        )
    };
    t.push(
        Group::Txonly,
        "dpdk",
        "testpmd txonly, 64 B, net_null (its own Tx-pps)",
        pmd,
        false,
    );
    t
}
