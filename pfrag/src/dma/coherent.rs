//! Coherent regions: memory mapped once in a domain for its whole life,
//! shared by the CPU and a device (descriptor rings, header bounce rings).

use std::mem::ManuallyDrop;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Dir, DmaMapper, Domain};
use crate::addr::{Iova, VirtAddr, PAGE_SIZE};
use crate::error::{Error, Result};
use crate::mem::{self, Region};

/// A coherent DMA region: memory mapped once at creation and unmapped when
/// dropped (descriptor rings, header bounce rings).
///
/// It is shared between the CPU and a device, so its accessors take `&self`
/// and the region is `Sync`. The promise:
///
/// - **CPU accesses are free of data races.** Every accessor is atomic at
///   32-bit word granularity: [`read_u32`](Self::read_u32) and
///   [`write_u32`](Self::write_u32) are single atomic operations;
///   [`read_u64`](Self::read_u64) and [`write_u64`](Self::write_u64) are two
///   of them (low-address word first), so a `u64` is *not* single-copy
///   atomic: another thread may see one half written
///   ([`write_u64s`](Self::write_u64s) is `write_u64` word after word).
///   [`write`](Self::write) and [`read`](Self::read) go word by word; a
///   word the range covers only in part is updated with a compare-and-swap,
///   keeping its other bytes.
///   Threads writing the same bytes at once leave each word as one of them
///   wrote it. The one exception is crate-private: a header bounce ring
///   writes its own region's slots with plain copies (`write_parts`),
///   through `&mut` (so no other CPU access runs) and only in a region
///   the device may not write (so no device write can race it either: it
///   faults in translation). Plain and atomic accesses never meet.
/// - **Device accesses are DMA** (a real device, or a model through
///   [`Translate`](super::Translate)): the driver hands memory to the device
///   with its doorbell (a release store, or a fence before an MMIO write)
///   and takes it back by reading the device's status write-back with
///   [`read_u32`](Self::read_u32) (acquire), as with real hardware. The
///   CPU's own stores are relaxed: that handshake orders them. A model's
///   *writes* through `Translate` ([`write`](super::Translate::write),
///   [`write_u32`](super::Translate::write_u32)) are 32-bit atomics as
///   well, so a device write that races the CPU on these bytes is no data
///   race. A model's *read* ([`read`](super::Translate::read)) is not: it
///   lends the model the bytes in place as a plain `&[u8]`, and it is
///   `Translate::read`'s safety contract (nothing writes the 4-byte words
///   that hold the bytes during the call) that rules out a CPU write
///   racing it. Mind the words: [`write`](Self::write) of a range that
///   starts or ends inside a word rewrites the whole word, bytes outside
///   the range included (atomically, keeping their values).
///
/// ```
/// # use std::sync::Arc;
/// # use pfrag::dma::{Coherent, Dir, Domain, Identity};
/// let ring = Coherent::new(Arc::new(Domain::new(Identity::new())), 4096, Dir::BIDIRECTIONAL)?;
/// std::thread::scope(|s| {
///     s.spawn(|| ring.write(0, b"from one thread"));
///     s.spawn(|| ring.write_u64(8, 7));
/// });
/// # Ok::<(), pfrag::Error>(())
/// ```
pub struct Coherent<M: DmaMapper> {
    domain: Arc<Domain<M>>,
    /// Freed in `drop` only once the mapping is retired.
    region: ManuallyDrop<Region>,
    iova: Iova,
    /// How it is mapped.
    dir: Dir,
}

impl<M: DmaMapper> std::fmt::Debug for Coherent<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coherent")
            .field("iova", &self.iova)
            .field("len", &self.region.len())
            .finish()
    }
}

impl<M: DmaMapper> Coherent<M> {
    /// Allocates and maps `len` bytes (rounded up to 4 KiB) for `dir`.
    pub fn new(domain: Arc<Domain<M>>, len: usize, dir: Dir) -> Result<Coherent<M>> {
        let region = Region::new(len, PAGE_SIZE as usize, false)?;
        // SAFETY: `region` lives in the returned `Coherent`, whose drop
        // retires the mapping before freeing it (or leaks it if that fails).
        let iova = unsafe { domain.map(region.addr(), region.len() as u64, PAGE_SIZE, dir) }?;
        Ok(Coherent {
            domain,
            region: ManuallyDrop::new(region),
            iova,
            dir,
        })
    }

    /// Where the device sees the region.
    pub fn iova(&self) -> Iova {
        self.iova
    }
    /// Where the CPU sees it.
    pub fn addr(&self) -> VirtAddr {
        self.region.addr()
    }
    /// Its size.
    pub fn len(&self) -> usize {
        self.region.len()
    }
    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Keeps the memory allocated and mapped for good, counted in its
    /// domain's [`pinned`](Domain::pinned) host and IOVA bytes, as a drop
    /// whose unmap fails does: for memory a device that could not be
    /// stopped may still reach.
    pub fn pin(self) {
        self.domain.pin_host(self.region.len() as u64);
        self.domain.pin_iova(self.region.len() as u64);
        std::mem::forget(self);
    }
    /// The domain it is mapped in.
    pub fn domain(&self) -> &Arc<Domain<M>> {
        &self.domain
    }

    #[inline]
    fn at(&self, off: usize, len: usize, align: usize) -> Result<VirtAddr> {
        let size = self.region.len();
        match off.checked_add(len) {
            Some(end) if end <= size && off % align == 0 => Ok(self.region.addr().offset(off)),
            _ => Err(Error::OutOfRange {
                what: "coherent region offset (aligned, access inside the region)",
                value: off as u64,
                min: 0,
                max: size.saturating_sub(len) as u64,
            }),
        }
    }

    /// Copies `src` in at `off`, word by word with relaxed atomic stores
    /// (see the type docs). A range that starts or ends inside an aligned
    /// 4-byte word rewrites that whole word with a compare-and-swap that
    /// keeps its other bytes: a device read of those bytes, lent in place,
    /// must not run meanwhile ([`Translate::read`](super::Translate::read)).
    #[inline]
    pub fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        let at = self.at(off, src.len(), 1)?;
        // SAFETY: in bounds of the live region, whose base is page aligned
        // and length a page multiple, so every word the range touches lies
        // inside it; the CPU reaches region memory only through these
        // 32-bit atomics (`write_parts`' plain copies take `&mut self`, so
        // none runs now), and the device only after the doorbell (type
        // docs).
        unsafe { mem::write_words(at, src) };
        Ok(())
    }
    /// Copies the bytes of `parts`, one after another, in at `off` (8-byte
    /// aligned), `len` bytes in all, with plain (non-atomic) stores, and
    /// zeroes the bytes from `off + len` to the next 8-byte boundary, which
    /// must lie inside the region too. The caller measured the parts: past
    /// that boundary nothing is written, even by parts that reach further,
    /// and parts that end sooner leave zeros up to it.
    ///
    /// Crate-private: the stores are not the 32-bit atomics every other
    /// accessor uses, so no other access to them may run meanwhile. `&mut
    /// self` rules out the CPU's (through this region; its memory is
    /// reached no other way), and a region the device may write is refused
    /// ([`Error::BadConfig`]), so that a device write, even one that
    /// breaks the ring's rules, faults in translation before it reaches
    /// the bytes; a device read of bytes being written breaks
    /// [`Translate::read`](super::Translate::read)'s contract, as it would
    /// for any write here.
    #[inline]
    pub(crate) fn write_parts<'a>(
        &mut self,
        off: usize,
        len: usize,
        parts: impl Iterator<Item = &'a [u8]>,
    ) -> Result<()> {
        if self.dir.contains(Dir::FROM_DEVICE) {
            return Err(Error::BadConfig {
                what: "coherent region for plain copies (the device may write it)",
                value: u64::from(self.dir.bits()),
            });
        }
        let words = len.div_ceil(8);
        let bytes = words.checked_mul(8).ok_or(Error::OutOfRange {
            what: "coherent region length (whole 8-byte words)",
            value: len as u64,
            min: 0,
            max: self.region.len() as u64,
        })?;
        let at = self.at(off, bytes, 8)?;
        // SAFETY: in bounds and aligned (the region's base is page
        // aligned), live while `self` is; no other access runs meanwhile,
        // as said above. No part lies in the region: safe code never holds
        // a reference into it (its bytes are lent as `&[u8]` only to a
        // device model inside the `unsafe` `Translate::read`, whose caller
        // promised that nothing writes them meanwhile).
        unsafe { mem::write_parts(at, words, parts) };
        Ok(())
    }
    /// Copies out from `off`, word by word with relaxed atomic loads. To see
    /// what a device wrote, read its status word with
    /// [`read_u32`](Self::read_u32) first.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        let at = self.at(off, dst.len(), 1)?;
        // SAFETY: as in `write`.
        unsafe { mem::read_words(at, dst) };
        Ok(())
    }
    /// Atomic 32-bit load with acquire ordering at `off` (4-byte aligned):
    /// how a driver polls a status word the device writes back, also when
    /// a device model runs on another thread (it stores the word with
    /// [`Translate::write_u32`](super::Translate::write_u32)).
    pub fn read_u32(&self, off: usize) -> Result<u32> {
        let at = self.at(off, 4, 4)?;
        // SAFETY: in bounds and aligned (the region's base is page
        // aligned); CPU accesses are 32-bit atomics, and a device model
        // writes such a word only with a 32-bit atomic store.
        Ok(unsafe { mem::load_u32(at, Ordering::Acquire) })
    }
    /// Atomic 32-bit store at `off` (4-byte aligned). Relaxed: the device
    /// reads it only after the doorbell, which orders it.
    pub fn write_u32(&self, off: usize, v: u32) -> Result<()> {
        let at = self.at(off, 4, 4)?;
        // SAFETY: as in `read_u32`.
        unsafe { mem::store_u32(at, v, Ordering::Relaxed) };
        Ok(())
    }
    /// Atomic 16-bit load with acquire ordering at `off` (2-byte aligned):
    /// a split virtqueue's used index, which its device stores with a
    /// 16-bit atomic.
    ///
    /// # Safety
    /// No access of another size to the 4-byte word around `off` runs
    /// meanwhile, on any thread (a mixed-size race): this region's CPU
    /// accesses are otherwise 32-bit atomics, and `Coherent` is `Sync`.
    pub unsafe fn read_u16(&self, off: usize) -> Result<u16> {
        let at = self.at(off, 2, 2)?;
        // SAFETY: in bounds and aligned (the region's base is page
        // aligned); the caller promised no access of another size races.
        Ok(unsafe { mem::load_u16(at, Ordering::Acquire) })
    }
    /// Atomic 16-bit store with release ordering at `off` (2-byte aligned):
    /// a split virtqueue's available index, which publishes the entries
    /// written before it.
    ///
    /// # Safety
    /// As [`read_u16`](Self::read_u16).
    pub unsafe fn write_u16(&self, off: usize, v: u16) -> Result<()> {
        let at = self.at(off, 2, 2)?;
        // SAFETY: as in `read_u16`.
        unsafe { mem::store_u16(at, v, Ordering::Release) };
        Ok(())
    }
    /// 64-bit store at `off` (8-byte aligned), as two relaxed 32-bit atomic
    /// stores, low address first: not single-copy atomic (a descriptor is
    /// read by the device only after the doorbell).
    #[inline]
    pub fn write_u64(&self, off: usize, v: u64) -> Result<()> {
        self.write_u64s(off, &[v])
    }
    /// [`write_u64`](Self::write_u64) of each of `words` in turn, from
    /// `off` on (8-byte aligned), with one bounds check for them all (a
    /// descriptor of two or four words). Nothing is written if any word
    /// falls outside the region.
    #[inline]
    pub fn write_u64s(&self, off: usize, words: &[u64]) -> Result<()> {
        // A slice's bytes never overflow a `usize`.
        let at = self.at(off, size_of_val(words), 8)?;
        for (i, w) in words.iter().enumerate() {
            let b = w.to_ne_bytes();
            let (lo, hi) = (
                u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
                u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
            );
            let at = at.offset(8 * i);
            // SAFETY: in bounds and aligned, as in `read_u32`, for all the
            // `words.len()` words from `at` (checked above), so each is two
            // whole words, stored with two relaxed 32-bit atomic stores, low
            // address first (`write_words`' general loop cost a descriptor
            // write dozens of instructions more); every other access to
            // them is a 32-bit atomic too.
            unsafe {
                mem::store_u32(at, lo, Ordering::Relaxed);
                mem::store_u32(at.offset(4), hi, Ordering::Relaxed);
            }
        }
        Ok(())
    }
    /// 64-bit load at `off` (8-byte aligned), as two 32-bit atomic loads
    /// with acquire ordering, low address first: not single-copy atomic.
    pub fn read_u64(&self, off: usize) -> Result<u64> {
        let at = self.at(off, 8, 8)?;
        // SAFETY: in bounds and aligned, as in `read_u32`, for both words.
        let (lo, hi) = unsafe {
            (
                mem::load_u32(at, Ordering::Acquire).to_ne_bytes(),
                mem::load_u32(at.offset(4), Ordering::Acquire).to_ne_bytes(),
            )
        };
        Ok(u64::from_ne_bytes([
            lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3],
        ]))
    }
}

impl<M: DmaMapper> Drop for Coherent<M> {
    fn drop(&mut self) {
        let len = self.region.len() as u64;
        // SAFETY: the region's mapping is this `Coherent`'s own, made in
        // `new`; it is going away, and nothing names its IOVA after this.
        if unsafe { self.domain.retire(self.iova, len) }.is_ok() {
            // SAFETY: the mapping and its invalidation are complete: no
            // device can reach the region, and it is not used again.
            unsafe { ManuallyDrop::drop(&mut self.region) };
        } else {
            // A device may still reach the region: keep it allocated for
            // good, and count it.
            self.domain.pin_host(len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::{Identity, SoftIommu, SoftIommuConfig, Translate};

    #[test]
    fn coherent_region_is_mapped_for_its_life() {
        let d = Arc::new(Domain::new(
            SoftIommu::new(SoftIommuConfig::default()).unwrap(),
        ));
        let c = Coherent::new(d.clone(), 100, Dir::BIDIRECTIONAL).unwrap();
        c.write_u32(8, 0xdead_beef).unwrap();
        assert_eq!(c.read_u32(8).unwrap(), 0xdead_beef);
        assert!(c.write_u32(4096, 1).is_err());
        assert!(c.write_u32(2, 1).is_err());
        let iova = c.iova();
        drop(c);
        assert!(d.mapper().translate(iova, Dir::TO_DEVICE).is_err());
        assert_eq!(d.iova_in_use(), 0);
    }

    #[test]
    fn words_go_in_all_or_none() {
        let d = Arc::new(Domain::new(
            SoftIommu::new(SoftIommuConfig::default()).unwrap(),
        ));
        let c = Coherent::new(d, 4096, Dir::BIDIRECTIONAL).unwrap();
        let words = [0x0102_0304_0506_0708, u64::MAX, 0, 0xdead_beef_0bad_f00d];
        c.write_u64s(4096 - 32, &words).unwrap();
        for (i, w) in words.iter().enumerate() {
            assert_eq!(c.read_u64(4096 - 32 + 8 * i).unwrap(), *w, "word {i}");
        }
        c.write_u64s(16, &[]).unwrap();
        // One word past the end, or unaligned: nothing written.
        c.write_u64(4096 - 40, 7).unwrap();
        for off in [4096 - 24, 4096 - 36, usize::MAX - 7] {
            assert!(c.write_u64s(off, &[1, 2, 3, 4]).is_err(), "at {off}");
        }
        assert!(c.write_u64s(4, &[1]).is_err());
        assert_eq!(c.read_u64(4096 - 40).unwrap(), 7);
        assert_eq!(c.read_u64(4096 - 24).unwrap(), words[1]);
        assert_eq!(c.read_u64(0).unwrap(), 0);
    }

    #[test]
    fn slot_copies_only_reach_memory_the_device_cannot_write() {
        let d = Arc::new(Domain::new(
            SoftIommu::new(SoftIommuConfig::default()).unwrap(),
        ));
        let parts = || [&b"abc"[..], b"defghijk"].into_iter();
        let mut both = Coherent::new(d.clone(), 64, Dir::BIDIRECTIONAL).unwrap();
        let e = both.write_parts(0, 11, parts()).unwrap_err();
        assert!(matches!(e, Error::BadConfig { .. }), "{e:?}");
        let mut ro = Coherent::new(d, 4096, Dir::TO_DEVICE).unwrap();
        ro.write(0, &[0xee; 24]).unwrap();
        ro.write_parts(8, 11, parts()).unwrap();
        let mut got = [0u8; 24];
        ro.read(0, &mut got).unwrap();
        assert_eq!(&got[..8], &[0xee; 8]);
        assert_eq!(&got[8..24], b"abcdefghijk\0\0\0\0\0");
        // Unaligned, or a padded end past the region: refused, nothing
        // written.
        assert!(ro.write_parts(4, 11, parts()).is_err());
        assert!(ro.write_parts(4088, 11, parts()).is_err());
        // A length whose whole words would overflow: refused, not wrapped.
        assert!(ro.write_parts(4088, usize::MAX - 3, parts()).is_err());
        assert!(ro.write_parts(0, usize::MAX, parts()).is_err());
        ro.read(0, &mut got).unwrap();
        assert_eq!(&got[8..24], b"abcdefghijk\0\0\0\0\0");
    }

    fn config() -> proptest::prelude::ProptestConfig {
        let mut c = proptest::prelude::ProptestConfig::with_cases(if cfg!(miri) { 8 } else { 256 });
        if cfg!(miri) {
            c.failure_persistence = None;
        }
        c
    }

    proptest::proptest! {
        #![proptest_config(config())]

        /// Any parts, empty and short ones too, land as their
        /// concatenation, zero-padded to a whole word, and nothing past
        /// that word changes; parts that reach further than the length
        /// given are cut off at its last word, and parts that end sooner
        /// leave zeros up to it (the length a caller measured on a first
        /// walk of an iterator whose second walk differs).
        #[test]
        fn parts_land_as_their_concatenation_and_no_further(
            parts in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..20), 0..6),
            word in 0usize..4,
            delta in -9i64..=17,
        ) {
            let d = Arc::new(Domain::new(Identity::new()));
            let mut c = Coherent::new(d, 4096, Dir::TO_DEVICE).unwrap();
            c.write(0, &[0xee; 256]).unwrap();
            let all: Vec<u8> = parts.concat();
            let len = (all.len() as i64 + delta).max(0) as usize;
            let off = 8 * word;
            c.write_parts(off, len, parts.iter().map(|p| &p[..])).unwrap();
            let mut got = [0u8; 256];
            c.read(0, &mut got).unwrap();
            let end = off + len.div_ceil(8) * 8;
            let mut want = vec![0xeeu8; 256];
            let copied = all.len().min(end - off);
            want[off..off + copied].copy_from_slice(&all[..copied]);
            want[off + copied..end].fill(0);
            proptest::prop_assert_eq!(&got[..], &want[..]);
        }
    }
}
