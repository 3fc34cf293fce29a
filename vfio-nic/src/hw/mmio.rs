//! Device registers: the one module that maps a BAR and touches it.
//!
//! A [`Bar`] is a PCI memory BAR mapped from a VFIO device file descriptor
//! at the region's offset. Every access is a bounds- and alignment-checked
//! volatile read or write of one width: 32 bits through [`Regs`] (the
//! width the 82576 documents for its registers), and 8, 16 or 32 bits
//! through [`Bar::load`]/[`Bar::store`], as virtio's common configuration
//! asks (each field at its own width).

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
    ///
    /// Crate-private and `unsafe`: [`Bar::load`] and [`Bar::read`] are safe
    /// volatile reads of the mapping, so the mapping must be one whose
    /// every byte can be read. A mapping past the end of an ordinary file
    /// (or of one another process truncates) would make such a read raise
    /// `SIGBUS`.
    ///
    /// # Safety
    /// `fd` is a VFIO device file descriptor, and `offset..offset + len`
    /// is one of its regions that VFIO offers to mmap (flag `MMAP`), whole.
    pub(crate) unsafe fn map(fd: RawFd, offset: u64, len: u64) -> Result<Bar> {
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

    fn check(&self, r: Reg, width: usize) -> Result<usize> {
        let off = r.0 as usize;
        if !off.is_multiple_of(width) || off.checked_add(width).is_none_or(|e| e > self.map.len()) {
            return Err(Error::BadRegister {
                offset: r.0,
                bar_len: self.map.len(),
            });
        }
        Ok(off)
    }

    /// Reads register `r`.
    pub fn read(&self, r: Reg) -> Result<u32> {
        self.load::<u32>(r)
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
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.store::<u32>(r, v) }
    }

    /// Reads the `T` (`u8`, `u16` or `u32`) at `r`, little-endian.
    pub fn load<T: Width>(&self, r: Reg) -> Result<T> {
        let off = self.check(r, size_of::<T>())?;
        // SAFETY: `off + size_of::<T>() <= len` and `off` is aligned to it
        // (checked above); the mapping lives as long as `self`; device
        // registers need a volatile access of exactly this width.
        let v = unsafe { std::ptr::read_volatile(self.map.as_ptr().add(off).cast::<T>()) };
        Ok(v.le_to_native())
    }

    /// Writes the `T` (`u8`, `u16` or `u32`) `v` at `r`, little-endian.
    ///
    /// # Safety
    /// As [`Bar::write`]: the write makes the device read or write no
    /// memory that was not handed to it.
    pub unsafe fn store<T: Width>(&self, r: Reg, v: T) -> Result<()> {
        let off = self.check(r, size_of::<T>())?;
        // SAFETY: as in `load`: in bounds, aligned, mapping alive; writes
        // to device registers must be volatile so none is merged or
        // dropped.
        unsafe {
            std::ptr::write_volatile(self.map.as_mut_ptr().add(off).cast::<T>(), v.native_to_le())
        };
        Ok(())
    }
}

/// The widths a register access may have.
pub trait Width: Copy + private::Sealed {
    /// From little-endian.
    fn le_to_native(self) -> Self;
    /// To little-endian.
    fn native_to_le(self) -> Self;
}

mod private {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for u16 {}
    impl Sealed for u32 {}
}

impl Width for u8 {
    fn le_to_native(self) -> u8 {
        self
    }
    fn native_to_le(self) -> u8 {
        self
    }
}

impl Width for u16 {
    fn le_to_native(self) -> u16 {
        u16::from_le(self)
    }
    fn native_to_le(self) -> u16 {
        u16::to_le(self)
    }
}

impl Width for u32 {
    fn le_to_native(self) -> u32 {
        u32::from_le(self)
    }
    fn native_to_le(self) -> u32 {
        u32::to_le(self)
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
        self.load::<u32>(r)
    }
    unsafe fn write(&self, r: Reg, v: u32) -> Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.store::<u32>(r, v) }
    }
}
