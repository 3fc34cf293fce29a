//! Giving the device back: [`Queue::into_device`] and the error that
//! hands the queue back when it cannot, so that nothing in flight is lost
//! (as [`std::io::IntoInnerError`] hands back a writer that could not
//! flush).

use std::fmt;

use pfrag::dma::DmaMapper;

use super::Queue;
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
    /// `?` turns the error into an [`Error`], dropping the queue (and
    /// stopping the device) as the end of a driver would.
    pub fn into_device(mut self) -> std::result::Result<D, IntoDeviceError<M, D>> {
        if !self.pending.is_empty() {
            let in_flight = self.pending.len();
            return Err(IntoDeviceError::new(self, Error::Busy { in_flight }));
        }
        if let Err(e) = self.dev.detach() {
            return Err(IntoDeviceError::new(self, e));
        }
        let Queue { dev, ring, .. } = self;
        drop(ring);
        Ok(dev)
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
