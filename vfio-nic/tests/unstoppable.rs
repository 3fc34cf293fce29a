//! Dropping a queue whose device cannot be stopped: everything the device
//! may still read (the ring, the bounce ring, the frags of the packets in
//! flight) is kept allocated and mapped for good, counted in the domain's
//! pinned memory, and never handed out again. A device that stops gets
//! it all back.

mod common;

use std::sync::Arc;

use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order};
use vfio_nic::device::TxDevice;
use vfio_nic::format::igb::Advanced;
use vfio_nic::format::Format;
use vfio_nic::offload::Offload;
use vfio_nic::{tx, Error};

/// A device that takes its ring and completes nothing; its detach fails
/// unless `stops`.
struct Silent {
    stops: bool,
}

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
        match self.stops {
            true => Ok(()),
            false => Err(Error::DeviceTimeout {
                what: "transmit stop",
                waited_ms: 10,
            }),
        }
    }
}

/// What is left after a queue on a [`Silent`] device was dropped with two
/// packets in flight: one whose 3,000-byte payload is a frag at
/// `payload`, one inline in a bounce slot.
struct After {
    domain: Arc<Domain<Arc<SoftIommu>>>,
    pool: Pool<Arc<SoftIommu>>,
    payload: std::ops::Range<usize>,
    ring: usize,
    bounce: usize,
}

fn drop_in_flight(stops: bool) -> After {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu));
    let pcfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let cfg = tx::Config {
        mtu: 9000,
        ..tx::Config::default()
    };
    // SAFETY: the device reads no memory at all.
    let mut q =
        unsafe { tx::Queue::new(domain.clone(), pool.clone(), Silent { stops }, cfg) }.unwrap();
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
    drop(q);
    let tx::HeaderMode::Bounce(slot) = cfg.header else {
        panic!("{:?}", cfg.header)
    };
    After {
        domain,
        pool,
        payload: at..at + 3000,
        ring: (usize::from(cfg.ring) * Advanced::DESC_SIZE).next_multiple_of(4096),
        bounce: (usize::from(cfg.ring) * slot as usize).next_multiple_of(4096),
    }
}

/// Whether any of 320 fresh chunk-sized frags from `pool` (more than the
/// 256 chunks it grew by) overlaps `r`.
fn handed_out_again(pool: &Pool<Arc<SoftIommu>>, r: &std::ops::Range<usize>) -> bool {
    let mut cache = FragCache::new(pool.clone());
    let mut out = Vec::new();
    for _ in 0..320 {
        cache.frags(4096, true, &mut out).unwrap();
    }
    out.iter().any(|f| {
        let a = f.addr().raw();
        a < r.end && r.start < a + f.len()
    })
}

/// A device that cannot be stopped may still read the ring, the bounce
/// ring and the payload in flight: the queue's drop keeps them for good,
/// counted, and the payload's memory is never handed out again. The
/// queue used to give it all back (the payload's chunk to the pool, the
/// rings freed), counting nothing.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_device_that_cannot_be_stopped_keeps_what_is_in_flight() {
    let a = drop_in_flight(false);
    let kept = a.ring + a.bounce + a.payload.len();
    assert_eq!(a.domain.pinned().host_bytes, kept as u64);
    assert_eq!(a.pool.stats().recycles, 0, "the payload's chunk");
    assert!(!handed_out_again(&a.pool, &a.payload));
}

/// The control: a device that stops gets everything back, and the
/// payload's memory is handed out again.
#[test]
fn a_device_that_stops_gives_everything_back() {
    let a = drop_in_flight(true);
    assert_eq!(a.domain.pinned().host_bytes, 0);
    assert_eq!(a.pool.stats().recycles, 1, "the payload's chunk");
    assert!(handed_out_again(&a.pool, &a.payload));
}
