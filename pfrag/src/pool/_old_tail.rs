    /// Adds one batch of chunks to the free list: released chunks first,
    /// else a new arena. Persistent pools map the batch with one call per
    /// contiguous run (one for a new arena).
    fn grow(&self) -> Result<()> {
        let mut arenas = lock(&self.arenas);
        if !self.free.is_empty() {
            return Ok(()); // someone else grew while we waited
        }
        let cfg = &self.cfg;
        let size = cfg.order.size();
        let batch = cfg.grow_batch;
        let mut released = lock(&self.released);
        let reuse = released.len().min(batch);
        let fresh = reuse == 0;
        let count = if fresh { batch } else { reuse };
        if let Some(max) = cfg.max_bytes {
            let held = self.counters.chunks.load(Ordering::Relaxed) * size as u64;
            let want = (count * size) as u64;
            if held + want > max {
                return Err(Error::LimitReached {
                    held,
                    requested: want,
                    max,
                });
            }
        }
        let charge = (count * size) as u64;
        if let Some(a) = &self.account {
            a.charge(charge)?;
        }
        let uncharge = || {
            if let Some(a) = &self.account {
                a.uncharge(charge);
            }
        };
        let mut huge = false;
        let chunks: Vec<ChunkPtr<M>> = if !fresh {
            let at = released.len() - reuse;
            released.drain(at..).collect()
        } else {
            let align = if cfg.hugepages {
                HUGE_PAGE_SIZE as usize
            } else {
                size
            };
            let region = match Region::new(batch * size, align.max(size), cfg.hugepages) {
                Ok(r) => r,
                Err(e) => {
                    uncharge();
                    return Err(e);
                }
            };
            huge = region.backing() == Backing::Huge;
            match region.backing() {
                Backing::Huge => self.counters.huge_arenas.fetch_add(1, Ordering::Relaxed),
                Backing::HugeFallback => {
                    self.counters.huge_fallbacks.fetch_add(1, Ordering::Relaxed)
                }
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
                    flush_seq: AtomicU64::new(0),
                })
                .collect();
            arenas.push(Arena { region, chunks });
            let a = arenas.last().expect("just pushed");
            a.chunks
                .iter()
                .map(|c| ChunkPtr(NonNull::from(c)))
                .collect()
        };
        if cfg.policy == Policy::Persistent {
            let addrs: Vec<VirtAddr> = chunks.iter().map(|c| c.get().addr).collect();
            let total = (chunks.len() * size) as u64;
            let align = if huge && total >= HUGE_PAGE_SIZE {
                HUGE_PAGE_SIZE
            } else {
                size as u64
            };
            match self
                .domain
                .map_many(&addrs, size as u64, align, cfg.dir, huge)
            {
                Ok(iovas) => {
                    for (c, i) in chunks.iter().zip(iovas) {
                        c.get().iova.store(i.raw(), Ordering::Relaxed);
                    }
                    self.note_mapped(total, true);
                }
                Err(e) => {
                    // Nothing leaks: reused chunks go back to the released
                    // list; a new arena's chunks become released chunks
                    // (their memory was never touched).
                    released.extend(chunks);
                    if fresh {
                        self.counters
                            .released
                            .fetch_add(batch as u64, Ordering::Relaxed);
                    }
                    uncharge();
                    return Err(e);
                }
            }
        }
        if !fresh {
            self.counters
                .released
                .fetch_sub(reuse as u64, Ordering::Relaxed);
        }
        self.counters
            .chunks
            .fetch_add(count as u64, Ordering::Relaxed);
        self.counters.grows.fetch_add(1, Ordering::Relaxed);
        for c in chunks {
            self.free.push(c);
        }
        Ok(())
    }

    /// Returns a chunk whose last reference is gone to the free list.
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
            if sh.cfg.policy == Policy::PerChunk {
                let size = sh.cfg.order.size() as u64;
                let iova = c.get().iova.swap(NO_IOVA, Ordering::Relaxed);
                if iova != NO_IOVA {
                    match sh.domain.unmap(Iova(iova), size) {
                        Ok(()) => sh.note_mapped(size, false),
                        Err(_) => sh.note_unmap_error(),
                    }
                }
            }
            let size = sh.cfg.order.size() as u64;
            let r = &sh.reserves[c.get().owner.load(Ordering::Relaxed) as usize];
            let pressure = sh.under_pressure();
            match sh.cfg.reclaim {
                Reclaim::Eager => {
                    sh.free.push(c);
                    r.shared_op(1);
                    r.c.reclaim_calls.fetch_add(1, Ordering::Relaxed);
                    r.c.reclaimed_bytes.fetch_add(size, Ordering::Relaxed);
                }
                Reclaim::Hysteresis { threshold, chunk } => {
                    // Count before the push: a taker pops first and
                    // subtracts after, so `held` never drops below what the
                    // reserve holds (loom found the other order underflow).
                    let held = r.held.fetch_add(size, Ordering::Relaxed) + size;
                    r.free.push(c);
                    r.c.peak_held.fetch_max(held, Ordering::Relaxed);
                    if r.pressured.load(Ordering::Relaxed) && held >= (threshold / 4).max(size) {
                        // The owner has room again.
                        r.pressured.store(false, Ordering::Relaxed);
                    }
                    if pressure {
                        sh.reclaim(r, u64::MAX);
                    } else if held > threshold {
                        sh.reclaim(r, chunk);
                    }
                }
            }
            r.c.recycles.fetch_add(1, Ordering::Relaxed);
            if pressure || sh.free.len() > sh.cfg.high_watermark {
                let _ = sh.shrink();
            }
            r.out.fetch_sub(1, Ordering::AcqRel) == 1
        };
        if last {
            // SAFETY: pairs with the `forget(clone)` in `Pool::take` made
            // when this queue's count left zero; nothing of the shared state
            // is used after it.
            unsafe { Arc::decrement_strong_count(ptr) };
        }
    }

    /// Gives back one batch of free chunks if the free list is past the high
    /// watermark (or holds any, under memory pressure): unmapped first (one
    /// call per contiguous range), then their memory returned to the OS and
    /// uncharged. Returns chunks released.
    fn shrink(&self) -> Result<usize> {
        if self.shrinking.swap(true, Ordering::Acquire) {
            return Ok(0);
        }
        let r = self.shrink_locked();
        self.shrinking.store(false, Ordering::Release);
        r
    }

    fn shrink_locked(&self) -> Result<usize> {
        let cfg = &self.cfg;
        let mark = if self.under_pressure() {
            0
        } else {
            cfg.high_watermark
        };
        if self.free.len() <= mark {
            return Ok(0);
        }
        let arenas = lock(&self.arenas);
        let size = cfg.order.size();
        let mut out: Vec<ChunkPtr<M>> = Vec::with_capacity(cfg.shrink_batch);
        while out.len() < cfg.shrink_batch {
            match self.free.pop() {
                Some(c) => out.push(c),
                None => break,
            }
        }
        out.sort_unstable_by_key(|c| c.get().addr);
        let ranges: Vec<(Iova, u64)> = out
            .iter()
            .filter_map(|c| {
                let i = c.get().iova.load(Ordering::Relaxed);
                (i != NO_IOVA).then_some((Iova(i), size as u64))
            })
            .collect();
        if let Err(e) = self.domain.unmap_many(&ranges) {
            for c in out {
                self.free.push(c);
            }
            return Err(e);
        }
        self.note_mapped(ranges.len() as u64 * size as u64, false);
        for c in &out {
            let ch = c.get();
            ch.iova.store(NO_IOVA, Ordering::Relaxed);
            let a = &arenas[ch.arena as usize];
            let off = ch.addr.raw() - a.region.addr().raw();
            // SAFETY: the chunk is unmapped and in no list or frag: nobody
            // can reach its memory until it is grown again.
            if unsafe { a.region.release(off, size) }.is_err() {
                // Memory stays resident; the chunk is still released and
                // unmapped, so this is only a missed saving.
                self.note_unmap_error();
            }
        }
        let n = out.len();
        lock(&self.released).extend(out);
        self.counters
            .released
            .fetch_add(n as u64, Ordering::Relaxed);
        self.counters.chunks.fetch_sub(n as u64, Ordering::Relaxed);
        self.counters.shrinks.fetch_add(1, Ordering::Relaxed);
        if let Some(a) = &self.account {
            a.uncharge((n * size) as u64);
        }
        Ok(n)
    }
}

impl<M: DmaMapper> Drop for Shared<M> {
    fn drop(&mut self) {
        // Every chunk is back (each outstanding one held a strong count).
        let size = self.cfg.order.size() as u64;
        let mut ranges = Vec::new();
        let lists = std::iter::once(&self.free).chain(self.reserves.iter().map(|r| &r.free));
        for list in lists {
            while let Some(c) = list.pop() {
                let i = c.get().iova.load(Ordering::Relaxed);
                if i != NO_IOVA {
                    ranges.push((Iova(i), size));
                }
            }
        }
        // Unmap before the arenas (and their memory) go away.
        let _ = self.domain.unmap_many(&ranges);
        if let Some(a) = &self.account {
            a.uncharge(self.counters.chunks.load(Ordering::Relaxed) * size);
        }
    }
}
