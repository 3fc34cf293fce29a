//! Pressure hooks that call back into the pool whose growth or shrink ran
//! them: a hook that trims the pool or drops frags it kept on entering
//! pressure, or that takes memory again (the natural answers to memory
//! pressure), must not wait for a lock the pool holds while it runs the
//! hook.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pfrag::account::{Limits, MemAccount, PressureHooks};
use pfrag::dma::{Domain, Identity};
use pfrag::frag::{Frag, FragCache};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;

/// On entering pressure: trims the pool and drops the frags it keeps. On
/// leaving it: refills from its cache, if it has one.
#[derive(Default)]
struct Shed {
    pool: Mutex<Option<Pool<Identity>>>,
    kept: Mutex<Vec<Frag<Identity>>>,
    cache: Mutex<Option<FragCache<Identity>>>,
    /// Taken from on entering pressure, as many frags as `grab` says.
    grab_from: Mutex<Option<FragCache<Identity>>>,
    grab: usize,
}

impl PressureHooks for Shed {
    fn enter(&self, _bytes: u64) {
        let pool = self.pool.lock().unwrap().clone();
        if let Some(p) = pool {
            p.trim().unwrap();
        }
        let kept = std::mem::take(&mut *self.kept.lock().unwrap());
        drop(kept);
        if let Some(c) = self.grab_from.lock().unwrap().as_mut() {
            let got: Vec<_> = (0..self.grab)
                .map(|_| c.refill(4096, true).unwrap())
                .collect();
            self.kept.lock().unwrap().extend(got);
        }
    }

    fn leave(&self, _bytes: u64) {
        if let Some(c) = self.cache.lock().unwrap().as_mut() {
            let f = c.refill(4096, true).unwrap();
            self.kept.lock().unwrap().push(f);
        }
    }
}

const KIB: u64 = 1 << 10;

/// A pool of 4 KiB chunks grown 4 at a time; pressure past 16 KiB, so the
/// second grow enters it.
fn setup() -> (Arc<MemAccount<Shed>>, Pool<Identity>) {
    setup_with(Shed::default())
}

/// [`setup`] with hooks of the caller's.
fn setup_with(hooks: Shed) -> (Arc<MemAccount<Shed>>, Pool<Identity>) {
    let limits = Limits {
        min: 8 * KIB,
        pressure: 16 * KIB,
        max: 1 << 30,
    };
    let acct = MemAccount::new(limits, hooks).unwrap();
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 4;
    let d = Arc::new(Domain::new(Identity::new()));
    let pool = Pool::with_account(d, cfg, acct.clone()).unwrap();
    (acct, pool)
}

/// Runs `f` on a thread of its own; fails if it has not returned within
/// ten seconds (a deadlock: the thread is left behind). Under Miri, `f`
/// runs here: Miri reports a thread that waits for a lock it holds.
fn within_ten_seconds(f: impl FnOnce() + Send + 'static) {
    if cfg!(miri) {
        return f();
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the test thread panicked"),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("deadlock: the test thread never returned"),
    }
}

#[test]
fn a_hook_that_trims_the_growing_pool_does_not_deadlock() {
    let (acct, pool) = setup();
    *acct.hooks().pool.lock().unwrap() = Some(pool.clone());
    let a = acct.clone();
    within_ten_seconds(move || {
        let mut cache = FragCache::new(pool);
        // The first grow stays below `pressure`; the fifth chunk grows
        // again and enters it, and the hook trims the pool.
        let held: Vec<_> = (0..5).map(|_| cache.refill(4096, true).unwrap()).collect();
        assert!(a.under_pressure());
        drop(held);
    });
    assert_eq!(acct.stats().entered, 1);
    // Break the account -> hooks -> pool -> account cycle.
    acct.hooks().pool.lock().unwrap().take();
}

#[test]
fn a_hook_that_drops_frags_of_the_growing_pool_does_not_deadlock() {
    let (acct, pool) = setup();
    let a = acct.clone();
    within_ten_seconds(move || {
        let mut cache = FragCache::new(pool);
        let first: Vec<_> = (0..4).map(|_| cache.refill(4096, true).unwrap()).collect();
        // The hook keeps the first chunks' frags; the cache lets go of
        // its chunk, so the hook's drop recycles the last of them.
        a.hooks().kept.lock().unwrap().extend(first);
        cache.release();
        // Grows again: pressure, and the hook drops what it kept.
        let f = cache.refill(4096, true).unwrap();
        assert!(a.hooks().kept.lock().unwrap().is_empty());
        drop(f);
    });
    assert_eq!(acct.stats().entered, 1);
}

#[test]
fn a_hook_that_refills_when_the_shrink_leaves_pressure_does_not_deadlock() {
    let (acct, pool) = setup();
    *acct.hooks().cache.lock().unwrap() = Some(FragCache::new(pool.clone()));
    let a = acct.clone();
    within_ten_seconds(move || {
        let mut cache = FragCache::new(pool.clone());
        // Two grows: 32 KiB, under pressure.
        let held: Vec<_> = (0..8).map(|_| cache.refill(4096, true).unwrap()).collect();
        assert!(a.under_pressure());
        cache.release();
        // Each arena goes back whole as its last chunk comes back; the
        // second shrink leaves pressure, and the hook grows the pool again.
        drop(held);
        assert!(!a.under_pressure());
        assert_eq!(a.hooks().kept.lock().unwrap().len(), 1);
        assert_eq!(pool.stats().grows, 3);
    });
    assert_eq!(acct.stats().left, 1);
    acct.hooks().kept.lock().unwrap().clear();
    acct.hooks().cache.lock().unwrap().take();
}

/// A hook that takes more frags from the growing pool than that grow
/// added, so that the pool grows again under the hook. The grow used to
/// run the hook with its growth lock held, which the second grow waited
/// for on the same thread.
#[test]
fn a_hook_that_takes_from_the_growing_pool_does_not_deadlock() {
    let (acct, pool) = setup_with(Shed {
        grab: 5,
        ..Shed::default()
    });
    *acct.hooks().grab_from.lock().unwrap() = Some(FragCache::new(pool.clone()));
    let a = acct.clone();
    within_ten_seconds(move || {
        let mut cache = FragCache::new(pool.clone());
        // The fifth chunk grows again and enters pressure; the hook takes
        // five chunks, more than the four that grow added: a third grow,
        // from the hook.
        let held: Vec<_> = (0..5).map(|_| cache.refill(4096, true).unwrap()).collect();
        assert!(a.under_pressure());
        assert_eq!(a.hooks().kept.lock().unwrap().len(), 5);
        assert_eq!(pool.stats().grows, 3);
        drop(held);
    });
    assert_eq!(acct.stats().entered, 1);
    acct.hooks().kept.lock().unwrap().clear();
    acct.hooks().grab_from.lock().unwrap().take();
}

/// The grow that enters pressure runs a hook that trims the pool. The
/// chunk that grow was made for is the caller's before the hook runs, so
/// the trim cannot give back the batch just grown (it used to: the caller
/// then grew again, one extra grow, unmap and map per pressure entry).
#[test]
fn a_trim_on_entering_pressure_keeps_the_batch_just_grown() {
    let (acct, pool) = setup();
    *acct.hooks().pool.lock().unwrap() = Some(pool.clone());
    let p = pool.clone();
    within_ten_seconds(move || {
        let mut cache = FragCache::new(p.clone());
        // Four chunks from the first grow, the fifth from the second,
        // which enters pressure.
        let held: Vec<_> = (0..5).map(|_| cache.refill(4096, true).unwrap()).collect();
        let st = p.stats();
        assert_eq!((st.grows, st.shrinks, st.released), (2, 0, 0));
        assert_eq!((st.chunks, p.free_chunks()), (8, 3));
        drop(held);
    });
    assert_eq!(acct.stats().entered, 1);
    acct.hooks().pool.lock().unwrap().take();
}

/// With `min` as high as `pressure`, giving back the batch just grown
/// leaves pressure again at once. A trim on entering pressure used to do
/// so, and the caller's next grow entered pressure again: the take never
/// returned.
#[test]
fn a_trim_on_entering_pressure_does_not_make_the_take_grow_forever() {
    let limits = Limits {
        min: 20 * KIB,
        pressure: 20 * KIB,
        max: 1 << 30,
    };
    let acct = MemAccount::new(limits, Shed::default()).unwrap();
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 4;
    let d = Arc::new(Domain::new(Identity::new()));
    let pool = Pool::with_account(d, cfg, acct.clone()).unwrap();
    *acct.hooks().pool.lock().unwrap() = Some(pool.clone());
    let p = pool.clone();
    within_ten_seconds(move || {
        let mut cache = FragCache::new(p.clone());
        let held: Vec<_> = (0..5).map(|_| cache.refill(4096, true).unwrap()).collect();
        assert_eq!(p.stats().grows, 2);
        drop(held);
    });
    assert_eq!(acct.stats().entered, 1);
    acct.hooks().pool.lock().unwrap().take();
}

/// A hook that panics on entering pressure.
struct PanicOnEnter;

impl PressureHooks for PanicOnEnter {
    fn enter(&self, _bytes: u64) {
        panic!("the hook panics on entering pressure");
    }
}

/// A hook that unwinds out of the grow that ran it loses no chunk: the
/// one the grow held for its taker goes back to the free list.
#[test]
fn a_hook_that_panics_in_a_grow_loses_no_chunk() {
    let limits = Limits {
        min: 8 * KIB,
        pressure: 16 * KIB,
        max: 1 << 30,
    };
    let acct = MemAccount::new(limits, PanicOnEnter).unwrap();
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = 4;
    let d = Arc::new(Domain::new(Identity::new()));
    let pool = Pool::with_account(d.clone(), cfg, acct.clone()).unwrap();
    let mut cache = FragCache::new(pool.clone());
    let held: Vec<_> = (0..4).map(|_| cache.refill(4096, true).unwrap()).collect();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cache.refill(4096, true)));
    assert!(r.is_err(), "the second grow entered pressure");
    assert_eq!((pool.stats().grows, pool.free_chunks()), (2, 4));
    drop((held, cache, pool));
    // A chunk in no list would keep its arena for good, counted here.
    assert_eq!(d.pinned().host_bytes, 0, "no chunk lost");
}
