//! End to end on the software NIC: packets built by the TX queue from pfrag
//! memory, DMA'd through the software IOMMU, segmented, checksummed and
//! verified byte for byte.

use std::collections::HashMap;
use std::sync::Arc;

use etherparse::{NetSlice, SlicedPacket, TransportSlice};
use pfrag::dma::{
    Coherent, Dir, DmaMapper, Domain, Identity, Invalidation, SoftIommu, SoftIommuConfig,
};
use pfrag::pool::{Policy, Pool, PoolConfig};
use pfrag::{Iova, Order};
use vfio_nic::desc::{Context, Data, Dcmd, Desc, Popts, Sta};
use vfio_nic::device::TxDevice;
use vfio_nic::flow;
use vfio_nic::pattern;
use vfio_nic::softnic::{SoftNic, SoftNicConfig, Touch};
use vfio_nic::txq::{HeaderMode, TxConfig, TxQueue};
use vfio_nic::Error;

type Queue = TxQueue<Arc<SoftIommu>, SoftNic<Arc<SoftIommu>>>;

fn queue(
    order: u32,
    policy: Policy,
    inv: Invalidation,
    cfg: TxConfig,
    nic: SoftNicConfig,
) -> (Arc<SoftIommu>, Queue) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig {
        invalidation: inv,
        ..SoftIommuConfig::default()
    }));
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::new(
        domain.clone(),
        PoolConfig::new(Order::new(order).unwrap(), policy),
    )
    .unwrap();
    let q = TxQueue::new(domain, pool, SoftNic::new(iommu.clone(), nic), cfg).unwrap();
    (iommu, q)
}

fn send_all(q: &mut Queue, plan: &[(usize, usize)]) {
    for &(flow, len) in plan {
        loop {
            match q.send(flow, len) {
                Ok(()) => break,
                Err(Error::RingFull { .. }) => {
                    q.kick().unwrap();
                    q.reap().unwrap();
                }
                Err(e) => panic!("send: {e}"),
            }
        }
    }
    q.kick().unwrap();
    q.reap().unwrap();
}

/// Parses every frame and checks checksums, per-flow sequence continuity
/// and the payload pattern. Returns payload bytes per flow.
fn check_frames(frames: &[Vec<u8>]) -> HashMap<u32, u32> {
    let mut next: HashMap<u32, u32> = HashMap::new();
    for fr in frames {
        let p = SlicedPacket::from_ethernet(fr).expect("frame parses");
        let Some(NetSlice::Ipv4(ip)) = p.net else {
            panic!("not ipv4")
        };
        let iph = ip.header().to_header();
        assert_eq!(
            iph.header_checksum,
            iph.calc_header_checksum(),
            "IPv4 checksum"
        );
        let Some(TransportSlice::Tcp(tcp)) = p.transport else {
            panic!("not tcp")
        };
        let th = tcp.to_header();
        let payload = tcp.payload();
        assert_eq!(
            th.checksum,
            th.calc_checksum_ipv4(&iph, payload).unwrap(),
            "TCP checksum"
        );
        assert!(payload.len() <= 1448);
        let fl = flow::flow_of_port(th.source_port).unwrap();
        let off = th.sequence_number.wrapping_sub(flow::isn(fl));
        let expect = next.entry(fl).or_insert(0);
        assert_eq!(off, *expect, "flow {fl}: sequence is continuous");
        assert!(
            pattern::verify(fl, off, payload),
            "flow {fl}: payload at {off}"
        );
        *expect = off.wrapping_add(payload.len() as u32);
    }
    next
}

#[test]
fn tso_frames_are_correct_for_every_order_and_policy() {
    for order in 0..=4 {
        for policy in Policy::ALL {
            let header = if policy == Policy::PerFrag {
                HeaderMode::Mapped
            } else {
                TxConfig::default().header
            };
            let cfg = TxConfig {
                flows: 3,
                header,
                fit_whole: policy != Policy::PerFrag,
                ring: 64,
                ..TxConfig::default()
            };
            let nic = SoftNicConfig {
                capture: true,
                ..SoftNicConfig::default()
            };
            let (iommu, mut q) = queue(order, policy, Invalidation::Strict, cfg, nic);
            let plan: Vec<(usize, usize)> = (0..40)
                .map(|i| (i % 3, [65160, 100, 3000, 1448, 20000][i % 5]))
                .collect();
            send_all(&mut q, &plan);
            let st = q.device().stats();
            let total: usize = plan.iter().map(|p| p.1).sum();
            assert_eq!(st.bytes_verified, total as u64, "order {order} {policy:?}");
            assert_eq!((st.faults, st.bad_payload, st.bad_desc), (0, 0, 0));
            assert_eq!(iommu.stats().faults, 0);
            let frames = q.device_mut().take_frames();
            let segs: usize = plan.iter().map(|p| p.1.div_ceil(1448)).sum();
            assert_eq!(frames.len(), segs);
            let per_flow = check_frames(&frames);
            for f in 0..3u32 {
                let sent: usize = plan.iter().filter(|p| p.0 == f as usize).map(|p| p.1).sum();
                assert_eq!(per_flow[&f], sent as u32);
            }
            assert_eq!(q.in_flight(), 0);
        }
    }
}

#[test]
fn lazy_and_identity_deliver_every_byte() {
    let (_, mut q) = queue(
        3,
        Policy::PerFrag,
        Invalidation::Lazy,
        TxConfig::default(),
        SoftNicConfig::default(),
    );
    send_all(&mut q, &vec![(0, 65160); 300]);
    assert_eq!(q.device().stats().bytes_verified, 300 * 65160);

    let domain = Arc::new(Domain::new(Identity::new()));
    let pool = Pool::new(
        domain.clone(),
        PoolConfig::new(Order::new(2).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let mut q = TxQueue::new(
        domain,
        pool,
        SoftNic::new(Identity::new(), SoftNicConfig::default()),
        TxConfig::default(),
    )
    .unwrap();
    for _ in 0..100 {
        q.send(0, 65160).unwrap();
        q.kick().unwrap();
        q.reap().unwrap();
    }
    assert_eq!(q.device().stats().bytes_verified, 100 * 65160);
}

#[test]
fn persistent_bounce_order4_makes_no_mappings_and_uses_three_descriptors() {
    let (iommu, mut q) = queue(
        4,
        Policy::Persistent,
        Invalidation::Strict,
        TxConfig::default(),
        SoftNicConfig::default(),
    );
    send_all(&mut q, &vec![(0, 65160); 600]);
    let before = iommu.stats();
    let descs = q.stats().descs;
    send_all(&mut q, &vec![(0, 65160); 1000]);
    let s = iommu.stats().since(&before);
    assert_eq!((s.map_calls, s.unmap_calls, s.invalidations), (0, 0, 0));
    assert_eq!(q.stats().descs - descs, 3000);
}

#[test]
fn touch_pages_reads_a_line_per_page() {
    let nic = SoftNicConfig {
        touch: Touch::Pages,
        capture: false,
    };
    let (_, mut q) = queue(
        4,
        Policy::Persistent,
        Invalidation::Strict,
        TxConfig::default(),
        nic,
    );
    send_all(&mut q, &[(0, 65160)]);
    let st = q.device().stats();
    assert_eq!(st.bad_payload, 0);
    // 16 payload pages plus the header page; one line from each payload piece.
    assert!(
        st.bytes_verified >= 15 * 64 && st.bytes_verified <= 17 * 64,
        "{st:?}"
    );
    assert_eq!(st.pages, 17);
}

#[test]
fn ring_full_is_a_typed_error_and_nothing_leaks() {
    let cfg = TxConfig {
        ring: 8,
        ..TxConfig::default()
    };
    let (iommu, mut q) = queue(
        0,
        Policy::PerFrag,
        Invalidation::Strict,
        cfg,
        SoftNicConfig::default(),
    );
    match q.send(0, 65160) {
        Err(Error::RingFull {
            needed: 19,
            free: 7,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        iommu.stats().map_calls,
        2,
        "only the ring and the bounce ring are mapped"
    );
    q.send(0, 1000).unwrap();
    q.send(0, 1000).unwrap();
    assert!(matches!(
        q.send(0, 1000),
        Err(Error::RingFull { needed: 4, free: 1 })
    ));
    assert!(matches!(
        q.send(5, 10),
        Err(Error::BadFlow { flow: 5, flows: 1 })
    ));
    assert!(matches!(
        q.send(0, 0),
        Err(Error::Pool(pfrag::Error::ZeroLength))
    ));
    q.kick().unwrap();
    assert_eq!(q.reap().unwrap(), 2);
    assert_eq!(q.free_descs(), 7);
}

#[test]
fn too_many_buffers_is_refused_before_allocating() {
    let cfg = TxConfig {
        ring: 256,
        max_bufs: 8,
        ..TxConfig::default()
    };
    let (_, mut q) = queue(
        0,
        Policy::Persistent,
        Invalidation::Strict,
        cfg,
        SoftNicConfig::default(),
    );
    assert!(matches!(
        q.send(0, 65160),
        Err(Error::TooManyBuffers { needed: 18, max: 8 })
    ));
    assert_eq!(q.cache().stats().frags, 0);
}

/// A NIC attached to an 8-descriptor ring mapped for `dir`, for tests that
/// write descriptors by hand.
struct RawRing {
    iommu: Arc<SoftIommu>,
    ring: Coherent<Arc<SoftIommu>>,
    nic: SoftNic<Arc<SoftIommu>>,
}

impl RawRing {
    fn new(dir: Dir) -> RawRing {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()));
        let domain = Arc::new(Domain::new(iommu.clone()));
        let ring = Coherent::new(domain, 8 * 16, dir).unwrap();
        let mut nic = SoftNic::new(iommu.clone(), SoftNicConfig::default());
        nic.attach(ring.iova(), 8).unwrap();
        RawRing { iommu, ring, nic }
    }

    fn put(&self, i: usize, d: Desc) {
        let w = d.encode();
        self.ring.write_u64(i * 16, w[0]).unwrap();
        self.ring.write_u64(i * 16 + 8, w[1]).unwrap();
    }

    fn dd(&self, i: usize) -> u32 {
        self.ring.read_u32(i * 16 + 12).unwrap() & Sta::DD.bits()
    }
}

#[test]
fn descriptor_at_unmapped_iova_faults_and_is_still_completed() {
    let mut r = RawRing::new(Dir::BIDIRECTIONAL);
    r.put(0, Desc::Context(Context::tcp_ipv4(14, 20, 20, 1448)));
    let bad = Iova(0x7700_0000);
    r.put(
        1,
        Desc::Data(Data::new(
            bad.raw(),
            1000,
            Dcmd::EOP | Dcmd::RS | Dcmd::IFCS,
            1000,
            Popts::TXSM,
        )),
    );
    r.nic.kick(2).unwrap();
    let st = r.nic.stats();
    assert_eq!((st.faults, st.bytes_verified, st.frames), (1, 0, 0));
    assert_eq!(r.iommu.faults()[0].fault.iova, bad);
    assert_eq!(r.dd(1), Sta::DD.bits(), "completion written back");
    assert!(matches!(
        r.nic.kick(8),
        Err(Error::BadConfig { what: "tail", .. })
    ));
}

#[test]
fn ring_mapped_read_only_cannot_take_write_back() {
    let mut r = RawRing::new(Dir::TO_DEVICE);
    let at = r.ring.iova().raw();
    r.put(
        0,
        Desc::Data(Data::new(at, 64, Dcmd::EOP | Dcmd::RS, 64, Popts::empty())),
    );
    r.nic.kick(1).unwrap();
    assert_eq!(r.dd(0), 0, "the IOMMU refused the write-back");
    assert!(r.nic.stats().faults >= 1);
    assert_eq!(r.iommu.stats().faults, r.nic.stats().faults);
}
