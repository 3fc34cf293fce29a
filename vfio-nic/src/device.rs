//! The device side of a TX queue, as the queue sees it.

use pfrag::Iova;

use crate::error::Result;

/// A NIC TX queue engine: the device models here
/// ([`SoftNic`](crate::model::softnic::SoftNic),
/// [`VirtioNet`](crate::model::virtio::VirtioNet), ...), the 82576 through
/// VFIO elsewhere. The queue owns the ring; the device reads descriptors
/// of its [`Format`](crate::format::Format) from it and reports completion
/// the format's way (`DD`, a used ring).
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
    /// the caller keeps for the device (the format's
    /// [`ring_bytes`](crate::format::Format::ring_bytes) of memory) until it attaches another ring or
    /// detaches, and a device that a queue owns must not be re-pointed
    /// behind the queue's back (the queue's own doorbell would then vouch
    /// for descriptors it never wrote).
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()>;
    /// Doorbell: descriptors before `tail` are ready (for a format with an
    /// available ring, those it published there). An error means the
    /// device took none of them: the queue may still rewrite the
    /// descriptors it posted since the last doorbell that succeeded (it
    /// asks the last of them for a report, [`Format::ask_report`](crate::format::Format::ask_report)),
    /// and rings again with them later. The one exception is
    /// [`Error::DeviceStopped`](crate::Error::DeviceStopped): the device
    /// stopped part way, may have taken some of them, and takes nothing
    /// more until it is reset; a queue keeps every packet in flight, as it
    /// does after any failed doorbell, and frees them only once the device
    /// is detached.
    ///
    /// # Safety
    /// The doorbell hands memory to the device. Every descriptor from the
    /// device's head up to `tail` (or published in the available ring),
    /// and every buffer those descriptors name, must be memory that no CPU
    /// reference touches (other than [`Coherent`](pfrag::dma::Coherent)'s
    /// atomic accessors, of the same size as the device's accesses to the
    /// same bytes), counting the whole aligned 4-byte words that hold it
    /// (a device access rewrites or lends whole words, see
    /// [`Translate`](pfrag::dma::Translate)), from this call until the device reports the packet done
    /// (the status write-back of its last descriptor, or its head in the
    /// used ring) or is detached. Where the format defers reports
    /// ([`Format::DEFERRED_REPORT`](crate::format::Format::DEFERRED_REPORT)),
    /// a report of a later packet of the same ring reports this one done
    /// too: a device of such a format reads no packet's memory after it
    /// has reported a later packet. A model reads that memory through
    /// [`Translate`](pfrag::dma::Translate); a real NIC by DMA.
    /// [`tx::Queue`](crate::tx::Queue) keeps this promise for the
    /// descriptors it writes: their buffers are frags it owns until it
    /// reaps them, and its own header ring.
    unsafe fn kick(&mut self, tail: u16) -> Result<()>;
    /// Stops the device using the ring (before the ring is freed): once it
    /// returns `Ok`, the device reads no memory the ring or its packets
    /// name, or will not once it is dropped (the default, for a device
    /// that stops in its own `Drop`). [`tx::Queue`](crate::tx::Queue)
    /// calls it when it hands the device back and when it is dropped
    /// (dropping the device next, before the ring); after an `Err` or a
    /// panic it keeps the ring and every packet in flight allocated and
    /// mapped for good.
    fn detach(&mut self) -> Result<()> {
        Ok(())
    }
    /// The device's head pointer, for diagnostics (a timeout reports it).
    fn head(&mut self) -> Option<u16> {
        None
    }
    /// Whether the device still runs: [`Error::DeviceStopped`](crate::Error::DeviceStopped) if it
    /// stopped on its own (a virtio device's `NEEDS_RESET`), or the error
    /// of asking. A [`tx::Queue`](crate::tx::Queue) asks only when a wait
    /// finds nothing to reap for a while and when it gives up, never per
    /// packet (a real device answers with a register read). The default,
    /// for a device that cannot stop on its own: `Ok`.
    fn check_running(&mut self) -> Result<()> {
        Ok(())
    }
}
