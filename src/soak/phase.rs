//! What a phase is: its settings, drawn from the run's random stream.

use pfrag::account::Limits;
use pfrag::bounce::SlotSize;
use pfrag::dma::{FaultyConfig, Invalidation};
use pfrag::pool::Policy;
use pfrag::{Order, PAGE_SIZE};
use vfio_nic::desc::MAX_PAYLEN;
use vfio_nic::tx::HeaderMode;

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
    /// Failures injected (the soak counts them, and each refusal they
    /// cause is explained by one).
    pub faults: FaultyConfig,
    /// Failures beneath the injector that the soak is not told of: a
    /// stand-in for real ones (memory or address space running out). Every
    /// drawn phase has none; an error they cause is unexplained and fails
    /// the soak.
    pub untold: FaultyConfig,
    /// Seed of the payload sizes and flows.
    pub seed: u64,
    /// When to stop posting, if before `packets` (the soak's time limit):
    /// a phase cut short verifies what it sent. Not drawn.
    pub deadline: Option<std::time::Instant>,
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
            untold: FaultyConfig {
                seed: 0,
                ..FaultyConfig::default()
            },
            seed: rng.next_u64(),
            deadline: None,
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
            self.header.name(),
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
