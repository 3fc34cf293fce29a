//! What differs between NICs' TX rings: the descriptor format.
//!
//! The TX engine ([`tx::Queue`](crate::tx::Queue)) owns the ring memory,
//! the indices and free-space accounting, the all-or-nothing post, the
//! splitting of buffers, the header bounce ring and inline packets, the
//! tokens, reaping and the counters. A [`Format`] says only what a NIC's
//! descriptors look like: their size, how one buffer of a packet (and the
//! offload state the device keeps, if any) is written into one, the
//! format's limits, and how a completed descriptor shows.
//!
//! A device names its format ([`TxDevice::Format`](crate::device::TxDevice::Format)),
//! so a queue cannot pair a format with a device that reads another.
//!
//! [`igb`] is the Intel 82576's advanced descriptor format.

pub mod igb;

use pfrag::Iova;

use crate::offload::{Layout, Offload};

/// One buffer of a packet, at most [`Format::MAX_BUF`] bytes, crossing no
/// boundary the queue was configured with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buf {
    /// Where the device reads it.
    pub iova: Iova,
    /// Its bytes.
    pub len: usize,
    /// Whether it is the packet's first buffer (its headers, or the whole
    /// of an inline packet).
    pub first: bool,
    /// Whether it is the packet's last buffer: the descriptor whose
    /// completion the engine waits for.
    pub last: bool,
}

/// What a format knows of the packet whose descriptors it writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    /// The offload asked for.
    pub offload: Offload,
    /// Header bytes (the first buffer's, unless the packet is inline).
    pub hlen: usize,
    /// Payload bytes after the headers.
    pub len: usize,
    /// Where the header layers are, for an offload (`None` without one).
    pub layout: Option<Layout>,
}

/// How the device reported a completed packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Sent.
    Ok,
    /// The device set an error flag; the value is the format's status word.
    Error(u32),
}

/// A NIC's TX descriptor format; see the module docs.
///
/// Descriptors are written as little-endian 64-bit words (every format
/// here is a multiple of 8 bytes), into a slot the engine picks; a format
/// never sees an index.
///
/// # Safety
///
/// The queue's doorbell hands the device exactly the buffers it gave the
/// format ([`TxDevice::kick`](crate::device::TxDevice::kick)'s promise),
/// so an implementation promises that the descriptors it writes name no
/// other memory: as the device that reads this format decodes them,
/// [`write_data`](Self::write_data) makes it read `buf.len` bytes at
/// `buf.iova` and nothing else, and [`write_context`](Self::write_context)
/// makes it read no memory at all. The status word is the only place the
/// device writes. And the queue frees a packet's buffers once
/// [`status`](Self::status) says it is done, so `status` returns `Some`
/// only for a word the device wrote back after it finished reading every
/// buffer of the packet, never for what `write_data` itself left there.
pub unsafe trait Format {
    /// A short name, for errors and reports.
    const NAME: &'static str;
    /// Bytes of one descriptor: a multiple of 8.
    const DESC_SIZE: usize;
    /// Largest buffer one data descriptor carries.
    const MAX_BUF: usize;
    /// Most payload bytes one packet may carry (the 82576's PAYLEN is 18
    /// bits).
    const MAX_PAYLOAD: usize;
    /// Byte offset, in a packet's last descriptor, of the 32-bit status
    /// word the device writes back when done.
    const STATUS_OFFSET: usize;
    /// Whether the device keeps offload state between packets, set by a
    /// descriptor of its own (the 82576's context descriptor). If so the
    /// engine writes one only when a packet's [`Context`](Self::Context)
    /// differs from the last written.
    const HAS_CONTEXT: bool;

    /// Whether the format can carry `offload`. A packet asking for one it
    /// cannot is refused ([`Error::UnsupportedOffload`](crate::Error::UnsupportedOffload))
    /// before anything is posted. All of them by default.
    fn supports(&self, offload: Offload) -> bool {
        let _ = offload;
        true
    }

    /// The offload state a context descriptor sets (`()` for a format
    /// without one).
    type Context: Copy + PartialEq + std::fmt::Debug;

    /// The context an offloaded packet with headers at `layout` needs.
    fn context(&self, layout: &Layout, offload: Offload) -> Self::Context;

    /// Writes the context descriptor for `ctx` into `desc`
    /// ([`DESC_SIZE`](Self::DESC_SIZE)` / 8` words). Only called if
    /// [`HAS_CONTEXT`](Self::HAS_CONTEXT).
    fn write_context(&self, desc: &mut [u64], ctx: &Self::Context);

    /// Writes the data descriptor for `buf` of `pkt` into `desc`. The last
    /// buffer's descriptor must ask for the status write-back.
    fn write_data(&self, desc: &mut [u64], buf: Buf, pkt: &Packet);

    /// The packet's completion, from the status word of its last
    /// descriptor: `None` while the device has not written it back.
    fn status(&self, word: u32) -> Option<Status>;
}
