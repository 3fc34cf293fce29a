//! Real hardware: the only modules that map a BAR and touch registers
//! ([`mmio`]), talk to VFIO ([`vfio`]), and drive an Intel 82576 ([`igb`]).

pub mod igb;
pub mod mmio;
pub mod vfio;
