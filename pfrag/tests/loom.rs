//! loom models of the concurrent paths whose correctness rests on
//! atomics: a chunk's reference count deciding who recycles it, a queue
//! borrowing from a neighbour whose owner is freeing into (and flagging)
//! its reserve, and two takers meeting at a grow that hands one chunk of
//! its batch to its own taker. Under `--cfg loom` pfrag's `sync` module is loom's, so these
//! explore the interleavings of the real code:
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C overflow-checks=on" cargo test -p pfrag --test loom --release
//! ```
#![cfg(loom)]

use std::sync::Arc;

use pfrag::dma::{Domain, Identity};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool, Reclaim};
use pfrag::Order;

fn pool(queues: usize, reclaim: Reclaim) -> Pool<Identity> {
    pool_of(queues, reclaim, 1)
}

fn pool_of(queues: usize, reclaim: Reclaim, grow_batch: usize) -> Pool<Identity> {
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    cfg.grow_batch = grow_batch;
    cfg.queues = queues;
    cfg.reclaim = reclaim;
    Pool::new(Arc::new(Domain::new(Identity::new())), cfg).unwrap()
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// Every chunk is in exactly one place: a list or a cache/frag.
fn accounted(p: &Pool<Identity>, out: usize) {
    assert_eq!(
        p.stats().chunks as usize,
        p.free_chunks() + p.reserved_chunks() + out,
        "{:?}",
        p.stats()
    );
}

/// Two frags of one chunk completed on two threads after the cache let go:
/// exactly one completer recycles the chunk.
#[test]
fn last_completion_recycles_exactly_once() {
    model(|| {
        let p = pool(1, Reclaim::HYSTERESIS);
        let mut c = FragCache::new(p.clone());
        let a = c.refill(100, true).unwrap();
        let b = c.refill(100, true).unwrap();
        c.release();
        let t = loom::thread::spawn(move || a.complete().unwrap());
        b.complete().unwrap();
        t.join().unwrap();
        assert_eq!(p.stats().recycles, 1);
        accounted(&p, 0);
    });
}

/// A frag completing on another thread while the cache moves to its next
/// chunk: either the cache sees the chunk idle and reuses it in place, or
/// the completer recycles it. Never both, never neither.
#[test]
fn in_place_reuse_races_with_the_last_completion() {
    model(|| {
        let p = pool(1, Reclaim::Eager);
        let mut c = FragCache::new(p.clone());
        let a = c.refill(4000, true).unwrap();
        let t = loom::thread::spawn(move || a.complete().unwrap());
        // Needs a fresh chunk: the current one has 96 bytes left.
        let b = c.refill(4000, true).unwrap();
        t.join().unwrap();
        let reused = c.stats().reused_in_place;
        let recycled = p.stats().recycles;
        assert_eq!(reused + recycled, 1, "reused {reused}, recycled {recycled}");
        drop(b);
        drop(c);
        accounted(&p, 0);
    });
}

/// Owner-local completion beside the atomic path: the owning thread gives
/// one frag's reference back to its bias (no atomic) while another thread
/// completes a second frag of the same chunk atomically, and then the owner
/// moves on. The chunk's refcount, reconciled once when the cache moves on,
/// must end in exactly one reuse in place or one recycle.
#[test]
fn owner_local_completion_races_with_a_remote_completion() {
    model(|| {
        let p = pool(1, Reclaim::Eager);
        let mut c = FragCache::new(p.clone());
        let local = c.refill(2000, true).unwrap();
        let remote = c.refill(2000, true).unwrap();
        let t = loom::thread::spawn(move || remote.complete().unwrap());
        c.complete(local).unwrap();
        // Needs a fresh chunk: the current one has 96 bytes left.
        let next = c.refill(4000, true).unwrap();
        t.join().unwrap();
        let reused = c.stats().reused_in_place;
        let recycled = p.stats().recycles;
        assert_eq!(reused + recycled, 1, "reused {reused}, recycled {recycled}");
        c.complete(next).unwrap();
        drop(c);
        accounted(&p, 0);
    });
}

/// A burst completed on the owning thread whose frags span the current
/// chunk and an older one that another thread's completion also drops:
/// the older chunk is recycled exactly once, by whichever side is last.
#[test]
fn owner_burst_and_remote_completion_share_an_older_chunk() {
    model(|| {
        let p = pool(1, Reclaim::Eager);
        let mut c = FragCache::new(p.clone());
        let a = c.refill(2000, true).unwrap();
        let b = c.refill(2000, true).unwrap();
        // The cache moves to a second chunk; the first stays with a and b.
        let d = c.refill(4000, true).unwrap();
        let t = loom::thread::spawn(move || b.complete().unwrap());
        c.complete_burst([a, d]).unwrap();
        t.join().unwrap();
        assert_eq!(p.stats().recycles, 1);
        drop(c);
        accounted(&p, 0);
    });
}

/// Queue 1 owns a flagged reserve and frees into it (which clears the flag
/// once it has room) while queue 0, dry, borrows: queue 0 never waits, and
/// no chunk is lost or handed out twice.
#[test]
fn borrowing_races_with_the_owner_freeing_and_clearing_its_flag() {
    model(|| {
        // Room mark (a quarter of the threshold): two 4 KiB chunks.
        let reclaim = Reclaim::Hysteresis {
            threshold: 32 << 10,
            chunk: 8 << 10,
        };
        let p = pool(2, reclaim);
        let mut q1 = FragCache::for_queue(p.clone(), 1).unwrap();
        // Queue 1 runs dry (flagged), holds one chunk in reserve and one
        // frag in flight.
        let first = q1.refill(4096, true).unwrap();
        q1.release();
        drop(first);
        let held = q1.refill(4096, true).unwrap();
        let second = q1.refill(4096, true).unwrap();
        q1.release();
        drop(second);
        assert!(p.queue_stats(1).unwrap().pressured);
        let owner = loom::thread::spawn(move || {
            // The owner's completion: reserve back to two chunks.
            held.complete().unwrap();
            q1
        });
        let mut q0 = FragCache::for_queue(p.clone(), 0).unwrap();
        let got = q0.refill(4096, true).unwrap();
        let q1 = owner.join().unwrap();
        let s0 = p.queue_stats(0).unwrap();
        let s1 = p.queue_stats(1).unwrap();
        // Whatever queue 0 did (borrow, or skip and grow), the books close.
        assert_eq!(s0.borrows, s1.lent);
        assert!(s0.borrows + s0.skipped_pressured >= 1 || p.stats().grows > 0);
        drop(got);
        drop(q0);
        drop(q1);
        accounted(&p, 0);
    });
}

/// The owner frees a chunk into its empty, unflagged reserve while a dry
/// neighbour borrows: the borrower may pop the chunk the moment it is
/// pushed. The reserve's byte count must never go below zero (run with
/// overflow checks) and ends equal to what the reserve holds.
#[test]
fn borrowing_the_chunk_being_freed_keeps_the_byte_count_exact() {
    model(|| {
        // Room mark and threshold: one 4 KiB chunk.
        let reclaim = Reclaim::Hysteresis {
            threshold: 4 << 10,
            chunk: 4 << 10,
        };
        let p = pool(2, reclaim);
        let mut q1 = FragCache::for_queue(p.clone(), 1).unwrap();
        let a = q1.refill(4096, true).unwrap();
        let b = q1.refill(4096, true).unwrap();
        q1.release();
        drop(a); // reserve {A}: room again, flag cleared
        let again = q1.refill(4096, true).unwrap(); // takes A back
        assert!(!p.queue_stats(1).unwrap().pressured);
        assert_eq!(p.reserved_chunks(), 0);
        let owner = loom::thread::spawn(move || b.complete().unwrap());
        let mut q0 = FragCache::for_queue(p.clone(), 0).unwrap();
        let got = q0.refill(4096, true).unwrap();
        owner.join().unwrap();
        let held = p.queue_stats(1).unwrap().held;
        assert_eq!(held, p.reserved_chunks() as u64 * 4096);
        drop((got, again));
        drop((q0, q1));
        accounted(&p, 0);
    });
}

/// Two queues take from an empty pool at once. The grow keeps one chunk
/// of its batch for its own taker and lists the other; the second taker,
/// whether it raced to the free list or waited on the grow's lock, takes
/// that one. Every interleaving: one grow, two distinct chunks, each
/// counted as one shared-list operation.
#[test]
fn two_takers_meet_at_a_grow_that_keeps_one_chunk_for_its_taker() {
    model(|| {
        let p = pool_of(2, Reclaim::Eager, 2);
        let p1 = p.clone();
        let t = loom::thread::spawn(move || {
            let mut q1 = FragCache::for_queue(p1, 1).unwrap();
            let f = q1.refill(4096, true).unwrap();
            (q1, f)
        });
        let mut q0 = FragCache::for_queue(p.clone(), 0).unwrap();
        let f0 = q0.refill(4096, true).unwrap();
        let (q1, f1) = t.join().unwrap();
        assert_ne!(f0.addr(), f1.addr(), "one chunk handed out twice");
        let st = p.stats();
        assert_eq!((st.grows, st.chunks, st.shared_ops), (1, 2, 2), "{st:?}");
        accounted(&p, 2);
        drop((f0, f1));
        drop((q0, q1));
        accounted(&p, 0);
    });
}
