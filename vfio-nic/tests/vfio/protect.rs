//! The device tries to write into TX memory: an RX descriptor points at a
//! TX payload's IOVA while MAC loopback brings a sent frame back. Mapped
//! read-only (the default), the IOMMU blocks the write; mapped read-write
//! (the control run), the frame lands in the payload.

use super::*;
use pfrag::frag::FragCache;
use vfio_nic::check::wire::WireCheck;
use vfio_nic::hw::igb::RX_BUF;
use vfio_nic::hw::vfio::MapAccess;

/// What the TX payload held before the device was pointed at it.
pub(super) const FILL: u8 = 0xA5;
/// The looped-back frame's flow.
const FLOW: usize = 5;
/// RX descriptors (all pointing at the payload; the first is used).
const RX_LEN: u16 = 8;

/// The outcome of one attempt.
pub(super) struct Attempt {
    /// The payload's bytes afterwards.
    pub(super) after: Vec<u8>,
    /// The frame length the RX descriptor reports, if it was written back.
    pub(super) rx_len: Option<usize>,
    /// DMAR write faults the kernel logged inside the payload's page.
    pub(super) faults: Vec<String>,
}

/// Points every RX descriptor at a TX pool payload mapped with `access`,
/// loops one frame back into it, and reports what happened.
fn device_writes_into_tx_payload(access: MapAccess) -> Attempt {
    let pci = VfioPci::open(&bdf()).expect("open the VFIO device");
    let mapper = VfioMapper::with_access(&pci, access).unwrap();
    device_writes_into_tx_payload_over(pci, mapper, access)
}

/// [`device_writes_into_tx_payload`] on a device opened with its mapper
/// (whose access is `access`): type1 or iommufd.
pub(super) fn device_writes_into_tx_payload_over<M: DmaMapper>(
    pci: VfioPci,
    mapper: M,
    access: MapAccess,
) -> Attempt {
    let domain = Arc::new(Domain::new(mapper));
    let mut nic = Igb::new(pci, IgbConfig::default()).expect("reset and link up");
    let cfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    let mut cache = FragCache::new(Pool::new(domain.clone(), cfg).unwrap());
    let mut payload = cache.refill(RX_BUF, true).unwrap();
    payload.as_mut_slice().fill(FILL);
    let page = payload.iova().raw() & !0xfff;

    let ring = Coherent::new(
        domain.clone(),
        usize::from(RX_LEN) * desc::SIZE,
        Dir::BIDIRECTIONAL,
    )
    .unwrap();
    for i in 0..usize::from(RX_LEN) {
        ring.write_u64(i * desc::SIZE, payload.iova().raw())
            .unwrap();
        ring.write_u64(i * desc::SIZE + 8, 0).unwrap();
    }
    // SAFETY: on purpose, every RX buffer is the TX payload's page, so
    // that the IOMMU's answer to the device's write shows: blocked under
    // the narrow (read-only) mapping; in the read-write control run the
    // NIC writes into `payload`, a frag no reference touches from here
    // until it is read after `stop_rx`. The ring lives past that too.
    unsafe { nic.start_rx_at(ring.iova(), RX_LEN, true) }.unwrap();

    // The frame to loop back comes from a pool of its own.
    let tx_pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(2).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let cfg = txcfg(HeaderMode::Bounce(SlotSize::B128));
    // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
    let mut q = unsafe { tx::Queue::new(domain.clone(), tx_pool, nic, cfg) }.unwrap();
    let log_end = kmsg_end();
    send(&mut q, &mut traffic(FLOW + 1), FLOW, 1000).unwrap();
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    let nic = q.into_device().unwrap();

    // What each case expects ends its wait early (a frame received, a
    // fault logged); the other wait is only a look.
    let (rx_wait, log_wait) = match access {
        MapAccess::Narrow => (Duration::from_secs(3), WAIT),
        MapAccess::ReadWrite => (WAIT, Duration::from_millis(500)),
    };
    // Descriptor 0's write-back: status (DD is bit 0) and length.
    let t0 = Instant::now();
    let mut w1 = ring.read_u64(8).unwrap();
    while w1 & 1 == 0 && t0.elapsed() < rx_wait {
        std::thread::sleep(Duration::from_millis(5));
        w1 = ring.read_u64(8).unwrap();
    }
    let rx_len = (w1 & 1 != 0).then_some(((w1 >> 32) & 0xffff) as usize);
    let faults = kmsg_records(log_end, log_wait, |r| {
        r.contains("DMA Write") && dmar_fault_addr(r) == Some(page)
    });
    if let Err(e) = nic.stop_rx() {
        // The receiver may still write the ring and the page: the
        // device's for good.
        ring.pin();
        payload.pin();
        panic!("stopping RX: {e}");
    }
    let after = payload.as_slice().to_vec();
    cache.complete(payload).unwrap();
    Attempt {
        after,
        rx_len,
        faults,
    }
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn device_write_into_read_only_tx_memory_is_blocked() {
    check_blocked(&device_writes_into_tx_payload(MapAccess::Narrow));
}

/// The device's write into read-only TX memory was blocked: a DMAR write
/// fault in the payload's page, and every byte unchanged.
pub(super) fn check_blocked(a: &Attempt) {
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
        "read-only TX payload: write blocked, {} bytes unchanged (descriptor written back: {:?})",
        a.after.len(),
        a.rx_len
    );
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn device_write_into_read_write_tx_memory_lands() {
    check_lands(&device_writes_into_tx_payload(MapAccess::ReadWrite));
}

/// The control run: no fault, and the payload holds the looped-back frame.
pub(super) fn check_lands(a: &Attempt) {
    assert!(a.faults.is_empty(), "unexpected faults: {:?}", a.faults);
    let len = a.rx_len.expect("the looped-back frame was received");
    assert!(len <= RX_BUF, "{len}-byte frame");
    // The payload now holds the frame, which checks out.
    let mut check = WireCheck::default();
    check
        .frame(&a.after[..len])
        .unwrap_or_else(|e| panic!("payload does not hold the frame: {e}"));
    assert_eq!(check.report().frames, 1);
    let changed = a.after.iter().filter(|&&b| b != FILL).count();
    println!(
        "read-write control: the device overwrote {changed} payload bytes with a {len}-byte frame"
    );
}
