//! Caller code that panics inside pfrag never frees memory a device may
//! still reach:
//! - a pool whose drop unwinds (its account's hook or `pin` panics) frees
//!   none of it;
//! - a pool that lost chunks to a panic in the middle of a shrink keeps
//!   their arenas when it drops;
//! - a DMA mapper call that panics aborts the process, since what the
//!   IOMMU still translates is unknown after it.
//!
//! And a pool dropped after ordinary work, under every policy, keeps
//! nothing.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pfrag::dma::{
    Dir, Domain, Faulty, FaultyConfig, Invalidation, Pinned, SoftIommu, SoftIommuConfig, Translate,
};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool, Reclaim};
use pfrag::{Iova, Order};

/// A software IOMMU that allows split unmaps, as shared by a test's pool
/// and its checks.
fn iommu(invalidation: Invalidation) -> Arc<SoftIommu> {
    let cfg = SoftIommuConfig {
        whole_unmaps: false,
        invalidation,
        ..SoftIommuConfig::default()
    };
    Arc::new(SoftIommu::new(cfg).unwrap())
}

/// The `n` bytes a device reads at `iova` through `iommu`.
fn device_reads(iommu: &SoftIommu, iova: Iova, n: usize) -> Vec<u8> {
    let mut seen = Vec::new();
    // SAFETY: nothing writes those bytes during the call.
    unsafe { iommu.read(iova, n, &mut |b| seen.extend_from_slice(b)) }.unwrap();
    seen
}

/// A pressure hook that panics when its account leaves pressure.
struct PanicOnLeave;

impl pfrag::account::PressureHooks for PanicOnLeave {
    fn leave(&self, _bytes: u64) {
        panic!("the hook panics on leaving pressure");
    }
}

/// A pool whose drop unwinds (a pressure hook panics as the pool gives its
/// memory back) frees none of its memory: a pinned frag's chunk stays
/// mapped and its bytes stay alive, so a device reading it reads what was
/// there.
#[test]
fn a_pool_whose_drop_panics_keeps_a_pinned_chunk_alive() {
    use pfrag::account::{Limits, MemAccount};
    const KIB: u64 = 1 << 10;
    // Split unmaps allowed, so the arena's other chunks are unmapped and
    // given back (uncharged) while the pinned one stays.
    let iommu = iommu(Invalidation::Strict);
    let d = Arc::new(Domain::new(iommu.clone()));
    let limits = Limits {
        min: 48 * KIB,
        pressure: 48 * KIB,
        max: 1 << 30,
    };
    let acct = MemAccount::new(limits, PanicOnLeave).unwrap();
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    // One arena of 64 KiB: past `pressure` at once.
    cfg.grow_batch = 16;
    let pool = Pool::with_account(d, cfg, acct.clone()).unwrap();
    let mut cache = FragCache::new(pool.clone());
    let mut f = cache.refill(64, true).unwrap();
    f.as_mut_slice().fill(0xab);
    let iova = f.iova();
    f.pin();
    drop(cache);
    assert!(acct.under_pressure());
    // The drop gives back 60 KiB: the account leaves pressure, the hook
    // panics.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(pool)));
    assert!(r.is_err(), "the hook panicked inside the pool's drop");
    // Were the arena freed, this read would reach memory no longer
    // allocated. It is kept, its pages given back to the kernel as for
    // any pinned arena: a device reads zeroes.
    assert_eq!(
        device_reads(&iommu, iova, 64),
        [0; 64],
        "the pinned chunk, released to zeroes"
    );
}

/// An account whose `pin` panics while `panic` is set, with a pressure
/// flag a test sets.
#[derive(Default)]
struct PanicOnPin {
    pressure: Arc<AtomicBool>,
    panic: AtomicBool,
}

impl pfrag::account::Charge for PanicOnPin {
    fn charge(&self, _: u64) -> pfrag::Result<()> {
        Ok(())
    }
    fn uncharge(&self, _: u64) {}
    fn pressure_flag(&self) -> Arc<AtomicBool> {
        self.pressure.clone()
    }
    fn pin(&self, _: u64) {
        if self.panic.load(Ordering::Relaxed) {
            panic!("the account panics on a pin");
        }
    }
}

/// A domain over a software IOMMU that fails what its config says.
type Dom = Arc<Domain<Faulty<SoftIommu>>>;

/// A persistent pool of order-0 chunks, `batch` per arena, over a
/// software IOMMU whose unmaps all fail while armed (it starts disarmed),
/// with a [`PanicOnPin`] account; `cfg` sets the rest.
fn failing_unmaps(
    batch: usize,
    cfg: impl FnOnce(&mut pool::Config),
) -> (Dom, Arc<PanicOnPin>, Pool<Faulty<SoftIommu>>) {
    let faults = FaultyConfig {
        unmap_rate: 1.0,
        ..FaultyConfig::default()
    };
    let m = Faulty::new(SoftIommu::new(SoftIommuConfig::default()).unwrap(), faults).unwrap();
    m.arm(false);
    let d = Arc::new(Domain::new(m));
    let mut c = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    c.grow_batch = batch;
    cfg(&mut c);
    let acct = Arc::new(PanicOnPin::default());
    let pool = Pool::with_account(d.clone(), c, acct.clone()).unwrap();
    (d, acct, pool)
}

/// A pool whose drop unwinds before it has settled its memory (its
/// account panics on pinning a chunk whose unmap failed) frees no arena:
/// that chunk, still mapped, still holds its bytes.
#[test]
fn a_pool_whose_drop_panics_early_frees_no_arena() {
    let (d, acct, pool) = failing_unmaps(1, |_| {});
    let mut cache = FragCache::new(pool.clone());
    let mut f = cache.refill(64, true).unwrap();
    f.as_mut_slice().fill(0xcd);
    let iova = f.iova();
    drop(f);
    drop(cache);
    // The drop's unmap fails: the chunk stays mapped and is pinned, and
    // the account's `pin` panics.
    d.mapper().arm(true);
    acct.panic.store(true, Ordering::Relaxed);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(pool)));
    acct.panic.store(false, Ordering::Relaxed);
    assert!(r.is_err(), "the account panicked inside the pool's drop");
    let iommu = d.mapper().inner();
    assert!(
        iommu.translate(iova, Dir::TO_DEVICE).is_ok(),
        "still mapped"
    );
    assert_eq!(device_reads(iommu, iova, 64), [0xcd; 64], "kept");
}

/// A shrink that unwinds half-way (the account panics on pinning the first
/// of two chunks whose unmaps failed) loses the second chunk, still
/// mapped, to no list. The pool keeps its arena when it drops, and counts
/// it: a device reading it reads memory still allocated.
#[test]
fn chunks_lost_to_a_panic_in_a_shrink_keep_their_arenas() {
    // One chunk per arena; no shrink but the trim below, which (under
    // pressure) gives back two of the three free chunks in one shrink.
    let (d, acct, pool) = failing_unmaps(1, |c| {
        c.high_watermark = 100;
        c.shrink_batch = 2;
        c.reclaim = Reclaim::Eager;
    });
    let mut cache = FragCache::new(pool.clone());
    let frags: Vec<_> = (0..3).map(|_| cache.refill(4096, true).unwrap()).collect();
    let iovas: Vec<Iova> = frags.iter().map(|f| f.iova()).collect();
    drop(frags);
    drop(cache);
    d.mapper().arm(true);
    acct.pressure.store(true, Ordering::Relaxed);
    acct.panic.store(true, Ordering::Relaxed);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pool.trim()));
    acct.panic.store(false, Ordering::Relaxed);
    assert!(r.is_err(), "the account panicked inside the trim: {r:?}");
    // The third chunk, still free, is unmapped when the pool drops.
    d.mapper().arm(false);
    drop(pool);
    let iommu = d.mapper().inner();
    let kept: Vec<Iova> = iovas
        .into_iter()
        .filter(|&i| iommu.translate(i, Dir::TO_DEVICE).is_ok())
        .collect();
    assert_eq!(kept.len(), 2, "the two chunks whose unmap failed");
    for iova in kept {
        // Kept, its pages given back to the kernel: zeroes.
        assert_eq!(device_reads(iommu, iova, 64), [0; 64]);
    }
    assert_eq!(
        d.pinned().host_bytes,
        2 * 4096,
        "the pinned and the lost chunk"
    );
}

/// A mapper call that panics aborts the process, with a message: the pool
/// whose unmap it was could not tell what stays mapped. Run in a child
/// process (this test's binary, asked to run only this test).
#[test]
#[cfg_attr(miri, ignore = "starts a process")]
fn a_mapper_call_that_panics_aborts_the_process() {
    const CHILD: &str = "PFRAG_UNWIND_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let panics = common::Hooked {
            before_unmap: Box::new(|_, _| panic!("the mapper panics on unmap")),
            ..common::Hooked::new(iommu(Invalidation::Strict))
        };
        let d = Arc::new(Domain::new(panics));
        let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerFrag);
        let mut cache = FragCache::new(Pool::new(d, cfg).unwrap());
        // The frag's own mapping is removed when it drops: the mapper
        // panics there.
        drop(cache.refill(64, true).unwrap());
        unreachable!("the drop aborts the process");
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_mapper_call_that_panics_aborts_the_process"])
        .args(["--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{stderr}");
    assert!(stderr.contains("the mapper panics on unmap"), "{stderr}");
    assert!(stderr.contains("a DMA mapper call panicked"), "{stderr}");
}

/// A pool dropped after ordinary work keeps nothing, under every policy
/// and both invalidation modes: every chunk is found settled (free,
/// parked until a flush, or given back by a shrink).
#[test]
fn a_pool_dropped_after_ordinary_work_keeps_nothing() {
    let (n, sizes) = if cfg!(miri) {
        (40, [64, 1500, 5000])
    } else {
        (2_000, [64, 1500, 9000])
    };
    for policy in [Policy::Persistent, Policy::PerChunk, Policy::PerFrag] {
        for inv in [Invalidation::Strict, Invalidation::Lazy] {
            let iommu = iommu(inv);
            let d = Arc::new(Domain::new(iommu.clone()));
            let mut cfg = pool::Config::new(Order::new(2).unwrap(), policy);
            cfg.grow_batch = 2;
            cfg.queues = 2;
            cfg.reclaim = Reclaim::Eager;
            let pool = Pool::new(d.clone(), cfg).unwrap();
            let mut caches = [
                FragCache::for_queue(pool.clone(), 0).unwrap(),
                FragCache::for_queue(pool.clone(), 1).unwrap(),
            ];
            let mut held = Vec::new();
            for i in 0..n {
                let c = &mut caches[i % 2];
                held.push(c.refill(sizes[i % 3], true).unwrap());
                if held.len() > 16 {
                    // Oldest first, on the other queue's cache or dropped.
                    let f = held.remove(0);
                    if i % 5 == 0 {
                        drop(f);
                    } else {
                        caches[(i + 1) % 2].complete(f).unwrap();
                    }
                }
                if i % 97 == 0 {
                    pool.trim().unwrap();
                }
            }
            drop(held);
            drop(caches);
            drop(pool);
            assert_eq!(d.pinned(), Pinned::default(), "{policy:?} {inv:?}");
            assert_eq!(d.iova_in_use(), 0, "{policy:?} {inv:?}");
        }
    }
}
