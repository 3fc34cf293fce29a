//! No IOMMU: the device uses host addresses directly.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::{
    DmaMapper, Fault, IovaSpace, MapStats, Mapping, PageSizes, Translate, Translation, Unmapped,
};
use crate::addr::{Iova, VirtAddr, PAGE_SIZE};
use crate::error::{Error, Result};

/// The no-IOMMU mapper: IOVA = host address, nothing is checked on the
/// device side. Map and unmap calls are still counted (a driver still makes
/// them, as `dma_map_*` does with the direct mapping), so the lab can tell
/// how many calls a policy makes even without an IOMMU.
#[derive(Debug, Default)]
pub struct Identity {
    map_calls: AtomicU64,
    unmap_calls: AtomicU64,
}

impl Identity {
    /// A new identity mapper.
    pub fn new() -> Identity {
        Identity::default()
    }
}

impl DmaMapper for Identity {
    fn map(&self, m: &Mapping) -> Result<()> {
        if m.iova.raw() != m.addr.raw() as u64 {
            return Err(Error::Map {
                iova: m.iova,
                len: m.len,
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        self.map_calls.fetch_add(1, Relaxed);
        Ok(())
    }
    fn unmap(&self, _iova: Iova, _len: u64) -> Result<Unmapped> {
        self.unmap_calls.fetch_add(1, Relaxed);
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
            ..MapStats::default()
        }
    }
}

impl Translate for Identity {
    fn translate(&self, iova: Iova, _access: super::Dir) -> Result<Translation, Fault> {
        Ok(Translation {
            addr: VirtAddr(iova.raw() as usize),
            len: PAGE_SIZE - (iova.raw() & (PAGE_SIZE - 1)),
        })
    }
}
