//! The capture of a virtio-net NIC, taken on the driver's side of the
//! device (QEMU's `filter-dump` on a tap backend with vnet headers): each
//! frame as the driver posted it, without its `virtio_net_hdr`. Every
//! frame of ours goes through [`segment`] (what the device sends for it,
//! its checksum completed, a TSO super-frame cut into MSS segments), and
//! each resulting frame through a wire check.

use std::io::Read;
use std::path::Path;

use pcap_file::pcap::PcapReader;
use vfio_nic::check::gso::segment;
use vfio_nic::check::wire::{WireCheck, WireReport};

use super::{CaptureError, FLOW_MAC};

/// The MSS of the flows the guest tests send over virtio-net.
pub const VIRTIO_MSS: usize = 1448;

/// What a virtio-net capture held.
#[derive(Clone, Debug, Default)]
pub struct VirtioCapture {
    /// Frames of ours as the driver posted them (a TSO packet is one).
    pub super_frames: u64,
    /// Frames the device puts on the wire for them.
    pub segments: u64,
    /// Frames of ours the device could not take as they are (wrong IP
    /// length, IPv4 header checksum or pseudo-header sum, or not
    /// parsing), each with no segments.
    pub refused: u64,
    /// The wire check of the segments.
    pub report: WireReport,
    /// Frames from other sources (the host's IPv6 router solicitations,
    /// say): not errors.
    pub foreign: u64,
    /// Frames of ours cut short by the capture (not checked).
    pub truncated: u64,
    /// The first few refusals, in order.
    pub first_errors: Vec<String>,
    /// Frames of killed drivers' flows (judged apart: see
    /// [`Console::virtio_crash_flows`](super::Console)).
    pub crash_frames: u64,
    /// Of those, frames refused or whose segments failed their check.
    pub crash_bad: u64,
    /// Of those, frames after the first frame of the fresh start that
    /// followed (a device still sending for a dead driver).
    pub stale: u64,
}

impl VirtioCapture {
    /// Frames that failed: refused ones and segments the wire check
    /// rejected.
    pub fn bad(&self) -> u64 {
        self.refused + self.report.bad_frames
    }
}

/// Checks every frame of ours in the virtio-net capture at `path`; see
/// the module docs. The frames of a killed driver's flow (the first of
/// each `crash` pair) are checked apart, their number unknown, and none
/// may follow the first frame of the fresh start's flow (the second).
pub fn check_virtio_pcap(path: &Path, crash: &[(u32, u32)]) -> Result<VirtioCapture, CaptureError> {
    let (f, p) = super::open_capture(path)?;
    check_virtio_pcap_from(f, &p, crash)
}

fn check_virtio_pcap_from(
    r: impl Read,
    name: &str,
    crash: &[(u32, u32)],
) -> Result<VirtioCapture, CaptureError> {
    let perr = |e: pcap_file::PcapError| CaptureError::Pcap {
        path: name.into(),
        detail: e.to_string(),
    };
    let mut rd = PcapReader::new(r).map_err(perr)?;
    let mut wire = WireCheck::default();
    let mut crash_wire = WireCheck::default();
    let mut crashes = super::Crashes::new(crash);
    let mut cap = VirtioCapture::default();
    while let Some(pkt) = rd.next_packet() {
        let pkt = pkt.map_err(perr)?;
        if pkt.data.len() < 12 || pkt.data[6..12] != FLOW_MAC {
            cap.foreign += 1;
            continue;
        }
        let flow = super::source_flow(&pkt.data);
        if let Some(stale) = crashes.judge(flow) {
            cap.crash_frames += 1;
            cap.stale += u64::from(stale);
            let ok = segment(&pkt.data, VIRTIO_MSS)
                .is_ok_and(|fs| fs.iter().all(|f| crash_wire.frame(f).is_ok()));
            cap.crash_bad += u64::from(!ok);
            continue;
        }
        cap.super_frames += 1;
        if (pkt.data.len() as u32) < pkt.orig_len {
            cap.truncated += 1;
            continue;
        }
        match segment(&pkt.data, VIRTIO_MSS) {
            Ok(frames) => {
                cap.segments += frames.len() as u64;
                for f in frames {
                    let _ = wire.frame(&f);
                }
            }
            Err(e) => {
                cap.refused += 1;
                if cap.first_errors.len() < 10 {
                    let n = cap.super_frames;
                    cap.first_errors.push(format!("frame {n}: {e}"));
                }
            }
        }
    }
    cap.report = wire.report();
    Ok(cap)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{frame, pcap};
    use super::*;

    /// `fr`, a valid frame on the wire, as the driver posts it: the TCP
    /// checksum field holding the pseudo-header sum.
    fn posted(mut fr: Vec<u8>) -> Vec<u8> {
        let (ip, l4) = (14..34, 34);
        let sum = vfio_nic::csum::pseudo_header_sum(&fr[ip], fr.len() - l4).unwrap();
        fr[l4 + 16..l4 + 18].copy_from_slice(&sum.to_be_bytes());
        fr
    }

    #[test]
    fn super_frames_are_cut_and_checked_and_foreign_frames_counted() {
        // A router solicitation from the host: another source.
        let mut foreign = vec![0x33, 0x33, 0, 0, 0, 2, 0x52, 0x54, 0, 0x12, 0x34, 0x56];
        foreign.extend_from_slice(&[0x86, 0xdd]);
        foreign.resize(70, 0);
        let mut forgot = frame(1, 0, 100); // the driver forgot the sum
        forgot[34 + 16..34 + 18].fill(0);
        let frames = [
            posted(frame(0, 0, 10_000)),
            foreign,
            posted(frame(0, 10_000, 100)),
            forgot,
            posted(frame(2, 0, 1448)),
        ];
        let cap = check_virtio_pcap_from(&pcap(&frames)[..], "x", &[]).unwrap();
        assert_eq!((cap.super_frames, cap.foreign, cap.truncated), (4, 1, 0));
        assert_eq!(cap.segments, 7 + 1 + 1);
        assert_eq!((cap.refused, cap.report.bad_frames, cap.bad()), (1, 0, 1));
        assert!(
            cap.first_errors[0].starts_with("frame 3: "),
            "{:?}",
            cap.first_errors
        );
        assert_eq!(cap.report.payload_bytes, 10_000 + 100 + 1448);
        assert_eq!(cap.report.flows, 2);
    }

    #[test]
    fn a_frame_on_the_wire_is_not_one_a_driver_posts() {
        // Completed checksums, as a capture of the wire would hold: each
        // is refused, not passed through.
        let frames = [frame(0, 0, 100), frame(0, 100, 100)];
        let cap = check_virtio_pcap_from(&pcap(&frames)[..], "x", &[]).unwrap();
        assert_eq!((cap.super_frames, cap.refused, cap.segments), (2, 2, 0));
    }
}
