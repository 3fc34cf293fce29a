//! Turns of a phase's queue threads: each queue runs on its own thread,
//! but only while it holds the turn, and turns pass in a fixed order after
//! a fixed number of sends. The pool, the account and the mapper the
//! queues share then see the same calls in the same order in every run of
//! a seed, so a failing run replays (a shared random stream of injected
//! failures included).

use std::sync::{Condvar, Mutex, MutexGuard};

/// Sends a queue makes per turn.
pub(super) const SENDS_PER_TURN: u64 = 16;

/// Whose turn it is, and which queues have finished.
pub(super) struct Turns {
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    turn: usize,
    done: Vec<bool>,
}

impl Turns {
    /// Turns for `queues` queues; queue 0 goes first.
    pub(super) fn new(queues: usize) -> Turns {
        Turns {
            state: Mutex::new(State {
                turn: 0,
                done: vec![false; queues.max(1)],
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A queue thread that panicked leaves its seat (Seat's drop); the
        // state stays consistent, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes queue `q`'s seat and waits for its first turn. The seat is
    /// given up when the returned guard drops (on return, error or panic),
    /// so the other queues never wait for a queue that has ended.
    pub(super) fn sit(&self, q: usize) -> Seat<'_> {
        self.wait(q);
        Seat { turns: self, q }
    }

    fn wait(&self, q: usize) {
        let mut s = self.lock();
        while s.turn != q {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn hand_on(&self, s: &mut State, q: usize) {
        let n = s.done.len();
        if let Some(next) = (1..=n).map(|k| (q + k) % n).find(|&i| !s.done[i]) {
            s.turn = next;
        }
        self.changed.notify_all();
    }
}

/// A queue's place in the turns.
pub(super) struct Seat<'a> {
    turns: &'a Turns,
    q: usize,
}

impl Seat<'_> {
    /// The queue seated.
    pub(super) fn queue(&self) -> usize {
        self.q
    }

    /// Hands the turn to the next queue still running and waits for it to
    /// come back (at once if no other queue runs).
    pub(super) fn pass(&self) {
        {
            let mut s = self.turns.lock();
            self.turns.hand_on(&mut s, self.q);
        }
        self.turns.wait(self.q);
    }
}

impl Drop for Seat<'_> {
    fn drop(&mut self) {
        let mut s = self.turns.lock();
        s.done[self.q] = true;
        if s.turn == self.q {
            self.turns.hand_on(&mut s, self.q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two threads taking turns interleave their steps in one fixed order,
    /// and one that ends early lets the other run to its end.
    #[test]
    fn turns_alternate_in_a_fixed_order() {
        let turns = Turns::new(2);
        let log = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for (q, steps) in [(0usize, 3usize), (1, 1)] {
                let (turns, log) = (&turns, &log);
                s.spawn(move || {
                    let seat = turns.sit(q);
                    for i in 0..steps {
                        if i > 0 {
                            seat.pass();
                        }
                        log.lock().unwrap().push(q);
                    }
                });
            }
        });
        assert_eq!(*log.lock().unwrap(), vec![0, 1, 0, 0]);
    }
}
