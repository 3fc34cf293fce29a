//! Posting packets: the copying send, its vectored form, and the zero-copy
//! post of frags the caller filled. Every path checks everything the device
//! cannot carry (headers the offload cannot use, PAYLEN, buffers per
//! packet, ring space) before it writes a descriptor, and is all or
//! nothing: on error nothing is posted, advanced, allocated or leaked.

use std::io::IoSlice;

use pfrag::dma::DmaMapper;
use pfrag::frag::Frag;
use pfrag::Iova;

use super::inflight::Span;
use super::room::Need;
use super::{header, pieces, Fmt, FmtContext, Hdr, Queue, MAX_DESC_WORDS};
use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::format::{Buf, Format, Packet, RingMem};
use crate::offload::{self, Layout, Offload};

/// Bytes of an Ethernet header (no VLAN tag): what a frame has beyond
/// the MTU.
pub(super) const ETH_HLEN: usize = 14;

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// The most payload one packet may carry: the pool's limit, and the
    /// format's ([`Format::MAX_PAYLOAD`]; the 82576's PAYLEN is 18 bits):
    /// [`tx::max_payload`](super::max_payload) of the queue's format and
    /// pool.
    pub fn max_payload(&self) -> usize {
        super::max_payload::<Fmt<D>>(self.cache.pool().config())
    }

    /// The most payload one packet with these `headers` may carry under
    /// `offload`: [`tx::max_payload_with`](super::max_payload_with) of the
    /// queue's format and pool (at most [`max_payload`](Self::max_payload);
    /// on virtio-net a TSO packet's IP length field bounds it further).
    pub fn max_payload_with(&self, headers: &[u8], offload: Offload) -> Result<usize> {
        super::max_payload_with::<Fmt<D>>(self.cache.pool().config(), headers, offload)
    }

    /// Sends one packet: `headers` (Ethernet + IPv4 + TCP/UDP for an
    /// offload; any frame start for [`Offload::None`]) and `payload`, which
    /// is copied once into pool frags, as a kernel copies from user memory
    /// (a packet that fits a bounce slot whole, TSO excepted, is copied
    /// into the slot instead and takes one data descriptor, no frag).
    /// `token` comes back from [`reap_tokens`](Self::reap_tokens) when the
    /// device is done with the packet. The packet is visible to the device
    /// after [`kick`](Self::kick). A full ring is [`Error::RingFull`]: reap
    /// and retry; a packet that needs more descriptors than the empty ring
    /// holds is [`Error::PacketTooLarge`], which no retry mends. All or
    /// nothing.
    pub fn send(
        &mut self,
        headers: &[u8],
        payload: &[u8],
        offload: Offload,
        token: u64,
    ) -> Result<()> {
        self.send_vectored(headers, &[IoSlice::new(payload)], offload, token)
    }

    /// [`send`](Self::send) of a payload gathered from `parts`.
    pub fn send_vectored(
        &mut self,
        headers: &[u8],
        parts: &[IoSlice<'_>],
        offload: Offload,
        token: u64,
    ) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let layout = self.check_packet(headers, len, offload)?;
        let ctx = self.context(layout, offload);
        let pkt = Packet {
            offload,
            hlen: headers.len(),
            len,
            layout,
        };
        if self.inline_fits(headers.len(), len, offload) {
            return self.send_inline(headers, parts, ctx, pkt, token);
        }
        // The quick check of `room_for`, knowing whether a context
        // descriptor is needed.
        let nctx = ctx.descs();
        self.check_capacity(nctx + self.descs_at_least(len))?;
        self.check_room(self.descs_at_most(len, nctx), nctx, Need::AtMost)?;
        // The cache may have been swapped for one over another domain or
        // a pool the device cannot read (`cache_mut`).
        let pool = self.cache.pool();
        let what = "the queue's frag cache";
        super::check_memory(&self.domain, pool.domain(), pool.config().dir, what)?;
        let mut frags = self.spare.pop().unwrap_or_default();
        if let Err(e) = self.frags(len, &mut frags) {
            self.spare.push(frags);
            return Err(e);
        }
        copy_into(&mut frags, parts);
        let r = self.post_frags(headers, ctx, pkt, &mut frags, token);
        // A refused packet's frags go back to the cache they came from,
        // never handed out after all.
        if r.is_err() {
            let failed = self.payload_cache(len).take_back(frags.drain(..));
            self.stats.unmap_errors += failed as u64;
        }
        self.spare.push(frags);
        r
    }

    /// Whether a packet goes out inline: headers and payload together in
    /// its bounce slot, one data descriptor and no frag. Any packet that
    /// fits a slot, but TSO ones (whose payload is segmented apart from
    /// the headers).
    fn inline_fits(&self, hlen: usize, len: usize, offload: Offload) -> bool {
        let n = Fmt::<D>::PREFIX + hlen + len;
        !matches!(offload, Offload::Tso { .. })
            && n <= Fmt::<D>::MAX_BUF
            && self.bounce.as_ref().is_some_and(|b| n <= b.slot_size())
    }

    /// Sends a small packet inline (see [`inline_fits`](Self::inline_fits)):
    /// copied into the bounce slot of its descriptor, posted as one data
    /// descriptor (after a context descriptor if the offload changed).
    fn send_inline(
        &mut self,
        headers: &[u8],
        parts: &[IoSlice<'_>],
        ctx: Ctx<FmtContext<D>>,
        pkt: Packet,
        token: u64,
    ) -> Result<()> {
        let nctx = ctx.descs();
        self.check_room(nctx + 1, nctx, Need::Exact)?;
        let idx = self.next_by(self.tail, nctx);
        let iova = self.with_front(headers, &pkt, |q, front| {
            let bytes = front.into_iter().chain(parts.iter().map(|p| &**p));
            let b = q.bounce.as_mut().expect("inline_fits saw a bounce ring");
            b.fill_parts(usize::from(idx), bytes)
        })?;
        let head = self.tail;
        let report = self.report_next();
        self.write_inline(head, idx, iova, ctx, &pkt, report)?;
        self.stats.inline_packets += 1;
        self.advance(
            head,
            (idx, report),
            nctx + 1,
            ctx,
            Hdr::Slot(usize::from(idx)),
            None,
            &pkt,
            token,
        );
        Ok(())
    }

    /// Writes a packet that lies whole in bounce slot `idx` (at `iova`):
    /// its context descriptor at `head` if `ctx` asks for one, its one data
    /// descriptor at `idx` (asking for a report if `report`), then
    /// publishes it from `head`. On error the slot is given back and
    /// nothing is posted: what [`send_inline`](Self::send_inline) and
    /// `send_burst`'s run of plain packets both do once the slot is
    /// filled.
    #[inline(always)]
    pub(super) fn write_inline(
        &mut self,
        head: u16,
        idx: u16,
        iova: Iova,
        ctx: Ctx<FmtContext<D>>,
        pkt: &Packet,
        report: bool,
    ) -> Result<()> {
        let buf = Buf {
            iova,
            len: Fmt::<D>::PREFIX + pkt.hlen + pkt.len,
            first: true,
            last: true,
            next: self.next(idx),
            report,
        };
        let written = self
            .write_context(head, ctx)
            .and_then(|()| self.write_data(idx, buf, pkt))
            .and_then(|()| self.publish(head));
        if let Err(e) = written {
            self.drop_header(Hdr::Slot(usize::from(idx)));
            return Err(e);
        }
        Ok(())
    }

    /// The context descriptor a packet needs: none without an offload, and
    /// none when the device already holds the same context (the 82576
    /// keeps it per queue; DPDK's igb and ixgbe drivers skip it the same
    /// way).
    fn context(&self, layout: Option<Layout>, offload: Offload) -> Ctx<FmtContext<D>> {
        let Some(l) = layout.filter(|_| Fmt::<D>::HAS_CONTEXT) else {
            return Ctx::NotNeeded;
        };
        let c = self.fmt.context(&l, offload);
        if self.ctx == Some(c) {
            Ctx::Held
        } else {
            Ctx::Write(c)
        }
    }

    /// Records a written packet: the tail moves past `last` (which asked
    /// the device for a report if `report`), the counters, the device's
    /// context and the reports follow, and the packet waits for its
    /// completion.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn advance(
        &mut self,
        head: u16,
        (last, report): (u16, bool),
        ndesc: usize,
        ctx: Ctx<FmtContext<D>>,
        hdr: Hdr<M>,
        frags: Option<Vec<Frag<M>>>,
        pkt: &Packet,
        token: u64,
    ) {
        self.note_report(last, report);
        match ctx {
            Ctx::Write(c) => self.ctx = Some(c),
            Ctx::Held => self.stats.contexts_skipped += 1,
            Ctx::NotNeeded => {}
        }
        self.tail = self.next(last);
        self.used += ndesc;
        self.stats.packets += 1;
        self.stats.bytes += pkt.len as u64;
        self.stats.descs += ndesc as u64;
        if matches!(hdr, Hdr::Frag(_)) {
            // Where the queue has bounce slots, a header in a frag of its
            // own is one that fit none (`place_front`).
            self.stats.mapped_headers += 1;
            self.stats.header_fallbacks += u64::from(self.bounce.is_some());
        }
        let span = Span::new(head, last, ndesc as u16, report);
        self.pending.push(span, hdr, frags, token);
    }

    /// Posts one packet whose payload the caller already wrote into `frags`
    /// (taken from [`frags`](Self::frags) or [`cache_mut`](Self::cache_mut)):
    /// no copy. On success the queue owns the frags until the packet
    /// completes and `frags` is left empty; on error nothing is posted and
    /// the frags stay in `frags`, the caller's. Frags of another domain
    /// are [`Error::WrongDomain`], frags the device may not read (their
    /// pool maps without [`Dir::TO_DEVICE`](pfrag::dma::Dir::TO_DEVICE))
    /// [`Error::Unreadable`].
    pub fn post(
        &mut self,
        headers: &[u8],
        frags: &mut Vec<Frag<M>>,
        offload: Offload,
        token: u64,
    ) -> Result<()> {
        let len: usize = frags.iter().map(|f| f.len()).sum();
        let layout = self.check_packet(headers, len, offload)?;
        for f in frags.iter() {
            super::check_memory(&self.domain, f.domain(), f.dir(), "a frag")?;
        }
        let ctx = self.context(layout, offload);
        let pkt = Packet {
            offload,
            hlen: headers.len(),
            len,
            layout,
        };
        let mut mine = self.spare.pop().unwrap_or_default();
        mine.append(frags);
        let r = self.post_frags(headers, ctx, pkt, &mut mine, token);
        if r.is_err() {
            frags.append(&mut mine);
        }
        self.spare.push(mine);
        r
    }

    /// Frags for a payload of `len` bytes, appended to `out`: from the
    /// small payloads' cache up to the split ([`Config::split`](super::Config::split)), else from
    /// the queue's cache (fit-whole as the queue is configured). A memory
    /// limit is counted as a back-off (`mem_backoffs`). On error the frags
    /// of this call are given back and removed from `out`; each whose unmap
    /// failed is counted ([`Stats::unmap_errors`](super::Stats::unmap_errors)).
    pub fn frags(&mut self, len: usize, out: &mut Vec<Frag<M>>) -> Result<()> {
        super::check_payload::<Fmt<D>>(self.cache.pool().config(), len)?;
        // A small payload sits whole in one order-0 chunk.
        let fit_whole = self.cfg.fits_whole(len);
        self.payload_cache(len)
            .frags_counting(len, fit_whole, out)
            .map_err(|(e, failed)| {
                // The frags carved before the failure went back to the
                // pool; those whose unmap failed stay mapped for good.
                self.stats.unmap_errors += failed as u64;
                let e = Error::from(e);
                if e.is_backoff() {
                    // Out of memory by policy, not by bug: the caller backs
                    // off (reaps completions) and retries.
                    self.stats.mem_backoffs += 1;
                }
                e
            })
    }

    /// Checks headers, payload size and offload; the layout for the
    /// context descriptor.
    fn check_packet(&self, headers: &[u8], len: usize, offload: Offload) -> Result<Option<Layout>> {
        if len == 0 {
            return Err(pfrag::Error::ZeroLength.into());
        }
        let unsupported = || Error::UnsupportedOffload {
            offload: offload.name(),
            format: Fmt::<D>::NAME,
        };
        // Whether the format carries the offload at all, before the
        // headers are parsed; then for these headers.
        if !self.fmt.supports(offload, None) {
            return Err(unsupported());
        }
        // The format's limit for these headers, then the pool's: a payload
        // past either is refused naming the limit a retry must meet (the
        // pool's is checked only at or under the format's).
        let layout = offload::check::<Fmt<D>>(headers, len, offload)?;
        super::check_payload::<Fmt<D>>(self.cache.pool().config(), len)?;
        if layout.is_some() && !self.fmt.supports(offload, layout.as_ref()) {
            return Err(unsupported());
        }
        // Headers go in one buffer (after the format's prefix), never
        // split: refused here if longer than the queue can place.
        header::check_placeable::<Fmt<D>>(headers.len(), offload)?;
        header::check_patchable::<Fmt<D>>(headers.len(), offload)?;
        self.check_mtu(headers.len(), len, offload)?;
        Ok(layout)
    }

    /// Refuses a frame longer than the MTU allows: the whole frame
    /// without TSO, each segment (headers + MSS) with it.
    fn check_mtu(&self, hlen: usize, len: usize, offload: Offload) -> Result<()> {
        let max = usize::from(self.cfg.mtu) + ETH_HLEN;
        let frame = match offload {
            Offload::Tso { mss } => hlen + usize::from(mss).min(len),
            _ => hlen + len,
        };
        if frame > max {
            return Err(Error::FrameTooLong { len: frame, max });
        }
        Ok(())
    }

    /// Writes the packet of `frags` (`len` payload bytes, context need
    /// `ctx`) into the ring and advances the queue;
    /// on success `frags` moves into the pending packet. On error nothing is
    /// advanced and `frags` are the caller's to free.
    fn post_frags(
        &mut self,
        headers: &[u8],
        ctx: Ctx<FmtContext<D>>,
        pkt: Packet,
        frags: &mut Vec<Frag<M>>,
        token: u64,
    ) -> Result<()> {
        let boundary = self.cfg.boundary;
        let max = Fmt::<D>::MAX_BUF;
        let data: usize = frags
            .iter()
            .map(|f| pieces(f.iova(), f.len(), max, boundary).count())
            .sum();
        let nctx = ctx.descs();
        let ndesc = nctx + 1 + data;
        self.check_room(ndesc, nctx, Need::Exact)?;
        let hdr_idx = self.next_by(self.tail, nctx);
        let (hdr_iova, hold) = self.place_header(hdr_idx, headers, &pkt)?;
        let head = self.tail;
        let written = self
            .write_packet(ctx, &pkt, hdr_iova, frags)
            .and_then(|last| self.publish(head).map(|()| last));
        let (last, report) = match written {
            Ok(last) => last,
            Err(e) => {
                self.drop_header(hold);
                return Err(e);
            }
        };
        let frags = std::mem::replace(frags, self.spare.pop().unwrap_or_default());
        self.advance(
            head,
            (last, report),
            ndesc,
            ctx,
            hold,
            Some(frags),
            &pkt,
            token,
        );
        Ok(())
    }

    /// Writes the context (`ctx`, if the device needs a new one), header
    /// and data descriptors from the tail on. Returns the index of the last
    /// one and whether it asks for a report (as
    /// [`report_next`](Self::report_next) says).
    fn write_packet(
        &self,
        ctx: Ctx<FmtContext<D>>,
        pkt: &Packet,
        hdr_iova: Iova,
        frags: &[Frag<M>],
    ) -> Result<(u16, bool)> {
        let report = self.report_next();
        let mut idx = self.tail;
        self.write_context(idx, ctx)?;
        idx = self.next_by(idx, ctx.descs());
        let hdr = Buf {
            iova: hdr_iova,
            len: Fmt::<D>::PREFIX + pkt.hlen,
            first: true,
            last: false,
            next: self.next(idx),
            report,
        };
        self.write_data(idx, hdr, pkt)?;
        let nfr = frags.len();
        for (i, f) in frags.iter().enumerate() {
            let max = Fmt::<D>::MAX_BUF;
            let mut ps = pieces(f.iova(), f.len(), max, self.cfg.boundary).peekable();
            while let Some((iova, n)) = ps.next() {
                idx = self.next(idx);
                let last = i + 1 == nfr && ps.peek().is_none();
                let buf = Buf {
                    iova,
                    len: n,
                    first: false,
                    last,
                    next: self.next(idx),
                    report,
                };
                self.write_data(idx, buf, pkt)?;
            }
        }
        Ok((idx, report))
    }

    /// Writes the context descriptor at `idx` if `ctx` asks for one.
    fn write_context(&self, idx: u16, ctx: Ctx<FmtContext<D>>) -> Result<()> {
        if let Ctx::Write(c) = ctx {
            let mut w = [0u64; MAX_DESC_WORDS];
            let w = &mut w[..Fmt::<D>::DESC_SIZE / 8];
            self.fmt.write_context(w, &c);
            self.write_desc(idx, w)?;
        }
        Ok(())
    }

    /// Writes the data descriptor for `buf` of `pkt` at `idx`.
    pub(super) fn write_data(&self, idx: u16, buf: Buf, pkt: &Packet) -> Result<()> {
        let mut w = [0u64; MAX_DESC_WORDS];
        let w = &mut w[..Fmt::<D>::DESC_SIZE / 8];
        self.fmt.write_data(w, buf, pkt);
        self.write_desc(idx, w)
    }

    /// Publishes the packet whose descriptors start at `head`
    /// ([`Format::publish`]).
    pub(super) fn publish(&mut self, head: u16) -> Result<()> {
        self.fmt
            .publish(&RingMem::new(&self.ring, self.cfg.ring), head)
    }
}

/// What a packet needs of the device's offload context `C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ctx<C> {
    /// No offload (or a format without a context): no context.
    NotNeeded,
    /// The device holds the same context already: no descriptor.
    Held,
    /// A context descriptor to write first.
    Write(C),
}

impl<C> Ctx<C> {
    /// Context descriptors the packet takes.
    fn descs(self) -> usize {
        usize::from(matches!(self, Ctx::Write(_)))
    }
}

/// Copies the gathered `parts` into `frags`, in order.
fn copy_into<M: DmaMapper>(frags: &mut [Frag<M>], parts: &[IoSlice<'_>]) {
    let mut src = parts.iter().flat_map(|p| p.chunks(4096));
    let mut cur: &[u8] = &[];
    for f in frags.iter_mut() {
        let mut dst = f.as_mut_slice();
        while !dst.is_empty() {
            if cur.is_empty() {
                match src.next() {
                    Some(c) => cur = c,
                    None => return,
                }
            }
            let n = dst.len().min(cur.len());
            dst[..n].copy_from_slice(&cur[..n]);
            dst = &mut dst[n..];
            cur = &cur[n..];
        }
    }
}
