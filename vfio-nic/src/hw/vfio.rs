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
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pfrag::dma::{DmaMapper, IovaSpace, MapStats, Mapping, PageSizes, Unmapped};
use pfrag::{Iova, OsAdvice};
use vfio_bindings::bindings::vfio::{
    vfio_info_cap_header, vfio_iommu_type1_info, vfio_iova_range, VFIO_BASE, VFIO_IOMMU_INFO_CAPS,
    VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE, VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL,
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_REGION_INFO_FLAG_MMAP,
    VFIO_TYPE,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioError};

use crate::error::{Error, Result};
use crate::hw::mmio::{Bar, Reg, Regs};

/// `VFIO_IOMMU_GET_INFO`: `_IO(VFIO_TYPE, VFIO_BASE + 12)`.
const VFIO_IOMMU_GET_INFO: u64 = ((VFIO_TYPE as u64) << 8) | (VFIO_BASE as u64 + 12);

/// PCI command register offset in config space, and its bits.
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;

/// The module parameter that caps mappings per container.
pub const DMA_ENTRY_LIMIT: &str = "/sys/module/vfio_iommu_type1/parameters/dma_entry_limit";

/// A PCI device opened through VFIO: its container, the device, and BAR0.
pub struct VfioPci {
    bdf: String,
    group: u32,
    container: Arc<VfioContainer>,
    device: VfioDevice,
    bar0: Bar,
}

impl std::fmt::Debug for VfioPci {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioPci")
            .field("bdf", &self.bdf)
            .field("group", &self.group)
            .field("bar0", &self.bar0)
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
            errno: std::error::Error::source(&other)
                .and_then(|s| s.downcast_ref::<vmm_sys_util::errno::Error>())
                .map(|e| e.errno()),
            detail: other.to_string(),
        },
    }
}

impl VfioPci {
    /// Opens the device at PCI address `bdf` (`0000:00:02.0`): finds its
    /// IOMMU group, opens a new type1 container with that group, gets the
    /// device, enables memory decoding and bus mastering, and maps BAR0.
    pub fn open(bdf: &str) -> Result<VfioPci> {
        let sys = PathBuf::from("/sys/bus/pci/devices").join(bdf);
        if !sys.exists() {
            return Err(Error::DeviceMissing { bdf: bdf.into() });
        }
        let group = iommu_group(&sys, bdf)?;
        let dev_node = PathBuf::from(format!("/dev/vfio/{group}"));
        if !dev_node.exists() {
            let driver = std::fs::read_link(sys.join("driver"))
                .ok()
                .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "none".into());
            return Err(Error::GroupMissing {
                bdf: bdf.into(),
                group,
                driver,
            });
        }
        let container = Arc::new(VfioContainer::new(None).map_err(|e| open_err(bdf, group, e))?);
        let device =
            VfioDevice::new(&sys, container.clone(), false).map_err(|e| open_err(bdf, group, e))?;
        let bar0 = map_bar0(&device)?;
        let pci = VfioPci {
            bdf: bdf.into(),
            group,
            container,
            device,
            bar0,
        };
        pci.enable_bus_master();
        Ok(pci)
    }

    fn enable_bus_master(&self) {
        let mut cmd = [0u8; 2];
        self.device
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, &mut cmd, PCI_COMMAND);
        let v = u16::from_le_bytes(cmd) | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
        self.device
            .region_write(VFIO_PCI_CONFIG_REGION_INDEX, &v.to_le_bytes(), PCI_COMMAND);
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
    pub fn bar0(&self) -> &Bar {
        &self.bar0
    }

    /// The container (the IOMMU domain of the device).
    pub fn container(&self) -> &Arc<VfioContainer> {
        &self.container
    }
}

impl Regs for VfioPci {
    fn read(&self, r: Reg) -> Result<u32> {
        self.bar0().read(r)
    }
    fn write(&self, r: Reg, v: u32) -> Result<()> {
        self.bar0().write(r, v)
    }
}

fn iommu_group(sys: &Path, bdf: &str) -> Result<u32> {
    let link = std::fs::read_link(sys.join("iommu_group"))
        .map_err(|_| Error::NoIommuGroup { bdf: bdf.into() })?;
    link.file_name()
        .and_then(|s| s.to_str())
        .and_then(|s| s.parse().ok())
        .ok_or(Error::NoIommuGroup { bdf: bdf.into() })
}

fn map_bar0(device: &VfioDevice) -> Result<Bar> {
    let idx = VFIO_PCI_BAR0_REGION_INDEX;
    let flags = device.get_region_flags(idx);
    if flags & VFIO_REGION_INFO_FLAG_MMAP == 0 {
        return Err(Error::BarNotMappable { index: idx, flags });
    }
    Bar::map(
        device.as_raw_fd(),
        device.get_region_offset(idx),
        device.get_region_size(idx),
    )
}

/// What `VFIO_IOMMU_GET_INFO` reports about a container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IommuInfo {
    /// Page sizes the IOMMU maps (bit n set: 2^n bytes).
    pub page_sizes: u64,
    /// Usable IOVA ranges, end exclusive (reserved regions such as the MSI
    /// window are holes between them).
    pub ranges: Vec<Range<u64>>,
    /// Mappings the container may still create (`dma_entry_limit` minus
    /// those in use), when the kernel reports it.
    pub dma_avail: Option<u32>,
}

/// Reads `VFIO_IOMMU_GET_INFO` of `container`, with its capability chain.
pub fn iommu_info(container: &VfioContainer) -> Result<IommuInfo> {
    let hdr = std::mem::size_of::<vfio_iommu_type1_info>();
    // u64 words keep the buffer 8-byte aligned, as the kernel's structs are.
    let mut buf: Vec<u64> = vec![0; 512];
    loop {
        let argsz = (buf.len() * 8) as u32;
        buf.iter_mut().for_each(|w| *w = 0);
        buf[0] = u64::from(argsz);
        // SAFETY: the ioctl number is VFIO_IOMMU_GET_INFO, whose argument is
        // a vfio_iommu_type1_info of `argsz` bytes that the kernel fills in
        // and never writes past; `buf` is that many bytes, aligned to 8.
        let ret = unsafe {
            libc::ioctl(
                container.as_raw_fd(),
                VFIO_IOMMU_GET_INFO as _,
                buf.as_mut_ptr(),
            )
        };
        if ret != 0 {
            return Err(Error::IommuInfo {
                errno: std::io::Error::last_os_error().raw_os_error(),
            });
        }
        let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_le_bytes()).collect();
        let need = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
        if need as usize > bytes.len() {
            buf = vec![0; (need as usize).div_ceil(8)];
            continue;
        }
        return Ok(parse_iommu_info(&bytes[..need.max(hdr as u32) as usize]));
    }
}

fn le32(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

fn le64(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// Parses the bytes `VFIO_IOMMU_GET_INFO` returned: a
/// `vfio_iommu_type1_info` with its capability chain (IOVA ranges,
/// DMA-avail count). Never panics, and bounded in time, on any input: a
/// looping or truncated chain ends the parse, and a range count larger
/// than the buffer holds reads only what is there.
pub fn parse_iommu_info(b: &[u8]) -> IommuInfo {
    let flags = le32(b, 4).unwrap_or(0);
    let mut info = IommuInfo {
        page_sizes: le64(b, 8).unwrap_or(0),
        ..IommuInfo::default()
    };
    if flags & VFIO_IOMMU_INFO_CAPS == 0 {
        return info;
    }
    let caph = std::mem::size_of::<vfio_info_cap_header>();
    let mut at = le32(b, 16).unwrap_or(0) as usize;
    let mut hops = 0;
    while at != 0 && at + caph <= b.len() && hops < 64 {
        hops += 1;
        let id = u32::from(u16::from_le_bytes([b[at], b[at + 1]]));
        let next = le32(b, at + 4).unwrap_or(0) as usize;
        if id == VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE && info.ranges.is_empty() {
            // The kernel reports one range capability; a repeated one is
            // malformed and ignored.
            let first = at + caph + 8;
            let step = std::mem::size_of::<vfio_iova_range>();
            let room = b.len().saturating_sub(first) / step;
            let n = (le32(b, at + caph).unwrap_or(0) as usize).min(room);
            for i in 0..n {
                let off = first + i * step;
                if let (Some(s), Some(e)) = (le64(b, off), le64(b, off + 8)) {
                    // The kernel's ranges are inclusive.
                    info.ranges.push(s..e.saturating_add(1));
                }
            }
        } else if id == VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL {
            info.dma_avail = le32(b, at + caph);
        }
        if next <= at {
            break;
        }
        at = next;
    }
    info
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

#[derive(Default)]
struct Counters {
    map_calls: AtomicU64,
    unmap_calls: AtomicU64,
    pages: AtomicU64,
}

/// A [`DmaMapper`] over a VFIO type1 container: every `map` is one
/// `VFIO_IOMMU_MAP_DMA` ioctl, every `unmap` one `VFIO_IOMMU_UNMAP_DMA`,
/// and a batch is one ioctl per contiguous run.
///
/// Counters: `map_calls`/`unmap_calls` are ioctls; `ptes_written` is 4 KiB
/// pages mapped; `invalidations` counts unmap ioctls, since the type1
/// driver ends each unmap with one IOTLB sync of its range in strict mode
/// (what the IOMMU itself did is read from QEMU's trace in `vm/run.sh
/// sweep`). The IOTLB is in the IOMMU, out of sight: hits and misses stay 0.
///
/// The container maps every range readable and writable by the device
/// (`vfio-ioctls` sets both flags); the requested direction is not narrowed.
pub struct VfioMapper {
    container: Arc<VfioContainer>,
    info: IommuInfo,
    c: Counters,
}

impl std::fmt::Debug for VfioMapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioMapper")
            .field("info", &self.info)
            .finish()
    }
}

impl VfioMapper {
    /// A mapper over `pci`'s container, reading its usable IOVA ranges.
    pub fn new(pci: &VfioPci) -> Result<VfioMapper> {
        let info = iommu_info(&pci.container)?;
        Ok(VfioMapper {
            container: pci.container.clone(),
            info,
            c: Counters::default(),
        })
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

fn errno(e: &VfioError) -> i32 {
    match e {
        VfioError::IommuDmaMap(s) | VfioError::IommuDmaUnmap(s) => s.errno(),
        VfioError::InvalidDmaUnmapSize => libc::EINVAL,
        _ => libc::EIO,
    }
}

impl DmaMapper for VfioMapper {
    unsafe fn map(&self, m: &Mapping) -> pfrag::Result<()> {
        let len = usize::try_from(m.len).map_err(|_| pfrag::Error::OutOfRange {
            what: "mapping length",
            value: m.len,
            min: 1,
            max: usize::MAX as u64,
        })?;
        // SAFETY: vfio_dma_map lets the device reach `m.addr..+len` until
        // the unmap. Our caller promised (`DmaMapper::map`'s contract) that
        // the memory stays allocated until then: pfrag's pools and
        // `Coherent` regions retire the mapping before freeing or releasing
        // it, and keep it for good if the unmap fails. Rings and bounce slots are touched only with volatile
        // accesses. A frag's slice is written by the driver before its IOVA
        // is put in a descriptor and not touched again until completion;
        // a TX device only reads it in between, and the IOMMU confines any
        // device access to these ranges.
        let r = unsafe {
            self.container
                .vfio_dma_map(m.iova.raw(), len, m.addr.raw() as *mut u8)
        };
        self.c.map_calls.fetch_add(1, Ordering::Relaxed);
        match r {
            Ok(()) => {
                self.c
                    .pages
                    .fetch_add(m.len.div_ceil(pfrag::PAGE_SIZE), Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                let n = errno(&e);
                Err(pfrag::Error::Map {
                    iova: m.iova,
                    len: m.len,
                    source: OsAdvice::io(n, map_hint(n)),
                })
            }
        }
    }

    fn unmap(&self, iova: Iova, len: u64) -> pfrag::Result<Unmapped> {
        let n = usize::try_from(len).map_err(|_| pfrag::Error::OutOfRange {
            what: "unmap length",
            value: len,
            min: 1,
            max: usize::MAX as u64,
        })?;
        self.c.unmap_calls.fetch_add(1, Ordering::Relaxed);
        match self.container.vfio_dma_unmap(iova.raw(), n) {
            Ok(()) => Ok(Unmapped::Flushed),
            Err(e) => {
                let n = errno(&e);
                Err(pfrag::Error::Unmap {
                    iova,
                    len,
                    source: OsAdvice::io(
                        n,
                        "VFIO_IOMMU_UNMAP_DMA refused: the range must match whole earlier mappings",
                    ),
                })
            }
        }
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
        let unmaps = self.c.unmap_calls.load(Ordering::Relaxed);
        MapStats {
            map_calls: self.c.map_calls.load(Ordering::Relaxed),
            unmap_calls: unmaps,
            ptes_written: self.c.pages.load(Ordering::Relaxed),
            invalidations: unmaps,
            ..MapStats::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push32(v: &mut Vec<u8>, x: u32) {
        v.extend_from_slice(&x.to_le_bytes());
    }
    fn push64(v: &mut Vec<u8>, x: u64) {
        v.extend_from_slice(&x.to_le_bytes());
    }

    /// A GET_INFO answer laid out as the kernel writes it: header, then an
    /// IOVA-range capability with two ranges, then a DMA-avail capability.
    #[test]
    fn parses_capability_chain() {
        let mut b = Vec::new();
        push32(&mut b, 0); // argsz, patched below
        push32(&mut b, VFIO_IOMMU_INFO_CAPS | 1);
        push64(&mut b, (1 << 12) | (1 << 21) | (1 << 30));
        push32(&mut b, 24); // cap_offset
        push32(&mut b, 0);
        // IOVA range cap at 24: header(8) + nr(4) + reserved(4) + 2*16.
        let dma_at = 24 + 16 + 32;
        b.extend_from_slice(&(VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE as u16).to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        push32(&mut b, dma_at as u32);
        push32(&mut b, 2);
        push32(&mut b, 0);
        push64(&mut b, 0);
        push64(&mut b, 0xfedf_ffff);
        push64(&mut b, 0xfef0_0000);
        push64(&mut b, (1 << 39) - 1);
        b.extend_from_slice(&(VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL as u16).to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        push32(&mut b, 0);
        push32(&mut b, 65_530);
        push32(&mut b, 0);
        let n = b.len() as u32;
        b[0..4].copy_from_slice(&n.to_le_bytes());
        let info = parse_iommu_info(&b);
        assert_eq!(info.page_sizes, (1 << 12) | (1 << 21) | (1 << 30));
        assert_eq!(info.ranges, vec![0..0xfee0_0000, 0xfef0_0000..(1 << 39)]);
        assert_eq!(info.dma_avail, Some(65_530));
    }

    #[test]
    fn no_caps_flag_means_no_ranges() {
        let mut b = Vec::new();
        push32(&mut b, 24);
        push32(&mut b, 1);
        push64(&mut b, 1 << 12);
        push32(&mut b, 24);
        push32(&mut b, 0);
        let info = parse_iommu_info(&b);
        assert!(info.ranges.is_empty());
        assert_eq!(info.dma_avail, None);
    }

    #[test]
    fn looping_chain_stops() {
        let mut b = Vec::new();
        push32(&mut b, 40);
        push32(&mut b, VFIO_IOMMU_INFO_CAPS);
        push64(&mut b, 1 << 12);
        push32(&mut b, 24);
        push32(&mut b, 0);
        b.extend_from_slice(&(VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL as u16).to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        push32(&mut b, 24); // points at itself
        push32(&mut b, 7);
        push32(&mut b, 0);
        let info = parse_iommu_info(&b);
        assert_eq!(info.dma_avail, Some(7));
    }

    #[test]
    fn hints_name_the_cause() {
        assert!(map_hint(libc::ENOSPC).contains("dma_entry_limit"));
        assert!(map_hint(libc::ENOMEM).contains("RLIMIT_MEMLOCK"));
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
