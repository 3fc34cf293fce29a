//! The packets in flight, oldest first: a queue of fixed capacity (the
//! ring's size; every packet takes at least one descriptor) kept in
//! arrays indexed by the packet's position: one of the fields every
//! packet has (its span, token and bounce slot), and one each for the
//! frags a packet may hold.
//!
//! Posting a packet stores each field in place, one by one. A queue of
//! whole structs (`VecDeque<Pending>`, as before) had the compiler put the
//! struct together on the stack, with narrow stores for its small fields,
//! and copy it into the queue with wide loads that those stores could not
//! forward: a store-forwarding stall on every packet, about a tenth of the
//! 64-byte send loop's time in `perf record` (`docs/benchmarks.md`). The
//! fields every packet has share one array so that a push or a pop checks
//! one bound for them, not one per field.

use pfrag::dma::DmaMapper;
use pfrag::frag::Frag;

use super::Hdr;

/// Where a packet sits in the ring: its first descriptor (its head, in a
/// used ring), its last (the one that may ask for a report), how many it
/// takes, and whether its last asks the device for a report. Packed in one
/// word, so that it is stored with one move.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Span(u64);

const LAST_SHIFT: u32 = 16;
const NDESC_SHIFT: u32 = 32;
const REPORT_BIT: u64 = 1 << 48;

impl Span {
    #[inline(always)]
    pub(super) fn new(head: u16, last: u16, ndesc: u16, report: bool) -> Span {
        let report = if report { REPORT_BIT } else { 0 };
        Span(
            u64::from(head)
                | u64::from(last) << LAST_SHIFT
                | u64::from(ndesc) << NDESC_SHIFT
                | report,
        )
    }
    #[inline(always)]
    pub(super) fn head(self) -> u16 {
        self.0 as u16
    }
    #[inline(always)]
    pub(super) fn last(self) -> u16 {
        (self.0 >> LAST_SHIFT) as u16
    }
    #[inline(always)]
    pub(super) fn ndesc(self) -> u16 {
        (self.0 >> NDESC_SHIFT) as u16
    }
    /// Whether the packet's last descriptor asks the device for a report:
    /// every packet's does, unless the format defers reports
    /// ([`Format::DEFERRED_REPORT`](crate::format::Format::DEFERRED_REPORT)).
    #[inline(always)]
    pub(super) fn report(self) -> bool {
        self.0 & REPORT_BIT != 0
    }
    pub(super) fn set_report(&mut self, report: bool) {
        if report {
            self.0 |= REPORT_BIT;
        } else {
            self.0 &= !REPORT_BIT;
        }
    }
}

/// The fields of a packet in flight that every packet has, side by side:
/// written field by field (never put together on the stack first), and
/// reached with one bounds check.
#[derive(Clone, Copy, Debug, Default)]
struct Rec {
    span: Span,
    token: u64,
    /// A header in a bounce slot: the slot ([`Hdr::Slot`]), read when
    /// `hdr_frag` is `None`.
    slot: usize,
}

/// The packets in flight; see the module docs.
pub(super) struct InFlight<M: DmaMapper> {
    rec: Box<[Rec]>,
    /// A header in a frag of its own ([`Hdr::Frag`]). The two arrays
    /// stand for a `Hdr`, which would be put together on the stack and
    /// copied in, as the structs were.
    hdr_frag: Box<[Option<Frag<M>>]>,
    frags: Box<[Option<Vec<Frag<M>>>]>,
    /// Position of the oldest packet.
    first: usize,
    len: usize,
    /// The positions of the packets that ask for a report, oldest first,
    /// in a ring of the same capacity: each is found without a scan
    /// ([`report`](Self::report)).
    reports: Box<[u32]>,
    /// Where the oldest of them sits in `reports`.
    rfirst: usize,
    /// How many there are.
    rlen: usize,
    /// How many packets hold a header frag or payload frags: none, and a
    /// reap frees its packets without looking for any
    /// ([`pop_plain`](Self::pop_plain)).
    holding: usize,
}

impl<M: DmaMapper> InFlight<M> {
    /// Room for `cap` packets: a ring of `cap` descriptors never holds
    /// more.
    pub(super) fn new(cap: usize) -> InFlight<M> {
        InFlight {
            rec: vec![Rec::default(); cap].into_boxed_slice(),
            hdr_frag: std::iter::repeat_with(|| None).take(cap).collect(),
            frags: std::iter::repeat_with(|| None).take(cap).collect(),
            first: 0,
            len: 0,
            reports: vec![0; cap].into_boxed_slice(),
            rfirst: 0,
            rlen: 0,
            holding: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The array position of the `k`-th oldest packet.
    #[inline(always)]
    fn at(&self, k: usize) -> usize {
        self.wrap(self.first + k)
    }

    /// `i` (below twice the capacity) brought inside the arrays.
    #[inline(always)]
    fn wrap(&self, i: usize) -> usize {
        let cap = self.rec.len();
        if i >= cap {
            i - cap
        } else {
            i
        }
    }

    /// Records that the packet at position `i`, the newest, asks for a
    /// report.
    #[inline(always)]
    fn add_report(&mut self, i: usize) {
        let r = self.wrap(self.rfirst + self.rlen);
        // Positions are below the capacity, itself a ring's size (at most
        // 65,536).
        self.reports[r] = i as u32;
        self.rlen += 1;
    }

    /// Appends a packet, the newest.
    ///
    /// # Panics
    /// If the queue is full, which a queue never is: it posts a packet
    /// only after its room check, which keeps the descriptors in use at
    /// most one fewer than the ring's size (the capacity here), and every
    /// packet takes at least one. Were it ever full, failing loudly beats
    /// writing over the oldest packet, whose frags the device may still
    /// read.
    #[inline(always)]
    pub(super) fn push(
        &mut self,
        span: Span,
        hdr: Hdr<M>,
        frags: Option<Vec<Frag<M>>>,
        token: u64,
    ) {
        assert!(
            self.len < self.rec.len(),
            "more packets in flight than the ring has descriptors"
        );
        let i = self.at(self.len);
        let rec = &mut self.rec[i];
        rec.span = span;
        rec.token = token;
        // A vacant position holds no frags (a [`Popped`] leaves `None`),
        // so only frags are written, never a `None`: that write would put
        // the option together on the stack and copy it in.
        let holds = matches!(hdr, Hdr::Frag(_)) || frags.is_some();
        match hdr {
            Hdr::Slot(s) => rec.slot = s,
            Hdr::Frag(f) => self.hdr_frag[i] = Some(f),
        }
        if frags.is_some() {
            self.frags[i] = frags;
        }
        self.holding += usize::from(holds);
        if span.report() {
            self.add_report(i);
        }
        self.len += 1;
    }

    /// Takes the oldest packet out of the queue: its fields come out one
    /// by one from the [`Popped`] (rather than as one struct, for the
    /// reason in the module docs), and what the caller leaves in it is
    /// dropped with it.
    #[inline(always)]
    pub(super) fn pop(&mut self) -> Option<Popped<'_, M>> {
        if self.len == 0 {
            return None;
        }
        let at = self.take_oldest();
        if self.hdr_frag[at].is_some() || self.frags[at].is_some() {
            self.holding -= 1;
        }
        Some(Popped { q: self, at })
    }

    /// Moves the queue past its oldest packet (there is one), with its
    /// report if it asked for one; returns the packet's position, whose
    /// fields the caller takes.
    #[inline(always)]
    fn take_oldest(&mut self) -> usize {
        let at = self.first;
        self.first = self.at(1);
        self.len -= 1;
        self.drop_report(at);
        at
    }

    /// Forgets the oldest report if it is the packet at position `at`,
    /// just taken out (every report's packet is in the queue, so the
    /// oldest report is at or after the oldest packet).
    #[inline(always)]
    fn drop_report(&mut self, at: usize) {
        if self.rlen > 0 && self.reports[self.rfirst] as usize == at {
            self.rfirst = self.wrap(self.rfirst + 1);
            self.rlen -= 1;
        }
    }

    /// Whether no packet in the queue holds a header frag or payload
    /// frags: every header is in a bounce slot, and every payload inline.
    #[inline(always)]
    pub(super) fn holds_no_frags(&self) -> bool {
        self.holding == 0
    }

    /// Takes the `k` oldest packets out (all, if there are fewer), oldest
    /// first, handing `each` the span, bounce slot and token of each: what
    /// [`pop`](Self::pop) gives, for a queue that
    /// [`holds_no_frags`](Self::holds_no_frags). They sit in at most two
    /// runs of the array (the second from its start, past the wrap), each
    /// walked in one loop; the queue and its reports move once after.
    ///
    /// # Panics
    /// If a packet holds a frag, which the caller checked it does not:
    /// failing loudly beats leaking the frag.
    #[inline(always)]
    pub(super) fn pop_plain(&mut self, k: usize, mut each: impl FnMut(Span, usize, u64)) {
        assert!(self.holding == 0, "a plain pop of packets that hold frags");
        let k = k.min(self.len);
        let cap = self.rec.len();
        let end = self.first + k;
        let (run, wrapped) = if end > cap {
            (self.first..cap, 0..end - cap)
        } else {
            (self.first..end, 0..0)
        };
        let mut reports = 0;
        for r in self.rec[run].iter().chain(&self.rec[wrapped]) {
            reports += usize::from(r.span.report());
            each(r.span, r.slot, r.token);
        }
        self.first = self.wrap(end);
        self.len -= k;
        // The reports of the packets taken are the oldest ones (every
        // report's packet is in the queue, in the order of the packets).
        self.rfirst = self.wrap(self.rfirst + reports);
        self.rlen -= reports;
    }

    /// Drops the frags left at position `at`.
    #[cold]
    #[inline(never)]
    fn drop_left(&mut self, at: usize) {
        self.hdr_frag[at] = None;
        self.frags[at] = None;
    }

    /// Where the `k`-th oldest packet sits, if there are that many.
    #[cfg(test)]
    fn span(&self, k: usize) -> Option<Span> {
        (k < self.len).then(|| self.rec[self.at(k)].span)
    }

    /// Sets whether the newest packet asks for a report (nothing if the
    /// queue is empty).
    pub(super) fn set_newest_report(&mut self, report: bool) {
        let Some(k) = self.len.checked_sub(1) else {
            return;
        };
        let i = self.at(k);
        match (self.rec[i].span.report(), report) {
            (false, true) => self.add_report(i),
            // The newest packet's report is the newest report.
            (true, false) => self.rlen -= 1,
            _ => {}
        }
        self.rec[i].span.set_report(report);
    }

    /// The `j`-th oldest packet that asked for a report (0: the oldest),
    /// if that many did: how many packets are older, and where it sits.
    #[inline(always)]
    pub(super) fn report(&self, j: usize) -> Option<(usize, Span)> {
        if j >= self.rlen {
            return None;
        }
        let i = self.reports[self.wrap(self.rfirst + j)] as usize;
        let cap = self.rec.len();
        let k = if i >= self.first {
            i - self.first
        } else {
            i + cap - self.first
        };
        Some((k, self.rec[i].span))
    }
}

/// The oldest packet, just taken out of [`InFlight`]; see
/// [`InFlight::pop`].
pub(super) struct Popped<'a, M: DmaMapper> {
    q: &'a mut InFlight<M>,
    at: usize,
}

impl<M: DmaMapper> Popped<'_, M> {
    #[inline(always)]
    pub(super) fn span(&self) -> Span {
        self.q.rec[self.at].span
    }

    #[inline(always)]
    pub(super) fn token(&self) -> u64 {
        self.q.rec[self.at].token
    }

    /// Its header, taken out.
    #[inline(always)]
    pub(super) fn take_header(&mut self) -> Hdr<M> {
        // Only a header frag is taken (and its place written): the common
        // bounce slot costs one read of the option's tag.
        let f = &mut self.q.hdr_frag[self.at];
        if f.is_some() {
            if let Some(f) = f.take() {
                return Hdr::Frag(f);
            }
        }
        Hdr::Slot(self.q.rec[self.at].slot)
    }

    /// Its payload frags, taken out.
    #[inline(always)]
    pub(super) fn take_frags(&mut self) -> Option<Vec<Frag<M>>> {
        let f = &mut self.q.frags[self.at];
        if f.is_some() {
            f.take()
        } else {
            None
        }
    }
}

impl<M: DmaMapper> Drop for Popped<'_, M> {
    /// Drops what the caller did not take, so that the position is vacant
    /// (no frags) for the next push. The tags it reads were just read.
    #[inline(always)]
    fn drop(&mut self) {
        if self.q.hdr_frag[self.at].is_some() || self.q.frags[self.at].is_some() {
            self.q.drop_left(self.at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pfrag::dma::SoftIommu;
    use proptest::prelude::*;
    use std::collections::VecDeque;
    use std::sync::Arc;

    type Q = InFlight<Arc<SoftIommu>>;

    #[test]
    fn a_span_keeps_every_field() {
        let s = Span::new(u16::MAX, 0x1234, 0x8001, true);
        assert_eq!(
            (s.head(), s.last(), s.ndesc(), s.report()),
            (u16::MAX, 0x1234, 0x8001, true)
        );
        let mut s = Span::new(7, 9, 3, false);
        assert!(!s.report());
        s.set_report(true);
        assert_eq!((s.head(), s.last(), s.ndesc(), s.report()), (7, 9, 3, true));
        s.set_report(false);
        assert_eq!(s, Span::new(7, 9, 3, false));
    }

    #[test]
    fn packets_come_out_oldest_first_across_the_wrap() {
        let mut q = Q::new(3);
        let mut next = 0u64;
        let mut oldest = 0u64;
        // Fill, then alternate pops and pushes so positions wrap many times.
        for round in 0..10 {
            while q.len() < 3 {
                let s = Span::new(next as u16, next as u16, 1, next.is_multiple_of(2));
                q.push(s, Hdr::Slot(next as usize), None, next);
                next += 1;
            }
            let k = usize::from(!oldest.is_multiple_of(2));
            let (found, span) = q.report(0).unwrap();
            assert_eq!((found, span.head()), (k, (oldest + k as u64) as u16));
            for _ in 0..=round % 3 {
                let mut p = q.pop().unwrap();
                assert_eq!(p.token(), oldest);
                assert_eq!(p.span().head(), oldest as u16);
                assert!(matches!(p.take_header(), Hdr::Slot(i) if i as u64 == oldest));
                assert!(p.take_frags().is_none());
                oldest += 1;
            }
        }
        assert_eq!(q.span(q.len()), None);
        q.set_newest_report(true);
        let k = q.len() - 1;
        assert!(q.span(k).unwrap().report());
        while q.pop().is_some() {}
        assert!(q.is_empty() && q.report(0).is_none());
        q.set_newest_report(true);
        assert!(q.is_empty() && q.report(0).is_none());
    }

    #[test]
    fn frags_a_pop_leaves_are_dropped_with_it() {
        use pfrag::dma::{Domain, SoftIommuConfig};
        use pfrag::frag::FragCache;
        use pfrag::pool::{self, Policy, Pool};
        use pfrag::Order;

        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let domain = Arc::new(Domain::new(iommu));
        let order = Order::new(0).unwrap();
        let pool = Pool::new(domain, pool::Config::new(order, Policy::Persistent)).unwrap();
        let mut cache = FragCache::new(pool);
        let mut q = Q::new(1);
        let hdr = cache.refill(64, false).unwrap();
        let payload = vec![cache.refill(512, false).unwrap()];
        q.push(Span::new(0, 0, 2, true), Hdr::Frag(hdr), Some(payload), 1);
        assert!(!q.holds_no_frags());
        // Popped, its frags left behind: dropped with the `Popped`.
        assert_eq!(q.pop().map(|p| p.token()), Some(1));
        assert!(q.holds_no_frags());
        q.push(Span::new(0, 0, 1, true), Hdr::Slot(5), None, 2);
        assert!(q.holds_no_frags());
        let mut p = q.pop().unwrap();
        assert!(matches!(p.take_header(), Hdr::Slot(5)));
        assert!(p.take_frags().is_none());
        drop(p);
        // Payload frags alone, behind a bounce slot, count too; taken out,
        // the queue holds none again.
        let payload = vec![cache.refill(512, false).unwrap()];
        q.push(Span::new(0, 0, 2, true), Hdr::Slot(6), Some(payload), 3);
        assert!(!q.holds_no_frags());
        let frags = q.pop().unwrap().take_frags().unwrap();
        assert!(q.holds_no_frags());
        cache.complete_burst(frags).unwrap();
    }

    #[test]
    #[should_panic(expected = "a plain pop of packets that hold frags")]
    fn a_plain_pop_refuses_a_queue_that_holds_frags() {
        use pfrag::dma::{Domain, SoftIommuConfig};
        use pfrag::frag::FragCache;
        use pfrag::pool::{self, Policy, Pool};
        use pfrag::Order;

        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let domain = Arc::new(Domain::new(iommu));
        let pool = Pool::new(
            domain,
            pool::Config::new(Order::new(0).unwrap(), Policy::Persistent),
        )
        .unwrap();
        let mut cache = FragCache::new(pool);
        let mut q = Q::new(2);
        q.push(
            Span::new(0, 0, 2, true),
            Hdr::Frag(cache.refill(64, false).unwrap()),
            None,
            1,
        );
        q.pop_plain(1, |_, _, _| {});
    }

    /// Steps per case: fewer under Miri, whose cases are fewer too and
    /// slow (a queue of up to 9 wraps within 40 steps).
    const MAX_OPS: usize = if cfg!(miri) { 40 } else { 200 };

    /// One step of [`matches_a_queue_of_records`].
    #[derive(Clone, Debug)]
    enum Op {
        Push { span: Span, slot: usize },
        Pop,
        PopPlain(usize),
        Report(bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        let span = (any::<u16>(), any::<u16>(), 1u16..8, any::<bool>())
            .prop_map(|(h, l, n, r)| Span::new(h, l, n, r));
        prop_oneof![
            (span, 0usize..1000).prop_map(|(span, slot)| Op::Push { span, slot }),
            Just(Op::Pop),
            (0usize..5).prop_map(Op::PopPlain),
            any::<bool>().prop_map(Op::Report),
        ]
    }

    proptest! {
        #![proptest_config(crate::proptest_config())]

        /// Any sequence of pushes (while there is room), pops and report
        /// flags on the newest gives what a `VecDeque` of records gives:
        /// order, fields, `report(j)`, `span(k)` and the length.
        #[test]
        fn matches_a_queue_of_records(cap in 1usize..10, ops in proptest::collection::vec(op(), 0..MAX_OPS)) {
            let mut q = Q::new(cap);
            let mut model: VecDeque<(Span, u64, usize)> = VecDeque::new();
            for (token, op) in (0u64..).zip(ops) {
                match op {
                    Op::Push { span, slot } if model.len() < cap => {
                        q.push(span, Hdr::Slot(slot), None, token);
                        model.push_back((span, token, slot));
                    }
                    Op::Push { .. } => {}
                    Op::Pop => match (q.pop(), model.pop_front()) {
                        (None, None) => {}
                        (Some(mut p), Some((span, token, slot))) => {
                            prop_assert_eq!((p.span(), p.token()), (span, token));
                            prop_assert!(matches!(p.take_header(), Hdr::Slot(s) if s == slot));
                            prop_assert!(p.take_frags().is_none());
                        }
                        (p, m) => prop_assert!(false, "{:?} against {:?}", p.is_some(), m),
                    },
                    Op::PopPlain(k) => {
                        prop_assert!(q.holds_no_frags());
                        let mut got = Vec::new();
                        q.pop_plain(k, |span, slot, token| got.push((span, token, slot)));
                        let want: Vec<_> = model.drain(..k.min(model.len())).collect();
                        prop_assert_eq!(got, want);
                    }
                    Op::Report(r) => {
                        q.set_newest_report(r);
                        if let Some(m) = model.back_mut() {
                            m.0.set_report(r);
                        }
                    }
                }
                prop_assert_eq!(q.len(), model.len());
                prop_assert_eq!(q.is_empty(), model.is_empty());
                let first = model.iter().position(|m| m.0.report());
                prop_assert_eq!(q.report(0), first.map(|k| (k, model[k].0)));
                let reported: Vec<_> = (0..).map_while(|j| q.report(j)).collect();
                let want: Vec<_> = model.iter().enumerate().filter(|m| m.1.0.report()).map(|(k, m)| (k, m.0)).collect();
                prop_assert_eq!(reported, want);
                for k in 0..=cap {
                    prop_assert_eq!(q.span(k), model.get(k).map(|m| m.0));
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "more packets in flight")]
    fn a_full_queue_refuses_another() {
        let mut q = Q::new(1);
        q.push(Span::default(), Hdr::Slot(0), None, 0);
        q.push(Span::default(), Hdr::Slot(1), None, 1);
    }
}
