//! End to end on the software NIC: packets built by the TX queue from pfrag
//! memory, DMA'd through the software IOMMU, segmented, checksummed and
//! verified byte for byte.

use std::sync::Arc;

use pfrag::dma::{DmaMapper, Domain, Identity, Invalidation, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::check::wire::{FrameError, WireCheck};
use vfio_nic::gen::flow;
use vfio_nic::model::softnic::{self, SoftNic, Touch};
use vfio_nic::tx::{self, HeaderMode};
use vfio_nic::Error;

mod common;

use common::Gen;

type Queue = Gen<tx::Queue<Arc<SoftIommu>, SoftNic<Arc<SoftIommu>>>, Arc<SoftIommu>>;

fn queue(
    order: u32,
    policy: Policy,
    inv: Invalidation,
    cfg: tx::Config,
    nic: softnic::Config,
) -> (Arc<SoftIommu>, Queue) {
    queue_flows(order, policy, inv, cfg, nic, 1)
}

fn queue_flows(
    order: u32,
    policy: Policy,
    inv: Invalidation,
    cfg: tx::Config,
    nic: softnic::Config,
    flows: usize,
) -> (Arc<SoftIommu>, Queue) {
    let iommu = Arc::new(
        SoftIommu::new(SoftIommuConfig {
            invalidation: inv,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    );
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(order).unwrap(), policy),
    )
    .unwrap();
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let q = unsafe { tx::Queue::new(domain, pool, SoftNic::new(iommu.clone(), nic), cfg) }.unwrap();
    (iommu, Gen::new(q, flows))
}

/// Checks every frame (checksums, per-flow sequence continuity, payload
/// pattern) and panics on the first bad one.
fn check_frames(frames: &[Vec<u8>]) -> WireCheck {
    let mut c = WireCheck::default();
    for fr in frames {
        if let Err(e) = c.frame(fr) {
            panic!("{e}");
        }
    }
    c
}

/// A TSO payload: 64 KB natively; under Miri (which interprets every byte
/// of the copy, the device's read and its checksums) 9,000 bytes, still
/// several pages, several segments and, at order 0, several chunks.
fn big() -> usize {
    if cfg!(miri) {
        9_000
    } else {
        65_160
    }
}

/// Iterations: the full count natively, a small one under Miri (which is
/// orders of magnitude slower); the properties checked stay the same.
fn n(full: usize) -> usize {
    if cfg!(miri) {
        (full / 100).max(2)
    } else {
        full
    }
}

#[test]
fn tso_frames_are_correct_for_every_order_and_policy() {
    for order in 0..=4 {
        for policy in Policy::ALL {
            let header = if policy == Policy::PerFrag {
                HeaderMode::Mapped
            } else {
                tx::Config::default().header
            };
            let cfg = tx::Config {
                header,
                fit_whole: policy != Policy::PerFrag,
                ring: 64,
                ..tx::Config::default()
            };
            let nic = softnic::Config {
                capture: true,
                ..softnic::Config::default()
            };
            let (iommu, mut q) = queue_flows(order, policy, Invalidation::Strict, cfg, nic, 3);
            let plan: Vec<(usize, usize)> = (0..n(40))
                .map(|i| (i % 3, [big(), 100, 3000, 1448, 20000][i % 5]))
                .collect();
            q.send_all(&plan);
            let st = q.device().stats();
            let total: usize = plan.iter().map(|p| p.1).sum();
            assert_eq!(st.bytes_verified, total as u64, "order {order} {policy:?}");
            assert_eq!((st.faults, st.bad_payload, st.bad_desc), (0, 0, 0));
            assert_eq!(iommu.stats().faults, 0);
            let frames = q.take_frames();
            let segs: usize = plan.iter().map(|p| p.1.div_ceil(1448)).sum();
            assert_eq!(frames.len(), segs);
            let per_flow = check_frames(&frames);
            for f in 0..3u32 {
                let sent: usize = plan.iter().filter(|p| p.0 == f as usize).map(|p| p.1).sum();
                // A flow with nothing planned (short Miri runs) has no frames.
                let seen = per_flow.next_offset(f).unwrap_or(0);
                assert_eq!(seen, sent as u32, "flow {f}");
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
        tx::Config::default(),
        softnic::Config::default(),
    );
    q.send_all(&vec![(0, big()); n(300)]);
    assert_eq!(q.device().stats().bytes_verified, (n(300) * big()) as u64);

    // Without an IOMMU the device still reaches only what the driver
    // mapped: the NIC and the domain share one identity mapper.
    let id = Arc::new(Identity::new());
    let domain = Arc::new(Domain::new(id.clone()));
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(2).unwrap(), Policy::Persistent),
    )
    .unwrap();
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let q = unsafe {
        tx::Queue::new(
            domain,
            pool,
            SoftNic::new(id, softnic::Config::default()),
            tx::Config::default(),
        )
    }
    .unwrap();
    let mut q = Gen::new(q, 1);
    for _ in 0..n(100) {
        q.send(0, big()).unwrap();
        q.kick().unwrap();
        q.reap().unwrap();
    }
    assert_eq!(q.device().stats().bytes_verified, (n(100) * big()) as u64);
}

#[test]
fn persistent_bounce_order4_makes_no_mappings_and_uses_two_descriptors() {
    let (iommu, mut q) = queue(
        4,
        Policy::Persistent,
        Invalidation::Strict,
        tx::Config::default(),
        softnic::Config::default(),
    );
    // Warm up at least as long as the measured part: under Miri the pool
    // grows one small batch at a time and the run is short.
    // One data descriptor: the payload fits one order-4 chunk whole.
    q.send_all(&vec![(0, big()); n(600).max(n(1000))]);
    let before = iommu.stats();
    let descs = q.stats().descs;
    q.send_all(&vec![(0, big()); n(1000)]);
    let s = iommu.stats().since(&before);
    assert_eq!((s.map_calls, s.unmap_calls, s.invalidations), (0, 0, 0));
    // Header and one data descriptor: the device holds the TSO context
    // from the first packet on, so no context descriptor is written again.
    assert_eq!(q.stats().descs - descs, 2 * n(1000) as u64);
    assert_eq!(q.stats().contexts_skipped, q.stats().packets - 1);
}

/// The MSS decides how many pages each TSO segment's fetch translates: a
/// page-aligned payload cut at 4096 bytes costs one page per segment, at
/// 8192 two, at 6144 two whenever a segment straddles a page boundary, at
/// 1448 one or two. The wire bytes count every frame's headers and FCS.
#[test]
fn segments_span_the_pages_their_mss_implies() {
    let payload = if cfg!(miri) { 3 * 4096 } else { 16 * 4096 };
    for mss in [4096u16, 8192, 6144, 1448] {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let domain = Arc::new(Domain::new(iommu.clone()));
        let pool = Pool::new(
            domain.clone(),
            pool::Config::new(Order::new(4).unwrap(), Policy::Persistent),
        )
        .unwrap();
        let nic = SoftNic::new(iommu, softnic::Config::default());
        // Jumbo frames: segments of up to 8192 payload bytes.
        let txc = tx::Config {
            mtu: 9000,
            ..tx::Config::default()
        };
        // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
        let mut q = unsafe { tx::Queue::new(domain, pool, nic, txc) }.unwrap();
        let mut g = vfio_nic::gen::Traffic::new(1, mss).unwrap();
        g.send(&mut q, 0, payload).unwrap();
        q.kick().unwrap();
        q.reap().unwrap();
        let st = q.device().stats();
        assert_eq!(st.bytes_verified, payload as u64, "mss {mss}");
        let segs = payload.div_ceil(usize::from(mss)) as u64;
        assert_eq!(st.frames, segs, "mss {mss}");
        // The payload starts a page (its chunk's start): segment k spans
        // the pages from its first byte's to its last byte's.
        let m = usize::from(mss);
        let expect: u64 = (0..segs as usize)
            .map(|k| {
                let end = ((k + 1) * m).min(payload);
                ((end - 1) / 4096 - k * m / 4096 + 1) as u64
            })
            .sum();
        assert_eq!(st.segment_pages, expect, "mss {mss}");
        if mss == 4096 {
            assert_eq!(st.segment_pages, segs, "page-aligned: exactly one each");
        }
        // Ethernet 14 + IPv4 20 + TCP header, plus FCS, per frame.
        let hlen = (st.wire_bytes - payload as u64) / segs - 4;
        assert!((54..=100).contains(&hlen), "{hlen}-byte headers");
        assert_eq!(st.wire_bytes, payload as u64 + segs * (hlen + 4));
    }
}

#[test]
fn touch_pages_reads_a_line_per_page() {
    let nic = softnic::Config {
        touch: Touch::Pages,
        capture: false,
        verify: true,
    };
    let (_, mut q) = queue(
        4,
        Policy::Persistent,
        Invalidation::Strict,
        tx::Config::default(),
        nic,
    );
    q.send_all(&[(0, 65160)]);
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
    let cfg = tx::Config {
        ring: 8,
        ..tx::Config::default()
    };
    let (iommu, mut q) = queue(
        0,
        Policy::PerFrag,
        Invalidation::Strict,
        cfg,
        softnic::Config::default(),
    );
    // At least 16 data descriptors of a 4 KiB chunk each and the header:
    // never on a ring of 8, which holds 7. Refused before allocating.
    match q.send(0, 65160) {
        Err(Error::PacketTooLarge {
            needed: 17,
            capacity: 7,
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
    // 3 + 2 descriptors used (the second packet reuses the context); the
    // quick check before carving counts a context descriptor for any
    // offload, as it does not know the headers yet, and one frag for a
    // payload that fits a chunk whole.
    match q.send(0, 1000) {
        Err(Error::RingFull { needed: 3, free: 2 }) => {}
        other => panic!("{other:?}"),
    }
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
    let cfg = tx::Config {
        ring: 256,
        max_bufs: 8,
        ..tx::Config::default()
    };
    let (_, mut q) = queue(
        0,
        Policy::Persistent,
        Invalidation::Strict,
        cfg,
        softnic::Config::default(),
    );
    // The header and 16 whole-chunk frags.
    assert!(matches!(
        q.send(0, 65160),
        Err(Error::TooManyBuffers { needed: 17, max: 8 })
    ));
    assert_eq!(q.cache_stats().frags, 0);
}

/// The wire checker used on real captures rejects each kind of damage: a
/// flipped payload byte, a flipped IP header byte, a lost segment, and a
/// frame of someone else's port.
#[test]
fn wire_check_catches_corruption_loss_and_strangers() {
    let (_iommu, mut q) = queue_flows(
        2,
        Policy::Persistent,
        Invalidation::Strict,
        tx::Config::default(),
        softnic::Config {
            touch: Touch::Checksum,
            capture: true,
            verify: true,
        },
        2,
    );
    for i in 0..4 {
        q.send(i % 2, 5000).unwrap();
    }
    q.kick().unwrap();
    q.reap().unwrap();
    let frames = q.take_frames();
    assert_eq!(frames.len(), 4 * 4);
    let good = check_frames(&frames);
    assert_eq!(good.report().good_frames, 16);
    assert_eq!(good.report().payload_bytes, 4 * 5000);
    assert_eq!(good.report().streams, 2);

    let mut bad = frames.clone();
    let last = bad[3].len() - 1;
    bad[3][last] ^= 1;
    let mut c = WireCheck::default();
    let errs: Vec<_> = bad.iter().filter_map(|f| c.frame(f).err()).collect();
    assert!(
        matches!(errs[..], [FrameError::TcpChecksum { .. }]),
        "{errs:?}"
    );

    let mut bad = frames.clone();
    bad[5][flow::MACLEN + 8] ^= 0x40; // IPv4 TTL
    let mut c = WireCheck::default();
    let errs: Vec<_> = bad.iter().filter_map(|f| c.frame(f).err()).collect();
    assert!(
        matches!(errs[..], [FrameError::IpChecksum { .. }]),
        "{errs:?}"
    );

    // A lost frame costs the frame after it, and nothing more: the
    // checker takes the flow up again from there.
    let mut lost = frames.clone();
    lost.remove(1);
    let mut c = WireCheck::default();
    let errs: Vec<_> = lost.iter().filter_map(|f| c.frame(f).err()).collect();
    assert!(matches!(errs[..], [FrameError::Gap { .. }]), "{errs:?}");
    assert_eq!(c.report().bad_frames, 1);
    assert_eq!(c.report().good_frames, 14);
    // Two frames swapped: both bad (the early one, then the late one), the
    // rest of the flow good.
    let mut swapped = frames.clone();
    swapped.swap(1, 2);
    let mut c = WireCheck::default();
    let errs: Vec<_> = swapped.iter().filter_map(|f| c.frame(f).err()).collect();
    assert!(
        matches!(errs[..], [FrameError::Gap { .. }, FrameError::Gap { .. }]),
        "{errs:?}"
    );
    assert_eq!(c.report().good_frames, 14);
    // A flow's first frame lost: the next, whole, starts its stream.
    let mut first = frames.clone();
    first.remove(0);
    let mut c = WireCheck::default();
    first.iter().for_each(|f| drop(c.frame(f)));
    assert_eq!((c.report().good_frames, c.report().bad_frames), (14, 1));
    // A sequence number damaged in flight (its checksum no longer holds)
    // takes the flow nowhere: that frame and the one after it (whose
    // bytes before it never arrived whole) are bad, the rest good.
    let mut damaged = frames.clone();
    let seq = flow::MACLEN + flow::IPLEN + 4;
    damaged[1][seq] ^= 0x10;
    let mut c = WireCheck::default();
    damaged.iter().for_each(|f| drop(c.frame(f)));
    assert_eq!((c.report().good_frames, c.report().bad_frames), (14, 2));

    let mut stranger = frames[0].clone();
    let sport = flow::MACLEN + flow::IPLEN;
    stranger[sport..sport + 2].copy_from_slice(&80u16.to_be_bytes());
    let mut c = WireCheck::default();
    assert!(c.frame(&stranger).is_err());
}

/// With a 4 KiB boundary no data buffer crosses a page, at any order and
/// policy, and the frames are as correct as without it; without the
/// boundary large chunks do produce crossing buffers.
#[test]
fn boundary_keeps_every_buffer_inside_one_page() {
    // Under Miri (every byte interpreted) the order and policy where
    // buffers do cross pages; natively every combination.
    let orders: &[u32] = if cfg!(miri) { &[4] } else { &[0, 2, 4] };
    let policies: &[Policy] = if cfg!(miri) {
        &[Policy::Persistent]
    } else {
        &Policy::ALL
    };
    for &order in orders {
        for &policy in policies {
            for boundary in [None, Some(4096)] {
                let (_iommu, mut q) = queue_flows(
                    order,
                    policy,
                    Invalidation::Strict,
                    tx::Config {
                        boundary,
                        ..tx::Config::default()
                    },
                    softnic::Config {
                        touch: Touch::Checksum,
                        capture: true,
                        verify: true,
                    },
                    2,
                );
                let rounds = if cfg!(miri) { 1 } else { 2 };
                for i in 0..4 * rounds {
                    q.send(i % 2, [big(), 3_000, 9_000, 100][i % 4]).unwrap();
                    q.kick().unwrap();
                    q.reap().unwrap();
                }
                let st = q.device().stats();
                let frames = q.take_frames();
                let c = check_frames(&frames);
                let sent = (big() + 3_000 + 9_000 + 100) as u64 * rounds as u64;
                assert_eq!(c.report().payload_bytes, sent);
                match boundary {
                    Some(_) => assert_eq!(st.page_crossing_bufs, 0, "order {order} {policy:?}"),
                    None if order >= 2 => assert!(st.page_crossing_bufs > 0, "order {order}"),
                    None => {}
                }
            }
        }
    }
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(0).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let nic = SoftNic::new(iommu, softnic::Config::default());
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let bad = unsafe {
        tx::Queue::new(
            domain,
            pool,
            nic,
            tx::Config {
                boundary: Some(3000),
                ..tx::Config::default()
            },
        )
    };
    assert!(matches!(bad, Err(Error::BadConfig { value: 3000, .. })));
}

/// Past the account's `max` the queue refuses the packet with a back-off
/// error (no panic, nothing posted), and after completions are reaped the
/// same send goes through.
#[test]
fn memory_limit_makes_the_queue_back_off() {
    use pfrag::account::{Limits, MemAccount, NoHooks};
    // 16 chunks' worth of memory: 64 KiB chunks natively; under Miri 16 KiB
    // chunks and payloads that fill one (the same back-off, a quarter of
    // the bytes to interpret).
    let (order, payload) = if cfg!(miri) { (2, 16_000) } else { (4, 65_160) };
    let limit = 16 << (12 + order);
    let acct = MemAccount::new(
        Limits {
            min: 0,
            pressure: limit,
            max: limit,
        },
        NoHooks,
    )
    .unwrap();
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::with_account(
        domain.clone(),
        pool::Config::new(Order::new(order).unwrap(), Policy::Persistent),
        acct.clone(),
    )
    .unwrap();
    let nic = SoftNic::new(iommu, softnic::Config::default());
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let mut q = Gen::new(
        unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }.unwrap(),
        1,
    );
    let mut sent = 0;
    let err = loop {
        match q.send(0, payload) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent <= 16, "the limit holds 16 chunks");
    };
    assert!(err.is_backoff(), "{err}");
    assert!(matches!(
        err,
        Error::Pool(pfrag::Error::MemoryLimit { max, .. }) if max == limit
    ));
    assert_eq!(sent, 16);
    assert_eq!(q.stats().mem_backoffs, 1);
    assert_eq!(q.stats().packets, 16);
    q.kick().unwrap();
    assert_eq!(q.reap().unwrap(), 16);
    q.send(0, payload).unwrap();
    assert_eq!(acct.bytes(), limit);
}
