//! Latency injection for the software IOMMU
//! ([`SoftIommuConfig::inject`](super::SoftIommuConfig::inject)): the cost
//! model's time for each operation, spun on the thread that would wait for
//! the hardware (the driver for map, unmap and the synchronous
//! invalidation; the device for the page walk after an IOTLB miss), after
//! the IOMMU's lock is released so that the other side is not held up.
//! It is a model, not a measurement of any IOMMU.

use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    /// Modelled ns this thread owes, paid when its IOMMU call returns.
    static DEBT: Cell<f64> = const { Cell::new(0.0) };
}

/// Adds `ns` to the calling thread's debt.
pub(crate) fn owe(ns: f64) {
    DEBT.with(|d| d.set(d.get() + ns));
}

/// Spins the calling thread for the debt it ran up, and clears it.
pub(crate) fn pay() {
    let ns = DEBT.with(|d| d.replace(0.0));
    if ns < 1.0 {
        return;
    }
    let until = Duration::from_nanos(ns as u64);
    let t0 = Instant::now();
    while t0.elapsed() < until {
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_debt_is_paid_once() {
        owe(2_000.0);
        owe(1_000.0);
        let t0 = Instant::now();
        pay();
        assert!(t0.elapsed() >= Duration::from_nanos(3_000));
        assert_eq!(DEBT.with(|d| d.get()), 0.0);
    }
}
