use super::*;

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn mac_loopback_receives_what_was_sent() {
    use vfio_nic::check::wire::WireCheck;
    use vfio_nic::hw::igb::RxRing;
    let (domain, mut nic) = open();
    let mut rx = RxRing::new(domain.clone(), 128).unwrap();
    // SAFETY: `rx` lives to the end of the test, after RX is stopped, and
    // is pinned if it cannot be.
    unsafe { nic.start_rx(&mut rx, true) }.unwrap();
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(2).unwrap(), Policy::Persistent),
    )
    .unwrap();
    // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
    let mut q =
        unsafe { tx::Queue::new(domain, pool, nic, txcfg(HeaderMode::Bounce(SlotSize::B128))) }
            .unwrap();
    let mut g = traffic(2);
    let mut rx = rx;
    let sizes = [8_000usize, 300, 8_000, 300, 16_000, 60];
    let mut want_frames = 0;
    let mut check = WireCheck::default();
    let mut got = 0u64;
    for (i, &len) in sizes.iter().enumerate() {
        send(&mut q, &mut g, i % 2, len).unwrap();
        want_frames += segments(len);
        q.kick().unwrap();
        q.wait(WAIT).unwrap();
        // Drain what came back so far, handing descriptors back as we go.
        let t0 = Instant::now();
        while got < want_frames {
            match rx.next_frame().unwrap() {
                Some((frame, tail)) => {
                    check
                        .frame(&frame)
                        .unwrap_or_else(|e| panic!("frame {got}: {e}"));
                    got += 1;
                    // SAFETY: the descriptors up to `tail` are `rx`'s,
                    // read and handed back.
                    unsafe { q.device().rx_tail(tail) }.unwrap();
                }
                None => {
                    assert!(
                        t0.elapsed() < WAIT,
                        "received {got} of {want_frames} looped-back frames"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
    assert!(
        rx.next_frame().unwrap().is_none(),
        "no frame beyond those sent"
    );
    let r = check.report();
    assert_eq!(r.frames, want_frames);
    assert_eq!(r.payload_bytes, sizes.iter().sum::<usize>() as u64);
    assert_eq!(r.flows, 2);
    // Looped back, not sent: nothing for the capture to see.
    let nic = q.into_device().unwrap();
    if let Err(e) = nic.stop_rx() {
        // The receiver may still write the ring: it is the device's for
        // good.
        rx.pin();
        panic!("stopping RX: {e}");
    }
    println!(
        "loopback: {} frames received and checked in the guest",
        r.frames
    );
}
