//! Raw memory: every `mmap` and every raw-pointer access of pfrag lives here.
//!
//! Safety model. A [`Region`] owns an anonymous mapping for its whole life;
//! addresses inside it stay valid until it is dropped. The pool, the bounce
//! ring and the descriptor ring hand out [`VirtAddr`]s inside regions they
//! own. Memory a device may access is only ever touched through the raw
//! functions below (never through a Rust reference that outlives the call),
//! so that a device (or the software NIC model) reading or writing it does
//! not alias a live `&`/`&mut`. The one exception is the crate's
//! `slice_mut` / `slice`, whose callers promise the device is not using the
//! range. The raw accessors are private to pfrag; outside it, memory is
//! reached through [`Region::write`] (`&mut self`: one writer, no reader),
//! `Coherent` (32-bit atomics, safe to share between threads; the bounce
//! ring's slot writes, through `&mut` to memory the device only reads,
//! are plain copies) and frags.

use std::io;
use std::ptr;
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};

use memmap2::{MmapMut, MmapOptions, UncheckedAdvice};

use crate::addr::{checked_align_up, VirtAddr, HUGE_PAGE_SIZE, PAGE_SIZE};
use crate::error::{Error, Result};

/// Backing of a region: what the kernel actually gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Normal 4 KiB pages.
    Small,
    /// 2 MiB huge pages (`MAP_HUGETLB`).
    Huge,
    /// Huge pages were asked for but none were available; normal pages used.
    HugeFallback,
}

/// An anonymous, page-aligned mapping whose usable part starts at an address
/// aligned to `align`.
#[derive(Debug)]
pub struct Region {
    /// The mapping; `base..base+len` lies inside it.
    map: MmapMut,
    /// First usable byte; a multiple of the requested alignment.
    base: usize,
    /// Usable bytes.
    len: usize,
    /// What backs the region.
    backing: Backing,
}

/// The longest region [`Region::new`] maps: the largest multiple of 2 MiB
/// that fits an `isize` (an allocation's size never exceeds `isize::MAX`),
/// so that rounding a length up to 4 KiB or 2 MiB cannot overflow.
pub const MAX_REGION_LEN: usize = isize::MAX as usize & !(HUGE_PAGE_SIZE as usize - 1);

impl Region {
    /// Maps `len` bytes (rounded up to 4 KiB) aligned to `align` (a power of
    /// two). With `huge`, tries 2 MiB pages first and falls back to normal
    /// pages, recording the fallback in [`Region::backing`].
    ///
    /// A `len` past [`MAX_REGION_LEN`] is [`Error::OutOfRange`], refused
    /// before anything is mapped.
    pub fn new(len: usize, align: usize, huge: bool) -> Result<Region> {
        if len == 0 {
            return Err(Error::ZeroLength);
        }
        if !align.is_power_of_two() {
            return Err(Error::BadConfig {
                what: "region alignment",
                value: align as u64,
            });
        }
        let len = round_len(len, PAGE_SIZE)?;
        // Miri models only plain anonymous mappings: no huge pages there.
        if huge && cfg!(miri) {
            return Self::small(len, align, Backing::HugeFallback);
        }
        if huge && align as u64 <= HUGE_PAGE_SIZE {
            let hlen = round_len(len, HUGE_PAGE_SIZE)?;
            match MmapOptions::new().len(hlen).huge(Some(21)).map_anon() {
                Ok(map) => {
                    let base = map.as_ptr() as usize;
                    return Ok(Region {
                        map,
                        base,
                        len,
                        backing: Backing::Huge,
                    });
                }
                Err(_) => return Self::small(len, align, Backing::HugeFallback),
            }
        }
        Self::small(len, align, Backing::Small)
    }

    fn small(len: usize, align: usize, backing: Backing) -> Result<Region> {
        let slack = align.saturating_sub(PAGE_SIZE as usize);
        let total = len.checked_add(slack).ok_or(Error::Mmap {
            len,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        })?;
        let map = MmapOptions::new()
            .len(total)
            .map_anon()
            .map_err(|source| Error::Mmap { len: total, source })?;
        let start = map.as_ptr() as usize;
        // `start + slack` lies inside the mapping, so this cannot overflow.
        let base = start.next_multiple_of(align);
        Ok(Region {
            map,
            base,
            len,
            backing,
        })
    }

    /// First usable address.
    pub fn addr(&self) -> VirtAddr {
        VirtAddr(self.base)
    }
    /// Usable bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// What backs the region.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Copies `src` into the region at `off`; out of bounds is an error.
    ///
    /// Memory a device may read is written through a raw copy, never a
    /// reference. The copy is a plain one, so it takes `&mut self`: one
    /// writer at a time, and no reader meanwhile. Memory the CPU shares
    /// with a device while both run is a
    /// [`Coherent`](crate::dma::Coherent) region, whose accesses are
    /// atomic. Two threads cannot write through a shared `&Region`:
    ///
    /// ```compile_fail,E0596
    /// use pfrag::mem::Region;
    /// let region = Region::new(4096, 4096, false).unwrap();
    /// let r = &region;
    /// std::thread::scope(|s| {
    ///     s.spawn(move || r.write(0, &[1; 64])); // error: `*r` is behind a `&`
    ///     s.spawn(move || r.write(0, &[2; 64]));
    /// });
    /// ```
    pub fn write(&mut self, off: usize, src: &[u8]) -> Result<()> {
        match off.checked_add(src.len()) {
            Some(end) if end <= self.len => {
                // SAFETY: in bounds of the live mapping (checked above); no
                // Rust reference to region memory exists outside this
                // module's short-lived slices.
                unsafe { write(self.addr().offset(off), src) };
                Ok(())
            }
            _ => Err(Error::OutOfRange {
                what: "region offset",
                value: off as u64,
                min: 0,
                max: self.len.saturating_sub(src.len()) as u64,
            }),
        }
    }

    /// Gives the pages of `off..off+len` (page-aligned, inside the region)
    /// back to the kernel; they read as zeroes afterwards.
    ///
    /// # Safety
    /// No device mapping may cover the range (unmap it first) and no frag,
    /// reference or pointer may still be used to access it.
    pub unsafe fn release(&self, off: usize, len: usize) -> Result<()> {
        if cfg!(miri) {
            // Miri has no madvise: zero the range, which is what a reader
            // sees after DONTNEED.
            // SAFETY: as below; nothing uses the range.
            unsafe { ptr::write_bytes((self.base + off) as *mut u8, 0, len) };
            return Ok(());
        }
        let map_off = self.base - self.map.as_ptr() as usize + off;
        // SAFETY: the caller guarantees nothing uses the range; DONTNEED on
        // anonymous private memory only discards its contents.
        unsafe {
            self.map
                .unchecked_advise_range(UncheckedAdvice::DontNeed, map_off, len)
        }
        .map_err(|source| Error::Mmap { len, source })
    }
}

impl Region {
    /// Gives every page of the region back to the kernel, huge pages
    /// included (they return to the system's free huge pages), as
    /// [`release`](Self::release) does for a part of it.
    ///
    /// # Safety
    /// As [`release`](Self::release), for the whole region.
    pub unsafe fn release_all(&self) -> Result<()> {
        if cfg!(miri) {
            // SAFETY: as in `release`; nothing uses the region.
            return unsafe { self.release(0, self.len) };
        }
        let len = self.map.len();
        // SAFETY: the caller guarantees nothing uses the region; DONTNEED
        // on private anonymous (or huge) memory only discards its contents.
        unsafe {
            self.map
                .unchecked_advise_range(UncheckedAdvice::DontNeed, 0, len)
        }
        .map_err(|source| Error::Mmap { len, source })
    }

    /// Faults every page of the region in, writable, before it is used
    /// again after [`release_all`](Self::release_all). For huge pages this
    /// is where a shortage shows: as an error here
    /// (`MADV_POPULATE_WRITE`), not as `SIGBUS` at the first write.
    pub fn populate(&self) -> Result<()> {
        if cfg!(miri) {
            return Ok(());
        }
        let len = self.map.len();
        self.map
            .advise_range(memmap2::Advice::PopulateWrite, 0, len)
            .map_err(|source| Error::Mmap { len, source })
    }
}

/// `len` rounded up to a multiple of `align` (4 KiB or 2 MiB), or
/// [`Error::OutOfRange`] past [`MAX_REGION_LEN`].
fn round_len(len: usize, align: u64) -> Result<usize> {
    checked_align_up(len as u64, align)
        .filter(|&l| l <= MAX_REGION_LEN as u64)
        .map(|l| l as usize)
        .ok_or(Error::OutOfRange {
            what: "region length",
            value: len as u64,
            min: 1,
            max: MAX_REGION_LEN as u64,
        })
}

/// Copies `src` to `addr`.
///
/// # Safety
/// `addr..addr+src.len()` lies in a live [`Region`] that no device writes
/// while this runs, and no Rust reference to that range is live.
#[inline]
pub(crate) unsafe fn write(addr: VirtAddr, src: &[u8]) {
    // SAFETY: per the contract above the destination is valid for writes
    // and does not overlap `src` (which is a Rust reference).
    unsafe { ptr::copy_nonoverlapping(src.as_ptr(), addr.0 as *mut u8, src.len()) }
}

/// Copies from `addr` into `dst` (tests read what a device would see).
///
/// # Safety
/// `addr..addr+dst.len()` lies in a live [`Region`] that nobody writes while
/// this runs.
#[cfg(test)]
#[inline]
pub(crate) unsafe fn read(addr: VirtAddr, dst: &mut [u8]) {
    // SAFETY: per the contract above the source is valid for reads.
    unsafe { ptr::copy_nonoverlapping(addr.0 as *const u8, dst.as_mut_ptr(), dst.len()) }
}

/// A shared view of `len` bytes at `addr`.
///
/// # Safety
/// The range lies in a live [`Region`] and nobody writes it for `'a`.
#[inline]
pub(crate) unsafe fn slice<'a>(addr: VirtAddr, len: usize) -> &'a [u8] {
    // SAFETY: per the contract above.
    unsafe { std::slice::from_raw_parts(addr.0 as *const u8, len) }
}

/// An exclusive view of `len` bytes at `addr`.
///
/// # Safety
/// The range lies in a live [`Region`], and for `'a` nobody else (device or
/// CPU) reads or writes it.
#[inline]
pub(crate) unsafe fn slice_mut<'a>(addr: VirtAddr, len: usize) -> &'a mut [u8] {
    // SAFETY: per the contract above.
    unsafe { std::slice::from_raw_parts_mut(addr.0 as *mut u8, len) }
}

/// The aligned 32-bit word at `addr`, as an atomic.
///
/// # Safety
/// `addr` is 4-byte aligned and lies in a live [`Region`] for `'a`, and
/// every concurrent access to those 4 bytes is a 32-bit atomic.
#[inline]
unsafe fn word<'a>(addr: usize) -> &'a AtomicU32 {
    // SAFETY: per the contract above (alignment, liveness, and no
    // concurrent non-atomic or mixed-size access).
    unsafe { AtomicU32::from_ptr(addr as *mut u32) }
}

/// Atomic 32-bit load.
///
/// # Safety
/// As [`word`]: `addr` is 4-byte aligned, in a live [`Region`], and
/// concurrent accesses to those 4 bytes are 32-bit atomics.
#[inline]
pub(crate) unsafe fn load_u32(addr: VirtAddr, order: Ordering) -> u32 {
    // SAFETY: per the contract above.
    unsafe { word(addr.0) }.load(order)
}

/// Atomic 32-bit store.
///
/// # Safety
/// As [`load_u32`].
#[inline]
pub(crate) unsafe fn store_u32(addr: VirtAddr, v: u32, order: Ordering) {
    // SAFETY: per the contract above.
    unsafe { word(addr.0) }.store(v, order)
}

/// Atomic 32-bit store with release ordering: a device model's write-back
/// of a descriptor's status word, which the driver polls with an acquire
/// [`load_u32`] while the device runs, so seeing the word also shows
/// everything the device did before (a real device's write is a single
/// aligned store too).
///
/// # Safety
/// As [`load_u32`].
#[inline]
pub(crate) unsafe fn store_u32_release(addr: VirtAddr, v: u32) {
    // SAFETY: per the contract above.
    unsafe { store_u32(addr, v, Ordering::Release) }
}

/// Atomic 16-bit load (a split virtqueue's ring indices and entries).
///
/// # Safety
/// `addr` is 2-byte aligned and lies in a live [`Region`], and every
/// concurrent access to those 2 bytes (or to the 4-byte word around them)
/// is a 16-bit atomic: no mixed-size race.
#[inline]
pub(crate) unsafe fn load_u16(addr: VirtAddr, order: Ordering) -> u16 {
    // SAFETY: per the contract above (alignment, liveness, and no
    // concurrent non-atomic or mixed-size access).
    unsafe { AtomicU16::from_ptr(addr.0 as *mut u16) }.load(order)
}

/// Atomic 16-bit store.
///
/// # Safety
/// As [`load_u16`].
#[inline]
pub(crate) unsafe fn store_u16(addr: VirtAddr, v: u16, order: Ordering) {
    // SAFETY: per the contract above.
    unsafe { AtomicU16::from_ptr(addr.0 as *mut u16) }.store(v, order)
}

/// The aligned 32-bit words that `addr..addr + len` touches, as one slice
/// of atomics (one reference for the whole range, not one per word: Miri's
/// borrow trackers then follow one tag, as for a plain slice).
///
/// # Safety
/// As [`word`], for every word the range touches.
#[inline]
unsafe fn words<'a>(addr: usize, len: usize) -> &'a [AtomicU32] {
    let first = addr & !3;
    // From the first word's start to the range's end, in words rounded up.
    let n = (addr % 4 + len).div_ceil(4);
    // SAFETY: per the contract above: `first` is 4-byte aligned, the `n`
    // words lie in a live region, and every concurrent access to them is
    // a 32-bit atomic (`AtomicU32` has the layout of `u32`).
    unsafe { std::slice::from_raw_parts(first as *const AtomicU32, n) }
}

/// Copies `src` to `addr` with relaxed 32-bit atomic stores: whole words
/// where `src` covers them, a compare-and-swap of the word where it covers
/// only part (the word's other bytes are left as they are, even if another
/// thread writes them meanwhile).
///
/// # Safety
/// The words that `addr..addr + src.len()` touches lie in a live
/// [`Region`], and every concurrent access to them is a 32-bit atomic.
#[inline]
pub(crate) unsafe fn write_words(addr: VirtAddr, src: &[u8]) {
    if src.is_empty() {
        return;
    }
    if addr.0 % 4 == 0 && src.len() % 4 == 0 {
        // Whole words only (a descriptor, most frames): no edge to merge,
        // and a loop small enough to inline into the caller.
        // SAFETY: per the contract above; the words are exactly the range.
        let ws = unsafe { words(addr.0, src.len()) };
        store_whole(ws, src);
    } else {
        // SAFETY: per the contract above.
        unsafe { write_edges(addr, src) };
    }
}

/// Copies the bytes of `parts`, one after another, to `addr` with plain
/// (non-atomic) stores, and zeroes the rest of the `words` 8-byte words
/// from `addr`: every byte of them is written, and none past them (parts
/// that reach further are cut off there).
///
/// # Safety
/// `addr` is 8-byte aligned, the `words` words from it lie in a live
/// [`Region`], and no other access to them runs meanwhile, on any thread:
/// the caller holds them alone (the rest of this module accesses region
/// memory with atomics, and a plain access racing any other is a data
/// race). None of `parts` lies in those words.
#[inline]
pub(crate) unsafe fn write_parts<'a>(
    addr: VirtAddr,
    words: usize,
    parts: impl Iterator<Item = &'a [u8]>,
) {
    debug_assert_eq!(addr.0 % 8, 0);
    let Some(cap) = words.checked_mul(8).filter(|&c| c > 0) else {
        return;
    };
    let base = addr.0 as *mut u8;
    // SAFETY: the last word lies in the live region and is 8-byte
    // aligned (`addr` is), and nothing else accesses it meanwhile (the
    // contract above). Zeroed first (one store): the parts' bytes then
    // land over it, and a packet that ends inside it leaves the rest zero.
    unsafe { base.add(cap - 8).cast::<u64>().write(0) };
    let mut off = 0usize;
    for p in parts {
        let n = p.len().min(cap - off);
        // SAFETY: `off + n <= cap`, so the bytes lie in the words the
        // contract covers, which nothing else accesses meanwhile; `p` is
        // a live slice outside them (the contract), so the two do not
        // overlap.
        unsafe { ptr::copy_nonoverlapping(p.as_ptr(), base.add(off), n) };
        off += n;
    }
    if off + 8 < cap {
        // Parts shorter than the caller measured (an iterator whose
        // second walk yields less): the words they did not reach become
        // zero too, so no earlier packet's bytes stay.
        // SAFETY: `off..cap - 8` lies in the words the contract covers.
        unsafe { ptr::write_bytes(base.add(off), 0, cap - 8 - off) };
    }
}

/// [`write_words`] of a range with a partial first or last word.
///
/// # Safety
/// As [`write_words`], and `src` is not empty (an empty range at an
/// unaligned address would still name the word around it).
#[inline(never)]
unsafe fn write_edges(addr: VirtAddr, src: &[u8]) {
    debug_assert!(!src.is_empty());
    // SAFETY: per the contract above.
    let ws = unsafe { words(addr.0, src.len()) };
    // A partial first word, then whole words, then a partial last word.
    let pos = addr.0 % 4;
    let (ws, src) = match pos {
        0 => (ws, src),
        _ => {
            let n = (4 - pos).min(src.len());
            merge(&ws[0], pos, &src[..n]);
            (&ws[1..], &src[n..])
        }
    };
    let n = src.len() / 4;
    store_whole(&ws[..n], &src[..4 * n]);
    let tail = &src[4 * n..];
    if !tail.is_empty() {
        merge(&ws[n], 0, tail);
    }
}

/// Stores the words of `src` (4 bytes for each word of `ws`) with relaxed
/// 32-bit atomic stores, one loop over both (the compiler unrolls it; an
/// explicit four-at-a-time loop with a tail cost a 64-byte copy more
/// instructions to set up than it saved).
#[inline(always)]
fn store_whole(ws: &[AtomicU32], src: &[u8]) {
    debug_assert_eq!(src.len(), 4 * ws.len());
    for (w, b) in ws.iter().zip(src.chunks_exact(4)) {
        w.store(ne_word(b), Ordering::Relaxed);
    }
}

/// The native-endian word of the 4 bytes `b`.
#[inline(always)]
fn ne_word(b: &[u8]) -> u32 {
    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}

/// Replaces bytes `pos..pos + bytes.len()` of the word `w`, keeping the
/// others: one compare-and-swap loop.
fn merge(w: &AtomicU32, pos: usize, bytes: &[u8]) {
    let put = |old: u32| {
        let mut b = old.to_ne_bytes();
        b[pos..pos + bytes.len()].copy_from_slice(bytes);
        Some(u32::from_ne_bytes(b))
    };
    // The closure always returns `Some`: the update cannot be refused.
    let _ = w.fetch_update(Ordering::Relaxed, Ordering::Relaxed, put);
}

/// Copies from `addr` into `dst` with relaxed 32-bit atomic loads (whole
/// words; the bytes of an edge word outside the range are loaded and
/// dropped).
///
/// # Safety
/// As [`write_words`].
#[inline]
pub(crate) unsafe fn read_words(addr: VirtAddr, dst: &mut [u8]) {
    if dst.is_empty() {
        return;
    }
    // SAFETY: per the contract above.
    let ws = unsafe { words(addr.0, dst.len()) };
    let mut pos = addr.0 % 4;
    let mut done = 0;
    for w in ws {
        let n = (4 - pos).min(dst.len() - done);
        let b = w.load(Ordering::Relaxed).to_ne_bytes();
        dst[done..done + n].copy_from_slice(&b[pos..pos + n]);
        (pos, done) = (0, done + n);
    }
}

/// Whether every page of `addr..addr + len` is resident in RAM (`mincore`).
/// False for a range that is not mapped into the process, that the kernel
/// reclaimed or never faulted in, or whose end does not fit a `usize`.
/// Under Miri, which has no page tables to ask, true for any range that
/// fits. The kernel is asked 256 pages at a time, into a fixed buffer: no
/// allocation, whatever `len` is.
pub fn resident(addr: VirtAddr, len: usize) -> bool {
    let Some(end) = addr.0.checked_add(len) else {
        return false;
    };
    if cfg!(miri) || len == 0 {
        return true;
    }
    let page = PAGE_SIZE as usize;
    let mut start = addr.0 & !(page - 1);
    let mut vec = [0u8; RESIDENT_BLOCK];
    while start < end {
        let n = (end - start).min(RESIDENT_BLOCK * page);
        let pages = n.div_ceil(page);
        // SAFETY: mincore reads only the process's page tables for the
        // range (failing with ENOMEM where nothing is mapped) and writes
        // one byte per page of it into `vec`: `pages <= RESIDENT_BLOCK`.
        let r = unsafe { libc::mincore(start as *mut libc::c_void, n, vec.as_mut_ptr()) };
        if r != 0 || !vec[..pages].iter().all(|b| b & 1 == 1) {
            return false;
        }
        // `start + n <= end`: no overflow.
        start += n;
    }
    true
}

/// Pages [`resident`] asks the kernel about per `mincore` call.
const RESIDENT_BLOCK: usize = 256;

#[cfg(test)]
mod tests;
