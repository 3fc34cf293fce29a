//! The synchronisation primitives pfrag's shared state is built on, in one
//! place so that `--cfg loom` can swap in loom's models of them: atomics,
//! the mutex, and the lock-free chunk queue (crossbeam's `SegQueue`
//! normally; a loom mutex around a `VecDeque` under loom, which loom can
//! explore).
//!
//! Run the model tests with
//! `RUSTFLAGS="--cfg loom -C overflow-checks=on" cargo test -p pfrag --test loom --release`.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

/// Locks `m`. Every lock holder of pfrag updates its state completely (or
/// rolls it back) before anything that can fail or panic, so a poisoned
/// lock still guards consistent data: the one poison-tolerant lock helper.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Locks `m` if no one holds it now, else `None` (a lock held by this very
/// thread included, where [`lock`] would never return). Poison is
/// tolerated as in [`lock`].
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// [`lock`] for the std mutexes of state that loom does not model (the
/// IOMMU models); the same function when loom is off.
#[cfg(not(loom))]
pub(crate) use lock as lock_std;

/// [`lock`] for the std mutexes of state that loom does not model.
#[cfg(loom)]
pub(crate) fn lock_std<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A multi-producer, multi-consumer queue that never blocks a pop behind a
/// busy pusher.
#[cfg(not(loom))]
pub(crate) struct Queue<T>(crossbeam_queue::SegQueue<T>);

#[cfg(not(loom))]
impl<T> Queue<T> {
    pub(crate) fn new() -> Queue<T> {
        Queue(crossbeam_queue::SegQueue::new())
    }
    pub(crate) fn push(&self, v: T) {
        self.0.push(v)
    }
    pub(crate) fn pop(&self) -> Option<T> {
        self.0.pop()
    }
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Under loom: a modelled mutex around a deque.
#[cfg(loom)]
pub(crate) struct Queue<T>(loom::sync::Mutex<std::collections::VecDeque<T>>);

#[cfg(loom)]
impl<T> Queue<T> {
    pub(crate) fn new() -> Queue<T> {
        Queue(loom::sync::Mutex::new(std::collections::VecDeque::new()))
    }
    pub(crate) fn push(&self, v: T) {
        lock(&self.0).push_back(v)
    }
    pub(crate) fn pop(&self) -> Option<T> {
        lock(&self.0).pop_front()
    }
    pub(crate) fn len(&self) -> usize {
        lock(&self.0).len()
    }
    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.0).is_empty()
    }
}
