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

impl std::fmt::Display for IommuMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for IommuMode {
    type Err = String;
    /// `off`, `strict` or `lazy`.
    fn from_str(s: &str) -> Result<IommuMode, String> {
        [IommuMode::Off, IommuMode::Strict, IommuMode::Lazy]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("'{s}' is not an IOMMU mode (off, strict, lazy)"))
    }
}

impl std::fmt::Display for DeviceModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DeviceModel {
    type Err = String;
    /// `soft` or `null`.
    fn from_str(s: &str) -> Result<DeviceModel, String> {
        match s {
            "soft" => Ok(DeviceModel::Soft),
            "null" => Ok(DeviceModel::Null),
            _ => Err(format!("'{s}' is not a device model (soft, null)")),
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

impl RunConfig {
    /// The pool's settings: one pool for all the run's queues. The one
    /// place a run's pool is configured.
    fn pool_config(&self) -> Result<pool::Config, RunError> {
        let mut p = pool::Config::new(Order::new(self.order)?, self.policy);
        p.hugepages = self.hugepages;
        p.queues = self.queues.max(1);
        p.reclaim = self.reclaim;
        Ok(p)
    }

    /// The settings of TX queue `queue`, with data descriptors split at
    /// `boundary` if given. The one place a run's queues are configured.
    fn tx_config(&self, queue: usize, boundary: Option<usize>) -> tx::Config {
        tx::Config {
            ring: self.ring,
            header: self.header,
            fit_whole: self.fit_whole,
            queue,
            boundary,
            ..tx::Config::default()
        }
    }
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

/// One result row: the one definition of the CSV schema (field names are
/// the column names, in order; see [`crate::report::columns`]).
#[derive(Clone, Debug, Default, serde::Serialize)]
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
    /// A queue's thread panicked (a bug, not a setting).
    #[error("the thread of queue {queue} panicked")]
    Panicked {
        /// The queue.
        queue: usize,
    },
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

fn backing_name(hugepages: bool, fallbacks: u64) -> &'static str {
    if !hugepages {
        "small"
    } else if fallbacks > 0 {
        "huge-fallback"
    } else {
        "huge"
    }
}

mod limit;
mod soft;
mod vfio;

pub use limit::limit;
pub use soft::run;
pub use vfio::run_vfio;

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
