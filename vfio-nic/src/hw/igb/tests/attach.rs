//! A TX ring the 82576 cannot take is refused before any register is
//! written, and an attach that fails part-way leaves the queue stopped,
//! confirmed, with the ring registers it wrote put back; one whose stop
//! fails too says so, and the ring stays the device's. An RX start that
//! fails part-way does the same.

use super::*;

/// A TX ring of more than 4,096 descriptors is refused before any
/// register is written, as an RX ring is; 4,096 is taken. It used to be
/// programmed.
#[test]
fn a_tx_ring_longer_than_4096_descriptors_is_refused_before_any_write() {
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    let before = nic.regs().writes.borrow().len();
    for len in [4104, 65528] {
        // SAFETY: the registers are a fake: no device reads a ring.
        let r = unsafe { nic.attach(Iova(0x1000), len) };
        assert!(
            matches!(r, Err(Error::BadConfig { value, .. }) if value == u64::from(len)),
            "{r:?}"
        );
        // SAFETY: as above.
        let r = unsafe { nic.start_rx_at(Iova(0x1000), len, false) };
        assert!(matches!(r, Err(Error::BadConfig { .. })), "{r:?}");
    }
    assert_eq!(nic.regs().writes.borrow().len(), before);
    // SAFETY: as above.
    unsafe { nic.attach(Iova(0x1000), 4096) }.unwrap();
    assert_eq!(nic.regs().get(tdlen(0)), 4096 * 16);
    nic.detach().unwrap();
}

/// The TX ring registers: base, length, head and tail.
fn ring_regs(f: &Fake) -> [u32; 5] {
    [tdbal(0), tdbah(0), tdlen(0), tdh(0), tdt(0)].map(|r| f.get(r))
}

/// An attach whose enable does not read back leaves the queue disabled
/// (the device read back the disable), the transmitter off, and the ring
/// registers as they were: here those of a ring attached before, which
/// the attach stopped first. It used to leave TXDCTL.ENABLE written, the
/// queue pointed at a ring its caller would free.
#[test]
fn a_tx_enable_that_does_not_read_back_leaves_the_queue_off() {
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    // SAFETY: the registers are a fake: no device reads a ring.
    unsafe { nic.attach(Iova(0x1000), 64) }.unwrap();
    nic.detach().unwrap();
    let regs = ring_regs(nic.regs());
    nic.regs().enable_reads.set(u32::MAX);
    // SAFETY: as above.
    let r = unsafe { nic.attach(Iova(0x2000), 128) };
    assert!(
        matches!(
            r,
            Err(Error::DeviceTimeout {
                what: "TX queue enable",
                ..
            })
        ),
        "{r:?}"
    );
    let f = nic.regs();
    assert_eq!(f.get(txdctl(0)) & QUEUE_ENABLE, 0, "the queue disabled");
    assert_eq!(f.get(TCTL) & Tctl::EN.bits(), 0, "the transmitter off");
    assert_eq!(ring_regs(f), regs, "the ring registers put back");
    // SAFETY: as above.
    assert!(matches!(unsafe { nic.kick(1) }, Err(Error::NotAttached)));
}

/// An attach whose enable does not read back, and whose queue then does
/// not stop, reports both: the device may read the ring, which its
/// registers still name, and which the caller keeps. It used to report
/// the enable alone, as a failure that left the device as it was.
#[test]
fn a_failed_tx_enable_whose_stop_fails_too_reports_both() {
    let fake = Fake {
        disable_reads: u32::MAX,
        ..Fake::default()
    };
    fake.enable_reads.set(u32::MAX);
    let mut nic = Igb::new(fake, quick()).unwrap();
    // SAFETY: the registers are a fake: no device reads a ring.
    let r = unsafe { nic.attach(Iova(0x2000), 64) };
    match r {
        Err(Error::StopFailed { error, stop }) => {
            let what = |e: &Error| match e {
                Error::DeviceTimeout { what, .. } => *what,
                other => panic!("{other:?}"),
            };
            assert_eq!(what(&error), "TX queue enable");
            assert_eq!(what(&stop), "TX queue disable");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(nic.regs().get(tdbal(0)), 0x2000, "the ring still named");
    // SAFETY: as above.
    assert!(matches!(unsafe { nic.kick(1) }, Err(Error::NotAttached)));
}

/// A [`tx::Queue`](crate::tx::Queue) over an 82576 whose enable does not
/// read back, and whose queue stops (or not, `stops`): the queue's error
/// and the host bytes its domain keeps pinned after.
fn queue_over_a_failed_attach(stops: bool) -> (Error, u64) {
    use crate::tx;
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    use pfrag::pool::{self, Policy, Pool};
    let d = Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig::default()).unwrap(),
    ));
    let pcfg = pool::Config::new(pfrag::Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(d.clone(), pcfg).unwrap();
    let fake = Fake {
        disable_reads: if stops { 0 } else { u32::MAX },
        ..Fake::default()
    };
    fake.enable_reads.set(u32::MAX);
    let nic = Igb::new(fake, quick()).unwrap();
    // SAFETY: the registers are a fake: no device reads memory.
    let r = unsafe { tx::Queue::new(d.clone(), pool, nic, tx::Config::default()) };
    let e = r.expect_err("the enable does not read back");
    (e, d.pinned().host_bytes)
}

/// Through the queue: an 82576 whose attach fails, and whose queue then
/// stops, has the ring freed.
#[test]
fn a_queue_frees_the_ring_of_a_failed_attach_once_stopped() {
    let (e, pinned) = queue_over_a_failed_attach(true);
    assert!(matches!(e, Error::DeviceTimeout { .. }), "{e:?}");
    assert_eq!(pinned, 0);
}

/// Through the queue: an 82576 whose attach fails, and whose queue then
/// does not stop, keeps the ring for good (the queue's detach after the
/// failed attach fails too).
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn a_queue_keeps_the_ring_of_a_failed_attach_that_does_not_stop() {
    let (e, pinned) = queue_over_a_failed_attach(false);
    assert!(matches!(e, Error::StopFailed { .. }), "{e:?}");
    assert_eq!(pinned, 4096, "the ring, in whole pages");
}

/// The RX ring registers: base, length, buffer size, head and tail.
fn rx_ring_regs(f: &Fake) -> [u32; 6] {
    [rdbal(0), rdbah(0), rdlen(0), srrctl(0), rdh(0), rdt(0)].map(|r| f.get(r))
}

/// A start whose RX enable does not read back leaves the queue disabled
/// (the device read back the disable), the receiver off, and the ring
/// registers as they were: here those of a ring started and stopped
/// before. It used to leave RXDCTL.ENABLE written, the queue pointed at a
/// ring its caller may free.
#[test]
fn an_rx_enable_that_does_not_read_back_leaves_the_queue_off() {
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    // SAFETY: the registers are a fake: no device writes a ring.
    unsafe { nic.start_rx_at(Iova(0x1000), 32, true) }.unwrap();
    nic.stop_rx().unwrap();
    let regs = rx_ring_regs(nic.regs());
    nic.regs().enable_reads.set(u32::MAX);
    // SAFETY: as above.
    let r = unsafe { nic.start_rx_at(Iova(0x2000), 64, false) };
    assert!(
        matches!(
            r,
            Err(Error::DeviceTimeout {
                what: "RX queue enable",
                ..
            })
        ),
        "{r:?}"
    );
    let f = nic.regs();
    assert_eq!(f.get(rxdctl(0)) & QUEUE_ENABLE, 0, "the queue disabled");
    assert_eq!(f.get(RCTL) & Rctl::EN.bits(), 0, "the receiver off");
    assert_eq!(rx_ring_regs(f), regs, "the ring registers put back");
}

/// A start whose RX enable does not read back, and whose queue then does
/// not stop, reports both: the device may write the ring, which its
/// registers still name, and which the caller keeps. It used to report
/// the enable alone.
#[test]
fn a_failed_rx_enable_whose_stop_fails_too_reports_both() {
    let fake = Fake {
        disable_reads: u32::MAX,
        ..Fake::default()
    };
    fake.enable_reads.set(u32::MAX);
    let mut nic = Igb::new(fake, quick()).unwrap();
    // SAFETY: the registers are a fake: no device writes a ring.
    let r = unsafe { nic.start_rx_at(Iova(0x2000), 64, false) };
    match r {
        Err(Error::StopFailed { error, stop }) => {
            let what = |e: &Error| match e {
                Error::DeviceTimeout { what, .. } => *what,
                other => panic!("{other:?}"),
            };
            assert_eq!(what(&error), "RX queue enable");
            assert_eq!(what(&stop), "RX queue disable");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(nic.regs().get(rdbal(0)), 0x2000, "the ring still named");
}
