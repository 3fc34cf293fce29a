//! Chunk orders: a chunk of order `n` is `4 KiB << n` bytes.

use std::fmt;

use crate::addr::PAGE_SIZE;
use crate::error::{Error, Result};

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
}
