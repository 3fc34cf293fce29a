//! The bounds a caller checks without a queue are the queue's own: a packet
//! at the largest payload each lets through is sent, one byte more is
//! refused by `send` with the same error, before anything is allocated, on
//! either format, with or without a context descriptor or a boundary. The
//! descriptors against the ring (`tx::Config::check_fits`,
//! `descs_at_least`: `PacketTooLarge`), the buffers against the device's
//! limit (`tx::Config::check_bufs`, `bufs_at_most`: `TooManyBuffers`) and
//! the payload against the format's and the pool's limit
//! (`tx::check_payload`, `tx::max_payload`: `PayloadTooLarge`).

mod common;

use std::sync::Arc;

use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::device::TxDevice;
use vfio_nic::format::igb::Advanced;
use vfio_nic::format::virtio::Split;
use vfio_nic::model::null::NullNic;
use vfio_nic::model::softnic;
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::offload::Offload;
use vfio_nic::{tx, Error};

type Iommu = Arc<SoftIommu>;

const TSO: Offload = Offload::Tso { mss: 1448 };

/// Queue settings: a ring of `ring`, payloads fit whole into chunks of the
/// queue's pool (no size-class split), cut at `boundary`, any frame length.
fn config(ring: u16, boundary: Option<usize>) -> tx::Config {
    tx::Config {
        ring,
        boundary,
        split: None,
        mtu: u16::MAX,
        ..tx::Config::default()
    }
}

/// The largest payload `fits` lets through: found by bisection over the
/// function alone.
fn largest_fitting(cfg: &tx::Config, order: Order, offload: Offload, fits: Fit) -> usize {
    let (mut lo, mut hi) = (1usize, 1 << 20);
    assert!(fits(cfg, order, 1, offload).is_ok());
    assert!(fits(cfg, order, hi, offload).is_err());
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(cfg, order, mid, offload).is_ok() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// `tx::Config::check_fits` on one format.
type Fit = fn(&tx::Config, Order, usize, Offload) -> vfio_nic::Result<usize>;

/// Builds a queue of `cfg` over a fresh pool of `order` chunks on the
/// device `make` builds, for each send: the first packet of a queue always
/// needs its context descriptor, as `check_fits` counts.
fn fresh<D: TxDevice>(
    cfg: tx::Config,
    order: Order,
    make: &dyn Fn(Iommu) -> D,
) -> tx::Queue<Iommu, D> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::new(domain.clone(), pool::Config::new(order, Policy::Persistent)).unwrap();
    // SAFETY: every device here translates through `iommu`, which the
    // domain maps through.
    unsafe { tx::Queue::new(domain, pool, make(iommu), cfg) }.unwrap()
}

/// The queue agrees with `check_fits` at its edge: the largest payload it
/// lets through takes exactly the ring's capacity and is sent; one byte
/// more is refused by `send` with the error `check_fits` gives. Returns
/// that payload.
fn agrees<D: TxDevice>(
    cfg: tx::Config,
    order: Order,
    offload: Offload,
    fits: Fit,
    make: &dyn Fn(Iommu) -> D,
) -> usize {
    let len = largest_fitting(&cfg, order, offload, fits);
    let hdr = common::tcp_headers();
    assert_eq!(fits(&cfg, order, len, offload).unwrap(), cfg.capacity());
    let mut q = fresh(cfg, order, make);
    q.send(&hdr, &vec![7u8; len], offload, 1)
        .unwrap_or_else(|e| panic!("{len} bytes, at the bound, refused: {e}"));
    assert_eq!(q.stats().descs, cfg.capacity() as u64, "{len} bytes");

    let past = fits(&cfg, order, len + 1, offload).unwrap_err();
    assert!(
        matches!(past, Error::PacketTooLarge { needed, capacity }
            if needed == cfg.capacity() + 1 && capacity == cfg.capacity()),
        "{past:?}"
    );
    let mut q = fresh(cfg, order, make);
    let chunks = q.cache().pool().stats().chunks;
    match q.send(&hdr, &vec![7u8; len + 1], offload, 2) {
        Err(e @ Error::PacketTooLarge { .. }) => assert_eq!(e.to_string(), past.to_string()),
        other => panic!("{} bytes, past the bound: {other:?}", len + 1),
    }
    // Refused before anything was allocated.
    assert_eq!(q.cache().pool().stats().chunks, chunks, "the pool grew");
    assert_eq!(q.in_flight(), 0);
    len
}

fn igb(cfg: &tx::Config, order: Order, len: usize, offload: Offload) -> vfio_nic::Result<usize> {
    cfg.check_fits::<Advanced>(order, len, offload)
}

fn virtio(cfg: &tx::Config, order: Order, len: usize, offload: Offload) -> vfio_nic::Result<usize> {
    cfg.check_fits::<Split>(order, len, offload)
}

fn order(o: u32) -> Order {
    Order::new(o).unwrap()
}

/// On the 82576's format with 4 KiB chunks and a ring of 8 (7
/// descriptors): without an offload, the header and six pages of payload
/// fit, a byte more does not.
#[test]
fn igb_without_context_at_and_past_the_bound() {
    let len = agrees(config(8, None), order(0), Offload::None, igb, &NullNic::new);
    assert_eq!(len, 6 * 4096);
    assert_eq!(config(8, None).descs_at_least::<Advanced>(order(0), len), 7);
}

/// With TSO the first packet takes a context descriptor too: one page
/// fewer fits.
#[test]
fn igb_with_context_at_and_past_the_bound() {
    let len = agrees(config(8, None), order(0), TSO, igb, &NullNic::new);
    assert_eq!(len, 5 * 4096);
    let len = agrees(config(32, None), order(1), TSO, igb, &NullNic::new);
    assert_eq!(len, 29 * 8192);
}

/// A boundary cuts each 8 KiB chunk's frag in two: the bound counts the
/// pieces, as the queue writes them.
#[test]
fn igb_with_a_boundary_at_and_past_the_bound() {
    let nic = |m| softnic::SoftNic::new(m, softnic::Config::default());
    let len = agrees(config(8, Some(4096)), order(1), TSO, igb, &nic);
    assert_eq!(len, 5 * 4096);
}

/// virtio-net keeps no context: TSO costs no descriptor.
#[test]
fn virtio_at_and_past_the_bound() {
    let nic = |m| VirtioNet::new(m, softnic::Config::default()).unwrap();
    let len = agrees(config(8, None), order(0), TSO, virtio, &nic);
    assert_eq!(len, 6 * 4096);
}

/// The queue agrees with `check_bufs` at its edge: the largest payload it
/// lets through takes at most `max_bufs` buffers and is sent; one byte more
/// is refused by `send` with the `TooManyBuffers` `check_bufs` gives,
/// before any chunk is taken. Returns that payload.
fn bufs_agree<D: TxDevice>(
    cfg: tx::Config,
    order: Order,
    offload: Offload,
    bufs: Fit,
    make: &dyn Fn(Iommu) -> D,
) -> usize {
    let len = largest_fitting(&cfg, order, offload, bufs);
    let hdr = common::tcp_headers();
    assert!(bufs(&cfg, order, len, offload).unwrap() <= cfg.max_bufs);
    let mut q = fresh(cfg, order, make);
    q.send(&hdr, &vec![7u8; len], offload, 1)
        .unwrap_or_else(|e| panic!("{len} bytes, within the buffers, refused: {e}"));

    let past = bufs(&cfg, order, len + 1, offload).unwrap_err();
    assert!(
        matches!(past, Error::TooManyBuffers { needed, max }
            if needed > cfg.max_bufs && max == cfg.max_bufs),
        "{past:?}"
    );
    let mut q = fresh(cfg, order, make);
    let chunks = q.cache().pool().stats().chunks;
    match q.send(&hdr, &vec![7u8; len + 1], offload, 2) {
        Err(e @ Error::TooManyBuffers { .. }) => assert_eq!(e.to_string(), past.to_string()),
        other => panic!("{} bytes, past the buffers: {other:?}", len + 1),
    }
    assert_eq!(q.cache().pool().stats().chunks, chunks, "the pool grew");
    assert_eq!(q.in_flight(), 0);
    len
}

fn igb_bufs(cfg: &tx::Config, order: Order, len: usize, _: Offload) -> vfio_nic::Result<usize> {
    cfg.check_bufs::<Advanced>(order, len)
}

fn virtio_bufs(cfg: &tx::Config, order: Order, len: usize, _: Offload) -> vfio_nic::Result<usize> {
    cfg.check_bufs::<Split>(order, len)
}

/// The 82576 over 4 KiB chunks, 64 buffers a packet: the header and 63
/// pages fit, a byte more does not, well within a ring of 256; its largest
/// payload takes 65.
#[test]
fn igb_buffers_at_and_past_the_limit() {
    let cfg = config(256, None);
    let len = bufs_agree(cfg, order(0), TSO, igb_bufs, &NullNic::new);
    assert_eq!(len, 63 * 4096);
    assert_eq!(cfg.bufs_at_most::<Advanced>(order(0), len), 64);
    assert!(matches!(
        igb_bufs(&cfg, order(0), 262_143, TSO),
        Err(Error::TooManyBuffers {
            needed: 65,
            max: 64
        })
    ));
    // The ring would hold it: only the buffers refuse it.
    assert_eq!(igb(&cfg, order(0), 262_143, TSO).unwrap(), 66);
}

/// Without fit-whole the first bytes may go in the carved chunk's tail:
/// one frag more, so one page fewer fits 8 buffers.
#[test]
fn igb_buffers_without_fit_whole() {
    let cfg = tx::Config {
        fit_whole: false,
        max_bufs: 8,
        ..config(16, None)
    };
    let len = bufs_agree(cfg, order(0), TSO, igb_bufs, &NullNic::new);
    assert_eq!(len, 6 * 4096);
}

/// virtio-net with its buffers cut at 1 KiB: the cuts count too.
#[test]
fn virtio_buffers_with_a_boundary() {
    let nic = |m| VirtioNet::new(m, softnic::Config::default()).unwrap();
    let cfg = config(256, Some(1024));
    let len = bufs_agree(cfg, order(0), TSO, virtio_bufs, &nic);
    // 50 KiB: the header, 13 chunks' frags, 49 cuts at 1 KiB and one for a
    // frag that may start off one.
    assert_eq!(len, 50 * 1024);
    assert_eq!(cfg.bufs_at_most::<Split>(order(0), len), 64);
}

/// The queue's payload limit for TCP/IPv4 headers under TSO is
/// `tx::max_payload_with` of its format, pool and those headers: a payload
/// at it is sent, one byte more is refused by `send` with
/// `PayloadTooLarge` naming it (past the limit for any headers too),
/// before any chunk is taken. It is at most the limit for any headers,
/// `tx::max_payload`, past which `check_payload` refuses. Returns both
/// limits (any headers, these headers).
fn payload_agrees<D: TxDevice>(order: Order, make: &dyn Fn(Iommu) -> D) -> (usize, usize) {
    let pool = pool::Config::new(order, Policy::Persistent);
    let hdr = common::tcp_headers();
    let max = tx::max_payload_with::<D::Format>(&pool, &hdr, TSO).unwrap();
    let any = tx::max_payload::<D::Format>(&pool);
    let cfg = config(256, None);
    let mut q = fresh(cfg, order, make);
    assert_eq!(
        (q.max_payload(), q.max_payload_with(&hdr, TSO).unwrap()),
        (any, max)
    );
    assert!(max <= any);
    q.send(&hdr, &vec![7u8; max], TSO, 1)
        .unwrap_or_else(|e| panic!("{max} bytes, at the limit, refused: {e}"));

    // Past the limit for any headers too, the limit for these headers is
    // named: the one a retry must meet.
    for len in [max + 1, any + 1] {
        let mut q = fresh(cfg, order, make);
        let chunks = q.cache().pool().stats().chunks;
        match q.send(&hdr, &vec![7u8; len], TSO, 2) {
            Err(Error::PayloadTooLarge { len: l, max: m }) if l == len && m == max => {}
            other => panic!("{len} bytes, past the limit {max}: {other:?}"),
        }
        assert_eq!(q.cache().pool().stats().chunks, chunks, "the pool grew");
    }
    let past = tx::check_payload::<D::Format>(&pool, any + 1).unwrap_err();
    assert!(
        matches!(past, Error::PayloadTooLarge { len, max: m } if len == any + 1 && m == any),
        "{past:?}"
    );
    tx::check_payload::<D::Format>(&pool, any).unwrap();
    (any, max)
}

/// The 82576 carries 18 bits of PAYLEN whatever the headers; virtio-net a
/// 64 KiB packet, and under TSO one IPv4 packet: its 16-bit total length
/// counts the 20-byte IPv4 and TCP headers too.
#[test]
fn payload_limits_per_format() {
    assert_eq!(payload_agrees(order(4), &NullNic::new), (262_143, 262_143));
    let nic = |m| VirtioNet::new(m, softnic::Config::default()).unwrap();
    assert_eq!(payload_agrees(order(0), &nic), (65_535, 65_495));
    // A pool's smaller limit wins.
    let small = pool::Config {
        max_payload: 1000,
        ..pool::Config::new(order(0), Policy::Persistent)
    };
    assert_eq!(tx::max_payload::<Advanced>(&small), 1000);
    assert_eq!(tx::max_payload::<Split>(&small), 1000);
    let hdr = common::tcp_headers();
    assert_eq!(
        tx::max_payload_with::<Split>(&small, &hdr, TSO).unwrap(),
        1000
    );
    // Headers the offload cannot use are the send's typed error.
    assert!(matches!(
        tx::max_payload_with::<Split>(&small, &hdr[..40], TSO),
        Err(Error::BadHeaders { .. })
    ));
}

/// The generator's limit is carried whatever its MSS: a payload up to the
/// MSS goes as one frame, where the whole frame counts, so with an MSS of
/// 65,535 on virtio-net the limit is one frame's (65,481 bytes after 54
/// of headers), not TSO's 65,495, which was then refused. The limit is
/// sent, one byte more refused by the generator with that limit.
#[test]
fn the_generators_limit_is_sent_at_any_mss() {
    let cfg = config(256, None);
    let nic = |m| {
        let c = softnic::Config {
            verify: false,
            ..softnic::Config::default()
        };
        VirtioNet::new(m, c).unwrap()
    };
    for (mss, want) in [
        (1448, 65_495),
        (65_480, 65_495),
        (65_481, 65_481),
        (u16::MAX, 65_481),
    ] {
        let mut q = fresh(cfg, order(4), &nic);
        let mut g = vfio_nic::gen::Traffic::new(1, mss).unwrap();
        let max = g.max_payload(&q);
        assert_eq!(max, want, "mss {mss}");
        let r = g.send(&mut q, 0, max + 1);
        assert!(
            matches!(r, Err(Error::PayloadTooLarge { len, max: m }) if len == max + 1 && m == max),
            "mss {mss}: {r:?}"
        );
        g.send(&mut q, 0, max)
            .unwrap_or_else(|e| panic!("mss {mss}: {max} bytes refused: {e}"));
    }
}

/// The same on the 82576: a payload up to the MSS goes as one frame, whose
/// 16-bit IPv4 length bounds it (65,495 bytes after 40 of IPv4 and TCP
/// headers), and past the MTU a segment of that MSS is no frame the queue
/// sends: the generator refuses what does not go before it carves
/// anything.
#[test]
fn the_generators_82576_limit_is_sent_at_any_mss() {
    let nic = |m| {
        let c = softnic::Config {
            verify: false,
            ..softnic::Config::default()
        };
        softnic::SoftNic::new(m, c)
    };
    for (mtu, mss, want) in [
        (u16::MAX, 1448, 262_143),
        (u16::MAX, 65_495, 65_495),
        (u16::MAX, u16::MAX, 65_495),
        // Segments of 1,460 bytes pass an MTU of 1,500: one frame at most.
        (1500, 1461, 1460),
    ] {
        let cfg = tx::Config {
            mtu,
            ..config(256, None)
        };
        let mut q = fresh(cfg, order(4), &nic);
        let mut g = vfio_nic::gen::Traffic::new(1, mss).unwrap();
        let max = g.max_payload(&q);
        assert_eq!(max, want, "mtu {mtu}, mss {mss}");
        let chunks = q.cache().pool().stats().chunks;
        let r = g.send(&mut q, 0, max + 1);
        assert!(
            matches!(r, Err(Error::PayloadTooLarge { len, max: m }) if len == max + 1 && m == max),
            "mss {mss}: {r:?}"
        );
        assert_eq!(q.cache().pool().stats().chunks, chunks, "nothing carved");
        g.send(&mut q, 0, max)
            .unwrap_or_else(|e| panic!("mtu {mtu}, mss {mss}: {max} bytes refused: {e}"));
    }
    // The queue's own send says the same of one checksummed frame.
    let mut q = fresh(config(256, None), order(4), &nic);
    let mut h = [0u8; vfio_nic::gen::flow::HDR_LEN];
    vfio_nic::gen::flow::Flow::new(0)
        .unwrap()
        .header(65_496, &mut h);
    for len in [65_496, 262_100] {
        let r = q.send(&h, &vec![0; len], Offload::Checksum, 1);
        assert!(
            matches!(r, Err(Error::PayloadTooLarge { len: l, max: 65_495 }) if l == len),
            "{len}: {r:?}"
        );
    }
}

/// Settings a queue refuses (`Queue::new`'s `BadConfig`) are refused by
/// the checks made without a queue too, with the same error, and the
/// bounds themselves never panic or wrap on them: a ring of 0, a boundary
/// of 0 or 1, any payload length.
#[test]
fn settings_no_queue_takes_are_refused_without_a_queue_too() {
    let bad = [
        config(0, None),
        config(12, None),
        config(8, Some(0)),
        config(8, Some(1)),
        tx::Config {
            max_bufs: 1,
            ..config(8, None)
        },
    ];
    for cfg in bad {
        let refused = |r: vfio_nic::Result<usize>| matches!(r, Err(Error::BadConfig { .. }));
        assert!(refused(igb(&cfg, order(0), 100, TSO)), "{cfg:?}");
        assert!(refused(igb_bufs(&cfg, order(0), 100, TSO)), "{cfg:?}");
        for len in [0, 1, 4096, usize::MAX] {
            let _ = cfg.capacity();
            let _ = cfg.descs_at_least::<Advanced>(order(0), len);
            let _ = cfg.bufs_at_most::<Split>(order(0), len);
        }
    }
    assert_eq!(config(0, None).capacity(), 0);
    let one = config(8, Some(1));
    assert_eq!(one.descs_at_least::<Advanced>(order(0), 10), 11);
    assert_eq!(
        one.descs_at_least::<Advanced>(order(0), usize::MAX),
        usize::MAX
    );
    assert_eq!(
        one.bufs_at_most::<Advanced>(order(0), usize::MAX),
        usize::MAX
    );
}
