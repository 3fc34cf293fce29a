//! Newtypes for the address spaces and sizes pfrag deals in.

use std::fmt;

use crate::error::{Error, Result};

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
    pub const fn raw(self) -> u64 {
        self.0
    }
    /// `self + off`, or `None` on overflow.
    pub fn checked_add(self, off: u64) -> Option<Iova> {
        self.0.checked_add(off).map(Iova)
    }
    /// `self + off`, wrapping (callers have checked the range).
    pub const fn offset(self, off: u64) -> Iova {
        Iova(self.0.wrapping_add(off))
    }
    /// The 4 KiB page number.
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
    pub const fn raw(self) -> usize {
        self.0
    }
    /// `self + off`, wrapping (callers have checked the range).
    pub const fn offset(self, off: usize) -> VirtAddr {
        VirtAddr(self.0.wrapping_add(off))
    }
}

impl fmt::Debug for VirtAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VirtAddr({:#x})", self.0)
    }
}

/// A chunk order: a chunk of order `n` is `4 KiB << n` bytes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Order(u8);

impl Order {
    /// The largest order (2 MiB chunks).
    pub const MAX: u32 = 9;

    /// Checks `order` against [`Order::MAX`].
    pub fn new(order: u32) -> Result<Order> {
        if order > Self::MAX {
            return Err(Error::BadOrder {
                order,
                max: Self::MAX,
            });
        }
        Ok(Order(order as u8))
    }
    /// The order as a number.
    pub const fn get(self) -> u32 {
        self.0 as u32
    }
    /// Bytes in one chunk of this order.
    pub const fn size(self) -> usize {
        (PAGE_SIZE as usize) << self.0
    }
    /// 4 KiB pages in one chunk of this order.
    pub const fn pages(self) -> usize {
        1 << self.0
    }
}

impl TryFrom<u32> for Order {
    type Error = Error;
    fn try_from(v: u32) -> Result<Order> {
        Order::new(v)
    }
}

impl From<Order> for u32 {
    fn from(o: Order) -> u32 {
        o.get()
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Rounds `v` up to a multiple of the power of two `align`.
pub(crate) const fn align_up(v: u64, align: u64) -> u64 {
    (v + align - 1) & !(align - 1)
}

/// Rounds `v` down to a multiple of the power of two `align`.
pub(crate) const fn align_down(v: u64, align: u64) -> u64 {
    v & !(align - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_round_trips_and_rejects_ten() {
        for o in 0..=Order::MAX {
            let order = Order::try_from(o).unwrap();
            assert_eq!(u32::from(order), o);
            assert_eq!(order.size(), 4096 << o);
            assert_eq!(order.pages(), 1 << o);
        }
        match Order::new(10) {
            Err(Error::BadOrder { order: 10, max: 9 }) => {}
            other => panic!("expected BadOrder, got {other:?}"),
        }
    }

    #[test]
    fn align_helpers() {
        assert_eq!(align_up(1, 4096), 4096);
        assert_eq!(align_up(4096, 4096), 4096);
        assert_eq!(align_down(8191, 4096), 4096);
    }
}
