//! # pfrag
//!
//! Order-N page-fragment pools for userspace NIC drivers, with DMA mappings
//! that cost (almost) nothing per packet: chunks are mapped in batches and
//! stay mapped while they are recycled, headers go through one premapped
//! bounce ring, and refills can fit a whole payload into one chunk.
//!
//! The pieces:
//! - [`mem`]: anonymous memory (the only place that maps memory or touches it
//!   through raw pointers);
//! - [`dma`]: the [`DmaMapper`](dma::DmaMapper) and
//!   [`Translate`](dma::Translate) traits, the [`Identity`](dma::Identity)
//!   mapper, the software IOMMU [`SoftIommu`](dma::SoftIommu), and
//!   [`Domain`](dma::Domain) (mapper + IOVA allocator);
//! - [`pool`]: chunk pools with the `PerFrag`, `PerChunk` and `Persistent`
//!   mapping policies;
//! - [`frag`]: the per-queue [`FragCache`](frag::FragCache) and
//!   [`Frag`](frag::Frag);
//! - [`bounce`]: the header bounce ring;
//! - [`account`]: process-wide memory limits with pressure hooks;
//! - [`iova`]: the IOVA allocator a [`Domain`](dma::Domain) takes its
//!   ranges from;
//! - [`addr`], [`order`] and [`error`]: addresses ([`Iova`], [`VirtAddr`]),
//!   chunk orders ([`Order`]) and the crate's [`Error`];
//! - `sync`: the atomics, mutex and queue the shared state uses (loom's
//!   models under `--cfg loom`).
//!
//! pfrag has no optional features. It needs Linux (`mmap`, `madvise`,
//! `mincore`). Its public API names no other crate's types but those of
//! `bitflags` 2 (the traits and iterators of the flag types [`dma::Dir`]
//! and [`dma::PageSizes`]).
//!
//! # Example
//!
//! A persistent pool under the software IOMMU: a 64 KB payload goes into
//! one frag, and after the first grow no packet makes a map call.
//!
//! ```
//! use std::sync::Arc;
//! use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig, DmaMapper};
//! use pfrag::pool::{self, Pool, Policy};
//! use pfrag::frag::FragCache;
//! use pfrag::Order;
//!
//! let domain = Arc::new(Domain::new(SoftIommu::new(SoftIommuConfig::default())?));
//! let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(4)?, Policy::Persistent))?;
//! let mut cache = FragCache::new(pool);
//! let mut frags = Vec::new();
//! cache.frags(65160, true, &mut frags)?;           // a 64 KB TSO payload
//! assert_eq!(frags.len(), 1);                      // fits one order-4 chunk
//! frags[0].as_mut_slice().fill(0xab);
//! let maps = domain.mapper().stats().map_calls;    // the grow's one batch
//! drop(frags);                                     // completion: recycled, still mapped
//! cache.frags(65160, true, &mut Vec::new())?;
//! assert_eq!(domain.mapper().stats().map_calls, maps); // no map call per packet
//! # Ok::<(), pfrag::Error>(())
//! ```

/// The crate README's example, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub mod account;
pub mod addr;
pub mod bounce;
pub mod dma;
pub mod error;
pub mod frag;
pub mod iova;
pub mod mem;
pub mod order;
pub mod pool;
mod sync;

pub use addr::{Iova, VirtAddr, PAGE_SIZE};
pub use error::{Error, OsAdvice, Result};
pub use order::Order;
