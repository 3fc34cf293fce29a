//! The TX hot path allocates nothing on the heap in steady state: after a
//! warm-up, sending small (inline) and TSO packets, ringing the doorbell
//! and reaping, under a strict software IOMMU and the null device model,
//! makes no allocation at all. Counted per thread (tests run in parallel) by
//! a global allocator that wraps the system one.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use pfrag::dma::{Domain, SoftIommu, SoftIommuConfig};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::model::null::NullNic;
use vfio_nic::offload::Offload;
use vfio_nic::tx;

struct Counting;

thread_local! {
    /// This thread's allocations (const-initialised, no destructor: safe
    /// to touch from inside the allocator).
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    ALLOCS.with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is passed to the system allocator unchanged; the
// counter has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract for `alloc` is passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract for `realloc` is passed on.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn headers(tcp: bool) -> Vec<u8> {
    let b = etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]).ipv4(
        [10, 0, 0, 1],
        [10, 0, 0, 2],
        64,
    );
    let mut v = Vec::new();
    if tcp {
        b.tcp(1, 2, 0, 65535).write(&mut v, &[]).unwrap();
    } else {
        b.udp(1, 2).write(&mut v, &[]).unwrap();
    }
    v
}

type Queue = tx::Queue<Arc<SoftIommu>, NullNic<Arc<SoftIommu>>>;

fn queue() -> (Pool<Arc<SoftIommu>>, Queue) {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let cfg = pool::Config::new(Order::new(4).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    // SAFETY: the device is a model on the very IOMMU object `domain` maps through.
    let q = unsafe {
        tx::Queue::new(
            domain,
            pool.clone(),
            NullNic::new(iommu),
            tx::Config::default(),
        )
    };
    (pool, q.unwrap())
}

/// Allocations made by `f`, after `f` ran once as a warm-up.
fn allocs_in(mut f: impl FnMut()) -> u64 {
    f();
    let before = ALLOCS.with(Cell::get);
    f();
    ALLOCS.with(Cell::get) - before
}

const ROUNDS: usize = if cfg!(miri) { 4 } else { 200 };

#[test]
fn small_packets_make_no_heap_allocation() {
    let (_, mut q) = queue();
    let udp = headers(false);
    let n = allocs_in(|| {
        for _ in 0..ROUNDS {
            for i in 0..32 {
                q.send(&udp, &[7u8; 22], Offload::None, i).unwrap();
            }
            q.kick().unwrap();
            assert_eq!(q.reap().unwrap(), 32);
        }
    });
    assert_eq!(n, 0);
    assert_eq!(q.stats().inline_packets, 2 * 32 * ROUNDS as u64);
}

/// TSO packets, each a whole order-4 chunk: nothing per packet. The only
/// allocations are the pool's lock-free free list taking a new block of 31
/// slots as chunks cycle through it (crossbeam's `SegQueue`).
#[test]
fn tso_packets_allocate_only_free_list_blocks() {
    let (pool, mut q) = queue();
    let tcp = headers(true);
    let big = vec![9u8; if cfg!(miri) { 9_000 } else { 65_160 }];
    let mut recycled = 0;
    let n = allocs_in(|| {
        let r = pool.stats().recycles;
        for _ in 0..ROUNDS {
            for i in 0..16 {
                q.send(&tcp, &big, Offload::Tso { mss: 1448 }, i).unwrap();
            }
            q.kick().unwrap();
            assert_eq!(q.reap().unwrap(), 16);
        }
        recycled = pool.stats().recycles - r;
    });
    let packets = 16 * ROUNDS as u64;
    assert!(
        n <= recycled.div_ceil(31) + 1,
        "{n} allocations, {recycled} chunk returns"
    );
    assert!(n * 16 <= packets, "{n} allocations for {packets} packets");
}
