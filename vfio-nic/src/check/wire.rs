//! Checking what reached the wire: every frame a TX queue's flows produce
//! can be verified on its own (checksums, payload pattern) and against the
//! frames before it (TCP sequence continuity per flow). How a flow's
//! restarts are told from copies of its first frame, and what the frame
//! format cannot tell, is described on [`WireCheck`].
//!
//! Used on frames captured from the software NIC and on a pcap of the real
//! NIC's output.
//!
//! ```
//! use vfio_nic::check::wire::WireCheck;
//! let mut check = WireCheck::default();
//! assert!(check.frame(&[0u8; 10]).is_err());
//! assert_eq!(check.report().bad_frames, 1);
//! ```

use std::collections::HashMap;

use etherparse::{NetSlice, SlicedPacket, TransportSlice};

use crate::gen::{flow, pattern};

/// Why one frame failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Not Ethernet + IPv4 + TCP, or truncated.
    #[error("frame does not parse as Ethernet/IPv4/TCP: {0}")]
    Parse(String),
    /// Wrong IPv4 header checksum.
    #[error("IPv4 checksum {got:#06x}, expected {want:#06x}")]
    IpChecksum {
        /// In the frame.
        got: u16,
        /// Computed.
        want: u16,
    },
    /// Wrong TCP checksum.
    #[error("TCP checksum {got:#06x}, expected {want:#06x}")]
    TcpChecksum {
        /// In the frame.
        got: u16,
        /// Computed.
        want: u16,
    },
    /// A source port that is no flow of ours.
    #[error("source port {0} is not a pfrag flow")]
    NotOurs(u16),
    /// The segment does not continue its flow. The checker takes the flow
    /// up again from a whole frame ahead of where it was (frames lost or
    /// reordered), so one lost frame costs one bad frame, and a pair
    /// swapped two; a damaged frame or a late one moves nothing. A copy of
    /// a stream's first frame (`got` 0) is refused once the flow's next
    /// frame shows it (see [`WireCheck`]). A new stream whose first frame
    /// was lost cannot be placed: its frames behind the old stream's end
    /// are each refused (see [`WireCheck`]).
    #[error(
        "flow {flow}: segment at stream offset {got}, expected {want} (or 0 for a new stream)"
    )]
    Gap {
        /// The flow.
        flow: u32,
        /// Offset of this segment.
        got: u32,
        /// Where the flow left off.
        want: u32,
    },
    /// Payload bytes differ from the flow's pattern.
    #[error(
        "flow {flow}: payload of {len} bytes at stream offset {off} does not match the pattern"
    )]
    Payload {
        /// The flow.
        flow: u32,
        /// Stream offset.
        off: u32,
        /// Payload length.
        len: usize,
    },
}

#[derive(Clone, Debug, Default)]
struct FlowState {
    next: u32,
    streams: u64,
    /// A frame at offset 0 that came while the stream was under way, to be
    /// placed by the flow's next frame.
    start: Option<Start>,
}

/// A frame at stream offset 0 that came while its flow's stream was under
/// way: the first frame of a new stream, or a copy of the current one's
/// (a duplicate, or the first frame arriving late). Nothing in the frame
/// tells which; the flow's next frame may. Whole frames identical to it
/// that come right after it, before any other frame of the flow, are held
/// with it and placed with it.
#[derive(Clone, Debug)]
struct Start {
    /// Its payload bytes.
    len: u32,
    /// Whether it was whole (a damaged one was counted bad already).
    whole: bool,
    /// The frame, to tell an identical one that follows it.
    bytes: Box<[u8]>,
    /// It and the identical frames held with it.
    copies: u64,
    /// Its number among the frames seen, and the numbers of the identical
    /// frames held with it, in order, the first [`FIRST_ERRORS`] only: for
    /// their errors, of which a report words no more.
    frames: Vec<u64>,
}

impl Start {
    /// A frame at offset 0 that came while its flow's stream was under
    /// way: frame number `frame`, `whole` or not.
    fn new(fr: &[u8], len: usize, whole: bool, frame: u64) -> Start {
        Start {
            len: len as u32,
            whole,
            bytes: fr.into(),
            copies: 1,
            frames: vec![frame],
        }
    }

    /// Holds frame number `frame`, identical to it, with it: counted, and
    /// its number kept while the errors it may have are worded.
    fn again(&mut self, frame: u64) {
        self.copies += 1;
        if self.frames.len() < FIRST_ERRORS {
            self.frames.push(frame);
        }
    }

    /// Places `self` by its flow's next frame, at stream offset `off`:
    /// the first frame of a new stream if that continues it and not the
    /// old stream (it counts, and the flow follows the new stream); a copy
    /// of the old stream's first frame if it continues the old stream and
    /// not it (bad, and the flow stays); otherwise unplaced. The flow
    /// follows the new stream unless the next frame continues the old one
    /// or is at offset 0 itself.
    ///
    /// The identical frames held with it are placed with it: all copies
    /// (each bad) if it was one; if it started a new stream, one of them
    /// did and each of the others is a copy of it or a new stream of that
    /// one frame, which nothing tells apart: unplaced.
    fn settle(&self, st: &mut FlowState, flow: u32, off: u32, report: &mut WireReport) {
        let old = st.next;
        let stays = off == old || off == 0;
        if !stays {
            st.streams += 1;
            report.streams += 1;
            st.next = self.len;
        }
        if !self.whole {
            return;
        }
        let n = self.copies;
        if off == self.len && !stays {
            report.good_frames += 1;
            report.payload_bytes += u64::from(self.len);
            self.unplaced(report, n - 1);
        } else if off == old && off != self.len {
            let e = FrameError::Gap {
                flow,
                got: 0,
                want: old,
            };
            // Those past the numbers kept are counted alone: the report
            // has worded its first errors by then.
            self.frames.iter().for_each(|&f| report.refused(f, &e));
            report.bad_frames += n - self.frames.len() as u64;
        } else {
            self.unplaced(report, n);
        }
    }

    /// Counts `n` of its whole frames as ones that nothing placed.
    fn unplaced(&self, report: &mut WireReport, n: u64) {
        report.unplaced_frames += n;
        report.unplaced_bytes += n * u64::from(self.len);
    }
}

/// Whether two Internet checksums are equal: 0x0000 and 0xffff are the two
/// ones'-complement zeros, and senders differ in which they write (QEMU's
/// segmentation writes 0xffff where etherparse computes 0x0000).
pub fn same_checksum(a: u16, b: u16) -> bool {
    a == b || (a | b == 0xffff && a & b == 0 && (a == 0 || b == 0))
}

/// Checks that a frame of flow `fl` at stream offset `off` is whole in
/// itself: its IPv4 and TCP checksums hold and its payload is the flow's
/// pattern there. The first check that fails is the error. Only a whole
/// frame may take a flow up after a gap.
fn whole(
    iph: &etherparse::Ipv4Header,
    th: &etherparse::TcpHeader,
    fl: u32,
    off: u32,
    payload: &[u8],
) -> Result<(), FrameError> {
    let want = iph.calc_header_checksum();
    if iph.header_checksum != want {
        return Err(FrameError::IpChecksum {
            got: iph.header_checksum,
            want,
        });
    }
    let want = th
        .calc_checksum_ipv4(iph, payload)
        .map_err(|e| FrameError::Parse(e.to_string()))?;
    if !same_checksum(th.checksum, want) {
        return Err(FrameError::TcpChecksum {
            got: th.checksum,
            want,
        });
    }
    if !pattern::verify(fl, off, payload) {
        return Err(FrameError::Payload {
            flow: fl,
            off,
            len: payload.len(),
        });
    }
    Ok(())
}

/// Running check of a sequence of frames.
///
/// # Streams
///
/// A frame names its flow (the TCP source port) and its stream offset (the
/// sequence number less the flow's initial one), nothing else: not which
/// run of the flow sent it. Every run of a flow starts at offset 0 with the
/// same bytes, so runs (streams) are told apart by offset 0 alone:
///
/// - A flow's first frame at offset 0 starts its first stream.
/// - A frame at offset 0 while a stream is under way is the first frame of
///   a new stream, or a copy of the current one's (a duplicate, or the
///   first frame arriving after the ones that follow it); the frame cannot
///   tell. The flow's next frame places it: if that continues it and not
///   the old stream, it started a new stream and is good; if that
///   continues the old stream and not it, it was a copy and is bad
///   ([`FrameError::Gap`] with `got` 0, counted then, not when it came);
///   otherwise (the next frame continues both, after a stream of one
///   frame; or neither, one lost or late in between; or is another frame
///   at offset 0; or none came yet) it is
///   [unplaced](WireReport::unplaced_frames): its bytes are not counted.
///   The flow follows the new stream unless its next frame continues the
///   old one or is at offset 0. [`frame`](Self::frame) returns `Ok` for
///   such a frame when it is whole; the report has its verdict.
/// - Whole frames byte-identical to such a frame that come right after it
///   (the flow's next frames) wait with it, and the first other frame of
///   the flow places them all: if it continues the old stream and not
///   them, each is a copy and bad; if it continues them and not the old
///   stream, one is the new stream's first frame (good, one stream) and
///   each of the others unplaced; otherwise all are unplaced.
///
/// What the frame format cannot tell, and how it is counted (a frame that
/// named its run would lift both):
///
/// - A copy of a stream's first two or more frames, in order, is what a
///   new stream sends: it counts as a new stream, its bytes again.
/// - A copy of a stream's first frame right after it is what a new stream
///   of one frame sends, followed by another stream's first frame: all
///   runs of a flow start with the same bytes, and a frame of the same
///   length is the same frame. So a stream's first frame followed at once
///   by an identical one, then by its second frame, counts the first
///   frame good and the second unplaced; and identical starts in a row
///   followed by a new stream count one good, the others unplaced.
/// - A new stream whose first frame was lost cannot be placed: its frames
///   at offsets the old stream passed are refused as behind their flow
///   ([`FrameError::Gap`], bad, bytes not counted), and the stream is not
///   counted. From the old stream's end on its frames read as that
///   stream's continuation (one beyond the end takes the flow up, one more
///   bad frame) and count: their bytes are the flow's at their offsets.
#[derive(Debug, Default)]
pub struct WireCheck {
    flows: HashMap<u32, FlowState>,
    report: WireReport,
}

/// What a [`WireCheck`] saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WireReport {
    /// Frames seen.
    pub frames: u64,
    /// Frames that passed every check.
    pub good_frames: u64,
    /// Frames that failed one.
    pub bad_frames: u64,
    /// Payload bytes that matched their pattern.
    pub payload_bytes: u64,
    /// Distinct flows seen.
    pub flows: usize,
    /// Streams (a flow restarting at offset 0 starts a new one; see
    /// [`WireCheck`] for how a restart is told from a copy of the first
    /// frame).
    pub streams: u64,
    /// Whole frames at stream offset 0 that came while their flow's stream
    /// was under way and that no later frame placed (or, of identical
    /// ones in a row before a new stream, all but the one counted its
    /// first frame): each is the first frame of a new stream or a copy,
    /// and nothing tells which (see [`WireCheck`]). Neither good nor bad:
    /// `frames` is
    /// `good_frames + bad_frames + unplaced_frames`.
    pub unplaced_frames: u64,
    /// Their payload bytes, not in `payload_bytes`.
    pub unplaced_bytes: u64,
    /// The first few failures, in the order they were found (a copy of a
    /// stream's first frame when its flow's next frame came).
    pub first_errors: Vec<String>,
}

/// The failures a [`WireReport`] keeps in words
/// ([`first_errors`](WireReport::first_errors)).
const FIRST_ERRORS: usize = 10;

impl WireReport {
    /// Counts frame number `frame` bad for `e`.
    fn refused(&mut self, frame: u64, e: &FrameError) {
        self.bad_frames += 1;
        if self.first_errors.len() < FIRST_ERRORS {
            self.first_errors.push(format!("frame {frame}: {e}"));
        }
    }
}

impl WireCheck {
    /// Checks one Ethernet frame (without FCS). A whole frame at offset 0
    /// in the middle of its flow's stream is `Ok` here and judged when the
    /// flow's next frame comes (see [Streams](Self#streams)): a caller
    /// that must see every bad frame checks [`report`](Self::report) too.
    pub fn frame(&mut self, fr: &[u8]) -> Result<(), FrameError> {
        self.report.frames += 1;
        let r = self.check(fr);
        match &r {
            Ok(Some(n)) => {
                self.report.good_frames += 1;
                self.report.payload_bytes += *n as u64;
            }
            // A start, placed by its flow's next frame.
            Ok(None) => {}
            Err(e) => self.report.refused(self.report.frames, e),
        }
        r.map(|_| ())
    }

    /// The payload bytes of a good frame, or `None` for a start left to
    /// its flow's next frame.
    fn check(&mut self, fr: &[u8]) -> Result<Option<usize>, FrameError> {
        let p = SlicedPacket::from_ethernet(fr).map_err(|e| FrameError::Parse(e.to_string()))?;
        let Some(NetSlice::Ipv4(ip)) = p.net else {
            return Err(FrameError::Parse("not IPv4".into()));
        };
        let iph = ip.header().to_header();
        let Some(TransportSlice::Tcp(tcp)) = p.transport else {
            return Err(FrameError::Parse("not TCP".into()));
        };
        let th = tcp.to_header();
        let payload = tcp.payload();
        let fl = flow::flow_of_port(th.source_port).ok_or(FrameError::NotOurs(th.source_port))?;
        let off = th.sequence_number.wrapping_sub(flow::isn(fl));
        // Sequence first, so that a damaged frame in the right place still
        // moves its flow on and the frames after it are judged on their own.
        let st = self.flows.entry(fl).or_default();
        if let Some(mut start) = st.start.take() {
            if start.whole && *start.bytes == *fr {
                // The held start again: placed with it.
                start.again(self.report.frames);
                st.start = Some(start);
                return Ok(None);
            }
            start.settle(st, fl, off, &mut self.report);
        }
        let want = if st.streams == 0 { 0 } else { st.next };
        if off == 0 && st.streams > 0 && off != st.next {
            let w = whole(&iph, &th, fl, off, payload);
            st.start = Some(Start::new(fr, payload.len(), w.is_ok(), self.report.frames));
            return w.map(|()| None);
        }
        if off == 0 && st.streams == 0 {
            st.streams += 1;
            self.report.streams += 1;
        } else if off != want {
            // A frame ahead of where the flow was (frames lost or reordered
            // before it), and whole in itself, takes the flow up: it counts
            // bad once, and those after it are judged against it. A damaged
            // one, or one behind (late, or a duplicate), moves nothing.
            if off.wrapping_sub(want) < 1 << 31 && whole(&iph, &th, fl, off, payload).is_ok() {
                if st.streams == 0 {
                    st.streams += 1;
                    self.report.streams += 1;
                }
                st.next = off.wrapping_add(payload.len() as u32);
            }
            return Err(FrameError::Gap {
                flow: fl,
                got: off,
                want,
            });
        }
        st.next = off.wrapping_add(payload.len() as u32);
        whole(&iph, &th, fl, off, payload)?;
        Ok(Some(payload.len()))
    }

    /// Stream offset after the last good segment of `flow` (its bytes sent,
    /// in its current stream; a start not placed yet is not in it).
    pub fn next_offset(&self, flow: u32) -> Option<u32> {
        self.flows.get(&flow).map(|s| s.next)
    }

    /// The totals so far.
    /// A start that no frame placed yet counts as unplaced.
    pub fn report(&self) -> WireReport {
        let mut r = WireReport {
            flows: self.flows.len(),
            ..self.report.clone()
        };
        let starts = self.flows.values().filter_map(|st| st.start.as_ref());
        let whole = starts.filter(|s| s.whole);
        whole.for_each(|s| s.unplaced(&mut r, s.copies));
        r
    }
}

#[cfg(test)]
mod tests {
    use super::{same_checksum, WireCheck};
    use crate::gen::flow::{isn, BASE_PORT, DST_PORT};
    use crate::gen::pattern;

    /// A whole frame of flow 3 carrying `len` bytes at stream offset `off`.
    fn frame(off: u32, len: usize) -> Vec<u8> {
        let mut payload = vec![0u8; len];
        pattern::fill(3, off, &mut payload);
        let b = etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4([10, 1, 0, 1], [10, 0, 0, 3], 64)
            .tcp(BASE_PORT + 3, DST_PORT, isn(3).wrapping_add(off), 65_535);
        let mut out = Vec::new();
        b.write(&mut out, &payload).unwrap();
        out
    }

    /// Endless copies of a held start (a device resending one frame) are
    /// counted, not kept one by one: what the check holds for them stays
    /// as small as the errors it reports, and every copy is still counted
    /// once when the flow's next frame places them. The held start used to
    /// keep each copy's frame number, growing without bound.
    #[test]
    fn copies_of_a_held_start_take_bounded_memory() {
        let mut c = WireCheck::default();
        let (first, second) = (frame(0, 100), frame(100, 100));
        c.frame(&first).unwrap();
        c.frame(&second).unwrap();
        let copies = 10_000u64;
        for _ in 0..copies {
            c.frame(&first).unwrap();
        }
        let held = c.flows[&3].start.as_ref().unwrap();
        assert!(
            held.frames.len() <= super::FIRST_ERRORS,
            "{}",
            held.frames.len()
        );
        let r = c.report();
        assert_eq!(
            (r.unplaced_frames, r.unplaced_bytes),
            (copies, copies * 100)
        );
        // The stream goes on: every copy was a copy, bad.
        c.frame(&frame(200, 100)).unwrap();
        let r = c.report();
        assert_eq!(
            (r.good_frames, r.bad_frames, r.unplaced_frames),
            (3, copies, 0)
        );
        assert_eq!(r.frames, r.good_frames + r.bad_frames + r.unplaced_frames);
        assert_eq!(r.first_errors.len(), super::FIRST_ERRORS);
        for (i, e) in r.first_errors.iter().enumerate() {
            assert!(e.starts_with(&format!("frame {}: ", 3 + i)), "{e}");
        }
    }

    #[test]
    fn both_zeros_are_the_same_checksum() {
        assert!(same_checksum(0x1234, 0x1234));
        assert!(same_checksum(0x0000, 0xffff));
        assert!(same_checksum(0xffff, 0x0000));
        assert!(!same_checksum(0x1234, 0x1235));
        assert!(!same_checksum(0x00ff, 0xff00));
        assert!(!same_checksum(0x0001, 0xfffe));
    }
}
