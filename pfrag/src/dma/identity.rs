//! No IOMMU: the device uses host addresses directly.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use super::iotlb::PageHasher;
use super::{
    device_read, device_store_u32, device_write, Dir, DmaMapper, Fault, Fence, IovaSpace, MapStats,
    Mapping, PageSizes, Translate, Translation, Unmapped,
};
use crate::addr::{Iova, VirtAddr, PAGE_SHIFT, PAGE_SIZE};
use crate::error::{Error, Result};

/// The no-IOMMU mapper: IOVA = host address. Map and unmap calls are still
/// counted (a driver still makes them, as `dma_map_*` does with the direct
/// mapping), so the lab can tell how many calls a policy makes even without
/// an IOMMU.
///
/// A real system without an IOMMU lets the NIC reach any memory. A model of
/// it in safe Rust may not: the device side ([`Translate`]) reaches only
/// pages that are mapped now (one hash lookup per page, no IOTLB, no
/// counters), and anything else is a fault.
#[derive(Debug, Default)]
pub struct Identity {
    map_calls: AtomicU64,
    unmap_calls: AtomicU64,
    faults: AtomicU64,
    /// Mapped pages (page number -> allowed directions).
    pages: Mutex<HashMap<u64, Dir, BuildHasherDefault<PageHasher>>>,
    fence: Fence,
}

impl Identity {
    /// A new identity mapper.
    pub fn new() -> Identity {
        Identity::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Dir, BuildHasherDefault<PageHasher>>> {
        // Every update completes before unlocking.
        crate::sync::lock_std(&self.pages)
    }

    /// 4 KiB pages mapped now.
    pub fn mapped_pages(&self) -> u64 {
        self.lock().len() as u64
    }
}

fn einval(iova: Iova, len: u64) -> Error {
    Error::Map {
        iova,
        len,
        source: io::Error::from_raw_os_error(libc::EINVAL),
    }
}

impl DmaMapper for Identity {
    unsafe fn map(&self, m: &Mapping) -> Result<()> {
        let aligned = m.len > 0 && (m.iova.raw() | m.len) % PAGE_SIZE == 0;
        let end = m.iova.raw().checked_add(m.len);
        if m.iova.raw() != m.addr.raw() as u64 || !aligned || end.is_none() || m.dir.is_empty() {
            return Err(einval(m.iova, m.len));
        }
        let first = m.iova.page();
        let n = m.len >> PAGE_SHIFT;
        let mut pages = self.lock();
        if let Some(p) = (first..first + n).find(|p| pages.contains_key(p)) {
            return Err(Error::Map {
                iova: Iova(p << PAGE_SHIFT),
                len: m.len,
                source: io::Error::from_raw_os_error(libc::EEXIST),
            });
        }
        pages.extend((first..first + n).map(|p| (p, m.dir)));
        self.map_calls.fetch_add(1, Relaxed);
        Ok(())
    }

    fn unmap(&self, iova: Iova, len: u64) -> Result<Unmapped> {
        let unmap_err = |code| Error::Unmap {
            iova,
            len,
            source: io::Error::from_raw_os_error(code),
        };
        if len == 0 || (iova.raw() | len) % PAGE_SIZE != 0 || iova.raw().checked_add(len).is_none()
        {
            return Err(unmap_err(libc::EINVAL));
        }
        let first = iova.page();
        let n = len >> PAGE_SHIFT;
        {
            let mut pages = self.lock();
            if !(first..first + n).all(|p| pages.contains_key(&p)) {
                return Err(unmap_err(libc::ENOENT));
            }
            for p in first..first + n {
                pages.remove(&p);
            }
        }
        self.unmap_calls.fetch_add(1, Relaxed);
        self.fence.quiesce();
        Ok(Unmapped::Flushed)
    }
    fn page_sizes(&self) -> PageSizes {
        PageSizes::SIZE_4K | PageSizes::SIZE_2M
    }
    fn iova_space(&self) -> IovaSpace {
        IovaSpace::Identity
    }
    fn flushed_seq(&self) -> u64 {
        0
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn stats(&self) -> MapStats {
        MapStats {
            map_calls: self.map_calls.load(Relaxed),
            unmap_calls: self.unmap_calls.load(Relaxed),
            faults: self.faults.load(Relaxed),
            ..MapStats::default()
        }
    }
}

impl Translate for Identity {
    fn translate(&self, iova: Iova, access: Dir) -> Result<Translation, Fault> {
        match self.lock().get(&iova.page()) {
            Some(d) if d.contains(access) => Ok(Translation {
                addr: VirtAddr(iova.raw() as usize),
                len: PAGE_SIZE - (iova.raw() & (PAGE_SIZE - 1)),
            }),
            _ => {
                self.faults.fetch_add(1, Relaxed);
                Err(Fault { iova, access })
            }
        }
    }
    fn read(&self, iova: Iova, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), Fault> {
        device_read(&self.fence, |i, d| self.translate(i, d), iova, len, f)
    }
    fn write(&self, iova: Iova, src: &[u8]) -> Result<(), Fault> {
        device_write(&self.fence, |i, d| self.translate(i, d), iova, src)
    }
    fn write_u32(&self, iova: Iova, v: u32) -> Result<(), Fault> {
        device_store_u32(&self.fence, |i, d| self.translate(i, d), iova, v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Region;

    /// The first page of `r`, for the device to read, at its own address.
    fn page_to_device(r: &Region) -> Mapping {
        Mapping {
            iova: Iova(r.addr().raw() as u64),
            addr: r.addr(),
            len: 4096,
            dir: Dir::TO_DEVICE,
            huge: false,
        }
    }

    #[test]
    fn device_reaches_only_mapped_pages() {
        let id = Identity::new();
        let r = Region::new(2 * 4096, 4096, false).unwrap();
        let at = Iova(r.addr().raw() as u64);
        // An address nobody mapped: a fault, never a dereference.
        assert!(id.read(Iova(0x1000), 8, &mut |_| {}).is_err());
        assert!(id.read(at, 8, &mut |_| {}).is_err());
        let m = page_to_device(&r);
        // SAFETY: `r` outlives the mapping (unmapped below, before drop).
        unsafe { id.map(&m) }.unwrap();
        let mut seen = 0;
        id.read(at, 4096, &mut |s| seen += s.len()).unwrap();
        assert_eq!(seen, 4096);
        // The second page is not mapped; writing the first is not allowed.
        assert!(id.read(at, 4097, &mut |_| {}).is_err());
        assert!(id.write(at, &[1]).is_err());
        id.unmap(at, 4096).unwrap();
        assert!(id.read(at, 1, &mut |_| {}).is_err());
        assert_eq!(id.stats().faults, 5);
        assert_eq!(id.mapped_pages(), 0);
    }

    #[test]
    fn unmap_of_unmapped_range_fails_and_keeps_others() {
        let id = Identity::new();
        let r = Region::new(4096, 4096, false).unwrap();
        let at = Iova(r.addr().raw() as u64);
        let m = page_to_device(&r);
        // SAFETY: `r` outlives the mapping.
        unsafe { id.map(&m) }.unwrap();
        assert_eq!(id.unmap(at, 8192).unwrap_err().errno(), Some(libc::ENOENT));
        assert!(id.translate(at, Dir::TO_DEVICE).is_ok());
        id.unmap(at, 4096).unwrap();
    }
}
