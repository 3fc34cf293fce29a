//! Regressions for the rule that safe public API answers bad input with a
//! typed error carrying the numbers (or a documented, saturated value),
//! never a panic or a wrapped count.

use std::sync::Arc;

use pfrag::bounce::{self, SlotSize};
use pfrag::dma::{Coherent, Dir, DmaMapper, Domain, Identity, MapStats};
use pfrag::frag::CacheStats;
use pfrag::iova::IovaAllocator;
use pfrag::mem::{self, Region, MAX_REGION_LEN};
use pfrag::pool::{self, Policy, Pool, QueueStats, Stats};
use pfrag::{Error, Iova, Order, VirtAddr};

const SPACE: std::ops::Range<u64> = 0x1000..0x10_0000;

fn identity() -> Arc<Domain<Identity>> {
    Arc::new(Domain::new(Identity::new()))
}

fn is_region_length(r: pfrag::Result<impl Sized>, len: usize) -> bool {
    matches!(
        r,
        Err(Error::OutOfRange { what: "region length", value, min: 1, max })
            if value == len as u64 && max == MAX_REGION_LEN as u64
    )
}

/// A region length whose rounding to 4 KiB (or 2 MiB) would overflow is
/// refused before anything is mapped.
#[test]
fn region_past_max_len_is_out_of_range() {
    for len in [usize::MAX, usize::MAX - 4094, MAX_REGION_LEN + 1] {
        for huge in [false, true] {
            assert!(is_region_length(Region::new(len, 4096, huge), len));
        }
    }
}

/// `Coherent::new` of a huge length: the region's typed error.
#[test]
fn coherent_past_max_len_is_out_of_range() {
    let len = usize::MAX - 10;
    assert!(is_region_length(
        Coherent::new(identity(), len, Dir::TO_DEVICE),
        len
    ));
}

/// A bounce ring whose bytes fit a `usize` but no region is refused too.
#[test]
fn bounce_ring_past_max_len_is_out_of_range() {
    let slots = usize::MAX / 128;
    assert!(is_region_length(
        bounce::Ring::new(identity(), slots, SlotSize::B128),
        slots * 128
    ));
}

/// An IOVA allocation whose size cannot be rounded is exhaustion.
#[test]
fn iova_alloc_of_u64_max_is_exhausted() {
    let mut a = IovaAllocator::new(&[SPACE]);
    assert!(matches!(
        a.alloc(u64::MAX, 4096),
        Err(Error::IovaExhausted { .. })
    ));
    assert_eq!(a.in_use(), 0);
}

/// Giving back an IOVA range never allocated is refused and changes
/// nothing (it used to underflow `in_use`).
#[test]
fn iova_free_of_a_range_never_allocated_is_refused() {
    let mut a = IovaAllocator::new(&[SPACE]);
    assert!(matches!(
        a.free(Iova(0x2000), 0x1000),
        Err(Error::IovaNotInUse {
            iova: Iova(0x2000),
            size: 0x1000,
            in_use: 0
        })
    ));
    assert!(matches!(
        a.free_deferred(Iova(0x2000), 0x1000, 1),
        Err(Error::IovaNotInUse { .. })
    ));
    assert_eq!((a.in_use(), a.deferred()), (0, 0));
    // The space is whole.
    assert_eq!(a.alloc(0xff000, 4096).unwrap(), Iova(0x1000));
}

/// A second free of an IOVA range still waiting for its flush is refused
/// and changes nothing, though other bytes are in use (it used to be
/// accepted, and the flush gave the range back twice).
#[test]
fn iova_second_free_of_a_deferred_range_is_refused() {
    let mut a = IovaAllocator::new(&[SPACE]);
    let x = a.alloc(0x1000, 4096).unwrap();
    let _y = a.alloc(0x3000, 4096).unwrap();
    a.free_deferred(x, 0x1000, 7).unwrap();
    for second in [a.free_deferred(x, 0x1000, 8), a.free(x, 0x1000)] {
        assert!(matches!(
            second,
            Err(Error::IovaNotInUse { iova, size: 0x1000, in_use: 0x3000 }) if iova == x
        ));
    }
    assert_eq!((a.in_use(), a.deferred()), (0x3000, 1));
    assert_eq!(a.reclaim(8), 1);
    assert_eq!((a.in_use(), a.deferred()), (0x3000, 0));
    // Back once: free again, and handed out once.
    assert_eq!(a.alloc(0x1000, 4096).unwrap(), x);
}

/// A range whose end does not fit a `usize` is not resident, and asking
/// does not panic.
#[test]
fn resident_of_a_wrapping_range_is_false() {
    assert!(!mem::resident(VirtAddr(usize::MAX - 10), 100));
    assert!(!mem::resident(VirtAddr(4096), usize::MAX));
}

/// A huge length is answered block by block, without a buffer as large as
/// the range: a live region followed by unmapped address space is not
/// resident.
#[test]
#[cfg_attr(miri, ignore = "mincore: Miri has no page tables to ask")]
fn resident_of_a_huge_range_is_false_without_a_huge_buffer() {
    let mut r = Region::new(8192, 4096, false).unwrap();
    r.write(0, &[1; 8192]).unwrap();
    assert!(mem::resident(r.addr(), 8192));
    assert!(!mem::resident(r.addr(), usize::MAX / 2));
}

/// A grow or shrink batch whose bytes would overflow (or exceed what one
/// region can hold) is refused with the largest batch accepted.
#[test]
fn pool_batch_past_max_region_len_is_out_of_range() {
    let order = Order::new(0).unwrap();
    let max = (MAX_REGION_LEN / order.size()) as u64;
    for (grow, shrink, what) in [
        (usize::MAX / 2, 0, "grow_batch"),
        (usize::MAX, 0, "grow_batch"),
        (max as usize + 1, 0, "grow_batch"),
        (1, usize::MAX, "shrink_batch"),
    ] {
        let mut cfg = pool::Config::new(order, Policy::Persistent);
        cfg.grow_batch = grow;
        cfg.shrink_batch = shrink;
        match Pool::new(identity(), cfg) {
            Err(Error::OutOfRange {
                what: w,
                value,
                max: m,
                ..
            }) => assert_eq!((w, m), (what, max), "value {value}"),
            other => panic!("grow {grow}, shrink {shrink}: {other:?}"),
        }
    }
    // The largest accepted batch resolves (its watermark saturates).
    let mut cfg = pool::Config::new(order, Policy::Persistent);
    cfg.grow_batch = max as usize;
    let p = Pool::new(identity(), cfg).unwrap();
    assert!(p.config().high_watermark >= max as usize);
}

/// `since` with its arguments swapped saturates at zero instead of
/// panicking on underflow.
#[test]
fn since_of_a_later_snapshot_saturates_at_zero() {
    // The snapshots are `#[non_exhaustive]`: built from their defaults.
    let mut later = CacheStats::default();
    (later.frags, later.bytes, later.chunks_taken) = (5, 5, 5);
    (later.reused_in_place, later.waste_bytes) = (5, 5);
    assert_eq!(CacheStats::default().since(&later), CacheStats::default());
    let mut later = Stats::default();
    (later.shared_ops, later.reclaim_calls) = (3, 3);
    (later.borrows, later.skipped_pressured) = (3, 3);
    assert_eq!(Stats::default().since(&later), Stats::default());
    let mut later = QueueStats::default();
    (later.reclaim_calls, later.reclaimed_bytes, later.shared_ops) = (2, 2, 2);
    (later.borrows, later.lent) = (2, 2);
    (later.skipped_pressured, later.pressure_flags) = (2, 2);
    assert_eq!(QueueStats::default().since(&later), QueueStats::default());
    let later = MapStats {
        map_calls: 1,
        unmap_calls: 1,
        ptes_written: 1,
        invalidations: 1,
        iotlb_hits: 1,
        iotlb_misses: 1,
        faults: 1,
        model_ns: 1.5,
    };
    assert_eq!(MapStats::default().since(&later), MapStats::default());
}

/// Ranges that touch but whose merged length would pass `u64::MAX` are
/// left as runs of their own: `coalesce_ranges`, `coalesce` and the
/// mappers' safe `unmap_batch` added the lengths unchecked (a panic in a
/// debug build, a wrapped run in a release one).
#[test]
fn touching_ranges_past_u64_max_stay_apart() {
    use pfrag::dma::{coalesce, coalesce_ranges, DmaMapper, Mapping, SoftIommu};
    let half = 1u64 << 63;
    let ranges = [(Iova(0), half), (Iova(half), half)];
    assert_eq!(coalesce_ranges(&ranges), ranges.to_vec());
    let m = |at: u64| Mapping {
        iova: Iova(at),
        addr: VirtAddr(at as usize),
        len: half,
        dir: Dir::TO_DEVICE,
        huge: false,
    };
    assert_eq!(coalesce(&[m(0), m(half)]), vec![m(0), m(half)]);
    let soft = SoftIommu::new(pfrag::dma::SoftIommuConfig::default()).unwrap();
    for out in [
        Identity::new().unmap_batch(&ranges),
        soft.unmap_batch(&ranges),
    ] {
        assert_eq!(out.failed, ranges.to_vec());
        assert!(
            matches!(out.error, Some(Error::Unmap { .. })),
            "{:?}",
            out.error
        );
    }
}

/// Configured ranges that overlap, in any order, are one space: every byte
/// is handed out once (an overlapping range used to become a second free
/// range over the same bytes, handed out twice, or a debug panic).
#[test]
fn iova_ranges_that_overlap_are_merged() {
    let orders: [&[std::ops::Range<u64>]; 3] = [
        &[0x2000..0x3000, 0x1000..0x5000],
        &[0x1000..0x5000, 0x2000..0x3000],
        &[0x3000..0x5000, 0x1000..0x4000, 0x4000..0x5000],
    ];
    for ranges in orders {
        let mut a = IovaAllocator::new(ranges);
        let mut got = Vec::new();
        while let Ok(i) = a.alloc(0x1000, 0x1000) {
            got.push(i.raw());
            assert!(got.len() <= 4, "{ranges:?}: more pages than the space");
        }
        got.sort_unstable();
        assert_eq!(got, [0x1000, 0x2000, 0x3000, 0x4000], "{ranges:?}");
        assert_eq!(a.in_use(), 0x4000);
        // The whole space in one piece leaves nothing behind.
        let mut b = IovaAllocator::new(ranges);
        assert_eq!(b.alloc(0x4000, 0x1000).unwrap(), Iova(0x1000), "{ranges:?}");
        assert!(
            b.alloc(0x1000, 0x1000).is_err(),
            "{ranges:?}: handed out twice"
        );
    }
}

/// An identity domain's `map_many` whose total length overflows is
/// refused with the numbers, as in a domain with an IOVA allocator, not
/// an overflow panic.
#[test]
fn identity_map_many_of_an_overflowing_total_is_an_error() {
    let d = identity();
    let each = (1u64 << 63) + 1;
    let addrs = [VirtAddr(0x10_0000), VirtAddr(0x20_0000)];
    // SAFETY: the total overflows, so the domain refuses before anything
    // is mapped.
    let e = unsafe { d.map_many(&addrs, each, 4096, Dir::TO_DEVICE, false) }.unwrap_err();
    assert!(
        matches!(e, Error::BadConfig { what: "mapping size", value } if value == each),
        "{e:?}"
    );
    assert_eq!(d.pinned(), Default::default());
    assert_eq!(d.mapper().stats().map_calls, 0);
}

/// A device's 32-bit store at an IOVA that is not 4-byte aligned is
/// refused, and counted as the refused access it is, once, with no
/// translation counted (it used to fault uncounted).
#[test]
fn an_unaligned_device_store_is_a_counted_fault() {
    use pfrag::dma::{FaultReason, Mapping, SoftIommu, SoftIommuConfig, Translate};
    let r = Region::new(4096, 4096, false).unwrap();
    let at = |iova: u64| Mapping {
        iova: Iova(iova),
        addr: r.addr(),
        len: 4096,
        dir: Dir::FROM_DEVICE,
        huge: false,
    };
    let soft = SoftIommu::new(SoftIommuConfig::default()).unwrap();
    let id = Identity::new();
    let own = r.addr().raw() as u64;
    // SAFETY: `r` outlives both mappings (unmapped below); no reference
    // to its bytes is alive while the device stores.
    unsafe {
        soft.map(&at(0x10_0000)).unwrap();
        id.map(&at(own)).unwrap();
        assert!(soft.write_u32(Iova(0x10_0002), 1).is_err());
        assert!(id.write_u32(Iova(own + 2), 1).is_err());
        soft.write_u32(Iova(0x10_0004), 1).unwrap();
        id.write_u32(Iova(own + 8), 1).unwrap();
    }
    let s = soft.stats();
    assert_eq!((s.faults, s.iotlb_misses, s.iotlb_hits), (1, 1, 0));
    let f = soft.faults();
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].reason, FaultReason::Unaligned);
    assert_eq!(f[0].fault.iova, Iova(0x10_0002));
    assert_eq!(id.stats().faults, 1);
    soft.unmap(Iova(0x10_0000), 4096).unwrap();
    id.unmap(Iova(own), 4096).unwrap();
}

/// A mapping whose direction allows no access (only bits `Dir` does not
/// define) is refused by every mapper with `EINVAL`, and maps nothing (the
/// identity mapper took it, and its page then allowed nothing: a debug
/// assertion in the first translation).
#[test]
fn a_mapping_that_allows_no_access_is_refused() {
    use pfrag::dma::{Mapping, SoftIommu, SoftIommuConfig, Translate};
    let r = Region::new(4096, 4096, false).unwrap();
    let own = Iova(r.addr().raw() as u64);
    let at = |iova| Mapping {
        iova,
        addr: r.addr(),
        len: 4096,
        dir: Dir::from_bits_retain(1 << 5),
        huge: false,
    };
    let id = Identity::new();
    let soft = SoftIommu::new(SoftIommuConfig::default()).unwrap();
    // SAFETY: refused, so nothing can reach `r`; were one taken, it is
    // unmapped below before `r` drops.
    let (a, b) = unsafe { (id.map(&at(own)), soft.map(&at(Iova(0x10_0000)))) };
    let refused = |r: pfrag::Result<()>| r.map_err(|e| e.errno());
    assert_eq!(refused(b), Err(Some(libc::EINVAL)));
    let taken = a.is_ok();
    assert!(id.translate(own, Dir::TO_DEVICE).is_err());
    if taken {
        id.unmap(own, 4096).unwrap();
    }
    assert!(!taken, "identity took a mapping that allows nothing");
    assert_eq!((id.mapped_pages(), id.stats().map_calls), (0, 0));
}

/// A zero-length range given to `Domain::unmap_many` names no bytes: it is
/// neither freed nor pinned (its free was refused, a debug assertion), and
/// alone it is a `ZeroLength` error.
#[test]
fn unmap_many_of_a_zero_length_range_frees_and_pins_nothing() {
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    let d = Domain::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let r = Region::new(4096, 4096, false).unwrap();
    // SAFETY: `r` outlives the mapping, removed below.
    let iova = unsafe { d.map(r.addr(), 4096, 4096, Dir::TO_DEVICE) }.unwrap();
    let after = Iova(iova.raw() + 4096);
    // SAFETY: the mapping is this test's own, and nothing names it after.
    unsafe { d.unmap_many(&[(iova, 4096), (after, 0)]) }.unwrap();
    assert_eq!((d.iova_in_use(), d.pinned().iova_bytes), (0, 0));
    // SAFETY: names nothing mapped.
    let e = unsafe { d.unmap_many(&[(iova, 0)]) }.unwrap_err();
    assert!(matches!(e.error, Error::ZeroLength), "{e:?}");
    assert_eq!((d.iova_in_use(), d.pinned().iova_bytes), (0, 0));
}

/// Buffers whose length is not a whole number of 4 KiB pages are refused
/// by `Domain::map_many` before anything is mapped, even where they would
/// coalesce into page-aligned runs: their IOVAs could not be given back one
/// by one (a free of an unaligned IOVA is refused), so the block leaked.
#[test]
fn map_many_of_buffers_that_are_not_whole_pages_is_refused() {
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    let d = Domain::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let r = Region::new(3 * 4096, 4096, false).unwrap();
    let each = 6 * 1024;
    let addrs = [r.addr(), r.addr().offset(each as usize)];
    // SAFETY: `r` outlives any mapping of it: all are removed below.
    let got = unsafe { d.map_many(&addrs, each, 4096, Dir::TO_DEVICE, false) };
    if let Ok(iovas) = &got {
        let ranges: Vec<_> = iovas.iter().map(|&i| (i, each)).collect();
        // SAFETY: the mapping is this test's own.
        let _ = unsafe { d.unmap_many(&ranges) };
    }
    assert!(
        matches!(got, Err(Error::BadConfig { value, .. }) if value == each),
        "{got:?}"
    );
    assert_eq!((d.iova_in_use(), d.mapper().mapped_pages()), (0, 0));
}

/// Ranges given to `Domain::unmap_many` that overlap each other are
/// refused before any unmap, naming the two that overlap, and nothing
/// changes: every page stays mapped, no IOVA is freed or pinned. They
/// used to be unmapped run by run: a failed run's bytes that another
/// range covered too were counted twice in `pinned` (and a page the other
/// range did unmap was counted as kept), and a duplicate range was
/// unmapped twice.
#[test]
fn unmap_many_of_overlapping_ranges_is_refused_and_changes_nothing() {
    use pfrag::dma::{Faulty, FaultyConfig, Op, SoftIommu, SoftIommuConfig, Translate};
    let cfg = FaultyConfig {
        fail_nth: Some((Op::Unmap, 1)),
        ..FaultyConfig::default()
    };
    let soft = SoftIommu::new(SoftIommuConfig::default()).unwrap();
    let d = Domain::new(Faulty::new(soft, cfg).unwrap());
    let r = Region::new(3 * 4096, 4096, false).unwrap();
    let addrs: Vec<_> = (0..3).map(|i| r.addr().offset(i * 4096)).collect();
    // SAFETY: `r` outlives the mapping: it is unmapped below, before `r`
    // drops.
    let iovas = unsafe { d.map_many(&addrs, 4096, 4096, Dir::TO_DEVICE, false) }.unwrap();
    let (x, y) = (iovas[0], iovas[1]);
    let cases = [
        [(x, 8192), (y, 8192)],
        [(y, 8192), (x, 8192)],
        [(x, 4096), (x, 4096)],
        [(x, 3 * 4096), (y, 4096)],
    ];
    for ranges in cases {
        // SAFETY: the mappings are this test's own; the call is refused.
        let e = unsafe { d.unmap_many(&ranges) }.unwrap_err();
        let [a, b] = if ranges[0].0 <= ranges[1].0 {
            ranges
        } else {
            [ranges[1], ranges[0]]
        };
        assert!(
            matches!(e.error, Error::OverlappingRanges { first, first_len, second, second_len }
                if (first, first_len, second, second_len) == (a.0, a.1, b.0, b.1)),
            "{ranges:x?}: {e:?}"
        );
        for (i, _) in ranges {
            assert!(e.still_mapped(i), "{ranges:x?}: {i} said gone");
        }
        for &i in &iovas {
            assert!(d.mapper().translate(i, Dir::TO_DEVICE).is_ok());
        }
        assert_eq!(d.pinned().iova_bytes, 0, "{ranges:x?}");
        assert_eq!(d.iova_in_use(), 3 * 4096, "{ranges:x?}");
        assert_eq!(d.mapper().stats_injected().unmap_calls, 0, "{ranges:x?}");
    }
    d.mapper().arm(false);
    let all: Vec<_> = iovas.iter().map(|&i| (i, 4096)).collect();
    // SAFETY: as above; nothing names the mappings after this.
    unsafe { d.unmap_many(&all) }.unwrap();
    assert_eq!((d.iova_in_use(), d.pinned().iova_bytes), (0, 0));
}

/// A zero-length range names no bytes wherever it lies among the others
/// of a `Domain::unmap_many`: the batch unmaps the rest and succeeds. It
/// used to reach the mapper as an unmap of its own (a `ZeroLength` error,
/// so the call failed after unmapping everything) unless it happened to
/// touch the end of another range, so `[(x, 4 KiB), (x, 0)]` failed and
/// `[(x, 0), (x, 4 KiB)]` succeeded.
#[test]
fn unmap_many_skips_zero_length_ranges_wherever_they_lie() {
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    let d = Domain::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let r = Region::new(2 * 4096, 4096, false).unwrap();
    let far = |x: Iova| Iova(x.raw() + 0x10_0000);
    for case in 0..3 {
        // SAFETY: `r` outlives the mapping, removed below.
        let x = unsafe { d.map(r.addr(), 4096, 4096, Dir::TO_DEVICE) }.unwrap();
        let ranges = match case {
            0 => [(x, 4096), (x, 0)],
            1 => [(x, 0), (x, 4096)],
            _ => [(far(x), 0), (x, 4096)],
        };
        // SAFETY: the mapping is this test's own; nothing names it after.
        let got = unsafe { d.unmap_many(&ranges) };
        assert!(got.is_ok(), "{ranges:x?}: {got:?}");
        assert_eq!(d.mapper().mapped_pages(), 0, "{ranges:x?}");
        assert_eq!((d.iova_in_use(), d.pinned().iova_bytes), (0, 0));
    }
}
