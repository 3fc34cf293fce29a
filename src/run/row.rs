//! A run's result: [`Row`], the one definition of the CSV schema, and how
//! the measured counters become its per-packet figures.

use super::*;

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
    /// What the measured part lost, 0 when every packet was delivered
    /// whole: with a device model, its losses
    /// ([`NicStats::losses`](vfio_nic::model::softnic::NicStats::losses):
    /// DMA faults, every packet lost to a fault making at least one, the
    /// packets it found corrupt or malformed, the doorbells on which it
    /// stopped) plus the completions with an error; on VFIO, the packets
    /// the device did not count as sent.
    /// Summed over the repetitions in a summary row (the warm-up is
    /// checked separately: a run whose warm-up loses a packet fails).
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
    /// Repetitions this row summarises: `ns_per_pkt`, `gbit_s` and
    /// `driver_ns_per_pkt` are their medians, the `_min`/`_max` columns
    /// their spread, and every other column is the median repetition's.
    pub reps: usize,
    /// Fastest repetition's ns per packet.
    pub ns_per_pkt_min: f64,
    /// Slowest repetition's ns per packet.
    pub ns_per_pkt_max: f64,
    /// Slowest repetition's Gbit/s.
    pub gbit_s_min: f64,
    /// Fastest repetition's Gbit/s.
    pub gbit_s_max: f64,
    /// CPU time of the driver's thread per packet
    /// (`CLOCK_THREAD_CPUTIME_ID`), the device model's share taken out
    /// when it runs inline.
    pub driver_ns_per_pkt: Option<f64>,
    /// Least driver CPU per packet over the repetitions.
    pub driver_ns_per_pkt_min: Option<f64>,
    /// Most driver CPU per packet over the repetitions.
    pub driver_ns_per_pkt_max: Option<f64>,
    /// CPU time the device model spent serving doorbells, per packet.
    pub device_ns_per_pkt: Option<f64>,
    /// Whether the device model ran on its own thread.
    pub device_thread: bool,
    /// The wire rate the device was paced to (empty: unpaced).
    pub line_rate_gbit: Option<f64>,
    /// Driver CPU time over wall time of the measured part: the share of
    /// one core the driver needed (with the device on its own thread).
    pub driver_cpu_share: Option<f64>,
    /// Driver CPU ns per Gbit delivered.
    pub cpu_ns_per_gbit: Option<f64>,
    /// Whether the cost model's time was spun (`--iommu-latency`): a
    /// model, kept apart from uninjected runs.
    pub iommu_latency: bool,
    /// Cost model: ns per map or unmap call (empty without an IOMMU).
    pub cost_call_ns: Option<f64>,
    /// Cost model: ns per page-table entry.
    pub cost_pte_ns: Option<f64>,
    /// Cost model: ns per invalidation.
    pub cost_inval_ns: Option<f64>,
    /// Cost model: ns per IOTLB miss.
    pub cost_miss_ns: Option<f64>,
    /// TCP MSS: payload bytes per TSO segment.
    pub mss: u16,
    /// Distinct 4 KiB pages per segment's payload: the page translations
    /// a TSO engine makes per segment (software NIC).
    pub pages_per_segment: Option<f64>,
    /// Payload bytes posted in the measured part (the most of any
    /// repetition in a summary row, whose `bytes_verified` is the least):
    /// `bytes_verified` must equal it where the device reads every byte.
    pub bytes_sent: u64,
    /// IOVA bytes unmapped under lazy invalidation whose flush had not
    /// completed at the end of the measured part
    /// ([`Domain::iova_awaiting_flush`](pfrag::dma::Domain::iova_awaiting_flush)):
    /// not yet free for another mapping, the memory behind them kept until
    /// the flush. 0 under strict invalidation and without an IOMMU (the
    /// IOVA is the host address). The domain is shared: per-queue rows
    /// repeat the total's.
    pub iova_awaiting_flush: u64,
}

/// What both backends measure over a run's measured part.
pub(super) struct Measured {
    pub(super) map: pfrag::dma::MapStats,
    /// Packets measured.
    pub(super) packets: u64,
    /// Payload bytes of those packets.
    pub(super) bytes: u64,
    /// Payload bytes the device delivered intact.
    pub(super) delivered: u64,
    pub(super) descs: u64,
    pub(super) waste: u64,
    pub(super) ns: f64,
    /// Driver and device CPU ns over the measured part (`None` where the
    /// backend does not measure them).
    pub(super) cpu: Option<Cpu>,
    /// Pool counters at the end.
    pub(super) pool: pfrag::pool::Stats,
    /// Pool counters over the measured part.
    pub(super) delta: pfrag::pool::Stats,
    /// The domain's IOVA bytes awaiting their flush at the end.
    pub(super) iova_awaiting_flush: u64,
}

impl Measured {
    /// The row's columns common to both backends.
    pub(super) fn row(&self, backend: &str, cfg: &RunConfig) -> Row {
        let p = self.packets.max(1) as f64;
        let m = &self.map;
        Row {
            backend: backend.into(),
            order: cfg.order.to_string(),
            policy: cfg.policy.name().into(),
            iommu: cfg.iommu.name().into(),
            header: cfg.header.name().into(),
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
            device_thread: cfg.device.thread,
            line_rate_gbit: cfg.device.line_rate_gbit,
            iommu_latency: cfg.device.iommu_latency,
            mss: cfg.mss,
            bytes_sent: self.bytes,
            iova_awaiting_flush: self.iova_awaiting_flush,
            ..self.cpu_columns(cfg)
        }
        .single()
    }

    /// The CPU-time columns and the cost model's parameters.
    fn cpu_columns(&self, cfg: &RunConfig) -> Row {
        let p = self.packets.max(1) as f64;
        let cost = (cfg.iommu != IommuMode::Off).then_some(cfg.cost);
        let mut r = Row {
            cost_call_ns: cost.map(|c| c.call_ns),
            cost_pte_ns: cost.map(|c| c.pte_ns),
            cost_inval_ns: cost.map(|c| c.invalidation_ns),
            cost_miss_ns: cost.map(|c| c.miss_ns),
            ..Row::default()
        };
        if let Some(c) = self.cpu {
            r.driver_ns_per_pkt = Some(c.driver_ns as f64 / p);
            r.device_ns_per_pkt = Some(c.device_ns as f64 / p);
            r.driver_cpu_share = Some(c.driver_ns as f64 / self.ns.max(1.0));
            let gbit = self.delivered as f64 * 8.0 / 1e9;
            r.cpu_ns_per_gbit = (gbit > 0.0).then(|| c.driver_ns as f64 / gbit);
        }
        r
    }
}

impl Row {
    /// What is wrong with the row, in words (empty when it is sound): a
    /// device fault (or, on a real NIC, a packet it did not count as
    /// sent), a pressure hook call count other than the account's
    /// transitions, or, where its device read every payload byte
    /// ([`reads_every_byte`](Self::reads_every_byte)), a payload byte sent
    /// and not verified. The one judgement of a row's soundness: the sweep
    /// and the reclaim experiment fail on any row that has a problem.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.faults > 0 || self.pressure_hook_calls != self.pressure_transitions {
            out.push(format!(
                "{} faults, {} hook calls for {} transitions",
                self.faults, self.pressure_hook_calls, self.pressure_transitions
            ));
        }
        if self.reads_every_byte()
            && (self.bytes_verified == 0 || self.bytes_verified != self.bytes_sent)
        {
            out.push(format!(
                "{} bytes verified of {} sent",
                self.bytes_verified, self.bytes_sent
            ));
        }
        out
    }

    /// Whether the row's device read and verified every payload byte, as
    /// its columns say: all but the driver's ceiling (`driver-limit`, no
    /// device), a device that read a line per page (`touch` `pages`), the
    /// null device (`none`) and a real NIC (`wire`, whose frames are
    /// checked where they are captured).
    pub fn reads_every_byte(&self) -> bool {
        self.policy != "driver-limit" && !matches!(self.touch.as_str(), "pages" | "none" | "wire")
    }

    /// The row as one repetition: `reps` 1, and each figure's range (the
    /// `_min` and `_max` columns) the figure itself.
    pub fn single(self) -> Row {
        Row {
            reps: 1,
            ns_per_pkt_min: self.ns_per_pkt,
            ns_per_pkt_max: self.ns_per_pkt,
            gbit_s_min: self.gbit_s,
            gbit_s_max: self.gbit_s,
            driver_ns_per_pkt_min: self.driver_ns_per_pkt,
            driver_ns_per_pkt_max: self.driver_ns_per_pkt,
            ..self
        }
    }
}

/// CPU time of a run's measured part, in ns.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Cpu {
    /// The driver's thread, less the device model's time when it ran
    /// inline.
    pub(super) driver_ns: u64,
    /// The device model serving doorbells.
    pub(super) device_ns: u64,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A row as the sweep makes them: `backend`, `policy`, `touch`, 10
    /// packets of 100 bytes, every byte verified.
    fn sweep_row(backend: &str, policy: &str, touch: &str) -> Row {
        let verified = if touch == "checksum" && policy != "driver-limit" {
            1000
        } else {
            0
        };
        Row {
            backend: backend.into(),
            policy: policy.into(),
            touch: touch.into(),
            packets: 10,
            payload_bytes: 100,
            bytes_sent: 1000,
            bytes_verified: verified,
            ..Row::default()
        }
    }

    /// The sweep judges its rows by `Row::problems`, which knows from the
    /// row's own columns whether its device read every byte: every sound
    /// row the sweep makes passes (a real NIC's, the null device's, a
    /// line per page, the driver's ceiling), and a row whose pressure hooks
    /// were called other than the account's transitions fails, as a fault
    /// or a byte short does.
    #[test]
    fn the_sweep_and_problems_judge_rows_alike() {
        let sound = [
            sweep_row("soft", "persistent", "checksum"),
            sweep_row("soft", "limit", "checksum"),
            sweep_row("soft", "driver-limit", "checksum"),
            sweep_row("soft", "persistent", "pages"),
            sweep_row("soft", "persistent", "none"),
            sweep_row("vfio", "persistent", "wire"),
        ];
        for r in &sound {
            assert!(r.problems().is_empty(), "{r:?}: {:?}", r.problems());
        }
        let hooks = Row {
            pressure_hook_calls: 3,
            pressure_transitions: 2,
            ..sweep_row("soft", "persistent", "checksum")
        };
        let fault = Row {
            faults: 1,
            ..sweep_row("vfio", "persistent", "wire")
        };
        let short = Row {
            bytes_verified: 999,
            ..sweep_row("soft", "limit", "checksum")
        };
        for r in [hooks, fault, short] {
            assert!(!r.problems().is_empty(), "passed: {r:?}");
        }
    }
}
