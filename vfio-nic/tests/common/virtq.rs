//! A virtio-net model on a virtqueue written by hand, with no TX queue in
//! front of it, and an IOMMU view that faults the device's writes at one
//! offset of a page (a used entry that cannot be written).

use std::sync::Arc;

use pfrag::dma::{
    Coherent, Dir, Domain, Fault, Hold, SoftIommu, SoftIommuConfig, Translate, Translation,
};
use pfrag::Iova;
use vfio_nic::device::TxDevice;
use vfio_nic::format::virtio::{Layout, Split, HDR_LEN};
use vfio_nic::format::Format;
use vfio_nic::model::softnic;
use vfio_nic::model::virtio::VirtioNet;

/// The software IOMMU the raw queues map through.
pub type Iommu = Arc<SoftIommu>;

/// Descriptors in the table.
pub const SIZE: u16 = 8;

/// A virtio-net model attached to a hand-written virtqueue, and a buffer
/// of packets beside it. The model translates through `T`, a view of the
/// IOMMU that `ring` and `buf` are mapped in.
pub struct RawQueue<T: Translate = Iommu> {
    pub layout: Layout,
    pub ring: Coherent<Iommu>,
    pub buf: Coherent<Iommu>,
    pub nic: VirtioNet<T>,
    pub posted: u16,
}

impl RawQueue {
    /// A ring the device may read and write, translated as mapped.
    pub fn new() -> RawQueue {
        RawQueue::over(Dir::BIDIRECTIONAL, |i| i)
    }
}

impl<T: Translate> RawQueue<T> {
    /// A ring mapped with `dir` for the device, which translates through
    /// `view` of the IOMMU.
    pub fn over(dir: Dir, view: impl FnOnce(Iommu) -> T) -> RawQueue<T> {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let domain = Arc::new(Domain::new(iommu.clone()));
        let ring = Coherent::new(domain.clone(), Split::ring_bytes(SIZE), dir);
        let buf = Coherent::new(domain, 4096, Dir::TO_DEVICE).unwrap();
        let cfg = softnic::Config {
            capture: true,
            verify: false,
            ..softnic::Config::default()
        };
        let mut nic = VirtioNet::new(view(iommu), cfg).unwrap();
        let ring = ring.unwrap();
        // SAFETY: `ring` is this test's, kept for the device until it drops.
        unsafe { nic.attach(ring.iova(), SIZE) }.unwrap();
        RawQueue {
            layout: Layout::new(SIZE),
            ring,
            buf,
            nic,
            posted: 0,
        }
    }

    /// Writes descriptor `i` of the table: `len` bytes at buffer offset
    /// `off`, with `flags` and `next`.
    pub fn desc(&self, i: u16, off: usize, len: u32, flags: u16, next: u16) {
        let at = usize::from(i) * 16;
        let addr = self.buf.iova().raw() + off as u64;
        self.ring.write_u64(at, addr).unwrap();
        let word = u64::from(len) | u64::from(flags) << 32 | u64::from(next) << 48;
        self.ring.write_u64(at + 8, word).unwrap();
    }

    /// A raw frame of `len` bytes behind a header asking for nothing, at
    /// buffer offset `off`.
    pub fn packet(&self, off: usize, len: usize) -> usize {
        let mut p = vec![0u8; HDR_LEN + len];
        for (i, b) in p[HDR_LEN..].iter_mut().enumerate() {
            *b = i as u8;
        }
        self.buf.write(off, &p).unwrap();
        p.len()
    }

    /// Publishes chains with these heads in the available ring.
    pub fn publish(&mut self, heads: &[u16]) {
        for &h in heads {
            let at = self.layout.avail_entry(self.posted % SIZE);
            self.ring.write(at, &h.to_le_bytes()).unwrap();
            self.posted = self.posted.wrapping_add(1);
        }
        self.set_avail_idx(self.posted);
    }

    /// Writes the available ring's index.
    pub fn set_avail_idx(&self, idx: u16) {
        let idx = idx.to_le_bytes();
        self.ring.write(self.layout.avail_idx(), &idx).unwrap();
    }

    pub fn kick(&mut self) -> vfio_nic::Result<()> {
        // SAFETY: the device's only mappings are `ring` and `buf`, reached
        // by the CPU only through `Coherent`'s accessors, not meanwhile.
        unsafe { self.nic.kick(self.posted) }
    }

    pub fn used_idx(&self) -> u16 {
        let mut b = [0u8; 2];
        self.ring.read(self.layout.used_idx(), &mut b).unwrap();
        u16::from_le_bytes(b)
    }
}

/// The IOMMU `inner`, but a device write translated at byte `offset` of a
/// page faults: placed on a used entry's id, it fails that entry's write
/// and no other access (a check of the used ring from its start
/// translates at the ring's own offset). Rings are page-aligned.
pub struct UsedEntryFault<T> {
    pub inner: T,
    pub offset: u64,
}

impl<T> UsedEntryFault<T> {
    /// Faults the write of used entry `entry` of a page-aligned ring of
    /// `size` entries.
    pub fn new(inner: T, size: u16, entry: u16) -> Self {
        let offset = (Layout::new(size).used_entry(entry) % 4096) as u64;
        UsedEntryFault { inner, offset }
    }
}

// SAFETY: every call is the inner IOMMU's, or a fault that touches
// nothing.
unsafe impl<T: Translate> Translate for UsedEntryFault<T> {
    fn translate(&self, iova: Iova, access: Dir) -> Result<Translation, Fault> {
        if access.contains(Dir::FROM_DEVICE) && iova.raw() % 4096 == self.offset {
            return Err(Fault { iova, access });
        }
        self.inner.translate(iova, access)
    }
    unsafe fn hold(&self) -> Hold<'_> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.hold() }
    }
    unsafe fn read(&self, iova: Iova, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), Fault> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.read(iova, len, f) }
    }
    unsafe fn write(&self, iova: Iova, src: &[u8]) -> Result<(), Fault> {
        // A write over the faulting byte faults as its translation does.
        let hits = (0..src.len() as u64).any(|i| (iova.raw() + i) % 4096 == self.offset);
        if hits {
            return Err(Fault {
                iova,
                access: Dir::FROM_DEVICE,
            });
        }
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.write(iova, src) }
    }
}
