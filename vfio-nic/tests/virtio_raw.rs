//! The virtio-net model on virtqueues written by hand, with no TX queue in
//! front of it: chains a driver may not post (an indirect descriptor the
//! device never offered, a head outside the table) are counted as
//! malformed, never sent, and never stop the chains around them.

mod common;

use common::virtq::{RawQueue, SIZE};
use vfio_nic::format::virtio::HDR_LEN;
use vfio_nic::model::Model;
use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;

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
