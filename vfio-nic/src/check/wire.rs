//! Checking what reached the wire: every frame a TX queue's flows produce
//! can be verified on its own (checksums, payload pattern) and against the
//! frames before it (TCP sequence continuity per flow).
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
    /// swapped two; a damaged frame or a late one moves nothing. The first
    /// frame of a stream after the first is the exception: lost, it leaves
    /// the new stream's frames behind the old one's end, each of them bad,
    /// until a frame at offset 0 starts another.
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

#[derive(Clone, Copy, Debug, Default)]
struct FlowState {
    next: u32,
    streams: u64,
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
#[derive(Debug, Default)]
pub struct WireCheck {
    flows: HashMap<u32, FlowState>,
    report: WireReport,
}

/// What a [`WireCheck`] saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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
    /// Streams (a flow restarting at offset 0 starts a new one).
    pub streams: u64,
    /// The first few failures, in order.
    pub first_errors: Vec<String>,
}

impl WireCheck {
    /// Checks one Ethernet frame (without FCS).
    pub fn frame(&mut self, fr: &[u8]) -> Result<(), FrameError> {
        self.report.frames += 1;
        let r = self.check(fr);
        match &r {
            Ok(n) => {
                self.report.good_frames += 1;
                self.report.payload_bytes += *n as u64;
            }
            Err(e) => {
                self.report.bad_frames += 1;
                if self.report.first_errors.len() < 10 {
                    self.report
                        .first_errors
                        .push(format!("frame {}: {e}", self.report.frames));
                }
            }
        }
        r.map(|_| ())
    }

    fn check(&mut self, fr: &[u8]) -> Result<usize, FrameError> {
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
        let want = if st.streams == 0 { 0 } else { st.next };
        if off == 0 && (st.streams == 0 || off != st.next) {
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
        Ok(payload.len())
    }

    /// Stream offset after the last good segment of `flow` (its bytes sent,
    /// in its current stream).
    pub fn next_offset(&self, flow: u32) -> Option<u32> {
        self.flows.get(&flow).map(|s| s.next)
    }

    /// The totals so far.
    pub fn report(&self) -> WireReport {
        WireReport {
            flows: self.flows.len(),
            ..self.report.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::same_checksum;

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
