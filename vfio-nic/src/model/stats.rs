//! The models' counters ([`NicStats`]) and what a frame costs on the wire.

use super::segment::Outcome;

/// Counters of the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NicStats {
    /// Packets seen: descriptor chains ended by EOP, and chains dropped
    /// before their end (longer than [`MAX_BUFS`](super::softnic::MAX_BUFS),
    /// or cut by a descriptor that could not be read).
    pub packets: u64,
    /// Frames put on the (modelled) wire.
    pub frames: u64,
    /// Descriptors consumed.
    pub descs: u64,
    /// Payload bytes of packets sent.
    pub payload_bytes: u64,
    /// Ethernet bytes put on the (modelled) wire: every frame's headers,
    /// payload and FCS, at least 64 per frame; the preamble and the
    /// inter-frame gap ([`WIRE_GAP`] per frame) are not included.
    pub wire_bytes: u64,
    /// Payload bytes read and found equal to their flow's pattern.
    pub bytes_verified: u64,
    /// Payload bytes of packets delivered whole and intact: no fault, and
    /// every byte the model checked matched. Throughput counts these.
    pub delivered_bytes: u64,
    /// Distinct 4 KiB pages read for packet data, summed over packets.
    pub pages: u64,
    /// Distinct 4 KiB pages each MSS segment's payload spans, summed over
    /// segments: the page translations a TSO engine makes fetching the
    /// payload segment by segment (offloaded packets).
    pub segment_pages: u64,
    /// Packets dropped because a translation faulted.
    pub faults: u64,
    /// Packets whose payload did not match the pattern.
    pub bad_payload: u64,
    /// Malformed descriptors or packets.
    pub bad_desc: u64,
    /// Data buffers whose IOVA range crosses a 4 KiB page (a real NIC
    /// does not care; QEMU's emulated one drops such packets behind an
    /// IOMMU, see [`tx::Config::boundary`](crate::tx::Config::boundary)).
    pub page_crossing_bufs: u64,
    /// Status words written back: descriptors that asked (RS).
    pub write_backs: u64,
}

impl NicStats {
    /// Counts an offloaded packet sent as `out`: `hlen` header bytes per
    /// frame, `paylen` payload bytes, `pages` and `segment_pages` read.
    pub(super) fn count_sent(
        &mut self,
        out: &Outcome,
        hlen: usize,
        paylen: usize,
        pages: u64,
        segment_pages: u64,
    ) {
        self.pages += pages;
        self.segment_pages += segment_pages;
        self.payload_bytes += paylen as u64;
        self.wire_bytes += wire_bytes(out.frames, hlen, paylen);
        self.frames += out.frames;
        self.bytes_verified += out.verified;
        if out.ok {
            self.delivered_bytes += paylen as u64;
        } else {
            self.bad_payload += 1;
        }
    }

    /// Counts a frame of `len` bytes sent as given, over `pages` pages.
    pub(super) fn count_raw(&mut self, len: usize, pages: u64) {
        self.pages += pages;
        self.payload_bytes += len as u64;
        self.wire_bytes += wire_bytes(1, 0, len);
        self.delivered_bytes += len as u64;
        self.frames += 1;
    }

    /// `self - earlier`, field by field: the work done in between. A
    /// field that is smaller in `self` (the arguments swapped) gives 0:
    /// the subtraction saturates.
    pub fn since(&self, earlier: &NicStats) -> NicStats {
        self.zip(earlier, u64::saturating_sub)
    }

    /// `self + other`, field by field (totals over queues).
    pub fn plus(&self, other: &NicStats) -> NicStats {
        self.zip(other, u64::wrapping_add)
    }

    fn zip(&self, o: &NicStats, f: fn(u64, u64) -> u64) -> NicStats {
        NicStats {
            packets: f(self.packets, o.packets),
            frames: f(self.frames, o.frames),
            descs: f(self.descs, o.descs),
            payload_bytes: f(self.payload_bytes, o.payload_bytes),
            wire_bytes: f(self.wire_bytes, o.wire_bytes),
            bytes_verified: f(self.bytes_verified, o.bytes_verified),
            delivered_bytes: f(self.delivered_bytes, o.delivered_bytes),
            pages: f(self.pages, o.pages),
            segment_pages: f(self.segment_pages, o.segment_pages),
            faults: f(self.faults, o.faults),
            bad_payload: f(self.bad_payload, o.bad_payload),
            bad_desc: f(self.bad_desc, o.bad_desc),
            page_crossing_bufs: f(self.page_crossing_bufs, o.page_crossing_bufs),
            write_backs: f(self.write_backs, o.write_backs),
        }
    }
}

/// Bytes a frame occupies on an Ethernet wire besides itself: the preamble
/// and start delimiter (8) and the inter-frame gap (12).
pub const WIRE_GAP: u64 = 20;

/// Ethernet bytes of `frames` frames carrying `hlen` header bytes each and
/// `paylen` payload bytes in all, with their FCS (4) and the 64-byte
/// minimum frame.
pub fn wire_bytes(frames: u64, hlen: usize, paylen: usize) -> u64 {
    (paylen as u64 + frames * (hlen as u64 + 4)).max(frames * 64)
}
