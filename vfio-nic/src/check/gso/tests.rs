use std::sync::Arc;
use std::time::Duration;

use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TransportSlice};
use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;

use super::*;
use crate::check::wire::{same_checksum, WireCheck};
use crate::gen::{flow, Traffic};
use crate::model::softnic::{self, SoftNic};
use crate::tx;

const MAC: usize = flow::MACLEN;
const L4: usize = flow::MACLEN + flow::IPLEN;

/// What the software NIC puts on the wire for flow 0's packets of
/// `sizes` bytes (TSO at MSS 1448 above it), one `Vec` of frames each.
fn model_frames(sizes: &[usize]) -> Vec<Vec<Vec<u8>>> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let cfg = pool::Config::new(Order::new(2).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let nic_cfg = softnic::Config {
        capture: true,
        ..softnic::Config::default()
    };
    let nic = SoftNic::new(iommu, nic_cfg);
    // SAFETY: the model translates through the very IOMMU object `domain`
    // maps through.
    let mut q = unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }.unwrap();
    let mut g = Traffic::new(1, 1448).unwrap();
    let mut done = Vec::new();
    let wait = Duration::from_secs(60);
    sizes
        .iter()
        .map(|&len| {
            g.send_waiting(&mut q, 0, len, wait, &mut done).unwrap();
            q.kick().unwrap();
            q.wait(wait).unwrap();
            q.take_frames()
        })
        .collect()
}

/// The one frame a driver posts for `segs`, the segments of one TCP/IPv4
/// packet of the flows: their payloads behind the first one's headers,
/// with the last one's flags, the IP length covering all of it, and the
/// pseudo-header sum over the whole L4 length in the checksum field.
fn join(segs: &[Vec<u8>]) -> Vec<u8> {
    let mut fr = segs[0][..flow::HDR_LEN].to_vec();
    for s in segs {
        fr.extend_from_slice(&s[flow::HDR_LEN..]);
    }
    fr[L4 + 13] = segs[segs.len() - 1][L4 + 13];
    let total = (fr.len() - MAC) as u16;
    fr[MAC + 2..MAC + 4].copy_from_slice(&total.to_be_bytes());
    csum::fill_ipv4_header(&mut fr[MAC..L4]);
    let sum = csum::pseudo_header_sum(&fr[MAC..L4], fr.len() - L4).unwrap();
    fr[L4 + 16..L4 + 18].copy_from_slice(&sum.to_be_bytes());
    fr
}

/// Whether two frames are the same but for the representation of a zero
/// TCP checksum.
fn same_frame(a: &[u8], b: &[u8]) -> bool {
    let c = L4 + 16;
    let sum = |f: &[u8]| u16::from_be_bytes([f[c], f[c + 1]]);
    a.len() == b.len()
        && a[..c] == b[..c]
        && a[c + 2..] == b[c + 2..]
        && same_checksum(sum(a), sum(b))
}

#[test]
fn super_frames_of_the_models_segments_give_them_back() {
    let sizes = [20_000, 100, 1448, 1449, 65_160];
    let mut wire = WireCheck::default();
    for (segs, len) in model_frames(&sizes).iter().zip(sizes) {
        assert_eq!(segs.len(), len.div_ceil(1448));
        let out = segment(&join(segs), 1448).unwrap();
        assert_eq!(out.len(), segs.len(), "{len} bytes");
        for (o, s) in out.iter().zip(segs) {
            assert!(same_frame(o, s), "{len} bytes");
            wire.frame(o).unwrap();
        }
    }
    let r = wire.report();
    assert_eq!(r.payload_bytes, sizes.iter().sum::<usize>() as u64);
}

#[test]
fn ipv6_super_frames_are_cut_with_their_lengths_flags_and_checksums() {
    let payload: Vec<u8> = (0..5000usize).map(|i| (i * 31) as u8).collect();
    let mut fr = Vec::new();
    let mut tcp = etherparse::TcpHeader::new(40_000, 443, 7, 65_535);
    (tcp.fin, tcp.psh, tcp.cwr, tcp.ack) = (true, true, true, true);
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv6([1; 16], [2; 16], 64)
        .tcp_header(tcp)
        .write(&mut fr, &payload)
        .unwrap();
    let l4 = MAC + 40;
    let sum = csum::pseudo_header_sum(&fr[MAC..l4], fr.len() - l4).unwrap();
    fr[l4 + 16..l4 + 18].copy_from_slice(&sum.to_be_bytes());
    let out = segment(&fr, 1440).unwrap();
    assert_eq!(out.len(), 4);
    let mut stream = Vec::new();
    for (k, f) in out.iter().enumerate() {
        let p = SlicedPacket::from_ethernet(f).unwrap();
        let (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Tcp(t))) = (p.net, p.transport) else {
            panic!("not TCP/IPv6");
        };
        let ih = ip.header().to_header();
        let want = t.to_header().calc_checksum_ipv6(&ih, t.payload()).unwrap();
        assert!(same_checksum(t.checksum(), want), "segment {k}");
        assert_eq!(usize::from(ih.payload_length), 20 + t.payload().len());
        assert_eq!(t.sequence_number(), 7 + 1440 * k as u32);
        let last = k == 3;
        assert_eq!((t.fin(), t.psh(), t.cwr()), (last, last, k == 0));
        stream.extend_from_slice(t.payload());
    }
    assert_eq!(stream, payload);
}

#[test]
fn a_udp_frame_is_completed_whole() {
    let mut fr = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
        .udp(53, 53)
        .write(&mut fr, &[9u8; 3000])
        .unwrap();
    let want = fr[L4 + 6..L4 + 8].to_vec();
    let sum = csum::pseudo_header_sum(&fr[MAC..L4], fr.len() - L4).unwrap();
    fr[L4 + 6..L4 + 8].copy_from_slice(&sum.to_be_bytes());
    let out = segment(&fr, 1448).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0][L4 + 6..L4 + 8], want[..]);
}

#[test]
fn what_a_device_relies_on_is_checked_not_repaired() {
    let segs = &model_frames(&[5000])[0];
    let fr = join(segs);
    // The field without the pseudo-header sum.
    let mut bad = fr.clone();
    bad[L4 + 16..L4 + 18].fill(0);
    assert!(matches!(
        segment(&bad, 1448),
        Err(GsoError::PseudoSum { got: 0, .. })
    ));
    // A wrong IPv4 header checksum.
    let mut bad = fr.clone();
    bad[MAC + 10] ^= 1;
    assert!(matches!(
        segment(&bad, 1448),
        Err(GsoError::IpChecksum { .. })
    ));
    // Truncated: the IP length says more than the frame holds.
    let cut = &fr[..fr.len() - 100];
    assert_eq!(
        segment(cut, 1448),
        Err(GsoError::Length {
            ip: fr.len() - MAC,
            frame: fr.len() - MAC - 100,
        })
    );
    // Cut inside the headers: the IP header, or the TCP header.
    assert!(matches!(segment(&fr[..30], 1448), Err(GsoError::Parse(_))));
    assert!(matches!(
        segment(&fr[..40], 1448),
        Err(GsoError::Length { .. })
    ));
    let mut short = fr[..40].to_vec();
    short[MAC + 2..MAC + 4].copy_from_slice(&26u16.to_be_bytes());
    csum::fill_ipv4_header(&mut short[MAC..L4]);
    assert!(matches!(segment(&short, 1448), Err(GsoError::Parse(_))));
    assert_eq!(segment(&fr, 0), Err(GsoError::ZeroMss));
}
