//! Real hardware: the only modules that map a BAR and touch registers
//! ([`mmio`]), issue ioctls of their own ([`ioctl`]), talk to VFIO
//! ([`vfio`], [`info`]) and iommufd ([`iommufd`]), with what both mappers
//! share (`access`), read and write PCI config space (`pci`), find a device in sysfs
//! (`sysfs`), and drive an Intel 82576 ([`igb`]) and a
//! virtio-net device over the modern PCI transport ([`virtio`]).

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

mod access;
pub mod igb;
pub mod info;
pub mod ioctl;
pub mod iommufd;
pub mod mmio;
mod pci;
mod sysfs;
pub mod vfio;
pub mod virtio;

/// Polls `done` every millisecond until it holds, for at most `timeout`;
/// [`Error::DeviceTimeout`] naming `what` after that. Returns the wait.
pub(crate) fn wait_for(
    what: &'static str,
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<Duration> {
    let t0 = Instant::now();
    loop {
        if done()? {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() >= timeout {
            return Err(Error::DeviceTimeout {
                what,
                waited_ms: t0.elapsed().as_millis() as u64,
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
