//! The mapping policy in one place ("map on take, unmap on recycle, map per
//! frag"), and where a chunk goes when its last reference is gone: the
//! per-chunk map and unmap, the per-frag map and unmap, and the rule that a
//! chunk is reused only once every unmap of it has completed its
//! invalidation. (`Persistent` maps on grow, in `arena.rs`.) The frag
//! cache never calls the domain itself.
//!
//! A chunk whose last unmap waits for a lazy flush is *parked*; it goes
//! back to the free list when the flush has happened (checked before the
//! pool would grow, forcing a flush rather than growing). A chunk a mapping
//! of which could not be removed is *pinned*: kept out of circulation for
//! good, counted, never handed out again.

use std::sync::Arc;

use super::{ChunkPtr, Policy, Reclaim, Shared, NO_IOVA};
use crate::addr::{align_down, align_up, Iova, VirtAddr, PAGE_SIZE};
use crate::dma::{DmaMapper, Unmapped};
use crate::error::Result;
use crate::sync::{lock, Ordering};

impl<M: DmaMapper> Shared<M> {
    /// Maps a chunk a cache just took, under `PerChunk`.
    pub(super) fn map_taken(&self, c: ChunkPtr<M>) -> Result<()> {
        if self.cfg.policy != Policy::PerChunk {
            return Ok(());
        }
        let size = self.cfg.order.size() as u64;
        // SAFETY: the chunk's arena lives until the pool's shared state
        // drops, which retires every mapping first (or pins the arena); the
        // mapping is removed in `give_back` before the chunk is reused.
        let iova = unsafe { self.domain.map(c.get().addr, size, size, self.cfg.dir) }?;
        c.get().iova.store(iova.raw(), Ordering::Relaxed);
        self.note_mapped(size, true);
        Ok(())
    }

    /// The IOVA of chunk `c` when its frags use the chunk's mapping
    /// (`Persistent`, `PerChunk`); `None` when each frag maps itself
    /// (`PerFrag`).
    #[inline]
    pub(crate) fn chunk_iova(&self, c: ChunkPtr<M>) -> Option<Iova> {
        (self.cfg.policy != Policy::PerFrag).then(|| Iova(c.get().iova.load(Ordering::Relaxed)))
    }

    /// The IOVA of a frag of `len` bytes at `addr` (offset `start` in chunk
    /// `c`), and whether the frag has a mapping of its own (`PerFrag`: made
    /// here, one map call for the pages it touches), which its completion
    /// removes.
    #[inline]
    pub(crate) fn frag_iova(
        &self,
        c: ChunkPtr<M>,
        addr: VirtAddr,
        start: usize,
        len: usize,
    ) -> Result<(Iova, bool)> {
        if let Some(base) = self.chunk_iova(c) {
            return Ok((base.offset(start as u64), false));
        }
        let lo = align_down(addr.raw() as u64, PAGE_SIZE);
        let hi = align_up((addr.raw() + len) as u64, PAGE_SIZE);
        // SAFETY: the pages lie in the chunk's arena, which lives until the
        // pool's shared state retires every mapping (the frag's own is
        // removed at its completion, before the chunk can be reused).
        let base = unsafe {
            self.domain
                .map(VirtAddr(lo as usize), hi - lo, PAGE_SIZE, self.cfg.dir)
        }?;
        self.note_mapped(hi - lo, true);
        Ok((base.offset(addr.raw() as u64 - lo), true))
    }

    /// Returns a chunk whose last reference is gone: to its queue's reserve
    /// or the free list, or parked, or pinned.
    ///
    /// # Safety
    /// `c`'s refcount just dropped to zero (the caller holds the chunk
    /// exclusively), and the chunk is counted out by its owning queue, which
    /// this call undoes (dropping the queue's strong count on the pool if it
    /// was the last): `c` must not be used afterwards.
    pub(crate) unsafe fn recycle(c: ChunkPtr<M>) {
        let ptr = c.get().pool;
        let last = {
            // SAFETY: the owning queue's strong count (held while this chunk
            // is out) keeps the shared state alive until the decrement below.
            let sh = unsafe { &*ptr };
            let r = &sh.reserves[c.get().owner.load(Ordering::Relaxed) as usize];
            sh.give_back(c);
            r.out.fetch_sub(1, Ordering::AcqRel) == 1
        };
        if last {
            // SAFETY: pairs with the increment in `Pool::take` made when
            // this queue's count left zero; `ptr` comes from the Arc's own
            // allocation (`Weak::as_ptr`), and nothing of the shared state
            // is used after it.
            unsafe { Arc::decrement_strong_count(ptr) };
        }
    }

    fn give_back(&self, c: ChunkPtr<M>) {
        if self.cfg.policy == Policy::PerChunk {
            self.unmap_chunk(c);
        }
        if c.get().poisoned.load(Ordering::Relaxed) {
            self.pin_listed(c);
            return;
        }
        if self.flush_pending(c) {
            lock(&self.parked).push_back(c);
            self.counters.parks.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.free_to_lists(c);
    }

    /// Removes a `PerChunk` chunk's own mapping as its last frag goes,
    /// unless the chunk was pinned on purpose (`poisoned` before the
    /// unmap: [`Frag::pin`](crate::frag::Frag::pin) is the only way there,
    /// since a failed unmap of this mapping happens here). A device that
    /// could not be stopped may still reach a pinned chunk through the
    /// mapping, and a removed mapping's IOVA would go back to the
    /// allocator, to be mapped to other memory the device must never
    /// reach: so the mapping stays for good, counted in the domain's
    /// pinned IOVA bytes.
    fn unmap_chunk(&self, c: ChunkPtr<M>) {
        let size = self.cfg.order.size() as u64;
        if c.get().poisoned.load(Ordering::Relaxed) {
            if c.get().iova.load(Ordering::Relaxed) != NO_IOVA {
                self.domain.pin_iova(size);
            }
            return;
        }
        let iova = c.get().iova.swap(NO_IOVA, Ordering::Relaxed);
        if iova != NO_IOVA && self.unmap_part(c, Iova(iova), size).is_err() {
            // Still mapped: keep the IOVA with the pinned chunk.
            c.get().iova.store(iova, Ordering::Relaxed);
        }
    }

    /// The reserve or the free list, by the reclaim policy; shrinks past
    /// the watermark or under pressure.
    fn free_to_lists(&self, c: ChunkPtr<M>) {
        let size = self.cfg.order.size() as u64;
        let r = &self.reserves[c.get().owner.load(Ordering::Relaxed) as usize];
        let pressure = self.under_pressure();
        match self.cfg.reclaim {
            Reclaim::Eager => {
                self.push_free(c);
                r.shared_op(1);
                r.c.reclaim_calls.fetch_add(1, Ordering::Relaxed);
                r.c.reclaimed_bytes.fetch_add(size, Ordering::Relaxed);
            }
            Reclaim::Hysteresis { threshold, chunk } => {
                // Count before the push: a taker pops first and subtracts
                // after, so `held` never drops below what the reserve holds
                // (loom found the other order underflow).
                let held = r.held.fetch_add(size, Ordering::Relaxed) + size;
                r.free.push(c);
                r.c.peak_held.fetch_max(held, Ordering::Relaxed);
                if r.pressured.load(Ordering::Relaxed) && held >= (threshold / 4).max(size) {
                    // The owner has room again.
                    r.pressured.store(false, Ordering::Relaxed);
                }
                if pressure {
                    self.reclaim(r, u64::MAX);
                } else if held > threshold {
                    self.reclaim(r, chunk);
                }
            }
        }
        r.c.recycles.fetch_add(1, Ordering::Relaxed);
        if pressure || self.free.len() > self.cfg.high_watermark {
            // Failures are counted and their chunks pinned inside.
            let _ = self.shrink();
        }
    }

    /// Unmaps `iova..iova+len`, a mapping of (part of) chunk `c`: a deferred
    /// unmap makes the chunk wait for its flush before reuse; a failed one
    /// poisons the chunk (it is pinned when its last reference goes).
    pub(crate) fn unmap_part(&self, c: ChunkPtr<M>, iova: Iova, len: u64) -> Result<()> {
        // SAFETY: the range is the mapping a per-frag or per-chunk policy
        // made for `c`, whose last user is done with it (its frag completed
        // or the chunk's last reference went); it is not named again.
        match unsafe { self.domain.unmap(iova, len) } {
            Ok(how) => {
                if let Unmapped::Deferred { seq } = how {
                    c.get().flush_seq.fetch_max(seq, Ordering::Relaxed);
                    c.get().deferred.fetch_add(1, Ordering::Release);
                }
                self.note_mapped(len, false);
                Ok(())
            }
            Err(e) => {
                c.get().poisoned.store(true, Ordering::Relaxed);
                self.note_unmap_error();
                Err(e)
            }
        }
    }

    /// Whether a deferred unmap of `c` still waits for its flush.
    fn flush_pending(&self, c: ChunkPtr<M>) -> bool {
        let seq = c.get().flush_seq.load(Ordering::Relaxed);
        seq != 0 && seq > self.domain.flushed_seq()
    }

    /// Whether a cache may keep carving `c` after all its frags completed
    /// (no pending flush, not poisoned).
    pub(crate) fn reusable(&self, c: ChunkPtr<M>) -> bool {
        !c.get().poisoned.load(Ordering::Relaxed) && !self.flush_pending(c)
    }

    /// Moves parked chunks whose flush has completed to the free list;
    /// with `force`, flushes first if the oldest still waits (when the pool
    /// cannot grow). Returns how many moved.
    pub(super) fn unpark(&self, force: bool) -> usize {
        let mut parked = lock(&self.parked);
        let Some(&front) = parked.front() else {
            return 0;
        };
        if force && self.flush_pending(front) && self.domain.flush().is_err() {
            // The chunks wait for a later flush.
            return 0;
        }
        let mut n = 0;
        while let Some(&c) = parked.front() {
            if self.flush_pending(c) {
                break;
            }
            parked.pop_front();
            self.push_free(c);
            n += 1;
        }
        n
    }

    /// Pins a chunk that was counted in `chunks` (in circulation). Counted
    /// pinned first, so that the pool's limit check (which sums the two)
    /// never sees the chunk in neither.
    pub(super) fn pin_listed(&self, c: ChunkPtr<M>) {
        self.pin_unlisted(c);
        self.counters.chunks.fetch_sub(1, Ordering::Release);
    }

    /// Pins a chunk that was not counted in `chunks` (a grow that failed
    /// half-way).
    pub(super) fn pin_unlisted(&self, c: ChunkPtr<M>) {
        self.counters.pinned.fetch_add(1, Ordering::Relaxed);
        // Listed before the account's code runs: a panic there leaves it
        // pinned all the same.
        lock(&self.pinned).push(c);
        if let Some(a) = &self.account {
            // Still charged (the memory is still held), and said so.
            a.pin(self.cfg.order.size() as u64);
        }
    }
}
