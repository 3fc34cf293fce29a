//! IOVA allocation: first-fit over free ranges, with frees that wait for the
//! IOMMU's flush before the range can be handed out again.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use crate::addr::{checked_align_up, Iova, PAGE_SIZE};
use crate::error::{Error, Result};

/// Hands out size- and alignment-constrained IOVA ranges.
///
/// Invariants: `free` holds disjoint, non-touching ranges (start -> end)
/// inside the configured space; `deferred` holds ranges freed while a lazy
/// invalidation may still cover them, oldest generation first, and
/// `pending` the same ranges by address; a range is in at most one of
/// `free`, `deferred`, or in use.
///
/// A free of a range that is not in use is refused with
/// [`Error::IovaNotInUse`] and changes nothing: one larger than the bytes
/// in use, not page aligned, past the end of the address space or of the
/// configured ranges, or overlapping a free range or one waiting for its
/// flush (a second free of a deferred range included; each an O(log n)
/// check).
#[derive(Debug)]
pub struct IovaAllocator {
    /// The configured space, merged: start -> end (exclusive).
    space: BTreeMap<u64, u64>,
    /// Free ranges, keyed by start, value = end (exclusive).
    free: BTreeMap<u64, u64>,
    /// Freed ranges waiting for flush generation `.0`, oldest generation
    /// first.
    deferred: VecDeque<(u64, Iova, u64)>,
    /// The ranges in `deferred`, keyed by start, value = end (exclusive):
    /// what a free is checked against.
    pending: BTreeMap<u64, u64>,
    /// Bytes currently handed out.
    in_use: u64,
    /// Bytes of the ranges in `deferred`.
    deferred_bytes: u64,
}

impl IovaAllocator {
    /// An allocator over `ranges` (each trimmed to 4 KiB boundaries; ranges
    /// that overlap or touch, in any order, make one space).
    ///
    /// The page at IOVA 0 is never handed out, even when a range starts
    /// there: devices read a zero buffer address as "no buffer" (QEMU's
    /// 82576 skips such an RX descriptor and writes it back empty), and a
    /// zero IOVA cannot be told from an unset field.
    pub fn new(ranges: &[Range<u64>]) -> IovaAllocator {
        let mut a = IovaAllocator {
            space: BTreeMap::new(),
            free: BTreeMap::new(),
            deferred: VecDeque::new(),
            pending: BTreeMap::new(),
            in_use: 0,
            deferred_bytes: 0,
        };
        let mut pages: Vec<(u64, u64)> = ranges
            .iter()
            .filter_map(|r| {
                // `None`: no whole page left in the range.
                let start = checked_align_up(r.start, PAGE_SIZE)?.max(PAGE_SIZE);
                let end = r.end & !(PAGE_SIZE - 1);
                (start < end).then_some((start, end))
            })
            .collect();
        // Sorted and merged first: `free` holds disjoint ranges only.
        pages.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(pages.len());
        for (start, end) in pages {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        for (start, end) in merged {
            a.insert_free(start, end);
        }
        a.space = a.free.clone();
        a
    }

    /// Allocates `size` bytes aligned to `align` (a power of two >= 4 KiB).
    /// A size that no range can hold (even one whose rounding to 4 KiB
    /// would overflow) is [`Error::IovaExhausted`].
    pub fn alloc(&mut self, size: u64, align: u64) -> Result<Iova> {
        if size == 0 {
            return Err(Error::ZeroLength);
        }
        let align = align.max(PAGE_SIZE);
        if !align.is_power_of_two() {
            return Err(Error::BadConfig {
                what: "iova alignment",
                value: align,
            });
        }
        let size = checked_align_up(size, PAGE_SIZE).ok_or(Error::IovaExhausted { size, align })?;
        let found = self.free.iter().find_map(|(&s, &e)| {
            let a = checked_align_up(s, align)?;
            (a.checked_add(size)? <= e).then_some((s, e, a))
        });
        let (s, e, a) = found.ok_or(Error::IovaExhausted { size, align })?;
        self.free.remove(&s);
        if s < a {
            self.free.insert(s, a);
        }
        if a + size < e {
            self.free.insert(a + size, e);
        }
        self.in_use += size;
        Ok(Iova(a))
    }

    /// Returns a range for immediate reuse. A range that is not in use is
    /// refused (see the type docs) and nothing changes.
    pub fn free(&mut self, iova: Iova, size: u64) -> Result<()> {
        let size = self.in_use_range(iova, size)?;
        self.in_use -= size;
        self.insert_free(iova.raw(), iova.raw() + size);
        Ok(())
    }

    /// Returns a range that may be reused only once flush generation `seq`
    /// has completed, in any order of generations: each range becomes
    /// free at the first [`reclaim`](Self::reclaim) that its flush
    /// precedes. Refused as [`free`](Self::free) refuses.
    pub fn free_deferred(&mut self, iova: Iova, size: u64, seq: u64) -> Result<()> {
        let size = self.in_use_range(iova, size)?;
        self.in_use -= size;
        self.deferred_bytes += size;
        // Kept in generation order, which `reclaim` relies on: ranges may
        // come out of it (an unmap of generation g whose free raced with a
        // flush and an unmap of g + 1), and one queued behind a later
        // generation would wait for that one's flush as well. Found from
        // the back: nearly always the last place.
        let at = self
            .deferred
            .iter()
            .rposition(|&(s, ..)| s <= seq)
            .map_or(0, |i| i + 1);
        self.deferred.insert(at, (seq, iova, size));
        self.pending.insert(iova.raw(), iova.raw() + size);
        Ok(())
    }

    /// `size` rounded up to 4 KiB, if `iova..iova + size` can be in use:
    /// page aligned, not empty, no more than the bytes in use, inside the
    /// configured space and overlapping no free range and no range waiting
    /// for its flush.
    fn in_use_range(&self, iova: Iova, size: u64) -> Result<u64> {
        let refuse = Error::IovaNotInUse {
            iova,
            size,
            in_use: self.in_use,
        };
        let start = iova.raw();
        let Some(len) = checked_align_up(size, PAGE_SIZE) else {
            return Err(refuse);
        };
        let Some(end) = start.checked_add(len) else {
            return Err(refuse);
        };
        let inside = self
            .space
            .range(..=start)
            .next_back()
            .is_some_and(|(_, &e)| end <= e);
        let given_back = overlaps(&self.free, start, end) || overlaps(&self.pending, start, end);
        if len == 0 || len > self.in_use || start % PAGE_SIZE != 0 || !inside || given_back {
            return Err(refuse);
        }
        Ok(len)
    }

    /// Moves deferred ranges whose flush has completed to the free set.
    /// Returns how many moved.
    pub fn reclaim(&mut self, flushed_seq: u64) -> usize {
        let mut n = 0;
        while let Some(&(seq, iova, size)) = self.deferred.front() {
            if seq > flushed_seq {
                break;
            }
            self.deferred.pop_front();
            self.deferred_bytes -= size;
            let pending = self.pending.remove(&iova.raw());
            debug_assert_eq!(pending, Some(iova.raw() + size), "deferred {iova}");
            self.insert_free(iova.raw(), iova.raw() + size);
            n += 1;
        }
        n
    }

    /// Ranges waiting for a flush.
    pub fn deferred(&self) -> usize {
        self.deferred.len()
    }

    /// Bytes of the ranges waiting for a flush (freed, not yet reusable).
    pub fn deferred_bytes(&self) -> u64 {
        self.deferred_bytes
    }

    /// Bytes handed out and not freed.
    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    /// Whether `iova..iova+len` overlaps a range waiting for a flush.
    pub fn is_deferred(&self, iova: Iova, len: u64) -> bool {
        overlaps(&self.pending, iova.raw(), iova.raw().saturating_add(len))
    }

    fn insert_free(&mut self, mut start: u64, mut end: u64) {
        if let Some((&ps, &pe)) = self.free.range(..=start).next_back() {
            debug_assert!(pe <= start, "double free of iova {start:#x}");
            if pe == start {
                self.free.remove(&ps);
                start = ps;
            }
        }
        if let Some(&ne) = self.free.get(&end) {
            self.free.remove(&end);
            end = ne;
        }
        self.free.insert(start, end);
    }
}

/// Whether `start..end` overlaps one of `ranges` (disjoint, start -> end
/// exclusive): only the last one starting before `end` can.
fn overlaps(ranges: &BTreeMap<u64, u64>, start: u64, end: u64) -> bool {
    ranges
        .range(..end)
        .next_back()
        .is_some_and(|(_, &e)| e > start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_and_disjoint() {
        let mut a = IovaAllocator::new(&[Range {
            start: 0x1000,
            end: 0x100_0000,
        }]);
        let x = a.alloc(0x3000, 0x1000).unwrap();
        let y = a.alloc(0x10000, 0x10000).unwrap();
        assert_eq!(y.raw() % 0x10000, 0);
        assert!(x.raw() + 0x3000 <= y.raw() || y.raw() + 0x10000 <= x.raw());
        assert_eq!(a.in_use(), 0x13000);
    }

    #[test]
    fn freed_range_is_reused_and_merged() {
        let mut a = IovaAllocator::new(&[Range {
            start: 0x1000,
            end: 0x5000,
        }]);
        let x = a.alloc(0x2000, 0x1000).unwrap();
        let y = a.alloc(0x2000, 0x1000).unwrap();
        assert!(matches!(
            a.alloc(0x1000, 0x1000),
            Err(Error::IovaExhausted { .. })
        ));
        a.free(x, 0x2000).unwrap();
        a.free(y, 0x2000).unwrap();
        // Merged back into one range: a 0x4000 request fits again.
        assert_eq!(a.alloc(0x4000, 0x1000).unwrap(), Iova(0x1000));
    }

    #[test]
    fn deferred_range_is_not_reused_before_its_flush() {
        let mut a = IovaAllocator::new(&[Range {
            start: 0x1000,
            end: 0x3000,
        }]);
        let x = a.alloc(0x2000, 0x1000).unwrap();
        a.free_deferred(x, 0x2000, 5).unwrap();
        assert!(a.is_deferred(x, 0x2000));
        assert!(matches!(
            a.alloc(0x1000, 0x1000),
            Err(Error::IovaExhausted {
                size: 0x1000,
                align: 0x1000
            })
        ));
        assert_eq!(a.reclaim(4), 0);
        assert_eq!(a.reclaim(5), 1);
        assert_eq!(a.alloc(0x2000, 0x1000).unwrap(), x);
    }

    /// Ranges freed out of generation order each become free at their
    /// own flush, and the bytes waiting drop with them.
    #[test]
    fn deferred_ranges_freed_out_of_order_free_at_their_own_flush() {
        let mut a = IovaAllocator::new(&[Range {
            start: 0x1000,
            end: 0x10_0000,
        }]);
        let x = a.alloc(0x1000, 0x1000).unwrap();
        let y = a.alloc(0x2000, 0x1000).unwrap();
        a.free_deferred(y, 0x2000, 6).unwrap();
        a.free_deferred(x, 0x1000, 5).unwrap();
        assert_eq!((a.deferred(), a.deferred_bytes()), (2, 0x3000));
        assert_eq!(a.reclaim(5), 1);
        assert_eq!(
            (a.is_deferred(x, 0x1000), a.is_deferred(y, 0x2000)),
            (false, true)
        );
        assert_eq!(a.deferred_bytes(), 0x2000);
        assert_eq!(a.reclaim(6), 1);
        assert_eq!(a.deferred_bytes(), 0);
    }

    #[test]
    fn page_zero_is_never_handed_out() {
        let mut a = IovaAllocator::new(&[Range {
            start: 0,
            end: 0x3000,
        }]);
        assert_eq!(a.alloc(0x1000, 0x1000).unwrap(), Iova(0x1000));
        assert_eq!(a.alloc(0x1000, 0x1000).unwrap(), Iova(0x2000));
        assert!(a.alloc(0x1000, 0x1000).is_err());
        // A range of page 0 alone holds nothing.
        let mut b = IovaAllocator::new(&[Range {
            start: 0,
            end: 0x1000,
        }]);
        assert!(b.alloc(0x1000, 0x1000).is_err());
    }

    #[test]
    fn zero_size_is_an_error() {
        let mut a = IovaAllocator::new(&[Range {
            start: 0x1000,
            end: 0x3000,
        }]);
        assert!(matches!(a.alloc(0, 4096), Err(Error::ZeroLength)));
    }

    const SPACE: Range<u64> = 0x1000..0x10_0000;
    const TOP: Range<u64> = u64::MAX - 10..u64::MAX;

    /// A size whose rounding to 4 KiB overflows is exhaustion, not a panic.
    #[test]
    fn huge_size_is_exhaustion() {
        let mut a = IovaAllocator::new(&[SPACE]);
        for size in [u64::MAX, u64::MAX - 1, 1 << 63] {
            assert!(matches!(
                a.alloc(size, 0x1000),
                Err(Error::IovaExhausted { size: s, .. }) if s >= size
            ));
        }
        assert!(matches!(
            a.alloc(0x1000, 1 << 63),
            Err(Error::IovaExhausted { .. })
        ));
        // A range whose start cannot be rounded up holds nothing.
        let mut b = IovaAllocator::new(&[TOP]);
        assert!(b.alloc(0x1000, 0x1000).is_err());
    }

    /// Giving back a range that is not in use is refused with the numbers
    /// and changes nothing (it used to underflow `in_use`).
    #[test]
    fn free_of_a_range_not_in_use_is_refused() {
        let mut a = IovaAllocator::new(&[SPACE]);
        let not_in_use = |r: Result<()>| matches!(r, Err(Error::IovaNotInUse { .. }));
        // Nothing allocated yet.
        assert!(matches!(
            a.free(Iova(0x2000), 0x1000),
            Err(Error::IovaNotInUse {
                iova: Iova(0x2000),
                size: 0x1000,
                in_use: 0
            })
        ));
        assert!(not_in_use(a.free_deferred(Iova(0x2000), 0x1000, 1)));
        let x = a.alloc(0x2000, 0x1000).unwrap();
        // Free range, overlapping a free range, past the end, past the
        // space, unaligned, empty, more than in use.
        assert!(not_in_use(a.free(Iova(x.raw() + 0x2000), 0x1000)));
        assert!(not_in_use(a.free(Iova(x.raw() + 0x1000), 0x2000)));
        assert!(not_in_use(a.free(Iova(!0xfff), 0x2000)));
        assert!(not_in_use(a.free(Iova(0x10_0000), 0x1000)));
        assert!(not_in_use(a.free(Iova(x.raw() + 1), 0x1000)));
        assert!(not_in_use(a.free(x, 0)));
        assert!(not_in_use(a.free(x, u64::MAX)));
        assert_eq!(a.in_use(), 0x2000);
        a.free(x, 0x2000).unwrap();
        // Twice: refused.
        assert!(not_in_use(a.free(x, 0x2000)));
        assert_eq!(a.in_use(), 0);
        // Everything is one free range again.
        assert_eq!(a.alloc(0xff000, 0x1000).unwrap(), Iova(0x1000));
    }

    /// A range waiting for its flush is not in use: a second free of it
    /// (deferred or not), or a free overlapping it, is refused and changes
    /// nothing, even while other bytes are in use (the byte count alone
    /// let it through, and the flush then gave the range back twice).
    #[test]
    fn free_of_a_range_waiting_for_its_flush_is_refused() {
        let mut a = IovaAllocator::new(&[SPACE]);
        let x = a.alloc(0x2000, 0x1000).unwrap();
        let y = a.alloc(0x2000, 0x1000).unwrap();
        assert_eq!(y.raw(), x.raw() + 0x2000);
        a.free_deferred(x, 0x2000, 1).unwrap();
        let refused = |r: Result<()>, iova: Iova, size: u64| {
            matches!(r, Err(Error::IovaNotInUse { iova: i, size: s, in_use: 0x2000 })
                if i == iova && s == size)
        };
        assert!(refused(a.free_deferred(x, 0x2000, 2), x, 0x2000));
        assert!(refused(a.free(x, 0x2000), x, 0x2000));
        // Its second page alone, and a range across its end into `y`.
        let second = Iova(x.raw() + 0x1000);
        assert!(refused(a.free(second, 0x1000), second, 0x1000));
        assert!(refused(a.free_deferred(second, 0x2000, 2), second, 0x2000));
        assert_eq!((a.in_use(), a.deferred()), (0x2000, 1));
        assert!(a.is_deferred(x, 0x2000) && !a.is_deferred(y, 0x2000));
        // `y` is still in use and can go back.
        a.free_deferred(y, 0x2000, 2).unwrap();
        assert_eq!(a.reclaim(2), 2);
        assert_eq!((a.in_use(), a.deferred()), (0, 0));
        assert!(!a.is_deferred(x, 0x4000));
        // Given back once each: the space is one free range again.
        assert_eq!(a.alloc(0xff000, 0x1000).unwrap(), Iova(0x1000));
    }
}
