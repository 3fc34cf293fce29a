//! How the driver reaches a virtio device's common configuration and
//! notification area: [`PciTransport`] over the BARs of a VFIO device, or
//! an in-memory model in tests.

use crate::error::{Error, Result};
use crate::hw::mmio::{Bar, Reg, Width};
use crate::hw::vfio::VfioPci;

use super::caps::{self, Caps, Region};

/// Access to a virtio device's common configuration and notifications.
pub trait Transport {
    /// Reads the field of width `W` at `off` of the common configuration.
    fn common_read<W: Width>(&self, off: u32) -> Result<W>;
    /// Writes the field of width `W` at `off` of the common configuration.
    ///
    /// # Safety
    /// A write can set a queue's ring addresses and enable it: the caller
    /// promises that the device reads or writes no memory that was not
    /// handed to it.
    unsafe fn common_write<W: Width>(&self, off: u32, v: W) -> Result<()>;
    /// The byte offset in the notification area of a queue whose
    /// `queue_notify_off` is `queue_off`; an error if it lies outside.
    fn notify_offset(&self, queue_off: u32) -> Result<u32>;
    /// Writes `v` at byte `off` of the notification area.
    ///
    /// # Safety
    /// A notification makes the device read the queue's available ring:
    /// as [`TxDevice::kick`](crate::device::TxDevice::kick).
    unsafe fn notify<W: Width>(&self, off: u32, v: W) -> Result<()>;
    /// Reads (and so clears) the ISR status byte; `None` if the device
    /// has none.
    fn isr(&self) -> Result<Option<u8>>;
}

/// The modern virtio PCI transport over a device opened with VFIO.
#[derive(Debug)]
pub struct PciTransport {
    pci: VfioPci,
    caps: Caps,
}

impl PciTransport {
    /// Reads the device's capabilities and checks that the structures it
    /// names lie inside BARs that are mapped.
    pub fn new(pci: VfioPci) -> Result<PciTransport> {
        let mut cfg = vec![0u8; 256];
        pci.config_read(0, &mut cfg)?;
        let caps = caps::parse(&cfg)?;
        let t = PciTransport { pci, caps };
        t.bar_of(caps.common, "common configuration", 0x38)?;
        t.bar_of(caps.notify, "notification area", 2)?;
        Ok(t)
    }

    /// The structures, as the capabilities place them.
    pub fn caps(&self) -> &Caps {
        &self.caps
    }

    /// The VFIO device.
    pub fn pci(&self) -> &VfioPci {
        &self.pci
    }

    /// The BAR that holds `r`, checked to hold at least `need` bytes of it.
    fn bar_of(&self, r: Region, what: &'static str, need: u32) -> Result<&Bar> {
        let bar = self.pci.bar(u32::from(r.bar))?;
        let end = u64::from(r.offset) + u64::from(r.length);
        if r.length < need || end > bar.len() as u64 {
            return Err(Error::VirtioCap { what });
        }
        Ok(bar)
    }

    /// The register at `off` of region `r`, for an access of `W`.
    fn reg<W: Width>(&self, r: Region, off: u32, what: &'static str) -> Result<(&Bar, Reg)> {
        let bar = self.bar_of(r, what, 0)?;
        let w = size_of::<W>() as u32;
        let at = r.offset.checked_add(off);
        match at {
            Some(at) if off.checked_add(w).is_some_and(|e| e <= r.length) => Ok((bar, Reg(at))),
            _ => Err(Error::BadRegister {
                offset: off,
                bar_len: r.length as usize,
            }),
        }
    }
}

impl Transport for PciTransport {
    fn common_read<W: Width>(&self, off: u32) -> Result<W> {
        let (bar, reg) = self.reg::<W>(self.caps.common, off, "common configuration")?;
        bar.load(reg)
    }

    unsafe fn common_write<W: Width>(&self, off: u32, v: W) -> Result<()> {
        let (bar, reg) = self.reg::<W>(self.caps.common, off, "common configuration")?;
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { bar.store(reg, v) }
    }

    fn notify_offset(&self, queue_off: u32) -> Result<u32> {
        let off = queue_off.checked_mul(self.caps.notify_mult).filter(|o| {
            o.checked_add(2)
                .is_some_and(|e| e <= self.caps.notify.length)
        });
        off.ok_or(Error::VirtioCap {
            what: "notification address for the queue (outside the notify area)",
        })
    }

    unsafe fn notify<W: Width>(&self, off: u32, v: W) -> Result<()> {
        let (bar, reg) = self.reg::<W>(self.caps.notify, off, "notification area")?;
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { bar.store(reg, v) }
    }

    fn isr(&self) -> Result<Option<u8>> {
        let Some(r) = self.caps.isr else {
            return Ok(None);
        };
        let (bar, reg) = self.reg::<u8>(r, 0, "ISR status")?;
        bar.load(reg).map(Some)
    }
}
