//! Completions: reaping what the device reported, waiting for it, and
//! asking the device for reports. A format that defers reports
//! ([`Format::DEFERRED_REPORT`], the 82576's RS bit) is asked for one every
//! [`Config::report_every`](super::Config::report_every) packets and for
//! the last packet before each doorbell; the packets before a reported one
//! complete with it, in one burst of frees (as DPDK's ixgbe and i40e
//! drivers do with `tx_rs_thresh` and `tx_free_thresh`).

use std::time::{Duration, Instant};

use pfrag::dma::DmaMapper;
use pfrag::frag::Frag;

use super::{header, Backoff, Completion, Fmt, Queue, MAX_DESC_WORDS};
use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::format::{Format, RingMem, Status};

/// Where the queue is in its reports.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Reports {
    /// Packets posted since the last one that asked for a report.
    since: u16,
    /// The slot of the last descriptor of the last of them, if any: the
    /// doorbell makes it ask ([`Format::ask_report`]).
    last: Option<u16>,
}

impl Reports {
    /// Packets posted since the last one that asked for a report.
    #[inline(always)]
    pub(super) fn since(self) -> u16 {
        self.since
    }

    /// Whether a packet posted after `since` packets without a report
    /// asks the device to report its completion: every packet, unless the
    /// format defers reports (`F`); then every `every`-th
    /// ([`Config::report_every`](super::Config::report_every)).
    #[inline(always)]
    pub(super) fn due<F: Format>(since: u16, every: u16) -> bool {
        !F::DEFERRED_REPORT || since + 1 >= every
    }

    /// The packets since the last report once one more is posted, which
    /// asked for a report if `report`.
    #[inline(always)]
    pub(super) fn count(since: u16, report: bool) -> u16 {
        if report {
            0
        } else {
            since + 1
        }
    }

    /// The reports when the last packet posted ended in slot `idx`, `since`
    /// packets after the last report (if it asked for one, none).
    #[inline(always)]
    pub(super) fn at(since: u16, idx: u16) -> Reports {
        Reports {
            since,
            last: (since > 0).then_some(idx),
        }
    }
}

/// How a walk of the reports ([`Queue::reported`]) ended.
enum Walk {
    /// At a packet the device is not done with, or past the last report.
    Waiting,
    /// At a report that is not [`Status::Ok`], the last packet it
    /// completes: later reports may be done too.
    NotOk,
    /// At a report that could not be read.
    Failed(Error),
}

impl<M: DmaMapper, D: TxDevice> Queue<M, D> {
    /// Whether the next packet posted asks the device to report its
    /// completion ([`Reports::due`]).
    pub(super) fn report_next(&self) -> bool {
        Reports::due::<Fmt<D>>(self.reports.since, self.cfg.report_every)
    }

    /// Records the packet just posted, whose last descriptor sits in slot
    /// `idx` and asked for a report if `report`.
    #[inline(always)]
    pub(super) fn note_report(&mut self, idx: u16, report: bool) {
        self.reports = Reports::at(Reports::count(self.reports.since, report), idx);
    }

    /// Before a doorbell: the last packet posted asks for a report, so
    /// that everything handed to the device is reported. It was posted
    /// since the last doorbell, so the device has not read it yet.
    /// Returns where the reports were, for [`unreport`](Self::unreport).
    /// The descriptor is read back and written in place: a slot below the
    /// ring's size lies inside the ring, so neither access fails, and the
    /// request is all that changes.
    pub(super) fn report_last(&mut self) -> Result<Reports> {
        let before = self.reports;
        let Some(idx) = before.last else {
            return Ok(before);
        };
        let mut w = [0u64; MAX_DESC_WORDS];
        let w = &mut w[..Fmt::<D>::DESC_SIZE / 8];
        self.read_desc(idx, w)?;
        self.fmt.ask_report(w);
        self.write_desc(idx, w)?;
        self.pending.set_newest_report(true);
        self.reports = Reports::default();
        Ok(before)
    }

    /// The doorbell after [`report_last`](Self::report_last) failed: the
    /// reports are as they were before it. The descriptor keeps its
    /// request, which the device has not seen and which only makes it
    /// report sooner.
    pub(super) fn unreport(&mut self, before: Reports) {
        if before.last.is_some() {
            self.pending.set_newest_report(false);
        }
        self.reports = before;
    }

    /// Reaps until nothing is in flight. Fails with [`Error::Timeout`] if
    /// `timeout` passes without any packet completing (the device stopped:
    /// a blocked DMA, a disabled queue), instead of spinning forever. A
    /// device that says it stopped ([`TxDevice::check_running`]: a virtio
    /// device's `NEEDS_RESET`) fails it with its own error
    /// ([`Error::DeviceStopped`]) instead: the wait asks once spinning
    /// found nothing to reap (when it starts to sleep) and when it gives
    /// up, never while packets complete. [`reap`](Self::reap) never asks
    /// (it runs per packet); a device that stopped shows there as no
    /// progress.
    /// Returns how many completed. Like [`reap`](Self::reap) it drops the
    /// completed packets' tokens: a driver that needs them (at shutdown,
    /// before [`into_device`](Self::into_device)) calls
    /// [`wait_tokens`](Self::wait_tokens).
    pub fn wait(&mut self, timeout: Duration) -> Result<usize> {
        self.wait_with(timeout, |_| {})
    }

    /// [`wait`](Self::wait), appending each completed packet's token to
    /// `out`, oldest first, as [`reap_tokens`](Self::reap_tokens) does. On
    /// a timeout `out` still holds the tokens of every packet completed
    /// before it; the rest stay in flight and come back from a later reap.
    pub fn wait_tokens(&mut self, timeout: Duration, out: &mut Vec<u64>) -> Result<usize> {
        self.wait_with(timeout, |c| out.push(c.token))
    }

    fn wait_with(&mut self, timeout: Duration, mut each: impl FnMut(Completion)) -> Result<usize> {
        let mut done = 0;
        let mut since = Instant::now();
        let mut backoff = Backoff::default();
        while !self.pending.is_empty() {
            let n = self.reap_with(&mut each)?;
            if n > 0 {
                done += n;
                since = Instant::now();
                backoff.reset();
                continue;
            }
            if since.elapsed() >= timeout {
                self.dev_mut().check_running()?;
                return Err(Error::Timeout {
                    pending: self.pending.len(),
                    waited_ms: since.elapsed().as_millis() as u64,
                    head: self.dev_mut().head(),
                    tail: self.tail,
                });
            }
            backoff.pause();
            if backoff.first_sleep() {
                self.dev_mut().check_running()?;
            }
        }
        Ok(done)
    }

    /// Frees every packet the device reported done, oldest first: those
    /// whose last descriptor has `DD` set (or whose head is in the used
    /// ring), and, where the format defers reports, the packets before a
    /// reported one.
    /// Returns how many completed (their tokens are dropped; see
    /// [`reap_tokens`](Self::reap_tokens)).
    ///
    /// An error reading a report ([`Format::done`]) before any packet
    /// completed in the call is returned, and nothing changed. One after
    /// some completed ends the call with their count, each of them freed,
    /// counted ([`Stats::completed`](super::Stats::completed)) and handed
    /// over; the next reap reads that report again (and returns the error
    /// if it persists). [`reap_tokens`](Self::reap_tokens) and
    /// [`reap_completions`](Self::reap_completions) do the same;
    /// [`wait`](Self::wait) reaps on, and returns the error once it comes
    /// before any packet completed.
    pub fn reap(&mut self) -> Result<usize> {
        self.reap_with(|_| {})
    }

    /// [`reap`](Self::reap), appending each completed packet's token to
    /// `out`, oldest first: how the caller learns what finished (the role
    /// of an skb destructor or a DPDK free callback).
    pub fn reap_tokens(&mut self, out: &mut Vec<u64>) -> Result<usize> {
        self.reap_with(|c| out.push(c.token))
    }

    /// [`reap`](Self::reap), appending each completed packet's token and
    /// the device's verdict on it ([`Status`]) to `out`, oldest first.
    /// Packets with [`Status::Error`] are counted in
    /// [`Stats::device_errors`](super::Stats::device_errors) too.
    pub fn reap_completions(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        self.reap_with(|c| out.push(c))
    }

    fn reap_with(&mut self, mut done: impl FnMut(Completion)) -> Result<usize> {
        let mut n = 0;
        loop {
            let (k, status, walk) = self.reported();
            if k > 0 {
                self.free_first(k, status, &mut done);
                n += k;
            }
            match walk {
                Walk::NotOk => {}
                Walk::Waiting => break,
                // Packets already freed (their tokens handed over) are
                // counted and their number returned; the packet whose
                // status could not be read is asked about again next call.
                Walk::Failed(_) if n > 0 => break,
                Walk::Failed(e) => return Err(e),
            }
        }
        self.stats.completed += n as u64;
        Ok(n)
    }

    /// Walks the packets that asked for a report, oldest first, while the
    /// device reports them done with [`Status::Ok`] (every packet asks
    /// where the format does not defer reports; where it does, the packets
    /// before a reported one complete with it, in order). Returns how many
    /// of the oldest packets complete, the status of the last of them, and
    /// how the walk ended; the caller frees them all at once. A report
    /// that is not OK ends the walk, the last of its packets, and is
    /// counted in [`Stats::device_errors`](super::Stats::device_errors).
    fn reported(&mut self) -> (usize, Status, Walk) {
        let ring = RingMem::new(&self.ring, self.cfg.ring);
        let mut k = 0;
        let mut j = 0;
        while let Some((older, s)) = self.pending.report(j) {
            match self.fmt.done(&ring, s.head(), s.last()) {
                Ok(Some(Status::Ok)) => k = older + 1,
                Ok(Some(status)) => {
                    self.stats.device_errors += 1;
                    return (older + 1, status, Walk::NotOk);
                }
                Ok(None) => break,
                Err(e) => return (k, Status::Ok, Walk::Failed(e)),
            }
            j += 1;
        }
        (k, Status::Ok, Walk::Waiting)
    }

    /// Frees the `k` oldest packets, the last of which the device reported
    /// with `status` (the others complete as [`Status::Ok`]): their
    /// descriptors, headers and frags, the frags in one burst.
    fn free_first(&mut self, k: usize, status: Status, done: &mut impl FnMut(Completion)) {
        if self.pending.holds_no_frags() {
            return self.free_first_plain(k, status, done);
        }
        let mut burst = self.spare.pop().unwrap_or_default();
        for i in 0..k {
            let Some(mut p) = self.pending.pop() else {
                break;
            };
            self.used -= usize::from(p.span().ndesc());
            if let Some(mut frags) = p.take_frags() {
                burst.append(&mut frags);
                self.spare.push(frags);
            }
            let (bounce, cache, stats) = (&mut self.bounce, &mut self.hdr_cache, &mut self.stats);
            header::release_header(p.take_header(), bounce, cache, stats);
            done(Completion {
                token: p.token(),
                status: if i + 1 == k { status } else { Status::Ok },
            });
        }
        if !burst.is_empty() {
            self.complete_frags(burst.drain(..));
        }
        self.spare.push(burst);
    }

    /// [`free_first`](Self::free_first) of packets that hold no frag: a
    /// bounce slot each, given back.
    #[inline(always)]
    fn free_first_plain(&mut self, k: usize, status: Status, done: &mut impl FnMut(Completion)) {
        let bounce = &mut self.bounce;
        let (mut i, mut descs) = (0, 0);
        self.pending.pop_plain(k, |span, slot, token| {
            descs += usize::from(span.ndesc());
            if let Some(b) = bounce.as_mut() {
                // The slot the queue filled for this packet: in range.
                let r = b.release(slot);
                debug_assert!(r.is_ok(), "{r:?}");
            }
            i += 1;
            done(Completion {
                token,
                status: if i == k { status } else { Status::Ok },
            });
        });
        self.used -= descs;
    }

    /// Completes payload frags the queue is done with (reaped) in one
    /// burst, on the queue's own thread (frags of the chunk the cache is
    /// carving need no atomic operation),
    /// counting each frag whose unmap failed in
    /// [`Stats::unmap_errors`](super::Stats::unmap_errors) (the pool keeps
    /// that memory out of use).
    pub(super) fn complete_frags(&mut self, frags: impl IntoIterator<Item = Frag<M>>) {
        let failed = self.cache.complete_burst_counting(frags);
        self.stats.unmap_errors += failed as u64;
    }
}
