//! A software NIC: a simulator of an 82576 TX queue that consumes advanced
//! descriptors from a ring in memory and does every DMA through a
//! [`Translate`] (IOMMU translation, IOTLB, faults).
//!
//! On each doorbell it walks the ring from its head to the tail, gathers each
//! packet's buffers page by page through the IOMMU, reads every payload byte
//! (verifying it against its flow's pattern and checksumming it), segments
//! TSO packets into MSS-sized frames with their IPv4 and TCP checksums, and
//! writes back `DD` on descriptors that asked for it. A translation fault
//! drops the packet and is counted; the model never touches memory the
//! IOMMU did not translate.

use pfrag::dma::{Dir, Fault, Translate};
use pfrag::{mem, Iova, VirtAddr};

use crate::csum::Csum;
use crate::desc::{self, Context, Data, Dcmd, Desc, Popts, Sta};
use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::flow;
use crate::pattern;

/// How much of each payload the model reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Touch {
    /// Every byte: verified against the flow pattern and checksummed.
    Checksum,
    /// One cache line per 4 KiB page (verified), no checksums: exposes the
    /// driver's own cost.
    Pages,
}

/// Settings of the model.
#[derive(Clone, Copy, Debug)]
pub struct SoftNicConfig {
    /// How much of each payload is read.
    pub touch: Touch,
    /// Keep every frame sent (for tests; only with [`Touch::Checksum`]).
    pub capture: bool,
}

impl Default for SoftNicConfig {
    fn default() -> Self {
        SoftNicConfig {
            touch: Touch::Checksum,
            capture: false,
        }
    }
}

/// Counters of the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NicStats {
    /// Packets (EOP-terminated descriptor chains) seen.
    pub packets: u64,
    /// Frames put on the (modelled) wire.
    pub frames: u64,
    /// Descriptors consumed.
    pub descs: u64,
    /// Payload bytes of packets sent.
    pub payload_bytes: u64,
    /// Payload bytes read and found equal to their flow's pattern.
    pub bytes_verified: u64,
    /// Distinct 4 KiB pages read for packet data, summed over packets.
    pub pages: u64,
    /// Packets dropped because a translation faulted.
    pub faults: u64,
    /// Packets whose payload did not match the pattern.
    pub bad_payload: u64,
    /// Malformed descriptors or packets.
    pub bad_desc: u64,
    /// Data buffers whose IOVA range crosses a 4 KiB page (a real NIC
    /// does not care; QEMU's emulated one drops such packets behind an
    /// IOMMU, see [`TxConfig::boundary`](crate::txq::TxConfig::boundary)).
    pub page_crossing_bufs: u64,
}

/// The largest header the model parses.
const MAX_HDR: usize = 256;

/// What the model parsed of one packet, once, from its context descriptor,
/// first data descriptor and header.
#[derive(Clone, Copy, Debug)]
struct Packet {
    maclen: usize,
    iplen: usize,
    l4len: usize,
    /// TCP sequence number of the first payload byte.
    seq0: u32,
    flow: u32,
    paylen: usize,
    mss: usize,
    popts: Popts,
}

impl Packet {
    /// Stream offset of the first payload byte (where its pattern starts).
    fn stream0(&self) -> u32 {
        self.seq0.wrapping_sub(flow::isn(self.flow))
    }
}

/// The software NIC.
pub struct SoftNic<T: Translate> {
    iommu: T,
    cfg: SoftNicConfig,
    ring: Option<(Iova, u16)>,
    head: u16,
    ctx: Context,
    first: Option<Data>,
    bufs: Vec<(Iova, usize)>,
    /// Translated pieces of the current packet: host address, length.
    pieces: Vec<(VirtAddr, usize)>,
    pages: Vec<u64>,
    frames: Vec<Vec<u8>>,
    stats: NicStats,
}

impl<T: Translate> std::fmt::Debug for SoftNic<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftNic")
            .field("cfg", &self.cfg)
            .field("head", &self.head)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<T: Translate> SoftNic<T> {
    /// A NIC whose DMA goes through `iommu`.
    pub fn new(iommu: T, cfg: SoftNicConfig) -> SoftNic<T> {
        SoftNic {
            iommu,
            cfg,
            ring: None,
            head: 0,
            ctx: Context::default(),
            first: None,
            bufs: Vec::with_capacity(64),
            pieces: Vec::with_capacity(64),
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

    fn read_desc(&self, at: Iova) -> Result<[u64; 2], Fault> {
        let t = self.iommu.translate(at, Dir::TO_DEVICE)?;
        if t.len < desc::SIZE as u64 || t.addr.raw() % 8 != 0 {
            return Err(Fault {
                iova: at,
                access: Dir::TO_DEVICE,
            });
        }
        // SAFETY: the IOMMU translated 16 aligned bytes into memory the
        // driver mapped for the device (its descriptor ring, kept alive while
        // attached); volatile reads create no references.
        Ok(unsafe { [mem::read_u64(t.addr), mem::read_u64(t.addr.offset(8))] })
    }

    fn write_back(&self, at: Iova) -> Result<(), Fault> {
        let at = at.offset(desc::STATUS_OFFSET as u64);
        let t = self.iommu.translate(at, Dir::FROM_DEVICE)?;
        // SAFETY: the IOMMU translated the aligned status dword for writing
        // into the driver's live ring, which the driver only reads volatile.
        unsafe { mem::write_u32(t.addr, Sta::DD.bits()) };
        Ok(())
    }

    /// Translates the current packet's buffers into host pieces.
    fn gather(&mut self) -> Result<usize, Fault> {
        self.pieces.clear();
        self.pages.clear();
        let mut total = 0;
        for &(iova, len) in &self.bufs {
            let mut off = 0;
            while off < len {
                let at = iova.offset(off as u64);
                let t = self.iommu.translate(at, Dir::TO_DEVICE)?;
                let n = (t.len as usize).min(len - off);
                self.pieces.push((t.addr, n));
                // Every 4 KiB page the piece covers (a superpage piece spans many).
                self.pages
                    .extend(at.page()..=at.offset(n as u64 - 1).page());
                off += n;
            }
            total += len;
        }
        self.pages.sort_unstable();
        self.pages.dedup();
        Ok(total)
    }

    /// Calls `f` with the packet's bytes `start..start+len`, piece by piece.
    fn range(&self, mut start: usize, mut len: usize, mut f: impl FnMut(&[u8])) {
        for &(addr, n) in &self.pieces {
            if len == 0 {
                break;
            }
            if start >= n {
                start -= n;
                continue;
            }
            let take = (n - start).min(len);
            // SAFETY: the piece was translated by the IOMMU for reading and
            // lies in memory the driver keeps alive and unwritten until this
            // packet's completion is written back.
            f(unsafe { mem::slice(addr.offset(start), take) });
            len -= take;
            start = 0;
        }
    }

    fn process(&mut self) {
        self.stats.packets += 1;
        let Some(first) = self.first.take() else {
            self.stats.bad_desc += 1;
            return;
        };
        let total = match self.gather() {
            Ok(t) => t,
            Err(_) => {
                self.stats.faults += 1;
                return;
            }
        };
        self.stats.pages += self.pages.len() as u64;
        let ctx = self.ctx;
        let (maclen, iplen, l4len) = (ctx.maclen(), ctx.iplen(), ctx.l4len());
        let hlen = maclen + iplen + l4len;
        let tse = first.cmd().contains(Dcmd::TSE);
        if hlen > MAX_HDR || hlen > total || iplen < 20 || l4len < 20 {
            self.stats.bad_desc += 1;
            return;
        }
        let paylen = total - hlen;
        let expect = if tse { paylen } else { total };
        let mss = if tse { ctx.mss() } else { paylen.max(1) };
        if first.paylen() as usize != expect || mss == 0 {
            self.stats.bad_desc += 1;
            return;
        }
        let mut hdr = [0u8; MAX_HDR];
        let mut at = 0;
        self.range(0, hlen, |s| {
            hdr[at..at + s.len()].copy_from_slice(s);
            at += s.len();
        });
        let tcp = maclen + iplen;
        let sport = u16::from_be_bytes([hdr[tcp], hdr[tcp + 1]]);
        let Some(fl) = flow::flow_of_port(sport) else {
            self.stats.bad_desc += 1;
            return;
        };
        let pkt = Packet {
            maclen,
            iplen,
            l4len,
            seq0: u32::from_be_bytes([hdr[tcp + 4], hdr[tcp + 5], hdr[tcp + 6], hdr[tcp + 7]]),
            flow: fl,
            paylen,
            mss,
            popts: first.popts(),
        };
        self.stats.payload_bytes += paylen as u64;
        match self.cfg.touch {
            Touch::Checksum => self.segment(&hdr[..hlen], &pkt),
            Touch::Pages => self.touch_pages(hlen, &pkt),
        }
    }

    /// Reads one cache line at the start of every page piece of the payload.
    fn touch_pages(&mut self, hlen: usize, pkt: &Packet) {
        let (fl, stream0) = (pkt.flow, pkt.stream0());
        let mut pos = 0usize; // packet offset of the current piece
        let mut ok = true;
        let mut verified = 0;
        for i in 0..self.pieces.len() {
            let (addr, n) = self.pieces[i];
            let start = hlen.saturating_sub(pos).min(n);
            let take = (n - start).min(64);
            if take > 0 {
                // SAFETY: as in `range`.
                let s = unsafe { mem::slice(addr.offset(start), take) };
                let off = stream0.wrapping_add((pos + start - hlen) as u32);
                ok &= pattern::verify(fl, off, s);
                verified += take as u64;
            }
            pos += n;
        }
        self.stats.frames += 1;
        if ok {
            self.stats.bytes_verified += verified;
        } else {
            self.stats.bad_payload += 1;
        }
    }

    /// Cuts the packet into frames of `mss` payload bytes, verifying and
    /// checksumming every byte.
    fn segment(&mut self, hdr: &[u8], pkt: &Packet) {
        let Packet {
            maclen,
            iplen,
            l4len,
            seq0,
            flow: fl,
            paylen,
            mss,
            popts,
        } = *pkt;
        let stream0 = pkt.stream0();
        let hlen = hdr.len();
        let tcp = maclen + iplen;
        let id0 = u16::from_be_bytes([hdr[maclen + 4], hdr[maclen + 5]]);
        let nseg = paylen.div_ceil(mss).max(1);
        let mut all_ok = true;
        for k in 0..nseg {
            let off = k * mss;
            let len = mss.min(paylen - off);
            let mut sum = Csum::new();
            let mut ok = true;
            let mut pos = off;
            let mut frame = self.cfg.capture.then(|| Vec::with_capacity(hlen + len));
            if let Some(fr) = frame.as_mut() {
                fr.extend_from_slice(hdr);
            }
            self.range(hlen + off, len, |s| {
                ok &= pattern::verify(fl, stream0.wrapping_add(pos as u32), s);
                sum.add(s);
                pos += s.len();
                if let Some(fr) = frame.as_mut() {
                    fr.extend_from_slice(s);
                }
            });
            let mut h = [0u8; MAX_HDR];
            h[..hlen].copy_from_slice(hdr);
            let ip = &mut h[maclen..maclen + iplen];
            ip[2..4].copy_from_slice(&((iplen + l4len + len) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&id0.wrapping_add(k as u16).to_be_bytes());
            if popts.contains(Popts::IXSM) {
                ip[10..12].fill(0);
                let mut c = Csum::new();
                c.add(ip);
                ip[10..12].copy_from_slice(&c.finish().to_be_bytes());
            }
            let t = &mut h[tcp..tcp + l4len];
            t[4..8].copy_from_slice(&seq0.wrapping_add(off as u32).to_be_bytes());
            if k + 1 < nseg {
                t[13] &= !0x09; // FIN and PSH only on the last segment
            }
            if popts.contains(Popts::TXSM) {
                t[16..18].fill(0);
                let mut c = Csum::new();
                c.add(&h[maclen + 12..maclen + 20]); // source and destination
                c.add_u16(6);
                c.add_u16((l4len + len) as u16);
                c.add(&h[tcp..tcp + l4len]);
                c.add_u16(sum.sum());
                h[tcp + 16..tcp + 18].copy_from_slice(&c.finish().to_be_bytes());
            }
            if let Some(mut fr) = frame {
                fr[..hlen].copy_from_slice(&h[..hlen]);
                self.frames.push(fr);
            }
            self.stats.frames += 1;
            if ok {
                self.stats.bytes_verified += len as u64;
            }
            all_ok &= ok;
        }
        if !all_ok {
            self.stats.bad_payload += 1;
        }
    }
}

impl<T: Translate> TxDevice for SoftNic<T> {
    fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        if len == 0 || len % 8 != 0 {
            return Err(Error::BadConfig {
                what: "ring length (multiple of 8)",
                value: u64::from(len),
            });
        }
        self.ring = Some((ring, len));
        self.head = 0;
        Ok(())
    }

    fn kick(&mut self, tail: u16) -> Result<()> {
        let (base, n) = self.ring.ok_or(Error::NotAttached)?;
        if tail >= n {
            return Err(Error::BadConfig {
                what: "tail",
                value: u64::from(tail),
            });
        }
        while self.head != tail {
            let at = base.offset(u64::from(self.head) * desc::SIZE as u64);
            self.head = (self.head + 1) % n;
            self.stats.descs += 1;
            let words = match self.read_desc(at) {
                Ok(w) => w,
                Err(_) => {
                    self.stats.faults += 1;
                    continue;
                }
            };
            match Desc::decode(words) {
                Desc::Context(c) => self.ctx = c,
                Desc::Data(d) => {
                    if self.bufs.is_empty() {
                        self.first = Some(d);
                    }
                    self.bufs.push((Iova(d.addr), usize::from(d.len())));
                    let last = d.addr + u64::from(d.len()).max(1) - 1;
                    if d.addr / pfrag::PAGE_SIZE != last / pfrag::PAGE_SIZE {
                        self.stats.page_crossing_bufs += 1;
                    }
                    if d.cmd().contains(Dcmd::EOP) {
                        self.process();
                        self.bufs.clear();
                    }
                    if d.cmd().contains(Dcmd::RS) && self.write_back(at).is_err() {
                        self.stats.faults += 1;
                    }
                }
                Desc::Other(_) => self.stats.bad_desc += 1,
            }
        }
        Ok(())
    }
}
