//! The chaos soak: randomized phases of TX through pfrag pools on the
//! software NIC, with map, unmap and flush failures injected
//! ([`Faulty`]), and a check after every phase that nothing was lost,
//! corrupted, duplicated or leaked.
//!
//! A phase draws its chunk order (0..=9), mapping policy, invalidation mode,
//! queues (one or two threads sharing one pool), header placement,
//! fit-whole, ring size, memory limits (crossing the pressure limit, or
//! not) and failure rates (0..=5 % per kind), then sends payloads of 1 byte
//! up to the device maximum, with the edges (65,535, 65,536, 65,537,
//! 262,143) drawn often. A send refused with a typed error (an injected map
//! failure, a memory limit with nothing to reap, more buffers than the
//! device takes) is counted and skipped: the queue promises it changed
//! nothing, and the stream check proves it.
//!
//! After each phase: every frame the NIC put on the wire is valid, each
//! flow's stream is continuous up to exactly the bytes sent (no gap, no
//! duplicate), the device saw no fault (none is injected on its side), and
//! nothing is outstanding. Once the phase's queues and pool are dropped:
//! the mappings still in the IOMMU, the IOVA still allocated and the bytes
//! still charged are exactly what was pinned on purpose after failed
//! unmaps (counted by the domain), and nothing else.

use std::sync::Arc;
use std::time::Duration;

use pfrag::account::{CountHooks, Limits, MemAccount};
use pfrag::bounce::SlotSize;
use pfrag::dma::{Domain, Faulty, FaultyConfig, Invalidation, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool, Reclaim};
use pfrag::{Order, PAGE_SIZE};
use vfio_nic::check::wire::WireCheck;
use vfio_nic::desc::MAX_PAYLEN;
use vfio_nic::gen::Traffic;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::tx::{self, HeaderMode};

/// A deterministic random stream (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[(self.next_u64() % items.len() as u64) as usize]
    }
    /// A share in `0.0..=max`.
    pub fn rate(&mut self, max: f64) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * max
    }
}

/// Payload sizes that sit on an edge: one byte, one descriptor's worth, one
/// order-4 chunk and either side of it, and the largest PAYLEN.
pub const EDGE_SIZES: [usize; 6] = [1, 1448, 65_535, 65_536, 65_537, MAX_PAYLEN];

/// Everything one phase draws.
#[derive(Clone, Debug)]
pub struct Phase {
    /// Chunk order.
    pub order: u32,
    /// Mapping policy.
    pub policy: Policy,
    /// Strict or lazy invalidation.
    pub invalidation: Invalidation,
    /// TX queues, one thread each.
    pub queues: usize,
    /// Header placement.
    pub header: HeaderMode,
    /// Fit each payload whole in one chunk.
    pub fit_whole: bool,
    /// Ring descriptors.
    pub ring: u16,
    /// Flows per queue.
    pub flows: usize,
    /// Packets per queue.
    pub packets: u64,
    /// Memory limits of the pool's account.
    pub limits: Limits,
    /// Failures injected.
    pub faults: FaultyConfig,
    /// Seed of the payload sizes and flows.
    pub seed: u64,
}

impl Phase {
    /// Draws a phase of about `packets` packets in total.
    pub fn draw(rng: &mut Rng, packets: u64) -> Phase {
        let order = rng.range(0, 9) as u32;
        let queues = rng.range(1, 2) as usize;
        let chunk = Order::new(order).map_or(PAGE_SIZE, |o| o.size() as u64);
        // Pressure a few chunks up, so phases cross it; a hard maximum
        // (sometimes) that still fits a full ring of the largest payloads.
        let pressure = chunk * rng.range(2, 64);
        let limits = match rng.range(0, 2) {
            0 => Limits::UNLIMITED,
            1 => Limits {
                min: pressure / 2,
                pressure,
                max: u64::MAX,
            },
            _ => Limits {
                min: pressure / 2,
                pressure,
                max: pressure + (64 << 20),
            },
        };
        Phase {
            order,
            policy: rng.pick(&Policy::ALL),
            invalidation: rng.pick(&[Invalidation::Strict, Invalidation::Lazy]),
            queues,
            header: rng.pick(&[HeaderMode::Bounce(SlotSize::B128), HeaderMode::Mapped]),
            fit_whole: rng.range(0, 3) > 0,
            ring: rng.pick(&[64, 256, 512]),
            flows: rng.range(1, 16) as usize,
            packets: (packets / queues as u64).max(1),
            limits,
            faults: FaultyConfig {
                seed: rng.next_u64(),
                map_rate: rng.rate(0.05),
                unmap_rate: rng.rate(0.05),
                flush_rate: rng.rate(0.05),
                fail_nth: None,
            },
            seed: rng.next_u64(),
        }
    }

    /// One line for logs.
    pub fn describe(&self) -> String {
        format!(
            "order {} {} {:?} queues {} {} fit-whole {} ring {} flows {} failures map {:.3} unmap {:.3} flush {:.3}{}",
            self.order,
            self.policy.name(),
            self.invalidation,
            self.queues,
            match self.header {
                HeaderMode::Bounce(_) => "bounce",
                HeaderMode::Mapped => "mapped",
            },
            self.fit_whole,
            self.ring,
            self.flows,
            self.faults.map_rate,
            self.faults.unmap_rate,
            self.faults.flush_rate,
            if self.limits == Limits::UNLIMITED {
                String::new()
            } else {
                format!(" limits {}/{} MiB", self.limits.pressure >> 20, self.limits.max >> 20)
            }
        )
    }
}

/// What phases did, summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Packets posted.
    pub packets: u64,
    /// Payload bytes the NIC delivered and verified.
    pub bytes_verified: u64,
    /// Sends refused with a typed error (and skipped).
    pub refused: u64,
    /// Failures injected (map, unmap, flush).
    pub injected: u64,
    /// Payload bytes or frames found corrupt, missing or duplicated.
    pub corrupted: u64,
    /// Mappings, IOVA bytes or charged bytes left beyond what was pinned.
    pub leaked: u64,
    /// Bytes of host memory pinned on purpose after failed unmaps.
    pub pinned_bytes: u64,
    /// Phases run.
    pub phases: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.packets += o.packets;
        self.bytes_verified += o.bytes_verified;
        self.refused += o.refused;
        self.injected += o.injected;
        self.corrupted += o.corrupted;
        self.leaked += o.leaked;
        self.pinned_bytes += o.pinned_bytes;
        self.phases += o.phases;
    }
}

/// A rule a phase broke.
#[derive(Debug, thiserror::Error)]
#[error("phase {phase} ({what}): {why}")]
pub struct Violation {
    /// The phase, counted from 0.
    pub phase: u64,
    /// The phase's settings.
    pub what: String,
    /// What went wrong.
    pub why: String,
    /// Bytes left mapped, allocated or charged beyond what was pinned (0
    /// for a corruption or loss).
    pub leaked: u64,
}

type Mapper = Arc<Faulty<SoftIommu>>;
type Queue = tx::Queue<Mapper, SoftNic<Mapper>>;

/// One queue's view of a phase.
#[derive(Default)]
struct QueueTally {
    packets: u64,
    refused: u64,
    /// Bytes sent per flow.
    sent: Vec<u64>,
    wire: WireCheck,
    wire_bytes: u64,
}

/// Runs one phase; `tick` gets packet counts as they go.
pub fn run_phase(p: &Phase, index: u64, tick: &(dyn Fn(u64) + Sync)) -> Result<Tally, Violation> {
    let fail = |why: String| Violation {
        phase: index,
        what: p.describe(),
        why,
        leaked: 0,
    };
    let soft = SoftIommu::new(SoftIommuConfig {
        invalidation: p.invalidation,
        flush_queue: 64,
        ..SoftIommuConfig::default()
    })
    .map_err(|e| fail(e.to_string()))?;
    let mapper = Arc::new(Faulty::new(soft, p.faults).map_err(|e| fail(e.to_string()))?);
    let domain = Arc::new(Domain::new(mapper.clone()));
    let account =
        MemAccount::new(p.limits, CountHooks::default()).map_err(|e| fail(e.to_string()))?;
    let order = Order::new(p.order).map_err(|e| fail(e.to_string()))?;
    let mut cfg = pool::Config::new(order, p.policy);
    cfg.queues = p.queues;
    let size = order.size() as u64;
    cfg.reclaim = if p.seed.is_multiple_of(2) {
        Reclaim::Eager
    } else {
        Reclaim::Hysteresis {
            threshold: (2 << 20).max(2 * size),
            chunk: (1 << 20).max(size),
        }
    };
    let pool = Pool::with_account(domain.clone(), cfg, account.clone())
        .map_err(|e| fail(e.to_string()))?;
    let results: Vec<Result<QueueTally, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..p.queues)
            .map(|q| {
                let (domain, pool, mapper) = (domain.clone(), pool.clone(), mapper.clone());
                s.spawn(move || drive(p, q, domain, pool, mapper, tick))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("queue thread panicked".into()))
            })
            .collect()
    });
    let pool_stats = pool.stats();
    drop(pool);
    let mut t = Tally {
        phases: 1,
        ..Tally::default()
    };
    for r in results {
        let q = r.map_err(fail)?;
        t.packets += q.packets;
        t.refused += q.refused;
        t.bytes_verified += q.wire_bytes;
    }
    let inj = mapper.stats_injected();
    t.injected = inj.maps + inj.unmaps + inj.flushes;
    // Nothing of the phase is alive now: what is still mapped, allocated
    // or charged must be exactly what was pinned on purpose.
    let pinned = domain.pinned();
    let mapped = mapper.inner().mapped_pages() * PAGE_SIZE;
    let iova = domain.iova_in_use();
    let acct = account.stats();
    t.pinned_bytes = pinned.host_bytes;
    // A batch map whose undo failed pins its whole IOVA block, of which
    // only some runs stay mapped: mapped bytes may be fewer than pinned.
    let leaks = [
        (
            "mapped bytes",
            mapped,
            pinned.iova_bytes,
            mapped <= pinned.iova_bytes,
        ),
        (
            "IOVA bytes",
            iova,
            pinned.iova_bytes,
            iova == pinned.iova_bytes,
        ),
        (
            "charged bytes",
            acct.bytes,
            acct.pinned,
            acct.bytes == acct.pinned,
        ),
    ];
    for (what, have, allowed, ok) in leaks {
        if !ok {
            return Err(Violation {
                leaked: have.abs_diff(allowed),
                ..fail(format!(
                    "{what}: {have} left, {allowed} pinned on purpose (pool {pool_stats:?})"
                ))
            });
        }
    }
    Ok(t)
}

/// One queue of a phase: send, reap, check the wire; then drain and check
/// every flow.
fn drive(
    p: &Phase,
    q: usize,
    domain: Arc<Domain<Mapper>>,
    pool: Pool<Mapper>,
    mapper: Mapper,
    tick: &(dyn Fn(u64) + Sync),
) -> Result<QueueTally, String> {
    let nic = SoftNic::new(
        mapper,
        softnic::Config {
            capture: true,
            ..softnic::Config::default()
        },
    );
    let cfg = tx::Config {
        ring: p.ring,
        header: p.header,
        fit_whole: p.fit_whole,
        queue: q,
        ..tx::Config::default()
    };
    let mut gen = Traffic::new(p.flows, 1448).map_err(|e| e.to_string())?;
    let mut txq = match tx::Queue::new(domain, pool, nic, cfg) {
        Ok(t) => t,
        // Setting up can meet an injected map failure: a clean refusal.
        Err(e) if e.errno().is_some() => {
            return Ok(QueueTally {
                refused: 1,
                ..QueueTally::default()
            })
        }
        Err(e) => return Err(format!("queue {q}: {e}")),
    };
    let mut rng = Rng::new(p.seed ^ (q as u64 + 1).wrapping_mul(0x5851_f42d_4c95_7f2d));
    let mut t = QueueTally {
        sent: vec![0; p.flows],
        ..QueueTally::default()
    };
    let max = txq.max_payload();
    let mut since = 0;
    for _ in 0..p.packets {
        let flow = (rng.next_u64() % p.flows as u64) as usize;
        let len = payload_size(&mut rng, max);
        // Half the packets zero-copy, half through the copying send.
        let copy = rng.next_u64().is_multiple_of(2);
        if send(&mut txq, &mut gen, copy, &mut t, flow, len)? {
            t.sent[flow] += len as u64;
            t.packets += 1;
        } else {
            t.refused += 1;
        }
        since += 1;
        if since == 256 {
            tick(since);
            since = 0;
        }
    }
    tick(since);
    txq.kick().map_err(|e| e.to_string())?;
    txq.wait(Duration::from_secs(30))
        .map_err(|e| format!("queue {q}: {e}"))?;
    check_wire(&mut txq, &mut t)?;
    verify_queue(&txq, &t, q)?;
    Ok(t)
}

/// A payload size: edges a fifth of the time, else small, medium or large.
fn payload_size(rng: &mut Rng, max: usize) -> usize {
    let len = match rng.range(0, 9) {
        0 | 1 => rng.pick(&EDGE_SIZES),
        2..=5 => rng.range(1, 1500) as usize,
        6..=8 => rng.range(1, 70_000) as usize,
        _ => rng.range(70_000, MAX_PAYLEN as u64) as usize,
    };
    len.min(max)
}

/// Sends one packet, reaping and retrying while the ring or memory is
/// full. `Ok(false)`: refused with a typed error and skipped.
fn send(
    txq: &mut Queue,
    gen: &mut Traffic<Mapper>,
    copy: bool,
    t: &mut QueueTally,
    flow: usize,
    len: usize,
) -> Result<bool, String> {
    loop {
        let r = if copy {
            gen.send_copied(txq, flow, len)
        } else {
            gen.send(txq, flow, len)
        };
        match r {
            Ok(()) => return Ok(true),
            Err(e) if e.is_backoff() => {
                txq.kick().map_err(|e| e.to_string())?;
                let n = txq.reap().map_err(|e| e.to_string())?;
                check_wire(txq, t)?;
                if n == 0 && txq.in_flight() == 0 {
                    // Nothing to wait for: the limit stands. Refused.
                    return Ok(false);
                }
            }
            // More buffers or descriptors than the phase's device and
            // ring carry: the configuration refuses it, no retry would.
            Err(
                vfio_nic::Error::TooManyBuffers { .. } | vfio_nic::Error::PacketTooLarge { .. },
            ) => return Ok(false),
            Err(e) if e.errno().is_some() => return Ok(false), // injected
            Err(e) => return Err(format!("send of {len} bytes on flow {flow}: {e}")),
        }
    }
}

/// Runs the captured frames through the wire checker.
fn check_wire(txq: &mut Queue, t: &mut QueueTally) -> Result<(), String> {
    for fr in txq.device_mut().take_frames() {
        t.wire
            .frame(&fr)
            .map_err(|e| format!("bad frame on the wire: {e}"))?;
    }
    t.wire_bytes = t.wire.report().payload_bytes;
    Ok(())
}

/// After draining: no fault, nothing in flight, and each flow's stream ends
/// at exactly the bytes sent on it.
fn verify_queue(txq: &Queue, t: &QueueTally, q: usize) -> Result<(), String> {
    let st = txq.device().stats();
    if st.faults + st.bad_payload + st.bad_desc > 0 {
        return Err(format!("queue {q}: device stats {st:?}"));
    }
    if txq.in_flight() != 0 {
        return Err(format!(
            "queue {q}: {} packets outstanding",
            txq.in_flight()
        ));
    }
    let sent: u64 = t.sent.iter().sum();
    if st.delivered_bytes != sent || t.wire_bytes != sent {
        return Err(format!(
            "queue {q}: sent {sent} bytes, device delivered {}, wire saw {}",
            st.delivered_bytes, t.wire_bytes
        ));
    }
    for (f, &bytes) in t.sent.iter().enumerate() {
        let got = t.wire.next_offset(f as u32).unwrap_or(0);
        if u64::from(got) != bytes % (1 << 32) {
            return Err(format!(
                "queue {q} flow {f}: stream ends at {got}, {bytes} bytes sent"
            ));
        }
    }
    Ok(())
}

/// Runs phases until `packets` were posted or `deadline` passed, drawing
/// them from `seed`. Stops at the first violation.
pub fn soak(
    seed: u64,
    packets: u64,
    phase_packets: u64,
    deadline: Option<std::time::Instant>,
    tick: &(dyn Fn(u64) + Sync),
    on_phase: &mut dyn FnMut(u64, &Phase, &Tally),
) -> Result<Tally, Box<(Tally, Violation)>> {
    let mut rng = Rng::new(seed);
    let mut total = Tally::default();
    let mut i = 0;
    while total.packets < packets && deadline.is_none_or(|d| std::time::Instant::now() < d) {
        let p = Phase::draw(&mut rng, phase_packets.min(packets - total.packets).max(1));
        match run_phase(&p, i, tick) {
            Ok(t) => {
                total.add(&t);
                on_phase(i, &p, &total);
            }
            Err(v) => {
                if v.leaked > 0 {
                    total.leaked += v.leaked;
                } else {
                    total.corrupted += 1;
                }
                return Err(Box::new((total, v)));
            }
        }
        i += 1;
    }
    Ok(total)
}

/// The soak's closing line.
pub fn summary(t: &Tally) -> String {
    format!(
        "soak: {} packets, {} bytes verified, {} injected failures, {} corrupted, {} leaked",
        t.packets, t.bytes_verified, t.injected, t.corrupted, t.leaked
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_soak_delivers_everything_and_leaks_nothing() {
        let t = soak(7, 3_000, 300, None, &|_| {}, &mut |_, _, _| {}).map_err(|b| b.1);
        let t = t.unwrap();
        assert!(t.phases >= 10);
        assert_eq!((t.corrupted, t.leaked), (0, 0));
        assert!(t.bytes_verified > 0);
    }

    #[test]
    fn every_injected_failure_kind_shows_up_in_a_run_with_high_rates() {
        let p = Phase {
            order: 0,
            policy: Policy::PerFrag,
            invalidation: Invalidation::Lazy,
            queues: 2,
            header: HeaderMode::Mapped,
            fit_whole: false,
            ring: 64,
            flows: 3,
            packets: 400,
            limits: Limits::UNLIMITED,
            faults: FaultyConfig {
                seed: 9,
                map_rate: 0.05,
                unmap_rate: 0.05,
                flush_rate: 0.05,
                fail_nth: None,
            },
            seed: 4,
        };
        let t = run_phase(&p, 0, &|_| {}).unwrap();
        assert!(t.injected > 0 && t.refused > 0);
        assert_eq!(t.leaked, 0);
    }

    #[test]
    fn edge_sizes_include_both_sides_of_an_order4_chunk() {
        assert!(EDGE_SIZES.contains(&65_535) && EDGE_SIZES.contains(&65_537));
        assert_eq!(*EDGE_SIZES.last().unwrap(), 262_143);
    }
}
