//! The flows experiment's machinery: frags held until their ACK, stalls,
//! and amplification from exact byte counts.

use pfrag_lab::flows::{run, write_svg, CacheKind, FlowsConfig, FlowsRow};

/// One bulk flow whose every payload is exactly one chunk and whose window
/// allows one packet: after each send the held bytes are that packet
/// (16 KiB), and the pool's chunks out of the free lists are the held one
/// plus those of packets the queue has not reaped yet. The queue reaps
/// every 8th packet, so over each 8 sends 1, 2, .., 7, then 1 chunk are in
/// use: amplification 29/8 on average and 7 at the peak, exactly.
#[test]
fn amplification_is_computed_from_exact_byte_counts() {
    let cfg = FlowsConfig {
        flows: 1,
        order: 2,
        cache: CacheKind::Shared,
        packets: 800,
        warmup: 800,
        bulk_share: 1.0,
        bulk_payload: 16 << 10,
        bulk_window: 16 << 10,
        stall_share: 0.0,
        ..FlowsConfig::default()
    };
    let r = run(&cfg).unwrap();
    assert_eq!(r.inflight_bytes_peak, 16 << 10);
    assert_eq!(r.inflight_bytes_mean, (16 << 10) as f64);
    assert_eq!(r.pool_bytes_peak, 7 * (16 << 10));
    assert_eq!(r.amplification_mean, 29.0 / 8.0);
    assert_eq!(r.amplification_peak, 7.0);
    assert_eq!(r.pinned_chunks_mean, 1.0);
    assert_eq!(r.bytes_verified, 800 * (16 << 10));
    assert_eq!(r.bytes_sent, r.bytes_verified);
}

/// Every flow stalls once: ACKs due during a stall wait for its end (their
/// frags held), no ACK ever lets a frag go before it is due, and every byte
/// still reaches the NIC intact.
#[test]
fn the_ack_model_never_completes_a_frag_before_its_ack() {
    let base = FlowsConfig {
        flows: 40,
        order: 3,
        packets: 3_000,
        warmup: 500,
        stall_share: 0.0,
        ..FlowsConfig::default()
    };
    let calm = run(&base).unwrap();
    let stalls = FlowsConfig {
        stall_share: 1.0,
        stall_ms: 2.0,
        ..base.clone()
    };
    let r = run(&stalls).unwrap();
    assert_eq!(r.early_acks, 0);
    assert_eq!(calm.early_acks, 0);
    assert!(r.stalled_flows > 30, "{} flows stalled", r.stalled_flows);
    // ACKs that came due during a stall were put off to its end, with
    // their frags held; without stalls none was.
    assert!(r.deferred_acks > 0);
    assert_eq!(calm.deferred_acks, 0);
    assert_eq!(r.bytes_verified, r.bytes_sent);
}

/// The caches see the same workload (same flows, sizes and times), so
/// their in-flight bytes agree and only the pool memory differs; a cache
/// per flow keeps at least one chunk per flow that sent; the queue's
/// default source splits as `split` does.
#[test]
fn caches_compare_on_the_same_workload() {
    let kinds = [
        CacheKind::Shared,
        CacheKind::PerFlow,
        CacheKind::Split,
        CacheKind::Default,
    ];
    let rows: Vec<_> = kinds
        .into_iter()
        .map(|cache| {
            run(&FlowsConfig {
                flows: 300,
                order: 4,
                cache,
                packets: 4_000,
                warmup: 1_000,
                ..FlowsConfig::default()
            })
            .unwrap()
        })
        .collect();
    assert_eq!(rows[0].inflight_bytes_mean, rows[1].inflight_bytes_mean);
    assert_eq!(rows[0].inflight_bytes_mean, rows[2].inflight_bytes_mean);
    assert!(rows[1].pool_bytes_mean >= 300.0 * 0.9 * (64 << 10) as f64 * 0.5);
    assert!(rows[1].pool_bytes_mean > rows[0].pool_bytes_mean);
    assert!(rows[2].pool_bytes_mean < rows[0].pool_bytes_mean);
    assert_eq!(rows[3].inflight_bytes_mean, rows[0].inflight_bytes_mean);
    assert!(
        rows[3].pool_bytes_mean < rows[0].pool_bytes_mean,
        "the default source keeps less than one shared cache: {} vs {}",
        rows[3].pool_bytes_mean,
        rows[0].pool_bytes_mean
    );
    for r in &rows {
        assert_eq!(r.bytes_verified, r.bytes_sent);
        assert!(r.amplification_mean >= 1.0, "{r:?}");
    }
}

#[test]
fn bad_settings_are_refused_with_their_name() {
    let bad = [
        FlowsConfig {
            flows: 0,
            ..FlowsConfig::default()
        },
        FlowsConfig {
            bulk_share: 1.5,
            ..FlowsConfig::default()
        },
        FlowsConfig {
            line_rate_gbit: f64::NAN,
            ..FlowsConfig::default()
        },
        FlowsConfig {
            bulk_payload: 1 << 20,
            ..FlowsConfig::default()
        },
    ];
    for c in bad {
        assert!(run(&c).is_err(), "{c:?}");
    }
}

/// Round-trip and stall times are checked before a run: a least RTT above
/// the longest, a stall that overflows the simulated clock and a line rate
/// too slow to finish are refused, each naming the value and its range.
#[test]
fn times_that_cannot_be_simulated_are_refused_before_the_run() {
    let base = FlowsConfig::default();
    let inverted = FlowsConfig {
        rtt_min_us: 1_000_000.0,
        rtt_max_ms: 1.0,
        ..base.clone()
    };
    let e = inverted.check().unwrap_err();
    assert!(e.contains("1000000") && e.contains("1 ms"), "{e}");
    let stall = FlowsConfig {
        stall_ms: 2e13,
        ..base.clone()
    };
    let e = stall.check().unwrap_err();
    assert!(e.contains("stall") && e.contains("0..="), "{e}");
    let slow = FlowsConfig {
        line_rate_gbit: 1e-300,
        ..base.clone()
    };
    assert!(slow.check().unwrap_err().contains("out of range"));
    let long_rtt = FlowsConfig {
        rtt_max_ms: 1e300,
        ..base.clone()
    };
    assert!(long_rtt.check().unwrap_err().contains("rtt max"));
    base.check().unwrap();
}

/// A chart that cannot be written is an error, however small it is (a
/// chart of one point fits in a write buffer whose failure on drop would
/// go unseen).
#[test]
fn a_chart_that_cannot_be_written_is_an_error() {
    let full = std::path::Path::new("/dev/full");
    if !full.exists() {
        return;
    }
    let row = FlowsRow {
        cache: "shared".into(),
        order: 2,
        flows: 200,
        amplification_mean: 1.2,
        ..FlowsRow::default()
    };
    let e = write_svg(full, &[row]).unwrap_err().to_string();
    assert!(e.contains("/dev/full"), "{e}");
}
