//! Device models fed a packet whose descriptors cannot all be read, and
//! the virtio-net model served by a device thread whose doorbells come
//! late.
//!
//! The rule: a model counts as delivered only packets it read whole and
//! intact. A descriptor-read fault in the middle of a packet loses that
//! packet, and the packet after it starts afresh: it is neither glued to
//! the lost one nor dropped with it. Counting is in one unit per counter:
//! `faults` counts the descriptors that could not be read, and the lost
//! packet is counted once, in `packets` and `faulted_packets`, whether the
//! fault hid its middle, its end or its first descriptor.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pfrag::dma::{
    Dir, DmaMapper, Domain, Fault, Hold, Mapping, SoftIommu, SoftIommuConfig, Translate,
    Translation,
};
use pfrag::mem::Region;
use pfrag::Iova;
use vfio_nic::desc::{Data, Dcmd, Desc, Popts};
use vfio_nic::device::TxDevice;
use vfio_nic::model::null::NullNic;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::model::Model;

/// Writes descriptor `i` of the ring in `ring` (no doorbell runs
/// meanwhile).
fn put(ring: &mut Region, i: usize, d: Desc) {
    let [lo, hi] = d.encode();
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&lo.to_le_bytes());
    b[8..].copy_from_slice(&hi.to_le_bytes());
    ring.write(i * 16, &b).unwrap();
}

/// A 512-descriptor ring (two pages) whose second page is not mapped: the
/// descriptors there fault. The first page is mapped and doubles as the
/// packets' buffer memory (at offset 2048).
fn half_mapped_ring() -> (Region, Arc<SoftIommu>, Iova) {
    let mem = Region::new(8192, 4096, false).unwrap();
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let base = Iova(1 << 20);
    let m = Mapping {
        iova: base,
        addr: mem.addr(),
        len: 4096,
        dir: Dir::BIDIRECTIONAL,
        huge: false,
    };
    // SAFETY: `mem` is live and outlives the model (the caller declares it
    // first), which is its only reader.
    unsafe { iommu.map(&m) }.unwrap();
    (mem, iommu, base)
}

/// A data descriptor of `len` bytes at the buffer, with PAYLEN `paylen`,
/// ending its packet if `end`.
fn data(base: Iova, len: u16, paylen: u32, end: bool) -> Desc {
    let cmd = if end {
        Dcmd::EOP | Dcmd::RS
    } else {
        Dcmd::empty()
    };
    Desc::Data(Data::new(
        base.raw() + 2048,
        len,
        Dcmd::IFCS | cmd,
        paylen,
        Popts::empty(),
    ))
}

/// Null device: packet A (descriptors 254, 255; its end would be 256, in
/// the unmapped page) is lost when the page faults; packet B after the
/// wrap (0, 1: 100 bytes) is delivered alone, 100 bytes, not 2100.
#[test]
fn null_nic_drops_a_packet_whose_end_faulted_and_delivers_the_next() {
    let (mut mem, iommu, base) = half_mapped_ring();
    put(&mut mem, 254, data(base, 1000, 3000, false));
    put(&mut mem, 255, data(base, 1000, 0, false));
    let mut nic = NullNic::new(iommu.clone());
    // SAFETY: the ring lies at `base`; only the model reads it.
    unsafe { nic.attach(base, 512) }.unwrap();
    // First doorbell: 0..256 (zeros, then A's two buffers).
    // SAFETY: as above.
    unsafe { nic.kick(256) }.unwrap();
    let before = nic.counters();
    // Second doorbell: 256..512 (faults), the wrap, then B.
    put(&mut mem, 0, data(base, 60, 100, false));
    put(&mut mem, 1, data(base, 40, 0, true));
    // SAFETY: as above.
    unsafe { nic.kick(2) }.unwrap();
    let st = nic.counters().since(&before);
    // The unmapped page's 256 descriptors, and packet A lost with them.
    assert_eq!((st.faults, st.faulted_packets), (256, 1), "{st:?}");
    assert_eq!((st.packets, st.frames), (2, 1), "{st:?}");
    assert_eq!(st.delivered_bytes, 100, "A's bytes counted with B's");
}

/// Software NIC: B (a whole, valid packet) after A whose descriptors
/// past its first fault is sent, not dropped as glued to A.
#[test]
fn softnic_drops_a_packet_whose_end_faulted_and_sends_the_next() {
    let (mut mem, iommu, base) = half_mapped_ring();
    let cfg = softnic::Config {
        verify: false,
        capture: true,
        ..softnic::Config::default()
    };
    let mut nic = SoftNic::new(iommu.clone(), cfg);
    // SAFETY: the ring lies at `base`; only the model reads it.
    unsafe { nic.attach(base, 512) }.unwrap();
    // Packet A: its first buffer at 255 (PAYLEN 3000), the rest at 256..,
    // in the unmapped page.
    put(&mut mem, 255, data(base, 1000, 3000, false));
    // SAFETY: as above.
    unsafe { nic.kick(256) }.unwrap();
    let before = nic.stats();
    put(&mut mem, 0, data(base, 60, 100, false));
    put(&mut mem, 1, data(base, 40, 0, true));
    // SAFETY: as above.
    unsafe { nic.kick(2) }.unwrap();
    let st = nic.stats().since(&before);
    assert_eq!((st.faults, st.faulted_packets), (256, 1), "{st:?}");
    assert_eq!((st.packets, st.bad_desc), (2, 0), "{st:?}");
    assert_eq!((st.frames, st.delivered_bytes), (1, 100), "{st:?}");
    assert_eq!(nic.take_frames().len(), 1);
}

/// Forwards to a software IOMMU, but the first device read that covers
/// `bad` faults: a descriptor that could not be read once.
struct OneBadRead {
    inner: Arc<SoftIommu>,
    bad: Iova,
    armed: AtomicBool,
}

// SAFETY: every call is the inner IOMMU's, or a fault that touches nothing.
unsafe impl Translate for OneBadRead {
    fn translate(&self, iova: Iova, access: Dir) -> Result<Translation, Fault> {
        self.inner.translate(iova, access)
    }
    unsafe fn hold(&self) -> Hold<'_> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.hold() }
    }
    unsafe fn read(&self, iova: Iova, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), Fault> {
        let hit = iova.raw() <= self.bad.raw() && self.bad.raw() < iova.raw() + len as u64;
        if hit && self.armed.swap(false, Ordering::Relaxed) {
            return Err(Fault {
                iova: self.bad,
                access: Dir::TO_DEVICE,
            });
        }
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.read(iova, len, f) }
    }
    unsafe fn write(&self, iova: Iova, src: &[u8]) -> Result<(), Fault> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.write(iova, src) }
    }
    unsafe fn write_u32(&self, iova: Iova, v: u32) -> Result<(), Fault> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.write_u32(iova, v) }
    }
}

/// A ring of 8 descriptors in one mapped page (which doubles as buffer
/// memory), read through a translation whose first read of descriptor
/// `bad` faults. Packet A is descriptors 0 (first, PAYLEN 1100), 1 and 2
/// (its end); packet B is descriptor 3 alone (100 bytes).
fn fault_at(bad: u64) -> (Region, Arc<OneBadRead>, Iova) {
    let (mut mem, iommu, base) = half_mapped_ring();
    put(&mut mem, 0, data(base, 60, 1100, false));
    put(&mut mem, 1, data(base, 1000, 0, false));
    put(&mut mem, 2, data(base, 40, 0, true));
    put(&mut mem, 3, data(base, 100, 100, true));
    let t = Arc::new(OneBadRead {
        inner: iommu,
        bad: Iova(base.raw() + 16 * bad),
        armed: AtomicBool::new(true),
    });
    (mem, t, base)
}

/// [`fault_at`] descriptor 1, A's middle.
fn middle_fault() -> (Region, Arc<OneBadRead>, Iova) {
    fault_at(1)
}

/// What both models must count when one descriptor of A could not be read
/// (wherever it lay in A): that one fault, A lost once and nothing of it
/// delivered, B delivered whole.
fn assert_a_lost_b_sent(st: &softnic::NicStats) {
    assert_eq!((st.faults, st.faulted_packets), (1, 1), "{st:?}");
    assert_eq!((st.packets, st.bad_desc), (2, 0), "A lost, B sent: {st:?}");
    assert_eq!((st.frames, st.delivered_bytes), (1, 100), "{st:?}");
    assert_eq!(st.descs, 4, "{st:?}");
}

/// Null device: when a descriptor in the middle of a packet cannot be
/// read, the readable rest of that packet (its last buffer) is not
/// delivered as a packet of its own; the next packet is.
#[test]
fn null_nic_never_delivers_the_tail_of_a_packet_whose_middle_faulted() {
    let (_mem, t, base) = middle_fault();
    let mut nic = NullNic::new(t.clone());
    // SAFETY: the ring lies at `base`; only the model reads it.
    unsafe { nic.attach(base, 8) }.unwrap();
    // One doorbell per descriptor, so that only descriptor 1's read faults.
    for tail in 1..=4 {
        // SAFETY: as above.
        unsafe { nic.kick(tail) }.unwrap();
    }
    let st = nic.counters();
    assert_a_lost_b_sent(&st);
}

/// Software NIC: the same ring, read in one doorbell per descriptor.
#[test]
fn softnic_never_sends_the_tail_of_a_packet_whose_middle_faulted() {
    let (_mem, t, base) = middle_fault();
    let cfg = softnic::Config {
        verify: false,
        capture: true,
        ..softnic::Config::default()
    };
    let mut nic = SoftNic::new(t.clone(), cfg);
    // SAFETY: the ring lies at `base`; only the model reads it.
    unsafe { nic.attach(base, 8) }.unwrap();
    for tail in 1..=4 {
        // SAFETY: as above.
        unsafe { nic.kick(tail) }.unwrap();
    }
    let st = nic.stats();
    assert_a_lost_b_sent(&st);
    assert_eq!(nic.take_frames().len(), 1);
}

/// Null device: a fault that hides only A's first descriptor. A's tail
/// (descriptors 1 and 2) is skipped, A counted as lost once, at its end;
/// B is delivered whole.
#[test]
fn null_nic_counts_a_packet_whose_first_descriptor_faulted_as_lost() {
    let (_mem, t, base) = fault_at(0);
    let mut nic = NullNic::new(t.clone());
    // SAFETY: the ring lies at `base`; only the model reads it.
    unsafe { nic.attach(base, 8) }.unwrap();
    for tail in 1..=4 {
        // SAFETY: as above.
        unsafe { nic.kick(tail) }.unwrap();
    }
    assert_a_lost_b_sent(&nic.counters());
}

/// Software NIC: the same; A's tail is neither sent nor counted as a
/// malformed packet of its own.
#[test]
fn softnic_counts_a_packet_whose_first_descriptor_faulted_as_lost() {
    let (_mem, t, base) = fault_at(0);
    let cfg = softnic::Config {
        verify: false,
        capture: true,
        ..softnic::Config::default()
    };
    let mut nic = SoftNic::new(t.clone(), cfg);
    // SAFETY: the ring lies at `base`; only the model reads it.
    unsafe { nic.attach(base, 8) }.unwrap();
    for tail in 1..=4 {
        // SAFETY: as above.
        unsafe { nic.kick(tail) }.unwrap();
    }
    assert_a_lost_b_sent(&nic.stats());
    let frames = nic.take_frames();
    assert_eq!(frames.len(), 1);
    assert_eq!(frames[0].len(), 100, "B whole, nothing of A");
}

/// Both models: a fault that hides A's end (descriptor 2). A is lost
/// once, when the fault comes; B, read next, is delivered.
#[test]
fn a_packet_whose_end_faulted_is_counted_once_in_both_models() {
    let (_mem, t, base) = fault_at(2);
    let mut null = NullNic::new(t.clone());
    // SAFETY: the ring lies at `base`; only the model reads it.
    unsafe { null.attach(base, 8) }.unwrap();
    for tail in 1..=4 {
        // SAFETY: as above.
        unsafe { null.kick(tail) }.unwrap();
    }
    assert_a_lost_b_sent(&null.counters());
    let (_mem, t, base) = fault_at(2);
    let cfg = softnic::Config {
        verify: false,
        ..softnic::Config::default()
    };
    let mut soft = SoftNic::new(t.clone(), cfg);
    // SAFETY: as above.
    unsafe { soft.attach(base, 8) }.unwrap();
    for tail in 1..=4 {
        // SAFETY: as above.
        unsafe { soft.kick(tail) }.unwrap();
    }
    assert_a_lost_b_sent(&soft.stats());
}

/// Virtio-net model: a chain whose buffer lies at an IOVA nothing maps is
/// one fault and one packet lost, as in the other models.
#[test]
fn virtio_counts_a_chain_whose_buffer_faulted_as_one_lost_packet() {
    use pfrag::dma::Coherent;
    use vfio_nic::format::virtio::{Layout, Split};
    use vfio_nic::format::Format;
    use vfio_nic::model::virtio::VirtioNet;
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let l = Layout::new(8);
    let ring = Coherent::new(domain, Split::ring_bytes(8), Dir::BIDIRECTIONAL).unwrap();
    // Descriptor 0: 72 bytes at an unmapped IOVA, no NEXT.
    ring.write_u64(0, 0x7700_0000).unwrap();
    ring.write_u64(8, 72).unwrap();
    let cfg = softnic::Config {
        verify: false,
        capture: true,
        ..softnic::Config::default()
    };
    let mut nic = VirtioNet::new(iommu, cfg).unwrap();
    // SAFETY: `ring` is this test's, kept for the device until it drops.
    unsafe { nic.attach(ring.iova(), 8) }.unwrap();
    ring.write(l.avail + 2, &1u16.to_le_bytes()).unwrap();
    // SAFETY: the device's only mapping is `ring`, reached by the CPU only
    // through `Coherent`'s atomic accessors, not meanwhile.
    unsafe { nic.kick(0) }.unwrap();
    let st = nic.stats();
    assert_eq!((st.faults, st.faulted_packets), (1, 1), "{st:?}");
    assert_eq!((st.packets, st.bad_desc, st.frames), (1, 0, 0), "{st:?}");
    assert!(nic.take_frames().is_empty());
}

/// The virtio-net model on a device thread, whose doorbells may come
/// after the pass before took their chains: a pass that takes nothing,
/// then the driver publishing before the model re-reads the available
/// index, is a race, not an unreadable ring. A valid queue's `kick`
/// never fails with `AvailUnreadable` (the model errs only after two
/// empty passes in a row; `a_hostile_available_ring_is_an_error_not_a_hang`
/// keeps a broken ring an error).
#[test]
#[cfg_attr(miri, ignore = "a race between threads, run for seconds")]
fn virtio_device_thread_never_fails_a_valid_queue_on_a_late_doorbell() {
    use pfrag::pool::{self, Policy, Pool};
    use pfrag::Order;
    use vfio_nic::model::thread::{self, Threaded};
    use vfio_nic::model::virtio::VirtioNet;
    use vfio_nic::offload::Offload;
    use vfio_nic::tx;
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(2).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let cfg = softnic::Config {
        verify: false,
        ..softnic::Config::default()
    };
    let nic = Threaded::spawn(
        VirtioNet::new(iommu.clone(), cfg).unwrap(),
        thread::Config::default(),
    )
    .unwrap();
    let txc = tx::Config {
        ring: 256,
        ..tx::Config::default()
    };
    // SAFETY: the model is on the very IOMMU object `domain` maps through.
    let mut q = unsafe { tx::Queue::new(domain, pool, nic, txc) }.unwrap();
    let frame = [0u8; 60];
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < 300_000 && t0.elapsed() < Duration::from_secs(3) {
        match q.send(&frame[..14], &frame[14..], Offload::None, sent) {
            Ok(()) => sent += 1,
            Err(e) if e.is_backoff() => {
                q.reap().unwrap();
                continue;
            }
            Err(e) => panic!("send: {e}"),
        }
        if let Err(e) = q.kick() {
            panic!("kick of a valid queue failed after {sent} packets: {e} ({e:?})");
        }
        q.reap().unwrap();
    }
    assert!(sent > 0);
}
