//! The reset waits until no bus-master request is pending (datasheet:
//! CTRL.GIO_MASTER_DISABLE, then STATUS.GIO_MASTER_ENABLE clear), and
//! refuses to reset a device whose requests do not drain.

use super::*;

/// A reset sets the master disable and waits until STATUS reads the
/// requests drained before it resets the device; mastering is enabled
/// again after. The reset used to be issued with requests pending.
#[test]
fn a_reset_waits_until_no_master_request_is_pending() {
    let fake = Fake::default();
    fake.master_reads.set(3);
    let nic = Igb::new(fake, patient()).unwrap();
    let r = nic.regs();
    assert_eq!(r.resets_while_mastering.get(), 0);
    let disable = Ctrl::GIO_MASTER_DISABLE.bits();
    assert!(r
        .writes
        .borrow()
        .iter()
        .any(|&(o, v)| o == CTRL.offset() && v & disable != 0));
    assert_eq!(r.get(CTRL) & disable, 0, "mastering enabled again");
}

/// Requests that do not drain are a typed error carrying STATUS: the
/// device is not reset, and is left as it was (mastering enabled again,
/// the receiver, transmitter and their queues untouched).
#[test]
fn a_reset_whose_master_requests_do_not_drain_is_refused() {
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    // SAFETY: the registers are a fake: no device reads a ring.
    unsafe { nic.attach(Iova(0x1000), 64) }.unwrap();
    nic.regs().master_reads.set(u32::MAX);
    let before = nic.regs().writes.borrow().len();
    let tx = (nic.regs().get(TCTL), nic.regs().get(txdctl(0)));
    match nic.reset() {
        Err(Error::MasterRequestsPending { status, waited_ms }) => {
            assert_ne!(status & Status::GIO_MASTER_ENABLE.bits(), 0);
            assert!(waited_ms >= 20);
        }
        other => panic!("{other:?}"),
    }
    let r = nic.regs();
    let writes: Vec<_> = r.writes.borrow()[before..].to_vec();
    let ctrl = CTRL.offset();
    assert!(
        writes.iter().all(|&(o, _)| o == ctrl),
        "only CTRL written: {writes:x?}"
    );
    assert!(
        writes.iter().all(|&(_, v)| v & Ctrl::RST.bits() == 0),
        "no reset"
    );
    assert_eq!(r.get(CTRL) & Ctrl::GIO_MASTER_DISABLE.bits(), 0);
    assert_eq!((r.get(TCTL), r.get(txdctl(0))), tx);
    // SAFETY: as above.
    unsafe { nic.kick(1) }.expect("still attached");
}

/// The registers a reset changes before CTRL.RST.
const QUIESCED: [Reg; 6] = [CTRL, IMS, EIMS, RCTL, TCTL, txdctl(0)];

fn quiesced(f: &Fake) -> [u32; 6] {
    QUIESCED.map(|r| f.get(r))
}

/// An 82576 in use: its TX queue attached, its receiver on and some of
/// its interrupts unmasked.
fn in_use() -> Igb<Fake> {
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    // SAFETY: the registers are a fake: no device reads a ring or raises
    // an interrupt.
    unsafe {
        nic.attach(Iova(0x1000), 64).unwrap();
        nic.write(RCTL, Rctl::EN.bits()).unwrap();
        nic.write(IMS, 0x15).unwrap();
        nic.write(EIMS, 0x3).unwrap();
    }
    nic
}

fn rst_written(writes: &[(u32, u32)]) -> bool {
    writes
        .iter()
        .any(|&(o, v)| o == CTRL.offset() && v & Ctrl::RST.bits() != 0)
}

fn bad_register(e: &Error) -> u32 {
    match e {
        Error::BadRegister { offset, .. } => *offset,
        other => panic!("{other:?}"),
    }
}

/// A reset whose access fails before the device is reset (masking the
/// interrupts, stopping the receiver or transmitter, the RST write
/// itself) puts back what it changed: mastering enabled again, the
/// masks, receiver and transmitter as they were, the queue attached. It
/// used to leave the master disable set (no DMA) and the rest off.
#[test]
fn a_reset_failing_before_the_device_reset_leaves_it_as_it_was() {
    // CTRL: its read, the master disable, then the RST write.
    for (r, after) in [(IMC, 0), (EIMC, 0), (RCTL, 0), (TCTL, 0), (CTRL, 2)] {
        let mut nic = in_use();
        let before = quiesced(nic.regs());
        let writes = nic.regs().writes.borrow().len();
        nic.regs().fail(r, after);
        let e = nic.reset().unwrap_err();
        assert_eq!(bad_register(&e), r.offset(), "{r:?}");
        let f = nic.regs();
        assert!(
            !rst_written(&f.writes.borrow()[writes..]),
            "{r:?}: no reset"
        );
        assert_eq!(quiesced(f), before, "{r:?}: as it was");
        assert_eq!(f.get(CTRL) & Ctrl::GIO_MASTER_DISABLE.bits(), 0);
        // SAFETY: as above.
        unsafe { nic.kick(1) }.expect("still attached");
    }
}

/// A failure before the reset whose putting back fails too reports both;
/// the master disable the failed write should have cleared stays set. It
/// used to report the first failure alone.
#[test]
fn a_reset_that_cannot_put_the_device_back_reports_both() {
    let mut nic = in_use();
    let before = quiesced(nic.regs());
    nic.regs().fail(IMC, 0);
    // CTRL: its read, the master disable, then the write taking it back.
    nic.regs().fail(CTRL, 2);
    match nic.reset() {
        Err(Error::UndoFailed { error, undo }) => {
            assert_eq!(bad_register(&error), IMC.offset());
            assert_eq!(bad_register(&undo), CTRL.offset());
        }
        other => panic!("{other:?}"),
    }
    let f = nic.regs();
    assert_ne!(f.get(CTRL) & Ctrl::GIO_MASTER_DISABLE.bits(), 0);
    assert_eq!(quiesced(f)[1..], before[1..], "the rest put back");
}

/// Master requests that do not drain, and a master disable that cannot
/// be taken back: both reported. It used to report the requests alone,
/// as a device left as it was.
#[test]
fn a_master_disable_that_cannot_be_taken_back_is_reported() {
    let mut nic = in_use();
    nic.regs().master_reads.set(u32::MAX);
    nic.regs().fail(CTRL, 2);
    match nic.reset() {
        Err(Error::UndoFailed { error, undo }) => {
            assert!(matches!(*error, Error::MasterRequestsPending { .. }));
            assert_eq!(bad_register(&undo), CTRL.offset());
        }
        other => panic!("{other:?}"),
    }
    let disable = Ctrl::GIO_MASTER_DISABLE.bits();
    assert_ne!(nic.regs().get(CTRL) & disable, 0);
}

/// A reset failing after the RST write leaves a device that was reset:
/// its queue forgot the ring (the driver says not attached), its
/// counters start again. It used to take the next doorbell as if the
/// ring were still attached.
#[test]
fn a_reset_failing_after_the_device_reset_leaves_it_reset() {
    let mut nic = in_use();
    let writes = nic.regs().writes.borrow().len();
    // IMC: before the reset, then after it.
    nic.regs().fail(IMC, 1);
    let e = nic.reset().unwrap_err();
    assert_eq!(bad_register(&e), IMC.offset());
    assert!(rst_written(&nic.regs().writes.borrow()[writes..]));
    // SAFETY: as above.
    assert!(matches!(unsafe { nic.kick(1) }, Err(Error::NotAttached)));
}

/// The TX counters the device kept across a reset that then failed are
/// not the driver's: they are read and dropped once the reset is done,
/// whatever fails after it. They used to come back in the next `stats`,
/// as packets sent since the reset.
#[test]
fn counters_from_before_a_reset_that_then_fails_are_dropped() {
    let mut nic = in_use();
    nic.regs().set(GPTC, 7);
    nic.regs().set(GOTCL, 7 * 64);
    nic.regs().set(TPT, 7);
    // IMC: before the reset, then after it.
    nic.regs().fail(IMC, 1);
    assert_eq!(bad_register(&nic.reset().unwrap_err()), IMC.offset());
    let st = nic.stats().unwrap();
    assert_eq!(
        (st.good_packets, st.good_octets, st.total_packets),
        (0, 0, 0)
    );
    // What the device counts from then on is counted.
    nic.regs().set(GPTC, 2);
    assert_eq!(nic.stats().unwrap().good_packets, 2);
}
