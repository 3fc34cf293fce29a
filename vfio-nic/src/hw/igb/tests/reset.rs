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
