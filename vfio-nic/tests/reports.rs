//! Deferred reports (`tx::Config::report_every`, the 82576's RS bit): the
//! device writes back only every N-th packet and the last one before each
//! doorbell, and the packets before a reported one complete with it.

use std::sync::Arc;

use pfrag::dma::SoftIommu;
use vfio_nic::offload::Offload;
use vfio_nic::tx::{self, Queue};
use vfio_nic::Error;

mod common;
use common::{CaptureQueue as Q, Flaky};

fn queue(report_every: u16) -> Result<Q, Error> {
    let cfg = tx::Config {
        report_every,
        ring: 64,
        ..tx::Config::default()
    };
    common::capture_queue(2, cfg)
}

/// Ethernet + IPv4 + UDP headers for `len` payload bytes.
fn headers(len: usize) -> Vec<u8> {
    let mut h = Vec::new();
    etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
        .udp(4000, 5000)
        .write(&mut h, &vec![0; len])
        .unwrap();
    h.truncate(42);
    h
}

/// Sends `n` packets (tokens `first..first + n`): every third with a
/// payload too large to go inline, so both posting paths are covered.
fn send(q: &mut Q, first: u64, n: u64) {
    for t in first..first + n {
        let len = if t % 3 == 0 { 1000 } else { 22 };
        q.send(&headers(len), &vec![t as u8; len], Offload::None, t)
            .unwrap();
    }
}

fn reap_all(q: &mut Q) -> Vec<u64> {
    let mut done = Vec::new();
    q.wait_tokens(std::time::Duration::from_secs(10), &mut done)
        .unwrap();
    done
}

#[test]
fn every_nth_packet_and_the_last_before_each_doorbell_ask_for_a_report() {
    let mut q = queue(4).unwrap();
    send(&mut q, 0, 10);
    q.kick().unwrap();
    assert_eq!(reap_all(&mut q), (0..10).collect::<Vec<_>>());
    // Packets 4 and 8 by count, 10 before the doorbell.
    assert_eq!(q.device().stats().write_backs, 3);
    // The count starts again after the doorbell's report.
    send(&mut q, 10, 5);
    q.kick().unwrap();
    assert_eq!(reap_all(&mut q), (10..15).collect::<Vec<_>>());
    assert_eq!(q.device().stats().write_backs, 5);
    assert_eq!(q.device().stats().packets, 15);
    assert_eq!(q.stats().completed, 15);
    assert_eq!(q.take_frames().len(), 15, "every frame reached the wire");
}

#[test]
fn report_every_one_reports_every_packet() {
    let mut q = queue(1).unwrap();
    send(&mut q, 0, 9);
    q.kick().unwrap();
    assert_eq!(reap_all(&mut q), (0..9).collect::<Vec<_>>());
    assert_eq!(q.device().stats().write_backs, 9);
}

#[test]
fn unreported_packets_stay_in_flight_until_a_report() {
    let mut q = queue(32).unwrap();
    send(&mut q, 0, 6);
    // Nothing handed over, nothing asked: nothing completes.
    assert_eq!(q.reap().unwrap(), 0);
    assert_eq!(q.in_flight(), 6);
    q.kick().unwrap();
    assert_eq!(reap_all(&mut q), (0..6).collect::<Vec<_>>());
    assert_eq!(q.device().stats().write_backs, 1, "one report for six");
    // A doorbell with nothing new posted asks for nothing more.
    q.kick().unwrap();
    assert_eq!(q.device().stats().write_backs, 1);
    // Each frame as sent: no frag was freed and reused before the device
    // read it.
    for (t, f) in q.take_frames().iter().enumerate() {
        assert!(f[42..].iter().all(|&b| b == t as u8), "frame {t}");
    }
}

#[test]
fn report_every_zero_is_refused() {
    let e = queue(0).unwrap_err();
    assert!(
        matches!(e, Error::BadConfig { what, value: 0 } if what.contains("report_every")),
        "{e:?}"
    );
}

#[test]
fn a_failed_doorbell_leaves_the_reports_as_they_were() {
    let (domain, pool, nic) = common::capture_parts(2);
    let dev = Flaky {
        nic,
        fail_next: false,
    };
    let cfg = tx::Config {
        report_every: 4,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through the domain's IOMMU.
    let mut q = unsafe { Queue::new(domain, pool, dev, cfg) }.unwrap();
    let h = headers(22);
    for t in 0..6 {
        q.send(&h, &[t as u8; 22], Offload::None, t).unwrap();
    }
    // SAFETY: only a flag of the wrapper is set.
    unsafe { q.device_mut() }.fail_next = true;
    assert!(matches!(q.kick(), Err(Error::Busy { .. })));
    assert_eq!(q.in_flight(), 6);
    assert_eq!(q.reap().unwrap(), 0, "nothing was handed over");
    // Two more packets, and the retried doorbell hands over all 8.
    for t in 6..8 {
        q.send(&h, &[t as u8; 22], Offload::None, t).unwrap();
    }
    q.kick().unwrap();
    assert_eq!(reap_all_of(&mut q), (0..8).collect::<Vec<_>>());
    // Packets 4 and 8 by count; packet 6's request, left from the failed
    // doorbell, is reported too.
    assert_eq!(q.device().nic.stats().write_backs, 3);
}

fn reap_all_of<D: vfio_nic::device::TxDevice>(q: &mut Queue<Arc<SoftIommu>, D>) -> Vec<u64> {
    let mut done = Vec::new();
    q.wait_tokens(std::time::Duration::from_secs(10), &mut done)
        .unwrap();
    done
}
