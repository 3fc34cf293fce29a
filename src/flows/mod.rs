//! The thousands-of-flows experiment: how much pool memory TX data in
//! flight keeps from reuse when its frags are held until the flow's ACK,
//! with one cache per queue (`shared`), one per flow (`per-flow`, as each
//! socket owns its page frag), the remedy `split` (bulk payloads from
//! the shared cache, small sends from a second cache of 4 KiB chunks), or
//! `default`: the TX queue's own frag source as a driver gets it without
//! configuring anything (`tx::Config::split`, the same size-class split,
//! inside the engine).
//!
//! The workload is simulated in time: every frame takes its wire time at
//! the line rate, each flow has a window and a round-trip time drawn from a
//! heavy-tailed (Pareto) distribution, and a share of flows stall (zero
//! window) for a long time, their data held until the stall ends. Packets
//! really go through the TX queue, the software IOMMU and the software NIC,
//! which verifies every payload byte.

mod plot;
mod sim;

use pfrag::pool::Policy;

pub use plot::write_svg;
pub use sim::run;

/// How flows get their frags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheKind {
    /// One frag cache for the queue, shared by every flow.
    Shared,
    /// One frag cache per flow.
    PerFlow,
    /// Bulk (TSO) payloads from the queue's cache, small sends from a
    /// second cache of order-0 chunks: a stalled small send pins 4 KiB,
    /// not a large chunk full of other flows' frags.
    Split,
    /// The queue's default frag source (`tx::Config::default()`): the
    /// engine's size-class split.
    Default,
}

impl CacheKind {
    /// The CSV's name for it.
    pub fn name(self) -> &'static str {
        match self {
            CacheKind::Shared => "shared",
            CacheKind::PerFlow => "per-flow",
            CacheKind::Split => "split",
            CacheKind::Default => "default",
        }
    }
}

impl std::str::FromStr for CacheKind {
    type Err = String;
    /// `shared`, `per-flow`, `split` or `default`.
    fn from_str(s: &str) -> Result<CacheKind, String> {
        [
            CacheKind::Shared,
            CacheKind::PerFlow,
            CacheKind::Split,
            CacheKind::Default,
        ]
        .into_iter()
        .find(|c| c.name() == s)
        .ok_or_else(|| format!("'{s}' is not a cache (shared, per-flow, split, default)"))
    }
}

/// The workload and the setup of one run.
#[derive(Clone, Debug)]
pub struct FlowsConfig {
    /// Flows.
    pub flows: usize,
    /// Chunk order of the queue's pool.
    pub order: u32,
    /// How flows get their frags.
    pub cache: CacheKind,
    /// Mapping policy of the pools.
    pub policy: Policy,
    /// Packets measured (after `warmup`).
    pub packets: u64,
    /// Packets sent before measuring.
    pub warmup: u64,
    /// Wire rate of simulated time, Gbit/s.
    pub line_rate_gbit: f64,
    /// Share of flows that are bulk (64 KB TSO packets); the rest send
    /// small messages.
    pub bulk_share: f64,
    /// Payload of a bulk flow's packet.
    pub bulk_payload: usize,
    /// Smallest and largest small send.
    pub small: (usize, usize),
    /// Bytes a bulk flow may have unacknowledged.
    pub bulk_window: usize,
    /// Bytes a small-send flow may have unacknowledged.
    pub small_window: usize,
    /// Least round-trip time, µs (the Pareto scale).
    pub rtt_min_us: f64,
    /// Pareto shape of the round-trip times (smaller: heavier tail).
    pub rtt_alpha: f64,
    /// Longest round-trip time, ms (the tail is cut here).
    pub rtt_max_ms: f64,
    /// Share of flows that stall once (zero window).
    pub stall_share: f64,
    /// How long a stall lasts, ms.
    pub stall_ms: f64,
    /// Seed of the workload's random draws.
    pub seed: u64,
}

impl Default for FlowsConfig {
    fn default() -> FlowsConfig {
        FlowsConfig {
            flows: 1000,
            order: 3,
            cache: CacheKind::Shared,
            policy: Policy::Persistent,
            packets: 100_000,
            warmup: 10_000,
            line_rate_gbit: 100.0,
            bulk_share: 0.1,
            bulk_payload: 65_160,
            small: (64, 1448),
            bulk_window: 256 << 10,
            small_window: 16 << 10,
            rtt_min_us: 50.0,
            rtt_alpha: 1.5,
            rtt_max_ms: 10.0,
            stall_share: 0.01,
            stall_ms: 20.0,
            seed: 0x5eed,
        }
    }
}

impl FlowsConfig {
    /// Checks every setting, naming the bad one.
    pub fn check(&self) -> Result<(), String> {
        let max = vfio_nic::gen::flow::MAX_FLOWS;
        if self.flows == 0 || self.flows > max {
            return Err(format!("flows {} out of range (1..={max})", self.flows));
        }
        if self.order > pfrag::Order::MAX {
            return Err(format!(
                "order {} out of range (0..={})",
                self.order,
                pfrag::Order::MAX
            ));
        }
        if self.packets == 0 {
            return Err("packets must be > 0".into());
        }
        let (lo, hi) = self.small;
        if lo == 0 || lo > hi || hi > self.small_window || self.bulk_payload > self.bulk_window {
            return Err(format!(
                "sends must fit their windows: small {lo}..={hi} B (window {}), bulk {} B (window {})",
                self.small_window, self.bulk_payload, self.bulk_window
            ));
        }
        if self.bulk_payload == 0 || self.bulk_payload > vfio_nic::desc::MAX_PAYLEN {
            return Err(format!(
                "bulk payload {} out of range (1..={})",
                self.bulk_payload,
                vfio_nic::desc::MAX_PAYLEN
            ));
        }
        for (what, v) in [
            ("bulk share", self.bulk_share),
            ("stall share", self.stall_share),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{what} {v} is not in 0..=1"));
            }
        }
        crate::cli::line_rate(self.line_rate_gbit)?;
        self.check_times()
    }

    /// Round-trip and stall times: each in its range, the least RTT at most
    /// the longest, and the whole run's simulated time (every packet at the
    /// line rate, every flow's stall one after another) within the
    /// simulator's clock of [`MAX_SIM_NS`] ns.
    fn check_times(&self) -> Result<(), String> {
        for (what, v, max) in [
            ("rtt min", self.rtt_min_us, MAX_RTT_MS * 1e3),
            ("rtt max", self.rtt_max_ms, MAX_RTT_MS),
            ("rtt alpha", self.rtt_alpha, 1e3),
        ] {
            if !(v > 0.0 && v <= max) {
                return Err(format!(
                    "{what} {v} is out of range (above 0, at most {max})"
                ));
            }
        }
        if self.rtt_min_us > self.rtt_max_ms * 1e3 {
            return Err(format!(
                "rtt min {} µs is above rtt max {} ms",
                self.rtt_min_us, self.rtt_max_ms
            ));
        }
        if !(0.0..=MAX_STALL_MS).contains(&self.stall_ms) {
            return Err(format!(
                "stall {} ms is out of range (0..={MAX_STALL_MS})",
                self.stall_ms
            ));
        }
        let largest = self.bulk_payload.max(self.small.1);
        let wire = vfio_nic::model::softnic::line_bytes(
            vfio_nic::gen::flow::HDR_LEN,
            largest,
            usize::from(crate::run::MSS),
        );
        let sends = (self.packets + self.warmup) as f64 * wire as f64 * 8.0 / self.line_rate_gbit;
        let total = sends + self.flows as f64 * self.stall_ms * 1e6 + self.rtt_max_ms * 1e6;
        if total > MAX_SIM_NS {
            return Err(format!(
                "the run could take {total:.3e} ns of simulated time, more than the \
                 simulator's clock holds ({MAX_SIM_NS:.3e} ns): fewer packets or a \
                 higher line rate"
            ));
        }
        Ok(())
    }
}

/// The longest round-trip time accepted, ms.
pub const MAX_RTT_MS: f64 = 60_000.0;

/// The longest stall accepted, ms (an hour).
pub const MAX_STALL_MS: f64 = 3_600_000.0;

/// The simulated time a run may span, ns (its clock counts ns in a `u64`;
/// half of that keeps the sums exact enough).
pub const MAX_SIM_NS: f64 = (1u64 << 62) as f64;

/// One run's result: the experiment's CSV row.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FlowsRow {
    /// `shared`, `per-flow`, `split` or `default`.
    pub cache: String,
    /// Chunk order.
    pub order: u32,
    /// Flows.
    pub flows: usize,
    /// Packets measured.
    pub packets: u64,
    /// Payload bytes sent and not yet acknowledged (their frags held), mean
    /// over the measured packets.
    pub inflight_bytes_mean: f64,
    /// The most of them at once.
    pub inflight_bytes_peak: u64,
    /// Pool memory out of the free lists (held by caches, the device or
    /// holds), mean.
    pub pool_bytes_mean: f64,
    /// The most of it at once.
    pub pool_bytes_peak: u64,
    /// `pool_bytes_mean / inflight_bytes_mean`.
    pub amplification_mean: f64,
    /// `pool_bytes_peak / inflight_bytes_peak`.
    pub amplification_peak: f64,
    /// Chunks kept alive by exactly one held frag, mean.
    pub pinned_chunks_mean: f64,
    /// Map calls per packet.
    pub maps_per_pkt: f64,
    /// IOTLB invalidations per packet.
    pub invalidations_per_pkt: f64,
    /// IOTLB misses per packet.
    pub iotlb_misses_per_pkt: f64,
    /// Payload bytes the NIC read and matched (measured part).
    pub bytes_verified: u64,
    /// Payload bytes sent (measured part): `bytes_verified` must equal it.
    pub bytes_sent: u64,
    /// Simulated time of the measured part, ms.
    pub sim_ms: f64,
    /// Flows that stalled during the run.
    pub stalled_flows: usize,
    /// ACKs that let frags go before they were due: always 0 (a run with
    /// any fails).
    pub early_acks: u64,
    /// ACKs put off until their flow's stall ended (their frags held).
    pub deferred_acks: u64,
}
