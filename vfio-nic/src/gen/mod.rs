//! A traffic generator for measurements and tests: TCP/IPv4 flows whose
//! payload is a deterministic per-flow pattern ([`pattern`]), so that the
//! device model and the wire checker can verify every byte and every
//! flow's sequence. It drives a [`tx::Queue`] through the queue's public API
//! only, like any application: it fills frags from the queue's cache with
//! the pattern and posts them zero-copy with the flow's headers. A flow
//! advances only when its packet was posted.

pub mod flow;
pub mod pattern;

use pfrag::dma::DmaMapper;
use pfrag::frag::Frag;
use pfrag::pool;

use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::gen::flow::{Flow, HDR_LEN, MAX_FLOWS};
use crate::offload::{self, Offload};
use crate::tx;

/// The most payload one generated packet (cut into `mss`-byte segments)
/// may carry on a queue that writes format `F` over a pool with settings
/// `pool`: [`tx::max_payload_with`] of the flows' headers under TSO (a
/// payload past the MSS is sent with TSO), and, for an MSS past what one
/// frame carries, that frame's limit; every payload up to it is carried. On virtio-net that is 65,495
/// bytes, what an IPv4 packet's length leaves after the IPv4 and TCP
/// headers; on the 82576 the format's and the pool's limit.
///
/// ```
/// use pfrag::pool::{Config, Policy};
/// use pfrag::Order;
/// use vfio_nic::format::{igb::Advanced, virtio::Split};
/// use vfio_nic::gen;
///
/// let pool = Config::new(Order::new(4)?, Policy::Persistent);
/// assert_eq!(gen::max_payload::<Split>(&pool, 1448), 65_495);
/// assert_eq!(gen::max_payload::<Advanced>(&pool, 1448), 262_143);
/// // One frame of 54 + 65,481 bytes is virtio-net's largest; on the
/// // 82576 one IPv4 frame carries what its 16-bit length leaves.
/// assert_eq!(gen::max_payload::<Split>(&pool, u16::MAX), 65_481);
/// assert_eq!(gen::max_payload::<Advanced>(&pool, u16::MAX), 65_495);
/// # Ok::<(), pfrag::Error>(())
/// ```
pub fn max_payload<F: Format>(pool: &pool::Config, mss: u16) -> usize {
    let l = Some(&flow::LAYOUT);
    let tso = offload::max_payload::<F>(HDR_LEN, l, Offload::Tso { mss });
    let one = offload::max_payload::<F>(HDR_LEN, l, Offload::Checksum);
    // A payload up to the MSS goes as one frame, where the whole frame
    // counts: with an MSS past that limit, the payloads between it and
    // the MSS are refused, so the limit is the lesser one.
    let format = if usize::from(mss) >= one {
        tso.min(one)
    } else {
        tso
    };
    tx::max_payload::<F>(pool).min(format)
}

/// Refuses a payload of `len` bytes past [`max_payload`] with
/// [`Error::PayloadTooLarge`] naming it: the check the generator makes
/// before it builds a packet, made here without a queue.
pub fn check_payload<F: Format>(pool: &pool::Config, mss: u16, len: usize) -> Result<()> {
    let max = max_payload::<F>(pool, mss);
    if len > max {
        return Err(Error::PayloadTooLarge { len, max });
    }
    Ok(())
}

/// Flows and their send state; see the module docs.
pub struct Traffic<M: DmaMapper> {
    flows: Vec<Flow>,
    mss: u16,
    /// Frags of the packet being built (reused: no allocation per packet).
    scratch: Vec<Frag<M>>,
    /// Packets posted (each packet's token).
    posted: u64,
    /// Payload staging for [`send_copied`](Self::send_copied).
    buf: Vec<u8>,
}

impl<M: DmaMapper> std::fmt::Debug for Traffic<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traffic")
            .field("flows", &self.flows.len())
            .field("mss", &self.mss)
            .field("posted", &self.posted)
            .finish()
    }
}

impl<M: DmaMapper> Traffic<M> {
    /// `flows` flows (1..=MAX_FLOWS) cut into `mss`-byte TCP segments.
    pub fn new(flows: usize, mss: u16) -> Result<Traffic<M>> {
        if flows == 0 || flows > MAX_FLOWS {
            return Err(Error::OutOfRange {
                what: "flows",
                value: flows as u64,
                min: 1,
                max: MAX_FLOWS as u64,
            });
        }
        if mss == 0 {
            return Err(Error::OutOfRange {
                what: "mss",
                value: 0,
                min: 1,
                max: u64::from(u16::MAX),
            });
        }
        Ok(Traffic {
            flows: (0..flows).map(Flow::new).collect::<Result<_>>()?,
            mss,
            scratch: Vec::with_capacity(8),
            posted: 0,
            buf: Vec::new(),
        })
    }

    /// Flows.
    pub fn flows(&self) -> usize {
        self.flows.len()
    }

    /// Packets posted so far (the next packet's token).
    pub fn posted(&self) -> u64 {
        self.posted
    }

    fn flow(&self, flow: usize) -> Result<&Flow> {
        let flows = self.flows.len();
        self.flows.get(flow).ok_or(Error::BadFlow { flow, flows })
    }

    /// The most payload one of its packets may carry on `q`:
    /// [`max_payload`] of `q`'s format and pool at the generator's MSS,
    /// and, where a segment of that MSS would pass `q`'s MTU (so that
    /// only single frames go out), what one frame within the MTU carries.
    pub fn max_payload<D: TxDevice>(&self, q: &tx::Queue<M, D>) -> usize {
        let max = max_payload::<D::Format>(q.cache().pool().config(), self.mss);
        let frame = (usize::from(q.config().mtu) + flow::MACLEN).saturating_sub(HDR_LEN);
        if usize::from(self.mss) > frame {
            max.min(frame)
        } else {
            max
        }
    }

    /// Refuses, before anything is staged, carved or built, a payload no
    /// packet of `q` carries: empty, or longer than
    /// [`max_payload`](Self::max_payload) (a send of any length is then a
    /// typed error, never an allocation of that many bytes).
    fn check_len<D: TxDevice>(&self, q: &tx::Queue<M, D>, len: usize) -> Result<()> {
        if len == 0 {
            return Err(pfrag::Error::ZeroLength.into());
        }
        let max = self.max_payload(q);
        if len > max {
            return Err(Error::PayloadTooLarge { len, max });
        }
        Ok(())
    }

    fn offload(&self, len: usize) -> Offload {
        if len > usize::from(self.mss) {
            Offload::Tso { mss: self.mss }
        } else {
            Offload::Checksum
        }
    }

    /// Like [`send`](Self::send), but through the queue's copying
    /// [`tx::Queue::send`]: the payload is written into a buffer of the
    /// generator's and copied into frags by the queue, as an application's
    /// bytes are.
    pub fn send_copied<D: TxDevice>(
        &mut self,
        q: &mut tx::Queue<M, D>,
        flow: usize,
        len: usize,
    ) -> Result<()> {
        let fl = self.flow(flow)?;
        self.check_len(q, len)?;
        let mut hdr = [0u8; HDR_LEN];
        let off = fl.header(len, &mut hdr);
        self.buf.resize(len, 0);
        pattern::fill(flow as u32, off, &mut self.buf);
        q.send(&hdr, &self.buf, self.offload(len), self.posted)?;
        self.flows[flow].advance(len, usize::from(self.mss));
        self.posted += 1;
        Ok(())
    }

    /// [`send`](Self::send), kicking and reaping (or waiting up to
    /// `timeout` for a device that completes later) while the ring or the
    /// memory is full; any other error, or a back-off with nothing in
    /// flight, is returned. The tokens of the packets it reaps are appended
    /// to `done`, oldest first, as [`tx::Queue::reap_tokens`] does: with
    /// the caller's own reaping, every packet's token comes back once.
    pub fn send_waiting<D: TxDevice>(
        &mut self,
        q: &mut tx::Queue<M, D>,
        flow: usize,
        len: usize,
        timeout: std::time::Duration,
        done: &mut Vec<u64>,
    ) -> Result<()> {
        loop {
            match self.send(q, flow, len) {
                Err(e) if e.is_backoff() => {
                    q.kick()?;
                    if q.reap_tokens(done)? == 0 {
                        if q.in_flight() == 0 {
                            return Err(e);
                        }
                        q.wait_tokens(timeout, done)?;
                    }
                }
                other => return other,
            }
        }
    }

    /// Posts one packet of `len` payload bytes on `flow` to `q`: TSO for a
    /// payload longer than the MSS, checksum offload otherwise. All or
    /// nothing: on error the flow does not advance and the frags go back.
    /// A full ring or a memory limit is a back-off ([`Error::is_backoff`]).
    pub fn send<D: TxDevice>(
        &mut self,
        q: &mut tx::Queue<M, D>,
        flow: usize,
        len: usize,
    ) -> Result<()> {
        let fl = self.flow(flow)?;
        self.check_len(q, len)?;
        let offload = self.offload(len);
        q.room_to_send(len, offload)?;
        let mut hdr = [0u8; HDR_LEN];
        let mut off = fl.header(len, &mut hdr);
        q.frags(len, &mut self.scratch)?;
        for f in self.scratch.iter_mut() {
            pattern::fill(flow as u32, off, f.as_mut_slice());
            off = off.wrapping_add(f.len() as u32);
        }
        match q.post(&hdr, &mut self.scratch, offload, self.posted) {
            Ok(()) => {
                self.flows[flow].advance(len, usize::from(self.mss));
                self.posted += 1;
                Ok(())
            }
            Err(e) => {
                // Not posted: the frags are ours again; completing them
                // gives them back to the pool.
                self.scratch.clear();
                Err(e)
            }
        }
    }
}
