//! Regressions for the pool's soundness rules: memory is freed or reused
//! only after the unmap and the invalidation that cover it completed; a
//! mapping that could not be removed pins its memory for good.

mod common;

use std::sync::Arc;

use pfrag::dma::{
    DmaMapper, Domain, Faulty, FaultyConfig, Invalidation, Op, SoftIommu, SoftIommuConfig,
    Translate,
};
use pfrag::frag::{Frag, FragCache};
use pfrag::pool::{self, Policy, Pool};
use pfrag::{Iova, Order};

fn soft(inv: Invalidation) -> SoftIommu {
    SoftIommu::new(SoftIommuConfig {
        invalidation: inv,
        ..SoftIommuConfig::default()
    })
    .unwrap()
}

fn small_pool<M: DmaMapper>(d: &Arc<Domain<M>>, order: u32, policy: Policy) -> Pool<M> {
    let mut cfg = pool::Config::new(Order::new(order).unwrap(), policy);
    cfg.grow_batch = 4;
    cfg.high_watermark = 4;
    cfg.shrink_batch = 4;
    Pool::new(d.clone(), cfg).unwrap()
}

/// Reads a frag through the IOMMU, as the device would.
///
/// # Safety
/// As for [`Translate::read`]: nothing writes the bytes meanwhile.
unsafe fn device_sum<M: Translate>(m: &M, iova: Iova, len: usize) -> Option<u64> {
    let mut sum = 0u64;
    // SAFETY: the caller's promise.
    unsafe {
        m.read(iova, len, &mut |s| {
            sum += s.iter().map(|&b| u64::from(b)).sum::<u64>()
        })
    }
    .ok()?;
    Some(sum)
}

/// Defect 3: with lazy invalidation, dropping the pool once freed its
/// arenas while the IOTLB still translated into them.
#[test]
fn lazy_pool_drop_flushes_before_freeing() {
    let m = Arc::new(soft(Invalidation::Lazy));
    let d = Arc::new(Domain::new(m.clone()));
    let pool = small_pool(&d, 2, Policy::Persistent);
    let mut c = FragCache::new(pool);
    let mut iovas = Vec::new();
    for _ in 0..8 {
        let mut f = c.refill(16 << 10, true).unwrap();
        f.as_mut_slice().fill(1);
        // The device reads it: its translation is now in the IOTLB.
        // SAFETY: the frag's `&mut` is gone; nothing writes it meanwhile.
        let sum = unsafe { device_sum(&*m, f.iova(), f.len()) };
        assert_eq!(sum, Some(16 << 10));
        iovas.push(f.iova());
    }
    drop(c);
    for i in iovas {
        assert!(m.translate(i, pfrag::dma::Dir::TO_DEVICE).is_err(), "{i}");
        // SAFETY: the cache and its frags are gone: nothing writes there.
        assert_eq!(unsafe { device_sum(&*m, i, 64) }, None);
    }
    assert_eq!(m.mapped_pages(), 0);
    assert_eq!(d.iova_in_use(), 0);
}

/// The reuse rule under lazy invalidation: a chunk whose unmap waits for a
/// flush is parked, not handed out, until the flush completed.
#[test]
fn lazy_unmapped_chunk_waits_for_its_flush() {
    let m = Arc::new(soft(Invalidation::Lazy));
    let d = Arc::new(Domain::new(m.clone()));
    let pool = small_pool(&d, 0, Policy::PerChunk);
    let mut c = FragCache::new(pool.clone());
    let f = c.refill(4096, true).unwrap();
    let first = f.addr();
    drop(f);
    c.release();
    assert_eq!(pool.parked_chunks(), 1);
    // Its IOVA waits for the flush as well, and says so.
    assert_eq!((d.iova_awaiting_flush(), d.iova_in_use()), (4096, 0));
    // Taking again while the flush is pending never hands out that chunk.
    let mut held: Vec<Frag<_>> = Vec::new();
    for _ in 0..3 {
        let f = c.refill(4096, true).unwrap();
        assert_ne!(f.addr(), first);
        held.push(f);
    }
    m.flush().unwrap();
    assert_eq!(d.iova_awaiting_flush(), 0);
    drop(held);
    c.release();
    let again: Vec<_> = (0..8).map(|_| c.refill(4096, true).unwrap()).collect();
    assert!(
        again.iter().any(|f| f.addr() == first),
        "reused after the flush"
    );
}

/// Defect 6, at pool level: unmaps failing while the pool shrinks once left
/// chunks with a dead IOVA in the free list. Every frag handed out must
/// translate to its own memory.
#[test]
fn failed_shrink_unmaps_pin_chunks_and_hand_out_none() {
    let m = Arc::new(
        Faulty::new(
            soft(Invalidation::Strict),
            FaultyConfig {
                seed: 5,
                unmap_rate: 0.3,
                ..FaultyConfig::default()
            },
        )
        .unwrap(),
    );
    let d = Arc::new(Domain::new(m.clone()));
    let pool = small_pool(&d, 0, Policy::Persistent);
    let mut c = FragCache::new(pool.clone());
    for round in 0..if cfg!(miri) { 3 } else { 30 } {
        let frags: Vec<_> = (0..32).map(|_| c.refill(4096, true).unwrap()).collect();
        for f in &frags {
            let t = m.translate(f.iova(), pfrag::dma::Dir::TO_DEVICE);
            assert_eq!(t.map(|t| t.addr).ok(), Some(f.addr()), "round {round}");
        }
        drop(frags);
        c.release();
    }
    let st = pool.stats();
    assert!(st.pinned > 0 && st.unmap_errors > 0, "{st:?}");
    assert_eq!(d.pinned().iova_bytes, st.pinned * 4096);
    assert_eq!(m.inner().stats().faults, 0);
}

/// Defect 7: dropping a pool after a failed unmap once freed arenas that
/// still translated. The address range now stays mapped for good (pinned
/// and counted); its pages went back to the kernel, so a device reading
/// through the stale mapping reads zeroes: live memory, never another
/// allocation's data.
#[test]
fn pool_drop_after_failed_unmap_keeps_the_memory() {
    let m = Arc::new(
        Faulty::new(
            soft(Invalidation::Strict),
            FaultyConfig {
                fail_nth: Some((Op::Unmap, 1)),
                ..FaultyConfig::default()
            },
        )
        .unwrap(),
    );
    let d = Arc::new(Domain::new(m.clone()));
    let pool = small_pool(&d, 1, Policy::Persistent);
    let mut c = FragCache::new(pool.clone());
    let mut f = c.refill(100, true).unwrap();
    f.as_mut_slice().fill(3);
    let iova = f.iova();
    drop((f, c, pool));
    // The drop's one unmap (a whole contiguous arena) failed: still mapped.
    assert_eq!(m.stats_injected().unmaps, 1);
    // SAFETY: the frag is gone and its memory pinned: nothing writes it.
    assert_eq!(unsafe { device_sum(&*m, iova, 100) }, Some(0));
    let p = d.pinned();
    assert_eq!((p.iova_bytes, p.host_bytes), (4 * 8192, 4 * 8192));
}

/// Defect 1 is a Miri finding (a pool pointer without the Arc's
/// provenance, given back to `Arc::decrement_strong_count`): this is the
/// path, run under `cargo +nightly miri test`.
#[test]
fn last_chunk_back_after_every_handle_is_gone_frees_the_pool() {
    let m = Arc::new(soft(Invalidation::Strict));
    let d = Arc::new(Domain::new(m.clone()));
    let pool = small_pool(&d, 0, Policy::PerChunk);
    let mut c = FragCache::new(pool);
    let f = c.refill(10, true).unwrap();
    drop(c);
    std::thread::spawn(move || drop(f)).join().unwrap();
    assert_eq!(d.iova_in_use(), 0);
    assert_eq!(m.mapped_pages(), 0);
}

/// `Coherent` is `Sync` and its accessors take `&self`: two threads using
/// the same bytes at once must not race (a data race is UB; Miri reports
/// it). CPU accesses are atomic at 32-bit word granularity, so each word
/// read is one of the values written, whole.
#[test]
fn coherent_accesses_from_two_threads_do_not_race() {
    use pfrag::dma::{Coherent, Dir, Identity};
    let d = Arc::new(Domain::new(Identity::new()));
    let c = Coherent::new(d, 64, Dir::BIDIRECTIONAL).unwrap();
    let run = |b: u8| {
        // Unaligned on purpose: edge words are shared with other bytes.
        c.write(1, &[b; 13]).unwrap();
        c.write_u32(16, u32::from_ne_bytes([b; 4])).unwrap();
        c.write_u64(24, u64::from_ne_bytes([b; 8])).unwrap();
        let mut got = [0u8; 13];
        c.read(1, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0xaa || x == 0xbb), "{got:?}");
        let w = c.read_u32(16).unwrap().to_ne_bytes();
        assert!(w == [0xaa; 4] || w == [0xbb; 4], "{w:?}");
        let q = c.read_u64(24).unwrap().to_ne_bytes();
        assert!(q.iter().all(|&x| x == 0xaa || x == 0xbb), "{q:?}");
    };
    std::thread::scope(|s| {
        s.spawn(|| run(0xaa));
        s.spawn(|| run(0xbb));
    });
    // The bytes around the writes are untouched.
    let mut b = [0u8; 1];
    c.read(0, &mut b).unwrap();
    assert_eq!(b, [0]);
    c.read(14, &mut b).unwrap();
    assert_eq!(b, [0]);
}

/// `max_bytes` counts every byte the pool holds: chunks pinned after a
/// failed unmap stay held, so they count until the pool drops. With half
/// the unmaps failing, the pool once held 78 times its limit.
#[test]
fn pinned_chunks_count_toward_max_bytes() {
    let m = Arc::new(
        Faulty::new(
            soft(Invalidation::Strict),
            FaultyConfig {
                seed: 11,
                unmap_rate: 0.5,
                ..FaultyConfig::default()
            },
        )
        .unwrap(),
    );
    let d = Arc::new(Domain::new(m.clone()));
    let max = 8 * 4096;
    let mut cfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerChunk);
    cfg.grow_batch = 1;
    cfg.max_bytes = Some(max);
    let pool = Pool::new(d.clone(), cfg).unwrap();
    let mut c = FragCache::new(pool.clone());
    let mut refused = 0;
    for _ in 0..if cfg!(miri) { 24 } else { 200 } {
        match c.refill(4096, true) {
            Ok(f) => drop(f),
            Err(pfrag::Error::LimitReached { held, max: m, .. }) => {
                assert_eq!(m, max);
                assert!(held <= max, "{held}");
                refused += 1;
            }
            Err(e) => panic!("{e}"),
        }
        c.release();
        let st = pool.stats();
        assert!((st.chunks + st.pinned) * 4096 <= max, "{st:?}");
    }
    let st = pool.stats();
    assert!(st.pinned > 0 && refused > 0, "{st:?} {refused}");
}

/// A device (through `Translate`, as the software models reach memory)
/// and the CPU (through `Coherent`) touching the same coherent bytes at
/// once, as a status write-back and the driver polling it do: device
/// writes and the CPU's accesses are 32-bit atomics, so Miri's race
/// detector finds no data race, on unaligned edges too; a device read
/// beside the CPU's reads of the same bytes is none either (a CPU write
/// there would be, and `Translate::read`'s caller promises there is none).
/// Through `SoftIommu` as through `Identity`.
#[test]
fn device_and_cpu_on_the_same_coherent_bytes_do_not_race() {
    use pfrag::dma::{Coherent, Dir, Identity};
    fn race<M: DmaMapper + Translate + 'static>(m: M) {
        let d = Arc::new(Domain::new(m));
        let c = Coherent::new(d.clone(), 64, Dir::BIDIRECTIONAL).unwrap();
        let iova = c.iova();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut b = [0u8; 11];
                c.read(1, &mut b).unwrap();
                c.write(3, &[2u8; 9]).unwrap();
                c.read(33, &mut b).unwrap();
            });
            s.spawn(|| {
                // SAFETY: the bytes are `c`'s, coherent memory that the
                // CPU touches only through its atomic accessors, and it
                // only reads bytes 32.. (which the device reads).
                unsafe {
                    d.mapper().write(iova.offset(2), &[1u8; 10]).unwrap();
                    d.mapper().read(iova.offset(32), 13, &mut |_| {}).unwrap();
                }
            });
        });
        // Each byte holds what one side wrote, or the zero it started as.
        let mut b = [0u8; 16];
        c.read(0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x <= 2), "{b:?}");
        assert_eq!(b[12..], [0, 0, 0, 0]);
    }
    race(Identity::new());
    race(soft(Invalidation::Strict));
}

/// Two domains over one software IOMMU, lazy invalidation: the first
/// frees an IOVA whose translation the IOTLB still caches (the unmap waits
/// for its flush), the second hands the same IOVA out again at once. The
/// new mapping must be what the device sees, never the first domain's
/// memory, which a live frag now holds (found by review: the IOTLB entry
/// used to survive the new map).
#[test]
fn a_fresh_mapping_never_sees_a_stale_translation_of_its_iova() {
    use pfrag::dma::{Coherent, Dir};
    let iommu = Arc::new(
        SoftIommu::new(SoftIommuConfig {
            invalidation: Invalidation::Lazy,
            flush_queue: 1 << 20,
            ..SoftIommuConfig::default()
        })
        .unwrap(),
    );
    let d1 = Arc::new(Domain::new(iommu.clone()));
    let d2 = Arc::new(Domain::new(iommu.clone()));
    let mut cache = FragCache::new(small_pool(&d1, 0, Policy::PerFrag));
    let a = cache.refill(64, true).unwrap();
    let x = a.iova();
    iommu.translate(x, Dir::TO_DEVICE).unwrap(); // cached in the IOTLB
    cache.complete(a).unwrap(); // lazy: the entry stays until a flush
    let mut b = cache.refill(64, true).unwrap();
    b.as_mut_slice().fill(0xab);
    let ring = Coherent::new(d2, 4096, Dir::BIDIRECTIONAL).unwrap();
    assert_eq!(ring.iova(), x, "the second domain reuses the IOVA");
    let t = iommu.translate(ring.iova(), Dir::TO_DEVICE).unwrap();
    assert_ne!(
        t.addr.raw() & !0xfff,
        b.addr().raw() & !0xfff,
        "aliased a live frag"
    );
    b.as_mut_slice()[0] = 1;
}

/// Lazy invalidation: a batch whose second run is refused undoes the
/// first, and says nothing stayed mapped, so its caller frees the memory.
/// The undo was deferred, so the IOTLB still translated the first run
/// into that freed memory until some later flush (found by review: a
/// device read there was a use after free). If that flush fails, the
/// batch's error says a run may still be reached, and the domain keeps it.
#[test]
fn a_refused_batch_leaves_no_stale_translation_of_its_undone_runs() {
    use pfrag::dma::Dir;
    use pfrag::mem::Region;
    use pfrag::Error;
    for flush_fails in [false, true] {
        let iommu = Arc::new(soft(Invalidation::Lazy));
        let cfg = FaultyConfig {
            fail_nth: flush_fails.then_some((Op::Flush, 1)),
            ..FaultyConfig::default()
        };
        // A device that reads each mapping as soon as it is installed (a
        // device on a thread of its own may, at any time): the
        // translation is then in the IOTLB. The IOVAs it read.
        let read = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = read.clone();
        let eager = common::Hooked {
            after_map: Box::new(move |iommu, iova| {
                iommu.translate(iova, Dir::TO_DEVICE).unwrap();
                seen.lock().unwrap().push(iova);
            }),
            ..common::Hooked::new(iommu.clone())
        };
        let d = Domain::new(Faulty::new(eager, cfg).unwrap());
        let region = Region::new(3 * 4096, 4096, false).unwrap();
        // Two runs; the second is not page aligned, so the mapper refuses
        // it after the first one went in.
        let addrs = [region.addr(), region.addr().offset(4096 + 1)];
        // SAFETY: the region outlives every mapping of it: the batch
        // fails, and it is freed only if nothing of it can be reached.
        let err = unsafe { d.map_many(&addrs, 4096, 4096, Dir::TO_DEVICE, false) }.unwrap_err();
        let iova = read.lock().unwrap()[0];
        if flush_fails {
            assert!(matches!(err, Error::Unmap { .. }), "{err}");
            assert_eq!(err.errno(), Some(libc::EIO));
            assert_eq!(d.pinned().iova_bytes, 2 * 4096);
            assert!(iommu.translate(iova, Dir::TO_DEVICE).is_ok());
            std::mem::forget(region); // a device may still reach it
            continue;
        }
        assert!(!matches!(err, Error::Unmap { .. }), "{err}");
        assert_eq!(d.iova_in_use(), 0);
        drop(region); // nothing stayed mapped: the memory goes
        assert!(
            iommu.translate(iova, Dir::TO_DEVICE).is_err(),
            "a stale translation into freed memory"
        );
        // SAFETY: nothing writes the bytes (there are none: the read faults).
        assert_eq!(unsafe { device_sum(&*iommu, iova, 64) }, None);
    }
}

/// Lazy invalidation: a flush made the new generation visible before it
/// waited for the device accesses that translated through the old IOTLB
/// entries, so a caller that saw `flushed_seq` reach its unmap freed the
/// memory while a device model still held a translation into it (found by
/// review: a use after free, three threads, no `unsafe` promise broken).
#[test]
fn a_flush_is_seen_only_after_the_device_accesses_it_waits_for() {
    use pfrag::dma::{Dir, Mapping, Unmapped};
    use pfrag::mem::Region;
    use std::sync::mpsc::channel;
    let iommu = Arc::new(soft(Invalidation::Lazy));
    let mut region = Some(Region::new(4096, 4096, false).unwrap());
    let r = region.as_mut().unwrap();
    r.write(0, &[7]).unwrap();
    let iova = Iova(0x10_0000);
    let m = Mapping {
        iova,
        addr: r.addr(),
        len: 4096,
        dir: Dir::TO_DEVICE,
        huge: false,
    };
    // SAFETY: the region is freed only once the unmap's flush completed.
    unsafe { iommu.map(&m) }.unwrap();
    iommu.translate(iova, Dir::TO_DEVICE).unwrap(); // in the IOTLB now
    let Unmapped::Deferred { seq } = iommu.unmap(iova, 4096).unwrap() else {
        panic!("lazy unmaps are deferred");
    };
    let (held, holding) = channel();
    let (go, going) = channel::<()>();
    std::thread::scope(|s| {
        let device = iommu.clone();
        s.spawn(move || {
            // SAFETY: this thread neither unmaps, flushes nor accesses
            // through the mapper while it holds the fence.
            let hold = unsafe { device.hold() };
            let t = device.translate(iova, Dir::TO_DEVICE).unwrap(); // stale
            held.send(()).unwrap();
            going.recv().unwrap();
            // SAFETY: the translation names allocated memory while the
            // hold lives (the `Translate` contract); nothing writes it.
            let b = unsafe { std::ptr::read_volatile(t.addr.raw() as *const u8) };
            drop(hold);
            assert_eq!(b, 7);
        });
        holding.recv().unwrap();
        let flusher = iommu.clone();
        s.spawn(move || flusher.flush().unwrap());
        // Wait for the flush to complete, as a pool does, then free.
        for _ in 0..200 {
            if iommu.flushed_seq() >= seq {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let done = iommu.flushed_seq() >= seq;
        if done {
            region = None; // the unmap and its flush completed
        }
        go.send(()).unwrap();
        assert!(!done, "the flush was seen before the device let go");
    });
    drop(region); // the flush has returned
}

/// With the IOMMU off, a translation answers from a table of pages known to
/// be mapped, without the mapper's lock. A device access must still come
/// after the map that made its page visible (and so after the CPU's writes
/// before it), and no device access may reach the page once its unmap
/// returns. Here the CPU writes the page between an unmap and the next
/// map, while two device threads keep reading it, so that one can hit an
/// entry the other filled. Natively this checks that the reads see whole
/// pieces and lose no fault; under Miri, the race detector sees any read a
/// missing order or a stale answer let through.
#[test]
fn identity_device_reads_are_ordered_by_map_and_unmap() {
    use pfrag::dma::{Dir, Identity, Mapping};
    use pfrag::mem::Region;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    let id = Identity::new();
    let mut r = Region::new(4096, 4096, false).unwrap();
    let at = Iova(r.addr().raw() as u64);
    let m = Mapping {
        iova: at,
        addr: r.addr(),
        len: 4096,
        dir: Dir::TO_DEVICE,
        huge: false,
    };
    let (stop, faults) = (AtomicBool::new(false), AtomicU64::new(0));
    let rounds = if cfg!(miri) { 30 } else { 3000 };
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (device, stop, faults) = (&id, &stop, &faults);
            s.spawn(move || loop {
                // SAFETY: the CPU writes the bytes only while no
                // mapping covers them, so a read either faults or
                // ends before the unmap that precedes the write
                // returns.
                let r = unsafe {
                    device.read(at, 64, &mut |b| {
                        assert_eq!(b.len(), 64);
                        std::hint::black_box(b[0]);
                    })
                };
                faults.fetch_add(u64::from(r.is_err()), Relaxed);
                if stop.load(Relaxed) {
                    break;
                }
                std::thread::yield_now();
            });
        }
        for k in 0..rounds {
            // SAFETY: the region outlives every mapping (each is removed
            // in this round).
            unsafe { id.map(&m) }.unwrap();
            // Time for one reader to fill the entry and the other to hit it.
            std::thread::yield_now();
            std::thread::yield_now();
            id.unmap(at, 4096).unwrap();
            r.write(0, &[k as u8; 64]).unwrap();
        }
        stop.store(true, Relaxed);
    });
    // The readers' faults are the ones the mapper counted: none was lost.
    assert_eq!(faults.load(Relaxed), id.stats().faults);
}
