//! The iommufd backend: [`IommufdMapper`], a [`DmaMapper`] over an IOAS
//! of `/dev/iommu`, for a device opened with
//! [`VfioPci::open_iommufd`] (its VFIO cdev bound to the iommufd and
//! attached to the IOAS). The same pools, queues and drivers run over it
//! as over the type1 container's [`VfioMapper`](super::vfio::VfioMapper).
//!
//! ```no_run
//! use std::sync::Arc;
//! use pfrag::dma::Domain;
//! use vfio_nic::hw::iommufd::IommufdMapper;
//! use vfio_nic::hw::vfio::VfioPci;
//!
//! // The NIC bound to vfio-pci, on a kernel with CONFIG_IOMMUFD and
//! // CONFIG_VFIO_DEVICE_CDEV.
//! let pci = VfioPci::open_iommufd("0000:00:02.0")?;
//! let mapper = IommufdMapper::new(&pci)?;
//! println!("usable IOVA ranges: {:x?}", mapper.ranges());
//! let domain = Arc::new(Domain::new(mapper));
//! # let _ = domain;
//! # Ok::<(), vfio_nic::Error>(())
//! ```
//!
//! What differs from type1: there is no `dma_entry_limit` (a mapping
//! fails when the process runs out of lockable memory or the IOAS of IOVA
//! space instead), and the usable IOVA ranges are the IOAS's
//! (`IOMMU_IOAS_IOVA_RANGES`), narrowed by every device attached.

use std::ops::Range;
use std::sync::Arc;

use iommufd_ioctls::IommuFd;
use pfrag::dma::{DmaMapper, IovaSpace, MapStats, Mapping, PageSizes, Unmapped};
use pfrag::{Iova, OsAdvice};
use vfio_ioctls::VfioIommufd;

use crate::error::{Error, Result};
use crate::hw::access::{check_range, map_request, Counters, MapAccess};
use crate::hw::info::check_ranges;
use crate::hw::ioctl;
use crate::hw::vfio::VfioPci;

/// A [`DmaMapper`] over an iommufd IOAS: every `map` is one
/// `IOMMU_IOAS_MAP` at a fixed IOVA, every `unmap` one `IOMMU_IOAS_UNMAP`.
///
/// Each range is mapped with the narrowest access its direction allows
/// ([`MapAccess::Narrow`]): TX payloads and header slots READABLE only,
/// RX buffers WRITEABLE only, rings both. A mapping with no direction
/// is refused (`EINVAL`) before any ioctl, under either policy.
///
/// Counters as [`VfioMapper`](super::vfio::VfioMapper)'s: ioctls, 4 KiB
/// pages mapped, and one invalidation per unmap that removed (some of)
/// its range (the IOMMU driver syncs the IOTLB for it before the unmap
/// returns). An unmap that removes another size than asked is an error,
/// as on type1 ([`ShortUnmap`](super::vfio::ShortUnmap) its source).
pub struct IommufdMapper {
    /// Keeps the IOAS (and the iommufd) alive while anything is mapped.
    ioas: Arc<VfioIommufd>,
    ranges: Vec<Range<u64>>,
    alignment: u64,
    access: MapAccess,
    c: Counters,
}

impl std::fmt::Debug for IommufdMapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IommufdMapper")
            .field("ioas", &self.ioas_id())
            .field("ranges", &self.ranges)
            .field("alignment", &self.alignment)
            .field("access", &self.access)
            .finish()
    }
}

impl IommufdMapper {
    /// A mapper over `pci`'s IOAS, reading its usable IOVA ranges; every
    /// mapping as narrow as its direction allows. [`Error::WrongBackend`]
    /// for a device opened through a type1 container.
    pub fn new(pci: &VfioPci) -> Result<IommufdMapper> {
        IommufdMapper::with_access(pci, MapAccess::Narrow)
    }

    /// As [`new`](Self::new), with the access policy `access`.
    /// [`Error::OddIovaRanges`] if the IOAS's IOVA ranges overlap, and
    /// [`Error::BadConfig`] for an alignment pfrag's maps cannot keep.
    pub fn with_access(pci: &VfioPci, access: MapAccess) -> Result<IommufdMapper> {
        let ioas = pci.iommufd().ok_or(Error::WrongBackend {
            want: "iommufd",
            have: pci.backend_name(),
        })?;
        let (ranges, alignment) = ioctl::ioas_iova_ranges(ioas.iommufd(), ioas.ioas().id())
            .map_err(|errno| Error::VfioOpen {
                what: "the IOAS's IOVA ranges (IOMMU_IOAS_IOVA_RANGES)".into(),
                errno: Some(errno),
                detail: std::io::Error::from_raw_os_error(errno).to_string(),
            })?;
        check_ioas(&ranges, alignment)?;
        Ok(IommufdMapper {
            ioas: ioas.clone(),
            ranges,
            alignment,
            access,
            c: Counters::default(),
        })
    }

    /// Usable IOVA ranges, end exclusive, as read at creation.
    pub fn ranges(&self) -> &[Range<u64>] {
        &self.ranges
    }

    /// The alignment every mapping's IOVA and length must keep.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The access policy.
    pub fn map_access(&self) -> MapAccess {
        self.access
    }

    /// The IOAS's object ID.
    pub fn ioas_id(&self) -> u32 {
        self.ioas.ioas().id()
    }

    fn fd(&self) -> &IommuFd {
        self.ioas.iommufd()
    }
}

/// Checks what `IOMMU_IOAS_IOVA_RANGES` reported: ranges ascending and
/// disjoint ([`check_ranges`]), and an alignment that pfrag's 4 KiB-aligned
/// maps keep.
fn check_ioas(ranges: &[Range<u64>], alignment: u64) -> Result<()> {
    check_ranges(ranges)?;
    // pfrag maps 4 KiB pages at 4 KiB-aligned IOVAs: an IOAS whose
    // alignment does not divide 4 KiB (larger, or not a power of two)
    // would refuse every map.
    if !pfrag::PAGE_SIZE.is_multiple_of(alignment) {
        return Err(Error::BadConfig {
            what: "IOAS IOVA alignment (a divisor of pfrag's 4 KiB)",
            value: alignment,
        });
    }
    Ok(())
}

/// Advice for an errno of `IOMMU_IOAS_MAP`.
fn map_hint(errno: i32) -> &'static str {
    match errno {
        libc::ENOMEM => {
            "pinning these pages would pass RLIMIT_MEMLOCK: raise it (ulimit -l, or \
             limits.conf) or run with CAP_IPC_LOCK"
        }
        libc::EEXIST => "the IOVA range overlaps an existing mapping of the IOAS",
        libc::EINVAL => {
            "iova, address or length is not aligned to the IOAS's alignment, or the \
             range is outside its usable IOVA ranges"
        }
        libc::ENOSPC => "the IOAS has no room at this IOVA",
        libc::EFAULT => "the host address range is not mapped in this process",
        _ => "IOMMU_IOAS_MAP failed",
    }
}

impl DmaMapper for IommufdMapper {
    unsafe fn map(&self, m: &Mapping) -> pfrag::Result<()> {
        let access = map_request(self.access, m)?;
        // SAFETY: the map lets the device reach `m.addr..+m.len` until the
        // unmap, with the access of `m.dir` (narrowed by `self.access`).
        // Our caller promised (`DmaMapper::map`'s contract) that the memory
        // stays allocated until then, and pfrag keeps it for good if the
        // unmap fails; the CPU reaches ring and bounce memory only through
        // atomics, and a frag is not touched between its post and its
        // completion, while a TX device only reads it.
        let r = unsafe {
            ioctl::ioas_map(
                self.fd(),
                self.ioas_id(),
                m.iova.raw(),
                m.addr.raw() as u64,
                m.len,
                access,
            )
        };
        self.c.map_call(r.is_ok().then_some(m.len));
        match r {
            Ok(()) => Ok(()),
            Err(n) => Err(pfrag::Error::Map {
                iova: m.iova,
                len: m.len,
                source: OsAdvice::io(n, map_hint(n).to_string()),
            }),
        }
    }

    fn unmap(&self, iova: Iova, len: u64) -> pfrag::Result<Unmapped> {
        check_range("unmap length", iova, len)?;
        let r = ioctl::ioas_unmap(self.fd(), self.ioas_id(), iova.raw(), len);
        self.c.unmap("IOMMU_IOAS_UNMAP", iova, len, r)
    }

    fn page_sizes(&self) -> PageSizes {
        PageSizes::SIZE_4K
    }

    fn iova_space(&self) -> IovaSpace {
        IovaSpace::Ranges(self.ranges.clone())
    }

    fn flushed_seq(&self) -> u64 {
        u64::MAX
    }

    fn flush(&self) -> pfrag::Result<()> {
        Ok(())
    }

    fn stats(&self) -> MapStats {
        self.c.stats()
    }
}

/// Bytes still mapped in the IOAS of `mapper`, found by unmapping
/// everything (`IOMMU_IOAS_UNMAP` of the whole space reports what it
/// removed): for a test that checks, at its end, that every mapping was
/// undone. Whatever it finds is unmapped under its owner, whose own unmap
/// then fails (and pfrag keeps that memory out of circulation).
///
/// # Safety
/// No other mapper may map into this IOAS while a pool whose mappings
/// this removes still hands out IOVAs: that pool still counts its IOVAs
/// as mapped, and another mapper's memory mapped there would take the
/// device's accesses meant for the pool (writes, for receive memory).
pub unsafe fn unmap_all(mapper: &IommufdMapper) -> Result<u64> {
    ioctl::ioas_unmap(mapper.fd(), mapper.ioas_id(), 0, u64::MAX).map_err(|errno| Error::VfioOpen {
        what: "IOMMU_IOAS_UNMAP of the whole IOAS".into(),
        errno: Some(errno),
        detail: std::io::Error::from_raw_os_error(errno).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_ioas_ranges_are_refused() {
        check_ioas(&[0x1000..0x10_0000, 0x20_0000..0x30_0000], 4096).unwrap();
        assert!(matches!(
            check_ioas(&[0x1000..0x10_0000, 0x8000..0x30_0000], 4096),
            Err(Error::OddIovaRanges { index: 1, .. })
        ));
    }

    /// pfrag maps at 4 KiB-aligned IOVAs, so only an alignment that
    /// divides 4 KiB lets a map through; the kernel's is a power of two.
    #[test]
    fn an_alignment_that_does_not_divide_4k_is_refused() {
        let r = 0x1000..0x10_0000;
        for a in [1, 8, 4096] {
            check_ioas(std::slice::from_ref(&r), a).unwrap();
        }
        for a in [0x600, 3, 8192, 0] {
            assert!(
                matches!(
                    check_ioas(std::slice::from_ref(&r), a),
                    Err(Error::BadConfig { value, .. }) if value == a
                ),
                "{a:#x}"
            );
        }
    }

    #[test]
    fn hints_name_the_cause() {
        assert!(map_hint(libc::ENOMEM).contains("RLIMIT_MEMLOCK"));
        assert!(map_hint(libc::EEXIST).contains("overlaps"));
        assert!(map_hint(libc::EINVAL).contains("IOVA ranges"));
        assert_eq!(map_hint(libc::EPERM), "IOMMU_IOAS_MAP failed");
    }
}
