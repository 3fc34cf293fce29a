use super::*;

/// A ring of 64 descriptors written by hand, with a page of 128-byte
/// header slots: for posting what the TX queue never would.
struct HandRing {
    ring: Coherent<VfioMapper>,
    hdrs: Coherent<VfioMapper>,
}

impl HandRing {
    fn new(domain: &Dom) -> HandRing {
        HandRing {
            ring: Coherent::new(domain.clone(), 64 * desc::SIZE, Dir::BIDIRECTIONAL).unwrap(),
            hdrs: Coherent::new(domain.clone(), 4096, Dir::TO_DEVICE).unwrap(),
        }
    }

    fn put(&self, i: usize, d: Desc) {
        let w = d.encode();
        self.ring.write_u64(i * desc::SIZE, w[0]).unwrap();
        self.ring.write_u64(i * desc::SIZE + 8, w[1]).unwrap();
    }

    fn dd(&self, i: usize) -> bool {
        let status = self
            .ring
            .read_u32(i * desc::SIZE + desc::STATUS_OFFSET)
            .unwrap();
        status & Sta::DD.bits() != 0
    }

    /// A TSO packet of `flow` at descriptors `at..at + 3`: its context,
    /// its header (from slot `at`) and `len` payload bytes at `buf`.
    fn post(&self, flow: usize, at: usize, buf: pfrag::Iova, len: usize) {
        let mut fl = Flow::new(flow).unwrap();
        let mut hdr = [0u8; HDR_LEN];
        fl.next_header(len, MSS, &mut hdr);
        self.hdrs.write(at * 128, &hdr).unwrap();
        let (maclen, iplen) = (flow::MACLEN as u8, flow::IPLEN as u16);
        let ctx = Context::tcp_ipv4(maclen, iplen, flow::L4LEN as u8, MSS as u16);
        self.put(at, Desc::Context(ctx));
        let hdr_iova = self.hdrs.iova().raw() + (at * 128) as u64;
        let paylen = (len + HDR_LEN) as u32;
        let csum = Popts::IXSM | Popts::TXSM;
        let head = Data::new(hdr_iova, HDR_LEN as u16, Dcmd::IFCS, paylen, csum);
        self.put(at + 1, Desc::Data(head));
        let end = Dcmd::IFCS | Dcmd::EOP | Dcmd::RS;
        let body = Data::new(buf.raw(), len as u16, end, 0, Popts::empty());
        self.put(at + 2, Desc::Data(body));
    }
}

/// Memory that holds exactly what `flow`'s first 1,000 payload bytes
/// should be, mapped and then unmapped (the IOTLB invalidated), and the
/// IOVA it had: if the IOMMU let the device read there, the host would
/// find a valid frame of that flow. The region must outlive the test's
/// last device access.
fn unmapped_copy(domain: &Dom, flow: usize) -> (pfrag::mem::Region, pfrag::Iova) {
    let mut secret = pfrag::mem::Region::new(4096, 4096, false).unwrap();
    let mut want = vec![0u8; 1000];
    vfio_nic::gen::pattern::fill(flow as u32, 0, &mut want);
    secret.write(0, &want).unwrap();
    // SAFETY: `secret` outlives the mapping: it is unmapped (strictly, by
    // VFIO) on the next line, and the caller keeps the region.
    let bad = unsafe { domain.map(secret.addr(), 4096, 4096, Dir::TO_DEVICE) }.unwrap();
    // SAFETY: the mapping was made on the line above, for this test alone.
    unsafe { domain.unmap(bad, 4096) }.unwrap();
    (secret, bad)
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn descriptor_at_unmapped_iova_is_blocked_and_does_not_hang() {
    const BLOCKED_FLOW: usize = 98;
    const GOOD_FLOW: usize = 99;
    let (domain, mut nic) = open();
    let r = HandRing::new(&domain);
    let payload = Coherent::new(domain.clone(), 4096, Dir::TO_DEVICE).unwrap();
    let (secret, bad) = unmapped_copy(&domain, BLOCKED_FLOW);
    // SAFETY: the ring is this test's, kept as long as the NIC.
    unsafe { nic.attach(r.ring.iova(), 64) }.unwrap();
    println!("pcap-blocked-flow: {BLOCKED_FLOW}");
    let log_end = kmsg_end();
    r.post(BLOCKED_FLOW, 0, bad, 1000);
    // SAFETY: the descriptors name the header slots (coherent memory, which
    // the CPU touches only through atomic accessors) and `bad`, which
    // nothing maps any more; the device only reads.
    unsafe { nic.kick(3) }.unwrap();
    let t0 = Instant::now();
    while !r.dd(2) && t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(1));
    }
    println!(
        "blocked descriptor: written back {} after {:?}, device head {:?}",
        r.dd(2),
        t0.elapsed(),
        nic.head()
    );
    let faults = kmsg_records(log_end, WAIT, |rec| {
        dmar_fault_addr(rec) == Some(bad.raw() & !0xfff)
    });
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
    r.post(GOOD_FLOW, 3, payload.iova(), 1000);
    // SAFETY: the new descriptors name the header slots and `payload`,
    // coherent memory that the CPU leaves alone until the write-back.
    unsafe { nic.kick(6) }.unwrap();
    let t0 = Instant::now();
    while !r.dd(5) {
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
    let mut q = persistent_queue(&domain, nic, 2);
    let mut g = traffic(1);
    // Transmitter off: descriptors are posted but never processed.
    // SAFETY: turning the transmitter off makes the NIC touch no memory.
    unsafe { q.device().write(vfio_nic::hw::igb::regs::TCTL, 0) }.unwrap();
    g.send(&mut q, 0, 3000).unwrap();
    q.kick().unwrap();
    // The wait ends (the test would hang otherwise), and only after its
    // timeout.
    let err = q.wait(Duration::from_millis(300)).unwrap_err();
    println!("stalled: {err}");
    if let Error::Timeout { waited_ms, .. } = err {
        assert!(waited_ms >= 300, "gave up after {waited_ms} ms");
    }
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
    // SAFETY: back on, the NIC reads the queue's own ring and frags, which
    // the queue handed over at its kick.
    unsafe { q.device().write(vfio_nic::hw::igb::regs::TCTL, on.bits()) }.unwrap();
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
