//! Reclaim thrash, measured: a tbench-like workload (many small sends of
//! 64 B ..= 16 KiB over 1..1024 flows, completions interleaved with sends)
//! on the software NIC, under `Eager` reclaim (every freed chunk straight
//! back to the shared pool) and `Hysteresis` (per-queue reserves trimmed
//! 1 MiB at a time past 2 MiB).
//!
//! ```text
//! cargo run --release --example reclaim
//! cargo run --release --example reclaim -- --flows 1,1024 --queues 2 --csv reclaim.csv
//! cargo run --release --example reclaim -- --mem-limits 1,2,64   # MiB: cross the pressure limits
//! ```
//!
//! Every run repeats `--reps` times (5 by default), the policies'
//! runs interleaved round robin so that the machine's drift hits both
//! alike. A row is the repetitions' median, `gbit_s` with its range; the
//! hysteresis/eager throughput is the median of per-round ratios, with
//! its range, and from 6 rounds its 95 % confidence interval and whether
//! it differs from 1.
//!
//! Columns: `policy,queues,flows,packets,reclaim_calls_per_pkt,
//! shared_pool_ops_per_pkt,pressure_hook_calls,gbit_s,peak_bytes`, plus
//! `pressure_transitions` (the account's own count, which the hook count
//! must equal), `bytes_verified`, `reps`, `gbit_s_min` and `gbit_s_max`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use pfrag::account::Limits;
use pfrag::bounce::SlotSize;
use pfrag::dma::CostModel;
use pfrag::pool::{Policy, Reclaim};
use pfrag_lab::run::{run, DeviceModel, IommuMode, Row, RunConfig, Workload};
use pfrag_lab::{cli, report, reps};
use vfio_nic::model::softnic::Touch;
use vfio_nic::tx::HeaderMode;

/// Reclaim calls and shared-pool traffic per packet under Eager and
/// Hysteresis reclaim, on a many-small-sends workload.
#[derive(Parser, Debug)]
#[command(version, allow_negative_numbers = true)]
struct Args {
    /// Reclaim policies to compare.
    #[arg(long, value_delimiter = ',', default_value = "eager,hysteresis")]
    policies: Vec<Reclaim>,
    /// Flow counts, one run each.
    #[arg(long, value_delimiter = ',', default_value = "1,64,1024")]
    flows: Vec<usize>,
    /// TX queues (threads) sharing the pool.
    #[arg(long, default_value_t = 1)]
    queues: usize,
    /// Sends per run, 1..=1,000,000,000.
    #[arg(long, default_value_t = 200_000, value_parser = cli::packets)]
    packets: u64,
    /// Smallest send, bytes.
    #[arg(long, default_value_t = 64)]
    min: usize,
    /// Largest send, bytes.
    #[arg(long, default_value_t = 16 * 1024)]
    max: usize,
    /// Chunk order of the pool (2 = 16 KiB chunks).
    #[arg(long, default_value_t = 2)]
    order: u32,
    /// TX ring descriptors (in-flight sends): a multiple of 8 in 8..=4096.
    #[arg(long, default_value_t = vfio_nic::tx::Config::DEFAULT_RING, value_parser = cli::ring)]
    ring: u16,
    /// Sends per doorbell (completions are reaped between bursts),
    /// 1..=--ring.
    #[arg(long, default_value_t = 8)]
    burst: u64,
    /// Account limits MIN,PRESSURE,MAX in MiB (default: none).
    #[arg(long, value_parser = cli::mem_limits)]
    mem_limits: Option<Limits>,
    /// Repetitions of every run, interleaved round robin: rows show the
    /// median and the range, the throughput ratio its 95 % confidence
    /// interval from 6 on.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    reps: u32,
    /// Write the rows as CSV.
    #[arg(long)]
    csv: Option<PathBuf>,
}

/// The table's and the CSV's columns: (header, field of the lab's `Row`).
const COLUMNS: [(&str, &str); 14] = [
    ("policy", "reclaim"),
    ("queues", "queues"),
    ("flows", "flows"),
    ("packets", "packets"),
    ("reclaim_calls_per_pkt", "reclaim_calls_per_pkt"),
    ("shared_pool_ops_per_pkt", "shared_pool_ops_per_pkt"),
    ("pressure_hook_calls", "pressure_hook_calls"),
    ("gbit_s", "gbit_s"),
    ("peak_bytes", "peak_bytes"),
    ("pressure_transitions", "pressure_transitions"),
    ("bytes_verified", "bytes_verified"),
    ("reps", "reps"),
    ("gbit_s_min", "gbit_s_min"),
    ("gbit_s_max", "gbit_s_max"),
];

fn main() -> ExitCode {
    let a = Args::parse();
    let cfgs = match plan(&a) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(per_cfg) = run_all(&a, &cfgs) else {
        return ExitCode::FAILURE;
    };
    let rows: Vec<Row> = per_cfg.iter().filter_map(|r| reps::summarise(r)).collect();
    print_rows(&rows, &per_cfg, &a.flows);
    // A run that failed leaves the CSV with its header only: its rows are
    // in the table above, not in a file that looks complete.
    if !per_cfg.iter().all(|r| rows_ok(r)) {
        return ExitCode::FAILURE;
    }
    if let Some(path) = &a.csv {
        let w = report::write_csv_columns(path, &rows, &COLUMNS);
        if let Err(e) = w {
            eprintln!("error: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        eprintln!("wrote {}", path.display());
    }
    ExitCode::SUCCESS
}

/// Checks the arguments and the output file, and gives the runs, one per
/// (policy, flows), each checked; or what is wrong, in words.
fn plan(a: &Args) -> Result<Vec<RunConfig>, String> {
    if a.min == 0 || a.min > a.max || a.queues == 0 {
        return Err(format!(
            "need 0 < --min <= --max and --queues >= 1 (got --min {}, --max {}, --queues {})",
            a.min, a.max, a.queues
        ));
    }
    cli::distinct("--policies", &a.policies)?;
    cli::distinct("--flows", &a.flows)?;
    if let Some(e) = a
        .flows
        .iter()
        .find_map(|&f| pfrag_lab::run::check_flows(f).err())
    {
        return Err(e.to_string());
    }
    let limits = a.mem_limits.unwrap_or(Limits::UNLIMITED);
    let mut cfgs = Vec::new();
    for &p in &a.policies {
        for &flows in &a.flows {
            cfgs.push(config(a, p, flows, limits));
        }
    }
    if let Some(e) = cfgs.iter().find_map(|c| pfrag_lab::run::check(c).err()) {
        return Err(e.to_string());
    }
    // Last: a refused command leaves an existing file as it was.
    let columns: Vec<String> = COLUMNS.iter().map(|c| c.0.to_string()).collect();
    cli::outputs(a.csv.as_deref(), &columns, None)?;
    Ok(cfgs)
}

/// The run of `flows` flows under reclaim policy `p` (a hysteresis policy
/// at its default thresholds): small sends on the software NIC.
fn config(a: &Args, p: Reclaim, flows: usize, limits: Limits) -> RunConfig {
    RunConfig {
        order: a.order,
        policy: Policy::Persistent,
        iommu: IommuMode::Strict,
        header: HeaderMode::Bounce(SlotSize::B128),
        fit_whole: true,
        payload: a.max,
        flows,
        packets: a.packets,
        warmup: 2 * u64::from(a.ring),
        ring: a.ring,
        burst: a.burst,
        iotlb_entries: 128,
        hugepages: false,
        touch: Touch::Checksum,
        cost: CostModel::default(),
        queues: a.queues,
        skew: None,
        reclaim: match p {
            Reclaim::Hysteresis { .. } => Reclaim::HYSTERESIS,
            other => other,
        },
        workload: Workload::Small {
            min: a.min,
            max: a.max,
        },
        limits,
        model: DeviceModel::Soft,
        device: Default::default(),
        mss: pfrag_lab::run::MSS,
    }
}

/// Runs `a.reps` rounds of `cfgs`, in turn within each round, under a
/// progress bar, and gives each configuration's rows, one per round;
/// `None` (the error said) if a run fails.
fn run_all(a: &Args, cfgs: &[RunConfig]) -> Option<Vec<Vec<Row>>> {
    eprintln!(
        "reclaim: {} runs of {} sends of {}..={} B on the software NIC, {} queue(s), order-{} \
         chunks, {} repetitions",
        cfgs.len(),
        a.packets,
        a.min,
        a.max,
        a.queues,
        a.order,
        a.reps
    );
    let per_run = a.packets + 2 * u64::from(a.ring) * a.queues as u64;
    let bar = ProgressBar::new(u64::from(a.reps) * cfgs.len() as u64 * per_run);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} sends  {msg}  [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut per_cfg = vec![Vec::new(); cfgs.len()];
    for rep in 1..=a.reps {
        for (c, rows) in cfgs.iter().zip(&mut per_cfg) {
            let what = format!("{} {} flows", c.reclaim.name(), c.flows);
            bar.set_message(format!("repetition {rep}/{}: {what}", a.reps));
            match run(c, &mut |n| bar.inc(n)) {
                Ok(mut r) => rows.push(r.remove(0)),
                Err(e) => {
                    bar.abandon();
                    eprintln!("error: repetition {rep}: {what}: {e}");
                    return None;
                }
            }
        }
    }
    bar.finish_and_clear();
    Some(per_cfg)
}

/// Prints the table of summary `rows`, then per flow count the eager and
/// hysteresis runs side by side, the throughput ratio taken per round of
/// their repetitions `per_cfg`.
fn print_rows(rows: &[Row], per_cfg: &[Vec<Row>], flow_counts: &[usize]) {
    let mut out = std::io::stdout().lock();
    let _ = report::print_columns(&mut out, rows, &COLUMNS);
    let _ = writeln!(out);
    let reps_of = |name: &str, flows: usize| {
        per_cfg.iter().find(|r| {
            r.first()
                .is_some_and(|r| r.reclaim == name && r.flows == flows)
        })
    };
    for &flows in flow_counts {
        let find = |name: &str| rows.iter().find(|r| r.reclaim == name && r.flows == flows);
        let (Some(e), Some(h)) = (find("eager"), find("hysteresis")) else {
            continue;
        };
        let ratio = match (reps_of("hysteresis", flows), reps_of("eager", flows)) {
            (Some(h), Some(e)) => reps::ratio(h, e, |r| Some(r.gbit_s)),
            _ => None,
        };
        let _ = writeln!(
            out,
            "{flows} flows: reclaim calls per packet eager {:.4} vs hysteresis {:.4}; \
             shared-pool ops {:.4} vs {:.4}; hysteresis/eager throughput {}",
            e.reclaim_calls_per_pkt,
            h.reclaim_calls_per_pkt,
            e.shared_pool_ops_per_pkt,
            h.shared_pool_ops_per_pkt,
            ratio.map_or("n/a".to_string(), |s| throughput_ratio(&s, e.reps))
        );
    }
}

/// A ratio's median and range over `rounds` rounds, with its 95 %
/// confidence interval and whether it differs from 1 when it has one.
fn throughput_ratio(s: &reps::Spread, rounds: usize) -> String {
    let mut t = format!(
        "{:.2}x ({:.2}-{:.2}, {rounds} rounds",
        s.median, s.min, s.max
    );
    match (s.ci95, s.differs_from(1.0)) {
        (Some((lo, hi)), Some(d)) => {
            let verdict = if d {
                "differs from 1"
            } else {
                "not different from 1"
            };
            t += &format!("; 95 % CI {lo:.2}-{hi:.2}, {verdict})");
        }
        _ => t += ")",
    }
    t
}

/// Whether every run is sound: no device fault, one pressure hook call per
/// transition, and every payload byte sent verified (each error said).
fn rows_ok(rows: &[Row]) -> bool {
    let mut ok = true;
    for r in rows {
        for why in r.problems() {
            eprintln!("error: {} {} flows: {why}", r.reclaim, r.flows);
            ok = false;
        }
    }
    ok
}
