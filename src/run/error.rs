//! How a run fails: every error carries its numbers.

/// Failures of a run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The NIC side failed.
    #[error(transparent)]
    Nic(#[from] vfio_nic::Error),
    /// The pool side failed.
    #[error(transparent)]
    Pool(#[from] pfrag::Error),
    /// A setting is out of range.
    #[error("invalid setting: {0}")]
    Setting(String),
    /// A queue's thread could not be created (e.g. the process's thread
    /// limit, `ulimit -u`); the run's other threads left without running.
    #[error("could not start the thread of queue {queue} of {queues}: {source}")]
    Spawn {
        /// The queue.
        queue: usize,
        /// The run's queues.
        queues: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// A queue's thread panicked (a bug, not a setting).
    #[error("the thread of queue {queue} panicked")]
    Panicked {
        /// The queue.
        queue: usize,
    },
    /// The run's packets carry more payload than one packet may on the
    /// format its queues write (the 82576's PAYLEN is 18 bits, a
    /// virtio-net packet carries at most 65,535 bytes) or than its pool
    /// allows, so no retry sends them: found before the run
    /// ([`check`](super::check)), or by the queue.
    #[error(
        "a {payload}-byte payload is more than one packet carries on the {format} format \
         (at most {max} B): use smaller packets"
    )]
    PayloadTooLarge {
        /// Payload bytes of the packet.
        payload: usize,
        /// The most one packet carries there.
        max: usize,
        /// The descriptor format the queue writes.
        format: &'static str,
    },
    /// A packet of the run takes more buffers than one packet may have, as
    /// its queue counts them before carving its frags, so no retry sends
    /// it: found before the run ([`check`](super::check)), or by the queue.
    #[error(
        "a {payload}-byte packet takes up to {needed} buffers on the {format} format \
         (order-{order} chunks{}{}), one packet may have {max}: use larger chunks or \
         smaller packets",
        .boundary.map_or(String::new(), |b| format!(", buffers cut at {b} B")),
        if *.fit_whole { "" } else { ", not fit whole" }
    )]
    TooManyBuffers {
        /// Payload bytes of the packet.
        payload: usize,
        /// Buffers (header and data) it takes, at most.
        needed: usize,
        /// The most one packet may have.
        max: usize,
        /// The descriptor format the queue writes.
        format: &'static str,
        /// Chunk order of the run's pool.
        order: u32,
        /// Where data buffers are cut, if anywhere.
        boundary: Option<usize>,
        /// Whether each payload is fit whole into one chunk (if not, its
        /// first bytes may take a chunk's tail: one buffer more).
        fit_whole: bool,
    },
    /// A packet of the run needs more descriptors than its ring holds, so
    /// no retry sends it: found before the run from the least it needs
    /// ([`check`](super::check)), or by the queue from its exact count.
    #[error(
        "a {payload}-byte packet needs at least {needed} descriptors on the {format} format \
         (order-{order} chunks{}), a ring of {ring} holds {capacity}: use a larger ring, \
         larger chunks or smaller packets",
        .boundary.map_or(String::new(), |b| format!(", buffers cut at {b} B"))
    )]
    PacketTooLarge {
        /// Payload bytes of the packet.
        payload: usize,
        /// Descriptors it needs.
        needed: usize,
        /// The descriptor format the queue writes.
        format: &'static str,
        /// Chunk order of the run's pool.
        order: u32,
        /// Where data buffers are cut, if anywhere.
        boundary: Option<usize>,
        /// Descriptors in the ring.
        ring: u16,
        /// Descriptors the ring holds at once (one fewer).
        capacity: usize,
    },
    /// The warm-up lost packets, which the measured part's counters,
    /// started after it, would not show.
    #[error(
        "the warm-up lost packets: {lost} losses counted (DMA faults, corrupt payloads, bad \
         descriptors or completions with an error)"
    )]
    WarmUp {
        /// Losses counted during the warm-up: DMA faults, corrupt
        /// payloads, bad descriptors and completions with an error (not a
        /// count of packets: a lost packet makes one or more).
        lost: u64,
    },
}
