//! A TX queue: builds TCP/IPv4 packets for a set of flows, header in the
//! bounce ring (or in its own mapping), payload from a pfrag frag cache;
//! writes a context descriptor and data descriptors into a coherent ring;
//! reaps completions by their `DD` write-back and frees frags in bursts.
//!
//! The queue is generic over the device ([`TxDevice`]) and the mapper, so
//! the hot path has no indirect calls.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pfrag::bounce::{self, SlotSize};
use pfrag::dma::{Coherent, Dir, DmaMapper, Domain};
use pfrag::frag::{complete_burst, Frag, FragCache};
use pfrag::pool::{Policy, Pool, PoolConfig};
use pfrag::{Iova, Order};

use crate::desc::{self, Context, Data, Dcmd, Desc, Popts, Sta};
use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::flow::{self, Flow, HDR_LEN};
use crate::pattern;

/// Largest buffer one data descriptor carries (DTALEN is 16 bits).
pub const MAX_DESC_LEN: usize = u16::MAX as usize;

/// The data descriptors one buffer takes: pieces of at most
/// [`MAX_DESC_LEN`] bytes that cross no multiple of `boundary`.
fn pieces(iova: Iova, len: usize, boundary: Option<usize>) -> impl Iterator<Item = (Iova, usize)> {
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let at = iova.offset(done as u64);
        let mut n = (len - done).min(MAX_DESC_LEN);
        if let Some(b) = boundary {
            n = n.min(b - (at.raw() as usize & (b - 1)));
        }
        done += n;
        Some((at, n))
    })
}

/// Where packet headers go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderMode {
    /// Copied into the premapped bounce ring: no mapping per packet.
    Bounce(SlotSize),
    /// Each header in its own frag, mapped per packet (the stock kernel's
    /// `dma_map_single` of the skb head).
    Mapped,
}

/// Settings of a [`TxQueue`].
#[derive(Clone, Copy, Debug)]
pub struct TxConfig {
    /// Descriptors in the ring: a multiple of 8, 8..=4096.
    pub ring: u16,
    /// Header placement.
    pub header: HeaderMode,
    /// Ask the frag cache to fit each payload whole in one chunk.
    pub fit_whole: bool,
    /// TCP maximum segment size for TSO.
    pub mss: u16,
    /// Flows (distinct source ports) the queue sends on.
    pub flows: usize,
    /// Most data buffers per packet the device accepts.
    pub max_bufs: usize,
    /// If set (a power of two), no data descriptor crosses a multiple of
    /// it. QEMU's emulated 82576 behind an emulated IOMMU maps each buffer
    /// as one IOTLB entry and silently drops a packet whose buffer crosses
    /// an IOMMU page, so runs under emulation set this to 4096; real
    /// hardware needs no split.
    pub boundary: Option<usize>,
    /// The pool queue (reserve) whose chunks the payload cache takes.
    pub queue: usize,
}

impl Default for TxConfig {
    fn default() -> Self {
        TxConfig {
            ring: 256,
            header: HeaderMode::Bounce(SlotSize::B128),
            fit_whole: true,
            mss: 1448,
            flows: 1,
            max_bufs: 64,
            boundary: None,
            queue: 0,
        }
    }
}

/// Counters of a queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TxStats {
    /// Packets posted.
    pub packets: u64,
    /// Payload bytes posted.
    pub bytes: u64,
    /// Descriptors written.
    pub descs: u64,
    /// Packets completed and reaped.
    pub completed: u64,
    /// Headers that went to their own mapping because no bounce slot fit.
    pub header_fallbacks: u64,
    /// Headers mapped on their own (including fallbacks).
    pub mapped_headers: u64,
    /// Sends refused because the ring was full.
    pub ring_full: u64,
    /// Frag completions whose unmap failed.
    pub unmap_errors: u64,
    /// Sends refused because the pool hit a memory limit.
    pub mem_backoffs: u64,
}

enum Hdr<M: DmaMapper> {
    Slot(usize),
    Frag(Frag<M>),
}

/// A posted packet waiting for its write-back.
struct Pending<M: DmaMapper> {
    /// Index of its last descriptor (the one with RS).
    last: u16,
    /// Descriptors it uses.
    ndesc: u16,
    hdr: Hdr<M>,
    frags: Vec<Frag<M>>,
}

/// A TX queue over device `D`, with pool memory mapped through `M`.
pub struct TxQueue<M: DmaMapper, D: TxDevice> {
    /// Declared first so it is dropped (and stops) before any memory it may
    /// still read.
    dev: D,
    cfg: TxConfig,
    ring: Coherent<M>,
    /// Next descriptor to write.
    tail: u16,
    /// Descriptors posted and not reaped.
    used: usize,
    cache: FragCache<M>,
    hdr_cache: FragCache<M>,
    bounce: Option<bounce::Ring<M>>,
    /// Posted packets, oldest first.
    pending: VecDeque<Pending<M>>,
    /// Emptied frag vectors, reused to avoid allocating per packet.
    spare: Vec<Vec<Frag<M>>>,
    flows: Vec<Flow>,
    stats: TxStats,
}

impl<M: DmaMapper, D: TxDevice> std::fmt::Debug for TxQueue<M, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxQueue")
            .field("cfg", &self.cfg)
            .field("tail", &self.tail)
            .field("used", &self.used)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<M: DmaMapper, D: TxDevice> TxQueue<M, D> {
    /// A queue whose payloads come from `pool`, with its ring, header
    /// memory and bounce ring mapped in `domain`, attached to `dev`.
    pub fn new(domain: Arc<Domain<M>>, pool: Pool<M>, mut dev: D, cfg: TxConfig) -> Result<Self> {
        if cfg.ring < 8 || cfg.ring > 4096 || cfg.ring % 8 != 0 {
            return Err(Error::BadConfig {
                what: "ring (multiple of 8, 8..=4096)",
                value: u64::from(cfg.ring),
            });
        }
        if cfg.flows == 0 || cfg.flows > flow::MAX_FLOWS {
            return Err(Error::BadConfig {
                what: "flows",
                value: cfg.flows as u64,
            });
        }
        if cfg.mss == 0 || cfg.max_bufs < 2 {
            return Err(Error::BadConfig {
                what: "mss / max_bufs",
                value: u64::from(cfg.mss),
            });
        }
        if let Some(b) = cfg.boundary {
            if !b.is_power_of_two() || b < 64 {
                return Err(Error::BadConfig {
                    what: "boundary (a power of two, at least 64)",
                    value: b as u64,
                });
            }
        }
        let ring = Coherent::new(
            domain.clone(),
            usize::from(cfg.ring) * desc::SIZE,
            Dir::BIDIRECTIONAL,
        )?;
        let hdr_pool = Pool::new(
            domain.clone(),
            PoolConfig::new(Order::new(0)?, Policy::PerFrag),
        )?;
        let bounce = match cfg.header {
            HeaderMode::Bounce(size) => {
                Some(bounce::Ring::new(domain, usize::from(cfg.ring), size)?)
            }
            HeaderMode::Mapped => None,
        };
        dev.attach(ring.iova(), cfg.ring)?;
        let flows = (0..cfg.flows).map(Flow::new).collect::<Result<Vec<_>>>()?;
        Ok(TxQueue {
            dev,
            cfg,
            ring,
            tail: 0,
            used: 0,
            cache: FragCache::for_queue(pool, cfg.queue)?,
            hdr_cache: FragCache::new(hdr_pool),
            bounce,
            pending: VecDeque::with_capacity(usize::from(cfg.ring)),
            spare: Vec::new(),
            flows,
            stats: TxStats::default(),
        })
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }
    /// The device, mutably.
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }
    /// The payload frag cache.
    pub fn cache(&self) -> &FragCache<M> {
        &self.cache
    }
    /// Counters.
    pub fn stats(&self) -> TxStats {
        self.stats
    }
    /// Packets posted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
    /// Descriptors free for new packets (one is always kept empty).
    pub fn free_descs(&self) -> usize {
        usize::from(self.cfg.ring) - 1 - self.used
    }
    /// The settings.
    pub fn config(&self) -> &TxConfig {
        &self.cfg
    }

    /// Descriptors a payload of `len` bytes is expected to need (context +
    /// header + data), before its frags are known: the quick check that
    /// refuses a full ring before allocating. [`send`](Self::send) counts
    /// the exact number once the frags are known and refuses the packet if
    /// that does not fit.
    pub fn descs_needed(&self, len: usize) -> usize {
        let chunk = self.cache.pool().chunk_size();
        let per = chunk.min(MAX_DESC_LEN);
        match self.cfg.boundary {
            None => 2 + len.div_ceil(per) + 1,
            // Each frag may start mid-boundary and cost one more split.
            Some(b) => 2 + len.div_ceil(per.min(b)) + len.div_ceil(chunk) + 1,
        }
    }

    fn write_desc(&self, idx: u16, d: Desc) -> Result<()> {
        let w = d.encode();
        let off = usize::from(idx) * desc::SIZE;
        self.ring.write_u64(off, w[0])?;
        self.ring.write_u64(off + 8, w[1])?;
        Ok(())
    }

    fn next(&self, idx: u16) -> u16 {
        (idx + 1) % self.cfg.ring
    }

    /// The most payload one packet may carry: the pool's limit, and the
    /// 82576's 18-bit PAYLEN.
    pub fn max_payload(&self) -> usize {
        self.cache.pool().config().max_payload.min(desc::MAX_PAYLEN)
    }

    /// Posts one packet of `len` payload bytes on `flow` (not yet visible to
    /// the device: see [`kick`](Self::kick)). A full ring is
    /// [`Error::RingFull`]: reap and retry. All or nothing: when this fails,
    /// nothing is written, posted, advanced (the flow's sequence included),
    /// allocated or leaked.
    pub fn send(&mut self, flow: usize, len: usize) -> Result<()> {
        self.check_send(flow, len)?;
        let mut frags = self.spare.pop().unwrap_or_default();
        if let Err(e) = self.cache.frags(len, self.cfg.fit_whole, &mut frags) {
            self.spare.push(frags);
            let e = Error::from(e);
            if e.is_backoff() {
                // Out of memory by policy, not by bug: the caller backs off
                // (reaps completions) and retries.
                self.stats.mem_backoffs += 1;
            }
            return Err(e);
        }
        match self.post(flow, len, &mut frags) {
            Ok(p) => {
                self.pending.push_back(p);
                Ok(())
            }
            Err(e) => {
                complete_burst(frags.drain(..)).ok();
                self.spare.push(frags);
                Err(e)
            }
        }
    }

    /// Refuses what the device cannot carry or the ring cannot take, before
    /// anything is allocated (the ring check is an estimate; `post` checks
    /// the exact count).
    fn check_send(&mut self, flow: usize, len: usize) -> Result<()> {
        if flow >= self.flows.len() {
            return Err(Error::BadFlow {
                flow,
                flows: self.flows.len(),
            });
        }
        if len == 0 {
            return Err(pfrag::Error::ZeroLength.into());
        }
        let paylen = if len > usize::from(self.cfg.mss) {
            len
        } else {
            len + HDR_LEN
        };
        let max = self.max_payload();
        if len > max || paylen > desc::MAX_PAYLEN {
            return Err(Error::PayloadTooLarge { len, max });
        }
        self.check_room(self.descs_needed(len) - 2)
    }

    /// Whether `data` data descriptors (plus context and header) fit the
    /// device's buffer limit and the free part of the ring.
    fn check_room(&mut self, data: usize) -> Result<()> {
        let needed = data + 2;
        if needed - 1 > self.cfg.max_bufs {
            return Err(Error::TooManyBuffers {
                needed: needed - 1,
                max: self.cfg.max_bufs,
            });
        }
        if needed > self.free_descs() {
            self.stats.ring_full += 1;
            return Err(Error::RingFull {
                needed,
                free: self.free_descs(),
            });
        }
        Ok(())
    }

    /// Writes the packet of `frags` into the ring and advances the queue.
    /// On error nothing is advanced and `frags` are the caller's to free.
    fn post(&mut self, flow: usize, len: usize, frags: &mut Vec<Frag<M>>) -> Result<Pending<M>> {
        let boundary = self.cfg.boundary;
        let data: usize = frags
            .iter()
            .map(|f| pieces(f.iova(), f.len(), boundary).count())
            .sum();
        self.check_room(data)?;
        let mut hdr = [0u8; HDR_LEN];
        let mut off = self.flows[flow].header(len, &mut hdr);
        for f in frags.iter_mut() {
            pattern::fill(flow as u32, off, f.as_mut_slice());
            off = off.wrapping_add(f.len() as u32);
        }
        let hdr_idx = self.next(self.tail);
        let (hdr_iova, hold) = self.place_header(hdr_idx, &hdr)?;
        let last = match self.write_packet(len, hdr_iova, frags) {
            Ok(last) => last,
            Err(e) => {
                self.drop_header(hold);
                return Err(e);
            }
        };
        let ndesc = (data + 2) as u16;
        self.flows[flow].advance(len, usize::from(self.cfg.mss));
        self.tail = self.next(last);
        self.used += usize::from(ndesc);
        self.stats.packets += 1;
        self.stats.bytes += len as u64;
        self.stats.descs += u64::from(ndesc);
        Ok(Pending {
            last,
            ndesc,
            hdr: hold,
            frags: std::mem::take(frags),
        })
    }

    /// Writes context, header and data descriptors from the tail on.
    /// Returns the index of the last one (which asks for write-back).
    fn write_packet(&self, len: usize, hdr_iova: Iova, frags: &[Frag<M>]) -> Result<u16> {
        let mss = usize::from(self.cfg.mss);
        let tse = len > mss;
        let tso = if tse { Dcmd::TSE } else { Dcmd::empty() };
        let paylen = if tse { len } else { len + HDR_LEN };
        let ctx_idx = self.tail;
        let hdr_idx = self.next(ctx_idx);
        self.write_desc(
            ctx_idx,
            Desc::Context(Context::tcp_ipv4(
                flow::MACLEN as u8,
                flow::IPLEN as u16,
                flow::L4LEN as u8,
                self.cfg.mss,
            )),
        )?;
        self.write_desc(
            hdr_idx,
            Desc::Data(Data::new(
                hdr_iova.raw(),
                HDR_LEN as u16,
                Dcmd::IFCS | tso,
                paylen as u32,
                Popts::IXSM | Popts::TXSM,
            )),
        )?;
        let mut idx = hdr_idx;
        let nfr = frags.len();
        for (i, f) in frags.iter().enumerate() {
            let mut ps = pieces(f.iova(), f.len(), self.cfg.boundary).peekable();
            while let Some((at, n)) = ps.next() {
                idx = self.next(idx);
                let end = if i + 1 == nfr && ps.peek().is_none() {
                    Dcmd::EOP | Dcmd::RS
                } else {
                    Dcmd::empty()
                };
                let cmd = Dcmd::IFCS | tso | end;
                let d = Data::new(at.raw(), n as u16, cmd, 0, Popts::empty());
                self.write_desc(idx, Desc::Data(d))?;
            }
        }
        Ok(idx)
    }

    fn drop_header(&mut self, h: Hdr<M>) {
        match h {
            Hdr::Slot(i) => {
                if let Some(b) = self.bounce.as_mut() {
                    b.release(i);
                }
            }
            Hdr::Frag(f) => {
                if f.complete().is_err() {
                    self.stats.unmap_errors += 1;
                }
            }
        }
    }

    fn place_header(&mut self, idx: u16, hdr: &[u8]) -> Result<(Iova, Hdr<M>)> {
        if let Some(b) = self.bounce.as_mut() {
            match b.fill(usize::from(idx), hdr) {
                Ok(iova) => return Ok((iova, Hdr::Slot(usize::from(idx)))),
                Err(pfrag::Error::HeaderTooLarge { .. }) => self.stats.header_fallbacks += 1,
                Err(e) => return Err(e.into()),
            }
        }
        let mut f = self.hdr_cache.refill(hdr.len(), true)?;
        f.as_mut_slice().copy_from_slice(hdr);
        self.stats.mapped_headers += 1;
        Ok((f.iova(), Hdr::Frag(f)))
    }

    /// Rings the doorbell for everything posted.
    pub fn kick(&mut self) -> Result<()> {
        self.dev.kick(self.tail)
    }

    /// Reaps until nothing is in flight. Fails with [`Error::Timeout`] if
    /// `timeout` passes without any packet completing (the device stopped:
    /// a blocked DMA, a disabled queue), instead of spinning forever.
    /// Returns how many completed.
    pub fn wait(&mut self, timeout: Duration) -> Result<usize> {
        let mut done = 0;
        let mut since = Instant::now();
        let mut idle = 0u32;
        while !self.pending.is_empty() {
            let n = self.reap()?;
            if n > 0 {
                done += n;
                since = Instant::now();
                idle = 0;
                continue;
            }
            if since.elapsed() >= timeout {
                return Err(Error::Timeout {
                    pending: self.pending.len(),
                    waited_ms: since.elapsed().as_millis() as u64,
                    head: self.dev.head(),
                    tail: self.tail,
                });
            }
            idle += 1;
            if idle < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(done)
    }

    /// Detaches the device and hands it back, for another queue. Everything
    /// posted must have completed ([`wait`](Self::wait)); otherwise the
    /// queue is dropped with the device stopped first and
    /// [`Error::Timeout`] tells how many packets were still pending.
    pub fn into_device(self) -> Result<D> {
        let TxQueue {
            mut dev,
            ring,
            pending,
            tail,
            ..
        } = self;
        dev.detach()?;
        if !pending.is_empty() {
            return Err(Error::Timeout {
                pending: pending.len(),
                waited_ms: 0,
                head: dev.head(),
                tail,
            });
        }
        drop(ring);
        Ok(dev)
    }

    /// Frees every packet whose last descriptor has `DD` set, oldest first.
    /// Returns how many completed.
    pub fn reap(&mut self) -> Result<usize> {
        let mut n = 0;
        while let Some(p) = self.pending.front() {
            let sta = self
                .ring
                .read_u32(usize::from(p.last) * desc::SIZE + desc::STATUS_OFFSET)?;
            if sta & Sta::DD.bits() == 0 {
                break;
            }
            let mut p = self.pending.pop_front().expect("front exists");
            self.used -= usize::from(p.ndesc);
            if complete_burst(p.frags.drain(..)).is_err() {
                self.stats.unmap_errors += 1;
            }
            self.spare.push(p.frags);
            self.drop_header(p.hdr);
            n += 1;
        }
        self.stats.completed += n as u64;
        Ok(n)
    }
}
