//! Device access through a translation, fenced against unmaps.
//!
//! A device model reaches memory only through [`device_read`] and
//! [`device_write`]: each piece of an access is translated and touched while
//! a read guard of the mapper's [`Fence`] is held, and a mapper's unmap (or
//! flush) calls [`Fence::quiesce`] after the translation is gone and before
//! it returns. So when an unmap returns, no device access through the old
//! translation is still running, and the caller may free the memory.
//!
//! The translations themselves only ever cover memory whose mapping was
//! installed by an `unsafe` [`DmaMapper::map`](super::DmaMapper::map), whose
//! caller promised the memory stays allocated until that unmap (and its
//! flush) completed. That promise plus this fence is the whole soundness
//! argument of the device side.

use std::sync::{RwLock, RwLockReadGuard};

use super::{Dir, Fault, Translation};
use crate::addr::{Iova, VirtAddr};
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
}

/// Bytes a device read hands its reader at once (a copy, on the stack).
const READ_PIECE: usize = 512;

fn fault(iova: Iova, access: Dir) -> Fault {
    Fault { iova, access }
}

/// Reads `len` bytes at `iova` through `translate`, handing `f` copies of
/// them in pieces, each within one translated page. Used by the mappers' [`Translate::read`](super::Translate::read).
///
/// # Safety
/// The `len` bytes at `iova` are handed to the device: no CPU reference to
/// them is used during the call ([`Translate`](super::Translate)'s Safety).
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
        // Copied out word by word with atomic loads, never lent as a
        // reference: a `Coherent` word the CPU writes meanwhile (with its
        // own 32-bit atomics) is then no data race.
        let mut buf = [0u8; READ_PIECE];
        let mut p = 0;
        while p < n {
            let m = (n - p).min(READ_PIECE);
            // SAFETY: `t` covers `n` bytes of one page whose mapping is
            // present now (the mapper just translated it), so the page is
            // allocated: the mapper's `unsafe map` caller keeps it so until
            // an unmap (and flush) removed the translation, and that unmap
            // waits in `quiesce` for this guard. The words touched lie in
            // that page (it is 4 KiB aligned). CPU accesses to those bytes
            // meanwhile are `Coherent`'s 32-bit atomics; other CPU memory
            // (frags, regions) no reference touches during this call: our
            // caller promised so (the bytes are handed to the device).
            unsafe { mem::read_words(VirtAddr(t.addr.0 + p), &mut buf[..m]) };
            f(&buf[..m]);
            p += m;
        }
        off += n;
    }
    Ok(())
}

/// Writes `src` at `iova` through `translate`, page by page. Used by the
/// mappers' [`Translate::write`](super::Translate::write).
///
/// # Safety
/// As for [`device_read`], for the `src.len()` bytes at `iova`.
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
        // SAFETY: as in `device_read`; the translation allows writes, and
        // the words are written with 32-bit atomics (the edge words by
        // compare-and-swap), as `Coherent`'s CPU accesses are.
        unsafe { mem::write_words(t.addr, &src[off..off + n]) };
        off += n;
    }
    Ok(())
}

/// Stores the 32-bit word `v` at `iova` through `translate` with one atomic
/// release store: a device's descriptor write-back, which the driver polls
/// while the device runs (on a thread of its own). `iova` must be 4-byte
/// aligned (a translation keeps the page offset, so the address is too).
///
/// # Safety
/// As for [`device_read`], for the 4 bytes at `iova`.
pub(crate) unsafe fn device_store_u32(
    fence: &Fence,
    translate: impl FnOnce(Iova, Dir) -> Result<Translation, Fault>,
    iova: Iova,
    v: u32,
) -> Result<(), Fault> {
    if iova.raw() % 4 != 0 {
        return Err(fault(iova, Dir::FROM_DEVICE));
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
