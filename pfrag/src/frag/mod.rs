//! The per-queue frag cache and the frags it hands out.
//!
//! A cache holds one chunk at a time and carves frags from it with a cursor,
//! like Linux's `skb_page_frag_refill`. When it takes a chunk it charges the
//! chunk's refcount with a large bias up front and keeps the unused part of
//! the bias locally (Linux's `pagecnt_bias`), so handing out a frag costs no
//! atomic operation, and [`FragCache::refill_bulk`] hands out many at the
//! cost of one.
//!
//! Under `PerFrag` a frag's own mapping covers the whole pages it touches,
//! which it may share with the next frag. So the cache carves a chunk no
//! further once an unmap of one of its frags failed (the chunk is poisoned,
//! to be pinned), and skips to the next page once one was deferred to a
//! lazy flush: the next frag never comes from a page that a stale or stuck
//! translation still reaches. (A frag completed on another thread is seen
//! by the next carve that its completion happens before.)
//!
//! Completion has two paths:
//! - **On the owning thread** ([`FragCache::complete`],
//!   [`FragCache::complete_burst`]): a frag of the chunk the cache is carving
//!   gives its reference back to the bias, a plain integer, with no atomic
//!   operation. The chunk's refcount is reconciled once, when the cache
//!   moves on from it. This is the run-to-completion case: a queue reaps
//!   what it sent, on its own thread.
//! - **Anywhere** (dropping the frag, [`Frag::complete`], the free function
//!   [`complete_burst`]): one atomic decrement per frag, or one per run of
//!   frags of one chunk. Whoever drops the refcount to zero recycles the
//!   chunk.

mod handle;
mod stats;

use std::mem::ManuallyDrop;

use crate::addr::{Iova, VirtAddr, PAGE_SIZE};
use crate::dma::DmaMapper;
use crate::error::{Error, Result};
use crate::pool::{ChunkPtr, Pool, Shared, MAX_REFCNT};
use crate::sync::Ordering;

pub use handle::{complete_burst, Frag, FragHold};
use handle::{complete_runs, put};
pub use stats::CacheStats;

/// Frag starts are aligned to a cache line.
pub const FRAG_ALIGN: usize = 64;
/// Without fit-whole, a chunk tail smaller than this is abandoned rather than
/// handed out as a sliver.
pub const MIN_SPLIT: usize = 64;
/// The refcount bias a cache charges when it takes a chunk. Far below the
/// limit holds may raise the count to ([`MAX_REFCNT`]).
const BIAS: u32 = 1 << 24;
const _: () = assert!(BIAS < MAX_REFCNT / 2);

/// A per-queue frag cache. Not shared between queues (it is `Send`, not
/// `Sync`).
pub struct FragCache<M: DmaMapper> {
    pool: Pool<M>,
    /// The chunk being carved, with `bias - lent` references still owned
    /// here.
    cur: Option<ChunkPtr<M>>,
    /// Next free byte in `cur`: always a multiple of [`FRAG_ALIGN`].
    offset: usize,
    /// References charged on `cur`, plus those its frags gave back on this
    /// thread since. A carve counts in `lent`, a completion here in `bias`:
    /// two counters, so that a refill followed by its completion (the
    /// common case) updates two places in memory, not one place twice,
    /// whose second update waits for the first's store to forward.
    bias: u32,
    /// References handed to frags of `cur` since the cache charged it.
    lent: u32,
    /// Bytes of the chunks the cache has moved on from (handed out or
    /// skipped): the waste count is derived from it, off the hot path.
    left_bytes: u64,
    /// Where `cur` starts, for the CPU and (when its frags share the
    /// chunk's mapping) for the device: read once when the cache takes the
    /// chunk, so that a refill touches only the cache.
    base: VirtAddr,
    base_iova: Option<Iova>,
    /// `cur`'s count of deferred unmaps when the cache last looked
    /// (`PerFrag` only, see [`may_carve`](Self::may_carve)).
    deferred_seen: u32,
    chunk_size: usize,
    /// The queue whose reserve the cache takes from.
    queue: usize,
    stats: CacheStats,
}

// SAFETY: the cache holds references on its current chunk, which are valid
// from any thread; it is used by one thread at a time (`&mut self`).
unsafe impl<M: DmaMapper> Send for FragCache<M> {}

impl<M: DmaMapper> std::fmt::Debug for FragCache<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FragCache")
            .field("offset", &self.offset)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<M: DmaMapper> FragCache<M> {
    /// A cache that carves chunks of `pool` for its queue 0.
    pub fn new(pool: Pool<M>) -> FragCache<M> {
        let chunk_size = pool.chunk_size();
        FragCache {
            pool,
            cur: None,
            offset: 0,
            bias: 0,
            lent: 0,
            left_bytes: 0,
            base: VirtAddr(0),
            base_iova: None,
            deferred_seen: 0,
            chunk_size,
            queue: 0,
            stats: CacheStats::default(),
        }
    }

    /// A cache for queue `queue` of `pool`: it takes chunks from that
    /// queue's reserve first, and its freed chunks return there.
    pub fn for_queue(pool: Pool<M>, queue: usize) -> Result<FragCache<M>> {
        if queue >= pool.queues() {
            return Err(Error::BadQueue {
                queue,
                queues: pool.queues(),
            });
        }
        let mut c = FragCache::new(pool);
        c.queue = queue;
        Ok(c)
    }

    /// The queue the cache serves.
    pub fn queue(&self) -> usize {
        self.queue
    }

    /// The pool behind the cache.
    pub fn pool(&self) -> &Pool<M> {
        &self.pool
    }

    /// Its counters.
    pub fn stats(&self) -> CacheStats {
        // Every byte of a chunk the cache carved is handed out or wasted
        // (padding, skipped tails).
        let carved = self.left_bytes + self.cur.map_or(0, |_| self.offset as u64);
        CacheStats {
            waste_bytes: carved - self.stats.bytes,
            ..self.stats
        }
    }

    /// One frag of up to `len` bytes, `skb_page_frag_refill`-style.
    ///
    /// With `fit_whole`, the frag is exactly `len` bytes and never straddles
    /// chunks: if the current chunk's tail is too short, the cache moves to a
    /// fresh chunk (the tail is counted as waste); `len` larger than a chunk
    /// is an error. Without it, the frag is `min(len, tail)` bytes (the
    /// stock behaviour), and the caller asks again for the rest.
    #[inline(always)]
    pub fn refill(&mut self, len: usize, fit_whole: bool) -> Result<Frag<M>> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        if fit_whole && len > self.chunk_size {
            return Err(Error::LargerThanChunk {
                len,
                chunk: self.chunk_size,
            });
        }
        let need = if fit_whole { len } else { len.min(MIN_SPLIT) };
        let c = self.chunk_with_room(need)?;
        let start = self.offset;
        let flen = len.min(self.chunk_size - start);
        let addr = self.base.offset(start);
        let (iova, own) = match self.base_iova {
            Some(b) => (b.offset(start as u64), false),
            None => self.pool.shared.frag_iova(c, addr, start, flen)?,
        };
        self.offset = self.end_after(start, len);
        self.lent += 1;
        self.stats.frags += 1;
        self.stats.bytes += flen as u64;
        Ok(Frag {
            chunk: c,
            addr,
            iova,
            len: flen as u32,
            own,
        })
    }

    /// `n` frags of exactly `len` bytes each, carved one after another from
    /// one chunk and appended to `out`: the bulk form of [`refill`], which
    /// charges the chunk's bias and the counters once for all of them.
    ///
    /// `n` frags must fit one chunk (each but the last padded to
    /// [`FRAG_ALIGN`]); if the current chunk's tail is too short, the cache
    /// moves to a fresh chunk. Frags that cannot fit one chunk are
    /// [`Error::LargerThanChunk`] (with `len` itself when one frag is
    /// larger than a chunk). On error nothing is appended and nothing is
    /// charged; under `PerFrag`, where a later map failed after earlier
    /// ones, the bytes of the frags mapped and undone are skipped (counted
    /// as waste), never handed out under a translation that may outlive
    /// the undo.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use pfrag::{dma::{Domain, Identity}, frag::FragCache, pool::{self, Policy, Pool}, Order};
    /// let pool = Pool::new(
    ///     Arc::new(Domain::new(Identity::new())),
    ///     pool::Config::new(Order::new(3).unwrap(), Policy::Persistent),
    /// )?;
    /// let mut cache = FragCache::new(pool);
    /// let mut burst = Vec::with_capacity(32);
    /// cache.refill_bulk(64, 32, &mut burst)?;
    /// assert_eq!(burst.len(), 32);
    /// assert_eq!(burst[1].iova().raw() - burst[0].iova().raw(), 64);
    /// // Completed on the owning thread: no atomic operation.
    /// cache.complete_burst(burst.drain(..))?;
    /// # Ok::<(), pfrag::Error>(())
    /// ```
    ///
    /// [`refill`]: FragCache::refill
    pub fn refill_bulk(&mut self, len: usize, n: usize, out: &mut Vec<Frag<M>>) -> Result<()> {
        if len > self.chunk_size {
            // Also keeps the rounding below from overflowing.
            return Err(Error::LargerThanChunk {
                len,
                chunk: self.chunk_size,
            });
        }
        let stride = len.next_multiple_of(FRAG_ALIGN);
        let need = match n.checked_sub(1) {
            _ if len == 0 => return Err(Error::ZeroLength),
            None => return Ok(()),
            Some(k) => k.saturating_mul(stride).saturating_add(len),
        };
        if need > self.chunk_size {
            return Err(Error::LargerThanChunk {
                len: need,
                chunk: self.chunk_size,
            });
        }
        let c = self.chunk_with_room(need)?;
        if let Some(ciova) = self.base_iova {
            // The frags share the chunk's mapping: nothing can fail.
            let (first, base) = (self.offset, self.base);
            out.extend((0..n).map(|i| Frag {
                chunk: c,
                addr: base.offset(first + i * stride),
                iova: ciova.offset((first + i * stride) as u64),
                len: len as u32,
                own: false,
            }));
        } else {
            self.bulk_own_mappings(c, len, n, stride, out)?;
        }
        self.lent += n as u32;
        self.offset = self.end_after(self.offset, need);
        self.stats.frags += n as u64;
        self.stats.bytes += (n * len) as u64;
        Ok(())
    }

    /// `n` frags of `len` bytes from `c` at the cache's offset, each with
    /// its own mapping (`PerFrag`), appended to `out`. If a map fails, the
    /// mappings made so far are removed and nothing is appended.
    #[cold]
    fn bulk_own_mappings(
        &mut self,
        c: ChunkPtr<M>,
        len: usize,
        n: usize,
        stride: usize,
        out: &mut Vec<Frag<M>>,
    ) -> Result<()> {
        let mark = out.len();
        out.reserve(n);
        for i in 0..n {
            let start = self.offset + i * stride;
            let addr = self.base.offset(start);
            match self.pool.shared.frag_iova(c, addr, start, len) {
                Ok((iova, own)) => out.push(Frag {
                    chunk: c,
                    addr,
                    iova,
                    len: len as u32,
                    own,
                }),
                Err(e) => {
                    // The frags made so far never took a reference. An
                    // undo whose unmap fails (counted in the pool's
                    // `unmap_errors`) poisons the chunk, which the cache
                    // then carves no further; one deferred to a flush
                    // makes the next carve skip to a fresh page
                    // (`may_carve_own`). The bytes those frags spanned are
                    // skipped (waste) if any was mapped, so that page is
                    // past them. The map failure is the error reported.
                    if i > 0 {
                        self.offset = start.min(self.chunk_size);
                    }
                    for f in out.drain(mark..) {
                        let f = ManuallyDrop::new(f);
                        let _ = f.unmap_own();
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Completes `f` on the thread that owns this cache. A frag of the chunk
    /// being carved gives its reference back to the cache's bias: no atomic
    /// operation (the chunk's refcount is reconciled once, when the cache
    /// moves on). Any other frag takes the atomic path of [`Frag::complete`].
    /// Reports an unmap failure of a `PerFrag` frag, as `Frag::complete`
    /// does.
    #[inline(always)]
    pub fn complete(&mut self, f: Frag<M>) -> Result<()> {
        // The common case reads two fields and returns a constant `Ok`:
        // moving the frag or an error-sized result through memory just
        // after `refill` wrote it field by field stalls store forwarding
        // (measured: 11-13 ns against 5 ns per frag).
        if f.own {
            return self.complete_own(f);
        }
        let c = f.chunk;
        std::mem::forget(f);
        self.put_local(c, 1);
        Ok(())
    }

    /// [`complete`](Self::complete) of a frag with its own mapping.
    #[cold]
    fn complete_own(&mut self, f: Frag<M>) -> Result<()> {
        let f = ManuallyDrop::new(f);
        let r = f.unmap_own();
        self.put_local(f.chunk, 1);
        r
    }

    /// Completes many frags on the owning thread: [`complete`] for each,
    /// with the frags of other chunks batched as the free function
    /// [`complete_burst`] does. Returns the first unmap error, after
    /// completing every frag.
    ///
    /// [`complete`]: FragCache::complete
    pub fn complete_burst(&mut self, frags: impl IntoIterator<Item = Frag<M>>) -> Result<()> {
        complete_runs(frags, |c, n| self.put_local(c, n)).1
    }

    /// [`complete_burst`](Self::complete_burst), returning how many of the
    /// frags' unmaps failed (0 if none did) instead of the first failure:
    /// for a caller that counts each frag whose memory stays mapped (each
    /// is also counted in the pool's
    /// [`unmap_errors`](crate::pool::Stats::unmap_errors), and its chunk
    /// pinned).
    pub fn complete_burst_counting(&mut self, frags: impl IntoIterator<Item = Frag<M>>) -> usize {
        complete_runs(frags, |c, n| self.put_local(c, n)).0
    }

    /// Takes back frags this cache handed out and that were never used (a
    /// send refused once its payload was carved): completed as
    /// [`complete_burst_counting`](Self::complete_burst_counting) does,
    /// and counted as never handed out, their bytes (which the cursor has
    /// passed) as waste. Returns how many of their unmaps failed (0 if
    /// none did). Frags of another cache are completed alike, and the
    /// counters never go below zero.
    pub fn take_back(&mut self, frags: impl IntoIterator<Item = Frag<M>>) -> usize {
        let (mut n, mut bytes) = (0u64, 0u64);
        let frags = frags.into_iter().inspect(|f| {
            n += 1;
            bytes += u64::from(f.len);
        });
        let failed = complete_runs(frags, |c, k| self.put_local(c, k)).0;
        self.stats.frags = self.stats.frags.saturating_sub(n);
        self.stats.bytes = self.stats.bytes.saturating_sub(bytes);
        failed
    }

    /// Drops `n` references on `c` from the owning thread: back into the
    /// bias if `c` is the chunk being carved, else atomically.
    #[inline(always)]
    fn put_local(&mut self, c: ChunkPtr<M>, n: u32) {
        if self.cur == Some(c) {
            // Cannot pass `BIAS + lent`, far below `u32::MAX`: the frags of
            // `cur` were carved since the cache charged it (a chunk is taken
            // again only at count zero, which `Chunk::acquire` keeps from
            // wrapping), and each gives back the one reference it was lent.
            self.bias += n;
        } else {
            put(c, n);
        }
    }

    /// Frags for a payload of `len` bytes, appended to `out`. With
    /// `fit_whole`, each piece of up to one chunk sits whole in one chunk (a
    /// payload that fits a chunk is one frag); without it, pieces fill chunk
    /// tails first (the stock behaviour). On error the frags of this call
    /// are completed and removed from `out`.
    pub fn frags(&mut self, len: usize, fit_whole: bool, out: &mut Vec<Frag<M>>) -> Result<()> {
        self.frags_counting(len, fit_whole, out).map_err(|(e, _)| e)
    }

    /// [`frags`](Self::frags), whose error also says how many of the frags
    /// it had carved, and completed on the way out, failed to unmap (0 if
    /// none did): for a caller that counts each frag whose memory stays
    /// mapped, as [`complete_burst_counting`](Self::complete_burst_counting)
    /// does. Each is also counted in the pool's
    /// [`unmap_errors`](crate::pool::Stats::unmap_errors), and its chunk
    /// pinned.
    pub fn frags_counting(
        &mut self,
        len: usize,
        fit_whole: bool,
        out: &mut Vec<Frag<M>>,
    ) -> std::result::Result<(), (Error, usize)> {
        if len == 0 {
            return Err((Error::ZeroLength, 0));
        }
        let max = self.pool.config().max_payload;
        if len > max {
            return Err((Error::TooLarge { len, max }, 0));
        }
        let mark = out.len();
        let mut left = len;
        while left > 0 {
            let want = if fit_whole {
                left.min(self.chunk_size)
            } else {
                left
            };
            match self.refill(want, fit_whole) {
                Ok(f) => {
                    left -= f.len();
                    out.push(f);
                }
                Err(e) => {
                    let failed = self.take_back(out.drain(mark..));
                    return Err((e, failed));
                }
            }
        }
        Ok(())
    }

    /// The references on `cur` the cache still owns: charged, less those
    /// lent to frags, plus those given back.
    #[inline(always)]
    fn owned(&self) -> u32 {
        self.bias - self.lent
    }

    /// Where the next carve starts after `len` bytes (or the chunk's rest,
    /// if fewer) carved at `start`: past them, rounded up to
    /// [`FRAG_ALIGN`], at most the chunk's end. `start` is aligned (every
    /// offset is) and so is the chunk's size, so the rounding of `len`
    /// can be done on its own: the offset's chain from one carve to the
    /// next is one add and one compare, with no dependence on `len`'s
    /// rounding or the room left.
    #[inline(always)]
    fn end_after(&self, start: usize, len: usize) -> usize {
        debug_assert_eq!(start % FRAG_ALIGN, 0);
        let step = len.min(self.chunk_size).next_multiple_of(FRAG_ALIGN);
        (start + step).min(self.chunk_size)
    }

    /// The chunk being carved, if at least `need` bytes are left in it and
    /// it may still be carved ([`may_carve`](Self::may_carve)); otherwise
    /// the next one ([`next_chunk`](Self::next_chunk)).
    #[inline(always)]
    fn chunk_with_room(&mut self, need: usize) -> Result<ChunkPtr<M>> {
        if let Some(c) = self.cur {
            if self.may_carve(c, need) {
                return Ok(c);
            }
        }
        self.next_chunk()?;
        Ok(self.cur.expect("next_chunk set a chunk"))
    }

    /// Whether the cache may hand out `need` more bytes of `c`, the chunk
    /// being carved. Where its frags share the chunk's mapping
    /// (`Persistent`, `PerChunk`) that is only whether they are left: one
    /// predictable branch more. Under `PerFrag` see
    /// [`may_carve_own`](Self::may_carve_own).
    #[inline(always)]
    fn may_carve(&mut self, c: ChunkPtr<M>, need: usize) -> bool {
        (self.base_iova.is_some() || self.may_carve_own(c)) && self.chunk_size - self.offset >= need
    }

    /// Under `PerFrag`, each frag's own mapping covers the whole pages it
    /// touches, which the next frag may share. If one of those unmaps
    /// failed (the chunk is poisoned), the chunk is carved no further:
    /// [`next_chunk`](Self::next_chunk) hands it back to the pool, which
    /// pins it once its last reference goes. If one was deferred to a
    /// lazy flush since the cache last looked, its translation may outlive
    /// it: the cache skips to the next page (every frag carved so far ends
    /// below it) and counts the skipped bytes as waste, so a frag never
    /// shares a page with a translation still waiting for its flush.
    ///
    /// An unmap on another thread is seen by the carves it happens before
    /// (the counter is released after the unmap).
    fn may_carve_own(&mut self, c: ChunkPtr<M>) -> bool {
        let h = c.get();
        if h.poisoned.load(Ordering::Relaxed) {
            return false;
        }
        let deferred = h.deferred.load(Ordering::Acquire);
        if deferred != self.deferred_seen {
            self.deferred_seen = deferred;
            self.offset = self
                .offset
                .next_multiple_of(PAGE_SIZE as usize)
                .min(self.chunk_size);
        }
        true
    }

    /// Moves to a fresh chunk: reuses the current one in place if all its
    /// frags completed and it is reusable (no failed unmap, no unmap
    /// waiting for its flush), else takes one from the pool and leaves the
    /// current one to its frags (or, if none is left, to the pool, to pin
    /// or park). The bytes of the current chunk not carved count as waste.
    ///
    /// A chunk with frags out is let go only once the next one is taken:
    /// a take that fails (the pool at its limit, say) leaves the cache as
    /// it was, still carving it.
    #[cold]
    fn next_chunk(&mut self) -> Result<()> {
        if let Some(c) = self.cur {
            // `refcnt` is the bias plus one per frag or hold out, and only
            // frags make holds: at the bias alone, no other reference is
            // left or can appear, and the acquire load sees what the last
            // completer did.
            if c.get().refcnt.load(Ordering::Acquire) == self.owned() {
                self.left_bytes += self.chunk_size as u64;
                if self.pool.shared.reusable(c) {
                    // Every frag completed: the chunk is ours alone; keep it.
                    self.carve_from(c);
                    self.stats.reused_in_place += 1;
                    return Ok(());
                }
                // It waits for a flush, or must be pinned: let the pool
                // decide (before taking, so that a flush it forces can
                // free it for the take).
                self.cur = None;
                (self.bias, self.lent) = (0, 0);
                c.get().refcnt.store(0, Ordering::Relaxed);
                // SAFETY: the cache held the only references, so the chunk
                // is ours alone, and `c` is not used again.
                unsafe { Shared::recycle(c) };
            }
        }
        let next = self.pool.take(self.queue)?;
        if let Some(c) = self.cur.take() {
            self.left_bytes += self.chunk_size as u64;
            put(c, self.owned());
        }
        self.carve_from(next);
        self.stats.chunks_taken += 1;
        Ok(())
    }

    /// Makes `c`, held exclusively, the chunk being carved: charges the
    /// bias and reads its addresses once.
    fn carve_from(&mut self, c: ChunkPtr<M>) {
        c.get().refcnt.store(BIAS, Ordering::Relaxed);
        self.cur = Some(c);
        (self.bias, self.lent) = (BIAS, 0);
        self.offset = 0;
        self.base = c.get().addr;
        self.base_iova = self.pool.shared.chunk_iova(c);
        // A chunk comes from the pool, or back in place, only once every
        // deferred unmap of it was flushed.
        self.deferred_seen = c.get().deferred.load(Ordering::Acquire);
    }

    /// Lets go of the current chunk (it recycles once its frags complete).
    pub fn release(&mut self) {
        if let Some(c) = self.cur.take() {
            self.left_bytes += self.chunk_size as u64;
            put(c, self.owned());
            (self.bias, self.lent) = (0, 0);
        }
    }
}

impl<M: DmaMapper> Drop for FragCache<M> {
    fn drop(&mut self) {
        self.release();
    }
}
