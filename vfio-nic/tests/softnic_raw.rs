//! The software NIC on descriptors written by hand, with no TX queue in
//! front of it: what it does with a descriptor whose buffer is not mapped,
//! with a ring it may read but not write back to, and with a packet whose
//! headers do not match its buffers.

use std::sync::Arc;

use pfrag::dma::{Coherent, Dir, DmaMapper, Domain, SoftIommu, SoftIommuConfig};
use pfrag::Iova;
use vfio_nic::desc::{Context, Data, Dcmd, Desc, Popts, Sta};
use vfio_nic::device::TxDevice;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::Error;

mod common;

/// A NIC attached to an 8-descriptor ring mapped for `dir`, for tests that
/// write descriptors by hand.
struct RawRing {
    iommu: Arc<SoftIommu>,
    ring: Coherent<Arc<SoftIommu>>,
    nic: SoftNic<Arc<SoftIommu>>,
}

impl RawRing {
    fn new(dir: Dir) -> RawRing {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let domain = Arc::new(Domain::new(iommu.clone()));
        let ring = Coherent::new(domain, 8 * 16, dir).unwrap();
        let mut nic = SoftNic::new(iommu.clone(), softnic::Config::default());
        // SAFETY: the ring is this test's, kept as long as the NIC.
        unsafe { nic.attach(ring.iova(), 8) }.unwrap();
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

    fn kick(&mut self, tail: u16) -> vfio_nic::Result<()> {
        // SAFETY: the IOMMU is this ring's own: its only mapping is the
        // ring, coherent memory that the CPU touches only through atomic
        // accessors. A descriptor naming anything else faults.
        unsafe { self.nic.kick(tail) }
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
    r.kick(2).unwrap();
    let st = r.nic.stats();
    assert_eq!((st.faults, st.bytes_verified, st.frames), (1, 0, 0));
    assert_eq!((st.packets, st.faulted_packets), (1, 1));
    assert_eq!(r.iommu.faults()[0].fault.iova, bad);
    assert_eq!(r.dd(1), Sta::DD.bits(), "completion written back");
    assert!(matches!(
        r.kick(8),
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
    r.kick(1).unwrap();
    assert_eq!(r.dd(0), 0, "the IOMMU refused the write-back");
    assert!(r.nic.stats().faults >= 1);
    assert_eq!(r.iommu.stats().faults, r.nic.stats().faults);
}

/// A packet cut short (no `EOP`) when the ring is attached again is
/// forgotten: its buffers belonged to the old ring, which the driver may
/// reuse, so the next packet is made of its own buffers only.
#[test]
fn attach_forgets_a_packet_cut_short() {
    let mut r = RawRing::new(Dir::BIDIRECTIONAL);
    let at = r.ring.iova().raw();
    let data = |len: u16, cmd: Dcmd| {
        Desc::Data(Data::new(at + 64, len, cmd, u32::from(len), Popts::empty()))
    };
    r.put(0, data(16, Dcmd::empty()));
    r.kick(1).unwrap();
    // SAFETY: the same ring again.
    unsafe { r.nic.attach(r.ring.iova(), 8) }.unwrap();
    r.put(0, data(32, Dcmd::EOP | Dcmd::RS));
    r.kick(1).unwrap();
    let st = r.nic.stats();
    assert_eq!((st.packets, st.bad_desc, st.frames), (1, 0, 1), "{st:?}");
    assert_eq!(r.dd(0), Sta::DD.bits());
}

/// A checksum-offloaded packet (no TSO) goes out with the IP length its
/// driver wrote, as an 82576 sends it: the device fills in checksums, not
/// lengths. So a frame whose IPv4 header claims 700 bytes of payload while
/// its descriptor carries 500 is short on the wire, and the wire checker
/// says so; the model does not repair it into a good one.
#[test]
fn a_checksum_offload_keeps_the_drivers_ip_length() {
    use vfio_nic::check::wire::WireCheck;
    use vfio_nic::gen::{flow, pattern};
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let ring = Coherent::new(domain.clone(), 8 * 16, Dir::BIDIRECTIONAL).unwrap();
    let buf = Coherent::new(domain, 4096, Dir::TO_DEVICE).unwrap();
    let (claimed, carried) = (700, 500);
    let mut h = [0u8; flow::HDR_LEN];
    flow::Flow::new(0).unwrap().header(claimed, &mut h);
    let mut fr = h.to_vec();
    fr.resize(flow::HDR_LEN + carried, 0);
    pattern::fill(0, 0, &mut fr[flow::HDR_LEN..]);
    buf.write(0, &fr).unwrap();
    common::put_descs(
        &ring,
        [
            Desc::Context(Context::tcp_ipv4(14, 20, 20, 0)),
            Desc::Data(Data::new(
                buf.iova().raw(),
                fr.len() as u16,
                Dcmd::EOP | Dcmd::RS | Dcmd::IFCS,
                fr.len() as u32,
                Popts::IXSM | Popts::TXSM,
            )),
        ],
    );
    let cfg = softnic::Config {
        capture: true,
        ..softnic::Config::default()
    };
    let mut nic = SoftNic::new(iommu, cfg);
    // SAFETY: the ring and the buffer are this test's; the CPU touches
    // them only through `Coherent`'s accessors, and not during the kick.
    unsafe { nic.attach(ring.iova(), 8) }.unwrap();
    // SAFETY: as above.
    unsafe { nic.kick(2) }.unwrap();
    let out = nic.take_frames();
    assert_eq!(out.len(), 1);
    let at = flow::MACLEN + 2;
    let total = u16::from_be_bytes([out[0][at], out[0][at + 1]]);
    assert_eq!(usize::from(total), flow::IPLEN + flow::L4LEN + claimed);
    let mut w = WireCheck::default();
    let _ = w.frame(&out[0]);
    let r = w.report();
    assert_eq!((r.good_frames, r.bad_frames), (0, 1), "{r:?}");
}
