//! The descriptor-ring models at the edges of their ring: a doorbell
//! whose tail lies outside the ring, served paced on the device's thread,
//! and a doorbell after the ring was detached. Neither may read a
//! descriptor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pfrag::dma::{Coherent, Dir, Domain, SoftIommu, SoftIommuConfig};
use vfio_nic::desc::{Data, Dcmd, Desc, Popts};
use vfio_nic::device::TxDevice;
use vfio_nic::format::virtio::Split;
use vfio_nic::format::Format;
use vfio_nic::model::null::NullNic;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::model::thread::{self, Threaded};
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use vfio_nic::Error;

mod common;

type Iommu = Arc<SoftIommu>;

const WAIT: Duration = Duration::from_secs(if cfg!(miri) { 600 } else { 10 });

/// An 8-descriptor ring whose descriptor 0 is a packet of one buffer of
/// 100 bytes (at an IOVA nothing maps), asking for a report.
fn ring() -> (Iommu, Coherent<Iommu>) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let ring = Coherent::new(domain, 8 * 16, Dir::BIDIRECTIONAL).unwrap();
    let cmd = Dcmd::EOP | Dcmd::RS | Dcmd::IFCS;
    let d = Data::new(0x7700_0000, 100, cmd, 100, Popts::empty());
    common::put_descs(&ring, [Desc::Data(d)]);
    (iommu, ring)
}

/// A paced device thread given a tail past the ring's end reports it at
/// the next doorbell, having read nothing; it used to walk the ring round
/// and round looking for that tail, taking descriptors never handed over.
#[test]
fn a_paced_doorbell_past_the_ring_is_refused_and_reads_nothing() {
    let (iommu, ring) = ring();
    let nic = SoftNic::new(iommu, softnic::Config::default());
    let cfg = thread::Config {
        line_rate_gbit: Some(1000.0),
    };
    let mut dev = Threaded::spawn(nic, cfg).unwrap();
    // SAFETY: the ring is this test's, kept as long as the device.
    unsafe { dev.attach(ring.iova(), 8) }.unwrap();
    let t0 = Instant::now();
    loop {
        // SAFETY: a tail past the ring names no descriptor; the ring's
        // own are reached by the CPU only through `Coherent`.
        match unsafe { dev.kick(9) } {
            Err(Error::BadConfig { what: "tail", .. }) => break,
            Ok(()) if t0.elapsed() < WAIT => std::thread::yield_now(),
            other => panic!("{other:?} after {:?}", t0.elapsed()),
        }
        assert_eq!(dev.counters().descs, 0, "{:?}", dev.counters());
    }
    assert_eq!(dev.counters().descs, 0, "{:?}", dev.counters());
    drop(dev);
    drop(ring);
}

/// After `detach`, a model reads nothing of the ring it was attached to:
/// a doorbell finds no ring.
fn detached_reads_nothing<D: Model>(mut nic: D, ring: &Coherent<Iommu>) {
    // SAFETY: the ring is this test's, kept as long as the device.
    unsafe { nic.attach(ring.iova(), 8) }.unwrap();
    nic.detach().unwrap();
    // SAFETY: nothing is attached; the old ring is reached by the CPU
    // only through `Coherent`.
    let r = unsafe { nic.kick(1) };
    assert!(matches!(r, Err(Error::NotAttached)), "{r:?}");
    let st = nic.counters();
    assert_eq!((st.descs, st.faults, st.packets), (0, 0, 0), "{st:?}");
    assert_eq!(nic.head(), None);
}

#[test]
fn the_software_nic_reads_nothing_once_detached() {
    let (iommu, ring) = ring();
    detached_reads_nothing(SoftNic::new(iommu, softnic::Config::default()), &ring);
}

#[test]
fn the_null_device_reads_nothing_once_detached() {
    let (iommu, ring) = ring();
    detached_reads_nothing(NullNic::new(iommu), &ring);
}

/// A packet of no bytes at all (one data descriptor of length 0) is
/// malformed: counted as such, completed, and no frame on the wire.
fn empty_packet_is_malformed<D: Model>(mut nic: D, ring: &Coherent<Iommu>) {
    let cmd = Dcmd::EOP | Dcmd::RS | Dcmd::IFCS;
    let d = Data::new(0x7700_0000, 0, cmd, 0, Popts::empty());
    common::put_descs(ring, [Desc::Data(d)]);
    // SAFETY: the ring is this test's, kept as long as the device.
    unsafe { nic.attach(ring.iova(), 8) }.unwrap();
    // SAFETY: descriptor 0 is handed over; it names no bytes.
    unsafe { nic.kick(1) }.unwrap();
    let st = nic.counters();
    assert_eq!(
        (st.packets, st.bad_desc, st.write_backs),
        (1, 1, 1),
        "{st:?}"
    );
    assert_eq!((st.frames, st.wire_bytes), (0, 0), "{st:?}");
}

#[test]
fn the_software_nic_sends_no_empty_frame() {
    let (iommu, ring) = ring();
    empty_packet_is_malformed(SoftNic::new(iommu, softnic::Config::default()), &ring);
}

#[test]
fn the_null_device_sends_no_empty_frame() {
    let (iommu, ring) = ring();
    empty_packet_is_malformed(NullNic::new(iommu), &ring);
}

/// A ring that would run past the top of the IOVA space is refused at
/// attach: its descriptors' addresses would wrap to IOVAs the caller
/// never vouched for.
#[test]
fn a_ring_past_the_top_of_the_iova_space_is_refused() {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let top = pfrag::Iova(u64::MAX - 63);
    let fits = pfrag::Iova(u64::MAX - 127);
    let mut nic = SoftNic::new(iommu.clone(), softnic::Config::default());
    // SAFETY: refused, nothing attached; a kick would fault (nothing is
    // mapped).
    let r = unsafe { nic.attach(top, 8) };
    assert!(matches!(r, Err(Error::BadConfig { .. })), "{r:?}");
    assert_eq!(nic.head(), None);
    // SAFETY: as above; nothing is mapped there.
    unsafe { nic.attach(fits, 8) }.unwrap();
    let mut null = NullNic::new(iommu.clone());
    // SAFETY: as above.
    let r = unsafe { null.attach(top, 8) };
    assert!(matches!(r, Err(Error::BadConfig { .. })), "{r:?}");
    let mut virtio = VirtioNet::new(iommu, softnic::Config::default()).unwrap();
    let bytes = Split::ring_bytes(8) as u64;
    // SAFETY: as above.
    let r = unsafe { virtio.attach(pfrag::Iova((u64::MAX - bytes + 17) & !15), 8) };
    assert!(matches!(r, Err(Error::BadConfig { .. })), "{r:?}");
    assert_eq!(virtio.head(), None);
}
