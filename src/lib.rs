//! The measurement side of pfrag: run one TX configuration on the software
//! NIC and report per-packet mapping, invalidation, IOTLB and throughput
//! figures ([`run()`](run::run)), and write them as a table, CSV or SVG
//! ([`report`]). The `sweep` example drives it across orders, policies and
//! IOMMU modes. The project README follows; the rest of the documentation is
//! under `docs/`.
//!
#![doc = include_str!("../README.md")]

pub mod cli;
pub mod flows;
pub mod harness;
pub mod peers;
pub mod report;
pub mod reps;
pub mod run;
pub mod soak;
pub mod timed;
pub mod vm;

pub use run::{limit, run, IommuMode, Row, RunConfig};

/// The documents under `docs/`, so that `cargo test --doc` compiles and
/// runs their Rust examples as it does the README's.
#[cfg(doctest)]
pub mod docs {
    #[doc = include_str!("../docs/benchmarks.md")]
    pub struct Benchmarks;
    #[doc = include_str!("../docs/driver.md")]
    pub struct Driver;
    #[doc = include_str!("../docs/experiments.md")]
    pub struct Experiments;
    #[doc = include_str!("../docs/iommufd.md")]
    pub struct Iommufd;
    #[doc = include_str!("../docs/layout.md")]
    pub struct Layout;
    #[doc = include_str!("../docs/library.md")]
    pub struct Library;
    #[doc = include_str!("../docs/memory.md")]
    pub struct Memory;
    #[doc = include_str!("../docs/reliability.md")]
    pub struct Reliability;
    #[doc = include_str!("../docs/results.md")]
    pub struct Results;
    #[doc = include_str!("../docs/vfio-guest.md")]
    pub struct VfioGuest;
    #[doc = include_str!("../docs/virtio-net.md")]
    pub struct VirtioNet;
}
