//! Header bounce ring: N small slots in one premapped region. Headers are
//! copied in, so they need no mapping of their own; with a 2 MiB superpage
//! or a small ring the whole ring sits in a few IOTLB entries.

use std::sync::Arc;

use crate::addr::Iova;
use crate::dma::{Coherent, Dir, DmaMapper, Domain};
use crate::error::{Error, Result};

/// Bytes per bounce slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotSize {
    /// 128 bytes: Ethernet + IPv4 + TCP with options.
    B128 = 128,
    /// 256 bytes: room for tunnels and IPv6 extension headers.
    B256 = 256,
}

/// The bounce ring. Slot `i` belongs to TX slot `i` of the queue that owns
/// the ring: it is filled when that TX slot is posted and released when it
/// completes. Invariant: `busy[i]` is true from `fill(i)` to `release(i)`.
pub struct Ring<M: DmaMapper> {
    mem: Coherent<M>,
    slot: usize,
    busy: Vec<bool>,
}

impl<M: DmaMapper> std::fmt::Debug for Ring<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("bounce::Ring")
            .field("slots", &self.busy.len())
            .field("slot", &self.slot)
            .field("in_use", &self.in_use())
            .finish()
    }
}

impl<M: DmaMapper> Ring<M> {
    /// Keeps the ring's memory allocated and mapped for good, counted in
    /// its domain's [`pinned`](crate::dma::Domain::pinned) host bytes
    /// ([`Coherent::pin`]): for slots a device that could not be stopped
    /// may still read.
    pub fn pin(self) {
        self.mem.pin();
    }

    /// `slots` slots of `size` bytes, mapped with one call.
    pub fn new(domain: Arc<Domain<M>>, slots: usize, size: SlotSize) -> Result<Ring<M>> {
        if slots == 0 {
            return Err(Error::BadConfig {
                what: "bounce slots",
                value: 0,
            });
        }
        let slot = size as usize;
        let bytes = slots.checked_mul(slot).ok_or(Error::OutOfRange {
            what: "bounce slots",
            value: slots as u64,
            min: 1,
            max: (usize::MAX / slot) as u64,
        })?;
        let mem = Coherent::new(domain, bytes, Dir::TO_DEVICE)?;
        Ok(Ring {
            mem,
            slot,
            busy: vec![false; slots],
        })
    }

    /// Slots in the ring.
    pub fn slots(&self) -> usize {
        self.busy.len()
    }
    /// Bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.slot
    }
    /// Slots filled and not released: counted when asked (a look at
    /// every slot), so that filling and releasing a slot touch only its
    /// own flag.
    pub fn in_use(&self) -> usize {
        self.busy.iter().filter(|&&b| b).count()
    }
    /// IOVA of the whole ring.
    pub fn iova(&self) -> Iova {
        self.mem.iova()
    }

    /// Copies `hdr` into slot `i`; returns the IOVA the device reads it at.
    /// Errors: `i` out of range, `hdr` empty or larger than a slot, slot
    /// busy; on error the slot is unchanged.
    pub fn fill(&mut self, i: usize, hdr: &[u8]) -> Result<Iova> {
        self.fill_parts(i, std::iter::once(hdr))
    }

    /// Copies `parts` one after another into slot `i` (a small packet's
    /// headers and payload, so that the whole frame goes out as one
    /// buffer); returns the IOVA the device reads it at. The slot's bytes
    /// after the packet, up to the next 8-byte boundary, become zero. The
    /// parts are walked twice: once to measure them, once to copy them
    /// (plain copies: the ring holds the slot alone while it is not in
    /// flight, and its region is one the device only reads). Errors as for
    /// [`fill`](Self::fill), the length being the bytes the parts reach at
    /// the first part that passes the slot (the total when that is the
    /// last: the parts after it are not read).
    pub fn fill_parts<'a>(
        &mut self,
        i: usize,
        parts: impl Iterator<Item = &'a [u8]> + Clone,
    ) -> Result<Iova> {
        let slots = self.busy.len();
        let busy = self
            .busy
            .get_mut(i)
            .ok_or(Error::SlotOutOfRange { slot: i, slots })?;
        if *busy {
            return Err(Error::SlotBusy { slot: i });
        }
        // Measured first, so that the slot is written only once the whole
        // packet is known to fit.
        let mut n = 0usize;
        for p in parts.clone() {
            n = n.saturating_add(p.len());
            if n > self.slot {
                return Err(Error::HeaderTooLarge {
                    len: n,
                    slot: self.slot,
                });
            }
        }
        if n == 0 {
            return Err(Error::ZeroLength);
        }
        // The slot's bytes past the packet up to an 8-byte boundary become
        // zero (a slot is a whole number of words, and the device reads
        // only the packet's bytes). The ring is mapped for the device to
        // read only.
        let at = i * self.slot;
        self.mem.write_parts(at, n, parts)?;
        *busy = true;
        Ok(self.mem.iova().offset(at as u64))
    }

    /// Marks slot `i` free (its TX completed). Releasing a free slot does
    /// nothing; a slot past the ring's end is
    /// [`Error::SlotOutOfRange`], as for [`fill`](Self::fill).
    pub fn release(&mut self, i: usize) -> Result<()> {
        let slots = self.busy.len();
        let b = self
            .busy
            .get_mut(i)
            .ok_or(Error::SlotOutOfRange { slot: i, slots })?;
        *b = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::{SoftIommu, SoftIommuConfig, Translate};
    use crate::mem;

    fn ring(slots: usize) -> Ring<SoftIommu> {
        let d = Arc::new(Domain::new(
            SoftIommu::new(SoftIommuConfig::default()).unwrap(),
        ));
        Ring::new(d, slots, SlotSize::B128).unwrap()
    }

    /// `n` bytes at `iova`, as the device reads them.
    fn device_reads(r: &Ring<SoftIommu>, iova: Iova, n: usize) -> Vec<u8> {
        let t = r
            .mem
            .domain()
            .mapper()
            .translate(iova, Dir::TO_DEVICE)
            .unwrap();
        let mut b = vec![0u8; n];
        // SAFETY: the translation points into the ring's live region, which
        // nobody writes now.
        unsafe { mem::read(t.addr, &mut b) };
        b
    }

    #[test]
    fn parts_go_out_whole_or_not_at_all() {
        let mut r = ring(2);
        r.fill(0, &[0xaa; 20]).unwrap();
        r.release(0).unwrap();
        // Parts that end mid-word, one after another.
        let slot0 = r
            .fill_parts(0, [&b"abc"[..], b"", b"defgh"].into_iter())
            .unwrap();
        assert_eq!(device_reads(&r, slot0, 10), b"abcdefgh\xaa\xaa");
        r.release(0).unwrap();
        // Nothing at all, or too much: refused, the slot free and as it was.
        let e = r.fill_parts(0, [&b""[..], b""].into_iter()).unwrap_err();
        assert!(matches!(e, Error::ZeroLength), "{e:?}");
        let big = [1u8; 100];
        let e = r
            .fill_parts(0, [&big[..], &big[..]].into_iter())
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::HeaderTooLarge {
                    len: 200,
                    slot: 128
                }
            ),
            "{e:?}"
        );
        assert_eq!(device_reads(&r, slot0, 10), b"abcdefgh\xaa\xaa");
        assert_eq!(r.in_use(), 0);
    }

    #[test]
    fn a_packet_that_ends_mid_word_pads_only_that_word_with_zeros() {
        let mut r = ring(2);
        r.fill(1, &[0xaa; 24]).unwrap();
        r.release(1).unwrap();
        // 9 bytes: the second 8-byte word is 1 byte and 7 zeros, the
        // third word as it was.
        let iova = r
            .fill_parts(1, [&b"abcd"[..], b"efghi"].into_iter())
            .unwrap();
        assert_eq!(
            device_reads(&r, iova, 20),
            b"abcdefghi\0\0\0\0\0\0\0\xaa\xaa\xaa\xaa"
        );
        r.release(1).unwrap();
        // A 63-byte frame from parts that end mid-word, an empty one among
        // them.
        let hdr: Vec<u8> = (1..=42).collect();
        let payload: Vec<u8> = (43..=63).collect();
        let parts = [&b""[..], &hdr[..], &[][..], &payload[..]];
        let iova = r.fill_parts(1, parts.into_iter()).unwrap();
        let mut want: Vec<u8> = (1..=63).collect();
        want.push(0);
        assert_eq!(device_reads(&r, iova, 64), want);
    }

    /// Parts whose walk for the copy differs from the walk that measured
    /// them (`fill_parts` measures a clone first): the first walk yields
    /// `first`, every later one `then`.
    #[derive(Clone)]
    struct TwoFaced {
        walks: std::rc::Rc<std::cell::Cell<usize>>,
        walk: Option<usize>,
        first: &'static [&'static [u8]],
        then: &'static [&'static [u8]],
        at: usize,
    }

    impl Iterator for TwoFaced {
        type Item = &'static [u8];
        fn next(&mut self) -> Option<&'static [u8]> {
            let walk = *self.walk.get_or_insert_with(|| {
                let w = self.walks.get();
                self.walks.set(w + 1);
                w
            });
            let parts = if walk == 0 { self.first } else { self.then };
            self.at += 1;
            parts.get(self.at - 1).copied()
        }
    }

    fn two_faced(first: &'static [&'static [u8]], then: &'static [&'static [u8]]) -> TwoFaced {
        TwoFaced {
            walks: Default::default(),
            walk: None,
            first,
            then,
            at: 0,
        }
    }

    #[test]
    fn parts_that_change_between_walks_stay_inside_the_slot() {
        let mut r = ring(2);
        r.fill(1, &[0x11; 128]).unwrap();
        // Measured at 3 bytes (one word), then 12 KiB: one word written.
        static BIG: [u8; 4096] = [0xab; 4096];
        static THEN: [&[u8]; 3] = [&BIG, &BIG, &BIG];
        let iova = r.fill_parts(0, two_faced(&[&[1; 3]], &THEN)).unwrap();
        let got = device_reads(&r, iova, 256);
        assert_eq!(&got[..8], &[0xab; 8]);
        assert_eq!(
            &got[8..128],
            &[0; 120][..],
            "the rest of slot 0, never written"
        );
        assert_eq!(&got[128..], &[0x11; 128][..], "slot 1 untouched");
        r.release(0).unwrap();
        // Measured at 40 bytes, then 4: the 36 after them become zero, not
        // the last packet's bytes.
        r.fill(0, &[0xcc; 48]).unwrap();
        r.release(0).unwrap();
        let iova = r.fill_parts(0, two_faced(&[&[1; 40]], &[&[2; 4]])).unwrap();
        let got = device_reads(&r, iova, 48);
        assert_eq!(&got[..4], &[2; 4]);
        assert_eq!(&got[4..40], &[0; 36][..]);
        assert_eq!(&got[40..], &[0xcc; 8], "past the measured words: as it was");
    }

    #[test]
    fn filled_slot_reads_back_through_the_iommu() {
        let mut r = ring(4);
        let iova = r.fill(2, b"header bytes").unwrap();
        assert_eq!(device_reads(&r, iova, 12), b"header bytes");
        assert_eq!(r.mem.domain().mapper().stats().map_calls, 1);
    }

    #[test]
    fn huge_slot_count_is_a_typed_error() {
        let d = Arc::new(Domain::new(
            SoftIommu::new(SoftIommuConfig::default()).unwrap(),
        ));
        match Ring::new(d, usize::MAX / 2, SlotSize::B256) {
            Err(Error::OutOfRange { what, .. }) => assert_eq!(what, "bounce slots"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn busy_slot_is_not_reused_before_release() {
        let mut r = ring(2);
        r.fill(0, b"a").unwrap();
        assert!(matches!(r.fill(0, b"b"), Err(Error::SlotBusy { slot: 0 })));
        r.release(0).unwrap();
        r.fill(0, b"b").unwrap();
        assert_eq!(r.in_use(), 1);
    }

    #[test]
    fn header_larger_than_slot_is_an_error_with_sizes() {
        let mut r = ring(2);
        match r.fill(1, &[0u8; 129]) {
            Err(Error::HeaderTooLarge {
                len: 129,
                slot: 128,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            r.fill(2, b"x"),
            Err(Error::SlotOutOfRange { slot: 2, slots: 2 })
        ));
        assert_eq!(r.in_use(), 0);
    }

    #[test]
    fn releasing_a_slot_past_the_end_is_an_error_and_changes_nothing() {
        let mut r = ring(2);
        r.fill(1, b"x").unwrap();
        assert!(matches!(
            r.release(2),
            Err(Error::SlotOutOfRange { slot: 2, slots: 2 })
        ));
        assert_eq!(r.in_use(), 1);
        // Releasing a free slot is no error.
        r.release(0).unwrap();
        r.release(1).unwrap();
        assert_eq!(r.in_use(), 0);
    }
}
