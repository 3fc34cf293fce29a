//! Memory kept for good on purpose ([`Frag::pin`], [`Coherent::pin`], for
//! a device that could not be stopped) is counted in its domain's
//! [`pinned`](Domain::pinned) bytes: the host bytes that stay allocated and
//! the IOVA bytes that stay mapped, each once, under every mapping policy.
//! A pool whose drop unwinds (a panic in its account's code) frees none of
//! the memory a device may still reach.

use std::sync::Arc;

use pfrag::dma::{Coherent, Dir, Domain, Pinned, SoftIommu, SoftIommuConfig, Translate};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Order, PAGE_SIZE};

type Dom = Arc<Domain<Arc<SoftIommu>>>;

fn domain() -> (Arc<SoftIommu>, Dom) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    (iommu.clone(), Arc::new(Domain::new(iommu)))
}

/// The chunk size of [`pin_one`]'s pool: order 1.
const CHUNK: u64 = 2 * PAGE_SIZE;

/// Pins a 100-byte frag (it spans no page boundary) from a pool of order-1
/// chunks mapped by `policy`, then drops the pool and maps 8 more
/// chunk-sized regions in the domain. Returns the domain's pinned bytes
/// just after the pin and at the end, and whether the frag's IOVA still
/// reaches the frag's memory and none of the new regions took it.
fn pin_one(policy: Policy) -> (Pinned, Pinned, bool) {
    let (iommu, d) = domain();
    let mut cfg = pool::Config::new(Order::new(1).unwrap(), policy);
    cfg.grow_batch = 1;
    let mut cache = FragCache::new(Pool::new(d.clone(), cfg).unwrap());
    let f = cache.refill(100, true).unwrap();
    let iova = f.iova();
    let addr = iommu.translate(iova, Dir::TO_DEVICE).unwrap().addr;
    f.pin();
    let at_pin = d.pinned();
    drop(cache);
    let others: Vec<_> = (0..8)
        .map(|_| Coherent::new(d.clone(), CHUNK as usize, Dir::BIDIRECTIONAL).unwrap())
        .collect();
    let same = iommu.translate(iova, Dir::TO_DEVICE).map(|t| t.addr) == Ok(addr);
    let kept = same && others.iter().all(|o| o.iova() != iova);
    (at_pin, d.pinned(), kept)
}

/// `PerFrag`: the frag's own mapping (its one page) stays for good and
/// counts at once; the chunk's host bytes count once the pool is gone.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_pinned_per_frag_frag_keeps_its_own_mapping_counted() {
    let (at_pin, end, kept) = pin_one(Policy::PerFrag);
    assert_eq!(at_pin.iova_bytes, PAGE_SIZE);
    let end_want = Pinned {
        iova_bytes: PAGE_SIZE,
        host_bytes: CHUNK,
    };
    assert_eq!(end, end_want);
    // Counted because it is still there.
    assert!(kept);
}

/// `Persistent`: the chunk's part of its arena's mapping stays (a mapping
/// is not removed in part), counted when the pool goes, once.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_pinned_persistent_frag_keeps_its_chunk_mapped_and_counted() {
    let (at_pin, end, kept) = pin_one(Policy::Persistent);
    assert_eq!(at_pin, Pinned::default(), "counted when the pool goes");
    let end_want = Pinned {
        iova_bytes: CHUNK,
        host_bytes: CHUNK,
    };
    assert_eq!(end, end_want);
    assert!(kept);
}

/// `PerChunk`: the chunk's own mapping stays too, counted when its last
/// reference goes, and its IOVA is never mapped again. It used to be
/// unmapped like any chunk's, so the next mapping in the domain took its
/// IOVA, and a device that could not be stopped, still reading there,
/// reached other memory.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_pinned_per_chunk_frag_keeps_its_mapping_for_good() {
    let (_, end, kept) = pin_one(Policy::PerChunk);
    let end_want = Pinned {
        iova_bytes: CHUNK,
        host_bytes: CHUNK,
    };
    assert_eq!(end, end_want);
    // New mappings in the domain land elsewhere.
    assert!(kept);
}

/// A pinned coherent region: its mapping and its memory, at once.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_pinned_coherent_region_counts_its_mapping_and_memory() {
    let (iommu, d) = domain();
    let ring = Coherent::new(d.clone(), 3 * PAGE_SIZE as usize, Dir::BIDIRECTIONAL).unwrap();
    let iova = ring.iova();
    ring.pin();
    let len = 3 * PAGE_SIZE;
    assert_eq!(
        d.pinned(),
        Pinned {
            iova_bytes: len,
            host_bytes: len
        }
    );
    assert!(iommu.translate(iova, Dir::FROM_DEVICE).is_ok());
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
    let iommu = Arc::new(
        SoftIommu::new(SoftIommuConfig {
            whole_unmaps: false,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    );
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
    let mut seen = Vec::new();
    // SAFETY: nothing writes the 64 bytes at `iova` during the call.
    unsafe { iommu.read(iova, 64, &mut |b| seen.extend_from_slice(b)) }.unwrap();
    assert_eq!(seen, [0; 64], "the pinned chunk, released to zeroes");
}

/// An account whose `pin` panics while `PANIC_ON_PIN` is set.
#[derive(Default)]
struct PanicOnPin(Arc<std::sync::atomic::AtomicBool>);

static PANIC_ON_PIN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl pfrag::account::Charge for PanicOnPin {
    fn charge(&self, _: u64) -> pfrag::Result<()> {
        Ok(())
    }
    fn uncharge(&self, _: u64) {}
    fn pressure_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.0.clone()
    }
    fn pin(&self, _: u64) {
        if PANIC_ON_PIN.load(std::sync::atomic::Ordering::Relaxed) {
            panic!("the account panics on a pin");
        }
    }
}

/// A pool whose drop unwinds before it has settled its memory (its
/// account panics on pinning a chunk whose unmap failed) frees no arena:
/// that chunk, still mapped, still holds its bytes.
#[test]
fn a_pool_whose_drop_panics_early_frees_no_arena() {
    use pfrag::dma::{Faulty, FaultyConfig};
    let faults = FaultyConfig {
        unmap_rate: 1.0,
        ..FaultyConfig::default()
    };
    let m = Faulty::new(SoftIommu::new(SoftIommuConfig::default()).unwrap(), faults).unwrap();
    m.arm(false);
    let d = Arc::new(Domain::new(m));
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 1;
    let pool = Pool::with_account(d.clone(), cfg, Arc::new(PanicOnPin::default())).unwrap();
    let mut cache = FragCache::new(pool.clone());
    let mut f = cache.refill(64, true).unwrap();
    f.as_mut_slice().fill(0xcd);
    let iova = f.iova();
    drop(f);
    drop(cache);
    // The drop's unmap fails: the chunk stays mapped and is pinned, and
    // the account's `pin` panics.
    d.mapper().arm(true);
    PANIC_ON_PIN.store(true, std::sync::atomic::Ordering::Relaxed);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(pool)));
    PANIC_ON_PIN.store(false, std::sync::atomic::Ordering::Relaxed);
    assert!(r.is_err(), "the account panicked inside the pool's drop");
    let iommu = d.mapper().inner();
    assert!(
        iommu.translate(iova, Dir::TO_DEVICE).is_ok(),
        "still mapped"
    );
    let mut seen = Vec::new();
    // SAFETY: nothing writes the 64 bytes at `iova` during the call.
    unsafe { iommu.read(iova, 64, &mut |b| seen.extend_from_slice(b)) }.unwrap();
    assert_eq!(seen, [0xcd; 64], "the chunk's bytes, kept");
}
