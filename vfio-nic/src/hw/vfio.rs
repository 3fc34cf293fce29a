//! The VFIO backend: a container, group and device opened with
//! `vfio-ioctls`, BAR0 mapped (see [`mmio`](crate::hw::mmio)), and
//! [`VfioMapper`], a [`DmaMapper`] over the type1 IOMMU of the container.
//!
//! ```no_run
//! use std::sync::Arc;
//! use pfrag::dma::Domain;
//! use vfio_nic::hw::vfio::{VfioMapper, VfioPci};
//!
//! // The NIC must be bound to vfio-pci first, e.g.
//! //   echo 8086 10c9 > /sys/bus/pci/drivers/vfio-pci/new_id
//! let pci = VfioPci::open("0000:00:02.0")?;
//! let mapper = VfioMapper::new(&pci)?;
//! println!("usable IOVA ranges: {:x?}", mapper.ranges());
//! let domain = Arc::new(Domain::new(mapper));
//! # let _ = domain;
//! # Ok::<(), vfio_nic::Error>(())
//! ```

use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use pfrag::dma::{DmaMapper, IovaSpace, MapStats, Mapping, PageSizes, Unmapped};
use pfrag::{Iova, OsAdvice};
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_BAR5_REGION_INDEX, VFIO_REGION_INFO_FLAG_MMAP,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioError, VfioIommufd};

use crate::error::{Error, Result};
use crate::hw::access::{check_range, map_request, Counters};
pub use crate::hw::access::{MapAccess, ShortUnmap};
use crate::hw::ioctl;
use crate::hw::mmio::{Bar, Reg, Regs};
use crate::hw::pci;
use crate::hw::sysfs::{bound, iommu_group, sysfs_dir};

pub use crate::hw::info::{
    check_page_sizes, check_ranges, iommu_info, parse_iommu_info, IommuInfo,
};

/// The module parameter that caps mappings per container.
pub const DMA_ENTRY_LIMIT: &str = "/sys/module/vfio_iommu_type1/parameters/dma_entry_limit";

/// A PCI device opened through VFIO: its container, the device, and its
/// memory BARs that VFIO lets us map.
pub struct VfioPci {
    bdf: String,
    group: u32,
    // Dropped before the device: VFIO releases the group only once no
    // mapping of the device file is left.
    bars: Vec<BarSlot>,
    /// Shared with the type1 mappers made over it ([`VfioMapper`]), which
    /// keep it open: see there.
    device: Arc<VfioDevice>,
    backend: Backend,
}

/// Where a device's DMA mappings go.
#[derive(Clone)]
enum Backend {
    /// A type1 container (`/dev/vfio/vfio` and the group).
    Type1(Arc<VfioContainer>),
    /// An IOAS of iommufd (`/dev/iommu`), the device opened through its
    /// cdev (`/dev/vfio/devices/vfioN`).
    Iommufd(Arc<VfioIommufd>),
}

/// One BAR of a device: mapped, not offered for mapping, or its mmap
/// failed (kept to report when the BAR is used).
#[derive(Debug)]
enum BarSlot {
    Mapped(Bar),
    NotMappable,
    Failed { offset: u64, len: u64, errno: i32 },
}

impl std::fmt::Debug for VfioPci {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioPci")
            .field("bdf", &self.bdf)
            .field("group", &self.group)
            .field("backend", &self.backend_name())
            .field("bars", &self.bars)
            .finish()
    }
}

fn open_err(bdf: &str, group: u32, e: VfioError) -> Error {
    match e {
        VfioError::GroupViable => Error::GroupNotViable { group },
        VfioError::OpenContainer(source) => Error::VfioOpen {
            what: "/dev/vfio/vfio (is the vfio module loaded?)".into(),
            errno: source.raw_os_error(),
            detail: source.to_string(),
        },
        other => Error::VfioOpen {
            what: format!("device {bdf} in group {group}"),
            errno: ioctl::errno_in(&other),
            detail: other.to_string(),
        },
    }
}

impl VfioPci {
    /// Opens the device at PCI address `bdf` (`0000:00:02.0`): finds its
    /// IOMMU group, opens a new type1 container with that group, gets the
    /// device, enables memory decoding and bus mastering, and maps every
    /// BAR that VFIO offers to map (an 82576's BAR0, a virtio device's
    /// modern BAR). [`Error::BadBdf`] for a `bdf` that is not a PCI
    /// address as sysfs names it (a short `00:02.0` or a path included).
    pub fn open(bdf: &str) -> Result<VfioPci> {
        let (sys, group) = bound(bdf)?;
        let container = Arc::new(VfioContainer::new(None).map_err(|e| open_err(bdf, group, e))?);
        let device =
            VfioDevice::new(&sys, container.clone(), false).map_err(|e| open_err(bdf, group, e))?;
        VfioPci::with(bdf, group, Backend::Type1(container), Arc::new(device))
    }

    /// Opens the device at `bdf` through iommufd instead of a type1
    /// container: opens `/dev/iommu`, allocates an IOAS, opens the device's
    /// cdev (`/dev/vfio/devices/vfioN`), binds it to the iommufd and
    /// attaches it to the IOAS; then as [`open`](Self::open). Needs a
    /// kernel with `CONFIG_IOMMUFD` and `CONFIG_VFIO_DEVICE_CDEV`.
    pub fn open_iommufd(bdf: &str) -> Result<VfioPci> {
        // No group node is needed: a kernel may have cdevs and no groups.
        let sys = sysfs_dir(bdf)?;
        if !sys.exists() {
            return Err(Error::DeviceMissing { bdf: bdf.into() });
        }
        let group = iommu_group(&sys, bdf)?;
        let iommufd = iommufd_ioctls::IommuFd::new().map_err(|e| Error::VfioOpen {
            what: "/dev/iommu (is the kernel built with CONFIG_IOMMUFD?)".into(),
            errno: Some(ioctl::iommufd_errno(&e)),
            detail: e.to_string(),
        })?;
        let ioas =
            VfioIommufd::new(Arc::new(iommufd), None, None).map_err(|e| open_err(bdf, group, e))?;
        let ioas = Arc::new(ioas);
        if !sys.join("vfio-dev").exists() {
            return Err(Error::VfioOpen {
                what: format!("the VFIO cdev of {bdf}"),
                errno: Some(libc::ENOENT),
                detail: format!(
                    "{} is missing: bind the device to vfio-pci, on a kernel built with \
                     CONFIG_VFIO_DEVICE_CDEV",
                    sys.join("vfio-dev").display()
                ),
            });
        }
        let device =
            VfioDevice::new(&sys, ioas.clone(), true).map_err(|e| open_err(bdf, group, e))?;
        VfioPci::with(bdf, group, Backend::Iommufd(ioas), Arc::new(device))
    }

    /// The opened device, its BARs mapped and bus mastering on.
    fn with(bdf: &str, group: u32, backend: Backend, device: Arc<VfioDevice>) -> Result<VfioPci> {
        let bars = map_bars(&device);
        let pci = VfioPci {
            bdf: bdf.into(),
            group,
            bars,
            device,
            backend,
        };
        pci.enable_bus_master()?;
        Ok(pci)
    }

    /// Turns on memory decoding and bus mastering, keeping the command
    /// register's other bits, and checks that they took.
    fn enable_bus_master(&self) -> Result<()> {
        let (file, region) = pci::ConfigRegion::of(&self.device)?;
        let read = || {
            let mut cmd = [0u8; 2];
            region.read(&file, pci::COMMAND, &mut cmd)?;
            Ok::<_, Error>(u16::from_le_bytes(cmd))
        };
        let v = pci::enabling(&self.bdf, read()?)?;
        region.write(&file, pci::COMMAND, &v.to_le_bytes())?;
        pci::check_enabled(&self.bdf, v, read()?)
    }

    /// The device's PCI address.
    pub fn bdf(&self) -> &str {
        &self.bdf
    }

    /// Its IOMMU group number.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// BAR0, mapped.
    pub fn bar0(&self) -> Result<&Bar> {
        self.bar(0)
    }

    /// BAR `index` (0..=5), mapped; [`Error::BarNotMappable`] if VFIO
    /// offered no mapping of it (an I/O BAR, the upper half of a 64-bit
    /// BAR, or none).
    pub fn bar(&self, index: u32) -> Result<&Bar> {
        match self.bars.get(index as usize) {
            Some(BarSlot::Mapped(b)) => Ok(b),
            Some(&BarSlot::Failed { offset, len, errno }) => Err(Error::BarMap {
                offset,
                len,
                source: std::io::Error::from_raw_os_error(errno),
            }),
            _ => Err(Error::BarNotMappable {
                index,
                flags: self.device.get_region_flags(index),
            }),
        }
    }

    /// Reads `buf.len()` bytes of PCI configuration space at `offset`:
    /// all of them, or [`Error::OutOfRange`] for bytes outside the
    /// region, [`Error::ConfigSpace`] (with the errno) for a read that
    /// failed.
    pub fn config_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (file, region) = pci::ConfigRegion::of(&self.device)?;
        region.read(&file, offset, buf)
    }

    /// The PCI vendor and device IDs.
    pub fn ids(&self) -> Result<(u16, u16)> {
        let mut b = [0u8; 4];
        self.config_read(0, &mut b)?;
        Ok((
            u16::from_le_bytes([b[0], b[1]]),
            u16::from_le_bytes([b[2], b[3]]),
        ))
    }

    /// The type1 container (the IOMMU domain of the device), if it was
    /// opened with [`open`](Self::open).
    pub(crate) fn container(&self) -> Option<&Arc<VfioContainer>> {
        match &self.backend {
            Backend::Type1(c) => Some(c),
            Backend::Iommufd(_) => None,
        }
    }

    /// The iommufd and IOAS of the device, if it was opened with
    /// [`open_iommufd`](Self::open_iommufd).
    pub(crate) fn iommufd(&self) -> Option<&Arc<VfioIommufd>> {
        match &self.backend {
            Backend::Iommufd(i) => Some(i),
            Backend::Type1(_) => None,
        }
    }

    /// `"type1"` or `"iommufd"`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Type1(_) => "type1",
            Backend::Iommufd(_) => "iommufd",
        }
    }
}

impl Regs for VfioPci {
    fn read(&self, r: Reg) -> Result<u32> {
        self.bar0()?.read(r)
    }
    unsafe fn write(&self, r: Reg, v: u32) -> Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.bar0()?.write(r, v) }
    }
}

/// Maps each of BARs 0..=5 that VFIO offers to mmap (flag `MMAP`, size
/// not 0). A BAR whose mmap fails is kept as the error, reported when the
/// BAR is used: a device is not refused for a BAR its driver never needs.
fn map_bars(device: &VfioDevice) -> Vec<BarSlot> {
    (VFIO_PCI_BAR0_REGION_INDEX..=VFIO_PCI_BAR5_REGION_INDEX)
        .map(|idx| {
            let flags = device.get_region_flags(idx);
            let (offset, len) = (device.get_region_offset(idx), device.get_region_size(idx));
            if flags & VFIO_REGION_INFO_FLAG_MMAP == 0 || len == 0 {
                return BarSlot::NotMappable;
            }
            // SAFETY: the fd is the VFIO device's, and `offset..offset +
            // len` is its region `idx` whole, which VFIO offers to mmap.
            match unsafe { Bar::map(device.as_raw_fd(), offset, len) } {
                Ok(b) => BarSlot::Mapped(b),
                Err(e) => BarSlot::Failed {
                    offset,
                    len,
                    errno: e.errno().unwrap_or(libc::EINVAL),
                },
            }
        })
        .collect()
}

/// Reads the type1 module's `dma_entry_limit`.
pub fn dma_entry_limit() -> std::io::Result<u32> {
    let s = std::fs::read_to_string(DMA_ENTRY_LIMIT)?;
    s.trim()
        .parse()
        .map_err(|_| std::io::Error::other(format!("{DMA_ENTRY_LIMIT}: {s:?}")))
}

/// Sets the type1 module's `dma_entry_limit` (root only). Containers opened
/// afterwards get the new limit.
pub fn set_dma_entry_limit(n: u32) -> std::io::Result<()> {
    std::fs::write(DMA_ENTRY_LIMIT, n.to_string())
}

/// A [`DmaMapper`] over a VFIO type1 container: every `map` is one
/// `VFIO_IOMMU_MAP_DMA` ioctl, every `unmap` one `VFIO_IOMMU_UNMAP_DMA`,
/// and a batch is one ioctl per contiguous run. An unmap that succeeds
/// but removes another size than asked is an error ([`ShortUnmap`] its
/// source, with both sizes): the range is kept out of circulation, as
/// after any failed unmap.
///
/// Counters: `map_calls`/`unmap_calls` are ioctls; `ptes_written` is 4 KiB
/// pages mapped; `invalidations` counts unmap ioctls that removed (some
/// of) their range, since the type1 driver ends each with one IOTLB sync
/// of it in strict mode (what the IOMMU itself did is read from QEMU's trace in
/// `vm/run.sh sweep`). The IOTLB is in the IOMMU, out of sight: hits and
/// misses stay 0.
///
/// Each range is mapped with the narrowest access its direction allows
/// ([`MapAccess::Narrow`]): TX payloads and header slots read-only, RX
/// buffers write-only, rings both. A mapping with no direction is
/// refused (`EINVAL`) before any ioctl, under either policy.
///
/// The mapper keeps the device it was made over open, even once its
/// [`VfioPci`] is dropped: closing the device takes its group out of the
/// container, and when the last group leaves, the type1 driver removes
/// every mapping of the container. The memory still mapped through the
/// mapper (a pool's chunks, a ring, dropped after the device as a queue
/// drops) could then never be unmapped, so it would be kept for good. The
/// device closes, and its group leaves the container, when the last
/// mapper made over it is dropped (with the [`Domain`](pfrag::dma::Domain)
/// holding it): the same device cannot be opened again before then
/// (`EBUSY`).
pub struct VfioMapper {
    container: Arc<VfioContainer>,
    info: IommuInfo,
    access: MapAccess,
    c: Counters,
    /// The device, kept open for the container's mappings (above).
    _device: Arc<VfioDevice>,
}

impl std::fmt::Debug for VfioMapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioMapper")
            .field("info", &self.info)
            .field("access", &self.access)
            .finish()
    }
}

impl VfioMapper {
    /// A mapper over `pci`'s container, reading its usable IOVA ranges;
    /// every mapping as narrow as its direction allows.
    pub fn new(pci: &VfioPci) -> Result<VfioMapper> {
        VfioMapper::with_access(pci, MapAccess::Narrow)
    }

    /// As [`new`](Self::new), with the access policy `access`.
    /// [`Error::WrongBackend`] for a device opened through iommufd (see
    /// [`IommufdMapper`](crate::hw::iommufd::IommufdMapper)), and
    /// [`Error::OddIovaRanges`] if the kernel's IOVA ranges overlap, and
    /// [`Error::BadConfig`] for an IOMMU whose smallest page passes 4 KiB
    /// ([`check_page_sizes`]).
    pub fn with_access(pci: &VfioPci, access: MapAccess) -> Result<VfioMapper> {
        let container = pci.container().ok_or(Error::WrongBackend {
            want: "type1",
            have: pci.backend_name(),
        })?;
        let info = iommu_info(container)?;
        check_ranges(&info.ranges)?;
        check_page_sizes(info.page_sizes)?;
        Ok(VfioMapper {
            container: container.clone(),
            info,
            access,
            c: Counters::default(),
            _device: pci.device.clone(),
        })
    }

    /// The access policy.
    pub fn map_access(&self) -> MapAccess {
        self.access
    }

    /// Usable IOVA ranges, end exclusive.
    pub fn ranges(&self) -> &[Range<u64>] {
        &self.info.ranges
    }

    /// The info read at creation.
    pub fn info(&self) -> &IommuInfo {
        &self.info
    }

    /// Mappings the container may still create, read now.
    pub fn dma_avail(&self) -> Result<Option<u32>> {
        Ok(iommu_info(&self.container)?.dma_avail)
    }
}

/// Advice for an errno of `VFIO_IOMMU_MAP_DMA`.
fn map_hint(errno: i32) -> String {
    match errno {
        libc::ENOSPC => format!(
            "the container holds as many mappings as the type1 dma_entry_limit allows \
             ({}); map fewer, larger ranges (a persistent pfrag pool) or raise {DMA_ENTRY_LIMIT}",
            dma_entry_limit().map_or_else(|_| "unknown".into(), |n| n.to_string())
        ),
        libc::ENOMEM => "pinning these pages would pass RLIMIT_MEMLOCK: raise it \
             (ulimit -l, or limits.conf) or run with CAP_IPC_LOCK"
            .into(),
        libc::EEXIST => "the IOVA range overlaps an existing mapping".into(),
        libc::EINVAL => {
            "iova, address or length is not page-aligned, or outside the usable IOVA ranges".into()
        }
        libc::EFAULT => "the host address range is not mapped in this process".into(),
        _ => "VFIO_IOMMU_MAP_DMA failed".into(),
    }
}

impl DmaMapper for VfioMapper {
    unsafe fn map(&self, m: &Mapping) -> pfrag::Result<()> {
        let access = map_request(self.access, m)?;
        let len = usize::try_from(m.len).map_err(|_| pfrag::Error::OutOfRange {
            what: "mapping length",
            value: m.len,
            min: 1,
            max: usize::MAX as u64,
        })?;
        // SAFETY: the map lets the device reach `m.addr..+len` until the
        // unmap, with the access of `m.dir` (narrowed by `self.access`).
        // Our caller promised (`DmaMapper::map`'s contract) that the memory
        // stays allocated until then: pfrag's pools and `Coherent` regions
        // retire the mapping before freeing or releasing it, and keep it for
        // good if the unmap fails. Rings are touched only with atomic
        // accesses, and a bounce slot is written with plain copies only
        // while it is not in flight. A frag's slice is written by the driver
        // before its IOVA is put in a descriptor and not touched again until
        // completion; a TX device only reads it in between (a TO_DEVICE
        // range is read-only to it), and the IOMMU confines any device
        // access to these ranges.
        let r = unsafe {
            ioctl::dma_map(
                self.container.as_raw_fd(),
                m.iova.raw(),
                m.addr.raw() as u64,
                len as u64,
                access,
            )
        };
        self.c.map_call(r.is_ok().then_some(m.len));
        match r {
            Ok(()) => Ok(()),
            Err(n) => Err(pfrag::Error::Map {
                iova: m.iova,
                len: m.len,
                source: OsAdvice::io(n, map_hint(n)),
            }),
        }
    }

    fn unmap(&self, iova: Iova, len: u64) -> pfrag::Result<Unmapped> {
        check_range("unmap length", iova, len)?;
        let r = ioctl::dma_unmap(&self.container, iova.raw(), len);
        self.c.unmap("VFIO_IOMMU_UNMAP_DMA", iova, len, r)
    }

    fn page_sizes(&self) -> PageSizes {
        let mut p = PageSizes::empty();
        if self.info.page_sizes & (1 << 12) != 0 {
            p |= PageSizes::SIZE_4K;
        }
        if self.info.page_sizes & (1 << 21) != 0 {
            p |= PageSizes::SIZE_2M;
        }
        if p.is_empty() {
            PageSizes::SIZE_4K
        } else {
            p
        }
    }

    fn iova_space(&self) -> IovaSpace {
        if self.info.ranges.is_empty() {
            // Older kernels give no range capability: the low 4 GiB minus
            // the x86 MSI window is safe everywhere.
            let low: Range<u64> = 0x10_0000..0xfee0_0000;
            IovaSpace::Ranges(vec![low])
        } else {
            IovaSpace::Ranges(self.info.ranges.clone())
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What the open failed with, for each kind of source a
    /// `vfio-ioctls` error carries: a group another process holds
    /// (`EBUSY`), a cdev this user may not open (`EACCES`), an iommufd
    /// that could not allocate (`ENOMEM`, two levels down) all lost their
    /// errno, which only a system call's error kept.
    #[test]
    fn an_open_error_carries_the_errno_whatever_its_source() {
        use iommufd_ioctls::IommufdError;
        use vmm_sys_util::errno::Error as SysError;
        let io = std::io::Error::from_raw_os_error;
        let cases = [
            (
                VfioError::OpenGroup(io(libc::EBUSY), "5".into()),
                libc::EBUSY,
            ),
            (VfioError::OpenDeviceCdev(io(libc::EACCES)), libc::EACCES),
            (
                VfioError::NewVfioIommufd(IommufdError::IommuIoasAlloc(SysError::new(
                    libc::ENOMEM,
                ))),
                libc::ENOMEM,
            ),
            (
                VfioError::GroupGetDeviceFD(SysError::new(libc::ENODEV)),
                libc::ENODEV,
            ),
        ];
        for (e, want) in cases {
            let shown = e.to_string();
            let got = open_err("0000:00:02.0", 5, e);
            assert_eq!(got.errno(), Some(want), "{shown}: {got}");
            assert!(matches!(got, Error::VfioOpen { .. }), "{got}");
        }
        let e = open_err("0000:00:02.0", 5, VfioError::GroupViable);
        assert!(matches!(e, Error::GroupNotViable { group: 5 }), "{e}");
    }

    #[test]
    fn hints_name_the_cause() {
        assert!(map_hint(libc::ENOMEM).contains("RLIMIT_MEMLOCK"));
        assert!(map_hint(libc::EEXIST).contains("overlaps"));
        let e = pfrag::Error::Map {
            iova: Iova(0x1000),
            len: 0x1000,
            source: OsAdvice::io(libc::ENOMEM, map_hint(libc::ENOMEM)),
        };
        assert_eq!(e.errno(), Some(libc::ENOMEM));
        let s = e.to_string();
        assert!(s.contains("errno Some(12)"), "{s}");
        assert!(s.contains("RLIMIT_MEMLOCK"), "{s}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads the type1 dma_entry_limit from /sys")]
    fn mapping_limit_hint_names_the_limit() {
        assert!(map_hint(libc::ENOSPC).contains("dma_entry_limit"));
        let e = pfrag::Error::Map {
            iova: Iova(0x1000),
            len: 0x1000,
            source: OsAdvice::io(libc::ENOSPC, map_hint(libc::ENOSPC)),
        };
        assert_eq!(e.errno(), Some(libc::ENOSPC));
        let s = e.to_string();
        assert!(s.contains("errno Some(28)"), "{s}");
        assert!(s.contains("dma_entry_limit"), "{s}");
    }
}
