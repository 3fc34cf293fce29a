//! Host side of the QEMU guest runs (`vm/run.sh`): reading the guest's
//! console, the frames QEMU captured from the NIC (the 82576's on the
//! wire; a virtio-net NIC's as the driver posted them, [`virtio`]), and
//! QEMU's IOMMU trace.

mod frames;
pub mod virtio;

use std::io::Read;
use std::path::Path;

use pcap_file::pcap::PcapReader;
use vfio_nic::check::wire::{WireCheck, WireReport};

pub use frames::{expected_frames, FrameCountError, RowSent};
pub use virtio::{check_virtio_pcap, VirtioCapture, VIRTIO_MSS};

/// Source MAC of every frame a pfrag flow sends.
pub const FLOW_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

/// What the guest printed that the host needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Console {
    /// Tests passed, summed over `test result:` lines.
    pub passed: u64,
    /// Tests failed.
    pub failed: u64,
    /// Whether any `test result:` line was seen.
    pub finished: bool,
    /// Frames the tests said they put on the wire (`pcap-expect: N`).
    pub expect_frames: u64,
    /// Segments the tests said a virtio-net NIC puts on the wire
    /// (`pcap-virtio-expect: N`).
    pub expect_virtio_segments: u64,
    /// The guest program's exit status (`guest-exit: N`).
    pub exit: Option<i32>,
    /// The lines between `=== csv begin` and `=== csv end`.
    pub csv: String,
    /// Flows whose payload the IOMMU must have blocked
    /// (`pcap-blocked-flow: F`).
    pub blocked_flows: Vec<u32>,
    /// (killed, fresh) flow pairs of crash-recovery runs
    /// (`pcap-crash-flows: K F`): the killed driver's frames are judged
    /// apart, and none may follow the fresh start's first frame.
    pub crash_flows: Vec<(u32, u32)>,
    /// The same for a virtio-net NIC's capture
    /// (`pcap-virtio-crash-flows: K F`).
    pub virtio_crash_flows: Vec<(u32, u32)>,
}

fn number_before(words: &[&str], what: &str) -> Option<u64> {
    words
        .windows(2)
        .find(|w| w[1].trim_end_matches([';', ',']) == what)
        .and_then(|w| w[0].parse().ok())
}

/// `K F`: a (killed, fresh) flow pair.
fn flow_pair(rest: &str) -> Option<(u32, u32)> {
    let f: Vec<u32> = rest
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    match f[..] {
        [killed, fresh] => Some((killed, fresh)),
        _ => None,
    }
}

/// Parses the guest's console log.
pub fn parse_console(text: &str) -> Console {
    let mut c = Console::default();
    let mut in_csv = false;
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if line == "=== csv begin" {
            in_csv = true;
            continue;
        }
        if line == "=== csv end" {
            in_csv = false;
            continue;
        }
        if in_csv {
            c.csv.push_str(line);
            c.csv.push('\n');
            continue;
        }
        // libtest prints `test name ... ` before a test's own output, and
        // kernel messages may land mid-line: markers are found anywhere.
        let after = |marker: &str| line.find(marker).map(|i| &line[i + marker.len()..]);
        if let Some(rest) = after("pcap-expect: ") {
            c.expect_frames = c
                .expect_frames
                .saturating_add(rest.trim().parse::<u64>().unwrap_or(0));
        } else if let Some(rest) = after("pcap-virtio-expect: ") {
            c.expect_virtio_segments = c
                .expect_virtio_segments
                .saturating_add(rest.trim().parse::<u64>().unwrap_or(0));
        } else if let Some(rest) = after("pcap-blocked-flow: ") {
            if let Ok(f) = rest.trim().parse() {
                c.blocked_flows.push(f);
            }
        } else if let Some(rest) = after("pcap-crash-flows: ") {
            c.crash_flows.extend(flow_pair(rest));
        } else if let Some(rest) = after("pcap-virtio-crash-flows: ") {
            c.virtio_crash_flows.extend(flow_pair(rest));
        } else if let Some(rest) = line.strip_prefix("guest-exit: ") {
            c.exit = rest.trim().parse().ok();
        } else if line.starts_with("test result:") {
            let words: Vec<&str> = line.split_whitespace().collect();
            c.finished = true;
            c.passed = c
                .passed
                .saturating_add(number_before(&words, "passed").unwrap_or(0));
            c.failed = c
                .failed
                .saturating_add(number_before(&words, "failed").unwrap_or(0));
        }
    }
    c
}

/// Frames in a capture: pfrag's (checked) and others (counted).
#[derive(Clone, Debug, Default)]
pub struct Capture {
    /// The check of pfrag's frames.
    pub report: WireReport,
    /// Frames from other sources (none expected on an isolated hub).
    pub foreign: u64,
    /// Frames cut short by the capture.
    pub truncated: u64,
    /// Frames of flows whose payload the IOMMU should have blocked.
    pub blocked_frames: u64,
    /// Of those, frames that carried the real payload: the IOMMU let the
    /// device read unmapped memory.
    pub leaks: u64,
    /// Frames of killed drivers' flows.
    pub crash_frames: u64,
    /// Of those, frames that failed the check.
    pub crash_bad: u64,
    /// Of those, frames after the fresh start's first frame: stale
    /// descriptors of the dead run that reached the wire.
    pub stale: u64,
}

/// Errors reading a capture.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Not a pcap file.
    #[error("{path}: {detail}")]
    Pcap {
        /// The file.
        path: String,
        /// The parser's message.
        detail: String,
    },
}

/// Checks every pfrag frame of the pcap at `path` against what the guest
/// said on its `console`. Frames of blocked flows are judged apart: none
/// may carry its flow's real payload. So are frames of killed drivers'
/// flows: each must be valid, and none may come after the first frame of
/// the fresh start that followed.
pub fn check_pcap(path: &Path, console: &Console) -> Result<Capture, CaptureError> {
    let (f, p) = open_capture(path)?;
    check_pcap_from(f, &p, console)
}

/// Opens the capture at `path`, with its name for errors.
fn open_capture(path: &Path) -> Result<(std::fs::File, String), CaptureError> {
    let p = path.display().to_string();
    match std::fs::File::open(path) {
        Ok(f) => Ok((f, p)),
        Err(source) => Err(CaptureError::Io { path: p, source }),
    }
}

/// The crash pairs `(killed, fresh)` of a capture, judged frame by frame:
/// a killed driver's frame is stale once its fresh start's first frame
/// went by.
struct Crashes<'a> {
    pairs: &'a [(u32, u32)],
    /// Per pair: has the fresh start's first frame been seen?
    fresh_seen: Vec<bool>,
}

impl<'a> Crashes<'a> {
    fn new(pairs: &'a [(u32, u32)]) -> Crashes<'a> {
        Crashes {
            pairs,
            fresh_seen: vec![false; pairs.len()],
        }
    }

    /// For a frame of `flow`: `Some(stale)` if it is a killed driver's,
    /// else `None` (and a fresh start's frame is noted).
    fn judge(&mut self, flow: Option<u32>) -> Option<bool> {
        if let Some(i) = self.pairs.iter().position(|p| Some(p.0) == flow) {
            return Some(self.fresh_seen[i]);
        }
        for (seen, p) in self.fresh_seen.iter_mut().zip(self.pairs) {
            *seen |= Some(p.1) == flow;
        }
        None
    }
}

fn source_flow(fr: &[u8]) -> Option<u32> {
    let sport = vfio_nic::gen::flow::MACLEN + vfio_nic::gen::flow::IPLEN;
    let b = fr.get(sport..sport + 2)?;
    vfio_nic::gen::flow::flow_of_port(u16::from_be_bytes([b[0], b[1]]))
}

fn check_pcap_from(r: impl Read, name: &str, c: &Console) -> Result<Capture, CaptureError> {
    let mut rd = PcapReader::new(r).map_err(|e| CaptureError::Pcap {
        path: name.into(),
        detail: e.to_string(),
    })?;
    let mut check = WireCheck::default();
    let mut leak_check = WireCheck::default();
    let mut crash_check = WireCheck::default();
    let mut crashes = Crashes::new(&c.crash_flows);
    let mut cap = Capture::default();
    while let Some(pkt) = rd.next_packet() {
        let pkt = pkt.map_err(|e| CaptureError::Pcap {
            path: name.into(),
            detail: e.to_string(),
        })?;
        if pkt.data.len() < 12 || pkt.data[6..12] != FLOW_MAC {
            cap.foreign += 1;
            continue;
        }
        if (pkt.data.len() as u32) < pkt.orig_len {
            cap.truncated += 1;
        }
        let flow = source_flow(&pkt.data);
        if flow.is_some_and(|f| c.blocked_flows.contains(&f)) {
            cap.blocked_frames += 1;
            if leak_check.frame(&pkt.data).is_ok() {
                cap.leaks += 1;
            }
            continue;
        }
        if let Some(stale) = crashes.judge(flow) {
            cap.crash_frames += 1;
            cap.crash_bad += u64::from(crash_check.frame(&pkt.data).is_err());
            cap.stale += u64::from(stale);
            continue;
        }
        let _ = check.frame(&pkt.data);
    }
    cap.report = check.report();
    Ok(cap)
}

/// IOMMU events QEMU traced inside one measurement window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VtdCounts {
    /// Invalidation descriptors (page-selective, domain and global IOTLB).
    pub invalidations: u64,
    /// IOTLB fills (a page walk whose result was cached).
    pub iotlb_fills: u64,
    /// IOTLB hits.
    pub iotlb_hits: u64,
}

/// The value a window mark writes: `MARK_MAGIC | (row << 1) | end`.
pub const MARK_MAGIC: u32 = 0x5f00_0000;

/// The value of a window mark, if `line` is one: an 82576 register write
/// to `mark_reg` or a virtio notification of the receive queue (address
/// 0 of the notify area), carrying a [`MARK_MAGIC`] value.
fn mark_value(line: &str, mark_reg: u32) -> Option<u32> {
    let hex = |s: &str| {
        let end = s.find(|c: char| !c.is_ascii_hexdigit()).unwrap_or(s.len());
        u32::from_str_radix(&s[..end], 16).ok()
    };
    let v = if line.contains("e1000e_core_write") {
        if !line.contains(&format!("0x{mark_reg:x},")) {
            return None;
        }
        hex(line.rsplit("0x").next()?.trim())?
    } else if let Some(i) = line.find("virtio_pci_notify_write 0x") {
        // `virtio_pci_notify_write 0xADDR = 0xVALUE (SIZE)`
        let rest = &line[i + "virtio_pci_notify_write 0x".len()..];
        if hex(rest)? != 0 {
            return None;
        }
        hex(rest.split("= 0x").nth(1)?)?
    } else {
        return None;
    };
    (v & 0xff00_0000 == MARK_MAGIC).then_some(v)
}

/// Splits QEMU's trace at the window marks (an 82576 register write to
/// `mark_reg`, or a virtio notification of queue 0, carrying a
/// [`MARK_MAGIC`] value) and counts
/// IOMMU events in each window, in order.
pub fn count_windows(trace: &str, mark_reg: u32) -> Vec<VtdCounts> {
    let mut out = Vec::new();
    let mut cur: Option<VtdCounts> = None;
    for line in trace.lines() {
        if let Some(v) = mark_value(line, mark_reg) {
            if v & 1 == 0 {
                cur = Some(VtdCounts::default());
            } else if let Some(c) = cur.take() {
                out.push(c);
            }
        } else if line.contains("e1000e_core_write") || line.contains("virtio_pci_notify") {
            continue;
        } else if let Some(c) = cur.as_mut() {
            if line.contains("vtd_inv_desc_iotlb_") {
                c.invalidations += 1;
            } else if line.contains("vtd_iotlb_page_update") {
                c.iotlb_fills += 1;
            } else if line.contains("vtd_iotlb_page_hit") {
                c.iotlb_hits += 1;
            }
        }
    }
    out
}

/// Sums windows into `rows` rows. The sweep numbers its windows
/// `repetition * rows + row`, in trace order, so window `i` belongs to row
/// `i % rows`. Returns the sums and the repetitions, or `None` when the
/// windows are not a whole number of repetitions of `rows`.
pub fn windows_per_row(windows: &[VtdCounts], rows: usize) -> Option<(Vec<VtdCounts>, u64)> {
    if rows == 0 || !windows.len().is_multiple_of(rows) {
        return None;
    }
    let mut out = vec![VtdCounts::default(); rows];
    for (i, w) in windows.iter().enumerate() {
        let s = &mut out[i % rows];
        s.invalidations += w.invalidations;
        s.iotlb_fills += w.iotlb_fills;
        s.iotlb_hits += w.iotlb_hits;
    }
    Some((out, (windows.len() / rows) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_sums_results_and_expectations() {
        let log = "boot noise\n\
            test x ... pcap-expect: 10\r\n\
            test a ... ok\n\
            pcap-expect: 5\n\
            test v ... pcap-virtio-expect: 45\n\
            pcap-virtio-expect: 3\n\
            test result: ok. 3 passed; 1 failed; 0 ignored; 0 measured; 2 filtered out\n\
            test result: ok. 1 passed; 0 failed; 0 ignored\n\
            test y ... pcap-blocked-flow: 98\n\
            crash: killed\n\
            pcap-crash-flows: 70 71\n\
            pcap-crash-flows: 72\n\
            guest-exit: 101\n\
            === csv begin\nh1,h2\n1,2\n=== csv end\n";
        let c = parse_console(log);
        assert_eq!((c.passed, c.failed, c.finished), (4, 1, true));
        assert_eq!(c.expect_frames, 15);
        assert_eq!(c.expect_virtio_segments, 48);
        assert_eq!(c.exit, Some(101));
        assert_eq!(c.blocked_flows, vec![98]);
        assert_eq!(c.crash_flows, vec![(70, 71)], "a pair, or nothing");
        assert_eq!(c.csv, "h1,h2\n1,2\n");
        assert!(!parse_console("kernel panic").finished);
    }

    #[test]
    fn virtio_marks_are_notifications_of_queue_0_only() {
        let t = "1@1.0:virtio_pci_notify_write 0x0 = 0x5f000004 (4)\n\
                 vtd_iotlb_page_update a\n\
                 virtio_pci_notify_write 0x4 = 0x1 (2)\n\
                 vtd_iotlb_page_hit b\n\
                 virtio_pci_notify_write 0x4 = 0x5f000005 (4)\n\
                 vtd_inv_desc_iotlb_pages c\n\
                 virtio_pci_notify_write 0x0 = 0x5f000005 (4)\n\
                 vtd_iotlb_page_update after\n";
        let w = count_windows(t, 0x5400);
        assert_eq!(
            w,
            vec![VtdCounts {
                invalidations: 1,
                iotlb_fills: 1,
                iotlb_hits: 1
            }]
        );
    }

    #[test]
    fn windows_count_only_between_marks() {
        let reg = 0x5478;
        let w = |v: u32| {
            format!("e1000e_core_write Write to register 0x{reg:x}, 4 byte(s), value: 0x{v:x}\n")
        };
        let mut t = String::new();
        t += "vtd_iotlb_page_hit x\n";
        t += "e1000e_core_write Write to register 0xe018, 4 byte(s), value: 0x5f000000\n";
        t += &w(MARK_MAGIC);
        t += "vtd_iotlb_page_hit a\nvtd_iotlb_page_update b\nvtd_inv_desc_iotlb_pages c\n";
        t += "vtd_inv_desc_iotlb_domain d\n";
        t += &w(MARK_MAGIC | 1);
        t += "vtd_iotlb_page_hit outside\n";
        t += &w(MARK_MAGIC | 2);
        t += "vtd_iotlb_page_hit y\nvtd_iotlb_page_hit z\n";
        t += &w(MARK_MAGIC | 3);
        let c = count_windows(&t, reg);
        assert_eq!(
            c,
            vec![
                VtdCounts {
                    invalidations: 2,
                    iotlb_fills: 1,
                    iotlb_hits: 1
                },
                VtdCounts {
                    invalidations: 0,
                    iotlb_fills: 0,
                    iotlb_hits: 2
                }
            ]
        );
    }

    /// A valid frame of `flow` carrying `len` bytes at stream offset `off`.
    pub(super) fn frame(flow: u32, off: u32, len: usize) -> Vec<u8> {
        use vfio_nic::gen::flow::{isn, BASE_PORT, DST_PORT};
        let mut payload = vec![0u8; len];
        vfio_nic::gen::pattern::fill(flow, off, &mut payload);
        let b = etherparse::PacketBuilder::ethernet2(FLOW_MAC, [2, 0, 0, 0, 0, 2])
            .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
            .tcp(
                BASE_PORT + flow as u16,
                DST_PORT,
                isn(flow).wrapping_add(off),
                1024,
            );
        let mut out = Vec::new();
        b.write(&mut out, &payload).unwrap();
        out
    }

    pub(super) fn pcap(frames: &[Vec<u8>]) -> Vec<u8> {
        use pcap_file::pcap::{PcapPacket, PcapWriter};
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        for f in frames {
            let p = PcapPacket::new(std::time::Duration::ZERO, f.len() as u32, f);
            w.write_packet(&p).unwrap();
        }
        w.into_writer()
    }

    #[test]
    fn crash_flows_are_judged_apart_and_stale_frames_counted() {
        let c = Console {
            crash_flows: vec![(70, 71)],
            ..Console::default()
        };
        let mut bad = frame(70, 200, 100);
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let frames = [
            frame(70, 0, 100),
            frame(70, 100, 100),
            bad,
            frame(71, 0, 100),
            frame(70, 300, 100), // the dead run's, after the fresh start
            frame(71, 100, 100),
        ];
        let cap = check_pcap_from(&pcap(&frames)[..], "x", &c).unwrap();
        assert_eq!((cap.crash_frames, cap.crash_bad, cap.stale), (4, 1, 1));
        assert_eq!((cap.report.frames, cap.report.good_frames), (2, 2));
        // Without the pair every frame is checked as one run.
        let all = check_pcap_from(&pcap(&frames)[..], "x", &Console::default()).unwrap();
        assert_eq!((all.crash_frames, all.report.frames), (0, 6));
    }

    #[test]
    fn repetitions_add_up_per_row() {
        let w = |n| VtdCounts {
            invalidations: n,
            iotlb_fills: 2 * n,
            iotlb_hits: 3 * n,
        };
        let (rows, reps) = windows_per_row(&[w(1), w(10), w(2), w(20)], 2).unwrap();
        assert_eq!(reps, 2);
        assert_eq!(rows, vec![w(3), w(30)]);
        assert!(windows_per_row(&[w(1), w(2), w(3)], 2).is_none());
        assert!(windows_per_row(&[], 0).is_none());
    }

    #[test]
    fn not_a_pcap_is_an_error() {
        let e = check_pcap_from(&b"hello world, not a capture"[..], "x", &Console::default())
            .unwrap_err();
        assert!(e.to_string().starts_with("x: "), "{e}");
    }
}
