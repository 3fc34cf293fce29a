//! A send the queue refuses only once its payload is carved, on an 82576
//! queue whose unmaps a test can make fail.

use std::sync::Arc;

use pfrag::dma::{Domain, Faulty, FaultyConfig, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::offload::Offload;
use vfio_nic::{tx, Error};

/// A software IOMMU that fails what its [`FaultyConfig`] says.
pub type FaultyMapper = Arc<Faulty<SoftIommu>>;
/// An 82576 queue on the software NIC over a [`FaultyMapper`].
pub type FaultyQueue = tx::Queue<FaultyMapper, SoftNic<FaultyMapper>>;

/// A queue with a ring of 8 (7 descriptors a packet) over order-0 chunks
/// carved per frag, neither fitting payloads whole nor splitting them,
/// MTU 65,535, on a model that does not verify payloads; and its mapper,
/// which fails as `faults` says.
pub fn ring_of_8(faults: FaultyConfig) -> (FaultyQueue, FaultyMapper) {
    let m =
        Arc::new(Faulty::new(SoftIommu::new(SoftIommuConfig::default()).unwrap(), faults).unwrap());
    let domain = Arc::new(Domain::new(m.clone()));
    let pcfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerFrag);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let cfg = tx::Config {
        ring: 8,
        fit_whole: false,
        split: None,
        mtu: u16::MAX,
        ..tx::Config::default()
    };
    let nic = softnic::Config {
        verify: false,
        ..softnic::Config::default()
    };
    // SAFETY: the model translates through the mapper the domain maps
    // through.
    let q = unsafe { tx::Queue::new(domain, pool, SoftNic::new(m.clone(), nic), cfg) }.unwrap();
    (q, m)
}

/// On a [`ring_of_8`] queue: one 1,000-byte frame sent and completed (the
/// chunk being carved keeps its 3 KiB tail); then `between`; then 24 KiB,
/// which needs 7 descriptors at least (as many as the ring holds, so
/// allowed before carving) but takes the tail and 6 more frags, 8
/// descriptors, refused once carved with `PacketTooLarge { needed: 8,
/// capacity: 7 }`; its 7 frags go back to the pool.
pub fn refused_once_carved(q: &mut FaultyQueue, between: impl FnOnce()) {
    let hdr = [0u8; 14];
    q.send(&hdr, &[1u8; 1000], Offload::None, 1).unwrap();
    q.kick().unwrap();
    q.wait(super::WAIT).unwrap();
    between();
    let r = q.send(&hdr, &[1u8; 24576], Offload::None, 2);
    assert!(
        matches!(
            r,
            Err(Error::PacketTooLarge {
                needed: 8,
                capacity: 7
            })
        ),
        "{r:?}"
    );
    assert_eq!(q.in_flight(), 0, "nothing posted");
}
