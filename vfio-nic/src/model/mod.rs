//! Device models: software stand-ins for a NIC's TX engine that consume
//! their format's descriptors from the queue's ring, and reach memory only through
//! an IOMMU translation (`pfrag::dma::Translate`). They are simulators: they
//! measure what the driver and the IOMMU model do per packet, not what a
//! real NIC does.
//!
//! - [`softnic`]: reads, verifies and checksums every payload byte,
//!   segments TSO packets into frames.
//! - [`null`]: translates every buffer and completes it, reading no
//!   payload: the driver's own cost.
//! - [`virtio`]: a virtio-net device's TX queue on `virtio-queue`, reading
//!   the split virtqueue format; segments and verifies like the software
//!   NIC.
//! - [`thread`]: runs any of them on a thread of its own, polling the doorbell
//!   beside the driver (optionally paced to a line rate).

pub mod null;
mod ring;
mod segment;
pub mod softnic;
mod stats;
pub mod thread;
pub mod virtio;

pub use softnic::NicStats as Stats;

/// A device model whose counters a run reads (the software NIC, the null
/// device, either on a thread).
pub trait Model: crate::device::TxDevice {
    /// The model's counters.
    fn counters(&self) -> softnic::NicStats;
    /// The frames it captured so far, emptied (none for a model that
    /// captures nothing).
    fn take_frames(&mut self) -> Vec<Vec<u8>> {
        Vec::new()
    }
    /// Whether a doorbell can be served a descriptor at a time: the model
    /// reports its head as a ring slot and stops at the tail it is given,
    /// which pacing to a line rate needs ([`thread::Config::line_rate_gbit`]).
    /// True by default; the virtio-net model takes whole available rings.
    fn paceable(&self) -> bool {
        true
    }
}
