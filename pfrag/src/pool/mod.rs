//! The chunk pool: order-N chunks carved from arenas, a lock-free free list
//! (`crossbeam_queue::SegQueue`), growth in batches mapped with one call, and
//! shrinking past a high watermark in batches unmapped one call per
//! contiguous range.
//!
//! Per-queue reserves. A pool serves `queues` TX queues. Under
//! [`Reclaim::Eager`] a chunk freed by a completion goes straight back to
//! the shared free list (one reclaim per freed chunk). Under
//! [`Reclaim::Hysteresis`] it goes to its queue's reserve (forward
//! allocation), which the queue takes from first; the reserve is trimmed
//! only past `threshold` bytes, `chunk` bytes at once, so the shared list
//! (and its atomics) is touched rarely. A queue that runs dry takes from
//! the shared list, then borrows from its neighbours' reserves, skipping any
//! neighbour that flagged itself *under pressure* (it ran dry too); only
//! the owner clears its flag, when its reserve has room again. Borrowing is
//! a lock-free pop: it never waits for a busy neighbour.
//!
//! Memory pressure. With a [`MemAccount`](crate::account::MemAccount)
//! ([`Pool::with_account`]), growth is charged and shrinking uncharged;
//! while the account is under pressure (one relaxed load per completion),
//! queues hand their whole reserve back and the pool gives free memory back
//! to the OS (unmapped first) regardless of its watermark.
//!
//! Lifetime. Chunk metadata (the side table) lives in boxed slices owned by
//! the pool's shared state, so its address never changes. Each queue counts
//! the chunks it has out of the lists (held by its frag cache or by
//! in-flight frags); while that count is above zero the queue holds one
//! strong count on the shared state, taken when the count leaves zero and
//! dropped when it returns to zero. So the pool outlives its frags without
//! an atomic per frag, and chunk turnover touches only the queue's own cache
//! lines, not a reference count shared by every queue.

mod arena;
mod config;
mod gate;
mod policy;
mod reserve;
mod stats;

pub use config::{Config, Policy, Reclaim};
use reserve::Reserve;
use stats::QueueCounters;
pub use stats::{QueueStats, Stats};

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

use crate::account::Charge;
use crate::addr::VirtAddr;
use crate::dma::{DmaMapper, Domain};
use crate::error::{Error, Result};
use crate::mem::Region;
use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Mutex, Ordering, Queue};

/// The most references a chunk may carry. Past it, taking one more
/// panics, after undoing the increment, so the count never wraps (leaked
/// holds could otherwise bring it back to zero while frags are live, as
/// `std::sync::Arc` guards against by aborting). Half the `u32` range: any
/// number of threads racing past the check together stays far below the
/// wrap.
pub(crate) const MAX_REFCNT: u32 = i32::MAX as u32;

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
    /// The pool's shared state. Derived from the `Arc` itself
    /// (`Weak::as_ptr`), so it carries the allocation's provenance and may
    /// give back the strong count a queue holds.
    pub(crate) pool: *const Shared<M>,
    /// Index of the arena that holds the memory.
    arena: u32,
    /// The queue that took it last (whose reserve it returns to).
    owner: AtomicU32,
    /// A mapping of this chunk could not be removed: it must never be
    /// reused, only pinned when its last reference goes.
    pub(crate) poisoned: AtomicBool,
    /// Deferred unmaps of (parts of) this chunk so far: a `PerFrag` cache
    /// that sees it change moves on to a page no such unmap covers.
    pub(crate) deferred: AtomicU32,
    /// The newest flush generation a deferred unmap of (part of) this chunk
    /// waits for; 0 if none. The chunk is reused only once the mapper's
    /// flush reached it.
    pub(crate) flush_seq: AtomicU64,
}

impl<M: DmaMapper> Chunk<M> {
    /// Takes one more reference on a chunk the caller already holds one
    /// on: the one path that adds to a live count (a cache charges its
    /// bias with a store, on a chunk it holds alone).
    ///
    /// # Panics
    /// Past [`MAX_REFCNT`], after giving the reference back: the count is
    /// left as it was, and can never wrap.
    #[inline]
    pub(crate) fn acquire(&self) {
        // Relaxed, as `Arc::clone`: the caller's reference keeps the count
        // above zero, and each release synchronises on its decrement.
        let old = self.refcnt.fetch_add(1, Ordering::Relaxed);
        if old >= MAX_REFCNT {
            self.refcnt.fetch_sub(1, Ordering::Relaxed);
            refcount_overflow(old);
        }
    }
}

#[cold]
#[inline(never)]
fn refcount_overflow(old: u32) -> ! {
    panic!("chunk reference count at its limit ({old} >= {MAX_REFCNT}): references leaked")
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

/// One mapping of chunk memory and the side table of its chunks.
///
/// The side table is a raw allocation (from `Box::into_raw`) rather than a
/// `Box`, so that moving the arena never retags it: every `ChunkPtr` is
/// derived from `chunks` and stays valid until the arena drops.
struct Arena<M: DmaMapper> {
    region: std::mem::ManuallyDrop<Region>,
    /// The side table of the arena's chunks.
    chunks: NonNull<[Chunk<M>]>,
    /// Holds a pinned chunk: its memory is never unmapped from the process.
    pinned: bool,
    /// Whether dropping it frees its memory. Set only by the pool's drop,
    /// once every unmap and invalidation is done and the arena is found to
    /// hold no pinned chunk; until then an arena dropped (by a panic that
    /// unwinds out of the pool's drop, from a pressure hook or a mapper)
    /// keeps its memory, as a pinned one does, since a device may still
    /// reach it.
    free: bool,
}

impl<M: DmaMapper> Arena<M> {
    fn new(region: Region, table: Box<[Chunk<M>]>) -> Arena<M> {
        Arena {
            region: std::mem::ManuallyDrop::new(region),
            chunks: NonNull::from(Box::leak(table)),
            pinned: false,
            free: false,
        }
    }

    /// Pointers to its chunks, with the table's own provenance.
    fn ptrs(&self) -> impl Iterator<Item = ChunkPtr<M>> + '_ {
        let base = self.chunks.cast::<Chunk<M>>();
        // SAFETY: `i < len`, inside the live table.
        (0..self.chunks.len()).map(move |i| ChunkPtr(unsafe { base.add(i) }))
    }
}

impl<M: DmaMapper> Drop for Arena<M> {
    fn drop(&mut self) {
        // SAFETY: the table came from `Box::leak` in `new` and nothing uses
        // it once the pool's shared state (which owns the arenas) drops.
        drop(unsafe { Box::from_raw(self.chunks.as_ptr()) });
        if self.free {
            // SAFETY: dropped once, here; the pool's drop found that no
            // device can reach it any more (see `free`). Any other region
            // is leaked on purpose.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.region) };
        }
    }
}

// SAFETY: the table holds atomics and plain data, and the region is owned
// memory; the pool's locks serialise what is not atomic.
unsafe impl<M: DmaMapper> Send for Arena<M> {}

#[derive(Default)]
struct Counters {
    grows: AtomicU64,
    shrinks: AtomicU64,
    chunks: AtomicU64,
    released: AtomicU64,
    mapped_bytes: AtomicU64,
    huge_fallbacks: AtomicU64,
    huge_arenas: AtomicU64,
    unmap_errors: AtomicU64,
    pinned: AtomicU64,
    parks: AtomicU64,
}

/// State shared by a pool's handles, caches and frags.
pub(crate) struct Shared<M: DmaMapper> {
    pub(crate) domain: Arc<Domain<M>>,
    pub(crate) cfg: Config,
    /// Chunks ready to hand out. Invariant: refcnt 0; mapped iff Persistent.
    free: Queue<ChunkPtr<M>>,
    /// Chunks whose memory was given back. Invariant: refcnt 0, unmapped.
    released: Mutex<Vec<ChunkPtr<M>>>,
    /// All arenas; also the lock that serialises grow and shrink.
    arenas: Mutex<Vec<Arena<M>>>,
    /// Set while one thread shrinks, so completions never queue behind it.
    shrinking: AtomicBool,
    /// When the next shrink can find a whole free arena (see
    /// [`gate::Gate`]).
    gate: gate::Gate,
    counters: Counters,
    /// One reserve per queue.
    reserves: Box<[Reserve<M>]>,
    /// The memory account charged on grow, uncharged on shrink.
    account: Option<Arc<dyn Charge>>,
    /// The account's pressure flag, read on the completion path.
    pressure: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// This state's own allocation, for the chunks' `pool` pointers.
    me: Weak<Shared<M>>,
    /// Chunks kept out of circulation for good: a mapping of theirs could
    /// not be removed (or its invalidation could not be completed).
    pinned: Mutex<Vec<ChunkPtr<M>>>,
    /// Chunks whose last unmap waits for a flush (lazy invalidation),
    /// oldest first. Invariant: refcnt 0, unmapped.
    parked: Mutex<VecDeque<ChunkPtr<M>>>,
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

impl<M: DmaMapper> Pool<M> {
    /// A new, empty pool in `domain`.
    pub fn new(domain: Arc<Domain<M>>, cfg: Config) -> Result<Pool<M>> {
        Pool::build(domain, cfg, None)
    }

    /// A new, empty pool whose memory counts against `account` (shared by
    /// every pool that should share its limits).
    pub fn with_account(
        domain: Arc<Domain<M>>,
        cfg: Config,
        account: Arc<dyn Charge>,
    ) -> Result<Pool<M>> {
        Pool::build(domain, cfg, Some(account))
    }

    fn build(
        domain: Arc<Domain<M>>,
        cfg: Config,
        account: Option<Arc<dyn Charge>>,
    ) -> Result<Pool<M>> {
        let cfg = cfg.resolve()?;
        let pressure = account.as_ref().map(|a| a.pressure_flag());
        Ok(Pool {
            shared: Arc::new_cyclic(|me| Shared {
                me: me.clone(),
                pinned: Mutex::new(Vec::new()),
                parked: Mutex::new(VecDeque::new()),
                domain,
                free: Queue::new(),
                released: Mutex::new(Vec::new()),
                arenas: Mutex::new(Vec::new()),
                shrinking: AtomicBool::new(false),
                gate: gate::Gate::default(),
                counters: Counters::default(),
                reserves: (0..cfg.queues).map(|_| Reserve::new()).collect(),
                account,
                pressure,
                cfg,
            }),
        })
    }

    /// The resolved configuration.
    pub fn config(&self) -> &Config {
        &self.shared.cfg
    }

    /// The domain chunks are mapped in.
    pub fn domain(&self) -> &Arc<Domain<M>> {
        &self.shared.domain
    }

    /// The memory account the pool charges, if it was made with one
    /// ([`Pool::with_account`]): another pool that should share its limits
    /// is made with the same.
    pub fn account(&self) -> Option<&Arc<dyn Charge>> {
        self.shared.account.as_ref()
    }

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> usize {
        self.shared.cfg.order.size()
    }

    /// Chunks in the shared free list now.
    pub fn free_chunks(&self) -> usize {
        self.shared.free.len()
    }

    /// Chunks waiting for a lazy flush before reuse, now.
    pub fn parked_chunks(&self) -> usize {
        crate::sync::lock(&self.shared.parked).len()
    }

    /// Chunks in queue reserves now.
    pub fn reserved_chunks(&self) -> usize {
        self.shared.reserves.iter().map(|r| r.free.len()).sum()
    }

    /// Queues the pool serves.
    pub fn queues(&self) -> usize {
        self.shared.reserves.len()
    }

    /// Whether the pool's memory account is under pressure.
    pub fn under_pressure(&self) -> bool {
        self.shared.under_pressure()
    }

    /// A snapshot of queue `q`'s reserve.
    pub fn queue_stats(&self, q: usize) -> Result<QueueStats> {
        let r = self.shared.reserve(q)?;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Ok(QueueStats {
            held: l(&r.held),
            peak_held: l(&r.c.peak_held),
            reclaim_calls: l(&r.c.reclaim_calls),
            reclaimed_bytes: l(&r.c.reclaimed_bytes),
            shared_ops: l(&r.c.shared_ops),
            borrows: l(&r.c.borrows),
            lent: l(&r.c.lent),
            skipped_pressured: l(&r.c.skipped_pressured),
            pressure_flags: l(&r.c.pressure_flags),
            pressured: r.pressured.load(Ordering::Relaxed),
        })
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            grows: l(&c.grows),
            shrinks: l(&c.shrinks),
            chunks: l(&c.chunks),
            released: l(&c.released),
            recycles: self.shared.reserves.iter().map(|r| l(&r.c.recycles)).sum(),
            mapped_bytes: l(&c.mapped_bytes),
            huge_fallbacks: l(&c.huge_fallbacks),
            huge_arenas: l(&c.huge_arenas),
            unmap_errors: l(&c.unmap_errors),
            pinned: l(&c.pinned),
            parks: l(&c.parks),
            shared_ops: self
                .shared
                .reserves
                .iter()
                .map(|r| l(&r.c.shared_ops))
                .sum(),
            reclaim_calls: self
                .shared
                .reserves
                .iter()
                .map(|r| l(&r.c.reclaim_calls))
                .sum(),
            borrows: self.shared.reserves.iter().map(|r| l(&r.c.borrows)).sum(),
            skipped_pressured: self
                .shared
                .reserves
                .iter()
                .map(|r| l(&r.c.skipped_pressured))
                .sum(),
        }
    }

    /// Takes a free chunk for exclusive use by queue `q`'s cache: from its
    /// reserve, else the shared list, else a neighbour's reserve, else by
    /// growing. Maps it under `PerChunk`. The chunk holds a strong count on
    /// the pool.
    pub(crate) fn take(&self, q: usize) -> Result<ChunkPtr<M>> {
        let sh = &self.shared;
        let r = sh.reserve(q)?;
        let size = sh.cfg.order.size() as u64;
        // The reserve the chunk came from, if any: a chunk whose map fails
        // goes back there.
        let (c, from) = loop {
            if let Some(c) = r.free.pop() {
                r.held.fetch_sub(size, Ordering::Relaxed);
                break (c, Some(q));
            }
            if sh.cfg.reclaim != Reclaim::Eager && !r.pressured.load(Ordering::Relaxed) {
                // Ran dry: ask the neighbours to leave our reserve alone.
                r.pressured.store(true, Ordering::Relaxed);
                r.c.pressure_flags.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(c) = sh.free.pop() {
                r.shared_op(1);
                break (c, None);
            }
            if let Some((c, nb)) = sh.borrow(q) {
                break (c, Some(nb));
            }
            if sh.unpark(false) == 0 {
                match sh.grow() {
                    Ok(Some(c)) => {
                        // Counted as the pop from the shared list it
                        // stands for.
                        r.shared_op(1);
                        break (c, None);
                    }
                    Ok(None) => {}
                    // Out of room: a flush may free parked chunks.
                    Err(e) => {
                        if sh.unpark(true) == 0 {
                            return Err(e);
                        }
                    }
                }
            }
        };
        c.get().owner.store(q as u32, Ordering::Relaxed);
        if let Err(e) = sh.map_taken(c) {
            sh.untake(c, from, r);
            return Err(e);
        }
        if let Some(nb) = from.filter(|&nb| nb != q) {
            r.c.borrows.fetch_add(1, Ordering::Relaxed);
            sh.reserves[nb].c.lent.fetch_add(1, Ordering::Relaxed);
        }
        if r.out.fetch_add(1, Ordering::AcqRel) == 0 {
            // The queue's first chunk out: it now keeps the pool alive.
            // SAFETY: `self.shared` is a live Arc; the count is given back
            // in `recycle` through the chunk's `pool` pointer, which comes
            // from the same allocation.
            unsafe { Arc::increment_strong_count(Arc::as_ptr(&self.shared)) };
        }
        Ok(c)
    }

    /// Gives back free chunks past the high watermark (all free chunks
    /// under memory pressure) now; normally done by completions. Returns the
    /// number of chunks released: 0 while another trim or shrink runs, or
    /// while the pool grows (a pool grows only when it has no free chunk).
    /// A grow runs the pressure hooks once it let go of its lock, and once
    /// the chunk it was made for is its taker's: a hook's trim gives back
    /// none of that grow's batch (its arena is not whole).
    pub fn trim(&self) -> Result<usize> {
        self.shared.gate.open();
        self.shared.shrink()
    }
}

impl<M: DmaMapper> Shared<M> {
    fn reserve(&self, q: usize) -> Result<&Reserve<M>> {
        self.reserves.get(q).ok_or(Error::BadQueue {
            queue: q,
            queues: self.reserves.len(),
        })
    }

    fn under_pressure(&self) -> bool {
        self.pressure
            .as_ref()
            .is_some_and(|p| p.load(std::sync::atomic::Ordering::Relaxed))
    }

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
}
