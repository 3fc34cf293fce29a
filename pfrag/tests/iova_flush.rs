//! IOVA freed by deferred unmaps on two threads, with a flush between
//! them: the ranges reach the allocator in an order other than their
//! flush generations', and the domain's count of IOVA waiting for a flush
//! must still drop each range once its own flush has completed.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use pfrag::dma::{
    Dir, DmaMapper, Domain, Invalidation, IovaSpace, MapStats, Mapping, PageSizes, SoftIommu,
    SoftIommuConfig, Unmapped,
};
use pfrag::mem::Region;
use pfrag::{Iova, Result};

/// Where an unmap stops, and the channels it says so on (`removed`)
/// and waits on (`resume`).
type StallAt = (Iova, Sender<()>, Receiver<()>);

/// The unmap of one IOVA stops once the mapper has removed it, before
/// the domain frees the IOVA: it says so on `removed`, then waits for
/// `resume`.
struct Stall {
    inner: SoftIommu,
    at: Mutex<Option<StallAt>>,
}

impl DmaMapper for Stall {
    unsafe fn map(&self, m: &Mapping) -> Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.map(m) }
    }
    fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped> {
        let r = self.inner.unmap(iova, len);
        let stall = {
            let mut at = self.at.lock().unwrap();
            match at.take() {
                Some(s) if s.0 == iova => Some(s),
                other => {
                    *at = other;
                    None
                }
            }
        };
        if let Some((_, removed, resume)) = stall {
            removed.send(()).unwrap();
            resume.recv().unwrap();
        }
        r
    }
    fn page_sizes(&self) -> PageSizes {
        self.inner.page_sizes()
    }
    fn iova_space(&self) -> IovaSpace {
        self.inner.iova_space()
    }
    fn flushed_seq(&self) -> u64 {
        self.inner.flushed_seq()
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn stats(&self) -> MapStats {
        self.inner.stats()
    }
}

/// Thread 1 unmaps A (generation g) and stalls before its IOVA is freed;
/// meanwhile a flush completes g, and thread 2 unmaps B (generation
/// g + 1), whose IOVA is freed first. A's range, flushed, must not be
/// counted as waiting behind B's.
#[test]
fn a_range_freed_after_a_later_generation_leaves_the_count_at_its_flush() {
    let cfg = SoftIommuConfig {
        invalidation: Invalidation::Lazy,
        ..SoftIommuConfig::default()
    };
    let (removed_tx, removed) = channel();
    let (resume, resume_rx) = channel();
    let mapper = Stall {
        inner: SoftIommu::new(cfg).unwrap(),
        at: Mutex::new(None),
    };
    let d = Arc::new(Domain::new(mapper));
    let r = Region::new(3 * 4096, 4096, false).unwrap();
    // SAFETY: `r` outlives both mappings: both are unmapped and flushed
    // below before it drops.
    let a = unsafe { d.map(r.addr(), 4096, 4096, Dir::TO_DEVICE) }.unwrap();
    // SAFETY: as above.
    let b = unsafe { d.map(r.addr().offset(4096), 2 * 4096, 4096, Dir::TO_DEVICE) }.unwrap();
    *d.mapper().at.lock().unwrap() = Some((a, removed_tx, resume_rx));
    let d1 = d.clone();
    // SAFETY: the mappings are this test's, named nowhere else.
    let t = std::thread::spawn(move || unsafe { d1.unmap(a, 4096) }.unwrap());
    removed.recv().unwrap();
    // A's generation completes; B's unmap opens the next one.
    d.flush().unwrap();
    // SAFETY: as above.
    let how = unsafe { d.unmap(b, 2 * 4096) }.unwrap();
    assert!(matches!(how, Unmapped::Deferred { .. }));
    resume.send(()).unwrap();
    let how_a = t.join().unwrap();
    let (Unmapped::Deferred { seq: sa }, Unmapped::Deferred { seq: sb }) = (how_a, how) else {
        panic!("both unmaps deferred: {how_a:?}, {how:?}");
    };
    assert!(sa <= d.flushed_seq() && sb > d.flushed_seq(), "{sa} {sb}");
    assert_eq!(d.iova_in_use(), 0);
    assert_eq!(d.iova_awaiting_flush(), 2 * 4096, "only B waits");
    d.flush().unwrap();
    assert_eq!(d.iova_awaiting_flush(), 0);
}
