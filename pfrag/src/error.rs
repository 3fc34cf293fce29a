//! The crate's one error type.

use std::io;

use crate::addr::Iova;

/// Everything that can go wrong in pfrag. Variants carry the numbers that
/// explain the failure and, where the OS said no, the `io::Error` with its errno.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A chunk order outside `0..=MAX_ORDER`.
    #[error("order {order} is out of range (0..={max})")]
    BadOrder {
        /// The order asked for.
        order: u32,
        /// The largest order supported.
        max: u32,
    },
    /// A zero-length frag, payload or mapping.
    #[error("length 0 is not a valid request")]
    ZeroLength,
    /// A single frag asked to fit whole but larger than one chunk.
    #[error("{len} bytes do not fit in one chunk of {chunk} bytes")]
    LargerThanChunk {
        /// Bytes requested.
        len: usize,
        /// Chunk size of the pool.
        chunk: usize,
    },
    /// A payload larger than the pool's configured maximum.
    #[error("payload of {len} bytes exceeds the pool's maximum of {max} bytes")]
    TooLarge {
        /// Bytes requested.
        len: usize,
        /// Largest payload the pool accepts.
        max: usize,
    },
    /// Growing the pool would pass its byte limit.
    #[error("pool limit reached: {held} bytes held, {requested} more requested, max {max}")]
    LimitReached {
        /// Bytes the pool already holds.
        held: u64,
        /// Bytes the growth needed.
        requested: u64,
        /// The configured maximum.
        max: u64,
    },
    /// A number outside the range the setting accepts.
    #[error("{what} = {value} is out of range ({min}..={max})")]
    OutOfRange {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The smallest value accepted.
        min: u64,
        /// The largest value accepted.
        max: u64,
    },
    /// A floating-point setting that is not a finite, non-negative number.
    #[error("{what} = {value} is not a finite, non-negative number")]
    BadFloat {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: f64,
    },
    /// Flushing deferred IOTLB invalidations failed.
    #[error("IOTLB flush failed (errno {errno:?}): {source}", errno = errno_of(.source))]
    Flush {
        /// What the OS (or a fault injector) said.
        #[source]
        source: io::Error,
    },
    /// An invalid configuration value.
    #[error("invalid configuration: {what} = {value}")]
    BadConfig {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: u64,
    },
    /// A DMA map request that is not aligned to the mapper's page size.
    #[error("unaligned mapping: iova {iova}, addr {addr:#x}, len {len:#x} (page {page:#x})")]
    Unaligned {
        /// IOVA of the request.
        iova: Iova,
        /// Host address of the request.
        addr: usize,
        /// Length of the request.
        len: u64,
        /// The page size it must be aligned to.
        page: u64,
    },
    /// Growth would pass the process-wide memory limit of the pool's
    /// [`MemAccount`](crate::account::MemAccount): back off (complete
    /// frags) and retry.
    #[error("memory limit: {allocated} bytes in use, {requested} more requested, max {max}")]
    MemoryLimit {
        /// Bytes charged to the account.
        allocated: u64,
        /// Bytes the growth needed.
        requested: u64,
        /// The account's `max`.
        max: u64,
    },
    /// A queue index past the pool's queues.
    #[error("queue {queue} does not exist (the pool has {queues})")]
    BadQueue {
        /// The queue asked for.
        queue: usize,
        /// Queues configured.
        queues: usize,
    },
    /// The mapper refused a map request.
    #[error("DMA map of {len:#x} bytes at iova {iova} failed (errno {errno:?}): {source}", errno = errno_of(.source))]
    Map {
        /// IOVA of the request.
        iova: Iova,
        /// Length of the request.
        len: u64,
        /// What the OS (or the model, with the errno the kernel would give) said.
        #[source]
        source: io::Error,
    },
    /// The mapper refused an unmap request.
    #[error("DMA unmap of {len:#x} bytes at iova {iova} failed (errno {errno:?}): {source}", errno = errno_of(.source))]
    Unmap {
        /// IOVA of the request.
        iova: Iova,
        /// Length of the request.
        len: u64,
        /// What the OS (or the model) said.
        #[source]
        source: io::Error,
    },
    /// Two ranges of one unmap batch that share bytes, refused before any
    /// unmap: nothing was unmapped, freed or pinned.
    #[error(
        "unmap ranges overlap: iova {first} + {first_len:#x} and iova {second} + {second_len:#x}"
    )]
    OverlappingRanges {
        /// Start of the range that begins first.
        first: Iova,
        /// Its length.
        first_len: u64,
        /// Start of the range that begins inside it.
        second: Iova,
        /// Its length.
        second_len: u64,
    },
    /// No free IOVA range of the requested size and alignment.
    #[error("IOVA space exhausted: no free range of {size:#x} bytes aligned to {align:#x}")]
    IovaExhausted {
        /// Size requested.
        size: u64,
        /// Alignment requested.
        align: u64,
    },
    /// An IOVA range given back that is not in use: never allocated, freed
    /// already, or past the allocator's space.
    #[error("IOVA range {iova} + {size:#x} is not in use ({in_use:#x} bytes are)")]
    IovaNotInUse {
        /// Start of the range.
        iova: Iova,
        /// Its length.
        size: u64,
        /// Bytes the allocator had handed out.
        in_use: u64,
    },
    /// Anonymous memory could not be mapped.
    #[error("mmap of {len} bytes failed (errno {errno:?})", errno = .source.raw_os_error())]
    Mmap {
        /// Bytes requested.
        len: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A header longer than a bounce slot.
    #[error("header of {len} bytes does not fit a {slot}-byte bounce slot")]
    HeaderTooLarge {
        /// Header length.
        len: usize,
        /// Slot size.
        slot: usize,
    },
    /// A bounce slot still owned by an uncompleted TX.
    #[error("bounce slot {slot} is still in flight")]
    SlotBusy {
        /// The slot index.
        slot: usize,
    },
    /// A bounce slot index past the end of the ring.
    #[error("bounce slot {slot} is out of range (ring has {slots} slots)")]
    SlotOutOfRange {
        /// The slot index.
        slot: usize,
        /// Slots in the ring.
        slots: usize,
    },
}

impl Error {
    /// The errno behind a map, unmap or mmap failure, whether the mapper
    /// gave a plain OS error or an [`OsAdvice`].
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Map { source, .. }
            | Error::Unmap { source, .. }
            | Error::Flush { source }
            | Error::Mmap { source, .. } => errno_of(source),
            _ => None,
        }
    }
}

/// An OS error together with what to do about it, for mappers whose errnos
/// have a known cause (VFIO's `ENOSPC` is its mapping limit, `ENOMEM` the
/// locked-memory limit). Carried inside an [`io::Error`] so that
/// [`Error::errno`] still finds the number.
#[derive(Debug, thiserror::Error)]
#[error("{}; {hint}", io::Error::from_raw_os_error(*errno))]
pub struct OsAdvice {
    /// The errno the OS returned.
    pub errno: i32,
    /// What the user can do about it.
    pub hint: String,
}

impl OsAdvice {
    /// An `io::Error` of the errno's kind carrying `errno` and `hint`.
    pub fn io(errno: i32, hint: impl Into<String>) -> io::Error {
        let kind = io::Error::from_raw_os_error(errno).kind();
        io::Error::new(
            kind,
            OsAdvice {
                errno,
                hint: hint.into(),
            },
        )
    }
}

/// The errno of `e`: its raw OS error, or the one in an [`OsAdvice`].
pub fn errno_of(e: &io::Error) -> Option<i32> {
    e.raw_os_error().or_else(|| {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<OsAdvice>())
            .map(|a| a.errno)
    })
}

/// Shorthand for pfrag results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
