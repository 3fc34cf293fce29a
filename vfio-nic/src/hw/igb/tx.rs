//! The 82576's transmit queue 0 as a [`TxDevice`]: attaching a ring, the
//! doorbell and the stop.

use super::*;

impl<R: Regs> Igb<R> {
    /// Turns the transmitter off and waits (bounded) until the TX queue's
    /// enable bit reads 0, as [`stop_rx`](Self::stop_rx) does for RX.
    pub(super) fn stop_tx(&self) -> Result<()> {
        self.reg(regs::TCTL, 0)?;
        self.reg(regs::txdctl(0), 0)?;
        self.wait_stopped("TX queue disable", regs::txdctl(0), Txdctl::ENABLE.bits())
    }
}

impl<R: Regs> TxDevice for Igb<R> {
    type Format = crate::format::igb::Advanced;
    fn format(&self) -> Self::Format {
        crate::format::igb::Advanced
    }

    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        check_ring_len(
            "igb TX ring length (descriptors, multiple of 8, 8..=4096)",
            len,
        )?;
        let bytes = u32::from(len) * crate::desc::SIZE as u32;
        if !ring.raw().is_multiple_of(128) {
            return Err(Error::BadConfig {
                what: "igb TX ring address (128-byte aligned)",
                value: ring.raw(),
            });
        }
        if self.ring_len.is_some() {
            // The queue reads the ring attached before: stopped first, so
            // that its owner may free it once this returns. If it does
            // not stop, it stays attached and sending (`detach`).
            self.detach()?;
        }
        self.reg(regs::txdctl(0), 0)?;
        self.reg(regs::tdbal(0), ring.raw() as u32)?;
        self.reg(regs::tdbah(0), (ring.raw() >> 32) as u32)?;
        self.reg(regs::tdlen(0), bytes)?;
        self.reg(regs::tdh(0), 0)?;
        self.reg(regs::tdt(0), 0)?;
        self.reg(regs::txdctl(0), Txdctl::ENABLE.bits())?;
        wait_for("TX queue enable", self.cfg.enable_timeout, || {
            Ok(self.read(regs::txdctl(0))? & Txdctl::ENABLE.bits() != 0)
        })?;
        self.reg(
            regs::TCTL,
            Tctl::EN.bits() | Tctl::PSP.bits() | TCTL_CT | TCTL_COLD,
        )?;
        self.ring_len = Some(len);
        Ok(())
    }

    unsafe fn kick(&mut self, tail: u16) -> Result<()> {
        let len = self.ring_len.ok_or(Error::NotAttached)?;
        if tail >= len {
            return Err(Error::BadConfig {
                what: "TX tail",
                value: u64::from(tail),
            });
        }
        // Descriptors and bounce slots were written with relaxed atomic
        // (or, for a slot not in flight, plain) stores to write-back
        // memory; they must be visible before the doorbell.
        fence(Ordering::SeqCst);
        self.reg(regs::tdt(0), u32::from(tail))
    }

    /// Turns the transmitter off and waits (bounded by the enable
    /// timeout) until the queue's enable bit reads 0: the device no longer
    /// reads the ring. [`Error::DeviceTimeout`] if it does not (or a
    /// register access error), and then the transmitter is switched back
    /// on as it was: the queue stays attached and sending.
    fn detach(&mut self) -> Result<()> {
        let (tctl, txdctl) = (self.read(regs::TCTL)?, self.read(regs::txdctl(0))?);
        if let Err(e) = self.stop_tx() {
            // Best effort: the error that stopped the detach is the one
            // reported.
            let _ = self.reg(regs::txdctl(0), txdctl);
            let _ = self.reg(regs::TCTL, tctl);
            return Err(e);
        }
        self.ring_len = None;
        Ok(())
    }

    fn head(&mut self) -> Option<u16> {
        self.read(regs::tdh(0)).ok().map(|h| h as u16)
    }
}
