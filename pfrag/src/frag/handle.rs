//! A frag, and its completion from any thread: one atomic decrement per
//! frag, or one per run of frags of one chunk ([`complete_burst`]). The
//! owning thread's path without atomics is in [`super::FragCache`].

use std::mem::ManuallyDrop;
use std::sync::Arc;

use crate::addr::{align_down, align_up, Iova, VirtAddr, PAGE_SIZE};
use crate::dma::{Dir, DmaMapper, Domain};
use crate::error::Result;
use crate::mem;
use crate::pool::{ChunkPtr, Shared};
use crate::sync::Ordering;

/// A piece of a chunk, ready for DMA: move-only; completing (dropping) it
/// releases its reference on the chunk and, under `PerFrag`, its mapping.
///
/// At most 32 bytes, half a cache line:
///
/// ```
/// # use pfrag::{dma::SoftIommu, frag::Frag};
/// assert!(std::mem::size_of::<Frag<SoftIommu>>() <= 32);
/// ```
///
/// A frag is `Send` (its completion may drop it on another thread than the
/// one that filled it), not `Sync`:
///
/// ```
/// # use pfrag::{dma::SoftIommu, frag::Frag};
/// fn send<T: Send>() {}
/// send::<Frag<SoftIommu>>();
/// ```
///
/// ```compile_fail,E0277
/// # use pfrag::{dma::SoftIommu, frag::Frag};
/// fn sync<T: Sync>() {}
/// sync::<Frag<SoftIommu>>(); // not `Sync`
/// ```
pub struct Frag<M: DmaMapper> {
    pub(super) chunk: ChunkPtr<M>,
    pub(super) addr: VirtAddr,
    pub(super) iova: Iova,
    pub(super) len: u32,
    /// The frag has a mapping of its own (`PerFrag`): the pages it touches,
    /// mapped at `iova` minus its offset in its first page.
    pub(super) own: bool,
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
    /// The DMA domain the frag is mapped in (its pool's): its IOVA means
    /// this frag only there.
    pub fn domain(&self) -> &Arc<Domain<M>> {
        &shared(&self.chunk).domain
    }
    /// The direction its pool maps memory for
    /// ([`pool::Config::dir`](crate::pool::Config::dir)): whether a device
    /// may read the frag, write it, or both.
    pub fn dir(&self) -> Dir {
        shared(&self.chunk).cfg.dir
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
    /// same and counts the failure in the pool's stats). On the thread that
    /// owns the frag's cache, [`FragCache::complete`](super::FragCache::complete) is cheaper.
    pub fn complete(self) -> Result<()> {
        let f = ManuallyDrop::new(self);
        let r = f.unmap_own();
        put(f.chunk, 1);
        r
    }

    /// Keeps the frag's memory allocated for good, for a frag a device
    /// that could not be stopped may still read: its chunk is never handed
    /// out again, and is pinned when its last reference goes, as a chunk
    /// whose unmap failed is (counted in the pool's
    /// [`pinned`](crate::pool::Stats::pinned) chunks, and in the domain's
    /// [`pinned`](crate::dma::Domain::pinned) host bytes once the pool is
    /// dropped). What stays mapped depends on the pool's policy, and the
    /// domain's pinned IOVA bytes count it:
    /// - `PerFrag`: the frag's own mapping (the whole pages its bytes
    ///   touch) stays, counted at once;
    /// - `Persistent`: the chunk's part of its arena's mapping stays (a
    ///   mapping is not removed in part, so the arena's memory is kept
    ///   whole), counted when the pool drops;
    /// - `PerChunk`: the chunk's own mapping stays (a removed mapping's
    ///   IOVA would be mapped again, to memory the device must never
    ///   reach), counted when the chunk's last reference goes.
    ///
    /// Under `PerFrag` the cache that carved the frag carves its chunk no
    /// further (the next frag could share a page of the frag's own
    /// mapping). Under `Persistent` and `PerChunk` it may go on carving the
    /// rest of the chunk while it is the one being carved: the device
    /// reaches the whole chunk through the shared mapping either way, and
    /// the hot path reads no flag for it.
    pub fn pin(self) {
        let f = ManuallyDrop::new(self);
        if f.own {
            let (_, len) = f.own_mapping();
            shared(&f.chunk).domain.pin_iova(len);
        }
        // Released by the reference count's `AcqRel` below, to whoever
        // recycles the chunk.
        f.chunk.get().poisoned.store(true, Ordering::Relaxed);
        put(f.chunk, 1);
    }

    /// Removes a `PerFrag` frag's own mapping. A failure leaves it mapped
    /// and poisons the chunk, which is then pinned instead of reused.
    #[inline]
    pub(super) fn unmap_own(&self) -> Result<()> {
        if !self.own {
            return Ok(());
        }
        self.unmap_own_slow()
    }

    /// [`unmap_own`](Self::unmap_own) of a frag that has its own mapping:
    /// the whole pages its bytes touch, mapped (by `Shared::frag_iova`) at
    /// the frag's IOVA minus its offset in its first page.
    #[cold]
    pub(super) fn unmap_own_slow(&self) -> Result<()> {
        let (iova, len) = self.own_mapping();
        shared(&self.chunk).unmap_part(self.chunk, iova, len)
    }

    /// A `PerFrag` frag's own mapping: its IOVA and length.
    fn own_mapping(&self) -> (Iova, u64) {
        let addr = self.addr.raw() as u64;
        let lo = align_down(addr, PAGE_SIZE);
        let hi = align_up(addr + u64::from(self.len), PAGE_SIZE);
        (Iova(self.iova.raw() - (addr - lo)), hi - lo)
    }
}

impl<M: DmaMapper> Frag<M> {
    /// A hold on the frag's chunk, without access to its bytes: what a
    /// sender keeps after handing the frag to the device, until the data
    /// is acknowledged (TCP's retransmit queue keeps its pages referenced
    /// so). While any hold lives, the chunk is neither reused in place nor
    /// recycled. One atomic increment.
    ///
    /// # Panics
    /// If the chunk already carries about two billion references (holds
    /// leaked with `mem::forget`): the count never wraps, as
    /// `std::sync::Arc` guards its own.
    pub fn hold(&self) -> FragHold<M> {
        self.chunk.get().acquire();
        FragHold {
            chunk: self.chunk,
            len: self.len,
        }
    }
}

/// A reference on a frag's chunk with no access to its bytes (see
/// [`Frag::hold`]). It carries no mapping: under `PerFrag` the frag's own
/// mapping still goes when the frag completes; the hold only keeps the
/// chunk's memory from reuse. Dropping it releases the reference.
pub struct FragHold<M: DmaMapper> {
    chunk: ChunkPtr<M>,
    len: u32,
}

// SAFETY: a hold gives no access to memory; its reference is released with
// an atomic, and the pool state that release touches is Sync.
unsafe impl<M: DmaMapper> Send for FragHold<M> {}
// SAFETY: `&FragHold` only reads the two plain fields.
unsafe impl<M: DmaMapper> Sync for FragHold<M> {}

impl<M: DmaMapper> FragHold<M> {
    /// Bytes of the frag it was taken from.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Always false for a hold of a frag of at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// An opaque identity of the chunk held: equal for holds on the same
    /// chunk while they live (for counting chunks).
    pub fn chunk_id(&self) -> usize {
        self.chunk.get() as *const _ as usize
    }
}

impl<M: DmaMapper> std::fmt::Debug for FragHold<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FragHold")
            .field("chunk", &self.chunk_id())
            .field("len", &self.len)
            .finish()
    }
}

impl<M: DmaMapper> Drop for FragHold<M> {
    fn drop(&mut self) {
        put(self.chunk, 1);
    }
}

impl<M: DmaMapper> Drop for Frag<M> {
    #[inline]
    fn drop(&mut self) {
        // A failure is counted and poisons the chunk (see `unmap_own`).
        let _ = self.unmap_own();
        put(self.chunk, 1);
    }
}

fn shared<M: DmaMapper>(c: &ChunkPtr<M>) -> &Shared<M> {
    // SAFETY: a chunk that is out of the free list holds a strong count on
    // its pool, and callers hold a reference on the chunk while the borrow
    // lasts.
    unsafe { &*c.get().pool }
}

/// Drops `n` references on `c`; the last one recycles the chunk.
#[inline]
pub(super) fn put<M: DmaMapper>(c: ChunkPtr<M>, n: u32) {
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
    complete_runs(frags, put).1
}

/// Completes `frags`, dropping each run of frags of one chunk with one
/// `put(chunk, n)`. Returns how many frags' unmaps failed and the first
/// such error, after completing every frag. Fields are read in place and
/// each frag forgotten: no frag is copied whole.
#[inline]
pub(super) fn complete_runs<M: DmaMapper>(
    frags: impl IntoIterator<Item = Frag<M>>,
    mut put: impl FnMut(ChunkPtr<M>, u32),
) -> (usize, Result<()>) {
    let mut first_err = Ok(());
    let mut failed = 0;
    let mut run: Option<(ChunkPtr<M>, u32)> = None;
    for f in frags {
        if f.own {
            if let Err(e) = f.unmap_own_slow() {
                failed += 1;
                first_err = first_err.and(Err(e));
            }
        }
        let c = f.chunk;
        std::mem::forget(f);
        match &mut run {
            Some((rc, n)) if *rc == c => *n += 1,
            _ => {
                if let Some((rc, n)) = run.replace((c, 1)) {
                    put(rc, n);
                }
            }
        }
    }
    if let Some((c, n)) = run {
        put(c, n);
    }
    (failed, first_err)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::Arc;

    use super::*;
    use crate::dma::{Domain, Identity};
    use crate::frag::FragCache;
    use crate::pool::{self, Policy, Pool, MAX_REFCNT};
    use crate::Order;

    fn cache() -> FragCache<Identity> {
        let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
        cfg.grow_batch = 1;
        FragCache::new(Pool::new(Arc::new(Domain::new(Identity::new())), cfg).unwrap())
    }

    /// Leaked holds (`mem::forget` is safe) must not wrap the chunk's
    /// count: past the limit a hold panics, with the count as it was.
    #[test]
    fn hold_past_the_refcount_limit_panics_without_wrapping() {
        let mut c = cache();
        let f = c.refill(64, true).unwrap();
        let rc = &f.chunk.get().refcnt;
        let before = rc.load(Ordering::Relaxed);
        // As if about two billion holds had been leaked.
        rc.store(MAX_REFCNT, Ordering::Relaxed);
        let r = catch_unwind(AssertUnwindSafe(|| std::mem::forget(f.hold())));
        assert!(r.is_err(), "a hold past the limit was granted");
        assert_eq!(rc.load(Ordering::Relaxed), MAX_REFCNT);
        // One below the limit a hold is still granted.
        rc.store(MAX_REFCNT - 1, Ordering::Relaxed);
        drop(f.hold());
        assert_eq!(rc.load(Ordering::Relaxed), MAX_REFCNT - 1);
        rc.store(before, Ordering::Relaxed);
        c.complete(f).unwrap();
    }
}
