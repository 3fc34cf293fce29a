//! The settings of the software IOMMU ([`SoftIommu`](super::SoftIommu)):
//! invalidation mode, cost model, IOTLB and flush-queue sizes, IOVA range,
//! and the unmap rule.

use std::ops::Range;

use crate::addr::PAGE_SIZE;
use crate::error::{Error, Result};

/// When unmapped translations leave the IOTLB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalidation {
    /// Every unmap call invalidates its range synchronously (`iommu.strict=1`).
    Strict,
    /// Unmaps queue up; a full flush queue is drained with one global
    /// invalidation (Linux's flush queue). Until then stale IOTLB entries
    /// still translate.
    Lazy,
}

/// Modelled cost of IOMMU operations, in ns. These are parameters of a model
/// and reported apart from measured time, never mixed into it.
/// [`CostModel::default()`] takes illustrative values: 150 ns per call,
/// 5 ns per PTE, 2 µs per invalidation, 200 ns per IOTLB miss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Per map or unmap call. Default 150 ns
    /// ([`CostModel::DEFAULT_CALL_NS`]).
    pub call_ns: f64,
    /// Per page-table entry written or cleared. Default 5 ns
    /// ([`CostModel::DEFAULT_PTE_NS`]).
    pub pte_ns: f64,
    /// Per invalidation operation (with its wait). Default 2,000 ns
    /// ([`CostModel::DEFAULT_INVALIDATION_NS`]).
    pub invalidation_ns: f64,
    /// Per IOTLB miss (page walk). Default 200 ns
    /// ([`CostModel::DEFAULT_MISS_NS`]).
    pub miss_ns: f64,
}

impl CostModel {
    /// The default cost of a map or unmap call: 150 ns, syscall scale.
    pub const DEFAULT_CALL_NS: f64 = 150.0;
    /// The default cost per page-table entry: 5 ns, a cache-line write.
    pub const DEFAULT_PTE_NS: f64 = 5.0;
    /// The default cost of an invalidation: 2,000 ns, a queued
    /// invalidation with its wait descriptor.
    pub const DEFAULT_INVALIDATION_NS: f64 = 2000.0;
    /// The default cost of an IOTLB miss: 200 ns, a 4-level walk.
    pub const DEFAULT_MISS_NS: f64 = 200.0;
}

impl Default for CostModel {
    /// Illustrative defaults: a syscall-scale call, a cache-line write per
    /// PTE, a queued invalidation with wait descriptor, a 4-level walk.
    fn default() -> CostModel {
        CostModel {
            call_ns: CostModel::DEFAULT_CALL_NS,
            pte_ns: CostModel::DEFAULT_PTE_NS,
            invalidation_ns: CostModel::DEFAULT_INVALIDATION_NS,
            miss_ns: CostModel::DEFAULT_MISS_NS,
        }
    }
}

/// Settings of a [`SoftIommu`](super::SoftIommu). [`SoftIommuConfig::default()`]: 128 IOTLB
/// entries, strict invalidation, 4 KiB pages only, a flush queue of 256,
/// no cost model, IOVAs from 1 MiB to 2^48, unmaps of whole mappings only.
#[derive(Clone, Debug)]
pub struct SoftIommuConfig {
    /// IOTLB entries (LRU), 1..=[`MAX_IOTLB_ENTRIES`]. Default 128
    /// ([`SoftIommuConfig::DEFAULT_IOTLB_ENTRIES`]).
    pub iotlb_entries: usize,
    /// Strict or lazy invalidation. Default [`Invalidation::Strict`].
    pub invalidation: Invalidation,
    /// Install 2 MiB superpages where IOVA, address and length allow.
    /// Default off.
    pub superpages: bool,
    /// Entries in the lazy flush queue, 1..=2^20. Default
    /// 256 ([`SoftIommuConfig::DEFAULT_FLUSH_QUEUE`]).
    pub flush_queue: usize,
    /// Optional cost model, each figure in `0..=`[`MAX_COST_NS`]. Default
    /// `None`: no modelled time is counted.
    pub cost: Option<CostModel>,
    /// Spin the cost model's time on the thread that would wait for the
    /// hardware: the mapping caller for map, unmap and a strict
    /// invalidation, the translating device for an IOTLB miss, each after
    /// the IOMMU's lock is released. A model, not a measurement of any
    /// IOMMU. Off by default: the model's time is then only counted
    /// ([`MapStats::model_ns`](super::MapStats::model_ns)).
    pub inject: bool,
    /// The IOVA space it accepts, inside the 48 bits the page table
    /// decodes. Default 1 MiB .. 2^48
    /// ([`SoftIommuConfig::DEFAULT_IOVA_RANGE`]).
    pub iova_range: Range<u64>,
    /// An unmap must cover whole earlier mappings, as VFIO type1 (v2)
    /// demands: a range that splits one is refused with `EINVAL`, touching
    /// nothing. Default on; off, any mapped pages may be unmapped.
    pub whole_unmaps: bool,
}

/// Most IOTLB entries a [`SoftIommu`](super::SoftIommu) accepts.
pub const MAX_IOTLB_ENTRIES: usize = 1 << 20;
/// Most entries of the lazy flush queue.
pub const MAX_FLUSH_QUEUE: usize = 1 << 20;
/// The largest cost-model figure accepted, in ns: a millisecond for a
/// call, a PTE, an invalidation or a miss, far above any IOMMU, and small
/// enough that a run's modelled time stays a finite number. It bounds each
/// figure, not an operation: a map of many pages waits the PTE figure
/// once per page.
pub const MAX_COST_NS: f64 = 1e6;
/// The IOVA width the page table decodes (4 levels of 9 bits above 4 KiB).
pub const IOVA_BITS: u32 = 48;

impl SoftIommuConfig {
    /// The default IOTLB size: 128 entries.
    pub const DEFAULT_IOTLB_ENTRIES: usize = 128;
    /// The default lazy flush queue: 256 entries.
    pub const DEFAULT_FLUSH_QUEUE: usize = 256;
    /// The default IOVA space: 1 MiB up to 2^48.
    pub const DEFAULT_IOVA_RANGE: Range<u64> = (1 << 20)..(1 << IOVA_BITS);

    /// Checks every setting: IOTLB entries in `1..=MAX_IOTLB_ENTRIES`, flush
    /// queue in `1..=MAX_FLUSH_QUEUE`, an IOVA range of whole pages inside
    /// 48 bits, and a cost model of finite numbers in `0..=`[`MAX_COST_NS`].
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_IOTLB_ENTRIES).contains(&self.iotlb_entries) {
            return Err(Error::OutOfRange {
                what: "iotlb entries",
                value: self.iotlb_entries as u64,
                min: 1,
                max: MAX_IOTLB_ENTRIES as u64,
            });
        }
        if !(1..=MAX_FLUSH_QUEUE).contains(&self.flush_queue) {
            return Err(Error::OutOfRange {
                what: "flush queue entries",
                value: self.flush_queue as u64,
                min: 1,
                max: MAX_FLUSH_QUEUE as u64,
            });
        }
        let r = &self.iova_range;
        if r.start >= r.end || (r.start | r.end) % PAGE_SIZE != 0 || r.end > 1 << IOVA_BITS {
            return Err(Error::OutOfRange {
                what: "iova range end (whole pages, start < end)",
                value: r.end,
                // Saturated and capped: a start near the top of the
                // 64-bit space must not overflow here.
                min: r.start.saturating_add(PAGE_SIZE).min(1 << IOVA_BITS),
                max: 1 << IOVA_BITS,
            });
        }
        if let Some(c) = self.cost {
            for (what, v) in [
                ("cost call ns", c.call_ns),
                ("cost pte ns", c.pte_ns),
                ("cost invalidation ns", c.invalidation_ns),
                ("cost miss ns", c.miss_ns),
            ] {
                if !v.is_finite() || v < 0.0 {
                    return Err(Error::BadFloat { what, value: v });
                }
                if v > MAX_COST_NS {
                    return Err(Error::OutOfRange {
                        what,
                        // Rounded up (and saturated): never shown in range.
                        value: v.ceil() as u64,
                        min: 0,
                        max: MAX_COST_NS as u64,
                    });
                }
            }
        }
        Ok(())
    }
}

impl Default for SoftIommuConfig {
    fn default() -> SoftIommuConfig {
        SoftIommuConfig {
            iotlb_entries: SoftIommuConfig::DEFAULT_IOTLB_ENTRIES,
            invalidation: Invalidation::Strict,
            superpages: false,
            flush_queue: SoftIommuConfig::DEFAULT_FLUSH_QUEUE,
            cost: None,
            inject: false,
            iova_range: SoftIommuConfig::DEFAULT_IOVA_RANGE,
            whole_unmaps: true,
        }
    }
}
