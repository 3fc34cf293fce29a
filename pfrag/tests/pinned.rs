//! Memory kept for good on purpose ([`Frag::pin`], [`Coherent::pin`], for
//! a device that could not be stopped) is counted in its domain's
//! [`pinned`](Domain::pinned) bytes: the host bytes that stay allocated and
//! the IOVA bytes that stay mapped, each once, under every mapping policy.

use std::sync::Arc;

use pfrag::dma::{Coherent, Dir, Domain, Pinned, SoftIommu, SoftIommuConfig, Translate};
use pfrag::frag::{Frag, FragCache};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Order, PAGE_SIZE};

type Dom = Arc<Domain<Arc<SoftIommu>>>;

fn domain() -> (Arc<SoftIommu>, Dom) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    (iommu.clone(), Arc::new(Domain::new(iommu)))
}

/// A cache over a pool of order-1 chunks (8 KiB) mapped by `policy`, and
/// one 100-byte frag from it, which spans no page boundary.
fn one_frag(d: &Dom, policy: Policy) -> (FragCache<Arc<SoftIommu>>, Frag<Arc<SoftIommu>>) {
    let mut cfg = pool::Config::new(Order::new(1).unwrap(), policy);
    cfg.grow_batch = 1;
    let mut c = FragCache::new(Pool::new(d.clone(), cfg).unwrap());
    let f = c.refill(100, true).unwrap();
    (c, f)
}

fn pinned(d: &Dom) -> Pinned {
    d.pinned()
}

/// `PerFrag`: the frag's own mapping (its one page) stays for good and
/// counts at once; the chunk's host bytes count once the pool is gone.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_pinned_per_frag_frag_keeps_its_own_mapping_counted() {
    let (iommu, d) = domain();
    let (cache, f) = one_frag(&d, Policy::PerFrag);
    let iova = f.iova();
    f.pin();
    assert_eq!(pinned(&d).iova_bytes, PAGE_SIZE);
    drop(cache);
    assert_eq!(
        pinned(&d),
        Pinned {
            iova_bytes: PAGE_SIZE,
            host_bytes: 2 * PAGE_SIZE
        }
    );
    // Counted because it is still there.
    assert!(iommu.translate(iova, Dir::TO_DEVICE).is_ok());
}

/// `Persistent`: the chunk's part of its arena's mapping stays (a mapping
/// is not removed in part), counted when the pool goes, once.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_pinned_persistent_frag_keeps_its_chunk_mapped_and_counted() {
    let (iommu, d) = domain();
    let (cache, f) = one_frag(&d, Policy::Persistent);
    let iova = f.iova();
    f.pin();
    assert_eq!(pinned(&d), Pinned::default(), "counted when the pool goes");
    drop(cache);
    let chunk = 2 * PAGE_SIZE;
    assert_eq!(
        pinned(&d),
        Pinned {
            iova_bytes: chunk,
            host_bytes: chunk
        }
    );
    assert!(iommu.translate(iova, Dir::TO_DEVICE).is_ok());
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
    let (iommu, d) = domain();
    let (cache, f) = one_frag(&d, Policy::PerChunk);
    let iova = f.iova();
    let addr = iommu.translate(iova, Dir::TO_DEVICE).unwrap().addr;
    f.pin();
    drop(cache);
    let chunk = 2 * PAGE_SIZE;
    assert_eq!(
        pinned(&d),
        Pinned {
            iova_bytes: chunk,
            host_bytes: chunk
        }
    );
    // New mappings in the domain land elsewhere.
    let others: Vec<_> = (0..8)
        .map(|_| Coherent::new(d.clone(), chunk as usize, Dir::BIDIRECTIONAL).unwrap())
        .collect();
    assert_eq!(iommu.translate(iova, Dir::TO_DEVICE).unwrap().addr, addr);
    assert!(others.iter().all(|o| o.iova() != iova));
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
        pinned(&d),
        Pinned {
            iova_bytes: len,
            host_bytes: len
        }
    );
    assert!(iommu.translate(iova, Dir::FROM_DEVICE).is_ok());
}
