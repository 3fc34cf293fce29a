//! The same TX engine on a virtio-net device (modern PCI, behind the
//! vIOMMU, `ACCESS_PLATFORM`), through VFIO: flows of TSO and
//! checksum-offloaded packets, memory returned, a device write into
//! read-only TX memory blocked (with a read-write control run), and the
//! type1 mapping budget.
//!
//! `PFRAG_VIRTIO_DEVICE` names the device (default `0000:00:03.0`). The
//! host checks every captured frame (`pcap-virtio-expect: N` segments):
//! the capture holds GSO super-frames as the driver posted them.

use super::transmit::Limit;
use super::*;
use pfrag::frag::FragCache;
use vfio_nic::format::virtio::{features, Layout, HDR_LEN as VNET_HDR};
use vfio_nic::hw::vfio::MapAccess;
use vfio_nic::hw::virtio::{VirtioConfig, VirtioNetPci};

pub(super) fn vbdf() -> String {
    std::env::var("PFRAG_VIRTIO_DEVICE").unwrap_or_else(|_| "0000:00:03.0".into())
}

type VQueue = tx::Queue<VfioMapper, VirtioNetPci>;

fn open_virtio(access: MapAccess) -> (Dom, VirtioNetPci) {
    let pci = VfioPci::open(&vbdf()).expect("open the virtio-net VFIO device");
    let mapper = VfioMapper::with_access(&pci, access).expect("read the container's IOMMU info");
    let nic = VirtioNetPci::new(pci, VirtioConfig::default()).expect("virtio bring-up");
    (Arc::new(Domain::new(mapper)), nic)
}

/// Tells the host how many on-wire segments this test's virtio packets
/// stand for.
pub(super) fn expect_virtio(segments: u64) {
    println!("pcap-virtio-expect: {segments}");
}

#[test]
#[ignore = "needs a virtio-net device bound to vfio-pci: vm/run.sh test"]
fn virtio_negotiates_checksum_tso_and_the_iommu() {
    let (_domain, nic) = open_virtio(MapAccess::Narrow);
    let f = nic.format().features();
    println!("virtio: offered {:#x}, in use {f:#x}", nic.offered());
    for (bit, name) in [
        (features::VERSION_1, "VERSION_1"),
        (features::ACCESS_PLATFORM, "ACCESS_PLATFORM"),
        (features::CSUM, "CSUM"),
        (features::HOST_TSO4, "HOST_TSO4"),
        (features::HOST_TSO6, "HOST_TSO6"),
    ] {
        assert_ne!(f & bit, 0, "{name} not in use (tap backend with vnet_hdr?)");
    }
}

#[test]
#[ignore = "needs a virtio-net device bound to vfio-pci: vm/run.sh test"]
fn virtio_tso_and_checksum_flows_at_every_order_and_policy() {
    let (domain, mut nic) = open_virtio(MapAccess::Narrow);
    let avail0 = domain.mapper().dma_avail().unwrap();
    let mut wire = 0;
    for order in 0..=4 {
        for policy in Policy::ALL {
            let cfg = pool::Config::new(Order::new(order).unwrap(), policy);
            let pool = Pool::new(domain.clone(), cfg).unwrap();
            let txc = txcfg(header_for(policy));
            // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
            let mut q: VQueue =
                unsafe { tx::Queue::new(domain.clone(), pool.clone(), nic, txc) }.unwrap();
            let mut g = traffic(13);
            let sizes = [65_160usize, 200, 3_000, 1_448, 64_000, 60];
            for (i, &len) in sizes.iter().cycle().take(24).enumerate() {
                if let Err(e) = g.send_waiting(&mut q, 10 + i % 3, len, WAIT, &mut Vec::new()) {
                    panic!("order {order} {policy:?}: {e}");
                }
                wire += segments(len);
            }
            q.kick().unwrap();
            q.wait(WAIT).unwrap();
            assert_eq!(q.stats().completed, 24, "order {order} {policy:?}");
            nic = q.into_device().unwrap();
            drop(pool);
        }
    }
    expect_virtio(wire);
    assert_eq!(
        domain.mapper().dma_avail().unwrap(),
        avail0,
        "every mapping was undone"
    );
}

/// What a device write into TX memory did.
struct Attempt {
    /// The payload's bytes afterwards.
    after: Vec<u8>,
    /// The ISR status once the device took the chain.
    isr: Option<u8>,
    /// DMAR write faults the kernel logged inside the payload's page.
    faults: Vec<String>,
}

/// What the TX payload held before the device was pointed at it.
const FILL: u8 = 0xA5;

/// Sets up the TX queue with its used ring (which the device writes) at a
/// TX pool payload's IOVA, mapped with `access`, posts one frame, and
/// reports what happened to the payload.
fn device_writes_into_tx_payload(access: MapAccess) -> Attempt {
    const LEN: u16 = 8;
    let (domain, nic) = open_virtio(access);
    let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    let mut cache = FragCache::new(Pool::new(domain.clone(), cfg).unwrap());
    let mut payload = cache.refill(4096, true).unwrap();
    payload.as_mut_slice().fill(FILL);
    let page = payload.iova().raw() & !0xfff;

    // Descriptors and the available ring in a ring of their own; one
    // buffer: a zero virtio_net_hdr (no offload) and a 60-byte frame that
    // is no flow of ours.
    let l = Layout::new(LEN);
    let ring = Coherent::new(domain.clone(), l.used, Dir::BIDIRECTIONAL).unwrap();
    let buf = Coherent::new(domain.clone(), 4096, Dir::TO_DEVICE).unwrap();
    // Bound again after the memory it will use, so that it is dropped (and
    // the device reset) before that memory, also when a step below panics.
    let mut nic = nic;
    let mut frame = [0u8; VNET_HDR + 60];
    frame[VNET_HDR..VNET_HDR + 12]
        .copy_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 2, 0, 0, 0, 0, 0x99]);
    frame[VNET_HDR + 12..VNET_HDR + 14].copy_from_slice(&[0x88, 0xb5]);
    buf.write(0, &frame).unwrap();
    ring.write_u64(0, buf.iova().raw()).unwrap();
    ring.write_u64(8, frame.len() as u64).unwrap();
    ring.write_u32(l.avail + 4, 0).unwrap(); // entry 0: descriptor 0
    ring.write_u32(l.avail, 1 << 16).unwrap(); // flags 0, idx 1
    let log_end = kmsg_end();
    // SAFETY: on purpose, the used ring is the TX payload's page, so that
    // the IOMMU's answer to the device's write shows: blocked under the
    // narrow (read-only) mapping; in the read-write control run the device
    // writes into `payload`, a frag no reference touches from here until
    // it is read after the reset below. The descriptor ring and buffer
    // live past that reset too.
    unsafe {
        nic.attach_parts(
            LEN,
            ring.iova(),
            ring.iova().offset(l.avail as u64),
            payload.iova(),
        )
    }
    .unwrap();
    // SAFETY: as above: the chain and its buffer are the device's.
    unsafe { nic.kick(0) }.unwrap();
    // The device interrupts (ISR bit 0) once it used the chain; a blocked
    // used-ring write may leave it unset.
    let (isr_wait, log_wait) = match access {
        MapAccess::Narrow => (Duration::from_secs(3), WAIT),
        MapAccess::ReadWrite => (WAIT, Duration::from_millis(500)),
    };
    let t0 = Instant::now();
    let mut isr = None;
    while isr.is_none() && t0.elapsed() < isr_wait {
        isr = nic.isr().unwrap().filter(|s| s & 1 != 0);
        std::thread::sleep(Duration::from_millis(5));
    }
    let faults = kmsg_records(log_end, log_wait, |r| {
        r.contains("DMA Write") && dmar_fault_addr(r) == Some(page)
    });
    nic.detach().unwrap(); // reset: the device is done with every ring
    let after = payload.as_slice().to_vec();
    cache.complete(payload).unwrap();
    Attempt { after, isr, faults }
}

#[test]
#[ignore = "needs a virtio-net device bound to vfio-pci: vm/run.sh test"]
fn virtio_device_write_into_read_only_tx_memory_is_blocked() {
    let a = device_writes_into_tx_payload(MapAccess::Narrow);
    for f in &a.faults {
        println!("kernel: {f}");
    }
    assert!(
        !a.faults.is_empty(),
        "the IOMMU logged no DMAR write fault in the TX payload's page"
    );
    let changed = a.after.iter().filter(|&&b| b != FILL).count();
    assert_eq!(changed, 0, "{changed} payload bytes changed");
    println!(
        "virtio, read-only TX payload: used-ring write blocked, {} bytes unchanged (ISR {:?})",
        a.after.len(),
        a.isr
    );
}

#[test]
#[ignore = "needs a virtio-net device bound to vfio-pci: vm/run.sh test"]
fn virtio_device_write_into_read_write_tx_memory_lands() {
    let a = device_writes_into_tx_payload(MapAccess::ReadWrite);
    assert!(a.faults.is_empty(), "unexpected faults: {:?}", a.faults);
    assert!(a.isr.is_some(), "the device never used the chain");
    // The used ring: flags, idx 1, then entry 0 = (id 0, len).
    let idx = u16::from_le_bytes([a.after[2], a.after[3]]);
    let id = u32::from_le_bytes(a.after[4..8].try_into().unwrap());
    assert_eq!((idx, id), (1, 0), "used ring in the payload");
    let changed = a.after.iter().filter(|&&b| b != FILL).count();
    println!(
        "virtio, read-write control: the device wrote its used ring over {changed} payload bytes"
    );
}

#[test]
#[ignore = "needs a virtio-net device bound to vfio-pci: vm/run.sh test"]
fn virtio_mapping_limit_fails_per_frag_with_enospc() {
    const LIMIT: u32 = 64;
    let _limit = Limit::set(LIMIT);
    let (domain, nic) = open_virtio(MapAccess::Narrow);
    let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::PerFrag);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
    let mut q: VQueue =
        unsafe { tx::Queue::new(domain.clone(), pool, nic, txcfg(HeaderMode::Mapped)) }.unwrap();
    let mut g = traffic(1);
    let (mut sent, mut wire) = (0u64, 0u64);
    let err = loop {
        match g.send(&mut q, 0, 9_000) {
            Ok(_) => {
                sent += 1;
                wire += segments(9_000);
            }
            Err(e) => break e,
        }
        assert!(sent < 1000, "the mapping budget never ran out");
    };
    println!("virtio per-frag: {sent} packets in flight, then: {err}");
    assert_eq!(err.errno(), Some(libc::ENOSPC), "{err}");
    // Nothing half-posted: what was posted completes, and the queue goes on
    // once it has.
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    assert_eq!(q.stats().completed, sent);
    g.send(&mut q, 0, 9_000).unwrap();
    wire += segments(9_000);
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    expect_virtio(wire);
}

#[test]
#[ignore = "needs a virtio-net device bound to vfio-pci: vm/run.sh test"]
fn virtio_driver_killed_mid_tx_then_a_fresh_start_sends_clean() {
    const KILLED_FLOW: usize = 74;
    const FRESH_FLOW: usize = 75;
    let args = ["--nic", "virtio", "--device", &vbdf()];
    let st = super::crash::kill_sender_mid_run(&args, KILLED_FLOW);
    println!("virtio crash: sender killed ({st})");
    println!("pcap-virtio-crash-flows: {KILLED_FLOW} {FRESH_FLOW}");

    // A fresh start: `open_virtio` resets the device, the queue sets up
    // new rings.
    let (domain, nic) = open_virtio(MapAccess::Narrow);
    let cfg = pool::Config::new(Order::new(4).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let txc = txcfg(HeaderMode::Bounce(SlotSize::B128));
    // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
    let mut q: VQueue = unsafe { tx::Queue::new(domain.clone(), pool, nic, txc) }.unwrap();
    let mut g = traffic(FRESH_FLOW + 1);
    let sizes = [65_160usize, 300, 9_000, 60];
    let n = 16;
    for &len in sizes.iter().cycle().take(n) {
        g.send_waiting(&mut q, FRESH_FLOW, len, WAIT, &mut Vec::new())
            .unwrap();
    }
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    assert_eq!(q.stats().completed, n as u64);
    let frames: u64 = sizes.iter().cycle().take(n).map(|&l| segments(l)).sum();
    println!("virtio crash: the fresh start sent {n} packets ({frames} segments)");
    expect_virtio(frames);
}
