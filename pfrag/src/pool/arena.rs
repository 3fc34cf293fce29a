//! Growing and shrinking a pool's memory, and giving it all back when the
//! pool goes: the only places that create arenas, map them in batches,
//! unmap them and return their memory to the OS.
//!
//! The rule every path here keeps: memory is released (to the OS or to a
//! later grow) only after the unmap and the invalidation that cover it have
//! completed. A chunk whose unmap or flush failed is pinned instead (kept
//! out of circulation for good, counted), and an arena holding a pinned
//! chunk is never unmapped from the process.

use super::{Arena, Chunk, ChunkPtr, Policy, Shared, NO_IOVA};
use crate::addr::{Iova, VirtAddr, HUGE_PAGE_SIZE};
use crate::dma::{DmaMapper, Unmapped};
use crate::error::{Error, Result};
use crate::mem::{Backing, Region};
use crate::sync::{lock, try_lock, AtomicBool, AtomicU32, AtomicU64, MutexGuard, Ordering};

/// The locks a grow holds: the released list and the arenas.
type GrowLocks<'a, M> = (
    MutexGuard<'a, Vec<ChunkPtr<M>>>,
    MutexGuard<'a, Vec<Arena<M>>>,
);

/// A chunk a grow took for its caller: back on the free list if dropped
/// still holding it (the account's code unwound before the grow returned).
struct Taken<'a, M: DmaMapper>(&'a Shared<M>, Option<ChunkPtr<M>>);

impl<M: DmaMapper> Drop for Taken<'_, M> {
    fn drop(&mut self) {
        if let Some(c) = self.1.take() {
            self.0.push_free(c);
        }
    }
}

impl<M: DmaMapper> Shared<M> {
    /// Puts a free chunk on the free list, counted for the shrink gate.
    pub(super) fn push_free(&self, c: ChunkPtr<M>) {
        self.free.push(c);
        self.gate.pushed();
    }

    /// Adds one batch of chunks: released chunks first, else a new arena.
    /// Persistent pools map the batch with one call per contiguous run
    /// (one for a new arena). Returns one chunk of the batch for the
    /// caller, and puts the others on the free list; `None` if another
    /// thread grew the pool meanwhile (the free list has chunks again).
    /// All or nothing: on error the pool is as it was (or, if undoing a
    /// partial map failed, the batch is pinned and counted).
    ///
    /// The caller's chunk is its own before the account's hooks run, so
    /// the batch's arena is not whole while they do: a hook that trims
    /// this pool on entering pressure cannot give back the batch just
    /// grown, which would make the caller grow again (and, were usage then
    /// to fall below `min`, enter pressure again, without end).
    pub(super) fn grow(&self) -> Result<Option<ChunkPtr<M>>> {
        let mut arenas = lock(&self.arenas);
        if !self.free.is_empty() {
            return Ok(None); // someone else grew while we waited
        }
        let size = self.cfg.order.size();
        let batch = self.cfg.grow_batch;
        let mut released = lock(&self.released);
        let reuse = released.len().min(batch);
        let fresh = reuse == 0;
        let count = if fresh { batch } else { reuse };
        self.check_limit(count)?;
        // Reserved, not charged: a grow that fails gives it back with no
        // effect on the account's pressure.
        let charge = (count * size) as u64;
        if let Some(a) = &self.account {
            a.reserve(charge)?;
        }
        let got = if fresh {
            self.new_arena(&mut arenas)
        } else {
            self.reuse(&arenas, &mut released, reuse)
        };
        let (chunks, huge) = match got {
            Ok(v) => v,
            Err(e) => {
                self.cancel(charge);
                return Err(e);
            }
        };
        if self.cfg.policy == Policy::Persistent {
            if let Err(e) = self.map_batch(&chunks, huge) {
                self.map_failed(chunks, &e, charge, (released, arenas));
                return Err(e);
            }
        }
        self.counters
            .chunks
            .fetch_add(count as u64, Ordering::Relaxed);
        self.counters.grows.fetch_add(1, Ordering::Relaxed);
        let mut chunks = chunks.into_iter();
        // On the free list again if the account's code unwinds.
        let mut mine = Taken(self, chunks.next());
        for c in chunks {
            self.push_free(c);
        }
        self.settle_grow(charge, (released, arenas));
        Ok(mine.1.take())
    }

    /// Where a grow's batch goes when mapping it failed with `e`, and
    /// what becomes of its `charge`. After an [`Error::Unmap`] a run
    /// stayed mapped: a device may reach the memory, so the batch is
    /// pinned for good and stays charged. After any other error nothing
    /// was mapped: the chunks are released chunks again (a new arena's
    /// memory was never touched) and the charge is cancelled.
    fn map_failed(
        &self,
        chunks: Vec<ChunkPtr<M>>,
        e: &Error,
        charge: u64,
        locks: GrowLocks<'_, M>,
    ) {
        if matches!(e, Error::Unmap { .. }) {
            chunks.iter().for_each(|&c| self.pin_unlisted(c));
            self.settle_grow(charge, locks);
        } else {
            let (mut released, arenas) = locks;
            self.counters
                .released
                .fetch_add(chunks.len() as u64, Ordering::Relaxed);
            released.extend(chunks);
            self.cancel(charge);
            drop((released, arenas));
        }
    }

    /// Ends a grow that keeps its memory: commits its `charge`, lets go of
    /// its locks, then runs the account's hooks for what the commit
    /// changed. The hooks run with no lock held: one may take memory from
    /// this pool, and grow it again.
    fn settle_grow(&self, charge: u64, locks: GrowLocks<'_, M>) {
        self.commit(charge);
        drop(locks);
        self.settle();
    }

    /// The last `n` released chunks (whole arenas, as shrink released
    /// them), their huge pages faulted in again first, and whether they
    /// are huge. A shortage of huge pages is an error here, with the
    /// chunks still released.
    fn reuse(
        &self,
        arenas: &[Arena<M>],
        released: &mut Vec<ChunkPtr<M>>,
        n: usize,
    ) -> Result<(Vec<ChunkPtr<M>>, bool)> {
        let at = released.len() - n;
        let mut idx: Vec<u32> = released[at..].iter().map(|c| c.get().arena).collect();
        idx.dedup();
        let mut huge = true;
        for &i in &idx {
            let region = &arenas[i as usize].region;
            if region.backing() == Backing::Huge {
                region.populate()?;
            } else {
                huge = false;
            }
        }
        self.counters
            .released
            .fetch_sub(n as u64, Ordering::Relaxed);
        Ok((released.drain(at..).collect(), huge))
    }

    /// Refuses a growth by `count` chunks past `max_bytes`. The limit
    /// counts every byte the pool holds: chunks in circulation and chunks
    /// pinned for good (still allocated, maybe still mapped).
    fn check_limit(&self, count: usize) -> Result<()> {
        let Some(max) = self.cfg.max_bytes else {
            return Ok(());
        };
        let size = self.cfg.order.size() as u64;
        // `pin_listed` counts a chunk pinned before it leaves `chunks`
        // (release); read in the other order (acquire), the sum never
        // misses a chunk that moves between the two.
        let listed = self.counters.chunks.load(Ordering::Acquire);
        let n = listed + self.counters.pinned.load(Ordering::Relaxed);
        let held = n * size;
        let want = count as u64 * size;
        if held.saturating_add(want) > max {
            return Err(Error::LimitReached {
                held,
                requested: want,
                max,
            });
        }
        Ok(())
    }

    pub(super) fn uncharge(&self, bytes: u64) {
        if let Some(a) = &self.account {
            a.uncharge(bytes);
        }
    }

    /// Commits `bytes` a grow reserved in the account, if any; the hooks
    /// wait for [`settle`](Self::settle).
    fn commit(&self, bytes: u64) {
        if let Some(a) = &self.account {
            a.commit(bytes);
        }
    }

    /// Runs the account's hooks for what a commit changed, if any: called
    /// with no lock of the pool held.
    fn settle(&self) {
        if let Some(a) = &self.account {
            a.settle();
        }
    }

    /// Gives back `bytes` a grow that failed reserved in the account, if
    /// any.
    fn cancel(&self, bytes: u64) {
        if let Some(a) = &self.account {
            a.cancel(bytes);
        }
    }

    /// A new arena of one grow batch; its chunks, unmapped, and whether it
    /// is backed by huge pages.
    fn new_arena(&self, arenas: &mut Vec<Arena<M>>) -> Result<(Vec<ChunkPtr<M>>, bool)> {
        let size = self.cfg.order.size();
        let batch = self.cfg.grow_batch;
        let align = if self.cfg.hugepages {
            HUGE_PAGE_SIZE as usize
        } else {
            size
        };
        let region = Region::new(batch * size, align.max(size), self.cfg.hugepages)?;
        let huge = region.backing() == Backing::Huge;
        match region.backing() {
            Backing::Huge => self.counters.huge_arenas.fetch_add(1, Ordering::Relaxed),
            Backing::HugeFallback => self.counters.huge_fallbacks.fetch_add(1, Ordering::Relaxed),
            Backing::Small => 0,
        };
        let idx = arenas.len() as u32;
        let chunks: Box<[Chunk<M>]> = (0..batch)
            .map(|i| Chunk {
                refcnt: AtomicU32::new(0),
                addr: region.addr().offset(i * size),
                iova: AtomicU64::new(NO_IOVA),
                pool: self.me.as_ptr(),
                arena: idx,
                owner: AtomicU32::new(0),
                poisoned: AtomicBool::new(false),
                deferred: AtomicU32::new(0),
                flush_seq: AtomicU64::new(0),
            })
            .collect();
        arenas.push(Arena::new(region, chunks));
        let ptrs = arenas
            .last()
            .map(|a| a.ptrs().collect())
            .unwrap_or_default();
        Ok((ptrs, huge))
    }

    /// Maps `chunks` with one call per contiguous run (persistent policy).
    fn map_batch(&self, chunks: &[ChunkPtr<M>], huge: bool) -> Result<()> {
        let size = self.cfg.order.size();
        let addrs: Vec<VirtAddr> = chunks.iter().map(|c| c.get().addr).collect();
        let total = (chunks.len() * size) as u64;
        let align = if huge && total >= HUGE_PAGE_SIZE {
            HUGE_PAGE_SIZE
        } else {
            size as u64
        };
        // SAFETY: the arenas live until the shared state drops, which
        // retires every mapping first and keeps any arena whose mapping
        // could not be retired; shrink unmaps and flushes before releasing.
        let iovas = unsafe {
            self.domain
                .map_many(&addrs, size as u64, align, self.cfg.dir, huge)
        }?;
        for (c, i) in chunks.iter().zip(iovas) {
            c.get().iova.store(i.raw(), Ordering::Relaxed);
        }
        self.note_mapped(total, true);
        Ok(())
    }

    /// Gives back one batch of free chunks if the free list is past the high
    /// watermark (or holds any, under memory pressure): unmapped first (one
    /// call per contiguous range), flushed, then their memory returned to
    /// the OS and uncharged. Chunks whose unmap or flush failed are pinned.
    /// Returns chunks released.
    pub(super) fn shrink(&self) -> Result<usize> {
        if self.shrinking.swap(true, Ordering::Acquire) {
            return Ok(0);
        }
        // Cleared however the shrink ends, a panic in a caller's code
        // (the account's) included, so later shrinks still run.
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _done = Done(&self.shrinking);
        self.shrink_locked()
    }

    fn shrink_locked(&self) -> Result<usize> {
        let mark = if self.under_pressure() {
            0
        } else {
            self.cfg.high_watermark
        };
        let free = self.free.len();
        if free <= mark || self.gate.shut(mark) {
            return Ok(0);
        }
        // Not waited for: a grow holds the lock while it maps, and a pool
        // that grows had no free chunk to give back when it began. A grow
        // lets go of it before the account runs its pressure hooks, and a
        // shrink before it uncharges (below), so a hook may trim this pool
        // or drop its frags (and so shrink it) on either thread.
        let Some(arenas) = try_lock(&self.arenas) else {
            return Ok(0);
        };
        let (out, missing) = self.take_whole_arenas(&arenas, free - mark);
        self.gate.set(missing, mark);
        if out.is_empty() {
            return Ok(0);
        }
        let size = self.cfg.order.size();
        let (stuck, first_err) = self.retire(&out);
        let mut released = Vec::with_capacity(out.len());
        let mut keep_memory = Vec::new();
        for c in out {
            if stuck(c) {
                keep_memory.push(c.get().arena);
                self.pin_listed(c);
            } else {
                released.push(c);
            }
        }
        let mut gone: Vec<u32> = released.iter().map(|c| c.get().arena).collect();
        gone.dedup();
        for idx in gone {
            if keep_memory.contains(&idx) {
                continue; // part of it stays reachable: keep its pages
            }
            // SAFETY: every chunk of the arena is unmapped, its invalidation
            // complete, and in no list or frag: nobody can reach its memory
            // until it is grown again.
            if unsafe { arenas[idx as usize].region.release_all() }.is_err() {
                // Memory stays resident; the chunks are still released and
                // unmapped, so this is only a missed saving.
                self.note_unmap_error();
            }
        }
        let n = released.len();
        self.counters.chunks.fetch_sub(n as u64, Ordering::Relaxed);
        self.counters.shrinks.fetch_add(1, Ordering::Relaxed);
        // Uncharged with the lock let go: the account's hooks may grow
        // this pool (a hook that takes memory again as pressure ends).
        // And before a grow can reuse the chunks, so that the account
        // never counts them twice.
        drop(arenas);
        self.uncharge((n * size) as u64);
        lock(&self.released).extend(released);
        self.counters
            .released
            .fetch_add(n as u64, Ordering::Relaxed);
        first_err.map_or(Ok(n), Err)
    }

    /// Memory goes back a whole arena at a time: an arena is one mapping
    /// (VFIO refuses an unmap that splits a mapping) and, with huge pages,
    /// whole 2 MiB pages. Pops the free list, keeps the chunks of arenas
    /// whose every chunk is free, up to `want` chunks and about one shrink
    /// batch, and pushes the rest back. The kept chunks come sorted by
    /// arena and address. Also returns how many pushes to the free list
    /// must come before another call can take an arena (0 if this one took
    /// any).
    fn take_whole_arenas(&self, arenas: &[Arena<M>], want: usize) -> (Vec<ChunkPtr<M>>, u64) {
        let mut all = Vec::with_capacity(self.free.len());
        while let Some(c) = self.free.pop() {
            all.push(c);
        }
        let mut free_in = vec![0usize; arenas.len()];
        for c in &all {
            free_in[c.get().arena as usize] += 1;
        }
        let mut take = vec![false; arenas.len()];
        let mut chosen = 0;
        let mut missing = u64::MAX;
        for (i, a) in arenas.iter().enumerate() {
            let n = a.chunks.len();
            if chosen >= self.cfg.shrink_batch {
                break;
            }
            if free_in[i] < n {
                missing = missing.min((n - free_in[i]) as u64);
            } else if chosen + n > want {
                // Whole, but taking it would go below the watermark.
                missing = missing.min((chosen + n - want) as u64);
            } else {
                take[i] = true;
                chosen += n;
            }
        }
        if chosen > 0 || missing == u64::MAX {
            missing = 0;
        }
        let (mut out, back): (Vec<_>, Vec<_>) =
            all.into_iter().partition(|c| take[c.get().arena as usize]);
        for c in back {
            self.free.push(c);
        }
        out.sort_unstable_by_key(|c| (c.get().arena, c.get().addr));
        (out, missing)
    }

    /// Unmaps the mapped chunks of `chunks` and completes the invalidation.
    /// Returns which chunks are stuck (still reachable by a device: their
    /// unmap failed, or the flush after a deferred unmap failed) and the
    /// first error. Stuck chunks keep their IOVA; the others lose it.
    fn retire(&self, chunks: &[ChunkPtr<M>]) -> (impl Fn(ChunkPtr<M>) -> bool, Option<Error>) {
        let size = self.cfg.order.size() as u64;
        let ranges: Vec<(Iova, u64)> = chunks
            .iter()
            .filter_map(|c| {
                let i = c.get().iova.load(Ordering::Relaxed);
                (i != NO_IOVA).then_some((Iova(i), size))
            })
            .collect();
        // SAFETY: the chunks are the pool's, out of circulation (free, not
        // carved), so no frag names their IOVAs; each loses its IOVA below
        // unless its unmap failed.
        let (how, failed, mut err) = match unsafe { self.domain.unmap_many(&ranges) } {
            Ok(how) => (how, Vec::new(), None),
            Err(p) => {
                self.note_unmap_error();
                (p.how, p.failed, Some(p.error))
            }
        };
        let flushed = match self.domain.settle(how) {
            Ok(()) => true,
            Err(e) => {
                err.get_or_insert(e);
                false
            }
        };
        let deferred = matches!(how, Unmapped::Deferred { .. });
        let stuck: Vec<u64> = chunks
            .iter()
            .filter_map(|c| {
                let i = c.get().iova.load(Ordering::Relaxed);
                let in_failed = crate::dma::in_runs(&failed, Iova(i));
                let gone = i == NO_IOVA;
                let stuck = !gone && (in_failed || (deferred && !flushed));
                if !gone && !in_failed {
                    self.note_mapped(size, false);
                }
                if !gone && !stuck {
                    c.get().iova.store(NO_IOVA, Ordering::Relaxed);
                }
                stuck.then_some(c.get().addr.raw() as u64)
            })
            .collect();
        (
            move |c: ChunkPtr<M>| stuck.contains(&(c.get().addr.raw() as u64)),
            err,
        )
    }
}

impl<M: DmaMapper> Drop for Shared<M> {
    fn drop(&mut self) {
        // Every chunk is back (each queue with chunks out held a strong
        // count): in the free list, a reserve, the parked list, or pinned.
        let size = self.cfg.order.size() as u64;
        let mut back = Vec::new();
        let lists = std::iter::once(&self.free).chain(self.reserves.iter().map(|r| &r.free));
        for list in lists {
            while let Some(c) = list.pop() {
                back.push(c);
            }
        }
        let parked: Vec<ChunkPtr<M>> = lock(&self.parked).drain(..).collect();
        // Unmap before the arenas (and their memory) go away, and complete
        // the invalidations, parked chunks' included.
        let (stuck, _) = self.retire(&back);
        let parked_ok = parked.is_empty() || self.domain.flush().is_ok();
        // The chunks no device can reach any more: unmapped (or never
        // mapped) with their invalidations complete.
        let mut settled = Vec::with_capacity(back.len() + parked.len());
        for c in back {
            if stuck(c) {
                self.pin_listed(c);
            } else {
                settled.push(c);
            }
        }
        if parked_ok {
            settled.extend(parked);
        } else {
            parked.into_iter().for_each(|c| self.pin_listed(c));
        }
        settled.append(&mut lock(&self.released));
        self.keep_arenas(&settled);
        // What stays charged is what stays pinned. Last: a pressure hook
        // runs here, and a panic from it must find the memory settled.
        self.uncharge(self.counters.chunks.load(Ordering::Relaxed) * size);
    }
}

impl<M: DmaMapper> Shared<M> {
    /// Frees the memory of every arena whose chunks are all `settled` (no
    /// device can reach them), and keeps (leaks on purpose) every other:
    /// one that holds a pinned chunk, or a chunk in no list at all (lost
    /// to a panic in a caller's code, its mapping unknown). So a device
    /// that can still reach a chunk never reaches memory reused by another
    /// allocation: the address range stays mapped for good. Its pages go
    /// back to the kernel (`MADV_DONTNEED`): a device reading through a
    /// stale translation sees zeroes, never someone else's data, and a
    /// process whose unmaps keep failing does not grow its resident set
    /// without bound. Counts the pinned and lost bytes in the domain.
    fn keep_arenas(&mut self, settled: &[ChunkPtr<M>]) {
        let size = self.cfg.order.size();
        let pinned = std::mem::take(&mut *lock(&self.pinned));
        let mut arenas = std::mem::take(&mut *lock(&self.arenas));
        // Per arena: its chunks found settled or pinned.
        let mut found = vec![0usize; arenas.len()];
        for c in settled.iter().chain(&pinned) {
            if let Some(n) = found.get_mut(c.get().arena as usize) {
                *n += 1;
            }
        }
        for c in &pinned {
            if let Some(a) = arenas.get_mut(c.get().arena as usize) {
                a.pinned = true;
            }
        }
        let mut lost = 0;
        for (a, &n) in arenas.iter_mut().zip(&found) {
            let missing = a.chunks.len().saturating_sub(n);
            lost += missing;
            a.pinned |= missing > 0;
        }
        self.domain.pin_host(((pinned.len() + lost) * size) as u64);
        // A persistent chunk pinned on purpose (`Frag::pin` poisons it)
        // keeps its part of the arena's mapping, which no unmap tried and
        // so none counted. One whose unmap failed was counted then.
        if self.cfg.policy == Policy::Persistent {
            let kept = pinned.iter().filter(|c| {
                let c = c.get();
                c.poisoned.load(Ordering::Relaxed) && c.iova.load(Ordering::Relaxed) != NO_IOVA
            });
            self.domain.pin_iova((kept.count() * size) as u64);
        }
        for a in arenas.iter_mut() {
            if a.pinned {
                // SAFETY: the pool is going away: no frag, list or cache
                // can reach this memory any more (a lost chunk was in no
                // list, and the pool's last strong count is gone), and the
                // region stays mapped in the process for good (its `free`
                // stays false).
                let _ = unsafe { a.region.release(0, a.region.len()) };
            } else {
                a.free = true;
            }
        }
        // Dropping an arena frees its memory only if `free` (not kept).
        drop(arenas);
    }
}
