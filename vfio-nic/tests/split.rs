//! The queue's default frag source splits by size (`tx::Config::split`):
//! payloads up to the threshold come from order-0 chunks of a second pool,
//! larger ones from the queue's pool; `None` keeps one shared cache.

use std::sync::Arc;

use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::model::null::NullNic;
use vfio_nic::tx::{self, Queue};
use vfio_nic::Error;

type Q = Queue<Arc<SoftIommu>, NullNic<Arc<SoftIommu>>>;

fn queue(order: u32, cfg: tx::Config) -> Result<(Q, Pool<Arc<SoftIommu>>), Error> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(Order::new(order).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    // SAFETY: the null device translates through `iommu`, which `domain`
    // maps through.
    let q = unsafe { tx::Queue::new(domain, pool.clone(), NullNic::new(iommu), cfg) }?;
    Ok((q, pool))
}

#[test]
fn small_payloads_come_from_order_0_chunks_and_bulk_from_the_queues_order() {
    let (mut q, pool) = queue(4, tx::Config::default()).unwrap();
    let small = q.small_cache().expect("a split by default").pool().clone();
    assert_eq!(small.chunk_size(), 4096);
    let mut v = Vec::new();
    for len in [1, 1000, 4096] {
        q.frags(len, &mut v).unwrap();
    }
    assert_eq!(v.len(), 3, "each small payload is one frag");
    assert!(
        small.stats().chunks > 0,
        "small frags from the order-0 pool"
    );
    assert_eq!(pool.stats().chunks, 0, "none from the queue's pool");
    q.frags(4097, &mut v).unwrap();
    q.frags(60_000, &mut v).unwrap();
    assert!(pool.stats().chunks > 0, "bulk from the queue's pool");
    for f in v.drain(..) {
        q.cache_mut().complete(f).unwrap();
    }
}

#[test]
fn without_a_split_every_payload_comes_from_the_queues_pool() {
    let cfg = tx::Config {
        split: None,
        ..tx::Config::default()
    };
    let (mut q, pool) = queue(4, cfg).unwrap();
    assert!(q.small_cache().is_none());
    let mut v = Vec::new();
    q.frags(1000, &mut v).unwrap();
    assert!(pool.stats().chunks > 0);
    // Order 0 has nothing to split: no second pool.
    let (q0, _) = queue(0, tx::Config::default()).unwrap();
    assert!(q0.small_cache().is_none());
    for f in v.drain(..) {
        q.cache_mut().complete(f).unwrap();
    }
}

#[test]
fn a_split_outside_one_page_is_refused() {
    for t in [0usize, 4097] {
        let cfg = tx::Config {
            split: Some(t),
            ..tx::Config::default()
        };
        match queue(4, cfg) {
            Err(Error::BadConfig { what, value }) => {
                assert!(what.contains("split"), "{what}");
                assert_eq!(value, t as u64);
            }
            other => panic!("split {t}: {:?}", other.err()),
        }
    }
}

#[test]
fn small_payloads_charge_the_queues_memory_account_and_stop_at_its_limit() {
    let account = one_mib_account();
    let mut q = accounted_queue(&account, tx::Config::default());
    assert!(q.small_cache().is_some());
    let mut held = Vec::new();
    let err = loop {
        if let Err(e) = q.frags(4000, &mut held) {
            break e;
        }
        assert!(held.len() <= 1024, "1 MiB of 4 KiB chunks never ran out");
    };
    assert!(err.is_backoff(), "{err}");
    assert!(
        account.bytes() > 0 && account.bytes() <= 1 << 20,
        "{}",
        account.bytes()
    );
    for f in held.drain(..) {
        q.cache_mut().complete(f).unwrap();
    }
}

#[test]
fn a_pool_with_a_byte_limit_and_no_account_is_not_split() {
    let mut pcfg = pool::Config::new(Order::new(4).unwrap(), Policy::Persistent);
    pcfg.max_bytes = Some(1 << 20);
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    // SAFETY: as above.
    let q = unsafe { tx::Queue::new(domain, pool, NullNic::new(iommu), tx::Config::default()) }
        .unwrap();
    assert!(
        q.small_cache().is_none(),
        "its limit holds for every payload"
    );
}

/// A payload up to the split comes whole from one order-0 chunk (or,
/// where there is no second pool, whole from the queue's), whatever
/// `fit_whole` says: the count of buffers before carving says so too, so
/// with two buffers a packet (headers and data) and payloads not fit
/// whole, such a packet is sent, never refused as `TooManyBuffers`, and
/// the check without a queue agrees. One byte past the split, the
/// payload may take the carved chunk's tail and a fresh chunk: refused.
#[test]
fn a_payload_up_to_the_split_counts_as_one_frag_against_the_buffers() {
    use vfio_nic::format::igb::Advanced;
    use vfio_nic::offload::Offload;
    let cfg = tx::Config {
        fit_whole: false,
        max_bufs: 2,
        mtu: 9000,
        ..tx::Config::default()
    };
    let hdr = [0u8; 14];
    for order in [0, 4] {
        let (mut q, _) = queue(order, cfg).unwrap();
        for len in [1000, 4096] {
            assert_eq!(
                cfg.check_bufs::<Advanced>(Order::new(order).unwrap(), len)
                    .unwrap(),
                2
            );
            let r = q.send(&hdr, &vec![1u8; len], Offload::None, 1);
            assert!(r.is_ok(), "order {order}, {len} bytes: {r:?}");
        }
        assert_eq!(q.stats().descs, 4, "order {order}: header and data, twice");
        let r = q.send(&hdr, &vec![1u8; 4097], Offload::None, 2);
        assert!(
            matches!(r, Err(Error::TooManyBuffers { needed, max: 2 }) if needed > 2),
            "order {order}: {r:?}"
        );
    }
    // Without a split, payloads are carved as `fit_whole` says.
    let plain = tx::Config { split: None, ..cfg };
    let (mut q, _) = queue(4, plain).unwrap();
    let r = q.send(&hdr, &[1u8; 1000], Offload::None, 3);
    assert!(
        matches!(r, Err(Error::TooManyBuffers { needed: 3, max: 2 })),
        "{r:?}"
    );
}

/// A memory account that holds at most 1 MiB (its minimum, its pressure
/// mark and its limit alike).
fn one_mib_account() -> Arc<pfrag::account::MemAccount> {
    use pfrag::account::{Limits, MemAccount, NoHooks};
    let limits = Limits {
        min: 1 << 20,
        pressure: 1 << 20,
        max: 1 << 20,
    };
    MemAccount::new(limits, NoHooks).unwrap()
}

/// A queue with a split (`cfg`) over order-4 chunks of a pool charging
/// `account`, on the null device.
fn accounted_queue(account: &Arc<pfrag::account::MemAccount>, cfg: tx::Config) -> Q {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(Order::new(4).unwrap(), Policy::Persistent);
    let pool = Pool::with_account(domain.clone(), pcfg, account.clone()).unwrap();
    // SAFETY: the null device translates through `iommu`, which `domain`
    // maps through.
    unsafe { tx::Queue::new(domain, pool, NullNic::new(iommu), cfg) }.unwrap()
}

/// A small send whose order-0 chunk the memory account refuses is a
/// back-off, counted once, and changes nothing else: nothing posted or
/// charged, no frag handed out; `send_burst` stops quietly at it; once
/// memory is back the same sends go out and complete.
#[test]
fn a_small_send_refused_by_the_memory_limit_changes_nothing_but_the_back_off_count() {
    use vfio_nic::offload::Offload;
    use vfio_nic::tx::TxPacket;
    let account = one_mib_account();
    let cfg = tx::Config {
        ring: 64,
        mtu: 9000,
        ..tx::Config::default()
    };
    let mut q = accounted_queue(&account, cfg);
    let mut held = Vec::new();
    while q.frags(4096, &mut held).is_ok() {
        assert!(held.len() <= 256, "1 MiB of 4 KiB chunks never ran out");
    }
    let (stats, cache, bytes) = (q.stats(), q.cache_stats(), account.bytes());
    let small = q.small_cache().unwrap().pool().stats();
    let hdr = [0u8; 14];
    let payload = [7u8; 3000];
    let r = q.send(&hdr, &payload, Offload::None, 1);
    assert!(matches!(&r, Err(e) if e.is_backoff()), "{r:?}");
    let pkts = [TxPacket {
        headers: &hdr,
        payload: &payload,
        offload: Offload::None,
        token: 2,
    }; 3];
    assert_eq!(q.send_burst(&pkts).unwrap(), 0);
    let mut want = stats;
    want.mem_backoffs += 2;
    assert_eq!(q.stats(), want, "only the two back-offs counted");
    assert_eq!(q.in_flight(), 0);
    assert_eq!(q.cache_stats(), cache, "no frag handed out");
    assert_eq!(account.bytes(), bytes, "nothing charged");
    assert_eq!(q.small_cache().unwrap().pool().stats(), small);
    // Memory back: the same packets go out and complete.
    for f in held.drain(..) {
        q.cache_mut().complete(f).unwrap();
    }
    assert_eq!(q.send_burst(&pkts).unwrap(), 3);
    q.kick().unwrap();
    q.wait(std::time::Duration::from_secs(60)).unwrap();
    assert_eq!(q.stats().completed, 3);
}

/// A small send whose order-0 pool fails to map a new arena is refused
/// with that error and changes nothing: nothing posted, mapped or handed
/// out, no counter moved (a map failure is no back-off); `send_burst`
/// returns the error; once maps work the same sends go out and complete.
#[test]
fn a_small_send_whose_pool_cannot_map_changes_nothing() {
    for policy in [Policy::Persistent, Policy::PerFrag] {
        small_send_map_fails(policy);
    }
}

fn small_send_map_fails(policy: Policy) {
    use pfrag::dma::{Faulty, FaultyConfig};
    use vfio_nic::offload::Offload;
    use vfio_nic::tx::TxPacket;
    let faults = FaultyConfig {
        map_rate: 1.0,
        ..FaultyConfig::default()
    };
    let m =
        Arc::new(Faulty::new(SoftIommu::new(SoftIommuConfig::default()).unwrap(), faults).unwrap());
    m.arm(false);
    let domain = Arc::new(Domain::new(m.clone()));
    let pcfg = pool::Config::new(Order::new(4).unwrap(), policy);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let cfg = tx::Config {
        mtu: 9000,
        ..tx::Config::default()
    };
    // SAFETY: the null device translates through `m`, which `domain`
    // maps through.
    let mut q =
        unsafe { tx::Queue::new(domain.clone(), pool, NullNic::new(m.clone()), cfg) }.unwrap();
    let (stats, cache, mapped) = (q.stats(), q.cache_stats(), domain.iova_in_use());
    let small = q.small_cache().unwrap().pool().stats();
    m.arm(true);
    let hdr = [0u8; 14];
    let payload = [7u8; 3000];
    let r = q.send(&hdr, &payload, Offload::None, 1);
    assert!(matches!(&r, Err(e) if !e.is_backoff()), "{r:?}");
    let pkts = [TxPacket {
        headers: &hdr,
        payload: &payload,
        offload: Offload::None,
        token: 2,
    }; 3];
    assert!(q.send_burst(&pkts).is_err());
    assert!(m.stats_injected().maps >= 2);
    assert_eq!(q.stats(), stats, "no counter moved");
    assert_eq!(q.in_flight(), 0);
    // Under `PerFrag` the cache took an order-0 chunk (mapped per frag,
    // so taking it maps nothing) and keeps carving it next time.
    let mut want = cache;
    let took = u64::from(policy == Policy::PerFrag);
    want.chunks_taken += took;
    assert_eq!(q.cache_stats(), want, "no frag handed out");
    assert_eq!(domain.iova_in_use(), mapped, "nothing left mapped");
    // Under `Persistent` the new arena's untouched chunks wait as released
    // ones for the next grow (the pool's `released`): nothing grew.
    // One grow batch of order-0 chunks (fewer under Miri).
    let small_pool = q.small_cache().unwrap().pool();
    let batch = small_pool.config().grow_batch as u64;
    let now = small_pool.stats();
    assert_eq!(
        (now.grows, now.chunks, now.mapped_bytes),
        (
            small.grows + took,
            small.chunks + batch * took,
            small.mapped_bytes
        )
    );
    m.arm(false);
    assert_eq!(q.send_burst(&pkts).unwrap(), 3);
    q.kick().unwrap();
    q.wait(std::time::Duration::from_secs(60)).unwrap();
    assert_eq!(q.stats().completed, 3);
}
