//! Newtypes for the address spaces and sizes pfrag deals in.

use std::fmt;

/// Size of the base page (4 KiB) that IOMMU page tables map.
pub const PAGE_SIZE: u64 = 4096;
/// Shift of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;
/// Size of a 2 MiB huge page / IOMMU superpage.
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

/// An I/O virtual address: what a device puts on the bus.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Iova(pub u64);

impl Iova {
    /// The raw value.
    #[inline]
    pub const fn raw(self) -> u64 {
        self.0
    }
    /// `self + off`, or `None` on overflow.
    #[inline]
    pub fn checked_add(self, off: u64) -> Option<Iova> {
        self.0.checked_add(off).map(Iova)
    }
    /// `self + off`, wrapping (callers have checked the range).
    #[inline]
    pub const fn offset(self, off: u64) -> Iova {
        Iova(self.0.wrapping_add(off))
    }
    /// The 4 KiB page number.
    #[inline]
    pub const fn page(self) -> u64 {
        self.0 >> PAGE_SHIFT
    }
}

impl fmt::Debug for Iova {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Iova({:#x})", self.0)
    }
}

impl fmt::Display for Iova {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A host virtual address in this process.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct VirtAddr(pub usize);

impl VirtAddr {
    /// The raw value.
    #[inline]
    pub const fn raw(self) -> usize {
        self.0
    }
    /// `self + off`, wrapping (callers have checked the range).
    #[inline]
    pub const fn offset(self, off: usize) -> VirtAddr {
        VirtAddr(self.0.wrapping_add(off))
    }
}

impl fmt::Debug for VirtAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VirtAddr({:#x})", self.0)
    }
}

/// Rounds `v` up to a multiple of the power of two `align`. The caller has
/// checked that the result fits (else [`checked_align_up`]).
pub(crate) const fn align_up(v: u64, align: u64) -> u64 {
    (v + align - 1) & !(align - 1)
}

/// Rounds `v` up to a multiple of the power of two `align`, or `None` if
/// the result does not fit a `u64`.
#[inline]
pub(crate) const fn checked_align_up(v: u64, align: u64) -> Option<u64> {
    match v.checked_add(align - 1) {
        Some(x) => Some(x & !(align - 1)),
        None => None,
    }
}

/// Rounds `v` down to a multiple of the power of two `align`.
pub(crate) const fn align_down(v: u64, align: u64) -> u64 {
    v & !(align - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_helpers() {
        assert_eq!(align_up(1, 4096), 4096);
        assert_eq!(align_up(4096, 4096), 4096);
        assert_eq!(align_down(8191, 4096), 4096);
        assert_eq!(checked_align_up(4097, 4096), Some(8192));
        assert_eq!(checked_align_up(u64::MAX - 4094, 4096), None);
        assert_eq!(
            checked_align_up(u64::MAX - 4095, 4096),
            Some(u64::MAX - 4095)
        );
    }
}
