//! What both descriptor-ring models (the software NIC, the null device) do
//! after descriptors they could not read, or a chain they dropped before
//! its end: the one home of how such a loss is counted and where reading
//! packets resumes.
//!
//! Each unreadable descriptor is one fault ([`NicStats::faults`]). The
//! packet being gathered when the fault came is lost: counted once in
//! [`NicStats::packets`] and [`NicStats::faulted_packets`], and dropped.
//! What follows the fault is skipped up to the next packet's first
//! descriptor (a context descriptor, or data with PAYLEN, which only a
//! packet's first data descriptor carries), so that the readable tail of a
//! lost packet is never sent as a packet of its own. A packet whose first
//! descriptor the fault hid, but whose tail was read, is lost too, and
//! counted once when its tail ends (its `EOP`). A packet whose every
//! descriptor lay among the unreadable ones is never seen: only `faults`
//! shows it. A chain dropped for more buffers than a packet may have is
//! counted where it is dropped, and its rest skipped the same way, never
//! counted or sent as a packet of its own.

use super::softnic::NicStats;
use crate::desc::{Data, Dcmd};

/// Where a model stands after descriptors it could not read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Resync {
    /// Reading packets: nothing to skip.
    #[default]
    Off,
    /// Skipping to the next packet's start; nothing seen yet of the packet
    /// the next descriptors belong to.
    Unseen,
    /// Skipping: descriptors of a packet whose start was lost were seen;
    /// that packet is not counted yet.
    Seen,
    /// Skipping the rest of a packet already counted as lost (to a fault,
    /// or dropped as too long).
    Counted,
}

impl Resync {
    /// Whether descriptors are being skipped (one predictable test per
    /// descriptor; the rest is out of line).
    #[inline]
    pub(super) fn skipping(self) -> bool {
        self != Resync::Off
    }

    /// `n` descriptors could not be read; `gathering`: part of a packet
    /// had been read (the caller drops it).
    #[cold]
    pub(super) fn unreadable(&mut self, n: u64, gathering: bool, stats: &mut NicStats) {
        stats.faults += n;
        if gathering || *self == Resync::Seen {
            lost(stats);
            *self = Resync::Counted;
        } else if *self == Resync::Off {
            *self = Resync::Unseen;
        }
        // `Unseen` and `Counted` stay: what comes next may be the rest of
        // the same packet, which must not be counted twice.
    }

    /// The packet being gathered was dropped at data descriptor `last`
    /// and counted (a chain longer than a packet may be): unless `last`
    /// ended it (`EOP`), its rest is skipped up to the next packet's first
    /// descriptor and not counted again.
    #[cold]
    pub(super) fn dropped(&mut self, last: Data) {
        if !last.cmd().contains(Dcmd::EOP) {
            *self = Resync::Counted;
        }
    }

    /// A context descriptor: it starts a packet, which ends any skipping.
    #[inline]
    pub(super) fn context(&mut self, stats: &mut NicStats) {
        if self.skipping() {
            self.resume(stats);
        }
    }

    /// While [`skipping`](Self::skipping): whether data descriptor `d`
    /// starts a packet (it carries PAYLEN), which ends the skipping and is
    /// to be read. Otherwise `d` is skipped; if it ends its packet (`EOP`),
    /// that packet is counted as lost (unless it already is) and the
    /// skipping ends after it.
    #[cold]
    pub(super) fn resumes_at(&mut self, d: Data, stats: &mut NicStats) -> bool {
        if d.paylen() != 0 {
            self.resume(stats);
            return true;
        }
        if d.cmd().contains(Dcmd::EOP) {
            if *self != Resync::Counted {
                lost(stats);
            }
            *self = Resync::Off;
        } else if *self == Resync::Unseen {
            *self = Resync::Seen;
        }
        false
    }

    /// A packet starts: skipping ends. A lost packet whose tail was seen
    /// without its end is counted now.
    #[cold]
    fn resume(&mut self, stats: &mut NicStats) {
        if *self == Resync::Seen {
            lost(stats);
        }
        *self = Resync::Off;
    }
}

/// A packet seen in part and lost to a fault (its descriptors are counted
/// where they faulted).
fn lost(stats: &mut NicStats) {
    stats.packets += 1;
    stats.faulted_packets += 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::Popts;

    fn data(paylen: u32, end: bool) -> Data {
        let cmd = if end { Dcmd::EOP } else { Dcmd::empty() };
        Data::new(0x1000, 100, Dcmd::IFCS | cmd, paylen, Popts::empty())
    }

    /// Counts of `(faults, packets, faulted_packets)`.
    fn counts(s: &NicStats) -> (u64, u64, u64) {
        (s.faults, s.packets, s.faulted_packets)
    }

    #[test]
    fn a_packet_cut_mid_way_is_counted_once_and_its_tail_skipped() {
        let (mut r, mut s) = (Resync::Off, NicStats::default());
        r.unreadable(3, true, &mut s);
        assert_eq!(counts(&s), (3, 1, 1));
        // Its tail, up to its end: skipped, not counted again.
        assert!(!r.resumes_at(data(0, false), &mut s));
        assert!(!r.resumes_at(data(0, true), &mut s));
        assert_eq!((counts(&s), r), ((3, 1, 1), Resync::Off));
    }

    #[test]
    fn a_packet_whose_start_was_hidden_is_counted_at_its_end() {
        let (mut r, mut s) = (Resync::Off, NicStats::default());
        r.unreadable(1, false, &mut s);
        assert_eq!(counts(&s), (1, 0, 0));
        assert!(!r.resumes_at(data(0, false), &mut s));
        assert!(!r.resumes_at(data(0, true), &mut s));
        assert_eq!((counts(&s), r), ((1, 1, 1), Resync::Off));
    }

    #[test]
    fn a_second_fault_counts_the_tail_seen_once() {
        let (mut r, mut s) = (Resync::Off, NicStats::default());
        r.unreadable(1, false, &mut s);
        assert!(!r.resumes_at(data(0, false), &mut s));
        // Its end is hidden too: the packet is counted now, and what
        // follows (its rest, or another's) is not counted again.
        r.unreadable(2, false, &mut s);
        assert_eq!((counts(&s), r), ((3, 1, 1), Resync::Counted));
        assert!(!r.resumes_at(data(0, true), &mut s));
        assert_eq!(counts(&s), (3, 1, 1));
    }

    #[test]
    fn a_packet_start_ends_the_skipping() {
        let (mut r, mut s) = (Resync::Off, NicStats::default());
        r.unreadable(1, false, &mut s);
        assert!(r.resumes_at(data(100, true), &mut s));
        assert_eq!((counts(&s), r), ((1, 0, 0), Resync::Off));
        r.unreadable(1, false, &mut s);
        r.context(&mut s);
        assert_eq!((counts(&s), r), ((2, 0, 0), Resync::Off));
        // A tail seen without its end, then a packet's start: counted.
        r.unreadable(1, false, &mut s);
        assert!(!r.resumes_at(data(0, false), &mut s));
        assert!(r.resumes_at(data(100, true), &mut s));
        assert_eq!((counts(&s), r), ((3, 1, 1), Resync::Off));
    }
}
