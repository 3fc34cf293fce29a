//! One configuration, measured: build the IOMMU, pool, TX queue and software
//! NIC, warm up, then time `packets` packets and turn counter differences
//! into per-packet figures.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pfrag::account::{CountHooks, Limits, MemAccount};
use pfrag::dma::{
    CostModel, DmaMapper, Domain, Identity, Invalidation, SoftIommu, SoftIommuConfig, Translate,
};
use pfrag::pool::{self, Policy, Pool, Reclaim};
use pfrag::Order;
use vfio_nic::csum::Csum;
use vfio_nic::device::{Model, TxDevice};
use vfio_nic::gen::pattern;
use vfio_nic::gen::Traffic;
use vfio_nic::hw::igb::{Igb, IgbConfig};
use vfio_nic::hw::vfio::{VfioMapper, VfioPci};
use vfio_nic::model::null::NullNic;
use vfio_nic::model::softnic::{self, SoftNic, Touch};
use vfio_nic::tx::{self, HeaderMode};

/// The IOMMU under the software NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IommuMode {
    /// No IOMMU (identity mapping).
    Off,
    /// Software IOMMU, strict invalidation.
    Strict,
    /// Software IOMMU, lazy invalidation (flush queue).
    Lazy,
}

impl IommuMode {
    /// The lab's name for it.
    pub fn name(self) -> &'static str {
        match self {
            IommuMode::Off => "off",
            IommuMode::Strict => "strict",
            IommuMode::Lazy => "lazy",
        }
    }
}

/// Everything that defines one measured configuration.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Chunk order.
    pub order: u32,
    /// Mapping policy.
    pub policy: Policy,
    /// IOMMU mode.
    pub iommu: IommuMode,
    /// Header placement.
    pub header: HeaderMode,
    /// Fit each payload whole in one chunk.
    pub fit_whole: bool,
    /// Payload bytes per packet.
    pub payload: usize,
    /// Flows, round robin.
    pub flows: usize,
    /// Packets measured.
    pub packets: u64,
    /// Packets sent before measuring.
    pub warmup: u64,
    /// TX ring descriptors.
    pub ring: u16,
    /// Packets posted per doorbell.
    pub burst: u64,
    /// IOTLB entries of the software IOMMU.
    pub iotlb_entries: usize,
    /// Back the pool with 2 MiB huge pages (and map superpages).
    pub hugepages: bool,
    /// How much payload the NIC reads.
    pub touch: Touch,
    /// Cost model for modelled IOMMU time.
    pub cost: CostModel,
    /// TX queues, one thread each, sharing one pool and one mapper.
    pub queues: usize,
    /// Share of the packets queue 0 sends (the rest split evenly); `None`
    /// splits evenly.
    pub skew: Option<f64>,
    /// How freed chunks return to the shared pool.
    pub reclaim: Reclaim,
    /// What each packet looks like.
    pub workload: Workload,
    /// Process-wide memory limits of the pool's account (`Limits::UNLIMITED`
    /// to only measure).
    pub limits: Limits,
    /// The device model behind the ring.
    pub model: DeviceModel,
}

/// Which device model consumes the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceModel {
    /// The software NIC: reads, verifies and checksums every payload byte
    /// (or a line per page with `Touch::Pages`), segments TSO.
    Soft,
    /// The null device: translates every buffer page and completes, reading
    /// no payload: the driver's own cost.
    Null,
}

impl DeviceModel {
    /// The lab's name for it.
    pub fn name(self) -> &'static str {
        match self {
            DeviceModel::Soft => "soft",
            DeviceModel::Null => "null",
        }
    }
}

/// Packet sizes and flows of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Every packet `payload` bytes, flows round robin.
    Fixed,
    /// tbench-like: many small sends, sizes uniform in `min..=max` bytes,
    /// flows picked at random (deterministic per queue).
    Small {
        /// Smallest send.
        min: usize,
        /// Largest send.
        max: usize,
    },
}

/// A deterministic xorshift stream per queue.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

impl Workload {
    /// Flow and payload of packet `i`.
    fn packet(&self, cfg: &RunConfig, i: u64, rng: &mut Rng) -> (usize, usize) {
        match *self {
            Workload::Fixed => ((i % cfg.flows as u64) as usize, cfg.payload),
            Workload::Small { min, max } => {
                let r = rng.next();
                let span = (max - min + 1) as u64;
                (
                    (r >> 32) as usize % cfg.flows,
                    min + ((r & 0xffff_ffff) % span) as usize,
                )
            }
        }
    }
}

/// One result row. Field names are the CSV column names.
#[derive(Clone, Debug, Default)]
pub struct Row {
    /// `soft` (software NIC) or `vfio`.
    pub backend: String,
    /// Chunk order (empty for the limit row).
    pub order: String,
    /// Mapping policy, or `limit`.
    pub policy: String,
    /// `off`, `strict` or `lazy`.
    pub iommu: String,
    /// `bounce` or `mapped`.
    pub header: String,
    /// Flows, round robin.
    pub flows: usize,
    /// Packets measured (after the warm-up).
    pub packets: u64,
    /// Payload bytes per packet.
    pub payload_bytes: usize,
    /// Map calls per packet (a batch is one call). Empty where the row
    /// cannot measure it (per-queue rows share one mapper; the limit row
    /// has none).
    pub maps_per_pkt: Option<f64>,
    /// Unmap calls per packet.
    pub unmaps_per_pkt: Option<f64>,
    /// Page-table entries written per packet.
    pub map_pages_per_pkt: Option<f64>,
    /// IOTLB invalidation operations per packet.
    pub invalidations_per_pkt: Option<f64>,
    /// NIC translations that missed the IOTLB, per packet.
    pub iotlb_misses_per_pkt: Option<f64>,
    /// Distinct 4 KiB pages the NIC read per packet.
    pub pages_per_pkt: Option<f64>,
    /// Descriptors per packet.
    pub descs_per_pkt: f64,
    /// Chunk bytes skipped (tails, alignment) per packet.
    pub waste_bytes_per_pkt: f64,
    /// Measured wall time per packet (driver + NIC model).
    pub ns_per_pkt: f64,
    /// Payload bits the device delivered intact per ns of measured time
    /// (never bits merely posted).
    pub gbit_s: f64,
    /// Modelled IOMMU time per packet (cost model; not in `ns_per_pkt`).
    pub model_iommu_ns_per_pkt: Option<f64>,
    /// Packets dropped by DMA faults or found corrupt in the measured part
    /// (the warm-up is checked separately: a run whose warm-up faults
    /// fails).
    pub faults: u64,
    /// Payload bytes the NIC read and matched, measured part.
    pub bytes_verified: u64,
    /// Whether payloads were fitted whole into chunks.
    pub fit_whole: bool,
    /// Pool memory mapped for DMA at the end.
    pub pool_bytes: u64,
    /// Packets sent before measuring.
    pub warmup: u64,
    /// `checksum` or `pages`.
    pub touch: String,
    /// `small`, `huge` or `huge-fallback`.
    pub backing: String,
    /// Queues in the run.
    pub queues: usize,
    /// `all`, or the queue this row is about.
    pub queue: String,
    /// `eager` or `hysteresis`.
    pub reclaim: String,
    /// Chunks borrowed from neighbour queues, per packet.
    pub borrows_per_pkt: f64,
    /// Neighbours skipped as under pressure while borrowing, per packet.
    pub skipped_pressured_per_pkt: f64,
    /// Returns of memory from a queue to the shared pool, per packet.
    pub reclaim_calls_per_pkt: f64,
    /// Pushes and pops on the shared free list, per packet.
    pub shared_pool_ops_per_pkt: f64,
    /// Calls of the memory-pressure hooks (whole run).
    pub pressure_hook_calls: u64,
    /// Memory-pressure transitions of the account (whole run).
    pub pressure_transitions: u64,
    /// Most pool memory in use at once (whole run).
    pub peak_bytes: u64,
    /// IOTLB entries of the software IOMMU (empty without one).
    pub iotlb_entries: Option<usize>,
    /// The device behind the ring: `soft`, `null` or `igb`.
    pub device_model: String,
}

/// Failures of a run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The NIC side failed.
    #[error(transparent)]
    Nic(#[from] vfio_nic::Error),
    /// The pool side failed.
    #[error(transparent)]
    Pool(#[from] pfrag::Error),
    /// A setting is out of range.
    #[error("invalid setting: {0}")]
    Setting(String),
}

fn header_name(h: HeaderMode) -> &'static str {
    match h {
        HeaderMode::Bounce(_) => "bounce",
        HeaderMode::Mapped => "mapped",
    }
}

fn touch_name(t: Touch) -> &'static str {
    match t {
        Touch::Checksum => "checksum",
        Touch::Pages => "pages",
    }
}

/// Settings every backend needs in range.
fn check(cfg: &RunConfig) -> Result<(), RunError> {
    Order::new(cfg.order)?;
    if cfg.payload > vfio_nic::desc::MAX_PAYLEN {
        return Err(RunError::Setting(format!(
            "payload {} is more than one packet carries (1..={}: the 82576's PAYLEN is 18 bits)",
            cfg.payload,
            vfio_nic::desc::MAX_PAYLEN
        )));
    }
    if cfg.payload == 0 || cfg.packets == 0 || cfg.burst == 0 {
        return Err(RunError::Setting(format!(
            "payload {}, packets {} and burst {} must be > 0",
            cfg.payload, cfg.packets, cfg.burst
        )));
    }
    Ok(())
}

/// Runs `cfg` on the software NIC, one thread per queue. Returns the total
/// row first, then (with more than one queue) one row per queue. `tick` is
/// called with packet counts as they are sent (for progress).
pub fn run(cfg: &RunConfig, tick: &mut dyn FnMut(u64)) -> Result<Vec<Row>, RunError> {
    check(cfg)?;
    if cfg.queues == 0 || (cfg.packets as usize) < cfg.queues {
        return Err(RunError::Setting(format!(
            "queues {} must be >= 1 and <= packets {}",
            cfg.queues, cfg.packets
        )));
    }
    if let Workload::Small { min, max } = cfg.workload {
        if min == 0 || min > max {
            return Err(RunError::Setting(format!(
                "send sizes {min}..={max} are not a range of positive sizes"
            )));
        }
    }
    match cfg.iommu {
        IommuMode::Off => measure(cfg, Arc::new(Identity::new()), tick),
        mode => {
            let m = SoftIommu::new(SoftIommuConfig {
                iotlb_entries: cfg.iotlb_entries,
                invalidation: if mode == IommuMode::Lazy {
                    Invalidation::Lazy
                } else {
                    Invalidation::Strict
                },
                superpages: cfg.hugepages,
                cost: Some(cfg.cost),
                ..SoftIommuConfig::default()
            })?;
            measure(cfg, Arc::new(m), tick)
        }
    }
}

/// The TCP MSS of the generated traffic (a 1500-byte MTU).
pub const MSS: u16 = 1448;

/// How long a queue may go without completing anything before the run
/// fails (a stuck device), instead of waiting forever.
const STALL: Duration = Duration::from_secs(10);

fn pump<M: DmaMapper, D: TxDevice>(
    q: &mut tx::Queue<M, D>,
    gen: &mut Traffic<M>,
    cfg: &RunConfig,
    n: u64,
    rng: &mut Rng,
    tick: &mut dyn FnMut(u64),
) -> Result<u64, RunError> {
    let mut since_tick = 0;
    let mut bytes = 0u64;
    for i in 0..n {
        let (flow, len) = cfg.workload.packet(cfg, i, rng);
        bytes += len as u64;
        let mut full_since: Option<Instant> = None;
        loop {
            match gen.send(q, flow, len) {
                Ok(()) => break,
                Err(e) if e.is_backoff() => {
                    q.kick()?;
                    if q.reap()? > 0 {
                        full_since = None;
                        continue;
                    }
                    if q.in_flight() == 0 {
                        return Err(match e {
                            vfio_nic::Error::RingFull { .. } => RunError::Setting(format!(
                                "a {len}-byte packet cannot fit a {}-descriptor ring",
                                cfg.ring
                            )),
                            other => other.into(),
                        });
                    }
                    let t = *full_since.get_or_insert_with(Instant::now);
                    if t.elapsed() > STALL {
                        q.wait(Duration::ZERO)?;
                    }
                    std::hint::spin_loop();
                }
                Err(e) => return Err(e.into()),
            }
        }
        if (i + 1) % cfg.burst == 0 {
            q.kick()?;
        }
        since_tick += 1;
        if since_tick == 256 {
            tick(since_tick);
            since_tick = 0;
        }
    }
    q.kick()?;
    q.wait(STALL)?;
    tick(since_tick);
    Ok(bytes)
}

/// Packets queue `i` of `n` sends out of `total`.
fn share(total: u64, n: usize, i: usize, skew: Option<f64>) -> u64 {
    let n64 = n as u64;
    match skew {
        Some(f) if n > 1 => {
            let first = ((total as f64) * f.clamp(0.0, 1.0)).round() as u64;
            let rest = total - first.min(total);
            if i == 0 {
                first.min(total)
            } else {
                rest / (n64 - 1) + u64::from(((i - 1) as u64) < rest % (n64 - 1))
            }
        }
        _ => total / n64 + u64::from((i as u64) < total % n64),
    }
}

/// One queue's figures over the measured part.
struct QueueRun {
    packets: u64,
    bytes: u64,
    descs: u64,
    waste: u64,
    nic: vfio_nic::model::softnic::NicStats,
    faults: u64,
    start: Instant,
    end: Instant,
}

impl QueueRun {
    /// Wall time of its measured part.
    fn ns(&self) -> f64 {
        (self.end - self.start).as_nanos() as f64
    }
}

/// Runs `cfg` on the device model it names.
fn measure<M: DmaMapper + Translate + 'static>(
    cfg: &RunConfig,
    mapper: Arc<M>,
    tick: &mut dyn FnMut(u64),
) -> Result<Vec<Row>, RunError> {
    match cfg.model {
        DeviceModel::Soft => {
            let nic = |m: Arc<M>| {
                SoftNic::new(
                    m,
                    softnic::Config {
                        touch: cfg.touch,
                        capture: false,
                        verify: true,
                    },
                )
            };
            measure_on(cfg, mapper, &nic, tick)
        }
        DeviceModel::Null => measure_on(cfg, mapper, &NullNic::new, tick),
    }
}

fn measure_on<M: DmaMapper + Translate + 'static, D: Model>(
    cfg: &RunConfig,
    mapper: Arc<M>,
    make_nic: &(dyn Fn(Arc<M>) -> D + Sync),
    tick: &mut dyn FnMut(u64),
) -> Result<Vec<Row>, RunError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Barrier;

    let queues = cfg.queues.max(1);
    let domain = Arc::new(Domain::new(mapper.clone()));
    let mut pcfg = pool::Config::new(Order::new(cfg.order)?, cfg.policy);
    pcfg.hugepages = cfg.hugepages;
    pcfg.queues = queues;
    pcfg.reclaim = cfg.reclaim;
    let account = MemAccount::new(cfg.limits, CountHooks::default())?;
    let pool = Pool::with_account(domain.clone(), pcfg, account.clone())?;
    let progress = AtomicU64::new(0);
    // Phases: all warmed up (main snapshots the counters), go, all done
    // (main snapshots again before any queue is dropped, since dropping
    // unmaps its ring), release.
    let warmed = Barrier::new(queues + 1);
    let go = Barrier::new(queues + 1);
    let done = Barrier::new(queues + 1);
    let release = Barrier::new(queues + 1);
    let finished = std::sync::atomic::AtomicUsize::new(0);

    let one = |i: usize| -> Result<QueueRun, RunError> {
        let nic = make_nic(mapper.clone());
        let tx = tx::Config {
            ring: cfg.ring,
            header: cfg.header,
            fit_whole: cfg.fit_whole,
            queue: i,
            ..tx::Config::default()
        };
        let mut tick = |n| {
            progress.fetch_add(n, Ordering::Relaxed);
        };
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1));
        let setup = tx::Queue::new(domain.clone(), pool.clone(), nic, tx)
            .and_then(|q| Ok((q, Traffic::new(cfg.flows, MSS)?)))
            .map_err(RunError::from)
            .and_then(|(mut q, mut g)| {
                pump(&mut q, &mut g, cfg, cfg.warmup, &mut rng, &mut tick).map(|_| (q, g))
            });
        // Every thread passes every barrier, even after an error, so that
        // none waits forever.
        warmed.wait();
        go.wait();
        let t0 = Instant::now();
        let measured = setup.and_then(|(mut q, mut g)| {
            let snap = (q.device().counters(), q.stats(), q.cache().stats());
            let packets = share(cfg.packets, queues, i, cfg.skew);
            let bytes = pump(&mut q, &mut g, cfg, packets, &mut rng, &mut tick)?;
            Ok((q, snap, packets, bytes, Instant::now()))
        });
        finished.fetch_add(1, Ordering::Release);
        done.wait();
        release.wait();
        let (q, (n0, q0, c0), packets, bytes, end) = measured?;
        let (n, qs, cs) = (q.device().counters(), q.stats(), q.cache().stats());
        Ok(QueueRun {
            packets,
            bytes,
            descs: qs.descs - q0.descs,
            waste: cs.waste_bytes - c0.waste_bytes,
            faults: (n.faults + n.bad_payload + n.bad_desc)
                - (n0.faults + n0.bad_payload + n0.bad_desc),
            nic: n.since(&n0),
            start: t0,
            end,
        })
    };

    let (runs, m, pool0, pool1, qdelta) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..queues).map(|i| s.spawn(move || one(i))).collect();
        let mut seen = 0;
        let mut poll = |seen: &mut u64| {
            let now = progress.load(Ordering::Relaxed);
            tick(now - *seen);
            *seen = now;
        };
        let qstats = || -> Vec<pfrag::pool::QueueStats> {
            (0..queues)
                .map(|i| pool.queue_stats(i).unwrap_or_default())
                .collect()
        };
        warmed.wait();
        let (m0, pool0, q0) = (mapper.stats(), pool.stats(), qstats());
        go.wait();
        while finished.load(Ordering::Acquire) < queues {
            std::thread::sleep(Duration::from_millis(20));
            poll(&mut seen);
        }
        done.wait();
        let (m, pool1, q1) = (mapper.stats().since(&m0), pool.stats(), qstats());
        release.wait();
        poll(&mut seen);
        let runs: Vec<Result<QueueRun, RunError>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(RunError::Setting("a queue thread panicked".into())))
            })
            .collect();
        let qdelta: Vec<pfrag::pool::QueueStats> =
            q0.iter().zip(&q1).map(|(a, b)| b.since(a)).collect();
        (runs, m, pool0, pool1, qdelta)
    });
    let runs = runs.into_iter().collect::<Result<Vec<_>, _>>()?;
    // The total's measured part: first start to last end.
    let now = Instant::now();
    let start = runs.iter().map(|r| r.start).min().unwrap_or(now);
    let end = runs.iter().map(|r| r.end).max().unwrap_or(now);

    let total = QueueRun {
        packets: runs.iter().map(|r| r.packets).sum(),
        bytes: runs.iter().map(|r| r.bytes).sum(),
        descs: runs.iter().map(|r| r.descs).sum(),
        waste: runs.iter().map(|r| r.waste).sum(),
        faults: runs.iter().map(|r| r.faults).sum(),
        nic: runs
            .iter()
            .fold(vfio_nic::model::softnic::NicStats::default(), |a, r| {
                a.plus(&r.nic)
            }),
        start,
        end,
    };
    let row = |r: &QueueRun, queue: Option<usize>| -> Row {
        let p = r.packets.max(1) as f64;
        let (map, pool_delta) = match queue {
            None => (m, pool1.since(&pool0)),
            Some(_) => (
                pfrag::dma::MapStats::default(),
                pfrag::pool::Stats::default(),
            ),
        };
        let common = Measured {
            map,
            packets: r.packets,
            bytes: r.bytes,
            delivered: r.nic.delivered_bytes,
            descs: r.descs,
            waste: r.waste,
            ns: r.ns(),
            pool: pool1,
            delta: pool_delta,
        };
        let mut row = Row {
            iotlb_misses_per_pkt: Some(map.iotlb_misses as f64 / p),
            pages_per_pkt: Some(r.nic.pages as f64 / r.nic.packets.max(1) as f64),
            model_iommu_ns_per_pkt: Some(map.model_ns / p),
            faults: r.faults,
            bytes_verified: r.nic.bytes_verified,
            touch: touch_name(cfg.touch).into(),
            ..common.row("soft", cfg)
        };
        if let Some(i) = queue {
            // The mapper is shared by all queues: its counters belong to
            // the total row only.
            row.maps_per_pkt = None;
            row.unmaps_per_pkt = None;
            row.map_pages_per_pkt = None;
            row.invalidations_per_pkt = None;
            row.iotlb_misses_per_pkt = None;
            row.model_iommu_ns_per_pkt = None;
            let qs = qdelta[i];
            row.queue = i.to_string();
            row.borrows_per_pkt = qs.borrows as f64 / p;
            row.skipped_pressured_per_pkt = qs.skipped_pressured as f64 / p;
            row.reclaim_calls_per_pkt = qs.reclaim_calls as f64 / p;
            row.shared_pool_ops_per_pkt = qs.shared_ops as f64 / p;
        }
        row
    };
    let acct = account.stats();
    let mut top = row(&total, None);
    top.pressure_hook_calls = account.hooks().calls();
    top.pressure_transitions = acct.entered + acct.left;
    top.peak_bytes = acct.peak;
    let mut rows = vec![top];
    if queues > 1 {
        for (i, r) in runs.iter().enumerate() {
            rows.push(row(r, Some(i)));
        }
    }
    Ok(rows)
}

/// What both backends measure over a run's measured part.
struct Measured {
    map: pfrag::dma::MapStats,
    /// Packets measured.
    packets: u64,
    /// Payload bytes of those packets.
    bytes: u64,
    /// Payload bytes the device delivered intact.
    delivered: u64,
    descs: u64,
    waste: u64,
    ns: f64,
    /// Pool counters at the end.
    pool: pfrag::pool::Stats,
    /// Pool counters over the measured part.
    delta: pfrag::pool::Stats,
}

impl Measured {
    /// The row's columns common to both backends.
    fn row(&self, backend: &str, cfg: &RunConfig) -> Row {
        let p = self.packets.max(1) as f64;
        let m = &self.map;
        Row {
            backend: backend.into(),
            order: cfg.order.to_string(),
            policy: cfg.policy.name().into(),
            iommu: cfg.iommu.name().into(),
            header: header_name(cfg.header).into(),
            flows: cfg.flows,
            packets: self.packets,
            payload_bytes: (self.bytes / self.packets.max(1)) as usize,
            maps_per_pkt: Some(m.map_calls as f64 / p),
            unmaps_per_pkt: Some(m.unmap_calls as f64 / p),
            map_pages_per_pkt: Some(m.ptes_written as f64 / p),
            invalidations_per_pkt: Some(m.invalidations as f64 / p),
            descs_per_pkt: self.descs as f64 / p,
            waste_bytes_per_pkt: self.waste as f64 / p,
            ns_per_pkt: self.ns / p,
            gbit_s: self.delivered as f64 * 8.0 / self.ns.max(1.0),
            fit_whole: cfg.fit_whole,
            pool_bytes: self.pool.mapped_bytes,
            warmup: cfg.warmup,
            backing: backing_name(cfg.hugepages, self.pool.huge_fallbacks).into(),
            queues: cfg.queues.max(1),
            queue: "all".into(),
            reclaim: cfg.reclaim.name().into(),
            iotlb_entries: (cfg.iommu != IommuMode::Off).then_some(cfg.iotlb_entries),
            device_model: cfg.model.name().into(),
            borrows_per_pkt: self.delta.borrows as f64 / p,
            skipped_pressured_per_pkt: self.delta.skipped_pressured as f64 / p,
            reclaim_calls_per_pkt: self.delta.reclaim_calls as f64 / p,
            shared_pool_ops_per_pkt: self.delta.shared_ops as f64 / p,
            ..Row::default()
        }
    }
}

/// Runs `cfg` on the Intel 82576 at PCI address `bdf` through VFIO (the
/// kernel's type1 IOMMU driver, strict by construction: each unmap ioctl
/// ends with its IOTLB invalidation). Data buffers are split at 4 KiB, as
/// QEMU's emulated 82576 needs behind an emulated IOMMU.
///
/// The measured part is framed by two [`Igb::mark`] writes carrying
/// `crate::vm::MARK_MAGIC | window << 1` and `| 1`, so that the IOMMU events
/// of an emulator's trace can be counted per row. Payload bytes are not
/// read back here (`bytes_verified` is 0): the frames are checked where
/// they are captured.
pub fn run_vfio(
    cfg: &RunConfig,
    bdf: &str,
    window: u32,
    tick: &mut dyn FnMut(u64),
) -> Result<Row, RunError> {
    check(cfg)?;
    if cfg.iommu != IommuMode::Strict {
        return Err(RunError::Setting(format!(
            "VFIO runs under the kernel's type1 IOMMU driver, which unmaps strictly; iommu {} is not available",
            cfg.iommu.name()
        )));
    }
    if cfg.payload == 0 || cfg.packets == 0 || cfg.burst == 0 {
        return Err(RunError::Setting(format!(
            "payload {}, packets {} and burst {} must be > 0",
            cfg.payload, cfg.packets, cfg.burst
        )));
    }
    let pci = VfioPci::open(bdf)?;
    let mapper = Arc::new(VfioMapper::new(&pci)?);
    let nic = Igb::new(pci, IgbConfig::default())?;
    let domain = Arc::new(Domain::new(mapper.clone()));
    let mut pcfg = pool::Config::new(Order::new(cfg.order)?, cfg.policy);
    pcfg.hugepages = cfg.hugepages;
    pcfg.reclaim = cfg.reclaim;
    let pool = Pool::new(domain.clone(), pcfg)?;
    let tx = tx::Config {
        ring: cfg.ring,
        header: cfg.header,
        fit_whole: cfg.fit_whole,
        boundary: Some(pfrag::PAGE_SIZE as usize),
        ..tx::Config::default()
    };
    let mut q = tx::Queue::new(domain, pool.clone(), nic, tx)?;
    let mut gen = Traffic::new(cfg.flows, MSS)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    pump(&mut q, &mut gen, cfg, cfg.warmup, &mut rng, tick)?;

    let magic = crate::vm::MARK_MAGIC | (window & 0x7f_ffff) << 1;
    let (m0, q0, c0, pool0) = (mapper.stats(), q.stats(), q.cache().stats(), pool.stats());
    let g0 = q.device_mut().stats()?.good_packets;
    q.device().mark(magic)?;
    let t0 = Instant::now();
    let bytes = pump(&mut q, &mut gen, cfg, cfg.packets, &mut rng, tick)?;
    let ns = t0.elapsed().as_nanos() as f64;
    q.device().mark(magic | 1)?;
    let m = mapper.stats().since(&m0);
    let (qs, cs) = (q.stats(), q.cache().stats());
    let sent = q.device_mut().stats()?.good_packets - g0;
    let pool1 = pool.stats();
    // The device counts packets it sent whole; the frames themselves are
    // checked where they are captured.
    let delivered = sent.min(cfg.packets) * (bytes / cfg.packets.max(1));
    let common = Measured {
        map: m,
        packets: cfg.packets,
        bytes,
        delivered,
        descs: qs.descs - q0.descs,
        waste: cs.waste_bytes - c0.waste_bytes,
        ns,
        pool: pool1,
        delta: pool1.since(&pool0),
    };
    Ok(Row {
        // Packets the device did not count as sent (the 82576 counts each
        // TSO segment, QEMU's model each packet once: both reach `packets`).
        faults: cfg.packets.saturating_sub(sent),
        touch: "wire".into(),
        // The IOTLB and the pages the device read are out of sight here
        // (QEMU's trace gives them to `vm/run.sh sweep`).
        iotlb_misses_per_pkt: None,
        pages_per_pkt: None,
        model_iommu_ns_per_pkt: None,
        iotlb_entries: None,
        device_model: "igb".into(),
        ..common.row("vfio", cfg)
    })
}

fn backing_name(hugepages: bool, fallbacks: u64) -> &'static str {
    if !hugepages {
        "small"
    } else if fallbacks > 0 {
        "huge-fallback"
    } else {
        "huge"
    }
}

/// The ceiling: the NIC's own work (read, verify and checksum each MSS
/// segment of the payload) on one plain preallocated buffer, with no driver,
/// pool or IOMMU.
pub fn limit(cfg: &RunConfig) -> Row {
    let mut buf = vec![0u8; cfg.payload];
    pattern::fill(0, 0, &mut buf);
    let mss = 1448;
    let t0 = Instant::now();
    let mut verified = 0u64;
    for _ in 0..cfg.packets {
        let b = black_box(&buf[..]);
        match cfg.touch {
            Touch::Checksum => {
                for (k, seg) in b.chunks(mss).enumerate() {
                    let mut c = Csum::new();
                    if pattern::verify(0, (k * mss) as u32, seg) {
                        verified += seg.len() as u64;
                    }
                    c.add(seg);
                    black_box(c.finish());
                }
            }
            Touch::Pages => {
                for (k, page) in b.chunks(4096).enumerate() {
                    let line = &page[..page.len().min(64)];
                    if pattern::verify(0, (k * 4096) as u32, line) {
                        verified += line.len() as u64;
                    }
                }
            }
        }
    }
    let ns = t0.elapsed().as_nanos() as f64;
    let p = cfg.packets as f64;
    Row {
        backend: "soft".into(),
        order: String::new(),
        policy: "limit".into(),
        iommu: "none".into(),
        header: "none".into(),
        flows: 1,
        packets: cfg.packets,
        payload_bytes: cfg.payload,
        ns_per_pkt: ns / p,
        gbit_s: cfg.payload as f64 * 8.0 * p / ns,
        bytes_verified: verified,
        touch: touch_name(cfg.touch).into(),
        backing: "small".into(),
        queues: 1,
        queue: "all".into(),
        ..Row::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Defect 10: a row's Gbit/s counts bytes the device delivered intact,
    /// never bytes posted: a run whose packets all faulted shows 0.
    #[test]
    fn gbit_s_counts_delivered_bytes_only() {
        let cfg = RunConfig {
            order: 4,
            policy: Policy::Persistent,
            iommu: IommuMode::Strict,
            header: HeaderMode::Mapped,
            fit_whole: true,
            payload: 1000,
            flows: 1,
            packets: 10,
            warmup: 0,
            ring: 64,
            burst: 1,
            iotlb_entries: 128,
            hugepages: false,
            touch: Touch::Checksum,
            cost: CostModel::default(),
            queues: 1,
            skew: None,
            reclaim: Reclaim::Eager,
            workload: Workload::Fixed,
            limits: Limits::UNLIMITED,
            model: DeviceModel::Soft,
        };
        let m = |delivered| Measured {
            map: pfrag::dma::MapStats::default(),
            packets: 10,
            bytes: 10_000,
            delivered,
            descs: 30,
            waste: 0,
            ns: 1000.0,
            pool: pfrag::pool::Stats::default(),
            delta: pfrag::pool::Stats::default(),
        };
        assert_eq!(m(0).row("soft", &cfg).gbit_s, 0.0);
        assert_eq!(m(5_000).row("soft", &cfg).gbit_s, 40.0);
    }
}
