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
//! had taken the lock first. Memory a translation points at stays
//! allocated for the same reason as before: a device access translates
//! inside the mapper's fence, and the unmap clears the entry before it
//! waits in the fence ([`Fence::quiesce`](super::fence::Fence)), so an
//! access that enters the fence after that wait reads the cleared entry
//! (the fence's lock orders the two), and one that entered before holds the
//! unmap up until it ends.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::Dir;

/// Entries in the table: a power of two.
const SEEN: usize = 256;
/// Set in every filled entry (page 0 with no direction is not a fill).
const FILLED: u64 = 1 << 2;
/// Where the page number starts in an entry; below it, `FILLED` and the
/// two direction bits.
const PAGE_AT: u32 = 3;

/// The table; see the module docs.
#[derive(Debug)]
pub(super) struct Seen([AtomicU64; SEEN]);

impl Default for Seen {
    fn default() -> Seen {
        Seen(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

/// Page numbers this table can hold: 4 KiB pages of a 64-bit address.
const _: () = assert!(64 - 12 + PAGE_AT <= 64);

impl Seen {
    fn slot(&self, page: u64) -> &AtomicU64 {
        &self.0[(page as usize) & (SEEN - 1)]
    }

    /// The directions `page`'s live mappings allow, if the table has the
    /// page; `None` says nothing (look in the map).
    #[inline]
    pub(super) fn get(&self, page: u64) -> Option<Dir> {
        let e = self.slot(page).load(Relaxed);
        (e & FILLED != 0 && e >> PAGE_AT == page).then(|| Dir::from_bits_truncate(e as u8))
    }

    /// Records that `page`'s live mappings allow `dir` (not empty).
    ///
    /// Only with the mapper's lock held, and `dir` read under it.
    pub(super) fn fill(&self, page: u64, dir: Dir) {
        debug_assert!(!dir.is_empty() && page >> (64 - PAGE_AT) == 0);
        let e = page << PAGE_AT | FILLED | u64::from(dir.bits());
        self.slot(page).store(e, Relaxed);
    }

    /// Forgets the pages `first..first + n`, whose mappings changed.
    ///
    /// Only with the mapper's lock held, the one the change was made under.
    pub(super) fn forget(&self, first: u64, n: u64) {
        for page in first..first.saturating_add(n) {
            let s = self.slot(page);
            let e = s.load(Relaxed);
            if e & FILLED != 0 && e >> PAGE_AT == page {
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
        let top = u64::MAX >> PAGE_AT;
        for p in [1, 2, 3, top] {
            s.fill(p, Dir::FROM_DEVICE);
        }
        // Page 2 + SEEN shares page 2's entry: forgetting it spares page 2.
        s.forget(2 + SEEN as u64, 1);
        assert_eq!(s.get(2), Some(Dir::FROM_DEVICE));
        s.forget(1, 2);
        assert_eq!((s.get(1), s.get(2)), (None, None));
        assert_eq!(s.get(3), Some(Dir::FROM_DEVICE));
        // The highest page number round-trips, and a range ending at the
        // top of the address space does not overflow.
        assert_eq!(s.get(top), Some(Dir::FROM_DEVICE));
        s.forget(top, 2);
        assert_eq!(s.get(top), None);
    }
}
