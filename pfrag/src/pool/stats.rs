//! Snapshots of a pool's counters, and the per-queue counters behind them.

use crate::sync::AtomicU64;

/// A snapshot of a pool's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
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
    /// Chunks kept out of circulation for good because a mapping of
    /// theirs could not be removed or its invalidation completed.
    pub pinned: u64,
    /// Times a freed chunk waited for a lazy flush before reuse.
    pub parks: u64,
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

impl Stats {
    /// This snapshot with the queue-traffic counters (`shared_ops`,
    /// `reclaim_calls`, `borrows`, `skipped_pressured`) taken relative to
    /// `earlier`; levels (chunks, bytes) stay as they are now. Each
    /// difference saturates at zero (the counters only grow, so only
    /// swapped arguments could make one negative).
    pub fn since(&self, earlier: &Stats) -> Stats {
        Stats {
            shared_ops: self.shared_ops.saturating_sub(earlier.shared_ops),
            reclaim_calls: self.reclaim_calls.saturating_sub(earlier.reclaim_calls),
            borrows: self.borrows.saturating_sub(earlier.borrows),
            skipped_pressured: self
                .skipped_pressured
                .saturating_sub(earlier.skipped_pressured),
            ..*self
        }
    }
}

/// A snapshot of one queue's reserve.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Each difference saturates at zero, as in [`Stats::since`].
    pub fn since(&self, earlier: &QueueStats) -> QueueStats {
        QueueStats {
            reclaim_calls: self.reclaim_calls.saturating_sub(earlier.reclaim_calls),
            reclaimed_bytes: self.reclaimed_bytes.saturating_sub(earlier.reclaimed_bytes),
            shared_ops: self.shared_ops.saturating_sub(earlier.shared_ops),
            borrows: self.borrows.saturating_sub(earlier.borrows),
            lent: self.lent.saturating_sub(earlier.lent),
            skipped_pressured: self
                .skipped_pressured
                .saturating_sub(earlier.skipped_pressured),
            pressure_flags: self.pressure_flags.saturating_sub(earlier.pressure_flags),
            ..*self
        }
    }
}

#[derive(Default)]
pub(super) struct QueueCounters {
    pub(super) recycles: AtomicU64,
    pub(super) peak_held: AtomicU64,
    pub(super) reclaim_calls: AtomicU64,
    pub(super) reclaimed_bytes: AtomicU64,
    pub(super) shared_ops: AtomicU64,
    pub(super) borrows: AtomicU64,
    pub(super) lent: AtomicU64,
    pub(super) skipped_pressured: AtomicU64,
    pub(super) pressure_flags: AtomicU64,
}
