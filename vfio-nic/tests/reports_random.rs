//! Deferred reports under any sequence of sends, doorbells that fail,
//! doorbells that succeed and reaps: copied and inline packets, zero-copy
//! posts of many frags, checksum offloads over UDP and TCP (context
//! descriptors written and skipped), rings that wrap, `report_every` from
//! 1 to the ring's size, and the device on the driver's thread or its own.
//! Every packet comes back, in order, and on the wire as it was sent.

use proptest::prelude::*;
use vfio_nic::model::thread::{self, Threaded};
use vfio_nic::model::Model;
use vfio_nic::offload::Offload;
use vfio_nic::tx::{self, Queue};
use vfio_nic::Error;

mod common;
use common::Flaky;

/// One step of a run.
#[derive(Clone, Debug)]
enum Op {
    /// A packet: copied with `len` payload bytes, or (`frags > 0`) posted
    /// zero-copy in that many frags of 1 to 200 bytes.
    Send {
        len: usize,
        frags: usize,
        checksum: bool,
        tcp: bool,
    },
    /// A doorbell that fails.
    FailedKick,
    Kick,
    Reap,
}

fn op() -> impl Strategy<Value = Op> {
    let send = (
        prop_oneof![Just(22usize), Just(1000), Just(5000)],
        prop_oneof![2 => Just(0usize), 1 => 1usize..=12],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(len, frags, checksum, tcp)| Op::Send {
            len,
            frags,
            checksum,
            tcp,
        });
    prop_oneof![6 => send, 1 => Just(Op::FailedKick), 2 => Just(Op::Kick), 1 => Just(Op::Reap)]
}

/// Ethernet + IPv4 + UDP or TCP headers for `len` payload bytes.
fn headers(tcp: bool, len: usize) -> Vec<u8> {
    let b = etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]).ipv4(
        [10, 0, 0, 1],
        [10, 0, 0, 2],
        64,
    );
    let mut h = Vec::new();
    let body = vec![0; len];
    let hlen = if tcp {
        b.tcp(4000, 5000, 1, 1000).write(&mut h, &body).unwrap();
        54
    } else {
        b.udp(4000, 5000).write(&mut h, &body).unwrap();
        42
    };
    h.truncate(hlen);
    h
}

/// Posts packet `token`; returns its header length and payload, or `None`
/// if the queue refused it whole (no room now, or too many descriptors).
fn send<D: Model>(
    q: &mut Queue<common::Soft, Flaky<D>>,
    op: &Op,
    token: u64,
) -> Option<(usize, Vec<u8>)> {
    let &Op::Send {
        len,
        frags,
        checksum,
        tcp,
    } = op
    else {
        unreachable!("only sends are sent");
    };
    let offload = if checksum {
        Offload::Checksum
    } else {
        Offload::None
    };
    let byte = |i: usize| (token as usize * 31 + i) as u8;
    let r = if frags == 0 {
        let payload: Vec<u8> = (0..len).map(byte).collect();
        let h = headers(tcp, len);
        q.send(&h, &payload, offload, token)
            .map(|()| (h.len(), payload))
    } else {
        let mut fs = Vec::new();
        let mut payload = Vec::new();
        for k in 0..frags {
            let n = 1 + (token as usize * 7 + k * 13) % 200;
            let mut f = q.cache_mut().refill(n, true).unwrap();
            for (i, b) in f.as_mut_slice().iter_mut().enumerate() {
                *b = byte(payload.len() + i);
            }
            payload.extend_from_slice(f.as_slice());
            fs.push(f);
        }
        let h = headers(tcp, payload.len());
        let r = q.post(&h, &mut fs, offload, token);
        // On error the frags stay the caller's.
        q.cache_mut().complete_burst(fs.drain(..)).unwrap();
        r.map(|()| (h.len(), payload))
    };
    match r {
        Ok(sent) => Some(sent),
        // Refused whole: no room now, or more descriptors than the ring
        // or the device takes for one packet.
        Err(e) if e.is_backoff() => None,
        Err(Error::PacketTooLarge { .. } | Error::TooManyBuffers { .. }) => None,
        Err(e) => panic!("packet {token}: {e}"),
    }
}

fn run<D: Model>(nic: D, q_parts: QueueParts, ring: u16, report_every: u16, ops: &[Op]) {
    let (domain, pool) = q_parts;
    // Jumbo frames: a copied packet of 5,000 bytes, or twelve frags.
    let cfg = tx::Config {
        ring,
        report_every,
        mtu: 9000,
        ..tx::Config::default()
    };
    let dev = Flaky {
        nic,
        fail_next: false,
    };
    // SAFETY: the model translates through the domain's IOMMU.
    let mut q = unsafe { Queue::new(domain, pool, dev, cfg) }.unwrap();
    let mut sent = Vec::new();
    let mut done = Vec::new();
    for op in ops {
        match op {
            Op::Send { .. } => {
                if let Some(p) = send(&mut q, op, sent.len() as u64) {
                    sent.push(p);
                }
            }
            Op::FailedKick => {
                // SAFETY: only a flag of the wrapper is set.
                unsafe { q.device_mut() }.fail_next = true;
                assert!(matches!(q.kick(), Err(Error::Busy { .. })));
            }
            Op::Kick => q.kick().unwrap(),
            Op::Reap => {
                q.reap_tokens(&mut done).unwrap();
            }
        }
    }
    q.kick().unwrap();
    q.wait_tokens(common::WAIT, &mut done).unwrap();
    assert_eq!(done, (0..sent.len() as u64).collect::<Vec<_>>());
    let frames = q.take_frames();
    assert_eq!(frames.len(), sent.len());
    for (i, (f, (hlen, payload))) in frames.iter().zip(&sent).enumerate() {
        assert_eq!(&f[*hlen..], &payload[..], "frame {i}");
    }
    let st = q.device().counters();
    assert_eq!((st.bad_desc, st.faults), (0, 0));
}

type QueueParts = (
    std::sync::Arc<pfrag::dma::Domain<common::Soft>>,
    pfrag::pool::Pool<common::Soft>,
);

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    #[cfg_attr(miri, ignore = "48 runs of up to 300 steps with a device that checks every byte: hours under Miri; reports.rs covers the paths")]
    fn every_packet_is_reported_and_delivered_whatever_the_doorbells(
        (ring, report_every) in prop_oneof![
            Just((8u16, 3u16)), Just((8, 8)), Just((16, 1)), Just((16, 4)),
            Just((16, 16)), Just((64, 32)), Just((64, 64)),
        ],
        threaded in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let (domain, pool, nic) = common::capture_parts(2);
        if threaded {
            let nic = Threaded::spawn(nic, thread::Config::default()).unwrap();
            run(nic, (domain, pool), ring, report_every, &ops);
        } else {
            run(nic, (domain, pool), ring, report_every, &ops);
        }
    }
}

/// A fixed run that fails a doorbell between every burst, so that the
/// failed-doorbell path is certain to be taken whatever proptest draws.
#[test]
fn failed_doorbells_between_bursts_lose_no_report() {
    let send = |len, tcp| Op::Send {
        len,
        frags: 0,
        checksum: true,
        tcp,
    };
    let mut ops = Vec::new();
    for i in 0..16 {
        ops.extend([send(22, i % 2 == 0), send(1000, i % 3 == 0), Op::FailedKick]);
        ops.extend([send(22, false), Op::Kick]);
        if i % 4 == 3 {
            ops.push(Op::Reap);
        }
    }
    let (domain, pool, nic) = common::capture_parts(2);
    run(nic, (domain, pool), 16, 4, &ops);
}
