//! Real hardware: the only modules that map a BAR and touch registers
//! ([`mmio`]), issue ioctls of their own ([`ioctl`]), talk to VFIO
//! ([`vfio`], [`info`]), and drive an Intel 82576 ([`igb`]).

pub mod igb;
pub mod info;
pub mod ioctl;
pub mod mmio;
pub mod vfio;
