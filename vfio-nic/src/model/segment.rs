//! Cutting one packet's payload into frames: the software NIC's TSO and
//! checksum engine, fed piece by piece as the IOMMU hands the bytes over.

use pfrag::dma::{Fault, Translate};
use pfrag::Iova;

use crate::csum::{self, Csum};
use crate::desc::Popts;
use crate::gen::{flow, pattern};

/// The largest header the model parses.
pub(super) const MAX_HDR: usize = 256;

/// What the model parsed of one packet, once, from its context descriptor,
/// first data descriptor and header.
#[derive(Clone, Copy, Debug)]
pub(super) struct Packet {
    pub(super) maclen: usize,
    pub(super) iplen: usize,
    pub(super) l4len: usize,
    /// TCP sequence number of the first payload byte.
    pub(super) seq0: u32,
    pub(super) flow: u32,
    pub(super) paylen: usize,
    pub(super) mss: usize,
    pub(super) popts: Popts,
    /// TCP (else UDP), from the context descriptor.
    pub(super) tcp: bool,
    /// IPv4 (else IPv6), from the context descriptor.
    pub(super) ipv4: bool,
    /// Check the payload against the flow's pattern.
    pub(super) verify: bool,
    /// The device cuts the packet into segments (the 82576's TSE, a virtio
    /// GSO type): it writes each segment's IP length (and IPv4 id). A
    /// packet it does not segment goes out with the headers the driver
    /// wrote, lengths included.
    pub(super) segmented: bool,
    /// What the L4 checksum field holds, which the device completes.
    pub(super) seed: Seed,
}

/// The partial sum a driver leaves in the L4 checksum field, which the
/// device completes by summing the L4 header (the field included) and the
/// payload: the pseudo-header sum, over an L4 length that depends on the
/// device when it segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Seed {
    /// Over the whole packet's L4 length, which the device moves to each
    /// segment's (virtio-net's `NEEDS_CSUM`, as Linux's GSO leaves it).
    WholeLength,
    /// Over no length when segmenting, the device adding each segment's;
    /// over the packet's own otherwise (the 82576's `TXSM`).
    SegmentAdds,
}

impl Packet {
    /// Stream offset of the first payload byte (where its pattern starts).
    pub(super) fn stream0(&self) -> u32 {
        self.seq0.wrapping_sub(flow::isn(self.flow))
    }

    /// Frames the packet goes out as: one per MSS segment, at least one.
    pub(super) fn frames(&self) -> usize {
        super::stats::frames(self.paylen, self.mss) as usize
    }
}

/// What one packet produced, committed to the counters only once the whole
/// packet was read without a fault.
#[derive(Default)]
pub(super) struct Outcome {
    pub(super) frames: u64,
    pub(super) verified: u64,
    pub(super) ok: bool,
}

/// The pieces `(iova, len)` of packet bytes `start..start + len` (offsets
/// over the packet's buffers `bufs`), in order, each inside one buffer.
pub(super) fn pieces(
    bufs: &[(Iova, usize)],
    mut start: usize,
    mut len: usize,
) -> impl Iterator<Item = (Iova, usize)> + '_ {
    bufs.iter().filter_map(move |&(iova, blen)| {
        if len == 0 {
            return None;
        }
        if start >= blen {
            start -= blen;
            return None;
        }
        let take = (blen - start).min(len);
        let piece = (iova.offset(start as u64), take);
        len -= take;
        start = 0;
        Some(piece)
    })
}

/// Reads packet bytes `start..start + len` (offsets over the packet's
/// buffers `bufs`) through `iommu`, piece by piece.
///
/// # Safety
/// Every buffer in `bufs` is handed to the device (named by a descriptor a
/// doorbell handed over, and not yet reported done).
pub(super) unsafe fn read_range<T: Translate>(
    iommu: &T,
    bufs: &[(Iova, usize)],
    start: usize,
    len: usize,
    f: &mut dyn FnMut(&[u8]),
) -> Result<(), Fault> {
    for (at, n) in pieces(bufs, start, len) {
        // SAFETY: `pieces` yields ranges inside `bufs`, which the caller
        // promised are handed to the device.
        unsafe { iommu.read(at, n, f) }?;
    }
    Ok(())
}

/// Distinct 4 KiB IOVA pages that packet bytes `start..start + len` (over
/// the buffers `bufs`) span: what a DMA engine translates to fetch them.
pub(super) fn range_pages(bufs: &[(Iova, usize)], start: usize, len: usize) -> u64 {
    let mut pages = 0u64;
    let mut last: Option<u64> = None;
    for (at, n) in pieces(bufs, start, len) {
        let (first, end) = (at.page(), at.offset(n as u64 - 1).page());
        pages += end - first + 1;
        if last == Some(first) {
            pages -= 1; // the previous buffer ended in this page
        }
        last = Some(end);
    }
    pages
}

/// Distinct 4 KiB pages each MSS segment of `pkt`'s payload spans,
/// summed, for a payload starting at packet offset `start` of `bufs`: the
/// page translations a TSO engine makes fetching it segment by segment.
pub(super) fn segment_pages(bufs: &[(Iova, usize)], start: usize, pkt: &Packet) -> u64 {
    segments(pkt.paylen, pkt.mss)
        .map(|(at, len)| range_pages(bufs, start + at, len))
        .sum()
}

/// The MSS segments of a payload of `paylen` bytes: `(offset, len)` each.
pub(super) fn segments(paylen: usize, mss: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..paylen)
        .step_by(mss.max(1))
        .map(move |at| (at, mss.min(paylen - at)))
}

/// Cuts a payload stream into MSS-sized frames: verifies every byte against
/// the flow's pattern, checksums it, and (with capture) keeps the frames.
pub(super) struct Segmenter<'a> {
    pkt: &'a Packet,
    hdr: &'a [u8],
    id0: u16,
    nseg: usize,
    /// Segment being filled, its length and bytes so far.
    k: usize,
    len: usize,
    fill: usize,
    sum: Csum,
    ok: bool,
    frame: Option<Vec<u8>>,
    capture: bool,
    pub(super) out: Outcome,
    pub(super) frames: Vec<Vec<u8>>,
}

impl<'a> Segmenter<'a> {
    pub(super) fn new(pkt: &'a Packet, hdr: &'a [u8], capture: bool) -> Segmenter<'a> {
        let m = pkt.maclen;
        let mut s = Segmenter {
            pkt,
            hdr,
            id0: u16::from_be_bytes([hdr[m + 4], hdr[m + 5]]),
            nseg: pkt.frames(),
            k: 0,
            len: 0,
            fill: 0,
            sum: Csum::new(),
            ok: true,
            frame: None,
            capture,
            out: Outcome {
                ok: true,
                ..Outcome::default()
            },
            frames: Vec::new(),
        };
        s.start(0);
        s
    }

    fn start(&mut self, k: usize) {
        self.k = k;
        self.len = self.pkt.mss.min(self.pkt.paylen - k * self.pkt.mss);
        self.fill = 0;
        self.sum = Csum::new();
        self.ok = true;
        self.frame = self.capture.then(|| {
            let mut v = Vec::with_capacity(self.hdr.len() + self.len);
            v.extend_from_slice(self.hdr);
            v
        });
        if self.len == 0 {
            self.finish();
        }
    }

    pub(super) fn feed(&mut self, mut s: &[u8]) {
        while !s.is_empty() && self.k < self.nseg {
            let take = s.len().min(self.len - self.fill);
            let off = self.k * self.pkt.mss + self.fill;
            let piece = &s[..take];
            if self.pkt.verify {
                let at = self.pkt.stream0().wrapping_add(off as u32);
                self.ok &= pattern::verify(self.pkt.flow, at, piece);
            }
            self.sum.add(piece);
            if let Some(f) = self.frame.as_mut() {
                f.extend_from_slice(piece);
            }
            self.fill += take;
            s = &s[take..];
            if self.fill == self.len {
                self.finish();
            }
        }
    }

    /// Completes segment `k`: its headers, checksums and counters.
    fn finish(&mut self) {
        let p = self.pkt;
        let (maclen, iplen, l4len, hlen) = (p.maclen, p.iplen, p.l4len, self.hdr.len());
        let tcp = maclen + iplen;
        let mut h = [0u8; MAX_HDR];
        h[..hlen].copy_from_slice(self.hdr);
        let ip = &mut h[maclen..maclen + iplen];
        // A segment's IPv4 total length and id, or IPv6 payload length; a
        // packet not segmented keeps the driver's.
        if p.segmented && p.ipv4 {
            ip[2..4].copy_from_slice(&((iplen + l4len + self.len) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&self.id0.wrapping_add(self.k as u16).to_be_bytes());
        } else if p.segmented {
            ip[4..6].copy_from_slice(&((l4len + self.len) as u16).to_be_bytes());
        }
        if p.ipv4 && p.popts.contains(Popts::IXSM) {
            csum::fill_ipv4_header(ip);
        }
        let off = self.k * p.mss;
        let t = &mut h[tcp..tcp + l4len];
        // Where the L4 checksum goes.
        let at = if p.tcp {
            t[4..8].copy_from_slice(&p.seq0.wrapping_add(off as u32).to_be_bytes());
            if self.k + 1 < self.nseg {
                t[13] &= !0x09; // FIN and PSH only on the last segment
            }
            16
        } else {
            6
        };
        if p.popts.contains(Popts::TXSM) {
            let l4 = &mut h[tcp..tcp + l4len];
            let mut c = match p.seed {
                Seed::WholeLength => partial_sum(l4, at, l4len + p.paylen, l4len + self.len),
                Seed::SegmentAdds => {
                    let mut c = partial_sum(l4, at, 0, 0);
                    if p.segmented {
                        c.add_u16((l4len + self.len) as u16);
                    }
                    c
                }
            };
            c.add_u16(self.sum.sum());
            let mut sum = c.finish();
            if !p.tcp && sum == 0 {
                sum = 0xffff; // UDP sends a computed zero as all ones
            }
            h[tcp + at..tcp + at + 2].copy_from_slice(&sum.to_be_bytes());
        }
        if let Some(mut fr) = self.frame.take() {
            fr[..hlen].copy_from_slice(&h[..hlen]);
            self.frames.push(fr);
        }
        self.out.frames += 1;
        if self.ok && p.verify {
            self.out.verified += self.len as u64;
        }
        self.out.ok &= self.ok;
        if self.k + 1 < self.nseg {
            self.start(self.k + 1);
        } else {
            self.k = self.nseg;
        }
    }
}

/// The sum a device completing a partial checksum starts from: the L4
/// header `l4` as the driver left it, its field at `at` moved from the
/// whole packet's L4 length `whole` to the segment's `part` (as Linux's
/// `tcp_gso_segment` does; nothing moves for an unsegmented packet). No
/// pseudo-header of the device's own: the field carries it.
fn partial_sum(l4: &mut [u8], at: usize, whole: usize, part: usize) -> Csum {
    if whole != part {
        let field = u16::from_be_bytes([l4[at], l4[at + 1]]);
        l4[at..at + 2].copy_from_slice(&csum::reseat_len(field, whole, part).to_be_bytes());
    }
    let mut c = Csum::new();
    c.add(l4);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_pages_counts_each_page_once() {
        let p = pfrag::PAGE_SIZE as usize;
        // One buffer: a range inside a page, one across a boundary.
        let one = [(Iova(0x10_0000), 4 * p)];
        assert_eq!(range_pages(&one, 0, p), 1);
        assert_eq!(range_pages(&one, 100, p), 2);
        assert_eq!(range_pages(&one, 0, 4 * p), 4);
        // Two buffers sharing a page count it once; a skipped head buffer
        // counts nothing.
        let two = [(Iova(0x10_0000), 100), (Iova(0x10_0064), p)];
        assert_eq!(range_pages(&two, 0, 100 + p), 2);
        assert_eq!(range_pages(&two, 100, 10), 1);
        assert_eq!(range_pages(&two, 0, 0), 0);
    }
}
