//! The per-queue frag cache and the frags it hands out.
//!
//! A cache holds one chunk at a time and carves frags from it with a cursor,
//! like Linux's `skb_page_frag_refill`. When it takes a chunk it charges the
//! chunk's refcount with a large bias up front and keeps the unused part of
//! the bias locally (Linux's `pagecnt_bias`), so handing out a frag costs no
//! atomic operation. Completing a frag is one atomic decrement; completing a
//! burst of frags of one chunk ([`complete_burst`]) is one atomic for the
//! burst. Whoever drops the refcount to zero recycles the chunk.

use crate::sync::Ordering;
use std::mem::ManuallyDrop;

use crate::addr::{Iova, VirtAddr};
use crate::dma::DmaMapper;
use crate::error::{Error, Result};
use crate::mem;
use crate::pool::{ChunkPtr, Pool, Shared};

/// Frag starts are aligned to a cache line.
pub const FRAG_ALIGN: usize = 64;
/// Without fit-whole, a chunk tail smaller than this is abandoned rather than
/// handed out as a sliver.
pub const MIN_SPLIT: usize = 64;
/// The refcount bias a cache charges when it takes a chunk.
const BIAS: u32 = 1 << 24;

/// Counters of one cache (plain integers: a cache belongs to one queue).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Frags handed out.
    pub frags: u64,
    /// Bytes handed out.
    pub bytes: u64,
    /// Chunks taken from the pool.
    pub chunks_taken: u64,
    /// Chunks reused in place (all their frags had completed).
    pub reused_in_place: u64,
    /// Bytes skipped: abandoned chunk tails plus alignment padding.
    pub waste_bytes: u64,
}

impl CacheStats {
    /// `self - earlier`, field by field: the work done in between.
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            frags: self.frags - earlier.frags,
            bytes: self.bytes - earlier.bytes,
            chunks_taken: self.chunks_taken - earlier.chunks_taken,
            reused_in_place: self.reused_in_place - earlier.reused_in_place,
            waste_bytes: self.waste_bytes - earlier.waste_bytes,
        }
    }
}

/// A piece of a chunk, ready for DMA: move-only; completing (dropping) it
/// releases its reference on the chunk and, under `PerFrag`, its mapping.
pub struct Frag<M: DmaMapper> {
    chunk: ChunkPtr<M>,
    addr: VirtAddr,
    iova: Iova,
    len: u32,
    /// The frag's own mapping (`PerFrag` policy): IOVA and length.
    own: Option<(Iova, u64)>,
}

// SAFETY: a Frag owns its byte range exclusively and its chunk reference is
// released with an atomic; all pool state it touches on drop is Sync.
unsafe impl<M: DmaMapper> Send for Frag<M> {}

impl<M: DmaMapper> std::fmt::Debug for Frag<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frag")
            .field("iova", &self.iova)
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

impl<M: DmaMapper> Frag<M> {
    /// Where the device sees the frag.
    pub fn iova(&self) -> Iova {
        self.iova
    }
    /// Where the CPU sees it.
    pub fn addr(&self) -> VirtAddr {
        self.addr
    }
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Always false: frags are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The frag's bytes, to fill before handing the IOVA to a device.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the frag owns this range of a live chunk exclusively (no
        // other frag overlaps it, the pool lives while the chunk is out), and
        // `&mut self` ensures one view at a time.
        unsafe { mem::slice_mut(self.addr, self.len as usize) }
    }
    /// The frag's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above; devices only read TX frags.
        unsafe { mem::slice(self.addr, self.len as usize) }
    }

    /// Completes the frag, reporting an unmap failure (dropping does the
    /// same and counts the failure in the pool's stats).
    pub fn complete(self) -> Result<()> {
        let f = ManuallyDrop::new(self);
        let r = unmap_own(f.chunk, f.own);
        put(f.chunk, 1);
        r
    }
}

impl<M: DmaMapper> Drop for Frag<M> {
    fn drop(&mut self) {
        // A failure is counted and poisons the chunk (see `unmap_own`).
        let _ = unmap_own(self.chunk, self.own);
        put(self.chunk, 1);
    }
}

fn shared<M: DmaMapper>(c: &ChunkPtr<M>) -> &Shared<M> {
    // SAFETY: a chunk that is out of the free list holds a strong count on
    // its pool, and callers hold a reference on the chunk while the borrow
    // lasts.
    unsafe { &*c.get().pool }
}

/// Removes a `PerFrag` frag's own mapping. A failure leaves it mapped and
/// poisons the chunk, which is then pinned instead of reused.
fn unmap_own<M: DmaMapper>(c: ChunkPtr<M>, own: Option<(Iova, u64)>) -> Result<()> {
    match own {
        Some((iova, len)) => shared(&c).unmap_part(c, iova, len),
        None => Ok(()),
    }
}

/// Drops `n` references on `c`; the last one recycles the chunk.
fn put<M: DmaMapper>(c: ChunkPtr<M>, n: u32) {
    if c.get().refcnt.fetch_sub(n, Ordering::AcqRel) == n {
        // SAFETY: the refcount reached zero here, so this thread holds the
        // chunk exclusively; `c` is not used again by the caller.
        unsafe { Shared::recycle(c) };
    }
}

/// Completes many frags at once: frags of the same chunk that come one after
/// another cost one atomic operation together. Returns the first unmap
/// error, after completing every frag.
pub fn complete_burst<M: DmaMapper>(frags: impl IntoIterator<Item = Frag<M>>) -> Result<()> {
    let mut first_err = Ok(());
    let mut run: Option<(ChunkPtr<M>, u32)> = None;
    for f in frags {
        let f = ManuallyDrop::new(f);
        if let Err(e) = unmap_own(f.chunk, f.own) {
            if first_err.is_ok() {
                first_err = Err(e);
            }
        }
        match &mut run {
            Some((c, n)) if *c == f.chunk => *n += 1,
            _ => {
                if let Some((c, n)) = run.take() {
                    put(c, n);
                }
                run = Some((f.chunk, 1));
            }
        }
    }
    if let Some((c, n)) = run {
        put(c, n);
    }
    first_err
}

/// A per-queue frag cache. Not shared between queues (it is `Send`, not
/// `Sync`).
pub struct FragCache<M: DmaMapper> {
    pool: Pool<M>,
    /// The chunk being carved, with `bias` references still owned here.
    cur: Option<ChunkPtr<M>>,
    /// Next free byte in `cur`.
    offset: usize,
    /// References charged on `cur` and not yet given to frags.
    bias: u32,
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
            .field("stats", &self.stats)
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
        self.stats
    }

    /// One frag of up to `len` bytes, `skb_page_frag_refill`-style.
    ///
    /// With `fit_whole`, the frag is exactly `len` bytes and never straddles
    /// chunks: if the current chunk's tail is too short, the cache moves to a
    /// fresh chunk (the tail is counted as waste); `len` larger than a chunk
    /// is an error. Without it, the frag is `min(len, tail)` bytes (the
    /// stock behaviour), and the caller asks again for the rest.
    #[inline]
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
        if self.cur.is_none() || self.chunk_size - self.offset < need {
            self.next_chunk()?;
        }
        let c = self.cur.expect("next_chunk set a chunk");
        let flen = len.min(self.chunk_size - self.offset);
        let start = self.offset;
        let addr = c.get().addr.offset(start);
        let sh = &self.pool.shared;
        let (iova, own) = sh.frag_iova(c, addr, start, flen)?;
        let end = (start + flen)
            .next_multiple_of(FRAG_ALIGN)
            .min(self.chunk_size);
        self.stats.waste_bytes += (end - start - flen) as u64;
        self.offset = end;
        self.bias -= 1;
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

    /// Frags for a payload of `len` bytes, appended to `out`. With
    /// `fit_whole`, each piece of up to one chunk sits whole in one chunk (a
    /// payload that fits a chunk is one frag); without it, pieces fill chunk
    /// tails first (the stock behaviour). On error the frags of this call
    /// are completed and removed from `out`.
    pub fn frags(&mut self, len: usize, fit_whole: bool, out: &mut Vec<Frag<M>>) -> Result<()> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        let max = self.pool.config().max_payload;
        if len > max {
            return Err(Error::TooLarge { len, max });
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
                    complete_burst(out.drain(mark..)).ok();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Moves to a fresh chunk: reuses the current one in place if all its
    /// frags completed, else leaves it to its frags and takes one from the
    /// pool.
    #[cold]
    fn next_chunk(&mut self) -> Result<()> {
        if let Some(c) = self.cur {
            self.stats.waste_bytes += (self.chunk_size - self.offset) as u64;
            self.cur = None;
            if c.get().refcnt.fetch_sub(self.bias, Ordering::AcqRel) == self.bias {
                self.bias = 0;
                if self.pool.shared.reusable(c) {
                    // Every frag completed: the chunk is ours alone; keep it.
                    c.get().refcnt.store(BIAS, Ordering::Relaxed);
                    self.cur = Some(c);
                    self.bias = BIAS;
                    self.offset = 0;
                    self.stats.reused_in_place += 1;
                    return Ok(());
                }
                // It waits for a flush, or must be pinned: let the pool
                // decide. SAFETY: the refcount reached zero here, so the
                // chunk is ours alone, and `c` is not used again.
                unsafe { Shared::recycle(c) };
            }
            self.bias = 0;
        }
        let c = self.pool.take(self.queue)?;
        c.get().refcnt.store(BIAS, Ordering::Relaxed);
        self.cur = Some(c);
        self.bias = BIAS;
        self.offset = 0;
        self.stats.chunks_taken += 1;
        Ok(())
    }

    /// Lets go of the current chunk (it recycles once its frags complete).
    pub fn release(&mut self) {
        if let Some(c) = self.cur.take() {
            self.stats.waste_bytes += (self.chunk_size - self.offset) as u64;
            put(c, self.bias);
            self.bias = 0;
        }
    }
}

impl<M: DmaMapper> Drop for FragCache<M> {
    fn drop(&mut self) {
        self.release();
    }
}
