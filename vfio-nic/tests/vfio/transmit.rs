use super::*;

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn tx_tso_and_small_packets_at_every_order_and_policy() {
    let (domain, mut nic) = open();
    let avail0 = domain.mapper().dma_avail().unwrap();
    let mut wire = 0;
    for order in 0..=4 {
        for policy in Policy::ALL {
            let pool = Pool::new(
                domain.clone(),
                pool::Config::new(Order::new(order).unwrap(), policy),
            )
            .unwrap();
            let before = nic.stats().unwrap().good_packets;
            let cfg = txcfg(header_for(policy));
            // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
            let mut q = unsafe { tx::Queue::new(domain.clone(), pool.clone(), nic, cfg) }.unwrap();
            let mut g = traffic(3);
            let sizes = [65_160usize, 200, 3_000, 1_448, 64_000, 60];
            let (mut frames, mut packets) = (0, 0);
            for (i, &len) in sizes.iter().cycle().take(24).enumerate() {
                if let Err(e) = send(&mut q, &mut g, i % 3, len) {
                    panic!("order {order} {policy:?}: {e}");
                }
                frames += segments(len);
                packets += 1;
            }
            q.kick().unwrap();
            q.wait(WAIT).unwrap();
            assert_eq!(q.stats().completed, 24);
            nic = q.into_device().unwrap();
            // The 82576 counts each TSO segment; QEMU's model counts each
            // packet once. Either way every packet went out.
            let sent = nic.stats().unwrap().good_packets - before;
            assert!(
                sent == frames || sent == packets,
                "order {order} {policy:?}: device counted {sent} frames, sent {packets} packets of {frames} segments"
            );
            wire += frames;
            drop(pool);
        }
    }
    expect_on_wire(wire);
    assert_eq!(
        domain.mapper().dma_avail().unwrap(),
        avail0,
        "every mapping was undone"
    );
}

/// Sets `dma_entry_limit` for the containers opened while it lives and
/// puts the old value back on drop (also when the test fails).
pub(super) struct Limit(u32);

impl Limit {
    pub(super) fn set(n: u32) -> Limit {
        let old = vf::dma_entry_limit().expect("read dma_entry_limit");
        vf::set_dma_entry_limit(n).expect("write dma_entry_limit (root)");
        Limit(old)
    }
}

impl Drop for Limit {
    fn drop(&mut self) {
        let _ = vf::set_dma_entry_limit(self.0);
    }
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn mapping_limit_fails_per_frag_with_enospc_and_persistent_keeps_working() {
    const LIMIT: u32 = 64;
    let _limit = Limit::set(LIMIT);

    // Per-frag: every payload frag and header is a mapping; with packets
    // in flight the container runs out.
    {
        let (domain, nic) = open();
        assert_eq!(domain.mapper().dma_avail().unwrap(), Some(LIMIT));
        let pool = Pool::new(
            domain.clone(),
            pool::Config::new(Order::new(0).unwrap(), Policy::PerFrag),
        )
        .unwrap();
        let cfg = txcfg(HeaderMode::Mapped);
        // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
        let mut q = unsafe { tx::Queue::new(domain.clone(), pool.clone(), nic, cfg) }.unwrap();
        let mut g = traffic(1);
        let mut sent = 0u64;
        let err = loop {
            match g.send(&mut q, 0, 65_160) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(sent < 1000, "the mapping limit was never reached");
        };
        assert_eq!(err.errno(), Some(libc::ENOSPC), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("dma_entry_limit"), "{msg}");
        println!("per-frag stopped after {sent} packets: {msg}");
        // The failed packet left nothing mapped; the sent ones complete.
        q.kick().unwrap();
        q.wait(WAIT).unwrap();
        assert_eq!(q.stats().completed, sent);
        expect_on_wire(sent * segments(65_160));
        // The device is kept while the container is asked: once it closes,
        // its group leaves the container, which then has no IOMMU to ask.
        let nic = q.into_device().unwrap();
        drop(pool);
        assert_eq!(
            domain.mapper().dma_avail().unwrap(),
            Some(LIMIT),
            "nothing stays mapped after the error"
        );
        drop(nic);
    }

    // Persistent: a handful of mappings for the whole run.
    let (domain, nic) = open();
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(4).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let cfg = txcfg(HeaderMode::Bounce(SlotSize::B128));
    // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
    let mut q = unsafe { tx::Queue::new(domain.clone(), pool.clone(), nic, cfg) }.unwrap();
    let mut g = traffic(1);
    let n = 300u64;
    let mut m0 = None;
    for i in 0..n {
        if i == 100 {
            q.kick().unwrap();
            q.wait(WAIT).unwrap();
            m0 = Some(domain.mapper().stats());
        }
        if let Err(e) = send(&mut q, &mut g, 0, 65_160) {
            panic!("persistent under the limit: {e}");
        }
    }
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    assert_eq!(q.stats().completed, n);
    let d = domain.mapper().stats().since(&m0.unwrap());
    assert_eq!(
        (d.map_calls, d.unmap_calls),
        (0, 0),
        "steady state maps nothing"
    );
    let used = LIMIT - domain.mapper().dma_avail().unwrap().unwrap();
    println!("persistent: {n} packets with {used} mappings in the container");
    assert!(used <= 8, "{used} mappings");
    expect_on_wire(n * segments(65_160));
}
