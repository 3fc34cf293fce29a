//! A driver's own bytes through the TX queue, using the public API only:
//! headers and payload chosen by the caller, TSO and checksum offload, the
//! copying, vectored and zero-copy sends, and completion tokens. The frames
//! the software NIC puts on the wire are parsed with etherparse: their
//! checksums must be valid and their payloads, put back together, must be
//! exactly the caller's bytes.

use std::io::IoSlice;
use std::sync::Arc;

use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TransportSlice};
use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::offload::{HeaderFault, Offload};
use vfio_nic::tx::{self};
use vfio_nic::Error;

type Queue = tx::Queue<Arc<SoftIommu>, SoftNic<Arc<SoftIommu>>>;

fn queue(order: u32) -> Queue {
    queue_with(order, tx::Config::default())
}

fn queue_with(order: u32, txc: tx::Config) -> Queue {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let cfg = pool::Config::new(Order::new(order).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let nic = SoftNic::new(
        iommu,
        softnic::Config {
            capture: true,
            verify: false,
            ..softnic::Config::default()
        },
    );
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    unsafe { tx::Queue::new(domain, pool, nic, txc) }.unwrap()
}

/// Ethernet + IPv4 + TCP headers for `payload` bytes at sequence `seq`.
fn tcp_headers(seq: u32, payload: usize) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4([192, 0, 2, 1], [192, 0, 2, 2], 64)
        .tcp(40_000, 443, seq, 65_535)
        .write(&mut v, &vec![0; payload.min(60_000)])
        .unwrap();
    v.truncate(54);
    v
}

fn udp_headers(payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4([192, 0, 2, 1], [192, 0, 2, 2], 64)
        .udp(5353, 5353)
        .write(&mut v, payload)
        .unwrap();
    v.truncate(42);
    v
}

/// Bytes a caller might send: not the lab's pattern.
fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Parses every frame, checks both checksums, and returns the TCP payload
/// put back together in sequence order.
fn tcp_stream(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut segs: Vec<(u32, Vec<u8>)> = Vec::new();
    for fr in frames {
        let p = SlicedPacket::from_ethernet(fr).unwrap();
        let (Some(NetSlice::Ipv4(ip)), Some(TransportSlice::Tcp(tcp))) = (p.net, p.transport)
        else {
            panic!("not TCP/IPv4");
        };
        let iph = ip.header().to_header();
        assert_eq!(iph.header_checksum, iph.calc_header_checksum());
        let th = tcp.to_header();
        let want = th.calc_checksum_ipv4(&iph, tcp.payload()).unwrap();
        assert!(vfio_nic::check::wire::same_checksum(th.checksum, want));
        segs.push((th.sequence_number, tcp.payload().to_vec()));
    }
    segs.sort_by_key(|s| s.0);
    segs.into_iter().flat_map(|s| s.1).collect()
}

/// Parses a UDP/IPv4 frame, checks both checksums, and returns its payload.
fn udp_payload(frame: &[u8]) -> Vec<u8> {
    let p = SlicedPacket::from_ethernet(frame).unwrap();
    let (Some(NetSlice::Ipv4(ip)), Some(TransportSlice::Udp(udp))) = (p.net, p.transport) else {
        panic!("not UDP/IPv4");
    };
    let iph = ip.header().to_header();
    assert_eq!(iph.header_checksum, iph.calc_header_checksum());
    let want = udp
        .to_header()
        .calc_checksum_ipv4(&iph, udp.payload())
        .unwrap();
    assert_eq!(udp.checksum(), want);
    udp.payload().to_vec()
}

fn drain(q: &mut Queue) -> Vec<u64> {
    q.kick().unwrap();
    let mut tokens = Vec::new();
    // The software NIC completes within the doorbell.
    q.reap_tokens(&mut tokens).unwrap();
    assert_eq!(q.in_flight(), 0);
    tokens
}

#[test]
fn own_bytes_go_out_exactly_with_tso_and_checksums() {
    let mut q = queue(4);
    // Several TSO segments either way; fewer under Miri, which interprets
    // every byte.
    let big = if cfg!(miri) { 12_000 } else { 100_000 };
    let payload = bytes(big, 7);
    q.send(
        &tcp_headers(1000, payload.len()),
        &payload,
        Offload::Tso { mss: 1448 },
        11,
    )
    .unwrap();
    // The same stream continues, in three gathered pieces.
    let more = bytes(5_000, 9);
    let parts = [
        IoSlice::new(&more[..10]),
        IoSlice::new(&more[10..4000]),
        IoSlice::new(&more[4000..]),
    ];
    let seq = 1000 + payload.len() as u32;
    q.send_vectored(
        &tcp_headers(seq, more.len()),
        &parts,
        Offload::Tso { mss: 1448 },
        12,
    )
    .unwrap();
    assert_eq!(drain(&mut q), [11, 12]);
    let frames = q.take_frames();
    assert_eq!(frames.len(), big.div_ceil(1448) + 5_000usize.div_ceil(1448));
    let mut want = payload.clone();
    want.extend_from_slice(&more);
    assert_eq!(tcp_stream(&frames), want);
    assert_eq!(q.device().stats().faults, 0);
}

#[test]
fn udp_checksum_offload_and_a_raw_frame() {
    let mut q = queue(2);
    let payload = bytes(777, 3);
    q.send(&udp_headers(&payload), &payload, Offload::Checksum, 1)
        .unwrap();
    // No offload: the frame goes out byte for byte (one descriptor fewer).
    let raw = bytes(200, 5);
    let descs = q.stats().descs;
    q.send(&raw[..14], &raw[14..], Offload::None, 2).unwrap();
    assert_eq!(q.stats().descs - descs, 2, "header + payload, no context");
    assert_eq!(drain(&mut q), [1, 2]);
    let frames = q.take_frames();
    assert_eq!(udp_payload(&frames[0]), payload);
    assert_eq!(frames[1], raw);
}

#[test]
fn zero_copy_post_sends_the_frags_the_caller_filled() {
    let mut q = queue(3);
    let payload = bytes(if cfg!(miri) { 5_000 } else { 20_000 }, 1);
    let mut frags = Vec::new();
    q.frags(payload.len(), &mut frags).unwrap();
    let mut at = 0;
    for f in frags.iter_mut() {
        let n = f.len();
        f.as_mut_slice().copy_from_slice(&payload[at..at + n]);
        at += n;
    }
    q.post(
        &tcp_headers(5, payload.len()),
        &mut frags,
        Offload::Tso { mss: 1000 },
        99,
    )
    .unwrap();
    assert!(frags.is_empty(), "the queue owns them until completion");
    assert_eq!(drain(&mut q), [99]);
    assert_eq!(tcp_stream(&q.take_frames()), payload);
}

#[test]
fn headers_the_offload_cannot_use_post_nothing() {
    let mut q = queue(2);
    let payload = bytes(3000, 2);
    let udp = udp_headers(&payload);
    let tcp = tcp_headers(0, 100);
    let cases: [(&[u8], Offload); 5] = [
        (&[], Offload::None),
        (&udp, Offload::Tso { mss: 1448 }),
        (&tcp[..40], Offload::Checksum),
        (&tcp, Offload::Checksum), // IPv4 length says 140, the packet is 3054
        (&tcp, Offload::Tso { mss: 0 }),
    ];
    for (h, o) in cases {
        let before = (q.stats(), q.cache_stats().frags, q.free_descs());
        match q.send(h, &payload, o, 0) {
            Err(Error::BadHeaders { why, .. }) => assert!(
                matches!(
                    why,
                    HeaderFault::TsoNeedsTcp
                        | HeaderFault::Parse(_)
                        | HeaderFault::IpLength { .. }
                        | HeaderFault::ZeroMss
                        | HeaderFault::Empty
                ),
                "{why:?}"
            ),
            other => panic!("{o:?}: {other:?}"),
        }
        let after = (q.stats(), q.cache_stats().frags, q.free_descs());
        assert_eq!(before, after, "nothing posted, allocated or advanced");
    }
    // A rejected zero-copy post hands the frags back.
    let mut frags = Vec::new();
    q.frags(3000, &mut frags).unwrap();
    assert!(q
        .post(&udp, &mut frags, Offload::Tso { mss: 100 }, 0)
        .is_err());
    assert_eq!(frags.iter().map(|f| f.len()).sum::<usize>(), 3000);
}

#[test]
fn small_packets_go_out_inline_in_their_bounce_slot() {
    let mut q = queue(2);
    let payload = bytes(60, 4);
    let hdr = udp_headers(&payload);
    let raw = bytes(64, 8);
    // Frags carved by either cache (small payloads come from the queue's
    // order-0 cache: `tx::Config::split`).
    let carved = |q: &Queue| q.cache_stats().frags;
    let frags = carved(&q);
    let descs = q.stats().descs;
    // Context + one data descriptor, then one data descriptor each: the
    // device keeps the checksum context, and headers and payload share the
    // bounce slot.
    q.send(&hdr, &payload, Offload::Checksum, 1).unwrap();
    q.send(&hdr, &payload, Offload::Checksum, 2).unwrap();
    q.send(&raw[..14], &raw[14..], Offload::None, 3).unwrap();
    assert_eq!(q.stats().descs - descs, 4);
    assert_eq!(q.stats().inline_packets, 3);
    assert_eq!(q.stats().contexts_skipped, 1);
    assert_eq!(carved(&q), frags, "no frag carved");
    // A frame larger than a slot (128 bytes) takes a frag as before.
    let big = bytes(200, 9);
    q.send(&udp_headers(&big), &big, Offload::Checksum, 4)
        .unwrap();
    assert_eq!(q.stats().inline_packets, 3);
    assert_eq!(carved(&q), frags + 1);
    assert_eq!(drain(&mut q), [1, 2, 3, 4]);
    let frames = q.take_frames();
    for (fr, want) in [
        (&frames[0], &payload),
        (&frames[1], &payload),
        (&frames[3], &big),
    ] {
        assert_eq!(&udp_payload(fr), want);
    }
    assert_eq!(frames[2], raw);
    assert_eq!(q.device().stats().faults, 0);
}

#[test]
fn context_is_written_only_when_the_offload_changes() {
    let mut q = queue(4);
    let data = bytes(20_000, 2);
    let mut seq = 0u32;
    let descs = q.stats().descs;
    for (i, mss) in [1448u16, 1448, 1000, 1000].into_iter().enumerate() {
        let part = &data[i * 5000..(i + 1) * 5000];
        let tso = Offload::Tso { mss };
        q.send(&tcp_headers(seq, part.len()), part, tso, i as u64)
            .unwrap();
        seq += part.len() as u32;
    }
    // 3 + 2 + 3 + 2: a context for the first packet and for the MSS change.
    assert_eq!(q.stats().descs - descs, 10);
    assert_eq!(q.stats().contexts_skipped, 2);
    assert_eq!(drain(&mut q), [0, 1, 2, 3]);
    let frames = q.take_frames();
    // Each packet is segmented with its own MSS.
    assert_eq!(frames.len(), 4 + 4 + 5 + 5);
    let payload = |f: &Vec<u8>| f.len() - 54;
    assert!(frames[..8].iter().all(|f| payload(f) <= 1448));
    assert_eq!(payload(&frames[0]), 1448);
    assert!(frames[8..].iter().all(|f| payload(f) <= 1000));
    assert_eq!(payload(&frames[8]), 1000);
    assert_eq!(tcp_stream(&frames), data);
}

#[test]
fn wait_hands_back_the_tokens_it_reaps() {
    let mut q = queue(2);
    let payload = bytes(1400, 6);
    let hdr = udp_headers(&payload);
    let n = 20u64;
    for t in 0..n {
        q.send(&hdr, &payload, Offload::Checksum, t).unwrap();
    }
    q.kick().unwrap();
    // Nothing reaped before the wait: every token comes back from it.
    let mut tokens = Vec::new();
    assert_eq!(
        q.wait_tokens(std::time::Duration::from_secs(60), &mut tokens)
            .unwrap(),
        n as usize
    );
    assert_eq!(tokens, (0..n).collect::<Vec<_>>());
    assert_eq!(q.in_flight(), 0);
}

#[test]
fn a_packet_larger_than_the_whole_ring_is_too_large_not_ring_full() {
    let ring = tx::Config {
        ring: 8,
        ..tx::Config::default()
    };
    let mut q = queue_with(0, ring);
    let tso = Offload::Tso { mss: 1448 };
    let big = bytes(40_000, 1);
    let hdr = tcp_headers(0, big.len());
    // An empty ring of 8 holds 7 descriptors; the packet needs more, so a
    // retry can never succeed.
    for _ in 0..2 {
        match q.send(&hdr, &big, tso, 1) {
            Err(
                e @ Error::PacketTooLarge {
                    needed,
                    capacity: 7,
                },
            ) => {
                assert!(needed > 7, "{e}");
                assert!(!e.is_backoff());
            }
            other => panic!("{other:?}"),
        }
        assert_eq!((q.in_flight(), q.free_descs()), (0, 7));
    }
    // The zero-copy post says the same and hands the frags back.
    let mut frags = Vec::new();
    q.frags(big.len(), &mut frags).unwrap();
    assert!(matches!(
        q.post(&hdr, &mut frags, tso, 2),
        Err(Error::PacketTooLarge { capacity: 7, .. })
    ));
    assert_eq!(frags.iter().map(|f| f.len()).sum::<usize>(), big.len());
    drop(frags);
    // A packet that fits the empty ring is a back-off while the ring is
    // busy, and goes out once it drained.
    let small = bytes(3000, 2);
    let hdr = tcp_headers(0, small.len());
    let mut t = 0;
    let full = loop {
        match q.send(&hdr, &small, tso, t) {
            Ok(()) => t += 1,
            Err(e) => break e,
        }
    };
    assert!(matches!(full, Error::RingFull { .. }), "{full:?}");
    assert!(full.is_backoff());
    assert_eq!(drain(&mut q), (0..t).collect::<Vec<_>>());
    q.send(&hdr, &small, tso, t).unwrap();
}

#[test]
fn into_device_with_packets_in_flight_hands_the_queue_back() {
    let mut q = queue(2);
    let payload = bytes(1400, 5);
    q.send(&udp_headers(&payload), &payload, Offload::Checksum, 41)
        .unwrap();
    let e = q.into_device().unwrap_err();
    assert!(
        matches!(e.error(), Error::Busy { in_flight: 1 }),
        "{:?}",
        e.error()
    );
    // Nothing was lost: the same queue, device attached, sends its packet
    // and hands back its token, then gives the device up.
    let mut q = e.into_queue();
    q.kick().unwrap();
    let mut tokens = Vec::new();
    q.wait_tokens(std::time::Duration::from_secs(60), &mut tokens)
        .unwrap();
    assert_eq!(tokens, [41]);
    assert_eq!(udp_payload(&q.take_frames()[0]), payload);
    let nic = q.into_device().unwrap();
    assert_eq!(nic.stats().faults, 0);
}

#[test]
fn into_device_errors_convert_for_question_mark() {
    fn detach(q: Queue) -> vfio_nic::Result<()> {
        q.into_device()?;
        Ok(())
    }
    let mut q = queue(2);
    let payload = bytes(1400, 5);
    q.send(&udp_headers(&payload), &payload, Offload::Checksum, 1)
        .unwrap();
    assert!(matches!(detach(q), Err(Error::Busy { in_flight: 1 })));
}

/// The MTU the queue is configured with bounds every frame on the wire: a
/// frame without TSO, and each segment of a TSO packet. A longer one is
/// refused before anything is posted or carved.
#[test]
fn frames_longer_than_the_mtu_are_refused() {
    let mut q = queue(2);
    let raw = bytes(9042, 1);
    let (frags, descs) = (q.cache_stats().frags, q.stats().descs);
    assert!(matches!(
        q.send(&raw[..14], &raw[14..], Offload::None, 1),
        Err(Error::FrameTooLong {
            len: 9042,
            max: 1514
        })
    ));
    let hdr = tcp_headers(1, 3000);
    assert!(matches!(
        q.send(&hdr, &bytes(3000, 2), Offload::Tso { mss: 1461 }, 2),
        Err(Error::FrameTooLong {
            len: 1515,
            max: 1514
        })
    ));
    assert_eq!((q.cache_stats().frags, q.stats().descs), (frags, descs));
    assert_eq!(q.in_flight(), 0);
    // At the limit they go.
    q.send(&raw[..14], &raw[14..1514], Offload::None, 3)
        .unwrap();
    q.send(&hdr, &bytes(3000, 2), Offload::Tso { mss: 1460 }, 4)
        .unwrap();
    assert_eq!(drain(&mut q), [3, 4]);
    // A jumbo MTU takes the 9042-byte frame; an MTU below 68 is refused.
    let jumbo = tx::Config {
        mtu: 9028,
        ..tx::Config::default()
    };
    let mut q = queue_with(2, jumbo);
    q.send(&raw[..14], &raw[14..], Offload::None, 5).unwrap();
    assert_eq!(drain(&mut q), [5]);
    assert_eq!(q.take_frames()[0], raw);
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let nic = SoftNic::new(iommu, softnic::Config::default());
    let tiny = tx::Config {
        mtu: 67,
        ..tx::Config::default()
    };
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let r = unsafe { tx::Queue::new(domain, pool, nic, tiny) };
    assert!(matches!(r, Err(Error::BadConfig { value: 67, .. })));
}

/// `max_bufs` is bounded by the most buffers any device of the crate takes
/// (`format::MAX_BUFS`, 64): above it a model would drop as malformed a
/// packet the queue posted and then completed as sent. A queue refuses
/// such a setting, with the value, and takes the bound itself.
#[test]
fn max_bufs_above_what_devices_take_is_refused() {
    assert_eq!(vfio_nic::format::MAX_BUFS, 64);
    for (max_bufs, ok) in [
        (1, false),
        (2, true),
        (64, true),
        (65, false),
        (1000, false),
    ] {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let domain = Arc::new(Domain::new(iommu.clone()));
        let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
        let pool = Pool::new(domain.clone(), cfg).unwrap();
        let nic = SoftNic::new(iommu, softnic::Config::default());
        let txc = tx::Config {
            max_bufs,
            ..tx::Config::default()
        };
        // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
        let r = unsafe { tx::Queue::new(domain, pool, nic, txc) };
        match r {
            Ok(_) if ok => {}
            Err(Error::BadConfig { what, value }) if !ok => {
                assert_eq!(value, max_bufs as u64);
                assert!(what.contains("max_bufs"), "{what}");
            }
            Err(e) => panic!("max_bufs {max_bufs}: {e}"),
            Ok(_) => panic!("max_bufs {max_bufs} was taken"),
        }
    }
}
