//! A queue whose device fails to take the ring, or panics taking it, frees
//! the ring only once the device is stopped: after a `detach` that
//! returned `Ok` and, for a device that stops only in its own `Drop`, after
//! that drop. A device that panics in `attach` or `detach` may hold the
//! ring: it is kept for good, counted in the domain's pinned memory, and
//! so is the ring of a queue dropped while its device's drop panics.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use pfrag::dma::{Dir, Domain, SoftIommu, SoftIommuConfig, Translate};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order};
use vfio_nic::device::TxDevice;
use vfio_nic::format::igb::Advanced;
use vfio_nic::format::Format;
use vfio_nic::{tx, Error};

type Iommu = Arc<SoftIommu>;

/// Whether a device's ring was still mapped when it was dropped.
type Seen = Arc<Mutex<Option<bool>>>;

/// How a [`Refusing`] device's calls end.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ends {
    /// `attach` fails after taking the ring; `detach` keeps the default.
    AttachFails,
    /// `attach` panics after taking the ring.
    AttachPanics,
    /// `attach` fails after taking the ring, and `detach` panics.
    DetachPanics,
    /// `attach` fails after taking the ring, and the device's `Drop`,
    /// where it stops, panics.
    DropPanics,
    /// `attach` succeeds; the device's `Drop`, where it stops, panics.
    AttachedDropPanics,
}

/// A device that takes the ring, then fails as its [`Ends`] says, and
/// stops only in its own `Drop`, where it records whether its ring was
/// still mapped.
struct Refusing {
    iommu: Iommu,
    ends: Ends,
    ring: Option<Iova>,
    seen: Seen,
}

impl TxDevice for Refusing {
    type Format = Advanced;
    fn format(&self) -> Advanced {
        Advanced
    }
    unsafe fn attach(&mut self, ring: Iova, _: u16) -> vfio_nic::Result<()> {
        self.ring = Some(ring);
        match self.ends {
            Ends::AttachPanics => panic!("the device's attach panicked"),
            Ends::AttachedDropPanics => Ok(()),
            _ => Err(Error::DeviceTimeout {
                what: "TX queue enable",
                waited_ms: 10,
            }),
        }
    }
    unsafe fn kick(&mut self, _: u16) -> vfio_nic::Result<()> {
        Ok(())
    }
    fn detach(&mut self) -> vfio_nic::Result<()> {
        if self.ends == Ends::DetachPanics {
            panic!("the device's detach panicked");
        }
        Ok(())
    }
}

impl Drop for Refusing {
    fn drop(&mut self) {
        let mapped = self
            .ring
            .is_some_and(|i| self.iommu.translate(i, Dir::TO_DEVICE).is_ok());
        *self.seen.lock().unwrap() = Some(mapped);
        if matches!(self.ends, Ends::DropPanics | Ends::AttachedDropPanics) {
            panic!("the device's drop panicked");
        }
    }
}

/// The queue's ring, in whole pages.
fn ring_bytes() -> u64 {
    let ring = usize::from(tx::Config::default().ring) * Advanced::DESC_SIZE;
    ring.next_multiple_of(4096) as u64
}

/// What a queue on a [`Refusing`] device ending as `ends` is made of: a
/// domain on a software IOMMU, a pool, the device, and where it records
/// whether its ring was mapped when it was dropped.
fn parts(ends: Ends) -> (Arc<Domain<Iommu>>, Pool<Iommu>, Refusing, Seen) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let seen = Arc::new(Mutex::new(None));
    let dev = Refusing {
        iommu,
        ends,
        ring: None,
        seen: seen.clone(),
    };
    (domain, pool, dev, seen)
}

/// Builds a queue on a [`Refusing`] device ending as `ends`: the result
/// (`None` for a panic), the domain, and whether the ring was mapped when
/// the device was dropped.
fn attach(ends: Ends) -> (Option<Error>, Arc<Domain<Iommu>>, Option<bool>) {
    let (domain, pool, dev, seen) = parts(ends);
    let d = domain.clone();
    let r = catch_unwind(AssertUnwindSafe(move || {
        // SAFETY: the device reads no memory.
        unsafe { tx::Queue::new(d, pool, dev, tx::Config::default()) }
    }));
    let e = r.ok().map(|r| r.expect_err("the attach fails"));
    let seen = *seen.lock().unwrap();
    (e, domain, seen)
}

/// A device that stops only in its own `Drop` (the default `detach`) and
/// fails its attach is dropped before the ring is freed. The ring used to
/// be freed first: a local of `Queue::new`, dropped before its argument.
#[test]
fn a_failed_attach_drops_the_device_before_the_ring() {
    let (e, domain, seen) = attach(Ends::AttachFails);
    assert!(matches!(e, Some(Error::DeviceTimeout { .. })), "{e:?}");
    assert_eq!(seen, Some(true), "the ring mapped as the device stopped");
    assert_eq!(domain.pinned(), pfrag::dma::Pinned::default());
}

/// The device ending as `ends` may still hold the ring: it is kept for
/// good, and counted. `error` says whether an error (rather than the
/// panic) may come back.
fn ring_kept(ends: Ends, error: bool) {
    let (e, domain, seen) = attach(ends);
    assert!(
        e.is_none() || error && matches!(e, Some(Error::DeviceTimeout { .. })),
        "{e:?}"
    );
    assert_eq!(seen, Some(true), "the ring mapped as the device stopped");
    let p = domain.pinned();
    assert_eq!((p.host_bytes, p.iova_bytes), (ring_bytes(), ring_bytes()));
}

/// An attach that panics may leave the device holding the ring: it is kept
/// for good. It used to be freed while the panic unwound.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn an_attach_that_panics_keeps_the_ring() {
    ring_kept(Ends::AttachPanics, false);
}

/// A failed attach whose detach panics is one whose detach failed: the
/// ring is kept for good.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_detach_that_panics_after_a_failed_attach_keeps_the_ring() {
    ring_kept(Ends::DetachPanics, true);
}

/// A device whose own drop (where it stops) panics may still hold the
/// ring: it is kept for good.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_device_drop_that_panics_after_a_failed_attach_keeps_the_ring() {
    ring_kept(Ends::DropPanics, false);
}

/// A queue dropped while its device's own drop (where it stops) panics
/// keeps the ring, which the device may still read, and counts it; the
/// panic is not passed on out of the queue's drop. The ring used to be
/// leaked, uncounted, as the panic left the queue's drop.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_queue_whose_device_drop_panics_keeps_the_ring() {
    let (domain, pool, dev, seen) = parts(Ends::AttachedDropPanics);
    // SAFETY: the device reads no memory.
    let q = unsafe { tx::Queue::new(domain.clone(), pool, dev, tx::Config::default()) }.unwrap();
    let r = catch_unwind(AssertUnwindSafe(move || drop(q)));
    assert!(r.is_ok(), "the queue's drop passed the device's panic on");
    assert_eq!(
        *seen.lock().unwrap(),
        Some(true),
        "the ring mapped as the device stopped"
    );
    let p = domain.pinned();
    assert!(p.host_bytes >= ring_bytes(), "{p:?}");
    assert!(p.iova_bytes >= ring_bytes(), "{p:?}");
}
