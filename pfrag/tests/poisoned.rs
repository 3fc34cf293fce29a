//! Regressions for the frag cache's carving rule under `PerFrag`: a frag's
//! own mapping covers whole pages, which the next frag may share, so the
//! cache carves a chunk no further once an unmap of one of its frags failed
//! (memory whose unmap failed is never handed out again), and skips to a
//! fresh page once one was deferred to a lazy flush (memory is reused only
//! after the unmap and the invalidation covering it completed).

use std::sync::Arc;

use pfrag::dma::{
    Dir, DmaMapper, Domain, Faulty, FaultyConfig, Invalidation, Op, SoftIommu, SoftIommuConfig,
    Translate,
};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order, PAGE_SIZE};

fn page_of(a: usize) -> usize {
    a & !(PAGE_SIZE as usize - 1)
}

/// A `PerFrag` pool of one-page chunks, growing one chunk at a time.
fn per_frag_pool<M: DmaMapper>(d: &Arc<Domain<M>>) -> Pool<M> {
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerFrag);
    cfg.grow_batch = 1;
    Pool::new(d.clone(), cfg).unwrap()
}

/// A software IOMMU whose first unmap fails.
fn first_unmap_fails(cfg: SoftIommuConfig) -> Arc<Faulty<SoftIommu>> {
    let fc = FaultyConfig {
        fail_nth: Some((Op::Unmap, 1)),
        ..FaultyConfig::default()
    };
    Arc::new(Faulty::new(SoftIommu::new(cfg).unwrap(), fc).unwrap())
}

/// Memory whose unmap failed is never handed out again: after a `PerFrag`
/// frag's unmap fails, no later frag lands in the page the stuck mapping
/// still translates (the cache used to keep carving the poisoned chunk),
/// and the chunk is pinned once the cache lets go of it.
#[test]
fn per_frag_failed_unmap_moves_the_cache_to_another_chunk() {
    let m = first_unmap_fails(SoftIommuConfig::default());
    let d = Arc::new(Domain::new(m.clone()));
    let mut c = FragCache::new(per_frag_pool(&d));
    let a = c.refill(64, true).unwrap();
    let stuck_iova = a.iova();
    assert!(a.complete().is_err(), "the injected unmap failure");
    // Still mapped, for good.
    let stuck = m.translate(stuck_iova, Dir::TO_DEVICE).unwrap();
    let mut frags = Vec::new();
    for _ in 0..8 {
        let f = c.refill(64, true).unwrap();
        assert_ne!(
            page_of(f.addr().raw()),
            page_of(stuck.addr.raw()),
            "frag {:?} handed out in the page a failed unmap left mapped at {stuck_iova}",
            f.addr()
        );
        frags.push(f);
    }
    assert_eq!(c.stats().chunks_taken, 2, "one move, to a fresh chunk");
    let pool = c.pool().clone();
    assert_eq!(pool.stats().pinned, 1, "the poisoned chunk, pinned");
    c.complete_burst(frags).unwrap();
    drop(c);
    assert_eq!(pool.stats().pinned, 1);
    assert_eq!(pool.stats().unmap_errors, 1);
}

/// Memory whose unmap failed is never handed out again, in bulk: when a
/// `PerFrag` `refill_bulk` undoes the frags it mapped (a later map failed)
/// and undoing one fails, the next refill used to hand out *the same
/// bytes* the stuck mapping still translates. Now the cache moves on.
#[test]
fn per_frag_bulk_undo_failure_never_rehands_the_stuck_bytes() {
    // Room for exactly two one-page IOVA allocations.
    let base = 0x10_0000u64;
    let m = first_unmap_fails(SoftIommuConfig {
        iova_range: base..base + 2 * PAGE_SIZE,
        ..SoftIommuConfig::default()
    });
    let d = Arc::new(Domain::new(m.clone()));
    let mut c = FragCache::new(per_frag_pool(&d));
    let mut out = Vec::new();
    // Frags 0 and 1 map, frag 2 finds no IOVA; undoing frag 0 fails.
    assert!(c.refill_bulk(64, 3, &mut out).is_err());
    assert!(out.is_empty());
    assert_eq!(m.stats_injected().unmaps, 1);
    let stuck = m.translate(Iova(base), Dir::TO_DEVICE).unwrap();
    let f = c.refill(64, true).unwrap();
    assert_ne!(
        page_of(f.addr().raw()),
        page_of(stuck.addr.raw()),
        "the page a failed unmap left mapped (iova {base:#x}) is handed out again"
    );
    assert_eq!(c.pool().stats().unmap_errors, 1);
    c.complete(f).unwrap();
    drop(c);
    assert_eq!(d.pinned().iova_bytes, PAGE_SIZE);
}

/// Memory is reused only after the unmap and the invalidation covering it
/// completed: under lazy invalidation a `PerFrag` frag's unmap is
/// deferred and its IOTLB entry stays until the flush; the cache used to
/// hand out the next frag in that page before any flush. Now it skips to
/// the next page, here the end of a one-page chunk: it moves to another
/// chunk, parks the old one until the flush, and counts the chunk's
/// untouched rest as waste.
#[test]
fn per_frag_lazy_unmap_moves_the_cache_on_until_the_flush() {
    let m = Arc::new(
        SoftIommu::new(SoftIommuConfig {
            invalidation: Invalidation::Lazy,
            flush_queue: 1 << 10,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    );
    let d = Arc::new(Domain::new(m.clone()));
    let mut c = FragCache::new(per_frag_pool(&d));
    let a = c.refill(64, true).unwrap();
    let ia = a.iova();
    m.translate(ia, Dir::TO_DEVICE).unwrap(); // in the IOTLB now
    c.complete(a).unwrap(); // deferred
    let flushed = m.flushed_seq();
    let b = c.refill(64, true).unwrap();
    // No flush happened, and the stale entry still translates.
    assert_eq!(m.flushed_seq(), flushed);
    let stale = m.translate(ia, Dir::TO_DEVICE).unwrap();
    assert_ne!(
        page_of(stale.addr.raw()),
        page_of(b.addr().raw()),
        "frag handed out in a page whose unmap still waits for its flush"
    );
    let pool = c.pool().clone();
    assert_eq!(pool.parked_chunks(), 1);
    assert_eq!(pool.stats().parks, 1);
    let st = c.stats();
    assert_eq!((st.chunks_taken, st.reused_in_place), (2, 0));
    assert_eq!(st.bytes, 128);
    assert_eq!(
        st.waste_bytes,
        PAGE_SIZE - 64,
        "the rest of the first chunk"
    );
    c.complete(b).unwrap();
}

/// The rule costs nothing when no unmap waits: with strict invalidation a
/// `PerFrag` cache keeps carving (and reusing in place) its one chunk.
#[test]
fn per_frag_strict_unmaps_keep_carving_one_chunk() {
    let m = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let d = Arc::new(Domain::new(m));
    let mut c = FragCache::new(per_frag_pool(&d));
    let first = c.refill(64, true).unwrap();
    let page = page_of(first.addr().raw());
    c.complete(first).unwrap();
    for _ in 0..(2 * PAGE_SIZE / 64) {
        let f = c.refill(64, true).unwrap();
        assert_eq!(page_of(f.addr().raw()), page);
        c.complete(f).unwrap();
    }
    let st = c.stats();
    assert_eq!(st.chunks_taken, 1);
    assert!(st.reused_in_place >= 1);
}

/// Under lazy invalidation a deferred unmap costs the cache the rest of a
/// page, not of a chunk: frags sent and completed one at a time from a
/// `PerFrag` pool of 64 KiB chunks each start a fresh page (never one a
/// translation still waiting for its flush reaches), and the pool grows by
/// about a page per frag until the flush queue fills and flushes, not by a
/// chunk per frag.
#[test]
fn per_frag_lazy_unmaps_skip_a_page_not_a_chunk() {
    let m = Arc::new(
        SoftIommu::new(SoftIommuConfig {
            invalidation: Invalidation::Lazy,
            flush_queue: 256,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    );
    let d = Arc::new(Domain::new(m.clone()));
    let mut cfg = pool::Config::new(Order::new(4).unwrap(), Policy::PerFrag);
    cfg.grow_batch = 1;
    let mut c = FragCache::new(Pool::new(d, cfg).unwrap());
    let n = if cfg!(miri) { 40 } else { 2000 };
    let mut last_page = None;
    for _ in 0..n {
        let f = c.refill(64, true).unwrap();
        let page = page_of(f.addr().raw());
        assert_ne!(
            Some(page),
            last_page,
            "a frag in the page of a deferred unmap"
        );
        last_page = Some(page);
        c.complete(f).unwrap();
    }
    let st = c.stats();
    // Sixteen pages a chunk: one chunk per 16 frags at most.
    assert!(
        st.chunks_taken <= n / 16 + 1,
        "{} chunks for {n} frags",
        st.chunks_taken
    );
    assert_eq!(st.bytes, 64 * n);
}
