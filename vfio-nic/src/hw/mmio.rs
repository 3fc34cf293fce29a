//! Device registers: the one module that maps a BAR and touches it.
//!
//! A [`Bar`] is a PCI memory BAR mapped from a VFIO device file descriptor
//! at the region's offset. Every access is a bounds- and alignment-checked
//! volatile 32-bit read or write, the width the 82576 documents for its
//! registers.

use std::os::fd::RawFd;

use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Error, Result};

/// A register offset inside BAR0, named after the datasheet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Reg(pub u32);

impl Reg {
    /// The offset in bytes.
    pub const fn offset(self) -> u32 {
        self.0
    }
}

/// A mapped memory BAR.
pub struct Bar {
    map: MmapRaw,
}

impl std::fmt::Debug for Bar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bar").field("len", &self.map.len()).finish()
    }
}

impl Bar {
    /// Maps `len` bytes of the device file `fd` at `offset` (the VFIO
    /// region's offset), shared, readable and writable.
    pub fn map(fd: RawFd, offset: u64, len: u64) -> Result<Bar> {
        let n = usize::try_from(len).map_err(|_| Error::BadConfig {
            what: "BAR length",
            value: len,
        })?;
        if n == 0 {
            return Err(Error::BadConfig {
                what: "BAR length",
                value: 0,
            });
        }
        let map = MmapOptions::new()
            .offset(offset)
            .len(n)
            .map_raw(fd)
            .map_err(|source| Error::BarMap {
                offset,
                len,
                source,
            })?;
        Ok(Bar { map })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True if nothing is mapped (never, for a BAR that mapped).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn check(&self, r: Reg) -> Result<usize> {
        let off = r.0 as usize;
        if off % 4 != 0 || off + 4 > self.map.len() {
            return Err(Error::BadRegister {
                offset: r.0,
                bar_len: self.map.len(),
            });
        }
        Ok(off)
    }

    /// Reads register `r`.
    pub fn read(&self, r: Reg) -> Result<u32> {
        self.load(r)
    }

    /// Writes `v` to register `r`.
    ///
    /// # Safety
    /// A register write can point the device's DMA engines at any IOVA and
    /// ring their doorbells (an 82576's TDBAL/TDT, RDBAL/RDT): the caller
    /// promises that the write makes the device read or write no memory
    /// that was not handed to it (a ring or buffer the caller keeps for the
    /// device until it stops it).
    pub unsafe fn write(&self, r: Reg, v: u32) -> Result<()> {
        self.store(r, v)
    }

    fn load(&self, r: Reg) -> Result<u32> {
        let off = self.check(r)?;
        // SAFETY: `off + 4 <= len` and `off` is 4-aligned (checked above);
        // the mapping lives as long as `self`; device registers need a
        // volatile access of exactly this width.
        let v = unsafe { std::ptr::read_volatile(self.map.as_ptr().add(off).cast::<u32>()) };
        Ok(u32::from_le(v))
    }

    fn store(&self, r: Reg, v: u32) -> Result<()> {
        let off = self.check(r)?;
        // SAFETY: as in `read`: in bounds, aligned, mapping alive; writes to
        // device registers must be volatile so none is merged or dropped.
        unsafe {
            std::ptr::write_volatile(self.map.as_mut_ptr().add(off).cast::<u32>(), v.to_le())
        };
        Ok(())
    }
}

/// Register access: what a driver needs of a device's registers. The BAR
/// implements it with volatile MMIO; a test can implement it with an
/// in-memory model of the device, so bring-up logic is tested on any host.
pub trait Regs {
    /// Reads register `r`.
    fn read(&self, r: Reg) -> Result<u32>;
    /// Writes `v` to register `r`.
    ///
    /// # Safety
    /// A register write can point the device's DMA engines at any IOVA and
    /// ring their doorbells (an 82576's TDBAL/TDT, RDBAL/RDT): the caller
    /// promises that the write makes the device read or write no memory
    /// that was not handed to it (a ring or buffer the caller keeps for the
    /// device until it stops it).
    unsafe fn write(&self, r: Reg, v: u32) -> Result<()>;
}

impl Regs for Bar {
    fn read(&self, r: Reg) -> Result<u32> {
        self.load(r)
    }
    unsafe fn write(&self, r: Reg, v: u32) -> Result<()> {
        self.store(r, v)
    }
}
