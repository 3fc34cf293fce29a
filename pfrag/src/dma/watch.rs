//! A mapper that watches the release rule: memory goes back to the OS only
//! after the unmap *and* the invalidation that cover it have completed.
//!
//! [`Watch`] wraps any mapper and remembers where each mapping's memory
//! lives. When an unmap returns, and when a flush completes the
//! invalidations of deferred unmaps, it asks the kernel (`mincore`) whether
//! that memory is still resident. Memory a pool released too early (with
//! `MADV_DONTNEED`, or by unmapping it from the process) would not be, and
//! [`WatchStats::early`] counts it. Wrap the mapper of a test or a debug
//! build; the checks cost a system call per unmap.
//!
//! [`Watch`] keeps one record per mapping, keyed by its first IOVA, as
//! mappers that refuse overlapping mappings (VFIO, [`SoftIommu`](super::SoftIommu))
//! make them; an unmap that covers part of a mapping leaves the rest
//! recorded. Over a mapper that lets mappings overlap
//! ([`Identity`](super::Identity)) two mappings with one first IOVA share a
//! record, so [`WatchStats::live`] may count fewer.
//!
//! Memory the device may reach is resident when the mapper pins it (VFIO
//! does); with a mapper that does not, write every page of a mapping before
//! it is unmapped, or the check reports pages that were never faulted in.
//!
//! ```
//! use std::sync::Arc;
//! use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig, Watch};
//! use pfrag::frag::FragCache;
//! use pfrag::pool::{self, Policy, Pool};
//! use pfrag::Order;
//!
//! let domain = Arc::new(Domain::new(Watch::new(SoftIommu::new(SoftIommuConfig::default())?)));
//! let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(0)?, Policy::PerChunk))?;
//! let mut cache = FragCache::new(pool);
//! let mut f = cache.refill(4096, true)?;
//! f.as_mut_slice().fill(1); // resident
//! cache.complete(f)?; // per-chunk: unmapped now, while still resident
//! cache.release();
//! let st = domain.mapper().watch_stats();
//! assert!(st.checked >= 1);
//! assert_eq!(st.early, 0);
//! # Ok::<(), pfrag::Error>(())
//! ```

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::granules::cut;
use super::{DmaMapper, IovaSpace, MapStats, Mapping, PageSizes, Unmapped};
use crate::addr::{Iova, VirtAddr};
use crate::error::Result;
use crate::mem;

/// What a [`Watch`] has checked so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WatchStats {
    /// Ranges checked, at unmaps and at flushes.
    pub checked: u64,
    /// Ranges whose memory was no longer resident when checked: released
    /// before their unmap or invalidation completed.
    pub early: u64,
    /// Deferred unmaps whose flush has not been seen yet.
    pub pending: usize,
    /// Mappings installed and not yet unmapped.
    pub live: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Live mappings: IOVA → (address, length).
    live: BTreeMap<u64, (usize, u64)>,
    /// (flush generation, address, length) of unmapped ranges whose flush
    /// is outstanding.
    pending: Vec<(u64, usize, usize)>,
    checked: u64,
    early: u64,
}

impl State {
    fn check(&mut self, ranges: &[(usize, usize)]) {
        for &(addr, len) in ranges {
            self.checked += 1;
            if !mem::resident(VirtAddr(addr), len) {
                self.early += 1;
            }
        }
    }

    /// Checks the pending ranges whose flush generation has completed
    /// (`flushed`), as their memory may go from now on, and forgets them.
    fn settle(&mut self, flushed: u64) {
        let (done, wait) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition::<Vec<_>, _>(|&(seq, _, _)| seq <= flushed);
        self.pending = wait;
        let done: Vec<(usize, usize)> = done.into_iter().map(|(_, a, l)| (a, l)).collect();
        self.check(&done);
    }

    /// Removes `iova..iova + len` from the live mappings (one covered in
    /// part is [`cut`], the rest of it stays live) and returns the memory
    /// behind the part of each that the range covers.
    fn take(&mut self, iova: Iova, len: u64) -> Vec<(usize, usize)> {
        let (start, end) = (iova.raw(), iova.raw().saturating_add(len));
        let first = self
            .live
            .range(..=start)
            .next_back()
            .map_or(start, |(&k, _)| k);
        let hits: Vec<(u64, (usize, u64))> = self
            .live
            .range(first..end)
            .map(|(&k, &v)| (k, v))
            .filter(|&(k, (_, l))| k + l > start)
            .collect();
        let mut out = Vec::with_capacity(hits.len());
        for (k, (addr, l)) in hits {
            let (s, e) = (k.max(start), (k + l).min(end));
            out.push((addr + (s - k) as usize, (e - s) as usize));
            // What the range leaves of the mapping stays live, each part
            // with the memory behind it.
            self.live.remove(&k);
            for (ps, pl) in cut((k, l), (start, len)).into_iter().flatten() {
                self.live.insert(ps, (addr + (ps - k) as usize, pl));
            }
        }
        out
    }
}

/// A mapper wrapper that checks, at every unmap and every flush, that the
/// memory behind the ranges is still resident: memory released before its
/// unmap and invalidation completed shows up in [`WatchStats::early`].
#[derive(Debug)]
pub struct Watch<M> {
    inner: M,
    state: Mutex<State>,
}

impl<M: DmaMapper> Watch<M> {
    /// Watches `inner`.
    pub fn new(inner: M) -> Watch<M> {
        Watch {
            inner,
            state: Mutex::new(State::default()),
        }
    }

    /// The wrapped mapper.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// What has been checked so far.
    pub fn watch_stats(&self) -> WatchStats {
        let s = self.lock();
        WatchStats {
            checked: s.checked,
            early: s.early,
            pending: s.pending.len(),
            live: s.live.len(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<M: DmaMapper> DmaMapper for Watch<M> {
    unsafe fn map(&self, m: &Mapping) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.map(m) }?;
        self.lock().live.insert(m.iova.raw(), (m.addr.0, m.len));
        Ok(())
    }
    fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped> {
        let how = self.inner.unmap(iova, len)?;
        let mut s = self.lock();
        let ranges = s.take(iova, len);
        s.check(&ranges);
        if let Unmapped::Deferred { seq } = how {
            s.pending
                .extend(ranges.into_iter().map(|(a, l)| (seq, a, l)));
            // The unmap may have flushed (a full flush queue): what that
            // completed may go now.
            s.settle(self.inner.flushed_seq());
        }
        Ok(how)
    }
    // `map_batch` and `unmap_batch` keep the trait's defaults, so every run
    // goes through the watching `map` and `unmap` above.
    fn page_sizes(&self) -> PageSizes {
        self.inner.page_sizes()
    }
    fn iova_space(&self) -> IovaSpace {
        self.inner.iova_space()
    }
    fn flushed_seq(&self) -> u64 {
        // A caller that sees the generation may release its memory: check
        // what it completed first.
        let flushed = self.inner.flushed_seq();
        self.lock().settle(flushed);
        flushed
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()?;
        self.lock().settle(u64::MAX);
        Ok(())
    }
    fn stats(&self) -> MapStats {
        self.inner.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::{Dir, SoftIommu, SoftIommuConfig};
    use crate::mem::Region;

    fn mapping(r: &Region, iova: u64, off: usize, len: u64) -> Mapping {
        Mapping {
            iova: Iova(iova),
            addr: r.addr().offset(off),
            len,
            dir: Dir::TO_DEVICE,
            huge: false,
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "mincore: Miri has no page tables to ask")]
    fn memory_not_resident_at_its_unmap_is_caught() {
        let w = Watch::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let mut r = Region::new(4 * 4096, 4096, false).unwrap();
        // The first half is written (resident); the second never touched,
        // so it reads to `mincore` like memory given back too early.
        r.write(0, &[1u8; 2 * 4096]).unwrap();
        let (a, b) = (
            mapping(&r, 0x10_0000, 0, 8192),
            mapping(&r, 0x10_4000, 8192, 8192),
        );
        // SAFETY: `r` outlives both mappings; the test unmaps them before
        // dropping it.
        unsafe { w.map_batch(&[a, b]).unwrap() };
        assert_eq!(w.watch_stats().live, 2);
        w.unmap(Iova(0x10_0000), 8192).unwrap();
        assert_eq!(w.watch_stats().early, 0);
        w.unmap(Iova(0x10_4000), 8192).unwrap();
        let st = w.watch_stats();
        assert_eq!((st.checked, st.early, st.live), (2, 1, 0));
    }

    #[test]
    fn one_unmap_across_two_mappings_checks_both_parts() {
        let w = Watch::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let mut r = Region::new(4 * 4096, 4096, false).unwrap();
        r.write(0, &[1u8; 4 * 4096]).unwrap();
        let (a, b) = (
            mapping(&r, 0x20_0000, 0, 8192),
            mapping(&r, 0x20_2000, 8192, 8192),
        );
        // SAFETY: `r` outlives both mappings.
        unsafe {
            w.map(&a).unwrap();
            w.map(&b).unwrap();
        }
        w.unmap(Iova(0x20_0000), 4 * 4096).unwrap();
        let st = w.watch_stats();
        assert_eq!((st.checked, st.early, st.live), (2, 0, 0));
    }

    /// Lazy invalidation with a flush queue of one: the unmap's own flush
    /// completes its invalidation, so the memory may go at once. A later
    /// flush must not check it again (it used to, and counted it early).
    #[test]
    #[cfg_attr(miri, ignore = "mincore: Miri has no page tables to ask")]
    fn memory_released_after_its_flush_is_not_early() {
        let w = Watch::new(
            SoftIommu::new(SoftIommuConfig {
                invalidation: crate::dma::Invalidation::Lazy,
                flush_queue: 1,
                ..SoftIommuConfig::default()
            })
            .unwrap(),
        );
        let mut r = Region::new(4096, 4096, false).unwrap();
        r.write(0, &[1u8; 4096]).unwrap();
        // SAFETY: `r` outlives the mapping, released only once its unmap
        // and flush completed.
        unsafe { w.map(&mapping(&r, 0x10_0000, 0, 4096)).unwrap() };
        let Unmapped::Deferred { seq } = w.unmap(Iova(0x10_0000), 4096).unwrap() else {
            panic!("lazy unmaps are deferred");
        };
        assert!(w.flushed_seq() >= seq, "the full queue was flushed");
        // Checked at its unmap, and at its flush (inside the unmap).
        assert_eq!(w.watch_stats().checked, 2);
        // SAFETY: unmapped and flushed: no device reaches the page.
        unsafe { r.release(0, 4096).unwrap() };
        w.flush().unwrap();
        let st = w.watch_stats();
        assert_eq!((st.checked, st.early, st.pending), (2, 0, 0));
    }

    /// A watch over an IOMMU that lets any mapped pages be unmapped.
    fn loose() -> Watch<SoftIommu> {
        Watch::new(
            SoftIommu::new(SoftIommuConfig {
                whole_unmaps: false,
                ..SoftIommuConfig::default()
            })
            .unwrap(),
        )
    }

    #[test]
    fn partial_unmaps_cut_the_live_mappings() {
        let w = loose();
        let mut r = Region::new(3 * 4096, 4096, false).unwrap();
        r.write(0, &[1u8; 3 * 4096]).unwrap();
        let live = |w: &Watch<SoftIommu>| w.watch_stats().live;
        // Front, then back.
        // SAFETY: `r` outlives every mapping of this test (all unmapped).
        unsafe { w.map(&mapping(&r, 0x10_0000, 0, 8192)).unwrap() };
        w.unmap(Iova(0x10_0000), 4096).unwrap();
        assert_eq!(live(&w), 1);
        w.unmap(Iova(0x10_1000), 4096).unwrap();
        assert_eq!(live(&w), 0);
        // Middle: two are left.
        // SAFETY: as above.
        unsafe { w.map(&mapping(&r, 0x10_0000, 0, 3 * 4096)).unwrap() };
        w.unmap(Iova(0x10_1000), 4096).unwrap();
        assert_eq!(live(&w), 2);
        w.unmap(Iova(0x10_2000), 4096).unwrap();
        assert_eq!(live(&w), 1);
        // What is left still checks the right memory: the first page.
        w.unmap(Iova(0x10_0000), 4096).unwrap();
        let st = w.watch_stats();
        assert_eq!((st.live, st.checked, st.early), (0, 5, 0));
    }

    /// A map or an unmap of `pages` pages from page `first`.
    #[derive(Clone, Debug)]
    enum Step {
        Map { first: u64, pages: u64 },
        Unmap { first: u64, pages: u64 },
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (0..12u64, 1..5u64).prop_map(|(first, pages)| Step::Map { first, pages }),
            (0..12u64, 1..5u64).prop_map(|(first, pages)| Step::Unmap { first, pages }),
        ]
    }

    /// Runs of consecutive pages made by one map call: the mappings a
    /// record of them must count.
    fn runs(model: &BTreeMap<u64, u64>) -> usize {
        let mut prev: Option<(u64, u64)> = None;
        let mut n = 0;
        for (&p, &id) in model {
            if prev != Some((p.wrapping_sub(1), id)) {
                n += 1;
            }
            prev = Some((p, id));
        }
        n
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// The IOMMU's record and the watch's agree with a model that
        /// keeps, for each mapped page, the map call that mapped it.
        #[test]
        #[cfg_attr(miri, ignore = "proptest: 64 cases of up to 40 steps, minutes under Miri")]
        fn records_agree_with_a_page_model(steps in proptest::collection::vec(step(), 1..40)) {
            let mut r = Region::new(16 * 4096, 4096, false).unwrap();
            let w = loose();
            r.write(0, &[1u8; 16 * 4096]).unwrap();
            let base = 0x10_0000u64;
            let mut model: BTreeMap<u64, u64> = BTreeMap::new();
            for (id, s) in steps.into_iter().enumerate() {
                match s {
                    Step::Map { first, pages } => {
                        let m = mapping(&r, base + first * 4096, first as usize * 4096, pages * 4096);
                        let free = (first..first + pages).all(|p| !model.contains_key(&p));
                        // SAFETY: `r` outlives the watch and its mappings.
                        let got = unsafe { w.map(&m) };
                        proptest::prop_assert_eq!(got.is_ok(), free);
                        if free {
                            model.extend((first..first + pages).map(|p| (p, id as u64)));
                        }
                    }
                    Step::Unmap { first, pages } => {
                        let all = (first..first + pages).all(|p| model.contains_key(&p));
                        let got = w.unmap(Iova(base + first * 4096), pages * 4096);
                        proptest::prop_assert_eq!(got.is_ok(), all);
                        if all {
                            for p in first..first + pages {
                                model.remove(&p);
                            }
                        }
                    }
                }
                proptest::prop_assert_eq!(w.inner().mapped_pages(), model.len() as u64);
                proptest::prop_assert_eq!(w.inner().mappings(), runs(&model));
                proptest::prop_assert_eq!(w.watch_stats().live, runs(&model));
            }
            // Unmap what is left before `r` goes.
            let left: Vec<u64> = model.keys().copied().collect();
            for p in left {
                w.unmap(Iova(base + p * 4096), 4096).unwrap();
            }
            proptest::prop_assert_eq!(w.watch_stats().early, 0);
        }
    }
}
