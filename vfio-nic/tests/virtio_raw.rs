//! The virtio-net model on virtqueues written by hand, with no TX queue in
//! front of it: chains a driver may not post (an indirect descriptor the
//! device never offered, a head outside the table) are counted as
//! malformed, never sent, and never stop the chains around them.

use std::sync::Arc;

use pfrag::dma::{Coherent, Dir, Domain, SoftIommu, SoftIommuConfig};
use vfio_nic::device::TxDevice;
use vfio_nic::format::virtio::{Layout, Split, HDR_LEN};
use vfio_nic::format::Format;
use vfio_nic::model::softnic;
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;

type Iommu = Arc<SoftIommu>;

/// Descriptors in the table.
const SIZE: u16 = 8;

/// A virtio-net model attached to a hand-written virtqueue, and a buffer
/// of packets beside it.
struct RawQueue {
    layout: Layout,
    ring: Coherent<Iommu>,
    buf: Coherent<Iommu>,
    nic: VirtioNet<Iommu>,
    posted: u16,
}

impl RawQueue {
    fn new() -> RawQueue {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let domain = Arc::new(Domain::new(iommu.clone()));
        let ring = Coherent::new(domain.clone(), Split::ring_bytes(SIZE), Dir::BIDIRECTIONAL);
        let buf = Coherent::new(domain, 4096, Dir::TO_DEVICE).unwrap();
        let cfg = softnic::Config {
            capture: true,
            verify: false,
            ..softnic::Config::default()
        };
        let mut nic = VirtioNet::new(iommu, cfg).unwrap();
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
    fn desc(&self, i: u16, off: usize, len: u32, flags: u16, next: u16) {
        let at = usize::from(i) * 16;
        let addr = self.buf.iova().raw() + off as u64;
        self.ring.write_u64(at, addr).unwrap();
        let word = u64::from(len) | u64::from(flags) << 32 | u64::from(next) << 48;
        self.ring.write_u64(at + 8, word).unwrap();
    }

    /// A raw frame of `len` bytes behind a header asking for nothing, at
    /// buffer offset `off`.
    fn packet(&self, off: usize, len: usize) -> usize {
        let mut p = vec![0u8; HDR_LEN + len];
        for (i, b) in p[HDR_LEN..].iter_mut().enumerate() {
            *b = i as u8;
        }
        self.buf.write(off, &p).unwrap();
        p.len()
    }

    /// Publishes chains with these heads in the available ring.
    fn publish(&mut self, heads: &[u16]) {
        for &h in heads {
            let at = self.layout.avail_entry(self.posted % SIZE);
            self.ring.write(at, &h.to_le_bytes()).unwrap();
            self.posted = self.posted.wrapping_add(1);
        }
        let idx = self.posted.to_le_bytes();
        self.ring.write(self.layout.avail_idx(), &idx).unwrap();
    }

    fn kick(&mut self) -> vfio_nic::Result<()> {
        // SAFETY: the device's only mappings are `ring` and `buf`, reached
        // by the CPU only through `Coherent`'s accessors, not meanwhile.
        unsafe { self.nic.kick(self.posted) }
    }

    fn used_idx(&self) -> u16 {
        let mut b = [0u8; 2];
        self.ring.read(self.layout.used_idx(), &mut b).unwrap();
        u16::from_le_bytes(b)
    }
}

/// Without `INDIRECT_DESC` negotiated, a descriptor naming an indirect
/// table is a chain the device must not follow: malformed, nothing sent,
/// and still returned in the used ring.
#[test]
fn an_indirect_descriptor_is_malformed_and_not_followed() {
    let mut q = RawQueue::new();
    // The indirect table at offset 0: one descriptor, the whole packet.
    let len = q.packet(256, 60);
    let entry = q.buf.iova().raw() + 256;
    q.buf.write(0, &entry.to_le_bytes()).unwrap();
    q.buf.write(8, &(len as u32).to_le_bytes()).unwrap();
    q.desc(0, 0, 16, VRING_DESC_F_INDIRECT as u16, 0);
    q.publish(&[0]);
    q.kick().unwrap();
    let st = q.nic.stats();
    assert_eq!((st.packets, st.bad_desc, st.frames), (1, 1, 0), "{st:?}");
    assert!(q.nic.take_frames().is_empty());
    assert_eq!(q.used_idx(), 1);
}

/// An indirect descriptor behind a chain's first one is malformed too.
#[test]
fn an_indirect_descriptor_inside_a_chain_is_malformed() {
    let mut q = RawQueue::new();
    let len = q.packet(256, 60);
    let entry = q.buf.iova().raw() + 256 + HDR_LEN as u64;
    q.buf.write(0, &entry.to_le_bytes()).unwrap();
    q.buf
        .write(8, &((len - HDR_LEN) as u32).to_le_bytes())
        .unwrap();
    // Descriptor 0: the header, then descriptor 1: an indirect table.
    let next = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
    q.desc(0, 256, HDR_LEN as u32, next, 1);
    q.desc(1, 0, 16, VRING_DESC_F_INDIRECT as u16, 0);
    q.publish(&[0]);
    q.kick().unwrap();
    let st = q.nic.stats();
    assert_eq!((st.packets, st.bad_desc, st.frames), (1, 1, 0), "{st:?}");
    assert!(q.nic.take_frames().is_empty());
}

/// A head outside the descriptor table names no chain: counted as
/// malformed, and the doorbell still takes the good chain behind it (a
/// doorbell that fails must have taken nothing).
#[test]
fn a_head_outside_the_table_is_counted_and_the_rest_is_taken() {
    let mut q = RawQueue::new();
    let len = q.packet(0, 60);
    q.desc(0, 0, len as u32, 0, 0);
    q.publish(&[SIZE + 1, 0]);
    q.kick().unwrap();
    let st = q.nic.stats();
    assert_eq!((st.packets, st.bad_desc, st.frames), (2, 1, 1), "{st:?}");
    assert_eq!(q.nic.take_frames().len(), 1);
    assert_eq!(q.used_idx(), 1, "only the good chain has a used entry");
}
