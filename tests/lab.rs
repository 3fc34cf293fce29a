//! The lab's runner end to end on the software NIC: several queues on one
//! pool, skewed traffic, and the reclaim policies on the small-sends
//! workload.

use pfrag::account::Limits;
use pfrag::bounce::SlotSize;
use pfrag::dma::CostModel;
use pfrag::pool::{Policy, Reclaim};
use pfrag_lab::run::{run, DeviceModel, DeviceSetup, IommuMode, RunConfig, Workload};
use vfio_nic::model::softnic::Touch;
use vfio_nic::tx::HeaderMode;

fn config(queues: usize, reclaim: Reclaim, workload: Workload, packets: u64) -> RunConfig {
    RunConfig {
        order: 2,
        policy: Policy::Persistent,
        iommu: IommuMode::Strict,
        header: HeaderMode::Bounce(SlotSize::B128),
        fit_whole: true,
        payload: 16_000,
        flows: 16,
        packets,
        warmup: 128,
        ring: 256,
        burst: 8,
        iotlb_entries: 128,
        hugepages: false,
        touch: Touch::Checksum,
        cost: CostModel::default(),
        queues,
        skew: None,
        reclaim,
        workload,
        limits: Limits::UNLIMITED,
        model: DeviceModel::Soft,
        device: DeviceSetup::default(),
        mss: pfrag_lab::run::MSS,
    }
}

#[test]
fn two_skewed_queues_share_one_pool_and_verify_every_byte() {
    let mut c = config(2, Reclaim::HYSTERESIS, Workload::Fixed, 4000);
    c.skew = Some(0.9);
    let rows = run(&c, &mut |_| {}).unwrap();
    assert_eq!(rows.len(), 3, "a total row and one per queue");
    let (total, q0, q1) = (&rows[0], &rows[1], &rows[2]);
    assert_eq!(
        (total.queue.as_str(), q0.queue.as_str(), q1.queue.as_str()),
        ("all", "0", "1")
    );
    assert_eq!((q0.packets, q1.packets), (3600, 400));
    assert_eq!(total.packets, 4000);
    for r in &rows {
        assert_eq!(r.faults, 0);
        assert_eq!(r.bytes_verified, r.packets * 16_000, "{}", r.queue);
    }
    assert_eq!(total.pressure_hook_calls, total.pressure_transitions);
    // Defect 11: the mapper is shared, so per-queue rows cannot measure its
    // counters: those cells are empty, not 0. The total row has them.
    let cols = pfrag_lab::report::columns();
    let cell = |r: &pfrag_lab::Row, name: &str| {
        let i = cols.iter().position(|c| *c == name).unwrap();
        pfrag_lab::report::record(r)[i].clone()
    };
    for name in [
        "maps_per_pkt",
        "invalidations_per_pkt",
        "iotlb_misses_per_pkt",
        "model_iommu_ns_per_pkt",
    ] {
        assert_eq!(cell(q0, name), "", "{name}");
        assert_ne!(cell(total, name), "", "{name}");
    }
    // Defect 12: the IOTLB size is a column.
    assert_eq!(cell(total, "iotlb_entries"), "128");
    // Defect 10: throughput is delivered bits over measured time.
    let ns = total.ns_per_pkt * total.packets as f64;
    let delivered = total.gbit_s * ns / 8.0;
    assert!((delivered - total.bytes_verified as f64).abs() < 1.0);
}

#[test]
fn payload_past_paylen_is_refused_before_running() {
    let mut c = config(1, Reclaim::Eager, Workload::Fixed, 100);
    c.payload = 262_144;
    match run(&c, &mut |_| {}) {
        Err(
            e @ pfrag_lab::run::RunError::PayloadTooLarge {
                payload: 262_144,
                max: 262_143,
                ..
            },
        ) => assert!(e.to_string().contains("at most 262143 B"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn eager_reclaims_often_hysteresis_rarely_on_small_sends() {
    let small = Workload::Small {
        min: 64,
        max: 16 * 1024,
    };
    let rows = |reclaim| run(&config(1, reclaim, small, 20_000), &mut |_| {}).unwrap();
    let eager = &rows(Reclaim::Eager)[0];
    let hyst = &rows(Reclaim::HYSTERESIS)[0];
    assert!(
        eager.reclaim_calls_per_pkt >= 0.5,
        "{}",
        eager.reclaim_calls_per_pkt
    );
    assert!(
        hyst.reclaim_calls_per_pkt <= 0.01,
        "{}",
        hyst.reclaim_calls_per_pkt
    );
    assert!(hyst.shared_pool_ops_per_pkt < eager.shared_pool_ops_per_pkt / 10.0);
    for r in [eager, hyst] {
        assert_eq!(r.faults, 0);
        assert!(r.bytes_verified > 20_000 * 64);
    }
}

#[test]
fn crossing_the_pressure_limits_runs_one_hook_per_transition() {
    let small = Workload::Small {
        min: 64,
        max: 16 * 1024,
    };
    let mut c = config(1, Reclaim::HYSTERESIS, small, 20_000);
    c.ring = 4096;
    c.burst = 512;
    c.limits = Limits {
        min: 2 << 20,
        pressure: 4 << 20,
        max: 64 << 20,
    };
    let r = &run(&c, &mut |_| {}).unwrap()[0];
    assert!(r.pressure_transitions >= 2, "{}", r.pressure_transitions);
    assert_eq!(r.pressure_hook_calls, r.pressure_transitions);
    assert!(r.peak_bytes > 4 << 20 && r.peak_bytes <= 64 << 20);
    assert_eq!(r.faults, 0);
}

#[test]
fn bad_settings_are_refused() {
    let mut c = config(0, Reclaim::Eager, Workload::Fixed, 100);
    assert!(run(&c, &mut |_| {}).is_err());
    c.queues = 1;
    c.workload = Workload::Small { min: 10, max: 5 };
    assert!(run(&c, &mut |_| {}).is_err());
    // The up-front check refuses them too, as a driver of many runs (the
    // sweep) calls it before any run: a range upside down or from 0, and
    // more queues than packets.
    let e = pfrag_lab::run::check(&c).unwrap_err().to_string();
    assert!(e.contains("10..=5"), "{e}");
    c.workload = Workload::Small { min: 0, max: 5 };
    assert!(pfrag_lab::run::check(&c).is_err());
    c.workload = Workload::Fixed;
    c.queues = 101;
    let e = pfrag_lab::run::check(&c).unwrap_err().to_string();
    assert!(e.contains("queues 101") && e.contains("packets 100"), "{e}");
    // A skew that leaves a queue with no packet: its row would measure
    // nothing.
    c.queues = 2;
    c.skew = Some(1.0);
    let e = pfrag_lab::run::check(&c).unwrap_err().to_string();
    assert!(e.contains("skew 1 leaves queue 1 of 2"), "{e}");
    c.skew = Some(0.99);
    pfrag_lab::run::check(&c).unwrap();
    c.queues = 1;
    c.skew = None;
    pfrag_lab::run::check(&c).unwrap();
    // A burst is posted before one doorbell: more packets than the ring
    // holds would ring it when the ring fills, not after the burst.
    c.burst = 257;
    let e = pfrag_lab::run::check(&c).unwrap_err().to_string();
    assert!(e.contains("burst 257") && e.contains("1..=256"), "{e}");
    c.burst = 256;
    pfrag_lab::run::check(&c).unwrap();
}

/// The device thread consumes the ring beside the driver: every byte is
/// still verified, and the driver's and device's CPU time come apart (the
/// driver's thread no longer includes the device's work).
#[test]
fn device_thread_run_verifies_every_byte_and_splits_the_cpu_time() {
    let mut c = config(1, Reclaim::Eager, Workload::Fixed, 2000);
    c.device.thread = true;
    let rows = run(&c, &mut |_| {}).unwrap();
    let r = &rows[0];
    assert!(r.device_thread);
    assert_eq!(r.faults, 0);
    assert_eq!(r.bytes_verified, 2000 * 16_000);
    assert!(r.device_ns_per_pkt.unwrap() > 0.0);
    assert!(r.driver_ns_per_pkt.unwrap() > 0.0);
    let inline = run(
        &config(1, Reclaim::Eager, Workload::Fixed, 2000),
        &mut |_| {},
    )
    .unwrap();
    assert!(!inline[0].device_thread);
    assert_eq!(inline[0].bytes_verified, 2000 * 16_000);
    assert!(inline[0].device_ns_per_pkt.unwrap() > 0.0);
}

/// Paced to a line rate, the delivered payload rate stays below it (the
/// wire also carries headers, FCS, preamble and gap), and the row carries
/// the rate and the driver's CPU share.
#[test]
fn line_rate_caps_the_delivered_rate() {
    let mut c = config(1, Reclaim::Eager, Workload::Fixed, 600);
    c.device = DeviceSetup {
        thread: true,
        line_rate_gbit: Some(1.0),
        iommu_latency: false,
    };
    let r = &run(&c, &mut |_| {}).unwrap()[0];
    assert_eq!(r.line_rate_gbit, Some(1.0));
    assert_eq!(r.bytes_verified, 600 * 16_000);
    assert!(
        r.gbit_s < 1.0,
        "{} Gbit/s of payload over a 1 Gbit/s wire",
        r.gbit_s
    );
    let share = r.driver_cpu_share.unwrap();
    assert!(share > 0.0 && share <= 1.05, "{share}");
    assert!(r.cpu_ns_per_gbit.unwrap() > 0.0);
}

/// With latency injected the run still delivers every byte, and the row
/// records that it was a model with the cost model's parameters.
#[test]
fn injected_iommu_latency_is_marked_with_its_parameters() {
    let mut c = config(1, Reclaim::Eager, Workload::Fixed, 300);
    c.device.iommu_latency = true;
    let r = &run(&c, &mut |_| {}).unwrap()[0];
    assert!(r.iommu_latency);
    assert_eq!(r.bytes_verified, 300 * 16_000);
    assert_eq!(r.cost_inval_ns, Some(CostModel::default().invalidation_ns));
    assert_eq!(r.cost_miss_ns, Some(CostModel::default().miss_ns));
}

/// A line rate at which one packet would take longer on the wire than
/// the run waits for a completion is refused before the run starts.
#[test]
fn a_packet_slower_on_the_wire_than_the_stall_limit_is_refused_up_front() {
    let mut c = config(1, Reclaim::Eager, Workload::Fixed, 100);
    c.payload = vfio_nic::desc::MAX_PAYLEN;
    c.mss = 1;
    c.device = DeviceSetup {
        thread: true,
        line_rate_gbit: Some(0.001),
        iommu_latency: false,
    };
    let e = run(&c, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("on the wire"), "{e}");
    c.mss = 1448;
    c.packets = 1;
    c.warmup = 0;
    c.payload = 1448;
    run(&c, &mut |_| {}).unwrap();
}

/// Settings that used to fail only once running are refused by
/// `run::check`, the check `sweep` makes of every configuration before it
/// runs any, with the numbers.
#[test]
fn check_refuses_what_would_fail_only_once_running() {
    use pfrag_lab::run::{check, check_flows, RunError};
    let refused = |c: &RunConfig, want: &[&str]| match check(c) {
        Err(RunError::Setting(s)) => {
            for w in want {
                assert!(s.contains(w), "{w:?} not in {s:?}");
            }
        }
        other => panic!("{other:?}"),
    };
    let ok = config(1, Reclaim::HYSTERESIS, Workload::Fixed, 100);
    check(&ok).unwrap();
    // Hysteresis trims 1 MiB: less than one order-9 chunk (2 MiB).
    let mut c = ok.clone();
    c.order = 9;
    refused(&c, &["order 9", "2097152", "hysteresis", "1048576"]);
    let mut c = ok.clone();
    c.queues = 4097;
    refused(&c, &["queues 4097", "1..=4096"]);
    let max = vfio_nic::gen::flow::MAX_FLOWS;
    for flows in [0, max + 1] {
        let mut c = ok.clone();
        c.flows = flows;
        refused(&c, &[&format!("flows {flows}"), &format!("1..={max}")]);
    }
    let mut c = ok.clone();
    c.flows = max;
    check(&c).unwrap();
    // A segment is one IPv4 packet: the MSS and 40 bytes of headers fit
    // 65,535 (a larger MSS made the run's MTU wrap to a small one).
    for mss in [0, 65_496, u16::MAX] {
        let mut c = ok.clone();
        c.mss = mss;
        refused(&c, &[&format!("mss {mss}"), "1..=65495"]);
    }
    let mut c = ok.clone();
    c.mss = 65_495;
    check(&c).unwrap();
    assert!(check_flows(1).is_ok() && check_flows(max).is_ok());
    assert!(check_flows(0).is_err() && check_flows(max + 1).is_err());
}

/// A packet that can never fit its ring is refused by `run::check` before
/// anything runs, with the numbers: the payload, the descriptors it needs
/// at least in the format the model reads, the ring and what it holds.
/// The defaults pass, and a packet exactly at the bound runs.
#[test]
fn check_refuses_a_packet_that_never_fits_its_ring() {
    use pfrag_lab::run::{check, RunError};
    let ok = config(1, Reclaim::Eager, Workload::Fixed, 100);
    check(&ok).unwrap();
    // The sweep's defaults: 65,160-byte packets, a ring of 256, orders 0-4.
    for order in 0..=4 {
        let mut c = ok.clone();
        (c.order, c.payload, c.ring) = (order, 65_160, vfio_nic::tx::Config::DEFAULT_RING);
        check(&c).unwrap();
    }

    // The 82576's largest payload in 16 KiB chunks: a context descriptor,
    // the header and 16 data descriptors; a ring of 8 holds 7.
    let mut c = ok.clone();
    (c.ring, c.payload) = (8, 262_143);
    let e = check(&c).unwrap_err();
    assert!(
        matches!(
            e,
            RunError::PacketTooLarge {
                payload: 262_143,
                needed: 18,
                ring: 8,
                capacity: 7,
                order: 2,
                boundary: None,
                ..
            }
        ),
        "{e:?}"
    );
    let s = e.to_string();
    for w in [
        "262143-byte",
        "at least 18 descriptors",
        "82576",
        "ring of 8 holds 7",
    ] {
        assert!(s.contains(w), "{w:?} not in {s:?}");
    }
    // virtio-net keeps no context descriptor: 4 KiB chunks, 16 data
    // descriptors and the header.
    (c.model, c.order, c.payload) = (DeviceModel::Virtio, 0, 65_495);
    let s = check(&c).unwrap_err().to_string();
    assert!(s.contains("at least 17 descriptors on the virtio"), "{s}");
    // The small-sends workload is checked at its largest send.
    let mut c = ok.clone();
    c.ring = 8;
    c.workload = Workload::Small {
        min: 64,
        max: 100_000,
    };
    assert!(matches!(
        check(&c),
        Err(RunError::PacketTooLarge {
            payload: 100_000,
            ..
        })
    ));

    // 4 KiB chunks and a ring of 24 (23 descriptors): context, header and
    // 21 pages fit, and every packet of such a run is sent; a byte more is
    // refused before the run.
    let mut c = ok.clone();
    (c.order, c.ring, c.payload, c.packets, c.warmup) = (0, 24, 21 * 4096, 40, 8);
    let r = &run(&c, &mut |_| {}).unwrap()[0];
    assert_eq!((r.faults, r.bytes_verified), (0, 40 * 21 * 4096));
    c.payload += 1;
    assert!(matches!(
        check(&c),
        Err(RunError::PacketTooLarge {
            needed: 24,
            capacity: 23,
            ..
        })
    ));
}

/// A VFIO run's settings are checked as it will run, without a device: on
/// the 82576 its data buffers are cut at 4 KiB, so a 64 KB packet over
/// 64 KiB chunks that fits a ring of 16 on the software NIC does not fit
/// it there; virtio-net cuts nothing; what one queue of a real NIC does
/// not allow is refused too.
#[test]
fn check_vfio_checks_the_ring_with_the_nics_own_cut() {
    use pfrag_lab::run::{check, check_vfio, RunError};
    let mut c = config(1, Reclaim::Eager, Workload::Fixed, 100);
    (c.order, c.ring, c.payload) = (4, 16, 65_160);
    check(&c).unwrap();
    let e = check_vfio(&c).unwrap_err();
    assert!(
        matches!(
            e,
            RunError::PacketTooLarge {
                needed: 18,
                capacity: 15,
                boundary: Some(4096),
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("buffers cut at 4096 B"), "{e}");
    c.model = DeviceModel::Virtio;
    check_vfio(&c).unwrap();
    c.iommu = IommuMode::Lazy;
    assert!(matches!(check_vfio(&c), Err(RunError::Setting(s)) if s.contains("strictly")));
    c.iommu = IommuMode::Strict;
    c.model = DeviceModel::Null;
    assert!(matches!(check_vfio(&c), Err(RunError::Setting(s)) if s.contains("null")));
}

/// A payload past what one packet carries in the format the model reads,
/// and a packet that takes more buffers than one may have, are refused by
/// `run::check` before anything runs, with the numbers: virtio-net carries
/// at most 65,495 bytes behind the generator's IPv4 and TCP headers (the
/// 82576 262,143), and the 82576's
/// largest payload over 4 KiB chunks takes the header and 64 data buffers,
/// one more than the 64 a packet may have, though a ring of 256 would hold
/// it. The sweep's defaults pass on either format, and a packet at the
/// buffers' limit runs.
#[test]
fn check_refuses_a_payload_past_the_format() {
    use pfrag_lab::run::{check, RunError};
    let ok = config(1, Reclaim::Eager, Workload::Fixed, 100);
    for model in [DeviceModel::Soft, DeviceModel::Null, DeviceModel::Virtio] {
        for order in 0..=4 {
            let mut c = ok.clone();
            (c.model, c.order, c.payload) = (model, order, 65_160);
            check(&c).unwrap();
        }
    }

    // A virtio-net GSO packet is one IPv4 packet: its 16-bit total length
    // counts the IPv4 and TCP headers (20 bytes each), which leaves 65,495.
    let mut c = ok.clone();
    (c.model, c.payload) = (DeviceModel::Virtio, 65_495);
    check(&c).unwrap();
    for payload in [65_496, 65_535, 65_536] {
        c.payload = payload;
        let e = check(&c).unwrap_err();
        assert!(
            matches!(
                e,
                RunError::PayloadTooLarge {
                    payload: p,
                    max: 65_495,
                    ..
                } if p == payload
            ),
            "{e:?}"
        );
        let s = e.to_string();
        for w in [&format!("{payload}-byte"), "virtio", "at most 65495 B"] {
            assert!(s.contains(w), "{w:?} not in {s:?}");
        }
        // The run refuses it the same way, before it starts.
        assert!(matches!(
            run(&c, &mut |_| {}),
            Err(RunError::PayloadTooLarge { max: 65_495, .. })
        ));
    }
    c.payload = 65_536;
    // The 82576 carries it, up to its 18-bit PAYLEN.
    c.model = DeviceModel::Soft;
    check(&c).unwrap();
    c.payload = vfio_nic::desc::MAX_PAYLEN;
    check(&c).unwrap();
    c.payload += 1;
    assert!(matches!(
        check(&c),
        Err(RunError::PayloadTooLarge {
            payload: 262_144,
            max: 262_143,
            ..
        })
    ));
}

#[test]
fn check_refuses_too_many_buffers() {
    use pfrag_lab::run::{check, RunError};
    let mut c = config(1, Reclaim::Eager, Workload::Fixed, 100);
    (c.order, c.payload, c.ring) = (0, 262_143, 256);
    let e = check(&c).unwrap_err();
    assert!(
        matches!(
            e,
            RunError::TooManyBuffers {
                payload: 262_143,
                needed: 65,
                max: 64,
                order: 0,
                boundary: None,
                fit_whole: true,
                ..
            }
        ),
        "{e:?}"
    );
    let s = e.to_string();
    for w in ["262143-byte", "up to 65 buffers", "82576", "may have 64"] {
        assert!(s.contains(w), "{w:?} not in {s:?}");
    }
    // Without fit-whole a payload's first bytes may take a chunk's tail:
    // 63 pages take 65 buffers.
    c.payload = 63 * 4096;
    check(&c).unwrap();
    c.fit_whole = false;
    let s = check(&c).unwrap_err().to_string();
    assert!(
        s.contains("up to 65 buffers") && s.contains("not fit whole"),
        "{s}"
    );
    // At the limit (the header and 63 pages) the run sends every packet.
    c.fit_whole = true;
    (c.packets, c.warmup) = (20, 4);
    let r = &run(&c, &mut |_| {}).unwrap()[0];
    assert_eq!((r.faults, r.bytes_verified), (0, 20 * 63 * 4096));
    c.payload += 1;
    assert!(matches!(
        check(&c),
        Err(RunError::TooManyBuffers {
            needed: 65,
            max: 64,
            ..
        })
    ));
}

/// A VFIO run on the 82576 cuts its data buffers at 4 KiB: the 82576's
/// largest payload over 64 KiB chunks, 9 buffers on the software NIC, is
/// 69 there (the header, 4 frags, 63 cuts and one for a frag that may start
/// off a page), more than a packet may have.
#[test]
fn check_vfio_counts_buffers_with_the_nics_own_cut() {
    use pfrag_lab::run::{check, check_vfio, RunError};
    let mut c = config(1, Reclaim::Eager, Workload::Fixed, 100);
    (c.order, c.ring, c.payload) = (4, 256, vfio_nic::desc::MAX_PAYLEN);
    check(&c).unwrap();
    let e = check_vfio(&c).unwrap_err();
    assert!(
        matches!(
            e,
            RunError::TooManyBuffers {
                needed: 69,
                max: 64,
                boundary: Some(4096),
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("buffers cut at 4096 B"), "{e}");
}

/// A ring the queue does not take (a multiple of 8 in 8..=4096) is
/// refused by `run::check` with the queue's own error and number, before
/// anything runs, on either format; a ring of 0 once panicked there,
/// counting what it holds.
#[test]
fn check_refuses_a_ring_the_queue_does_not_take() {
    use pfrag_lab::run::{check, check_vfio, RunError};
    for model in [DeviceModel::Soft, DeviceModel::Virtio] {
        for ring in [0, 1, 4, 12, 4104] {
            let mut c = config(1, Reclaim::Eager, Workload::Fixed, 100);
            (c.model, c.ring) = (model, ring);
            for e in [check(&c).unwrap_err(), check_vfio(&c).unwrap_err()] {
                assert!(
                    matches!(
                        e,
                        RunError::Nic(vfio_nic::Error::BadConfig { value, .. })
                            if value == u64::from(ring)
                    ),
                    "ring {ring}: {e:?}"
                );
            }
        }
    }
}

/// A small-sends run 64 bytes short of its sends is not sound: every byte
/// posted must be verified, not about all of them.
#[test]
fn a_small_sends_run_short_of_one_packet_is_not_sound() {
    let small = Workload::Small { min: 64, max: 9000 };
    let mut r = run(&config(1, Reclaim::Eager, small, 2_000), &mut |_| {}).unwrap()[0].clone();
    assert!(r.problems().is_empty(), "{:?}", r.problems());
    r.bytes_verified -= 64;
    assert!(!r.problems().is_empty(), "64 bytes short passed");
}
