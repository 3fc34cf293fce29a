//! The device side of a TX queue, as the queue sees it.

use pfrag::Iova;

use crate::error::Result;

/// A NIC TX queue engine: the [`SoftNic`](crate::model::softnic::SoftNic) model
/// here, the 82576 through VFIO elsewhere. The queue owns the descriptor
/// ring; the device reads descriptors from it and writes back `DD`.
///
/// Ringing a model's doorbell yourself takes `unsafe`:
///
/// ```compile_fail,E0133
/// use pfrag::dma::Identity;
/// use vfio_nic::device::TxDevice;
/// use vfio_nic::model::null::NullNic;
///
/// let mut nic = NullNic::new(Identity::new());
/// let _ = nic.kick(1); // needs `unsafe`
/// ```
///
/// So does pointing it at a ring, which a queue's later doorbells would
/// vouch for:
///
/// ```compile_fail,E0133
/// use pfrag::dma::Identity;
/// use pfrag::Iova;
/// use vfio_nic::device::TxDevice;
/// use vfio_nic::model::null::NullNic;
///
/// let mut nic = NullNic::new(Identity::new());
/// let _ = nic.attach(Iova(0x1000), 8); // needs `unsafe`
/// ```
pub trait TxDevice {
    /// The descriptor format the device reads: a queue over the device
    /// writes this one, so a format cannot be paired with a device that
    /// reads another.
    type Format: crate::format::Format;
    /// The format, as the device was set up (a format may depend on what
    /// the device offers).
    fn format(&self) -> Self::Format;
    /// Points the device at a ring of `len` descriptors at `ring`.
    ///
    /// # Safety
    /// The doorbells rung after this call, by whoever rings them (a
    /// [`tx::Queue`](crate::tx::Queue) that owns the device, say), hand over
    /// descriptors of this ring: so `ring` must be `len` descriptors that
    /// the caller keeps for the device until it attaches another ring or
    /// detaches, and a device that a queue owns must not be re-pointed
    /// behind the queue's back (the queue's own doorbell would then vouch
    /// for descriptors it never wrote).
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()>;
    /// Doorbell: descriptors before `tail` are ready.
    ///
    /// # Safety
    /// The doorbell hands memory to the device. Every descriptor from the
    /// device's head up to `tail`, and every buffer those descriptors
    /// name, must be memory that no CPU reference touches (other than
    /// [`Coherent`](pfrag::dma::Coherent)'s atomic accessors) from this
    /// call until the device reports the packet done (the status
    /// write-back of its last descriptor) or is detached. A model reads that memory through
    /// [`Translate`](pfrag::dma::Translate); a real NIC by DMA.
    /// [`tx::Queue`](crate::tx::Queue) keeps this promise for the
    /// descriptors it writes: their buffers are frags it owns until it
    /// reaps them, and its own header ring.
    unsafe fn kick(&mut self, tail: u16) -> Result<()>;
    /// Stops the device using the ring (before the ring is freed).
    fn detach(&mut self) -> Result<()> {
        Ok(())
    }
    /// The device's head pointer, for diagnostics (a timeout reports it).
    fn head(&mut self) -> Option<u16> {
        None
    }
}
