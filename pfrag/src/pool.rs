//! The chunk pool: order-N chunks carved from arenas, a lock-free free list
//! (`crossbeam_queue::SegQueue`), growth in batches mapped with one call, and
//! shrinking past a high watermark in batches unmapped one call per
//! contiguous range.
//!
//! Lifetime. Chunk metadata (the side table) lives in boxed slices owned by
//! the pool's shared state, so its address never changes. Every chunk that is
//! out of the free list (held by a frag cache or by in-flight frags) holds one
//! strong count on that shared state, taken when the chunk leaves the free
//! list and dropped when it returns; so the pool outlives its frags without an
//! atomic per frag.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crossbeam_queue::SegQueue;

use crate::addr::{Iova, Order, VirtAddr, HUGE_PAGE_SIZE};
use crate::dma::{Dir, DmaMapper, Domain};
use crate::error::{Error, Result};
use crate::mem::{Backing, Region};

/// When chunk memory is mapped for DMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Map each frag when handed out, unmap at its completion: the stock
    /// kernel baseline.
    PerFrag,
    /// Map a chunk when a cache takes it, unmap when its last frag completes.
    PerChunk,
    /// Map on grow, keep mapped while recycled, unmap on shrink.
    Persistent,
}

impl Policy {
    /// Every policy, in order of decreasing mapping cost.
    pub const ALL: [Policy; 3] = [Policy::PerFrag, Policy::PerChunk, Policy::Persistent];

    /// The lab's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::PerFrag => "per-frag",
            Policy::PerChunk => "per-chunk",
            Policy::Persistent => "persistent",
        }
    }
}

/// Settings of a [`Pool`].
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Chunk order.
    pub order: Order,
    /// Mapping policy.
    pub policy: Policy,
    /// Direction chunks are mapped for.
    pub dir: Dir,
    /// Chunks per grow (one arena, one map call). 0 = 1 MiB worth (2 MiB
    /// with huge pages), at least 1.
    pub grow_batch: usize,
    /// Free chunks above which the pool shrinks. 0 = the larger of 4 grow
    /// batches and 32 MiB of chunks: a TX ring reaped in one burst frees
    /// hundreds of chunks at once, and a watermark below that would shrink
    /// and regrow the pool on every burst (map and unmap calls in steady
    /// state).
    pub high_watermark: usize,
    /// Chunks per shrink. 0 = the grow batch.
    pub shrink_batch: usize,
    /// Most bytes of chunk memory the pool may hold; `None` = unlimited.
    pub max_bytes: Option<u64>,
    /// Largest payload one `FragCache::frags` call accepts.
    pub max_payload: usize,
    /// Back arenas with 2 MiB huge pages when available.
    pub hugepages: bool,
}

impl PoolConfig {
    /// Defaults for `order` and `policy`: TX direction, automatic batches,
    /// no byte limit, 256 KiB max payload, normal pages.
    pub fn new(order: Order, policy: Policy) -> PoolConfig {
        PoolConfig {
            order,
            policy,
            dir: Dir::TO_DEVICE,
            grow_batch: 0,
            high_watermark: 0,
            shrink_batch: 0,
            max_bytes: None,
            max_payload: 256 << 10,
            hugepages: false,
        }
    }

    fn resolve(mut self) -> Result<PoolConfig> {
        let chunk = self.order.size();
        if self.grow_batch == 0 {
            let target = if self.hugepages {
                HUGE_PAGE_SIZE as usize
            } else {
                1 << 20
            };
            self.grow_batch = (target / chunk).max(1);
        }
        if self.high_watermark == 0 {
            self.high_watermark = (4 * self.grow_batch).max((32 << 20) / chunk);
        }
        if self.shrink_batch == 0 {
            self.shrink_batch = self.grow_batch;
        }
        if self.max_payload == 0 {
            return Err(Error::BadConfig {
                what: "max_payload",
                value: 0,
            });
        }
        if self.dir.is_empty() {
            return Err(Error::BadConfig {
                what: "dir",
                value: 0,
            });
        }
        Ok(self)
    }
}

/// A snapshot of a pool's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Grow operations (each one arena or one batch of released chunks).
    pub grows: u64,
    /// Shrink operations.
    pub shrinks: u64,
    /// Chunks with memory behind them.
    pub chunks: u64,
    /// Chunks whose memory was given back to the OS.
    pub released: u64,
    /// Chunks that returned to the free list.
    pub recycles: u64,
    /// Bytes of pool memory mapped for DMA now.
    pub mapped_bytes: u64,
    /// Arenas that asked for huge pages and got normal ones.
    pub huge_fallbacks: u64,
    /// Arenas backed by huge pages.
    pub huge_arenas: u64,
    /// Unmaps that failed where no error could be returned (completion in
    /// `Drop`).
    pub unmap_errors: u64,
}

/// Sentinel for "no IOVA".
const NO_IOVA: u64 = u64::MAX;

/// One chunk's entry in the side table. Padded to a cache line so that
/// queues completing frags of neighbouring chunks do not share a line.
#[repr(align(64))]
pub(crate) struct Chunk<M: DmaMapper> {
    /// References: the holding cache's bias plus one per in-flight frag.
    /// Invariant: 0 exactly while the chunk is in the free or released list.
    pub(crate) refcnt: AtomicU32,
    /// Host address of the chunk; fixed for its life.
    pub(crate) addr: VirtAddr,
    /// IOVA of the chunk's mapping, or `NO_IOVA`. Written only by whoever
    /// owns the chunk exclusively (the pool on grow/shrink, the cache on
    /// take, the last completer on recycle).
    pub(crate) iova: AtomicU64,
    /// The pool's shared state.
    pub(crate) pool: *const Shared<M>,
    /// Index of the arena that holds the memory.
    arena: u32,
}

// SAFETY: the fields are atomics or immutable after construction; `pool`
// points at state that is itself Sync and outlives the chunk (see the module
// docs).
unsafe impl<M: DmaMapper> Sync for Chunk<M> {}
// SAFETY: as above.
unsafe impl<M: DmaMapper> Send for Chunk<M> {}

/// A pointer to a chunk's side-table entry.
pub(crate) struct ChunkPtr<M: DmaMapper>(pub(crate) NonNull<Chunk<M>>);

impl<M: DmaMapper> Clone for ChunkPtr<M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M: DmaMapper> Copy for ChunkPtr<M> {}
impl<M: DmaMapper> PartialEq for ChunkPtr<M> {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}

// SAFETY: the pointee is Sync and lives in the pool's side table, which stays
// allocated while any ChunkPtr can be used (module docs).
unsafe impl<M: DmaMapper> Send for ChunkPtr<M> {}

impl<M: DmaMapper> ChunkPtr<M> {
    pub(crate) fn get(&self) -> &Chunk<M> {
        // SAFETY: side-table entries are never freed while the pool's shared
        // state is alive, and every holder of a ChunkPtr outside the pool
        // keeps it alive (module docs).
        unsafe { self.0.as_ref() }
    }
}

struct Arena<M: DmaMapper> {
    region: Region,
    chunks: Box<[Chunk<M>]>,
}

#[derive(Default)]
struct Counters {
    grows: AtomicU64,
    shrinks: AtomicU64,
    chunks: AtomicU64,
    released: AtomicU64,
    recycles: AtomicU64,
    mapped_bytes: AtomicU64,
    huge_fallbacks: AtomicU64,
    huge_arenas: AtomicU64,
    unmap_errors: AtomicU64,
}

/// State shared by a pool's handles, caches and frags.
pub(crate) struct Shared<M: DmaMapper> {
    pub(crate) domain: Arc<Domain<M>>,
    pub(crate) cfg: PoolConfig,
    /// Chunks ready to hand out. Invariant: refcnt 0; mapped iff Persistent.
    free: SegQueue<ChunkPtr<M>>,
    /// Chunks whose memory was given back. Invariant: refcnt 0, unmapped.
    released: Mutex<Vec<ChunkPtr<M>>>,
    /// All arenas; also the lock that serialises grow and shrink.
    arenas: Mutex<Vec<Arena<M>>>,
    /// Set while one thread shrinks, so completions never queue behind it.
    shrinking: AtomicBool,
    counters: Counters,
}

/// A pool of order-N chunks. Cheap to clone (a shared handle).
pub struct Pool<M: DmaMapper> {
    pub(crate) shared: Arc<Shared<M>>,
}

impl<M: DmaMapper> Clone for Pool<M> {
    fn clone(&self) -> Self {
        Pool {
            shared: self.shared.clone(),
        }
    }
}

impl<M: DmaMapper> std::fmt::Debug for Pool<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("cfg", &self.shared.cfg)
            .field("stats", &self.stats())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Pool state is updated before any call that can fail or panic, so a
    // poisoned lock still guards consistent data.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<M: DmaMapper> Pool<M> {
    /// A new, empty pool in `domain`.
    pub fn new(domain: Arc<Domain<M>>, cfg: PoolConfig) -> Result<Pool<M>> {
        let cfg = cfg.resolve()?;
        Ok(Pool {
            shared: Arc::new(Shared {
                domain,
                cfg,
                free: SegQueue::new(),
                released: Mutex::new(Vec::new()),
                arenas: Mutex::new(Vec::new()),
                shrinking: AtomicBool::new(false),
                counters: Counters::default(),
            }),
        })
    }

    /// The resolved configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.shared.cfg
    }

    /// The domain chunks are mapped in.
    pub fn domain(&self) -> &Arc<Domain<M>> {
        &self.shared.domain
    }

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> usize {
        self.shared.cfg.order.size()
    }

    /// Chunks in the free list now.
    pub fn free_chunks(&self) -> usize {
        self.shared.free.len()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            grows: l(&c.grows),
            shrinks: l(&c.shrinks),
            chunks: l(&c.chunks),
            released: l(&c.released),
            recycles: l(&c.recycles),
            mapped_bytes: l(&c.mapped_bytes),
            huge_fallbacks: l(&c.huge_fallbacks),
            huge_arenas: l(&c.huge_arenas),
            unmap_errors: l(&c.unmap_errors),
        }
    }

    /// Takes a free chunk (growing if needed) for exclusive use by a cache.
    /// Maps it under `PerChunk`. The chunk holds a strong count on the pool.
    pub(crate) fn take(&self) -> Result<ChunkPtr<M>> {
        let sh = &self.shared;
        let c = loop {
            if let Some(c) = sh.free.pop() {
                break c;
            }
            sh.grow()?;
        };
        if sh.cfg.policy == Policy::PerChunk {
            let size = sh.cfg.order.size() as u64;
            match sh.domain.map(c.get().addr, size, size, sh.cfg.dir) {
                Ok(iova) => {
                    c.get().iova.store(iova.raw(), Ordering::Relaxed);
                    sh.counters.mapped_bytes.fetch_add(size, Ordering::Relaxed);
                }
                Err(e) => {
                    sh.free.push(c);
                    return Err(e);
                }
            }
        }
        std::mem::forget(self.shared.clone());
        Ok(c)
    }

    /// Gives back free chunks past the high watermark now (normally done by
    /// completions). Returns the number of chunks released.
    pub fn trim(&self) -> Result<usize> {
        self.shared.shrink()
    }
}

impl<M: DmaMapper> Shared<M> {
    pub(crate) fn note_unmap_error(&self) {
        self.counters.unmap_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn note_mapped(&self, bytes: u64, mapped: bool) {
        if mapped {
            self.counters
                .mapped_bytes
                .fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.counters
                .mapped_bytes
                .fetch_sub(bytes, Ordering::Relaxed);
        }
    }

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
            let region = Region::new(batch * size, align.max(size), cfg.hugepages)?;
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
                    pool: self as *const Shared<M>,
                    arena: idx,
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
    /// exclusively), and the chunk holds a strong count on its pool, which
    /// this call gives up: `c` must not be used afterwards.
    pub(crate) unsafe fn recycle(c: ChunkPtr<M>) {
        let ptr = c.get().pool;
        {
            // SAFETY: the chunk's strong count keeps the shared state alive
            // until the decrement below.
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
            sh.free.push(c);
            sh.counters.recycles.fetch_add(1, Ordering::Relaxed);
            if sh.free.len() > sh.cfg.high_watermark {
                let _ = sh.shrink();
            }
        }
        // SAFETY: pairs with the `forget(clone)` in `Pool::take`.
        unsafe { Arc::decrement_strong_count(ptr) };
    }

    /// Gives back one batch of free chunks if the free list is past the high
    /// watermark: unmapped first (one call per contiguous range), then their
    /// memory returned to the OS. Returns chunks released.
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
        if self.free.len() <= cfg.high_watermark {
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
        Ok(n)
    }
}

impl<M: DmaMapper> Drop for Shared<M> {
    fn drop(&mut self) {
        // Every chunk is back (each outstanding one held a strong count).
        let size = self.cfg.order.size() as u64;
        let mut ranges = Vec::new();
        while let Some(c) = self.free.pop() {
            let i = c.get().iova.load(Ordering::Relaxed);
            if i != NO_IOVA {
                ranges.push((Iova(i), size));
            }
        }
        // Unmap before the arenas (and their memory) go away.
        let _ = self.domain.unmap_many(&ranges);
    }
}
