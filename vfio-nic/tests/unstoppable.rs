//! Dropping a queue whose device cannot be stopped: everything the device
//! may still read (the ring, the bounce ring, the frags of the packets in
//! flight) is kept allocated and mapped for good, counted, and never
//! handed out again. A detach that panics counts as one that failed. A
//! device that stops gets it all back, and one that stops only in its own
//! `Drop` is dropped before anything it may read is freed.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use pfrag::dma::{Coherent, Dir, Domain, SoftIommu, SoftIommuConfig, Translate};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order};
use vfio_nic::device::TxDevice;
use vfio_nic::format::igb::Advanced;
use vfio_nic::format::Format;
use vfio_nic::offload::Offload;
use vfio_nic::{tx, Error};

type Iommu = Arc<SoftIommu>;

/// How a [`Silent`] device's detach ends.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Detach {
    Stops,
    Fails,
    Panics,
}

/// A device that takes its ring and completes nothing.
#[derive(Debug)]
struct Silent(Detach);

impl TxDevice for Silent {
    type Format = Advanced;
    fn format(&self) -> Advanced {
        Advanced
    }
    unsafe fn attach(&mut self, _: Iova, _: u16) -> vfio_nic::Result<()> {
        Ok(())
    }
    unsafe fn kick(&mut self, _: u16) -> vfio_nic::Result<()> {
        Ok(())
    }
    fn detach(&mut self) -> vfio_nic::Result<()> {
        match self.0 {
            Detach::Stops => Ok(()),
            Detach::Fails => Err(Error::DeviceTimeout {
                what: "transmit stop",
                waited_ms: 10,
            }),
            Detach::Panics => panic!("the device's detach panicked"),
        }
    }
}

type Parts<D> = (tx::Queue<Iommu, D>, Arc<Domain<Iommu>>, Pool<Iommu>);

/// A queue on `dev` over a persistent pool of 4 KiB chunks, with the
/// domain and the pool.
fn queue<D: TxDevice<Format = Advanced>>(dev: D, iommu: Iommu) -> Parts<D> {
    queue_on(dev, iommu, Policy::Persistent)
}

/// [`queue`] over a pool mapped by `policy`.
fn queue_on<D: TxDevice<Format = Advanced>>(dev: D, iommu: Iommu, policy: Policy) -> Parts<D> {
    let domain = Arc::new(Domain::new(iommu));
    let pcfg = pool::Config::new(Order::new(0).unwrap(), policy);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let cfg = tx::Config {
        mtu: 9000,
        ..tx::Config::default()
    };
    // SAFETY: the device reads no memory through any translation but the
    // domain's.
    let q = unsafe { tx::Queue::new(domain.clone(), pool.clone(), dev, cfg) }.unwrap();
    (q, domain, pool)
}

fn iommu() -> Iommu {
    Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap())
}

/// Posts two packets and rings the doorbell: a 3,000-byte payload frag
/// (returned: its first byte's address) and a packet in a bounce slot.
fn two_in_flight<D: TxDevice>(q: &mut tx::Queue<Iommu, D>) -> usize {
    let hdr = [0u8; 14];
    let mut frags = Vec::new();
    q.cache_mut().frags(3000, true, &mut frags).unwrap();
    let at = frags[0].addr().raw();
    q.post(&hdr, &mut frags, Offload::None, 1).unwrap();
    q.send(&hdr, &[1u8; 50], Offload::None, 2).unwrap();
    assert_eq!(
        q.stats().inline_packets,
        1,
        "the second packet is in a bounce slot"
    );
    q.kick().unwrap();
    assert_eq!(q.in_flight(), 2);
    at
}

/// The bytes of the queue's own rings: the descriptor ring and the
/// bounce ring, each in whole pages.
fn rings() -> u64 {
    let cfg = tx::Config::default();
    let tx::HeaderMode::Bounce(slot) = cfg.header else {
        panic!("{:?}", cfg.header)
    };
    let ring = usize::from(cfg.ring) * Advanced::DESC_SIZE;
    let bounce = usize::from(cfg.ring) * slot as usize;
    (ring.next_multiple_of(4096) + bounce.next_multiple_of(4096)) as u64
}

/// Whether any of 320 fresh chunk-sized frags from `pool` (more than the
/// 256 chunks it grew by) overlaps the 3,000 bytes at `at`.
fn handed_out_again(pool: &Pool<Iommu>, at: usize) -> bool {
    let mut cache = FragCache::new(pool.clone());
    let mut out = Vec::new();
    for _ in 0..320 {
        cache.frags(4096, true, &mut out).unwrap();
    }
    out.iter().any(|f| {
        let a = f.addr().raw();
        a < at + 3000 && at < a + f.len()
    })
}

/// Checks that what the device may read was kept: the rings counted at
/// once, the payload's chunk pinned in the pool (never recycled nor
/// handed out), and counted in the domain when the pool drops.
fn kept(domain: &Domain<Iommu>, pool: Pool<Iommu>, at: usize) {
    let p = domain.pinned();
    assert_eq!((p.host_bytes, p.iova_bytes), (rings(), rings()));
    let st = pool.stats();
    assert_eq!((st.pinned, st.recycles), (1, 0), "the payload's chunk");
    assert!(!handed_out_again(&pool, at));
    drop(pool);
    // The chunk at least; a persistent pool maps its arenas whole, and a
    // mapping is not removed in part, so its arena's other chunks stay
    // pinned with it.
    let host = domain.pinned().host_bytes;
    assert!(
        host >= rings() + 4096 && host.is_multiple_of(4096),
        "{host}"
    );
    // And mapped: the chunk's part of its arena's mapping, kept on
    // purpose, and the rest of it, whose unmap (a part of one mapping)
    // the IOMMU refused; all of it counted, once.
    assert_eq!(domain.pinned().iova_bytes, host);
}

/// A device that cannot be stopped may still read the ring, the bounce
/// ring and the payload in flight: the queue's drop keeps them for good.
/// The queue used to give it all back (the payload's chunk to the pool,
/// the rings freed), counting nothing.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_device_that_cannot_be_stopped_keeps_what_is_in_flight() {
    let (mut q, domain, pool) = queue(Silent(Detach::Fails), iommu());
    let at = two_in_flight(&mut q);
    drop(q);
    kept(&domain, pool, at);
}

/// A detach that panics, in the queue's drop or in `into_device`, leaves
/// a device that may still run: the same is kept, and the drop neither
/// recycles what is in flight nor aborts on a second panic.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_detach_that_panics_is_one_that_failed() {
    let (mut q, domain, pool) = queue(Silent(Detach::Panics), iommu());
    let at = two_in_flight(&mut q);
    drop(q);
    kept(&domain, pool, at);
    // `into_device` with nothing in flight: its detach panics, and the
    // queue's drop on the way out keeps the rings without calling it again.
    let (q, domain, _pool) = queue(Silent(Detach::Panics), iommu());
    assert!(catch_unwind(AssertUnwindSafe(|| q.into_device())).is_err());
    let p = domain.pinned();
    assert_eq!((p.host_bytes, p.iova_bytes), (rings(), rings()));
}

/// An `into_device` refused for packets in flight hands the queue back;
/// dropping that error (as `?` does) drops the queue, which keeps what a
/// device that cannot be stopped may read.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn an_into_device_error_dropped_keeps_what_is_in_flight() {
    let (mut q, domain, pool) = queue(Silent(Detach::Fails), iommu());
    let at = two_in_flight(&mut q);
    let e = q.into_device().unwrap_err();
    assert!(matches!(e.error(), Error::Busy { in_flight: 2 }), "{e:?}");
    let _: Error = e.into();
    kept(&domain, pool, at);
}

/// Under a `PerChunk` pool the payload's chunk keeps its own mapping too:
/// its IOVA never goes back to the allocator, so no later mapping lets the
/// device that could not be stopped reach other memory through it. The
/// chunk used to be unmapped as its last reference went, and the next
/// mappings in the domain took its IOVA.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_per_chunk_payload_keeps_its_iova() {
    let iommu = iommu();
    let (mut q, domain, pool) = queue_on(Silent(Detach::Fails), iommu.clone(), Policy::PerChunk);
    let mut frags = Vec::new();
    q.cache_mut().frags(3000, true, &mut frags).unwrap();
    let iova = frags[0].iova();
    let addr = iommu.translate(iova, Dir::TO_DEVICE).unwrap().addr;
    q.post(&[0u8; 14], &mut frags, Offload::None, 1).unwrap();
    q.kick().unwrap();
    drop(q);
    drop(pool);
    assert_eq!(domain.pinned().iova_bytes, rings() + 4096);
    let others: Vec<_> = (0..64)
        .map(|_| Coherent::new(domain.clone(), 4096, Dir::BIDIRECTIONAL).unwrap())
        .collect();
    assert_eq!(iommu.translate(iova, Dir::TO_DEVICE).unwrap().addr, addr);
    let page = |i: Iova| i.raw() >> 12;
    assert!(others.iter().all(|o| page(o.iova()) != page(iova)));
}

/// The control: a device that stops gets everything back, and the
/// payload's memory is handed out again.
#[test]
fn a_device_that_stops_gives_everything_back() {
    let (mut q, domain, pool) = queue(Silent(Detach::Stops), iommu());
    let at = two_in_flight(&mut q);
    drop(q);
    assert_eq!(domain.pinned(), pfrag::dma::Pinned::default());
    let st = pool.stats();
    assert_eq!((st.pinned, st.recycles), (0, 1), "the payload's chunk");
    assert!(handed_out_again(&pool, at));
}

/// What a [`StopsInDrop`] device saw mapped when it stopped: its ring and
/// the payload in flight.
type Seen = Arc<Mutex<Option<(bool, bool)>>>;

/// A device that keeps the default `detach` and stops only in its own
/// `Drop`, where it looks up its ring and the payload in flight.
struct StopsInDrop {
    iommu: Iommu,
    ring: Option<Iova>,
    payload: Arc<Mutex<Option<Iova>>>,
    seen: Seen,
}

impl TxDevice for StopsInDrop {
    type Format = Advanced;
    fn format(&self) -> Advanced {
        Advanced
    }
    unsafe fn attach(&mut self, ring: Iova, _: u16) -> vfio_nic::Result<()> {
        self.ring = Some(ring);
        Ok(())
    }
    unsafe fn kick(&mut self, _: u16) -> vfio_nic::Result<()> {
        Ok(())
    }
}

impl Drop for StopsInDrop {
    fn drop(&mut self) {
        let mapped =
            |at: Option<Iova>| at.is_some_and(|i| self.iommu.translate(i, Dir::TO_DEVICE).is_ok());
        let payload = *self.payload.lock().unwrap();
        *self.seen.lock().unwrap() = Some((mapped(self.ring), mapped(payload)));
    }
}

/// A device that stops only in its own `Drop` is dropped before its ring
/// and the frags in flight are unmapped (per chunk, here, so that the
/// payload's chunk is unmapped when it is recycled). The queue's drop used
/// to free the ring first, trusting the default `detach`.
#[test]
fn a_device_that_stops_in_its_drop_goes_before_its_memory() {
    let iommu = iommu();
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerChunk);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let (seen, payload) = (Seen::default(), Arc::new(Mutex::new(None)));
    let dev = StopsInDrop {
        iommu,
        ring: None,
        payload: payload.clone(),
        seen: seen.clone(),
    };
    let cfg = tx::Config {
        mtu: 9000,
        ..tx::Config::default()
    };
    // SAFETY: the device reads no memory.
    let mut q = unsafe { tx::Queue::new(domain, pool, dev, cfg) }.unwrap();
    let mut frags = Vec::new();
    q.cache_mut().frags(3000, true, &mut frags).unwrap();
    *payload.lock().unwrap() = Some(frags[0].iova());
    q.post(&[0u8; 14], &mut frags, Offload::None, 1).unwrap();
    q.kick().unwrap();
    drop(q);
    let seen = *seen.lock().unwrap();
    assert_eq!(
        seen,
        Some((true, true)),
        "(ring, payload) mapped as it stopped"
    );
}
