//! A virtio-net device's TX queue, on the host: the device side of the
//! split virtqueue is rust-vmm's `virtio-queue` (what VMMs use), so the
//! driver's format ([`Split`]) is read by code it did not write. The model
//! reaches memory only through the IOMMU translation (a `vm-memory` view
//! over `Translate` that holds off unmaps while in use), applies the
//! `virtio_net_hdr`'s checksum and GSO requests as the spec's device does
//! (the checksum sums the packet from `csum_start` on, the field the
//! driver left included: the driver puts the pseudo-header sum there;
//! segmentation moves that sum to each segment's length first, as Linux's
//! `tcp_gso_segment`), verifies every payload
//! byte against the flow pattern, captures frames for the wire checker,
//! and returns each chain in the used ring.
//!
//! A doorbell that fails has taken nothing: what the device can check
//! before it takes a chain (the rings reachable, the available index at
//! most a ring ahead) it checks first. A fault it can see only after it
//! took chains (a used entry it cannot write) stops it, as a virtio device
//! stops with `NEEDS_RESET` in its `device_status`: the doorbell, every
//! later one and [`TxDevice::check_running`] say
//! [`Error::DeviceStopped`], the stop is counted
//! ([`NicStats::stops`](super::softnic::NicStats::stops)), and only a
//! reset ([`TxDevice::detach`], then an attach) makes it serve again. The
//! chains it took without returning them stay the driver's in flight.
//!
//! ```
//! use std::sync::Arc;
//! use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
//! use pfrag::pool::{self, Policy, Pool};
//! use pfrag::Order;
//! use vfio_nic::model::softnic;
//! use vfio_nic::model::virtio::VirtioNet;
//! use vfio_nic::offload::Offload;
//! use vfio_nic::tx::{Config, Queue};
//!
//! let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default())?);
//! let domain = Arc::new(Domain::new(iommu.clone()));
//! let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(3)?, Policy::Persistent))?;
//! let cfg = softnic::Config { verify: false, capture: true, ..Default::default() };
//! let nic = VirtioNet::new(iommu, cfg)?;
//! // SAFETY: the model translates through `iommu`, which `domain` maps
//! // through.
//! let mut q = unsafe { Queue::new(domain, pool, nic, Config::default()) }?;
//! let mut headers = Vec::new();
//! etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
//!     .ipv6([0xfe; 16], [0xfd; 16], 64)
//!     .udp(4000, 5000)
//!     .write(&mut headers, b"over virtio")?;
//! headers.truncate(62);
//! q.send(&headers, b"over virtio", Offload::Checksum, 1)?;
//! q.kick()?;
//! q.wait(std::time::Duration::from_secs(1))?;
//! let frame = &q.take_frames()[0];
//! assert_eq!(&frame[62..], b"over virtio");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod mem;
mod ring;

use std::mem::offset_of;

use etherparse::{EtherType, Ethernet2Header, IpNumber, Ipv4Header, Ipv6Header, TcpHeader};
use pfrag::dma::Translate;
use pfrag::Iova;
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_bindings::virtio_net::{
    virtio_net_hdr_v1, virtio_net_hdr_v1__bindgen_ty_1__bindgen_ty_1 as CsumFields,
    VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_NONE, VIRTIO_NET_HDR_GSO_TCPV4,
    VIRTIO_NET_HDR_GSO_TCPV6,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemory, Permissions};

use super::segment::{
    pieces, range_pages, segment_pages, segments, Packet, Seed, Segmenter, MAX_HDR,
};
use super::softnic::{Config, NicStats, MAX_BUFS};
use crate::desc::Popts;
use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::format::virtio::{features, Layout, Split, HDR_LEN};
use crate::gen::flow;
use mem::IoView;

/// The longest chain a packet makes: the header, the frame's headers, and
/// at most 64 KiB after them (a GSO packet, like an IP packet).
const MAX_CHAIN: usize = HDR_LEN + MAX_HDR + u16::MAX as usize;

/// The `device_status` of the model once it stopped: set up and running
/// (`ACKNOWLEDGE`, `DRIVER`, `FEATURES_OK`, `DRIVER_OK`), and
/// `NEEDS_RESET`.
const STOPPED_STATUS: u8 = (VIRTIO_CONFIG_S_ACKNOWLEDGE
    | VIRTIO_CONFIG_S_DRIVER
    | VIRTIO_CONFIG_S_FEATURES_OK
    | VIRTIO_CONFIG_S_DRIVER_OK
    | VIRTIO_CONFIG_S_NEEDS_RESET) as u8;

/// The virtio-net model; see the module docs.
pub struct VirtioNet<T: Translate> {
    iommu: T,
    /// The format, with the features negotiated.
    fmt: Split,
    queue: Option<Queue>,
    tx: Engine,
}

/// What the device does with the chains it takes.
struct Engine {
    cfg: Config,
    /// The features negotiated: the offloads a header may ask for.
    features: u64,
    /// The current chain's buffers: IOVA, length.
    bufs: Vec<(Iova, usize)>,
    frames: Vec<Vec<u8>>,
    stats: NicStats,
    /// What reads copy guest memory through, a page at a time: allocated
    /// once (a page-sized array zeroed per read cost more than the copy).
    copy: Box<[u8]>,
    /// Whether the device stopped (`NEEDS_RESET`) since its last reset.
    stopped: bool,
}

impl<T: Translate> std::fmt::Debug for VirtioNet<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioNet")
            .field("cfg", &self.tx.cfg)
            .field("features", &format_args!("{:#x}", self.fmt.features()))
            .field("stats", &self.tx.stats)
            .finish()
    }
}

impl<T: Translate> VirtioNet<T> {
    /// A device offering every feature the TX path uses
    /// ([`features::USED`]), whose DMA goes through `iommu`. It reads and
    /// checksums every byte (`cfg.touch` is the software NIC's alone).
    pub fn new(iommu: T, cfg: Config) -> Result<VirtioNet<T>> {
        VirtioNet::offering(iommu, cfg, features::USED)
    }

    /// A device offering `offered` feature bits (see [`features`]);
    /// [`Error::MissingFeature`] without `VERSION_1` and `ACCESS_PLATFORM`.
    /// A header asking for an offload the negotiated features lack
    /// (`NEEDS_CSUM` without `CSUM`, a GSO type without its `HOST_TSO`)
    /// is a malformed chain, counted and not sent.
    pub fn offering(iommu: T, cfg: Config, offered: u64) -> Result<VirtioNet<T>> {
        let fmt = Split::negotiate(offered)?;
        Ok(VirtioNet {
            iommu,
            queue: None,
            tx: Engine {
                cfg,
                features: fmt.features(),
                bufs: Vec::with_capacity(MAX_BUFS),
                frames: Vec::new(),
                stats: NicStats::default(),
                copy: vec![0; COPY].into_boxed_slice(),
                stopped: false,
            },
            fmt,
        })
    }

    /// Its counters.
    pub fn stats(&self) -> NicStats {
        self.tx.stats
    }

    /// The translation the model uses.
    pub fn iommu(&self) -> &T {
        &self.iommu
    }
}

impl Engine {
    /// The error of a doorbell (or a check) on the stopped device, with
    /// what stopped it, where known.
    fn stop(&self, cause: Option<Error>) -> Error {
        Error::DeviceStopped {
            status: STOPPED_STATUS,
            cause: cause.map(Box::new),
        }
    }

    /// Sends the chain whose buffers `self.bufs` holds.
    fn process<M: GuestMemory>(&mut self, mem: &M) {
        self.stats.packets += 1;
        let total: usize = self.bufs.iter().map(|b| b.1).sum();
        if total > MAX_CHAIN {
            // Longer than any packet: a broken chain, refused before
            // anything is read or allocated for it.
            self.stats.bad_desc += 1;
            return;
        }
        if total <= HDR_LEN {
            // No frame after the header.
            self.stats.bad_desc += 1;
            return;
        }
        let mut head = [0u8; HDR_LEN + MAX_HDR];
        let n = total.min(head.len());
        let read_head = {
            let mut into = copy_into(&mut head);
            read(mem, &self.bufs, 0, n, &mut self.copy, &mut into)
        };
        if read_head.is_err() {
            self.stats.count_read_fault();
            return;
        }
        let hdr = NetHdr::parse(&head[..HDR_LEN]);
        let frame = &head[HDR_LEN..n];
        let len = total - HDR_LEN;
        if hdr.flags == 0 && hdr.gso == VIRTIO_NET_HDR_GSO_NONE as u8 {
            self.raw(mem, len);
            return;
        }
        let Some(pkt) = self.parse(&hdr, frame, len) else {
            self.stats.bad_desc += 1;
            return;
        };
        let hlen = pkt.maclen + pkt.iplen + pkt.l4len;
        let mut seg = Segmenter::new(&pkt, &frame[..hlen], self.cfg.capture);
        for (at, n) in segments(pkt.paylen, pkt.mss) {
            let start = HDR_LEN + hlen + at;
            let mut feed = |s: &[u8]| seg.feed(s);
            if read(mem, &self.bufs, start, n, &mut self.copy, &mut feed).is_err() {
                self.stats.count_read_fault();
                return;
            }
        }
        let (out, frames) = (seg.out, seg.frames);
        let pages = range_pages(&self.bufs, 0, total);
        let seg = segment_pages(&self.bufs, HDR_LEN + hlen, &pkt);
        self.stats.count_sent(&out, hlen, &pkt, pages, seg);
        self.frames.extend(frames);
    }

    /// A frame without offloads: out as given.
    fn raw<M: GuestMemory>(&mut self, mem: &M, len: usize) {
        let capture = self.cfg.capture;
        let mut frame = Vec::with_capacity(if capture { len } else { 0 });
        let read = read(mem, &self.bufs, HDR_LEN, len, &mut self.copy, &mut |s| {
            if capture {
                frame.extend_from_slice(s);
            }
        });
        if read.is_err() {
            self.stats.count_read_fault();
            return;
        }
        let pages = range_pages(&self.bufs, 0, HDR_LEN + len);
        self.stats.count_raw(len, pages);
        if capture {
            self.frames.push(frame);
        }
    }

    /// What the header and the frame's headers ask of the device; `None`
    /// for a request it cannot carry out, or that asks for an offload the
    /// features do not have (counted as malformed).
    fn parse(&self, hdr: &NetHdr, frame: &[u8], len: usize) -> Option<Packet> {
        let need = features::CSUM
            | match u32::from(hdr.gso) {
                VIRTIO_NET_HDR_GSO_TCPV4 => features::HOST_TSO4,
                VIRTIO_NET_HDR_GSO_TCPV6 => features::HOST_TSO6,
                _ => 0,
            };
        if self.features & need != need {
            return None;
        }
        let l = Layers::parse(frame)?;
        let hlen = l.maclen + l.iplen + l.l4len;
        let csum = hdr.flags & VIRTIO_NET_HDR_F_NEEDS_CSUM as u8 != 0;
        let field = if l.tcp { 16 } else { 6 };
        // The checksum the device completes is the L4 one, where TCP and
        // UDP keep it; the header names exactly that.
        if !csum || hdr.csum_start != l.maclen + l.iplen || hdr.csum_offset != field {
            return None;
        }
        let paylen = len.checked_sub(hlen)?;
        let (gso, mss) = match u32::from(hdr.gso) {
            VIRTIO_NET_HDR_GSO_NONE => (false, paylen.max(1)),
            VIRTIO_NET_HDR_GSO_TCPV4 if l.ipv4 && l.tcp => (true, hdr.gso_size),
            VIRTIO_NET_HDR_GSO_TCPV6 if !l.ipv4 && l.tcp => (true, hdr.gso_size),
            _ => return None,
        };
        if mss == 0 || (gso && hdr.hdr_len > hlen + paylen) {
            return None;
        }
        // A GSO packet is one IP packet: its 16-bit length field (IPv4's
        // counts the IP header, IPv6's does not) must hold it whole.
        let ip_len = if l.ipv4 { l.iplen } else { 0 } + l.l4len + paylen;
        if gso && ip_len > usize::from(u16::MAX) {
            return None;
        }
        let tcp = l.maclen + l.iplen;
        let sport = u16::from_be_bytes([frame[tcp], frame[tcp + 1]]);
        let verify = self.cfg.verify;
        let fl = match flow::flow_of_port(sport) {
            Some(f) => f,
            None if !verify => 0,
            None => return None,
        };
        let seq0 = if l.tcp {
            u32::from_be_bytes([
                frame[tcp + 4],
                frame[tcp + 5],
                frame[tcp + 6],
                frame[tcp + 7],
            ])
        } else {
            flow::isn(fl)
        };
        // A segmenting device writes each segment's IPv4 header checksum;
        // virtio-net has no offload of it otherwise.
        let ip_sum = if gso && l.ipv4 {
            Popts::IXSM
        } else {
            Popts::empty()
        };
        Some(Packet {
            maclen: l.maclen,
            iplen: l.iplen,
            l4len: l.l4len,
            seq0,
            flow: fl,
            paylen,
            mss,
            popts: Popts::TXSM | ip_sum,
            tcp: l.tcp,
            ipv4: l.ipv4,
            verify,
            segmented: gso,
            seed: Seed::WholeLength,
        })
    }
}

/// The fields of a `virtio_net_hdr` the TX path reads (little-endian, as
/// `VERSION_1` has them), at the offsets of `virtio-bindings`' struct.
struct NetHdr {
    flags: u8,
    gso: u8,
    hdr_len: usize,
    gso_size: usize,
    csum_start: usize,
    csum_offset: usize,
}

impl NetHdr {
    fn parse(b: &[u8]) -> NetHdr {
        let u16_at = |at: usize| usize::from(u16::from_le_bytes([b[at], b[at + 1]]));
        let csum = offset_of!(virtio_net_hdr_v1, __bindgen_anon_1);
        NetHdr {
            flags: b[offset_of!(virtio_net_hdr_v1, flags)],
            gso: b[offset_of!(virtio_net_hdr_v1, gso_type)],
            hdr_len: u16_at(offset_of!(virtio_net_hdr_v1, hdr_len)),
            gso_size: u16_at(offset_of!(virtio_net_hdr_v1, gso_size)),
            csum_start: u16_at(csum + offset_of!(CsumFields, csum_start)),
            csum_offset: u16_at(csum + offset_of!(CsumFields, csum_offset)),
        }
    }
}

/// Where a frame's layers are: Ethernet, IPv4 or IPv6, TCP or UDP.
struct Layers {
    maclen: usize,
    iplen: usize,
    l4len: usize,
    ipv4: bool,
    tcp: bool,
}

impl Layers {
    fn parse(frame: &[u8]) -> Option<Layers> {
        let (eth, rest) = Ethernet2Header::from_slice(frame).ok()?;
        let (ipv4, iplen, proto, rest) = match eth.ether_type {
            EtherType::IPV4 => {
                let (h, rest) = Ipv4Header::from_slice(rest).ok()?;
                (true, h.header_len(), h.protocol, rest)
            }
            EtherType::IPV6 => {
                let (h, rest) = Ipv6Header::from_slice(rest).ok()?;
                (false, Ipv6Header::LEN, h.next_header, rest)
            }
            _ => return None,
        };
        let (tcp, l4len) = match proto {
            IpNumber::TCP => (true, TcpHeader::from_slice(rest).ok()?.0.header_len()),
            IpNumber::UDP if rest.len() >= 8 => (false, 8),
            _ => return None,
        };
        Some(Layers {
            maclen: Ethernet2Header::LEN,
            iplen,
            l4len,
            ipv4,
            tcp,
        })
    }
}

/// A sink that copies what it is fed into `out`, in order.
fn copy_into(out: &mut [u8]) -> impl FnMut(&[u8]) + '_ {
    let mut at = 0;
    move |s| {
        out[at..at + s.len()].copy_from_slice(s);
        at += s.len();
    }
}

/// Bytes a read copies at a time.
const COPY: usize = 4096;

/// Reads chain bytes `start..start + len` (offsets over `bufs`) through
/// `mem`, copying through `buf` and handing `f` at most `buf.len()` bytes
/// at a time.
fn read<M: GuestMemory>(
    mem: &M,
    bufs: &[(Iova, usize)],
    start: usize,
    len: usize,
    buf: &mut [u8],
    f: &mut dyn FnMut(&[u8]),
) -> std::result::Result<(), vm_memory::guest_memory::Error> {
    for (at, n) in pieces(bufs, start, len) {
        for s in mem.get_slices(GuestAddress(at.raw()), n, Permissions::Read)? {
            let s = s?;
            let mut off = 0;
            while off < s.len() {
                let k = (s.len() - off).min(buf.len());
                let got = s.subslice(off, k)?.copy_to(&mut buf[..k]);
                f(&buf[..got]);
                off += k;
            }
        }
    }
    Ok(())
}

impl<T: Translate> super::Model for VirtioNet<T> {
    fn counters(&self) -> NicStats {
        self.tx.stats
    }
    fn take_frames(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.tx.frames)
    }
    /// A doorbell takes the whole available ring, and the head is the
    /// next available index, not a descriptor slot.
    fn paceable(&self) -> bool {
        false
    }
}

impl<T: Translate> TxDevice for VirtioNet<T> {
    type Format = Split;
    fn format(&self) -> Split {
        self.fmt.clone()
    }

    /// Sets up the virtqueue at the spec's [`Layout`] of the ring: what a
    /// driver writes into the common configuration's queue addresses.
    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        let bad = |what| Error::BadConfig {
            what,
            value: u64::from(len),
        };
        if !len.is_power_of_two() {
            return Err(bad("virtqueue size (a power of two)"));
        }
        let l = Layout::new(len);
        if ring.checked_add(l.bytes as u64 - 1).is_none() {
            return Err(Error::BadConfig {
                what: "virtqueue address (past the top of the IOVA space)",
                value: ring.raw(),
            });
        }
        let mut q = Queue::new(len).map_err(|_| bad("virtqueue size"))?;
        let at = |off: usize| ring.offset(off as u64);
        q.try_set_desc_table_address(GuestAddress(ring.raw()))
            .and_then(|()| q.try_set_avail_ring_address(GuestAddress(at(l.avail).raw())))
            .and_then(|()| q.try_set_used_ring_address(GuestAddress(at(l.used).raw())))
            .map_err(Error::Virtqueue)?;
        q.set_event_idx(self.fmt.event_idx());
        q.set_ready(true);
        self.queue = Some(q);
        self.tx.stopped = false;
        Ok(())
    }

    /// Forgets the ring, and a stop: the model's reset.
    fn detach(&mut self) -> Result<()> {
        self.queue = None;
        self.tx.stopped = false;
        Ok(())
    }

    /// [`Error::DeviceStopped`] once a doorbell stopped the device, until
    /// its reset.
    fn check_running(&mut self) -> Result<()> {
        if self.tx.stopped {
            return Err(self.tx.stop(None));
        }
        Ok(())
    }

    /// The next available ring index (a free-running count of chains
    /// taken, not a descriptor slot).
    fn head(&mut self) -> Option<u16> {
        self.queue.as_ref().map(|q| q.next_avail())
    }

    /// Takes every chain the available ring offers, sends it, and returns
    /// it in the used ring; with `EVENT_IDX`, it asks to hear of the next
    /// one and looks again before it stops.
    ///
    /// An error from the checks made before the first chain
    /// ([`Error::RingUnreachable`], [`Error::AvailIndex`], a virtqueue
    /// error reading the index) took nothing and changed nothing. A fault
    /// after them stops the device ([`Error::DeviceStopped`], the fault as
    /// its cause; counted in `stops`): the chains taken before it were
    /// sent, those returned in the used ring are done, the others are
    /// never returned. A stopped device refuses every doorbell
    /// ([`Error::DeviceStopped`] without a cause) until it is reset
    /// ([`detach`](TxDevice::detach)).
    unsafe fn kick(&mut self, _tail: u16) -> Result<()> {
        if self.tx.stopped {
            return Err(self.tx.stop(None));
        }
        let mut q = self.queue.take().ok_or(Error::NotAttached)?;
        // SAFETY: our caller handed over the chains the available ring
        // names and their buffers, and the ring itself (`kick`'s promise);
        // the view's accesses are `virtio-queue`'s (16-bit atomics for the
        // indices and entries, as the driver's format uses) and ours
        // (reads of those buffers). Nothing here unmaps.
        let mem = unsafe { IoView::new(&self.iommu) };
        let r = self.tx.drain(&mut q, &mem);
        drop(mem);
        self.queue = Some(q);
        r
    }
}
