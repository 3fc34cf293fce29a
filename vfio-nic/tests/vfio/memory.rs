//! Memory through real VFIO: IOVAs come from the ranges the kernel reports
//! (not from virtual addresses), the container's mapping count follows
//! arenas, and a pool under pressure gives its memory back, each range
//! unmapped (type1 unmaps strictly) while its memory is still resident.

use super::*;
use pfrag::account::{Limits, MemAccount, NoHooks};
use pfrag::dma::Watch;
use pfrag::frag::FragCache;

const MIB: u64 = 1 << 20;

fn status(key: &str) -> u64 {
    field(&std::fs::read_to_string("/proc/self/status").unwrap(), key)
}

fn meminfo(key: &str) -> u64 {
    field(&std::fs::read_to_string("/proc/meminfo").unwrap(), key)
}

fn field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{key} missing"))
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn iovas_come_from_the_reported_ranges_not_from_addresses() {
    let (domain, nic) = open();
    let ranges = domain.mapper().ranges().to_vec();
    let top = ranges.iter().map(|r| r.end).max().unwrap();
    println!("usable IOVA ranges: {ranges:x?}");
    // 64 MiB of 64 KiB chunks; each frag is checked, then sent.
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(4).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let mut cache = FragCache::new(pool.clone());
    let mut held = Vec::new();
    let (mut lowest_va, mut highest_iova) = (usize::MAX, 0);
    for _ in 0..(64 * MIB) >> 16 {
        let f = cache.refill(64 << 10, true).unwrap();
        let (iova, va) = (f.iova().raw(), f.addr().0);
        let end = iova + f.len() as u64;
        assert!(
            ranges.iter().any(|r| r.start <= iova && end <= r.end),
            "frag at IOVA {iova:#x}..{end:#x} outside {ranges:x?}"
        );
        lowest_va = lowest_va.min(va);
        highest_iova = highest_iova.max(end);
        held.push(f);
    }
    // The pool's addresses lie beyond 2^39: used as IOVAs (DPDK's
    // IOVA-as-VA) they would not fit a 39-bit IOMMU, and with that width
    // they lie outside every range the kernel reports.
    assert!(lowest_va as u64 >= 1 << 39, "pool at {lowest_va:#x}");
    if top <= 1 << 39 {
        assert!(ranges.iter().all(|r| lowest_va as u64 >= r.end));
        println!("39-bit IOVA space: the pool's addresses are outside it, its IOVAs inside");
    }
    println!(
        "pool: 64 MiB at virtual addresses from {lowest_va:#x}, IOVAs up to {highest_iova:#x} \
         (ranges end at {top:#x})"
    );
    drop(held);
    cache.release();
    // The same pool carries traffic the host checks.
    // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
    let mut q =
        unsafe { tx::Queue::new(domain, pool, nic, txcfg(HeaderMode::Bounce(SlotSize::B128))) }
            .unwrap();
    let mut g = traffic(2);
    for i in 0..8 {
        send(&mut q, &mut g, i % 2, 65_160).unwrap();
    }
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    expect_on_wire(8 * segments(65_160));
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn live_mappings_follow_arenas_not_chunks() {
    let (domain, _nic) = open();
    let avail0 = domain.mapper().dma_avail().unwrap();
    let Some(avail0) = avail0 else {
        println!("the kernel reports no DMA-avail count; skipped");
        return;
    };
    // 16 arenas of 16 MiB: 4,096 chunks of 64 KiB.
    let mut cfg = pool::Config::new(Order::new(4).unwrap(), Policy::Persistent);
    cfg.grow_batch = 256;
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let mut cache = FragCache::new(pool.clone());
    let mut held = Vec::new();
    for _ in 0..16 * 256 {
        held.push(cache.refill(64 << 10, true).unwrap());
    }
    let used = avail0 - domain.mapper().dma_avail().unwrap().unwrap();
    let st = pool.stats();
    println!(
        "mapping budget: {} chunks in {} MiB, {used} live type1 mappings ({avail0} were free)",
        st.chunks,
        st.mapped_bytes >> 20
    );
    assert_eq!(st.chunks, 4096);
    assert_eq!(used, 16, "one mapping per arena");
    drop(held);
    cache.release();
    drop(cache);
    drop(pool);
    assert_eq!(domain.mapper().dma_avail().unwrap(), Some(avail0));
}

/// What one load-and-drop phase measured.
#[derive(Debug)]
struct Phase {
    before: u64,
    peak: u64,
    after: u64,
    huge_arenas: u64,
}

/// Loads a persistent pool mapped through VFIO with `load` bytes of
/// whole-chunk frags, drops them under memory pressure, and measures with
/// `measure` before, at the peak and after.
fn load_and_drop(huge: bool, load: u64, measure: fn() -> u64) -> Phase {
    let pci = VfioPci::open(&bdf()).expect("open the VFIO device");
    let domain = Arc::new(Domain::new(Watch::new(VfioMapper::new(&pci).unwrap())));
    let order = Order::new(3).unwrap();
    let mut cfg = pool::Config::new(order, Policy::Persistent);
    cfg.grow_batch = 64; // 2 MiB arenas
    cfg.hugepages = huge;
    let limits = Limits {
        min: 1,
        pressure: load / 4,
        max: u64::MAX,
    };
    let account = MemAccount::new(limits, NoHooks).unwrap();
    let pool = Pool::with_account(domain.clone(), cfg, account.clone()).unwrap();
    let mut cache = FragCache::new(pool.clone());
    let avail0 = domain.mapper().inner().dma_avail().unwrap();
    let before = measure();
    let mut held = Vec::new();
    for i in 0..load / order.size() as u64 {
        let mut f = cache.refill(order.size(), false).unwrap();
        f.as_mut_slice().fill(i as u8 | 1);
        held.push(f);
    }
    let peak = measure();
    drop(held);
    cache.release();
    while pool.trim().unwrap() > 0 {}
    let after = measure();
    let st = pool.stats();
    assert_eq!((st.chunks, st.mapped_bytes), (0, 0), "{st:?}");
    assert_eq!(account.stats().bytes, 0, "every byte uncharged");
    assert_eq!(
        domain.mapper().inner().dma_avail().unwrap(),
        avail0,
        "no live mapping"
    );
    let w = domain.mapper().watch_stats();
    assert!(w.checked > 0, "the unmaps were watched");
    assert_eq!(w.early, 0, "memory released before its unmap completed");
    Phase {
        before,
        peak,
        after,
        huge_arenas: st.huge_arenas,
    }
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn pool_memory_goes_back_through_vfio() {
    // One grow batch: 64 chunks of 32 KiB.
    let (load, batch_kib) = (64 * MIB, 2048);
    let p = load_and_drop(false, load, || status("VmRSS"));
    println!(
        "guest VmRSS: {} KiB before, {} KiB at the peak, {} KiB after (one grow batch: {batch_kib} KiB)",
        p.before, p.peak, p.after
    );
    assert!(p.peak >= p.before + load / 1024 * 9 / 10, "{p:?}");
    assert!(
        p.after <= p.before + batch_kib,
        "resident memory did not go back: {p:?}"
    );

    // The guest reserves huge pages at boot.
    let h = load_and_drop(true, 32 * MIB, || meminfo("HugePages_Free"));
    println!(
        "guest HugePages_Free: {} before, {} at the peak, {} after ({} huge arenas)",
        h.before, h.peak, h.after, h.huge_arenas
    );
    assert!(h.huge_arenas > 0, "no huge arena: {h:?}");
    assert_eq!(h.before - h.peak, h.huge_arenas, "one huge page per arena");
    assert_eq!(h.after, h.before, "every huge page back: {h:?}");
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn type1_mapping_cost() {
    let pci = VfioPci::open(&bdf()).expect("open the VFIO device");
    let mapper = VfioMapper::new(&pci).unwrap();
    super::iommufd::mapping_cost(&mapper, "type1");
}

/// A queue dropped over VFIO unmaps everything it mapped: its ring, its
/// bounce slots and its pool's chunks go back, none kept for good, and
/// the container holds as many mappings as before the queue.
#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn a_dropped_queue_gives_back_every_mapping() {
    let (domain, nic) = open();
    let avail0 = domain.mapper().dma_avail().unwrap();
    let mut q = persistent_queue(&domain, nic, 2);
    let mut g = traffic(1);
    for len in [8_000usize, 300, 60] {
        send(&mut q, &mut g, 0, len).unwrap();
    }
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    expect_on_wire([8_000usize, 300, 60].iter().map(|&l| segments(l)).sum());
    assert!(domain.iova_in_use() > 0);
    drop(q);
    assert_eq!(
        domain.pinned(),
        pfrag::dma::Pinned::default(),
        "kept for good"
    );
    assert_eq!(domain.iova_in_use(), 0, "IOVA left in use");
    assert_eq!(
        domain.mapper().dma_avail().unwrap(),
        avail0,
        "mappings left"
    );
}
