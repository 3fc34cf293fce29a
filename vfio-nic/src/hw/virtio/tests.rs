//! The bring-up against an in-memory model of the common configuration.

use std::cell::RefCell;

use super::*;
use crate::format::virtio::features;
use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_NEEDS_RESET;

/// A virtio device's common configuration, as far as the driver uses it.
#[derive(Debug)]
struct Fake {
    offered: u64,
    accept_features: bool,
    max: std::cell::Cell<u16>,
    /// Common configuration bytes; queue fields (0x18..) per queue.
    common: RefCell<[u8; 0x38]>,
    queues: RefCell<[[u8; 0x38]; 2]>,
    /// Notifications: `(offset, value)`.
    notes: RefCell<Vec<(u32, u64)>>,
    driver_features: RefCell<u64>,
    /// Every status the driver wrote.
    statuses: RefCell<Vec<u64>>,
    /// Answer `DRIVER_OK` with `NEEDS_RESET`.
    refuse_driver_ok: std::cell::Cell<bool>,
    /// Bytes between two queues' notification addresses.
    mult: u32,
    /// Ignore a write of 0 to the status: a reset that never reads back 0,
    /// the device going on as it was.
    stuck: std::cell::Cell<bool>,
    /// A common configuration field whose writes do not take.
    ignored: std::cell::Cell<Option<u32>>,
}

impl Fake {
    fn new(offered: u64) -> Fake {
        Fake {
            offered,
            accept_features: true,
            max: std::cell::Cell::new(256),
            common: RefCell::new([0; 0x38]),
            queues: RefCell::new([[0; 0x38]; 2]),
            notes: RefCell::new(Vec::new()),
            driver_features: RefCell::new(0),
            statuses: RefCell::new(Vec::new()),
            refuse_driver_ok: std::cell::Cell::new(false),
            mult: 4,
            stuck: std::cell::Cell::new(false),
            ignored: std::cell::Cell::new(None),
        }
    }
    /// Resets as a write of 0 does: every field 0.
    fn clear(&self) {
        *self.common.borrow_mut() = [0; 0x38];
        *self.queues.borrow_mut() = [[0; 0x38]; 2];
    }
    fn sel(&self) -> usize {
        let c = self.common.borrow();
        usize::from(u16::from_le_bytes([c[0x16], c[0x17]])).min(1)
    }
    fn get(&self, off: u32, n: usize) -> u64 {
        let off = off as usize;
        let mut b = [0u8; 8];
        if off >= 0x18 {
            b[..n].copy_from_slice(&self.queues.borrow()[self.sel()][off..off + n]);
        } else {
            b[..n].copy_from_slice(&self.common.borrow()[off..off + n]);
        }
        u64::from_le_bytes(b)
    }
    fn put(&self, off: u32, n: usize, v: u64) {
        let off = off as usize;
        let b = v.to_le_bytes();
        if off >= 0x18 {
            let s = self.sel();
            self.queues.borrow_mut()[s][off..off + n].copy_from_slice(&b[..n]);
        } else {
            self.common.borrow_mut()[off..off + n].copy_from_slice(&b[..n]);
        }
    }
    fn queue(&self, q: usize, off: usize, n: usize) -> u64 {
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(&self.queues.borrow()[q][off..off + n]);
        u64::from_le_bytes(b)
    }
}

/// A width's value as `u64`, for the fake's byte store.
fn to64<W: Width>(v: W) -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `W` is u8, u16 or u32 (sealed), plain bytes of at most 4.
    let src = unsafe { std::slice::from_raw_parts((&v as *const W).cast::<u8>(), size_of::<W>()) };
    b[..src.len()].copy_from_slice(src);
    u64::from_ne_bytes(b)
}

/// A `u64` as a width's value.
fn from64<W: Width>(v: u64) -> W {
    let b = v.to_ne_bytes();
    // SAFETY: as above; every bit pattern is a valid u8/u16/u32, and the
    // read is unaligned-safe.
    unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<W>()) }
}

impl Transport for &Fake {
    fn common_read<W: Width>(&self, off: u32) -> Result<W> {
        let n = size_of::<W>();
        let v = match off {
            common::DEVICE_FEATURE => {
                let half = self.get(common::DEVICE_FEATURE_SELECT, 4);
                if half < 2 {
                    (self.offered >> (32 * half)) & 0xffff_ffff
                } else {
                    0
                }
            }
            common::QUEUE_SIZE if self.get(off, 2) == 0 => u64::from(self.max.get()),
            common::QUEUE_NOTIFY_OFF => self.sel() as u64,
            _ => self.get(off, n),
        };
        Ok(from64(v))
    }
    unsafe fn common_write<W: Width>(&self, off: u32, v: W) -> Result<()> {
        let (n, mut v) = (size_of::<W>(), to64(v));
        if off == common::DEVICE_STATUS {
            self.statuses.borrow_mut().push(v);
        }
        if self.ignored.get() == Some(off) {
            return Ok(());
        }
        match off {
            common::DEVICE_STATUS if v == 0 => {
                if !self.stuck.get() {
                    self.clear();
                }
                return Ok(());
            }
            common::DEVICE_STATUS if !self.accept_features => {
                v &= !u64::from(VIRTIO_CONFIG_S_FEATURES_OK);
            }
            common::DEVICE_STATUS
                if self.refuse_driver_ok.get() && v & u64::from(VIRTIO_CONFIG_S_DRIVER_OK) != 0 =>
            {
                v |= u64::from(VIRTIO_CONFIG_S_NEEDS_RESET);
            }
            common::DRIVER_FEATURE => {
                let half = self.get(common::DRIVER_FEATURE_SELECT, 4);
                let mut d = self.driver_features.borrow_mut();
                *d = (*d & !(0xffff_ffff << (32 * half))) | (v << (32 * half));
            }
            _ => {}
        }
        self.put(off, n, v);
        Ok(())
    }
    fn notify_offset(&self, queue_off: u32) -> Result<u32> {
        Ok(queue_off * self.mult)
    }
    unsafe fn notify<W: Width>(&self, off: u32, v: W) -> Result<()> {
        self.notes.borrow_mut().push((off, to64(v)));
        Ok(())
    }
    fn isr(&self) -> Result<Option<u8>> {
        Ok(None)
    }
}

const ALL: u64 = features::USED | (1 << 5); // and VIRTIO_NET_F_MAC, unused

#[test]
fn bring_up_takes_what_tx_uses_and_sets_features_ok() {
    let dev = Fake::new(ALL);
    let nic = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap();
    assert_eq!(*dev.driver_features.borrow(), features::USED);
    assert_eq!(nic.offered(), ALL);
    let want = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;
    assert_eq!(u32::from(nic.device_status().unwrap()), want);
    assert!(nic.format().event_idx());
}

#[test]
fn a_device_without_the_iommu_feature_is_refused_and_marked_failed() {
    let dev = Fake::new(ALL & !features::ACCESS_PLATFORM);
    let e = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap_err();
    assert!(matches!(e, Error::MissingFeature { .. }), "{e}");
    let failed = u64::from(VIRTIO_CONFIG_S_FAILED);
    let st = dev.statuses.borrow().clone();
    assert!(st.iter().any(|s| s & failed != 0), "{st:?}");
    assert_eq!(st.last(), Some(&0), "and reset when dropped: {st:?}");
    assert_eq!(*dev.driver_features.borrow(), 0, "no features were written");
}

#[test]
fn a_device_that_refuses_the_features_is_an_error() {
    let mut dev = Fake::new(ALL);
    dev.accept_features = false;
    let e = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap_err();
    assert!(matches!(e, Error::DeviceRefused { .. }), "{e}");
}

#[test]
fn attach_places_the_ring_parts_and_kick_notifies_the_tx_queue() {
    let dev = Fake::new(ALL);
    let mut nic = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap();
    // SAFETY: the fake device reads no memory.
    assert!(unsafe { nic.kick(0) }.is_err(), "no ring yet");
    // SAFETY: as above.
    unsafe { nic.attach(Iova(0x10_0000), 64) }.unwrap();
    let l = Layout::new(64);
    let q = usize::from(TX_QUEUE);
    assert_eq!(dev.queue(q, 0x18, 2), 64);
    assert_eq!(dev.queue(q, 0x1a, 2), u64::from(common::NO_VECTOR));
    assert_eq!(dev.queue(q, 0x1c, 2), 1);
    assert_eq!(dev.queue(q, 0x20, 8), 0x10_0000);
    assert_eq!(dev.queue(q, 0x28, 8), 0x10_0000 + l.avail as u64);
    assert_eq!(dev.queue(q, 0x30, 8), 0x10_0000 + l.used as u64);
    assert_eq!(dev.queue(0, 0x1c, 2), 0, "the RX queue stays off");
    let status = u32::from(nic.device_status().unwrap());
    assert_ne!(status & VIRTIO_CONFIG_S_DRIVER_OK, 0);
    // SAFETY: as above.
    unsafe { nic.kick(3) }.unwrap();
    nic.mark(0x5f00_0001).unwrap();
    assert_eq!(*dev.notes.borrow(), vec![(4, 1), (0, 0x5f00_0001)]);
    nic.detach().unwrap();
    assert_eq!(nic.device_status().unwrap(), 0, "detach resets");
    // SAFETY: as above.
    assert!(matches!(unsafe { nic.kick(0) }, Err(Error::NotAttached)));
    // Attaching again negotiates again.
    // SAFETY: as above.
    unsafe { nic.attach(Iova(0x20_0000), 8) }.unwrap();
    assert_eq!(dev.queue(q, 0x20, 8), 0x20_0000);
}

#[test]
fn a_device_that_refuses_the_queue_is_reset_before_the_error_returns() {
    let dev = Fake::new(ALL);
    let mut nic = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap();
    dev.refuse_driver_ok.set(true);
    // SAFETY: the fake device reads no memory.
    let e = unsafe { nic.attach(Iova(0x10_0000), 8) }.unwrap_err();
    assert!(matches!(e, Error::DeviceRefused { .. }), "{e}");
    assert_eq!(dev.queue(usize::from(TX_QUEUE), 0x1c, 2), 0, "queue off");
    assert_eq!(dev.queue(usize::from(TX_QUEUE), 0x20, 8), 0, "no address");
    assert_eq!(dev.get(common::DEVICE_STATUS, 1), 0, "reset");
    // SAFETY: as above.
    assert!(matches!(unsafe { nic.kick(0) }, Err(Error::NotAttached)));
}

#[test]
fn marks_need_notification_addresses_4_bytes_apart() {
    let mut dev = Fake::new(ALL);
    dev.mult = 2;
    let nic = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap();
    let e = nic.mark(0x5f00_0000).unwrap_err();
    assert!(matches!(e, Error::VirtioCap { .. }), "{e}");
    assert!(dev.notes.borrow().is_empty(), "nothing written");
}

#[test]
fn a_ring_the_device_cannot_take_is_refused_before_it_is_enabled() {
    let dev = Fake::new(ALL);
    dev.max.set(32);
    let mut nic = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap();
    for len in [64u16, 48] {
        // SAFETY: the fake device reads no memory.
        let e = unsafe { nic.attach(Iova(0x10_0000), len) }.unwrap_err();
        assert!(matches!(e, Error::VirtqueueSize { max: 32, .. }), "{e}");
        assert_eq!(dev.queue(usize::from(TX_QUEUE), 0x1c, 2), 0);
    }
    // A ring that runs is left running by a refused one.
    // SAFETY: as above.
    unsafe { nic.attach(Iova(0x10_0000), 32) }.unwrap();
    let statuses = dev.statuses.borrow().len();
    // SAFETY: as above.
    let e = unsafe { nic.attach(Iova(0x20_0000), 64) }.unwrap_err();
    assert!(
        matches!(e, Error::VirtqueueSize { len: 64, max: 32 }),
        "{e}"
    );
    assert_eq!(dev.statuses.borrow().len(), statuses, "no status written");
    assert_eq!(dev.queue(usize::from(TX_QUEUE), 0x20, 8), 0x10_0000);
    // SAFETY: as above.
    unsafe { nic.kick(0) }.unwrap();
    // Re-attaching at another size up to the device's maximum works, though
    // `queue_size` now reads back the size written.
    // SAFETY: as above.
    unsafe { nic.attach(Iova(0x30_0000), 16) }.unwrap();
    // SAFETY: as above.
    unsafe { nic.attach(Iova(0x40_0000), 32) }.unwrap();
}

/// A bring-up whose resets give up after a few milliseconds.
fn quick() -> VirtioConfig {
    VirtioConfig {
        reset_timeout: Duration::from_millis(20),
    }
}

#[test]
fn a_reset_that_does_not_read_back_0_keeps_the_ring_until_one_does() {
    let dev = Fake::new(ALL);
    let mut nic = VirtioNetPci::over(&dev, quick()).unwrap();
    // SAFETY: the fake device reads no memory.
    unsafe { nic.attach(Iova(0x10_0000), 64) }.unwrap();
    dev.stuck.set(true);
    for e in [nic.detach().unwrap_err(), nic.reset().unwrap_err()] {
        assert!(
            matches!(
                e,
                Error::DeviceTimeout {
                    what: "virtio reset",
                    ..
                }
            ),
            "{e}"
        );
    }
    assert_eq!((nic.ready, nic.ring), (true, Some(64)), "state kept");
    // The device may still be using the ring: it is still attached.
    // SAFETY: as above.
    unsafe { nic.kick(1) }.unwrap();
    assert_eq!(dev.notes.borrow().last(), Some(&(4, 1)));
    dev.stuck.set(false);
    nic.detach().unwrap();
    assert_eq!((nic.ready, nic.ring), (false, None), "cleared once reset");
    // SAFETY: as above.
    assert!(matches!(unsafe { nic.kick(0) }, Err(Error::NotAttached)));
}

#[test]
fn a_reset_that_completes_late_is_negotiated_again_before_a_ring() {
    let dev = Fake::new(ALL);
    let mut nic = VirtioNetPci::over(&dev, quick()).unwrap();
    dev.stuck.set(true);
    assert!(nic.detach().is_err());
    // The device finishes its reset after the driver gave up waiting.
    dev.stuck.set(false);
    dev.clear();
    *dev.driver_features.borrow_mut() = 0;
    // SAFETY: the fake device reads no memory.
    unsafe { nic.attach(Iova(0x10_0000), 64) }.unwrap();
    assert_eq!(*dev.driver_features.borrow(), features::USED);
    let want = NEGOTIATED | VIRTIO_CONFIG_S_DRIVER_OK;
    assert_eq!(u32::from(nic.device_status().unwrap()), want);
}

/// A device that refuses the queue and then does not reset: the error
/// carries both, the refusal first.
#[test]
fn a_refusal_whose_reset_fails_reports_both() {
    let dev = Fake::new(ALL);
    let mut nic = VirtioNetPci::over(&dev, quick()).unwrap();
    dev.refuse_driver_ok.set(true);
    dev.stuck.set(true);
    // SAFETY: the fake device reads no memory.
    let e = unsafe { nic.attach(Iova(0x10_0000), 8) }.unwrap_err();
    dev.stuck.set(false);
    match &e {
        Error::StopFailed { error, stop } => {
            assert!(matches!(**error, Error::DeviceRefused { .. }), "{e}");
            assert!(
                matches!(
                    **stop,
                    Error::DeviceTimeout {
                        what: "virtio reset",
                        ..
                    }
                ),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
    let s = e.to_string();
    assert!(s.contains("refused") && s.contains("virtio reset"), "{s}");
}

/// A queue whose enable (or size) does not take is an error with both
/// values, and the device is reset before it returns, the ring not
/// attached. The driver used to set `DRIVER_OK` on it and report the ring
/// attached.
#[test]
fn a_queue_field_that_does_not_take_is_an_error() {
    for (off, what, wrote) in [
        (common::QUEUE_ENABLE, "virtio queue_enable", 1),
        (common::QUEUE_SIZE, "virtio queue_size", 64),
    ] {
        let dev = Fake::new(ALL);
        let mut nic = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap();
        dev.ignored.set(Some(off));
        // SAFETY: the fake device reads no memory.
        let e = unsafe { nic.attach(Iova(0x10_0000), 64) }.unwrap_err();
        match e {
            Error::NotTaken {
                what: w, wrote: v, ..
            } => assert_eq!((w, v), (what, wrote)),
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(dev.get(common::DEVICE_STATUS, 1), 0, "reset");
        // SAFETY: as above.
        assert!(matches!(unsafe { nic.kick(0) }, Err(Error::NotAttached)));
    }
}

/// The size is checked against the maximum the device reports after the
/// reset that precedes the ring: a device that now takes fewer entries
/// than at the last bring-up refuses the ring before it is programmed.
/// The check used to be made against the maximum of the bring-up before.
#[test]
fn a_ring_is_checked_against_the_maximum_after_its_reset() {
    let dev = Fake::new(ALL);
    let mut nic = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap();
    nic.detach().unwrap();
    dev.max.set(32);
    // SAFETY: the fake device reads no memory.
    let e = unsafe { nic.attach(Iova(0x10_0000), 64) }.unwrap_err();
    assert!(
        matches!(e, Error::VirtqueueSize { len: 64, max: 32 }),
        "{e}"
    );
    assert_eq!(
        dev.queue(usize::from(TX_QUEUE), 0x18, 2),
        0,
        "no size written"
    );
    assert_eq!(dev.queue(usize::from(TX_QUEUE), 0x20, 8), 0, "no address");
    // SAFETY: as above.
    unsafe { nic.attach(Iova(0x10_0000), 32) }.unwrap();
}

/// Sets `bits` in the fake's device status, as a device does on its own
/// (`NEEDS_RESET`).
fn raise(dev: &Fake, bits: u32) {
    let s = dev.get(common::DEVICE_STATUS, 1);
    dev.put(common::DEVICE_STATUS, 1, s | u64::from(bits));
}

/// A running device answers `check_running` with `Ok`; one that set
/// `NEEDS_RESET`, or that a driver marked `FAILED`, with
/// `DeviceStopped` and the status byte it read.
#[test]
fn a_device_that_needs_a_reset_says_so_with_its_status() {
    for bit in [VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_CONFIG_S_FAILED] {
        let dev = Fake::new(ALL);
        let mut nic = VirtioNetPci::over(&dev, VirtioConfig::default()).unwrap();
        // SAFETY: the fake device reads no memory.
        unsafe { nic.attach(Iova(0x10_0000), 64) }.unwrap();
        nic.check_running().unwrap();
        raise(&dev, bit);
        let want = (NEGOTIATED | VIRTIO_CONFIG_S_DRIVER_OK | bit) as u8;
        match nic.check_running() {
            Err(Error::DeviceStopped {
                status,
                cause: None,
            }) => assert_eq!(status, want),
            other => panic!("{other:?}"),
        }
    }
}

/// A TX queue on a device that sets `NEEDS_RESET` with a packet in
/// flight: its wait fails with the device's status, whether it finds
/// nothing while spinning or gives up at once (a zero timeout); the
/// packet stays in flight. The wait used to end in a bare timeout.
#[test]
fn a_wait_on_a_device_that_needs_a_reset_reports_its_status() {
    use pfrag::dma::{Domain, SoftIommu};
    use pfrag::pool::{self, Policy, Pool};

    let dev = Fake::new(ALL);
    let nic = VirtioNetPci::over(&dev, quick()).unwrap();
    let iommu = std::sync::Arc::new(SoftIommu::new(Default::default()).unwrap());
    let domain = std::sync::Arc::new(Domain::new(iommu));
    let pcfg = pool::Config::new(pfrag::Order::new(0).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    // SAFETY: the fake device reads no memory.
    let mut q = unsafe { crate::tx::Queue::new(domain, pool, nic, Default::default()) }.unwrap();
    let offload = crate::offload::Offload::None;
    q.send(&[0u8; 14], &[1u8; 100], offload, 1).unwrap();
    q.kick().unwrap();
    raise(&dev, VIRTIO_CONFIG_S_NEEDS_RESET);
    let want = (NEGOTIATED | VIRTIO_CONFIG_S_DRIVER_OK | VIRTIO_CONFIG_S_NEEDS_RESET) as u8;
    for timeout in [Duration::from_secs(1), Duration::ZERO] {
        match q.wait(timeout) {
            Err(Error::DeviceStopped { status, .. }) => assert_eq!(status, want),
            other => panic!("{timeout:?}: {other:?}"),
        }
    }
    assert_eq!(q.in_flight(), 1);
    drop(q);
    assert_eq!(dev.get(common::DEVICE_STATUS, 1), 0, "reset when dropped");
}
