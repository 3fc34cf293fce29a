//! The mapping budget: a persistent pool holds one live mapping per arena,
//! not per chunk or packet. VFIO type1 allows 65,535 mappings per container
//! by default (`dma_entry_limit`); a pool of 32 GiB in 1 GiB arenas needs
//! 32. The arenas are mapped (their IOVA fills the software IOMMU's page
//! table) but never written, so the test needs little resident memory.
//! Under Miri, which holds every mapped byte and has no `/proc`, three
//! arenas of 256 KiB stand in and resident memory goes unmeasured; the
//! mapping counts are checked the same.

use std::sync::Arc;

use pfrag::dma::{DmaMapper, Domain, SoftIommu, SoftIommuConfig};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;

/// The arena size: 1 GiB, or 256 KiB (four chunks) under Miri.
const ARENA: u64 = if cfg!(miri) { 256 << 10 } else { 1 << 30 };

fn rss_kib() -> u64 {
    if cfg!(miri) {
        return 0;
    }
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

#[test]
fn live_mappings_grow_with_arenas_not_chunks() {
    let arenas = if cfg!(miri) { 3 } else { 32u64 };
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let order = Order::new(4).unwrap();
    let mut cfg = pool::Config::new(order, Policy::Persistent);
    cfg.grow_batch = (ARENA / order.size() as u64) as usize;
    let pool = Pool::new(domain, cfg).unwrap();
    let mut cache = FragCache::new(pool.clone());
    let rss0 = rss_kib();
    let chunks = arenas * ARENA / order.size() as u64;
    // One whole chunk per frag: every chunk of every arena is taken.
    let mut held = Vec::with_capacity(chunks as usize);
    for _ in 0..chunks {
        held.push(cache.refill(order.size(), false).unwrap());
    }
    let s = pool.stats();
    let m = iommu.stats();
    let grown_kib = rss_kib().saturating_sub(rss0);
    println!(
        "{} MiB in {} chunks: {} live mappings, {} map calls, {} PTEs, resident +{} MiB",
        s.mapped_bytes >> 20,
        s.chunks,
        iommu.mappings(),
        m.map_calls,
        m.ptes_written,
        grown_kib >> 10
    );
    assert_eq!(s.chunks, chunks);
    assert_eq!(s.mapped_bytes, arenas * ARENA);
    assert_eq!(iommu.mappings() as u64, arenas, "one mapping per arena");
    assert_eq!(m.map_calls, arenas);
    assert_eq!(m.ptes_written, arenas * ARENA / 4096);
    // Chunk memory is never touched: what grew is the page table and the
    // side tables (a few hundred bytes per 64 KiB chunk), not 32 GiB
    // (under Miri, which has no `/proc`, this reads 0).
    assert!(grown_kib < 512 << 10, "resident grew by {grown_kib} KiB");
    drop(held);
    drop(cache);
    drop(pool);
    assert_eq!(
        iommu.mappings(),
        0,
        "every arena unmapped when the pool goes"
    );
    // One unmap call per arena at most (adjacent arenas may go in one).
    let unmaps = iommu.stats().unmap_calls;
    assert!((1..=arenas).contains(&unmaps), "{unmaps} unmap calls");
}
