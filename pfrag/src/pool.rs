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

use std::ptr::NonNull;
use std::sync::Arc;

use crate::account::Charge;
use crate::addr::{Iova, Order, VirtAddr, HUGE_PAGE_SIZE};
use crate::dma::{Dir, DmaMapper, Domain};
use crate::error::{Error, Result};
use crate::mem::{Backing, Region};
use crate::sync::{lock, AtomicBool, AtomicU32, AtomicU64, Mutex, Ordering, Queue};

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

/// How a queue's freed chunks return to the shared pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reclaim {
    /// Straight back to the shared free list, every time a completion frees
    /// a chunk ("keep the forward allocation as small as possible").
    Eager,
    /// Kept in the queue's reserve; when the reserve passes `threshold`
    /// bytes, `chunk` bytes go back at once.
    Hysteresis {
        /// Bytes a queue may keep in reserve.
        threshold: u64,
        /// Bytes returned per reclaim.
        chunk: u64,
    },
}

impl Reclaim {
    /// Hysteresis with the values Linux used: 2 MiB threshold, 1 MiB back.
    pub const HYSTERESIS: Reclaim = Reclaim::Hysteresis {
        threshold: 2 << 20,
        chunk: 1 << 20,
    };

    /// The lab's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Reclaim::Eager => "eager",
            Reclaim::Hysteresis { .. } => "hysteresis",
        }
    }
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
    /// TX queues served, each with its own reserve (1..=4096).
    pub queues: usize,
    /// How freed chunks go back to the shared list.
    pub reclaim: Reclaim,
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
            queues: 1,
            reclaim: Reclaim::Eager,
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
        if self.queues == 0 || self.queues > 4096 {
            return Err(Error::BadConfig {
                what: "queues (1..=4096)",
                value: self.queues as u64,
            });
        }
        if let Reclaim::Hysteresis { threshold, chunk } = self.reclaim {
            if chunk < self.order.size() as u64 || threshold < chunk {
                return Err(Error::BadConfig {
                    what: "hysteresis (chunk >= one pool chunk, threshold >= chunk)",
                    value: chunk,
                });
            }
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
    /// Pushes and pops on the shared free list by queues (takes, eager
    /// frees, reclaims).
    pub shared_ops: u64,
    /// Reclaim calls of all queues.
    pub reclaim_calls: u64,
    /// Chunks queues borrowed from neighbours.
    pub borrows: u64,
    /// Neighbours skipped because they were under pressure.
    pub skipped_pressured: u64,
}

impl PoolStats {
    /// This snapshot with the queue-traffic counters (`shared_ops`,
    /// `reclaim_calls`, `borrows`, `skipped_pressured`) taken relative to
    /// `earlier`; levels (chunks, bytes) stay as they are now.
    pub fn since(&self, earlier: &PoolStats) -> PoolStats {
        PoolStats {
            shared_ops: self.shared_ops - earlier.shared_ops,
            reclaim_calls: self.reclaim_calls - earlier.reclaim_calls,
            borrows: self.borrows - earlier.borrows,
            skipped_pressured: self.skipped_pressured - earlier.skipped_pressured,
            ..*self
        }
    }
}

/// A snapshot of one queue's reserve.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Bytes in the reserve now.
    pub held: u64,
    /// Most bytes the reserve held.
    pub peak_held: u64,
    /// Times the queue gave memory back to the shared list.
    pub reclaim_calls: u64,
    /// Bytes it gave back.
    pub reclaimed_bytes: u64,
    /// Its pushes and pops on the shared free list.
    pub shared_ops: u64,
    /// Chunks it borrowed from neighbours.
    pub borrows: u64,
    /// Chunks neighbours borrowed from it.
    pub lent: u64,
    /// Neighbours it skipped because they were under pressure.
    pub skipped_pressured: u64,
    /// Times it flagged itself under pressure (ran dry).
    pub pressure_flags: u64,
    /// Whether it is flagged now.
    pub pressured: bool,
}

impl QueueStats {
    /// This snapshot with the event counters taken relative to `earlier`;
    /// levels (`held`, `peak_held`, `pressured`) stay as they are now.
    pub fn since(&self, earlier: &QueueStats) -> QueueStats {
        QueueStats {
            reclaim_calls: self.reclaim_calls - earlier.reclaim_calls,
            reclaimed_bytes: self.reclaimed_bytes - earlier.reclaimed_bytes,
            shared_ops: self.shared_ops - earlier.shared_ops,
            borrows: self.borrows - earlier.borrows,
            lent: self.lent - earlier.lent,
            skipped_pressured: self.skipped_pressured - earlier.skipped_pressured,
            pressure_flags: self.pressure_flags - earlier.pressure_flags,
            ..*self
        }
    }
}

#[derive(Default)]
struct QueueCounters {
    recycles: AtomicU64,
    peak_held: AtomicU64,
    reclaim_calls: AtomicU64,
    reclaimed_bytes: AtomicU64,
    shared_ops: AtomicU64,
    borrows: AtomicU64,
    lent: AtomicU64,
    skipped_pressured: AtomicU64,
    pressure_flags: AtomicU64,
}

/// One queue's reserve of free chunks. Aligned so that two queues' counters
/// never share a cache line (queues run on different cores).
#[repr(align(128))]
struct Reserve<M: DmaMapper> {
    /// Chunks this queue has out of the lists; while above zero the queue
    /// holds one strong count on the pool's shared state.
    out: AtomicU64,
    free: Queue<ChunkPtr<M>>,
    /// Bytes in `free`.
    held: AtomicU64,
    /// "Under pressure: do not borrow from me." Set by the owner when it
    /// runs dry, cleared by the owner when it has room again.
    pressured: AtomicBool,
    c: QueueCounters,
}

impl<M: DmaMapper> Reserve<M> {
    fn new() -> Reserve<M> {
        Reserve {
            out: AtomicU64::new(0),
            free: Queue::new(),
            held: AtomicU64::new(0),
            pressured: AtomicBool::new(false),
            c: QueueCounters::default(),
        }
    }

    /// Counts `n` pushes or pops on the shared free list by this queue.
    fn shared_op(&self, n: u64) {
        self.c.shared_ops.fetch_add(n, Ordering::Relaxed);
    }
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
    /// The queue that took it last (whose reserve it returns to).
    owner: AtomicU32,
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
    free: Queue<ChunkPtr<M>>,
    /// Chunks whose memory was given back. Invariant: refcnt 0, unmapped.
    released: Mutex<Vec<ChunkPtr<M>>>,
    /// All arenas; also the lock that serialises grow and shrink.
    arenas: Mutex<Vec<Arena<M>>>,
    /// Set while one thread shrinks, so completions never queue behind it.
    shrinking: AtomicBool,
    counters: Counters,
    /// One reserve per queue.
    reserves: Box<[Reserve<M>]>,
    /// The memory account charged on grow, uncharged on shrink.
    account: Option<Arc<dyn Charge>>,
    /// The account's pressure flag, read on the completion path.
    pressure: Option<Arc<std::sync::atomic::AtomicBool>>,
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
    pub fn new(domain: Arc<Domain<M>>, cfg: PoolConfig) -> Result<Pool<M>> {
        Pool::build(domain, cfg, None)
    }

    /// A new, empty pool whose memory counts against `account` (shared by
    /// every pool that should share its limits).
    pub fn with_account(
        domain: Arc<Domain<M>>,
        cfg: PoolConfig,
        account: Arc<dyn Charge>,
    ) -> Result<Pool<M>> {
        Pool::build(domain, cfg, Some(account))
    }

    fn build(
        domain: Arc<Domain<M>>,
        cfg: PoolConfig,
        account: Option<Arc<dyn Charge>>,
    ) -> Result<Pool<M>> {
        let cfg = cfg.resolve()?;
        let pressure = account.as_ref().map(|a| a.pressure_flag());
        Ok(Pool {
            shared: Arc::new(Shared {
                domain,
                free: Queue::new(),
                released: Mutex::new(Vec::new()),
                arenas: Mutex::new(Vec::new()),
                shrinking: AtomicBool::new(false),
                counters: Counters::default(),
                reserves: (0..cfg.queues).map(|_| Reserve::new()).collect(),
                account,
                pressure,
                cfg,
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

    /// Chunks in the shared free list now.
    pub fn free_chunks(&self) -> usize {
        self.shared.free.len()
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
    pub fn stats(&self) -> PoolStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            grows: l(&c.grows),
            shrinks: l(&c.shrinks),
            chunks: l(&c.chunks),
            released: l(&c.released),
            recycles: self.shared.reserves.iter().map(|r| l(&r.c.recycles)).sum(),
            mapped_bytes: l(&c.mapped_bytes),
            huge_fallbacks: l(&c.huge_fallbacks),
            huge_arenas: l(&c.huge_arenas),
            unmap_errors: l(&c.unmap_errors),
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
        let c = loop {
            if let Some(c) = r.free.pop() {
                r.held.fetch_sub(size, Ordering::Relaxed);
                break c;
            }
            if sh.cfg.reclaim != Reclaim::Eager && !r.pressured.load(Ordering::Relaxed) {
                // Ran dry: ask the neighbours to leave our reserve alone.
                r.pressured.store(true, Ordering::Relaxed);
                r.c.pressure_flags.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(c) = sh.free.pop() {
                r.shared_op(1);
                break c;
            }
            if let Some(c) = sh.borrow(q) {
                break c;
            }
            sh.grow()?;
        };
        c.get().owner.store(q as u32, Ordering::Relaxed);
        if sh.cfg.policy == Policy::PerChunk {
            let size = sh.cfg.order.size() as u64;
            match sh.domain.map(c.get().addr, size, size, sh.cfg.dir) {
                Ok(iova) => {
                    c.get().iova.store(iova.raw(), Ordering::Relaxed);
                    sh.counters.mapped_bytes.fetch_add(size, Ordering::Relaxed);
                }
                Err(e) => {
                    sh.free.push(c);
                    r.shared_op(1);
                    return Err(e);
                }
            }
        }
        if r.out.fetch_add(1, Ordering::AcqRel) == 0 {
            // The queue's first chunk out: it now keeps the pool alive.
            std::mem::forget(self.shared.clone());
        }
        Ok(c)
    }

    /// Gives back free chunks past the high watermark (all free chunks
    /// under memory pressure) now; normally done by completions. Returns the
    /// number of chunks released.
    pub fn trim(&self) -> Result<usize> {
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

    /// A chunk from the first neighbour of `q` (in ring order) that is not
    /// under pressure and has one. Lock-free pops only.
    fn borrow(&self, q: usize) -> Option<ChunkPtr<M>> {
        let n = self.reserves.len();
        let me = &self.reserves[q];
        let size = self.cfg.order.size() as u64;
        for i in 1..n {
            let nb = &self.reserves[(q + i) % n];
            if nb.pressured.load(Ordering::Relaxed) {
                me.c.skipped_pressured.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Some(c) = nb.free.pop() {
                nb.held.fetch_sub(size, Ordering::Relaxed);
                nb.c.lent.fetch_add(1, Ordering::Relaxed);
                me.c.borrows.fetch_add(1, Ordering::Relaxed);
                return Some(c);
            }
        }
        None
    }

    /// Moves up to `bytes` (at least one chunk) from queue `r`'s reserve to
    /// the shared list: one reclaim call.
    fn reclaim(&self, r: &Reserve<M>, bytes: u64) {
        let size = self.cfg.order.size() as u64;
        let mut moved = 0u64;
        while moved < bytes.max(size) {
            let Some(c) = r.free.pop() else { break };
            r.held.fetch_sub(size, Ordering::Relaxed);
            self.free.push(c);
            moved += size;
        }
        if moved > 0 {
            r.c.reclaim_calls.fetch_add(1, Ordering::Relaxed);
            r.c.reclaimed_bytes.fetch_add(moved, Ordering::Relaxed);
            r.shared_op(moved / size);
        }
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
                    pool: self as *const Shared<M>,
                    arena: idx,
                    owner: AtomicU32::new(0),
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
