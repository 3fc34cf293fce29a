//! The L4 checksum field of a virtio-net packet: a device completing
//! `NEEDS_CSUM` sums the packet from `csum_start` on, the field included,
//! so the driver leaves the pseudo-header sum there (virtio 1.x, 5.1.6.2);
//! a segmenting device moves that sum to each segment's length. The model
//! behaves so, a packet whose field lacks the sum comes out with bad
//! checksums, and the engine's packets carry it.

use std::mem::offset_of;
use std::sync::Arc;
use std::time::Duration;

use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TransportSlice};
use pfrag::dma::{Coherent, Dir, Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::check::wire::{same_checksum, WireCheck};
use vfio_nic::csum;
use vfio_nic::device::TxDevice;
use vfio_nic::format::virtio::{features, Layout, Split, HDR_LEN};
use vfio_nic::format::Format;
use vfio_nic::gen::{flow, pattern};
use vfio_nic::model::softnic;
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use vfio_nic::offload::Offload;
use vfio_nic::tx;
use virtio_bindings::virtio_net::{
    virtio_net_hdr_v1, VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_TCPV4,
};

type Iommu = Arc<SoftIommu>;

const WAIT: Duration = Duration::from_secs(if cfg!(miri) { 600 } else { 60 });

fn capture() -> softnic::Config {
    softnic::Config {
        capture: true,
        verify: false,
        ..softnic::Config::default()
    }
}

/// What a `virtio_net_hdr` asks: the checksum's start and offset, and for
/// GSO over TCP/IPv4 the segment size.
struct Ask {
    start: u16,
    offset: u16,
    mss: Option<u16>,
}

/// Posts `frame` behind a `virtio_net_hdr` with `ask` on a virtqueue
/// written by hand (as a driver other than the engine would) and returns
/// what the model put on the wire.
fn through_model(frame: &[u8], ask: &Ask) -> Vec<Vec<u8>> {
    let mut nic = model_after(frame, ask);
    assert_eq!(nic.stats().bad_desc + nic.stats().faults, 0);
    nic.take_frames()
}

/// The model after it took `frame` behind a `virtio_net_hdr` with `ask`
/// ([`through_model`]).
fn model_after(frame: &[u8], ask: &Ask) -> VirtioNet<Iommu> {
    model_offering(frame, ask, features::USED)
}

/// [`model_after`], on a model offering `offered` feature bits.
fn model_offering(frame: &[u8], ask: &Ask, offered: u64) -> VirtioNet<Iommu> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let l = Layout::new(8);
    let ring = Coherent::new(domain.clone(), Split::ring_bytes(8), Dir::BIDIRECTIONAL).unwrap();
    let len = HDR_LEN + frame.len();
    let buf = Coherent::new(domain, len.next_multiple_of(4096), Dir::TO_DEVICE).unwrap();
    let mut hdr = [0u8; HDR_LEN];
    hdr[offset_of!(virtio_net_hdr_v1, flags)] = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
    let csum = offset_of!(virtio_net_hdr_v1, __bindgen_anon_1);
    hdr[csum..csum + 2].copy_from_slice(&ask.start.to_le_bytes());
    hdr[csum + 2..csum + 4].copy_from_slice(&ask.offset.to_le_bytes());
    if let Some(mss) = ask.mss {
        let hlen = usize::from(ask.start) + 20;
        hdr[offset_of!(virtio_net_hdr_v1, gso_type)] = VIRTIO_NET_HDR_GSO_TCPV4 as u8;
        let at = offset_of!(virtio_net_hdr_v1, hdr_len);
        hdr[at..at + 2].copy_from_slice(&(hlen as u16).to_le_bytes());
        let at = offset_of!(virtio_net_hdr_v1, gso_size);
        hdr[at..at + 2].copy_from_slice(&mss.to_le_bytes());
    }
    buf.write(0, &hdr).unwrap();
    buf.write(HDR_LEN, frame).unwrap();
    // Descriptor 0: the whole packet, no chain.
    ring.write_u64(0, buf.iova().raw()).unwrap();
    ring.write_u64(8, len as u64).unwrap();
    ring.write(l.avail_idx(), &1u16.to_le_bytes()).unwrap();
    let mut nic = VirtioNet::offering(iommu, capture(), offered).unwrap();
    // SAFETY: `ring` is this test's, kept for the device until it drops.
    unsafe { nic.attach(ring.iova(), 8) }.unwrap();
    // SAFETY: the device's only mappings are `ring` and `buf`, reached by
    // the CPU only through `Coherent`'s accessors, not meanwhile.
    unsafe { nic.kick(0) }.unwrap();
    nic
}

/// Flow 0's first packet of `len` pattern bytes (Ethernet + IPv4 + TCP,
/// IPv4 header checksum written), its TCP checksum field holding `field`
/// of the pseudo-header sum: all of it, or none.
fn flow_frame(len: usize, with_sum: bool) -> Vec<u8> {
    let f = flow::Flow::new(0).unwrap();
    let mut h = [0u8; flow::HDR_LEN];
    f.header(len, &mut h);
    let mut v = h.to_vec();
    v.resize(flow::HDR_LEN + len, 0);
    pattern::fill(0, 0, &mut v[flow::HDR_LEN..]);
    let ip = flow::MACLEN..flow::MACLEN + flow::IPLEN;
    csum::fill_ipv4_header(&mut v[ip.clone()]);
    if with_sum {
        let sum = csum::pseudo_header_sum(&v[ip], flow::L4LEN + len).unwrap();
        v[flow::MACLEN + flow::IPLEN + 16..][..2].copy_from_slice(&sum.to_be_bytes());
    }
    v
}

fn tcp_ask(mss: Option<u16>) -> Ask {
    Ask {
        start: (flow::MACLEN + flow::IPLEN) as u16,
        offset: 16,
        mss,
    }
}

/// Each frame through one wire check: its report's (good, bad) frames.
fn wire(frames: &[Vec<u8>]) -> (u64, u64) {
    let mut w = WireCheck::default();
    for f in frames {
        let _ = w.frame(f);
    }
    let r = w.report();
    (r.good_frames, r.bad_frames)
}

#[test]
fn the_model_completes_the_checksum_field_as_the_driver_left_it() {
    let good = through_model(&flow_frame(700, true), &tcp_ask(None));
    assert_eq!(wire(&good), (1, 0));
    // A field without the pseudo-header sum: the device's sum lacks it.
    let bad = through_model(&flow_frame(700, false), &tcp_ask(None));
    assert_eq!(wire(&bad), (0, 1));
}

#[test]
fn the_model_moves_a_gso_packets_field_to_each_segments_length() {
    let len: usize = if cfg!(miri) { 3000 } else { 20_000 };
    let n = len.div_ceil(1448) as u64;
    let good = through_model(&flow_frame(len, true), &tcp_ask(Some(1448)));
    assert_eq!(wire(&good), (n, 0));
    let bad = through_model(&flow_frame(len, false), &tcp_ask(Some(1448)));
    assert_eq!(wire(&bad), (0, n));
}

/// A GSO packet is one IP packet: behind IPv4 and TCP headers of 20
/// bytes each, 65,495 bytes of payload fill the 16-bit total length, and
/// one byte more is a request the model refuses (as malformed, nothing
/// sent), as a host would; the model used to cut it into segments.
#[test]
fn the_model_refuses_a_gso_packet_past_the_ip_length() {
    let mut nic = model_after(&flow_frame(65_496, true), &tcp_ask(Some(1448)));
    let st = nic.stats();
    assert_eq!((st.bad_desc, st.faults, st.frames), (1, 0, 0), "{st:?}");
    assert!(nic.take_frames().is_empty());
    let good = through_model(&flow_frame(65_495, true), &tcp_ask(Some(1448)));
    assert_eq!(wire(&good), (65_495u64.div_ceil(1448), 0));
}

/// A device carries out only the offloads it offered: `NEEDS_CSUM` to a
/// device without `CSUM`, or GSO over TCP/IPv4 to one without
/// `HOST_TSO4`, is a request no driver may make, counted as malformed and
/// not sent. The model used to carry out both, so a driver asking for an
/// offload it had not negotiated went unseen.
#[test]
fn the_model_refuses_an_offload_it_did_not_offer() {
    let base = features::VERSION_1 | features::ACCESS_PLATFORM;
    let v6_only = base | features::CSUM | features::HOST_TSO6;
    for (offered, ask) in [(base, tcp_ask(None)), (v6_only, tcp_ask(Some(1448)))] {
        let mut nic = model_offering(&flow_frame(3000, true), &ask, offered);
        let st = nic.stats();
        assert_eq!((st.bad_desc, st.frames), (1, 0), "{offered:#x}: {st:?}");
        assert!(nic.take_frames().is_empty());
    }
    // What it offered it carries out.
    let nic = model_offering(&flow_frame(3000, true), &tcp_ask(None), v6_only);
    assert_eq!((nic.stats().bad_desc, nic.stats().frames), (0, 1));
}

/// A queue over the virtio model on a fresh software IOMMU.
fn queue() -> tx::Queue<Iommu, VirtioNet<Iommu>> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let cfg = pool::Config::new(Order::new(2).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let nic = VirtioNet::new(iommu, capture()).unwrap();
    // SAFETY: the model is on the very IOMMU object `domain` maps through.
    unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }.unwrap()
}

const SRC6: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const DST6: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

/// The headers of a packet carrying `payload`, L4 checksum zero (the
/// device's to fill), IPv4 or IPv6, TCP or UDP.
fn headers(v6: bool, tcp: bool, payload: &[u8]) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
    let ip = if v6 {
        eth.ipv6(SRC6, DST6, 64)
    } else {
        eth.ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
    };
    let mut v = Vec::new();
    if tcp {
        ip.tcp(40_000, 443, 1000, 65_535).write(&mut v, payload)
    } else {
        ip.udp(4000, 5000).write(&mut v, payload)
    }
    .unwrap();
    let (iplen, l4len) = (if v6 { 40 } else { 20 }, if tcp { 20 } else { 8 });
    v.truncate(14 + iplen + l4len);
    let at = 14 + iplen + if tcp { 16 } else { 6 };
    v[at..at + 2].fill(0);
    v
}

/// Whether `fr`'s L4 checksum is right; its L4 payload.
fn checked(fr: &[u8]) -> (bool, Vec<u8>) {
    let p = SlicedPacket::from_ethernet(fr).unwrap();
    let ok = |got: u16, want: Result<u16, _>| same_checksum(got, want.unwrap());
    match (p.net, p.transport) {
        (Some(NetSlice::Ipv4(ip)), Some(TransportSlice::Tcp(t))) => {
            let want = t
                .to_header()
                .calc_checksum_ipv4(&ip.header().to_header(), t.payload());
            (ok(t.checksum(), want), t.payload().to_vec())
        }
        (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Tcp(t))) => {
            let want = t
                .to_header()
                .calc_checksum_ipv6(&ip.header().to_header(), t.payload());
            (ok(t.checksum(), want), t.payload().to_vec())
        }
        (Some(NetSlice::Ipv4(ip)), Some(TransportSlice::Udp(u))) => {
            let want = u
                .to_header()
                .calc_checksum_ipv4(&ip.header().to_header(), u.payload());
            (ok(u.checksum(), want), u.payload().to_vec())
        }
        (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Udp(u))) => {
            let want = u
                .to_header()
                .calc_checksum_ipv6(&ip.header().to_header(), u.payload());
            (ok(u.checksum(), want), u.payload().to_vec())
        }
        _ => panic!("not TCP or UDP over IP"),
    }
}

#[test]
fn the_engines_offloaded_packets_carry_the_pseudo_header_sum() {
    let payload: Vec<u8> = (0..if cfg!(miri) { 3000 } else { 9000 })
        .map(|i: usize| (i * 13) as u8)
        .collect();
    let tso = Offload::Tso { mss: 1440 };
    // (IPv6, TCP, offload, payload bytes): small ones go inline, larger
    // ones in frags behind a header buffer.
    let cases = [
        (false, true, Offload::Checksum, 100),
        (false, true, Offload::Checksum, 1400),
        (false, true, tso, payload.len()),
        (true, true, Offload::Checksum, 61),
        (true, true, Offload::Checksum, 1400),
        (true, true, tso, payload.len()),
        (false, false, Offload::Checksum, 33),
        (false, false, Offload::Checksum, 1400),
        (true, false, Offload::Checksum, 1400),
    ];
    let mut q = queue();
    for (i, &(v6, tcp, offload, len)) in cases.iter().enumerate() {
        let p = &payload[..len];
        q.send(&headers(v6, tcp, p), p, offload, i as u64).unwrap();
        q.kick().unwrap();
        q.wait(WAIT).unwrap();
        let mut stream = Vec::new();
        for fr in q.take_frames() {
            let (ok, bytes) = checked(&fr);
            assert!(ok, "case {i}: a wrong checksum");
            stream.extend_from_slice(&bytes);
        }
        assert_eq!(stream, p, "case {i}");
    }
}
