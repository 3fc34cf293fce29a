//! Pool, frag cache and mapping-policy behaviour, observed through the
//! software IOMMU's counters.

use std::sync::Arc;

use pfrag::dma::{
    Dir, DmaMapper, Domain, Identity, Invalidation, SoftIommu, SoftIommuConfig, Translate,
};
use pfrag::frag::{complete_burst, FragCache};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Error, Order};

fn domain(inv: Invalidation) -> Arc<Domain<SoftIommu>> {
    Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig {
            invalidation: inv,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    ))
}

fn cache(order: u32, policy: Policy) -> (Arc<Domain<SoftIommu>>, FragCache<SoftIommu>) {
    let d = domain(Invalidation::Strict);
    let pool = Pool::new(
        d.clone(),
        pool::Config::new(Order::new(order).unwrap(), policy),
    )
    .unwrap();
    (d, FragCache::new(pool))
}

/// Iterations: the full count natively, a small one under Miri (which is
/// orders of magnitude slower); the properties checked stay the same.
fn n(full: usize) -> usize {
    if cfg!(miri) {
        (full / 400).max(4)
    } else {
        full
    }
}

#[test]
fn persistent_makes_no_map_calls_in_steady_state() {
    let (d, mut c) = cache(4, Policy::Persistent);
    let mut inflight = std::collections::VecDeque::new();
    // Under Miri grow batches are smaller: warm up past 32 in flight anyway.
    let warm = n(2000).max(40);
    for i in 0..warm {
        let mut v = Vec::new();
        c.frags(65160, true, &mut v).unwrap();
        assert_eq!(v.len(), 1, "a 64 KB payload fits one order-4 chunk");
        inflight.push_back(v);
        if inflight.len() > 32 {
            inflight.pop_front();
        }
        if i == warm / 2 {
            let s = d.mapper().stats();
            assert!(s.map_calls >= 1);
        }
    }
    let before = d.mapper().stats();
    for _ in 0..n(1000) {
        let mut v = Vec::new();
        c.frags(65160, true, &mut v).unwrap();
        inflight.push_back(v);
        inflight.pop_front();
    }
    let s = d.mapper().stats().since(&before);
    assert_eq!((s.map_calls, s.unmap_calls, s.invalidations), (0, 0, 0));
}

#[test]
fn per_frag_maps_and_unmaps_every_frag() {
    let (d, mut c) = cache(3, Policy::PerFrag);
    let mut v = Vec::new();
    c.frags(65160, false, &mut v).unwrap();
    let n = v.len() as u64;
    assert!(n >= 2);
    assert_eq!(d.mapper().stats().map_calls, n);
    drop(v);
    let s = d.mapper().stats();
    assert_eq!((s.unmap_calls, s.invalidations), (n, n));
    assert_eq!(d.iova_in_use(), 0);
}

/// Without an IOMMU each frag maps its pages at their own address, so two
/// frags in one page map the same page: it stays mapped until the last of
/// them completes.
#[test]
fn per_frag_frags_sharing_a_page_map_without_an_iommu() {
    let id = Arc::new(Identity::new());
    let d = Arc::new(Domain::new(id.clone()));
    let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerFrag);
    let mut c = FragCache::new(Pool::new(d, cfg).unwrap());
    let a = c.refill(1000, false).unwrap();
    let b = c.refill(1000, false).unwrap();
    let (ia, ib) = (a.iova(), b.iova());
    assert_eq!(ia.raw() >> 12, ib.raw() >> 12, "both frags in one page");
    assert_eq!(id.stats().map_calls, 2);
    assert_eq!(id.mapped_pages(), 1);
    drop(a);
    assert!(id.translate(ib, Dir::TO_DEVICE).is_ok());
    drop(b);
    assert!(id.translate(ia, Dir::TO_DEVICE).is_err());
    assert_eq!(id.stats().unmap_calls, 2);
    assert_eq!(id.mapped_pages(), 0);
}

#[test]
fn per_chunk_maps_on_take_and_unmaps_on_last_completion() {
    let (d, mut c) = cache(4, Policy::PerChunk);
    let a = c.refill(30000, true).unwrap();
    let b = c.refill(30000, true).unwrap();
    assert_eq!(
        d.mapper().stats().map_calls,
        1,
        "both frags share one chunk mapping"
    );
    let iova = a.iova();
    drop(a);
    assert!(d.mapper().translate(iova, Dir::TO_DEVICE).is_ok());
    c.release();
    drop(b);
    assert_eq!(d.mapper().stats().unmap_calls, 1);
    assert!(d.mapper().translate(iova, Dir::TO_DEVICE).is_err());
}

#[test]
fn fit_whole_never_straddles_and_split_fills_tails() {
    let (_, mut c) = cache(3, Policy::Persistent);
    let mut v = Vec::new();
    c.frags(1000, true, &mut v).unwrap();
    c.frags(32768, true, &mut v).unwrap();
    assert_eq!(v.len(), 2);
    assert_eq!(v[1].len(), 32768);
    assert_eq!(
        v[1].iova().raw() % 32768,
        0,
        "a whole-chunk frag starts a chunk"
    );

    let (_, mut c) = cache(3, Policy::Persistent);
    let mut v = Vec::new();
    c.frags(1000, false, &mut v).unwrap();
    c.frags(65160, false, &mut v).unwrap();
    // 1024 used by the first payload: 31744 + 32768 + 648.
    let lens: Vec<usize> = v[1..].iter().map(|f| f.len()).collect();
    assert_eq!(lens, vec![31744, 32768, 648]);
}

#[test]
fn frags_are_cache_line_aligned_and_waste_is_counted() {
    let (_, mut c) = cache(0, Policy::Persistent);
    let a = c.refill(100, false).unwrap();
    let b = c.refill(100, false).unwrap();
    assert_eq!(b.addr().raw() - a.addr().raw(), 128);
    assert_eq!(c.stats().waste_bytes, 56);
    let _x = c.refill(4000, true).unwrap(); // does not fit the 3840-byte tail
                                            // The abandoned 3840-byte tail, then 4000 rounded up to 4032.
    assert_eq!(c.stats().waste_bytes, 56 + (4096 - 256) + 32);
}

#[test]
fn chunk_is_reused_in_place_when_its_frags_completed() {
    let (d, mut c) = cache(0, Policy::PerChunk);
    for _ in 0..10 {
        let f = c.refill(4096, true).unwrap();
        drop(f);
    }
    assert_eq!(c.stats().chunks_taken, 1);
    assert_eq!(c.stats().reused_in_place, 9);
    assert_eq!(d.mapper().stats().map_calls, 1);
}

#[test]
fn burst_completion_recycles_each_chunk_once() {
    let (_, mut c) = cache(0, Policy::Persistent);
    let mut v = Vec::new();
    for _ in 0..3 {
        c.frags(4096, true, &mut v).unwrap();
    }
    c.release();
    let pool = c.pool().clone();
    let before = pool.stats().recycles;
    complete_burst(v.drain(..)).unwrap();
    assert_eq!(pool.stats().recycles - before, 3);
}

#[test]
fn bad_input_is_a_typed_error_with_numbers() {
    assert!(matches!(
        Order::new(10),
        Err(Error::BadOrder { order: 10, max: 9 })
    ));
    let (_, mut c) = cache(2, Policy::Persistent);
    assert!(matches!(c.refill(0, false), Err(Error::ZeroLength)));
    assert!(matches!(
        c.refill(16385, true),
        Err(Error::LargerThanChunk {
            len: 16385,
            chunk: 16384
        })
    ));
    let mut v = Vec::new();
    assert!(matches!(
        c.frags(300_000, true, &mut v),
        Err(Error::TooLarge {
            len: 300_000,
            max: 262_144
        })
    ));
    assert!(v.is_empty());
}

/// A bulk length near `usize::MAX` once overflowed while rounding up to
/// the frag alignment (a panic in debug builds).
#[test]
fn refill_bulk_of_a_huge_length_is_a_typed_error() {
    let (_, mut c) = cache(2, Policy::Persistent);
    let mut v = Vec::new();
    for len in [usize::MAX, usize::MAX - 63, usize::MAX / 2 + 1] {
        for n in [1, 2, usize::MAX] {
            match c.refill_bulk(len, n, &mut v) {
                Err(Error::LargerThanChunk { len: l, chunk }) => {
                    assert_eq!((l, chunk), (len, 16384));
                }
                other => panic!("{len} x {n}: {other:?}"),
            }
        }
    }
    assert!(v.is_empty());
    assert_eq!(c.stats().frags, 0);
}

#[test]
fn limit_reached_is_typed_and_leaks_nothing() {
    let d = domain(Invalidation::Strict);
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 4;
    cfg.max_bytes = Some(4 * 4096);
    let pool = Pool::new(d.clone(), cfg).unwrap();
    let mut c = FragCache::new(pool.clone());
    let mut v = Vec::new();
    for _ in 0..4 {
        c.frags(4096, true, &mut v).unwrap();
    }
    match c.frags(8192, false, &mut v) {
        Err(Error::LimitReached {
            held: 16384,
            requested: 16384,
            max: 16384,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(v.len(), 4, "the failed call left nothing behind");
    drop(v);
    drop(c);
    assert_eq!(pool.free_chunks(), 4);
}

#[test]
fn shrink_unmaps_in_one_call_and_gives_memory_back() {
    let d = domain(Invalidation::Strict);
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 8;
    cfg.high_watermark = 8;
    cfg.shrink_batch = 8;
    let pool = Pool::new(d.clone(), cfg).unwrap();
    let mut c = FragCache::new(pool.clone());
    let mut v = Vec::new();
    for _ in 0..16 {
        c.frags(4096, true, &mut v).unwrap();
    }
    c.release();
    assert_eq!(
        d.mapper().stats().map_calls,
        2,
        "two grows, one map call each"
    );
    let before = d.mapper().stats();
    drop(v); // 16 free > watermark 8: one shrink of 8
    let s = d.mapper().stats().since(&before);
    let st = pool.stats();
    assert_eq!(st.shrinks, 1);
    assert_eq!(st.released, 8);
    assert_eq!(st.mapped_bytes, 8 * 4096);
    assert_eq!(s.unmap_calls, 1, "one contiguous arena: one unmap call");
    assert_eq!(s.invalidations, 1, "strict: the unmap invalidated");
    // Growing again reuses the released chunks.
    let mut c = FragCache::new(pool.clone());
    let mut v = Vec::new();
    for _ in 0..16 {
        c.frags(4096, true, &mut v).unwrap();
    }
    assert_eq!(pool.stats().released, 0);
    assert_eq!(pool.stats().chunks, 16);
}

#[test]
fn lazy_unmapped_iova_is_not_reused_before_the_flush() {
    let d = domain(Invalidation::Lazy);
    let pool = Pool::new(
        d.clone(),
        pool::Config::new(Order::new(0).unwrap(), Policy::PerFrag),
    )
    .unwrap();
    let mut c = FragCache::new(pool);
    let first = c.refill(4096, true).unwrap();
    let old = first.iova();
    drop(first);
    assert_eq!(d.mapper().flushed_seq(), 0);
    for _ in 0..n(100) {
        let f = c.refill(4096, true).unwrap();
        assert_ne!(f.iova(), old, "IOVA reused before its flush");
        std::mem::forget(f.complete());
    }
    d.mapper().flush().unwrap();
    let mut seen = false;
    for _ in 0..n(300) {
        let f = c.refill(4096, true).unwrap();
        seen |= f.iova() == old;
    }
    assert!(seen, "after the flush the IOVA is reusable");
}

#[test]
fn pool_outlives_its_handles_while_frags_are_in_flight() {
    let (d, mut c) = cache(1, Policy::Persistent);
    let mut f = c.refill(100, true).unwrap();
    drop(c);
    f.as_mut_slice().fill(7);
    assert!(f.as_slice().iter().all(|&b| b == 7));
    drop(f); // last reference: the pool goes, unmapping everything
    assert_eq!(d.iova_in_use(), 0);
    let s = d.mapper().stats();
    assert_eq!(s.map_calls, s.unmap_calls);
}

/// A mapper that refuses every map call, to drive the pool's error paths.
struct Refuse(pfrag::dma::Identity);

impl DmaMapper for Refuse {
    unsafe fn map(&self, m: &pfrag::dma::Mapping) -> pfrag::Result<()> {
        Err(Error::Map {
            iova: m.iova,
            len: m.len,
            source: std::io::Error::from_raw_os_error(12),
        })
    }
    fn unmap(&self, iova: pfrag::Iova, len: u64) -> pfrag::Result<pfrag::dma::Unmapped> {
        self.0.unmap(iova, len)
    }
    fn page_sizes(&self) -> pfrag::dma::PageSizes {
        self.0.page_sizes()
    }
    fn iova_space(&self) -> pfrag::dma::IovaSpace {
        pfrag::dma::IovaSpace::Ranges(vec![std::ops::Range {
            start: 0x10_0000,
            end: 0x1000_0000,
        }])
    }
    fn flushed_seq(&self) -> u64 {
        0
    }
    fn flush(&self) -> pfrag::Result<()> {
        Ok(())
    }
    fn stats(&self) -> pfrag::dma::MapStats {
        self.0.stats()
    }
}

#[test]
fn refused_grow_map_carries_the_errno_and_leaks_nothing() {
    let d = Arc::new(Domain::new(Refuse(pfrag::dma::Identity::new())));
    for policy in [Policy::Persistent, Policy::PerChunk, Policy::PerFrag] {
        let pool = Pool::new(d.clone(), pool::Config::new(Order::new(2).unwrap(), policy)).unwrap();
        let mut c = FragCache::new(pool.clone());
        match c.refill(1000, true) {
            Err(Error::Map { source, .. }) => assert_eq!(source.raw_os_error(), Some(12)),
            other => panic!("{policy:?}: {other:?}"),
        }
        assert_eq!(
            d.iova_in_use(),
            0,
            "{policy:?}: IOVA of the failed map freed"
        );
        let st = pool.stats();
        assert_eq!(st.mapped_bytes, 0);
        if policy == Policy::Persistent {
            // The never-mapped arena is kept as released chunks, not counted as held.
            let batch = pool.config().grow_batch as u64;
            assert_eq!((st.chunks, st.released), (0, batch));
        }
    }
}

#[test]
fn frags_completed_on_another_thread_recycle_every_chunk() {
    for policy in [Policy::PerChunk, Policy::Persistent, Policy::PerFrag] {
        let d = domain(Invalidation::Strict);
        let pool = Pool::new(d.clone(), pool::Config::new(Order::new(1).unwrap(), policy)).unwrap();
        let mut c = FragCache::new(pool.clone());
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<pfrag::frag::Frag<SoftIommu>>>(64);
        let reaper = std::thread::spawn(move || {
            let mut n = 0u64;
            for burst in rx {
                n += burst.len() as u64;
                complete_burst(burst).unwrap();
            }
            n
        });
        let mut sent = 0u64;
        for i in 0..n(20_000) {
            let mut v = Vec::new();
            c.frags(100 + (i * 37) % 9000, i % 3 == 0, &mut v).unwrap();
            sent += v.len() as u64;
            tx.send(v).unwrap();
        }
        drop(tx);
        assert_eq!(reaper.join().unwrap(), sent);
        c.release();
        drop(c);
        let st = pool.stats();
        assert_eq!(
            pool.free_chunks() as u64,
            st.chunks,
            "{policy:?}: every chunk came back"
        );
        assert_eq!(st.unmap_errors, 0);
        let expect = if policy == Policy::Persistent {
            st.chunks * 8192
        } else {
            0
        };
        assert_eq!(st.mapped_bytes, expect, "{policy:?}");
        let s = d.mapper().stats();
        assert_eq!(s.faults, 0);
    }
}

#[test]
fn arenas_freed_out_of_order_still_go_back_whole() {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let d = Arc::new(Domain::new(iommu.clone()));
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 8;
    cfg.high_watermark = 8;
    cfg.shrink_batch = 8;
    let pool = Pool::new(d, cfg).unwrap();
    let mut c = FragCache::new(pool.clone());
    let mut v: Vec<Option<_>> = (0..32)
        .map(|_| Some(c.refill(4096, true).unwrap()))
        .collect();
    assert_eq!(iommu.mappings(), 4, "four arenas, one mapping each");
    // Free column by column: no arena is whole until its last chunk goes,
    // and a refill in between takes a chunk of a half-free arena.
    for j in 0..8 {
        for a in 0..4 {
            v[a * 8 + j] = None;
        }
        if j == 3 {
            v[0] = Some(c.refill(4096, true).unwrap());
        }
    }
    v.clear();
    c.release();
    let st = pool.stats();
    assert_eq!(st.chunks, 8, "all but one arena given back: {st:?}");
    assert_eq!(st.released, 24);
    assert_eq!(iommu.mappings(), 1);
}

/// A refill that fails for want of memory leaves the cache as it was: it
/// keeps the chunk it carves, so a frag that fits that chunk's tail still
/// comes from it, and the failed call counts no waste.
#[test]
fn a_refill_the_pool_cannot_grow_for_keeps_the_cache_as_it_was() {
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 1;
    cfg.max_bytes = Some(4096);
    let pool = Pool::new(domain(Invalidation::Strict), cfg).unwrap();
    let mut c = FragCache::new(pool.clone());
    let a = c.refill(3000, true).unwrap();
    let before = c.stats();
    // 1,088 bytes left: too few for 2,000 whole, or for 600 and 600.
    let mut v = Vec::new();
    let errs = [
        c.refill(2000, true).map(drop),
        c.refill_bulk(600, 2, &mut v),
        c.frags(2000, true, &mut v),
    ];
    for e in errs {
        assert!(matches!(e, Err(Error::LimitReached { .. })), "{e:?}");
    }
    assert!(v.is_empty());
    assert_eq!(c.stats(), before, "nothing counted for the failed calls");
    let b = c.refill(1000, true).unwrap();
    assert_eq!(
        b.addr().raw() - a.addr().raw(),
        3008,
        "the same chunk's tail"
    );
    drop((a, b));
    drop(c);
    assert_eq!(pool.free_chunks(), 1);
}
