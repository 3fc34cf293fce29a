//! Where a run's CPU time goes: the thread CPU clock, and a device wrapper
//! that charges the time spent inside the device model to the device, so
//! that the driver's share is the rest of its thread's time.

use nix::time::{clock_gettime, ClockId};
use pfrag::Iova;
use vfio_nic::device::TxDevice;
use vfio_nic::model::softnic::NicStats;
use vfio_nic::model::thread::Threaded;
use vfio_nic::model::Model;

/// CPU time the calling thread has used, in ns (`CLOCK_THREAD_CPUTIME_ID`;
/// 0 if the clock cannot be read, which Linux never refuses).
pub fn thread_cpu_ns() -> u64 {
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

/// A device model with the CPU time spent in its doorbell handler counted:
/// inline, that is the device's share of the driver thread; on a device
/// thread, the time the device was busy (not polling).
#[derive(Debug)]
pub struct Timed<D> {
    inner: D,
    cpu_ns: u64,
}

impl<D> Timed<D> {
    /// Wraps `inner`.
    pub fn new(inner: D) -> Timed<D> {
        Timed { inner, cpu_ns: 0 }
    }
}

impl<D: TxDevice> TxDevice for Timed<D> {
    type Format = D::Format;
    fn format(&self) -> D::Format {
        self.inner.format()
    }
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> vfio_nic::Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.attach(ring, len) }
    }
    unsafe fn kick(&mut self, tail: u16) -> vfio_nic::Result<()> {
        let t0 = thread_cpu_ns();
        // SAFETY: the caller's promise is passed on unchanged.
        let r = unsafe { self.inner.kick(tail) };
        self.cpu_ns += thread_cpu_ns().saturating_sub(t0);
        r
    }
    fn detach(&mut self) -> vfio_nic::Result<()> {
        self.inner.detach()
    }
    fn head(&mut self) -> Option<u16> {
        self.inner.head()
    }
    fn check_running(&mut self) -> vfio_nic::Result<()> {
        self.inner.check_running()
    }
}

impl<D: Model> Model for Timed<D> {
    fn counters(&self) -> NicStats {
        self.inner.counters()
    }
}

/// A device whose busy CPU time a run reads.
pub trait DeviceTime: Model {
    /// CPU ns spent in the device model so far.
    fn device_ns(&self) -> u64;
    /// Whether the device runs on a thread of its own (else inline, on the
    /// driver's thread, whose time then includes the device's).
    fn own_thread(&self) -> bool;
}

impl<D: Model> DeviceTime for Timed<D> {
    fn device_ns(&self) -> u64 {
        self.cpu_ns
    }
    fn own_thread(&self) -> bool {
        false
    }
}

impl<D: Model + Send + 'static> DeviceTime for Threaded<Timed<D>> {
    fn device_ns(&self) -> u64 {
        // SAFETY: the model is only read, never replaced or re-pointed.
        unsafe { self.with(|d| d.cpu_ns) }
    }
    fn own_thread(&self) -> bool {
        true
    }
}
