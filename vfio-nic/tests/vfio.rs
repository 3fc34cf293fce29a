//! Real VFIO: the TX queue driving an 82576 bound to vfio-pci, with DMA
//! through the IOMMU. These need the device, so they are ignored by a plain
//! `cargo test`; `vm/run.sh test` runs them in a QEMU guest with an
//! emulated VT-d IOMMU and 82576, as
//! `vfio-<hash> --ignored --test-threads=1 --nocapture`, then checks the
//! frames QEMU captured against the `pcap-expect:` lines printed here.
//!
//! `PFRAG_VFIO_DEVICE` names the device (default `0000:00:02.0`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pfrag::bounce::SlotSize;
use pfrag::dma::{Coherent, Dir, DmaMapper, Domain};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::desc::{self, Context, Data, Dcmd, Desc, Popts, Sta};
use vfio_nic::device::TxDevice;
use vfio_nic::gen::flow::{self, Flow, HDR_LEN};
use vfio_nic::gen::Traffic;
use vfio_nic::hw::igb::{Igb, IgbConfig};
use vfio_nic::hw::vfio::{self as vf, VfioMapper, VfioPci};
use vfio_nic::tx::{self, HeaderMode};
use vfio_nic::Error;

const WAIT: Duration = Duration::from_secs(10);
const MSS: usize = 1448;

fn bdf() -> String {
    std::env::var("PFRAG_VFIO_DEVICE").unwrap_or_else(|_| "0000:00:02.0".into())
}

type Dom = Arc<Domain<VfioMapper>>;

fn open() -> (Dom, Igb) {
    let pci = VfioPci::open(&bdf()).expect("open the VFIO device");
    let mapper = VfioMapper::new(&pci).expect("read the container's IOMMU info");
    assert!(
        !mapper.ranges().is_empty(),
        "the type1 driver reports usable IOVA ranges"
    );
    let nic = Igb::new(pci, IgbConfig::default()).expect("reset and link up");
    (Arc::new(Domain::new(mapper)), nic)
}

/// TX settings for the emulated device: no buffer may cross an IOMMU page
/// (QEMU maps each buffer as one IOTLB entry and drops packets whose
/// buffers cross one).
fn txcfg(header: HeaderMode) -> tx::Config {
    tx::Config {
        header,
        boundary: Some(4096),
        ..tx::Config::default()
    }
}

type Queue = tx::Queue<VfioMapper, Igb>;

/// The traffic generator for `flows` flows.
fn traffic(flows: usize) -> Traffic<VfioMapper> {
    Traffic::new(flows, MSS as u16).unwrap()
}

/// Posts one generated packet, kicking and waiting for completions while
/// the ring is full.
fn send(q: &mut Queue, g: &mut Traffic<VfioMapper>, flow: usize, len: usize) -> Result<(), Error> {
    g.send_waiting(q, flow, len, WAIT)
}

/// Tells the host how many frames this test put on the wire.
fn expect_on_wire(frames: u64) {
    println!("pcap-expect: {frames}");
}

fn segments(len: usize) -> u64 {
    len.div_ceil(MSS) as u64
}

fn header_for(policy: Policy) -> HeaderMode {
    match policy {
        Policy::PerFrag => HeaderMode::Mapped,
        _ => HeaderMode::Bounce(SlotSize::B128),
    }
}

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
            let mut q = tx::Queue::new(domain.clone(), pool.clone(), nic, cfg).unwrap();
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
struct Limit(u32);

impl Limit {
    fn set(n: u32) -> Limit {
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
        let mut q = tx::Queue::new(domain.clone(), pool.clone(), nic, cfg).unwrap();
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
        drop(q);
        drop(pool);
        assert_eq!(
            domain.mapper().dma_avail().unwrap(),
            Some(LIMIT),
            "nothing stays mapped after the error"
        );
    }

    // Persistent: a handful of mappings for the whole run.
    let (domain, nic) = open();
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(4).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let cfg = txcfg(HeaderMode::Bounce(SlotSize::B128));
    let mut q = tx::Queue::new(domain.clone(), pool.clone(), nic, cfg).unwrap();
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

/// Kernel log records (from `/dev/kmsg`) that contain `needle`, waiting up
/// to `wait` for one to appear.
fn kmsg_records(needle: &str, wait: Duration) -> Vec<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let t0 = Instant::now();
    loop {
        let mut found = Vec::new();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open("/dev/kmsg")
        {
            let mut buf = vec![0u8; 8192];
            // One record per read; EAGAIN at the end.
            while let Ok(n) = f.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let rec = String::from_utf8_lossy(&buf[..n]).into_owned();
                if rec.contains(needle) {
                    found.push(rec.trim_end().to_owned());
                }
            }
        }
        if !found.is_empty() || t0.elapsed() >= wait {
            return found;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn descriptor_at_unmapped_iova_is_blocked_and_does_not_hang() {
    const BLOCKED_FLOW: usize = 98;
    const GOOD_FLOW: usize = 99;
    let (domain, mut nic) = open();
    let ring = Coherent::new(domain.clone(), 64 * desc::SIZE, Dir::BIDIRECTIONAL).unwrap();
    let hdr_mem = Coherent::new(domain.clone(), 4096, Dir::TO_DEVICE).unwrap();
    let payload = Coherent::new(domain.clone(), 4096, Dir::TO_DEVICE).unwrap();
    // Memory that holds exactly what the blocked packet's payload should
    // be, mapped and then unmapped (IOTLB invalidated): if the IOMMU let
    // the device read it, the host would find a valid frame of that flow.
    let secret = pfrag::mem::Region::new(4096, 4096, false).unwrap();
    let mut want = vec![0u8; 1000];
    vfio_nic::gen::pattern::fill(BLOCKED_FLOW as u32, 0, &mut want);
    secret.write(0, &want).unwrap();
    // SAFETY: `secret` outlives the mapping: it is unmapped (strictly, by
    // VFIO) on the next line and the region dropped at the end of the test.
    let bad = unsafe { domain.map(secret.addr(), 4096, 4096, Dir::TO_DEVICE) }.unwrap();
    domain.unmap(bad, 4096).unwrap();
    nic.attach(ring.iova(), 64).unwrap();
    let put = |i: usize, d: Desc| {
        let w = d.encode();
        ring.write_u64(i * desc::SIZE, w[0]).unwrap();
        ring.write_u64(i * desc::SIZE + 8, w[1]).unwrap();
    };
    let dd = |i: usize| {
        ring.read_u32(i * desc::SIZE + desc::STATUS_OFFSET).unwrap() & Sta::DD.bits() != 0
    };
    let post = |flow: usize, at: usize, buf: pfrag::Iova, len: usize| {
        let mut fl = Flow::new(flow).unwrap();
        let mut hdr = [0u8; HDR_LEN];
        fl.next_header(len, MSS, &mut hdr);
        hdr_mem.write(at * 128, &hdr).unwrap();
        let ctx = Context::tcp_ipv4(
            flow::MACLEN as u8,
            flow::IPLEN as u16,
            flow::L4LEN as u8,
            MSS as u16,
        );
        put(at, Desc::Context(ctx));
        put(
            at + 1,
            Desc::Data(Data::new(
                hdr_mem.iova().raw() + (at * 128) as u64,
                HDR_LEN as u16,
                Dcmd::IFCS,
                (len + HDR_LEN) as u32,
                Popts::IXSM | Popts::TXSM,
            )),
        );
        put(
            at + 2,
            Desc::Data(Data::new(
                buf.raw(),
                len as u16,
                Dcmd::IFCS | Dcmd::EOP | Dcmd::RS,
                0,
                Popts::empty(),
            )),
        );
    };
    println!("pcap-blocked-flow: {BLOCKED_FLOW}");
    post(BLOCKED_FLOW, 0, bad, 1000);
    nic.kick(3).unwrap();
    let t0 = Instant::now();
    while !dd(2) && t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "blocked descriptor: written back {} after {:?}, device head {:?}",
        dd(2),
        t0.elapsed(),
        nic.head()
    );
    let faults = kmsg_records(
        &format!("fault addr {:#x}", bad.raw()),
        Duration::from_secs(3),
    );
    for f in &faults {
        println!("kernel: {f}");
    }
    assert!(
        !faults.is_empty(),
        "the IOMMU reported no fault for the read at {bad}"
    );

    // The device goes on: a good packet on another flow gets out.
    let mut data = vec![0u8; 1000];
    vfio_nic::gen::pattern::fill(GOOD_FLOW as u32, 0, &mut data);
    payload.write(0, &data).unwrap();
    post(GOOD_FLOW, 3, payload.iova(), 1000);
    nic.kick(6).unwrap();
    let t0 = Instant::now();
    while !dd(5) {
        assert!(
            t0.elapsed() < WAIT,
            "good packet after a blocked one did not complete"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    expect_on_wire(1);
    drop(secret);
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn stalled_transmitter_times_out_instead_of_hanging() {
    let (domain, nic) = open();
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(2).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let cfg = txcfg(HeaderMode::Bounce(SlotSize::B128));
    let mut q = tx::Queue::new(domain, pool, nic, cfg).unwrap();
    let mut g = traffic(1);
    // Transmitter off: descriptors are posted but never processed.
    q.device_mut()
        .write(vfio_nic::hw::igb::regs::TCTL, 0)
        .unwrap();
    g.send(&mut q, 0, 3000).unwrap();
    q.kick().unwrap();
    let t0 = Instant::now();
    let err = q.wait(Duration::from_millis(300)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    println!("stalled: {err}");
    assert!(
        matches!(
            err,
            Error::Timeout {
                pending: 1,
                head: Some(0),
                ..
            }
        ),
        "{err:?}"
    );
    // Back on, and the same packet completes.
    let on = vfio_nic::hw::igb::Tctl::EN | vfio_nic::hw::igb::Tctl::PSP;
    q.device_mut()
        .write(vfio_nic::hw::igb::regs::TCTL, on.bits())
        .unwrap();
    q.kick().unwrap();
    assert_eq!(q.wait(WAIT).unwrap(), 1);
    expect_on_wire(segments(3000));
}

/// The calling thread's capability sets, through the raw capget/capset
/// system calls (version 3: two 32-bit words per set).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

const CAP_V3: u32 = 0x2008_0522;
const CAP_IPC_LOCK: u32 = 14;

fn capget() -> [CapData; 2] {
    let mut h = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    let mut d = [CapData::default(); 2];
    // SAFETY: capget reads the header and writes two CapData, the layout
    // of the kernel's v3 structures, both valid for the call.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) };
    assert_eq!(r, 0, "capget: {}", std::io::Error::last_os_error());
    d
}

fn capset(d: &[CapData; 2]) {
    let mut h = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    // SAFETY: as in capget; capset only reads `d`.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) };
    assert_eq!(r, 0, "capset: {}", std::io::Error::last_os_error());
}

/// Lowers RLIMIT_MEMLOCK and drops CAP_IPC_LOCK from this thread's
/// effective set (VFIO checks it per map call) while it lives.
struct NoLockCap {
    caps: [CapData; 2],
    limit: libc::rlimit,
}

impl NoLockCap {
    fn with_memlock(bytes: u64) -> NoLockCap {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit.
        let r = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
        assert_eq!(r, 0);
        let low = libc::rlimit {
            rlim_cur: bytes,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit.
        let r = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) };
        assert_eq!(r, 0);
        let caps = capget();
        let mut less = caps;
        less[0].effective &= !(1 << CAP_IPC_LOCK);
        capset(&less);
        NoLockCap { caps, limit }
    }
}

impl Drop for NoLockCap {
    fn drop(&mut self) {
        capset(&self.caps);
        // SAFETY: setrlimit reads one rlimit.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &self.limit) };
    }
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn memlock_limit_without_cap_ipc_lock_gives_enomem() {
    let (domain, _nic) = open();
    let small = Coherent::new(domain.clone(), 64 << 10, Dir::TO_DEVICE).unwrap();
    let avail = domain.mapper().dma_avail().unwrap();
    let err = {
        let _guard = NoLockCap::with_memlock(1 << 20);
        Coherent::new(domain.clone(), 8 << 20, Dir::TO_DEVICE).unwrap_err()
    };
    println!("memlock: {err}");
    assert_eq!(err.errno(), Some(libc::ENOMEM), "{err}");
    assert!(err.to_string().contains("RLIMIT_MEMLOCK"), "{err}");
    assert_eq!(
        domain.mapper().dma_avail().unwrap(),
        avail,
        "the refused map left nothing behind"
    );
    // With the capability back, the same request succeeds.
    let big = Coherent::new(domain.clone(), 8 << 20, Dir::TO_DEVICE).unwrap();
    drop((big, small));
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn mac_loopback_receives_what_was_sent() {
    use vfio_nic::check::wire::WireCheck;
    use vfio_nic::hw::igb::RxRing;
    let (domain, mut nic) = open();
    let rx = RxRing::new(domain.clone(), 128).unwrap();
    nic.start_rx(&rx, true).unwrap();
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(2).unwrap(), Policy::Persistent),
    )
    .unwrap();
    let mut q =
        tx::Queue::new(domain, pool, nic, txcfg(HeaderMode::Bounce(SlotSize::B128))).unwrap();
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
                    q.device().rx_tail(tail).unwrap();
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
    nic.stop_rx().unwrap();
    println!(
        "loopback: {} frames received and checked in the guest",
        r.frames
    );
}
