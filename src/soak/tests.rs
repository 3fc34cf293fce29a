use super::*;
use pfrag::account::Limits;
use pfrag::dma::{FaultyConfig, Invalidation};
use pfrag::pool::Policy;
use vfio_nic::tx::HeaderMode;

#[test]
fn a_short_soak_delivers_everything_and_leaks_nothing() {
    let t = soak(7, 3_000, 300, None, &|_| {}, &mut |_, _, _| {}).map_err(|b| b.1);
    let t = t.unwrap();
    assert!(t.phases >= 10);
    assert_eq!((t.corrupted, t.leaked), (0, 0));
    assert!(t.bytes_verified > 0);
}

#[test]
fn every_injected_failure_kind_shows_up_in_a_run_with_high_rates() {
    let p = Phase {
        order: 0,
        policy: Policy::PerFrag,
        invalidation: Invalidation::Lazy,
        queues: 2,
        header: HeaderMode::Mapped,
        fit_whole: false,
        ring: 64,
        flows: 3,
        packets: 400,
        limits: Limits::UNLIMITED,
        faults: FaultyConfig {
            seed: 9,
            map_rate: 0.05,
            unmap_rate: 0.05,
            flush_rate: 0.05,
            fail_nth: None,
        },
        untold: FaultyConfig::default(),
        seed: 4,
        deadline: None,
    };
    let t = run_phase(&p, 0, &|_| {}).unwrap();
    assert!(t.injected > 0 && t.refused.injected > 0);
    assert!(t.refused.injected <= t.injected);
    assert_eq!(t.leaked, 0);
}

#[test]
fn edge_sizes_include_both_sides_of_an_order4_chunk() {
    assert!(EDGE_SIZES.contains(&65_535) && EDGE_SIZES.contains(&65_537));
    assert_eq!(*EDGE_SIZES.last().unwrap(), 262_143);
}

/// A phase whose mapper fails beneath the injector, without it being
/// told: those errors are explained by no injection, and the soak fails
/// saying which error it met.
#[test]
fn an_error_no_injection_explains_fails_the_phase() {
    let mut rng = Rng::new(3);
    let mut p = Phase::draw(&mut rng, 400);
    p.policy = Policy::PerFrag;
    p.queues = 1;
    p.packets = 400;
    p.faults.map_rate = 0.0;
    p.untold = FaultyConfig {
        seed: 11,
        map_rate: 0.05,
        ..FaultyConfig::default()
    };
    let v = run_phase(&p, 0, &|_| {}).unwrap_err();
    assert!(v.unexplained, "{v}");
    assert!(v.why.contains("DMA map"), "{v}");
}

/// The same seed replays the same run: the same phases with the same
/// counts, one-queue and two-queue phases alike.
#[test]
fn the_same_seed_replays_the_same_run() {
    let run = || {
        let mut phases = Vec::new();
        let t = soak(5, 1_500, 300, None, &|_| {}, &mut |_, p, t| {
            phases.push((p.queues, *t));
        })
        .map_err(|b| b.1)
        .unwrap();
        (t, phases)
    };
    let (a, b) = (run(), run());
    assert!(a.1.iter().any(|p| p.0 == 2), "a two-queue phase ran");
    assert_eq!(a, b);
}

/// Phase lines are printed when asked for even when no progress bar is
/// drawn (stderr not a terminal).
#[test]
fn verbose_lines_show_without_a_terminal() {
    let mut out = Vec::new();
    say(&indicatif::ProgressBar::hidden(), &mut out, "phase 0: ok");
    assert_eq!(String::from_utf8(out).unwrap(), "phase 0: ok\n");
}

/// A phase stops posting at its deadline (the soak's time limit), however
/// many packets it drew, and still verifies everything it sent; the soak
/// stops there too.
#[test]
fn a_phase_stops_at_its_deadline() {
    let mut rng = Rng::new(5);
    let mut p = Phase::draw(&mut rng, 1_000_000_000);
    p.deadline = Some(std::time::Instant::now());
    let t = run_phase(&p, 0, &|_| {}).unwrap();
    assert!(t.packets < 1_000, "{}", t.packets);
    let soon = std::time::Instant::now() + std::time::Duration::from_millis(100);
    let t = soak(
        5,
        u64::MAX,
        1_000_000_000,
        Some(soon),
        &|_| {},
        &mut |_, _, _| {},
    );
    let t = t.map_err(|b| b.1).unwrap();
    assert!(t.phases >= 1 && t.packets < 1_000_000_000, "{t:?}");
}
