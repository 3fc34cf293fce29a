//! What both device models do with the descriptor ring: where it is, the
//! device's head, reading a descriptor and writing back descriptor-done,
//! all through the IOMMU.

use pfrag::dma::{Fault, Translate};
use pfrag::{Iova, PAGE_SIZE};

use super::softnic::NicStats;
use crate::desc::{self, Data, Dcmd, Sta};
use crate::error::{Error, Result};

/// A model's view of the ring: its IOVA and length, and the head.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Ring {
    ring: Option<(Iova, u16)>,
    head: u16,
}

impl Ring {
    /// Points at a ring of `len` descriptors (a multiple of 8) at `ring`,
    /// which must end below the top of the IOVA space.
    pub(super) fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        if len == 0 || !len.is_multiple_of(8) {
            return Err(Error::BadConfig {
                what: "ring length (multiple of 8)",
                value: u64::from(len),
            });
        }
        let last = (u64::from(len) * desc::SIZE as u64) - 1;
        if ring.checked_add(last).is_none() {
            return Err(Error::BadConfig {
                what: "ring address (past the top of the IOVA space)",
                value: ring.raw(),
            });
        }
        self.ring = Some((ring, len));
        self.head = 0;
        Ok(())
    }

    /// Forgets the ring: a doorbell finds none until the next attach.
    pub(super) fn detach(&mut self) {
        self.ring = None;
        self.head = 0;
    }

    /// The head, once a ring is attached.
    pub(super) fn head(&self) -> Option<u16> {
        self.ring.map(|_| self.head)
    }

    /// Checks a doorbell value against the attached ring.
    pub(super) fn check(&self, tail: u16) -> Result<()> {
        let (_, n) = self.ring.ok_or(Error::NotAttached)?;
        if tail >= n {
            return Err(Error::BadConfig {
                what: "tail",
                value: u64::from(tail),
            });
        }
        Ok(())
    }

    /// The IOVA of the descriptor at the head, moving the head on; `None`
    /// once the head reached `tail` (checked with [`check`](Self::check)).
    pub(super) fn next(&mut self, tail: u16) -> Option<Iova> {
        let (base, n) = self.ring?;
        if self.head == tail {
            return None;
        }
        let at = base.offset(u64::from(self.head) * desc::SIZE as u64);
        self.head = (self.head + 1) % n;
        Some(at)
    }
}

/// Descriptors a model reads with one DMA read, as a NIC fetches
/// descriptors in bursts rather than one by one.
pub(super) const FETCH: usize = 32;

impl Ring {
    /// The run of descriptors from the head towards `tail` (checked with
    /// [`check`](Self::check)): the first one's IOVA and how many, at most
    /// [`FETCH`], none past the ring's end and none past the end of the
    /// first one's page (so that a run's one read translates one page: it
    /// faults whole, and the IOMMU counts one fault for it, as for a NIC's
    /// burst fetch), moving the head past them; `None` once the head
    /// reached `tail`.
    pub(super) fn next_run(&mut self, tail: u16) -> Option<(Iova, usize)> {
        let (base, n) = self.ring?;
        if self.head == tail {
            return None;
        }
        let end = if tail > self.head { tail } else { n };
        let at = base.offset(u64::from(self.head) * desc::SIZE as u64);
        // Whole descriptors left in the page; a descriptor that straddles
        // two pages goes alone.
        let in_page = (PAGE_SIZE - at.raw() % PAGE_SIZE) as usize / desc::SIZE;
        let len = usize::from(end - self.head).min(FETCH).min(in_page.max(1));
        self.head = ((usize::from(self.head) + len) % usize::from(n)) as u16;
        Some((at, len))
    }
}

/// Reads the `out.len()` descriptors from `at` with one read through the
/// IOMMU (page by page).
///
/// # Panics
/// If `out` holds more than [`FETCH`] descriptors.
///
/// # Safety
/// Each of them is a descriptor a doorbell handed to the device, as for
/// [`read_desc`].
pub(super) unsafe fn read_descs<T: Translate>(
    iommu: &T,
    at: Iova,
    out: &mut [[u64; 2]],
) -> Result<(), Fault> {
    assert!(
        out.len() <= FETCH,
        "a run holds at most {FETCH} descriptors"
    );
    let mut b = [0u8; desc::SIZE * FETCH];
    let len = out.len() * desc::SIZE;
    let mut n = 0;
    // SAFETY: the caller's promise covers every byte of the run, and the
    // run is whole aligned words (descriptors of 16 bytes, 16-aligned).
    unsafe {
        iommu.read(at, len, &mut |s| {
            b[n..n + s.len()].copy_from_slice(s);
            n += s.len();
        })
    }?;
    for (w, d) in out.iter_mut().zip(b[..len].chunks_exact(desc::SIZE)) {
        *w = words(d);
    }
    Ok(())
}

/// The two little-endian 64-bit words of the descriptor bytes `d`.
fn words(d: &[u8]) -> [u64; 2] {
    let q = |i: usize| u64::from_le_bytes(d[i..i + 8].try_into().expect("8 bytes"));
    [q(0), q(8)]
}

/// Reads the descriptor at `at` through the IOMMU.
///
/// # Safety
/// `at` is a descriptor a doorbell handed to the device
/// ([`TxDevice::kick`](crate::device::TxDevice::kick)'s promise).
pub(super) unsafe fn read_desc<T: Translate>(iommu: &T, at: Iova) -> Result<[u64; 2], Fault> {
    let mut b = [0u8; desc::SIZE];
    let mut n = 0;
    // SAFETY: the caller's promise covers the descriptor's bytes.
    unsafe {
        iommu.read(at, desc::SIZE, &mut |s| {
            b[n..n + s.len()].copy_from_slice(s);
            n += s.len();
        })
    }?;
    Ok(words(&b))
}

/// Writes back descriptor-done into the descriptor at `at`.
///
/// # Safety
/// As for [`read_desc`]: `at` is a descriptor handed to the device.
unsafe fn write_back<T: Translate>(iommu: &T, at: Iova) -> Result<(), Fault> {
    let at = at.offset(desc::STATUS_OFFSET as u64);
    // SAFETY: the status word lies in the descriptor the caller's promise
    // covers.
    unsafe { iommu.write_u32(at, Sta::DD.bits()) }
}

/// Writes back descriptor-done into the data descriptor `d` at `at` if it
/// asked (`RS`), counting the status word written or its fault.
///
/// # Safety
/// As for [`read_desc`]: `at` is a descriptor handed to the device.
pub(super) unsafe fn report<T: Translate>(iommu: &T, at: Iova, d: Data, stats: &mut NicStats) {
    if d.cmd().contains(Dcmd::RS) {
        // SAFETY: the caller's promise.
        match unsafe { write_back(iommu, at) } {
            Ok(()) => stats.write_backs += 1,
            Err(_) => stats.faults += 1,
        }
    }
}
