//! The flows experiment's event loop: flows take turns on the wire while
//! their window allows, ACKs release the frags they held, stalls hold them
//! longer. Simulated time advances by each packet's wire time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use pfrag::dma::{DmaMapper, Domain, SoftIommu, SoftIommuConfig};
use pfrag::frag::{Frag, FragCache, FragHold};
use pfrag::pool::{self, Pool};
use pfrag::Order;
use vfio_nic::gen::flow::{Flow, HDR_LEN};
use vfio_nic::gen::pattern;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::offload::Offload;
use vfio_nic::tx;

use super::{CacheKind, FlowsConfig, FlowsRow};
use crate::run::{Rng, RunError, MSS};

type M = Arc<SoftIommu>;
type Queue = tx::Queue<M, SoftNic<M>>;

/// One flow's send state.
struct FlowState {
    gen: Flow,
    bulk: bool,
    rtt_ns: f64,
    window: usize,
    /// Payload bytes sent and not yet acknowledged.
    inflight: usize,
    /// Packets sent before it stalls (`None`: it never does).
    stall_after: Option<u32>,
    sent: u32,
    /// End of its stall, while it lasts.
    stalled_until: Option<f64>,
}

/// What waits in simulated time.
enum Event {
    /// A packet's ACK: its flow's window opens and its frags are let go.
    Ack {
        flow: usize,
        bytes: usize,
        holds: Vec<FragHold<M>>,
        /// When the ACK is due: sent plus the flow's round trip.
        due_ns: f64,
    },
    /// A stalled flow's window opens again.
    Unstall { flow: usize },
}

/// Held frags, counted per chunk, with exact byte and chunk totals.
#[derive(Default)]
struct Holds {
    per_chunk: HashMap<usize, u32>,
    /// Chunks held by exactly one frag.
    ones: usize,
    /// Payload bytes held.
    bytes: u64,
}

impl Holds {
    fn add(&mut self, h: &FragHold<M>) {
        let n = self.per_chunk.entry(h.chunk_id()).or_insert(0);
        *n += 1;
        match *n {
            1 => self.ones += 1,
            2 => self.ones -= 1,
            _ => {}
        }
        self.bytes += h.len() as u64;
    }

    fn remove(&mut self, h: &FragHold<M>) {
        let id = h.chunk_id();
        let n = self
            .per_chunk
            .get_mut(&id)
            .expect("a held chunk is counted");
        *n -= 1;
        match *n {
            0 => {
                self.ones -= 1;
                self.per_chunk.remove(&id);
            }
            1 => self.ones += 1,
            _ => {}
        }
        self.bytes -= h.len() as u64;
    }
}

/// Running sums of the sampled levels.
#[derive(Default)]
struct Levels {
    samples: u64,
    inflight: f64,
    inflight_peak: u64,
    pool: f64,
    pool_peak: u64,
    pinned: f64,
}

/// The experiment's state.
struct Sim<'a> {
    cfg: &'a FlowsConfig,
    mapper: M,
    q: Queue,
    pools: Vec<Pool<M>>,
    /// `per-flow`: each flow's cache; `split`: the small sends' cache.
    caches: Vec<Option<FragCache<M>>>,
    flows: Vec<FlowState>,
    ready: VecDeque<usize>,
    events: BinaryHeap<Reverse<(u64, u64)>>,
    pending: HashMap<u64, Event>,
    next_event: u64,
    now_ns: f64,
    holds: Holds,
    rng: Rng,
    scratch: Vec<Frag<M>>,
    token: u64,
    /// ACKs that released frags before they were due (must stay 0).
    early_acks: u64,
    /// ACKs put off to the end of their flow's stall.
    deferred_acks: u64,
}

/// Runs one configuration. Fails on a bad setting, a device or pool
/// error, or if any payload byte was not delivered intact.
pub fn run(cfg: &FlowsConfig) -> Result<FlowsRow, RunError> {
    cfg.check().map_err(RunError::Setting)?;
    let mut s = Sim::new(cfg)?;
    for _ in 0..cfg.warmup {
        s.step()?;
    }
    // Everything of the warm-up reaches the device before the counters
    // are read.
    s.q.kick()?;
    s.q.wait(std::time::Duration::from_secs(10))?;
    let (m0, n0, t0) = (s.mapper.stats(), s.q.device().stats(), s.now_ns);
    let mut lv = Levels::default();
    let mut sent = 0u64;
    for _ in 0..cfg.packets {
        sent += s.step()? as u64;
        s.sample(&mut lv);
    }
    s.q.kick()?;
    s.q.wait(std::time::Duration::from_secs(10))?;
    let (m, n) = (s.mapper.stats().since(&m0), s.q.device().stats().since(&n0));
    let stalled_flows = s
        .flows
        .iter()
        .filter(|f| f.stall_after.is_some_and(|k| f.sent >= k))
        .count();
    let p = cfg.packets as f64;
    let k = lv.samples.max(1) as f64;
    let (inflight, pool) = (lv.inflight / k, lv.pool / k);
    let row = FlowsRow {
        cache: cfg.cache.name().into(),
        order: cfg.order,
        flows: cfg.flows,
        packets: cfg.packets,
        inflight_bytes_mean: inflight,
        inflight_bytes_peak: lv.inflight_peak,
        pool_bytes_mean: pool,
        pool_bytes_peak: lv.pool_peak,
        amplification_mean: pool / inflight.max(1.0),
        amplification_peak: lv.pool_peak as f64 / lv.inflight_peak.max(1) as f64,
        pinned_chunks_mean: lv.pinned / k,
        maps_per_pkt: m.map_calls as f64 / p,
        invalidations_per_pkt: m.invalidations as f64 / p,
        iotlb_misses_per_pkt: m.iotlb_misses as f64 / p,
        bytes_verified: n.bytes_verified,
        bytes_sent: sent,
        sim_ms: (s.now_ns - t0) / 1e6,
        stalled_flows,
        early_acks: s.early_acks,
        deferred_acks: s.deferred_acks,
    };
    if n.bytes_verified != sent || n.losses() > 0 || s.early_acks > 0 {
        return Err(RunError::Setting(format!(
            "{} flows order {} {}: {} of {sent} bytes verified, {} losses, {} early ACKs",
            cfg.flows,
            cfg.order,
            cfg.cache.name(),
            n.bytes_verified,
            n.losses(),
            s.early_acks
        )));
    }
    Ok(row)
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a FlowsConfig) -> Result<Sim<'a>, RunError> {
        let mapper = Arc::new(SoftIommu::new(SoftIommuConfig::default())?);
        let domain = Arc::new(Domain::new(mapper.clone()));
        let pool = Pool::new(
            domain.clone(),
            pool::Config::new(Order::new(cfg.order)?, cfg.policy),
        )?;
        let mut pools = vec![pool.clone()];
        let caches = match cfg.cache {
            CacheKind::Shared | CacheKind::Default => Vec::new(),
            CacheKind::PerFlow => (0..cfg.flows).map(|_| None).collect(),
            CacheKind::Split => {
                let small = Pool::new(
                    domain.clone(),
                    pool::Config::new(Order::new(0)?, cfg.policy),
                )?;
                pools.push(small.clone());
                vec![Some(FragCache::new(small))]
            }
        };
        let nic = SoftNic::new(mapper.clone(), softnic::Config::default());
        // Only `default` keeps the queue's own split; the others choose
        // their caches here.
        let txc = tx::Config {
            split: match cfg.cache {
                CacheKind::Default => tx::Config::DEFAULT_SPLIT,
                _ => None,
            },
            ..tx::Config::default()
        };
        // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
        let q = unsafe { tx::Queue::new(domain, pool, nic, txc) }?;
        pools.extend(q.small_cache().map(|c| c.pool().clone()));
        let mut rng = Rng(cfg.seed | 1);
        let flows = (0..cfg.flows)
            .map(|i| flow_state(cfg, i, &mut rng))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Sim {
            cfg,
            mapper,
            q,
            pools,
            caches,
            flows,
            ready: (0..cfg.flows).collect(),
            events: BinaryHeap::new(),
            pending: HashMap::new(),
            next_event: 0,
            now_ns: 0.0,
            holds: Holds::default(),
            rng,
            scratch: Vec::with_capacity(4),
            token: 0,
            early_acks: 0,
            deferred_acks: 0,
        })
    }

    /// Queues `e` at `at_ns`, rounded up: it never fires early.
    fn schedule(&mut self, at_ns: f64, e: Event) {
        let id = self.next_event;
        self.next_event += 1;
        self.events.push(Reverse((at_ns.ceil() as u64, id)));
        self.pending.insert(id, e);
    }

    /// Sends one packet: from the next flow whose window allows it, after
    /// letting simulated time run to the next event while none does.
    /// Returns its payload bytes.
    fn step(&mut self) -> Result<usize, RunError> {
        self.fire_due();
        let f = loop {
            if let Some(f) = self.ready.pop_front() {
                break f;
            }
            let Some(&Reverse((at, _))) = self.events.peek() else {
                return Err(RunError::Setting(
                    "no flow can send and nothing is pending".into(),
                ));
            };
            self.now_ns = self.now_ns.max(at as f64);
            self.fire_due();
        };
        let len = self.send_len(f);
        let holds = self.send(f, len)?;
        let st = &mut self.flows[f];
        st.inflight += len;
        st.sent += 1;
        let wire = softnic::line_bytes(HDR_LEN, len, usize::from(MSS));
        self.now_ns += wire as f64 * 8.0 / self.cfg.line_rate_gbit;
        let (rtt, stall) = (st.rtt_ns, st.stall_after == Some(st.sent));
        if stall {
            let until = self.now_ns + self.cfg.stall_ms * 1e6;
            self.flows[f].stalled_until = Some(until);
            self.schedule(until, Event::Unstall { flow: f });
        } else if self.can_send(f) {
            self.ready.push_back(f);
        }
        let due_ns = self.now_ns + rtt;
        self.schedule(
            due_ns,
            Event::Ack {
                flow: f,
                bytes: len,
                holds,
                due_ns,
            },
        );
        Ok(len)
    }

    /// Payload of flow `f`'s next packet.
    fn send_len(&mut self, f: usize) -> usize {
        if self.flows[f].bulk {
            return self.cfg.bulk_payload;
        }
        let (lo, hi) = self.cfg.small;
        lo + (self.rng.next() % (hi - lo + 1) as u64) as usize
    }

    /// Whether flow `f` may send a packet now.
    fn can_send(&self, f: usize) -> bool {
        let st = &self.flows[f];
        let most = if st.bulk {
            self.cfg.bulk_payload
        } else {
            self.cfg.small.1
        };
        st.stalled_until.is_none() && st.inflight + most <= st.window
    }

    /// Fires every event due by now. An ACK of a stalled flow waits for the
    /// stall's end: its data stays held.
    fn fire_due(&mut self) {
        while let Some(&Reverse((at, id))) = self.events.peek() {
            if at as f64 > self.now_ns {
                break;
            }
            self.events.pop();
            let Some(e) = self.pending.remove(&id) else {
                continue;
            };
            match e {
                Event::Ack {
                    flow,
                    bytes,
                    holds,
                    due_ns,
                } => {
                    if let Some(until) = self.flows[flow].stalled_until {
                        let e = Event::Ack {
                            flow,
                            bytes,
                            holds,
                            due_ns,
                        };
                        self.schedule(until, e);
                        self.deferred_acks += 1;
                        continue;
                    }
                    if self.now_ns < due_ns {
                        self.early_acks += 1;
                    }
                    for h in &holds {
                        self.holds.remove(h);
                    }
                    drop(holds);
                    let was = self.can_send(flow);
                    self.flows[flow].inflight -= bytes;
                    if !was && self.can_send(flow) {
                        self.ready.push_back(flow);
                    }
                }
                Event::Unstall { flow } => {
                    self.flows[flow].stalled_until = None;
                    if self.can_send(flow) {
                        self.ready.push_back(flow);
                    }
                }
            }
        }
    }

    /// Posts `len` payload bytes on flow `f`; returns holds on its frags.
    fn send(&mut self, f: usize, len: usize) -> Result<Vec<FragHold<M>>, RunError> {
        let offload = if len > usize::from(MSS) {
            Offload::Tso { mss: MSS }
        } else {
            Offload::Checksum
        };
        loop {
            match self.q.room_for(len, offload) {
                Ok(()) => break,
                Err(e) if e.is_backoff() && self.q.in_flight() > 0 => {
                    self.q.kick()?;
                    self.q.reap()?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let mut v = std::mem::take(&mut self.scratch);
        self.frags(f, len, &mut v)?;
        let mut hdr = [0u8; HDR_LEN];
        let mut off = self.flows[f].gen.header(len, &mut hdr);
        let mut holds = Vec::with_capacity(v.len());
        for fr in v.iter_mut() {
            pattern::fill(self.flows[f].gen.id(), off, fr.as_mut_slice());
            off = off.wrapping_add(fr.len() as u32);
            let h = fr.hold();
            self.holds.add(&h);
            holds.push(h);
        }
        let posted = self.q.post(&hdr, &mut v, offload, self.token);
        self.scratch = v;
        if let Err(e) = posted {
            for h in &holds {
                self.holds.remove(h);
            }
            return Err(e.into());
        }
        self.flows[f].gen.advance(len, usize::from(MSS));
        self.token += 1;
        if self.token.is_multiple_of(8) {
            self.q.kick()?;
            self.q.reap()?;
        }
        Ok(holds)
    }

    /// Frags for `len` bytes of flow `f` from the cache its kind assigns.
    fn frags(&mut self, f: usize, len: usize, out: &mut Vec<Frag<M>>) -> Result<(), RunError> {
        let cache = match self.cfg.cache {
            CacheKind::Shared | CacheKind::Default => None,
            CacheKind::PerFlow => Some(f),
            CacheKind::Split if self.flows[f].bulk => None,
            CacheKind::Split => Some(0),
        };
        match cache {
            None => self.q.frags(len, out)?,
            Some(i) => {
                let pool = &self.pools[self.pools.len() - 1];
                let c = self.caches[i].get_or_insert_with(|| FragCache::new(pool.clone()));
                c.frags(len, true, out)?;
            }
        }
        Ok(())
    }

    /// Adds the levels now to `lv`.
    fn sample(&self, lv: &mut Levels) {
        let pool: u64 = self.pools.iter().map(in_use_bytes).sum();
        lv.samples += 1;
        lv.inflight += self.holds.bytes as f64;
        lv.inflight_peak = lv.inflight_peak.max(self.holds.bytes);
        lv.pool += pool as f64;
        lv.pool_peak = lv.pool_peak.max(pool);
        lv.pinned += self.holds.ones as f64;
    }
}

/// Bytes of `p`'s chunks out of its free lists: carved by a cache, or kept
/// by frags in flight or held.
fn in_use_bytes<T: DmaMapper>(p: &Pool<T>) -> u64 {
    let s = p.stats();
    let free = (p.free_chunks() + p.reserved_chunks() + p.parked_chunks()) as u64 + s.pinned;
    s.chunks.saturating_sub(free) * p.chunk_size() as u64
}

/// Flow `i`: bulk or small, its window, round-trip time and stall.
fn flow_state(cfg: &FlowsConfig, i: usize, rng: &mut Rng) -> Result<FlowState, RunError> {
    let bulk = rng.unit() <= cfg.bulk_share;
    let rtt_us = (cfg.rtt_min_us / rng.unit().powf(1.0 / cfg.rtt_alpha)).min(cfg.rtt_max_ms * 1e3);
    let stall_after = (rng.unit() <= cfg.stall_share).then(|| 1 + (rng.next() % 4) as u32);
    Ok(FlowState {
        gen: Flow::new(i)?,
        bulk,
        rtt_ns: rtt_us * 1e3,
        window: if bulk {
            cfg.bulk_window
        } else {
            cfg.small_window
        },
        inflight: 0,
        stall_after,
        sent: 0,
        stalled_until: None,
    })
}
