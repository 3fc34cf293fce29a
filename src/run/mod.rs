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
use vfio_nic::device::TxDevice;
use vfio_nic::gen::flow::HDR_LEN;
use vfio_nic::gen::pattern;
use vfio_nic::gen::Traffic;
use vfio_nic::hw::igb::{Igb, IgbConfig};
use vfio_nic::hw::vfio::{VfioMapper, VfioPci};
use vfio_nic::model::null::NullNic;
use vfio_nic::model::softnic::{self, NicStats, SoftNic, Touch};
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use vfio_nic::tx::{self, HeaderMode};

use crate::timed::{thread_cpu_ns, DeviceTime, Timed};

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
    /// `soft`, `null` or `virtio`.
    fn from_str(s: &str) -> Result<DeviceModel, String> {
        match s {
            "soft" => Ok(DeviceModel::Soft),
            "null" => Ok(DeviceModel::Null),
            "virtio" => Ok(DeviceModel::Virtio),
            _ => Err(format!("'{s}' is not a device model (soft, null, virtio)")),
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
    /// Packets posted per doorbell, 1..=`ring` ([`check`] refuses more).
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
    /// Where the device model runs and how fast the IOMMU answers.
    pub device: DeviceSetup,
    /// TCP MSS of the generated traffic: TSO cuts each payload into
    /// segments of this many bytes.
    pub mss: u16,
}

/// Where a run's device model runs, at what wire rate, and whether the
/// IOMMU's modelled latency is spun.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceSetup {
    /// Run the model on its own thread, polling the doorbell (else inline,
    /// on the driver's thread, at each doorbell).
    pub thread: bool,
    /// Pace the device thread to this wire rate in Gbit/s.
    pub line_rate_gbit: Option<f64>,
    /// Spin the cost model's time where the hardware would make a thread
    /// wait (`SoftIommuConfig::inject`).
    pub iommu_latency: bool,
}

impl DeviceSetup {
    /// Checks the setup for a run of `queues` queues: a line rate paces
    /// the device thread of one queue (one wire), and lies in
    /// [`cli::LINE_RATE_GBIT`](crate::cli::LINE_RATE_GBIT).
    pub fn check(&self, queues: usize) -> Result<(), RunError> {
        match self.line_rate_gbit {
            Some(_) if !self.thread || queues > 1 => Err(RunError::Setting(
                "a line rate paces the device thread of one queue: \
                 --line-rate needs --device-thread and --queues 1"
                    .into(),
            )),
            Some(g) => crate::cli::line_rate(g)
                .map(|_| ())
                .map_err(RunError::Setting),
            None => Ok(()),
        }
    }
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
            // The link carries the run's segments: at least Ethernet's
            // MTU, more for an MSS past 1460 (jumbo frames).
            mtu: (usize::from(self.mss) + HDR_LEN - 14).max(usize::from(tx::Config::DEFAULT_MTU))
                as u16,
            // A row measures chunks of its order: every payload from the
            // pool of that order, small ones too (the flows experiment
            // measures the queue's default split).
            split: None,
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
    /// The virtio-net model (`virtio-queue`'s device side of the split
    /// virtqueue): the queue writes virtio's format, and the model reads,
    /// verifies and checksums every payload byte, segments GSO.
    Virtio,
}

impl DeviceModel {
    /// The lab's name for it.
    pub fn name(self) -> &'static str {
        match self {
            DeviceModel::Soft => "soft",
            DeviceModel::Null => "null",
            DeviceModel::Virtio => "virtio",
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

/// A deterministic xorshift stream (one per queue; the flows experiment's
/// workload). The seed must not be 0.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in (0, 1].
    pub(crate) fn unit(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
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

/// What a device lost between two snapshots of its counters and the
/// queue's (`nic` and `q`, each the later one's `since` the earlier): the
/// model's losses ([`NicStats::losses`], the one list of the counters
/// that show a loss) and the completions with an error. Not a count of
/// packets: 0 exactly when nothing was lost. The warm-up's check and the
/// measured part's `faults` both use it.
fn lost(nic: Option<&NicStats>, q: &tx::Stats) -> u64 {
    nic.map_or(0, NicStats::losses) + q.device_errors
}

/// Sends the warm-up's packets; one that loses any fails the run, since the
/// measured part's counters start after it and would never show them.
fn warm_up<M: DmaMapper, D: TxDevice>(
    q: &mut tx::Queue<M, D>,
    gen: &mut Traffic<M>,
    cfg: &RunConfig,
    rng: &mut Rng,
    tick: &mut dyn FnMut(u64),
    nic: impl Fn(&D) -> Option<NicStats>,
) -> Result<(), RunError> {
    let (nic0, q0) = (nic(q.device()), q.stats());
    pump(q, gen, cfg, cfg.warmup, rng, tick)?;
    let since = nic(q.device()).map(|n| n.since(&nic0.unwrap_or_default()));
    match lost(since.as_ref(), &q.stats().since(&q0)) {
        0 => Ok(()),
        lost => Err(RunError::WarmUp { lost }),
    }
}

/// The default TCP MSS of the generated traffic (a 1500-byte MTU).
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
        let mut backoff = tx::Backoff::default();
        loop {
            match gen.send(q, flow, len) {
                Ok(()) => break,
                Err(e) if e.is_backoff() => {
                    q.kick()?;
                    if q.reap()? > 0 {
                        full_since = None;
                        backoff.reset();
                        continue;
                    }
                    if q.in_flight() == 0 {
                        return Err(e.into());
                    }
                    let t = *full_since.get_or_insert_with(Instant::now);
                    if t.elapsed() > STALL {
                        q.wait(Duration::ZERO).map_err(|e| waited(e, t.elapsed()))?;
                    }
                    // A full ring that does not drain (a device on its own
                    // thread, paced): spin briefly, then sleep as a driver
                    // whose queue is stopped would, so that its CPU time
                    // counts work, not waiting.
                    backoff.pause();
                }
                // A packet no retry sends, with the run's numbers.
                Err(e) => return Err(refused::<D::Format>(cfg, q.config(), len, e)),
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

/// A timeout error from a zero-length wait, with the time the run really
/// waited.
fn waited(e: vfio_nic::Error, d: Duration) -> vfio_nic::Error {
    match e {
        vfio_nic::Error::Timeout {
            pending,
            head,
            tail,
            ..
        } => vfio_nic::Error::Timeout {
            pending,
            waited_ms: d.as_millis().try_into().unwrap_or(u64::MAX),
            head,
            tail,
        },
        other => other,
    }
}

mod check;
mod error;
mod gate;
mod limit;
mod row;
mod soft;
mod vfio;

pub use check::{check, check_flows, MAX_MSS};
use check::{check_packet, refused};
pub use error::RunError;
pub use limit::{driver_limit, limit};
pub use row::Row;
use row::{Cpu, Measured};
pub use soft::run;
pub use vfio::{check_vfio, run_vfio, DmaBackend};

/// A small run for tests: one queue and flow, ten 1,000-byte packets
/// after `warmup`, order 4 persistent, mapped headers, the software NIC.
#[cfg(test)]
fn test_config(iommu: IommuMode, warmup: u64) -> RunConfig {
    RunConfig {
        order: 4,
        policy: Policy::Persistent,
        iommu,
        header: HeaderMode::Mapped,
        fit_whole: true,
        payload: 1000,
        flows: 1,
        packets: 10,
        warmup,
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
        device: DeviceSetup::default(),
        mss: MSS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Defect 10: a row's Gbit/s counts bytes the device delivered intact,
    /// never bytes posted: a run whose packets all faulted shows 0.
    #[test]
    fn gbit_s_counts_delivered_bytes_only() {
        let cfg = test_config(IommuMode::Strict, 0);
        let m = |delivered| Measured {
            map: pfrag::dma::MapStats::default(),
            packets: 10,
            bytes: 10_000,
            delivered,
            descs: 30,
            waste: 0,
            ns: 1000.0,
            cpu: None,
            pool: pfrag::pool::Stats::default(),
            delta: pfrag::pool::Stats::default(),
            iova_awaiting_flush: 0,
        };
        assert_eq!(m(0).row("soft", &cfg).gbit_s, 0.0);
        assert_eq!(m(5_000).row("soft", &cfg).gbit_s, 40.0);
    }

    /// The row's `iova_awaiting_flush` cell: IOVA unmapped under lazy
    /// invalidation whose flush has not come, the memory behind it kept.
    /// Per-frag mapping unmaps each packet's frags as it completes, far
    /// fewer than a flush queue holds: some wait at the end. Strict
    /// invalidation flushes at each unmap, and without an IOMMU the IOVA
    /// is the host address: nothing waits.
    #[test]
    fn iova_awaiting_its_flush_is_a_column() {
        let cell = |iommu| {
            let mut cfg = test_config(iommu, 0);
            cfg.policy = Policy::PerFrag;
            let row = &run(&cfg, &mut |_| {}).unwrap()[0];
            let cols = crate::report::columns();
            let i = cols.iter().position(|c| c == "iova_awaiting_flush");
            let i = i.expect("an iova_awaiting_flush column");
            crate::report::record(row)[i].parse::<u64>().unwrap()
        };
        let lazy = cell(IommuMode::Lazy);
        assert!(lazy > 0 && lazy % 4096 == 0, "{lazy}");
        assert_eq!((cell(IommuMode::Strict), cell(IommuMode::Off)), (0, 0));
    }

    /// The null device fetches no segment: its rows leave
    /// `pages_per_segment` empty (not measured), not 0.
    #[test]
    fn a_null_device_row_has_no_pages_per_segment() {
        let mut cfg = test_config(IommuMode::Strict, 0);
        cfg.payload = 4000;
        let soft = run(&cfg, &mut |_| {}).unwrap();
        assert!(soft[0].pages_per_segment.is_some_and(|p| p > 0.0));
        cfg.model = DeviceModel::Null;
        let null = run(&cfg, &mut |_| {}).unwrap();
        assert_eq!(null[0].pages_per_segment, None);
    }

    /// The virtio-net model reads every byte: `--touch pages` with it is a
    /// bad setting, refused by the up-front check (exit status 2 in the
    /// sweep), not by the run after others ran.
    #[test]
    fn virtio_with_touch_pages_is_refused_up_front() {
        let mut cfg = test_config(IommuMode::Strict, 0);
        (cfg.model, cfg.touch) = (DeviceModel::Virtio, Touch::Pages);
        let e = check(&cfg).unwrap_err().to_string();
        assert!(e.contains("--touch pages"), "{e}");
        cfg.touch = Touch::Checksum;
        check(&cfg).unwrap();
    }

    /// The virtio-net model cannot be paced: a line rate with it is
    /// refused by the up-front check, not when its device thread starts.
    #[test]
    fn virtio_with_a_line_rate_is_refused_up_front() {
        let mut cfg = test_config(IommuMode::Strict, 0);
        cfg.model = DeviceModel::Virtio;
        cfg.device.thread = true;
        cfg.device.line_rate_gbit = Some(10.0);
        let e = check(&cfg).unwrap_err().to_string();
        assert!(e.contains("cannot be paced"), "{e}");
        // The same line rate paces the software NIC.
        cfg.model = DeviceModel::Soft;
        check(&cfg).unwrap();
    }
}
