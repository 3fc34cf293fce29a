//! The counters every device model keeps ([`NicStats`]), and the wire
//! arithmetic they use.

use super::segment::{Outcome, Packet};

/// Counters of a device model (the software NIC, the null device, the
/// virtio-net model: each counts the same events in the same units).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NicStats {
    /// Packets seen, whatever became of them: descriptor chains ended by
    /// `EOP`, chains dropped before their end for being longer than
    /// [`MAX_BUFS`](super::softnic::MAX_BUFS) (in
    /// [`bad_desc`](Self::bad_desc) too; the rest of such a chain is
    /// skipped, not counted again), and those a fault cut short (each
    /// counted once, in [`faulted_packets`](Self::faulted_packets) too).
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
    /// DMA the device could not do because a translation faulted, one
    /// count per transfer it could not make: each descriptor it could not
    /// read (every one of a run read at once), each packet whose data it
    /// could not read (one however many of its buffers fault: the packet
    /// is given up), each status word it could not write back. Every
    /// packet lost to a fault makes at least one; the packets themselves
    /// are [`faulted_packets`](Self::faulted_packets).
    pub faults: u64,
    /// Packets seen and dropped because of a fault: their data, or one of
    /// their descriptors, could not be read. A packet whose every
    /// descriptor lay among unreadable ones is never seen: only
    /// [`faults`](Self::faults) shows it.
    pub faulted_packets: u64,
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
    /// Doorbells on which the device stopped, needing a reset: a fault it
    /// saw only after it had taken chains (the virtio-net model: a used
    /// entry it could not write, the ring changed under it), where a
    /// virtio device sets `NEEDS_RESET`.
    pub stops: u64,
}

impl NicStats {
    /// What the model lost, the one list of the counters that show a loss:
    /// its DMA faults ([`faults`](Self::faults)), the packets it found
    /// corrupt ([`bad_payload`](Self::bad_payload)) or malformed
    /// ([`bad_desc`](Self::bad_desc)), and the doorbells on which it
    /// stopped ([`stops`](Self::stops)). A count of those events, not of
    /// packets: 0 exactly when nothing was lost.
    ///
    /// [`faulted_packets`](Self::faulted_packets) is not added: every
    /// packet lost to a fault made at least one fault, so it is in
    /// `faults` already; it counts only when it is the larger (counters
    /// that show a faulted packet and no fault still show a loss). A stop
    /// is counted besides the fault that caused it, if one was counted:
    /// a stopped device refuses every doorbell until a reset.
    pub fn losses(&self) -> u64 {
        self.faults
            .max(self.faulted_packets)
            .saturating_add(self.bad_payload)
            .saturating_add(self.bad_desc)
            .saturating_add(self.stops)
    }

    /// Counts the offloaded packet `pkt` sent as `out`: `hlen` header bytes
    /// per frame, `pages` and `segment_pages` read.
    pub(super) fn count_sent(
        &mut self,
        out: &Outcome,
        hlen: usize,
        pkt: &Packet,
        pages: u64,
        segment_pages: u64,
    ) {
        let paylen = pkt.paylen;
        self.pages += pages;
        self.segment_pages += segment_pages;
        self.payload_bytes += paylen as u64;
        self.wire_bytes += wire_bytes(hlen, paylen, pkt.mss);
        self.frames += out.frames;
        self.bytes_verified += out.verified;
        if out.ok {
            self.delivered_bytes += paylen as u64;
        } else {
            self.bad_payload += 1;
        }
    }

    /// Counts a packet given up at a read of its data that faulted: one
    /// fault, one packet lost (the packet is in `packets` already).
    pub(super) fn count_read_fault(&mut self) {
        self.faults += 1;
        self.faulted_packets += 1;
    }

    /// Counts a frame of `len` bytes sent as given, over `pages` pages.
    pub(super) fn count_raw(&mut self, len: usize, pages: u64) {
        self.count_frame(len as u64, len as u64, pages);
    }

    /// Counts one frame of `len` bytes delivered whole, `payload` of them
    /// payload (all of a frame sent as given; what follows the headers of
    /// an offloaded one), over `pages` pages.
    #[inline]
    pub(super) fn count_frame(&mut self, len: u64, payload: u64, pages: u64) {
        self.pages += pages;
        self.payload_bytes += payload;
        self.wire_bytes += frame_bytes(len);
        self.delivered_bytes += payload;
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
            faulted_packets: f(self.faulted_packets, o.faulted_packets),
            bad_payload: f(self.bad_payload, o.bad_payload),
            bad_desc: f(self.bad_desc, o.bad_desc),
            page_crossing_bufs: f(self.page_crossing_bufs, o.page_crossing_bufs),
            write_backs: f(self.write_backs, o.write_backs),
            stops: f(self.stops, o.stops),
        }
    }
}

/// Bytes a frame occupies on an Ethernet wire besides itself: the preamble
/// and start delimiter (8) and the inter-frame gap (12).
pub const WIRE_GAP: u64 = 20;

/// Ethernet bytes of one frame of `len` bytes (headers and payload): with
/// its FCS (4), and at least the 64-byte minimum frame.
pub fn frame_bytes(len: u64) -> u64 {
    len.saturating_add(4).max(64)
}

/// Frames a packet of `paylen` payload bytes goes out as, cut at `mss`
/// payload bytes a frame: one per segment, at least one (a packet without
/// payload is one frame of headers). An `mss` of 0 counts as 1.
pub fn frames(paylen: usize, mss: usize) -> u64 {
    paylen.div_ceil(mss.max(1)).max(1) as u64
}

/// Ethernet bytes of the [`frames`] a packet of `paylen` payload bytes goes
/// out as, cut at `mss` payload bytes a frame, each with `hlen` header
/// bytes: each frame is counted on its own ([`frame_bytes`]), so a last
/// segment of a few bytes costs a whole minimum frame. The preamble and
/// the gap after each frame ([`WIRE_GAP`]) are not included: see
/// [`line_bytes`].
pub fn wire_bytes(hlen: usize, paylen: usize, mss: usize) -> u64 {
    let mss = mss.max(1);
    let (full, rest) = (paylen / mss, paylen % mss);
    let hlen = hlen as u64;
    let last = if rest > 0 || paylen == 0 {
        frame_bytes(hlen.saturating_add(rest as u64))
    } else {
        0
    };
    (full as u64)
        .saturating_mul(frame_bytes(hlen.saturating_add(mss as u64)))
        .saturating_add(last)
}

/// Bytes of line time a packet as for [`wire_bytes`] takes: its frames
/// and, for each, the preamble and inter-frame gap ([`WIRE_GAP`]). At
/// `g` Gbit/s it takes `line_bytes * 8 / g` ns.
pub fn line_bytes(hlen: usize, paylen: usize, mss: usize) -> u64 {
    let gaps = frames(paylen, mss).saturating_mul(WIRE_GAP);
    wire_bytes(hlen, paylen, mss).saturating_add(gaps)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each counter that shows a loss counts alone; a faulted packet is
    /// not counted again beside its fault.
    #[test]
    fn losses_count_each_loss_once() {
        let with = |f: fn(&mut NicStats)| {
            let mut s = NicStats {
                packets: 5,
                frames: 5,
                delivered_bytes: 500,
                ..NicStats::default()
            };
            f(&mut s);
            s.losses()
        };
        assert_eq!(with(|_| {}), 0);
        assert_eq!(with(|s| s.faults += 1), 1);
        assert_eq!(with(|s| s.faulted_packets += 1), 1);
        assert_eq!(with(|s| s.bad_payload += 1), 1);
        assert_eq!(with(|s| s.bad_desc += 1), 1);
        assert_eq!(with(|s| s.stops += 1), 1);
        assert_eq!(with(|s| s.count_read_fault()), 1);
        assert_eq!(with(|s| s.page_crossing_bufs += 1), 0);
        assert_eq!(with(|s| (s.faults, s.stops) = (3, 1)), 4);
    }

    #[test]
    fn each_frame_is_padded_to_the_minimum_on_its_own() {
        // A TSO packet of one full segment and a 2-byte one: the last
        // frame (54 + 2 + 4 = 60 bytes) is padded to 64.
        assert_eq!(wire_bytes(54, 1450, 1448), (54 + 1448 + 4) + 64);
        assert_eq!(line_bytes(54, 1450, 1448), (54 + 1448 + 4) + 64 + 2 * 20);
        // Segments that fill their frames: no padding.
        assert_eq!(wire_bytes(54, 3 * 1448, 1448), 3 * (54 + 1448 + 4));
        assert_eq!(wire_bytes(54, 2 * 1448 + 6, 1448), 2 * 1506 + 64);
        assert_eq!(wire_bytes(54, 2 * 1448 + 7, 1448), 2 * 1506 + 65);
        // Tiny segments each take a minimum frame.
        assert_eq!(wire_bytes(14, 10, 1), 10 * 64);
        // No payload: one frame of headers.
        assert_eq!((frames(0, 1448), wire_bytes(54, 0, 1448)), (1, 64));
        // A frame sent as given (no headers of its own, one segment).
        assert_eq!(wire_bytes(0, 1000, 1000), frame_bytes(1000));
        assert_eq!((frame_bytes(40), frame_bytes(1000)), (64, 1004));
        // Nothing overflows.
        assert_eq!(wire_bytes(54, usize::MAX, 1), u64::MAX);
        assert_eq!(frames(7, 0), 7);
    }
}
