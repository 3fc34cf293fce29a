//! The device side of a TX queue, as the queue sees it.

use pfrag::Iova;

use crate::error::Result;

/// A NIC TX queue engine: the [`SoftNic`](crate::model::softnic::SoftNic) model
/// here, the 82576 through VFIO elsewhere. The queue owns the descriptor
/// ring; the device reads descriptors from it and writes back `DD`.
pub trait TxDevice {
    /// Points the device at a ring of `len` descriptors at `ring`.
    fn attach(&mut self, ring: Iova, len: u16) -> Result<()>;
    /// Doorbell: descriptors before `tail` are ready.
    fn kick(&mut self, tail: u16) -> Result<()>;
    /// Stops the device using the ring (before the ring is freed).
    fn detach(&mut self) -> Result<()> {
        Ok(())
    }
    /// The device's head pointer, for diagnostics (a timeout reports it).
    fn head(&mut self) -> Option<u16> {
        None
    }
}

/// A device model whose counters a run reads (the software NIC, the null
/// device).
pub trait Model: TxDevice {
    /// The model's counters.
    fn counters(&self) -> crate::model::softnic::NicStats;
}
