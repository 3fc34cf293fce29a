//! Why a send was refused. Every refusal must have a cause the soak can
//! name: a failure the injector reports for that very call, the account's
//! hard maximum with nothing left to reap, or a packet larger than the ring
//! or the device's buffer chain. Any other error is unexplained, and fails
//! the soak.

use pfrag::account::Limits;
use pfrag::dma::FaultyStats;

/// Sends refused, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refusals {
    /// A map, unmap or flush failure the injector reported for that call.
    pub injected: u64,
    /// The account's hard maximum, with nothing in flight left to reap.
    pub memory_limit: u64,
    /// A packet needing more descriptors than the whole ring holds.
    pub ring: u64,
    /// A packet needing more buffers than the device chains.
    pub buffers: u64,
}

impl Refusals {
    /// All refusals.
    pub fn total(&self) -> u64 {
        self.injected + self.memory_limit + self.ring + self.buffers
    }

    pub(super) fn add(&mut self, o: &Refusals) {
        self.injected += o.injected;
        self.memory_limit += o.memory_limit;
        self.ring += o.ring;
        self.buffers += o.buffers;
    }
}

/// The cause of a refused call, or `Err` with the error no cause explains.
/// `before` and `after` are the injector's counts around the call; the
/// phase's queues take turns, so no other call ran in between.
pub(super) fn classify(
    e: &vfio_nic::Error,
    nothing_in_flight: bool,
    limits: Limits,
    before: &FaultyStats,
    after: &FaultyStats,
) -> Result<Cause, String> {
    use pfrag::Error as P;
    use vfio_nic::Error as V;
    let explained = match e {
        V::Pool(P::Map { .. }) => after.maps > before.maps,
        V::Pool(P::Unmap { .. }) => after.unmaps > before.unmaps,
        V::Pool(P::Flush { .. }) => after.flushes > before.flushes,
        V::Pool(P::MemoryLimit { .. }) if nothing_in_flight && limits.max != u64::MAX => {
            return Ok(Cause::MemoryLimit)
        }
        // More descriptors than the phase's whole ring: no retry could
        // succeed. (A full ring with nothing in flight is not a refusal:
        // it would be a bug, and stays unexplained.)
        V::PacketTooLarge { .. } => return Ok(Cause::Ring),
        V::TooManyBuffers { .. } => return Ok(Cause::Buffers),
        _ => false,
    };
    if explained {
        Ok(Cause::Injected)
    } else {
        Err(format!(
            "unexplained error (no injected failure caused it): {e}"
        ))
    }
}

/// A refusal's cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cause {
    Injected,
    MemoryLimit,
    Ring,
    Buffers,
}

impl Refusals {
    pub(super) fn count(&mut self, c: Cause) {
        match c {
            Cause::Injected => self.injected += 1,
            Cause::MemoryLimit => self.memory_limit += 1,
            Cause::Ring => self.ring += 1,
            Cause::Buffers => self.buffers += 1,
        }
    }
}
