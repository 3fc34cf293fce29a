//! A TX queue for a driver's own packets: headers go into the bounce ring
//! (or their own mapping), payloads into pfrag frags (copied by
//! [`Queue::send`], or filled by the caller and posted zero-copy with
//! [`Queue::post`]); the queue writes its device's descriptor format
//! ([`Format`]): a context descriptor for the offloads ([`Offload`]) where
//! the format keeps one, a prefix such as virtio's header, and data
//! descriptors, into a coherent ring, and reaps completions the format's
//! way (a `DD` write-back, a used ring), handing back each packet's token
//! and freeing its frags in bursts.
//!
//! ```
//! use std::sync::Arc;
//! use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
//! use pfrag::pool::{self, Policy, Pool};
//! use pfrag::Order;
//! use vfio_nic::offload::Offload;
//! use vfio_nic::model::softnic::{self, SoftNic};
//! use vfio_nic::tx::{Config, Queue};
//!
//! let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default())?);
//! let domain = Arc::new(Domain::new(iommu.clone()));
//! let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(3)?, Policy::Persistent))?;
//! let nic = SoftNic::new(iommu, softnic::Config { verify: false, capture: true, ..Default::default() });
//! // SAFETY: the model translates through `iommu`, which `domain` maps
//! // through: the device sees the domain's mappings.
//! let mut q = unsafe { Queue::new(domain, pool, nic, Config::default()) }?;
//!
//! // Ethernet + IPv4 + UDP headers, built with etherparse; the NIC fills
//! // in both checksums.
//! let payload = b"hello from a driver";
//! let mut headers = Vec::new();
//! etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
//!     .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
//!     .udp(4000, 5000)
//!     .write(&mut headers, payload)?;
//! headers.truncate(42);
//! q.send(&headers, payload, Offload::Checksum, 7)?; // token 7
//! q.kick()?;
//! let mut done = Vec::new();
//! while done.is_empty() {
//!     q.reap_tokens(&mut done)?;
//! }
//! assert_eq!(done, [7]);
//! let frame = &q.take_frames()[0];
//! assert_eq!(&frame[42..], payload);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The queue is generic over the device ([`TxDevice`]) and the mapper, so
//! the hot path has no indirect calls.

mod burst;
mod config;
mod detach;
mod header;
mod inflight;
mod reap;
mod room;
mod send;
mod split;

use std::mem::ManuallyDrop;
use std::sync::Arc;

use pfrag::bounce;
use pfrag::dma::{Coherent, Dir, DmaMapper, Domain};
use pfrag::frag::{Frag, FragCache};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order};

use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::format::{Format, RingMem, Status};

pub use crate::offload::Offload;
pub use burst::TxPacket;
use config::check_config;
pub use config::{Backoff, Config, HeaderMode};
pub use detach::IntoDeviceError;
pub use room::{check_payload, max_payload, max_payload_with};

/// Room for one descriptor's words: formats of up to 64 bytes.
const MAX_DESC_WORDS: usize = 8;

/// The format of the descriptors a queue over device `D` writes.
type Fmt<D> = <D as TxDevice>::Format;
/// The offload state that format's device keeps.
type FmtContext<D> = <Fmt<D> as Format>::Context;

/// The data descriptors one buffer takes: pieces of at most `max` bytes
/// (the format's largest buffer) that cross no multiple of `boundary`.
fn pieces(
    iova: Iova,
    len: usize,
    max: usize,
    boundary: Option<usize>,
) -> impl Iterator<Item = (Iova, usize)> {
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let at = iova.offset(done as u64);
        let mut n = (len - done).min(max);
        if let Some(b) = boundary {
            n = n.min(b - (at.raw() as usize & (b - 1)));
        }
        done += n;
        Some((at, n))
    })
}

/// Counters of a queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Packets posted.
    pub packets: u64,
    /// Payload bytes posted.
    pub bytes: u64,
    /// Descriptors written.
    pub descs: u64,
    /// Packets completed and reaped.
    pub completed: u64,
    /// Headers that went to their own mapping because no bounce slot fit.
    pub header_fallbacks: u64,
    /// Headers mapped on their own (including fallbacks).
    pub mapped_headers: u64,
    /// Sends refused because the ring was full ([`Error::RingFull`]), one
    /// per refused send; a [`room_for`](Queue::room_for) query counts
    /// nothing.
    pub ring_full: u64,
    /// Frags whose unmap failed, one per frag: payload frags freed by a
    /// reap or given back by a refused send, and header frags.
    pub unmap_errors: u64,
    /// Sends refused because the pool hit a memory limit.
    pub mem_backoffs: u64,
    /// Packets the device completed with an error flag set
    /// ([`Status::Error`]).
    pub device_errors: u64,
    /// Packets sent inline: headers and payload in one bounce slot, one
    /// data descriptor, no frag.
    pub inline_packets: u64,
    /// Offloaded packets that needed no context descriptor (the device
    /// already held the same context).
    pub contexts_skipped: u64,
}

impl Stats {
    /// `self - earlier`, field by field: the work done in between. A
    /// field that is smaller in `self` (the arguments swapped, or counters
    /// of another queue) gives 0: the subtraction saturates.
    pub fn since(&self, earlier: &Stats) -> Stats {
        Stats {
            packets: self.packets.saturating_sub(earlier.packets),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            descs: self.descs.saturating_sub(earlier.descs),
            completed: self.completed.saturating_sub(earlier.completed),
            header_fallbacks: self
                .header_fallbacks
                .saturating_sub(earlier.header_fallbacks),
            mapped_headers: self.mapped_headers.saturating_sub(earlier.mapped_headers),
            ring_full: self.ring_full.saturating_sub(earlier.ring_full),
            unmap_errors: self.unmap_errors.saturating_sub(earlier.unmap_errors),
            mem_backoffs: self.mem_backoffs.saturating_sub(earlier.mem_backoffs),
            device_errors: self.device_errors.saturating_sub(earlier.device_errors),
            inline_packets: self.inline_packets.saturating_sub(earlier.inline_packets),
            contexts_skipped: self
                .contexts_skipped
                .saturating_sub(earlier.contexts_skipped),
        }
    }
}

enum Hdr<M: DmaMapper> {
    Slot(usize),
    Frag(Frag<M>),
}

/// A TX queue over device `D`, with pool memory mapped through `M`.
///
/// One thread drives a queue at a time (its calls take `&mut self`): it is
/// `Send` when its device is, and not `Sync`.
///
/// ```
/// use std::sync::Arc;
/// use pfrag::dma::SoftIommu;
/// use vfio_nic::model::softnic::SoftNic;
/// use vfio_nic::tx::Queue;
///
/// fn send<T: Send>() {}
/// send::<Queue<Arc<SoftIommu>, SoftNic<Arc<SoftIommu>>>>();
/// ```
///
/// ```compile_fail,E0277
/// # use std::sync::Arc;
/// # use pfrag::dma::SoftIommu;
/// # use vfio_nic::model::softnic::SoftNic;
/// # use vfio_nic::tx::Queue;
/// fn sync<T: Sync>() {}
/// sync::<Queue<Arc<SoftIommu>, SoftNic<Arc<SoftIommu>>>>(); // not `Sync`
/// ```
///
/// Building one promises that the device sees the domain's mappings
/// ([`new`](Self::new) is `unsafe`), and reaching the device mutably
/// promises not to replace it ([`device_mut`](Self::device_mut)):
///
/// ```compile_fail,E0133
/// use std::sync::Arc;
/// use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
/// use pfrag::pool::{self, Policy, Pool};
/// use pfrag::Order;
/// use vfio_nic::model::softnic::{self, SoftNic};
/// use vfio_nic::tx::{Config, Queue};
///
/// let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
/// let domain = Arc::new(Domain::new(iommu.clone()));
/// let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(0).unwrap(), Policy::Persistent)).unwrap();
/// let nic = SoftNic::new(iommu, softnic::Config::default());
/// let q = Queue::new(domain, pool, nic, Config::default()); // needs `unsafe`
/// ```
///
/// ```compile_fail,E0133
/// # use std::sync::Arc;
/// # use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
/// # use pfrag::pool::{self, Policy, Pool};
/// # use pfrag::Order;
/// # use vfio_nic::model::softnic::{self, SoftNic};
/// # use vfio_nic::tx::{Config, Queue};
/// # let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
/// # let domain = Arc::new(Domain::new(iommu.clone()));
/// # let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(0).unwrap(), Policy::Persistent)).unwrap();
/// # let nic = SoftNic::new(iommu, softnic::Config::default());
/// // SAFETY: the model translates through the domain's IOMMU.
/// let mut q = unsafe { Queue::new(domain, pool, nic, Config::default()) }.unwrap();
/// let _ = q.device_mut(); // needs `unsafe`: it could be swapped away
/// ```
pub struct Queue<M: DmaMapper, D: TxDevice> {
    /// The device, stopped by the queue's `Drop` before any memory it may
    /// still read is freed ([`detach`](TxDevice::detach)); `None` only
    /// once [`into_device`](Self::into_device) handed it back.
    dev: Option<D>,
    /// Set while [`into_device`](Self::into_device) calls the device's
    /// detach: if the queue drops meanwhile (the detach panicked), the
    /// device may still run.
    detaching: bool,
    cfg: Config,
    /// Dropped, or kept for good if the device cannot be stopped, by the
    /// queue's `Drop` alone.
    ring: ManuallyDrop<Coherent<M>>,
    /// Next descriptor to write.
    tail: u16,
    /// Descriptors posted and not reaped.
    used: usize,
    cache: FragCache<M>,
    /// Small payloads' cache, over order-0 chunks ([`Config::split`]).
    small: Option<FragCache<M>>,
    hdr_cache: FragCache<M>,
    bounce: Option<bounce::Ring<M>>,
    /// Where a packet's front (prefix, patched headers) is put together,
    /// for a format that needs it ([`header::scratch`]).
    scratch: Option<Box<header::Scratch>>,
    /// Posted packets, oldest first.
    pending: inflight::InFlight<M>,
    /// Emptied frag vectors, reused to avoid allocating per packet.
    spare: Vec<Vec<Frag<M>>>,
    /// The domain of the ring: every buffer the queue posts must be
    /// mapped here (the device sees this domain's mappings).
    domain: Arc<Domain<M>>,
    /// The device's descriptor format.
    fmt: Fmt<D>,
    /// The offload context the device holds (the last one written).
    ctx: Option<FmtContext<D>>,
    /// Where the queue is in asking for reports.
    reports: reap::Reports,
    stats: Stats,
}

/// A completed packet: its token, and how the device reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The token the packet was sent with.
    pub token: u64,
    /// The device's verdict.
    pub status: Status,
}

impl<M: DmaMapper, D: TxDevice> std::fmt::Debug for Queue<M, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("cfg", &self.cfg)
            .field("tail", &self.tail)
            .field("used", &self.used)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// A queue whose payloads come from `pool`, with its ring, header
    /// memory and bounce ring mapped in `domain`, attached to `dev`.
    /// `pool` must be on `domain` ([`Error::WrongDomain`] otherwise), and
    /// map its memory for the device to read
    /// ([`Dir::TO_DEVICE`](pfrag::dma::Dir::TO_DEVICE);
    /// [`Error::Unreadable`] otherwise).
    ///
    /// # Safety
    /// `dev` reaches memory through `domain`'s mappings: a device model
    /// built on the very IOMMU object that `domain` maps through (as
    /// `SoftNic::new(iommu.clone(), ..)` beside `Domain::new(iommu)`), or a
    /// NIC behind the IOMMU (VFIO container) that `domain` maps into. The
    /// queue's doorbell vouches for descriptors naming IOVAs of `domain`;
    /// a device that translated them through another IOMMU would read
    /// whatever that one maps there.
    pub unsafe fn new(domain: Arc<Domain<M>>, pool: Pool<M>, dev: D, cfg: Config) -> Result<Self> {
        check_config(&cfg)?;
        check_format::<Fmt<D>>()?;
        check_memory(&domain, pool.domain(), pool.config().dir, "the pool")?;
        let fmt = dev.format();
        let ring = Coherent::new(
            domain.clone(),
            Fmt::<D>::ring_bytes(cfg.ring),
            Dir::BIDIRECTIONAL,
        )?;
        let hdr_pool = Pool::new(
            domain.clone(),
            pool::Config::new(Order::new(header::FRAG_ORDER)?, Policy::PerFrag),
        )?;
        let bounce = match cfg.header {
            HeaderMode::Bounce(size) => Some(bounce::Ring::new(
                domain.clone(),
                usize::from(cfg.ring),
                size,
            )?),
            HeaderMode::Mapped => None,
        };
        let small = split::small_cache(&pool, &cfg)?;
        let cache = FragCache::for_queue(pool, cfg.queue)?;
        // SAFETY: `ring` is this queue's own, kept until the device is
        // detached or the queue dropped (the device first); nothing after
        // this can fail, and the queue owns the device from here
        // (`device_mut` is `unsafe`: the device is not re-pointed or
        // replaced). The caller promised the device translates through
        // `domain`, where the ring and every frag the queue posts are
        // mapped.
        let (dev, ring) = unsafe { detach::attach(dev, ring, cfg.ring) }?;
        Ok(Queue {
            dev: Some(dev),
            detaching: false,
            cfg,
            ring: ManuallyDrop::new(ring),
            tail: 0,
            used: 0,
            cache,
            small,
            hdr_cache: FragCache::new(hdr_pool),
            bounce,
            pending: inflight::InFlight::new(usize::from(cfg.ring)),
            spare: Vec::new(),
            domain,
            fmt,
            ctx: None,
            reports: reap::Reports::default(),
            scratch: header::scratch::<Fmt<D>>(),
            stats: Stats::default(),
        })
    }

    /// The device.
    pub fn device(&self) -> &D {
        match &self.dev {
            Some(d) => d,
            None => unreachable!("the device is handed back only with the queue"),
        }
    }
    /// The device, mutably.
    ///
    /// # Safety
    /// The device stays the one the queue attached to its ring: the caller
    /// neither replaces it (`mem::swap` with another queue's device,
    /// `mem::replace`) nor re-points it. The queue's doorbell vouches for
    /// its own ring to that device; another device would read descriptors
    /// the queue never wrote. For a model's captured frames,
    /// [`take_frames`](Self::take_frames) is safe.
    pub unsafe fn device_mut(&mut self) -> &mut D {
        self.dev_mut()
    }
    /// The device, mutably, for the queue's own use.
    #[inline]
    fn dev_mut(&mut self) -> &mut D {
        match &mut self.dev {
            Some(d) => d,
            None => unreachable!("the device is handed back only with the queue"),
        }
    }
    /// The payload frag cache.
    pub fn cache(&self) -> &FragCache<M> {
        &self.cache
    }
    /// The payload frag cache, to carve frags for a zero-copy
    /// [`post`](Self::post) (or use [`frags`](Self::frags)).
    pub fn cache_mut(&mut self) -> &mut FragCache<M> {
        &mut self.cache
    }
    /// Counters.
    pub fn stats(&self) -> Stats {
        self.stats
    }
    /// Packets posted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
    /// Descriptors free for new packets (one is always kept empty).
    pub fn free_descs(&self) -> usize {
        self.capacity() - self.used
    }
    /// Descriptors the ring holds at once: one fewer than its size (a full
    /// ring would look empty to the device). A packet that needs more is
    /// [`Error::PacketTooLarge`]. ([`Config::capacity`].)
    pub fn capacity(&self) -> usize {
        self.cfg.capacity()
    }
    /// The settings.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Writes the descriptor the format encoded into `words` at `idx`.
    fn write_desc(&self, idx: u16, words: &[u64]) -> Result<()> {
        let off = usize::from(idx) * Fmt::<D>::DESC_SIZE;
        Ok(self.ring.write_u64s(off, words)?)
    }

    /// Reads the words of the descriptor in slot `idx` back into `words`
    /// ([`Format::DESC_SIZE`]` / 8` of them).
    fn read_desc(&self, idx: u16, words: &mut [u64]) -> Result<()> {
        let off = usize::from(idx) * Fmt::<D>::DESC_SIZE;
        for (i, w) in words.iter_mut().enumerate() {
            *w = self.ring.read_u64(off + 8 * i)?;
        }
        Ok(())
    }

    /// The slot after `idx` (no division: this runs per descriptor).
    fn next(&self, idx: u16) -> u16 {
        if idx + 1 >= self.cfg.ring {
            0
        } else {
            idx + 1
        }
    }

    fn next_by(&self, idx: u16, n: usize) -> u16 {
        match n {
            0 => idx,
            1 => self.next(idx),
            _ => ((usize::from(idx) + n) % usize::from(self.cfg.ring)) as u16,
        }
    }

    /// Rings the doorbell for everything posted (if the device wants it:
    /// a virtio device may say it is still at work).
    ///
    /// A failed doorbell leaves the queue as it was: the packets stay
    /// posted and in flight, and the next `kick` hands them over. A device
    /// that stopped part way ([`Error::DeviceStopped`]: a virtio device's
    /// `NEEDS_RESET`) may have taken some of them; the queue treats them
    /// alike, in flight until reported done or until the device is
    /// detached (when the queue is dropped), so nothing the device may
    /// have read is reused.
    pub fn kick(&mut self) -> Result<()> {
        let reports = self.report_last()?;
        let flushed = match self.fmt.flush(&RingMem::new(&self.ring, self.cfg.ring)) {
            Ok(f) => f,
            Err(e) => {
                self.unreport(reports);
                return Err(e);
            }
        };
        if !flushed {
            return Ok(());
        }
        let rung = self.ring_doorbell();
        if rung.is_err() {
            self.fmt.unflush();
            self.unreport(reports);
        }
        rung
    }

    /// The doorbell itself, for everything up to the tail.
    fn ring_doorbell(&mut self) -> Result<()> {
        let tail = self.tail;
        // SAFETY: the descriptors from the device's head to `tail` are
        // this queue's, written by `post_frags` since the ring was attached
        // at `new`; they name the frags in `in_flight`, which the queue
        // owns (no `&mut` to them can exist) until `reap` sees the
        // packet's report (its own write-back, or, where the format defers
        // reports, a later packet's: `kick`'s contract), and header slots
        // of the queue's own bounce ring, reused only after that report
        // too.
        unsafe { self.dev_mut().kick(tail) }
    }
}

/// Refuses payload memory the queue's device cannot read: mapped in
/// `domain`, another domain than the queue's (`ours`), where its IOVAs
/// name other memory ([`Error::WrongDomain`]), or with a direction `dir`
/// without [`Dir::TO_DEVICE`] ([`Error::Unreadable`]). `what` names it.
fn check_memory<M: DmaMapper>(
    ours: &Arc<Domain<M>>,
    domain: &Arc<Domain<M>>,
    dir: Dir,
    what: &'static str,
) -> Result<()> {
    if !Arc::ptr_eq(domain, ours) {
        return Err(Error::WrongDomain { what });
    }
    if !dir.contains(Dir::TO_DEVICE) {
        return Err(Error::Unreadable {
            what,
            dir: dir.bits(),
        });
    }
    Ok(())
}

/// The longest [`Format::PREFIX`] the engine carries.
const MAX_PREFIX: usize = 64;

/// Refuses a format whose constants the engine cannot use: a descriptor
/// that is not a whole number of 64-bit words, or a status word outside it.
fn check_format<F: Format>() -> Result<()> {
    if F::DESC_SIZE == 0 || F::DESC_SIZE % 8 != 0 || F::DESC_SIZE > 64 {
        return Err(Error::BadConfig {
            what: "format descriptor size (a multiple of 8 bytes, at most 64)",
            value: F::DESC_SIZE as u64,
        });
    }
    if F::STATUS_OFFSET % 4 != 0 || F::STATUS_OFFSET + 4 > F::DESC_SIZE {
        return Err(Error::BadConfig {
            what: "format status offset (an aligned word inside the descriptor)",
            value: F::STATUS_OFFSET as u64,
        });
    }
    if F::PREFIX > MAX_PREFIX {
        return Err(Error::BadConfig {
            what: "format prefix (at most 64 bytes)",
            value: F::PREFIX as u64,
        });
    }
    if F::ring_bytes(2) < 2 * F::DESC_SIZE {
        return Err(Error::BadConfig {
            what: "format ring bytes (at least the descriptor table)",
            value: F::ring_bytes(2) as u64,
        });
    }
    if F::MAX_BUF == 0 {
        return Err(Error::BadConfig {
            what: "format largest buffer",
            value: 0,
        });
    }
    Ok(())
}

impl<M: DmaMapper, D: crate::model::Model> Queue<M, D> {
    /// The frames the device model captured so far, emptied
    /// ([`Model::take_frames`](crate::model::Model::take_frames)).
    pub fn take_frames(&mut self) -> Vec<Vec<u8>> {
        self.dev_mut().take_frames()
    }
}
