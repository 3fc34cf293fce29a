//! The frag fast path: completion on the owning thread (no atomic for a
//! frag of the chunk being carved) and bulk hand-out, observed through the
//! pool's and the cache's counters and the software IOMMU's.

use std::sync::Arc;

use pfrag::dma::{
    DmaMapper, Domain, Faulty, FaultyConfig, Invalidation, Op, SoftIommu, SoftIommuConfig,
};
use pfrag::frag::{FragCache, FRAG_ALIGN};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Error, Order};

fn soft() -> SoftIommu {
    SoftIommu::new(SoftIommuConfig {
        invalidation: Invalidation::Strict,
        ..SoftIommuConfig::default()
    })
    .unwrap()
}

fn cache<M: DmaMapper>(mapper: M, order: u32, policy: Policy) -> (Pool<M>, FragCache<M>) {
    let pool = Pool::new(
        Arc::new(Domain::new(mapper)),
        pool::Config::new(Order::new(order).unwrap(), policy),
    )
    .unwrap();
    (pool.clone(), FragCache::new(pool))
}

/// Every chunk is in exactly one place: a free list, or out (`out`).
fn accounted<M: DmaMapper>(p: &Pool<M>, out: usize) {
    let s = p.stats();
    assert_eq!(
        s.chunks as usize,
        p.free_chunks() + p.reserved_chunks() + p.parked_chunks() + s.pinned as usize + out,
        "{s:?}"
    );
}

#[test]
fn owner_completion_returns_references_to_the_bias() {
    for policy in Policy::ALL {
        let (p, mut c) = cache(soft(), 0, policy);
        // 4 KiB chunk: 64 frags of 64 bytes, completed as they go.
        for _ in 0..64 {
            let f = c.refill(64, true).unwrap();
            c.complete(f).unwrap();
        }
        // The next frag needs a fresh chunk: the first is idle (its
        // references all came back through the bias) and is reused in place.
        let f = c.refill(64, true).unwrap();
        assert_eq!(c.stats().chunks_taken, 1, "{policy:?}");
        assert_eq!(c.stats().reused_in_place, 1, "{policy:?}");
        assert_eq!(p.stats().recycles, 0, "{policy:?}");
        c.complete(f).unwrap();
        drop(c);
        accounted(&p, 0);
        let d = p.domain().clone();
        drop(p);
        assert_eq!(d.mapper().mapped_pages(), 0, "{policy:?}: pool gone");
    }
}

#[test]
fn owner_and_atomic_completions_mix_on_one_chunk() {
    let (p, mut c) = cache(soft(), 0, Policy::Persistent);
    let a = c.refill(1000, true).unwrap();
    let b = c.refill(1000, true).unwrap();
    let d = c.refill(1000, true).unwrap();
    c.complete(a).unwrap();
    drop(b); // the atomic path
    std::thread::spawn(move || d.complete().unwrap())
        .join()
        .unwrap();
    // The chunk's refcount now holds only the cache's bias: moving on finds
    // it idle exactly once.
    let e = c.refill(4096, true).unwrap();
    assert_eq!(c.stats().reused_in_place, 1);
    assert_eq!(p.stats().recycles, 0);
    drop(e);
    drop(c);
    accounted(&p, 0);
}

#[test]
fn frag_of_an_older_chunk_completes_atomically_and_recycles_it() {
    let (p, mut c) = cache(soft(), 0, Policy::Persistent);
    let old = c.refill(4096, true).unwrap();
    // The cache moves on while `old` is out: it takes a second chunk.
    let new = c.refill(4096, true).unwrap();
    assert_eq!(c.stats().chunks_taken, 2);
    // `old` is not of the chunk being carved: the atomic path recycles it.
    c.complete(old).unwrap();
    assert_eq!(p.stats().recycles, 1);
    accounted(&p, 1);
    c.complete_burst([new]).unwrap();
    drop(c);
    accounted(&p, 0);
}

#[test]
fn owner_burst_completion_spans_chunks() {
    let (p, mut c) = cache(soft(), 0, Policy::PerChunk);
    let mut v = Vec::new();
    // Three chunks' worth: the first two are left to their frags.
    for _ in 0..3 {
        c.refill_bulk(1024, 4, &mut v).unwrap();
    }
    assert_eq!(c.stats().chunks_taken, 3);
    c.complete_burst(v.drain(..)).unwrap();
    // Two older chunks recycled (and unmapped: per-chunk policy), the
    // current one idle in the cache.
    assert_eq!(p.stats().recycles, 2);
    accounted(&p, 1);
    drop(c);
    accounted(&p, 0);
    assert_eq!(p.domain().mapper().mapped_pages(), 0);
}

#[test]
fn bulk_carves_one_chunk_in_order() {
    let (p, mut c) = cache(soft(), 3, Policy::Persistent);
    let mut v = Vec::new();
    c.refill_bulk(100, 32, &mut v).unwrap();
    assert_eq!(v.len(), 32);
    let stride = 100usize.next_multiple_of(FRAG_ALIGN);
    for (i, f) in v.iter().enumerate() {
        assert_eq!(f.len(), 100);
        assert_eq!(f.iova().raw() - v[0].iova().raw(), (i * stride) as u64);
        assert_eq!(f.addr().raw() - v[0].addr().raw(), i * stride);
    }
    let s = c.stats();
    assert_eq!((s.frags, s.bytes), (32, 3200));
    assert_eq!(s.waste_bytes, (32 * stride - 3200) as u64);
    // The same as 32 single refills would have given.
    let (_, mut one) = cache(soft(), 3, Policy::Persistent);
    let w: Vec<_> = (0..32).map(|_| one.refill(100, true).unwrap()).collect();
    assert_eq!(one.stats(), s);
    drop(w);
    // Filled and completed on the owning thread.
    for f in v.iter_mut() {
        f.as_mut_slice().fill(7);
    }
    c.complete_burst(v.drain(..)).unwrap();
    drop(c);
    accounted(&p, 0);
}

#[test]
fn bulk_moves_to_a_fresh_chunk_rather_than_straddle() {
    let (_p, mut c) = cache(soft(), 0, Policy::Persistent);
    let mut v = Vec::new();
    c.refill_bulk(1024, 3, &mut v).unwrap();
    c.refill_bulk(1024, 2, &mut v).unwrap();
    assert_eq!(c.stats().chunks_taken, 2);
    assert_eq!(c.stats().waste_bytes, 1024);
    let page = |f: &pfrag::frag::Frag<SoftIommu>| f.addr().raw() / 4096;
    assert_eq!(page(&v[3]), page(&v[4]));
    assert_ne!(page(&v[2]), page(&v[3]));
}

#[test]
fn bulk_bad_input_is_typed_and_charges_nothing() {
    let (p, mut c) = cache(soft(), 0, Policy::Persistent);
    let mut v = Vec::new();
    assert!(matches!(
        c.refill_bulk(0, 4, &mut v),
        Err(Error::ZeroLength)
    ));
    // 64 frags of 64 bytes fill 4 KiB exactly; one more does not fit.
    c.refill_bulk(64, 64, &mut v).unwrap();
    match c.refill_bulk(64, 65, &mut v) {
        Err(Error::LargerThanChunk { len, chunk }) => assert_eq!((len, chunk), (65 * 64, 4096)),
        other => panic!("{other:?}"),
    }
    c.refill_bulk(64, 0, &mut v).unwrap();
    assert_eq!(v.len(), 64);
    assert_eq!(c.stats().frags, 64);
    c.complete_burst(v.drain(..)).unwrap();
    drop(c);
    accounted(&p, 0);
}

/// Per-frag policy: each frag of a bulk gets its own mapping; a map that
/// fails midway leaves nothing appended, mapped or charged.
#[test]
fn bulk_per_frag_failure_midway_rolls_back() {
    let faulty = Faulty::new(
        soft(),
        FaultyConfig {
            fail_nth: Some((Op::Map, 5)),
            ..FaultyConfig::default()
        },
    )
    .unwrap();
    let (p, mut c) = cache(faulty, 2, Policy::PerFrag);
    let mut v = Vec::new();
    // Map call 1 grows nothing under per-frag (chunks are not mapped);
    // calls 1..=4 are the first four frags, call 5 fails.
    let err = c.refill_bulk(512, 8, &mut v).unwrap_err();
    assert_eq!(err.errno(), Some(libc::ENOMEM), "{err}");
    assert!(v.is_empty());
    let before = c.stats();
    assert_eq!(before.frags, 0);
    let inner = p.domain().mapper().inner();
    assert_eq!(
        inner.mapped_pages(),
        0,
        "the four frags' mappings were removed"
    );
    // The cache still works, and everything comes back.
    c.refill_bulk(512, 8, &mut v).unwrap();
    assert_eq!(inner.stats().map_calls, 4 + 8);
    c.complete_burst(v.drain(..)).unwrap();
    assert_eq!(inner.mapped_pages(), 0);
    drop(c);
    accounted(&p, 0);
}

/// A payload carve that fails part-way gives back the frags it carved,
/// and `frags_counting` says how many of their unmaps failed, as the pool
/// counts them: three order-0 frags, the third's map fails, and both
/// earlier frags' unmaps fail. The cache counts no frag handed out, and
/// the bytes its cursor passed as waste.
#[test]
fn a_failed_carve_counts_the_unmaps_that_failed_on_the_way_out() {
    let faulty = Faulty::new(
        soft(),
        FaultyConfig {
            unmap_rate: 1.0,
            fail_nth: Some((Op::Map, 3)),
            ..FaultyConfig::default()
        },
    )
    .unwrap();
    let (p, mut c) = cache(faulty, 0, Policy::PerFrag);
    let mut v = Vec::new();
    let before = c.stats();
    let (err, failed) = c.frags_counting(3 * 4096, false, &mut v).unwrap_err();
    let after = c.stats();
    assert_eq!(
        (after.frags, after.bytes),
        (before.frags, before.bytes),
        "no frag counted as handed out: {after:?}"
    );
    assert_eq!(after.waste_bytes, 2 * 4096, "the two pages passed over");
    assert_eq!(err.errno(), Some(libc::ENOMEM), "{err}");
    assert!(v.is_empty(), "nothing appended");
    assert_eq!(failed, 2, "one per frag given back");
    assert_eq!(p.stats().unmap_errors, 2, "the pool's count agrees");
    // Bad input fails before any carve: nothing given back.
    let (err, failed) = c.frags_counting(0, false, &mut v).unwrap_err();
    assert!(matches!(err, Error::ZeroLength), "{err}");
    assert_eq!(failed, 0);
}

/// A hold keeps its chunk from reuse after the frag completed (on the
/// owner's path or any other), outlives the cache, and releases the chunk
/// when dropped; the per-frag mapping still goes with the frag.
#[test]
fn a_hold_keeps_the_chunk_out_of_circulation_until_dropped() {
    for policy in Policy::ALL {
        let iommu = Arc::new(soft());
        let (p, mut c) = cache(iommu.clone(), 0, policy);
        let f = c.refill(1000, true).unwrap();
        let h = f.hold();
        assert_eq!((h.len(), h.is_empty()), (1000, false));
        c.complete(f).unwrap();
        if policy == Policy::PerFrag {
            assert_eq!(iommu.mapped_pages(), 0, "the frag's own mapping went");
        }
        // Fill the chunk (four 1000-byte frags fit 4 KiB) and move on: every
        // frag completed, but the held chunk is not reused in place.
        for _ in 0..3 {
            let g = c.refill(1000, true).unwrap();
            assert_eq!(g.hold().chunk_id(), h.chunk_id(), "{policy:?}");
            c.complete(g).unwrap();
        }
        let g = c.refill(1000, true).unwrap();
        assert_ne!(g.hold().chunk_id(), h.chunk_id(), "{policy:?}");
        c.complete(g).unwrap();
        assert_eq!(c.stats().reused_in_place, 0, "{policy:?}");
        let h2 = c.refill(64, true).unwrap();
        let same = h2.hold();
        drop(c);
        // The cache is gone; the first hold still pins its chunk.
        accounted(&p, 2);
        drop(h);
        accounted(&p, 1);
        drop(h2);
        drop(same);
        accounted(&p, 0);
    }
}

/// Frags taken back unused (`take_back`, a send refused once carved)
/// count as never handed out, their bytes as waste; frags of the chunk
/// being carved give their references back to the bias, so that chunk is
/// reused in place once the rest completed; and the count of their failed
/// unmaps comes back, as the pool counts them. Frags of another cache
/// leave the counters at zero at worst.
#[test]
fn frags_taken_back_count_as_never_handed_out() {
    let (p, mut c) = cache(soft(), 0, Policy::Persistent);
    let kept = c.refill(100, true).unwrap();
    let mut v = Vec::new();
    c.frags(1000, true, &mut v).unwrap();
    c.refill_bulk(64, 4, &mut v).unwrap();
    assert_eq!(c.take_back(v.drain(..)), 0);
    let st = c.stats();
    assert_eq!((st.frags, st.bytes), (1, 100), "{st:?}");
    assert_eq!(st.waste_bytes, 128 + 1024 + 3 * 64 + 64 - 100, "{st:?}");
    c.complete(kept).unwrap();
    // All back through the bias: the chunk is reused, none recycled.
    let f = c.refill(4096, true).unwrap();
    assert_eq!((c.stats().reused_in_place, p.stats().recycles), (1, 0));
    let (_, mut other) = cache(soft(), 0, Policy::Persistent);
    assert_eq!(other.take_back([f]), 0);
    assert_eq!((other.stats().frags, other.stats().bytes), (0, 0));
    drop(c);
    accounted(&p, 0);
    // Per frag, each failed unmap is counted.
    let faulty = Faulty::new(
        soft(),
        FaultyConfig {
            unmap_rate: 1.0,
            ..FaultyConfig::default()
        },
    )
    .unwrap();
    let (p, mut c) = cache(faulty, 0, Policy::PerFrag);
    let mut v = Vec::new();
    c.frags(3 * 4096, true, &mut v).unwrap();
    assert_eq!(c.take_back(v.drain(..)), 3);
    assert_eq!(p.stats().unmap_errors, 3);
    assert_eq!((c.stats().frags, c.stats().bytes), (0, 0));
}
