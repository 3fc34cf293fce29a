//! Whether a packet fits: the descriptors it needs (counted at most before
//! its frags exist, at least for the whole ring, exactly once they do) and
//! the checks against the device's buffer limit and the ring, made before
//! anything is allocated where the count allows it. The bounds the queue
//! checks before allocating need no queue: the least descriptors against the
//! ring ([`Config::descs_at_least`], [`Config::check_fits`]), the most
//! buffers against the device's limit ([`Config::bufs_at_most`],
//! [`Config::check_bufs`]) and the payload against the format's and the
//! pool's limit ([`max_payload`], [`check_payload`]): a caller can refuse
//! settings whose packets are always refused before it builds a queue.

use pfrag::dma::DmaMapper;
use pfrag::pool;
use pfrag::{Order, PAGE_SIZE};

use super::{check_config, Config, Fmt, Queue};
use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::offload::{self, Offload};

/// How well a packet's descriptor count is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Need {
    /// Counted from its frags.
    Exact,
    /// Estimated before its frags exist: the packet needs at most this.
    AtMost,
}

/// Context descriptors a packet with `offload` takes on format `F` at
/// most: one for an offload where the format keeps the device's offload
/// state ([`Format::HAS_CONTEXT`]), none if the device already holds it.
fn context_descs<F: Format>(offload: Offload) -> usize {
    usize::from(F::HAS_CONTEXT && offload != Offload::None)
}

impl Config {
    /// Descriptors a ring of [`ring`](Self::ring) descriptors holds at
    /// once: one fewer than its size (a full ring would look empty to the
    /// device). A packet that needs more is [`Error::PacketTooLarge`].
    /// (0 for a ring of 0, which no queue takes.)
    pub fn capacity(&self) -> usize {
        usize::from(self.ring).saturating_sub(1)
    }

    /// The least descriptors a packet of `len` payload bytes takes on a
    /// queue with these settings that writes format `F`, its payload in
    /// frags of chunks of `order` (the queue's pool's): its header
    /// descriptor and as many data descriptors as the payload needs when
    /// none carries more than a chunk, the format's largest buffer
    /// ([`Format::MAX_BUF`]) or the [`boundary`](Self::boundary), and no
    /// context descriptor (the device may hold the packet's context
    /// already). A packet's exact count, known once its frags are, is never
    /// less. (A packet small enough to go inline, headers and payload in
    /// one bounce slot, takes one data descriptor and no frag.) A boundary
    /// of 0, which no queue takes, counts as 1, and the count saturates.
    ///
    /// The queue refuses a packet whose bound passes the ring's
    /// [`capacity`](Self::capacity) with [`Error::PacketTooLarge`] before
    /// allocating anything ([`Queue::room_for`], [`Queue::send`]); no queue
    /// is needed to compute it.
    ///
    /// ```
    /// use pfrag::Order;
    /// use vfio_nic::format::igb::Advanced;
    /// use vfio_nic::tx::Config;
    ///
    /// let cfg = Config::default();
    /// // 64 KiB chunks, but the 82576 carries at most 65,535 bytes per
    /// // buffer: a 65,536-byte payload takes the header and two buffers.
    /// assert_eq!(cfg.descs_at_least::<Advanced>(Order::new(4)?, 65_536), 3);
    /// // 4 KiB chunks: 16 data descriptors.
    /// assert_eq!(cfg.descs_at_least::<Advanced>(Order::new(0)?, 65_536), 17);
    /// # Ok::<(), pfrag::Error>(())
    /// ```
    pub fn descs_at_least<F: Format>(&self, order: Order, len: usize) -> usize {
        let per = order
            .size()
            .min(F::MAX_BUF)
            .min(self.boundary.unwrap_or(usize::MAX))
            .max(1);
        len.div_ceil(per).saturating_add(1)
    }

    /// Refuses a packet that needs at least `descs` descriptors if the
    /// whole ring holds fewer ([`capacity`](Self::capacity)):
    /// [`Error::PacketTooLarge`], which no retry mends.
    pub fn check_capacity(&self, descs: usize) -> Result<()> {
        let capacity = self.capacity();
        if descs > capacity {
            return Err(Error::PacketTooLarge {
                needed: descs,
                capacity,
            });
        }
        Ok(())
    }

    /// Whether a packet of `len` payload bytes with `offload` can fit the
    /// ring of a queue with these settings that writes format `F` over
    /// chunks of `order`, checked without a queue: the least descriptors
    /// it takes ([`descs_at_least`](Self::descs_at_least), plus a context
    /// descriptor for an offload on a format that keeps one, as the first
    /// packet with that offload needs), which it returns, against the
    /// ring's [`capacity`](Self::capacity). Settings no queue takes are
    /// [`Error::BadConfig`], as [`Queue::new`] refuses them.
    ///
    /// [`Error::PacketTooLarge`] means such a queue refuses the packet
    /// whenever its device does not hold the packet's context already, the
    /// first time in any case: settings to refuse before building the
    /// queue. `Ok` means it may fit; the exact count, known once the
    /// packet's frags are, decides.
    ///
    /// ```
    /// use pfrag::Order;
    /// use vfio_nic::format::igb::Advanced;
    /// use vfio_nic::offload::Offload;
    /// use vfio_nic::tx::Config;
    /// use vfio_nic::Error;
    ///
    /// let tso = Offload::Tso { mss: 1448 };
    /// let ring = Config { ring: 8, ..Config::default() };
    /// // The 82576's largest payload in 4 KiB chunks: a context, the
    /// // header and 64 data descriptors, past the 7 a ring of 8 holds.
    /// let r = ring.check_fits::<Advanced>(Order::new(0)?, 262_143, tso);
    /// assert!(matches!(r, Err(Error::PacketTooLarge { needed: 66, capacity: 7 })));
    /// assert_eq!(Config::default().check_fits::<Advanced>(Order::new(0)?, 262_143, tso)?, 66);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_fits<F: Format>(
        &self,
        order: Order,
        len: usize,
        offload: Offload,
    ) -> Result<usize> {
        check_config(self)?;
        let descs = context_descs::<F>(offload) + self.descs_at_least::<F>(order, len);
        self.check_capacity(descs)?;
        Ok(descs)
    }

    /// Whether the queue fits a payload of `len` bytes whole into one
    /// chunk (each piece of up to a chunk into one chunk): with
    /// [`fit_whole`](Self::fit_whole), and for any payload up to the
    /// [`split`](Self::split), which comes whole from one order-0 chunk
    /// (or, with no second pool, from one of the queue's).
    pub fn fits_whole(&self, len: usize) -> bool {
        self.fit_whole || self.split.is_some_and(|t| len <= t)
    }

    /// The most buffers (the header's and the data descriptors, no
    /// context) a packet of `len` payload bytes takes on a queue with these
    /// settings that writes format `F`, its payload carved from chunks of
    /// `order` (the queue's pool's): counted before its frags exist, never
    /// below what they take. One frag per chunk the payload spans (one more
    /// unless the payload is fit whole ([`fits_whole`](Self::fits_whole)),
    /// for the tail of the chunk being carved), each cut where it passes
    /// the format's largest buffer
    /// ([`Format::MAX_BUF`]) or the [`boundary`](Self::boundary). A
    /// boundary of 0, which no queue takes, counts as 1, and the count
    /// saturates.
    ///
    /// The queue refuses a packet whose count passes
    /// [`max_bufs`](Self::max_bufs) with [`Error::TooManyBuffers`] before
    /// allocating anything ([`Queue::room_for`], [`Queue::send`]); no queue
    /// is needed to compute it.
    ///
    /// ```
    /// use pfrag::Order;
    /// use vfio_nic::format::igb::Advanced;
    /// use vfio_nic::tx::Config;
    ///
    /// let cfg = Config::default();
    /// // 4 KiB chunks: the header and 16 data buffers.
    /// assert_eq!(cfg.bufs_at_most::<Advanced>(Order::new(0)?, 65_536), 17);
    /// // Without fit-whole the carved chunk's tail may hold the first bytes.
    /// let tails = Config { fit_whole: false, ..cfg };
    /// assert_eq!(tails.bufs_at_most::<Advanced>(Order::new(0)?, 65_536), 18);
    /// # Ok::<(), pfrag::Error>(())
    /// ```
    pub fn bufs_at_most<F: Format>(&self, order: Order, len: usize) -> usize {
        self.data_descs_at_most::<F>(order.size(), len)
            .saturating_add(1)
    }

    /// The data descriptors of the frags of a `len`-byte payload over
    /// chunks of `chunk` bytes, at most.
    ///
    /// Each frag ends one descriptor; the others end where a frag is cut.
    /// Every frag but one starts a chunk (with fit-whole, all but the last
    /// fill a chunk; without it, all but the first, the carved chunk's
    /// tail, start a fresh one), and a chunk starts on a page in IOVA
    /// space, so at most one frag starts off a boundary of at most a page.
    /// A frag of `l` bytes that starts on a boundary `b` is cut at most
    /// `(l - 1) / b` times, once more if it starts off one; summed over
    /// the frags (whose lengths add up to `len`), the cuts are at most
    /// `(len - 1) / b` plus one per frag that starts off a boundary. Within
    /// a stretch no longer than the format's largest buffer nothing is cut
    /// at it; otherwise those cuts are at most `(len - 1) / MAX_BUF`, by the
    /// same sum over stretches (a payload of exactly `k` boundaries or
    /// largest buffers is cut `k - 1` times, not `k`).
    fn data_descs_at_most<F: Format>(&self, chunk: usize, len: usize) -> usize {
        if len == 0 {
            return 0;
        }
        let frags = len.div_ceil(chunk) + usize::from(!self.fits_whole(len));
        let mut n = frags;
        let stretch = match self.boundary {
            None => chunk,
            Some(b) => {
                let b = b.max(1);
                let off = if b <= PAGE_SIZE as usize { 1 } else { frags };
                n = n.saturating_add((len - 1) / b).saturating_add(off);
                b.min(chunk)
            }
        };
        if stretch > F::MAX_BUF {
            n = n.saturating_add((len - 1) / F::MAX_BUF);
        }
        n
    }

    /// Refuses a packet of `bufs` buffers (the header's and the data
    /// descriptors, no context) if the device takes fewer per packet
    /// ([`max_bufs`](Self::max_bufs)): [`Error::TooManyBuffers`], which no
    /// retry mends.
    pub fn check_max_bufs(&self, bufs: usize) -> Result<()> {
        if bufs > self.max_bufs {
            return Err(Error::TooManyBuffers {
                needed: bufs,
                max: self.max_bufs,
            });
        }
        Ok(())
    }

    /// Whether a packet of `len` payload bytes stays within the buffers
    /// the device takes per packet on a queue with these settings that
    /// writes format `F` over chunks of `order`, checked without a queue:
    /// the most buffers it takes ([`bufs_at_most`](Self::bufs_at_most)),
    /// which it returns, against [`max_bufs`](Self::max_bufs). Settings no
    /// queue takes are [`Error::BadConfig`], as [`Queue::new`] refuses them.
    ///
    /// [`Error::TooManyBuffers`] means such a queue's
    /// [`send`](Queue::send) refuses every packet of that size with that
    /// error before carving any frag (unless it goes inline, headers and
    /// payload in one bounce slot: a packet of a few hundred bytes at
    /// most): settings to refuse before building the queue. `Ok` means
    /// `send` never refuses it for its buffers.
    ///
    /// ```
    /// use pfrag::Order;
    /// use vfio_nic::format::igb::Advanced;
    /// use vfio_nic::tx::Config;
    /// use vfio_nic::Error;
    ///
    /// let cfg = Config::default();
    /// // The 82576's largest payload in 4 KiB chunks: the header and 64
    /// // data buffers, one more than the 64 a packet may have.
    /// let r = cfg.check_bufs::<Advanced>(Order::new(0)?, 262_143);
    /// assert!(matches!(r, Err(Error::TooManyBuffers { needed: 65, max: 64 })));
    /// assert_eq!(cfg.check_bufs::<Advanced>(Order::new(0)?, 63 * 4096)?, 64);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_bufs<F: Format>(&self, order: Order, len: usize) -> Result<usize> {
        check_config(self)?;
        let bufs = self.bufs_at_most::<F>(order, len);
        self.check_max_bufs(bufs)?;
        Ok(bufs)
    }
}

/// The most payload one packet may carry on a queue that writes format
/// `F` over a pool with settings `pool`: the format's limit
/// ([`Format::MAX_PAYLOAD`]: 262,143 bytes on the 82576, whose PAYLEN is 18
/// bits; 65,535 on virtio-net, whose GSO packet is an IP packet) and the
/// pool's ([`max_payload`](pool::Config::max_payload)), whichever is less.
/// [`Queue::max_payload`] is this for the queue's own format and pool; no
/// queue is needed to compute it.
///
/// ```
/// use pfrag::pool::{Config, Policy};
/// use pfrag::Order;
/// use vfio_nic::format::{igb::Advanced, virtio::Split};
/// use vfio_nic::tx;
///
/// let pool = Config::new(Order::new(4)?, Policy::Persistent);
/// assert_eq!(tx::max_payload::<Advanced>(&pool), 262_143);
/// assert_eq!(tx::max_payload::<Split>(&pool), 65_535);
/// # Ok::<(), pfrag::Error>(())
/// ```
pub fn max_payload<F: Format>(pool: &pool::Config) -> usize {
    pool.max_payload.min(F::MAX_PAYLOAD)
}

/// The most payload one packet with these `headers` may carry under
/// `offload` on a queue that writes format `F` over a pool with settings
/// `pool`: [`max_payload`], and the format's bound for the headers
/// ([`offload::max_payload`]: without TSO the frame counts whole; with
/// TSO on virtio-net the IP length field bounds the packet). The headers
/// are parsed as a send parses them (a fault is the same typed error);
/// an IP length they state is not checked, since no payload is given.
/// The queue's MTU further bounds a frame without TSO
/// ([`Config::mtu`]).
///
/// ```
/// use etherparse::PacketBuilder;
/// use pfrag::pool::{Config, Policy};
/// use pfrag::Order;
/// use vfio_nic::format::{igb::Advanced, virtio::Split};
/// use vfio_nic::offload::Offload;
/// use vfio_nic::tx;
///
/// let mut h = Vec::new();
/// PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
///     .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
///     .tcp(1000, 2000, 7, 65_535)
///     .write(&mut h, &[])
///     .unwrap();
/// let pool = Config::new(Order::new(4)?, Policy::Persistent);
/// let tso = Offload::Tso { mss: 1448 };
/// assert_eq!(tx::max_payload_with::<Advanced>(&pool, &h, tso)?, 262_143);
/// assert_eq!(tx::max_payload_with::<Split>(&pool, &h, tso)?, 65_495);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn max_payload_with<F: Format>(
    pool: &pool::Config,
    headers: &[u8],
    offload: Offload,
) -> Result<usize> {
    let layout = match offload {
        Offload::None => None,
        _ => Some(offload::layout(headers, offload)?),
    };
    let format = offload::max_payload::<F>(headers.len(), layout.as_ref(), offload);
    Ok(max_payload::<F>(pool).min(format))
}

/// Refuses a payload of `len` bytes past what one packet may carry on a
/// queue that writes format `F` over a pool with settings `pool`
/// ([`max_payload`]): [`Error::PayloadTooLarge`], the error the queue's
/// [`send`](Queue::send) and [`frags`](Queue::frags) give such a payload
/// before anything is allocated.
pub fn check_payload<F: Format>(pool: &pool::Config, len: usize) -> Result<()> {
    let max = max_payload::<F>(pool);
    if len > max {
        return Err(Error::PayloadTooLarge { len, max });
    }
    Ok(())
}

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// Whether a packet of `len` payload bytes with `offload` is expected to
    /// fit the ring and the device's buffer limit: the check to make before
    /// carving frags for a [`post`](Self::post), so that a full ring costs
    /// no allocation ([`Error::RingFull`]: reap and retry). It counts a
    /// context descriptor for any offload (the headers are not known
    /// here) and at most the data descriptors of frags from
    /// [`frags`](Self::frags) (see [`descs_needed`](Self::descs_needed));
    /// `post` counts the exact descriptors and checks again. A
    /// packet whose estimate exceeds the whole ring passes once the ring is
    /// empty, and `post` then tells whether it fits
    /// ([`Error::PacketTooLarge`] if it never can).
    ///
    /// A query: it posts nothing and counts nothing, whatever it answers
    /// ([`Stats::ring_full`](super::Stats::ring_full) counts refused
    /// sends only).
    pub fn room_for(&self, len: usize, offload: Offload) -> Result<()> {
        let ctx = context_descs::<Fmt<D>>(offload);
        // The device may hold the context already: at least no context.
        self.check_capacity(self.descs_at_least(len))?;
        self.fits_room(self.descs_at_most(len, ctx), ctx, Need::AtMost)
    }

    /// [`room_for`](Self::room_for) made by a send of its own before it
    /// allocates ([`gen::Traffic::send`](crate::gen::Traffic::send)): a
    /// full ring refuses that send, and is counted in
    /// [`Stats::ring_full`](super::Stats::ring_full).
    pub(crate) fn room_to_send(&mut self, len: usize, offload: Offload) -> Result<()> {
        let r = self.room_for(len, offload);
        self.count_refusal(&r);
        r
    }

    /// Descriptors a payload of `len` bytes needs at most (context, if the
    /// format has one, + header + data), before its frags are known: the
    /// quick check that refuses a full ring, or more buffers than the
    /// device takes, before allocating. An upper bound for the frags
    /// [`frags`](Self::frags) carves (so for [`send`](Self::send)): one per
    /// chunk the payload spans (one more unless it is fit whole,
    /// [`Config::fits_whole`](super::Config::fits_whole), for the tail of
    /// the chunk being carved), each cut where it passes the format's
    /// largest buffer or a [`Config::boundary`](super::Config::boundary). `send`
    /// counts the exact number once the frags are known.
    pub fn descs_needed(&self, len: usize) -> usize {
        self.descs_at_most(len, usize::from(Fmt::<D>::HAS_CONTEXT))
    }

    /// [`descs_needed`](Self::descs_needed) with `ctx` context descriptors:
    /// `ctx` + [`Config::bufs_at_most`] over the chunks of the queue's pool.
    pub(super) fn descs_at_most(&self, len: usize, ctx: usize) -> usize {
        let order = self.cache.pool().config().order;
        ctx + self.cfg.bufs_at_most::<Fmt<D>>(order, len)
    }

    /// Descriptors a payload of `len` bytes needs at least (header + data,
    /// no context), over the chunks of the queue's pool:
    /// [`Config::descs_at_least`].
    pub(super) fn descs_at_least(&self, len: usize) -> usize {
        let order = self.cache.pool().config().order;
        self.cfg.descs_at_least::<Fmt<D>>(order, len)
    }

    /// Refuses a packet that needs at least `descs` descriptors if the
    /// whole ring holds fewer: [`Error::PacketTooLarge`]
    /// ([`Config::check_capacity`]), before anything is allocated.
    pub(super) fn check_capacity(&self, descs: usize) -> Result<()> {
        self.cfg.check_capacity(descs)
    }

    /// Whether `descs` descriptors, `ctx` of them context descriptors, fit
    /// the device's buffer limit and the free part of the ring. `need` says
    /// whether `descs` is the packet's exact count or an estimate made
    /// before its frags are known.
    ///
    /// A packet that needs more than the whole ring is
    /// [`Error::PacketTooLarge`], which a retry never mends: the exact
    /// count says so here, a lower bound before allocating
    /// ([`check_capacity`](Self::check_capacity)). An estimate past the
    /// ring whose lower bound fits asks for an empty ring instead
    /// ([`Error::RingFull`] until then), where the exact count decides.
    ///
    /// A send's check: a full ring ([`Error::RingFull`]) refuses the send,
    /// counted in [`Stats::ring_full`](super::Stats::ring_full).
    pub(super) fn check_room(&mut self, descs: usize, ctx: usize, need: Need) -> Result<()> {
        let r = self.fits_room(descs, ctx, need);
        self.count_refusal(&r);
        r
    }

    /// Counts `r`, a send's room check, in
    /// [`Stats::ring_full`](super::Stats::ring_full) if a full ring refused
    /// the send (no other refusal).
    fn count_refusal(&mut self, r: &Result<()>) {
        if let Err(Error::RingFull { .. }) = r {
            self.stats.ring_full += 1;
        }
    }

    /// [`check_room`](Self::check_room) without counting: the answer
    /// alone.
    fn fits_room(&self, descs: usize, ctx: usize, need: Need) -> Result<()> {
        self.cfg.check_max_bufs(descs - ctx)?;
        if need == Need::Exact {
            self.check_capacity(descs)?;
        }
        if descs.min(self.capacity()) > self.free_descs() {
            return Err(Error::RingFull {
                needed: descs,
                free: self.free_descs(),
            });
        }
        Ok(())
    }
}
