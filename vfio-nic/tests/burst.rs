//! `Queue::send_burst`: each packet all or nothing, the posted ones a
//! prefix of the burst, and the first that does not fit ends it.

use std::time::Duration;

use vfio_nic::offload::Offload;
use vfio_nic::tx::{self, TxPacket};
use vfio_nic::Error;

mod common;
use common::CaptureQueue as Q;

fn queue(ring: u16) -> Q {
    let cfg = tx::Config {
        ring,
        ..tx::Config::default()
    };
    common::capture_queue(1, cfg).unwrap()
}

/// A 14-byte Ethernet header with a local EtherType.
const ETH: [u8; 14] = [2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x88, 0xb5];

fn pkt(payload: &[u8], token: u64) -> TxPacket<'_> {
    TxPacket {
        headers: &ETH,
        payload,
        offload: Offload::None,
        token,
    }
}

#[test]
fn a_burst_posts_in_order_and_a_full_ring_ends_it_with_the_count() {
    let mut q = queue(16);
    let payloads: Vec<Vec<u8>> = (0..20u8).map(|t| vec![t; 46 + usize::from(t)]).collect();
    let pkts: Vec<_> = (0..20).map(|t| pkt(&payloads[t], t as u64)).collect();
    let sent = q.send_burst(&pkts).unwrap();
    assert_eq!(sent, 15, "15 one-descriptor packets fill a ring of 16");
    assert_eq!(q.in_flight(), 15);
    q.kick().unwrap();
    let mut done = Vec::new();
    q.wait_tokens(Duration::from_secs(10), &mut done).unwrap();
    assert_eq!(q.send_burst(&pkts[sent..]).unwrap(), 5);
    q.kick().unwrap();
    q.wait_tokens(Duration::from_secs(10), &mut done).unwrap();
    assert_eq!(done, (0..20).collect::<Vec<_>>());
    let frames = q.take_frames();
    assert_eq!(frames.len(), 20);
    for (t, f) in frames.iter().enumerate() {
        assert_eq!(&f[14..], &payloads[t][..], "frame {t}");
    }
}

#[test]
fn a_bad_packet_ends_the_burst_after_the_good_ones_and_leads_the_next() {
    let mut q = queue(64);
    let ok = vec![1u8; 100];
    let too_long = vec![2u8; 2000]; // past the 1500-byte MTU
    let pkts = [pkt(&ok, 0), pkt(&ok, 1), pkt(&too_long, 2), pkt(&ok, 3)];
    assert_eq!(q.send_burst(&pkts).unwrap(), 2);
    assert_eq!(q.in_flight(), 2, "nothing after the bad packet is posted");
    let e = q.send_burst(&pkts[2..]).unwrap_err();
    assert!(matches!(e, Error::FrameTooLong { .. }), "{e:?}");
    assert_eq!(q.in_flight(), 2);
    assert_eq!(q.stats().packets, 2);
    assert_eq!(q.send_burst(&[]).unwrap(), 0);
}
