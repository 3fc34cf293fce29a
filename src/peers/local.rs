//! The in-process rows of the peers table: pfrag's frag cache (one frag,
//! a bulk of 32, 32 single frags), and the Rust peers: a
//! `crossbeam_queue::ArrayQueue` free list and the `ixgbe-driver` crate's
//! `MemPool`.

use std::alloc::Layout;
use std::hint::black_box;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use ixgbe_driver::{alloc_pkt, IxgbeHal, MemPool, PhysAddr};
use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::frag::FragCache;
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;

use super::bench::{Harness, Timing};

/// Objects per bulk operation (DPDK's usual burst).
pub const BURST: usize = 32;
/// Frag size of the single-frag row (one MSS of payload).
pub const SINGLE_LEN: usize = 1448;
/// Frag size of the bulk rows.
pub const BULK_LEN: usize = 1024;
/// Objects in each peer's pool.
const POOL_OBJECTS: usize = 4096;

/// A frag cache over a persistent order-4 pool under a strict software
/// IOMMU: the configuration whose steady state makes no map calls.
fn cache() -> Result<FragCache<SoftIommu>, pfrag::Error> {
    let iommu = SoftIommu::new(SoftIommuConfig::default())?;
    let pool = Pool::new(
        Arc::new(Domain::new(iommu)),
        pool::Config::new(Order::new(4)?, Policy::Persistent),
    )?;
    Ok(FragCache::new(pool))
}

/// pfrag: `refill(1448)` and completion on the owning thread.
pub fn pfrag_single(h: &Harness) -> Result<Timing, pfrag::Error> {
    let mut c = cache()?;
    h.try_time(1, |iters| {
        for _ in 0..iters {
            let f = c.refill(black_box(SINGLE_LEN), false)?;
            black_box(f.iova());
            c.complete(f)?;
        }
        Ok(())
    })
}

/// pfrag: `refill_bulk(1024, 32)` and `complete_burst` on the owning
/// thread; per frag.
pub fn pfrag_bulk(h: &Harness) -> Result<Timing, pfrag::Error> {
    let mut c = cache()?;
    let mut v = Vec::with_capacity(BURST);
    h.try_time(BURST as u64, |iters| {
        for _ in 0..iters {
            c.refill_bulk(black_box(BULK_LEN), BURST, &mut v)?;
            black_box(v.last().map(|f| f.iova()));
            c.complete_burst(v.drain(..))?;
        }
        Ok(())
    })
}

/// pfrag: 32 single `refill(1024)` calls and one `complete_burst` on the
/// owning thread; per frag. The burst as a driver without the bulk call
/// would write it.
pub fn pfrag_burst_of_singles(h: &Harness) -> Result<Timing, pfrag::Error> {
    let mut c = cache()?;
    let mut v = Vec::with_capacity(BURST);
    h.try_time(BURST as u64, |iters| {
        for _ in 0..iters {
            for _ in 0..BURST {
                v.push(c.refill(black_box(BULK_LEN), false)?);
            }
            black_box(v.last().map(|f| f.iova()));
            c.complete_burst(v.drain(..))?;
        }
        Ok(())
    })
}

/// A free list of buffer indices in a `crossbeam_queue::ArrayQueue`:
/// one pop and push per object, or 32 pops then 32 pushes.
pub fn array_queue(h: &Harness, burst: usize) -> Timing {
    let q = ArrayQueue::new(POOL_OBJECTS);
    for i in 0..POOL_OBJECTS {
        q.push(i).expect("room for every index");
    }
    let mut held = [0usize; BURST];
    let n = burst.clamp(1, BURST);
    h.time(n as u64, |iters| {
        for _ in 0..iters {
            for slot in held.iter_mut().take(n) {
                *slot = q.pop().expect("the list holds every index");
            }
            black_box(held[n - 1]);
            for &i in held.iter().take(n) {
                q.push(i).expect("room for what was popped");
            }
        }
    })
}

/// The `ixgbe-driver` crate's `MemPool` with `alloc_pkt` and the packet's
/// drop: one packet buffer out and back, or 32.
pub fn ixgbe_mempool(h: &Harness, burst: usize) -> Result<Timing, String> {
    let pool = MemPool::allocate::<HeapHal>(POOL_OBJECTS, 2048).map_err(|e| format!("{e:?}"))?;
    let n = burst.clamp(1, BURST);
    let mut held = Vec::with_capacity(BURST);
    let mut failed = false;
    let t = h.time(n as u64, |iters| {
        for _ in 0..iters {
            for _ in 0..n {
                match alloc_pkt(&pool, 64) {
                    Some(p) => held.push(p),
                    None => failed = true,
                }
            }
            black_box(held.last().map(|p| p.get_phys_addr()));
            held.clear();
        }
    });
    if failed {
        return Err("alloc_pkt ran dry".into());
    }
    Ok(t)
}

/// The `ixgbe-driver` HAL for a pool in ordinary heap memory, with
/// physical addresses equal to virtual ones (no device is attached: only
/// the pool's bookkeeping is measured).
struct HeapHal;

const HAL_ALIGN: usize = 4096;

// SAFETY: `dma_alloc` returns a fresh, zeroed, page-aligned heap
// allocation of `size` bytes that nothing else aliases; `dma_dealloc` frees
// exactly what `dma_alloc` returned, with the same layout. No MMIO is
// mapped (the MMIO conversions are identities and are never called by the
// pool).
unsafe impl IxgbeHal for HeapHal {
    fn dma_alloc(size: usize) -> (PhysAddr, NonNull<u8>) {
        let layout = Layout::from_size_align(size.max(1), HAL_ALIGN).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let p = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        (p.as_ptr() as PhysAddr, p)
    }

    unsafe fn dma_dealloc(_paddr: PhysAddr, vaddr: NonNull<u8>, size: usize) -> i32 {
        let layout = Layout::from_size_align(size.max(1), HAL_ALIGN).expect("valid layout");
        // SAFETY: the caller passes what `dma_alloc` returned for `size`,
        // which allocated with this layout.
        unsafe { std::alloc::dealloc(vaddr.as_ptr(), layout) };
        0
    }

    unsafe fn mmio_phys_to_virt(paddr: PhysAddr, _size: usize) -> NonNull<u8> {
        NonNull::new(paddr as *mut u8).expect("a non-null address")
    }

    unsafe fn mmio_virt_to_phys(vaddr: NonNull<u8>, _size: usize) -> PhysAddr {
        vaddr.as_ptr() as PhysAddr
    }

    fn wait_until(duration: Duration) -> Result<(), &'static str> {
        std::thread::sleep(duration);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick() -> Harness {
        Harness {
            reps: 1,
            target: Duration::from_millis(1),
        }
    }

    #[test]
    fn every_local_row_runs() {
        let h = quick();
        for t in [
            pfrag_single(&h).unwrap(),
            pfrag_bulk(&h).unwrap(),
            pfrag_burst_of_singles(&h).unwrap(),
            array_queue(&h, 1),
            array_queue(&h, BURST),
            ixgbe_mempool(&h, 1).unwrap(),
            ixgbe_mempool(&h, BURST).unwrap(),
        ] {
            assert!(t.median > 0.0, "{t:?}");
        }
    }
}
