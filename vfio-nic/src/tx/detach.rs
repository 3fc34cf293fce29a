//! Giving the device back: [`Queue::into_device`] and the error that
//! hands the queue back when it cannot, so that nothing in flight is lost
//! (as [`std::io::IntoInnerError`] hands back a writer that could not
//! flush).

use std::any::Any;
use std::fmt;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use pfrag::dma::{Coherent, DmaMapper};
use pfrag::frag::Frag;

use super::{Hdr, Queue};
use crate::device::TxDevice;
use crate::error::Error;

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// Detaches the device and hands it back, for another queue. Everything
    /// posted must have completed and been reaped first
    /// ([`wait_tokens`](Self::wait_tokens)). Otherwise the queue comes back
    /// whole in the error, its device attached and its packets in flight
    /// ([`Error::Busy`]): wait and try again. A device that fails to
    /// detach comes back the same way, with its error.
    ///
    /// The queue frees its ring once the device is handed back, trusting
    /// the [`detach`](TxDevice::detach) that returned `Ok`. A device that
    /// keeps the default `detach` (it stops only in its own `Drop`) is
    /// handed back still holding the ring's IOVA: the ring is unmapped
    /// first, so what it reads there faults, but such a device is better
    /// dropped with the queue, which stops it before the ring goes.
    ///
    /// `?` turns the error into an [`Error`], dropping the queue (and
    /// stopping the device) as the end of a driver would.
    pub fn into_device(mut self) -> std::result::Result<D, IntoDeviceError<M, D>> {
        if !self.pending.is_empty() {
            let in_flight = self.pending.len();
            return Err(IntoDeviceError::new(self, Error::Busy { in_flight }));
        }
        // Until it returns: a detach that panics leaves a device that may
        // still run, and the queue's drop, on the way out, keeps what it
        // may read.
        self.detaching = true;
        let r = self.dev_mut().detach();
        self.detaching = false;
        if let Err(e) = r {
            return Err(IntoDeviceError::new(self, e));
        }
        // Detached: the queue's drop frees the ring and stops nothing.
        match self.dev.take() {
            Some(dev) => Ok(dev),
            None => unreachable!("the device is handed back only with the queue"),
        }
    }

    /// Keeps for good what a device that could not be stopped may still
    /// read: every in-flight packet's frags and header frag
    /// ([`Frag::pin`]: their chunks are pinned, never reused) and the
    /// bounce ring ([`bounce::Ring::pin`](pfrag::bounce::Ring::pin)),
    /// allocated and mapped.
    fn keep_in_flight(&mut self) {
        while let Some(mut p) = self.pending.pop() {
            if let Hdr::Frag(f) = p.take_header() {
                f.pin();
            }
            p.take_frags().into_iter().flatten().for_each(Frag::pin);
        }
        if let Some(b) = self.bounce.take() {
            b.pin();
        }
    }
}

/// Points `dev` at `ring` (`len` descriptors) and hands both back. If the
/// device fails to take it, the device is stopped before the ring is freed:
/// its [`detach`](TxDevice::detach), then the device itself is dropped
/// (one that stops only in its own `Drop` stops there), then the ring. A
/// detach that fails or panics, or an attach that panics, may leave the
/// device holding the ring: it is kept for good
/// ([`Coherent::pin`](pfrag::dma::Coherent::pin)), and a panic goes on.
///
/// # Safety
/// As [`TxDevice::attach`], for `ring`, which the queue keeps for the
/// device.
pub(super) unsafe fn attach<M: DmaMapper, D: TxDevice>(
    mut dev: D,
    ring: Coherent<M>,
    len: u16,
) -> Result<(D, Coherent<M>), Error> {
    // SAFETY: the caller's promise for `ring` is passed on unchanged.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe { dev.attach(ring.iova(), len) }));
    let error = match r {
        Ok(Ok(())) => return Ok((dev, ring)),
        Ok(Err(e)) => e,
        Err(panic) => {
            // It may hold the ring, and no detach could show otherwise.
            let _ = stop(dev, false);
            ring.pin();
            resume_unwind(panic);
        }
    };
    let (stopped, panic) = stop(dev, true);
    if stopped {
        drop(ring);
    } else {
        ring.pin();
    }
    if let Some(p) = panic {
        resume_unwind(p);
    }
    Err(error)
}

/// Stops `dev` as far as it can be: its [`detach`](TxDevice::detach) if
/// `detach`, then its drop (a device that stops only in its own `Drop`
/// stops there), each under `catch_unwind`. Whether it is known to have
/// stopped (a detach that returned `Ok` and a drop that returned; never
/// without `detach`), and the first panic, for the caller to pass on or
/// not.
fn stop<D: TxDevice>(mut dev: D, detach: bool) -> (bool, Option<Box<dyn Any + Send>>) {
    let detached = if detach {
        catch_unwind(AssertUnwindSafe(|| dev.detach().is_ok()))
    } else {
        Ok(false)
    };
    let dropped = catch_unwind(AssertUnwindSafe(|| drop(dev)));
    match (detached, dropped) {
        (Ok(stopped), Ok(())) => (stopped, None),
        (Err(panic), _) | (_, Err(panic)) => (false, Some(panic)),
    }
}

/// Stops the device before any memory it may read is freed: the device's
/// [`detach`](TxDevice::detach), then the device itself (one that stops
/// only in its own `Drop`, keeping the default `detach`, stops here), the
/// ring, the in-flight packets' frags (unmapped and recycled) and the
/// rest. A device whose detach fails or panics (here, or in
/// [`into_device`](Queue::into_device)) may still read the ring and every
/// packet in flight, and so may one whose own drop panics: they are kept
/// for good instead
/// ([`Coherent::pin`](pfrag::dma::Coherent::pin), [`Frag::pin`]), counted
/// in the domain's [`pinned`](pfrag::dma::Domain::pinned) host bytes (a
/// frag's chunk in its pool's pinned chunks, and in the domain's bytes
/// once the pool is dropped), never handed out again. A panic of
/// `detach` or of the device's drop here is not passed on: the panic hook reports it, and a drop
/// that panics could abort.
impl<M: DmaMapper, D: TxDevice> Drop for Queue<M, D> {
    fn drop(&mut self) {
        let stopped = match self.dev.take() {
            // `into_device` detached it and handed it back.
            None => true,
            // Unless its detach in `into_device` panicked, detached here.
            Some(dev) => stop(dev, !self.detaching).0,
        };
        if stopped {
            // SAFETY: the ring is dropped here, once, as the queue is
            // dropped, and never used after.
            unsafe { ManuallyDrop::drop(&mut self.ring) };
            return;
        }
        self.keep_in_flight();
        // SAFETY: the ring is taken here, once, as the queue is dropped,
        // and never used after.
        unsafe { ManuallyDrop::take(&mut self.ring) }.pin();
    }
}

/// Why [`Queue::into_device`] kept the device, with the queue handed back.
pub struct IntoDeviceError<M: DmaMapper, D: TxDevice> {
    /// Boxed: the queue is large, and the error path is rare.
    queue: Box<Queue<M, D>>,
    error: Error,
}

impl<M: DmaMapper, D: TxDevice> IntoDeviceError<M, D> {
    fn new(queue: Queue<M, D>, error: Error) -> Self {
        IntoDeviceError {
            queue: Box::new(queue),
            error,
        }
    }

    /// Why: [`Error::Busy`], or the device's detach error.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The queue, as it was: wait for what is in flight and try again.
    pub fn into_queue(self) -> Queue<M, D> {
        *self.queue
    }

    /// The error and the queue.
    pub fn into_parts(self) -> (Error, Queue<M, D>) {
        (self.error, *self.queue)
    }
}

impl<M: DmaMapper, D: TxDevice> fmt::Debug for IntoDeviceError<M, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IntoDeviceError")
            .field("error", &self.error)
            .field("queue", &self.queue)
            .finish()
    }
}

impl<M: DmaMapper, D: TxDevice> fmt::Display for IntoDeviceError<M, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<M: DmaMapper, D: TxDevice> std::error::Error for IntoDeviceError<M, D> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl<M: DmaMapper, D: TxDevice> From<IntoDeviceError<M, D>> for Error {
    /// The error alone; the queue is dropped.
    fn from(e: IntoDeviceError<M, D>) -> Error {
        e.error
    }
}
