//! Unit tests of the software IOMMU.

use super::*;
use crate::dma::{MAX_COST_NS, MAX_IOTLB_ENTRIES};

fn iommu(inv: Invalidation) -> SoftIommu {
    SoftIommu::new(SoftIommuConfig {
        invalidation: inv,
        flush_queue: 4,
        ..SoftIommuConfig::default()
    })
    .unwrap()
}

/// Maps a made-up host address. Sound only because these tests never let a
/// device read or write through the IOMMU (`translate` only looks).
fn map(m: &SoftIommu, iova: u64, addr: usize, len: u64, dir: Dir) -> Result<()> {
    // SAFETY: nothing reads or writes through these mappings (see above).
    unsafe {
        m.map(&Mapping {
            iova: Iova(iova),
            addr: VirtAddr(addr),
            len,
            dir,
            huge: false,
        })
    }
}

#[test]
fn translates_mapped_pages_and_counts_hits() {
    let m = iommu(Invalidation::Strict);
    map(&m, 0x10_0000, 0x7000_0000, 0x2000, Dir::TO_DEVICE).unwrap();
    let t = m.translate(Iova(0x10_1234), Dir::TO_DEVICE).unwrap();
    assert_eq!(t.addr, VirtAddr(0x7000_1234));
    assert_eq!(t.len, 0x1000 - 0x234);
    m.translate(Iova(0x10_1000), Dir::TO_DEVICE).unwrap();
    let s = m.stats();
    assert_eq!((s.map_calls, s.ptes_written), (1, 2));
    assert_eq!((s.iotlb_misses, s.iotlb_hits), (1, 1));
}

#[test]
fn strict_translate_after_unmap_faults() {
    let m = iommu(Invalidation::Strict);
    map(&m, 0x10_0000, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    m.translate(Iova(0x10_0000), Dir::TO_DEVICE).unwrap();
    assert_eq!(m.unmap(Iova(0x10_0000), 0x1000).unwrap(), Unmapped::Flushed);
    let err = m.translate(Iova(0x10_0000), Dir::TO_DEVICE).unwrap_err();
    assert_eq!(err.iova, Iova(0x10_0000));
    assert_eq!(m.stats().invalidations, 1);
    assert_eq!(m.faults()[0].reason, FaultReason::NotPresent);
}

#[test]
fn lazy_stale_entry_translates_until_the_flush() {
    let m = iommu(Invalidation::Lazy);
    map(&m, 0x10_0000, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    m.translate(Iova(0x10_0000), Dir::TO_DEVICE).unwrap(); // cached
    let r = m.unmap(Iova(0x10_0000), 0x1000).unwrap();
    assert_eq!(r, Unmapped::Deferred { seq: 1 });
    assert_eq!(m.flushed_seq(), 0);
    // Stale IOTLB entry: still translates, no invalidation yet.
    assert!(m.translate(Iova(0x10_0000), Dir::TO_DEVICE).is_ok());
    assert_eq!(m.stats().invalidations, 0);
    m.flush().unwrap();
    assert_eq!(m.flushed_seq(), 1);
    assert!(m.translate(Iova(0x10_0000), Dir::TO_DEVICE).is_err());
    assert_eq!(m.stats().invalidations, 1);
}

#[test]
fn lazy_full_flush_queue_drains_as_one_invalidation() {
    let m = iommu(Invalidation::Lazy);
    for i in 0..4u64 {
        map(
            &m,
            0x10_0000 + i * 0x1000,
            0x7000_0000,
            0x1000,
            Dir::TO_DEVICE,
        )
        .unwrap();
    }
    for i in 0..4u64 {
        m.unmap(Iova(0x10_0000 + i * 0x1000), 0x1000).unwrap();
    }
    assert_eq!(m.stats().invalidations, 1);
    assert_eq!(m.flushed_seq(), 1);
}

#[test]
fn wrong_direction_faults() {
    let m = iommu(Invalidation::Strict);
    map(&m, 0x10_0000, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    assert!(m.translate(Iova(0x10_0000), Dir::FROM_DEVICE).is_err());
    assert_eq!(m.faults()[0].reason, FaultReason::Permission);
    assert_eq!(m.stats().faults, 1);
}

#[test]
fn double_map_is_eexist_and_rolls_back() {
    let m = iommu(Invalidation::Strict);
    map(&m, 0x10_1000, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    let e = map(&m, 0x10_0000, 0x7100_0000, 0x3000, Dir::TO_DEVICE).unwrap_err();
    match e {
        Error::Map { source, .. } => assert_eq!(source.raw_os_error(), Some(libc::EEXIST)),
        other => panic!("{other:?}"),
    }
    // The first page of the failed request was rolled back.
    assert!(m.translate(Iova(0x10_0000), Dir::TO_DEVICE).is_err());
}

/// A refused map or unmap names the request (its IOVA and length, as the
/// error's fields say); the first page that conflicted or was missing used
/// to stand for the request's IOVA, which named a range never asked for.
#[test]
fn refusals_name_the_request() {
    let m = iommu(Invalidation::Strict);
    map(&m, 0x10_1000, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    let e = map(&m, 0x10_0000, 0x7100_0000, 0x3000, Dir::TO_DEVICE).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EEXIST));
    assert!(
        matches!(
            e,
            Error::Map {
                iova: Iova(0x10_0000),
                len: 0x3000,
                ..
            }
        ),
        "{e:?}"
    );
    // Mapped, then a hole: the unmap stops at the hole.
    let e = m.unmap(Iova(0x10_1000), 0x2000).unwrap_err();
    assert_eq!(e.errno(), Some(libc::ENOENT));
    assert!(
        matches!(
            e,
            Error::Unmap {
                iova: Iova(0x10_1000),
                len: 0x2000,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(m.mapped_pages(), 1);
}

#[test]
fn unmap_of_unmapped_range_is_enoent() {
    let m = iommu(Invalidation::Strict);
    match m.unmap(Iova(0x10_0000), 0x1000).unwrap_err() {
        Error::Unmap { source, .. } => assert_eq!(source.raw_os_error(), Some(libc::ENOENT)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn unaligned_map_is_rejected_with_numbers() {
    let m = iommu(Invalidation::Strict);
    match map(&m, 0x10_0800, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap_err() {
        Error::Unaligned { iova, page, .. } => {
            assert_eq!(iova, Iova(0x10_0800));
            assert_eq!(page, 4096);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn superpage_is_one_pte_and_one_iotlb_entry() {
    let m = SoftIommu::new(SoftIommuConfig {
        superpages: true,
        ..SoftIommuConfig::default()
    })
    .unwrap();
    // SAFETY: as in `map`: this test only translates.
    unsafe {
        m.map(&Mapping {
            iova: Iova(0x20_0000),
            addr: VirtAddr(0x4000_0000),
            len: HUGE_PAGE_SIZE,
            dir: Dir::TO_DEVICE,
            huge: true,
        })
    }
    .unwrap();
    for p in 0..512u64 {
        m.translate(Iova(0x20_0000 + p * 4096), Dir::TO_DEVICE)
            .unwrap();
    }
    let s = m.stats();
    assert_eq!((s.ptes_written, s.iotlb_misses, s.iotlb_hits), (1, 1, 511));
    // Partial unmap of a superpage is refused.
    assert!(m.unmap(Iova(0x20_0000), 0x1000).is_err());
    m.unmap(Iova(0x20_0000), HUGE_PAGE_SIZE).unwrap();
    assert!(m.translate(Iova(0x20_0000), Dir::TO_DEVICE).is_err());
}

/// An IOVA block once mapped with 4 KiB pages, now free, takes a
/// superpage mapping (the empty table the 4 KiB pages left used to make
/// it fail with `EEXIST`, though nothing was mapped there).
#[test]
fn a_free_block_once_mapped_in_4k_pages_takes_a_superpage() {
    let m = SoftIommu::new(SoftIommuConfig {
        superpages: true,
        ..SoftIommuConfig::default()
    })
    .unwrap();
    map(&m, 0x20_0000, 0x4000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    m.unmap(Iova(0x20_0000), 0x1000).unwrap();
    assert_eq!(m.mapped_pages(), 0);
    // SAFETY: as in `map`: this test only translates.
    unsafe {
        m.map(&Mapping {
            iova: Iova(0x20_0000),
            addr: VirtAddr(0x4000_0000),
            len: HUGE_PAGE_SIZE,
            dir: Dir::TO_DEVICE,
            huge: true,
        })
    }
    .unwrap();
    let t = m.translate(Iova(0x3f_f000), Dir::TO_DEVICE).unwrap();
    assert_eq!(t.addr, VirtAddr(0x401f_f000));
    m.unmap(Iova(0x20_0000), HUGE_PAGE_SIZE).unwrap();
    assert_eq!(m.mapped_pages(), 0);
}

#[test]
fn cost_model_is_kept_apart() {
    let m = SoftIommu::new(SoftIommuConfig {
        cost: Some(CostModel {
            call_ns: 100.0,
            pte_ns: 1.0,
            invalidation_ns: 1000.0,
            miss_ns: 10.0,
        }),
        ..SoftIommuConfig::default()
    })
    .unwrap();
    map(&m, 0x10_0000, 0x7000_0000, 0x2000, Dir::TO_DEVICE).unwrap();
    m.translate(Iova(0x10_0000), Dir::TO_DEVICE).unwrap();
    m.unmap(Iova(0x10_0000), 0x2000).unwrap();
    // map 100+2, miss 10, unmap 100+2+1000
    assert_eq!(m.stats().model_ns, 1214.0);
}

/// A cost figure past `MAX_COST_NS` is refused with its name and value.
/// Any finite figure used to pass: with `inject` the first map then spun
/// for `u64::MAX` ns, and a figure near `f64::MAX` made `model_ns`
/// infinite, so `MapStats::since` reported no modelled time at all.
#[test]
fn cost_figures_past_the_most_are_refused() {
    for v in [MAX_COST_NS * 2.0, 1e300, f64::MAX] {
        let cfg = SoftIommuConfig {
            cost: Some(CostModel {
                pte_ns: v,
                ..CostModel::default()
            }),
            inject: true,
            ..SoftIommuConfig::default()
        };
        match SoftIommu::new(cfg) {
            Err(Error::OutOfRange {
                what: "cost pte ns",
                max,
                ..
            }) => assert_eq!(max, MAX_COST_NS as u64),
            other => panic!("{v}: {other:?}"),
        }
    }
    let most = SoftIommuConfig {
        cost: Some(CostModel {
            call_ns: MAX_COST_NS,
            ..CostModel::default()
        }),
        ..SoftIommuConfig::default()
    };
    assert!(SoftIommu::new(most).is_ok());
}

/// With `inject`, each operation's modelled time is spun on the thread
/// that called it: the driver waits out map and unmap with its strict
/// invalidation, a translating device waits out the walk of a miss, and
/// nobody else does (another thread's debt is its own).
#[test]
#[cfg_attr(miri, ignore = "spins milliseconds of wall time")]
fn injected_latency_is_spun_by_the_thread_that_waits() {
    use std::time::{Duration, Instant};
    // The most a figure may be (`MAX_COST_NS`).
    let ms = 1_000_000.0;
    let m = SoftIommu::new(SoftIommuConfig {
        cost: Some(CostModel {
            call_ns: 0.0,
            pte_ns: 0.0,
            invalidation_ns: ms,
            miss_ns: 0.5 * ms,
        }),
        inject: true,
        ..SoftIommuConfig::default()
    })
    .unwrap();
    let t = Instant::now();
    map(&m, 0x10_0000, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    m.translate(Iova(0x10_0000), Dir::TO_DEVICE).unwrap(); // hit from now on
    let miss = t.elapsed();
    assert!(miss >= Duration::from_micros(500), "{miss:?}");
    let t = Instant::now();
    m.unmap(Iova(0x10_0000), 0x1000).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(1), "{:?}", t.elapsed());
    assert_eq!(m.stats().model_ns, 1.5 * ms);
}

#[test]
fn iova_outside_the_domain_faults_instead_of_aliasing() {
    let m = iommu(Invalidation::Strict);
    map(&m, 0x10_0000, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    // Bits above 47 were once ignored: this IOVA aliased the page at 0x100000.
    for iova in [0x1_0000_0010_0000u64, 1 << 48, !0xfffu64] {
        let f = m.translate(Iova(iova), Dir::TO_DEVICE).unwrap_err();
        assert_eq!(f.iova, Iova(iova));
        assert_eq!(m.faults().last().unwrap().reason, FaultReason::OutOfRange);
    }
    // SAFETY: the IOVA lies outside the domain: the read faults before
    // it touches any memory.
    assert!(unsafe { m.read(Iova(0x1_0000_0010_0000), 16, &mut |_| {}) }.is_err());
    assert!(m.translate(Iova(0x10_0000), Dir::TO_DEVICE).is_ok());
}

#[test]
fn settings_out_of_range_are_typed_errors() {
    let bad = |c: SoftIommuConfig| SoftIommu::new(c).unwrap_err();
    for n in [0, MAX_IOTLB_ENTRIES + 1, 100_000_000_000_000] {
        match bad(SoftIommuConfig {
            iotlb_entries: n,
            ..SoftIommuConfig::default()
        }) {
            Error::OutOfRange { value, min: 1, .. } => assert_eq!(value, n as u64),
            e => panic!("{e:?}"),
        }
    }
    assert!(matches!(
        bad(SoftIommuConfig {
            iova_range: (1 << 20)..(1 << 49),
            ..SoftIommuConfig::default()
        }),
        Error::OutOfRange { .. }
    ));
    assert!(matches!(
        bad(SoftIommuConfig {
            cost: Some(CostModel {
                miss_ns: f64::NAN,
                ..CostModel::default()
            }),
            ..SoftIommuConfig::default()
        }),
        Error::BadFloat {
            what: "cost miss ns",
            ..
        }
    ));
}

/// An IOVA range at the top of the 64-bit space, empty, reversed or
/// unaligned, is refused with the numbers; the bounds the error gives do
/// not overflow (`start + 4 KiB` used to, a panic in debug builds).
#[test]
fn iova_ranges_near_u64_max_are_typed_errors() {
    let top: u64 = !0xfff;
    let reversed = std::ops::Range {
        start: u64::MAX,
        end: 0,
    };
    for r in [top..u64::MAX, reversed, top..top, 0x1001..0x1_0000] {
        let cfg = SoftIommuConfig {
            iova_range: r.clone(),
            ..SoftIommuConfig::default()
        };
        match SoftIommu::new(cfg).unwrap_err() {
            Error::OutOfRange {
                value, min, max, ..
            } => {
                assert_eq!(value, r.end, "{r:?}");
                assert!(min <= max && max == 1 << 48, "{r:?}: {min:#x}..{max:#x}");
            }
            e => panic!("{r:?}: {e:?}"),
        }
    }
}

/// An IOMMU that lets any mapped pages be unmapped (not type1's rule).
fn loose() -> SoftIommu {
    SoftIommu::new(SoftIommuConfig {
        whole_unmaps: false,
        ..SoftIommuConfig::default()
    })
    .unwrap()
}

#[test]
fn partial_unmaps_cut_the_mapping_record() {
    let m = loose();
    let count = |m: &SoftIommu| (m.mappings(), m.mapped_pages());
    // Front, then back: the other half stays one mapping.
    map(&m, 0x10_0000, 0x7000_0000, 0x2000, Dir::TO_DEVICE).unwrap();
    m.unmap(Iova(0x10_0000), 0x1000).unwrap();
    assert_eq!(count(&m), (1, 1));
    m.unmap(Iova(0x10_1000), 0x1000).unwrap();
    assert_eq!(count(&m), (0, 0));
    map(&m, 0x10_0000, 0x7000_0000, 0x2000, Dir::TO_DEVICE).unwrap();
    m.unmap(Iova(0x10_1000), 0x1000).unwrap();
    assert_eq!(count(&m), (1, 1));
    m.unmap(Iova(0x10_0000), 0x1000).unwrap();
    assert_eq!(count(&m), (0, 0));
    // Middle: two mappings are left, each unmapped whole.
    map(&m, 0x10_0000, 0x7000_0000, 0x3000, Dir::TO_DEVICE).unwrap();
    m.unmap(Iova(0x10_1000), 0x1000).unwrap();
    assert_eq!(count(&m), (2, 2));
    m.unmap(Iova(0x10_0000), 0x1000).unwrap();
    m.unmap(Iova(0x10_2000), 0x1000).unwrap();
    assert_eq!(count(&m), (0, 0));
    // Whole.
    map(&m, 0x10_0000, 0x7000_0000, 0x3000, Dir::TO_DEVICE).unwrap();
    m.unmap(Iova(0x10_0000), 0x3000).unwrap();
    assert_eq!(count(&m), (0, 0));
}

#[test]
fn an_unmap_does_not_return_while_a_hold_is_alive() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let m = iommu(Invalidation::Strict);
    map(&m, 0x10_0000, 0x7000_0000, 0x1000, Dir::TO_DEVICE).unwrap();
    let unmapped = AtomicBool::new(false);
    // SAFETY: this thread neither unmaps nor accesses through `m` while
    // it holds; the unmap runs on another thread.
    let hold = unsafe { m.hold() };
    // What the holder translated stays valid: the unmap waits for it.
    assert!(m.translate(Iova(0x10_0000), Dir::TO_DEVICE).is_ok());
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            m.unmap(Iova(0x10_0000), 0x1000).unwrap();
            unmapped.store(true, Ordering::SeqCst);
        });
        // The unmapping thread has removed the translation (or is about
        // to) and waits in the fence; it cannot have returned.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            !unmapped.load(Ordering::SeqCst),
            "an unmap returned under a hold"
        );
        drop(hold);
        t.join().unwrap();
    });
    assert!(unmapped.load(Ordering::SeqCst));
    assert!(m.translate(Iova(0x10_0000), Dir::TO_DEVICE).is_err());
}
