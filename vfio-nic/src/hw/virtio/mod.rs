//! virtio-net over the modern (1.x) PCI transport, through VFIO.
//!
//! [`VirtioNetPci`] finds the device's structures in its capabilities
//! ([`caps`]), resets it, negotiates features (`VERSION_1` and
//! `ACCESS_PLATFORM` required; `CSUM`, `HOST_TSO4`, `HOST_TSO6` and
//! `EVENT_IDX` when offered, through [`Split::negotiate`]), and runs the
//! TX virtqueue (queue 1) as a [`TxDevice`] of [`Split`] format: the
//! [`tx::Queue`](crate::tx::Queue) that drives the 82576 drives this one
//! unchanged. It uses no interrupts (no MSI-X vector is assigned) and no
//! receive queue; a reset stops the device on drop, on
//! [`TxDevice::detach`], and first thing when it is opened (after another
//! process died holding it).
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use pfrag::dma::Domain;
//! use pfrag::pool::{self, Policy, Pool};
//! use pfrag::Order;
//! use vfio_nic::hw::vfio::{VfioMapper, VfioPci};
//! use vfio_nic::hw::virtio::{VirtioConfig, VirtioNetPci};
//! use vfio_nic::tx;
//!
//! // The device must be bound to vfio-pci first, e.g.
//! //   echo 1af4 1041 > /sys/bus/pci/drivers/vfio-pci/new_id
//! let pci = VfioPci::open("0000:00:03.0")?;
//! let domain = Arc::new(Domain::new(VfioMapper::new(&pci)?));
//! let nic = VirtioNetPci::new(pci, VirtioConfig::default())?;
//! let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(4)?, Policy::Persistent))?;
//! // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
//! let mut q = unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }?;
//! q.send(&[0u8; 14], &[0u8; 1000], vfio_nic::offload::Offload::None, 1)?;
//! q.kick()?;
//! q.wait(Duration::from_secs(1))?;
//! # Ok::<(), vfio_nic::Error>(())
//! ```

use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

use pfrag::Iova;
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK,
};

use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::format::virtio::{self, Layout, Split};
use crate::hw::mmio::Width;
use crate::hw::wait_for;

pub mod caps;
mod transport;

pub use transport::{PciTransport, Transport};

/// The transmit queue of a virtio-net device without multiqueue
/// (`transmitq1`; queue 0 receives).
pub const TX_QUEUE: u16 = 1;
/// The receive queue, which this driver never sets up: its notification
/// address carries [`VirtioNetPci::mark`]s.
pub const RX_QUEUE: u16 = 0;

/// The device status once features are negotiated and before a queue runs.
const NEGOTIATED: u32 =
    VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;

/// Offsets in `struct virtio_pci_common_cfg` (virtio 1.x, 4.1.4.3).
pub mod common {
    /// Selects which 32 bits `DEVICE_FEATURE` shows.
    pub const DEVICE_FEATURE_SELECT: u32 = 0x00;
    /// The device's features, 32 at a time.
    pub const DEVICE_FEATURE: u32 = 0x04;
    /// Selects which 32 bits `DRIVER_FEATURE` takes.
    pub const DRIVER_FEATURE_SELECT: u32 = 0x08;
    /// The driver's features, 32 at a time.
    pub const DRIVER_FEATURE: u32 = 0x0c;
    /// Device status (8 bits).
    pub const DEVICE_STATUS: u32 = 0x14;
    /// Selects the queue the fields below show (16 bits).
    pub const QUEUE_SELECT: u32 = 0x16;
    /// Queue size: the device's maximum on read, the driver's choice on
    /// write (16 bits).
    pub const QUEUE_SIZE: u32 = 0x18;
    /// The queue's MSI-X vector (16 bits).
    pub const QUEUE_MSIX_VECTOR: u32 = 0x1a;
    /// Queue enable (16 bits).
    pub const QUEUE_ENABLE: u32 = 0x1c;
    /// The queue's notification offset, in multiples of the notify
    /// capability's multiplier (16 bits).
    pub const QUEUE_NOTIFY_OFF: u32 = 0x1e;
    /// Descriptor table address (64 bits, as two 32-bit halves).
    pub const QUEUE_DESC: u32 = 0x20;
    /// Driver area (available ring) address.
    pub const QUEUE_DRIVER: u32 = 0x28;
    /// Device area (used ring) address.
    pub const QUEUE_DEVICE: u32 = 0x30;
    /// No MSI-X vector.
    pub const NO_VECTOR: u16 = 0xffff;
}

/// Timeouts of the bring-up.
#[derive(Clone, Copy, Debug)]
pub struct VirtioConfig {
    /// How long a reset may take to read back as done. Default 1 s.
    pub reset_timeout: Duration,
}

impl Default for VirtioConfig {
    fn default() -> Self {
        VirtioConfig {
            reset_timeout: Duration::from_secs(1),
        }
    }
}

/// A virtio-net device running its TX queue; see the module docs.
#[derive(Debug)]
pub struct VirtioNetPci<T: Transport = PciTransport> {
    t: T,
    cfg: VirtioConfig,
    offered: u64,
    fmt: Split,
    /// Notification offsets of the TX and RX queues.
    notify: [u32; 2],
    /// Whether features are negotiated (`FEATURES_OK` since the last
    /// reset).
    ready: bool,
    /// The attached ring's size.
    ring: Option<u16>,
    /// The TX queue's largest size, as the device reported it after the
    /// last reset (`queue_size` then reads back what the driver wrote).
    max: u16,
}

impl VirtioNetPci<PciTransport> {
    /// Takes the VFIO device, finds its structures, resets it and
    /// negotiates features.
    pub fn new(pci: crate::hw::vfio::VfioPci, cfg: VirtioConfig) -> Result<Self> {
        Self::over(PciTransport::new(pci)?, cfg)
    }
}

impl<T: Transport> VirtioNetPci<T> {
    /// As [`VirtioNetPci::new`], over any transport.
    pub fn over(t: T, cfg: VirtioConfig) -> Result<Self> {
        let mut nic = VirtioNetPci {
            t,
            cfg,
            offered: 0,
            fmt: Split::default(),
            notify: [0; 2],
            ready: false,
            ring: None,
            max: 0,
        };
        nic.init()?;
        Ok(nic)
    }

    fn read<W: Width>(&self, off: u32) -> Result<W> {
        self.t.common_read(off)
    }

    /// The driver's own writes to common configuration: none of them names
    /// memory but the queue addresses of `attach`, which its caller handed
    /// over.
    fn write<W: Width>(&self, off: u32, v: W) -> Result<()> {
        // SAFETY: see above.
        unsafe { self.t.common_write(off, v) }
    }

    fn status(&self) -> Result<u8> {
        self.read::<u8>(common::DEVICE_STATUS)
    }

    fn set_status(&self, bits: u32) -> Result<()> {
        let s = self.status()?;
        self.write::<u8>(common::DEVICE_STATUS, s | bits as u8)
    }

    /// Writes 0 to the device status and waits until it reads back 0:
    /// the device then no longer touches any ring or buffer, and the
    /// driver forgets the ring and the negotiated features.
    ///
    /// A status that does not read back 0 within
    /// [`VirtioConfig::reset_timeout`] is [`Error::DeviceTimeout`], and
    /// the driver keeps the ring and the features as they were: the device
    /// may still be using the ring, so its memory must stay the device's
    /// (a [`tx::Queue`](crate::tx::Queue) whose detach fails comes back
    /// whole, ring included). A reset can be tried again; the next
    /// [`attach_parts`](Self::attach_parts) negotiates again unless the
    /// device reads back as negotiation left it.
    pub fn reset(&mut self) -> Result<()> {
        self.write::<u8>(common::DEVICE_STATUS, 0)?;
        wait_for("virtio reset", self.cfg.reset_timeout, || {
            Ok(self.status()? == 0)
        })?;
        self.ready = false;
        self.ring = None;
        Ok(())
    }

    /// Reset, `ACKNOWLEDGE`, `DRIVER`, features, `FEATURES_OK` (3.1.1).
    fn init(&mut self) -> Result<()> {
        self.reset()?;
        self.set_status(VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER)?;
        let mut offered = 0u64;
        for half in 0..2u32 {
            self.write::<u32>(common::DEVICE_FEATURE_SELECT, half)?;
            offered |= u64::from(self.read::<u32>(common::DEVICE_FEATURE)?) << (32 * half);
        }
        self.offered = offered;
        let fmt = match Split::negotiate(offered) {
            Ok(f) => f,
            Err(e) => {
                self.set_status(VIRTIO_CONFIG_S_FAILED)?;
                return Err(e);
            }
        };
        for half in 0..2u32 {
            self.write::<u32>(common::DRIVER_FEATURE_SELECT, half)?;
            self.write::<u32>(
                common::DRIVER_FEATURE,
                (fmt.features() >> (32 * half)) as u32,
            )?;
        }
        self.set_status(VIRTIO_CONFIG_S_FEATURES_OK)?;
        let s = self.status()?;
        if u32::from(s) & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
            self.set_status(VIRTIO_CONFIG_S_FAILED)?;
            return Err(Error::DeviceRefused {
                what: "the negotiated features (FEATURES_OK)",
                status: s,
            });
        }
        for q in [RX_QUEUE, TX_QUEUE] {
            self.write::<u16>(common::QUEUE_SELECT, q)?;
            let off = u32::from(self.read::<u16>(common::QUEUE_NOTIFY_OFF)?);
            self.notify[usize::from(q)] = self.t.notify_offset(off)?;
        }
        // TX_QUEUE is selected.
        self.max = self.read::<u16>(common::QUEUE_SIZE)?;
        self.fmt = fmt;
        self.ready = true;
        Ok(())
    }

    /// Whether the device is as [`init`](Self::init) left it, so that a
    /// ring can be set up without a reset: features negotiated, no ring,
    /// the status `FEATURES_OK` without `DRIVER_OK`, the TX queue off (and
    /// selected). A reset that did not read back 0 in time may still
    /// complete later, with the driver's state kept: the status read here
    /// tells.
    fn negotiated(&self) -> Result<bool> {
        if !self.ready || self.ring.is_some() {
            return Ok(false);
        }
        self.write::<u16>(common::QUEUE_SELECT, TX_QUEUE)?;
        Ok(u32::from(self.status()?) == NEGOTIATED && self.read::<u16>(common::QUEUE_ENABLE)? == 0)
    }

    /// The features the device offered.
    pub fn offered(&self) -> u64 {
        self.offered
    }

    /// The device status, as read now.
    pub fn device_status(&self) -> Result<u8> {
        self.status()
    }

    /// Reads the ISR status byte, which clears it: bit 0 is set when the
    /// device has used buffers and would interrupt (this driver assigns no
    /// vector, so nothing else sees it). `None` if the device has no ISR
    /// capability.
    pub fn isr(&self) -> Result<Option<u8>> {
        self.t.isr()
    }

    /// Writes `value` to the notification address of the receive queue,
    /// which this driver never sets up (the device ignores a notification
    /// of a queue without rings). An emulator traces it, so it delimits
    /// measurement windows there (`vm/run.sh sweep --nic virtio`).
    ///
    /// A device whose notification addresses lie less than 4 bytes apart
    /// (a `notify_off_multiplier` below 4, which the spec allows: queues
    /// may share one address and be told apart by the value written) could
    /// take the mark for another queue's notification:
    /// [`Error::VirtioCap`], and nothing is written.
    pub fn mark(&self, value: u32) -> Result<()> {
        let [rx, tx] = self.notify;
        if rx.abs_diff(tx) < 4 {
            return Err(Error::VirtioCap {
                what: "notification layout for marks (queues less than 4 bytes apart)",
            });
        }
        // SAFETY: the 4 bytes at the receive queue's address are no other
        // queue's (checked above), and the receive queue has no rings
        // (every `init` starts from a reset, and nothing here sets them),
        // so the device reads and writes nothing for this notification.
        unsafe { self.t.notify(rx, value) }
    }

    /// Points TX queue `TX_QUEUE` at the three parts of a split ring and
    /// enables it, then sets `DRIVER_OK`.
    ///
    /// # Safety
    /// As [`TxDevice::attach`], for the ring whose parts lie at `desc`,
    /// `driver` and `device`; the used ring (`device`) is written by the
    /// device.
    pub unsafe fn attach_parts(
        &mut self,
        len: u16,
        desc: Iova,
        driver: Iova,
        device: Iova,
    ) -> Result<()> {
        // Checked before anything changes: a ring the device cannot take
        // leaves the device (and a ring it runs) as it was.
        self.check_size(len)?;
        if !self.negotiated()? {
            self.init()?;
            // Against the maximum the device reports after this reset.
            self.check_size(len)?;
        }
        // SAFETY: the caller's promise for the three parts is passed on.
        let r = unsafe { self.program(len, [desc, driver, device]) };
        if let Err(error) = r {
            // The device may hold some of the addresses: stop it before
            // the caller frees the ring.
            if let Err(stop) = self.reset() {
                return Err(Error::StopFailed {
                    error: Box::new(error),
                    stop: Box::new(stop),
                });
            }
            return Err(error);
        }
        Ok(())
    }

    /// [`Error::VirtqueueSize`] unless the device takes a TX queue of
    /// `len` entries: a power of two, up to its maximum.
    fn check_size(&self, len: u16) -> Result<()> {
        if !len.is_power_of_two() || len > self.max {
            return Err(Error::VirtqueueSize { len, max: self.max });
        }
        Ok(())
    }

    /// Writes the 16-bit field at `off` and reads it back:
    /// [`Error::NotTaken`] if the device kept another value.
    fn write_checked(&self, what: &'static str, off: u32, v: u16) -> Result<()> {
        self.write::<u16>(off, v)?;
        let read = self.read::<u16>(off)?;
        if read != v {
            return Err(Error::NotTaken {
                what,
                wrote: u32::from(v),
                read: u32::from(read),
            });
        }
        Ok(())
    }

    /// Writes the TX queue's size and addresses, enables it and sets
    /// `DRIVER_OK`; the size and the enable are read back.
    ///
    /// # Safety
    /// As [`attach_parts`](Self::attach_parts).
    unsafe fn program(&mut self, len: u16, parts: [Iova; 3]) -> Result<()> {
        self.write::<u16>(common::QUEUE_SELECT, TX_QUEUE)?;
        self.write_checked("virtio queue_size", common::QUEUE_SIZE, len)?;
        self.write::<u16>(common::QUEUE_MSIX_VECTOR, common::NO_VECTOR)?;
        let offs = [
            common::QUEUE_DESC,
            common::QUEUE_DRIVER,
            common::QUEUE_DEVICE,
        ];
        for (off, at) in offs.into_iter().zip(parts) {
            self.write::<u32>(off, at.raw() as u32)?;
            self.write::<u32>(off + 4, (at.raw() >> 32) as u32)?;
        }
        self.write_checked("virtio queue_enable", common::QUEUE_ENABLE, 1)?;
        self.set_status(VIRTIO_CONFIG_S_DRIVER_OK)?;
        let s = self.status()?;
        if s & virtio::STOPPED != 0 {
            return Err(Error::DeviceRefused {
                what: "the TX queue (DRIVER_OK)",
                status: s,
            });
        }
        self.ring = Some(len);
        Ok(())
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.t
    }
}

impl<T: Transport> TxDevice for VirtioNetPci<T> {
    type Format = Split;
    fn format(&self) -> Split {
        self.fmt.clone()
    }

    /// Sets up the TX queue at the spec's [`Layout`] of the ring.
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        let l = Layout::new(len);
        let at = |off: usize| ring.offset(off as u64);
        // SAFETY: the caller's promise for the ring covers its three parts.
        unsafe { self.attach_parts(len, ring, at(l.avail), at(l.used)) }
    }

    unsafe fn kick(&mut self, _tail: u16) -> Result<()> {
        self.ring.ok_or(Error::NotAttached)?;
        // The available ring was written with atomic stores to write-back
        // memory; they must be visible before the notification.
        fence(Ordering::SeqCst);
        // SAFETY: the caller hands over what the available ring names
        // (`kick`'s promise); the notification tells the device so.
        unsafe { self.t.notify(self.notify[usize::from(TX_QUEUE)], TX_QUEUE) }
    }

    /// Reads the device status: [`Error::DeviceStopped`] with it if the
    /// device set `NEEDS_RESET` (or a driver `FAILED`). One register read;
    /// the queue asks only when a wait finds nothing, never per packet or
    /// doorbell.
    fn check_running(&mut self) -> Result<()> {
        virtio::check_status(self.status()?)
    }

    /// A reset ([`reset`](VirtioNetPci::reset)). One that fails keeps the
    /// ring attached: unlike the 82576's transmitter, a virtio device's
    /// reset cannot be taken back once the 0 is written, so the device may
    /// be running, resetting or stopped; the ring stays its until a reset
    /// reads back 0.
    fn detach(&mut self) -> Result<()> {
        self.reset()
    }
}

impl<T: Transport> Drop for VirtioNetPci<T> {
    fn drop(&mut self) {
        // Stop DMA before the rings and buffers the device may still use
        // are unmapped and freed. A reset that fails has nothing left to
        // try here: the transport, dropped next, closes the VFIO device,
        // and the kernel turns off its bus mastering when the last file of
        // the device closes.
        let _ = self.reset();
    }
}

#[cfg(test)]
mod tests;
