//! What both device models do with the descriptor ring: where it is, the
//! device's head, reading a descriptor and writing back descriptor-done,
//! all through the IOMMU.

use pfrag::dma::{Fault, Translate};
use pfrag::Iova;

use crate::desc::{self, Sta};
use crate::error::{Error, Result};

/// A model's view of the ring: its IOVA and length, and the head.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Ring {
    ring: Option<(Iova, u16)>,
    head: u16,
}

impl Ring {
    /// Points at a ring of `len` descriptors (a multiple of 8) at `ring`.
    pub(super) fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        if len == 0 || !len.is_multiple_of(8) {
            return Err(Error::BadConfig {
                what: "ring length (multiple of 8)",
                value: u64::from(len),
            });
        }
        self.ring = Some((ring, len));
        self.head = 0;
        Ok(())
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
    let w = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    Ok([w(0), w(8)])
}

/// Writes back descriptor-done into the descriptor at `at`.
///
/// # Safety
/// As for [`read_desc`]: `at` is a descriptor handed to the device.
pub(super) unsafe fn write_back<T: Translate>(iommu: &T, at: Iova) -> Result<(), Fault> {
    let at = at.offset(desc::STATUS_OFFSET as u64);
    // SAFETY: the status word lies in the descriptor the caller's promise
    // covers.
    unsafe { iommu.write_u32(at, Sta::DD.bits()) }
}
