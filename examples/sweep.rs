//! The order sweep: TX on the software NIC (or, with `--backend vfio`, a
//! real 82576 through VFIO) across chunk orders, mapping policies and IOMMU
//! modes, one row per configuration.
//!
//! ```text
//! cargo run --release --example sweep                    # the default matrix
//! cargo run --release --example sweep -- --quick         # a smoke run
//! cargo run --release --example sweep -- --orders 3,4 --policies persistent \
//!     --iommu strict,lazy --csv sweep.csv --svg sweep.svg
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use pfrag::account::Limits;
use pfrag::bounce::SlotSize;
use pfrag::dma::CostModel;
use pfrag::pool::{Policy, Reclaim};
use pfrag_lab::run::{run_vfio, DeviceModel, Workload};
use pfrag_lab::{cli, report};
use pfrag_lab::{limit, run, IommuMode, Row, RunConfig};
use vfio_nic::model::softnic::Touch;
use vfio_nic::tx::HeaderMode;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The software NIC model (a simulator).
    Soft,
    /// An Intel 82576 bound to vfio-pci (see --device), through the
    /// kernel's IOMMU.
    Vfio,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

/// TX through pfrag pools on the software NIC: DMA map calls,
/// invalidations, IOTLB misses and throughput per packet across chunk orders.
///
/// Without --policies and --iommu it runs the default matrix: per-frag with
/// mapped headers (the stock kernel), per-chunk and persistent with the
/// bounce ring, all under a strict IOMMU, plus persistent with the IOMMU off,
/// for each order; and a `limit` row (the NIC's work alone).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Chunk orders: a list (0,2,4) or a range (0-4).
    #[arg(long, default_value = "0-4", value_parser = cli::orders)]
    orders: std::vec::Vec<u32>,
    /// Mapping policies: per-frag, per-chunk, persistent.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<Policy>,
    /// IOMMU modes: off, strict, lazy.
    #[arg(long, value_delimiter = ',')]
    iommu: Vec<IommuMode>,
    /// Header placement (default: mapped for per-frag, bounce otherwise).
    #[arg(long)]
    header: Option<HeaderMode>,
    /// Fit payloads whole in one chunk (default: off for per-frag, as the
    /// stock kernel; on otherwise).
    #[arg(long)]
    fit_whole: Option<OnOff>,
    /// Payload bytes per packet (45 × 1448 = one 64 KB TSO packet).
    #[arg(long, default_value_t = 65160)]
    payload: usize,
    /// Flows, round robin.
    #[arg(long, default_value_t = 200)]
    flows: usize,
    /// Packets measured per configuration (default 20,000 on the software
    /// NIC, 2,000 through VFIO).
    #[arg(long)]
    packets: Option<u64>,
    /// Packets sent before measuring (default: twice the ring size).
    #[arg(long)]
    warmup: Option<u64>,
    /// TX ring descriptors: a multiple of 8 in 8..=4096.
    #[arg(long, default_value_t = 256, value_parser = cli::ring)]
    ring: u16,
    /// Packets posted per doorbell.
    #[arg(long, default_value_t = 8)]
    burst: u64,
    /// IOTLB entries of the software IOMMU.
    #[arg(long, default_value_t = 128, value_parser = cli::iotlb_entries)]
    iotlb_entries: usize,
    /// Back pools with 2 MiB huge pages and map superpages (falls back to
    /// normal pages, shown in the `backing` column, when none are reserved).
    #[arg(long)]
    hugepages: bool,
    /// The device model behind the ring: the software NIC, or the null
    /// device (translates and completes, reads no payload: the driver's own
    /// cost).
    #[arg(long, default_value = "soft")]
    model: DeviceModel,
    /// How much payload the NIC reads: every byte (checksum), or a line per
    /// page (pages).
    #[arg(long, default_value = "checksum")]
    touch: Touch,
    /// The NIC backend.
    #[arg(long, value_enum, default_value = "soft")]
    backend: Backend,
    /// PCI address of the 82576 for --backend vfio.
    #[arg(long, default_value = "0000:00:02.0")]
    device: String,
    /// No progress bar (for serial consoles and logs).
    #[arg(long)]
    no_progress: bool,
    /// TX queues, one thread each, sharing one pool and one mapper; rows
    /// for each queue follow each configuration's total row.
    #[arg(long, default_value_t = 1)]
    queues: usize,
    /// Share of the packets queue 0 sends (e.g. 0.9); the other queues
    /// split the rest. Default: even.
    #[arg(long)]
    skew: Option<f64>,
    /// How freed chunks return to the shared pool.
    #[arg(long, default_value = "eager")]
    reclaim: Reclaim,
    /// Hysteresis threshold in MiB (half of it goes back at once).
    #[arg(long, default_value_t = 2)]
    threshold_mib: u64,
    /// Write all columns as CSV.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw Gbit/s and maps/packet against order as SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Smoke run: 1,000 packets per configuration, 100 warm-up.
    #[arg(long)]
    quick: bool,
    /// Cost model: ns per map or unmap call.
    #[arg(long, default_value_t = CostModel::default().call_ns, value_parser = cli::ns)]
    cost_call_ns: f64,
    /// Cost model: ns per page-table entry written or cleared.
    #[arg(long, default_value_t = CostModel::default().pte_ns, value_parser = cli::ns)]
    cost_pte_ns: f64,
    /// Cost model: ns per IOTLB invalidation.
    #[arg(long, default_value_t = CostModel::default().invalidation_ns, value_parser = cli::ns)]
    cost_inval_ns: f64,
    /// Cost model: ns per IOTLB miss.
    #[arg(long, default_value_t = CostModel::default().miss_ns, value_parser = cli::ns)]
    cost_miss_ns: f64,
}

fn configs(a: &Args, packets: u64, warmup: u64) -> Vec<RunConfig> {
    let default_matrix = a.policies.is_empty() && a.iommu.is_empty();
    let policies: Vec<Policy> = if a.policies.is_empty() {
        Policy::ALL.to_vec()
    } else {
        a.policies.clone()
    };
    let modes: Vec<IommuMode> = if a.iommu.is_empty() {
        vec![IommuMode::Strict]
    } else {
        a.iommu.clone()
    };
    let mut combos: Vec<(Policy, IommuMode)> = Vec::new();
    for &m in &modes {
        for &p in &policies {
            combos.push((p, m));
        }
    }
    if default_matrix && a.backend == Backend::Soft {
        combos.push((Policy::Persistent, IommuMode::Off));
    }
    let mut out = Vec::new();
    for &order in &a.orders {
        for &(p, m) in &combos {
            let header = match a.header {
                Some(h) => h,
                None if p == Policy::PerFrag => HeaderMode::Mapped,
                None => HeaderMode::Bounce(SlotSize::B128),
            };
            let fit_whole = match a.fit_whole {
                Some(v) => v == OnOff::On,
                None => p != Policy::PerFrag,
            };
            out.push(RunConfig {
                order,
                policy: p,
                iommu: m,
                header,
                fit_whole,
                payload: a.payload,
                flows: a.flows,
                packets,
                warmup,
                ring: a.ring,
                burst: a.burst,
                iotlb_entries: a.iotlb_entries,
                hugepages: a.hugepages,
                touch: a.touch,
                cost: CostModel {
                    call_ns: a.cost_call_ns,
                    pte_ns: a.cost_pte_ns,
                    invalidation_ns: a.cost_inval_ns,
                    miss_ns: a.cost_miss_ns,
                },
                queues: a.queues,
                skew: a.skew,
                reclaim: match a.reclaim {
                    Reclaim::Eager => Reclaim::Eager,
                    Reclaim::Hysteresis { .. } => Reclaim::Hysteresis {
                        threshold: a.threshold_mib << 20,
                        chunk: (a.threshold_mib << 20) / 2,
                    },
                },
                // (threshold_mib is checked by `cli::mib` before this runs)
                workload: Workload::Fixed,
                limits: Limits::UNLIMITED,
                model: a.model,
            });
        }
    }
    out
}

/// A row's key: order, policy, iommu.
type Key<'a> = (&'a str, &'a str, &'a str);

/// Gbit/s of row `a` over row `b`, if both ran.
fn ratio(rows: &[Row], a: Key, b: Key) -> Option<f64> {
    let find = |(o, p, i): Key| {
        rows.iter()
            .find(|r| r.order == o && r.policy == p && r.iommu == i && r.queue == "all")
    };
    Some(find(a)?.gbit_s / find(b)?.gbit_s)
}

fn main() -> ExitCode {
    let a = Args::parse();
    let (packets, warmup) = if a.quick {
        (a.packets.unwrap_or(1_000), a.warmup.unwrap_or(100))
    } else {
        let n = match a.backend {
            Backend::Soft => 20_000,
            Backend::Vfio => 2_000,
        };
        (
            a.packets.unwrap_or(n),
            a.warmup.unwrap_or(2 * u64::from(a.ring)),
        )
    };
    if a.queues == 0 || (a.queues > 1 && a.backend == Backend::Vfio) {
        eprintln!(
            "error: --queues must be >= 1, and 1 with --backend vfio (one NIC queue is driven)"
        );
        return ExitCode::from(2);
    }
    if let Some(f) = a.skew {
        if !(0.0..=1.0).contains(&f) || a.queues < 2 {
            eprintln!("error: --skew takes a share in 0..=1 and needs --queues >= 2 (got {f})");
            return ExitCode::from(2);
        }
    }
    if let Err(e) = cli::mib("--threshold-mib", a.threshold_mib) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    for p in a.csv.iter().chain(&a.svg) {
        if let Err(e) = cli::output(p) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    let cfgs = configs(&a, packets, warmup);
    let on = match a.backend {
        Backend::Soft => "on the software NIC (a simulator)".to_string(),
        Backend::Vfio => format!("on the 82576 at {} through VFIO", a.device),
    };
    eprintln!(
        "sweep: {} configurations {on}, {} packets of {} B each, \
         warm-up {} packets per configuration, {} flows",
        cfgs.len(),
        packets,
        a.payload,
        warmup,
        a.flows
    );
    let Some(rows) = run_all(&a, &cfgs, packets + warmup) else {
        return ExitCode::FAILURE;
    };
    let mut out = std::io::stdout().lock();
    if report::print_table(&mut out, &rows).is_err() {
        return ExitCode::FAILURE;
    }
    let _ = writeln!(out);
    print_ratios(&mut out, &rows, &a.orders);
    if !write_outputs(&a, &rows) || !all_delivered(&a, &rows) {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Runs every configuration with a progress bar; `None` after reporting
/// an error.
fn run_all(a: &Args, cfgs: &[RunConfig], per_cfg: u64) -> Option<Vec<Row>> {
    let bar = if a.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(cfgs.len() as u64 * per_cfg)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} packets  {msg}  [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    for (i, c) in cfgs.iter().enumerate() {
        bar.set_message(format!(
            "order {} {} {}",
            c.order,
            c.policy.name(),
            c.iommu.name()
        ));
        if a.no_progress {
            eprintln!(
                "sweep: {}/{}: order {} {} {}",
                i + 1,
                cfgs.len(),
                c.order,
                c.policy.name(),
                c.iommu.name()
            );
        }
        let r = match a.backend {
            Backend::Soft => run(c, &mut |n| bar.inc(n)),
            Backend::Vfio => run_vfio(c, &a.device, i as u32, &mut |n| bar.inc(n)).map(|r| vec![r]),
        };
        match r {
            Ok(r) => rows.extend(r),
            Err(e) => {
                bar.abandon();
                eprintln!(
                    "error: order {} {} iommu {}: {e}",
                    c.order,
                    c.policy.name(),
                    c.iommu.name()
                );
                return None;
            }
        }
    }
    if let (Some(c), Backend::Soft) = (cfgs.first(), a.backend) {
        rows.push(limit(c));
    }
    bar.finish_and_clear();
    Some(rows)
}

/// The ratios of the same run, per order.
fn print_ratios(out: &mut impl Write, rows: &[Row], orders: &[u32]) {
    for o in orders {
        let o = o.to_string();
        let persistent = (o.as_str(), "persistent", "strict");
        let pf = ratio(rows, persistent, (&o, "per-frag", "strict"));
        let off = ratio(rows, persistent, (&o, "persistent", "off"));
        let lim = ratio(rows, persistent, ("", "limit", "none"));
        match (pf, off, lim) {
            (Some(pf), Some(off), Some(lim)) => {
                let _ = writeln!(
                    out,
                    "order {o}: persistent/per-frag {pf:.2}x, persistent/off {off:.2}x, persistent/limit {lim:.2}x"
                );
            }
            (Some(pf), _, _) => {
                let _ = writeln!(out, "order {o}: persistent/per-frag {pf:.2}x");
            }
            _ => {}
        }
    }
}

/// Writes the CSV and SVG asked for; false after reporting an error.
fn write_outputs(a: &Args, rows: &[Row]) -> bool {
    if let Some(path) = &a.csv {
        if let Err(e) = report::write_csv(path, rows) {
            eprintln!("error: writing {}: {e}", path.display());
            return false;
        }
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &a.svg {
        if let Err(e) = report::write_svg(path, rows) {
            eprintln!("error: drawing {}: {e}", path.display());
            return false;
        }
        eprintln!("wrote {}", path.display());
    }
    true
}

/// Whether every row delivered every byte intact (faults are failures; on
/// the software NIC with checksums, every payload byte must be verified).
fn all_delivered(a: &Args, rows: &[Row]) -> bool {
    let bad: Vec<&Row> = rows
        .iter()
        .filter(|r| {
            r.faults > 0
                || (a.backend == Backend::Soft
                    && a.model == DeviceModel::Soft
                    && a.touch == Touch::Checksum
                    && r.bytes_verified != r.packets * r.payload_bytes as u64)
        })
        .collect();
    if !bad.is_empty() {
        for r in bad {
            eprintln!(
                "error: order {} {} {}: {} faults, {} of {} bytes verified",
                r.order,
                r.policy,
                r.iommu,
                r.faults,
                r.bytes_verified,
                r.packets * r.payload_bytes as u64
            );
        }
        return false;
    }
    true
}
