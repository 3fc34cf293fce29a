//! virtio-net 1.x TX on a split virtqueue (virtio 1.2, 2.7): 16-byte
//! descriptors chained by `next`, a `virtio_net_hdr` in front of every
//! packet's headers, the packet's head published in the available ring,
//! and completion read from the used ring. GSO (TCPv4, TCPv6) and checksum
//! offload (`NEEDS_CSUM` with `csum_start`/`csum_offset`) ride in the
//! header, and the packet's L4 checksum field holds the pseudo-header sum
//! the device completes ([`Format::PSEUDO_HEADER_SUM`]); `EVENT_IDX` suppresses doorbells the device does not want.
//!
//! The ring layout, the header and the feature bits are the spec's, taken
//! from `virtio-bindings`. The device side of the same ring is rust-vmm's
//! `virtio-queue` ([`VirtioNet`](crate::model::virtio::VirtioNet)).
//!
//! ```
//! use vfio_nic::format::virtio::{features, Layout, Split};
//!
//! let f = Split::negotiate(features::VERSION_1 | features::ACCESS_PLATFORM | features::CSUM)?;
//! assert!(!f.event_idx());
//! // The three parts of a 256-entry ring, as the driver tells the device.
//! let l = Layout::new(256);
//! assert_eq!((l.avail, l.used), (4096, 4096 + 6 + 512 + 2));
//! // Without VERSION_1 there is no modern device to drive.
//! assert!(Split::negotiate(features::ACCESS_PLATFORM).is_err());
//! # Ok::<(), vfio_nic::Error>(())
//! ```

use std::mem::{offset_of, size_of};
use std::sync::atomic::{fence, Ordering};

use pfrag::dma::DmaMapper;
use virtio_bindings::virtio_config::{VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_NEEDS_RESET};
use virtio_bindings::virtio_net::{
    virtio_net_hdr_v1, virtio_net_hdr_v1__bindgen_ty_1__bindgen_ty_1 as CsumFields,
    VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_TCPV4, VIRTIO_NET_HDR_GSO_TCPV6,
};
use virtio_bindings::virtio_ring::{
    vring_desc, vring_used_elem, VRING_DESC_F_NEXT, VRING_USED_F_NO_NOTIFY,
};

use super::{Buf, Format, Packet, RingMem, Status};
use crate::error::{Error, Result};
use crate::offload::{Ip, Layout as Headers, Offload, L4};

/// Feature bits (as a 64-bit mask) the format knows, from `virtio-bindings`.
pub mod features {
    use virtio_bindings::virtio_config::{VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1};
    use virtio_bindings::virtio_net::{
        VIRTIO_NET_F_CSUM, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6,
    };
    use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

    /// A modern (1.x) device: little-endian rings and headers. Required.
    pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
    /// The device reaches memory through the platform's IOMMU (IOVAs, not
    /// physical addresses). Required.
    pub const ACCESS_PLATFORM: u64 = 1 << VIRTIO_F_ACCESS_PLATFORM;
    /// The device completes partial checksums (`NEEDS_CSUM`).
    pub const CSUM: u64 = 1 << VIRTIO_NET_F_CSUM;
    /// The device segments TCP over IPv4.
    pub const HOST_TSO4: u64 = 1 << VIRTIO_NET_F_HOST_TSO4;
    /// The device segments TCP over IPv6.
    pub const HOST_TSO6: u64 = 1 << VIRTIO_NET_F_HOST_TSO6;
    /// Used and available event indices replace the notification flags.
    pub const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
    /// Every feature the TX path uses when offered.
    pub const USED: u64 = VERSION_1 | ACCESS_PLATFORM | CSUM | HOST_TSO4 | HOST_TSO6 | EVENT_IDX;
}

/// The `device_status` bits of a device that stopped: `NEEDS_RESET`, which
/// the device sets when it can go on no more, and `FAILED`, which a driver
/// sets when it gave up on the device.
pub const STOPPED: u8 = (VIRTIO_CONFIG_S_NEEDS_RESET | VIRTIO_CONFIG_S_FAILED) as u8;

/// [`Error::DeviceStopped`] if `status` (a `device_status`) has a
/// [`STOPPED`] bit.
pub fn check_status(status: u8) -> Result<()> {
    if status & STOPPED != 0 {
        return Err(Error::DeviceStopped {
            status,
            cause: None,
        });
    }
    Ok(())
}

/// Bytes of `virtio_net_hdr` (with `num_buffers`, as `VERSION_1` has it).
pub const HDR_LEN: usize = size_of::<virtio_net_hdr_v1>();

/// Where the three parts of a split virtqueue of `size` entries lie, as
/// byte offsets from the start of its memory: the descriptor table, the
/// available ring (driver area) and the used ring (device area), each as
/// aligned as the spec asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Entries.
    pub size: u16,
    /// The available ring: `flags`, `idx`, `ring[size]`, `used_event`.
    pub avail: usize,
    /// The used ring (4-byte aligned): `flags`, `idx`, `ring[size]` of
    /// `(id, len)`, `avail_event`.
    pub used: usize,
    /// Bytes of all three.
    pub bytes: usize,
}

impl Layout {
    /// The layout of a ring of `size` entries. A ring of 0 entries (which
    /// no queue builds) has none: its entry offsets are where entry 0
    /// would be, never a panic.
    pub fn new(size: u16) -> Layout {
        let n = usize::from(size);
        let avail = n * size_of::<vring_desc>();
        let used = (avail + 2 * 3 + 2 * n).next_multiple_of(4);
        let bytes = used + 2 * 3 + n * size_of::<vring_used_elem>();
        Layout {
            size,
            avail,
            used,
            bytes,
        }
    }
    /// Offset of the available ring's `idx`.
    pub fn avail_idx(&self) -> usize {
        self.avail + 2
    }
    /// `i % size` (0 for a ring of no entries): a mask for a size that is
    /// a power of two, as every device takes (no division per packet).
    fn entry(&self, i: u16) -> usize {
        let at = if self.size.is_power_of_two() {
            i & (self.size - 1)
        } else {
            i.checked_rem(self.size).unwrap_or(0)
        };
        usize::from(at)
    }
    /// Offset of available ring entry `i % size`.
    pub fn avail_entry(&self, i: u16) -> usize {
        self.avail + 4 + 2 * self.entry(i)
    }
    /// Offset of the used ring's `flags`.
    pub fn used_flags(&self) -> usize {
        self.used
    }
    /// Offset of the used ring's `idx`.
    pub fn used_idx(&self) -> usize {
        self.used + 2
    }
    /// Offset of used ring entry `i % size` (its `id`; `len` follows).
    pub fn used_entry(&self, i: u16) -> usize {
        self.used + 4 + size_of::<vring_used_elem>() * self.entry(i)
    }
    /// Offset of `avail_event`, after the used ring's entries.
    pub fn avail_event(&self) -> usize {
        self.used + 4 + size_of::<vring_used_elem>() * usize::from(self.size)
    }
}

/// The split virtqueue TX format of a virtio-net device, with the features
/// negotiated; see the module docs. It keeps the driver's ring state: the
/// next available entry, and the used entries seen.
#[derive(Clone, Debug, Default)]
pub struct Split {
    features: u64,
    /// Packets published (the available index the next flush writes).
    avail: u16,
    /// The available index as of the last flush.
    flushed: u16,
    /// The one before, for a doorbell that could not be rung.
    before: u16,
    /// Used entries consumed.
    used: u16,
    /// What the device was told of each slot as a packet's head, by slot:
    /// a device may complete out of order, and the engine asks about a
    /// head after its used entry came.
    heads: Vec<Head>,
    /// Heads made available whose used entry has not come.
    held: u16,
}

/// A slot as a packet's head, for [`Split`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Head {
    /// No packet the device holds starts here.
    #[default]
    Idle,
    /// Made available; the device holds the packet.
    Avail,
    /// Its used entry came; the engine has not asked about it yet.
    Used,
}

impl Split {
    /// The format for a device offering `offered`: keeps what the TX path
    /// uses ([`features::USED`]), and refuses a device without
    /// `VERSION_1` or `ACCESS_PLATFORM` ([`Error::MissingFeature`]).
    pub fn negotiate(offered: u64) -> Result<Split> {
        for (bit, name) in [
            (features::VERSION_1, "VIRTIO_F_VERSION_1"),
            (features::ACCESS_PLATFORM, "VIRTIO_F_ACCESS_PLATFORM"),
        ] {
            if offered & bit == 0 {
                return Err(Error::MissingFeature {
                    feature: name,
                    features: offered,
                    why: "pfrag drives modern (1.x) devices behind an IOMMU",
                });
            }
        }
        let mut used = offered & features::USED;
        // TSO needs checksum offload (the spec's feature dependencies).
        if used & features::CSUM == 0 {
            used &= !(features::HOST_TSO4 | features::HOST_TSO6);
        }
        Ok(Split {
            features: used,
            ..Split::default()
        })
    }
    /// The features in use.
    pub fn features(&self) -> u64 {
        self.features
    }
    /// Whether `EVENT_IDX` is in use.
    pub fn event_idx(&self) -> bool {
        self.features & features::EVENT_IDX != 0
    }
    fn has(&self, bit: u64) -> bool {
        self.features & bit == bit
    }
    /// Takes the used ring's new entries into `heads`. A used index
    /// further ahead than the packets the device holds is
    /// [`Error::UsedIndex`], with nothing taken; an entry whose id is not
    /// a head the device holds is [`Error::UsedId`], with the entries
    /// before it taken and none from it on. Either is read again, and
    /// refused again, by the next call: nothing is freed on its word.
    fn take_used<M: DmaMapper>(&mut self, ring: &RingMem<'_, M>, l: &Layout) -> Result<()> {
        let idx = ring.read_u16(l.used_idx())?;
        if idx.wrapping_sub(self.used) > self.held {
            return Err(Error::UsedIndex {
                idx,
                used: self.used,
                in_flight: self.held,
            });
        }
        while self.used != idx {
            let id = ring.read_u32(l.used_entry(self.used))?;
            match self.heads.get_mut(id as usize) {
                Some(h) if *h == Head::Avail => *h = Head::Used,
                _ => {
                    return Err(Error::UsedId {
                        entry: self.used,
                        id,
                        size: l.size,
                    })
                }
            }
            self.held -= 1;
            self.used = self.used.wrapping_add(1);
        }
        Ok(())
    }
}

/// Writes `v` little-endian at byte `at` of `out`.
fn put16(out: &mut [u8], at: usize, v: u16) {
    out[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

// SAFETY: a descriptor names `buf.iova` and `buf.len` and, but in the last
// buffer, chains to `buf.next`, the slot the engine writes the packet's
// next buffer into: the chain is exactly the packet's buffers. The device
// writes only the used ring (whose entries `done` reads after the 16-bit
// acquire load of its index; `virtio-queue` stores it with a 16-bit
// release store) and `avail_event`, read with 16-bit loads; and `done`
// reports a packet only once the device put its head into the used ring,
// which a device does only after it read the whole chain: a used entry is
// taken only for a head made available and not used since, and only up to
// as many as the device holds (the entries past them are a lap old).
unsafe impl Format for Split {
    const NAME: &'static str = "virtio-net split virtqueue";
    const DESC_SIZE: usize = size_of::<vring_desc>();
    /// A descriptor's length is 32 bits; the engine's buffers are at most
    /// a chunk.
    const MAX_BUF: usize = u32::MAX as usize;
    /// A GSO packet is an IP packet, at most 64 KiB; its length field
    /// bounds a TSO payload further ([`TSO_IP_LENGTH`](Format::TSO_IP_LENGTH)).
    const MAX_PAYLOAD: usize = u16::MAX as usize;
    /// Unused: completion comes from the used ring ([`done`](Format::done)).
    const STATUS_OFFSET: usize = 0;
    const HAS_CONTEXT: bool = false;
    const PREFIX: usize = HDR_LEN;
    /// A GSO packet reaches the host as one IP packet (QEMU hands it to
    /// a tap as it is, and the host's stack cuts it), so its own IP
    /// length must be one an IP header can state.
    const TSO_IP_LENGTH: bool = true;
    /// virtio-net has no IPv4 header checksum offload.
    const INSERTS_IPV4_CSUM: bool = false;
    /// `NEEDS_CSUM` completes the sum the driver started (virtio 1.x,
    /// 5.1.6.2).
    const PSEUDO_HEADER_SUM: bool = true;

    type Context = ();

    fn ring_bytes(size: u16) -> usize {
        Layout::new(size).bytes
    }

    fn supports(&self, offload: Offload, layout: Option<&Headers>) -> bool {
        match (offload, layout) {
            (Offload::None, _) => true,
            (Offload::Checksum, _) => self.has(features::CSUM),
            (Offload::Tso { .. }, Some(l)) => {
                let tso = match l.ip {
                    Ip::V4 => features::HOST_TSO4,
                    Ip::V6 => features::HOST_TSO6,
                };
                l.l4 == L4::Tcp && self.has(features::CSUM | tso)
            }
            (Offload::Tso { .. }, None) => {
                self.has(features::CSUM)
                    && self.features & (features::HOST_TSO4 | features::HOST_TSO6) != 0
            }
        }
    }

    fn context(&self, _: &Headers, _: Offload) {}

    fn write_context(&self, _: &mut [u64], _: &()) {}

    /// The header: `NEEDS_CSUM` with the L4 checksum's place for any
    /// offload, and the GSO type, segment size and header length for TSO.
    fn write_prefix(&self, out: &mut [u8], pkt: &Packet) {
        out.fill(0);
        let Some(l) = pkt.layout.filter(|_| pkt.offload != Offload::None) else {
            return;
        };
        let csum = offset_of!(virtio_net_hdr_v1, __bindgen_anon_1);
        let start = usize::from(l.maclen) + usize::from(l.iplen);
        let field = match l.l4 {
            L4::Tcp => 16, // TCP's checksum field
            L4::Udp => 6,  // UDP's
        };
        out[offset_of!(virtio_net_hdr_v1, flags)] = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
        put16(out, csum + offset_of!(CsumFields, csum_start), start as u16);
        put16(out, csum + offset_of!(CsumFields, csum_offset), field);
        if let Offload::Tso { mss } = pkt.offload {
            let gso = match l.ip {
                Ip::V4 => VIRTIO_NET_HDR_GSO_TCPV4,
                Ip::V6 => VIRTIO_NET_HDR_GSO_TCPV6,
            };
            out[offset_of!(virtio_net_hdr_v1, gso_type)] = gso as u8;
            put16(out, offset_of!(virtio_net_hdr_v1, hdr_len), l.len() as u16);
            put16(out, offset_of!(virtio_net_hdr_v1, gso_size), mss);
        }
    }

    /// `{addr, len, flags, next}`: `NEXT` and the next slot but in the
    /// last buffer.
    fn write_data(&self, d: &mut [u64], buf: Buf, _: &Packet) {
        let (flags, next) = if buf.last {
            (0, 0)
        } else {
            (VRING_DESC_F_NEXT as u64, u64::from(buf.next))
        };
        d[0] = buf.iova.raw();
        d[1] = buf.len as u64 | flags << 32 | next << 48;
    }

    /// Never called: every packet asks for its used-ring entry.
    fn ask_report(&self, _: &mut [u64]) {}

    fn status(&self, _: u32) -> Option<Status> {
        None
    }

    fn publish<M: DmaMapper>(&mut self, ring: &RingMem<'_, M>, head: u16) -> Result<()> {
        let l = Layout::new(ring.size());
        if self.heads.len() != usize::from(ring.size()) {
            self.heads = vec![Head::Idle; usize::from(ring.size())];
        }
        ring.write_u16(l.avail_entry(self.avail), head)?;
        let h = std::mem::replace(&mut self.heads[usize::from(head)], Head::Avail);
        if h != Head::Avail {
            self.held += 1;
        }
        self.avail = self.avail.wrapping_add(1);
        Ok(())
    }

    /// Writes the available index; the doorbell is wanted unless the
    /// device said otherwise (`avail_event` with `EVENT_IDX`, else the
    /// used ring's `NO_NOTIFY`). One that fails counts nothing as
    /// flushed: the next flush asks again for the same packets.
    fn flush<M: DmaMapper>(&mut self, ring: &RingMem<'_, M>) -> Result<bool> {
        let l = Layout::new(ring.size());
        let (old, new) = (self.flushed, self.avail);
        ring.write_u16(l.avail_idx(), new)?;
        // The index store before the device's word is read (the spec's
        // full barrier): else both sides may miss the other's update.
        fence(Ordering::SeqCst);
        let wanted = if self.event_idx() {
            let event = ring.read_u16(l.avail_event())?;
            // vring_need_event: the device asked to hear of `event + 1`.
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            ring.read_u16(l.used_flags())? & VRING_USED_F_NO_NOTIFY as u16 == 0
        };
        (self.before, self.flushed) = (old, new);
        Ok(wanted)
    }

    fn unflush(&mut self) {
        self.flushed = self.before;
    }

    fn done<M: DmaMapper>(
        &mut self,
        ring: &RingMem<'_, M>,
        head: u16,
        _last: u16,
    ) -> Result<Option<Status>> {
        let slot = usize::from(head);
        if self.heads.get(slot) != Some(&Head::Used) {
            let taken = self.take_used(ring, &Layout::new(ring.size()));
            // A bad entry after this packet's is the next call's error.
            if self.heads.get(slot) != Some(&Head::Used) {
                taken?;
            }
        }
        match self.heads.get_mut(slot) {
            Some(h) if *h == Head::Used => {
                *h = Head::Idle;
                Ok(Some(Status::Ok))
            }
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests;
