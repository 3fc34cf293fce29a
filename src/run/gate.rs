//! A barrier that can be aborted: the queue threads of a run wait on it
//! until every queue's thread exists, and leave without running if one
//! could not be created.

use std::sync::{Condvar, Mutex, PoisonError};

/// The barrier was aborted: the waiter must leave without running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Aborted;

/// A barrier of `n` parties: [`wait`](Self::wait) returns `Ok` once `n`
/// have called it, or `Err(Aborted)` once [`abort`](Self::abort) was
/// called (at once for a later `wait`).
#[derive(Debug)]
pub(crate) struct Gate {
    n: usize,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Debug)]
struct State {
    arrived: usize,
    aborted: bool,
}

impl Gate {
    /// A barrier that opens when `n` parties wait.
    pub(crate) fn new(n: usize) -> Gate {
        Gate {
            n,
            state: Mutex::new(State {
                arrived: 0,
                aborted: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Waits until `n` parties arrived (`Ok`) or the barrier is aborted.
    /// Once open, the barrier stays open.
    pub(crate) fn wait(&self) -> Result<(), Aborted> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.arrived += 1;
        if s.arrived >= self.n && !s.aborted {
            self.cv.notify_all();
        }
        loop {
            if s.aborted {
                return Err(Aborted);
            }
            if s.arrived >= self.n {
                return Ok(());
            }
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Releases every waiter, now and later, with `Err(Aborted)`.
    pub(crate) fn abort(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.aborted = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn opens_for_all_at_the_count() {
        let g = Gate::new(4);
        let passed = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    assert_eq!(g.wait(), Ok(()));
                    passed.fetch_add(1, Ordering::SeqCst);
                });
            }
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(passed.load(Ordering::SeqCst), 0, "opened before the count");
            assert_eq!(g.wait(), Ok(()));
        });
        assert_eq!(passed.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn abort_releases_the_waiters() {
        let g = Gate::new(4);
        std::thread::scope(|s| {
            let waiters: Vec<_> = (0..2).map(|_| s.spawn(|| g.wait())).collect();
            std::thread::sleep(Duration::from_millis(50));
            g.abort();
            for w in waiters {
                assert_eq!(w.join().unwrap(), Err(Aborted));
            }
        });
        // A late waiter leaves at once too.
        assert_eq!(g.wait(), Err(Aborted));
    }
}
