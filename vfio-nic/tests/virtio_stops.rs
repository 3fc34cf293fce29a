//! The virtio-net model's doorbell when the ring itself fails it, and the
//! TX queue in front of a device that stopped.
//!
//! The rule: a doorbell that fails has taken nothing, so every fault the
//! device can see before it takes a chain (an available index past the
//! ring, a used ring it cannot write) is refused first. A fault that shows
//! only after chains were taken (a used entry that cannot be written) is
//! what a virtio device answers with `NEEDS_RESET`: it is counted, the
//! device takes no more doorbells until it is reset, and the queue keeps
//! every packet it may have read in flight; its wait reports the stop,
//! not a timeout.

mod common;

use std::sync::Arc;

use common::virtq::{Iommu, RawQueue, UsedEntryFault, SIZE};
use pfrag::dma::{Dir, Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::device::TxDevice;
use vfio_nic::model::softnic;
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use vfio_nic::offload::Offload;
use vfio_nic::{tx, Error};
use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_NEEDS_RESET;

/// Two good chains, heads 0 and 1, each one descriptor.
fn two_chains<T: pfrag::dma::Translate>(q: &mut RawQueue<T>) {
    let len = q.packet(0, 60);
    q.desc(0, 0, len as u32, 0, 0);
    let len = q.packet(512, 70);
    q.desc(1, 512, len as u32, 0, 0);
    q.publish(&[0, 1]);
}

/// Whether `e` is the stop of a device that needs a reset.
fn stopped(e: &Error) -> bool {
    matches!(e, Error::DeviceStopped { status, .. }
        if u32::from(*status) & VIRTIO_CONFIG_S_NEEDS_RESET != 0)
}

/// A used ring the device may read but not write: the doorbell is refused
/// before it takes a chain. It used to send the first chain, fail to
/// return it, and report the doorbell failed with that packet delivered.
#[test]
fn a_used_ring_the_device_cannot_write_is_refused_before_any_chain() {
    let mut q = RawQueue::over(Dir::TO_DEVICE, |i| i);
    two_chains(&mut q);
    let e = q.kick().unwrap_err();
    assert!(
        matches!(
            e,
            Error::RingUnreachable {
                part: "used ring",
                ..
            }
        ),
        "{e}"
    );
    let st = q.nic.stats();
    assert_eq!((st.packets, st.frames, st.stops), (0, 0, 0), "{st:?}");
    assert_eq!(q.nic.head(), Some(0), "nothing taken");
    q.nic.check_running().unwrap();
}

/// An available index more than the ring's size ahead: refused with the
/// numbers before anything is taken, and the device serves the ring once
/// the index is right.
#[test]
fn an_available_index_past_the_ring_is_refused_with_its_numbers() {
    let mut q = RawQueue::new();
    two_chains(&mut q);
    q.set_avail_idx(2 + SIZE);
    let e = q.kick().unwrap_err();
    assert!(
        matches!(
            e,
            Error::AvailIndex {
                avail: 10,
                next_avail: 0,
                size: SIZE
            }
        ),
        "{e}"
    );
    assert_eq!(q.nic.stats().packets, 0);
    q.set_avail_idx(2);
    q.kick().unwrap();
    let st = q.nic.stats();
    assert_eq!((st.packets, st.frames, st.stops), (2, 2, 0), "{st:?}");
    assert_eq!(q.used_idx(), 2);
}

/// The second chain's used entry cannot be written: both chains were
/// sent, only the first returned. The device stops as a virtio device
/// does (`NEEDS_RESET`): the fault and the stop are counted, the doorbell
/// says so, and later doorbells take nothing until a reset (a detach and
/// an attach). It used to fail this doorbell and take the next one's
/// chains as if nothing had happened.
#[test]
fn a_used_entry_that_cannot_be_written_stops_the_device_until_a_reset() {
    let mut q = RawQueue::over(Dir::BIDIRECTIONAL, |i| UsedEntryFault::new(i, SIZE, 1));
    two_chains(&mut q);
    let e = q.kick().unwrap_err();
    assert!(stopped(&e), "{e}");
    assert!(
        matches!(&e, Error::DeviceStopped { cause: Some(c), .. } if matches!(**c, Error::Virtqueue(_))),
        "{e:?}"
    );
    let st = q.nic.stats();
    assert_eq!(
        (st.packets, st.frames, st.faults, st.stops),
        (2, 2, 1, 1),
        "{st:?}"
    );
    assert_eq!(q.used_idx(), 1);
    // Later doorbells are refused and take nothing.
    let len = q.packet(1024, 80);
    q.desc(2, 1024, len as u32, 0, 0);
    q.publish(&[2]);
    let e = q.kick().unwrap_err();
    assert!(
        matches!(e, Error::DeviceStopped { cause: None, .. }) && stopped(&e),
        "{e}"
    );
    assert!(stopped(&q.nic.check_running().unwrap_err()));
    assert_eq!(q.nic.stats(), st, "nothing more taken");
    assert_eq!(q.nic.take_frames().len(), 2);
    // A reset: the device forgets the ring and the stop.
    q.nic.detach().unwrap();
    q.nic.check_running().unwrap();
    q.ring.write(0, &vec![0u8; q.layout.bytes]).unwrap();
    // SAFETY: `ring` is this test's, kept for the device until it drops.
    unsafe { q.nic.attach(q.ring.iova(), SIZE) }.unwrap();
    q.posted = 0;
    q.desc(0, 1024, len as u32, 0, 0);
    q.publish(&[0]);
    q.kick().unwrap();
    assert_eq!(q.nic.stats().frames, 3);
}

/// A TX queue on a device that stops mid-doorbell: the doorbell reports
/// the stop; the packet the device returned is reaped, the ones it took
/// without returning stay in flight (the device may have read them: they
/// are not reused); the wait reports the stop instead of running into its
/// timeout; and dropping the queue (whose detach resets the device) frees
/// everything, nothing pinned.
#[test]
fn a_queue_keeps_what_a_stopped_device_took_and_its_wait_says_why() {
    let iommu: Iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let cfg = softnic::Config {
        verify: false,
        capture: true,
        ..Default::default()
    };
    let ring = tx::Config::DEFAULT_RING;
    let nic = VirtioNet::new(UsedEntryFault::new(iommu, ring, 1), cfg).unwrap();
    // SAFETY: the model translates through the IOMMU the domain maps
    // through.
    let mut q =
        unsafe { tx::Queue::new(domain.clone(), pool, nic, tx::Config::default()) }.unwrap();
    let headers = common::tcp_headers();
    for token in 0..3 {
        q.send(&headers, &[7u8; 100], Offload::None, token).unwrap();
    }
    let e = q.kick().unwrap_err();
    assert!(stopped(&e), "{e}");
    let st = q.device().stats();
    assert_eq!((st.frames, st.faults, st.stops), (2, 1, 1), "{st:?}");
    let mut done = Vec::new();
    let e = q.wait_tokens(common::WAIT, &mut done).unwrap_err();
    assert!(stopped(&e), "{e}");
    assert_eq!(done, vec![0], "only the returned packet completes");
    assert_eq!(q.in_flight(), 2, "the rest stay the device's");
    assert!(stopped(&q.kick().unwrap_err()));
    drop(q);
    let p = domain.pinned();
    assert_eq!((p.iova_bytes, p.host_bytes), (0, 0));
}
