//! No IOMMU: the device uses host addresses directly.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasherDefault;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use super::granules::{cut, Span};
use super::iotlb::PageHasher;
use super::seen::Seen;
use super::{
    device_read, device_store_u32, device_write, Dir, DmaMapper, Fault, Fence, IovaSpace, MapStats,
    Mapping, PageSizes, Translate, Translation, Unmapped,
};
use crate::addr::{Iova, VirtAddr, PAGE_SHIFT, PAGE_SIZE};
use crate::error::{Error, OsAdvice, Result};

/// The most live mappings one page may have under [`Identity`]: it counts
/// them in 16 bits, and refuses one more with `EOVERFLOW`.
pub const MAX_PAGE_MAPPINGS: u16 = u16::MAX;

/// The no-IOMMU mapper: IOVA = host address. Map and unmap calls are still
/// counted (a driver still makes them, as `dma_map_*` does with the direct
/// mapping), so a measurement can tell how many calls a policy makes even
/// without an IOMMU.
///
/// Mappings may overlap, as with a passthrough IOMMU, where every
/// `dma_map_*` of a page succeeds: frags that share a page each map the
/// whole page at its own address. Each page counts its live mappings, and
/// stays mapped until the last of them is unmapped. An unmap removes one
/// mapping from each page of its range: a mapping made with exactly that
/// range, or lying inside it, if there is one; else the range cuts the
/// mapping it overlaps (the oldest first), leaving its front, its back, or
/// both. A page allows the union of the directions of its live mappings.
/// A page with [`MAX_PAGE_MAPPINGS`] live mappings refuses another
/// (`EOVERFLOW`, with the page and the count); an unmap of a range with a
/// page not mapped at all is refused (`ENOENT`). Either refusal changes
/// nothing.
///
/// A real system without an IOMMU lets the NIC reach any memory. A model of
/// it in safe Rust may not: the device side ([`Translate`]) reaches only
/// pages that are mapped now (no IOTLB, no counters), and anything else is
/// a fault. A translation reads a small table of pages known to be mapped
/// without taking the mapper's lock, and looks the page up under the lock
/// only when the table does not have it; the table is kept exact (see
/// `seen.rs`).
#[derive(Debug, Default)]
pub struct Identity {
    map_calls: AtomicU64,
    unmap_calls: AtomicU64,
    faults: AtomicU64,
    state: Mutex<State>,
    /// Pages known to be mapped: written only under `state`'s lock.
    seen: Seen,
    fence: Fence,
}

/// The live mappings of one page: how many, and how many of them allow
/// each direction.
#[derive(Clone, Copy, Debug, Default)]
struct Refs {
    n: u16,
    to: u16,
    from: u16,
}

impl Refs {
    fn dir(self) -> Dir {
        let mut d = Dir::empty();
        d.set(Dir::TO_DEVICE, self.to > 0);
        d.set(Dir::FROM_DEVICE, self.from > 0);
        d
    }
    /// One more mapping (the caller checked `n < MAX_PAGE_MAPPINGS`).
    fn add(&mut self, dir: Dir) {
        self.n += 1;
        self.to += u16::from(dir.contains(Dir::TO_DEVICE));
        self.from += u16::from(dir.contains(Dir::FROM_DEVICE));
    }
    /// One mapping fewer (one of `dir` that was counted).
    fn sub(&mut self, dir: Dir) {
        self.n -= 1;
        self.to -= u16::from(dir.contains(Dir::TO_DEVICE));
        self.from -= u16::from(dir.contains(Dir::FROM_DEVICE));
    }
}

#[derive(Debug, Default)]
struct State {
    /// Mapped pages (page number -> its live mappings).
    pages: HashMap<u64, Refs, BuildHasherDefault<PageHasher>>,
    /// The mappings as made, cut by partial unmaps: (first IOVA, age) ->
    /// (length, direction). The pages' counts are the sum of these.
    made: BTreeMap<(u64, u64), (u64, Dir)>,
    /// Age of the next mapping.
    next: u64,
    /// The longest mapping ever made: how far below an unmapped range a
    /// mapping reaching into it may start.
    longest: u64,
}

impl State {
    fn map(&mut self, m: &Mapping) -> Result<()> {
        let (first, n) = (m.iova.page(), m.len >> PAGE_SHIFT);
        let full = (first..first + n)
            .find(|p| self.pages.get(p).is_some_and(|r| r.n == MAX_PAGE_MAPPINGS));
        if let Some(p) = full {
            let why = format!(
                "page {:#x} has {MAX_PAGE_MAPPINGS} live mappings, the most one page may have",
                p << PAGE_SHIFT
            );
            return Err(Error::Map {
                iova: m.iova,
                len: m.len,
                source: OsAdvice::io(libc::EOVERFLOW, why),
            });
        }
        for p in first..first + n {
            self.pages.entry(p).or_default().add(m.dir);
        }
        self.made.insert((m.iova.raw(), self.next), (m.len, m.dir));
        self.next += 1;
        self.longest = self.longest.max(m.len);
        Ok(())
    }

    /// Removes one mapping from each page of `start..start + len` (see
    /// [`Identity`]), or nothing and `ENOENT` if a page is not mapped.
    fn unmap(&mut self, start: u64, len: u64) -> Result<(), i32> {
        let (first, n, end) = (start >> PAGE_SHIFT, len >> PAGE_SHIFT, start + len);
        if !(first..first + n).all(|p| self.pages.contains_key(&p)) {
            return Err(libc::ENOENT);
        }
        // The mappings reaching into the range, the best to remove first:
        // those inside it (the earliest and longest first), then the
        // oldest of those it cuts. A mapping made with exactly the range
        // would come first: found directly, it spares the scan.
        let exact = self
            .made
            .range((start, 0)..=(start, u64::MAX))
            .find(|(_, &(l, _))| l == len);
        let lo = start.saturating_sub(self.longest);
        let mut cands: Vec<((u64, u64), (u64, Dir))> = match exact {
            Some((&k, &v)) => vec![(k, v)],
            None => self
                .made
                .range((lo, 0)..(end, 0))
                .filter(|(&(s, _), &(l, _))| s + l > start)
                .map(|(&k, &v)| (k, v))
                .collect(),
        };
        cands.sort_by_key(|&((s, age), (l, _))| {
            if s >= start && s + l <= end {
                (0, s, Reverse(l), age)
            } else {
                (1, 0, Reverse(0), age)
            }
        });
        // Each page goes from the first candidate that covers it.
        let mut runs: Vec<Vec<Span>> = vec![Vec::new(); cands.len()];
        for at in (first..first + n).map(|p| p << PAGE_SHIFT) {
            let Some(i) = cands
                .iter()
                .position(|&((s, _), (l, _))| s <= at && at - s < l)
            else {
                return Err(libc::ENOENT);
            };
            match runs[i].last_mut() {
                Some(r) if r.0 + r.1 == at => r.1 += PAGE_SIZE,
                _ => runs[i].push((at, PAGE_SIZE)),
            }
        }
        for (((s, age), (l, dir)), runs) in cands.into_iter().zip(runs) {
            if runs.is_empty() {
                continue;
            }
            self.made.remove(&(s, age));
            let mut left = vec![(s, l)];
            for &u in &runs {
                left = left.into_iter().flat_map(|m| cut(m, u)).flatten().collect();
                for p in (u.0 >> PAGE_SHIFT)..((u.0 + u.1) >> PAGE_SHIFT) {
                    let gone = self.pages.get_mut(&p).map(|r| {
                        r.sub(dir);
                        r.n == 0
                    });
                    if gone == Some(true) {
                        self.pages.remove(&p);
                    }
                }
            }
            for (ps, pl) in left {
                self.made.insert((ps, age), (pl, dir));
            }
        }
        Ok(())
    }
}

impl Identity {
    /// A new identity mapper.
    pub fn new() -> Identity {
        Identity::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update completes before unlocking (checks come first).
        crate::sync::lock_std(&self.state)
    }

    /// The directions `page`'s live mappings allow, from the map, which
    /// the table of pages known to be mapped then remembers; `None` if the
    /// page is not mapped.
    #[cold]
    fn look_up(&self, page: u64) -> Option<Dir> {
        let st = self.lock();
        let dir = st.pages.get(&page).map(|r| r.dir())?;
        self.seen.fill(page, dir);
        Some(dir)
    }

    /// 4 KiB pages mapped now (a page with several live mappings counts
    /// once).
    pub fn mapped_pages(&self) -> u64 {
        self.lock().pages.len() as u64
    }
}

fn einval(iova: Iova, len: u64) -> Error {
    Error::Map {
        iova,
        len,
        source: io::Error::from_raw_os_error(libc::EINVAL),
    }
}

impl DmaMapper for Identity {
    unsafe fn map(&self, m: &Mapping) -> Result<()> {
        let aligned = m.len > 0 && (m.iova.raw() | m.len) % PAGE_SIZE == 0;
        let end = m.iova.raw().checked_add(m.len);
        if m.iova.raw() != m.addr.raw() as u64
            || !aligned
            || end.is_none()
            || !m.dir.intersects(Dir::BIDIRECTIONAL)
        {
            return Err(einval(m.iova, m.len));
        }
        let mut st = self.lock();
        st.map(m)?;
        // Before the lock goes: the pages' directions changed.
        self.seen.forget(m.iova.page(), m.len >> PAGE_SHIFT);
        drop(st);
        self.map_calls.fetch_add(1, Relaxed);
        Ok(())
    }

    fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped> {
        let unmap_err = |code| Error::Unmap {
            iova,
            len,
            source: io::Error::from_raw_os_error(code),
        };
        if len == 0 || (iova.raw() | len) % PAGE_SIZE != 0 || iova.raw().checked_add(len).is_none()
        {
            return Err(unmap_err(libc::EINVAL));
        }
        let mut st = self.lock();
        st.unmap(iova.raw(), len).map_err(unmap_err)?;
        // Before the lock goes, and so before the fence's wait: a device
        // access that starts after the wait cannot find these pages.
        self.seen.forget(iova.page(), len >> PAGE_SHIFT);
        drop(st);
        self.unmap_calls.fetch_add(1, Relaxed);
        self.fence.quiesce();
        Ok(Unmapped::Flushed)
    }
    fn page_sizes(&self) -> PageSizes {
        PageSizes::SIZE_4K | PageSizes::SIZE_2M
    }
    fn iova_space(&self) -> IovaSpace {
        IovaSpace::Identity
    }
    fn flushed_seq(&self) -> u64 {
        0
    }
    fn flush(&self) -> Result<()> {
        // Nothing is deferred, but a flush still returns only once every
        // device access and `Hold` that started before it has ended, as
        // `Translate` promises.
        self.fence.quiesce();
        Ok(())
    }
    fn stats(&self) -> MapStats {
        MapStats {
            map_calls: self.map_calls.load(Relaxed),
            unmap_calls: self.unmap_calls.load(Relaxed),
            faults: self.faults.load(Relaxed),
            ..MapStats::default()
        }
    }
}

// SAFETY: a translation names the mapped page's own memory (the `unsafe
// map` caller keeps it allocated until the unmap), at least one byte of it,
// inside the page; unmaps and flushes wait in the fence for every `Hold`
// and device access; the accesses go through `translate`.
unsafe impl Translate for Identity {
    fn translate(&self, iova: Iova, access: Dir) -> Result<Translation, Fault> {
        let page = iova.page();
        let dir = self.seen.get(page).or_else(|| self.look_up(page));
        match dir {
            Some(d) if d.contains(access) => Ok(Translation {
                addr: VirtAddr(iova.raw() as usize),
                len: PAGE_SIZE - (iova.raw() & (PAGE_SIZE - 1)),
            }),
            _ => {
                self.faults.fetch_add(1, Relaxed);
                Err(Fault { iova, access })
            }
        }
    }
    unsafe fn hold(&self) -> super::Hold<'_> {
        self.fence.hold()
    }
    unsafe fn read(&self, iova: Iova, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), Fault> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { device_read(&self.fence, |i, d| self.translate(i, d), iova, len, f) }
    }
    unsafe fn write(&self, iova: Iova, src: &[u8]) -> Result<(), Fault> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { device_write(&self.fence, |i, d| self.translate(i, d), iova, src) }
    }
    unsafe fn write_u32(&self, iova: Iova, v: u32) -> Result<(), Fault> {
        // An unaligned store is refused there, counted here.
        let unaligned = |f| {
            self.faults.fetch_add(1, Relaxed);
            f
        };
        let translate = |i, d| self.translate(i, d);
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { device_store_u32(&self.fence, translate, unaligned, iova, v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Region;

    /// The first page of `r`, for the device to read, at its own address.
    fn page_to_device(r: &Region) -> Mapping {
        Mapping {
            iova: Iova(r.addr().raw() as u64),
            addr: r.addr(),
            len: 4096,
            dir: Dir::TO_DEVICE,
            huge: false,
        }
    }

    #[test]
    fn device_reaches_only_mapped_pages() {
        let id = Identity::new();
        let r = Region::new(2 * 4096, 4096, false).unwrap();
        let at = Iova(r.addr().raw() as u64);
        // An address nobody mapped: a fault, never a dereference.
        // SAFETY: (each device access here) no reference to `r`'s bytes
        // is alive; the region is only mapped and unmapped.
        unsafe {
            assert!(id.read(Iova(0x1000), 8, &mut |_| {}).is_err());
            assert!(id.read(at, 8, &mut |_| {}).is_err());
        }
        let m = page_to_device(&r);
        // SAFETY: `r` outlives the mapping (unmapped below, before drop).
        unsafe { id.map(&m) }.unwrap();
        let mut seen = 0;
        // SAFETY: as above.
        unsafe { id.read(at, 4096, &mut |s| seen += s.len()) }.unwrap();
        assert_eq!(seen, 4096);
        // The second page is not mapped; writing the first is not allowed.
        // SAFETY: as above.
        unsafe {
            assert!(id.read(at, 4097, &mut |_| {}).is_err());
            assert!(id.write(at, &[1]).is_err());
        }
        id.unmap(at, 4096).unwrap();
        // SAFETY: as above.
        assert!(unsafe { id.read(at, 1, &mut |_| {}) }.is_err());
        assert_eq!(id.stats().faults, 5);
        assert_eq!(id.mapped_pages(), 0);
    }

    #[test]
    fn unmap_of_unmapped_range_fails_and_keeps_others() {
        let id = Identity::new();
        let r = Region::new(4096, 4096, false).unwrap();
        let at = Iova(r.addr().raw() as u64);
        let m = page_to_device(&r);
        // SAFETY: `r` outlives the mapping.
        unsafe { id.map(&m) }.unwrap();
        assert_eq!(id.unmap(at, 8192).unwrap_err().errno(), Some(libc::ENOENT));
        assert!(id.translate(at, Dir::TO_DEVICE).is_ok());
        id.unmap(at, 4096).unwrap();
    }

    /// `pages` pages of `r` from page `first`, at their own address.
    fn pages(r: &Region, first: usize, pages: usize, dir: Dir) -> Mapping {
        let addr = r.addr().offset(first * 4096);
        Mapping {
            iova: Iova(addr.raw() as u64),
            addr,
            len: pages as u64 * 4096,
            dir,
            huge: false,
        }
    }

    fn page_at(r: &Region, page: usize) -> Iova {
        Iova(r.addr().offset(page * 4096).raw() as u64)
    }

    /// Which of `n` pages of `r` the device may reach for `access`.
    fn reachable(id: &Identity, r: &Region, n: usize, access: Dir) -> Vec<bool> {
        (0..n)
            .map(|p| id.translate(page_at(r, p), access).is_ok())
            .collect()
    }

    #[test]
    fn a_translation_sees_every_change_of_its_page() {
        let id = Identity::new();
        let r = Region::new(2 * 4096, 4096, false).unwrap();
        let at = page_at(&r, 0);
        let (to, from) = (Dir::TO_DEVICE, Dir::FROM_DEVICE);
        let ok = |d| id.translate(at, d).is_ok();
        // SAFETY: (each map here) `r` outlives the mappings: all are
        // unmapped below, before it drops.
        unsafe { id.map(&pages(&r, 0, 1, to)) }.unwrap();
        assert!(ok(to) && !ok(from), "read, and remembered read-only");
        // A second mapping widens the page: the remembered answer goes.
        // SAFETY: as above.
        unsafe { id.map(&pages(&r, 0, 2, from)) }.unwrap();
        assert!(ok(to) && ok(from));
        // The wider one goes: the page is read-only again.
        id.unmap(at, 2 * 4096).unwrap();
        assert!(ok(to) && !ok(from));
        id.unmap(at, 4096).unwrap();
        assert!(!ok(to) && !ok(from), "unmapped: a fault, not a memory");
        // A failed map or unmap changes nothing the device sees.
        // SAFETY: as above.
        unsafe { id.map(&pages(&r, 1, 1, from)) }.unwrap();
        assert!(id.translate(page_at(&r, 1), from).is_ok());
        assert!(id.unmap(at, 2 * 4096).is_err());
        assert!(id.translate(page_at(&r, 1), from).is_ok() && !ok(to));
        id.unmap(page_at(&r, 1), 4096).unwrap();
        assert!(id.translate(page_at(&r, 1), from).is_err());
        assert_eq!(id.mapped_pages(), 0);
    }

    #[test]
    fn a_change_reaches_every_page_of_its_range() {
        let id = Identity::new();
        let r = Region::new(3 * 4096, 4096, false).unwrap();
        let (to, from) = (Dir::TO_DEVICE, Dir::FROM_DEVICE);
        let all = |d| reachable(&id, &r, 3, d);
        // SAFETY: (each map here) `r` outlives the mappings: both are
        // unmapped below, before it drops.
        unsafe { id.map(&pages(&r, 0, 3, to)) }.unwrap();
        assert_eq!((all(to), all(from)), (vec![true; 3], vec![false; 3]));
        // SAFETY: as above.
        unsafe { id.map(&pages(&r, 0, 3, from)) }.unwrap();
        assert_eq!(all(from), vec![true; 3], "a map forgot some pages");
        id.unmap(page_at(&r, 0), 3 * 4096).unwrap();
        id.unmap(page_at(&r, 0), 3 * 4096).unwrap();
        assert_eq!(all(to), vec![false; 3], "an unmap forgot some pages");
    }

    #[test]
    fn overlapping_maps_share_pages_until_the_last_unmap() {
        let id = Identity::new();
        let r = Region::new(3 * 4096, 4096, false).unwrap();
        let (a, b, c) = (
            pages(&r, 0, 2, Dir::TO_DEVICE),
            pages(&r, 1, 2, Dir::TO_DEVICE),
            pages(&r, 1, 1, Dir::TO_DEVICE),
        );
        // SAFETY: `r` outlives the mappings (all unmapped below).
        unsafe {
            id.map(&a).unwrap();
            id.map(&b).unwrap();
            id.map(&c).unwrap();
        }
        assert_eq!(id.mapped_pages(), 3);
        id.unmap(a.iova, a.len).unwrap();
        assert_eq!(reachable(&id, &r, 3, Dir::TO_DEVICE), [false, true, true]);
        id.unmap(c.iova, c.len).unwrap();
        assert_eq!(reachable(&id, &r, 3, Dir::TO_DEVICE), [false, true, true]);
        id.unmap(b.iova, b.len).unwrap();
        assert_eq!(id.mapped_pages(), 0);
        // Nothing is left to unmap: a further unmap is refused.
        assert_eq!(
            id.unmap(b.iova, b.len).unwrap_err().errno(),
            Some(libc::ENOENT)
        );
        assert_eq!(id.stats().map_calls, 3);
        assert_eq!(id.stats().unmap_calls, 3);
    }

    #[test]
    fn a_page_allows_the_union_of_its_live_mappings_directions() {
        let id = Identity::new();
        let r = Region::new(2 * 4096, 4096, false).unwrap();
        let a = pages(&r, 0, 2, Dir::TO_DEVICE);
        let b = pages(&r, 1, 1, Dir::FROM_DEVICE);
        // SAFETY: `r` outlives the mappings (all unmapped below).
        unsafe {
            id.map(&a).unwrap();
            id.map(&b).unwrap();
        }
        assert_eq!(reachable(&id, &r, 2, Dir::BIDIRECTIONAL), [false, true]);
        // The unmap of `b`'s range removes `b`, not a page of `a`.
        id.unmap(b.iova, b.len).unwrap();
        assert_eq!(reachable(&id, &r, 2, Dir::TO_DEVICE), [true, true]);
        assert_eq!(reachable(&id, &r, 2, Dir::FROM_DEVICE), [false, false]);
        // SAFETY: as above.
        unsafe { id.map(&b).unwrap() };
        // The unmap of `a`'s range removes `a` whole, and leaves `b`.
        id.unmap(a.iova, a.len).unwrap();
        assert_eq!(reachable(&id, &r, 2, Dir::FROM_DEVICE), [false, true]);
        assert_eq!(reachable(&id, &r, 2, Dir::TO_DEVICE), [false, false]);
        id.unmap(b.iova, b.len).unwrap();
        assert_eq!(id.mapped_pages(), 0);
    }

    #[test]
    fn unmaps_in_any_order_and_in_other_pieces_than_the_maps() {
        let id = Identity::new();
        let r = Region::new(4 * 4096, 4096, false).unwrap();
        let a = pages(&r, 0, 2, Dir::TO_DEVICE);
        let b = pages(&r, 1, 3, Dir::TO_DEVICE);
        // SAFETY: `r` outlives the mappings (all unmapped below).
        unsafe {
            id.map(&a).unwrap();
            id.map(&b).unwrap();
        }
        // The later mapping first.
        id.unmap(b.iova, b.len).unwrap();
        assert_eq!(
            reachable(&id, &r, 4, Dir::TO_DEVICE),
            [true, true, false, false]
        );
        // SAFETY: as above.
        unsafe { id.map(&b).unwrap() };
        // The middle of `b` alone (its front and back stay), then one unmap
        // across what is left of both.
        id.unmap(page_at(&r, 2), 4096).unwrap();
        assert_eq!(
            reachable(&id, &r, 4, Dir::TO_DEVICE),
            [true, true, false, true]
        );
        id.unmap(page_at(&r, 0), 2 * 4096).unwrap();
        assert_eq!(
            reachable(&id, &r, 4, Dir::TO_DEVICE),
            [false, true, false, true]
        );
        id.unmap(page_at(&r, 1), 4096).unwrap();
        id.unmap(page_at(&r, 3), 4096).unwrap();
        assert_eq!(id.mapped_pages(), 0);
    }

    #[test]
    #[cfg_attr(miri, ignore = "65,536 map calls: minutes under Miri")]
    fn a_page_mapped_too_often_is_refused_with_eoverflow() {
        let id = Identity::new();
        let r = Region::new(2 * 4096, 4096, false).unwrap();
        let one = pages(&r, 1, 1, Dir::TO_DEVICE);
        for _ in 0..u16::MAX {
            // SAFETY: `r` outlives the mappings (all unmapped below).
            unsafe { id.map(&one).unwrap() };
        }
        let both = pages(&r, 0, 2, Dir::TO_DEVICE);
        // SAFETY: as above.
        let e = unsafe { id.map(&both) }.unwrap_err();
        assert_eq!(e.errno(), Some(libc::EOVERFLOW));
        let msg = e.to_string();
        assert!(msg.contains("65535"), "{msg}");
        // Refused whole: the first page was not counted either.
        assert_eq!(id.mapped_pages(), 1);
        for _ in 0..u16::MAX {
            id.unmap(one.iova, one.len).unwrap();
        }
        assert_eq!(id.mapped_pages(), 0);
    }
}
