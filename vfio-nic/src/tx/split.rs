//! The size-class split of payload memory ([`Config::split`]): small
//! payloads from order-0 chunks of a second pool the queue owns, so that a
//! small send held until its ACK pins 4 KiB rather than a large chunk.

use pfrag::dma::DmaMapper;
use pfrag::frag::{CacheStats, FragCache};
use pfrag::pool::{self, Pool};
use pfrag::Order;

use super::{Config, Queue};
use crate::device::TxDevice;
use crate::error::Result;

/// The small payloads' cache of a queue over `pool` with `cfg`: a pool of
/// order-0 chunks with the same policy, direction and payload limit, its
/// batches and watermark sized for order 0, on plain pages, charging the
/// same memory account as `pool`. A pool with `max_bytes` and no account
/// gets no split: a second pool would hold memory past that limit (give
/// the pool a [`MemAccount`](pfrag::account::MemAccount), which both pools
/// then share).
pub(super) fn small_cache<M: DmaMapper>(
    pool: &Pool<M>,
    cfg: &Config,
) -> Result<Option<FragCache<M>>> {
    let main = pool.config();
    let unshared_limit = main.max_bytes.is_some() && pool.account().is_none();
    if cfg.split.is_none() || main.order.get() == 0 || unshared_limit {
        return Ok(None);
    }
    let small = pool::Config {
        order: Order::new(0)?,
        grow_batch: 0,
        high_watermark: 0,
        shrink_batch: 0,
        max_bytes: None,
        queues: 1,
        hugepages: false,
        ..main.clone()
    };
    let domain = pool.domain().clone();
    let p = match pool.account() {
        Some(a) => Pool::with_account(domain, small, a.clone())?,
        None => Pool::new(domain, small)?,
    };
    Ok(Some(FragCache::new(p)))
}

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// The cache a payload of `len` bytes is carved from: the small
    /// payloads' one up to the split, else the queue's.
    pub(super) fn payload_cache(&mut self, len: usize) -> &mut FragCache<M> {
        match self.small.as_mut() {
            Some(c) if self.cfg.split.is_some_and(|t| len <= t) => c,
            _ => &mut self.cache,
        }
    }

    /// Both payload caches' counters, summed (the queue's cache and the
    /// small payloads' one).
    pub fn cache_stats(&self) -> CacheStats {
        let mut s = self.cache.stats();
        if let Some(t) = self.small.as_ref().map(FragCache::stats) {
            s.frags += t.frags;
            s.bytes += t.bytes;
            s.chunks_taken += t.chunks_taken;
            s.reused_in_place += t.reused_in_place;
            s.waste_bytes += t.waste_bytes;
        }
        s
    }
    /// The small payloads' cache, over order-0 chunks of the queue's
    /// second pool (`None` without a split, or with a pool of order 0).
    pub fn small_cache(&self) -> Option<&FragCache<M>> {
        self.small.as_ref()
    }
}
