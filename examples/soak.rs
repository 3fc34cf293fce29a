//! The chaos soak: randomized phases of TX with injected map, unmap and
//! flush failures, checked after every phase for lost, corrupted,
//! duplicated or leaked anything (see `pfrag_lab::soak`).
//!
//! ```text
//! cargo run --release --example soak                         # 1,000,000 packets
//! cargo run --release --example soak -- --packets 10000000 --seed 7
//! cargo run --release --example soak -- --seconds 600       # until time is up
//! ```
//!
//! Exits non-zero on any violation, and on any error that no injected
//! failure or limit explains. The last line has the form `soak: N packets,
//! B bytes verified, F injected failures, R sends refused (I injected, M
//! memory limit, G too big for the ring, T too many buffers), 0
//! unexplained, 0 corrupted, 0 leaked`. The same seed replays the same run.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use pfrag_lab::cli;
use pfrag_lab::soak::{say, soak, summary};

/// The longest `--seconds` taken: a year.
const MAX_SECONDS: u64 = 365 * 24 * 3600;

/// Randomized TX phases with injected DMA failures, each checked for loss,
/// corruption and leaks.
#[derive(Parser, Debug)]
#[command(version, allow_negative_numbers = true)]
struct Args {
    /// Packets to post in all (refused sends not counted), 1..=1,000,000,000.
    /// Default 1,000,000; with --seconds alone, no packet limit.
    #[arg(long, value_parser = cli::packets)]
    packets: Option<u64>,
    /// Stop after this many seconds (the phase running then stops posting
    /// and is checked), at most a year; with --packets too, at whichever
    /// limit comes first.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_SECONDS))]
    seconds: Option<u64>,
    /// Seed of the phases, sizes, flows and failures.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Packets per phase. Each phase's pool is dropped at its end, and
    /// memory pinned after failed unmaps stays allocated for good (by
    /// design), so more phases hold more memory. 1..=1,000,000,000.
    #[arg(long, default_value_t = 50_000, value_parser = cli::packets)]
    phase_packets: u64,
    /// Print each phase as it ends (above the progress bar, or as plain
    /// lines on stderr when no bar is drawn).
    #[arg(long)]
    verbose: bool,
    /// No progress bar: a line per phase instead (also when stderr is not
    /// a terminal).
    #[arg(long)]
    no_progress: bool,
}

fn main() -> ExitCode {
    let a = Args::parse();
    // A time limit alone runs until the time is up.
    let packets = match (a.packets, a.seconds) {
        (Some(n), _) => Some(n),
        (None, Some(_)) => None,
        (None, None) => Some(1_000_000),
    };
    let plain = cli::plain_progress(a.no_progress);
    let (bar, template) = match packets {
        _ if plain => (ProgressBar::hidden(), ""),
        Some(n) => (
            ProgressBar::new(n),
            "{bar:40} {pos}/{len} packets  {msg}  [{elapsed_precise}, eta {eta}]",
        ),
        None => (
            ProgressBar::no_length(),
            "{pos} packets  {msg}  [{elapsed_precise}]",
        ),
    };
    bar.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let done = AtomicU64::new(0);
    let tick = |n: u64| {
        bar.set_position(done.fetch_add(n, Ordering::Relaxed) + n);
    };
    let start = Instant::now();
    let deadline = a.seconds.map(|s| start + Duration::from_secs(s));
    let mut on_phase = |i: u64, p: &pfrag_lab::soak::Phase, t: &pfrag_lab::soak::Tally| {
        bar.set_message(format!(
            "phase {i}: {} injected, {} pinned bytes",
            t.injected, t.pinned_bytes
        ));
        if a.verbose {
            let line = format!("phase {i}: {} -> {t:?}", p.describe());
            say(&bar, &mut std::io::stderr(), &line);
        } else if plain {
            // No bar: a short line per phase, so a log shows progress.
            eprintln!(
                "soak: phase {i} done, {} packets so far, {} injected failures",
                t.packets, t.injected
            );
        }
    };
    let r = soak(
        a.seed,
        packets.unwrap_or(u64::MAX),
        a.phase_packets,
        deadline,
        &tick,
        &mut on_phase,
    );
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    match r {
        Ok(t) => {
            println!(
                "{} phases in {secs:.1} s, seed {}; {} bytes pinned on purpose after \
                 failed unmaps (counted, never reused)",
                t.phases, a.seed, t.pinned_bytes
            );
            println!("{}", summary(&t));
            ExitCode::SUCCESS
        }
        Err(b) => {
            let (t, v) = *b;
            eprintln!("error: {v}");
            println!("{}", summary(&t));
            ExitCode::FAILURE
        }
    }
}
