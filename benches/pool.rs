//! Criterion benches: the frag fast path per order and policy, completion
//! on the owning thread against the atomic drop, bulk hand-out, burst
//! completion, batched against single DMA maps on the software IOMMU, the
//! header bounce copy, and chunk turnover under each reclaim policy.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pfrag::bounce::{Ring, SlotSize};
use pfrag::dma::{Dir, Domain, SoftIommu, SoftIommuConfig};
use pfrag::frag::{complete_burst, FragCache};
use pfrag::mem::Region;
use pfrag::pool::{self, Policy, Pool, Reclaim};
use pfrag::Order;

fn domain() -> Arc<Domain<SoftIommu>> {
    Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig::default()).unwrap(),
    ))
}

fn cache(order: u32, policy: Policy) -> FragCache<SoftIommu> {
    let pool = Pool::new(
        domain(),
        pool::Config::new(Order::new(order).expect("order"), policy),
    )
    .expect("pool");
    FragCache::new(pool)
}

/// One 1448-byte frag handed out and completed.
fn fast_path(c: &mut Criterion) {
    let mut g = c.benchmark_group("frag_refill_complete_1448B");
    for order in [0, 3, 4] {
        for policy in Policy::ALL {
            let mut fc = cache(order, policy);
            g.bench_with_input(BenchmarkId::new(policy.name(), order), &order, |b, _| {
                b.iter(|| {
                    let f = fc.refill(black_box(1448), false).expect("refill");
                    black_box(f.iova());
                    drop(f);
                })
            });
        }
    }
    g.finish();
}

/// One 1448-byte frag handed out and completed by the owning thread
/// (`FragCache::complete`: no atomic for a frag of the current chunk),
/// beside the same frag dropped (one atomic decrement).
fn owner_completion(c: &mut Criterion) {
    let mut g = c.benchmark_group("frag_1448B_owner_vs_atomic_completion");
    let mut fc = cache(4, Policy::Persistent);
    g.bench_function("owner_complete", |b| {
        b.iter(|| {
            let f = fc.refill(black_box(1448), false).expect("refill");
            black_box(f.iova());
            fc.complete(f).expect("complete");
        })
    });
    let mut fc = cache(4, Policy::Persistent);
    g.bench_function("drop_atomic", |b| {
        b.iter(|| {
            let f = fc.refill(black_box(1448), false).expect("refill");
            black_box(f.iova());
            drop(f);
        })
    });
    g.finish();
}

/// 32 frags of 1024 bytes: one `refill_bulk` call, or 32 `refill` calls,
/// completed as one burst on the owning thread.
fn bulk(c: &mut Criterion) {
    let mut g = c.benchmark_group("frags_32x1024B");
    g.throughput(Throughput::Elements(32));
    let mut fc = cache(4, Policy::Persistent);
    let mut v = Vec::with_capacity(32);
    g.bench_function("refill_bulk", |b| {
        b.iter(|| {
            fc.refill_bulk(black_box(1024), 32, &mut v).expect("bulk");
            fc.complete_burst(v.drain(..)).expect("complete");
        })
    });
    g.bench_function("refill_x32", |b| {
        b.iter(|| {
            for _ in 0..32 {
                v.push(fc.refill(black_box(1024), false).expect("refill"));
            }
            fc.complete_burst(v.drain(..)).expect("complete");
        })
    });
    g.finish();
}

/// 32 frags of one chunk completed one by one, or as one burst.
fn burst(c: &mut Criterion) {
    let mut g = c.benchmark_group("complete_32_frags");
    g.throughput(Throughput::Elements(32));
    let mut fc = cache(4, Policy::Persistent);
    let mut v = Vec::with_capacity(32);
    g.bench_function("one_by_one", |b| {
        b.iter(|| {
            for _ in 0..32 {
                v.push(fc.refill(1024, false).expect("refill"));
            }
            for f in v.drain(..) {
                drop(f);
            }
        })
    });
    g.bench_function("burst", |b| {
        b.iter(|| {
            for _ in 0..32 {
                v.push(fc.refill(1024, false).expect("refill"));
            }
            complete_burst(v.drain(..)).expect("complete");
        })
    });
    g.finish();
}

/// K order-3 chunks mapped and unmapped with one batched call, or K calls.
fn map_batch(c: &mut Criterion) {
    let mut g = c.benchmark_group("map_unmap_order3_chunks");
    for k in [4usize, 16, 64] {
        let size = Order::new(3).expect("order").size();
        let region = Region::new(k * size, size, false).expect("region");
        let addrs: Vec<_> = (0..k).map(|i| region.addr().offset(i * size)).collect();
        let d = domain();
        g.throughput(Throughput::Elements(k as u64));
        g.bench_with_input(BenchmarkId::new("batch", k), &k, |b, _| {
            b.iter(|| {
                // SAFETY: `region` outlives every mapping (each is unmapped,
                // strictly, in this iteration).
                let iovas =
                    unsafe { d.map_many(&addrs, size as u64, size as u64, Dir::TO_DEVICE, false) }
                        .expect("map");
                let ranges: Vec<_> = iovas.iter().map(|&i| (i, size as u64)).collect();
                // SAFETY: the mappings were made just above, and nothing
                // else names their IOVAs.
                unsafe { d.unmap_many(&ranges) }.expect("unmap");
            })
        });
        g.bench_with_input(BenchmarkId::new("single", k), &k, |b, _| {
            b.iter(|| {
                for &a in &addrs {
                    // SAFETY: as above.
                    let i =
                        unsafe { d.map(a, size as u64, size as u64, Dir::TO_DEVICE) }.expect("map");
                    // SAFETY: the mapping was made just above, and nothing
                    // else names its IOVA.
                    unsafe { d.unmap(i, size as u64) }.expect("unmap");
                }
            })
        });
    }
    g.finish();
}

/// A 54-byte header copied into a bounce slot and released.
fn bounce(c: &mut Criterion) {
    let mut ring = Ring::new(domain(), 256, SlotSize::B128).expect("ring");
    let hdr = [0x5au8; 54];
    let mut i = 0;
    c.bench_function("bounce_fill_release_54B", |b| {
        b.iter(|| {
            black_box(ring.fill(i, black_box(&hdr)).expect("fill"));
            ring.release(i).expect("release");
            i = (i + 1) % 256;
        })
    });
}

/// Chunk turnover: 3000-byte frags on 4 KiB chunks, so every frag takes a
/// fresh chunk and every completion frees one, held in flight 64 at a time:
/// the take and recycle paths under each reclaim policy, one queue and two
/// queues sharing the pool from two threads.
fn reclaim(c: &mut Criterion) {
    let mut g = c.benchmark_group("chunk_turnover_64_frags");
    g.throughput(Throughput::Elements(64));
    for (name, policy) in [
        ("eager", Reclaim::Eager),
        ("hysteresis", Reclaim::HYSTERESIS),
    ] {
        for queues in [1usize, 2] {
            let mut cfg = pool::Config::new(Order::new(0).expect("order"), Policy::Persistent);
            cfg.reclaim = policy;
            cfg.queues = queues;
            let pool = Pool::new(domain(), cfg).expect("pool");
            let mut caches: Vec<FragCache<SoftIommu>> = (0..queues)
                .map(|q| FragCache::for_queue(pool.clone(), q).expect("queue"))
                .collect();
            let id = BenchmarkId::new(name, format!("{queues}q"));
            g.bench_function(id, |b| {
                // Threads started once per sample; each runs `iters` rounds.
                b.iter_custom(|iters| {
                    let t0 = std::time::Instant::now();
                    std::thread::scope(|s| {
                        for cache in caches.iter_mut() {
                            s.spawn(move || {
                                let mut v = Vec::with_capacity(64);
                                for _ in 0..iters {
                                    for _ in 0..64 {
                                        v.push(cache.refill(3000, true).expect("frag"));
                                    }
                                    complete_burst(v.drain(..)).expect("complete");
                                    black_box(&v);
                                }
                            });
                        }
                    });
                    t0.elapsed()
                });
            });
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    fast_path,
    owner_completion,
    bulk,
    burst,
    map_batch,
    bounce,
    reclaim
);
criterion_main!(benches);
