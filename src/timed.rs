//! Where a device model's time goes: [`Timed`], a device wrapper that adds
//! up the time spent inside the model's doorbell handler on a [`Clock`].
//! A run charges the device its thread CPU time ([`ThreadCpu`], so that the
//! driver's share is the rest of its thread's time); the peers table's TX
//! rows leave out its wall time ([`Wall`], the harness's clock).

use std::cell::Cell;
use std::time::{Duration, Instant};

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

/// A clock [`Timed`] reads around a doorbell handler.
pub trait Clock {
    /// The time on this clock since an origin of its own: only the
    /// difference of two readings means anything.
    fn now(&self) -> Duration;
}

/// Wall time (`Instant::now`), since the clock was made.
#[derive(Clone, Copy, Debug)]
pub struct Wall {
    origin: Instant,
}

impl Wall {
    /// A wall clock whose origin is now.
    pub fn new() -> Wall {
        Wall {
            origin: Instant::now(),
        }
    }
}

impl Default for Wall {
    fn default() -> Wall {
        Wall::new()
    }
}

impl Clock for Wall {
    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.origin)
    }
}

/// The reading thread's CPU time ([`thread_cpu_ns`]): inline, the device's
/// share of the driver thread; on a device thread, the time the device was
/// busy (not polling).
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadCpu;

impl Clock for ThreadCpu {
    fn now(&self) -> Duration {
        Duration::from_nanos(thread_cpu_ns())
    }
}

/// A device model whose doorbell handler is timed on the clock `C`. Only
/// the model's own `kick` lies between the clock's two reads; the queue's
/// part of the doorbell (asking the last packet for a report, publishing
/// the ring) is the driver's, and so is the clock's own cost. Everything
/// else is passed on to the model unchanged, its [`Model`] answers
/// (counters, captured frames, whether it can be paced) included.
#[derive(Debug)]
pub struct Timed<D, C> {
    inner: D,
    clock: C,
    /// Time spent in the model's `kick` since the wrapper was made.
    spent: Duration,
    /// `spent` at the last [`take`](Self::take).
    taken: Cell<Duration>,
}

impl<D> Timed<D, ThreadCpu> {
    /// Wraps `inner`, timed on the thread CPU clock of whichever thread
    /// serves its doorbells.
    pub fn cpu(inner: D) -> Timed<D, ThreadCpu> {
        Timed::with_clock(inner, ThreadCpu)
    }
}

impl<D> Timed<D, Wall> {
    /// Wraps `inner`, timed on wall time.
    pub fn wall(inner: D) -> Timed<D, Wall> {
        Timed::with_clock(inner, Wall::new())
    }
}

impl<D, C: Clock> Timed<D, C> {
    /// Wraps `inner`, timed on `clock`.
    pub fn with_clock(inner: D, clock: C) -> Timed<D, C> {
        Timed {
            inner,
            clock,
            spent: Duration::ZERO,
            taken: Cell::new(Duration::ZERO),
        }
    }

    /// The time spent in the model's doorbell handler since the wrapper
    /// was made.
    pub fn spent(&self) -> Duration {
        self.spent
    }

    /// The time spent in the model's doorbell handler since the last call
    /// (or since the wrapper was made). [`spent`](Self::spent) is not
    /// reset.
    pub fn take(&self) -> Duration {
        self.spent - self.taken.replace(self.spent)
    }
}

impl<D: TxDevice, C: Clock> TxDevice for Timed<D, C> {
    type Format = D::Format;
    fn format(&self) -> D::Format {
        self.inner.format()
    }
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> vfio_nic::Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.inner.attach(ring, len) }
    }
    unsafe fn kick(&mut self, tail: u16) -> vfio_nic::Result<()> {
        let t0 = self.clock.now();
        // SAFETY: the caller's promise is passed on unchanged.
        let r = unsafe { self.inner.kick(tail) };
        self.spent += self.clock.now().saturating_sub(t0);
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

impl<D: Model, C: Clock> Model for Timed<D, C> {
    fn counters(&self) -> NicStats {
        self.inner.counters()
    }
    fn take_frames(&mut self) -> Vec<Vec<u8>> {
        self.inner.take_frames()
    }
    fn paceable(&self) -> bool {
        self.inner.paceable()
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

impl<D: Model> DeviceTime for Timed<D, ThreadCpu> {
    fn device_ns(&self) -> u64 {
        self.spent.as_nanos() as u64
    }
    fn own_thread(&self) -> bool {
        false
    }
}

impl<D: Model + Send + 'static> DeviceTime for Threaded<Timed<D, ThreadCpu>> {
    fn device_ns(&self) -> u64 {
        // SAFETY: the model is only read, never replaced or re-pointed.
        unsafe { self.with(|d| d.spent.as_nanos() as u64) }
    }
    fn own_thread(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pfrag::dma::{SoftIommu, SoftIommuConfig};
    use std::sync::Arc;
    use vfio_nic::model::thread;
    use vfio_nic::model::virtio::VirtioNet;

    /// A timed device is as paceable as the model it wraps: a model that
    /// takes whole rings (virtio-net) is refused a line rate. The thread
    /// CPU wrapper used to answer the default, paceable, and so let a run
    /// pace the virtio-net model.
    #[test]
    fn a_timed_model_is_as_paceable_as_its_model() {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let nic = VirtioNet::new(iommu, Default::default()).unwrap();
        assert!(!nic.paceable());
        let timed = Timed::cpu(nic);
        assert!(!timed.paceable());
        let cfg = thread::Config {
            line_rate_gbit: Some(10.0),
        };
        let r = Threaded::spawn(timed, cfg);
        assert!(
            matches!(r, Err(vfio_nic::Error::Unpaceable)),
            "{:?}",
            r.err()
        );
    }

    /// `take` gives the time since the last `take`, `spent` the whole.
    #[test]
    fn take_gives_the_time_since_the_last_take_and_spent_the_whole() {
        let mut t = Timed::with_clock((), ThreadCpu);
        t.spent = Duration::from_nanos(5);
        assert_eq!(t.take(), Duration::from_nanos(5));
        assert_eq!(t.take(), Duration::ZERO);
        t.spent += Duration::from_nanos(3);
        assert_eq!((t.take(), t.spent()), (Duration::from_nanos(3), t.spent));
        assert_eq!(t.spent(), Duration::from_nanos(8));
    }
}
