//! What several test files share: a software IOMMU behind hooks a test
//! sets, to act as a device or a mapper would at a given moment.

use std::sync::Arc;

use pfrag::dma::{DmaMapper, IovaSpace, MapStats, Mapping, PageSizes, SoftIommu, Unmapped};
use pfrag::Iova;

/// A hook on a mapping: its IOVA.
pub type Hook = Box<dyn Fn(&SoftIommu, Iova) + Send + Sync>;

/// A hook before a map, whose error refuses it.
pub type Gate = Box<dyn Fn(&Mapping) -> pfrag::Result<()> + Send + Sync>;

/// A software IOMMU whose `before_map` runs before each map (and may
/// refuse it), `after_map` after each map installed its translation, and
/// `before_unmap` before each unmap.
pub struct Hooked {
    /// The IOMMU.
    pub iommu: Arc<SoftIommu>,
    /// Runs before each map; its error is the map's.
    pub before_map: Gate,
    /// Runs after each map that succeeded.
    pub after_map: Hook,
    /// Runs before each unmap.
    pub before_unmap: Hook,
}

impl Hooked {
    /// `iommu` with no hooks.
    pub fn new(iommu: Arc<SoftIommu>) -> Hooked {
        Hooked {
            iommu,
            before_map: Box::new(|_| Ok(())),
            after_map: Box::new(|_, _| {}),
            before_unmap: Box::new(|_, _| {}),
        }
    }
}

impl DmaMapper for Hooked {
    unsafe fn map(&self, m: &Mapping) -> pfrag::Result<()> {
        (self.before_map)(m)?;
        // SAFETY: the caller's promise, passed on.
        unsafe { self.iommu.map(m) }?;
        (self.after_map)(&self.iommu, m.iova);
        Ok(())
    }
    fn unmap(&self, iova: Iova, len: u64) -> pfrag::Result<Unmapped> {
        (self.before_unmap)(&self.iommu, iova);
        self.iommu.unmap(iova, len)
    }
    fn page_sizes(&self) -> PageSizes {
        self.iommu.page_sizes()
    }
    fn iova_space(&self) -> IovaSpace {
        self.iommu.iova_space()
    }
    fn flushed_seq(&self) -> u64 {
        self.iommu.flushed_seq()
    }
    fn flush(&self) -> pfrag::Result<()> {
        self.iommu.flush()
    }
    fn stats(&self) -> MapStats {
        self.iommu.stats()
    }
}
