//! Per-queue reserves, reclaim policies, borrowing between queues and the
//! process-wide memory account.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use pfrag::account::{CountHooks, Limits, MemAccount};
use pfrag::dma::{Dir, DmaMapper, Domain, Invalidation, SoftIommu, SoftIommuConfig, Translate};
use pfrag::frag::{Frag, FragCache};
use pfrag::pool::{self, Policy, Pool, Reclaim};
use pfrag::{Error, Order};

fn domain() -> Arc<Domain<SoftIommu>> {
    Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig {
            invalidation: Invalidation::Strict,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    ))
}

fn config(order: u32, reclaim: Reclaim, queues: usize) -> pool::Config {
    let mut c = pool::Config::new(Order::new(order).unwrap(), Policy::Persistent);
    c.reclaim = reclaim;
    c.queues = queues;
    c
}

/// A deterministic stream of sizes 64 B ..= 16 KiB.
fn sizes(seed: u64) -> impl Iterator<Item = usize> {
    let mut x = seed | 1;
    std::iter::from_fn(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        Some(64 + (x % (16 * 1024 - 63)) as usize)
    })
}

/// Sends sizes through `cache`, keeping `window` payloads in flight and
/// completing the oldest, then every burst of `burst` sends completes all
/// (so memory comes back in waves).
/// Iterations: the full count natively, fewer under Miri (which interprets
/// every step); the properties checked stay the same.
fn n(full: usize) -> usize {
    if cfg!(miri) {
        (full / 40).max(4)
    } else {
        full
    }
}

fn churn(cache: &mut FragCache<SoftIommu>, n: usize, window: usize, burst: usize) -> u64 {
    let mut inflight: VecDeque<Vec<Frag<SoftIommu>>> = VecDeque::new();
    let mut bytes = 0;
    for (i, len) in sizes(7).take(n).enumerate() {
        let mut v = Vec::new();
        cache.frags(len, true, &mut v).unwrap();
        bytes += len as u64;
        inflight.push_back(v);
        if inflight.len() > window {
            inflight.pop_front();
        }
        if (i + 1) % burst == 0 {
            inflight.clear();
        }
    }
    bytes
}

#[test]
fn eager_reclaims_every_freed_chunk_hysteresis_almost_never() {
    let run = |reclaim| {
        let pool = Pool::new(domain(), config(2, reclaim, 1)).unwrap();
        let mut c = FragCache::new(pool.clone());
        churn(&mut c, n(20_000), 64, 500);
        drop(c);
        (pool.stats(), pool.queue_stats(0).unwrap())
    };
    let (ep, eq) = run(Reclaim::Eager);
    let (hp, hq) = run(Reclaim::HYSTERESIS);
    // Eager: one reclaim per chunk freed by a completion.
    assert_eq!(eq.reclaim_calls, ep.recycles);
    assert!(eq.reclaim_calls * 2 >= n(20_000) as u64 / 4, "{eq:?}");
    // Hysteresis with a 2 MiB threshold: the working set (a window of 64
    // payloads of up to 16 KiB) never passes it.
    assert_eq!(hq.reclaim_calls, 0, "{hq:?}");
    assert!(hq.shared_ops < eq.shared_ops / 10, "{hq:?} vs {eq:?}");
    assert!(hp.recycles > 0);
}

#[test]
fn hysteresis_holds_at_most_threshold_plus_a_chunk_and_reclaims_in_chunks() {
    let (threshold, chunk) = (256 << 10, 128 << 10);
    let pool = Pool::new(
        domain(),
        config(2, Reclaim::Hysteresis { threshold, chunk }, 1),
    )
    .unwrap();
    let size = pool.chunk_size() as u64;
    let mut c = FragCache::new(pool.clone());
    // Waves of up to 400 payloads in flight, all freed at once: far more
    // than the threshold comes back in each wave.
    // Under Miri: fewer, smaller waves, still far past the threshold.
    let wave = if cfg!(miri) { 150 } else { 400 };
    churn(&mut c, n(10_000).max(2 * wave), wave, wave);
    let q = pool.queue_stats(0).unwrap();
    let freed = pool.stats().recycles * size;
    assert!(q.reclaim_calls > 0, "{q:?}");
    assert!(q.peak_held <= threshold + size, "{q:?}");
    assert_eq!(q.reclaimed_bytes, q.reclaim_calls * chunk, "{q:?}");
    assert!(q.reclaim_calls <= freed / chunk, "{q:?}, {freed} freed");
    assert!(q.held <= threshold);
}

/// A pool of 64 KiB chunks, grown 256 KiB at a time, charged to an account
/// with `limits` (MiB granularity is enough here).
fn limited(
    limits: Limits,
) -> (
    Arc<MemAccount<CountHooks>>,
    Arc<Domain<SoftIommu>>,
    Pool<SoftIommu>,
) {
    let acct = MemAccount::new(limits, CountHooks::default()).unwrap();
    let d = domain();
    let mut cfg = config(4, Reclaim::HYSTERESIS, 1);
    cfg.grow_batch = 4;
    let pool = Pool::with_account(d.clone(), cfg, acct.clone()).unwrap();
    (acct, d, pool)
}

#[test]
fn pressure_hooks_fire_once_per_transition_and_pressure_gives_memory_back() {
    let mib = 1u64 << 20;
    let (acct, d, pool) = limited(Limits {
        min: mib,
        pressure: 2 * mib,
        max: 8 * mib,
    });
    let size = pool.chunk_size() as u64;
    let mut c = FragCache::new(pool.clone());
    let mut transitions = 0;
    let mut was = false;
    let mut seen = |p: bool| {
        if p != was {
            transitions += 1;
            was = p;
        }
    };
    for round in 0..3 {
        // Hold 3 MiB: past `pressure`.
        let mut held = Vec::new();
        for _ in 0..48 {
            c.frags(65_000, true, &mut held).unwrap();
            seen(acct.under_pressure());
        }
        assert!(acct.under_pressure(), "round {round}: {:?}", acct.stats());
        assert_eq!(pool.under_pressure(), acct.under_pressure());
        let inv0 = d.mapper().stats().invalidations;
        // Free it all: under pressure the reserve goes back and the pool
        // gives memory to the OS until usage is below `min`.
        for f in held.drain(..) {
            f.complete().unwrap();
            seen(acct.under_pressure());
        }
        c.release();
        seen(acct.under_pressure());
        assert!(!acct.under_pressure(), "round {round}: {:?}", acct.stats());
        assert!(acct.bytes() < mib);
        assert_eq!(acct.bytes(), pool.stats().chunks * size);
        // Given back means unmapped first: each released range cost a
        // strict invalidation.
        assert!(d.mapper().stats().invalidations > inv0);
    }
    let st = acct.stats();
    assert_eq!(transitions, 6);
    assert_eq!((st.entered, st.left), (3, 3));
    assert_eq!(acct.hooks().enter.load(Ordering::Relaxed), 3);
    assert_eq!(acct.hooks().leave.load(Ordering::Relaxed), 3);
    assert!(pool.stats().released > 0);
}

#[test]
fn released_memory_no_longer_translates() {
    let mib = 1u64 << 20;
    let (_acct, d, pool) = limited(Limits {
        min: mib / 2,
        pressure: mib,
        max: 4 * mib,
    });
    let mut c = FragCache::new(pool.clone());
    let mut held = Vec::new();
    for _ in 0..24 {
        c.frags(65_536, true, &mut held).unwrap();
    }
    let iovas: Vec<_> = held.iter().map(|f| f.iova()).collect();
    for f in &iovas {
        assert!(d.mapper().translate(*f, Dir::TO_DEVICE).is_ok());
    }
    drop(held);
    c.release();
    let released = pool.stats().released as usize;
    assert!(released > 0);
    let gone = iovas
        .iter()
        .filter(|i| d.mapper().translate(**i, Dir::TO_DEVICE).is_err())
        .count();
    // Every chunk whose memory went back is unmapped; the rest stay mapped.
    assert_eq!(gone, released);
}

#[test]
fn past_max_growth_fails_typed_and_nothing_leaks() {
    let (acct, d, pool) = limited(Limits {
        min: 0,
        pressure: 1 << 20,
        max: 1 << 20,
    });
    let mut c = FragCache::new(pool.clone());
    let mut held = Vec::new();
    let err = loop {
        // 100 KB: two chunks each, so a failure can land mid-payload.
        match c.frags(100_000, true, &mut held) {
            Ok(()) => assert!(held.len() < 100),
            Err(e) => break e,
        }
    };
    let n = held.len();
    match err {
        Error::MemoryLimit {
            allocated,
            requested,
            max,
        } => {
            assert_eq!(max, 1 << 20);
            assert_eq!(allocated, 1 << 20);
            assert_eq!(requested, 4 * 65_536);
        }
        other => panic!("{other}"),
    }
    assert_eq!(held.len(), n, "the failed call left no frag behind");
    assert_eq!(acct.bytes(), 1 << 20);
    assert_eq!(d.mapper().stats().map_calls, 4, "one map per grow");
    drop(held);
    drop(c);
    drop(pool);
    assert_eq!(acct.bytes(), 0);
    assert_eq!(d.iova_in_use(), 0);
}

#[test]
fn borrowing_skips_pressured_neighbours_and_only_owners_clear_flags() {
    let d = domain();
    // 16 KiB chunks; a queue has room again at a quarter of the threshold
    // (two chunks).
    let reclaim = Reclaim::Hysteresis {
        threshold: 128 << 10,
        chunk: 64 << 10,
    };
    let mut cfg = config(2, reclaim, 3);
    cfg.grow_batch = 1; // the shared list runs dry at once
    let pool = Pool::new(d, cfg).unwrap();
    let mut q: Vec<FragCache<SoftIommu>> = (0..3)
        .map(|i| FragCache::for_queue(pool.clone(), i).unwrap())
        .collect();
    let chunk = pool.chunk_size();
    let c64 = chunk as u64;
    // `n` whole chunks through queue `i`, then all freed into its reserve.
    let cycle = |q: &mut Vec<FragCache<SoftIommu>>, i: usize, n: usize| {
        let mut v = Vec::new();
        for _ in 0..n {
            q[i].frags(chunk, true, &mut v).unwrap();
        }
        q[i].release();
        drop(v);
    };
    // Queue 1 runs dry on its first take and flags itself; one chunk back
    // is below its room mark (two chunks): still flagged.
    cycle(&mut q, 1, 1);
    let s1 = pool.queue_stats(1).unwrap();
    assert!(s1.pressured && s1.held == c64, "{s1:?}");
    // Queue 2 runs dry too and, borrowing, skips queue 1 every time; with
    // four chunks back it has room and clears its own flag.
    cycle(&mut q, 2, 4);
    let s2 = pool.queue_stats(2).unwrap();
    assert_eq!((s2.skipped_pressured, s2.borrows), (4, 0), "{s2:?}");
    assert!(!s2.pressured && s2.held == 4 * c64, "{s2:?}");

    // Queue 0 has nothing and the shared list is empty: it borrows,
    // skipping queue 1, from queue 2.
    assert_eq!(pool.free_chunks(), 0);
    let mut v0 = Vec::new();
    q[0].frags(chunk, true, &mut v0).unwrap();
    let s0 = pool.queue_stats(0).unwrap();
    assert_eq!((s0.borrows, s0.skipped_pressured), (1, 1), "{s0:?}");
    assert_eq!(pool.queue_stats(2).unwrap().lent, 1);
    let s1 = pool.queue_stats(1).unwrap();
    assert_eq!((s1.lent, s1.held), (0, c64), "queue 1 was left alone");
    assert!(s1.pressured, "a borrower never clears another queue's flag");

    // The owner gets two chunks back: room again, its flag clears.
    cycle(&mut q, 1, 2);
    let s1 = pool.queue_stats(1).unwrap();
    assert!(!s1.pressured && s1.held == 2 * c64, "{s1:?}");
    drop(v0);
    drop(q);
    assert_eq!(
        pool.stats().chunks as usize,
        pool.free_chunks() + pool.reserved_chunks()
    );
}

#[test]
fn bad_queue_and_bad_hysteresis_are_typed_errors() {
    let pool = Pool::new(domain(), config(2, Reclaim::Eager, 2)).unwrap();
    assert!(matches!(
        FragCache::for_queue(pool, 2),
        Err(Error::BadQueue {
            queue: 2,
            queues: 2
        })
    ));
    let tiny = Reclaim::Hysteresis {
        threshold: 1 << 20,
        chunk: 4096,
    };
    assert!(matches!(
        Pool::new(domain(), config(2, tiny, 1)),
        Err(Error::BadConfig { .. })
    ));
    assert!(matches!(
        Pool::new(domain(), config(2, Reclaim::Eager, 0)),
        Err(Error::BadConfig { .. })
    ));
}

/// Frags of queue 0 completed on another thread while queue 0 keeps
/// sending: every chunk returns to queue 0's reserve or the shared list,
/// none is lost or counted twice.
#[test]
fn cross_thread_completions_keep_the_books_straight() {
    let pool = Pool::new(domain(), config(1, Reclaim::HYSTERESIS, 2)).unwrap();
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Frag<SoftIommu>>>(64);
    let reaper = std::thread::spawn(move || {
        let mut n = 0;
        for v in rx {
            n += v.len();
        }
        n
    });
    let mut c0 = FragCache::for_queue(pool.clone(), 0).unwrap();
    let mut sent = 0;
    for len in sizes(3).take(n(5000)) {
        let mut v = Vec::new();
        c0.frags(len, true, &mut v).unwrap();
        sent += v.len();
        tx.send(v).unwrap();
    }
    drop(tx);
    assert_eq!(reaper.join().unwrap(), sent);
    drop(c0);
    let st = pool.stats();
    assert_eq!(
        st.chunks as usize,
        pool.free_chunks() + pool.reserved_chunks(),
        "{st:?}"
    );
    let q0 = pool.queue_stats(0).unwrap();
    assert_eq!(
        q0.held,
        pool.reserved_chunks() as u64 * pool.chunk_size() as u64
    );
}

/// A grow whose map fails leaves the account as it was: the charge it
/// made past `pressure` is given back without entering pressure, running
/// a hook or raising the peak. A grow that succeeds then enters it.
#[test]
fn a_grow_that_fails_leaves_the_account_as_it_was() {
    use pfrag::dma::{Faulty, FaultyConfig, Op};
    const KIB: u64 = 1 << 10;
    let limits = Limits {
        min: 32 * KIB,
        pressure: 100 * KIB,
        max: 1 << 30,
    };
    let acct = MemAccount::new(limits, CountHooks::default()).unwrap();
    // The first grow's map succeeds, the second's fails.
    let faults = FaultyConfig {
        fail_nth: Some((Op::Map, 2)),
        ..FaultyConfig::default()
    };
    let m = Faulty::new(SoftIommu::new(SoftIommuConfig::default()).unwrap(), faults).unwrap();
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 16;
    let pool = Pool::with_account(Arc::new(Domain::new(m)), cfg, acct.clone()).unwrap();
    let mut cache = FragCache::new(pool);
    let held: Vec<_> = (0..16).map(|_| cache.refill(4096, true).unwrap()).collect();
    let before = acct.stats();
    assert_eq!(before.bytes, 64 * KIB);
    // 64 KiB more would pass `pressure`; the map fails.
    let e = cache.refill(4096, true).unwrap_err();
    assert!(matches!(e, Error::Map { .. }), "{e:?}");
    assert_eq!(acct.stats(), before, "the account as it was");
    assert!(!acct.under_pressure());
    let hooks = acct.hooks();
    assert_eq!(hooks.enter.load(Ordering::Relaxed), 0, "no hook ran");
    assert_eq!(hooks.leave.load(Ordering::Relaxed), 0, "no hook ran");
    // The next grow maps: past `pressure` now, once.
    let more = cache.refill(4096, true).unwrap();
    let after = acct.stats();
    assert_eq!(
        (after.bytes, after.peak, after.entered),
        (128 * KIB, 128 * KIB, 1)
    );
    assert!(acct.under_pressure());
    drop((held, more));
}

/// A grow that fails while another pool on the same account grows and
/// commits: the other's commit leaves the reservation out, so the account
/// ends as the other's grow alone leaves it (no pressure entered, no peak
/// raised by bytes given back).
#[test]
fn a_failed_grow_beside_another_grow_leaves_the_account_as_that_one_alone() {
    use std::sync::Barrier;
    const KIB: u64 = 1 << 10;
    let limits = Limits {
        min: 16 * KIB,
        pressure: 48 * KIB,
        max: 1 << 30,
    };
    let acct = MemAccount::new(limits, CountHooks::default()).unwrap();
    // A's map waits until B has grown, then fails.
    let bar = Arc::new(Barrier::new(2));
    let b2 = bar.clone();
    let slow = common::Hooked {
        before_map: Box::new(move |m| {
            b2.wait(); // A has reserved
            b2.wait(); // B has grown and committed
            Err(Error::BadConfig {
                what: "a map refused by the test",
                value: m.iova.raw(),
            })
        }),
        ..common::Hooked::new(Arc::new(
            SoftIommu::new(SoftIommuConfig::default()).unwrap(),
        ))
    };
    let mut ca = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    ca.grow_batch = 10; // 40 KiB reserved by A
    let mut cb = ca.clone();
    cb.grow_batch = 4; // 16 KiB committed by B: below `pressure` alone
    let pa = Pool::with_account(Arc::new(Domain::new(slow)), ca, acct.clone()).unwrap();
    let pb = Pool::with_account(domain(), cb, acct.clone()).unwrap();
    let t = std::thread::spawn(move || {
        let mut c = FragCache::new(pa);
        assert!(c.refill(64, true).is_err(), "A's grow fails");
    });
    bar.wait();
    let mut c = FragCache::new(pb);
    let f = c.refill(64, true).unwrap();
    bar.wait();
    t.join().unwrap();
    let st = acct.stats();
    assert_eq!(
        (st.bytes, st.reserved, st.peak),
        (16 * KIB, 0, 16 * KIB),
        "{st:?}"
    );
    assert_eq!((st.entered, st.left), (0, 0), "{st:?}");
    assert_eq!(acct.hooks().calls(), 0);
    drop(f);
}

/// A per-chunk pool of 4 KiB chunks, grown one at a time, whose `nth` map
/// fails; a queue has room again with one chunk back.
fn failing_nth_map(queues: usize, nth: u64) -> Pool<pfrag::dma::Faulty<SoftIommu>> {
    use pfrag::dma::{Faulty, FaultyConfig, Op};
    let faults = FaultyConfig {
        fail_nth: Some((Op::Map, nth)),
        ..FaultyConfig::default()
    };
    let m = Faulty::new(SoftIommu::new(SoftIommuConfig::default()).unwrap(), faults).unwrap();
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerChunk);
    cfg.reclaim = Reclaim::Hysteresis {
        threshold: 16 << 10,
        chunk: 4 << 10,
    };
    cfg.queues = queues;
    cfg.grow_batch = 1;
    Pool::new(Arc::new(Domain::new(m)), cfg).unwrap()
}

/// A take whose per-chunk map fails leaves the reserves as they were: the
/// chunk goes back to the reserve it came from, its queue's own or the
/// neighbour's it was being borrowed from, and no borrow is counted.
#[test]
fn a_take_whose_map_fails_puts_the_chunk_back_where_it_was() {
    for borrowed in [false, true] {
        let pool = failing_nth_map(2, 2);
        let mut owner = FragCache::for_queue(pool.clone(), 1).unwrap();
        drop(owner.refill(4096, true).unwrap());
        owner.release();
        let taker = usize::from(!borrowed);
        let before: Vec<_> = (0..2).map(|q| pool.queue_stats(q).unwrap()).collect();
        assert_eq!(before[1].held, 4096, "{before:?}");
        let mut c = FragCache::for_queue(pool.clone(), taker).unwrap();
        let e = c.refill(4096, true).unwrap_err();
        assert!(matches!(e, Error::Map { .. }), "{e:?}");
        for (q, was) in before.iter().enumerate() {
            let now = pool.queue_stats(q).unwrap();
            let was = QueueStatsNoFlags::from(*was);
            assert_eq!(
                QueueStatsNoFlags::from(now),
                was,
                "queue {q}, borrowed {borrowed}"
            );
        }
        assert_eq!((pool.free_chunks(), pool.reserved_chunks()), (0, 1));
        // The next take maps: the chunk is where it was.
        drop(c.refill(4096, true).unwrap());
    }
}

/// A queue's reserve counters, less its running-dry flag and count (a
/// take that finds the reserve empty has run dry, whether it then fails
/// or not).
#[derive(Debug, PartialEq)]
struct QueueStatsNoFlags(u64, u64, u64, u64, u64);

impl From<pool::QueueStats> for QueueStatsNoFlags {
    fn from(s: pool::QueueStats) -> Self {
        QueueStatsNoFlags(s.held, s.shared_ops, s.borrows, s.lent, s.reclaim_calls)
    }
}
