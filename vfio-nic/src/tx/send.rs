//! Posting packets: the copying send, its vectored form, and the zero-copy
//! post of frags the caller filled. Every path checks everything the device
//! cannot carry (headers the offload cannot use, PAYLEN, buffers per
//! packet, ring space) before it writes a descriptor, and is all or
//! nothing: on error nothing is posted, advanced, allocated or leaked.

use std::io::IoSlice;

use pfrag::dma::DmaMapper;
use pfrag::frag::{complete_burst, Frag};
use pfrag::Iova;

use super::{pieces, Hdr, Pending, Queue};
use crate::desc::{self, Context, Data, Dcmd, Desc, Popts};
use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::offload::{self, Layout, Offload, L4};

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// The most payload one packet may carry: the pool's limit, and the
    /// 82576's 18-bit PAYLEN.
    pub fn max_payload(&self) -> usize {
        self.cache.pool().config().max_payload.min(desc::MAX_PAYLEN)
    }

    /// Sends one packet: `headers` (Ethernet + IPv4 + TCP/UDP for an
    /// offload; any frame start for [`Offload::None`]) and `payload`, which
    /// is copied once into pool frags, as a kernel copies from user memory.
    /// `token` comes back from [`reap_tokens`](Self::reap_tokens) when the
    /// device is done with the packet. The packet is visible to the device
    /// after [`kick`](Self::kick). A full ring is [`Error::RingFull`]: reap
    /// and retry. All or nothing.
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
        self.room_for(len, offload)?;
        let mut frags = self.spare.pop().unwrap_or_default();
        if let Err(e) = self.frags(len, &mut frags) {
            self.spare.push(frags);
            return Err(e);
        }
        copy_into(&mut frags, parts);
        let r = self.post_frags(headers, layout, offload, &mut frags, token);
        if r.is_err() {
            complete_burst(frags.drain(..)).ok();
        }
        self.spare.push(frags);
        r
    }

    /// Posts one packet whose payload the caller already wrote into `frags`
    /// (taken from [`frags`](Self::frags) or [`cache_mut`](Self::cache_mut)):
    /// no copy. On success the queue owns the frags until the packet
    /// completes and `frags` is left empty; on error nothing is posted and
    /// the frags stay in `frags`, the caller's.
    pub fn post(
        &mut self,
        headers: &[u8],
        frags: &mut Vec<Frag<M>>,
        offload: Offload,
        token: u64,
    ) -> Result<()> {
        let len: usize = frags.iter().map(|f| f.len()).sum();
        if len > self.max_payload() {
            return Err(Error::PayloadTooLarge {
                len,
                max: self.max_payload(),
            });
        }
        let layout = self.check_packet(headers, len, offload)?;
        let mut mine = self.spare.pop().unwrap_or_default();
        mine.append(frags);
        let r = self.post_frags(headers, layout, offload, &mut mine, token);
        if r.is_err() {
            frags.append(&mut mine);
        }
        self.spare.push(mine);
        r
    }

    /// Whether a packet of `len` payload bytes with `offload` is expected to
    /// fit the ring and the device's buffer limit: the check to make before
    /// carving frags for a [`post`](Self::post), so that a full ring costs
    /// no allocation ([`Error::RingFull`]: reap and retry). `post` counts
    /// the exact descriptors and checks again.
    pub fn room_for(&mut self, len: usize, offload: Offload) -> Result<()> {
        let ctx = ctx_descs(offload);
        self.check_room(self.descs_needed(len) - 1 + ctx, ctx)
    }

    /// Frags for a payload of `len` bytes from the queue's cache, appended
    /// to `out` (fit-whole as the queue is configured). A memory limit is
    /// counted as a back-off (`mem_backoffs`).
    pub fn frags(&mut self, len: usize, out: &mut Vec<Frag<M>>) -> Result<()> {
        if len > self.max_payload() {
            return Err(Error::PayloadTooLarge {
                len,
                max: self.max_payload(),
            });
        }
        self.cache.frags(len, self.cfg.fit_whole, out).map_err(|e| {
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
        if len > self.max_payload() {
            return Err(Error::PayloadTooLarge {
                len,
                max: self.max_payload(),
            });
        }
        offload::check(headers, len, offload)
    }

    /// Whether `descs` descriptors, `ctx` of them context descriptors, fit
    /// the device's buffer limit and the free part of the ring.
    fn check_room(&mut self, descs: usize, ctx: usize) -> Result<()> {
        let bufs = descs - ctx;
        if bufs > self.cfg.max_bufs {
            return Err(Error::TooManyBuffers {
                needed: bufs,
                max: self.cfg.max_bufs,
            });
        }
        if descs > self.free_descs() {
            self.stats.ring_full += 1;
            return Err(Error::RingFull {
                needed: descs,
                free: self.free_descs(),
            });
        }
        Ok(())
    }

    /// Writes the packet of `frags` into the ring and advances the queue;
    /// on success `frags` moves into the pending packet. On error nothing is
    /// advanced and `frags` are the caller's to free.
    fn post_frags(
        &mut self,
        headers: &[u8],
        layout: Option<Layout>,
        offload: Offload,
        frags: &mut Vec<Frag<M>>,
        token: u64,
    ) -> Result<()> {
        let boundary = self.cfg.boundary;
        let data: usize = frags
            .iter()
            .map(|f| pieces(f.iova(), f.len(), boundary).count())
            .sum();
        let ndesc = ctx_descs(offload) + 1 + data;
        self.check_room(ndesc, ctx_descs(offload))?;
        let len: usize = frags.iter().map(|f| f.len()).sum();
        let hdr_idx = self.next_by(self.tail, ctx_descs(offload));
        let (hdr_iova, hold) = self.place_header(hdr_idx, headers)?;
        let last = match self.write_packet(headers.len(), len, layout, offload, hdr_iova, frags) {
            Ok(last) => last,
            Err(e) => {
                self.drop_header(hold);
                return Err(e);
            }
        };
        self.tail = self.next(last);
        self.used += ndesc;
        self.stats.packets += 1;
        self.stats.bytes += len as u64;
        self.stats.descs += ndesc as u64;
        let frags = std::mem::replace(frags, self.spare.pop().unwrap_or_default());
        self.pending.push_back(Pending {
            last,
            ndesc: ndesc as u16,
            hdr: hold,
            frags,
            token,
        });
        Ok(())
    }

    /// Writes the context (for an offload), header and data descriptors
    /// from the tail on. Returns the index of the last one (which asks for
    /// write-back).
    fn write_packet(
        &self,
        hlen: usize,
        len: usize,
        layout: Option<Layout>,
        offload: Offload,
        hdr_iova: Iova,
        frags: &[Frag<M>],
    ) -> Result<u16> {
        let (tso, paylen, popts) = match offload {
            Offload::Tso { .. } => (Dcmd::TSE, len, Popts::IXSM | Popts::TXSM),
            Offload::Checksum => (Dcmd::empty(), hlen + len, Popts::IXSM | Popts::TXSM),
            Offload::None => (Dcmd::empty(), hlen + len, Popts::empty()),
        };
        let mut idx = self.tail;
        if let Some(l) = layout {
            let mss = match offload {
                Offload::Tso { mss } => mss,
                _ => 0,
            };
            let ctx = Context::ipv4(l.maclen, l.iplen, l.l4len, mss, l.l4 == L4::Tcp);
            self.write_desc(idx, Desc::Context(ctx))?;
            idx = self.next(idx);
        }
        let hdr = Data::new(
            hdr_iova.raw(),
            hlen as u16,
            Dcmd::IFCS | tso,
            paylen as u32,
            popts,
        );
        self.write_desc(idx, Desc::Data(hdr))?;
        let nfr = frags.len();
        for (i, f) in frags.iter().enumerate() {
            let mut ps = pieces(f.iova(), f.len(), self.cfg.boundary).peekable();
            while let Some((at, n)) = ps.next() {
                idx = self.next(idx);
                let end = if i + 1 == nfr && ps.peek().is_none() {
                    Dcmd::EOP | Dcmd::RS
                } else {
                    Dcmd::empty()
                };
                let d = Data::new(
                    at.raw(),
                    n as u16,
                    Dcmd::IFCS | tso | end,
                    0,
                    Popts::empty(),
                );
                self.write_desc(idx, Desc::Data(d))?;
            }
        }
        Ok(idx)
    }

    pub(super) fn drop_header(&mut self, h: Hdr<M>) {
        match h {
            Hdr::Slot(i) => {
                if let Some(b) = self.bounce.as_mut() {
                    b.release(i);
                }
            }
            Hdr::Frag(f) => {
                if f.complete().is_err() {
                    self.stats.unmap_errors += 1;
                }
            }
        }
    }

    fn place_header(&mut self, idx: u16, hdr: &[u8]) -> Result<(Iova, Hdr<M>)> {
        if let Some(b) = self.bounce.as_mut() {
            match b.fill(usize::from(idx), hdr) {
                Ok(iova) => return Ok((iova, Hdr::Slot(usize::from(idx)))),
                Err(pfrag::Error::HeaderTooLarge { .. }) => self.stats.header_fallbacks += 1,
                Err(e) => return Err(e.into()),
            }
        }
        let mut f = self.hdr_cache.refill(hdr.len(), true)?;
        f.as_mut_slice().copy_from_slice(hdr);
        self.stats.mapped_headers += 1;
        Ok((f.iova(), Hdr::Frag(f)))
    }
}

/// Context descriptors a packet with `offload` takes.
fn ctx_descs(offload: Offload) -> usize {
    usize::from(offload != Offload::None)
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
