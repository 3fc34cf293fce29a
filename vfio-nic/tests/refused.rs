//! A send the queue refuses is refused before anything is allocated: the
//! quick count made before the frags exist is an upper bound of what they
//! need (so a full ring or too many buffers costs no chunk and no frag),
//! headers the queue cannot place are refused with the header error and
//! the limit, and frags given back after a late refusal have their unmap
//! failures counted.

mod common;

use std::sync::Arc;

use pfrag::dma::{Domain, FaultyConfig, Op, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::offload::{HeaderFault, Offload};
use vfio_nic::{tx, Error};

type Iommu = Arc<SoftIommu>;

/// A software IOMMU, a domain on it and a persistent pool of
/// order-`order` chunks.
fn parts(order: u32) -> (Iommu, Arc<Domain<Iommu>>, Pool<Iommu>) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(Order::new(order).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    (iommu, domain, pool)
}

fn capture() -> softnic::Config {
    softnic::Config {
        capture: true,
        verify: false,
        ..softnic::Config::default()
    }
}

/// On virtio (no context descriptor) without fit-whole, a payload may be
/// split over the tail of the chunk being carved and a fresh chunk: the
/// quick count (`room_for`, and `send`'s own before it carves) keeps that
/// extra descriptor, so a ring one short is `RingFull` before any frag is
/// carved or any chunk taken.
#[test]
fn virtio_ring_full_is_refused_before_the_payload_is_carved() {
    let (iommu, domain, pool) = parts(0);
    let nic = VirtioNet::new(iommu, capture()).unwrap();
    let cfg = tx::Config {
        ring: 8,
        fit_whole: false,
        split: None,
        mtu: 9000,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through the IOMMU the domain maps through.
    let mut q = unsafe { tx::Queue::new(domain, pool, nic, cfg) }.unwrap();
    let hdr = [0u8; 14];
    // Two packets of header + one frag each (the chunk is part carved),
    // one inline: 5 of the 7 descriptors taken.
    q.send(&hdr, &[1u8; 1000], Offload::None, 1).unwrap();
    q.send(&hdr, &[1u8; 1000], Offload::None, 2).unwrap();
    q.send(&hdr, &[1u8; 10], Offload::None, 3).unwrap();
    assert_eq!(q.free_descs(), 2);
    // A page of payload may take the chunk's tail and a fresh chunk: 3.
    assert_eq!(q.descs_needed(4096), 3);
    let r = q.room_for(4096, Offload::None);
    assert!(
        matches!(r, Err(Error::RingFull { needed: 3, free: 2 })),
        "{r:?}"
    );
    let cache = q.cache_stats();
    let chunks = q.cache().pool().stats().chunks;
    let r = q.send(&hdr, &[1u8; 4096], Offload::None, 4);
    assert!(
        matches!(r, Err(Error::RingFull { needed: 3, free: 2 })),
        "{r:?}"
    );
    assert_eq!(q.cache_stats(), cache, "a refused send carved frags");
    assert_eq!(
        q.cache().pool().stats().chunks,
        chunks,
        "a refused send took a chunk"
    );
    assert_eq!((q.in_flight(), q.free_descs()), (3, 2));
}

/// A queue on the 82576 model over order-4 chunks (64 KiB, more than
/// DTALEN's 65,535) taking at most `max_bufs` data buffers per packet.
fn igb_order4(max_bufs: usize) -> tx::Queue<Iommu, SoftNic<Iommu>> {
    let (iommu, domain, pool) = parts(4);
    let cfg = tx::Config {
        ring: 64,
        max_bufs,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through the IOMMU the domain maps through.
    unsafe { tx::Queue::new(domain, pool, SoftNic::new(iommu, capture()), cfg) }.unwrap()
}

/// On the 82576 with chunks larger than a descriptor's buffer, each
/// whole-chunk frag takes two data descriptors: the count before carving
/// says so, and a TSO packet over more buffers than the device takes is
/// `TooManyBuffers` (carrying the count) before any chunk is taken or
/// frag carved.
#[test]
fn igb_frags_longer_than_a_buffer_are_refused_before_carving() {
    let len = 3 * 65536;
    let mut q = igb_order4(6);
    // Context, header and three frags of two buffers each.
    assert_eq!(q.descs_needed(len), 8);
    let chunks = q.cache().pool().stats().chunks;
    let frags = q.cache_stats().frags;
    let r = q.send(
        &common::tcp_headers(),
        &vec![7u8; len],
        Offload::Tso { mss: 1448 },
        1,
    );
    assert!(
        matches!(r, Err(Error::TooManyBuffers { needed: 7, max: 6 })),
        "{r:?}"
    );
    assert_eq!(q.cache().pool().stats().chunks, chunks, "the pool grew");
    assert_eq!(q.cache_stats().frags, frags, "frags were carved");
    assert_eq!(q.in_flight(), 0);
}

/// With room for them, the packet above goes out in exactly the buffers
/// counted: the count is no larger than it must be here.
#[test]
fn igb_frags_longer_than_a_buffer_go_out_in_the_counted_buffers() {
    let len = 3 * 65536;
    let mut q = igb_order4(7);
    q.send(
        &common::tcp_headers(),
        &vec![7u8; len],
        Offload::Tso { mss: 1448 },
        1,
    )
    .unwrap();
    assert_eq!(q.stats().descs, 8);
    q.kick().unwrap();
    assert_eq!(q.wait(common::WAIT).unwrap(), 1);
    let frames = q.take_frames();
    assert_eq!(frames.len(), len.div_ceil(1448));
}

/// Sends `n` packets of pseudo-random lengths up to `max` (seeded) and
/// checks that each took at most the descriptors `descs_needed` counted
/// before its frags were carved, reaping when the ring fills.
fn sends_within_the_count<D: vfio_nic::device::TxDevice>(
    q: &mut tx::Queue<Iommu, D>,
    offload: Offload,
    max: usize,
    n: u64,
) {
    let hdr = common::tcp_headers();
    let payload = vec![3u8; max];
    let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ max as u64;
    for t in 0..n {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let len = 1 + (x >> 33) as usize % max;
        let needed = q.descs_needed(len);
        let before = q.stats().descs;
        loop {
            match q.send(&hdr, &payload[..len], offload, t) {
                Ok(()) => break,
                Err(Error::RingFull { .. }) => {
                    q.kick().unwrap();
                    q.wait(common::WAIT).unwrap();
                }
                Err(e) => panic!("{len} bytes: {e}"),
            }
        }
        let took = (q.stats().descs - before) as usize;
        assert!(
            took <= needed,
            "{len} bytes took {took} descriptors, counted {needed}"
        );
    }
    q.kick().unwrap();
    q.wait(common::WAIT).unwrap();
}

/// The count made before the frags exist (`descs_needed`, which `send` and
/// `room_for` use to refuse before allocating) is never below what a
/// packet takes: over chunk orders, fit-whole or not, boundaries below a
/// page, at a page and past the format's largest buffer, on the 82576
/// (TSO up to 200,000 bytes) and virtio.
#[test]
#[cfg_attr(miri, ignore = "thousands of packets up to 200 KB: hours under Miri")]
fn the_count_before_carving_bounds_every_packet() {
    for order in [0, 2, 4] {
        for fit_whole in [true, false] {
            for boundary in [None, Some(256), Some(4096), Some(1 << 17)] {
                // Lengths the devices' buffer limit lets through: at most
                // 24 pieces of a chunk or boundary (each may be split in
                // two where a frag crosses a chunk's tail).
                let piece = boundary.unwrap_or(usize::MAX).min(4096 << order);
                let cap = |max: usize| max.min(24 * piece);
                let cfg = tx::Config {
                    ring: 4096,
                    max_bufs: vfio_nic::format::MAX_BUFS,
                    fit_whole,
                    boundary,
                    mtu: u16::MAX,
                    ..tx::Config::default()
                };
                let (iommu, domain, pool) = parts(order);
                let nic = SoftNic::new(iommu, softnic::Config::default());
                // SAFETY: as above.
                let mut q = unsafe { tx::Queue::new(domain, pool, nic, cfg) }.unwrap();
                sends_within_the_count(&mut q, Offload::Tso { mss: 1448 }, cap(200_000), 60);
                let (iommu, domain, pool) = parts(order);
                let nic = VirtioNet::new(iommu, softnic::Config::default()).unwrap();
                // SAFETY: as above.
                let mut q = unsafe { tx::Queue::new(domain, pool, nic, cfg) }.unwrap();
                sends_within_the_count(&mut q, Offload::None, cap(60_000), 60);
            }
        }
    }
}

/// Headers go whole in one buffer: a bounce slot, or else a header frag of
/// at most a page. Longer headers are `BadHeaders` with `TooLong` carrying
/// that limit, before the payload is carved; headers of exactly the limit
/// go out.
#[test]
fn headers_longer_than_the_queue_places_are_refused_before_carving() {
    let cfg = tx::Config {
        mtu: 9000,
        ..tx::Config::default()
    };
    let mut q = common::capture_queue(3, cfg).unwrap();
    let frags = q.cache_stats().frags;
    let r = q.send(&vec![0u8; 5000], &[1u8; 100], Offload::None, 1);
    assert!(
        matches!(
            r,
            Err(Error::BadHeaders {
                why: HeaderFault::TooLong {
                    len: 5000,
                    max: 4096
                },
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(q.cache_stats().frags, frags, "the payload was carved");
    assert_eq!((q.in_flight(), q.stats().mapped_headers), (0, 0));
    // A page of headers fits a header frag.
    q.send(&[0u8; 4096], &[1u8; 100], Offload::None, 2).unwrap();
    assert_eq!(q.stats().header_fallbacks, 1);
}

/// A send refused after its payload was carved gives the frags back; an
/// unmap that fails then is counted in the queue's `unmap_errors`, as at
/// completion (the pool keeps that memory out of use).
#[test]
fn a_failed_unmap_of_a_refused_sends_frags_is_counted() {
    // The first unmap is the completed packet's frag, the second the
    // refused send's first frag.
    let (mut q, _) = common::carved::ring_of_8(FaultyConfig {
        fail_nth: Some((Op::Unmap, 2)),
        ..FaultyConfig::default()
    });
    common::carved::refused_once_carved(&mut q, || {});
    assert_eq!(q.stats().unmap_errors, 1);
    assert_eq!(q.cache().pool().stats().unmap_errors, 1);
}

/// An 82576 queue over order-`order` chunks taking `max_bufs` buffers per
/// packet, cut at `boundary`.
fn igb_queue(
    order: u32,
    max_bufs: usize,
    boundary: Option<usize>,
) -> tx::Queue<Iommu, SoftNic<Iommu>> {
    let (iommu, domain, pool) = parts(order);
    let cfg = tx::Config {
        ring: 256,
        max_bufs,
        boundary,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through the IOMMU the domain maps through.
    unsafe { tx::Queue::new(domain, pool, SoftNic::new(iommu, capture()), cfg) }.unwrap()
}

/// The count is an upper bound, and no looser than it must be where the
/// payload is a whole number of boundaries: six 4 KiB pages cut at 4 KiB
/// take at most seven data buffers wherever the frag starts in its chunk,
/// so with eight buffers per packet the packet is sent, never refused as
/// `TooManyBuffers`.
#[test]
fn a_payload_of_whole_boundaries_that_fits_is_sent() {
    let len = 6 * 4096;
    let tso = Offload::Tso { mss: 1448 };
    let mut q = igb_queue(4, 64, Some(4096));
    let mut worst = 0;
    for (i, pre) in [0usize, 100, 1000, 3000, 4000].into_iter().enumerate() {
        if pre > 0 {
            q.send(&common::tcp_headers(), &vec![1u8; pre], tso, 100 + i as u64)
                .unwrap();
        }
        let before = q.stats().descs;
        q.send(&common::tcp_headers(), &vec![7u8; len], tso, i as u64)
            .unwrap();
        worst = worst.max((q.stats().descs - before) as usize);
    }
    // Context, header and data descriptors: the buffers are all but one.
    assert!(worst - 1 <= 8, "took {} buffers", worst - 1);
    let mut q = igb_queue(4, 8, Some(4096));
    let r = q.send(&common::tcp_headers(), &vec![7u8; len], tso, 1);
    assert!(r.is_ok(), "a packet of at most 8 buffers refused: {r:?}");
}

/// A payload of exactly the 82576's largest buffer (65,535 bytes) in one
/// frag of a 64 KiB chunk is one data buffer: with two buffers per packet
/// (headers and data) it is sent.
#[test]
fn a_payload_of_exactly_the_largest_buffer_is_one_buffer() {
    let mut q = igb_queue(4, 2, None);
    let r = q.send(
        &common::tcp_headers(),
        &vec![7u8; 65535],
        Offload::Tso { mss: 1448 },
        1,
    );
    assert!(r.is_ok(), "refused: {r:?}");
    assert_eq!(q.stats().descs, 3, "context, headers and one data buffer");
}

/// The traffic generator refuses a payload no packet carries before it
/// builds a header or stages a byte: any length is a typed error naming
/// the limit (a length past the address space used to overflow the IPv4
/// length, and a terabyte one to abort on the staging buffer), and the
/// flow does not advance.
#[test]
fn the_generator_refuses_a_payload_too_large_before_staging_it() {
    use vfio_nic::gen::flow::{Flow, HDR_LEN};
    use vfio_nic::gen::Traffic;
    let (iommu, domain, pool) = parts(2);
    let nic = SoftNic::new(iommu, capture());
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let mut q = unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }.unwrap();
    let mut gen = Traffic::new(1, 1448).unwrap();
    let max = q.max_payload();
    for len in [max + 1, 1 << 44, usize::MAX] {
        for copied in [false, true] {
            let r = if copied {
                gen.send_copied(&mut q, 0, len)
            } else {
                gen.send(&mut q, 0, len)
            };
            assert!(
                matches!(r, Err(Error::PayloadTooLarge { len: l, max: m }) if l == len && m == max),
                "{len} copied {copied}: {r:?}"
            );
        }
    }
    assert_eq!((gen.posted(), q.in_flight(), q.stats().packets), (0, 0, 0));
    gen.send_copied(&mut q, 0, 100).unwrap();
    assert_eq!(gen.posted(), 1);
    // A header for any length: the IPv4 length saturates.
    let mut h = [0u8; HDR_LEN];
    Flow::new(0).unwrap().header(usize::MAX, &mut h);
    assert_eq!(u16::from_be_bytes([h[16], h[17]]), u16::MAX);
}

/// `ring_full` counts sends refused for a full ring, one per refused
/// send: asking `room_for` posts nothing and counts nothing, however
/// often it is asked (a caller polling it while it reaps used to count
/// a refused send per poll, and one asked before a refused `send` two).
/// A [`Traffic`](vfio_nic::gen::Traffic) send refused by its own room
/// check is a refused send, and counts.
#[test]
fn a_room_query_counts_no_refused_send() {
    let (iommu, domain, pool) = parts(0);
    let nic = VirtioNet::new(iommu, capture()).unwrap();
    let cfg = tx::Config {
        ring: 8,
        mtu: 9000,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through the IOMMU the domain maps through.
    let mut q = unsafe { tx::Queue::new(domain, pool, nic, cfg) }.unwrap();
    let hdr = [0u8; 14];
    for t in 0..7 {
        q.send(&hdr, &[1u8; 10], Offload::None, t).unwrap();
    }
    assert_eq!(q.free_descs(), 0);
    for _ in 0..3 {
        let r = q.room_for(10, Offload::None);
        assert!(matches!(r, Err(Error::RingFull { .. })), "{r:?}");
    }
    assert_eq!(q.stats().ring_full, 0, "queries are no refused sends");
    let r = q.send(&hdr, &[1u8; 10], Offload::None, 7);
    assert!(matches!(r, Err(Error::RingFull { .. })), "{r:?}");
    assert_eq!(q.stats().ring_full, 1);
    let mut g = vfio_nic::gen::Traffic::new(1, 1448).unwrap();
    let r = g.send(&mut q, 0, 100);
    assert!(matches!(r, Err(Error::RingFull { .. })), "{r:?}");
    assert_eq!(q.stats().ring_full, 2, "the generator's refused send");
}
