//! Whether a packet fits: the descriptors it needs (counted at most before
//! its frags exist, at least for the whole ring, exactly once they do) and
//! the checks against the device's buffer limit and the ring, made before
//! anything is allocated where the count allows it.

use pfrag::dma::DmaMapper;
use pfrag::PAGE_SIZE;

use super::{Fmt, Queue};
use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::offload::Offload;

/// How well a packet's descriptor count is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Need {
    /// Counted from its frags.
    Exact,
    /// Estimated before its frags exist: the packet needs at most this.
    AtMost,
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
    pub fn room_for(&mut self, len: usize, offload: Offload) -> Result<()> {
        let ctx = usize::from(Fmt::<D>::HAS_CONTEXT && offload != Offload::None);
        // The device may hold the context already: at least no context.
        self.check_capacity(self.descs_at_least(len))?;
        self.check_room(self.descs_at_most(len, ctx), ctx, Need::AtMost)
    }

    /// Descriptors a payload of `len` bytes needs at most (context, if the
    /// format has one, + header + data), before its frags are known: the
    /// quick check that refuses a full ring, or more buffers than the
    /// device takes, before allocating. An upper bound for the frags
    /// [`frags`](Self::frags) carves (so for [`send`](Self::send)): one per
    /// chunk the payload spans (one more without
    /// [`Config::fit_whole`](super::Config::fit_whole), for the tail of the
    /// chunk being carved), each cut where it passes the format's largest
    /// buffer or a [`Config::boundary`](super::Config::boundary). `send`
    /// counts the exact number once the frags are known.
    pub fn descs_needed(&self, len: usize) -> usize {
        self.descs_at_most(len, usize::from(Fmt::<D>::HAS_CONTEXT))
    }

    /// [`descs_needed`](Self::descs_needed) with `ctx` context descriptors.
    pub(super) fn descs_at_most(&self, len: usize, ctx: usize) -> usize {
        ctx + 1 + self.data_descs_at_most(len)
    }

    /// The data descriptors of the frags of a `len`-byte payload, at most.
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
    fn data_descs_at_most(&self, len: usize) -> usize {
        if len == 0 {
            return 0;
        }
        let chunk = self.cache.pool().chunk_size();
        let frags = len.div_ceil(chunk) + usize::from(!self.cfg.fit_whole);
        let mut n = frags;
        let stretch = match self.cfg.boundary {
            None => chunk,
            Some(b) => {
                let off = if b <= PAGE_SIZE as usize { 1 } else { frags };
                n += (len - 1) / b + off;
                b.min(chunk)
            }
        };
        if stretch > Fmt::<D>::MAX_BUF {
            n += (len - 1) / Fmt::<D>::MAX_BUF;
        }
        n
    }

    /// Descriptors a payload of `len` bytes needs at least (header + data,
    /// no context): no data descriptor carries more than a chunk,
    /// the format's largest buffer or the boundary.
    pub(super) fn descs_at_least(&self, len: usize) -> usize {
        let chunk = self.cache.pool().chunk_size();
        let per = chunk
            .min(Fmt::<D>::MAX_BUF)
            .min(self.cfg.boundary.unwrap_or(usize::MAX));
        1 + len.div_ceil(per)
    }

    /// Refuses a packet that needs at least `descs` descriptors if the
    /// whole ring holds fewer: [`Error::PacketTooLarge`], before anything
    /// is allocated.
    pub(super) fn check_capacity(&self, descs: usize) -> Result<()> {
        let capacity = self.capacity();
        if descs > capacity {
            return Err(Error::PacketTooLarge {
                needed: descs,
                capacity,
            });
        }
        Ok(())
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
    pub(super) fn check_room(&mut self, descs: usize, ctx: usize, need: Need) -> Result<()> {
        let bufs = descs - ctx;
        if bufs > self.cfg.max_bufs {
            return Err(Error::TooManyBuffers {
                needed: bufs,
                max: self.cfg.max_bufs,
            });
        }
        if need == Need::Exact {
            self.check_capacity(descs)?;
        }
        if descs.min(self.capacity()) > self.free_descs() {
            self.stats.ring_full += 1;
            return Err(Error::RingFull {
                needed: descs,
                free: self.free_descs(),
            });
        }
        Ok(())
    }
}
