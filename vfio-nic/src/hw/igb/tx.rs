//! The 82576's transmit queue 0 as a [`TxDevice`]: attaching a ring (and
//! undoing an attach that fails part-way), the doorbell and the stop.

use super::*;

/// TX queue 0's ring registers, as [`Igb::attach`](TxDevice::attach)
/// writes them: base low and high, length, head and tail.
const TX_RING_REGS: [Reg; 5] = [
    regs::tdbal(0),
    regs::tdbah(0),
    regs::tdlen(0),
    regs::tdh(0),
    regs::tdt(0),
];

impl<R: Regs> Igb<R> {
    /// Turns the transmitter off and waits (bounded) until the TX queue's
    /// enable bit reads 0, as [`stop_rx`](Self::stop_rx) does for RX.
    pub(super) fn stop_tx(&self) -> Result<()> {
        self.reg(regs::TCTL, 0)?;
        self.reg(regs::txdctl(0), 0)?;
        self.wait_stopped("TX queue disable", regs::txdctl(0), Txdctl::ENABLE.bits())
    }

    /// Points TX queue 0 at the `len` descriptors at `ring`, enables it,
    /// waits (bounded) until the enable reads back, and turns the
    /// transmitter on.
    ///
    /// # Safety
    /// As [`TxDevice::attach`], for `ring`.
    unsafe fn program_tx(&self, ring: Iova, len: u16) -> Result<()> {
        let bytes = u32::from(len) * crate::desc::SIZE as u32;
        let values = [ring.raw() as u32, (ring.raw() >> 32) as u32, bytes, 0, 0];
        for (r, v) in TX_RING_REGS.into_iter().zip(values) {
            self.reg(r, v)?;
        }
        self.reg(regs::txdctl(0), Txdctl::ENABLE.bits())?;
        wait_for("TX queue enable", self.cfg.enable_timeout, || {
            Ok(self.read(regs::txdctl(0))? & Txdctl::ENABLE.bits() != 0)
        })?;
        self.reg(
            regs::TCTL,
            Tctl::EN.bits() | Tctl::PSP.bits() | TCTL_CT | TCTL_COLD,
        )
    }
}

impl<R: Regs> TxDevice for Igb<R> {
    type Format = crate::format::igb::Advanced;
    fn format(&self) -> Self::Format {
        crate::format::igb::Advanced
    }

    /// Stops the queue first, whatever ring it reads, as
    /// [`detach`](TxDevice::detach) does (one that does not stop is that
    /// error, the queue left as it was), then points it at `ring` and
    /// enables it. A ring the 82576 cannot take (its length, its
    /// alignment) is refused before any register is written. An attach
    /// that fails after the queue was pointed at `ring` stops it again,
    /// waiting until it reads disabled, and puts the ring registers back
    /// as they were; a queue that does not stop then is
    /// [`Error::StopFailed`], and it may still read `ring`, which the
    /// caller keeps for good ([`tx::Queue`](crate::tx::Queue) does).
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        check_ring_len(
            "igb TX ring length (descriptors, multiple of 8, 8..=4096)",
            len,
        )?;
        if !ring.raw().is_multiple_of(128) {
            return Err(Error::BadConfig {
                what: "igb TX ring address (128-byte aligned)",
                value: ring.raw(),
            });
        }
        // The queue may read a ring attached before (or the ring of an
        // attach whose stop failed): stopped first, so that its owner may
        // free it once this returns.
        self.detach()?;
        let saved = self.save(TX_RING_REGS)?;
        // SAFETY: the caller's promise for `ring` is passed on unchanged.
        if let Err(error) = unsafe { self.program_tx(ring, len) } {
            return Err(self.undo(|| self.stop_tx(), (TX_RING_REGS, saved), error));
        }
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
