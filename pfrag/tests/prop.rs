//! Property tests: random sequences of refill / complete over orders,
//! policies and sizes.

use std::sync::Arc;

use pfrag::dma::{Domain, Invalidation, SoftIommu, SoftIommuConfig, Translate};
use pfrag::frag::{Frag, FragCache};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// Allocate a payload of this many bytes, fit-whole or not.
    Alloc(usize, bool),
    /// Complete the live payload at this index (mod live count).
    Complete(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // Under Miri every byte is interpreted: smaller payloads, same paths
        // (still past a 4 KiB chunk).
        3 => (1usize..if cfg!(miri) { 9_000 } else { 70_000 }, any::<bool>())
            .prop_map(|(l, f)| Op::Alloc(l, f)),
        2 => any::<usize>().prop_map(Op::Complete),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::PerFrag),
        Just(Policy::PerChunk),
        Just(Policy::Persistent)
    ]
}

fn stamp(tag: u32, i: usize) -> u8 {
    (tag.wrapping_mul(31).wrapping_add(i as u32 * 7) >> 1) as u8
}

/// Reads the frag through the IOMMU, page by page, as a device would.
fn device_read(m: &SoftIommu, f: &Frag<SoftIommu>) -> Vec<u8> {
    let mut out = Vec::with_capacity(f.len());
    // SAFETY: `f` is borrowed shared for the call, so no `&mut` to its
    // bytes is alive, and nothing writes them.
    unsafe { m.read(f.iova(), f.len(), &mut |s| out.extend_from_slice(s)) }
        .expect("live frag lies in a mapped range");
    out
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 4 } else { 48 },
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_refill_complete_sequences_hold_the_invariants(
        order in 0u32..=4,
        policy in policy(),
        lazy in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..if cfg!(miri) { 16 } else { 120 }),
    ) {
        let inv = if lazy { Invalidation::Lazy } else { Invalidation::Strict };
        let domain = Arc::new(Domain::new(SoftIommu::new(SoftIommuConfig {
            invalidation: inv,
            flush_queue: 8,
            ..SoftIommuConfig::default()
        }).unwrap()));
        let mut cfg = pool::Config::new(Order::new(order).unwrap(), policy);
        cfg.grow_batch = 4;
        cfg.high_watermark = 6;
        let pool = Pool::new(domain.clone(), cfg).unwrap();
        let mut cache = FragCache::new(pool.clone());
        let mut live: Vec<(u32, Vec<Frag<SoftIommu>>)> = Vec::new();
        let mut tag = 0u32;
        let mut asked = 0u64;
        for op in ops {
            match op {
                Op::Alloc(len, fit) => {
                    let mut v = Vec::new();
                    cache.frags(len, fit, &mut v).unwrap();
                    asked += len as u64;
                    prop_assert_eq!(v.iter().map(|f| f.len()).sum::<usize>(), len);
                    let mut i = 0;
                    for f in v.iter_mut() {
                        prop_assert_eq!(f.addr().raw() % 64, 0);
                        for b in f.as_mut_slice() {
                            *b = stamp(tag, i);
                            i += 1;
                        }
                    }
                    live.push((tag, v));
                    tag += 1;
                }
                Op::Complete(i) if !live.is_empty() => {
                    let n = live.len();
                    live.swap_remove(i % n);
                }
                Op::Complete(_) => {}
            }
            // No two live frags overlap, in host memory or in IOVA space.
            let mut host: Vec<(usize, usize)> = Vec::new();
            let mut dev: Vec<(u64, u64)> = Vec::new();
            for (_, v) in &live {
                for f in v {
                    host.push((f.addr().raw(), f.addr().raw() + f.len()));
                    dev.push((f.iova().raw(), f.iova().raw() + f.len() as u64));
                }
            }
            host.sort_unstable();
            dev.sort_unstable();
            for w in host.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "host overlap {:x?}", w);
            }
            for w in dev.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "iova overlap {:x?}", w);
            }
        }
        // Every live frag is mapped, and every byte written reaches the
        // device intact.
        for (t, v) in &live {
            let mut i = 0;
            for f in v {
                let got = device_read(domain.mapper(), f);
                for b in got {
                    prop_assert_eq!(b, stamp(*t, i));
                    i += 1;
                }
            }
        }
        // Bytes in = bytes out: what the cache handed out is what was asked.
        prop_assert_eq!(cache.stats().bytes, asked);
        drop(live);
        drop(cache);
        // Everything came back: nothing is mapped outside the pool's chunks.
        let st = pool.stats();
        match policy {
            Policy::Persistent => prop_assert_eq!(st.mapped_bytes, st.chunks * Order::new(order).unwrap().size() as u64),
            _ => prop_assert_eq!(st.mapped_bytes, 0),
        }
        prop_assert_eq!(st.unmap_errors, 0);
        prop_assert_eq!(st.pinned, 0);
        // Under lazy invalidation some wait for their flush before reuse.
        prop_assert_eq!((pool.free_chunks() + pool.parked_chunks()) as u64, st.chunks);
    }
}
