//! The crate's one error type.

/// Everything the NIC side can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pool, mapper or bounce ring said no.
    #[error(transparent)]
    Pool(#[from] pfrag::Error),
    /// Not enough free descriptors for the packet: back off and reap.
    #[error("TX ring full: packet needs up to {needed} descriptors, {free} free")]
    RingFull {
        /// Descriptors the packet may need.
        needed: usize,
        /// Descriptors free now.
        free: usize,
    },
    /// A flow index past the configured flows.
    #[error("flow {flow} does not exist ({flows} flows)")]
    BadFlow {
        /// The flow asked for.
        flow: usize,
        /// Flows configured.
        flows: usize,
    },
    /// More buffers for one packet than the device takes.
    #[error("packet needs {needed} buffers, the device takes at most {max}")]
    TooManyBuffers {
        /// Buffers needed.
        needed: usize,
        /// The device limit.
        max: usize,
    },
    /// An invalid configuration value.
    #[error("invalid configuration: {what} = {value}")]
    BadConfig {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: u64,
    },
    /// The device was kicked before a ring was attached.
    #[error("no TX ring attached to the device")]
    NotAttached,
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
