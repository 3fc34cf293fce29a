//! A TX ring the 82576 cannot take is refused before any register is
//! written, and an attach that fails part-way leaves the queue stopped,
//! confirmed, with the ring registers it wrote put back; one whose stop
//! fails too says so, and the ring stays the device's.

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
