//! The same engine over both formats: the 82576's advanced descriptors
//! (the software NIC) and virtio-net's split virtqueue (the virtio model on
//! `virtio-queue`). Flows of TSO and checksum-offloaded packets, every
//! captured frame checked on the wire, every payload byte verified, and no
//! map or invalidation per packet from a persistent pool.

use std::sync::Arc;
use std::time::Duration;

use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TransportSlice};
use pfrag::dma::{DmaMapper, Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::check::wire::{same_checksum, WireCheck};
use vfio_nic::device::TxDevice;
use vfio_nic::format::virtio::features;
use vfio_nic::gen::Traffic;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use vfio_nic::offload::Offload;
use vfio_nic::{tx, Error};

type Iommu = Arc<SoftIommu>;

/// How long a wait for the device may take before it is a failure: a
/// deadlock guard (Miri, under Tree Borrows, runs a device thread some
/// thousand times slower).
const WAIT: Duration = Duration::from_secs(if cfg!(miri) { 600 } else { 60 });

/// The queue's settings of these tests: 256 descriptors.
fn txcfg() -> tx::Config {
    tx::Config {
        ring: 256,
        ..tx::Config::default()
    }
}

/// A queue over `make`'s device on a fresh software IOMMU, with a
/// persistent pool of `order`.
fn queue<D: Model>(order: u32, make: impl FnOnce(Iommu) -> D) -> tx::Queue<Iommu, D> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let cfg = pool::Config::new(Order::new(order).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    // SAFETY: every device here is a model on the very IOMMU object
    // `domain` maps through.
    unsafe { tx::Queue::new(domain, pool, make(iommu), txcfg()) }.unwrap()
}

fn capture(verify: bool) -> softnic::Config {
    softnic::Config {
        capture: true,
        verify,
        ..softnic::Config::default()
    }
}

fn igb(verify: bool) -> impl FnOnce(Iommu) -> SoftNic<Iommu> {
    move |m| SoftNic::new(m, capture(verify))
}

fn virtio(verify: bool) -> impl FnOnce(Iommu) -> VirtioNet<Iommu> {
    move |m| VirtioNet::new(m, capture(verify)).unwrap()
}

/// What a run of flows gave.
#[derive(Debug, PartialEq)]
struct Run {
    frames: u64,
    payload: u64,
    verified: u64,
    maps: u64,
    invalidations: u64,
}

/// Sends `packets` packets of `len` bytes over 4 flows (TSO above the MSS,
/// checksum offload below), every frame through the wire checker.
fn flows<D: Model>(q: &mut tx::Queue<Iommu, D>, packets: usize, len: usize) -> Run {
    let mut g = Traffic::new(4, 1448).unwrap();
    let mut wire = WireCheck::default();
    let mut done = Vec::new();
    let warm = 8;
    let (mut maps, mut inv) = (0, 0);
    let n0 = q.device().counters();
    for i in 0..warm + packets {
        if i == warm {
            q.wait_tokens(WAIT, &mut done).unwrap();
            let s = q.cache().pool().domain().mapper().stats();
            (maps, inv) = (s.map_calls, s.invalidations);
        }
        g.send_waiting(q, i % 4, len, WAIT, &mut done).unwrap();
        q.kick().unwrap();
        q.reap_tokens(&mut done).unwrap();
        for fr in q.take_frames() {
            wire.frame(&fr).unwrap();
        }
    }
    q.wait_tokens(WAIT, &mut done).unwrap();
    for fr in q.take_frames() {
        wire.frame(&fr).unwrap();
    }
    let s = q.cache().pool().domain().mapper().stats();
    let n = q.device().counters().since(&n0);
    let r = wire.report();
    assert_eq!(r.bad_frames, 0, "{:?}", r.first_errors);
    assert_eq!(done.len(), warm + packets, "every token back once");
    assert_eq!(n.bad_desc + n.faults + n.bad_payload, 0, "{n:?}");
    Run {
        frames: r.frames,
        payload: r.payload_bytes,
        verified: n.bytes_verified,
        maps: s.map_calls - maps,
        invalidations: s.invalidations - inv,
    }
}

#[test]
fn tso_flows_are_the_same_on_the_wire_over_both_formats() {
    let (packets, len) = if cfg!(miri) { (6, 6000) } else { (64, 65_160) };
    let a = flows(&mut queue(4, igb(true)), packets, len);
    let b = flows(&mut queue(4, virtio(true)), packets, len);
    let warm = 8 * len as u64;
    assert_eq!(a.payload, warm + (packets * len) as u64);
    assert_eq!(a, b);
    assert_eq!(a.verified, a.payload, "every payload byte verified");
    // A persistent pool: no map, no invalidation once warm.
    assert_eq!((b.maps, b.invalidations), (0, 0));
}

#[test]
fn small_checksummed_packets_are_the_same_on_the_wire_over_both_formats() {
    let packets = if cfg!(miri) { 8 } else { 200 };
    let ra = flows(&mut queue(0, igb(true)), packets, 64);
    let rb = flows(&mut queue(0, virtio(true)), packets, 64);
    assert_eq!(ra, rb);
    assert_eq!(ra.frames, packets as u64 + 8);
    assert_eq!((rb.maps, rb.invalidations), (0, 0));
}

#[test]
fn small_copied_packets_go_inline_in_one_virtio_descriptor() {
    let mut q = queue(0, virtio(false));
    let payload = [0xa5u8; 60]; // 12 + 42 + 60 bytes: one 128-byte slot
    let v = udp4(&payload);
    let n = if cfg!(miri) { 4 } else { 50 };
    for i in 0..n {
        q.send(&v, &payload, Offload::Checksum, i).unwrap();
    }
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    // The virtio header, headers and payload in one bounce slot: one
    // descriptor per packet, and no frag.
    let st = q.stats();
    assert_eq!((st.inline_packets, st.descs), (n, n));
    let frames = q.take_frames();
    assert_eq!(frames.len() as u64, n);
    assert!(frames.iter().all(|f| f[42..] == payload));
}

const SRC6: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const DST6: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

/// Ethernet + IPv4 + UDP headers for `payload` (42 bytes).
fn udp4(payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
        .udp(4000, 5000)
        .write(&mut v, payload)
        .unwrap();
    v.truncate(42);
    v
}

fn tcp6(payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv6(SRC6, DST6, 64)
        .tcp(40_000, 443, 1000, 65_535)
        .write(&mut v, payload)
        .unwrap();
    v.truncate(14 + 40 + 20);
    v
}

#[test]
fn virtio_gso_over_ipv6_cuts_segments_with_their_checksums() {
    let mut q = queue(2, virtio(false));
    let payload: Vec<u8> = (0..if cfg!(miri) { 3000 } else { 9000 })
        .map(|i: usize| (i * 7) as u8)
        .collect();
    let hdr = tcp6(&payload[..100]);
    q.send(&hdr, &payload, Offload::Tso { mss: 1440 }, 9)
        .unwrap();
    q.kick().unwrap();
    let mut done = Vec::new();
    q.reap_completions(&mut done).unwrap();
    assert_eq!(done.len(), 1);
    let frames = q.take_frames();
    assert_eq!(frames.len(), payload.len().div_ceil(1440));
    let mut stream = Vec::new();
    for fr in &frames {
        let p = SlicedPacket::from_ethernet(fr).unwrap();
        let (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Tcp(tcp))) = (p.net, p.transport)
        else {
            panic!("not TCP/IPv6");
        };
        let want = tcp
            .to_header()
            .calc_checksum_ipv6(&ip.header().to_header(), tcp.payload())
            .unwrap();
        assert!(same_checksum(tcp.checksum(), want));
        stream.extend_from_slice(tcp.payload());
    }
    assert_eq!(stream, payload);
}

#[test]
fn virtio_checksum_offload_fills_the_ipv4_header_checksum_in_software() {
    // virtio-net has no IPv4 header checksum offload: the engine writes
    // it, the device completes the UDP checksum.
    let mut q = queue(0, virtio(false));
    let payload = [0x5au8; 300];
    let mut v = udp4(&payload);
    v[24..26].fill(0); // no IPv4 header checksum from the caller
    q.send(&v, &payload, Offload::Checksum, 1).unwrap();
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    let fr = q.take_frames().remove(0);
    let p = SlicedPacket::from_ethernet(&fr).unwrap();
    let (Some(NetSlice::Ipv4(ip)), Some(TransportSlice::Udp(udp))) = (p.net, p.transport) else {
        panic!("not UDP/IPv4");
    };
    let ih = ip.header().to_header();
    assert_eq!(ih.header_checksum, ih.calc_header_checksum());
    let want = udp
        .to_header()
        .calc_checksum_ipv4(&ih, udp.payload())
        .unwrap();
    assert!(same_checksum(udp.checksum(), want));
}

#[test]
fn offloads_the_device_did_not_offer_are_refused_before_posting() {
    let base = features::VERSION_1 | features::ACCESS_PLATFORM;
    let make = |offered| move |m| VirtioNet::offering(m, capture(false), offered).unwrap();
    let payload = vec![1u8; 4000];
    let hdr = tcp6(&payload);
    // No TSO for IPv6 offered: TSO over IPv6 is refused, nothing posted.
    let mut q = queue(2, make(base | features::CSUM | features::HOST_TSO4));
    let e = q
        .send(&hdr, &payload, Offload::Tso { mss: 1440 }, 1)
        .unwrap_err();
    assert!(matches!(e, Error::UnsupportedOffload { .. }), "{e}");
    assert_eq!((q.in_flight(), q.stats().packets), (0, 0));
    // No checksum offered: only plain frames go.
    let mut q = queue(2, make(base));
    let hdr = tcp6(&payload[..100]);
    let e = q.send(&hdr, &payload[..100], Offload::Checksum, 1);
    assert!(matches!(e, Err(Error::UnsupportedOffload { .. })), "{e:?}");
    q.send(&hdr, &payload[..100], Offload::None, 2).unwrap();
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    assert_eq!(q.take_frames().len(), 1);
    // A device without VERSION_1 or ACCESS_PLATFORM is not driven at all.
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let e = VirtioNet::offering(iommu, capture(false), features::VERSION_1).unwrap_err();
    assert!(matches!(e, Error::MissingFeature { .. }), "{e}");
}

#[test]
fn event_idx_on_or_off_every_packet_completes() {
    let base = features::VERSION_1 | features::ACCESS_PLATFORM | features::CSUM;
    for offered in [base, base | features::EVENT_IDX | features::HOST_TSO4] {
        let mut q = queue(3, move |m| {
            VirtioNet::offering(m, capture(true), offered).unwrap()
        });
        let event = q.device().format().event_idx();
        assert_eq!(event, offered & features::EVENT_IDX != 0);
        let n = if cfg!(miri) { 40 } else { 600 };
        let r = flows(&mut q, n, 1000);
        assert_eq!(r.frames, n as u64 + 8);
    }
}

#[test]
fn a_virtqueue_size_that_is_not_a_power_of_two_is_refused() {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let nic = VirtioNet::new(iommu.clone(), capture(false)).unwrap();
    let txc = tx::Config {
        ring: 100,
        ..tx::Config::default()
    };
    // SAFETY: the model is on the very IOMMU object `domain` maps through.
    let e = unsafe { tx::Queue::new(domain.clone(), pool, nic, txc) }.unwrap_err();
    assert!(matches!(e, Error::BadConfig { .. }), "{e}");
    // Nothing of the failed queue stays mapped.
    assert_eq!(domain.iova_in_use(), 0);
}

#[test]
fn virtio_on_a_device_thread_loses_and_reorders_nothing() {
    use vfio_nic::model::thread::{self, Threaded};
    // The driver polls the used ring while the device thread reads the
    // available ring and writes the used one: Miri's race detector sees
    // both sides.
    let mut q = queue(2, |m| {
        Threaded::spawn(
            VirtioNet::new(m, capture(true)).unwrap(),
            thread::Config::default(),
        )
        .unwrap()
    });
    let (packets, sizes) = if cfg!(miri) {
        (12, [9_000, 100, 3000])
    } else {
        (400, [65_160, 100, 3000])
    };
    let mut g = Traffic::new(3, 1448).unwrap();
    let mut done = Vec::new();
    for i in 0..packets {
        g.send_waiting(&mut q, i % 3, sizes[i % 3], WAIT, &mut done)
            .unwrap();
        if i % 4 == 3 {
            q.kick().unwrap();
        }
    }
    q.kick().unwrap();
    q.wait_tokens(WAIT, &mut done).unwrap();
    assert_eq!(done, (0..packets as u64).collect::<Vec<_>>());
    let mut wire = WireCheck::default();
    for fr in q.take_frames() {
        wire.frame(&fr).unwrap_or_else(|e| panic!("{e}"));
    }
    let n = q.device().counters();
    assert_eq!((n.faults, n.bad_payload, n.bad_desc), (0, 0, 0));
    let total: usize = (0..packets).map(|i| sizes[i % 3]).sum();
    assert_eq!(n.bytes_verified, total as u64);
    for f in 0..3u32 {
        let sent: usize = (0..packets)
            .filter(|i| i % 3 == f as usize)
            .map(|i| sizes[i % 3])
            .sum();
        assert_eq!(wire.next_offset(f).unwrap_or(0), sent as u32, "flow {f}");
    }
}

#[test]
fn a_virtio_model_cannot_be_paced_to_a_line_rate() {
    use vfio_nic::model::thread::{self, Threaded};
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let nic = VirtioNet::new(iommu, capture(false)).unwrap();
    let paced = thread::Config {
        line_rate_gbit: Some(10.0),
    };
    // It takes whole available rings per doorbell; pacing needs a device
    // that stops at a slot.
    let e = Threaded::spawn(nic, paced).unwrap_err();
    assert!(matches!(e, Error::Unpaceable), "{e}");
}

/// A virtqueue written by hand, as a buggy or hostile driver would: the
/// model refuses what it cannot take with an error or a count, and
/// neither hangs nor allocates for a chain no packet can be.
#[test]
fn a_hostile_available_ring_is_an_error_not_a_hang() {
    use pfrag::dma::{Coherent, Dir};
    use vfio_nic::format::virtio::{Layout, Split};
    use vfio_nic::format::Format;
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let l = Layout::new(8);
    let ring = Coherent::new(domain.clone(), Split::ring_bytes(8), Dir::BIDIRECTIONAL).unwrap();
    let buf = Coherent::new(domain, 4096, Dir::TO_DEVICE).unwrap();
    // One descriptor claiming 1 GiB of a one-page buffer.
    ring.write_u64(0, buf.iova().raw()).unwrap();
    ring.write_u64(8, 1 << 30).unwrap();
    let mut nic = VirtioNet::new(iommu, capture(true)).unwrap();
    // SAFETY: `ring` is this test's, kept for the device until it drops.
    unsafe { nic.attach(ring.iova(), 8) }.unwrap();
    // Entry 0 names descriptor 0; the index says 1.
    ring.write(l.avail + 2, &1u16.to_le_bytes()).unwrap();
    // SAFETY: the device's only mappings are `ring` and `buf`, reached by
    // the CPU only through `Coherent`'s atomic accessors, not meanwhile.
    unsafe { nic.kick(0) }.unwrap();
    let st = nic.stats();
    assert_eq!((st.packets, st.bad_desc, st.frames), (1, 1, 0));
    assert!(nic.take_frames().is_empty());
    // An index 11 entries past the one the device took: more than the
    // ring holds.
    ring.write(l.avail + 2, &12u16.to_le_bytes()).unwrap();
    // SAFETY: as above.
    let e = unsafe { nic.kick(0) }.unwrap_err();
    assert!(
        matches!(
            e,
            Error::AvailIndex {
                avail: 12,
                next_avail: 1,
                size: 8
            }
        ),
        "{e}"
    );
}

/// A chain whose last descriptor read still names a next one (here past
/// the table) is cut short: the virtio-net model drops it as malformed and
/// never sends what it read as a shorter packet.
#[test]
fn a_chain_cut_short_is_dropped_not_sent_shorter() {
    use pfrag::dma::{Coherent, Dir};
    use vfio_nic::format::virtio::{Layout, Split};
    use vfio_nic::format::Format;
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let l = Layout::new(8);
    let ring = Coherent::new(domain.clone(), Split::ring_bytes(8), Dir::BIDIRECTIONAL).unwrap();
    let buf = Coherent::new(domain, 4096, Dir::TO_DEVICE).unwrap();
    // A whole frame after its (all-zero: no offload) virtio_net_hdr: 12
    // header bytes, then 60 bytes of Ethernet with a local EtherType.
    buf.write(12 + 12, &[0x88, 0xb5]).unwrap();
    // Descriptor 0: the 72 bytes, NEXT set, next = 9 (the table has 8).
    ring.write_u64(0, buf.iova().raw()).unwrap();
    ring.write_u64(8, 72 | (1 << 32) | (9 << 48)).unwrap();
    let mut nic = VirtioNet::new(iommu, capture(true)).unwrap();
    // SAFETY: `ring` is this test's, kept for the device until it drops.
    unsafe { nic.attach(ring.iova(), 8) }.unwrap();
    ring.write(l.avail + 2, &1u16.to_le_bytes()).unwrap();
    // SAFETY: the device's only mappings are `ring` and `buf`, reached by
    // the CPU only through `Coherent`'s atomic accessors, not meanwhile.
    unsafe { nic.kick(0) }.unwrap();
    let st = nic.stats();
    assert_eq!((st.packets, st.bad_desc, st.frames), (1, 1, 0), "{st:?}");
    assert!(nic.take_frames().is_empty());
    // The same descriptor without NEXT is a packet the model sends.
    ring.write_u64(8, 72).unwrap();
    ring.write(l.avail + 4 + 2, &0u16.to_le_bytes()).unwrap();
    ring.write(l.avail + 2, &2u16.to_le_bytes()).unwrap();
    // SAFETY: as above.
    unsafe { nic.kick(0) }.unwrap();
    assert_eq!(nic.stats().frames, 1, "{:?}", nic.stats());
}
