//! IPv6 through the queue and the software NIC: TCP segmentation and UDP
//! checksum offload, every frame parsed and its checksum checked.

use std::sync::Arc;

use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TransportSlice};
use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::check::wire::same_checksum;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::offload::{HeaderFault, Offload};
use vfio_nic::{tx, Error};

type Queue = tx::Queue<Arc<SoftIommu>, SoftNic<Arc<SoftIommu>>>;

fn queue() -> Queue {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let cfg = pool::Config::new(Order::new(2).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let ncfg = softnic::Config {
        capture: true,
        verify: false,
        ..softnic::Config::default()
    };
    let nic = SoftNic::new(iommu, ncfg);
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }.unwrap()
}

const SRC: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const DST: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

/// Ethernet + IPv6 + the L4 header `l4` writes, for `payload`; `hlen`
/// bytes kept.
fn headers(payload: &[u8], tcp: bool) -> Vec<u8> {
    let b = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]).ipv6(SRC, DST, 64);
    let mut v = Vec::new();
    if tcp {
        b.tcp(40_000, 443, 1000, 65_535)
            .write(&mut v, payload)
            .unwrap();
        v.truncate(14 + 40 + 20);
    } else {
        b.udp(5353, 5353).write(&mut v, payload).unwrap();
        v.truncate(14 + 40 + 8);
    }
    v
}

fn bytes(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + (i >> 8)) as u8).collect()
}

fn send_and_capture(q: &mut Queue, hdr: &[u8], payload: &[u8], o: Offload) -> Vec<Vec<u8>> {
    q.send(hdr, payload, o, 1).unwrap();
    q.kick().unwrap();
    let mut done = Vec::new();
    q.reap_tokens(&mut done).unwrap();
    assert_eq!(done, [1]);
    q.take_frames()
}

#[test]
fn tso_over_ipv6_cuts_segments_with_their_lengths_and_checksums() {
    let mut q = queue();
    let payload = bytes(if cfg!(miri) { 2900 } else { 9000 });
    let hdr = headers(&payload[..1000], true);
    let frames = send_and_capture(&mut q, &hdr, &payload, Offload::Tso { mss: 1440 });
    assert_eq!(frames.len(), payload.len().div_ceil(1440));
    let mut stream = Vec::new();
    for (k, fr) in frames.iter().enumerate() {
        let p = SlicedPacket::from_ethernet(fr).unwrap();
        let (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Tcp(tcp))) = (p.net, p.transport)
        else {
            panic!("frame {k}: not TCP/IPv6");
        };
        let ih = ip.header().to_header();
        assert_eq!(usize::from(ih.payload_length), 20 + tcp.payload().len());
        let th = tcp.to_header();
        assert_eq!(th.sequence_number, 1000 + (k * 1440) as u32);
        let want = th.calc_checksum_ipv6(&ih, tcp.payload()).unwrap();
        assert!(same_checksum(th.checksum, want), "frame {k}");
        stream.extend_from_slice(tcp.payload());
    }
    assert_eq!(stream, payload);
    assert_eq!(q.device().stats().faults + q.device().stats().bad_desc, 0);
}

#[test]
fn udp_checksum_offload_over_ipv6() {
    let mut q = queue();
    let payload = bytes(1200);
    let hdr = headers(&payload, false);
    let frames = send_and_capture(&mut q, &hdr, &payload, Offload::Checksum);
    let p = SlicedPacket::from_ethernet(&frames[0]).unwrap();
    let (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Udp(udp))) = (p.net, p.transport) else {
        panic!("not UDP/IPv6");
    };
    let ih = ip.header().to_header();
    let want = udp
        .to_header()
        .calc_checksum_ipv6(&ih, udp.payload())
        .unwrap();
    assert_eq!(udp.checksum(), want);
    assert_eq!(udp.payload(), &payload[..]);
}

#[test]
fn ipv6_headers_the_offload_cannot_use_are_refused() {
    let mut q = queue();
    let payload = bytes(500);
    // The IPv6 payload length says 300 bytes; the packet carries 508.
    let short = headers(&payload[..300], false);
    let why = |r: vfio_nic::Result<()>| match r {
        Err(Error::BadHeaders { why, .. }) => why,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        why(q.send(&short, &payload, Offload::Checksum, 1)),
        HeaderFault::IpLength {
            header: 40 + 308,
            packet: 40 + 508,
        }
    );
    let mut arp = headers(&payload, false);
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    assert_eq!(
        why(q.send(&arp, &payload, Offload::Checksum, 2)),
        HeaderFault::NotIp(0x0806)
    );
    let udp = headers(&payload, false);
    assert_eq!(
        why(q.send(&udp, &payload, Offload::Tso { mss: 1000 }, 3)),
        HeaderFault::TsoNeedsTcp
    );
    assert_eq!(q.in_flight(), 0);
}
