//! A fault-injecting mapper, for testing error paths: wrap any mapper in
//! [`Faulty`] and its map, unmap and flush calls fail at the rates you set
//! (seeded, so a failing run can be replayed), or exactly at the Nth call of
//! one kind.
//!
//! An injected failure does what a real one does: the wrapped mapper is not
//! called, so a refused map installs nothing and a refused unmap leaves the
//! range mapped. Errors carry `EIO` (`ENOMEM` for maps), like the kernel's.
//!
//! ```
//! use std::sync::Arc;
//! use pfrag::dma::{Domain, Faulty, FaultyConfig, Op, SoftIommu, SoftIommuConfig};
//! use pfrag::pool::{self, Policy, Pool};
//! use pfrag::frag::FragCache;
//! use pfrag::Order;
//!
//! // The first map call fails: the pool's first grow is refused cleanly.
//! let cfg = FaultyConfig { fail_nth: Some((Op::Map, 1)), ..FaultyConfig::default() };
//! let mapper = Faulty::new(SoftIommu::new(SoftIommuConfig::default())?, cfg)?;
//! let domain = Arc::new(Domain::new(mapper));
//! let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(2)?, Policy::Persistent))?;
//! let mut cache = FragCache::new(pool);
//! assert_eq!(cache.refill(1500, true).unwrap_err().errno(), Some(libc::ENOMEM));
//! assert!(cache.refill(1500, true).is_ok()); // the second grow maps
//! assert_eq!(domain.mapper().stats_injected().maps, 1);
//! # Ok::<(), pfrag::Error>(())
//! ```

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use super::{
    Dir, DmaMapper, Fault, IovaSpace, MapStats, Mapping, PageSizes, Translate, Translation,
    Unmapped,
};
use crate::addr::Iova;
use crate::error::{Error, Result};

/// A kind of mapper call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `map` (each run of a batch is one call).
    Map,
    /// `unmap` (each run of a batch is one call).
    Unmap,
    /// `flush`.
    Flush,
}

/// What [`Faulty`] injects. [`FaultyConfig::default()`] injects nothing:
/// every rate 0, no Nth call, seed 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultyConfig {
    /// Seed of the random stream that decides each call. Default 1.
    pub seed: u64,
    /// Share of map calls that fail, in `0.0..=1.0`. Default 0.
    pub map_rate: f64,
    /// Share of unmap calls that fail. Default 0.
    pub unmap_rate: f64,
    /// Share of flush calls that fail. Default 0.
    pub flush_rate: f64,
    /// Fail exactly the Nth call (counted from 1) of this kind, besides the
    /// rates. Default `None`.
    pub fail_nth: Option<(Op, u64)>,
}

impl Default for FaultyConfig {
    /// Nothing fails.
    fn default() -> FaultyConfig {
        FaultyConfig {
            seed: 1,
            map_rate: 0.0,
            unmap_rate: 0.0,
            flush_rate: 0.0,
            fail_nth: None,
        }
    }
}

/// Calls seen and failures injected, per kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FaultyStats {
    /// Map failures injected.
    pub maps: u64,
    /// Unmap failures injected.
    pub unmaps: u64,
    /// Flush failures injected.
    pub flushes: u64,
    /// Map calls seen.
    pub map_calls: u64,
    /// Unmap calls seen.
    pub unmap_calls: u64,
    /// Flush calls seen.
    pub flush_calls: u64,
}

#[derive(Debug, Default)]
struct Counter {
    calls: AtomicU64,
    injected: AtomicU64,
}

/// A mapper that fails on purpose; see the module docs.
#[derive(Debug)]
pub struct Faulty<M> {
    inner: M,
    cfg: FaultyConfig,
    /// Random stream position (splitmix64).
    rng: AtomicU64,
    armed: AtomicBool,
    map: Counter,
    unmap: Counter,
    flush: Counter,
}

fn check_rate(what: &'static str, v: f64) -> Result<()> {
    if v.is_finite() && (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(Error::BadFloat { what, value: v })
    }
}

impl<M> Faulty<M> {
    /// Wraps `inner`. Rates must lie in `0.0..=1.0`.
    pub fn new(inner: M, cfg: FaultyConfig) -> Result<Faulty<M>> {
        check_rate("map failure rate (0..=1)", cfg.map_rate)?;
        check_rate("unmap failure rate (0..=1)", cfg.unmap_rate)?;
        check_rate("flush failure rate (0..=1)", cfg.flush_rate)?;
        if let Some((_, 0)) = cfg.fail_nth {
            return Err(Error::OutOfRange {
                what: "fail_nth call (counted from 1)",
                value: 0,
                min: 1,
                max: u64::MAX,
            });
        }
        Ok(Faulty {
            inner,
            rng: AtomicU64::new(cfg.seed),
            cfg,
            armed: AtomicBool::new(true),
            map: Counter::default(),
            unmap: Counter::default(),
            flush: Counter::default(),
        })
    }

    /// The wrapped mapper.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// Turns injection on or off (calls are counted either way).
    pub fn arm(&self, on: bool) {
        self.armed.store(on, Relaxed);
    }

    /// Calls seen and failures injected so far.
    pub fn stats_injected(&self) -> FaultyStats {
        FaultyStats {
            maps: self.map.injected.load(Relaxed),
            unmaps: self.unmap.injected.load(Relaxed),
            flushes: self.flush.injected.load(Relaxed),
            map_calls: self.map.calls.load(Relaxed),
            unmap_calls: self.unmap.calls.load(Relaxed),
            flush_calls: self.flush.calls.load(Relaxed),
        }
    }

    /// A uniform number in `0.0..1.0` from the seeded stream.
    fn uniform(&self) -> f64 {
        let mut z = self
            .rng
            .fetch_add(0x9e37_79b9_7f4a_7c15, Relaxed)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Counts a call of kind `op` and says whether it fails.
    fn fails(&self, op: Op) -> bool {
        let (c, rate) = match op {
            Op::Map => (&self.map, self.cfg.map_rate),
            Op::Unmap => (&self.unmap, self.cfg.unmap_rate),
            Op::Flush => (&self.flush, self.cfg.flush_rate),
        };
        let n = c.calls.fetch_add(1, Relaxed) + 1;
        let nth = self.cfg.fail_nth == Some((op, n));
        let hit = nth || (rate > 0.0 && self.uniform() < rate);
        let fail = hit && self.armed.load(Relaxed);
        if fail {
            c.injected.fetch_add(1, Relaxed);
        }
        fail
    }
}

impl<M: DmaMapper> DmaMapper for Faulty<M> {
    unsafe fn map(&self, m: &Mapping) -> Result<()> {
        if self.fails(Op::Map) {
            return Err(Error::Map {
                iova: m.iova,
                len: m.len,
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.map(m) }
    }
    fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped> {
        if self.fails(Op::Unmap) {
            return Err(Error::Unmap {
                iova,
                len,
                source: io::Error::from_raw_os_error(libc::EIO),
            });
        }
        self.inner.unmap(iova, len)
    }
    // `map_batch` and `unmap_batch` keep the trait's defaults, so every run
    // of a batch goes through the injecting `map` and `unmap` above.
    fn page_sizes(&self) -> PageSizes {
        self.inner.page_sizes()
    }
    fn iova_space(&self) -> IovaSpace {
        self.inner.iova_space()
    }
    fn flushed_seq(&self) -> u64 {
        self.inner.flushed_seq()
    }
    fn flush(&self) -> Result<()> {
        if self.fails(Op::Flush) {
            return Err(Error::Flush {
                source: io::Error::from_raw_os_error(libc::EIO),
            });
        }
        self.inner.flush()
    }
    fn stats(&self) -> MapStats {
        self.inner.stats()
    }
}

// SAFETY: every call goes to the one inner translation.
unsafe impl<M: Translate> Translate for Faulty<M> {
    fn translate(&self, iova: Iova, access: Dir) -> Result<Translation, Fault> {
        self.inner.translate(iova, access)
    }
    unsafe fn hold(&self) -> super::Hold<'_> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.hold() }
    }
    unsafe fn read(&self, iova: Iova, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), Fault> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.read(iova, len, f) }
    }
    unsafe fn write(&self, iova: Iova, src: &[u8]) -> Result<(), Fault> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.write(iova, src) }
    }
    unsafe fn write_u32(&self, iova: Iova, v: u32) -> Result<(), Fault> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.write_u32(iova, v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::{SoftIommu, SoftIommuConfig};

    #[test]
    fn rates_outside_zero_to_one_are_refused() {
        let soft = || SoftIommu::new(SoftIommuConfig::default()).unwrap();
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let cfg = FaultyConfig {
                unmap_rate: bad,
                ..FaultyConfig::default()
            };
            assert!(matches!(
                Faulty::new(soft(), cfg),
                Err(Error::BadFloat { .. })
            ));
        }
    }

    #[test]
    fn same_seed_same_failures() {
        let run = |seed| {
            let f = Faulty::new(
                SoftIommu::new(SoftIommuConfig::default()).unwrap(),
                FaultyConfig {
                    seed,
                    flush_rate: 0.3,
                    ..FaultyConfig::default()
                },
            )
            .unwrap();
            (0..200).map(|_| f.flush().is_err()).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let n = run(7).iter().filter(|&&b| b).count();
        assert!((30..=90).contains(&n), "{n} of 200 failed at rate 0.3");
    }

    #[test]
    fn nth_unmap_fails_and_leaves_the_range_mapped() {
        use crate::mem::Region;
        let f = Faulty::new(
            SoftIommu::new(SoftIommuConfig::default()).unwrap(),
            FaultyConfig {
                fail_nth: Some((Op::Unmap, 2)),
                ..FaultyConfig::default()
            },
        )
        .unwrap();
        let r = Region::new(2 * 4096, 4096, false).unwrap();
        for i in 0..2u64 {
            let m = Mapping {
                iova: Iova(0x10_0000 + i * 4096),
                addr: r.addr().offset(i as usize * 4096),
                len: 4096,
                dir: Dir::TO_DEVICE,
                huge: false,
            };
            // SAFETY: `r` outlives both mappings (it is leaked below if one
            // stays).
            unsafe { f.map(&m) }.unwrap();
        }
        assert!(f.unmap(Iova(0x10_0000), 4096).is_ok());
        assert!(f.unmap(Iova(0x10_1000), 4096).is_err());
        assert!(f.translate(Iova(0x10_1000), Dir::TO_DEVICE).is_ok());
        assert!(f.unmap(Iova(0x10_1000), 4096).is_ok());
        assert_eq!(f.stats_injected().unmaps, 1);
    }
}
