//! The raw VFIO and iommufd ioctls this crate issues itself, where
//! `vfio-ioctls` has no call for what is needed: `VFIO_IOMMU_GET_INFO` with
//! its capability chain, `VFIO_IOMMU_MAP_DMA` and `IOMMU_IOAS_MAP` with a
//! chosen access (the crate's own maps always ask for read and write), and
//! `IOMMU_IOAS_IOVA_RANGES`, and `VFIO_IOMMU_UNMAP_DMA` with the size the
//! kernel unmapped (the crate's own unmap only says whether it matched).
//! Every `ioctl(2)` this crate issues itself is here, or called from here
//! through `iommufd-ioctls`; the rest (opening the container, group and
//! device) are `vfio-ioctls`' calls, made from [`vfio`](super::vfio).

use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};

use iommufd_bindings::{
    iommu_ioas_iova_ranges, iommu_ioas_map, iommu_ioas_unmap, iommu_iova_range,
    iommufd_ioas_map_flags_IOMMU_IOAS_MAP_FIXED_IOVA as MAP_FIXED_IOVA,
    iommufd_ioas_map_flags_IOMMU_IOAS_MAP_READABLE as MAP_READABLE,
    iommufd_ioas_map_flags_IOMMU_IOAS_MAP_WRITEABLE as MAP_WRITEABLE, IOMMUFD_CMD_IOAS_IOVA_RANGES,
    IOMMUFD_TYPE,
};
use iommufd_ioctls::{IommuFd, IommufdError};

use vfio_bindings::bindings::vfio::{
    vfio_iommu_type1_dma_map, vfio_iommu_type1_dma_unmap, vfio_iommu_type1_info, VFIO_BASE,
    VFIO_DMA_MAP_FLAG_READ, VFIO_DMA_MAP_FLAG_WRITE, VFIO_TYPE,
};

/// `VFIO_IOMMU_GET_INFO`: `_IO(VFIO_TYPE, VFIO_BASE + 12)`.
const VFIO_IOMMU_GET_INFO: u64 = ((VFIO_TYPE as u64) << 8) | (VFIO_BASE as u64 + 12);
/// `VFIO_IOMMU_MAP_DMA`: `_IO(VFIO_TYPE, VFIO_BASE + 13)`.
const VFIO_IOMMU_MAP_DMA: u64 = ((VFIO_TYPE as u64) << 8) | (VFIO_BASE as u64 + 13);

/// `VFIO_IOMMU_UNMAP_DMA`: `_IO(VFIO_TYPE, VFIO_BASE + 14)`.
const VFIO_IOMMU_UNMAP_DMA: u64 = ((VFIO_TYPE as u64) << 8) | (VFIO_BASE as u64 + 14);

/// `IOMMU_IOAS_IOVA_RANGES`: `_IO(IOMMUFD_TYPE, IOMMUFD_CMD_IOAS_IOVA_RANGES)`.
const IOMMU_IOAS_IOVA_RANGES: u64 =
    ((IOMMUFD_TYPE as u64) << 8) | IOMMUFD_CMD_IOAS_IOVA_RANGES as u64;

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

impl Access {
    /// The flags of `IOMMU_IOAS_MAP` at a fixed IOVA.
    pub fn ioas_flags(self) -> u32 {
        MAP_FIXED_IOVA
            | match self {
                Access::Read => MAP_READABLE,
                Access::Write => MAP_WRITEABLE,
                Access::ReadWrite => MAP_READABLE | MAP_WRITEABLE,
            }
    }
}

/// The errno inside an `iommufd-ioctls` error (EIO if it has none).
pub(crate) fn iommufd_errno(e: &IommufdError) -> i32 {
    errno_in(e).unwrap_or(libc::EIO)
}

/// The first errno along `e`'s chain of sources, `e` itself first: a
/// system call's error (`vmm-sys-util`'s) or an OS error (`std::io`'s),
/// however deep the `vfio-ioctls` or `iommufd-ioctls` error holds it.
pub(crate) fn errno_in(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    if let Some(sys) = e.downcast_ref::<vmm_sys_util::errno::Error>() {
        return Some(sys.errno());
    }
    if let Some(n) = e
        .downcast_ref::<std::io::Error>()
        .and_then(|io| io.raw_os_error())
    {
        return Some(n);
    }
    errno_in(e.source()?)
}

/// `IOMMU_IOAS_MAP` of `vaddr..vaddr+size` at the fixed `iova` of IOAS
/// `ioas` with `access`. Returns the errno on failure.
///
/// # Safety
/// As [`dma_map`]: the memory stays allocated until the range is unmapped,
/// and no Rust reference to it is live while the device may write it.
pub(crate) unsafe fn ioas_map(
    iommufd: &IommuFd,
    ioas: u32,
    iova: u64,
    vaddr: u64,
    size: u64,
    access: Access,
) -> Result<(), i32> {
    let map = iommu_ioas_map {
        size: std::mem::size_of::<iommu_ioas_map>() as u32,
        flags: access.ioas_flags(),
        ioas_id: ioas,
        __reserved: 0,
        user_va: vaddr,
        length: size,
        iova,
    };
    // `map_iommu_ioas` is a safe function of `iommufd-ioctls`, though it
    // lets the device reach the memory: what that may do is the caller's
    // promise above.
    iommufd.map_iommu_ioas(&map).map_err(|e| iommufd_errno(&e))
}

/// `IOMMU_IOAS_UNMAP` of `iova..iova+size` in IOAS `ioas`: the bytes
/// unmapped, or the errno. `iova` 0 and `size` `u64::MAX` unmap everything.
pub(crate) fn ioas_unmap(iommufd: &IommuFd, ioas: u32, iova: u64, size: u64) -> Result<u64, i32> {
    let mut unmap = iommu_ioas_unmap {
        size: std::mem::size_of::<iommu_ioas_unmap>() as u32,
        ioas_id: ioas,
        iova,
        length: size,
    };
    iommufd
        .unmap_iommu_ioas(&mut unmap)
        .map_err(|e| iommufd_errno(&e))?;
    Ok(unmap.length)
}

/// `IOMMU_IOAS_IOVA_RANGES` of IOAS `ioas`: the usable IOVA ranges (end
/// exclusive) and the alignment every mapping's start and length must
/// keep. Returns the errno on failure.
pub(crate) fn ioas_iova_ranges(
    iommufd: &IommuFd,
    ioas: u32,
) -> Result<(Vec<Range<u64>>, u64), i32> {
    let mut room = 8usize;
    loop {
        let mut out = vec![iommu_iova_range { start: 0, last: 0 }; room];
        let mut arg = iommu_ioas_iova_ranges {
            size: std::mem::size_of::<iommu_ioas_iova_ranges>() as u32,
            ioas_id: ioas,
            num_iovas: room as u32,
            __reserved: 0,
            allowed_iovas: out.as_mut_ptr() as u64,
            out_iova_alignment: 0,
        };
        // SAFETY: the ioctl number is IOMMU_IOAS_IOVA_RANGES, whose
        // argument is an iommu_ioas_iova_ranges of `size` bytes; the kernel
        // writes at most `num_iovas` iommu_iova_range entries at
        // `allowed_iovas`, which is `out`, that long and alive for the
        // call.
        let ret =
            unsafe { libc::ioctl(iommufd.as_raw_fd(), IOMMU_IOAS_IOVA_RANGES as _, &mut arg) };
        let n = arg.num_iovas as usize;
        match ret {
            0 => {
                out.truncate(n.min(room));
                let ranges = out
                    .iter()
                    .map(|r| r.start..r.last.saturating_add(1))
                    .collect();
                return Ok((ranges, arg.out_iova_alignment.max(1)));
            }
            _ if last_errno() == libc::EMSGSIZE && n > room && n <= 4096 => room = n,
            _ => return Err(last_errno()),
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
/// failure: `EINVAL`, without a call, for an `argsz` shorter than the
/// kernel's struct or longer than `buf`.
pub(crate) fn iommu_get_info(
    container: &vfio_ioctls::VfioContainer,
    buf: &mut [u64],
) -> Result<(), i32> {
    check_info_argsz(buf)?;
    let fd = container.as_raw_fd();
    // SAFETY: the descriptor is a VFIO container's (the type says so), on
    // which the ioctl number is VFIO_IOMMU_GET_INFO, whose argument is a
    // vfio_iommu_type1_info of `argsz` bytes that the kernel fills in and
    // never writes past; `buf` holds at least that many bytes (checked
    // above), aligned to 8 as the kernel's structs.
    let ret = unsafe { libc::ioctl(fd, VFIO_IOMMU_GET_INFO as _, buf.as_mut_ptr()) };
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// `EINVAL` unless `buf`'s `argsz` (its first word's low half) is at
/// least the kernel's `vfio_iommu_type1_info` and at most `buf`'s length.
fn check_info_argsz(buf: &[u64]) -> Result<(), i32> {
    let argsz = buf.first().map_or(0, |w| *w as u32) as usize;
    let min = std::mem::size_of::<vfio_iommu_type1_info>();
    if argsz < min || argsz > std::mem::size_of_val(buf) {
        return Err(libc::EINVAL);
    }
    Ok(())
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

/// `VFIO_IOMMU_UNMAP_DMA` of `iova..iova+size` on `container`: the bytes
/// the kernel unmapped (it writes them back into the argument's `size`),
/// or the errno.
pub(crate) fn dma_unmap(
    container: &vfio_ioctls::VfioContainer,
    iova: u64,
    size: u64,
) -> Result<u64, i32> {
    let mut arg = vfio_iommu_type1_dma_unmap {
        argsz: std::mem::size_of::<vfio_iommu_type1_dma_unmap>() as u32,
        flags: 0,
        iova,
        size,
        ..Default::default()
    };
    // SAFETY: the descriptor is a VFIO container's (the type says so), on
    // which the ioctl number is VFIO_IOMMU_UNMAP_DMA, whose argument is a
    // vfio_iommu_type1_dma_unmap of `argsz` bytes; with no flags the
    // kernel reads nothing past it, and writes back only its `size`.
    // `arg` is one, alive for the call. Removing a mapping lets the device
    // reach no memory it could not reach before.
    let ret = unsafe { libc::ioctl(container.as_raw_fd(), VFIO_IOMMU_UNMAP_DMA as _, &mut arg) };
    if ret == 0 {
        Ok(arg.size)
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
        assert_eq!(VFIO_IOMMU_UNMAP_DMA, 0x3b72);
    }

    #[test]
    fn access_flags_are_narrow() {
        assert_eq!(Access::Read.flags(), 1);
        assert_eq!(Access::Write.flags(), 2);
        assert_eq!(Access::ReadWrite.flags(), 3);
        // <linux/iommufd.h>: FIXED_IOVA 1, WRITEABLE 2, READABLE 4.
        assert_eq!(Access::Read.ioas_flags(), 1 | 4);
        assert_eq!(Access::Write.ioas_flags(), 1 | 2);
        assert_eq!(Access::ReadWrite.ioas_flags(), 1 | 2 | 4);
    }

    /// A safe call never lets the kernel write past its buffer: an
    /// `argsz` longer than the buffer (or shorter than the kernel's
    /// struct) is `EINVAL` before any ioctl.
    #[test]
    fn iommu_get_info_refuses_an_argsz_its_buffer_cannot_hold() {
        let mut buf = vec![0u64; 4];
        buf[0] = 4096;
        assert_eq!(check_info_argsz(&buf), Err(libc::EINVAL));
        buf[0] = 8;
        assert_eq!(check_info_argsz(&buf), Err(libc::EINVAL));
        buf[0] = 32;
        assert_eq!(check_info_argsz(&buf), Ok(()));
        assert_eq!(check_info_argsz(&[]), Err(libc::EINVAL));
    }

    #[test]
    fn iommufd_ioctl_numbers_are_the_kernels() {
        // From <linux/iommufd.h>: IOMMUFD_TYPE ';', IOMMUFD_CMD_BASE 0x80,
        // IOAS_IOVA_RANGES the fifth command.
        assert_eq!(IOMMU_IOAS_IOVA_RANGES, 0x3b84);
    }
}
