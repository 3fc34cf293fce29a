//! The device's memory, as `vm-memory` (and so `virtio-queue`) sees it: the
//! IOVA space through a pfrag translation. Every access is translated page
//! by page, for the access it makes (a read-only mapping refuses a write),
//! and reaches only memory that a translation covers while the view holds
//! off every unmap ([`Hold`]).
//!
//! `vm-memory`'s own `IommuMemory` translates into a physical
//! `GuestMemoryBackend` (a VMM's guest RAM) through an IOTLB it keeps. Here
//! the translation already yields host addresses, and the IOTLB is the
//! software IOMMU's (its misses and fills are what the runs count), so the
//! view implements `GuestMemory` directly over [`Translate`].

use std::iter::FusedIterator;

use pfrag::dma::{Dir, Hold, Translate};
use pfrag::Iova;
use vm_memory::bitmap::BS;
use vm_memory::guest_memory::{Error, GuestMemorySliceIterator, Result};
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryMmap, Permissions, VolatileSlice};

/// The IOVA space through `T`, while unmaps wait; see the module docs.
pub(crate) struct IoView<'a, T: Translate> {
    iommu: &'a T,
    _hold: Hold<'a>,
}

impl<'a, T: Translate> IoView<'a, T> {
    /// A view of what `iommu` maps, holding off its unmaps until dropped.
    ///
    /// # Safety
    /// Every access made through the view (by whatever code it is handed
    /// to) touches only memory handed to the device
    /// ([`TxDevice::kick`](crate::device::TxDevice::kick)'s promise, which
    /// counts the whole aligned 4-byte words that hold it): no CPU
    /// reference touches it meanwhile, other than
    /// [`Coherent`](pfrag::dma::Coherent)'s atomic accessors, and none of
    /// another size than the device's atomic accesses to the same bytes.
    /// The thread that holds the view does not unmap through `iommu`
    /// meanwhile ([`Hold`]).
    pub(crate) unsafe fn new(iommu: &'a T) -> Self {
        IoView {
            iommu,
            // SAFETY: our caller does not unmap through `iommu` on this
            // thread while the view lives, and the view makes no
            // `read`/`write` (only `translate`).
            _hold: unsafe { iommu.hold() },
        }
    }
}

fn dir(access: Permissions) -> Dir {
    match access {
        Permissions::No => Dir::empty(),
        Permissions::Read => Dir::TO_DEVICE,
        Permissions::Write => Dir::FROM_DEVICE,
        Permissions::ReadWrite => Dir::BIDIRECTIONAL,
    }
}

/// The translated pieces of one access, each inside one page.
pub(crate) struct Slices<'b, T: Translate> {
    iommu: &'b T,
    at: u64,
    left: usize,
    dir: Dir,
    failed: bool,
}

impl<'b, T: Translate> Iterator for Slices<'b, T> {
    type Item = Result<VolatileSlice<'b, ()>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.left == 0 {
            return None;
        }
        let Ok(t) = self.iommu.translate(Iova(self.at), self.dir) else {
            self.failed = true;
            return Some(Err(Error::InvalidGuestAddress(GuestAddress(self.at))));
        };
        let n = usize::try_from(t.len).unwrap_or(usize::MAX).min(self.left);
        if n == 0 {
            // `Translate` promises at least one byte; a fault otherwise,
            // never a loop.
            self.failed = true;
            return Some(Err(Error::InvalidGuestAddress(GuestAddress(self.at))));
        }
        let Some(next) = self.at.checked_add(n as u64) else {
            self.failed = true;
            return Some(Err(Error::GuestAddressOverflow));
        };
        self.at = next;
        self.left -= n;
        // SAFETY: `t` covers `n` bytes of one page whose mapping is present
        // now, so the memory is allocated: the mapper's `unsafe map` caller
        // keeps it so until an unmap removed the translation, and that
        // unmap does not return while the view's `Hold` is alive, which
        // outlives `'b` (the slice borrows the view). The view's maker
        // promised that nothing but volatile or same-size atomic accesses
        // touch these bytes meanwhile (they are the device's).
        Some(Ok(unsafe { VolatileSlice::new(t.addr.0 as *mut u8, n) }))
    }
}

impl<T: Translate> FusedIterator for Slices<'_, T> {}

impl<'b, T: Translate> GuestMemorySliceIterator<'b, ()> for Slices<'b, T> {}

impl<T: Translate> GuestMemory for IoView<'_, T> {
    /// Unused: there is no physical memory behind the view, only
    /// translations.
    type PhysicalMemory = GuestMemoryMmap<()>;
    type Bitmap = ();

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        self.get_slices(addr, count, access)
            .is_ok_and(|mut s| s.all(|r| r.is_ok()))
    }

    fn get_slices<'b>(
        &'b self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> Result<impl GuestMemorySliceIterator<'b, BS<'b, ()>>> {
        Ok(Slices {
            iommu: self.iommu,
            at: addr.0,
            left: count,
            dir: dir(access),
            failed: false,
        })
    }
}
