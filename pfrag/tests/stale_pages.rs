//! Under `PerFrag` and lazy invalidation, with injected map and unmap
//! failures, random refills (single, bulk, multi-chunk), completions (on
//! the cache's thread, in bursts, and on another thread) and releases
//! never hand out a frag in a page that a completed frag's translation,
//! stale (waiting for its flush) or stuck (its unmap failed), still
//! reaches; and the waste count never underflows.

use std::sync::Arc;

use pfrag::dma::{
    Dir, DmaMapper, Domain, Faulty, FaultyConfig, Invalidation, SoftIommu, SoftIommuConfig,
    Translate,
};
use pfrag::frag::{Frag, FragCache};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order, PAGE_SIZE};

/// Steps per run.
const STEPS: usize = 2000;

type M = Arc<Faulty<SoftIommu>>;
const P: u64 = PAGE_SIZE;

/// xorshift64: a seeded sequence, the same on every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn pages(f: &Frag<M>) -> (u64, u64) {
    let a = f.addr().raw() as u64;
    (a / P, (a + f.len() as u64 - 1) / P)
}

/// Translates every page of a frag, as a device would, filling the IOTLB.
fn touch(m: &M, f: &Frag<M>) {
    let lo = f.iova().raw() & !(P - 1);
    let hi = (f.iova().raw() + f.len() as u64).next_multiple_of(P);
    let mut i = lo;
    while i < hi {
        let t = m
            .translate(Iova(i.max(f.iova().raw())), Dir::TO_DEVICE)
            .unwrap();
        let _ = t;
        i += P;
    }
}

/// One random run of `STEPS` steps on a pool of order-`order` chunks.
fn one(seed: u64, order: u32, map_rate: f64, unmap_rate: f64) {
    let mut r = Rng(seed * 2 + 1);
    let m = mapper(seed, map_rate, unmap_rate);
    let d = Arc::new(Domain::new(m.clone()));
    let mut cfg = pool::Config::new(Order::new(order).unwrap(), Policy::PerFrag);
    cfg.grow_batch = 1;
    let pool = Pool::new(d, cfg).unwrap();
    let chunk = 4096usize << order;
    let mut c = FragCache::new(pool);
    let mut live: Vec<Frag<M>> = Vec::new();
    // The IOVA pages of completed frags that may still translate: until
    // the next flush (stale), or for good (stuck).
    let mut stale: Vec<(u64, u64)> = Vec::new();
    let mut stuck: Vec<(u64, u64)> = Vec::new();
    let mut seen_flush = m.flushed_seq();
    for step in 0..STEPS {
        if m.flushed_seq() != seen_flush {
            seen_flush = m.flushed_seq();
            stale.clear();
        }
        let mut new: Vec<Frag<M>> = Vec::new();
        match r.below(10) {
            k @ 0..=4 => carve(k, &mut r, &mut c, chunk, &mut new),
            _ => {
                if live.is_empty() {
                    continue;
                }
                let k = r.below(live.len() as u64) as usize;
                let f = live.swap_remove(k);
                let (iova, len) = (f.iova().raw(), f.len() as u64);
                let span = (iova / P, (iova + len - 1) / P);
                let res = match r.below(3) {
                    0 => c.complete(f),
                    1 => std::thread::spawn(move || f.complete()).join().unwrap(),
                    _ => c.complete_burst([f]),
                };
                if res.is_err() {
                    stuck.push(span);
                } else {
                    stale.push(span);
                }
                if r.below(50) == 0 {
                    c.release();
                }
                continue;
            }
        }
        // The waste count (carved minus handed out) must not underflow.
        let _ = c.stats();
        for f in &new {
            unreached(&m, f, stale.iter().chain(stuck.iter()), (seed, order, step));
            touch(&m, f);
        }
        live.extend(new);
    }
    let _ = c.stats();
    for f in live.drain(..) {
        let _ = c.complete(f);
    }
    let _ = c.stats();
}

#[test]
#[cfg_attr(miri, ignore = "thousands of steps with threads: hours under Miri")]
fn no_frag_is_handed_out_in_a_page_a_completed_frag_still_reaches() {
    for order in 0..=4 {
        one(1, order, 0.0, 0.0);
        one(2, order, 0.05, 0.0);
        one(3, order, 0.05, 0.05);
    }
}

/// The lazy software IOMMU of a run, with map and unmap failures injected
/// at the given rates.
fn mapper(seed: u64, map_rate: f64, unmap_rate: f64) -> M {
    Arc::new(
        Faulty::new(
            SoftIommu::new(SoftIommuConfig {
                invalidation: Invalidation::Lazy,
                flush_queue: 1 << 16,
                iotlb_entries: 1 << 16,
                ..SoftIommuConfig::default()
            })
            .unwrap(),
            FaultyConfig {
                seed,
                map_rate,
                unmap_rate,
                ..FaultyConfig::default()
            },
        )
        .unwrap(),
    )
}

/// Carves frags into `new` one of three ways (`k`: 0..=2 one refill, 3 a
/// bulk refill, 4 a payload over several chunks); a refused carve adds
/// none.
fn carve(k: u64, r: &mut Rng, c: &mut FragCache<M>, chunk: usize, new: &mut Vec<Frag<M>>) {
    match k {
        0..=2 => {
            let len = 1 + r.below(3 * P) as usize;
            let fw = r.below(2) == 0;
            if let Ok(f) = c.refill(len.min(chunk), fw) {
                new.push(f);
            }
        }
        3 => {
            let len = 1 + r.below(2 * P) as usize;
            let n = 1 + r.below(8) as usize;
            let _ = c.refill_bulk(len.min(chunk), n, new);
        }
        _ => {
            let len = 1 + r.below(3 * chunk as u64) as usize;
            let _ = c.frags(len, r.below(2) == 0, new);
        }
    }
}

/// Asserts that no IOVA page in `spans` (completed frags' pages that may
/// still translate) reaches the pages of the new frag `f`.
/// `(seed, order, step)` name the run in a failure.
fn unreached<'a>(
    m: &M,
    f: &Frag<M>,
    spans: impl Iterator<Item = &'a (u64, u64)>,
    (seed, order, step): (u64, u32, usize),
) {
    let (lo, hi) = pages(f);
    assert!(!f.is_empty());
    for &(a, b) in spans {
        for ip in a..=b {
            if let Ok(t) = m.translate(Iova(ip * P), Dir::TO_DEVICE) {
                let pp = t.addr.raw() as u64 / P;
                assert!(
                    pp < lo || pp > hi,
                    "seed {seed} order {order} step {step}: new frag {:?}+{} in page {pp:#x} still reached by a completed frag's iova page {ip:#x}",
                    f.addr(),
                    f.len()
                );
            }
        }
    }
}
