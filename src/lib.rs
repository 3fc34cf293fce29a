//! The measurement side of pfrag: run one TX configuration on the software
//! NIC and report per-packet mapping, invalidation, IOTLB and throughput
//! figures ([`run()`](run::run)), and write them as a table, CSV or SVG
//! ([`report`]). The `sweep` example drives it across orders, policies and
//! IOMMU modes. The project README follows.
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
pub mod vm;

pub use run::{limit, run, IommuMode, Row, RunConfig};
