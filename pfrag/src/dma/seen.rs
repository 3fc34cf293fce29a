//! Pages [`Identity`](super::Identity) knows to be mapped, read without its
//! lock.
//!
//! A device model translates once or more per packet, and with the IOMMU
//! off each translation used to take the mapper's lock and look the page
//! up in a hash map. [`Seen`] is a small direct-mapped table beside the
//! map: entry `p % SEEN` holds page `p` and the directions its live
//! mappings allow, or nothing. A translation that finds its page there
//! needs one atomic load; one that does not takes the lock, looks the page
//! up, and (if it is mapped) writes the entry.
//!
//! The entries stay exact because they are only ever written with the
//! mapper's lock held:
//! - a miss fills an entry from the map it has just read;
//! - a map or unmap, having changed a page's mappings, clears the page's
//!   entry before it lets go of the lock.
//!
//! So an entry names its page's directions as they were at some moment
//! since the last change of that page, which is what the lock gave: a
//! translation racing an unmap may see the page as mapped, exactly as if it
//! had taken the lock first.
//!
//! The lock also ordered a device access after the map that made its page
//! visible, and so after the CPU's writes before that map. A hit keeps
//! that order: a fill is a release store made under the lock, after the
//! map released it, and a hit is an acquire load of the fill. (Without it,
//! a second device thread that hit an entry the first had filled would
//! read bytes the CPU wrote before the map without ordering: a data race
//! Miri reports.)
//!
//! Memory a translation points at stays
//! allocated for the same reason as before: a device access translates
//! inside the mapper's fence, and the unmap clears the entry before it
//! waits in the fence ([`Fence::quiesce`](super::fence::Fence)), so an
//! access that enters the fence after that wait reads the cleared entry
//! (the fence's lock orders the two), and one that entered before holds the
//! unmap up until it ends.

use std::sync::atomic::{
    AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};

use super::Dir;
use crate::addr::PAGE_SHIFT;

/// Entries in the table: a power of two.
const SEEN: usize = 256;
/// Set in every filled entry (page 0 with no direction is not a fill).
const FILLED: u64 = 1 << 2;
/// Where the page number starts in an entry; below it, `FILLED` and the
/// two direction bits.
const PAGE_AT: u32 = 3;

/// The table; see the module docs.
pub(super) struct Seen([AtomicU64; SEEN]);

impl std::fmt::Debug for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let filled = self.0.iter().filter(|e| e.load(Relaxed) & FILLED != 0);
        f.debug_struct("Seen")
            .field("filled", &filled.count())
            .finish()
    }
}

impl Default for Seen {
    fn default() -> Seen {
        Seen(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

/// Page numbers this table can hold: 4 KiB pages of a 64-bit address.
const _: () = assert!(64 - PAGE_SHIFT + PAGE_AT <= 64);

impl Seen {
    fn slot(&self, page: u64) -> &AtomicU64 {
        &self.0[(page as usize) & (SEEN - 1)]
    }

    /// The directions `page`'s live mappings allow, if the table has the
    /// page; `None` says nothing (look in the map).
    #[inline]
    pub(super) fn get(&self, page: u64) -> Option<Dir> {
        // Acquire: pairs with `fill`'s release (module docs).
        let e = self.slot(page).load(Acquire);
        (e & FILLED != 0 && e >> PAGE_AT == page).then(|| Dir::from_bits_truncate(e as u8))
    }

    /// Records that `page`'s live mappings allow `dir` (not empty).
    ///
    /// Only with the mapper's lock held, and `dir` read under it.
    pub(super) fn fill(&self, page: u64, dir: Dir) {
        debug_assert!(!dir.is_empty() && page >> (64 - PAGE_AT) == 0);
        let e = page << PAGE_AT | FILLED | u64::from(dir.bits());
        // Release: a hit on this entry then happens after the lock's
        // holders before us, the map of `page` among them (module docs).
        self.slot(page).store(e, Release);
    }

    /// Forgets the pages `first..first + n`, whose mappings changed.
    ///
    /// Only with the mapper's lock held, the one the change was made under.
    pub(super) fn forget(&self, first: u64, n: u64) {
        let end = first.saturating_add(n);
        // Consecutive pages fall in distinct entries, so the entries of the
        // first `SEEN` pages are every entry a page of the range can hold:
        // a range wider than the table looks at each entry once.
        for page in first..first.saturating_add(n.min(SEEN as u64)) {
            let s = self.slot(page);
            let e = s.load(Relaxed);
            if e & FILLED != 0 && (first..end).contains(&(e >> PAGE_AT)) {
                // A clear needs no release: a hit that reads it finds
                // nothing.
                s.store(0, Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_answers_only_for_its_own_page() {
        let s = Seen::default();
        assert_eq!(s.get(0), None, "an empty entry is not page 0");
        s.fill(7, Dir::TO_DEVICE);
        assert_eq!(s.get(7), Some(Dir::TO_DEVICE));
        // The page that shares the entry is not taken for page 7.
        assert_eq!(s.get(7 + SEEN as u64), None);
        s.fill(7 + SEEN as u64, Dir::BIDIRECTIONAL);
        assert_eq!(s.get(7), None);
        assert_eq!(s.get(7 + SEEN as u64), Some(Dir::BIDIRECTIONAL));
    }

    #[test]
    fn forget_clears_its_pages_and_spares_the_others() {
        let s = Seen::default();
        // The last 4 KiB page of a 64-bit address space.
        let top = u64::MAX >> PAGE_SHIFT;
        for p in [1, 2, 3, top] {
            s.fill(p, Dir::FROM_DEVICE);
        }
        // Page 2 + SEEN shares page 2's entry: forgetting it spares page 2.
        s.forget(2 + SEEN as u64, 1);
        assert_eq!(s.get(2), Some(Dir::FROM_DEVICE));
        s.forget(1, 2);
        assert_eq!((s.get(1), s.get(2)), (None, None));
        assert_eq!(s.get(3), Some(Dir::FROM_DEVICE));
        // The highest page number round-trips, and a range whose end does
        // not fit in 64 bits reaches to the end (no overflow panic).
        assert_eq!(s.get(top), Some(Dir::FROM_DEVICE));
        s.forget(top, u64::MAX);
        assert_eq!(s.get(top), None);
    }

    #[test]
    fn a_range_wider_than_the_table_forgets_just_its_pages() {
        let s = Seen::default();
        let (first, n) = (100, 3 * SEEN as u64);
        // Two pages just outside the range and three inside, each in an
        // entry of its own.
        let pages = [
            first - 2,
            first + n,
            first + 1,
            first + n / 2,
            first + n - 1,
        ];
        let slots: std::collections::HashSet<_> = pages.iter().map(|p| p % SEEN as u64).collect();
        assert_eq!(slots.len(), pages.len());
        for p in pages {
            s.fill(p, Dir::TO_DEVICE);
        }
        s.forget(first, n);
        let left = pages.map(|p| s.get(p).is_some());
        assert_eq!(left, [true, true, false, false, false]);
    }
}
