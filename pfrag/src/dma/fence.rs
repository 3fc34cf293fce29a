//! Device access through a translation, fenced against unmaps.
//!
//! A device model reaches memory only through [`device_read`] and
//! [`device_write`]: each piece of an access is translated and touched while
//! a read guard of the mapper's [`Fence`] is held, and a mapper's unmap (or
//! flush) calls [`Fence::quiesce`] after the translation is gone and before
//! it returns. So when an unmap returns, no device access through the old
//! translation is still running, and the caller may free the memory. A
//! lazy mapper makes a flush generation visible
//! ([`flushed_seq`](super::DmaMapper::flushed_seq)) only after that wait
//! too, since a caller that sees it frees the memory.
//!
//! The translations themselves only ever cover memory whose mapping was
//! installed by an `unsafe` [`DmaMapper::map`](super::DmaMapper::map), whose
//! caller promised the memory stays allocated until that unmap (and its
//! flush) completed. That promise plus this fence is the whole soundness
//! argument of the device side.

use std::sync::{RwLock, RwLockReadGuard};

use super::{Dir, Fault, Translation};
use crate::addr::Iova;
use crate::mem;

/// Device accesses in progress; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Fence(RwLock<()>);

impl Fence {
    /// Waits until every device access that started before has ended.
    /// Mappers call it after removing a translation (and its IOTLB
    /// entries), without holding their own locks.
    pub(crate) fn quiesce(&self) {
        drop(self.0.write().unwrap_or_else(|p| p.into_inner()));
    }

    fn enter(&self) -> RwLockReadGuard<'_, ()> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    /// A [`Hold`] on this fence.
    pub(crate) fn hold(&self) -> Hold<'_> {
        Hold(self.enter())
    }
}

/// Keeps every unmap (and flush) of the [`Translate`](super::Translate)
/// it came from ([`Translate::hold`](super::Translate::hold)) from
/// returning while it is alive, so memory that a translation made
/// meanwhile points at stays allocated until it drops: what a device model
/// needs to reach translated memory through addresses of its own (a
/// `vm-memory` view, as virtio device code expects), where
/// [`read`](super::Translate::read) and [`write`](super::Translate::write)
/// enter the fence per access.
///
/// While it is alive, the thread holding it must not unmap or flush
/// through that mapper (directly, or by dropping a pool or queue): the
/// unmap would wait for this hold forever. Nor may it map through the
/// mapper's [`Domain`](super::Domain) (a pool growing included), which
/// flushes when the IOVA space runs out while ranges wait for a flush, and
/// unmaps what a failed batch installed. Nor should it call
/// [`read`](super::Translate::read) or [`write`](super::Translate::write)
/// of the same mapper, which may wait behind an unmap that waits for it.
/// Taking one is `unsafe` for that reason:
///
/// ```compile_fail,E0133
/// use pfrag::dma::{Identity, Translate};
///
/// let iommu = Identity::new();
/// let _held = iommu.hold(); // needs `unsafe`
/// ```
#[derive(Debug)]
#[must_use = "the fence is released as soon as the hold drops"]
pub struct Hold<'a>(#[allow(dead_code)] RwLockReadGuard<'a, ()>);

fn fault(iova: Iova, access: Dir) -> Fault {
    Fault { iova, access }
}

/// Reads `len` bytes at `iova` through `translate`, handing `f` one piece
/// per translated page. Used by the mappers' [`Translate::read`](super::Translate::read).
///
/// # Safety
/// Nothing writes the aligned 4-byte words that hold the `len` bytes at
/// `iova` during the call ([`Translate`](super::Translate)'s Safety): `f`
/// is lent the bytes as `&[u8]`, and a [`Coherent`](super::Coherent) write
/// to a neighbouring byte of the same word would rewrite it whole.
pub(crate) unsafe fn device_read(
    fence: &Fence,
    mut translate: impl FnMut(Iova, Dir) -> Result<Translation, Fault>,
    iova: Iova,
    len: usize,
    f: &mut dyn FnMut(&[u8]),
) -> Result<(), Fault> {
    let mut off = 0usize;
    while off < len {
        let at = iova
            .checked_add(off as u64)
            .ok_or(fault(iova, Dir::TO_DEVICE))?;
        let _in = fence.enter();
        let t = translate(at, Dir::TO_DEVICE)?;
        let n = usize::try_from(t.len).unwrap_or(usize::MAX).min(len - off);
        // SAFETY: `t` covers `n` bytes of one page whose mapping is present
        // now (the mapper just translated it), so the memory is allocated:
        // the mapper's `unsafe map` caller keeps it so until an unmap (and
        // flush) removed the translation, and that unmap waits in
        // `quiesce` for this guard, which outlives the slice (it lives only
        // during `f`). Nothing writes the bytes meanwhile: our caller's
        // promise, which covers the whole words that hold them (a
        // `Coherent` write rewrites whole words). Concurrent reads, atomic
        // (`Coherent`) or not, are no data race.
        f(unsafe { mem::slice(t.addr, n) });
        off += n;
    }
    Ok(())
}

/// Writes `src` at `iova` through `translate`, page by page. Used by the
/// mappers' [`Translate::write`](super::Translate::write).
///
/// # Safety
/// No CPU access touches the aligned 4-byte words that hold the
/// `src.len()` bytes at `iova` during the call, other than
/// [`Coherent`](super::Coherent)'s 32-bit atomics: a range that starts or
/// ends inside a word rewrites that whole word.
pub(crate) unsafe fn device_write(
    fence: &Fence,
    mut translate: impl FnMut(Iova, Dir) -> Result<Translation, Fault>,
    iova: Iova,
    src: &[u8],
) -> Result<(), Fault> {
    let mut off = 0usize;
    while off < src.len() {
        let at = iova
            .checked_add(off as u64)
            .ok_or(fault(iova, Dir::FROM_DEVICE))?;
        let _in = fence.enter();
        let t = translate(at, Dir::FROM_DEVICE)?;
        let n = usize::try_from(t.len)
            .unwrap_or(usize::MAX)
            .min(src.len() - off);
        // SAFETY: the page is allocated, as in `device_read`, and the
        // translation allows writes. The words are written with 32-bit
        // atomics (the edge words, bytes outside the range included, by
        // compare-and-swap), and the only CPU accesses to those whole
        // words meanwhile are `Coherent`'s 32-bit atomics (our caller's
        // promise): no data race.
        unsafe { mem::write_words(t.addr, &src[off..off + n]) };
        off += n;
    }
    Ok(())
}

/// Stores the 32-bit word `v` at `iova` through `translate` with one atomic
/// release store: a device's descriptor write-back, which the driver polls
/// while the device runs (on a thread of its own). `iova` must be 4-byte
/// aligned (a translation keeps the page offset, so the address is too):
/// an unaligned one is refused here, the one place that checks, with the
/// fault `unaligned` makes of it (where the mapper counts it), before
/// any translation.
///
/// # Safety
/// As for [`device_write`], for the 4 bytes at `iova`.
pub(crate) unsafe fn device_store_u32(
    fence: &Fence,
    translate: impl FnOnce(Iova, Dir) -> Result<Translation, Fault>,
    unaligned: impl FnOnce(Fault) -> Fault,
    iova: Iova,
    v: u32,
) -> Result<(), Fault> {
    if iova.raw() % 4 != 0 {
        return Err(unaligned(fault(iova, Dir::FROM_DEVICE)));
    }
    let _in = fence.enter();
    let t = translate(iova, Dir::FROM_DEVICE)?;
    if t.len < 4 {
        return Err(fault(iova, Dir::FROM_DEVICE));
    }
    // SAFETY: as in `device_write`: the 4 bytes lie in one page whose
    // mapping is present and allows writes, so the memory is allocated
    // until the fence guard drops; the address is 4-byte aligned (the
    // IOVA is, and translation keeps the page offset); and the caller
    // promised no CPU reference touches the word meanwhile (a driver
    // polls it with `Coherent::read_u32`, an atomic load).
    unsafe { mem::store_u32_release(t.addr, v) };
    Ok(())
}
