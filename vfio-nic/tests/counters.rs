//! A queue's counters stay true: packets freed by a reap that then fails
//! are counted and returned (posted = completed + in flight); every frag
//! whose unmap failed is counted, including those a failed carve gives
//! back; a refused send counts no header frag, and none of its payload
//! frags as handed out; and `since` with its
//! arguments swapped saturates at zero instead of panicking.

mod common;

use std::cell::Cell;
use std::sync::Arc;

use pfrag::dma::{DmaMapper, SoftIommu};
use pfrag::Iova;
use vfio_nic::device::TxDevice;
use vfio_nic::format::igb::Advanced;
use vfio_nic::format::{Buf, Format, Packet, RingMem, Status};
use vfio_nic::model::softnic::{NicStats, SoftNic};
use vfio_nic::offload::{Layout, Offload};
use vfio_nic::{tx, Error};

thread_local! {
    /// How many more `done` calls succeed before one fails (`None`:
    /// never). Per thread: each test drives its own queue.
    static DONE_OK_LEFT: Cell<Option<u32>> = const { Cell::new(None) };
    /// How many more packets `done` reports done before it reports one
    /// with an error status (`None`: never).
    static DONE_BEFORE_ERROR: Cell<Option<u32>> = const { Cell::new(None) };
    /// Whether `publish` fails.
    static PUBLISH_FAILS: Cell<bool> = const { Cell::new(false) };
}

/// The status word of a packet [`FailingDone`] reports with an error.
const BAD_STATUS: u32 = 0xbad;

/// The 82576's format, whose `done` fails once as [`DONE_OK_LEFT`] says,
/// and reports one packet with an error as [`DONE_BEFORE_ERROR`] says;
/// its `publish` fails while [`PUBLISH_FAILS`] says so.
#[derive(Clone, Copy, Debug, Default)]
struct FailingDone;

// SAFETY: every descriptor and status is Advanced's; `done` either fails
// (having read nothing) or answers as Advanced does, an error status
// standing for a packet Advanced says is done; `publish` writes nothing.
unsafe impl Format for FailingDone {
    const NAME: &'static str = "failing done";
    const DESC_SIZE: usize = Advanced::DESC_SIZE;
    const MAX_BUF: usize = Advanced::MAX_BUF;
    const MAX_PAYLOAD: usize = Advanced::MAX_PAYLOAD;
    const STATUS_OFFSET: usize = Advanced::STATUS_OFFSET;
    const HAS_CONTEXT: bool = true;
    const DEFERRED_REPORT: bool = true;
    type Context = <Advanced as Format>::Context;
    fn context(&self, l: &Layout, o: Offload) -> Self::Context {
        Advanced.context(l, o)
    }
    fn write_context(&self, d: &mut [u64], c: &Self::Context) {
        Advanced.write_context(d, c)
    }
    fn write_data(&self, d: &mut [u64], b: Buf, p: &Packet) {
        Advanced.write_data(d, b, p)
    }
    fn ask_report(&self, d: &mut [u64]) {
        Advanced.ask_report(d)
    }
    fn status(&self, w: u32) -> Option<Status> {
        Advanced.status(w)
    }
    fn publish<M: DmaMapper>(&mut self, _: &RingMem<'_, M>, _: u16) -> vfio_nic::Result<()> {
        if PUBLISH_FAILS.get() {
            return Err(Error::NotAttached);
        }
        Ok(())
    }
    fn done<M: DmaMapper>(
        &mut self,
        ring: &RingMem<'_, M>,
        head: u16,
        last: u16,
    ) -> vfio_nic::Result<Option<Status>> {
        match DONE_OK_LEFT.get() {
            Some(0) => {
                DONE_OK_LEFT.set(None);
                return Err(Error::NotAttached);
            }
            left => DONE_OK_LEFT.set(left.map(|n| n - 1)),
        }
        let done = Advanced.done(ring, head, last)?;
        if done.is_none() {
            return Ok(None);
        }
        match DONE_BEFORE_ERROR.get() {
            Some(0) => {
                DONE_BEFORE_ERROR.set(None);
                Ok(Some(Status::Error(BAD_STATUS)))
            }
            left => {
                DONE_BEFORE_ERROR.set(left.map(|n| n - 1));
                Ok(done)
            }
        }
    }
}

type Soft = Arc<SoftIommu>;

/// The software NIC (which reads the 82576's descriptors), declaring
/// [`FailingDone`].
struct Dev(SoftNic<Soft>);

impl TxDevice for Dev {
    type Format = FailingDone;
    fn format(&self) -> FailingDone {
        FailingDone
    }
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> vfio_nic::Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.0.attach(ring, len) }
    }
    unsafe fn kick(&mut self, tail: u16) -> vfio_nic::Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.0.kick(tail) }
    }
}

/// A queue reporting every packet, with three packets of one frag each
/// posted (tokens 1, 2, 3) and handed to the device.
fn three_sent() -> tx::Queue<Soft, Dev> {
    let (domain, pool, nic) = common::capture_parts(0);
    let cfg = tx::Config {
        ring: 16,
        report_every: 1,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through the IOMMU the domain maps
    // through.
    let mut q = unsafe { tx::Queue::new(domain, pool, Dev(nic), cfg) }.unwrap();
    for t in 1..=3 {
        q.send(&[0u8; 14], &[1u8; 300], Offload::None, t).unwrap();
    }
    q.kick().unwrap();
    q
}

/// A reap whose report reading fails after some packets were freed
/// returns their count, counts them as completed, and has handed over
/// their tokens: posted = completed + in flight. The next reap reads the
/// report again and frees the rest.
#[test]
fn a_reap_that_fails_after_freeing_packets_counts_and_returns_them() {
    let mut q = three_sent();
    // The first report is read, the second fails.
    DONE_OK_LEFT.set(Some(1));
    let mut out = Vec::new();
    assert_eq!(q.reap_tokens(&mut out).unwrap(), 1);
    assert_eq!(out, [1]);
    let s = q.stats();
    assert_eq!((s.completed, q.in_flight(), s.packets), (1, 2, 3));
    assert_eq!(q.reap_tokens(&mut out).unwrap(), 2);
    assert_eq!(out, [1, 2, 3]);
    assert_eq!(q.stats().completed, 3);
}

/// A reap whose first report reading fails returns the error and changes
/// nothing: no token, no count, every packet still in flight.
#[test]
fn a_reap_that_fails_before_freeing_anything_changes_nothing() {
    let mut q = three_sent();
    DONE_OK_LEFT.set(Some(0));
    let mut out = Vec::new();
    let r = q.reap_tokens(&mut out);
    assert!(matches!(r, Err(Error::NotAttached)), "{r:?}");
    assert!(out.is_empty());
    assert_eq!((q.stats().completed, q.in_flight()), (0, 3));
    assert_eq!(q.reap_tokens(&mut out).unwrap(), 3);
    assert_eq!(out, [1, 2, 3]);
}

/// A report with an error status ends the batch of packets a reap frees
/// as its last packet, counted once in `device_errors`, and the reports
/// after it that the device has written are reaped in the same call.
#[test]
fn a_packet_reported_with_an_error_completes_with_it_and_the_rest_follow() {
    // The software NIC sends all three inside the doorbell.
    let mut q = three_sent();
    DONE_BEFORE_ERROR.set(Some(1));
    let mut out = Vec::new();
    assert_eq!(q.reap_completions(&mut out).unwrap(), 3);
    let got: Vec<_> = out.iter().map(|c| (c.token, c.status)).collect();
    let want = [
        (1, Status::Ok),
        (2, Status::Error(BAD_STATUS)),
        (3, Status::Ok),
    ];
    assert_eq!(got, want);
    let s = q.stats();
    assert_eq!((s.device_errors, s.completed, q.in_flight()), (1, 3, 0));
    // A reap after it finds nothing and counts nothing again.
    assert_eq!(q.reap_completions(&mut out).unwrap(), 0);
    assert_eq!(q.stats().device_errors, 1);
}

/// `tx::Stats::since` with the later counters as `earlier` gives zeros,
/// not a panic (or, in a release build, wrapped numbers).
#[test]
fn queue_stats_since_with_the_arguments_swapped_is_zero() {
    let mut q = common::capture_queue(0, tx::Config::default()).unwrap();
    let before = q.stats();
    q.send(&[0u8; 14], &[1u8; 300], Offload::None, 1).unwrap();
    let after = q.stats();
    assert_eq!(before.since(&after), tx::Stats::default());
    assert_eq!(after.since(&before).packets, 1);
}

/// The software NIC's `NicStats::since` saturates the same way.
#[test]
fn nic_stats_since_with_the_arguments_swapped_is_zero() {
    let mut q = common::capture_queue(0, tx::Config::default()).unwrap();
    let before = q.device().stats();
    q.send(&[0u8; 14], &[1u8; 300], Offload::None, 1).unwrap();
    q.kick().unwrap();
    q.wait(common::WAIT).unwrap();
    let after = q.device().stats();
    assert_eq!(before.since(&after), NicStats::default());
    assert_eq!(after.since(&before).frames, 1);
}

/// The software NIC counts every frame it puts on the wire at least the
/// 64-byte Ethernet minimum on its own: a TSO packet whose last segment
/// carries a few bytes pays a whole minimum frame for it, not a share of
/// the packet's.
#[test]
fn wire_bytes_pad_each_segment_to_the_minimum_frame() {
    let q = common::capture_queue(4, tx::Config::default()).unwrap();
    let mut q = common::Gen::new(q, 1);
    // One full segment and 1, 2 or 6 bytes more (54 header bytes: frames
    // of 59, 60 and 64 bytes with the FCS), and two full segments.
    let plan = [(0, 1449), (0, 1450), (0, 1454), (0, 2 * 1448)];
    q.send_all(&plan);
    let st = q.device().stats();
    let frames = q.take_frames();
    assert_eq!(frames.len(), 8, "{st:?}");
    // A captured frame has its headers and payload, without the FCS.
    let lens: Vec<usize> = frames.iter().map(Vec::len).collect();
    assert_eq!(lens, [1502, 55, 1502, 56, 1502, 60, 1502, 1502]);
    let want: u64 = lens.iter().map(|&l| (l as u64 + 4).max(64)).sum();
    assert_eq!(st.wire_bytes, want, "{st:?}");
    assert_eq!(st.frames, 8);
}

/// `Stats::unmap_errors` counts every frag whose unmap failed, as the
/// pool does: a refused send that gives back seven frags whose unmaps all
/// fail counts seven, and a reap that frees a packet of three such frags
/// three.
#[test]
fn every_failed_frag_unmap_is_counted() {
    use pfrag::dma::FaultyConfig;
    let (mut q, m) = common::carved::ring_of_8(FaultyConfig {
        unmap_rate: 1.0,
        ..FaultyConfig::default()
    });
    let errors = |q: &common::carved::FaultyQueue| {
        (
            q.stats().unmap_errors,
            q.cache().pool().stats().unmap_errors,
        )
    };
    // The first frame's unmap succeeds; every one after fails. The 7
    // frags of the send refused once carved go back.
    m.arm(false);
    common::carved::refused_once_carved(&mut q, || m.arm(true));
    assert_eq!(errors(&q), (7, 7), "one per frag given back");
    // Three pages of payload: three frags, one per fresh chunk.
    let hdr = [0u8; 14];
    q.send(&hdr, &[1u8; 3 * 4096], Offload::None, 3).unwrap();
    q.kick().unwrap();
    assert_eq!(q.wait(common::WAIT).unwrap(), 1);
    assert_eq!(errors(&q), (10, 10), "one per frag completed");
}

/// A send whose publish fails after its header went into a frag of its
/// own (too long for a bounce slot) counts no mapped header and no
/// fallback, and gives the frag back; once publishing works, the same
/// send counts one of each.
#[test]
fn a_header_frag_is_counted_only_once_its_packet_is_posted() {
    let (domain, pool, nic) = common::capture_parts(0);
    // SAFETY: the model translates through the IOMMU the domain maps
    // through.
    let mut q = unsafe { tx::Queue::new(domain, pool, Dev(nic), tx::Config::default()) }.unwrap();
    let long = [0u8; 1024];
    let frags = q.cache_stats().frags;
    PUBLISH_FAILS.set(true);
    let r = q.send(&long, &[1u8; 300], Offload::None, 1);
    PUBLISH_FAILS.set(false);
    assert!(matches!(r, Err(Error::NotAttached)), "{r:?}");
    let st = q.stats();
    assert_eq!(q.in_flight(), 0, "nothing posted");
    assert_eq!((st.mapped_headers, st.header_fallbacks), (0, 0), "{st:?}");
    assert_eq!(st.packets, 0, "{st:?}");
    q.send(&long, &[1u8; 300], Offload::None, 2).unwrap();
    let st = q.stats();
    assert_eq!((st.mapped_headers, st.header_fallbacks), (1, 1), "{st:?}");
    assert!(q.cache_stats().frags > frags, "the header took a frag");
}

/// A send refused while its payload is being carved gives back the frags
/// carved so far; each whose unmap fails is counted by the queue too, not
/// only by the pool. Three pages of payload, three frags carved one by
/// one: the third's map fails, so the first two go back, and both of
/// their unmaps fail.
#[test]
fn frags_given_back_by_a_carve_that_fails_are_counted() {
    use pfrag::dma::{FaultyConfig, Op};
    // How many maps the queue's own setup makes, on a queue that fails
    // nothing.
    let (q, m) = common::carved::ring_of_8(FaultyConfig::default());
    let setup = m.stats_injected().map_calls;
    drop(q);
    let (mut q, m) = common::carved::ring_of_8(FaultyConfig {
        unmap_rate: 1.0,
        fail_nth: Some((Op::Map, setup + 3)),
        ..FaultyConfig::default()
    });
    let r = q.send(&[0u8; 14], &[1u8; 3 * 4096], Offload::None, 1);
    assert!(
        matches!(r, Err(Error::Pool(pfrag::Error::Map { .. }))),
        "{r:?}"
    );
    assert_eq!(m.stats_injected().maps, 1, "the third frag's map failed");
    assert_eq!(q.in_flight(), 0, "nothing posted");
    let st = q.stats();
    assert_eq!((st.packets, st.descs, st.mem_backoffs), (0, 0, 0), "{st:?}");
    assert_eq!(q.cache().pool().stats().unmap_errors, 2, "the pool's count");
    assert_eq!(st.unmap_errors, 2, "one per frag given back");
}

/// A send refused once its payload was carved gives each frag back to
/// the cache it came from, which counts it as never handed out (its
/// bytes, which the cache's cursor passed, count as waste), as a carve
/// that fails part-way does: the caches' counters then hold the payload
/// of the packets sent and no more. Payloads up to the split (the
/// order-0 cache) and past it (the queue's cache, two frags), refused by
/// a publish that fails; and a payload refused as too large for the ring
/// once its frags showed it.
#[test]
fn a_refused_send_counts_none_of_its_frags_as_handed_out() {
    let (domain, pool, nic) = common::capture_parts(2);
    let cfg = tx::Config {
        mtu: u16::MAX,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through the IOMMU the domain maps
    // through.
    let mut q = unsafe { tx::Queue::new(domain, pool, Dev(nic), cfg) }.unwrap();
    assert!(q.small_cache().is_some());
    let hdr = [0u8; 14];
    for (t, len) in [300usize, 4096, 4097, 20_000].into_iter().enumerate() {
        let before = q.cache_stats();
        PUBLISH_FAILS.set(true);
        let r = q.send(&hdr, &vec![1u8; len], Offload::None, t as u64);
        PUBLISH_FAILS.set(false);
        assert!(matches!(r, Err(Error::NotAttached)), "{len}: {r:?}");
        let after = q.cache_stats();
        assert_eq!(
            (after.frags, after.bytes),
            (before.frags, before.bytes),
            "{len}"
        );
        assert!(
            after.waste_bytes >= before.waste_bytes + len as u64,
            "{len}: {after:?}"
        );
        q.send(&hdr, &vec![1u8; len], Offload::None, t as u64)
            .unwrap();
        assert_eq!(q.cache_stats().bytes, q.stats().bytes, "{len}");
    }
    // Seven frags carved, then refused as too large for the ring.
    let (mut q, _) = common::carved::ring_of_8(pfrag::dma::FaultyConfig::default());
    common::carved::refused_once_carved(&mut q, || {});
    let (cache, st) = (q.cache_stats(), q.stats());
    assert_eq!(
        (cache.frags, cache.bytes),
        (st.packets, st.bytes),
        "{cache:?}"
    );
}

/// A device whose attach fails and that cannot be stopped either.
struct Stuck(SoftNic<Arc<SoftIommu>>);

impl TxDevice for Stuck {
    type Format = Advanced;
    fn format(&self) -> Advanced {
        Advanced
    }
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> vfio_nic::Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.0.attach(ring, len) }?;
        Err(Error::NotAttached)
    }
    unsafe fn kick(&mut self, _: u16) -> vfio_nic::Result<()> {
        Err(Error::NotAttached)
    }
    fn detach(&mut self) -> vfio_nic::Result<()> {
        Err(Error::NotAttached)
    }
}

/// A queue whose device took its ring and then could neither attach nor be
/// stopped keeps the ring allocated and mapped for good, and counts it
/// with the domain's pinned memory, as a ring whose unmap failed is.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps a ring allocated for good on purpose, which Miri's leak check reports"
)]
fn a_ring_kept_for_a_device_that_cannot_be_stopped_is_counted() {
    use pfrag::dma::{Domain, SoftIommuConfig};
    use pfrag::pool::{self, Policy, Pool};
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(pfrag::Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let dev = Stuck(SoftNic::new(iommu, Default::default()));
    let cfg = tx::Config::default();
    // SAFETY: the model translates through the IOMMU the domain maps
    // through.
    let r = unsafe { tx::Queue::new(domain.clone(), pool, dev, cfg) };
    assert!(matches!(r, Err(Error::NotAttached)), "{r:?}");
    let ring = (usize::from(cfg.ring) * Advanced::DESC_SIZE).next_multiple_of(4096);
    assert_eq!(domain.pinned().host_bytes, ring as u64);
}
