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
//! [`igb`] is the Intel 82576's advanced descriptor format; [`virtio`] is
//! virtio-net's split virtqueue.

pub mod igb;
pub mod virtio;

use pfrag::dma::{Coherent, DmaMapper};
use pfrag::Iova;

use crate::error::Result;
use crate::offload::{Layout, Offload};

/// Most data buffers (descriptors, the header's included) one packet may
/// chain, for every format and device of this crate: a device model counts
/// a longer chain as malformed, so a queue refuses a
/// [`max_bufs`](crate::tx::Config::max_bufs) above it.
pub const MAX_BUFS: usize = 64;

/// The queue's ring memory, as a format sees it beyond the descriptors it
/// writes: the indices and rings of a format whose device reads more than
/// a descriptor table (virtio's available and used rings), by byte offset
/// from the ring's start. Only the engine makes one, for the duration of
/// one call into the format, while no other CPU access to the ring runs.
pub struct RingMem<'a, M: DmaMapper> {
    ring: &'a Coherent<M>,
    size: u16,
}

impl<M: DmaMapper> std::fmt::Debug for RingMem<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMem")
            .field("iova", &self.ring.iova())
            .field("size", &self.size)
            .finish()
    }
}

impl<'a, M: DmaMapper> RingMem<'a, M> {
    /// The engine's view of its own ring of `size` descriptors.
    pub(crate) fn new(ring: &'a Coherent<M>, size: u16) -> Self {
        RingMem { ring, size }
    }
    /// Descriptors in the ring.
    pub fn size(&self) -> u16 {
        self.size
    }
    /// Where the ring starts, as the device sees it.
    pub fn iova(&self) -> Iova {
        self.ring.iova()
    }
    /// The 16-bit value at `off` (2-byte aligned), an atomic load with
    /// acquire ordering.
    pub fn read_u16(&self, off: usize) -> Result<u16> {
        // SAFETY: the ring is the queue's own and private, and the engine
        // makes a `RingMem` only inside a `&mut self` call: no other
        // driver-side access to it runs meanwhile. The device's accesses
        // to words the format reads or writes as 16 bits are 16-bit
        // atomics too (the `Format` contract): no mixed-size race.
        Ok(unsafe { self.ring.read_u16(off) }?)
    }
    /// Stores the 16-bit `v` at `off` (2-byte aligned), atomically with
    /// release ordering: what came before is visible to a device that
    /// sees it.
    pub fn write_u16(&self, off: usize, v: u16) -> Result<()> {
        // SAFETY: as in `read_u16`.
        Ok(unsafe { self.ring.write_u16(off, v) }?)
    }
    /// The 32-bit value at `off` (4-byte aligned), with acquire ordering.
    pub fn read_u32(&self, off: usize) -> Result<u32> {
        Ok(self.ring.read_u32(off)?)
    }
}

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
    /// The ring slot of the packet's next descriptor, for a format that
    /// chains a packet's descriptors by index (virtio's `next`); others
    /// ignore it. Meaningless in the last buffer.
    pub next: u16,
    /// Whether the device is to report the packet's completion (the
    /// 82576's RS bit). Always true unless the format defers reports
    /// ([`Format::DEFERRED_REPORT`]). Meaningful in the last buffer.
    pub report: bool,
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
#[non_exhaustive]
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
/// buffer of the packet, never for what `write_data` itself left there;
/// the same holds for [`done`](Self::done), if overridden, which judges
/// each packet on its own: a reap asks it about a reported packet while
/// older ones may still be in flight, so an answer worked out from the
/// packet's place relative to the oldest (a head index compared with the
/// slots) would free buffers the device still reads.
/// [`ask_report`](Self::ask_report) leaves a descriptor naming exactly
/// the memory it named before, and only adds the request for the status
/// write-back; where the format defers reports
/// ([`DEFERRED_REPORT`](Self::DEFERRED_REPORT)), a descriptor with that
/// request is one the device writes back. Where the
/// device and the engine may touch the same ring bytes at once (indices,
/// flags, event words), the device's accesses are atomic and of the size
/// the format's own [`RingMem`] accesses use for them; every other ring
/// byte the device writes (a used entry) it writes before a release store
/// that the format reads with an acquire load (its index) before reading
/// the byte.
pub unsafe trait Format {
    /// A short name, for errors and reports.
    const NAME: &'static str;
    /// Bytes of one descriptor: a multiple of 8.
    const DESC_SIZE: usize;
    /// Largest buffer one data descriptor carries.
    const MAX_BUF: usize;
    /// Most payload bytes one packet may carry (the 82576's PAYLEN is 18
    /// bits). For a TSO packet the payload is what follows its headers;
    /// for any other packet the whole frame, headers included, counts
    /// ([`offload::max_payload`](crate::offload::max_payload)).
    const MAX_PAYLOAD: usize;
    /// Byte offset, in a packet's last descriptor, of the 32-bit status
    /// word the device writes back when done.
    const STATUS_OFFSET: usize;
    /// Whether the device keeps offload state between packets, set by a
    /// descriptor of its own (the 82576's context descriptor). If so the
    /// engine writes one only when a packet's [`Context`](Self::Context)
    /// differs from the last written.
    const HAS_CONTEXT: bool;

    /// Whether a TSO packet, before the device cuts it, must itself be an
    /// IP packet whose 16-bit length field holds it (IPv4's total length
    /// counts the IP header, the TCP header and the payload; IPv6's
    /// payload length the TCP header and the payload). virtio-net's GSO
    /// packet is one: its payload is then at most 65,495 bytes behind
    /// IPv4 and TCP headers of 20 bytes each. False by default: the
    /// 82576 takes the headers as a template and counts the payload
    /// alone (PAYLEN).
    const TSO_IP_LENGTH: bool = false;
    /// Bytes the format puts in front of every packet's headers, in the
    /// same buffer (virtio-net's `virtio_net_hdr`); 0 by default. Written
    /// by [`write_prefix`](Self::write_prefix).
    const PREFIX: usize = 0;
    /// Whether the device fills in the IPv4 header checksum of an
    /// offloaded packet (the 82576's `IXSM`; true by default). If not
    /// (virtio-net), the engine computes it in the headers it posts.
    const INSERTS_IPV4_CSUM: bool = true;
    /// Whether the device completes a partial L4 checksum: it sums the
    /// packet from the L4 header on, the checksum field included, so the
    /// field must hold the pseudo-header sum (virtio-net's `NEEDS_CSUM`,
    /// the 82576's `TXSM`). If so, the engine writes it into the headers
    /// it posts for every offloaded packet, over the L4 length that
    /// [`TSO_PSEUDO_LENGTH`](Self::TSO_PSEUDO_LENGTH) says for TSO. False
    /// by default: the device computes the checksum from scratch.
    const PSEUDO_HEADER_SUM: bool = false;
    /// For TSO, whether the pseudo-header sum in the checksum field counts
    /// the whole packet's L4 length, which the device moves to each
    /// segment's (virtio-net, as Linux's GSO leaves it; true by default),
    /// or no length at all, each segment's being the device's to add (the
    /// 82576, as Intel's datasheets and Linux's igb have it). A packet
    /// without TSO counts its own L4 length either way.
    const TSO_PSEUDO_LENGTH: bool = true;
    /// Whether the device reports only the packets whose last buffer asks
    /// ([`Buf::report`]), and completes packets in ring order (the
    /// 82576's RS bit; DPDK's ixgbe and i40e drivers set theirs every
    /// `tx_rs_thresh` descriptors).
    /// If so, the engine asks every
    /// [`report_every`](crate::tx::Config::report_every) packets and for
    /// the last packet before each doorbell, polls only the packets that
    /// asked, and frees every packet before a reported one with it, as
    /// [`Status::Ok`]. False by default: every packet is reported (a
    /// virtio used ring).
    ///
    /// An implementation that says true also promises (part of the
    /// trait's safety contract) that when [`done`](Self::done) returns
    /// `Some` for a packet, the device has finished reading every buffer
    /// of every packet posted before it too.
    const DEFERRED_REPORT: bool = false;

    /// Bytes of ring memory for `size` descriptors: the descriptor table,
    /// and whatever else the device reads or writes beside it (virtio's
    /// available and used rings) after it.
    fn ring_bytes(size: u16) -> usize {
        usize::from(size) * Self::DESC_SIZE
    }

    /// Whether the format can carry `offload`: for some headers when
    /// `layout` is `None` (asked before a packet's headers are parsed),
    /// for headers at `layout` otherwise. A packet asking for one it
    /// cannot is refused ([`Error::UnsupportedOffload`](crate::Error::UnsupportedOffload))
    /// before anything is posted. All of them by default.
    fn supports(&self, offload: Offload, layout: Option<&Layout>) -> bool {
        let _ = (offload, layout);
        true
    }

    /// Writes the [`PREFIX`](Self::PREFIX) bytes in front of `pkt`'s
    /// headers into `out`. Only called if `PREFIX > 0`.
    fn write_prefix(&self, out: &mut [u8], pkt: &Packet) {
        let _ = (out, pkt);
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
    /// buffer's descriptor must ask for the status write-back when
    /// `buf.report` (always, unless the format defers reports; the engine
    /// may then ask later, with [`ask_report`](Self::ask_report)).
    fn write_data(&self, desc: &mut [u64], buf: Buf, pkt: &Packet);

    /// Makes a packet's last data descriptor ask for the status
    /// write-back, changing nothing else (the 82576 sets RS in its command
    /// byte; see the trait's Safety section). `desc` holds the words as
    /// [`write_data`](Self::write_data) wrote them, with or without the
    /// request: asking twice is asking once. The engine calls it only
    /// where the format defers reports
    /// ([`DEFERRED_REPORT`](Self::DEFERRED_REPORT)), on the last packet
    /// posted before a doorbell, which the device has not read yet. A
    /// format that defers reports must implement it; the others never see
    /// it called and may leave it empty. A required method: an empty
    /// default would leave a deferring format's last packets unreported.
    fn ask_report(&self, desc: &mut [u64]);

    /// The packet's completion, from the status word of its last
    /// descriptor: `None` while the device has not written it back.
    fn status(&self, word: u32) -> Option<Status>;

    /// Hands a written packet to the device's view of the ring, once its
    /// descriptors (from slot `head` on) are all written: nothing by
    /// default (the doorbell's tail does it); virtio puts `head` into the
    /// available ring.
    fn publish<M: DmaMapper>(&mut self, ring: &RingMem<'_, M>, head: u16) -> Result<()> {
        let _ = (ring, head);
        Ok(())
    }

    /// Makes everything published visible to the device, before the
    /// doorbell; returns whether the device wants the doorbell rung (true
    /// by default; virtio's `EVENT_IDX` may say no).
    fn flush<M: DmaMapper>(&mut self, ring: &RingMem<'_, M>) -> Result<bool> {
        let _ = ring;
        Ok(true)
    }

    /// The doorbell the last [`flush`](Self::flush) asked for could not be
    /// rung (the device call failed): the next flush must ask again.
    fn unflush(&mut self) {}

    /// The completion of a packet in flight that asked for a report, whose
    /// descriptors are the slots `head..=last`: `None` while the device is
    /// not done. By default the [`status`](Self::status) of the word at
    /// [`STATUS_OFFSET`](Self::STATUS_OFFSET) in its last descriptor;
    /// virtio reads its used ring. Called for the packets that asked for a
    /// report, in the order they were published, from the oldest of them
    /// in flight on: a reap asks about the next one after each done one
    /// and frees them all after the walk, so the packets before this one
    /// may still be in flight (done) when it is asked (see the trait's
    /// safety section).
    fn done<M: DmaMapper>(
        &mut self,
        ring: &RingMem<'_, M>,
        head: u16,
        last: u16,
    ) -> Result<Option<Status>> {
        let _ = head;
        let at = usize::from(last) * Self::DESC_SIZE + Self::STATUS_OFFSET;
        Ok(self.status(ring.read_u32(at)?))
    }
}
