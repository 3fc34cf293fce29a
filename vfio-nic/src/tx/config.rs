//! A queue's settings ([`Config`], [`HeaderMode`]) and how a driver
//! waits for a device ([`Backoff`]).

use std::time::Duration;

use pfrag::bounce::SlotSize;

use crate::error::{Error, Result};

/// Where packet headers go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderMode {
    /// Copied into the premapped bounce ring: no mapping per packet.
    Bounce(SlotSize),
    /// Each header in its own frag, mapped per packet (the stock kernel's
    /// `dma_map_single` of the skb head).
    Mapped,
}

impl HeaderMode {
    /// Its short name, as `Display` writes it.
    pub fn name(self) -> &'static str {
        match self {
            HeaderMode::Bounce(_) => "bounce",
            HeaderMode::Mapped => "mapped",
        }
    }
}

impl std::fmt::Display for HeaderMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for HeaderMode {
    type Err = String;
    /// `bounce` (128-byte slots) or `mapped`.
    fn from_str(s: &str) -> std::result::Result<HeaderMode, String> {
        match s {
            "bounce" => Ok(HeaderMode::Bounce(SlotSize::B128)),
            "mapped" => Ok(HeaderMode::Mapped),
            _ => Err(format!("'{s}' is not a header mode (bounce, mapped)")),
        }
    }
}

/// Settings of a [`Queue`](super::Queue). [`Config::default()`]: a ring of 256
/// descriptors, headers in 128-byte bounce slots, payloads fit whole, at
/// most 64 data buffers per packet, no boundary split, pool queue 0, MTU
/// 1500 (the `DEFAULT_` constants hold these values).
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Descriptors in the ring: a multiple of 8, 8..=4096. Default 256
    /// ([`Config::DEFAULT_RING`]).
    pub ring: u16,
    /// Header placement. Default bounce slots of 128 bytes
    /// ([`Config::DEFAULT_HEADER`]), which also carry a small packet's
    /// payload inline.
    pub header: HeaderMode,
    /// Ask the frag cache to fit each payload whole in one chunk. Default
    /// on ([`Config::DEFAULT_FIT_WHOLE`]).
    pub fit_whole: bool,
    /// Most data buffers per packet the device accepts: 2 to
    /// [`format::MAX_BUFS`](crate::format::MAX_BUFS) (64). Default 64
    /// ([`Config::DEFAULT_MAX_BUFS`]).
    pub max_bufs: usize,
    /// If set (a power of two), no data descriptor crosses a multiple of
    /// it. QEMU's emulated 82576 behind an emulated IOMMU maps each buffer
    /// as one IOTLB entry and silently drops a packet whose buffer crosses
    /// an IOMMU page, so runs under emulation set this to 4096; real
    /// hardware needs no split. Default `None`. Payload buffers are split
    /// at it; a packet's headers (or a whole inline packet) are one buffer
    /// in a bounce slot or a header frag, never split.
    pub boundary: Option<usize>,
    /// The pool queue (reserve) whose chunks the payload cache takes.
    /// Default 0, the first (and, by default, the only) one.
    pub queue: usize,
    /// The link's MTU: the most bytes after the Ethernet header of any
    /// frame on the wire. A frame without TSO longer than `mtu + 14`, or a
    /// TSO packet whose segments would be (headers + MSS), is refused
    /// ([`Error::FrameTooLong`]). Default 1500 ([`Config::DEFAULT_MTU`]);
    /// at least 68.
    pub mtu: u16,
    /// Where payload frags come from, by size. `Some(t)` (the default,
    /// [`Config::DEFAULT_SPLIT`]): payloads of at most `t` bytes from
    /// order-0 (4 KiB) chunks of a second pool of the queue's own, larger
    /// ones from the queue's pool, so that a small send held until its ACK
    /// pins 4 KiB rather than a large chunk full of other flows' frags
    /// (with a pool of order 0 there is nothing to split, and no second
    /// pool). The second pool charges the queue's pool's memory account;
    /// a pool with `max_bytes` and no account is not split, so that its
    /// limit holds. `None`: every payload from the queue's pool (one
    /// shared cache, for comparison). `t` is 1..=4096.
    pub split: Option<usize>,
    /// How often a packet asks its device to report completion, where the
    /// format lets the device report only some
    /// ([`Format::DEFERRED_REPORT`](crate::format::Format::DEFERRED_REPORT),
    /// the 82576's RS bit): every `report_every`-th packet, and the last
    /// packet before each doorbell. The packets before a reported one
    /// complete with it, their frags freed in one burst. Default 32
    /// ([`Config::DEFAULT_REPORT_EVERY`], as DPDK's ixgbe and i40e
    /// `tx_rs_thresh`; its igb driver reports every packet); 1 asks
    /// for every packet. Formats that report every packet (virtio) ignore
    /// it. At least 1.
    pub report_every: u16,
}

impl Config {
    /// The default ring size: 256 descriptors.
    pub const DEFAULT_RING: u16 = 256;
    /// The default header placement: bounce slots of 128 bytes.
    pub const DEFAULT_HEADER: HeaderMode = HeaderMode::Bounce(SlotSize::B128);
    /// Payloads are fit whole into one chunk by default.
    pub const DEFAULT_FIT_WHOLE: bool = true;
    /// The default most data buffers per packet: 64, the most any device
    /// takes ([`format::MAX_BUFS`](crate::format::MAX_BUFS)).
    pub const DEFAULT_MAX_BUFS: usize = crate::format::MAX_BUFS;
    /// The default MTU: 1500 bytes, Ethernet's.
    pub const DEFAULT_MTU: u16 = 1500;
    /// The smallest MTU a queue accepts: 68 bytes, IPv4's minimum.
    pub const MIN_MTU: u16 = 68;
    /// The default size-class split: payloads up to 4 KiB from order-0
    /// chunks.
    pub const DEFAULT_SPLIT: Option<usize> = Some(4096);
    /// By default a packet asks for a report every 32 packets (and before
    /// each doorbell).
    pub const DEFAULT_REPORT_EVERY: u16 = 32;
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ring: Config::DEFAULT_RING,
            header: Config::DEFAULT_HEADER,
            fit_whole: Config::DEFAULT_FIT_WHOLE,
            max_bufs: Config::DEFAULT_MAX_BUFS,
            boundary: None,
            queue: 0,
            mtu: Config::DEFAULT_MTU,
            split: Config::DEFAULT_SPLIT,
            report_every: Config::DEFAULT_REPORT_EVERY,
        }
    }
}

/// How a driver waits for a device that has completed nothing yet: it
/// spins for a little, then sleeps, as a stopped queue would, so that a
/// long wait costs little CPU. [`Queue::wait`](super::Queue::wait) waits so; a send loop that
/// meets a full ring can too.
#[derive(Debug, Default)]
pub struct Backoff {
    idle: u32,
}

impl Backoff {
    /// Pauses spun since the last reset before the first sleep.
    const SPINS: u32 = 64;

    /// Spins for the first 64 pauses since the last reset, then sleeps
    /// 20 µs per pause.
    pub fn pause(&mut self) {
        self.idle = self.idle.saturating_add(1);
        if self.idle <= Self::SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Whether the last pause was the first to sleep since the last reset:
    /// once per stretch without progress, when spinning gave up.
    pub(super) fn first_sleep(&self) -> bool {
        self.idle == Self::SPINS + 1
    }

    /// Progress was made: spin again before sleeping.
    pub fn reset(&mut self) {
        self.idle = 0;
    }
}

/// Refuses settings the queue cannot use.
pub(super) fn check_config(cfg: &Config) -> Result<()> {
    let bad = |what, value| Err(Error::BadConfig { what, value });
    if cfg.ring < 8 || cfg.ring > 4096 || !cfg.ring.is_multiple_of(8) {
        return bad("ring (multiple of 8, 8..=4096)", u64::from(cfg.ring));
    }
    // The text names the bound: a compile-time check below keeps it true.
    const _: () = assert!(crate::format::MAX_BUFS == 64);
    if cfg.max_bufs < 2 || cfg.max_bufs > crate::format::MAX_BUFS {
        return bad("max_bufs (2..=64)", cfg.max_bufs as u64);
    }
    if cfg.report_every == 0 {
        return bad("report_every (at least 1)", 0);
    }
    if cfg.mtu < Config::MIN_MTU {
        return bad("mtu (at least 68)", u64::from(cfg.mtu));
    }
    if let Some(t) = cfg
        .split
        .filter(|&t| t == 0 || t > pfrag::PAGE_SIZE as usize)
    {
        return bad(
            "split (payload bytes from order-0 chunks, 1..=4096)",
            t as u64,
        );
    }
    match cfg.boundary {
        Some(b) if !b.is_power_of_two() || b < 64 => {
            bad("boundary (a power of two, at least 64)", b as u64)
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::Backoff;

    /// The first 64 pauses since a reset spin and the 65th is the first to
    /// sleep, as `pause` says; after a reset, the same again. The 64th
    /// used to sleep.
    #[test]
    fn sixty_four_pauses_spin_before_the_first_sleep() {
        let mut b = Backoff::default();
        for _ in 0..2 {
            let first = (1..=100).find(|_| {
                b.pause();
                b.first_sleep()
            });
            assert_eq!(first, Some(Backoff::SPINS + 1));
            b.pause();
            assert!(!b.first_sleep(), "once per stretch");
            b.reset();
        }
    }
}
