//! Memory goes back: after a load drops, a persistent pool under memory
//! pressure gives its arenas back to the OS, and the process's resident
//! memory (or, with huge pages, the system's free huge pages) returns to
//! where it started. Every range's unmap and its invalidation complete
//! while its memory is still resident: the pool's mapper is wrapped in
//! [`Watch`], which checks with `mincore` at each unmap and each flush.
//!
//! One test function: resident memory is per process, so the phases must
//! not overlap. Set `PFRAG_REQUIRE_HUGEPAGES=1` (CI does, after reserving
//! huge pages) to fail rather than skip the huge-page phase when none are
//! available.

use std::sync::Arc;

use pfrag::account::{Limits, MemAccount, NoHooks};
use pfrag::dma::{Domain, Invalidation, SoftIommu, SoftIommuConfig, Watch};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;

const MIB: u64 = 1 << 20;

fn status(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    field(&s, key)
}

fn meminfo(key: &str) -> u64 {
    field(&std::fs::read_to_string("/proc/meminfo").unwrap(), key)
}

fn field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{key} missing"))
}

/// What one load-and-drop phase measured.
#[derive(Debug)]
struct Phase {
    /// `measure()` before the load, at its peak, and after the pool shrank.
    before: u64,
    peak: u64,
    after: u64,
    /// Arenas the pool backed with huge pages.
    huge_arenas: u64,
}

/// Loads a persistent pool with `load` bytes of whole-chunk frags, writes
/// every page, drops them all under memory pressure, and measures with
/// `measure` before, at the peak and after.
fn load_and_drop(order: u32, batch: usize, huge: bool, load: u64, measure: fn() -> u64) -> Phase {
    let domain = Arc::new(Domain::new(Watch::new(
        SoftIommu::new(SoftIommuConfig {
            invalidation: Invalidation::Lazy,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    )));
    let order = Order::new(order).unwrap();
    let mut cfg = pool::Config::new(order, Policy::Persistent);
    cfg.grow_batch = batch;
    cfg.hugepages = huge;
    // Pressure from a quarter of the load on, until every byte is back.
    let limits = Limits {
        min: 1,
        pressure: load / 4,
        max: u64::MAX,
    };
    let account = MemAccount::new(limits, NoHooks).unwrap();
    let pool = Pool::with_account(domain.clone(), cfg, account.clone()).unwrap();
    let mut cache = FragCache::new(pool.clone());
    let before = measure();
    let mut held = Vec::new();
    for i in 0..load / order.size() as u64 {
        let mut f = cache.refill(order.size(), false).unwrap();
        f.as_mut_slice().fill(i as u8 | 1);
        held.push(f);
    }
    let peak = measure();
    assert!(
        account.stats().entered >= 1,
        "the load put the account under pressure"
    );
    drop(held);
    cache.release();
    // Completions shrank the pool as they came; trim takes any rest.
    while pool.trim().unwrap() > 0 {}
    let after = measure();
    let st = pool.stats();
    assert_eq!(st.mapped_bytes, 0, "every arena unmapped: {st:?}");
    assert_eq!(st.chunks, 0);
    assert_eq!(account.stats().bytes, 0, "every byte uncharged");
    let watch = domain.mapper();
    assert_eq!(watch.inner().mappings(), 0, "no live mapping");
    let w = watch.watch_stats();
    assert!(w.checked > 0, "the unmaps were watched");
    assert_eq!(w.early, 0, "memory released before its unmap or flush");
    assert_eq!(w.pending, 0, "every lazy unmap flushed");
    Phase {
        before,
        peak,
        after,
        huge_arenas: st.huge_arenas,
    }
}

#[test]
#[cfg_attr(
    miri,
    ignore = "measures resident memory in /proc; Miri has no page tables"
)]
fn pool_memory_goes_back_after_the_load_drops() {
    // 4 KiB pages: 64 MiB in 2 MiB arenas of 32 KiB chunks.
    let (order, batch, load) = (3, 64, 64 * MIB);
    let p = load_and_drop(order, batch, false, load, || status("VmRSS"));
    let batch_kib = (batch << (12 + order)) as u64 / 1024;
    println!(
        "VmRSS: {} KiB before, {} KiB at the peak, {} KiB after (one grow batch: {} KiB)",
        p.before, p.peak, p.after, batch_kib
    );
    assert!(
        p.peak >= p.before + load / 1024 * 9 / 10,
        "the load was resident: {p:?}"
    );
    assert!(
        p.after <= p.before + batch_kib,
        "resident memory did not go back: {p:?}"
    );

    // Huge pages: 32 MiB in 2 MiB arenas (one huge page each).
    let load = 32 * MIB;
    let h = load_and_drop(4, 32, true, load, || meminfo("HugePages_Free"));
    println!(
        "HugePages_Free: {} before, {} at the peak, {} after ({} huge arenas)",
        h.before, h.peak, h.after, h.huge_arenas
    );
    if h.huge_arenas == 0 {
        assert!(
            std::env::var_os("PFRAG_REQUIRE_HUGEPAGES").is_none(),
            "no huge pages available (vm.nr_hugepages), but PFRAG_REQUIRE_HUGEPAGES is set"
        );
        println!("huge-page phase skipped: no huge pages reserved");
        return;
    }
    assert_eq!(
        h.before - h.peak,
        h.huge_arenas,
        "one huge page per arena in use"
    );
    assert_eq!(h.after, h.before, "every huge page back: {h:?}");
}
