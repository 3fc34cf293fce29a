//! Memory kept for good on purpose ([`Frag::pin`], [`Coherent::pin`], for
//! a device that could not be stopped) is counted in its domain's
//! [`pinned`](Domain::pinned) bytes: the host bytes that stay allocated and
//! the IOVA bytes that stay mapped, each once, under every mapping policy.

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
