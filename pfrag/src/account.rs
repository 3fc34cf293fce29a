//! Process-wide accounting of pool memory, with `tcp_mem`-style limits.
//!
//! A [`MemAccount`] is shared by every pool of a process that should count
//! against the same limits (pass it to [`Pool::with_account`]). It is charged
//! when a pool grows and uncharged when a pool gives memory back to the OS.
//!
//! - Above `pressure` bytes the account enters *memory pressure*; it leaves
//!   it only when usage falls below `min` (the gap is hysteresis, as in
//!   `tcp_mem`). Queues under pressure return their reserves to the shared
//!   pool and pools give free memory back to the OS.
//! - Growth past `max` fails with [`Error::MemoryLimit`]; nothing is mapped
//!   or allocated for it.
//! - A pool [`reserve`](MemAccount::reserve)s a grow's bytes before it
//!   allocates and maps them, and [`commit`](MemAccount::commit)s them once
//!   it has. Reserved bytes count against `max` at once, but the peak and
//!   pressure follow only committed ones, whoever's charge or uncharge
//!   moves them: a grow that fails [`cancel`](MemAccount::cancel)s its
//!   reservation and leaves the account as it was.
//!
//! The hot path reads the pressure state with one relaxed load of an
//! `AtomicBool`. The user's [`PressureHooks`] run only on transitions, once
//! per transition (a compare-and-swap decides which thread runs them), and
//! are called statically: `MemAccount<H>` knows `H`.
//!
//! ```
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use pfrag::account::{Limits, MemAccount, PressureHooks};
//!
//! #[derive(Default)]
//! struct Log { entered: AtomicU32, left: AtomicU32 }
//! impl PressureHooks for Log {
//!     fn enter(&self, _bytes: u64) { self.entered.fetch_add(1, Ordering::Relaxed); }
//!     fn leave(&self, _bytes: u64) { self.left.fetch_add(1, Ordering::Relaxed); }
//! }
//!
//! let acct = MemAccount::new(Limits { min: 4 << 20, pressure: 8 << 20, max: 16 << 20 }, Log::default())?;
//! acct.charge(10 << 20)?;            // past `pressure`: enter
//! assert!(acct.under_pressure());
//! acct.uncharge(5 << 20);            // 5 MiB: still above `min`
//! assert!(acct.under_pressure());
//! acct.uncharge(2 << 20);            // 3 MiB: below `min`: leave
//! assert!(!acct.under_pressure());
//! assert!(acct.charge(14 << 20).is_err()); // past `max`
//! assert_eq!(acct.hooks().entered.load(Ordering::Relaxed), 1);
//! assert_eq!(acct.hooks().left.load(Ordering::Relaxed), 1);
//! # Ok::<(), pfrag::Error>(())
//! ```
//!
//! [`Pool::with_account`]: crate::pool::Pool::with_account

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::sync::lock_std;

/// Byte limits, like the three numbers of `tcp_mem`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Pressure ends when usage falls below this.
    pub min: u64,
    /// Pressure starts when usage rises above this.
    pub pressure: u64,
    /// Growth past this fails.
    pub max: u64,
}

impl Limits {
    /// No limits at all.
    pub const UNLIMITED: Limits = Limits {
        min: u64::MAX,
        pressure: u64::MAX,
        max: u64::MAX,
    };
}

/// Called when the account enters or leaves memory pressure, with the bytes
/// in use at that moment. Runs once per transition, on the thread whose
/// charge or uncharge caused it; never per packet.
///
/// A pool's grow or shrink may be the cause. A pool runs the hooks with
/// none of its locks held, so a hook may trim pools
/// ([`Pool::trim`](crate::pool::Pool::trim)), drop frags, and take memory,
/// from the very pool whose grow or shrink ran it included.
pub trait PressureHooks: Send + Sync + 'static {
    /// Usage rose above `pressure`.
    fn enter(&self, _bytes: u64) {}
    /// Usage fell below `min`.
    fn leave(&self, _bytes: u64) {}
}

/// Hooks that do nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHooks;

impl PressureHooks for NoHooks {}

/// Hooks that count their calls (for tests and measurements).
#[derive(Debug, Default)]
pub struct CountHooks {
    /// `enter` calls.
    pub enter: AtomicU64,
    /// `leave` calls.
    pub leave: AtomicU64,
}

impl CountHooks {
    /// `enter` plus `leave` calls so far.
    pub fn calls(&self) -> u64 {
        self.enter.load(Ordering::Relaxed) + self.leave.load(Ordering::Relaxed)
    }
}

impl PressureHooks for CountHooks {
    fn enter(&self, _bytes: u64) {
        self.enter.fetch_add(1, Ordering::Relaxed);
    }
    fn leave(&self, _bytes: u64) {
        self.leave.fetch_add(1, Ordering::Relaxed);
    }
}

/// What a pool needs of an account: charge and uncharge on its cold paths
/// (grow and shrink, a batch at a time), and the pressure flag for its hot
/// path.
pub trait Charge: Send + Sync {
    /// Adds `bytes` to the usage, or fails past `max`.
    fn charge(&self, bytes: u64) -> Result<()>;
    /// Removes `bytes` from the usage.
    fn uncharge(&self, bytes: u64);
    /// The flag read on the hot path.
    fn pressure_flag(&self) -> Arc<AtomicBool>;
    /// Records that `bytes` of charged memory were pinned for good (a
    /// failed unmap): they stay charged, and are reported apart.
    fn pin(&self, bytes: u64);
    /// Charges `bytes` for a grow that may still fail: counted against
    /// `max` at once, so that `max` holds for every charge meanwhile, but
    /// not in the usage that the peak and pressure follow (no hook runs)
    /// until [`commit`](Self::commit). A grow that fails gives them back
    /// with [`cancel`](Self::cancel), leaving the account as it was. By
    /// default a plain [`charge`](Self::charge).
    fn reserve(&self, bytes: u64) -> Result<()> {
        self.charge(bytes)
    }
    /// The grow that reserved `bytes` succeeded (or pinned its memory for
    /// good): they count as charged now, in the usage and the peak. A hook
    /// that this brings about runs at the [`settle`](Self::settle) that
    /// follows, not here. By default nothing.
    fn commit(&self, bytes: u64) {
        let _ = bytes;
    }
    /// Brings pressure in line with the usage after a
    /// [`commit`](Self::commit), running a hook for a transition. The pool
    /// calls it once its grow holds no lock, so that a hook may take
    /// memory from the very pool that grew. By default nothing.
    fn settle(&self) {}
    /// The grow that reserved `bytes` failed: they are given back as if
    /// never charged. By default [`uncharge`](Self::uncharge).
    fn cancel(&self, bytes: u64) {
        self.uncharge(bytes)
    }
}

/// Counters of an account.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AccountStats {
    /// Bytes in use now (committed, and reserved by grows under way).
    pub bytes: u64,
    /// Of `bytes`, those reserved by grows under way: not yet in the usage
    /// that the peak and pressure follow.
    pub reserved: u64,
    /// Largest usage seen.
    pub peak: u64,
    /// Times pressure was entered.
    pub entered: u64,
    /// Times pressure was left.
    pub left: u64,
    /// Charges refused at `max`.
    pub refused: u64,
    /// Charged bytes pinned for good after failed unmaps (part of `bytes`).
    pub pinned: u64,
    /// Bytes uncharged past what was charged (a caller's bookkeeping
    /// error; the usage stops at zero instead of wrapping).
    pub over_uncharged: u64,
}

/// Memory shared by pools, with limits and pressure hooks `H`.
#[derive(Debug)]
pub struct MemAccount<H: PressureHooks = NoHooks> {
    limits: Limits,
    /// Bytes charged and reserved, changed together (the cold paths of
    /// grow and shrink only).
    usage: Mutex<Usage>,
    /// Charged bytes pinned for good.
    pinned: AtomicU64,
    peak: AtomicU64,
    pressure: Arc<AtomicBool>,
    entered: AtomicU64,
    left: AtomicU64,
    refused: AtomicU64,
    over_uncharged: AtomicU64,
    hooks: H,
}

impl<H: PressureHooks> MemAccount<H> {
    /// An account with `limits` (`min <= pressure <= max`) and `hooks`.
    pub fn new(limits: Limits, hooks: H) -> Result<Arc<MemAccount<H>>> {
        if limits.min > limits.pressure || limits.pressure > limits.max {
            return Err(Error::BadConfig {
                what: "limits (min <= pressure <= max)",
                value: limits.pressure,
            });
        }
        Ok(Arc::new(MemAccount {
            limits,
            usage: Mutex::new(Usage::default()),
            pinned: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            pressure: Arc::new(AtomicBool::new(false)),
            entered: AtomicU64::new(0),
            left: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            over_uncharged: AtomicU64::new(0),
            hooks,
        }))
    }

    /// The limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The hooks.
    pub fn hooks(&self) -> &H {
        &self.hooks
    }

    /// Whether the account is under memory pressure (one relaxed load).
    #[inline]
    pub fn under_pressure(&self) -> bool {
        self.pressure.load(Ordering::Relaxed)
    }

    /// Bytes charged now (reserved ones included).
    pub fn bytes(&self) -> u64 {
        lock_std(&self.usage).bytes
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> AccountStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let u = *lock_std(&self.usage);
        AccountStats {
            bytes: u.bytes,
            reserved: u.reserved,
            peak: l(&self.peak),
            entered: l(&self.entered),
            left: l(&self.left),
            refused: l(&self.refused),
            pinned: l(&self.pinned),
            over_uncharged: l(&self.over_uncharged),
        }
    }

    /// Adds `bytes`, entering pressure if usage passes `pressure`; fails
    /// with [`Error::MemoryLimit`] (and changes nothing) past `max`, or
    /// past `u64::MAX` (even without a limit).
    pub fn charge(&self, bytes: u64) -> Result<()> {
        self.reserve(bytes)?;
        self.commit(bytes);
        Ok(())
    }

    /// [`charge`](Self::charge) without its effect on the peak and on
    /// pressure, which wait for [`commit`](Self::commit): for a grow that
    /// may still fail and [`cancel`](Self::cancel) them, after which the
    /// account is as it was. Other charges meanwhile count the reserved
    /// bytes against `max`, and nothing else: their peak and pressure
    /// leave them out.
    pub fn reserve(&self, bytes: u64) -> Result<()> {
        let mut u = lock_std(&self.usage);
        let Some(new) = u.bytes.checked_add(bytes).filter(|&n| n <= self.limits.max) else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Error::MemoryLimit {
                allocated: u.bytes,
                requested: bytes,
                max: self.limits.max,
            });
        };
        u.bytes = new;
        u.reserved += bytes;
        Ok(())
    }

    /// Makes the `bytes` [`reserve`](Self::reserve)d count as charged:
    /// the peak and pressure follow them now.
    pub fn commit(&self, bytes: u64) {
        self.commit_usage(bytes);
        self.settle();
    }

    /// [`commit`](Self::commit)'s change of the usage and the peak, with
    /// no hook run yet.
    fn commit_usage(&self, bytes: u64) {
        let committed = {
            let mut u = lock_std(&self.usage);
            u.reserved = u.reserved.saturating_sub(bytes);
            u.committed()
        };
        self.peak.fetch_max(committed, Ordering::Relaxed);
    }

    /// Gives back the `bytes` [`reserve`](Self::reserve)d by a grow that
    /// failed: the account is as it was before the reservation.
    pub fn cancel(&self, bytes: u64) {
        let mut u = lock_std(&self.usage);
        u.reserved = u.reserved.saturating_sub(bytes);
        u.bytes = u.bytes.saturating_sub(bytes);
    }

    /// Brings the pressure flag in line with the usage. Each transition is
    /// made by exactly one compare-and-swap, whose winner runs the hook;
    /// the loop re-reads the usage afterwards, so that a charge and an
    /// uncharge racing across both limits cannot leave the flag stale.
    fn settle(&self) {
        loop {
            let bytes = lock_std(&self.usage).committed();
            let on = self.pressure.load(Ordering::Acquire);
            let want = if on {
                bytes >= self.limits.min
            } else {
                bytes > self.limits.pressure
            };
            if want == on {
                return;
            }
            if self
                .pressure
                .compare_exchange(on, want, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                if want {
                    self.entered.fetch_add(1, Ordering::Relaxed);
                    self.hooks.enter(bytes);
                } else {
                    self.left.fetch_add(1, Ordering::Relaxed);
                    self.hooks.leave(bytes);
                }
            }
        }
    }

    /// Removes `bytes`, leaving pressure if usage falls below `min`.
    ///
    /// Usage saturates at zero: uncharging more than is charged (a
    /// caller's bookkeeping error) leaves 0, never a wrapped count that
    /// would refuse every later charge, and the excess is counted in
    /// [`AccountStats::over_uncharged`].
    pub fn uncharge(&self, bytes: u64) {
        let old = {
            let mut u = lock_std(&self.usage);
            let old = u.bytes - u.reserved;
            u.bytes -= old.min(bytes);
            old
        };
        if old < bytes {
            self.over_uncharged
                .fetch_add(bytes - old, Ordering::Relaxed);
        }
        self.settle();
    }
}

impl<H: PressureHooks> Charge for MemAccount<H> {
    fn charge(&self, bytes: u64) -> Result<()> {
        MemAccount::charge(self, bytes)
    }
    fn uncharge(&self, bytes: u64) {
        MemAccount::uncharge(self, bytes)
    }
    fn pressure_flag(&self) -> Arc<AtomicBool> {
        self.pressure.clone()
    }
    fn pin(&self, bytes: u64) {
        self.pinned.fetch_add(bytes, Ordering::Relaxed);
    }
    fn reserve(&self, bytes: u64) -> Result<()> {
        MemAccount::reserve(self, bytes)
    }
    fn commit(&self, bytes: u64) {
        self.commit_usage(bytes)
    }
    fn settle(&self) {
        MemAccount::settle(self)
    }
    fn cancel(&self, bytes: u64) {
        MemAccount::cancel(self, bytes)
    }
}

/// An account's bytes: charged (reserved included), and reserved.
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    bytes: u64,
    reserved: u64,
}

impl Usage {
    /// The usage the peak and pressure follow.
    fn committed(self) -> u64 {
        self.bytes - self.reserved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_limits_are_refused() {
        let l = Limits {
            min: 10,
            pressure: 5,
            max: 20,
        };
        assert!(matches!(
            MemAccount::new(l, NoHooks),
            Err(Error::BadConfig { .. })
        ));
    }

    /// Many threads charging and uncharging across both limits: every
    /// transition runs exactly one hook, and enters and leaves alternate.
    #[test]
    fn concurrent_transitions_run_one_hook_each() {
        let a = MemAccount::new(
            Limits {
                min: 100,
                pressure: 200,
                max: 1000,
            },
            CountHooks::default(),
        )
        .unwrap();
        std::thread::scope(|s| {
            for _ in 0..4 {
                let a = &a;
                s.spawn(move || {
                    for _ in 0..if cfg!(miri) { 50 } else { 2000 } {
                        a.charge(60).unwrap();
                        a.uncharge(60);
                    }
                });
            }
        });
        assert_eq!(a.bytes(), 0);
        let st = a.stats();
        assert_eq!(a.hooks().enter.load(Ordering::Relaxed), st.entered);
        assert_eq!(a.hooks().leave.load(Ordering::Relaxed), st.left);
        // Ends at 0 < min: every enter was followed by its leave.
        assert_eq!(st.entered, st.left);
        assert!(!a.under_pressure());
    }

    /// A reservation counts against `max` at once but moves neither the
    /// peak nor pressure until it is committed; cancelled, it leaves the
    /// account as it was; and an uncharge cannot take reserved bytes.
    #[test]
    fn a_reservation_waits_for_its_commit() {
        let l = Limits {
            min: 10,
            pressure: 100,
            max: 200,
        };
        let a = MemAccount::new(l, CountHooks::default()).unwrap();
        a.charge(50).unwrap();
        let before = a.stats();
        a.reserve(100).unwrap();
        assert!(!a.under_pressure());
        assert_eq!((a.bytes(), a.stats().peak), (150, 50));
        assert!(a.reserve(51).is_err(), "past max with the reservation");
        a.uncharge(60);
        assert_eq!((a.bytes(), a.stats().over_uncharged), (100, 10));
        a.charge(10).unwrap();
        a.cancel(100);
        let refused = AccountStats {
            bytes: 10,
            refused: 1,
            over_uncharged: 10,
            ..before
        };
        assert_eq!(a.stats(), refused, "as the charges alone left it");
        assert_eq!(a.hooks().calls(), 0);
        a.reserve(100).unwrap();
        a.commit(100);
        assert!(a.under_pressure());
        assert_eq!((a.stats().peak, a.stats().entered), (110, 1));
    }

    /// Uncharging more than is charged leaves the usage at zero (it used
    /// to panic in debug builds and wrap to about 2^64 in release, after
    /// which every charge was refused) and counts the excess.
    #[test]
    fn uncharge_past_zero_saturates_and_is_counted() {
        let a = MemAccount::new(Limits::UNLIMITED, NoHooks).unwrap();
        a.uncharge(1);
        assert_eq!(a.bytes(), 0);
        a.charge(10).unwrap();
        a.uncharge(25);
        assert_eq!(a.bytes(), 0);
        assert_eq!(a.stats().over_uncharged, 16);
        // Still usable: the next charge goes through.
        a.charge(4096).unwrap();
        assert_eq!(a.bytes(), 4096);
    }

    /// A charge whose total would pass `u64::MAX` is refused, even without
    /// a limit (it used to saturate the usage at `u64::MAX` and succeed,
    /// so the charges it counted were no longer the charges made).
    #[test]
    fn charge_past_u64_max_is_refused() {
        let a = MemAccount::new(Limits::UNLIMITED, NoHooks).unwrap();
        a.charge(1).unwrap();
        match a.charge(u64::MAX) {
            Err(Error::MemoryLimit {
                allocated: 1,
                requested: u64::MAX,
                max: u64::MAX,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!((a.bytes(), a.stats().refused), (1, 1));
        a.uncharge(1);
        assert_eq!(a.stats().over_uncharged, 0);
    }
}
