//! DMA mapping: the driver side ([`DmaMapper`]) and the device side
//! ([`Translate`]) of an IOMMU, with two implementations here ([`Identity`],
//! [`SoftIommu`]) and a real one in `vfio-nic`.
//!
//! The driver picks IOVAs itself (VFIO type1 lets userspace choose them), so a
//! mapper only installs and removes translations. [`Domain`] pairs a mapper
//! with an [`IovaAllocator`](crate::iova::IovaAllocator) that never reuses an
//! IOVA before the mapper has flushed it.

mod coherent;
mod domain;
mod faulty;
mod fence;
mod granules;
mod identity;
mod iotlb;
mod latency;
mod seen;
mod soft;
mod soft_config;
pub mod watch;

use std::ops::Range;

pub use coherent::Coherent;
pub use domain::{Domain, PartialUnmap, Pinned};
pub use faulty::{Faulty, FaultyConfig, FaultyStats, Op};
pub use identity::{Identity, MAX_PAGE_MAPPINGS};
pub use soft::{FaultReason, FaultRecord, SoftIommu};
pub use soft_config::{CostModel, Invalidation, SoftIommuConfig, MAX_COST_NS, MAX_IOTLB_ENTRIES};
pub use watch::{Watch, WatchStats};

pub use fence::Hold;
pub(crate) use fence::{device_read, device_store_u32, device_write, Fence};

use crate::addr::{Iova, VirtAddr};
use crate::error::{Error, Result};

bitflags::bitflags! {
    /// Which way the device may move data through a mapping.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Dir: u8 {
        /// The device reads the memory (TX payload, descriptors).
        const TO_DEVICE = 1 << 0;
        /// The device writes the memory (RX buffers, descriptor write-back).
        const FROM_DEVICE = 1 << 1;
        /// Both.
        const BIDIRECTIONAL = Self::TO_DEVICE.bits() | Self::FROM_DEVICE.bits();
    }
}

bitflags::bitflags! {
    /// Page sizes a mapper can install as one translation.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct PageSizes: u8 {
        /// 4 KiB pages.
        const SIZE_4K = 1 << 0;
        /// 2 MiB superpages.
        const SIZE_2M = 1 << 1;
    }
}

/// One map request: `len` bytes at host `addr` made visible at `iova`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// Where the device sees the memory.
    pub iova: Iova,
    /// Where the memory lives in this process.
    pub addr: VirtAddr,
    /// Bytes; a multiple of 4 KiB.
    pub len: u64,
    /// Allowed access.
    pub dir: Dir,
    /// The memory is backed by 2 MiB huge pages, so a mapper may install
    /// superpages where IOVA, address and length are 2 MiB aligned (a real
    /// IOMMU needs physically contiguous 2 MiB blocks for that).
    pub huge: bool,
}

/// What an unmap did to the IOTLB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmapped {
    /// The translation is gone everywhere; the IOVA may be reused now.
    Flushed,
    /// The page table entry is gone, but stale IOTLB entries may remain until
    /// flush generation `seq` completes ([`DmaMapper::flushed_seq`]).
    Deferred {
        /// The flush generation that will cover this unmap.
        seq: u64,
    },
}

/// Which IOVAs a mapper accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IovaSpace {
    /// No IOMMU: the IOVA must equal the host address.
    Identity,
    /// Any IOVA inside these ranges.
    Ranges(Vec<Range<u64>>),
}

/// Counters of a mapper, as a snapshot. Differences of two snapshots give the
/// work done in between.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MapStats {
    /// Map calls (a batch of contiguous chunks is one call).
    pub map_calls: u64,
    /// Unmap calls.
    pub unmap_calls: u64,
    /// Page-table entries written: one per 4 KiB page, and one per 2 MiB
    /// superpage where the mapper installs one ([`SoftIommu`] with huge
    /// pages). A mapper that cannot see the page table (VFIO's) counts the
    /// 4 KiB pages it mapped.
    pub ptes_written: u64,
    /// IOTLB invalidation operations.
    pub invalidations: u64,
    /// Device translations served by the IOTLB.
    pub iotlb_hits: u64,
    /// Device translations that walked the page table.
    pub iotlb_misses: u64,
    /// Device accesses refused.
    pub faults: u64,
    /// Modelled IOMMU time in ns, from the cost model (0 without one).
    pub model_ns: f64,
}

impl MapStats {
    /// `self - earlier`, field by field: the work done in between. Each
    /// difference saturates at zero (the counters only grow, so only
    /// swapped arguments could make one negative).
    pub fn since(&self, earlier: &MapStats) -> MapStats {
        MapStats {
            map_calls: self.map_calls.saturating_sub(earlier.map_calls),
            unmap_calls: self.unmap_calls.saturating_sub(earlier.unmap_calls),
            ptes_written: self.ptes_written.saturating_sub(earlier.ptes_written),
            invalidations: self.invalidations.saturating_sub(earlier.invalidations),
            iotlb_hits: self.iotlb_hits.saturating_sub(earlier.iotlb_hits),
            iotlb_misses: self.iotlb_misses.saturating_sub(earlier.iotlb_misses),
            faults: self.faults.saturating_sub(earlier.faults),
            model_ns: (self.model_ns - earlier.model_ns).max(0.0),
        }
    }
}

/// What a batch unmap did: the runs it removed and the ones it could not.
#[derive(Debug)]
pub struct BatchUnmap {
    /// The latest flush generation any removed run waits for.
    pub how: Unmapped,
    /// Runs (coalesced, IOVA order) that are still mapped because their
    /// unmap failed. Their memory must stay allocated and out of use.
    pub failed: Vec<(Iova, u64)>,
    /// The first failure, if any.
    pub error: Option<Error>,
}

impl BatchUnmap {
    /// Whether `iova` lies in a run that is still mapped.
    pub fn still_mapped(&self, iova: Iova) -> bool {
        in_runs(&self.failed, iova)
    }
}

/// Whether `iova` lies in one of `runs`.
pub(crate) fn in_runs(runs: &[(Iova, u64)], iova: Iova) -> bool {
    runs.iter()
        .any(|&(s, l)| iova.raw() >= s.raw() && iova.raw() - s.raw() < l)
}

/// The driver side of an IOMMU.
///
/// Implementations are shared between the driver and completion paths, so
/// all methods take `&self`.
///
/// Mapping is `unsafe`: once mapped, memory can be reached by a device (and
/// by the device models of this workspace through [`Translate`]), so the
/// caller promises the memory stays allocated for as long as any
/// translation of it may exist. Pools and [`Coherent`] regions keep that
/// promise for you; map through them unless you own raw memory. Safe code
/// cannot map an address it made up:
///
/// ```compile_fail
/// use pfrag::dma::{Dir, DmaMapper, Identity, Mapping};
/// use pfrag::{Iova, VirtAddr};
/// let m = Identity::new();
/// let bogus = Mapping {
///     iova: Iova(0x1000),
///     addr: VirtAddr(0x1000),
///     len: 4096,
///     dir: Dir::TO_DEVICE,
///     huge: false,
/// };
/// m.map(&bogus).unwrap(); // error: call to unsafe function
/// ```
pub trait DmaMapper: Send + Sync {
    /// Installs one translation.
    ///
    /// A mapper may refuse a range that overlaps a live mapping (VFIO
    /// type1 and [`SoftIommu`] do, with `EEXIST`), or accept it and count
    /// the mappings of each page ([`Identity`] does, as a passthrough
    /// IOMMU would): a page mapped twice then stays mapped until both
    /// mappings are unmapped.
    ///
    /// # Safety
    /// `m.addr..m.addr + m.len` is memory of this process that stays
    /// allocated (neither unmapped from the process nor reused as another
    /// allocation) until this mapping has been removed: an unmap covering
    /// it has returned [`Unmapped::Flushed`], or returned
    /// [`Unmapped::Deferred`] and [`flushed_seq`](Self::flushed_seq) has
    /// reached its generation. A device may read it (and write it, with
    /// [`Dir::FROM_DEVICE`]) at any time until then. Where mappings
    /// overlap, a page stays reachable until its last mapping has been
    /// removed: each caller's promise covers its own mapping, and together
    /// the promises keep the page allocated while any mapping of it lives.
    unsafe fn map(&self, m: &Mapping) -> Result<()>;
    /// Removes the translations of `iova..iova+len`. On error the range
    /// stays mapped. Where mappings overlap ([`Identity`]), one mapping of
    /// each page goes, and a page stays mapped while another is live. A
    /// range that covers only part of a mapping (where the mapper allows
    /// it) leaves the rest mapped: the front, the back, or both.
    fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped>;
    /// Installs many translations, one call per contiguous run (see
    /// [`coalesce`]). On error nothing of the batch stays mapped, nor in
    /// an IOTLB (an undo deferred by lazy invalidation is flushed before
    /// the error returns), so the caller may free the memory; unless
    /// removing an already installed run failed too, or its flush did:
    /// then an [`Error::Unmap`] is returned, and the runs installed may
    /// still be reached, so their memory must stay allocated for good.
    ///
    /// # Safety
    /// As for [`map`](Self::map), for every mapping of the batch.
    unsafe fn map_batch(&self, ms: &[Mapping]) -> Result<()> {
        let runs = coalesce(ms);
        for (i, run) in runs.iter().enumerate() {
            // SAFETY: the caller's promise covers every mapping of the batch.
            if let Err(e) = unsafe { self.map(run) } {
                let undo: Vec<(Iova, u64)> = runs[..i].iter().map(|d| (d.iova, d.len)).collect();
                return Err(undo_runs(self, &undo).unwrap_or(e));
            }
        }
        Ok(())
    }
    /// Removes many ranges, one call per contiguous run. Every run is
    /// tried, even after one fails; the report says which stay mapped.
    fn unmap_batch(&self, ranges: &[(Iova, u64)]) -> BatchUnmap {
        let mut out = BatchUnmap {
            how: Unmapped::Flushed,
            failed: Vec::new(),
            error: None,
        };
        for (iova, len) in coalesce_ranges(ranges) {
            match self.unmap(iova, len) {
                Ok(Unmapped::Deferred { seq }) => out.how = Unmapped::Deferred { seq },
                Ok(Unmapped::Flushed) => {}
                Err(e) => {
                    out.failed.push((iova, len));
                    out.error.get_or_insert(e);
                }
            }
        }
        out
    }
    /// Page sizes this mapper can install.
    fn page_sizes(&self) -> PageSizes;
    /// The IOVAs it accepts.
    fn iova_space(&self) -> IovaSpace;
    /// The newest flush generation that has completed.
    fn flushed_seq(&self) -> u64;
    /// Completes every deferred invalidation now.
    fn flush(&self) -> Result<()>;
    /// A snapshot of the counters.
    fn stats(&self) -> MapStats;
}

/// Removes the runs a failed [`DmaMapper::map_batch`] installed, and
/// completes their invalidation: the caller frees the memory on that error.
/// `None` once nothing of them can be reached; else an [`Error::Unmap`]
/// (a failed flush becomes one, with the flush's cause, for the first run).
fn undo_runs<M: DmaMapper + ?Sized>(m: &M, runs: &[(Iova, u64)]) -> Option<Error> {
    let out = m.unmap_batch(runs);
    if out.error.is_some() {
        return out.error;
    }
    let Unmapped::Deferred { seq } = out.how else {
        return None;
    };
    if m.flushed_seq() >= seq {
        return None;
    }
    let source = match m.flush() {
        Ok(()) => return None,
        Err(Error::Flush { source }) => source,
        Err(other) => std::io::Error::other(other),
    };
    let (iova, len) = runs[0];
    Some(Error::Unmap { iova, len, source })
}

/// Why a device access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("DMA fault: {access:?} at iova {iova}")]
pub struct Fault {
    /// The address the device used.
    pub iova: Iova,
    /// The access it tried.
    pub access: Dir,
}

/// A translated piece of an IOVA range: host memory the device may touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Translation {
    /// Host address of the IOVA.
    pub addr: VirtAddr,
    /// Bytes from `addr` to the end of the translated page.
    pub len: u64,
}

/// The device side of an IOMMU: what a DMA engine asks before touching
/// memory, and the DMA itself.
///
/// A device model never dereferences an address: it asks the IOMMU to move
/// the bytes ([`read`](Self::read), [`write`](Self::write)). The IOMMU
/// touches only memory that a translation of its own covers at that moment,
/// and an unmap does not return while a device access through the old
/// translation is still running, so memory freed after its unmap (and, for
/// lazy invalidation, after its flush) is never touched again.
///
/// A device write moves its bytes with 32-bit atomics, as the CPU's
/// accesses to a [`Coherent`] region do, so a status write-back racing the
/// driver's polling is no data race. A device read lends the reader the
/// bytes in place (no copy): nothing may write them meanwhile. Other memory
/// (frags, [`Region`](crate::mem::Region)s) the CPU reaches with plain
/// loads and stores and through `&mut [u8]`
/// ([`Frag::as_mut_slice`](crate::frag::Frag::as_mut_slice)): a device may
/// touch it only between the doorbell that hands it over and the status
/// write-back that hands it back, as with real DMA. That is a promise only
/// the code that hands memory to the device can make, so the accesses
/// ([`read`](Self::read), [`write`](Self::write),
/// [`write_u32`](Self::write_u32)) are `unsafe`; [`translate`](Self::translate),
/// which touches nothing, is safe. A device model calls them from its
/// doorbell, which is itself `unsafe` with the same promise (the TX queue
/// makes it for the descriptors it wrote and the frags it owns).
///
/// Safe code cannot make a device access:
///
/// ```compile_fail,E0133
/// use pfrag::dma::{Identity, Translate};
/// use pfrag::Iova;
///
/// let iommu = Identity::new();
/// let _ = iommu.read(Iova(0x1000), 8, &mut |_| {}); // needs `unsafe`
/// ```
///
/// # Safety (for callers of the accesses)
///
/// What an access touches is handed to the device, from the start of the
/// call to its end. That is the aligned 4-byte words that hold its bytes,
/// not only the bytes: a write that starts or ends inside a word rewrites
/// the whole word (one atomic compare-and-swap), and so does a
/// [`Coherent`] write to any byte of a word.
/// - For a [`read`](Self::read), nothing writes those words (no
///   `&mut [u8]` that covers any of their bytes is alive, no [`Coherent`]
///   write touches any of their bytes); reads by the CPU meanwhile are
///   fine.
/// - For a [`write`](Self::write) or [`write_u32`](Self::write_u32), no
///   reference to any byte of those words is alive, and the only CPU
///   accesses to them are [`Coherent`]'s 32-bit accessors, which are
///   atomic (a driver polling a status word); not its 16-bit ones, whose
///   own contract keeps them off words a 32-bit access may touch.
///
/// Memory that no mapping covers needs no promise: the access faults.
///
/// # Safety
///
/// For implementors. Device models trust a translation: a model that needs addresses of its
/// own (the virtio-net model's `vm-memory` view) dereferences what
/// [`translate`](Self::translate) returns while it holds a
/// [`Hold`](Self::hold). So an implementation promises that a successful
/// `translate` names `len` (at least 1) bytes of memory, inside one page,
/// that the mapping covers for `access` and that stay allocated until an
/// unmap of that mapping returns (and, for a deferred one, until its
/// flush generation completes); that no unmap or flush returns `Ok` while
/// a `Hold` from [`hold`](Self::hold) is alive (one that fails removed
/// nothing, or leaves its memory allocated for good); and that `read`, `write` and
/// `write_u32` touch only what `translate` would name. pfrag's mappers
/// keep these with their fence; a wrapper forwards all of them to one
/// inner translation.
pub unsafe trait Translate: Send + Sync {
    /// Translates `iova` for `access`, or faults. The address is for
    /// inspection (tests, statistics); [`read`](Self::read) and
    /// [`write`](Self::write) are how a device reaches memory.
    fn translate(&self, iova: Iova, access: Dir) -> Result<Translation, Fault>;
    /// Holds off every unmap and flush until the [`Hold`] drops: while it
    /// is alive, memory that a [`translate`](Self::translate) made
    /// meanwhile points at stays allocated.
    ///
    /// # Safety
    /// Until the hold drops, the thread holding it neither unmaps nor
    /// flushes through this mapper (directly, or by dropping a pool, a
    /// `Coherent` region or a queue) nor calls [`read`](Self::read),
    /// [`write`](Self::write) or [`write_u32`](Self::write_u32): each
    /// would wait for the hold, forever. Mapping may unmap or flush too:
    /// [`Domain::map`] and [`Domain::map_many`] (and so a pool that grows,
    /// or [`Coherent::new`]) flush when the IOVA space is exhausted while
    /// ranges wait for a flush, and a [`map_batch`](DmaMapper::map_batch)
    /// that fails part way unmaps (and may flush) the runs it installed;
    /// so the holder does not map through this mapper's domain either.
    /// (Nothing unsound follows from breaking this; the thread hangs.)
    unsafe fn hold(&self) -> Hold<'_>;
    /// DMA read of `len` bytes at `iova`: `f` sees them piece by piece, in
    /// order, each piece within one translated page. A fault stops the read
    /// (after the pieces before it).
    ///
    /// # Safety
    /// Nothing writes the aligned 4-byte words that hold the `len` bytes at
    /// `iova` during the call (see the trait's Safety section).
    unsafe fn read(&self, iova: Iova, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), Fault>;
    /// DMA write of `src` at `iova`. A fault stops the write (after the
    /// pages before it).
    ///
    /// # Safety
    /// The aligned 4-byte words that hold the `src.len()` bytes at `iova`
    /// are handed to the device (see the trait's Safety section).
    unsafe fn write(&self, iova: Iova, src: &[u8]) -> Result<(), Fault>;
    /// DMA write of one aligned 32-bit word (a descriptor's status), as a
    /// single atomic store with release ordering, so that a driver polling
    /// the word while the device runs on another thread sees it whole, and
    /// sees everything the device did before. `iova` must be 4-byte
    /// aligned (else a fault). The default goes through
    /// [`write`](Self::write), which is enough for a device that runs on
    /// the driver's thread; pfrag's mappers store atomically.
    ///
    /// # Safety
    /// The 4 bytes at `iova` are handed to the device (see the trait's
    /// Safety section).
    unsafe fn write_u32(&self, iova: Iova, v: u32) -> Result<(), Fault> {
        // SAFETY: the caller's promise covers these 4 bytes.
        unsafe { self.write(iova, &v.to_le_bytes()) }
    }
}

// SAFETY: every call goes to the one inner translation.
unsafe impl<T: Translate + ?Sized> Translate for std::sync::Arc<T> {
    fn translate(&self, iova: Iova, access: Dir) -> Result<Translation, Fault> {
        (**self).translate(iova, access)
    }
    unsafe fn hold(&self) -> Hold<'_> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { (**self).hold() }
    }
    unsafe fn read(&self, iova: Iova, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), Fault> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { (**self).read(iova, len, f) }
    }
    unsafe fn write(&self, iova: Iova, src: &[u8]) -> Result<(), Fault> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { (**self).write(iova, src) }
    }
    unsafe fn write_u32(&self, iova: Iova, v: u32) -> Result<(), Fault> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { (**self).write_u32(iova, v) }
    }
}

impl<M: DmaMapper + ?Sized> DmaMapper for std::sync::Arc<M> {
    unsafe fn map(&self, m: &Mapping) -> Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { (**self).map(m) }
    }
    fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped> {
        (**self).unmap(iova, len)
    }
    unsafe fn map_batch(&self, ms: &[Mapping]) -> Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { (**self).map_batch(ms) }
    }
    fn unmap_batch(&self, ranges: &[(Iova, u64)]) -> BatchUnmap {
        (**self).unmap_batch(ranges)
    }
    fn page_sizes(&self) -> PageSizes {
        (**self).page_sizes()
    }
    fn iova_space(&self) -> IovaSpace {
        (**self).iova_space()
    }
    fn flushed_seq(&self) -> u64 {
        (**self).flushed_seq()
    }
    fn flush(&self) -> Result<()> {
        (**self).flush()
    }
    fn stats(&self) -> MapStats {
        (**self).stats()
    }
}

/// Merges mappings that continue each other in IOVA and host space with the
/// same direction, in the order given (unless the merged length would pass
/// `u64::MAX`: then they stay two runs).
pub fn coalesce(ms: &[Mapping]) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = Vec::with_capacity(ms.len());
    for m in ms {
        if let Some(last) = out.last_mut() {
            let merged = last.len.checked_add(m.len);
            if let Some(len) = merged.filter(|_| {
                last.dir == m.dir
                    && last.huge == m.huge
                    && last.iova.raw().checked_add(last.len) == Some(m.iova.raw())
                    && last.addr.raw().checked_add(last.len as usize) == Some(m.addr.raw())
            }) {
                last.len = len;
                continue;
            }
        }
        out.push(*m);
    }
    out
}

/// Sorts IOVA ranges and merges those that touch (unless the merged length
/// would pass `u64::MAX`: then they stay two runs).
pub fn coalesce_ranges(ranges: &[(Iova, u64)]) -> Vec<(Iova, u64)> {
    let mut v = ranges.to_vec();
    v.sort_unstable_by_key(|r| r.0);
    let mut out: Vec<(Iova, u64)> = Vec::with_capacity(v.len());
    for (iova, len) in v {
        if let Some(last) = out.last_mut() {
            let merged = last.1.checked_add(len);
            if let Some(l) = merged.filter(|_| last.0.raw().checked_add(last.1) == Some(iova.raw()))
            {
                last.1 = l;
                continue;
            }
        }
        out.push((iova, len));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesce_merges_only_contiguous_runs() {
        let m = |i: u64, a: usize| Mapping {
            iova: Iova(i),
            addr: VirtAddr(a),
            len: 4096,
            dir: Dir::TO_DEVICE,
            huge: false,
        };
        let runs = coalesce(&[m(0x1000, 0x10000), m(0x2000, 0x11000), m(0x4000, 0x13000)]);
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0].len, 8192);
        // Contiguous in IOVA but not in host memory: two runs.
        let runs = coalesce(&[m(0x1000, 0x10000), m(0x2000, 0x20000)]);
        assert_eq!(runs.len(), 2);
        let r = coalesce_ranges(&[(Iova(0x3000), 0x1000), (Iova(0x1000), 0x2000)]);
        assert_eq!(r, vec![(Iova(0x1000), 0x3000)]);
    }
}
