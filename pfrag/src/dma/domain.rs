//! A DMA domain: a mapper plus the IOVA allocator that serves it.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use super::{BatchUnmap, Dir, DmaMapper, IovaSpace, Mapping, Unmapped};
use crate::addr::{Iova, VirtAddr, PAGE_SIZE};
use crate::error::{Error, Result};
use crate::iova::IovaAllocator;

/// A mapper and its IOVA allocator. An IOVA freed by a lazy unmap is only
/// handed out again after the mapper's flush covered it.
///
/// Memory whose mapping could not be removed is kept out of circulation on
/// purpose: its IOVA stays allocated and its host memory is never freed or
/// reused. The domain counts both ([`pinned`](Self::pinned)), so a run can
/// report them.
///
/// A mapper call that panics aborts the process. After a panic in the
/// middle of a map or an unmap nobody can tell what the IOMMU still
/// translates, so no memory that was ever mapped could be freed or reused
/// safely, and the unwinding would run the very drops that free it. Every
/// call pfrag makes to the mapper goes through the domain, with this
/// guard.
pub struct Domain<M: DmaMapper> {
    mapper: M,
    /// `None` for identity mappers, where IOVA = host address.
    iova: Option<Mutex<IovaAllocator>>,
    /// IOVA bytes whose unmap failed (still allocated, still mapped).
    pinned_iova: AtomicU64,
    /// Host bytes kept allocated for good because a mapping of them, or the
    /// flush after their unmap, failed.
    pinned_host: AtomicU64,
}

/// Memory kept out of circulation after failed unmaps or flushes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pinned {
    /// IOVA bytes that stay mapped for good: their unmap failed, or their
    /// owner pinned them for a device that could not be stopped
    /// ([`Coherent::pin`](super::Coherent::pin), [`Frag::pin`](crate::frag::Frag::pin)).
    pub iova_bytes: u64,
    /// Host bytes never freed because a device might still reach them.
    pub host_bytes: u64,
}

/// A batch unmap that removed some runs but not all: the runs in `failed`
/// stay mapped (their IOVA stays allocated); every other range of the batch
/// is gone and its IOVA freed. A batch whose ranges overlap is refused
/// before any unmap ([`Error::OverlappingRanges`]): then `failed` holds
/// every range given that names any bytes, all still mapped, and nothing
/// was freed or pinned.
#[derive(Debug, thiserror::Error)]
#[error("{} of the ranges stayed mapped: {error}", failed.len())]
pub struct PartialUnmap {
    /// The latest flush generation the runs that went wait for.
    pub how: Unmapped,
    /// Coalesced runs that stay mapped.
    pub failed: Vec<(Iova, u64)>,
    /// The first failure.
    #[source]
    pub error: Error,
}

impl PartialUnmap {
    /// Whether `iova` lies in a run that stayed mapped.
    pub fn still_mapped(&self, iova: Iova) -> bool {
        super::in_runs(&self.failed, iova)
    }
}

impl<M: DmaMapper> std::fmt::Debug for Domain<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain")
            .field("identity", &self.iova.is_none())
            .finish()
    }
}

impl<M: DmaMapper> Domain<M> {
    /// A domain over `mapper`'s IOVA space.
    pub fn new(mapper: M) -> Domain<M> {
        let iova = match mapper.iova_space() {
            IovaSpace::Identity => None,
            IovaSpace::Ranges(r) => Some(Mutex::new(IovaAllocator::new(&r))),
        };
        Domain {
            mapper,
            iova,
            pinned_iova: AtomicU64::new(0),
            pinned_host: AtomicU64::new(0),
        }
    }

    /// Memory kept out of circulation because an unmap or flush failed.
    pub fn pinned(&self) -> Pinned {
        Pinned {
            iova_bytes: self.pinned_iova.load(Relaxed),
            host_bytes: self.pinned_host.load(Relaxed),
        }
    }

    /// Records `bytes` of host memory its owner keeps allocated for good
    /// (leaks on purpose) because a device might still reach it.
    pub fn pin_host(&self, bytes: u64) {
        self.pinned_host.fetch_add(bytes, Relaxed);
    }

    /// Records `bytes` of IOVA that stay mapped for good on purpose (no
    /// unmap was tried, so none counted them).
    pub(crate) fn pin_iova(&self, bytes: u64) {
        self.pinned_iova.fetch_add(bytes, Relaxed);
    }

    /// The mapper.
    pub fn mapper(&self) -> &M {
        &self.mapper
    }

    /// Runs `f` on the mapper; a panic inside it aborts the process (see
    /// the type docs).
    #[inline(always)]
    fn call<R>(&self, f: impl FnOnce(&M) -> R) -> R {
        let guard = AbortOnUnwind;
        let r = f(&self.mapper);
        std::mem::forget(guard);
        r
    }

    /// The mapper's [`flush`](DmaMapper::flush): every unmap deferred so
    /// far stops translating.
    pub fn flush(&self) -> Result<()> {
        self.call(|m| m.flush())
    }

    /// The mapper's [`flushed_seq`](DmaMapper::flushed_seq): the latest
    /// flush generation completed.
    pub fn flushed_seq(&self) -> u64 {
        self.call(|m| m.flushed_seq())
    }

    /// IOVA bytes handed out (0 for identity domains). Not counted here:
    /// ranges unmapped whose invalidation waits for a flush (see
    /// [`iova_awaiting_flush`](Self::iova_awaiting_flush)), and ranges
    /// pinned after a failed unmap (see [`pinned`](Self::pinned)).
    pub fn iova_in_use(&self) -> u64 {
        self.iova.as_ref().map_or(0, |a| lock(a).in_use())
    }

    /// IOVA bytes unmapped by an unmap the mapper deferred to a flush
    /// ([`Unmapped::Deferred`]) that has not completed yet: no longer in
    /// [`iova_in_use`](Self::iova_in_use), not yet free for another
    /// mapping, and a device may still reach the memory behind them
    /// through a stale translation, so their owners keep that memory
    /// until the flush (as many host bytes). Ranges whose flush has
    /// completed go back to the free IOVA first. 0 for identity domains,
    /// whose IOVA is the host address: there the memory waiting shows
    /// only in its owner's counts (a pool's parked chunks).
    pub fn iova_awaiting_flush(&self) -> u64 {
        self.iova.as_ref().map_or(0, |a| {
            let mut al = lock(a);
            al.reclaim(self.flushed_seq());
            al.deferred_bytes()
        })
    }

    /// Allocates IOVA, reclaiming flushed ranges first, and forcing a flush
    /// if the space is exhausted while ranges wait for one.
    fn alloc(&self, a: &Mutex<IovaAllocator>, size: u64, align: u64) -> Result<Iova> {
        let mut al = lock(a);
        al.reclaim(self.flushed_seq());
        match al.alloc(size, align) {
            Err(Error::IovaExhausted { .. }) if al.deferred() > 0 => {
                self.flush()?;
                al.reclaim(self.flushed_seq());
                al.alloc(size, align)
            }
            r => r,
        }
    }

    /// Gives the IOVA of a removed mapping back to the allocator (after
    /// the flush, if deferred).
    fn release(&self, iova: Iova, len: u64, how: Unmapped) {
        if let Some(a) = &self.iova {
            let mut al = lock(a);
            let r = match how {
                Unmapped::Flushed => al.free(iova, len),
                Unmapped::Deferred { seq } => al.free_deferred(iova, len, seq),
            };
            refused_free(r);
        }
    }

    /// Maps `len` bytes (4 KiB multiples) at `addr` at a fresh IOVA aligned to
    /// `align`. One map call.
    ///
    /// # Safety
    /// As [`DmaMapper::map`]: the memory stays allocated until an unmap of
    /// it through this domain succeeded and, if that unmap was deferred,
    /// the mapper's flush covered it ([`retire`](Self::retire) does both).
    pub unsafe fn map(&self, addr: VirtAddr, len: u64, align: u64, dir: Dir) -> Result<Iova> {
        // SAFETY: the caller's promise, passed on.
        Ok(unsafe { self.map_many(&[addr], len, align, dir, false) }?[0])
    }

    /// Maps `addrs.len()` buffers of `each` bytes (a multiple of 4 KiB, else
    /// [`Error::BadConfig`]) at one contiguous IOVA block
    /// (buffer `i` at `base + i * each`, base aligned to `align`), with one map
    /// call per run that is contiguous in host memory too. `huge` says the
    /// memory is backed by 2 MiB huge pages, so the mapper may use
    /// superpages.
    ///
    /// On an [`Error::Unmap`] (the batch failed, and undoing it or
    /// flushing the undo failed too) part of the block may still be
    /// reached: its IOVA stays allocated and pinned, and the caller must
    /// keep all the buffers' memory for good. On any other error nothing
    /// of the block can be reached, and the memory may go.
    ///
    /// It may wait for device accesses and for every
    /// [`Hold`](super::Hold) on the mapper: when the IOVA space is
    /// exhausted while ranges wait for a flush it flushes, and a batch that
    /// fails part way is unmapped again.
    ///
    /// # Safety
    /// As [`map`](Self::map), for every buffer.
    pub unsafe fn map_many(
        &self,
        addrs: &[VirtAddr],
        each: u64,
        align: u64,
        dir: Dir,
        huge: bool,
    ) -> Result<Vec<Iova>> {
        if addrs.is_empty() || each == 0 {
            return Err(Error::ZeroLength);
        }
        // Refused in every domain, identity too, before anything is
        // mapped: the error paths below count the whole block.
        let total = each
            .checked_mul(addrs.len() as u64)
            .ok_or(Error::BadConfig {
                what: "mapping size",
                value: each,
            })?;
        // Each buffer's IOVA is given back on its own (`unmap_many`), which
        // only whole pages can be, even where buffers coalesce into
        // page-aligned runs that the mapper would take.
        if each % PAGE_SIZE != 0 {
            return Err(Error::BadConfig {
                what: "buffer length (whole 4 KiB pages)",
                value: each,
            });
        }
        let iovas: Vec<Iova> = match &self.iova {
            None => addrs.iter().map(|a| Iova(a.raw() as u64)).collect(),
            Some(a) => {
                let base = self.alloc(a, total, align)?;
                (0..addrs.len() as u64)
                    .map(|i| base.offset(i * each))
                    .collect()
            }
        };
        let ms: Vec<Mapping> = addrs
            .iter()
            .zip(&iovas)
            .map(|(&addr, &iova)| Mapping {
                iova,
                addr,
                len: each,
                dir,
                huge,
            })
            .collect();
        let mapped = self.call(|m| {
            // SAFETY: the caller's promise covers every buffer.
            unsafe { m.map_batch(&ms) }
        });
        if let Err(e) = mapped {
            if matches!(e, Error::Unmap { .. }) {
                // Undoing the batch failed: some runs stay mapped. Keep the
                // whole block out of circulation (the caller pins the
                // memory, see `map_batch`).
                self.pinned_iova.fetch_add(total, Relaxed);
            } else if let Some(a) = &self.iova {
                refused_free(lock(a).free(iovas[0], total));
            }
            return Err(e);
        }
        Ok(iovas)
    }

    /// Unmaps one range and frees its IOVA (after the flush, if deferred).
    /// Safe code cannot free an IOVA that a frag or ring still names:
    ///
    /// ```compile_fail,E0133
    /// use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
    /// use pfrag::Iova;
    ///
    /// let d = Domain::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    /// let _ = d.unmap(Iova(0x10_0000), 4096); // needs `unsafe`
    /// ```
    /// On error the range stays mapped and its IOVA is kept out of
    /// circulation (counted in [`pinned`](Self::pinned)); the caller must
    /// keep the memory allocated for good.
    ///
    /// # Safety
    /// The caller owns the mapping it removes: it made it with
    /// [`map`](Self::map) or [`map_many`](Self::map_many), and nothing
    /// else (a frag, a ring, another caller's region) names these IOVAs or
    /// will use them again. The IOVA goes back to the allocator, and the
    /// next mapping there may be someone else's memory.
    pub unsafe fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped> {
        match self.call(|m| m.unmap(iova, len)) {
            Ok(how) => {
                self.release(iova, len, how);
                Ok(how)
            }
            Err(e) => {
                self.pinned_iova.fetch_add(len, Relaxed);
                Err(e)
            }
        }
    }

    /// Unmaps many ranges, one call per contiguous run, and frees the IOVA
    /// of every run that went. Runs whose unmap failed stay mapped and
    /// pinned, as with [`unmap`](Self::unmap), and are listed in the error.
    /// Ranges that overlap each other are refused first
    /// ([`Error::OverlappingRanges`], naming two of them): nothing is
    /// unmapped, freed or pinned, and the error lists every range of any
    /// bytes as still mapped. Ranges of no bytes are skipped; a batch of
    /// nothing else is refused ([`Error::ZeroLength`]) and changes nothing.
    ///
    /// # Safety
    /// The caller owns the mapping it removes: it made it with
    /// [`map`](Self::map) or [`map_many`](Self::map_many), and nothing
    /// else (a frag, a ring, another caller's region) names these IOVAs or
    /// will use them again. The IOVA goes back to the allocator, and the
    /// next mapping there may be someone else's memory.
    pub unsafe fn unmap_many(&self, ranges: &[(Iova, u64)]) -> Result<Unmapped, PartialUnmap> {
        if ranges.is_empty() {
            return Ok(Unmapped::Flushed);
        }
        // Before any unmap: a byte two ranges share would be unmapped,
        // and freed or pinned, twice.
        if let Some(error) = overlap(ranges) {
            return Err(PartialUnmap {
                how: Unmapped::Flushed,
                failed: ranges.iter().copied().filter(|r| r.1 > 0).collect(),
                error,
            });
        }
        // A range of no bytes names nothing to unmap, free or keep: only
        // the others reach the mapper (there it would be an unmap of its
        // own, refused after the rest went). Alone they are refused.
        let named: Vec<(Iova, u64)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
        if named.is_empty() {
            return Err(PartialUnmap {
                how: Unmapped::Flushed,
                failed: Vec::new(),
                error: Error::ZeroLength,
            });
        }
        let BatchUnmap { how, failed, error } = self.call(|m| m.unmap_batch(&named));
        let report = BatchUnmap {
            how,
            failed,
            error: None,
        };
        for &(iova, len) in &named {
            if report.still_mapped(iova) {
                self.pinned_iova.fetch_add(len, Relaxed);
            } else {
                self.release(iova, len, how);
            }
        }
        match error {
            None => Ok(how),
            Some(error) => Err(PartialUnmap {
                how,
                failed: report.failed,
                error,
            }),
        }
    }

    /// Waits until `how` no longer lets a device reach what was unmapped:
    /// nothing for a flushed unmap, a flush of the mapper for a deferred
    /// one whose generation has not completed yet.
    pub fn settle(&self, how: Unmapped) -> Result<()> {
        match how {
            Unmapped::Deferred { seq } if self.flushed_seq() < seq => self.flush(),
            _ => Ok(()),
        }
    }

    /// Unmaps one range and completes its invalidation, so its memory may
    /// be freed when this returns `Ok`. On error the memory must stay
    /// allocated for good.
    ///
    /// # Safety
    /// The caller owns the mapping it removes: it made it with
    /// [`map`](Self::map) or [`map_many`](Self::map_many), and nothing
    /// else (a frag, a ring, another caller's region) names these IOVAs or
    /// will use them again. The IOVA goes back to the allocator, and the
    /// next mapping there may be someone else's memory.
    pub unsafe fn retire(&self, iova: Iova, len: u64) -> Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        let how = unsafe { self.unmap(iova, len) }?;
        self.settle(how)
    }
}

/// The first two of `ranges` that share a byte, as
/// [`Error::OverlappingRanges`] (the one that begins first, then the one
/// that begins inside it); `None` if they are disjoint. Ranges of no
/// bytes share none.
fn overlap(ranges: &[(Iova, u64)]) -> Option<Error> {
    let mut v: Vec<(Iova, u64)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    v.sort_unstable_by_key(|r| r.0);
    // Sorted by start: if any two share a byte, two neighbours do.
    let end = |r: (Iova, u64)| u128::from(r.0.raw()) + u128::from(r.1);
    v.windows(2)
        .find(|w| end(w[0]) > u128::from(w[1].0.raw()))
        .map(|w| Error::OverlappingRanges {
            first: w[0].0,
            first_len: w[0].1,
            second: w[1].0,
            second_len: w[1].1,
        })
}

/// What a refused IOVA free leaves: the domain frees only ranges it
/// allocated and whose mapping it removed, so a refusal
/// ([`Error::IovaNotInUse`]) means its own bookkeeping broke. The range then
/// simply stays out of use, which is safe (an IOVA leak, never an IOVA
/// handed out twice); debug builds stop here.
fn refused_free(r: Result<()>) {
    debug_assert!(r.is_ok(), "IOVA free refused: {r:?}");
}

fn lock(a: &Mutex<IovaAllocator>) -> MutexGuard<'_, IovaAllocator> {
    // Allocator updates complete before unlocking; a poisoned lock still
    // guards consistent state.
    crate::sync::lock_std(a)
}

/// Aborts the process when dropped: by [`Domain::call`] only while a
/// mapper call unwinds.
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        eprintln!(
            "pfrag: a DMA mapper call panicked; what the IOMMU still translates is unknown, \
             so no mapped memory can be freed safely: aborting"
        );
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::{Invalidation, SoftIommu, SoftIommuConfig, Translate};
    use crate::mem::Region;

    #[test]
    fn map_many_is_one_call_for_contiguous_buffers() {
        let d = Domain::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let r = Region::new(8 * 4096, 4096, false).unwrap();
        let addrs: Vec<_> = (0..8).map(|i| r.addr().offset(i * 4096)).collect();
        // SAFETY: `r` outlives the mapping (unmapped below).
        let iovas = unsafe { d.map_many(&addrs, 4096, 4096, Dir::TO_DEVICE, false) }.unwrap();
        assert_eq!(d.mapper().stats().map_calls, 1);
        for (a, i) in addrs.iter().zip(&iovas) {
            assert_eq!(d.mapper().translate(*i, Dir::TO_DEVICE).unwrap().addr, *a);
        }
        let ranges: Vec<_> = iovas.iter().map(|&i| (i, 4096)).collect();
        // SAFETY: the mappings are this test's, made above.
        unsafe { d.unmap_many(&ranges) }.unwrap();
        let s = d.mapper().stats();
        assert_eq!((s.unmap_calls, s.invalidations), (1, 1));
        assert_eq!(d.iova_in_use(), 0);
    }

    /// An unmap deferred to a lazy flush frees its IOVA only after the
    /// flush, and the host memory behind it must stay until then: both
    /// wait, and the domain says how many bytes do. They used to show
    /// nowhere: not in `iova_in_use`, not in `pinned`.
    #[test]
    fn a_deferred_unmap_is_counted_until_its_flush() {
        let cfg = SoftIommuConfig {
            invalidation: Invalidation::Lazy,
            ..SoftIommuConfig::default()
        };
        let d = Domain::new(SoftIommu::new(cfg).unwrap());
        let r = Region::new(3 * 4096, 4096, false).unwrap();
        // SAFETY: `r` outlives the mappings (flushed below).
        let a = unsafe { d.map(r.addr(), 2 * 4096, 4096, Dir::TO_DEVICE) }.unwrap();
        // SAFETY: as above.
        let b = unsafe { d.map(r.addr().offset(2 * 4096), 4096, 4096, Dir::TO_DEVICE) }.unwrap();
        // SAFETY: the mappings are this test's, named nowhere else.
        let how = unsafe { d.unmap(a, 2 * 4096) }.unwrap();
        assert!(matches!(how, Unmapped::Deferred { .. }));
        // SAFETY: as above.
        unsafe { d.unmap_many(&[(b, 4096)]) }.unwrap();
        assert_eq!((d.iova_in_use(), d.pinned()), (0, Pinned::default()));
        assert_eq!(d.iova_awaiting_flush(), 3 * 4096);
        d.flush().unwrap();
        assert_eq!(d.iova_awaiting_flush(), 0);
        assert_eq!(d.iova_in_use(), 0);
    }

    #[test]
    fn failed_map_frees_its_iova() {
        let d = Domain::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        // Unaligned host address: the mapper refuses.
        // SAFETY: the map is refused, so nothing can reach the address.
        assert!(unsafe { d.map(VirtAddr(0x1234), 4096, 4096, Dir::TO_DEVICE) }.is_err());
        assert_eq!(d.iova_in_use(), 0);
    }

    #[test]
    fn overlap_names_two_ranges_that_share_a_byte() {
        let pair = |r: &[(Iova, u64)]| match overlap(r) {
            Some(Error::OverlappingRanges {
                first,
                first_len,
                second,
                second_len,
            }) => Some(((first, first_len), (second, second_len))),
            _ => None,
        };
        // Touching ranges and ranges of no bytes share nothing.
        let touching = [(Iova(0x2000), 0x1000), (Iova(0x1000), 0x1000)];
        assert_eq!(pair(&touching), None);
        assert_eq!(pair(&[(Iova(0x1000), 0x2000), (Iova(0x2000), 0)]), None);
        // A range inside a wide one, given after a disjoint one.
        let nested = [
            (Iova(0x10_0000), 0x1000),
            (Iova(0x6000), 0x1000),
            (Iova(0x1000), 0x8000),
        ];
        assert_eq!(
            pair(&nested),
            Some(((Iova(0x1000), 0x8000), (Iova(0x6000), 0x1000)))
        );
        // The end of a range at the top of the space is not wrapped.
        let top = Iova(u64::MAX - 0xfff);
        assert_eq!(pair(&[(top, 0x1000), (Iova(0x1000), 0x1000)]), None);
        assert_eq!(
            pair(&[(top, 0x1000), (Iova(u64::MAX - 0x1fff), u64::MAX)]),
            Some(((Iova(u64::MAX - 0x1fff), u64::MAX), (top, 0x1000)))
        );
    }
}
