//! Headers that parse but that an offload cannot use are refused before
//! anything is posted, on both formats: an IPv4 fragment (whose L4
//! checksum covers the whole datagram, and whose bytes after the IP header
//! are no L4 header unless it is the first) and a UDP header whose length
//! is not the datagram's.

use std::sync::Arc;

use etherparse::PacketBuilder;
use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::device::TxDevice;
use vfio_nic::format::virtio::features;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use vfio_nic::offload::{HeaderFault, Offload};
use vfio_nic::{tx, Error};

type Iommu = Arc<SoftIommu>;

fn capture() -> softnic::Config {
    softnic::Config {
        capture: true,
        verify: false,
        ..softnic::Config::default()
    }
}

fn queue<D: TxDevice>(nic: impl FnOnce(Iommu) -> D) -> tx::Queue<Iommu, D> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(Order::new(2).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let dev = nic(iommu);
    // SAFETY: the model translates through the IOMMU the domain maps through.
    unsafe { tx::Queue::new(domain, pool, dev, tx::Config::default()) }.unwrap()
}

fn softnic_queue() -> tx::Queue<Iommu, SoftNic<Iommu>> {
    queue(|iommu| SoftNic::new(iommu, capture()))
}

fn virtio_queue() -> tx::Queue<Iommu, VirtioNet<Iommu>> {
    let all = features::USED;
    queue(|iommu| VirtioNet::offering(iommu, capture(), all).unwrap())
}

/// Ethernet + IPv4 + TCP (or UDP) headers for `payload`, the IPv4 header
/// checksum filled in.
fn headers(udp: bool, payload: &[u8]) -> Vec<u8> {
    let b = PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]).ipv4(
        [10, 0, 0, 1],
        [10, 0, 0, 2],
        64,
    );
    let mut v = Vec::new();
    if udp {
        b.udp(4000, 5000).write(&mut v, payload).unwrap();
        v.truncate(42);
    } else {
        b.tcp(40_000, 80, 1, 65_535).write(&mut v, payload).unwrap();
        v.truncate(54);
    }
    v
}

/// `h` made an IPv4 fragment: `more` fragments follow, at `offset` (in
/// 8-byte units); its header checksum filled in again.
fn fragment(h: &[u8], more: bool, offset: u16) -> Vec<u8> {
    let mut h = h.to_vec();
    let flags = (u16::from(more) << 13) | offset;
    h[20..22].copy_from_slice(&flags.to_be_bytes());
    vfio_nic::csum::fill_ipv4_header(&mut h[14..34]);
    h
}

/// Sends `headers` and `payload` with `offload` and expects the header
/// fault `want`, with nothing posted, allocated or counted as sent.
fn refused<D: TxDevice + Model>(
    q: &mut tx::Queue<Iommu, D>,
    headers: &[u8],
    payload: &[u8],
    offload: Offload,
    want: impl Fn(&HeaderFault) -> bool,
) {
    let stats = q.stats();
    let cache = q.cache_stats();
    let r = q.send(headers, payload, offload, 1);
    let frames = {
        q.kick().unwrap();
        q.wait(std::time::Duration::from_secs(10)).unwrap();
        q.take_frames()
    };
    match &r {
        Err(Error::BadHeaders { why, .. }) if want(why) => {}
        other => panic!(
            "{offload:?}: {other:?}; on the wire after the IP header: {:?}",
            frames.first().map(|f| &f[34..f.len().min(60)])
        ),
    }
    assert_eq!(q.stats(), stats, "a refused send counted something");
    assert_eq!(q.cache_stats(), cache, "a refused send carved frags");
    assert_eq!(q.in_flight(), 0);
}

fn is_fragment(why: &HeaderFault) -> bool {
    matches!(why, HeaderFault::IpFragment { .. })
}

fn fragments_are_refused<D: TxDevice + Model>(q: &mut tx::Queue<Iommu, D>) {
    let payload = [0x5au8; 600];
    for udp in [false, true] {
        let h = headers(udp, &payload);
        // The first fragment (its L4 header is real, but its checksum
        // covers every fragment) and a later one (whose bytes after the IP
        // header are payload: the device would write a "checksum" there).
        for (more, offset) in [(true, 0), (false, 185), (true, 185)] {
            let f = fragment(&h, more, offset);
            refused(q, &f, &payload, Offload::Checksum, is_fragment);
            if !udp {
                let tso = Offload::Tso { mss: 536 };
                refused(q, &f, &payload, tso, is_fragment);
            }
        }
    }
    // The same headers, not fragmented, go out.
    let h = fragment(&headers(false, &payload), false, 0);
    q.send(&h, &payload, Offload::Checksum, 2).unwrap();
}

#[test]
fn ipv4_fragments_are_refused_for_an_offload_on_the_82576() {
    fragments_are_refused(&mut softnic_queue());
}

#[test]
fn ipv4_fragments_are_refused_for_an_offload_on_virtio() {
    fragments_are_refused(&mut virtio_queue());
}

/// Ethernet + IPv6 + UDP headers for `payload`.
fn udp6_headers(payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv6([1; 16], [2; 16], 64)
        .udp(4000, 5000)
        .write(&mut v, payload)
        .unwrap();
    v.truncate(62);
    v
}

/// `h` with the UDP length field (at `at`) set to `len`.
fn udp_length(h: &[u8], at: usize, len: u16) -> Vec<u8> {
    let mut h = h.to_vec();
    h[at + 4..at + 6].copy_from_slice(&len.to_be_bytes());
    h
}

fn udp_lengths_are_checked<D: TxDevice + Model>(q: &mut tx::Queue<Iommu, D>) {
    let payload = [0x5au8; 600];
    let want = 8 + payload.len();
    let wrong = |header: usize| move |why: &HeaderFault| matches!(why, HeaderFault::UdpLength { header: h, packet } if *h == header && *packet == want);
    for (h, at) in [(headers(true, &payload), 34), (udp6_headers(&payload), 54)] {
        // Shorter (the receiver takes the rest for padding and sums less
        // than the device did) and longer than the datagram.
        for len in [want - 100, want + 8] {
            let bad = udp_length(&h, at, len as u16);
            refused(q, &bad, &payload, Offload::Checksum, wrong(len));
        }
        q.send(&h, &payload, Offload::Checksum, 2).unwrap();
        q.kick().unwrap();
        q.wait(std::time::Duration::from_secs(10)).unwrap();
    }
}

#[test]
fn a_udp_length_that_is_not_the_datagrams_is_refused_on_the_82576() {
    udp_lengths_are_checked(&mut softnic_queue());
}

#[test]
fn a_udp_length_that_is_not_the_datagrams_is_refused_on_virtio() {
    udp_lengths_are_checked(&mut virtio_queue());
}
