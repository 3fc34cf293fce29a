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
use pfrag_lab::reps::{self, JobRows};
use pfrag_lab::run::driver_limit;
use pfrag_lab::run::{run_vfio, DeviceModel, DeviceSetup, DmaBackend, Workload};
use pfrag_lab::{cli, report};
use pfrag_lab::{limit, run, IommuMode, Row, RunConfig};
use vfio_nic::model::softnic::Touch;
use vfio_nic::tx::HeaderMode;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The software NIC model (a simulator).
    Soft,
    /// An Intel 82576 bound to vfio-pci (see --device), through the
    /// kernel's IOMMU, mapped through a type1 container.
    Vfio,
    /// The same, opened through its VFIO cdev and mapped through an
    /// iommufd IOAS (a kernel with CONFIG_IOMMUFD).
    Iommufd,
}

impl Backend {
    /// How a real NIC's memory is mapped; `None` for the software NIC.
    fn dma(self) -> Option<DmaBackend> {
        match self {
            Backend::Soft => None,
            Backend::Vfio => Some(DmaBackend::Type1),
            Backend::Iommufd => Some(DmaBackend::Iommufd),
        }
    }
}

/// The NIC whose descriptor format the queue writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Nic {
    /// The Intel 82576's advanced descriptors.
    Igb,
    /// virtio-net's split virtqueue.
    Virtio,
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
#[command(version, allow_negative_numbers = true)]
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
    /// Packets measured per configuration in each repetition,
    /// 1..=1,000,000,000 (default 2,000).
    #[arg(long, value_parser = cli::packets)]
    packets: Option<u64>,
    /// Packets sent before measuring, 0..=1,000,000,000 (default: twice
    /// the ring size).
    #[arg(long, value_parser = cli::warmup)]
    warmup: Option<u64>,
    /// TX ring descriptors: a multiple of 8 in 8..=4096.
    #[arg(long, default_value_t = vfio_nic::tx::Config::DEFAULT_RING, value_parser = cli::ring)]
    ring: u16,
    /// Packets posted per doorbell, 1..=--ring.
    #[arg(long, default_value_t = 8)]
    burst: u64,
    /// IOTLB entries of the software IOMMU.
    #[arg(long, default_value_t = pfrag::dma::SoftIommuConfig::DEFAULT_IOTLB_ENTRIES, value_parser = cli::iotlb_entries)]
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
    /// The NIC format the queue writes: the 82576's (the software NIC or
    /// the null device reads it) or virtio-net's (the virtio-net model on
    /// virtio-queue reads it; --model soft). The `device_model` column
    /// names the model.
    #[arg(long, value_enum, default_value = "igb")]
    nic: Nic,
    /// How much payload the NIC reads: every byte (checksum), or a line per
    /// page (pages).
    #[arg(long, default_value = "checksum")]
    touch: Touch,
    /// The NIC backend.
    #[arg(long, value_enum, default_value = "soft")]
    backend: Backend,
    /// PCI address of the NIC for --backend vfio or iommufd (default
    /// 0000:00:02.0; `vm/run.sh` places the 82576 there and the virtio-net
    /// device at 0000:00:03.0). Refused with --backend soft, which has no
    /// PCI device.
    #[arg(long, value_name = "PCI")]
    device: Option<String>,
    /// No progress bar: a line per repetition instead (also when stderr
    /// is not a terminal).
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
    /// Hysteresis threshold in MiB (half of it goes back at once); only
    /// with --reclaim hysteresis. Default 2.
    #[arg(long)]
    threshold_mib: Option<u64>,
    /// Write all columns as CSV (its header is written before the run).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw Gbit/s and maps/packet against order as SVG (a file other
    /// than the CSV).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Smoke run: 1,000 packets per configuration, 100 warm-up.
    #[arg(long)]
    quick: bool,
    /// Cost model: ns per map or unmap call (each --cost-*-ns takes
    /// 0..=1,000,000).
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
    /// TCP MSS values (bytes per TSO segment, 1..=9000): a list, each a
    /// row of every configuration.
    #[arg(long, value_delimiter = ',', default_value = "1448",
          value_parser = clap::value_parser!(u16).range(1..=9000))]
    mss: Vec<u16>,
    /// Repetitions of every configuration, interleaved round robin; rows
    /// show the median and the spread, ratios their 95 % confidence
    /// interval from 6 on (default 50 on the software backend, 5 on
    /// VFIO; 1 with --quick).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    reps: Option<u32>,
    /// Run the software NIC on its own thread, polling the ring's doorbell
    /// as hardware does (else inline, on the driver's thread).
    #[arg(long)]
    device_thread: bool,
    /// Pace the device thread to this wire rate in Gbit/s, 0.001..=10,000
    /// (frames with their headers, FCS, preamble and gap); needs
    /// --device-thread.
    #[arg(long, value_parser = cli::gbit)]
    line_rate: Option<f64>,
    /// Spin the cost model's time (--cost-*-ns) where hardware would make
    /// a thread wait: the driver for map, unmap and invalidation, the
    /// device for the walk after an IOTLB miss. A model.
    #[arg(long)]
    iommu_latency: bool,
}

impl Args {
    /// The hysteresis threshold in MiB: `--threshold-mib`, else 2.
    fn threshold(&self) -> u64 {
        self.threshold_mib.unwrap_or(2)
    }

    /// The NIC's PCI address for --backend vfio or iommufd: `--device`,
    /// else 0000:00:02.0 (where `vm/run.sh` places the 82576).
    fn device(&self) -> &str {
        self.device.as_deref().unwrap_or("0000:00:02.0")
    }
}

/// One measured unit of a round: a configuration, or a ceiling.
enum Job {
    Run(RunConfig),
    Limit(RunConfig),
    DriverLimit(RunConfig),
}

impl Job {
    fn label(&self) -> String {
        match self {
            Job::Run(c) => format!(
                "order {} {} {} mss {}",
                c.order,
                c.policy.name(),
                c.iommu.name(),
                c.mss
            ),
            Job::Limit(_) => "limit".into(),
            Job::DriverLimit(_) => "driver-limit".into(),
        }
    }
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
        for &mss in &a.mss {
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
                        Reclaim::Hysteresis { .. } => Reclaim::Hysteresis {
                            threshold: a.threshold() << 20,
                            chunk: (a.threshold() << 20) / 2,
                        },
                        other => other,
                    },
                    // (threshold_mib is checked by `cli::mib` before this runs)
                    workload: Workload::Fixed,
                    limits: Limits::UNLIMITED,
                    model: device_model(a),
                    device: device_setup(a),
                    mss,
                });
            }
        }
    }
    out
}

/// The model behind the ring: `--model`, read through `--nic`'s format.
fn device_model(a: &Args) -> DeviceModel {
    match a.nic {
        Nic::Igb => a.model,
        Nic::Virtio => DeviceModel::Virtio,
    }
}

fn main() -> ExitCode {
    let a = Args::parse();
    let (packets, warmup) = if a.quick {
        (a.packets.unwrap_or(1_000), a.warmup.unwrap_or(100))
    } else {
        (
            a.packets.unwrap_or(2_000),
            a.warmup.unwrap_or(2 * u64::from(a.ring)),
        )
    };
    let reps = a.reps.unwrap_or(match (a.quick, a.backend) {
        (true, _) => 1,
        (false, Backend::Soft) => 50,
        (false, Backend::Vfio | Backend::Iommufd) => 5,
    }) as usize;
    if let Err(e) = check_args(&a) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let cfgs = configs(&a, packets, warmup);
    // Each configuration is checked as its backend will run it.
    let check = if a.backend.dma().is_some() {
        run::check_vfio
    } else {
        run::check
    };
    if let Some(e) = cfgs.iter().find_map(|c| check(c).err()) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    // Last, once everything is known to run: a refused command leaves an
    // existing file as it was.
    if let Err(e) = cli::outputs(a.csv.as_deref(), &report::columns(), a.svg.as_deref()) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let on = match a.backend {
        Backend::Soft => "on the software NIC (a simulator)".to_string(),
        Backend::Vfio | Backend::Iommufd => {
            let how = match a.backend {
                Backend::Iommufd => "VFIO's cdev and iommufd",
                _ => "VFIO",
            };
            match a.nic {
                Nic::Igb => format!("on the 82576 at {} through {how}", a.device()),
                Nic::Virtio => format!("on the virtio-net device at {} through {how}", a.device()),
            }
        }
    };
    eprintln!(
        "sweep: {} configurations {on}, {reps} repetitions, {} packets of {} B each, \
         warm-up {} packets per configuration, {} flows",
        cfgs.len(),
        packets,
        a.payload,
        warmup,
        a.flows
    );
    // Each queue warms up on its own; the measured packets are shared.
    let per_run = packets + warmup * a.queues as u64;
    let Some(per_job) = run_all(&a, jobs(&a, cfgs), reps, per_run) else {
        return ExitCode::FAILURE;
    };
    let rows: Vec<Row> = per_job
        .iter()
        .flat_map(|(_, reps)| reps::summaries(reps))
        .collect();
    let mut out = std::io::stdout().lock();
    if report::print_table(&mut out, &rows).is_err() {
        return ExitCode::FAILURE;
    }
    let _ = writeln!(out);
    reps::print_ratios(&mut out, &per_job, &a.orders, &a.mss, a.line_rate.is_some());
    let every: Vec<&Row> = per_job.iter().flat_map(|j| j.1.iter().flatten()).collect();
    // A run that failed leaves the CSV with its header only and the SVG
    // empty: its rows are in the table above, not in files that look
    // complete.
    if !all_sound(&every) || !write_outputs(&a, &rows) {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Where the device runs, as the options say.
fn device_setup(a: &Args) -> DeviceSetup {
    DeviceSetup {
        thread: a.device_thread,
        line_rate_gbit: a.line_rate,
        iommu_latency: a.iommu_latency,
    }
}

/// Settings that do not go together, refused before anything runs.
fn check_args(a: &Args) -> Result<(), String> {
    if a.queues == 0 || (a.queues > 1 && a.backend != Backend::Soft) {
        return Err(
            "--queues must be >= 1, and 1 with --backend vfio or iommufd (one NIC queue is driven)"
                .into(),
        );
    }
    if let Some(f) = a.skew {
        if !(0.0..=1.0).contains(&f) || a.queues < 2 {
            return Err(format!(
                "--skew takes a share in 0..=1 and needs --queues >= 2 (got {f})"
            ));
        }
    }
    device_setup(a).check(a.queues).map_err(|e| e.to_string())?;
    if a.backend != Backend::Soft && (a.device_thread || a.iommu_latency) {
        return Err(
            "--device-thread and --iommu-latency model the software NIC and IOMMU; \
                    they do not apply to --backend vfio or iommufd"
                .into(),
        );
    }
    if let (Some(d), Backend::Soft) = (&a.device, a.backend) {
        return Err(format!(
            "--device {d} is the PCI address of a NIC for --backend vfio or iommufd; \
             --backend soft runs the software NIC, which has none"
        ));
    }
    if a.nic == Nic::Virtio && a.model == DeviceModel::Null {
        return Err(
            "--nic virtio runs the virtio-net model (--backend soft) or a virtio-net device \
             (--backend vfio): it takes --model soft"
                .into(),
        );
    }
    if let Some(t) = a.threshold_mib {
        if !matches!(a.reclaim, Reclaim::Hysteresis { .. }) {
            return Err(format!(
                "--threshold-mib {t} is the hysteresis reclaim's threshold: it needs \
                 --reclaim hysteresis (got --reclaim {})",
                a.reclaim.name()
            ));
        }
    }
    cli::mib("--threshold-mib", a.threshold())?;
    cli::distinct("--policies", &a.policies)?;
    cli::distinct("--iommu", &a.iommu)?;
    cli::distinct("--mss", &a.mss)
}

/// The round: every configuration, then (on the software NIC) the two
/// ceilings with the first configuration's payload and touch.
fn jobs(a: &Args, cfgs: Vec<RunConfig>) -> Vec<Job> {
    let first = cfgs.first().cloned();
    let mut jobs: Vec<Job> = cfgs.into_iter().map(Job::Run).collect();
    if let (Some(c), Backend::Soft) = (first, a.backend) {
        jobs.push(Job::Limit(c.clone()));
        jobs.push(Job::DriverLimit(c));
    }
    jobs
}

/// Runs `reps` rounds of every job with a progress bar over all of them;
/// `None` after reporting an error.
fn run_all(a: &Args, jobs: Vec<Job>, reps: usize, per_cfg: u64) -> Option<Vec<JobRows>> {
    let runs = jobs.iter().filter(|j| matches!(j, Job::Run(_))).count();
    let plain = cli::plain_progress(a.no_progress);
    let bar = if plain {
        ProgressBar::hidden()
    } else {
        ProgressBar::new((reps * runs) as u64 * per_cfg)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} packets  {msg}  [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut out: Vec<JobRows> = jobs.iter().map(|j| (j.label(), Vec::new())).collect();
    for rep in 0..reps {
        for (i, job) in jobs.iter().enumerate() {
            let what = format!("repetition {}/{reps}: {}", rep + 1, job.label());
            bar.set_message(what.clone());
            if plain {
                eprintln!("sweep: {what}");
            }
            let r = match job {
                Job::Run(c) => match a.backend.dma() {
                    None => run(c, &mut |n| bar.inc(n)),
                    Some(dma) => {
                        let window = (rep * jobs.len() + i) as u32;
                        run_vfio(c, a.device(), dma, window, &mut |n| bar.inc(n)).map(|r| vec![r])
                    }
                },
                Job::Limit(c) => Ok(vec![limit(c)]),
                Job::DriverLimit(c) => Ok(vec![driver_limit(c)]),
            };
            match r {
                Ok(rows) => out[i].1.push(rows),
                Err(e) => {
                    bar.abandon();
                    eprintln!("error: {what}: {e}");
                    return None;
                }
            }
        }
    }
    bar.finish_and_clear();
    Some(out)
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

/// Whether every row of every repetition is sound ([`Row::problems`]: no
/// fault, one pressure hook call per transition, and, where the device
/// read every byte, every payload byte sent verified), each error said.
fn all_sound(rows: &[&Row]) -> bool {
    let mut ok = true;
    for r in rows {
        for why in r.problems() {
            eprintln!("error: order {} {} {}: {why}", r.order, r.policy, r.iommu);
            ok = false;
        }
    }
    ok
}

#[cfg(test)]
mod tests;
