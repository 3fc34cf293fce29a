//! The shrink gate: when a shrink can next find a whole free arena.

use crate::sync::{AtomicU64, Ordering};

/// Keeps shrink from scanning the free list on every completion when no
/// arena can be whole yet. A scan that takes nothing records how many more
/// chunks the closest arena still misses; each push to the free list adds
/// at most one, so no scan can succeed before that many pushes. Written
/// only by the thread holding `Shared::shrinking`.
#[derive(Default)]
pub(super) struct Gate {
    /// Chunks ever pushed to the free list.
    pushes: AtomicU64,
    /// `pushes` at which a scan may next take an arena.
    next: AtomicU64,
    /// The watermark the gate was set under: a lower one (pressure)
    /// opens it.
    mark: AtomicU64,
}

impl Gate {
    /// Counts one push to the free list.
    pub(super) fn pushed(&self) {
        self.pushes.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether a shrink under watermark `mark` can take no arena yet.
    pub(super) fn shut(&self, mark: usize) -> bool {
        self.pushes.load(Ordering::Relaxed) < self.next.load(Ordering::Relaxed)
            && mark as u64 >= self.mark.load(Ordering::Relaxed)
    }

    /// Records a scan under `mark`: `missing` more pushes must come
    /// before the next can take an arena (0 if this one took any).
    pub(super) fn set(&self, missing: u64, mark: usize) {
        let now = self.pushes.load(Ordering::Relaxed);
        self.next
            .store(now.saturating_add(missing), Ordering::Relaxed);
        self.mark.store(mark as u64, Ordering::Relaxed);
    }

    /// Lets the next shrink scan (an explicit trim).
    pub(super) fn open(&self) {
        self.next.store(0, Ordering::Relaxed);
    }
}
