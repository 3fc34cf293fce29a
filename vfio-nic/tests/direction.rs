//! Every mapping asks for the narrowest direction the device needs: TX
//! payloads and header slots `TO_DEVICE` (read-only to the device over
//! VFIO), RX buffers `FROM_DEVICE`, and only descriptor rings, which the
//! device writes back to, `BIDIRECTIONAL`. A recording mapper sees every
//! map call the pool, the bounce ring, the TX queue and the RX ring make.

use std::sync::{Arc, Mutex};

use pfrag::bounce::SlotSize;
use pfrag::dma::{
    Dir, DmaMapper, Domain, IovaSpace, MapStats, Mapping, PageSizes, SoftIommu, SoftIommuConfig,
    Unmapped,
};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order};
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::tx::{self, HeaderMode};

mod common;

/// Forwards to a software IOMMU and records each map call's length and
/// direction.
struct Recording {
    inner: Arc<SoftIommu>,
    maps: Mutex<Vec<(u64, Dir)>>,
}

impl DmaMapper for Recording {
    unsafe fn map(&self, m: &Mapping) -> pfrag::Result<()> {
        self.maps.lock().unwrap().push((m.len, m.dir));
        // SAFETY: forwarded with the caller's promise.
        unsafe { self.inner.map(m) }
    }
    fn unmap(&self, iova: Iova, len: u64) -> pfrag::Result<Unmapped> {
        self.inner.unmap(iova, len)
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
    fn flush(&self) -> pfrag::Result<()> {
        self.inner.flush()
    }
    fn stats(&self) -> MapStats {
        self.inner.stats()
    }
}

fn recording() -> (Arc<SoftIommu>, Arc<Domain<Arc<Recording>>>, Arc<Recording>) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let rec = Arc::new(Recording {
        inner: iommu.clone(),
        maps: Mutex::new(Vec::new()),
    });
    (iommu, Arc::new(Domain::new(rec.clone())), rec)
}

/// Sends TSO and small packets with `policy` and `header`; returns every
/// map call made, and the TX ring's bytes.
fn tx_maps(policy: Policy, header: HeaderMode) -> (Vec<(u64, Dir)>, u64) {
    let (iommu, domain, rec) = recording();
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(2).unwrap(), policy),
    )
    .unwrap();
    let cfg = tx::Config {
        header,
        ..tx::Config::default()
    };
    let ring = u64::from(cfg.ring) * vfio_nic::desc::SIZE as u64;
    let nic = SoftNic::new(iommu, softnic::Config::default());
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let q = unsafe { tx::Queue::new(domain, pool, nic, cfg) }.unwrap();
    let mut g = common::Gen::new(q, 2);
    // Under Miri: fewer and smaller TSO packets, still spanning frags.
    let (packets, big) = if cfg!(miri) {
        (12, 5_000)
    } else {
        (40, 20_000)
    };
    let plan: Vec<(usize, usize)> = (0..packets)
        .map(|i| (i % 2, if i % 3 == 0 { big } else { 300 }))
        .collect();
    g.send_all(&plan);
    let maps = rec.maps.lock().unwrap().clone();
    (maps, ring)
}

#[test]
fn tx_maps_only_its_descriptor_ring_writable() {
    for policy in [Policy::Persistent, Policy::PerFrag, Policy::PerChunk] {
        for header in [HeaderMode::Bounce(SlotSize::B128), HeaderMode::Mapped] {
            let (maps, ring) = tx_maps(policy, header);
            assert!(maps.len() >= 2, "{policy:?} {header:?}: {maps:?}");
            let both: Vec<_> = maps
                .iter()
                .filter(|(_, d)| *d == Dir::BIDIRECTIONAL)
                .collect();
            assert_eq!(
                both,
                vec![&(ring.next_multiple_of(4096), Dir::BIDIRECTIONAL)],
                "{policy:?} {header:?}: only the descriptor ring is writable by the device"
            );
            assert!(
                maps.iter()
                    .all(|(_, d)| *d == Dir::TO_DEVICE || *d == Dir::BIDIRECTIONAL),
                "{policy:?} {header:?}: {maps:?}"
            );
        }
    }
}

#[test]
fn pool_and_bounce_ring_map_to_device_by_default() {
    let (_, domain, rec) = recording();
    let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    assert_eq!(cfg.dir, Dir::TO_DEVICE);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let mut cache = pfrag::frag::FragCache::new(pool);
    let f = cache.refill(100, false).unwrap();
    let ring = pfrag::bounce::Ring::new(domain, 64, SlotSize::B128).unwrap();
    let maps = rec.maps.lock().unwrap().clone();
    assert_eq!(maps.len(), 2, "{maps:?}");
    assert!(maps.iter().all(|(_, d)| *d == Dir::TO_DEVICE), "{maps:?}");
    drop((f, ring));
}

#[cfg(feature = "vfio")]
#[test]
fn rx_ring_maps_its_buffers_device_write_only() {
    use vfio_nic::hw::igb::RxRing;
    let (_, domain, rec) = recording();
    let rx = RxRing::new(domain, 8).unwrap();
    let maps = rec.maps.lock().unwrap().clone();
    assert_eq!(
        maps,
        vec![(4096, Dir::BIDIRECTIONAL), (8 * 2048, Dir::FROM_DEVICE)],
        "descriptors written back, buffers only written"
    );
    drop(rx);
}

#[cfg(feature = "vfio")]
#[test]
fn vfio_access_follows_the_direction() {
    use vfio_nic::hw::ioctl::Access;
    use vfio_nic::hw::vfio::MapAccess;
    let n = MapAccess::Narrow;
    assert_eq!(n.access(Dir::TO_DEVICE), Access::Read);
    assert_eq!(n.access(Dir::FROM_DEVICE), Access::Write);
    assert_eq!(n.access(Dir::BIDIRECTIONAL), Access::ReadWrite);
    assert_eq!(MapAccess::default(), n);
    for d in [Dir::TO_DEVICE, Dir::FROM_DEVICE, Dir::BIDIRECTIONAL] {
        assert_eq!(MapAccess::ReadWrite.access(d), Access::ReadWrite);
    }
}

/// A TX queue's device reads its payloads: a pool mapped without
/// `TO_DEVICE` (device-write-only, as RX buffers are) would have every
/// payload read fault at the device, each packet completing with its frame
/// lost. The queue refuses such a pool when it is built, with the
/// direction's bits, and such frags when they are posted, leaving them the
/// caller's.
#[test]
fn memory_the_device_cannot_read_is_refused() {
    let (iommu, domain, _) = recording();
    let write_only = |order| {
        let mut pcfg = pool::Config::new(Order::new(order).unwrap(), Policy::Persistent);
        pcfg.dir = Dir::FROM_DEVICE;
        Pool::new(domain.clone(), pcfg).unwrap()
    };
    let nic = || SoftNic::new(iommu.clone(), softnic::Config::default());
    let unreadable = |r: vfio_nic::Result<()>, what: &str| match r {
        Err(vfio_nic::Error::Unreadable { what: w, dir }) => {
            assert_eq!((w, dir), (what, Dir::FROM_DEVICE.bits()));
        }
        other => panic!("{what}: {other:?}"),
    };
    // SAFETY: the device is a model on the very IOMMU object `domain`
    // maps through.
    let r = unsafe { tx::Queue::new(domain.clone(), write_only(2), nic(), tx::Config::default()) };
    unreadable(r.map(drop), "the pool");
    // Frags of such a pool, posted to a queue over a readable one.
    let readable = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(2).unwrap(), Policy::Persistent),
    )
    .unwrap();
    // SAFETY: as above.
    let mut q =
        unsafe { tx::Queue::new(domain.clone(), readable, nic(), tx::Config::default()) }.unwrap();
    let mut cache = pfrag::frag::FragCache::new(write_only(0));
    let mut frags = vec![cache.refill(1000, true).unwrap()];
    let hdr = [0u8; 14];
    let r = q.post(&hdr, &mut frags, vfio_nic::offload::Offload::None, 1);
    unreadable(r, "a frag");
    assert_eq!((frags.len(), q.in_flight(), q.stats().packets), (1, 0, 0));
    // And a frag cache swapped for one over such a pool.
    std::mem::swap(q.cache_mut(), &mut cache);
    let r = q.send(&hdr, &[7u8; 1000], vfio_nic::offload::Offload::None, 2);
    unreadable(r, "the queue's frag cache");
    assert_eq!((q.in_flight(), q.stats().packets), (0, 0));
    drop(frags);
}
