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

/// How long a test waits for the device to make progress before it fails:
/// a guard against a stuck device, far above any healthy wait, so that a
/// guest on a busy host does not fail (every wait ends as soon as its
/// condition holds).
const WAIT: Duration = Duration::from_secs(60);
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

/// A TX queue on `nic` over a persistent pool of order-`order` chunks,
/// headers in the bounce ring.
fn persistent_queue(domain: &Dom, nic: Igb, order: u32) -> Queue {
    let cfg = pool::Config::new(Order::new(order).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), cfg).unwrap();
    let txc = txcfg(HeaderMode::Bounce(SlotSize::B128));
    // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
    unsafe { tx::Queue::new(domain.clone(), pool, nic, txc) }.unwrap()
}

/// The traffic generator for `flows` flows.
fn traffic<M: DmaMapper>(flows: usize) -> Traffic<M> {
    Traffic::new(flows, MSS as u16).unwrap()
}

/// Posts one generated packet, kicking and waiting for completions while
/// the ring is full.
fn send<M: DmaMapper>(
    q: &mut tx::Queue<M, Igb>,
    g: &mut Traffic<M>,
    flow: usize,
    len: usize,
) -> Result<(), Error> {
    g.send_waiting(q, flow, len, WAIT, &mut Vec::new())
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

mod crash;
mod faults;
mod iommufd;
mod loopback;
mod memory;
mod protect;
mod transmit;
mod virtio;

/// Kernel log records (from `/dev/kmsg`, one per read), as
/// `(sequence number, text)`.
fn kmsg_read() -> Vec<(u64, String)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut out = Vec::new();
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
    else {
        return out;
    };
    let mut buf = vec![0u8; 8192];
    // EAGAIN at the end of the log.
    while let Ok(n) = f.read(&mut buf) {
        if n == 0 {
            break;
        }
        let rec = String::from_utf8_lossy(&buf[..n]).into_owned();
        // `priority,sequence,timestamp,flags;text`
        let seq = rec.split(',').nth(1).and_then(|s| s.parse().ok());
        out.push((seq.unwrap_or(0), rec.trim_end().to_owned()));
    }
    out
}

/// The sequence number of the newest kernel log record: later searches
/// pass it to [`kmsg_records`] to skip what earlier tests logged.
fn kmsg_end() -> u64 {
    kmsg_read().last().map_or(0, |r| r.0)
}

/// Kernel log records newer than `after` for which `pred` holds, waiting
/// up to `wait` for one to appear.
fn kmsg_records(after: u64, wait: Duration, pred: impl Fn(&str) -> bool) -> Vec<String> {
    let t0 = Instant::now();
    loop {
        let found: Vec<String> = kmsg_read()
            .into_iter()
            .filter(|(seq, rec)| *seq > after && pred(rec))
            .map(|r| r.1)
            .collect();
        if !found.is_empty() || t0.elapsed() >= wait {
            return found;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The address of a DMAR fault record (`fault addr 0x...`), if it is one.
fn dmar_fault_addr(rec: &str) -> Option<u64> {
    let hex = rec.split("fault addr 0x").nth(1)?;
    let end = hex
        .find(|c: char| !c.is_ascii_hexdigit())
        .unwrap_or(hex.len());
    u64::from_str_radix(&hex[..end], 16).ok()
}
