//! Bring-up of the 82576 driver against an in-memory fake of its registers,
//! and the register layout.

use super::regs::*;
use super::*;
use std::sync::Arc;

use pfrag::dma::Domain;
use std::cell::RefCell;
use std::collections::HashMap;

/// An in-memory 82576: registers in a map, with the few behaviours
/// bring-up waits for (reset self-clears, link follows SLU, MDIC
/// completes, a queue enable reads back).
#[derive(Debug, Default)]
struct Fake {
    regs: RefCell<HashMap<u32, u32>>,
    writes: RefCell<Vec<(u32, u32)>>,
    no_link: bool,
    mdic_error: bool,
}

impl Fake {
    fn get(&self, r: Reg) -> u32 {
        self.regs.borrow().get(&r.offset()).copied().unwrap_or(0)
    }
}

impl Regs for Fake {
    fn read(&self, r: Reg) -> Result<u32> {
        Ok(self.get(r))
    }
    unsafe fn write(&self, r: Reg, v: u32) -> Result<()> {
        self.writes.borrow_mut().push((r.offset(), v));
        let stored = match r {
            CTRL => {
                if v & Ctrl::SLU.bits() != 0 && !self.no_link {
                    let st = self.get(STATUS) | Status::LU.bits();
                    self.regs.borrow_mut().insert(STATUS.offset(), st);
                }
                v & !Ctrl::RST.bits()
            }
            MDIC if self.mdic_error => v | Mdic::READY.bits() | Mdic::ERROR.bits(),
            MDIC => v | Mdic::READY.bits(),
            _ => v,
        };
        self.regs.borrow_mut().insert(r.offset(), stored);
        Ok(())
    }
}

fn quick() -> IgbConfig {
    IgbConfig {
        reset_timeout: Duration::from_millis(20),
        link_timeout: Duration::from_millis(20),
        enable_timeout: Duration::from_millis(20),
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
    assert_eq!(pos(TCTL.offset(), &|v| v == 0), Some(3), "TX off first");
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
    let rx = RxRing::new(d, 32).unwrap();
    // SAFETY: the registers are a fake: no device writes anything.
    unsafe { nic.start_rx(&rx, true) }.unwrap();
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
