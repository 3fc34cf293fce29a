//! One queue's reserve of free chunks, and the moves between reserves and
//! the shared free list: borrowing from a neighbour, giving back a chunk a
//! take could not map, and reclaiming a reserve's surplus.

use super::{ChunkPtr, QueueCounters, Shared};
use crate::dma::DmaMapper;
use crate::sync::{AtomicBool, AtomicU64, Ordering, Queue};

/// One queue's reserve of free chunks. Aligned so that two queues' counters
/// never share a cache line (queues run on different cores).
#[repr(align(128))]
pub(super) struct Reserve<M: DmaMapper> {
    /// Chunks this queue has out of the lists; while above zero the queue
    /// holds one strong count on the pool's shared state.
    pub(super) out: AtomicU64,
    pub(super) free: Queue<ChunkPtr<M>>,
    /// Bytes in `free`.
    pub(super) held: AtomicU64,
    /// "Under pressure: do not borrow from me." Set by the owner when it
    /// runs dry, cleared by the owner when it has room again.
    pub(super) pressured: AtomicBool,
    pub(super) c: QueueCounters,
}

impl<M: DmaMapper> Reserve<M> {
    pub(super) fn new() -> Reserve<M> {
        Reserve {
            out: AtomicU64::new(0),
            free: Queue::new(),
            held: AtomicU64::new(0),
            pressured: AtomicBool::new(false),
            c: QueueCounters::default(),
        }
    }

    /// Counts `n` pushes or pops on the shared free list by this queue.
    pub(super) fn shared_op(&self, n: u64) {
        self.c.shared_ops.fetch_add(n, Ordering::Relaxed);
    }
}

impl<M: DmaMapper> Shared<M> {
    /// A chunk from the first neighbour of `q` (in ring order) that is not
    /// under pressure and has one, and that neighbour. Lock-free pops only.
    /// The caller counts the borrow once it keeps the chunk.
    pub(super) fn borrow(&self, q: usize) -> Option<(ChunkPtr<M>, usize)> {
        let n = self.reserves.len();
        let me = &self.reserves[q];
        let size = self.cfg.order.size() as u64;
        for i in 1..n {
            let at = (q + i) % n;
            let nb = &self.reserves[at];
            if nb.pressured.load(Ordering::Relaxed) {
                me.c.skipped_pressured.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Some(c) = nb.free.pop() {
                nb.held.fetch_sub(size, Ordering::Relaxed);
                return Some((c, at));
            }
        }
        None
    }

    /// Puts back a chunk that a take of queue `r` could not map: into the
    /// reserve it came from, else the shared list (counted as `r`'s).
    pub(super) fn untake(&self, c: ChunkPtr<M>, from: Option<usize>, r: &Reserve<M>) {
        match from {
            Some(i) => {
                let src = &self.reserves[i];
                // Counted before the push, as in `free_to_lists`.
                src.held
                    .fetch_add(self.cfg.order.size() as u64, Ordering::Relaxed);
                src.free.push(c);
            }
            None => {
                self.push_free(c);
                r.shared_op(1);
            }
        }
    }

    /// Moves up to `bytes` (at least one chunk) from queue `r`'s reserve to
    /// the shared list: one reclaim call.
    pub(super) fn reclaim(&self, r: &Reserve<M>, bytes: u64) {
        let size = self.cfg.order.size() as u64;
        let mut moved = 0u64;
        while moved < bytes.max(size) {
            let Some(c) = r.free.pop() else { break };
            r.held.fetch_sub(size, Ordering::Relaxed);
            self.push_free(c);
            moved += size;
        }
        if moved > 0 {
            r.c.reclaim_calls.fetch_add(1, Ordering::Relaxed);
            r.c.reclaimed_bytes.fetch_add(moved, Ordering::Relaxed);
            r.shared_op(moved / size);
        }
    }
}
