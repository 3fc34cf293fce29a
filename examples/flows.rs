//! Thousands of flows: pool memory against bytes in flight when frags are
//! held until their flow's ACK, for a shared per-queue cache, one cache per
//! flow, the split remedy, and the TX queue's default frag source (the same
//! split, inside the engine), across flow counts and chunk orders.
//!
//! ```text
//! cargo run --release --example flows -- --flows 200,1000,10000 --orders 0-4
//! cargo run --release --example flows -- --quick
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use pfrag_lab::cli;
use pfrag_lab::flows::{self, CacheKind, FlowsConfig, FlowsRow};
use pfrag_lab::report;

/// Frags held until ACK across many flows: pool memory over bytes in
/// flight (amplification), chunks pinned by one frag, and the mapping
/// counts, for each cache, order and number of flows. Time is simulated
/// from the line rate; every payload byte still goes through the software
/// IOMMU and NIC and is verified.
#[derive(Parser, Debug)]
#[command(version, allow_negative_numbers = true)]
struct Args {
    /// Numbers of flows (default 200,1000,10000; 200,1000 with --quick).
    #[arg(long, value_delimiter = ',')]
    flows: Vec<usize>,
    /// Chunk orders: a list (0,2,4) or a range (0-4).
    #[arg(long, default_value = "0-4", value_parser = cli::orders)]
    orders: std::vec::Vec<u32>,
    /// Caches compared in the same run: shared, per-flow, split, default
    /// (the TX queue's own frag source, as a driver gets it).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shared,per-flow,split,default"
    )]
    caches: Vec<CacheKind>,
    /// Packets measured per configuration, 1..=1,000,000,000 (default
    /// 60,000; 2,000 with --quick).
    #[arg(long, value_parser = cli::packets)]
    packets: Option<u64>,
    /// Packets sent before measuring, 0..=1,000,000,000 (default 20,000;
    /// 500 with --quick).
    #[arg(long, value_parser = cli::warmup)]
    warmup: Option<u64>,
    /// Wire rate of the simulated time, Gbit/s, 0.001..=10,000.
    #[arg(long, default_value_t = 100.0, value_parser = cli::gbit)]
    line_rate: f64,
    /// Share of flows sending 64 KB TSO packets (the rest send small
    /// messages).
    #[arg(long, default_value_t = 0.1)]
    bulk_share: f64,
    /// Share of flows that stall once (zero window).
    #[arg(long, default_value_t = 0.01)]
    stall_share: f64,
    /// Length of a stall, ms.
    #[arg(long, default_value_t = 20.0)]
    stall_ms: f64,
    /// Least round-trip time, µs.
    #[arg(long, default_value_t = 50.0)]
    rtt_min_us: f64,
    /// Pareto shape of round-trip times.
    #[arg(long, default_value_t = 1.5)]
    rtt_alpha: f64,
    /// Longest round-trip time, ms (the tail is cut here).
    #[arg(long, default_value_t = 10.0)]
    rtt_max_ms: f64,
    /// Seed of the workload.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Smoke run: 2,000 packets, 500 warm-up, 200 and 1,000 flows, where
    /// the options do not say otherwise.
    #[arg(long)]
    quick: bool,
    /// Write the rows as CSV (its header is written before the run).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw amplification against flows as SVG (a file other than the
    /// CSV).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// No progress bar: a line per configuration instead (also when
    /// stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
}

/// The table's columns.
const TABLE: [(&str, &str); 11] = [
    ("cache", "cache"),
    ("order", "order"),
    ("flows", "flows"),
    ("inflight_MB", "inflight_bytes_mean"),
    ("pool_MB", "pool_bytes_mean"),
    ("amp_mean", "amplification_mean"),
    ("amp_peak", "amplification_peak"),
    ("pinned", "pinned_chunks_mean"),
    ("maps", "maps_per_pkt"),
    ("iotlb_misses", "iotlb_misses_per_pkt"),
    ("sim_ms", "sim_ms"),
];

fn configs(a: &Args) -> Vec<FlowsConfig> {
    // What the options give, else the defaults (a smoke run's with --quick).
    let (packets, warmup, flows) = if a.quick {
        (2_000, 500, vec![200, 1000])
    } else {
        (60_000, 20_000, vec![200, 1000, 10_000])
    };
    let packets = a.packets.unwrap_or(packets);
    let warmup = a.warmup.unwrap_or(warmup);
    let flows = if a.flows.is_empty() {
        flows
    } else {
        a.flows.clone()
    };
    let mut out = Vec::new();
    for &n in &flows {
        for &order in &a.orders {
            for &cache in &a.caches {
                out.push(FlowsConfig {
                    flows: n,
                    order,
                    cache,
                    packets,
                    warmup,
                    line_rate_gbit: a.line_rate,
                    bulk_share: a.bulk_share,
                    stall_share: a.stall_share,
                    stall_ms: a.stall_ms,
                    rtt_min_us: a.rtt_min_us,
                    rtt_alpha: a.rtt_alpha,
                    rtt_max_ms: a.rtt_max_ms,
                    seed: a.seed,
                    ..FlowsConfig::default()
                });
            }
        }
    }
    out
}

fn main() -> ExitCode {
    let a = Args::parse();
    let listed = cli::distinct("--flows", &a.flows).and(cli::distinct("--caches", &a.caches));
    if let Err(e) = listed {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let cfgs = configs(&a);
    for c in &cfgs {
        if let Err(e) = c.check() {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    let columns = report::columns_of::<FlowsRow>();
    if let Err(e) = cli::outputs(a.csv.as_deref(), &columns, a.svg.as_deref()) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let total: u64 = cfgs.iter().map(|c| c.packets + c.warmup).sum();
    let plain = cli::plain_progress(a.no_progress);
    let bar = if plain {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} packets  {msg}  [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows: Vec<FlowsRow> = Vec::new();
    for c in &cfgs {
        let what = format!("{} flows, order {}, {}", c.flows, c.order, c.cache.name());
        bar.set_message(what.clone());
        if plain {
            eprintln!("flows: {what}");
        }
        match flows::run(c) {
            Ok(r) => rows.push(r),
            Err(e) => {
                bar.abandon();
                eprintln!("error: {what}: {e}");
                return ExitCode::FAILURE;
            }
        }
        bar.inc(c.packets + c.warmup);
    }
    bar.finish_and_clear();
    let shown: Vec<FlowsRow> = rows
        .iter()
        .map(|r| FlowsRow {
            inflight_bytes_mean: r.inflight_bytes_mean / 1e6,
            pool_bytes_mean: r.pool_bytes_mean / 1e6,
            ..r.clone()
        })
        .collect();
    let mut out = std::io::stdout().lock();
    if report::print_columns(&mut out, &shown, &TABLE).is_err() {
        return ExitCode::FAILURE;
    }
    let _ = out.flush();
    if let Some(p) = &a.csv {
        if let Err(e) = report::write_csv(p, &rows) {
            eprintln!("error: writing {}: {e}", p.display());
            return ExitCode::FAILURE;
        }
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &a.svg {
        if let Err(e) = flows::write_svg(p, &rows) {
            eprintln!("error: drawing {}: {e}", p.display());
            return ExitCode::FAILURE;
        }
        eprintln!("wrote {}", p.display());
    }
    ExitCode::SUCCESS
}
