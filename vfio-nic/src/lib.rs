//! # vfio-nic
//!
//! The NIC side of pfrag, by layer:
//!
//! - the TX engine: [`tx::Queue`] sends a driver's own packets (copying,
//!   vectored or zero-copy, with [`offload::Offload`]s) over any
//!   [`device::TxDevice`], writing the descriptors of the device's
//!   [`format::Format`], and reaps completions with their tokens and
//!   status;
//! - descriptor formats ([`format`](mod@format)): the Intel 82576's advanced
//!   descriptors ([`format::igb`], their encoding in [`desc`]);
//! - device models ([`model`]): the software NIC and the null device, which
//!   consume the 82576's descriptors through an IOMMU translation;
//! - hardware ([`hw`]): MMIO, VFIO and the 82576 (igb) driver;
//! - checking ([`check`]): the frame checker used on model output and on
//!   captures of the real device;
//! - the traffic generator ([`gen`]): flows with a per-flow payload pattern,
//!   driving a queue through its public API.
//!
//! The device models are simulators: they measure what the driver and the
//! IOMMU model do per packet, not what a real NIC does.

/// The crate README's example, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub mod check;
pub mod csum;
pub mod device;
pub mod error;
pub mod format;
pub mod gen;
#[cfg(feature = "vfio")]
pub mod hw;
pub mod model;
pub mod offload;
pub mod tx;

/// The unit tests' proptest settings: Miri interprets every step, so fewer
/// cases there (the same properties), and no regression file (its isolation
/// has no working directory or files to look one up in).
#[cfg(test)]
fn proptest_config() -> proptest::test_runner::Config {
    let mut c = proptest::test_runner::Config::with_cases(if cfg!(miri) { 8 } else { 256 });
    if cfg!(miri) {
        c.failure_persistence = None;
    }
    c
}

pub use error::{Error, Result};
pub use format::igb::desc;
