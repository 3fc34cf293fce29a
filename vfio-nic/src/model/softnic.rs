//! A software NIC: a simulator of an 82576 TX queue that consumes advanced
//! descriptors from a ring in memory and does every DMA through a
//! [`Translate`] (IOMMU translation, IOTLB, faults).
//!
//! On each doorbell it walks the ring from its head to the tail, reads each
//! packet's buffers through the IOMMU ([`Translate::read`], page by page),
//! reads every payload byte (verifying it against its flow's pattern and
//! checksumming it), segments TSO packets into MSS-sized frames with their
//! IPv4 and TCP checksums, and writes back `DD` on descriptors that asked
//! for it ([`Translate::write`]). The model never dereferences an address
//! itself: all its memory access is DMA through the IOMMU, which refuses
//! anything not mapped. A translation fault drops the packet (nothing of it
//! is counted as sent) and is counted; after a descriptor it could not
//! read, the model skips to the next packet's first descriptor (see
//! [`NicStats::faults`] and `faulted_packets` for the counts).

use pfrag::dma::{Fault, Translate};
use pfrag::Iova;

use super::resync::Resync;
use super::ring::{read_desc, report, Ring};
use super::segment::{
    read_range, segment_pages, segments, Outcome, Packet, Seed, Segmenter, MAX_HDR,
};
pub use super::stats::{frame_bytes, frames, line_bytes, wire_bytes, NicStats, WIRE_GAP};
use crate::desc::{Context, Data, Dcmd, Desc};
use crate::device::TxDevice;
use crate::error::Result;
use crate::gen::flow;
use crate::gen::pattern;

/// How much of each payload the model reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Touch {
    /// Every byte: verified against the flow pattern and checksummed.
    Checksum,
    /// One cache line per 4 KiB page (verified), no checksums: exposes the
    /// driver's own cost.
    Pages,
}

impl Touch {
    /// Its short name, as `Display` writes it.
    pub fn name(self) -> &'static str {
        match self {
            Touch::Checksum => "checksum",
            Touch::Pages => "pages",
        }
    }
}

impl std::fmt::Display for Touch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Touch {
    type Err = String;
    /// `checksum` or `pages`.
    fn from_str(s: &str) -> Result<Touch, String> {
        match s {
            "checksum" => Ok(Touch::Checksum),
            "pages" => Ok(Touch::Pages),
            _ => Err(format!("'{s}' is not a touch mode (checksum, pages)")),
        }
    }
}

/// Settings of the model. [`Config::default()`] reads and checksums every
/// byte, keeps no frames, and verifies the test pattern of
/// [`gen`](crate::gen)'s flows.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// How much of each payload is read. Default [`Touch::Checksum`]
    /// (every byte).
    pub touch: Touch,
    /// Keep every frame sent (for tests; only with [`Touch::Checksum`]).
    /// Default off.
    pub capture: bool,
    /// Check every payload byte against its flow's test pattern (the traffic
    /// generator, [`gen`](crate::gen), writes it; `bytes_verified` counts
    /// matches). Off
    /// for a driver's own payloads, which the model then only reads,
    /// checksums and segments. Default on: turn it off for payloads that
    /// are not the generator's.
    pub verify: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            touch: Touch::Checksum,
            capture: false,
            verify: true,
        }
    }
}

/// Most data buffers one packet may chain ([`format::MAX_BUFS`](crate::format::MAX_BUFS),
/// the TX queue's bound on `max_bufs`); a longer chain is a malformed packet.
pub const MAX_BUFS: usize = crate::format::MAX_BUFS;

/// The software NIC.
pub struct SoftNic<T: Translate> {
    iommu: T,
    cfg: Config,
    ring: Ring,
    /// Skipping after descriptors that could not be read.
    resync: Resync,
    ctx: Context,
    first: Option<Data>,
    /// The current packet's buffers: IOVA, length.
    bufs: Vec<(Iova, usize)>,
    pages: Vec<u64>,
    frames: Vec<Vec<u8>>,
    stats: NicStats,
}

impl<T: Translate> std::fmt::Debug for SoftNic<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftNic")
            .field("cfg", &self.cfg)
            .field("ring", &self.ring)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<T: Translate> SoftNic<T> {
    /// A NIC whose DMA goes through `iommu`.
    pub fn new(iommu: T, cfg: Config) -> SoftNic<T> {
        SoftNic {
            iommu,
            cfg,
            ring: Ring::default(),
            resync: Resync::Off,
            ctx: Context::default(),
            first: None,
            bufs: Vec::with_capacity(64),
            pages: Vec::with_capacity(64),
            frames: Vec::new(),
            stats: NicStats::default(),
        }
    }

    /// Its counters.
    pub fn stats(&self) -> NicStats {
        self.stats
    }

    /// The frames captured so far (with `capture`), emptied.
    pub fn take_frames(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.frames)
    }

    /// The translation the model uses.
    pub fn iommu(&self) -> &T {
        &self.iommu
    }

    /// Drops a packet whose descriptors came without their end (`EOP`):
    /// its buffers belong to a ring the device no longer uses, or one of
    /// its descriptors could not be read.
    fn forget_packet(&mut self) {
        self.bufs.clear();
        self.first = None;
    }

    /// Distinct 4 KiB IOVA pages the current packet's buffers cover.
    fn count_pages(&mut self) -> u64 {
        self.pages.clear();
        for &(iova, len) in &self.bufs {
            if len > 0 {
                self.pages
                    .extend(iova.page()..=iova.offset(len as u64 - 1).page());
            }
        }
        self.pages.sort_unstable();
        self.pages.dedup();
        self.pages.len() as u64
    }

    /// Parses the packet's context, first descriptor and header; `None`
    /// (counted) for a malformed packet, `Err` for a fault.
    ///
    /// # Safety
    /// The buffers in `self.bufs` are handed to the device: a doorbell
    /// named them, and the packet is not yet reported done
    /// ([`TxDevice::kick`]'s promise).
    unsafe fn parse(&mut self, first: Data) -> Result<Option<(Packet, [u8; MAX_HDR])>, Fault> {
        let total: usize = self.bufs.iter().map(|b| b.1).sum();
        let ctx = self.ctx;
        let (maclen, iplen, l4len) = (ctx.maclen(), ctx.iplen(), ctx.l4len());
        let hlen = maclen + iplen + l4len;
        let tse = first.cmd().contains(Dcmd::TSE);
        let tcp_ctx = ctx.is_tcp();
        let l4_ok = if tcp_ctx {
            l4len >= 20
        } else {
            l4len == 8 && !tse
        };
        let ip_ok = if ctx.is_ipv4() {
            iplen >= 20
        } else {
            iplen == 40
        };
        if hlen > MAX_HDR || hlen > total || !ip_ok || !l4_ok || maclen < 14 {
            return Ok(None);
        }
        let paylen = total - hlen;
        let expect = if tse { paylen } else { total };
        let mss = if tse { ctx.mss() } else { paylen.max(1) };
        if first.paylen() as usize != expect || mss == 0 {
            return Ok(None);
        }
        // A segment is one IP packet: its 16-bit length field (IPv4's
        // counts the IP header, IPv6's does not) must hold the longest.
        let ip_hdr = if ctx.is_ipv4() { iplen } else { 0 };
        if tse && ip_hdr + l4len + mss.min(paylen) > usize::from(u16::MAX) {
            return Ok(None);
        }
        let mut hdr = [0u8; MAX_HDR];
        let mut at = 0;
        // SAFETY: `self.bufs` is handed to the device (our caller's promise).
        unsafe {
            read_range(&self.iommu, &self.bufs, 0, hlen, &mut |s| {
                hdr[at..at + s.len()].copy_from_slice(s);
                at += s.len();
            })
        }?;
        let tcp = maclen + iplen;
        let sport = u16::from_be_bytes([hdr[tcp], hdr[tcp + 1]]);
        let verify = self.cfg.verify;
        let fl = match flow::flow_of_port(sport) {
            Some(f) => f,
            None if !verify => 0,
            None => return Ok(None),
        };
        let seq0 = if tcp_ctx {
            u32::from_be_bytes([hdr[tcp + 4], hdr[tcp + 5], hdr[tcp + 6], hdr[tcp + 7]])
        } else {
            flow::isn(fl)
        };
        Ok(Some((
            Packet {
                maclen,
                iplen,
                l4len,
                seq0,
                flow: fl,
                paylen,
                mss,
                popts: first.popts(),
                tcp: tcp_ctx,
                ipv4: ctx.is_ipv4(),
                verify,
                segmented: tse,
                seed: Seed::SegmentAdds,
            },
            hdr,
        )))
    }

    /// Processes the packet whose buffers `self.bufs` holds.
    /// # Safety
    /// The buffers in `self.bufs` are handed to the device: a doorbell
    /// named them, and the packet is not yet reported done
    /// ([`TxDevice::kick`]'s promise).
    unsafe fn process(&mut self) {
        self.stats.packets += 1;
        let Some(first) = self.first.take() else {
            self.stats.bad_desc += 1;
            return;
        };
        if first.popts().is_empty() && !first.cmd().contains(Dcmd::TSE) {
            // SAFETY: our caller's promise, passed on.
            unsafe { self.raw(first) };
            return;
        }
        // SAFETY: our caller's promise, passed on.
        let (pkt, hdr) = match unsafe { self.parse(first) } {
            Ok(Some(p)) => p,
            Ok(None) => {
                self.stats.bad_desc += 1;
                return;
            }
            Err(_) => {
                self.stats.count_read_fault();
                return;
            }
        };
        let hlen = pkt.maclen + pkt.iplen + pkt.l4len;
        // SAFETY: our caller's promise, passed on.
        let read = unsafe {
            match self.cfg.touch {
                Touch::Checksum => self.segment(&hdr[..hlen], &pkt),
                Touch::Pages => self.touch_pages(hlen, &pkt),
            }
        };
        let Ok((out, frames)) = read else {
            self.stats.count_read_fault();
            return;
        };
        let pages = self.count_pages();
        let seg = segment_pages(&self.bufs, hlen, &pkt);
        self.stats.count_sent(&out, hlen, &pkt, pages, seg);
        self.frames.extend(frames);
    }

    /// A packet without offloads: its bytes go out as one frame, as given.
    ///
    /// # Safety
    /// The buffers in `self.bufs` are handed to the device: a doorbell
    /// named them, and the packet is not yet reported done
    /// ([`TxDevice::kick`]'s promise).
    unsafe fn raw(&mut self, first: Data) {
        let total: usize = self.bufs.iter().map(|b| b.1).sum();
        if total == 0 || first.paylen() as usize != total {
            // A packet of no bytes puts no frame on the wire.
            self.stats.bad_desc += 1;
            return;
        }
        let mut frame = Vec::with_capacity(if self.cfg.capture { total } else { 0 });
        let capture = self.cfg.capture;
        // SAFETY: `self.bufs` is handed to the device (our caller's promise).
        let read = unsafe {
            read_range(&self.iommu, &self.bufs, 0, total, &mut |s| {
                if capture {
                    frame.extend_from_slice(s);
                }
            })
        };
        if read.is_err() {
            self.stats.count_read_fault();
            return;
        }
        let pages = self.count_pages();
        self.stats.count_raw(total, pages);
        if capture {
            self.frames.push(frame);
        }
    }

    /// Reads one cache line at the start of every 4 KiB page of the payload.
    ///
    /// # Safety
    /// The buffers in `self.bufs` are handed to the device: a doorbell
    /// named them, and the packet is not yet reported done
    /// ([`TxDevice::kick`]'s promise).
    unsafe fn touch_pages(
        &self,
        hlen: usize,
        pkt: &Packet,
    ) -> Result<(Outcome, Vec<Vec<u8>>), Fault> {
        let mut out = Outcome {
            frames: pkt.frames() as u64,
            ok: true,
            ..Outcome::default()
        };
        let mut pos = 0usize; // packet offset of the current buffer
        for &(iova, len) in &self.bufs {
            let mut off = hlen.saturating_sub(pos).min(len);
            while off < len {
                let at = iova.offset(off as u64);
                let page_left = (pfrag::PAGE_SIZE - (at.raw() & (pfrag::PAGE_SIZE - 1))) as usize;
                let take = (len - off).min(64).min(page_left);
                let stream = pkt.stream0().wrapping_add((pos + off - hlen) as u32);
                // SAFETY: `take` bytes at `at` lie inside this buffer of
                // `self.bufs`, which our caller promised is handed over.
                unsafe {
                    self.iommu.read(at, take, &mut |s| {
                        if pkt.verify {
                            out.ok &= pattern::verify(pkt.flow, stream, s);
                            out.verified += s.len() as u64;
                        }
                    })
                }?;
                off += page_left.min(len - off);
            }
            pos += len;
        }
        if !out.ok {
            out.verified = 0;
        }
        Ok((out, Vec::new()))
    }

    /// Cuts the packet into frames of `mss` payload bytes, verifying and
    /// checksumming every byte.
    ///
    /// Like a TSO engine, it fetches the payload segment by segment: each
    /// segment's pages are translated for that segment.
    ///
    /// # Safety
    /// The buffers in `self.bufs` are handed to the device: a doorbell
    /// named them, and the packet is not yet reported done
    /// ([`TxDevice::kick`]'s promise).
    unsafe fn segment(&self, hdr: &[u8], pkt: &Packet) -> Result<(Outcome, Vec<Vec<u8>>), Fault> {
        let mut seg = Segmenter::new(pkt, hdr, self.cfg.capture);
        for (at, len) in segments(pkt.paylen, pkt.mss) {
            // SAFETY: `self.bufs` is handed to the device (our caller's
            // promise).
            unsafe {
                read_range(&self.iommu, &self.bufs, hdr.len() + at, len, &mut |s| {
                    seg.feed(s)
                })
            }?;
        }
        Ok((seg.out, seg.frames))
    }
}

impl<T: Translate> super::Model for SoftNic<T> {
    fn counters(&self) -> NicStats {
        self.stats
    }
    fn take_frames(&mut self) -> Vec<Vec<u8>> {
        SoftNic::take_frames(self)
    }
}

impl<T: Translate> TxDevice for SoftNic<T> {
    type Format = crate::format::igb::Advanced;
    fn format(&self) -> Self::Format {
        crate::format::igb::Advanced
    }

    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        self.ring.attach(ring, len)?;
        self.forget_packet();
        self.resync = Resync::Off;
        Ok(())
    }

    fn detach(&mut self) -> Result<()> {
        self.ring.detach();
        self.forget_packet();
        self.resync = Resync::Off;
        Ok(())
    }

    fn head(&mut self) -> Option<u16> {
        self.ring.head()
    }

    unsafe fn kick(&mut self, tail: u16) -> Result<()> {
        self.ring.check(tail)?;
        while let Some(at) = self.ring.next(tail) {
            self.stats.descs += 1;
            // SAFETY: `at` lies between the head and `tail`: our caller
            // handed this descriptor to the device.
            let Ok(words) = (unsafe { read_desc(&self.iommu, at) }) else {
                // A descriptor that cannot be read may have been the
                // packet's next or last one: the packet being gathered is
                // lost (dropped as faulted), and what follows is skipped
                // up to the next packet's start.
                let gathering = !self.bufs.is_empty();
                self.resync.unreadable(1, gathering, &mut self.stats);
                self.forget_packet();
                continue;
            };
            match Desc::decode(words) {
                Desc::Context(c) => {
                    self.resync.context(&mut self.stats);
                    self.ctx = c;
                }
                Desc::Data(d)
                    if self.resync.skipping() && !self.resync.resumes_at(d, &mut self.stats) =>
                {
                    // The rest of a lost packet: not read, but done.
                    // SAFETY: `at` was handed over, as above.
                    unsafe { report(&self.iommu, at, d, &mut self.stats) };
                }
                Desc::Data(d) => {
                    if self.bufs.is_empty() {
                        self.first = Some(d);
                    }
                    self.bufs.push((Iova(d.addr), usize::from(d.len())));
                    let last = d.addr.saturating_add(u64::from(d.len()).max(1) - 1);
                    if d.addr / pfrag::PAGE_SIZE != last / pfrag::PAGE_SIZE {
                        self.stats.page_crossing_bufs += 1;
                    }
                    if self.bufs.len() > MAX_BUFS {
                        // More buffers than one packet may have: a broken
                        // chain (EOP missing or late). Dropped as malformed
                        // rather than grown forever, its rest skipped up to
                        // the next packet's start; its descriptor's report
                        // is still written back, below, as for any dropped
                        // packet, so a driver waiting on it sees it done.
                        self.stats.packets += 1;
                        self.stats.bad_desc += 1;
                        self.forget_packet();
                        self.resync.dropped(d);
                    } else if d.cmd().contains(Dcmd::EOP) {
                        // SAFETY: every buffer in `self.bufs` was named by
                        // a descriptor of this doorbell or an earlier one
                        // of the same attachment (`attach` and `detach`
                        // forget a partial packet), and the packet is not
                        // reported done before its last descriptor's
                        // write-back, below, or a later packet's (this
                        // model reads in ring order): our caller's promise.
                        unsafe { self.process() };
                        self.bufs.clear();
                    }
                    // SAFETY: `at` was handed over, as above.
                    unsafe { report(&self.iommu, at, d, &mut self.stats) };
                }
                Desc::Other(_) => self.stats.bad_desc += 1,
            }
        }
        Ok(())
    }
}
