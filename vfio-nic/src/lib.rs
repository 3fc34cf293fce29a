//! # vfio-nic
//!
//! The NIC side of pfrag: Intel 82576 (igb) advanced TX descriptors
//! ([`desc`]), a TX queue that builds TCP/IPv4 packets from a pfrag frag
//! cache and header bounce ring ([`txq`]), and a software NIC model
//! ([`softnic`]) that consumes the same descriptors through an IOMMU
//! translation, reads and verifies every payload byte, segments TSO packets
//! and writes back completions.
//!
//! The software NIC is a simulator: it measures what the driver and the
//! IOMMU model do per packet, not what a real NIC does.

pub mod csum;
pub mod desc;
pub mod device;
pub mod error;
pub mod flow;
pub mod gen;
pub mod igb;
pub mod mmio;
pub mod null;
pub mod offload;
pub mod pattern;
pub mod softnic;
pub mod txq;
pub mod vfio;
pub mod wire;

pub use error::{Error, Result};
