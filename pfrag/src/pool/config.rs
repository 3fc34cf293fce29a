//! A pool's settings: the mapping policy, the reclaim policy, and the
//! sizes and limits, checked once when the pool is built.

use crate::addr::HUGE_PAGE_SIZE;
use crate::dma::Dir;
use crate::error::{Error, Result};
use crate::mem::MAX_REGION_LEN;
use crate::order::Order;

/// When chunk memory is mapped for DMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
#[non_exhaustive]
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

    /// Its short name, as `Display` writes it.
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

    /// Its short name, as `Display` writes it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::PerFrag => "per-frag",
            Policy::PerChunk => "per-chunk",
            Policy::Persistent => "persistent",
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    /// `per-frag`, `per-chunk` or `persistent`.
    fn from_str(s: &str) -> std::result::Result<Policy, String> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("'{s}' is not a policy (per-frag, per-chunk, persistent)"))
    }
}

impl std::fmt::Display for Reclaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Reclaim {
    type Err = String;
    /// `eager`, or `hysteresis` with [`Reclaim::HYSTERESIS`]'s sizes.
    fn from_str(s: &str) -> std::result::Result<Reclaim, String> {
        match s {
            "eager" => Ok(Reclaim::Eager),
            "hysteresis" => Ok(Reclaim::HYSTERESIS),
            _ => Err(format!("'{s}' is not a reclaim policy (eager, hysteresis)")),
        }
    }
}

/// Settings of a [`Pool`](super::Pool). [`Config::new`] takes the order
/// and the policy and sets every other field to its default, stated on
/// each field.
#[derive(Clone, Debug)]
pub struct Config {
    /// Chunk order (no default: [`Config::new`] takes it).
    pub order: Order,
    /// Mapping policy (no default: [`Config::new`] takes it).
    pub policy: Policy,
    /// Direction chunks are mapped for. Default [`Dir::TO_DEVICE`] (TX).
    pub dir: Dir,
    /// Chunks per grow (one arena, one map call). 0 (the default) = 1 MiB
    /// worth (2 MiB with huge pages, 64 KiB under Miri), at least 1. At
    /// most [`MAX_REGION_LEN`] bytes of chunks
    /// (else [`Error::OutOfRange`]).
    pub grow_batch: usize,
    /// Free chunks above which the pool shrinks. 0 (the default) = the
    /// larger of 4 grow batches and 32 MiB of chunks: a TX ring reaped in
    /// one burst frees hundreds of chunks at once, and a watermark below
    /// that would shrink and regrow the pool on every burst (map and unmap
    /// calls in steady state).
    pub high_watermark: usize,
    /// Chunks per shrink. 0 (the default) = the grow batch. At most
    /// [`MAX_REGION_LEN`] bytes of chunks, as
    /// `grow_batch`.
    pub shrink_batch: usize,
    /// Most bytes of chunk memory the pool may hold, chunks pinned after a
    /// failed unmap included (they stay held for good); past it, growth is
    /// refused with [`Error::LimitReached`].
    /// `None` (the default) = unlimited.
    pub max_bytes: Option<u64>,
    /// Largest payload one `FragCache::frags` call accepts. Default
    /// 256 KiB ([`Config::DEFAULT_MAX_PAYLOAD`]).
    pub max_payload: usize,
    /// Back arenas with 2 MiB huge pages when available. Default off.
    pub hugepages: bool,
    /// TX queues served, each with its own reserve (1..=4096). Default 1
    /// ([`Config::DEFAULT_QUEUES`]).
    pub queues: usize,
    /// How freed chunks go back to the shared list. Default
    /// [`Reclaim::Eager`].
    pub reclaim: Reclaim,
}

impl Config {
    /// The default largest payload of one `FragCache::frags` call: 256 KiB.
    pub const DEFAULT_MAX_PAYLOAD: usize = 256 << 10;
    /// The default number of TX queues a pool serves: 1.
    pub const DEFAULT_QUEUES: usize = 1;

    /// Defaults for `order` and `policy`: TX direction, automatic batches
    /// and watermark, no byte limit, 256 KiB max payload, normal pages, one
    /// queue, eager reclaim.
    pub fn new(order: Order, policy: Policy) -> Config {
        Config {
            order,
            policy,
            dir: Dir::TO_DEVICE,
            grow_batch: 0,
            high_watermark: 0,
            shrink_batch: 0,
            max_bytes: None,
            max_payload: Config::DEFAULT_MAX_PAYLOAD,
            hugepages: false,
            queues: Config::DEFAULT_QUEUES,
            reclaim: Reclaim::Eager,
        }
    }

    /// Checks the settings as [`Pool::new`](crate::pool::Pool::new) does,
    /// without building a pool: a caller that configures many pools can
    /// refuse a bad one before building any.
    pub fn check(&self) -> Result<()> {
        self.clone().resolve().map(|_| ())
    }

    pub(super) fn resolve(mut self) -> Result<Config> {
        let chunk = self.order.size();
        if self.grow_batch == 0 {
            let target = if cfg!(miri) {
                // Miri tracks every byte: smaller arenas keep its runs
                // short; the batching itself is the same.
                64 << 10
            } else if self.hugepages {
                HUGE_PAGE_SIZE as usize
            } else {
                1 << 20
            };
            self.grow_batch = (target / chunk).max(1);
        }
        if self.high_watermark == 0 {
            self.high_watermark = self.grow_batch.saturating_mul(4).max((32 << 20) / chunk);
        }
        if self.shrink_batch == 0 {
            self.shrink_batch = self.grow_batch;
        }
        batch_bytes("grow_batch", self.grow_batch, chunk)?;
        batch_bytes("shrink_batch", self.shrink_batch, chunk)?;
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

/// Refuses a batch of `n` chunks of `chunk` bytes past
/// [`MAX_REGION_LEN`] bytes (one arena is one
/// region), so that `n * chunk` never overflows where the pool computes it.
fn batch_bytes(what: &'static str, n: usize, chunk: usize) -> Result<()> {
    let max = MAX_REGION_LEN / chunk;
    if n > max {
        return Err(Error::OutOfRange {
            what,
            value: n as u64,
            min: 1,
            max: max as u64,
        });
    }
    Ok(())
}
