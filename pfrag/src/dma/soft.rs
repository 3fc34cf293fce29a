//! A software IOMMU: a 4-level radix page table of 4 KiB entries with
//! optional 2 MiB superpages, an LRU IOTLB, strict or lazy (flush-queue)
//! invalidation, and fault recording. Host virtual addresses stand in for
//! physical ones.

use std::collections::VecDeque;
use std::io;
use std::sync::Mutex;

use super::granules::Granules;
use super::iotlb::{Entry, Iotlb};
use super::latency;
use super::soft_config::{CostModel, Invalidation, SoftIommuConfig};
use super::{
    device_read, device_store_u32, device_write, Dir, DmaMapper, Fault, Fence, IovaSpace, MapStats,
    Mapping, PageSizes, Translate, Translation, Unmapped,
};
use crate::addr::{Iova, VirtAddr, HUGE_PAGE_SIZE, PAGE_SIZE};
use crate::error::{Error, Result};

/// Why a translation faulted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultReason {
    /// No translation for the IOVA.
    NotPresent,
    /// A translation exists but not for that direction.
    Permission,
    /// The IOVA lies outside the domain's IOVA range.
    OutOfRange,
    /// The access is not aligned as it must be: a 32-bit store
    /// ([`Translate::write_u32`]) at an IOVA that is not 4-byte aligned.
    Unaligned,
}

/// One recorded fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultRecord {
    /// The faulting access.
    pub fault: Fault,
    /// Why.
    pub reason: FaultReason,
}

/// Entry bits. A leaf holds the host page address plus R/W (and PS for 2 MiB);
/// a table entry holds the child node index shifted by 12 plus `TABLE`.
const PTE_R: u64 = 1 << 0;
const PTE_W: u64 = 1 << 1;
const PTE_PS: u64 = 1 << 7;
const PTE_TABLE: u64 = 1 << 11;
const ADDR_MASK: u64 = !0xfff;
const LEVEL_SHIFTS: [u32; 4] = [39, 30, 21, 12];
const RECORDED_FAULTS: usize = 64;

fn perms(dir: Dir) -> u64 {
    let mut p = 0;
    if dir.contains(Dir::TO_DEVICE) {
        p |= PTE_R;
    }
    if dir.contains(Dir::FROM_DEVICE) {
        p |= PTE_W;
    }
    p
}

fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// Where a leaf lives: node index and slot.
#[derive(Clone, Copy)]
struct Slot {
    node: usize,
    idx: usize,
}

struct State {
    /// Radix nodes; node 0 is the root. Invariant: table entries point at
    /// existing nodes, none of them in `spare`.
    nodes: Vec<Box<[u64; 512]>>,
    /// Empty nodes no table entry points at, for the next table.
    spare: Vec<usize>,
    iotlb: Iotlb,
    /// Ranges unmapped but maybe still in the IOTLB (lazy mode).
    flush_queue: Vec<(Iova, u64)>,
    /// The generation the queued ranges belong to.
    gen: u64,
    /// The newest completed generation: invalidated, and every device
    /// access that translated before waited for ([`SoftIommu::settle`]).
    flushed: u64,
    stats: MapStats,
    faults: VecDeque<FaultRecord>,
    /// 4 KiB pages mapped now (a superpage counts 512).
    live: u64,
    /// The mappings as made, for `whole_unmaps` and the live count.
    granules: Granules,
    /// Spin the modelled cost (`SoftIommuConfig::inject`).
    inject: bool,
}

/// The software IOMMU. See the module docs.
pub struct SoftIommu {
    cfg: SoftIommuConfig,
    state: Mutex<State>,
    /// Device accesses in progress; unmaps and flushes wait for them.
    fence: Fence,
}

impl std::fmt::Debug for SoftIommu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftIommu").field("cfg", &self.cfg).finish()
    }
}

impl SoftIommu {
    /// A new, empty IOMMU domain; a setting out of range is an error
    /// ([`SoftIommuConfig::validate`]).
    pub fn new(cfg: SoftIommuConfig) -> Result<SoftIommu> {
        cfg.validate()?;
        let state = State {
            nodes: vec![Box::new([0; 512])],
            spare: Vec::new(),
            iotlb: Iotlb::new(cfg.iotlb_entries),
            flush_queue: Vec::with_capacity(cfg.flush_queue),
            gen: 1,
            flushed: 0,
            stats: MapStats::default(),
            faults: VecDeque::with_capacity(RECORDED_FAULTS),
            live: 0,
            granules: Granules::default(),
            inject: cfg.inject,
        };
        Ok(SoftIommu {
            cfg,
            state: Mutex::new(state),
            fence: Fence::default(),
        })
    }

    /// 4 KiB pages mapped now (a 2 MiB superpage counts 512).
    pub fn mapped_pages(&self) -> u64 {
        self.lock().live
    }

    /// Mappings live now: one per successful map call not yet unmapped
    /// (what type1 counts against `dma_entry_limit`).
    pub fn mappings(&self) -> usize {
        self.lock().granules.len()
    }

    /// Its settings.
    pub fn config(&self) -> &SoftIommuConfig {
        &self.cfg
    }

    /// The most recent faults (at most 64), oldest first.
    pub fn faults(&self) -> Vec<FaultRecord> {
        self.lock().faults.iter().copied().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves the tables consistent
        // (every mutation is completed or rolled back before unlocking).
        crate::sync::lock_std(&self.state)
    }

    fn check(&self, iova: Iova, addr: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        if iova.raw() % PAGE_SIZE != 0 || addr % PAGE_SIZE != 0 || len % PAGE_SIZE != 0 {
            return Err(Error::Unaligned {
                iova,
                addr: addr as usize,
                len,
                page: PAGE_SIZE,
            });
        }
        let r = &self.cfg.iova_range;
        match iova.raw().checked_add(len) {
            Some(end) if iova.raw() >= r.start && end <= r.end => Ok(()),
            _ => Err(Error::Map {
                iova,
                len,
                source: errno(libc::EINVAL),
            }),
        }
    }
}

impl State {
    fn cost(&mut self, cost: Option<CostModel>, calls: u64, ptes: u64, invs: u64, misses: u64) {
        if let Some(c) = cost {
            let ns = calls as f64 * c.call_ns
                + ptes as f64 * c.pte_ns
                + invs as f64 * c.invalidation_ns
                + misses as f64 * c.miss_ns;
            self.stats.model_ns += ns;
            if self.inject {
                latency::owe(ns);
            }
        }
    }

    /// The slot for `iova` at depth `depth` (0 = root .. 3 = 4 KiB level),
    /// creating intermediate tables if `create`. `None` if a level is
    /// missing (or a superpage sits above) and `create` is false.
    fn slot(&mut self, iova: u64, depth: usize, create: bool) -> Option<Slot> {
        let mut node = 0;
        for (d, shift) in LEVEL_SHIFTS.iter().enumerate() {
            let idx = ((iova >> shift) & 511) as usize;
            if d == depth {
                return Some(Slot { node, idx });
            }
            let e = self.nodes[node][idx];
            if e & PTE_TABLE != 0 {
                node = (e >> 12) as usize;
            } else if e == 0 && create {
                let child = self.spare.pop().unwrap_or_else(|| {
                    self.nodes.push(Box::new([0; 512]));
                    self.nodes.len() - 1
                });
                self.nodes[node][idx] = ((child as u64) << 12) | PTE_TABLE;
                node = child;
            } else {
                return None;
            }
        }
        None
    }

    /// Whether slot `s` is free for a leaf: empty, or (for a 2 MiB leaf)
    /// holding a table of 4 KiB entries that are all empty, which then
    /// goes to `spare` (4 KiB mappings unmapped since left it).
    fn vacant(&mut self, s: Slot, huge: bool) -> bool {
        let e = self.nodes[s.node][s.idx];
        if e == 0 {
            return true;
        }
        let child = (e >> 12) as usize;
        if !huge || e & PTE_TABLE == 0 || self.nodes[child].iter().any(|&c| c != 0) {
            return false;
        }
        self.nodes[s.node][s.idx] = 0;
        self.spare.push(child);
        true
    }

    /// The leaf covering `iova`: (entry, is 2 MiB, slot).
    fn leaf(&mut self, iova: u64) -> Option<(u64, bool, Slot)> {
        let s2 = self.slot(iova, 2, false)?;
        let e2 = self.nodes[s2.node][s2.idx];
        if e2 & PTE_PS != 0 {
            return Some((e2, true, s2));
        }
        let s1 = self.slot(iova, 3, false)?;
        let e1 = self.nodes[s1.node][s1.idx];
        (e1 != 0).then_some((e1, false, s1))
    }

    /// Invalidates the queued ranges (if any); returns the newest
    /// generation invalidated, theirs or an earlier one, complete once
    /// [`SoftIommu::settle`] has waited for the device.
    fn flush(&mut self, cost: Option<CostModel>) -> u64 {
        if !self.flush_queue.is_empty() {
            self.iotlb.clear();
            self.flush_queue.clear();
            self.stats.invalidations += 1;
            self.cost(cost, 0, 0, 1, 0);
            self.gen += 1;
        }
        self.gen - 1
    }

    fn fault(&mut self, iova: Iova, access: Dir, reason: FaultReason) -> Fault {
        let fault = Fault { iova, access };
        self.stats.faults += 1;
        if self.faults.len() == RECORDED_FAULTS {
            self.faults.pop_front();
        }
        self.faults.push_back(FaultRecord { fault, reason });
        fault
    }
}

impl DmaMapper for SoftIommu {
    unsafe fn map(&self, m: &Mapping) -> Result<()> {
        self.check(m.iova, m.addr.raw() as u64, m.len)?;
        let p = perms(m.dir);
        if p == 0 {
            return Err(Error::Map {
                iova: m.iova,
                len: m.len,
                source: errno(libc::EINVAL),
            });
        }
        let mut st = self.lock();
        let mut written: Vec<Slot> = Vec::new();
        let (mut off, mut conflict) = (0u64, false);
        while off < m.len {
            let iova = m.iova.raw() + off;
            let addr = m.addr.raw() as u64 + off;
            let huge = self.cfg.superpages
                && m.huge
                && iova % HUGE_PAGE_SIZE == 0
                && addr % HUGE_PAGE_SIZE == 0
                && m.len - off >= HUGE_PAGE_SIZE;
            let (depth, step, flags) = if huge {
                (2, HUGE_PAGE_SIZE, p | PTE_PS)
            } else {
                (3, PAGE_SIZE, p)
            };
            match st.slot(iova, depth, true) {
                Some(s) if st.vacant(s, huge) => {
                    st.nodes[s.node][s.idx] = addr | flags;
                    written.push(s);
                }
                _ => {
                    conflict = true;
                    break;
                }
            }
            off += step;
        }
        if conflict {
            for s in &written {
                st.nodes[s.node][s.idx] = 0;
            }
            return Err(Error::Map {
                iova: m.iova,
                len: m.len,
                source: errno(libc::EEXIST),
            });
        }
        // A stale IOTLB entry for this range exists only if it was unmapped
        // lazily, not yet flushed, and handed out again by an allocator
        // other than the one that unmapped it (two domains over one
        // IOMMU). A real driver never reuses an IOVA before its flush; the
        // model drops such entries, so the device sees the new mapping and
        // never the old memory.
        st.iotlb.invalidate(m.iova.raw(), m.len);
        let n = written.len() as u64;
        st.stats.map_calls += 1;
        st.stats.ptes_written += n;
        st.live += m.len / PAGE_SIZE;
        st.granules.insert(m.iova.raw(), m.len);
        st.cost(self.cfg.cost, 1, n, 0, 0);
        drop(st);
        latency::pay();
        Ok(())
    }

    fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped> {
        self.check(iova, 0, len).map_err(|e| match e {
            Error::Map { source, .. } => Error::Unmap { iova, len, source },
            other => other,
        })?;
        let mut st = self.lock();
        if self.cfg.whole_unmaps {
            if let Err(r) = st.granules.check_unmap(iova.raw(), len) {
                return Err(Error::Unmap {
                    iova,
                    len,
                    source: errno(r.errno()),
                });
            }
        }
        // First pass: everything must be mapped, superpages whole.
        let mut leaves = Vec::new();
        let mut off = 0;
        while off < len {
            let at = iova.raw() + off;
            match st.leaf(at) {
                Some((_, true, s)) if at % HUGE_PAGE_SIZE == 0 && len - off >= HUGE_PAGE_SIZE => {
                    leaves.push(s);
                    off += HUGE_PAGE_SIZE;
                }
                Some((_, false, s)) => {
                    leaves.push(s);
                    off += PAGE_SIZE;
                }
                Some((_, true, _)) | None => {
                    // The request's numbers: the page that stopped it
                    // (`at`) is the first not mapped, or inside a 2 MiB
                    // page the range splits.
                    let code = if st.leaf(at).is_some() {
                        libc::EINVAL
                    } else {
                        libc::ENOENT
                    };
                    return Err(Error::Unmap {
                        iova,
                        len,
                        source: errno(code),
                    });
                }
            }
        }
        for s in &leaves {
            st.nodes[s.node][s.idx] = 0;
        }
        st.granules.remove(iova.raw(), len);
        let n = leaves.len() as u64;
        st.live -= len / PAGE_SIZE;
        st.stats.unmap_calls += 1;
        let (out, done) = match self.cfg.invalidation {
            Invalidation::Strict => {
                st.iotlb.invalidate(iova.raw(), len);
                st.stats.invalidations += 1;
                st.cost(self.cfg.cost, 1, n, 1, 0);
                (Unmapped::Flushed, None)
            }
            Invalidation::Lazy => {
                st.cost(self.cfg.cost, 1, n, 0, 0);
                st.flush_queue.push((iova, len));
                let seq = st.gen;
                let full = st.flush_queue.len() >= self.cfg.flush_queue.max(1);
                let done = full.then(|| st.flush(self.cfg.cost));
                (Unmapped::Deferred { seq }, done)
            }
        };
        drop(st);
        // (Under lazy invalidation the memory waits for the flush, which
        // waits for the device as well.)
        self.settle(done);
        latency::pay();
        Ok(out)
    }

    fn page_sizes(&self) -> PageSizes {
        if self.cfg.superpages {
            PageSizes::SIZE_4K | PageSizes::SIZE_2M
        } else {
            PageSizes::SIZE_4K
        }
    }

    fn iova_space(&self) -> IovaSpace {
        IovaSpace::Ranges(vec![self.cfg.iova_range.clone()])
    }

    fn flushed_seq(&self) -> u64 {
        self.lock().flushed
    }

    fn flush(&self) -> Result<()> {
        // Also with nothing queued: the generation a concurrent flush
        // invalidated shows once this one has waited for the device.
        let done = self.lock().flush(self.cfg.cost);
        self.settle(Some(done));
        latency::pay();
        Ok(())
    }

    fn stats(&self) -> MapStats {
        self.lock().stats
    }
}

// SAFETY: a translation names the mapped page's own memory (the `unsafe
// map` caller keeps it allocated until the unmap), at least one byte of it,
// inside the page; unmaps and flushes wait in the fence for every `Hold`
// and device access; the accesses go through `translate`.
unsafe impl Translate for SoftIommu {
    fn translate(&self, iova: Iova, access: Dir) -> Result<Translation, Fault> {
        let t = self.walk(iova, access);
        latency::pay();
        t
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
        // An unaligned store is refused there, recorded here.
        let unaligned = |f: Fault| self.lock().fault(f.iova, f.access, FaultReason::Unaligned);
        let translate = |i, d| self.translate(i, d);
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { device_store_u32(&self.fence, translate, unaligned, iova, v) }
    }
}

impl SoftIommu {
    /// Waits until every device access that translated before an
    /// invalidation just made has ended, then publishes the flush
    /// generation `done` (if a flush made one) as complete. A caller that
    /// sees the generation frees the memory, so never before the wait.
    fn settle(&self, done: Option<u64>) {
        self.fence.quiesce();
        if let Some(g) = done {
            let mut st = self.lock();
            st.flushed = st.flushed.max(g);
        }
    }

    /// An IOTLB miss: the page table's entry for `iova`, cached, or the
    /// fault if none. Out of line, so that the hit path, which a device
    /// takes for nearly every access, stays short.
    #[inline(never)]
    fn miss(&self, st: &mut State, iova: Iova, access: Dir) -> Result<Entry, Fault> {
        st.stats.iotlb_misses += 1;
        st.cost(self.cfg.cost, 0, 0, 0, 1);
        let Some((pte, huge, _)) = st.leaf(iova.raw()) else {
            return Err(st.fault(iova, access, FaultReason::NotPresent));
        };
        let size = if huge { HUGE_PAGE_SIZE } else { PAGE_SIZE };
        let e = Entry {
            addr: (pte & ADDR_MASK & !(size - 1)) as usize,
            perms: (pte & (PTE_R | PTE_W)) as u8,
            huge,
        };
        st.iotlb.insert(iova.raw(), e);
        Ok(e)
    }

    /// Translates through the IOTLB or, on a miss, the page table.
    fn walk(&self, iova: Iova, access: Dir) -> Result<Translation, Fault> {
        let mut st = self.lock();
        if !self.cfg.iova_range.contains(&iova.raw()) {
            // The page table decodes 48 bits; an IOVA outside the domain's
            // range must fault, not alias a mapped page.
            return Err(st.fault(iova, access, FaultReason::OutOfRange));
        }
        let want = perms(access) as u8;
        let entry = match st.iotlb.lookup(iova.raw()) {
            Some(e) => {
                st.stats.iotlb_hits += 1;
                e
            }
            None => self.miss(&mut st, iova, access)?,
        };
        if entry.perms & want != want {
            return Err(st.fault(iova, access, FaultReason::Permission));
        }
        let size = if entry.huge {
            HUGE_PAGE_SIZE
        } else {
            PAGE_SIZE
        };
        let off = iova.raw() & (size - 1);
        Ok(Translation {
            addr: VirtAddr(entry.addr + off as usize),
            len: size - off,
        })
    }
}

#[cfg(test)]
#[path = "soft_tests.rs"]
mod tests;
