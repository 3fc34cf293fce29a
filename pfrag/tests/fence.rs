//! The fence contract of every mapper: no unmap or flush returns while a
//! `Hold` taken on another thread is alive (the `Translate` trait's Safety
//! section), whatever the mapper and its invalidation mode.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::Duration;

use pfrag::dma::{
    DmaMapper, Faulty, FaultyConfig, Identity, Invalidation, SoftIommu, SoftIommuConfig, Translate,
};

/// Takes a hold on this thread, flushes on another, and checks that the
/// flush returns only once the hold has dropped.
fn flush_waits_for_a_hold<M: DmaMapper + Translate>(m: &M, name: &str) {
    let flushed = AtomicBool::new(false);
    // SAFETY: this thread neither unmaps, flushes nor accesses through `m`
    // while it holds; the flush runs on another thread.
    let hold = unsafe { m.hold() };
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            m.flush().unwrap();
            flushed.store(true, SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        let early = flushed.load(SeqCst);
        drop(hold);
        t.join().unwrap();
        assert!(!early, "{name}: a flush returned under a hold");
    });
    assert!(flushed.load(SeqCst));
}

#[test]
fn no_flush_returns_while_a_hold_is_alive() {
    let soft = |invalidation| {
        SoftIommu::new(SoftIommuConfig {
            invalidation,
            ..SoftIommuConfig::default()
        })
        .unwrap()
    };
    flush_waits_for_a_hold(&soft(Invalidation::Strict), "strict");
    flush_waits_for_a_hold(&soft(Invalidation::Lazy), "lazy");
    flush_waits_for_a_hold(&Identity::new(), "identity");
    let faulty = Faulty::new(Identity::new(), FaultyConfig::default()).unwrap();
    flush_waits_for_a_hold(&faulty, "faulty identity");
}

/// A map through a domain whose IOVA space is exhausted while ranges wait
/// for a flush flushes, and so waits for every hold: the reason a holder
/// must not map through its mapper's domain (`Translate::hold`).
#[test]
fn a_map_that_must_flush_waits_for_a_hold() {
    use pfrag::dma::{Dir, Domain};
    use pfrag::mem::Region;
    let d = Domain::new(
        SoftIommu::new(SoftIommuConfig {
            invalidation: Invalidation::Lazy,
            iova_range: (1 << 20)..(1 << 20) + 4096,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    );
    let r = Region::new(4096, 4096, false).unwrap();
    // SAFETY: `r` outlives every mapping of it: the last is retired below,
    // before it drops.
    let iova = unsafe { d.map(r.addr(), 4096, 4096, Dir::TO_DEVICE) }.unwrap();
    // SAFETY: the mapping is this test's own; nothing names it after.
    unsafe { d.unmap(iova, 4096) }.unwrap();
    let mapped = AtomicBool::new(false);
    // SAFETY: this thread neither maps, unmaps, flushes nor accesses
    // through the domain while it holds; the map runs on another thread.
    let hold = unsafe { d.mapper().hold() };
    let again = std::thread::scope(|s| {
        let t = s.spawn(|| {
            // SAFETY: as above.
            let at = unsafe { d.map(r.addr(), 4096, 4096, Dir::TO_DEVICE) };
            mapped.store(true, SeqCst);
            at
        });
        std::thread::sleep(Duration::from_millis(50));
        let early = mapped.load(SeqCst);
        drop(hold);
        let at = t.join().unwrap();
        assert!(!early, "a map that had to flush returned under a hold");
        at.unwrap()
    });
    assert_eq!(again, iova, "the flushed IOVA is handed out again");
    // SAFETY: as above.
    unsafe { d.retire(again, 4096) }.unwrap();
}
