//! # vfio-nic
//!
//! The NIC side of pfrag, by layer:
//!
//! - the TX engine: [`tx::Queue`] sends a driver's own packets (copying,
//!   vectored or zero-copy, with [`offload::Offload`]s) over any
//!   [`device::TxDevice`], writing the descriptors of the device's
//!   [`format::Format`], and reaps completions with their tokens and
//!   status; its memory and DMA mappings come from `pfrag` pools;
//! - descriptor formats ([`format`](mod@format)): the Intel 82576's advanced
//!   descriptors ([`format::igb`], their encoding in [`desc`]) and
//!   virtio-net's split virtqueue ([`format::virtio`]);
//! - device models ([`model`]): the software NIC, the null device and a
//!   virtio-net device, which reach memory only through an IOMMU
//!   translation, and a thread to run any of them beside the driver;
//! - hardware ([`hw`], with the `vfio` feature): MMIO, VFIO (type1 or
//!   iommufd), and drivers for the 82576 (igb) and for virtio-net over the
//!   modern PCI transport;
//! - checking ([`check`]): the frame checker used on model output and on
//!   captures of the real device;
//! - the traffic generator ([`gen`]): flows with a per-flow payload pattern,
//!   driving a queue through its public API.
//!
//! The device models are simulators: they measure what the driver and the
//! IOMMU model do per packet, not what a real NIC does.
//!
//! # Example
//!
//! One UDP frame sent through a persistent pool, under the software IOMMU,
//! to the software 82576 model, which reads it through its IOMMU
//! translation and captures it:
//!
//! ```
//! use std::sync::Arc;
//! use etherparse::PacketBuilder;
//! use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
//! use pfrag::pool::{self, Policy, Pool};
//! use pfrag::Order;
//! use vfio_nic::model::softnic::{self, SoftNic};
//! use vfio_nic::offload::Offload;
//! use vfio_nic::tx;
//!
//! let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default())?);
//! let domain = Arc::new(Domain::new(iommu.clone()));
//! let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(0)?, Policy::Persistent))?;
//! // Keep the frames; the payload is ours, not `gen`'s test pattern.
//! let cfg = softnic::Config { capture: true, verify: false, ..softnic::Config::default() };
//! let nic = SoftNic::new(iommu, cfg);
//! // SAFETY: the model translates through the IOMMU `domain` maps through.
//! let mut queue = unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }?;
//!
//! // A whole frame: Ethernet, IPv4 and UDP headers (42 bytes), then data.
//! let mut frame = Vec::new();
//! PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
//!     .ipv4([192, 0, 2, 1], [192, 0, 2, 2], 64)
//!     .udp(5000, 6000)
//!     .write(&mut frame, b"hello")?;
//! let (headers, payload) = frame.split_at(42);
//! queue.send(headers, payload, Offload::None, 1)?; // token 1
//! queue.kick()?; // the doorbell
//!
//! let mut done = Vec::new();
//! queue.reap_tokens(&mut done)?;
//! assert_eq!(done, [1]);
//! assert_eq!(queue.take_frames(), [frame]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The crate README has a TSO example: 64 KB cut into 45 frames.
//!
//! # Features
//!
//! - `vfio` (default): the real-hardware backend, [`hw`]: VFIO container,
//!   group and device (or the device's cdev and an iommufd IOAS), BAR
//!   access, and the 82576 and virtio-net drivers. Leave it out
//!   (`default-features = false`) on a system without VFIO; the TX queue,
//!   the device models, the checker and the generator need none of it.
//!
//! # Public dependencies
//!
//! `pfrag`'s types (pools, frags, mappers, IOVAs, its error) appear
//! throughout this crate's API, and `bitflags` 2's traits and iterators on
//! the descriptor flag types. [`Error::Virtqueue`] carries a
//! `virtio-queue` error (the virtio-net model's, so with or without
//! `vfio`), and with `vfio` [`hw::vfio::iommu_info`] takes a `vfio-ioctls`
//! container: a breaking release of `pfrag`, `vfio-ioctls` or
//! `virtio-queue` (for these 0.x crates, a new minor version) is a breaking
//! change of this crate.
//!
// The `hw` links, which point to the Features section when `hw` is left out.
#![cfg_attr(
    feature = "vfio",
    doc = "[`hw`]: crate::hw\n[`hw::vfio::iommu_info`]: crate::hw::vfio::iommu_info"
)]
#![cfg_attr(
    not(feature = "vfio"),
    doc = "[`hw`]: crate#features\n[`hw::vfio::iommu_info`]: crate#features"
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

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
#[cfg_attr(docsrs, doc(cfg(feature = "vfio")))]
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
