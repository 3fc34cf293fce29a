//! A fully associative IOTLB with LRU replacement, for [`super::SoftIommu`].

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::addr::{HUGE_PAGE_SIZE, PAGE_SHIFT, PAGE_SIZE};

/// A multiplicative hasher for page-number keys (the std SipHash would cost
/// more than the lookup it serves).
#[derive(Default)]
pub(super) struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// Tag bit that marks a 2 MiB key apart from a 4 KiB key.
const HUGE_TAG: u64 = 1 << 63;

/// One cached translation.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    /// Host address of the start of the page.
    pub addr: usize,
    /// Permission bits (the `Dir` bits).
    pub perms: u8,
    /// Whether this is a 2 MiB entry.
    pub huge: bool,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    key: u64,
    entry: Entry,
    stamp: u64,
}

/// Positions remembered for the 4 KiB pages looked up last, by page
/// number modulo this: enough that a device's ring pages and the pages of
/// the buffers in flight rarely share one (with 4, one lookup in six of
/// the virtio-net model's went on to the hash; with 64, almost none).
const RECENT: usize = 64;

/// The IOTLB. Invariant: the keys in `slots` are distinct, `index` maps
/// each to its position, and `slots.len() <= cap`.
pub(super) struct Iotlb {
    cap: usize,
    index: HashMap<u64, usize, BuildHasherDefault<PageHasher>>,
    slots: Vec<Slot>,
    clock: u64,
    /// Where 4 KiB keys were found last, a hint checked before the hash
    /// lookup: `recent[k % RECENT]` is the position key `k` had. A hint
    /// counts only if that position holds the key now (keys are distinct,
    /// so it is the position `index` gives); a stale one costs a hash
    /// lookup, never a wrong entry.
    recent: [usize; RECENT],
}

impl Iotlb {
    pub fn new(cap: usize) -> Iotlb {
        Iotlb {
            cap: cap.max(1),
            index: HashMap::with_capacity_and_hasher(cap * 2, Default::default()),
            slots: Vec::with_capacity(cap),
            clock: 0,
            recent: [0; RECENT],
        }
    }

    fn key(iova: u64, huge: bool) -> u64 {
        if huge {
            (iova / HUGE_PAGE_SIZE) | HUGE_TAG
        } else {
            iova >> PAGE_SHIFT
        }
    }

    /// The cached translation covering `iova`, refreshing its LRU stamp.
    pub fn lookup(&mut self, iova: u64) -> Option<Entry> {
        self.clock += 1;
        let small = Self::key(iova, false);
        let hint = small as usize % RECENT;
        let i = match self.slots.get(self.recent[hint]) {
            // The 4 KiB key first, as below: the position `index` holds
            // for it.
            Some(s) if s.key == small => self.recent[hint],
            _ => {
                let i = self.find(iova)?;
                if self.slots[i].key == small {
                    self.recent[hint] = i;
                }
                i
            }
        };
        self.slots[i].stamp = self.clock;
        Some(self.slots[i].entry)
    }

    /// The position of the entry covering `iova`: its 4 KiB key's, else its
    /// 2 MiB key's.
    fn find(&self, iova: u64) -> Option<usize> {
        [false, true]
            .into_iter()
            .find_map(|huge| self.index.get(&Self::key(iova, huge)).copied())
    }

    /// Caches a translation for the page containing `iova`, evicting the
    /// least recently used entry when full.
    pub fn insert(&mut self, iova: u64, entry: Entry) {
        self.clock += 1;
        let key = Self::key(iova, entry.huge);
        let slot = Slot {
            key,
            entry,
            stamp: self.clock,
        };
        if self.slots.len() < self.cap {
            self.index.insert(key, self.slots.len());
            self.slots.push(slot);
            return;
        }
        let (victim, _) = self
            .slots
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| s.stamp)
            .expect("cap >= 1");
        self.index.remove(&self.slots[victim].key);
        self.index.insert(key, victim);
        self.slots[victim] = slot;
    }

    /// Drops every entry that overlaps `iova..iova+len`.
    pub fn invalidate(&mut self, iova: u64, len: u64) {
        let end = iova + len;
        let mut i = 0;
        while i < self.slots.len() {
            let s = self.slots[i];
            let (start, size) = if s.entry.huge {
                ((s.key & !HUGE_TAG) * HUGE_PAGE_SIZE, HUGE_PAGE_SIZE)
            } else {
                (s.key << PAGE_SHIFT, PAGE_SIZE)
            };
            if start < end && iova < start + size {
                self.index.remove(&s.key);
                self.slots.swap_remove(i);
                if i < self.slots.len() {
                    self.index.insert(self.slots[i].key, i);
                }
            } else {
                i += 1;
            }
        }
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.index.clear();
        self.slots.clear();
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(addr: usize) -> Entry {
        Entry {
            addr,
            perms: 1,
            huge: false,
        }
    }

    #[test]
    fn lru_evicts_least_recently_used() {
        let mut t = Iotlb::new(2);
        t.insert(0x1000, e(1));
        t.insert(0x2000, e(2));
        assert!(t.lookup(0x1000).is_some()); // 0x2000 is now LRU
        t.insert(0x3000, e(3));
        assert!(t.lookup(0x2000).is_none());
        assert!(t.lookup(0x1000).is_some());
        assert!(t.lookup(0x3000).is_some());
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn a_stale_hint_never_gives_another_pages_entry() {
        // Pages 1, b and c share a hint.
        let at = |page: u64| page << PAGE_SHIFT;
        let (a, b, c) = (at(1), at(1 + RECENT as u64), at(1 + 2 * RECENT as u64));
        let mut t = Iotlb::new(2);
        t.insert(a, e(1));
        assert_eq!(t.lookup(a).map(|e| e.addr), Some(1));
        // b takes position 0 once page 1 is gone.
        t.invalidate(a, PAGE_SIZE);
        t.insert(b, e(2));
        assert!(t.lookup(a).is_none());
        assert_eq!(t.lookup(b).map(|e| e.addr), Some(2));
        // Eviction puts c where b was, the position the hint names.
        t.insert(a, e(11));
        t.insert(c, e(3));
        assert!(t.lookup(b).is_none(), "b was least recent");
        assert_eq!(t.lookup(a).map(|e| e.addr), Some(11));
        assert_eq!(t.lookup(c).map(|e| e.addr), Some(3));
        assert_eq!(t.lookup(c).map(|e| e.addr), Some(3));
        t.clear();
        assert!(t.lookup(c).is_none());
    }

    #[test]
    fn invalidate_drops_overlapping_entries_only() {
        let mut t = Iotlb::new(8);
        t.insert(0x1000, e(1));
        t.insert(0x2000, e(2));
        t.insert(0x3000, e(3));
        t.insert(
            0x20_0000,
            Entry {
                addr: 4,
                perms: 1,
                huge: true,
            },
        );
        t.invalidate(0x2000, 0x1000);
        assert!(t.lookup(0x2000).is_none());
        assert!(t.lookup(0x1000).is_some());
        assert!(t.lookup(0x3000).is_some());
        t.invalidate(0x3f_f000, 0x2000);
        assert!(t.lookup(0x20_1000).is_none());
    }
}
