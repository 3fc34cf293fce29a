//! The same driver over iommufd instead of a type1 container: the 82576
//! opened through its VFIO cdev, bound to `/dev/iommu` and attached to an
//! IOAS, with `IommufdMapper` under the pools. These run only on a guest
//! kernel built with `CONFIG_IOMMUFD` and `CONFIG_VFIO_DEVICE_CDEV`
//! (`VM_KERNEL=iommufd vm/run.sh test`; the other kernels skip the
//! `iommufd_` tests by name).

use super::crash::kill_sender_mid_run;
use super::protect::{check_blocked, check_lands, device_writes_into_tx_payload_over};
use super::virtio::{expect_virtio, vbdf};
use super::*;
use pfrag::frag::FragCache;
use vfio_nic::hw::iommufd::{self, IommufdMapper};
use vfio_nic::hw::vfio::MapAccess;
use vfio_nic::hw::virtio::{VirtioConfig, VirtioNetPci};

type FdQueue = tx::Queue<IommufdMapper, Igb>;

fn open_iommufd(access: MapAccess) -> (VfioPci, IommufdMapper) {
    open_iommufd_at(&bdf(), access)
}

fn open_iommufd_at(bdf: &str, access: MapAccess) -> (VfioPci, IommufdMapper) {
    let pci = VfioPci::open_iommufd(bdf).expect("open the device through iommufd");
    assert_eq!(pci.backend_name(), "iommufd");
    let mapper = IommufdMapper::with_access(&pci, access).expect("read the IOAS's IOVA ranges");
    (pci, mapper)
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_ranges_are_the_ioas_s_and_a_type1_mapper_is_refused() {
    let (pci, mapper) = open_iommufd(MapAccess::Narrow);
    let ranges = mapper.ranges().to_vec();
    println!(
        "iommufd IOAS {}: usable IOVA ranges {ranges:x?}, alignment {:#x}",
        mapper.ioas_id(),
        mapper.alignment()
    );
    assert!(!ranges.is_empty(), "the IOAS reports usable ranges");
    assert!(
        mapper.alignment() <= 4096,
        "alignment {:#x}",
        mapper.alignment()
    );
    // The x86 MSI window is never usable for DMA.
    let msi = 0xfee0_0000u64..0xfef0_0000;
    assert!(
        ranges
            .iter()
            .all(|r| r.end <= msi.start || r.start >= msi.end),
        "{ranges:x?} overlaps the MSI window"
    );
    let e = VfioMapper::new(&pci).unwrap_err();
    assert!(
        matches!(
            e,
            Error::WrongBackend {
                want: "type1",
                have: "iommufd"
            }
        ),
        "{e:?}"
    );
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_tso_flows_make_no_map_calls_per_packet_and_return_every_mapping() {
    let (pci, mapper) = open_iommufd(MapAccess::Narrow);
    let domain = Arc::new(Domain::new(mapper));
    let nic = Igb::new(pci, IgbConfig::default()).expect("reset and link up");
    let cfg = pool::Config::new(Order::new(3).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let txc = txcfg(HeaderMode::Bounce(SlotSize::B128));
    // SAFETY: the NIC is the VFIO device attached to the IOAS `domain`
    // maps into.
    let mut q = unsafe { tx::Queue::new(domain.clone(), pool, nic, txc) }.unwrap();
    let mut g = traffic(8);
    let len = 30 * MSS;
    // Bursts of 16 between doorbells; the warm-up grows the pool to what
    // that keeps in flight.
    let mut burst = |q: &mut FdQueue, n: usize| {
        for i in 0..n {
            send(q, &mut g, i % 8, len).unwrap();
            if i % 16 == 15 {
                q.kick().unwrap();
            }
        }
        q.kick().unwrap();
        q.wait(WAIT).unwrap();
    };
    let (warmup, packets) = (64, 200);
    burst(&mut q, warmup);
    let maps = domain.mapper().stats().map_calls;
    burst(&mut q, packets);
    expect_on_wire((warmup + packets) as u64 * segments(len));
    let steady = domain.mapper().stats().map_calls - maps;
    println!(
        "iommufd: {} packets of {len} B, {steady} map ioctls after the warm-up of {warmup}, {} unmaps",
        warmup + packets,
        domain.mapper().stats().unmap_calls
    );
    assert_eq!(steady, 0, "map ioctls in steady state");
    assert_eq!(q.stats().device_errors, 0);
    let mapper_handle = domain.clone();
    drop(q);
    // The device closed with the queue: the IOAS's mappings outlive it,
    // and each unmap succeeded (none kept for good).
    assert_eq!(mapper_handle.pinned(), pfrag::dma::Pinned::default());
    // Everything the queue and its pools mapped is unmapped with them:
    // the IOAS is empty.
    // SAFETY: nothing else maps into this IOAS, and no pool is left.
    let left = unsafe { iommufd::unmap_all(mapper_handle.mapper()) }.unwrap();
    assert_eq!(left, 0, "{left} bytes still mapped after the queue is gone");
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_leftover_mappings_are_found() {
    // The check above can fail: a pool still alive leaves its chunk mapped.
    let (_pci, mapper) = open_iommufd(MapAccess::Narrow);
    let domain = Arc::new(Domain::new(mapper));
    let cfg = pool::Config::new(Order::new(2).unwrap(), Policy::Persistent);
    let mut cache = FragCache::new(Pool::new(domain.clone(), cfg).unwrap());
    let f = cache.refill(1000, true).unwrap();
    // SAFETY: nothing else maps into this IOAS; the pool whose chunk this
    // unmaps hands out nothing more before it is dropped.
    let left = unsafe { iommufd::unmap_all(domain.mapper()) }.unwrap();
    assert!(
        left >= 16 << 10,
        "only {left} bytes mapped under a live pool"
    );
    // Its owner's unmap now fails, and pfrag keeps that memory out of
    // circulation rather than reuse it.
    cache.complete(f).unwrap();
    drop(cache);
    println!("iommufd: a live pool's {left} mapped bytes were found");
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_device_write_into_read_only_tx_memory_is_blocked() {
    let (pci, mapper) = open_iommufd(MapAccess::Narrow);
    check_blocked(&device_writes_into_tx_payload_over(
        pci,
        mapper,
        MapAccess::Narrow,
    ));
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_device_write_into_read_write_tx_memory_lands() {
    let (pci, mapper) = open_iommufd(MapAccess::ReadWrite);
    check_lands(&device_writes_into_tx_payload_over(
        pci,
        mapper,
        MapAccess::ReadWrite,
    ));
}

/// Map+unmap cost through `mapper`: `ROUNDS` maps and unmaps of one
/// range of each size, timed; prints microseconds per call pair and per
/// 4 KiB. Asserts only that every call was made and succeeded.
pub(super) fn mapping_cost<M: DmaMapper>(mapper: &M, label: &str) {
    use pfrag::dma::Mapping;
    use pfrag::mem::Region;
    const ROUNDS: u32 = 200;
    let iova = {
        let r = match mapper.iova_space() {
            pfrag::dma::IovaSpace::Ranges(r) => r,
            other => panic!("{other:?}"),
        };
        // The first 2 MiB-aligned IOVA with 2 MiB of room.
        let r = r
            .iter()
            .find_map(|r| {
                let at = r.start.next_multiple_of(2 << 20);
                (at + (2 << 20) <= r.end).then_some(at)
            })
            .expect("2 MiB of usable IOVA space");
        pfrag::Iova(r)
    };
    let region = Region::new(2 << 20, 2 << 20, false).unwrap();
    let calls0 = mapper.stats();
    for len in [4096u64, 64 << 10, 2 << 20] {
        let m = Mapping {
            iova,
            addr: region.addr(),
            len,
            dir: Dir::TO_DEVICE,
            huge: false,
        };
        let t = Instant::now();
        for _ in 0..ROUNDS {
            // SAFETY: `region` outlives the mapping, which is undone right
            // after; no device is pointed at it, and nothing else touches
            // the region meanwhile.
            unsafe { mapper.map(&m) }.unwrap();
            mapper.unmap(iova, len).unwrap();
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / f64::from(ROUNDS);
        println!(
            "map+unmap {label}, {} KiB: {us:.1} µs per map and unmap, {:.2} µs per 4 KiB",
            len >> 10,
            us / (len / 4096) as f64
        );
    }
    let calls = mapper.stats().since(&calls0);
    assert_eq!(calls.map_calls, 3 * u64::from(ROUNDS));
    assert_eq!(calls.unmap_calls, 3 * u64::from(ROUNDS));
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_mapping_cost() {
    let (_pci, mapper) = open_iommufd(MapAccess::Narrow);
    mapping_cost(&mapper, "iommufd");
}

/// Sends `n` packets of the sizes a crash test's fresh start uses on flow
/// `flow` of queue `q`; returns the on-wire segments they make.
fn fresh_start<D: TxDevice>(q: &mut tx::Queue<IommufdMapper, D>, flow: usize, n: usize) -> u64 {
    let mut g = traffic(flow + 1);
    let sizes = [65_160usize, 300, 9_000, 60];
    for &len in sizes.iter().cycle().take(n) {
        g.send_waiting(q, flow, len, WAIT, &mut Vec::new()).unwrap();
    }
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    assert_eq!(q.stats().completed, n as u64);
    sizes.iter().cycle().take(n).map(|&l| segments(l)).sum()
}

/// A queue on `nic` over a persistent order-4 pool in `domain`.
fn fd_queue<D: TxDevice>(
    domain: &Arc<Domain<IommufdMapper>>,
    nic: D,
) -> tx::Queue<IommufdMapper, D> {
    let cfg = pool::Config::new(Order::new(4).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let txc = txcfg(HeaderMode::Bounce(SlotSize::B128));
    // SAFETY: the NIC is the VFIO device attached to the IOAS `domain`
    // maps into.
    unsafe { tx::Queue::new(domain.clone(), pool, nic, txc) }.unwrap()
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_driver_killed_mid_tx_then_a_fresh_start_sends_clean() {
    const KILLED_FLOW: usize = 76;
    const FRESH_FLOW: usize = 77;
    let args = ["--backend", "iommufd", "--device", &bdf()];
    let st = kill_sender_mid_run(&args, KILLED_FLOW);
    println!("iommufd crash: sender killed ({st})");
    println!("pcap-crash-flows: {KILLED_FLOW} {FRESH_FLOW}");
    // A fresh start through iommufd: a new IOAS, the NIC reset.
    let (pci, mapper) = open_iommufd(MapAccess::Narrow);
    let domain = Arc::new(Domain::new(mapper));
    let nic = Igb::new(pci, IgbConfig::default()).expect("reset and link up");
    let mut q = fd_queue(&domain, nic);
    let frames = fresh_start(&mut q, FRESH_FLOW, 16);
    println!("iommufd crash: the fresh start sent 16 packets ({frames} frames)");
    expect_on_wire(frames);
}

#[test]
#[ignore = "needs a virtio-net device bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_virtio_flows_at_every_order_and_memory_returned() {
    let (pci, mapper) = open_iommufd_at(&vbdf(), MapAccess::Narrow);
    let domain = Arc::new(Domain::new(mapper));
    let mut nic = VirtioNetPci::new(pci, VirtioConfig::default()).expect("virtio bring-up");
    let mut wire = 0;
    for order in 0..=4 {
        for policy in [Policy::Persistent, Policy::PerFrag] {
            let cfg = pool::Config::new(Order::new(order).unwrap(), policy);
            let pool = Pool::new(domain.clone(), cfg).unwrap();
            // SAFETY: the NIC is the VFIO device attached to the IOAS
            // `domain` maps into.
            let mut q =
                unsafe { tx::Queue::new(domain.clone(), pool, nic, txcfg(header_for(policy))) }
                    .unwrap();
            let mut g = traffic(13);
            for (i, &len) in [65_160usize, 200, 3_000, 64_000]
                .iter()
                .cycle()
                .take(16)
                .enumerate()
            {
                g.send_waiting(&mut q, 10 + i % 3, len, WAIT, &mut Vec::new())
                    .unwrap_or_else(|e| panic!("order {order} {policy:?}: {e}"));
                wire += segments(len);
            }
            q.kick().unwrap();
            q.wait(WAIT).unwrap();
            assert_eq!(q.stats().completed, 16, "order {order} {policy:?}");
            nic = q.into_device().unwrap();
        }
    }
    expect_virtio(wire);
    drop(nic);
    // SAFETY: nothing else maps into this IOAS, and every pool is gone.
    let left = unsafe { iommufd::unmap_all(domain.mapper()) }.unwrap();
    assert_eq!(left, 0, "{left} bytes still mapped");
    println!("iommufd virtio: 160 packets ({wire} segments) at orders 0..4, the IOAS empty after");
}

#[test]
#[ignore = "needs a virtio-net device bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_virtio_driver_killed_mid_tx_then_a_fresh_start_sends_clean() {
    const KILLED_FLOW: usize = 78;
    const FRESH_FLOW: usize = 79;
    let args = [
        "--nic",
        "virtio",
        "--backend",
        "iommufd",
        "--device",
        &vbdf(),
    ];
    let st = kill_sender_mid_run(&args, KILLED_FLOW);
    println!("iommufd virtio crash: sender killed ({st})");
    println!("pcap-virtio-crash-flows: {KILLED_FLOW} {FRESH_FLOW}");
    let (pci, mapper) = open_iommufd_at(&vbdf(), MapAccess::Narrow);
    let domain = Arc::new(Domain::new(mapper));
    let nic = VirtioNetPci::new(pci, VirtioConfig::default()).expect("virtio bring-up");
    let mut q = fd_queue(&domain, nic);
    let frames = fresh_start(&mut q, FRESH_FLOW, 16);
    println!("iommufd virtio crash: the fresh start sent 16 packets ({frames} segments)");
    expect_virtio(frames);
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci and a kernel with iommufd: VM_KERNEL=iommufd vm/run.sh test"]
fn iommufd_has_no_type1_mapping_budget() {
    // type1 refuses the 65th mapping of a container under this limit
    // (the `mapping_limit` tests); an IOAS does not count mappings.
    const LIMIT: u32 = 64;
    let _limit = super::transmit::Limit::set(LIMIT);
    let (_pci, mapper) = open_iommufd(MapAccess::Narrow);
    let domain = Arc::new(Domain::new(mapper));
    let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerFrag);
    let mut cache = FragCache::new(Pool::new(domain.clone(), cfg).unwrap());
    // One mapping per frag: 4 * LIMIT mappings held at once.
    let frags: Vec<_> = (0..4 * LIMIT)
        .map(|i| {
            cache
                .refill(1000, true)
                .unwrap_or_else(|e| panic!("mapping {i} through iommufd: {e}"))
        })
        .collect();
    let maps = domain.mapper().stats().map_calls;
    assert!(maps >= u64::from(4 * LIMIT), "{maps} map ioctls");
    println!(
        "iommufd: {} mappings held at once, {maps} map ioctls, with type1's dma_entry_limit at {LIMIT}",
        frags.len()
    );
    for f in frags {
        cache.complete(f).unwrap();
    }
}
