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
//! 262,143) drawn often. A send refused with a typed error is counted by
//! its cause and skipped (the queue promises it changed nothing, and the
//! stream check proves it): a failure the injector reports for that very
//! call, the account's hard maximum with nothing left to reap, or a packet
//! larger than the ring or the device's buffer chain ([`Refusals`]). An
//! error none of these explains (a real map or mmap failure, say) fails the
//! soak, naming the error.
//!
//! The same seed replays the same run: every phase is drawn from it, and
//! the queue threads of a two-queue phase take turns of a fixed number of
//! sends, so the pool, account and mapper they share (and the injector's
//! random stream) see the same calls in the same order every time.
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

mod cause;
mod phase;
#[cfg(test)]
mod tests;
mod turns;

pub use cause::Refusals;
pub use phase::{Phase, Rng, EDGE_SIZES};
use turns::{Seat, Turns, SENDS_PER_TURN};

use pfrag::account::{CountHooks, MemAccount};
use pfrag::dma::{Domain, Faulty, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Pool, Reclaim};
use pfrag::{Order, PAGE_SIZE};
use vfio_nic::check::wire::WireCheck;
use vfio_nic::desc::MAX_PAYLEN;
use vfio_nic::gen::Traffic;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::tx;

/// What phases did, summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Packets posted.
    pub packets: u64,
    /// Payload bytes the NIC delivered and verified.
    pub bytes_verified: u64,
    /// Sends refused with a typed error (and skipped), by cause.
    pub refused: Refusals,
    /// Failures injected (map, unmap, flush).
    pub injected: u64,
    /// Payload bytes or frames found corrupt, missing or duplicated.
    pub corrupted: u64,
    /// Errors that no injected failure or limit explains.
    pub unexplained: u64,
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
        self.refused.add(&o.refused);
        self.injected += o.injected;
        self.corrupted += o.corrupted;
        self.unexplained += o.unexplained;
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
    /// An error that no injected failure explains.
    pub unexplained: bool,
}

type Mapper = Arc<Faulty<Faulty<SoftIommu>>>;
type Queue = tx::Queue<Mapper, SoftNic<Mapper>>;

/// One queue's view of a phase.
#[derive(Default)]
struct QueueTally {
    packets: u64,
    refused: Refusals,
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
        unexplained: false,
    };
    let Stack {
        mapper,
        domain,
        account,
        pool,
    } = Stack::new(p).map_err(fail)?;
    let results = run_queues(p, &domain, &pool, &mapper, tick);
    let pool_stats = pool.stats();
    drop(pool);
    let mut t = sum_queues(results).map_err(|f| match f {
        Failure::Broken(why) => fail(why),
        Failure::Unexplained(why) => Violation {
            unexplained: true,
            ..fail(why)
        },
    })?;
    let inj = mapper.stats_injected();
    t.injected = inj.maps + inj.unmaps + inj.flushes;
    if t.refused.injected > t.injected {
        return Err(Violation {
            unexplained: true,
            ..fail(format!(
                "{} sends refused for injected failures, but only {} were injected",
                t.refused.injected, t.injected
            ))
        });
    }
    // Nothing of the phase is alive now: what is still mapped, allocated
    // or charged must be exactly what was pinned on purpose.
    t.pinned_bytes =
        check_leaks(&domain, &mapper, &account, &pool_stats).map_err(|(leaked, why)| {
            Violation {
                leaked,
                ..fail(why)
            }
        })?;
    Ok(t)
}

/// What a phase sends through: the software IOMMU under two failure
/// injectors (the phase's `untold` failures inside, the counted `faults`
/// outside), the domain over them, the memory account and the pool.
struct Stack {
    mapper: Mapper,
    domain: Arc<Domain<Mapper>>,
    account: Arc<MemAccount<CountHooks>>,
    pool: Pool<Mapper>,
}

impl Stack {
    /// Builds the phase's stack; an error is said in words.
    fn new(p: &Phase) -> Result<Stack, String> {
        let soft = SoftIommu::new(SoftIommuConfig {
            invalidation: p.invalidation,
            flush_queue: 64,
            ..SoftIommuConfig::default()
        })
        .map_err(|e| e.to_string())?;
        let untold = Faulty::new(soft, p.untold).map_err(|e| e.to_string())?;
        let mapper = Arc::new(Faulty::new(untold, p.faults).map_err(|e| e.to_string())?);
        let domain = Arc::new(Domain::new(mapper.clone()));
        let account =
            MemAccount::new(p.limits, CountHooks::default()).map_err(|e| e.to_string())?;
        let cfg = pool_config(p).map_err(|e| e.to_string())?;
        let pool =
            Pool::with_account(domain.clone(), cfg, account.clone()).map_err(|e| e.to_string())?;
        Ok(Stack {
            mapper,
            domain,
            account,
            pool,
        })
    }
}

/// One phase's tally of its queues' packets, refusals and verified bytes,
/// or the failure of the first queue (in queue order) that failed.
fn sum_queues(results: Vec<Result<QueueTally, Failure>>) -> Result<Tally, Failure> {
    let mut t = Tally {
        phases: 1,
        ..Tally::default()
    };
    for r in results {
        let q = r?;
        t.packets += q.packets;
        t.refused.add(&q.refused);
        t.bytes_verified += q.wire_bytes;
    }
    Ok(t)
}

/// Checks that nothing leaked once a phase is over: mapped bytes, the
/// IOVA still allocated and the bytes still charged must each be what was
/// pinned on purpose (mapped bytes may be fewer: a batch map whose undo
/// failed pins its whole IOVA block, of which only some runs stay mapped).
/// Gives the host bytes pinned, or the first leak: the bytes beyond what
/// was pinned, and what leaked, in words.
fn check_leaks(
    domain: &Domain<Mapper>,
    mapper: &Mapper,
    account: &MemAccount<CountHooks>,
    pool_stats: &pool::Stats,
) -> Result<u64, (u64, String)> {
    let pinned = domain.pinned();
    let mapped = mapper.inner().inner().mapped_pages() * PAGE_SIZE;
    let iova = domain.iova_in_use();
    let acct = account.stats();
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
            return Err((
                have.abs_diff(allowed),
                format!("{what}: {have} left, {allowed} pinned on purpose (pool {pool_stats:?})"),
            ));
        }
    }
    Ok(pinned.host_bytes)
}

/// The phase's pool settings.
fn pool_config(p: &Phase) -> Result<pool::Config, pfrag::Error> {
    let order = Order::new(p.order)?;
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
    Ok(cfg)
}

/// Runs the phase's queues, each on its own thread, taking turns.
fn run_queues(
    p: &Phase,
    domain: &Arc<Domain<Mapper>>,
    pool: &Pool<Mapper>,
    mapper: &Mapper,
    tick: &(dyn Fn(u64) + Sync),
) -> Vec<Result<QueueTally, Failure>> {
    let turns = Turns::new(p.queues);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..p.queues)
            .map(|q| {
                let (domain, pool, mapper) = (domain.clone(), pool.clone(), mapper.clone());
                let turns = &turns;
                s.spawn(move || drive(p, turns.sit(q), domain, pool, mapper, tick))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("queue thread panicked".to_string().into()))
            })
            .collect()
    })
}

/// Why a queue's part of a phase failed.
enum Failure {
    /// A rule broken: a bad frame, a lost or extra byte, a device fault.
    Broken(String),
    /// An error that no injected failure or limit explains.
    Unexplained(String),
}

impl From<String> for Failure {
    fn from(why: String) -> Failure {
        Failure::Broken(why)
    }
}

/// One queue of a phase, in its turns: send, reap, check the wire; then
/// drain and check every flow.
fn drive(
    p: &Phase,
    seat: Seat<'_>,
    domain: Arc<Domain<Mapper>>,
    pool: Pool<Mapper>,
    mapper: Mapper,
    tick: &(dyn Fn(u64) + Sync),
) -> Result<QueueTally, Failure> {
    let q = seat.queue();
    let nic = SoftNic::new(
        mapper.clone(),
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
    let before = mapper.stats_injected();
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let mut txq = match unsafe { tx::Queue::new(domain, pool, nic, cfg) } {
        Ok(t) => t,
        // Setting up can meet an injected map failure: a clean refusal.
        Err(e) => {
            let why = |w: String| Failure::Unexplained(format!("queue {q} setup: {w}"));
            let cause = cause::classify(&e, true, p.limits, &before, &mapper.stats_injected());
            let mut t = QueueTally::default();
            t.refused.count(cause.map_err(why)?);
            return Ok(t);
        }
    };
    let mut rng = Rng::new(p.seed ^ (q as u64 + 1).wrapping_mul(0x5851_f42d_4c95_7f2d));
    let mut t = QueueTally {
        sent: vec![0; p.flows],
        ..QueueTally::default()
    };
    let max = gen.max_payload(&txq);
    let mut since = 0;
    for i in 0..p.packets {
        if i > 0 && i % SENDS_PER_TURN == 0 {
            if p.deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                break;
            }
            seat.pass();
        }
        let flow = (rng.next_u64() % p.flows as u64) as usize;
        let len = payload_size(&mut rng, max);
        // Half the packets zero-copy, half through the copying send.
        let copy = rng.next_u64().is_multiple_of(2);
        match send(&mut txq, &mut gen, copy, &mut t, flow, len, (p, &mapper))? {
            None => {
                t.sent[flow] += len as u64;
                t.packets += 1;
            }
            Some(cause) => t.refused.count(cause),
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
/// full. `Ok(None)`: sent; `Ok(Some(cause))`: refused with a typed error
/// that `cause` explains, and skipped.
fn send(
    txq: &mut Queue,
    gen: &mut Traffic<Mapper>,
    copy: bool,
    t: &mut QueueTally,
    flow: usize,
    len: usize,
    (p, mapper): (&Phase, &Mapper),
) -> Result<Option<cause::Cause>, Failure> {
    loop {
        let before = mapper.stats_injected();
        let r = if copy {
            gen.send_copied(txq, flow, len)
        } else {
            gen.send(txq, flow, len)
        };
        let e = match r {
            Ok(()) => return Ok(None),
            Err(e) => e,
        };
        let mut idle = true;
        if e.is_backoff() {
            txq.kick().map_err(|e| e.to_string())?;
            let n = txq.reap().map_err(|e| e.to_string())?;
            check_wire(txq, t)?;
            // Something to wait for: retry. Else the limit stands.
            idle = n == 0 && txq.in_flight() == 0;
            if !idle {
                continue;
            }
        }
        let after = mapper.stats_injected();
        return cause::classify(&e, idle, p.limits, &before, &after)
            .map(Some)
            .map_err(|w| Failure::Unexplained(format!("send of {len} bytes on flow {flow}: {w}")));
    }
}

/// Runs the captured frames through the wire checker. A phase's flows
/// never restart, so a frame at offset 0 in mid-stream is a copy: refused
/// by the report once the flow's next frame placed it, and none may be
/// left unplaced at the end (see [`verify_queue`]).
fn check_wire(txq: &mut Queue, t: &mut QueueTally) -> Result<(), String> {
    for fr in txq.take_frames() {
        t.wire
            .frame(&fr)
            .map_err(|e| format!("bad frame on the wire: {e}"))?;
    }
    let r = t.wire.report();
    if let Some(e) = r.first_errors.first() {
        return Err(format!("bad frame on the wire: {e}"));
    }
    t.wire_bytes = r.payload_bytes;
    Ok(())
}

/// After draining: no loss, nothing in flight, no frame left unplaced,
/// and each flow's stream ends at exactly the bytes sent on it.
fn verify_queue(txq: &Queue, t: &QueueTally, q: usize) -> Result<(), String> {
    let st = txq.device().stats();
    if st.losses() > 0 {
        return Err(format!("queue {q}: device stats {st:?}"));
    }
    if txq.in_flight() != 0 {
        return Err(format!(
            "queue {q}: {} packets outstanding",
            txq.in_flight()
        ));
    }
    let unplaced = t.wire.report().unplaced_frames;
    if unplaced != 0 {
        return Err(format!(
            "queue {q}: {unplaced} frames at stream offset 0 in mid-stream"
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

/// Runs phases until `packets` were posted or `deadline` passed (a phase
/// running then stops posting, and verifies what it sent), drawing them
/// from `seed`. Stops at the first violation.
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
        let mut p = Phase::draw(&mut rng, phase_packets.min(packets - total.packets).max(1));
        p.deadline = deadline;
        match run_phase(&p, i, tick) {
            Ok(t) => {
                total.add(&t);
                on_phase(i, &p, &total);
            }
            Err(v) => {
                if v.unexplained {
                    total.unexplained += 1;
                } else if v.leaked > 0 {
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

/// Prints a line above the progress bar, or to `out` when no bar is drawn.
pub fn say(bar: &indicatif::ProgressBar, out: &mut dyn std::io::Write, line: &str) {
    if bar.is_hidden() {
        // Logging must not fail the soak; a closed stream just drops it.
        let _ = writeln!(out, "{line}");
    } else {
        bar.println(line);
    }
}

/// The soak's closing line.
pub fn summary(t: &Tally) -> String {
    let r = &t.refused;
    format!(
        "soak: {} packets, {} bytes verified, {} injected failures, {} sends refused \
         ({} injected, {} memory limit, {} too big for the ring, {} too many buffers), \
         {} unexplained, {} corrupted, {} leaked",
        t.packets,
        t.bytes_verified,
        t.injected,
        r.total(),
        r.injected,
        r.memory_limit,
        r.ring,
        r.buffers,
        t.unexplained,
        t.corrupted,
        t.leaked
    )
}
