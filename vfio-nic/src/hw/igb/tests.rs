//! Bring-up of the 82576 driver against an in-memory fake of its registers,
//! and the register layout.

use super::regs::*;
use super::*;
use std::sync::Arc;

use pfrag::dma::Domain;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// An in-memory 82576: registers in a map, with the few behaviours
/// bring-up waits for (reset self-clears, link follows SLU, MDIC
/// completes); a queue enable that takes `enable_reads` reads of the
/// queue's control register to read back and a disable that takes
/// `disable_reads`, as a queue starting up or finishing its work; and
/// bus-master requests that drain `master_reads` reads of STATUS after
/// CTRL.GIO_MASTER_DISABLE is set. `u32::MAX` reads: never. A reset
/// while requests may be pending is counted in `resets_while_mastering`.
/// IMC and EIMC clear bits of the masks IMS and EIMS read, and IMS and
/// EIMS writes set bits of them. The TX statistics registers clear when
/// read, and a reset leaves them as they were (the conservative reading:
/// the datasheet has them cleared on power-up, and says nothing of a
/// software reset). An access [`fail`](Fake::fail)s as told.
#[derive(Debug, Default)]
pub(super) struct Fake {
    regs: RefCell<HashMap<u32, u32>>,
    pub(super) writes: RefCell<Vec<(u32, u32)>>,
    no_link: bool,
    mdic_error: bool,
    pub(super) disable_reads: u32,
    pub(super) enable_reads: Cell<u32>,
    pub(super) master_reads: Cell<u32>,
    /// STATUS reads since GIO_MASTER_DISABLE was set.
    master_seen: Cell<u32>,
    pub(super) resets_while_mastering: Cell<u32>,
    /// Queue control registers being disabled: reads left until they are.
    stopping: RefCell<HashMap<u32, u32>>,
    /// Queue control registers being enabled: reads left until they are.
    enabling: RefCell<HashMap<u32, u32>>,
    /// Registers with an access to fail: accesses left that succeed first.
    faults: RefCell<HashMap<u32, u32>>,
}

/// The enable bit of TXDCTL and RXDCTL.
pub(super) const QUEUE_ENABLE: u32 = 1 << 25;

impl Fake {
    /// Sets `r` as the device would (a counter counting, say), with no
    /// write.
    pub(super) fn set(&self, r: Reg, v: u32) {
        self.regs.borrow_mut().insert(r.offset(), v);
    }

    pub(super) fn get(&self, r: Reg) -> u32 {
        self.regs.borrow().get(&r.offset()).copied().unwrap_or(0)
    }

    /// Makes the access (read or write) of `r` after `after` more that
    /// succeed fail, once, with [`Error::BadRegister`]; a write that
    /// fails changes nothing.
    pub(super) fn fail(&self, r: Reg, after: u32) {
        self.faults.borrow_mut().insert(r.offset(), after);
    }

    /// The fault of this access of `r`, if [`fail`](Fake::fail) set one.
    fn fault(&self, r: Reg) -> Result<()> {
        let mut faults = self.faults.borrow_mut();
        let Some(left) = faults.get_mut(&r.offset()) else {
            return Ok(());
        };
        if *left > 0 {
            *left -= 1;
            return Ok(());
        }
        faults.remove(&r.offset());
        Err(Error::BadRegister {
            offset: r.offset(),
            bar_len: 0,
        })
    }

    /// Counts a read of `r` against its change pending in `pending`:
    /// whether the change is still pending after it.
    fn pending(pending: &RefCell<HashMap<u32, u32>>, r: Reg) -> bool {
        let mut pending = pending.borrow_mut();
        let Some(left) = pending.get_mut(&r.offset()) else {
            return false;
        };
        if *left != u32::MAX {
            *left -= 1;
        }
        if *left == 0 {
            pending.remove(&r.offset());
            return false;
        }
        true
    }

    /// Whether bus-master requests may be pending: mastering is not
    /// disabled, or STATUS has not yet been read with them drained.
    fn mastering(&self) -> bool {
        self.get(CTRL) & Ctrl::GIO_MASTER_DISABLE.bits() == 0
            || self.master_seen.get() <= self.master_reads.get()
    }

    fn status(&self) -> u32 {
        if self.get(CTRL) & Ctrl::GIO_MASTER_DISABLE.bits() != 0 {
            self.master_seen
                .set(self.master_seen.get().saturating_add(1));
        }
        match self.mastering() {
            true => self.get(STATUS) | Status::GIO_MASTER_ENABLE.bits(),
            false => self.get(STATUS),
        }
    }

    /// What a CTRL write of `v` leaves in CTRL.
    fn ctrl(&self, v: u32) -> u32 {
        if v & Ctrl::SLU.bits() != 0 && !self.no_link {
            let st = self.get(STATUS) | Status::LU.bits();
            self.regs.borrow_mut().insert(STATUS.offset(), st);
        }
        let reset = v & Ctrl::RST.bits() != 0;
        if reset && self.mastering() {
            let n = self.resets_while_mastering.get();
            self.resets_while_mastering.set(n + 1);
        }
        if reset || v & Ctrl::GIO_MASTER_DISABLE.bits() == 0 {
            self.master_seen.set(0);
        }
        // The reset self-clears, and clears the master disable.
        match reset {
            true => v & !(Ctrl::RST | Ctrl::GIO_MASTER_DISABLE).bits(),
            false => v,
        }
    }
}

impl Regs for Fake {
    fn read(&self, r: Reg) -> Result<u32> {
        self.fault(r)?;
        if r == STATUS {
            return Ok(self.status());
        }
        if self.stopping.borrow().contains_key(&r.offset()) && !Fake::pending(&self.stopping, r) {
            let v = self.get(r) & !QUEUE_ENABLE;
            self.regs.borrow_mut().insert(r.offset(), v);
        }
        if Fake::pending(&self.enabling, r) {
            return Ok(self.get(r) & !QUEUE_ENABLE);
        }
        if [GPTC, GOTCL, GOTCH, TPT].contains(&r) {
            return Ok(self.regs.borrow_mut().remove(&r.offset()).unwrap_or(0));
        }
        Ok(self.get(r))
    }
    unsafe fn write(&self, r: Reg, v: u32) -> Result<()> {
        self.fault(r)?;
        self.writes.borrow_mut().push((r.offset(), v));
        let queue = r == txdctl(0) || r == rxdctl(0);
        let enabled = self.get(r) & QUEUE_ENABLE != 0;
        if queue && v & QUEUE_ENABLE == 0 {
            self.enabling.borrow_mut().remove(&r.offset());
            if enabled && self.disable_reads > 0 {
                self.stopping
                    .borrow_mut()
                    .insert(r.offset(), self.disable_reads);
                self.regs.borrow_mut().insert(r.offset(), v | QUEUE_ENABLE);
                return Ok(());
            }
        }
        if queue && v & QUEUE_ENABLE != 0 && !enabled && self.enable_reads.get() > 0 {
            self.enabling
                .borrow_mut()
                .insert(r.offset(), self.enable_reads.get());
        }
        let stored = match r {
            CTRL => self.ctrl(v),
            MDIC if self.mdic_error => v | Mdic::READY.bits() | Mdic::ERROR.bits(),
            MDIC => v | Mdic::READY.bits(),
            IMS | EIMS => self.get(r) | v,
            IMC | EIMC => {
                let mask = if r == IMC { IMS } else { EIMS };
                let cleared = self.get(mask) & !v;
                self.regs.borrow_mut().insert(mask.offset(), cleared);
                v
            }
            _ => v,
        };
        self.regs.borrow_mut().insert(r.offset(), stored);
        Ok(())
    }
}

/// A bring-up that gives up after a few milliseconds: for a fake that
/// never answers (or answers at once).
pub(super) fn quick() -> IgbConfig {
    IgbConfig {
        reset_timeout: Duration::from_millis(20),
        link_timeout: Duration::from_millis(20),
        enable_timeout: Duration::from_millis(20),
    }
}

/// Timeouts far beyond a few register reads however slow the machine (or
/// Miri): for a fake that answers after a number of reads, so that the
/// test counts reads, never time.
pub(super) fn patient() -> IgbConfig {
    IgbConfig {
        reset_timeout: Duration::from_secs(600),
        link_timeout: Duration::from_secs(600),
        enable_timeout: Duration::from_secs(600),
    }
}

#[test]
fn bring_up_resets_links_and_programs_the_tx_queue() {
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    let w = nic.regs().writes.borrow().clone();
    let pos = |o: u32, pred: &dyn Fn(u32) -> bool| w.iter().position(|&(r, v)| r == o && pred(v));
    let rst = pos(CTRL.offset(), &|v| v & Ctrl::RST.bits() != 0).unwrap();
    let slu = pos(CTRL.offset(), &|v| v & Ctrl::SLU.bits() != 0).unwrap();
    assert!(rst < slu, "reset before link");
    let gio = pos(CTRL.offset(), &|v| v & Ctrl::GIO_MASTER_DISABLE.bits() != 0);
    assert_eq!(gio, Some(0), "bus mastering off first");
    let tx_off = pos(TCTL.offset(), &|v| v == 0).unwrap();
    assert!(tx_off < rst, "TX off before the reset");
    // SAFETY: the registers are a fake: no device reads a ring.
    unsafe { nic.attach(Iova(0x1_2345_6780), 64) }.unwrap();
    let r = nic.regs();
    assert_eq!(r.get(tdbal(0)), 0x2345_6780);
    assert_eq!(r.get(tdbah(0)), 0x1);
    assert_eq!(r.get(tdlen(0)), 64 * 16);
    assert_ne!(r.get(txdctl(0)) & Txdctl::ENABLE.bits(), 0);
    assert_ne!(r.get(TCTL) & Tctl::EN.bits(), 0);
    // SAFETY: the registers are a fake: no device reads the ring.
    unsafe { nic.kick(5) }.unwrap();
    assert_eq!(nic.regs().get(tdt(0)), 5);
    assert!(matches!(
        // SAFETY: as above.
        unsafe { nic.attach(Iova(0x1000_0040), 64) },
        Err(Error::BadConfig { .. })
    ));
    nic.detach().unwrap();
}

#[test]
fn no_link_is_a_timeout_naming_the_step() {
    let fake = Fake {
        no_link: true,
        ..Fake::default()
    };
    match Igb::new(fake, quick()) {
        Err(Error::DeviceTimeout { what, waited_ms }) => {
            assert_eq!(what, "link up");
            assert!(waited_ms >= 20);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn phy_error_is_reported_with_the_mdic_value() {
    let fake = Fake {
        mdic_error: true,
        ..Fake::default()
    };
    match Igb::new(fake, quick()) {
        Err(Error::Mdic { mdic }) => assert_ne!(mdic & Mdic::ERROR.bits(), 0),
        other => panic!("{other:?}"),
    }
}

#[test]
fn rx_queue_is_programmed_at_the_rx_stride() {
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    let d = Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig::default()).unwrap(),
    ));
    let mut rx = RxRing::new(d, 32).unwrap();
    // SAFETY: the registers are a fake: no device writes anything.
    unsafe { nic.start_rx(&mut rx, true) }.unwrap();
    let r = nic.regs();
    assert_eq!(
        u64::from(r.get(rdbal(0))),
        rx.ring.iova().raw() & 0xffff_ffff
    );
    assert_eq!(r.get(rdlen(0)), 32 * 16);
    assert_ne!(r.get(RCTL), 0);
    assert_eq!(rdbal(1).offset() - rdbal(0).offset(), 0x40);
    nic.stop_rx().unwrap();
}

#[test]
fn queue_registers_follow_the_datasheet_layout() {
    assert_eq!(tdbal(0).offset(), 0xE000);
    assert_eq!(tdbah(0).offset(), 0xE004);
    assert_eq!(tdlen(0).offset(), 0xE008);
    assert_eq!(tdh(0).offset(), 0xE010);
    assert_eq!(tdt(0).offset(), 0xE018);
    assert_eq!(txdctl(0).offset(), 0xE028);
    assert_eq!(tdt(1).offset(), 0xE058);
    assert_eq!(ral(15).offset(), 0x5478);
    assert_eq!(rdbal(0).offset(), 0xC000);
    assert_eq!(srrctl(0).offset(), 0xC00C);
    assert_eq!(rdt(0).offset(), 0xC018);
    assert_eq!(rxdctl(0).offset(), 0xC028);
}

/// Detach stops the TX queue before it returns: it waits until the
/// queue's enable bit reads 0 (the device no longer reads the ring, which
/// the caller may free next).
#[test]
fn detach_waits_until_the_tx_queue_reads_disabled() {
    let fake = Fake {
        disable_reads: 3,
        ..Fake::default()
    };
    let mut nic = Igb::new(fake, patient()).unwrap();
    // SAFETY: the registers are a fake: no device reads a ring.
    unsafe { nic.attach(Iova(0x1000), 64) }.unwrap();
    nic.detach().unwrap();
    assert_eq!(nic.regs().get(txdctl(0)) & Txdctl::ENABLE.bits(), 0);
    assert!(nic.regs().stopping.borrow().is_empty());
}

/// A TX queue that does not stop is a timeout naming the step, and the
/// queue stays attached (a failed detach leaves the state as it was).
#[test]
fn a_tx_queue_that_does_not_stop_is_a_detach_timeout() {
    let fake = Fake {
        disable_reads: u32::MAX,
        ..Fake::default()
    };
    let mut nic = Igb::new(fake, quick()).unwrap();
    // SAFETY: the registers are a fake: no device reads a ring.
    unsafe { nic.attach(Iova(0x1000), 64) }.unwrap();
    match nic.detach() {
        Err(Error::DeviceTimeout { what, waited_ms }) => {
            assert_eq!(what, "TX queue disable");
            assert!(waited_ms >= 20);
        }
        other => panic!("{other:?}"),
    }
    // SAFETY: as above.
    unsafe { nic.kick(1) }.expect("still attached");
}

/// Stopping RX waits until the RX queue reads disabled, and one that does
/// not stop is a timeout naming the step.
#[test]
fn stop_rx_waits_until_the_rx_queue_reads_disabled() {
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    let d = Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig::default()).unwrap(),
    ));
    let mut rx = RxRing::new(d, 32).unwrap();
    for (reads, stops) in [(3, true), (u32::MAX, false)] {
        let fake = Fake {
            disable_reads: reads,
            ..Fake::default()
        };
        let cfg = if stops { patient() } else { quick() };
        let mut nic = Igb::new(fake, cfg).unwrap();
        // SAFETY: the registers are a fake: no device writes anything.
        unsafe { nic.start_rx(&mut rx, true) }.unwrap();
        match nic.stop_rx() {
            Ok(()) if stops => {
                assert_eq!(nic.regs().get(rxdctl(0)) & Rxdctl::ENABLE.bits(), 0);
            }
            Err(Error::DeviceTimeout { what, .. }) if !stops => {
                assert_eq!(what, "RX queue disable");
            }
            other => panic!("{reads} reads: {other:?}"),
        }
    }
}

/// A detach that times out leaves the transmitter as it was (TCTL and
/// TXDCTL back to their values), so the queue that stays attached still
/// sends.
#[test]
fn a_failed_detach_leaves_the_transmitter_on() {
    let fake = Fake {
        disable_reads: u32::MAX,
        ..Fake::default()
    };
    let mut nic = Igb::new(fake, quick()).unwrap();
    // SAFETY: the registers are a fake: no device reads a ring.
    unsafe { nic.attach(Iova(0x1000), 64) }.unwrap();
    let before = (nic.regs().get(TCTL), nic.regs().get(regs::txdctl(0)));
    assert!(matches!(nic.detach(), Err(Error::DeviceTimeout { .. })));
    let after = (nic.regs().get(TCTL), nic.regs().get(regs::txdctl(0)));
    assert_eq!(after, before);
}

/// Attaching a ring while another is attached stops the queue first, as
/// a detach does: a queue that does not stop is a timeout, and the old
/// ring stays attached (its base is not rewritten); one that stops is
/// re-pointed.
#[test]
fn attaching_another_ring_stops_the_queue_first() {
    for stops in [false, true] {
        let fake = Fake {
            disable_reads: if stops { 3 } else { u32::MAX },
            ..Fake::default()
        };
        let cfg = if stops { patient() } else { quick() };
        let mut nic = Igb::new(fake, cfg).unwrap();
        // SAFETY: a fake: no device reads a ring.
        unsafe { nic.attach(Iova(0x1000), 64) }.unwrap();
        // SAFETY: as above.
        let r = unsafe { nic.attach(Iova(0x2000), 64) };
        let base = nic.regs().get(tdbal(0));
        if stops {
            r.unwrap();
            assert_eq!(base, 0x2000);
        } else {
            assert!(
                matches!(
                    r,
                    Err(Error::DeviceTimeout {
                        what: "TX queue disable",
                        ..
                    })
                ),
                "{r:?}"
            );
            assert_eq!(base, 0x1000, "the old ring stays attached");
            let enabled = nic.regs().get(txdctl(0)) & QUEUE_ENABLE != 0;
            assert!(enabled, "and its queue sending");
        }
    }
}

/// An RX ring kept for a receiver that could not be stopped stays
/// allocated and mapped, counted in the domain's pinned bytes; a new ring
/// does not take its IOVA.
#[test]
#[cfg_attr(
    miri,
    ignore = "keeps memory allocated for good on purpose, which Miri's leak check reports"
)]
fn an_rx_ring_pinned_after_a_failed_stop_keeps_its_mapping() {
    use pfrag::dma::{Dir, SoftIommu, SoftIommuConfig, Translate};
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let d = Arc::new(Domain::new(iommu.clone()));
    let mut rx = RxRing::new(d.clone(), 32).unwrap();
    let iova = rx.ring.iova();
    let fake = Fake {
        disable_reads: u32::MAX,
        ..Fake::default()
    };
    let mut nic = Igb::new(fake, quick()).unwrap();
    // SAFETY: `rx` is kept for good below, its stop having failed.
    unsafe { nic.start_rx(&mut rx, true) }.unwrap();
    assert!(nic.stop_rx().is_err());
    rx.pin();
    // 32 descriptors of 16 bytes and 32 buffers of 2 KiB, in whole pages.
    let bytes = 4096 + 32 * RX_BUF as u64;
    let p = d.pinned();
    assert_eq!((p.host_bytes, p.iova_bytes), (bytes, bytes));
    assert!(iommu.translate(iova, Dir::FROM_DEVICE).is_ok());
    let again = RxRing::new(d, 32).unwrap();
    assert_ne!(again.ring.iova(), iova);
}

/// The 82576 ignores the low 7 bits of RDBAL: an RX ring that is not
/// 128-byte aligned would have the device write receive descriptors
/// below it. Refused as the TX ring is, before any register is written.
#[test]
fn an_rx_ring_not_128_byte_aligned_is_refused_before_any_write() {
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    let before = nic.regs().writes.borrow().len();
    // SAFETY: the registers are a fake: no device writes anything.
    let r = unsafe { nic.start_rx_at(Iova(0x1000_0040), 32, true) };
    assert!(
        matches!(
            r,
            Err(Error::BadConfig {
                value: 0x1000_0040,
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(nic.regs().writes.borrow().len(), before);
    // SAFETY: as above.
    unsafe { nic.start_rx_at(Iova(0x1000_0080), 32, true) }.unwrap();
    assert_eq!(nic.regs().get(rdbal(0)), 0x1000_0080);
    nic.stop_rx().unwrap();
}

/// What the device does on receiving a `len`-byte frame into descriptor
/// `i`: the write-back with the length and DD set.
fn device_receives<M: pfrag::dma::DmaMapper>(rx: &RxRing<M>, i: usize, len: u64) {
    let wb = u64::from(RxSta::DD.bits()) | (len << 32);
    rx.ring.write_u64(i * crate::desc::SIZE + 8, wb).unwrap();
}

/// Started again after a stop, the device writes from descriptor 0 (RDH
/// 0): the ring reads from there too, and a frame written back before
/// the stop and not read is not taken for a new one (its descriptor, and
/// buffer, are the device's again).
#[test]
fn a_restarted_rx_ring_reads_where_the_device_writes() {
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    let d = Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig::default()).unwrap(),
    ));
    let mut rx = RxRing::new(d, 32).unwrap();
    let mut nic = Igb::new(Fake::default(), quick()).unwrap();
    // SAFETY: the registers are a fake: no device writes anything.
    unsafe { nic.start_rx(&mut rx, true) }.unwrap();
    device_receives(&rx, 0, 60);
    device_receives(&rx, 1, 61);
    let (frame, tail) = rx.next_frame().unwrap().unwrap();
    assert_eq!((frame.len(), tail), (60, 0));
    nic.stop_rx().unwrap();
    // SAFETY: as above.
    unsafe { nic.start_rx(&mut rx, true) }.unwrap();
    assert_eq!(nic.regs().get(rdh(0)), 0);
    assert!(rx.next_frame().unwrap().is_none(), "a frame from before");
    device_receives(&rx, 0, 70);
    let (frame, tail) = rx.next_frame().unwrap().expect("descriptor 0");
    assert_eq!((frame.len(), tail), (70, 0));
    nic.stop_rx().unwrap();
}

/// Pointing a running RX queue at another ring stops it first, as
/// attaching another TX ring does: a queue that does not stop is a
/// timeout, and the old ring stays the device's (its base is not
/// rewritten, the receiver is left on). It used to be re-pointed while
/// its disable had not read back, and the call returned `Ok`.
#[test]
fn restarting_rx_stops_the_queue_first() {
    for stops in [false, true] {
        let fake = Fake {
            disable_reads: if stops { 3 } else { u32::MAX },
            ..Fake::default()
        };
        let cfg = if stops { patient() } else { quick() };
        let mut nic = Igb::new(fake, cfg).unwrap();
        // SAFETY: a fake: no device writes anything.
        unsafe { nic.start_rx_at(Iova(0x1000), 32, true) }.unwrap();
        let rctl = nic.regs().get(RCTL);
        // SAFETY: as above.
        let r = unsafe { nic.start_rx_at(Iova(0x2000), 32, true) };
        let base = nic.regs().get(rdbal(0));
        if stops {
            r.unwrap();
            assert_eq!(base, 0x2000);
            continue;
        }
        assert!(
            matches!(
                r,
                Err(Error::DeviceTimeout {
                    what: "RX queue disable",
                    ..
                })
            ),
            "{r:?}"
        );
        assert_eq!(base, 0x1000, "the old ring stays the device's");
        assert_ne!(nic.regs().get(rxdctl(0)) & QUEUE_ENABLE, 0);
        assert_eq!(nic.regs().get(RCTL), rctl, "the receiver left on");
    }
}

/// A ring restarted while its receiver does not stop is not re-armed: a
/// frame the device wrote back stays there to be read, its descriptor
/// not handed back. It used to be re-armed before the receiver was
/// stopped.
#[test]
fn a_ring_whose_receiver_does_not_stop_is_not_rearmed() {
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    let d = Arc::new(Domain::new(
        SoftIommu::new(SoftIommuConfig::default()).unwrap(),
    ));
    let mut rx = RxRing::new(d, 32).unwrap();
    let fake = Fake {
        disable_reads: u32::MAX,
        ..Fake::default()
    };
    let mut nic = Igb::new(fake, quick()).unwrap();
    // SAFETY: the registers are a fake: no device writes anything.
    unsafe { nic.start_rx(&mut rx, true) }.unwrap();
    device_receives(&rx, 0, 60);
    // SAFETY: as above.
    let r = unsafe { nic.start_rx(&mut rx, true) };
    assert!(matches!(r, Err(Error::DeviceTimeout { .. })), "{r:?}");
    let (frame, tail) = rx.next_frame().unwrap().expect("the frame is kept");
    assert_eq!((frame.len(), tail), (60, 0));
}

mod attach;
mod reset;
