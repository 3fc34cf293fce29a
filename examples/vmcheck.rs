//! Host-side checks of a `vm/run.sh` guest run.
//!
//! `vmcheck test --console LOG --pcap PCAP`: the guest's test results, then
//! every frame QEMU captured from the NIC (checksums, per-flow sequence
//! continuity, payload pattern) and the frame count the tests announced.
//! With `--virtio-pcap PCAP`, also a virtio-net NIC's capture taken on
//! the driver's side (QEMU's `filter-dump` with vnet headers): every frame
//! of ours cut into the segments the device sends (MSS 1448), each checked
//! the same way, and their count against the tests' `pcap-virtio-expect`.
//! Prints `N passed, M failed`; exits non-zero on any failure.
//!
//! `vmcheck sweep --console LOG --trace TRACE --pcap PCAP --out CSV`: the
//! guest's sweep CSV with QEMU's IOMMU trace counts per measured window
//! added as `vtd_inv_per_pkt`, `vtd_iotlb_fills_per_pkt` and
//! `vtd_iotlb_hits_per_pkt`, written to CSV and printed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use pfrag_lab::vm::{self, Capture, VirtioCapture};

/// The NIC of a guest sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Nic {
    /// The 82576: its frames on the wire.
    Igb,
    /// virtio-net: GSO super-frames as the driver posted them.
    Virtio,
}

#[derive(Parser)]
#[command(about = "Check what a vm/run.sh guest run produced")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Guest test results plus the captured frames.
    Test {
        /// The guest's console log.
        #[arg(long)]
        console: PathBuf,
        /// QEMU's capture of the NIC's frames.
        #[arg(long)]
        pcap: PathBuf,
        /// A virtio-net NIC's capture, frames as the driver posted them.
        #[arg(long)]
        virtio_pcap: Option<PathBuf>,
    },
    /// The guest sweep's CSV joined with QEMU's IOMMU trace counts.
    Sweep {
        /// The guest's console log (holds the CSV).
        #[arg(long)]
        console: PathBuf,
        /// QEMU's trace log.
        #[arg(long)]
        trace: PathBuf,
        /// QEMU's capture of the NIC's frames.
        #[arg(long)]
        pcap: PathBuf,
        /// The NIC the sweep ran on: its capture is checked its way (a
        /// virtio-net capture holds frames as the driver posted them).
        #[arg(long, value_enum, default_value = "igb")]
        nic: Nic,
        /// Where to write the joined CSV.
        #[arg(long)]
        out: PathBuf,
    },
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn pcap_lines(cap: &Capture) -> Vec<String> {
    let r = &cap.report;
    let mut v = vec![format!(
        "pcap: {} frames of {} flows in {} streams, {} payload bytes matched, {} bad, {} unplaced, {} foreign, {} truncated; {} of blocked flows, {} leaked; {} of killed drivers, {} bad, {} stale",
        r.frames, r.flows, r.streams, r.payload_bytes, r.bad_frames, r.unplaced_frames, cap.foreign, cap.truncated,
        cap.blocked_frames, cap.leaks, cap.crash_frames, cap.crash_bad, cap.stale
    )];
    v.extend(r.first_errors.iter().map(|e| format!("pcap: {e}")));
    v
}

fn virtio_lines(cap: &VirtioCapture) -> Vec<String> {
    let r = &cap.report;
    let mut v = vec![format!(
        "virtio pcap: {} super-frames, {} segments of {} flows in {} streams, {} payload bytes matched, {} bad, {} unplaced, {} foreign, {} truncated; {} of killed drivers, {} bad, {} stale",
        cap.super_frames, cap.segments, r.flows, r.streams, r.payload_bytes, cap.bad(), r.unplaced_frames, cap.foreign, cap.truncated,
        cap.crash_frames, cap.crash_bad, cap.stale
    )];
    let errors = cap.first_errors.iter().chain(&r.first_errors);
    v.extend(errors.map(|e| format!("virtio pcap: {e}")));
    v
}

/// The checks of a virtio-net capture, by `check`.
fn test_virtio(path: &Path, c: &vm::Console, check: &mut dyn FnMut(bool, String)) {
    match vm::check_virtio_pcap(path, &c.virtio_crash_flows) {
        Ok(cap) => {
            for l in virtio_lines(&cap) {
                println!("{l}");
            }
            check(
                cap.bad() == 0
                    && cap.truncated == 0
                    && cap.super_frames > 0
                    && cap.crash_bad == 0
                    && cap.stale == 0,
                "every virtio frame valid (IP length, pseudo-header sum; each segment's checksums, sequence, payload)".into(),
            );
            check(
                cap.segments == c.expect_virtio_segments,
                format!(
                    "virtio segment count {} equals what the tests sent ({})",
                    cap.segments, c.expect_virtio_segments
                ),
            );
        }
        Err(e) => check(false, format!("virtio capture readable: {e}")),
    }
}

fn test(console: &Path, pcap: &Path, virtio_pcap: Option<&Path>) -> Result<bool, String> {
    let c = vm::parse_console(&read(console)?);
    let (mut passed, mut failed) = (c.passed, c.failed);
    let mut check = |ok: bool, what: String| {
        println!("host: {what} ... {}", if ok { "ok" } else { "FAILED" });
        if ok {
            passed += 1;
        } else {
            failed += 1;
        }
    };
    check(
        c.finished && c.exit == Some(0),
        format!(
            "guest tests finished (exit {:?}, {} passed, {} failed)",
            c.exit, c.passed, c.failed
        ),
    );
    match vm::check_pcap(pcap, &c) {
        Ok(cap) => {
            for l in pcap_lines(&cap) {
                println!("{l}");
            }
            let r = &cap.report;
            check(
                r.bad_frames == 0 && cap.truncated == 0 && r.frames > 0,
                "every captured frame valid (IPv4/TCP checksums, sequence, payload)".into(),
            );
            if !c.blocked_flows.is_empty() {
                check(
                    cap.leaks == 0,
                    format!(
                        "no frame of a blocked flow carries the unmapped memory ({} such frames)",
                        cap.blocked_frames
                    ),
                );
            }
            if !c.crash_flows.is_empty() {
                check(
                    cap.crash_frames > 0 && cap.crash_bad == 0 && cap.stale == 0,
                    format!(
                        "the killed driver's {} frames valid, none after the fresh start's first ({} stale)",
                        cap.crash_frames, cap.stale
                    ),
                );
            }
            check(
                r.frames == c.expect_frames,
                format!(
                    "frame count {} equals what the tests sent ({})",
                    r.frames, c.expect_frames
                ),
            );
        }
        Err(e) => check(false, format!("capture readable: {e}")),
    }
    if let Some(p) = virtio_pcap {
        test_virtio(p, &c, &mut check);
    }
    println!("{passed} passed, {failed} failed");
    Ok(failed == 0)
}

/// What each CSV row sent (a field missing or unparsable counts 0).
fn rows_sent(headers: &csv::StringRecord, rows: &[csv::StringRecord]) -> Vec<vm::RowSent> {
    let col = |name: &str| headers.iter().position(|h| h == name);
    let (packets, warmup, payload) = (col("packets"), col("warmup"), col("payload_bytes"));
    // A CSV from before the `mss` column was cut at the lab's one MSS.
    let mss = col("mss");
    let sent = |row: &csv::StringRecord| {
        let field = |c: Option<usize>| -> u64 {
            c.and_then(|i| row.get(i))
                .and_then(|s| s.parse().ok())
                .unwrap_or(0)
        };
        vm::RowSent {
            packets: field(packets),
            warmup: field(warmup),
            payload: field(payload),
            mss: mss.map_or(u64::from(pfrag_lab::run::MSS), |_| field(mss)),
        }
    };
    rows.iter().map(sent).collect()
}

/// The rows' segment sizes, for the summary line: "1448 B", or
/// "1448, 8948 B".
fn mss_list(rows: &[vm::RowSent]) -> String {
    let mut m: Vec<u64> = rows.iter().map(|r| r.mss).collect();
    m.sort_unstable();
    m.dedup();
    let m: Vec<String> = m.iter().map(u64::to_string).collect();
    format!("{} B", m.join(", "))
}

/// Prints the columns of `table` worth a glance.
fn print_table(headers: &csv::StringRecord, table: &[csv::StringRecord]) {
    let show = [
        "order",
        "policy",
        "header",
        "maps_per_pkt",
        "unmaps_per_pkt",
        "vtd_inv_per_pkt",
        "vtd_iotlb_fills_per_pkt",
        "vtd_iotlb_hits_per_pkt",
        "descs_per_pkt",
        "gbit_s",
    ];
    let idx: Vec<usize> = show
        .iter()
        .filter_map(|s| headers.iter().position(|h| h == *s))
        .collect();
    let line = |r: &csv::StringRecord| -> String {
        idx.iter()
            .map(|&i| format!("{:>14}", r.get(i).unwrap_or("")))
            .collect()
    };
    println!("{}", line(headers));
    for r in table {
        println!("{}", line(r));
    }
}

/// The frames of the capture and how many of them are bad, checked as
/// `nic` puts them there.
fn capture_counts(pcap: &Path, nic: Nic) -> Result<(u64, u64), String> {
    Ok(match nic {
        Nic::Igb => {
            let cap = vm::check_pcap(pcap, &vm::Console::default()).map_err(|e| e.to_string())?;
            pcap_lines(&cap).iter().for_each(|l| println!("{l}"));
            (cap.report.frames, cap.report.bad_frames)
        }
        Nic::Virtio => {
            let cap = vm::check_virtio_pcap(pcap, &[]).map_err(|e| e.to_string())?;
            virtio_lines(&cap).iter().for_each(|l| println!("{l}"));
            (cap.segments, cap.bad() + cap.truncated)
        }
    })
}

fn sweep(console: &Path, trace: &Path, pcap: &Path, nic: Nic, out: &Path) -> Result<bool, String> {
    let c = vm::parse_console(&read(console)?);
    if c.csv.is_empty() {
        return Err(format!(
            "{}: the guest printed no CSV (exit {:?})",
            console.display(),
            c.exit
        ));
    }
    let windows = vm::count_windows(&read(trace)?, vfio_nic::hw::igb::MARK_REG.offset());
    let mut rd = csv::Reader::from_reader(c.csv.as_bytes());
    let mut headers = rd.headers().map_err(|e| e.to_string())?.clone();
    let packets_col = headers
        .iter()
        .position(|h| h == "packets")
        .ok_or("the CSV has no packets column")?;
    let rows: Vec<csv::StringRecord> = rd
        .records()
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let (per_row, reps) = vm::windows_per_row(&windows, rows.len()).ok_or_else(|| {
        format!(
            "{} CSV rows but {} marked windows in the trace (not a whole number of repetitions)",
            rows.len(),
            windows.len()
        )
    })?;
    // Checked before anything is written: the numbers come from the guest.
    let sent = rows_sent(&headers, &rows);
    let expect_frames = vm::expected_frames(&sent, reps).map_err(|e| e.to_string())?;
    for h in [
        "vtd_inv_per_pkt",
        "vtd_iotlb_fills_per_pkt",
        "vtd_iotlb_hits_per_pkt",
    ] {
        headers.push_field(h);
    }
    let mut w = csv::Writer::from_path(out).map_err(|e| format!("{}: {e}", out.display()))?;
    w.write_record(&headers).map_err(|e| e.to_string())?;
    let mut table = Vec::new();
    for (row, win) in rows.iter().zip(&per_row) {
        let p: f64 = row
            .get(packets_col)
            .and_then(|s| s.parse().ok())
            .filter(|&p: &f64| p > 0.0)
            .ok_or("a row without packets")?;
        let mut r = row.clone();
        let per = |n: u64| format!("{:.4}", n as f64 / (p * reps as f64));
        r.push_field(&per(win.invalidations));
        r.push_field(&per(win.iotlb_fills));
        r.push_field(&per(win.iotlb_hits));
        w.write_record(&r).map_err(|e| e.to_string())?;
        table.push(r);
    }
    w.flush().map_err(|e| e.to_string())?;
    print_table(&headers, &table);
    println!("wrote {}", out.display());
    let (frames, bad) = capture_counts(pcap, nic)?;
    let count_ok = frames == expect_frames;
    println!(
        "pcap: {} frames, {} expected from the rows (packets + warm-up, in segments of {}): {}",
        frames,
        expect_frames,
        mss_list(&sent),
        if count_ok { "ok" } else { "MISMATCH" }
    );
    Ok(bad == 0 && count_ok && c.exit == Some(0))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Test {
            console,
            pcap,
            virtio_pcap,
        } => test(console, pcap, virtio_pcap.as_deref()),
        Cmd::Sweep {
            console,
            trace,
            pcap,
            nic,
            out,
        } => sweep(console, trace, pcap, *nic, out),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("vmcheck: {e}");
            ExitCode::from(2)
        }
    }
}
