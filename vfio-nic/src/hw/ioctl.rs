//! The raw VFIO ioctls this crate issues itself, where `vfio-ioctls` has
//! no call for what is needed: `VFIO_IOMMU_GET_INFO` with its capability
//! chain, and `VFIO_IOMMU_MAP_DMA` with a chosen access (the crate's own
//! map always asks for read and write). Every `ioctl(2)` of this crate is
//! here.

use std::os::fd::RawFd;

use vfio_bindings::bindings::vfio::{
    vfio_iommu_type1_dma_map, VFIO_BASE, VFIO_DMA_MAP_FLAG_READ, VFIO_DMA_MAP_FLAG_WRITE, VFIO_TYPE,
};

/// `VFIO_IOMMU_GET_INFO`: `_IO(VFIO_TYPE, VFIO_BASE + 12)`.
const VFIO_IOMMU_GET_INFO: u64 = ((VFIO_TYPE as u64) << 8) | (VFIO_BASE as u64 + 12);
/// `VFIO_IOMMU_MAP_DMA`: `_IO(VFIO_TYPE, VFIO_BASE + 13)`.
const VFIO_IOMMU_MAP_DMA: u64 = ((VFIO_TYPE as u64) << 8) | (VFIO_BASE as u64 + 13);

/// What the device may do to a mapping: the flags of `VFIO_IOMMU_MAP_DMA`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The device may only read (`VFIO_DMA_MAP_FLAG_READ`): TX buffers.
    Read,
    /// The device may only write (`VFIO_DMA_MAP_FLAG_WRITE`): RX buffers.
    Write,
    /// Both: descriptor rings the device writes back to.
    ReadWrite,
}

impl Access {
    /// The map flags.
    pub fn flags(self) -> u32 {
        match self {
            Access::Read => VFIO_DMA_MAP_FLAG_READ,
            Access::Write => VFIO_DMA_MAP_FLAG_WRITE,
            Access::ReadWrite => VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
        }
    }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// `VFIO_IOMMU_GET_INFO` on `container` into `buf`, whose first word's low
/// half must hold `argsz` (its length in bytes). Returns the errno on
/// failure.
pub(crate) fn iommu_get_info(container: RawFd, buf: &mut [u64]) -> Result<(), i32> {
    debug_assert!(u64::from(buf.first().map_or(0, |w| *w as u32)) <= (buf.len() * 8) as u64);
    // SAFETY: the ioctl number is VFIO_IOMMU_GET_INFO, whose argument is a
    // vfio_iommu_type1_info of `argsz` bytes that the kernel fills in and
    // never writes past; `buf` holds at least that many bytes (the caller
    // wrote argsz from its length), aligned to 8 as the kernel's structs.
    let ret = unsafe { libc::ioctl(container, VFIO_IOMMU_GET_INFO as _, buf.as_mut_ptr()) };
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// `VFIO_IOMMU_MAP_DMA` on `container`: the device may reach
/// `vaddr..vaddr+size` at `iova` with `access`. Returns the errno on
/// failure.
///
/// # Safety
/// The memory at `vaddr..vaddr+size` must stay allocated until the range
/// is unmapped, and no Rust reference to it may be live while the device
/// may write it (`Access::Write` or `ReadWrite`); with `Access::Read` the
/// IOMMU refuses every device write.
pub(crate) unsafe fn dma_map(
    container: RawFd,
    iova: u64,
    vaddr: u64,
    size: u64,
    access: Access,
) -> Result<(), i32> {
    let arg = vfio_iommu_type1_dma_map {
        argsz: std::mem::size_of::<vfio_iommu_type1_dma_map>() as u32,
        flags: access.flags(),
        vaddr,
        iova,
        size,
    };
    // SAFETY: the ioctl number is VFIO_IOMMU_MAP_DMA, whose argument is a
    // vfio_iommu_type1_dma_map that the kernel only reads; `arg` is one,
    // alive for the call, with argsz its size. What the mapping lets the
    // device reach is the caller's promise above.
    let ret = unsafe { libc::ioctl(container, VFIO_IOMMU_MAP_DMA as _, &arg) };
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        // From <linux/vfio.h>: VFIO_TYPE ';' (0x3b), VFIO_BASE 100.
        assert_eq!(VFIO_IOMMU_GET_INFO, 0x3b70);
        assert_eq!(VFIO_IOMMU_MAP_DMA, 0x3b71);
    }

    #[test]
    fn access_flags_are_narrow() {
        assert_eq!(Access::Read.flags(), 1);
        assert_eq!(Access::Write.flags(), 2);
        assert_eq!(Access::ReadWrite.flags(), 3);
    }
}
