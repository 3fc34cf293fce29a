//! The counters of a frag cache.

/// Counters of one cache (plain integers: a cache belongs to one queue).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Frags handed out.
    pub frags: u64,
    /// Bytes handed out.
    pub bytes: u64,
    /// Chunks taken from the pool.
    pub chunks_taken: u64,
    /// Chunks reused in place (all their frags had completed).
    pub reused_in_place: u64,
    /// Bytes skipped: abandoned chunk tails (too short for the next frag,
    /// or left because a `PerFrag` unmap in the chunk failed or waits for
    /// its flush) plus alignment padding.
    pub waste_bytes: u64,
}

impl CacheStats {
    /// `self - earlier`, field by field: the work done in between. Each
    /// difference saturates at zero (the counters only grow, so only
    /// swapped arguments could make one negative).
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            frags: self.frags.saturating_sub(earlier.frags),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            chunks_taken: self.chunks_taken.saturating_sub(earlier.chunks_taken),
            reused_in_place: self.reused_in_place.saturating_sub(earlier.reused_in_place),
            waste_bytes: self.waste_bytes.saturating_sub(earlier.waste_bytes),
        }
    }
}
