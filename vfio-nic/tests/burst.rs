//! `Queue::send_burst`: each packet all or nothing, the posted ones a
//! prefix of the burst, and the first that does not fit ends it.

use std::time::Duration;

use std::sync::Arc;

use pfrag::bounce::SlotSize;
use pfrag::dma::{Domain, SoftIommu};
use pfrag::pool::{self, Policy, Pool};
use proptest::prelude::*;
use vfio_nic::device::TxDevice;
use vfio_nic::format::Status;
use vfio_nic::model::softnic::{self, SoftNic};
use vfio_nic::model::thread::{self, Threaded};
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use vfio_nic::offload::Offload;
use vfio_nic::tx::{self, Completion, HeaderMode, TxPacket};
use vfio_nic::Error;

mod common;
use common::{CaptureQueue as Q, Flaky, Soft};

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
    assert_eq!(q.stats().inline_packets, 15, "each fits a bounce slot");
    assert_eq!(q.stats().ring_full, 1, "the 16th found the ring full");
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

/// A run that ends at the ring's last slot, its tail wrapping to 0, has
/// the doorbell ask for the report in that last slot: the device reports
/// the whole run. (With reports deferred past the run, only the doorbell
/// asks for one.)
#[test]
fn a_run_that_ends_at_the_ring_end_is_reported_whole() {
    let cfg = tx::Config {
        ring: 8,
        report_every: 32,
        ..tx::Config::default()
    };
    let mut q = common::capture_queue(1, cfg).unwrap();
    let payload = [7u8; 50];
    let pkts: Vec<_> = (0..5).map(|t| pkt(&payload, t)).collect();
    assert_eq!(q.send_burst(&pkts[..3]).unwrap(), 3);
    q.kick().unwrap();
    assert_eq!(q.reap().unwrap(), 3);
    // Slots 3 to 7: the tail wraps to 0.
    assert_eq!(q.send_burst(&pkts).unwrap(), 5);
    q.kick().unwrap();
    assert_eq!(q.reap().unwrap(), 5, "the doorbell asked in slot 7");
    assert_eq!(q.in_flight(), 0);
    assert_eq!(q.take_frames().len(), 8);
}

/// A threaded device reads each inline packet's bounce slot before the
/// queue fills the slot again: bursts into a ring of 8, reaped while the
/// device thread runs, every frame on the wire as sent.
#[test]
fn a_threaded_device_reads_each_slot_before_it_is_reused() {
    let (domain, pool, nic) = common::capture_parts(0);
    let dev = Threaded::spawn(nic, thread::Config::default()).unwrap();
    let cfg = tx::Config {
        ring: 8,
        report_every: 1,
        ..tx::Config::default()
    };
    // SAFETY: the model is on the very IOMMU object the domain maps
    // through.
    let mut q = unsafe { tx::Queue::new(domain, pool, dev, cfg) }.unwrap();
    let payloads: Vec<Vec<u8>> = (0..7u8).map(|i| vec![i; 9 + 13 * usize::from(i)]).collect();
    let rounds = if cfg!(miri) { 20 } else { 200 };
    let mut token = 0;
    for _ in 0..rounds {
        let pkts: Vec<_> = payloads
            .iter()
            .map(|p| {
                token += 1;
                pkt(p, token)
            })
            .collect();
        let mut n = 0;
        while n < pkts.len() {
            n += q.send_burst(&pkts[n..]).unwrap();
            q.kick().unwrap();
            q.reap().unwrap();
        }
    }
    q.wait(common::WAIT).unwrap();
    let frames = q.take_frames();
    assert_eq!(frames.len(), 7 * rounds);
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(&f[14..], &payloads[i % 7][..], "frame {i}");
    }
}

/// A queue's settings for [`a_burst_posts_what_a_loop_of_sends_posts`].
#[derive(Clone, Debug)]
struct Setup {
    virtio: bool,
    ring: u16,
    /// 128- or 256-byte bounce slots, or headers mapped on their own.
    header: HeaderMode,
    mtu: u16,
    /// The pool's largest payload.
    max_payload: usize,
    report_every: u16,
}

fn setup() -> impl Strategy<Value = Setup> {
    let header = prop_oneof![
        Just(HeaderMode::Bounce(SlotSize::B128)),
        Just(HeaderMode::Bounce(SlotSize::B256)),
        Just(HeaderMode::Mapped),
    ];
    (
        any::<bool>(),
        prop_oneof![Just(8u16), Just(16), Just(64)],
        header,
        prop_oneof![Just(68u16), Just(100), Just(1500)],
        prop_oneof![Just(1usize), Just(40), Just(100), Just(200), Just(1 << 18)],
        prop_oneof![Just(1u16), Just(2), Just(3), Just(32)],
    )
        .prop_map(
            |(virtio, ring, header, mtu, max_payload, report_every)| Setup {
                virtio,
                ring,
                header,
                mtu,
                max_payload,
                report_every,
            },
        )
}

/// A queue with settings `s` on a device from `dev` whose doorbell can be
/// made to fail.
fn flaky_queue<D: TxDevice>(s: &Setup, dev: impl Fn(Soft) -> D) -> tx::Queue<Soft, Flaky<D>> {
    let iommu = Soft::new(SoftIommu::new(Default::default()).unwrap());
    let domain = Arc::new(Domain::new(iommu.clone()));
    let mut pcfg = pool::Config::new(pfrag::Order::new(1).unwrap(), Policy::Persistent);
    pcfg.max_payload = s.max_payload;
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let cfg = tx::Config {
        ring: s.ring,
        header: s.header,
        mtu: s.mtu,
        report_every: s.report_every,
        ..tx::Config::default()
    };
    let nic = Flaky {
        nic: dev(iommu),
        fail_next: false,
    };
    // SAFETY: the model is on the very IOMMU object the domain maps
    // through.
    unsafe { tx::Queue::new(domain, pool, nic, cfg) }.unwrap()
}

/// One packet of a random burst: headers of `hlen` bytes (not parsed
/// without an offload; with one, only well-formed ones pass), a payload of
/// `len`, and the offload.
#[derive(Clone, Debug)]
struct Spec {
    hlen: usize,
    len: usize,
    offload: Offload,
    fill: u8,
}

fn spec() -> impl Strategy<Value = Spec> {
    // Lengths at the edges of a word, a slot (128 and 256 bytes less
    // headers and virtio's 12-byte prefix) and the MTU.
    let len = prop_oneof![
        4 => 0usize..300,
        1 => prop::sample::select(vec![0usize, 1, 7, 8, 9, 101, 102, 114, 115, 116, 242, 243, 244, 256, 1486, 1487]),
    ];
    let hlen = prop::sample::select(vec![0usize, 1, 3, 14, 42, 127, 128, 255]);
    let offload = prop_oneof![
        4 => Just(Offload::None),
        1 => Just(Offload::Checksum),
        1 => Just(Offload::Tso { mss: 100 }),
    ];
    (hlen, len, offload, any::<u8>()).prop_map(|(hlen, len, offload, fill)| Spec {
        hlen,
        len,
        offload,
        fill,
    })
}

/// A step of [`a_burst_posts_what_a_loop_of_sends_posts`], on both
/// queues.
#[derive(Clone, Debug)]
enum Step {
    Burst(Vec<Spec>),
    /// A doorbell, then a reap.
    KickReap,
    Kick,
    /// A doorbell that fails.
    FailedKick,
    Reap,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => proptest::collection::vec(spec(), 0..12).prop_map(Step::Burst),
        1 => Just(Step::KickReap),
        1 => Just(Step::Kick),
        1 => Just(Step::FailedKick),
        1 => Just(Step::Reap),
    ]
}

/// The headers and payload of a packet of `s`: Ethernet, IPv4 and UDP
/// headers for 42 bytes with an offload (so that it can pass), other
/// bytes otherwise.
fn packet(s: &Spec) -> (Vec<u8>, Vec<u8>) {
    let payload: Vec<u8> = (0..s.len)
        .map(|i| (i as u8).wrapping_mul(3) ^ s.fill)
        .collect();
    let headers = if s.hlen == 42 && s.offload != Offload::None {
        let mut h = Vec::new();
        etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
            .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
            .udp(4000, 5000)
            .write(&mut h, &payload)
            .unwrap();
        h.truncate(42);
        h
    } else {
        (0..s.hlen).map(|i| (i as u8) ^ s.fill).collect()
    };
    (headers, payload)
}

/// What `send_burst` promises, one `send` at a time: each packet all or
/// nothing, the first that fails ends the burst, and its error is
/// returned only if it is the first packet's and not a back-off.
fn send_one_by_one<D: TxDevice>(
    q: &mut tx::Queue<Soft, D>,
    pkts: &[TxPacket<'_>],
) -> Result<usize, Error> {
    for (n, p) in pkts.iter().enumerate() {
        if let Err(e) = q.send(p.headers, p.payload, p.offload, p.token) {
            if n == 0 && !e.is_backoff() {
                return Err(e);
            }
            return Ok(n);
        }
    }
    Ok(pkts.len())
}

/// Everything a caller can see of a queue, for comparing two.
fn seen<D: TxDevice>(q: &tx::Queue<Soft, D>) -> (tx::Stats, usize, usize) {
    (q.stats(), q.in_flight(), q.free_descs())
}

/// Feeds `steps` to two queues from `make`, one through `send_burst` and
/// one through [`send_one_by_one`], and checks that a caller sees the same
/// of both; see [`a_burst_posts_what_a_loop_of_sends_posts`].
fn same_as_one_by_one<D: TxDevice + Model>(
    make: impl Fn() -> tx::Queue<Soft, Flaky<D>>,
    steps: &[Step],
) -> Result<(), TestCaseError> {
    let (mut a, mut b) = (make(), make());
    let mut token = 0u64;
    let (mut done_a, mut done_b) = (Vec::<Completion>::new(), Vec::new());
    let text = |r: Result<usize, Error>| r.map_err(|e| e.to_string());
    for s in steps {
        match s {
            Step::Burst(specs) => {
                let bufs: Vec<_> = specs.iter().map(packet).collect();
                let pkts: Vec<_> = specs
                    .iter()
                    .zip(&bufs)
                    .map(|(s, (h, p))| {
                        token += 1;
                        let offload = s.offload;
                        TxPacket {
                            headers: h,
                            payload: p,
                            offload,
                            token,
                        }
                    })
                    .collect();
                let ra = text(a.send_burst(&pkts));
                prop_assert_eq!(ra, text(send_one_by_one(&mut b, &pkts)));
            }
            Step::KickReap => {
                for (q, done) in [(&mut a, &mut done_a), (&mut b, &mut done_b)] {
                    q.kick().unwrap();
                    q.reap_completions(done).unwrap();
                }
            }
            Step::Kick => prop_assert_eq!(a.kick().is_ok(), b.kick().is_ok()),
            Step::FailedKick => {
                let mut failed = [false; 2];
                for (q, f) in [&mut a, &mut b].into_iter().zip(&mut failed) {
                    // SAFETY: the device stays the queue's own; only its
                    // next doorbell is made to fail (a virtio queue with
                    // nothing new rings none).
                    unsafe { q.device_mut() }.fail_next = true;
                    *f = q.kick().is_err();
                    // SAFETY: as above.
                    unsafe { q.device_mut() }.fail_next = false;
                }
                prop_assert_eq!(failed[0], failed[1]);
            }
            Step::Reap => {
                let ra = text(a.reap_completions(&mut done_a));
                prop_assert_eq!(ra, text(b.reap_completions(&mut done_b)));
            }
        }
        prop_assert_eq!(seen(&a), seen(&b));
        prop_assert_eq!(&done_a, &done_b);
    }
    for (q, done) in [(&mut a, &mut done_a), (&mut b, &mut done_b)] {
        q.kick().unwrap();
        let mut tokens = Vec::new();
        q.wait_tokens(common::WAIT, &mut tokens).unwrap();
        // The device errors, if any, are in the counters compared below.
        let ok = |token| Completion {
            token,
            status: Status::Ok,
        };
        done.extend(tokens.into_iter().map(ok));
    }
    prop_assert_eq!(&done_a, &done_b);
    prop_assert_eq!(seen(&a), seen(&b));
    prop_assert_eq!(a.take_frames(), b.take_frames());
    let (na, nb) = (a.device().counters(), b.device().counters());
    prop_assert_eq!((na.faults, na.bad_desc), (0, 0));
    prop_assert_eq!(na, nb);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 256 }))]

    /// `send_burst` (which posts a run of plain inline packets in one
    /// loop) and a loop of `send` calls, fed the same random bursts,
    /// doorbells (some failing) and reaps on two queues alike, give the
    /// same counts and errors, the same counters and room, the same
    /// completions, and the same frames on the wire: in both formats, on
    /// rings small enough for a burst to fill, with small and large
    /// bounce slots or none, MTUs and pool limits below a slot, reports
    /// asked every 1 to 32 packets, and packets at every edge of those
    /// limits, offloaded or not, well-formed or refused.
    #[test]
    fn a_burst_posts_what_a_loop_of_sends_posts(
        s in setup(),
        steps in proptest::collection::vec(step(), 1..if cfg!(miri) { 6 } else { 25 }),
    ) {
        let capture = softnic::Config { verify: false, capture: true, ..Default::default() };
        if s.virtio {
            same_as_one_by_one(|| flaky_queue(&s, |m| VirtioNet::new(m, capture).unwrap()), &steps)?;
        } else {
            same_as_one_by_one(|| flaky_queue(&s, |m| SoftNic::new(m, capture)), &steps)?;
        }
    }
}
