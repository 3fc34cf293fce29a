//! Set-up shared by the integration tests: a TX queue with the traffic
//! generator in front of it.

#![allow(dead_code)] // each test binary uses what it needs

pub mod carved;
pub mod virtq;

use std::time::Duration;

use etherparse::PacketBuilder;

use vfio_nic::device::TxDevice;
use vfio_nic::tx;
use vfio_nic::Error;

/// How long a test waits for a device that completes nothing before it
/// fails: a guard against a stuck device, not a measure, so far above any
/// healthy wait that a busy machine does not reach it (a wait ends as soon
/// as everything completed). Miri interprets a device thread that verifies
/// every byte: longer still.
pub const WAIT: Duration = Duration::from_secs(if cfg!(miri) { 600 } else { 60 });

/// The queue with the traffic generator in front of it: `send(flow, len)`
/// posts a generated packet; everything else is the queue's own API.
pub struct Gen<Q, M: pfrag::dma::DmaMapper> {
    pub q: Q,
    pub g: vfio_nic::gen::Traffic<M>,
    /// Tokens of the packets reaped while sending, oldest first.
    pub done: Vec<u64>,
}

impl<Q, M: pfrag::dma::DmaMapper> std::ops::Deref for Gen<Q, M> {
    type Target = Q;
    fn deref(&self) -> &Q {
        &self.q
    }
}

impl<Q, M: pfrag::dma::DmaMapper> std::ops::DerefMut for Gen<Q, M> {
    fn deref_mut(&mut self) -> &mut Q {
        &mut self.q
    }
}

impl<M: pfrag::dma::DmaMapper, D: TxDevice> Gen<tx::Queue<M, D>, M> {
    pub fn new(q: tx::Queue<M, D>, flows: usize) -> Self {
        Gen {
            q,
            g: vfio_nic::gen::Traffic::new(flows, 1448).unwrap(),
            done: Vec::new(),
        }
    }
    /// Posts one generated packet.
    pub fn send(&mut self, flow: usize, len: usize) -> Result<(), Error> {
        self.g.send(&mut self.q, flow, len)
    }

    /// Posts one generated packet, reaping while the ring is full.
    pub fn send_waiting(&mut self, flow: usize, len: usize) -> Result<(), Error> {
        self.g
            .send_waiting(&mut self.q, flow, len, WAIT, &mut self.done)
    }

    /// Sends every (flow, len) of `plan`, then rings and reaps.
    pub fn send_all(&mut self, plan: &[(usize, usize)]) {
        for &(flow, len) in plan {
            if let Err(e) = self.send_waiting(flow, len) {
                panic!("send of {len} bytes on flow {flow}: {e}");
            }
        }
        self.q.kick().unwrap();
        self.q.reap().unwrap();
    }
}

/// The software IOMMU, shared by a domain and a device model.
pub type Soft = std::sync::Arc<pfrag::dma::SoftIommu>;
/// A queue on the software NIC, capturing what it sends.
pub type CaptureQueue = tx::Queue<Soft, vfio_nic::model::softnic::SoftNic<Soft>>;

/// A domain over a fresh software IOMMU, a persistent pool of
/// order-`order` chunks on it, and a software NIC on the same IOMMU that
/// captures its frames (without verifying payloads).
pub fn capture_parts(
    order: u32,
) -> (
    std::sync::Arc<pfrag::dma::Domain<Soft>>,
    pfrag::pool::Pool<Soft>,
    vfio_nic::model::softnic::SoftNic<Soft>,
) {
    use pfrag::pool::{self, Policy, Pool};
    use vfio_nic::model::softnic::{self, SoftNic};
    let iommu = Soft::new(pfrag::dma::SoftIommu::new(Default::default()).unwrap());
    let domain = std::sync::Arc::new(pfrag::dma::Domain::new(iommu.clone()));
    let pcfg = pool::Config::new(pfrag::Order::new(order).unwrap(), Policy::Persistent);
    let pool = Pool::new(domain.clone(), pcfg).unwrap();
    let cfg = softnic::Config {
        verify: false,
        capture: true,
        ..Default::default()
    };
    (domain, pool, SoftNic::new(iommu, cfg))
}

/// A queue with `cfg` over [`capture_parts`]`(order)`.
pub fn capture_queue(order: u32, cfg: tx::Config) -> Result<CaptureQueue, Error> {
    let (domain, pool, nic) = capture_parts(order);
    // SAFETY: the model translates through the IOMMU the domain maps
    // through.
    unsafe { tx::Queue::new(domain, pool, nic, cfg) }
}

/// A model device behind a doorbell that can be made to fail (handing the
/// device nothing, as `TxDevice::kick`'s contract says).
pub struct Flaky<D> {
    pub nic: D,
    /// Whether the next doorbell fails.
    pub fail_next: bool,
}

impl<D: TxDevice> TxDevice for Flaky<D> {
    type Format = D::Format;
    fn format(&self) -> Self::Format {
        self.nic.format()
    }
    unsafe fn attach(&mut self, ring: pfrag::Iova, len: u16) -> vfio_nic::Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.nic.attach(ring, len) }
    }
    unsafe fn kick(&mut self, tail: u16) -> vfio_nic::Result<()> {
        if std::mem::take(&mut self.fail_next) {
            return Err(Error::Busy { in_flight: 0 });
        }
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.nic.kick(tail) }
    }
    fn head(&mut self) -> Option<u16> {
        self.nic.head()
    }
    fn check_running(&mut self) -> vfio_nic::Result<()> {
        self.nic.check_running()
    }
}

impl<D: vfio_nic::model::Model> vfio_nic::model::Model for Flaky<D> {
    fn counters(&self) -> vfio_nic::model::softnic::NicStats {
        self.nic.counters()
    }
    fn take_frames(&mut self) -> Vec<Vec<u8>> {
        self.nic.take_frames()
    }
}

/// Ethernet + IPv4 + TCP headers (54 bytes) for a TSO packet.
pub fn tcp_headers() -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
        .ipv4([10, 0, 0, 1], [10, 0, 0, 2], 64)
        .tcp(1000, 2000, 7, 65535)
        .write(&mut v, &[0u8; 8])
        .unwrap();
    v.truncate(54);
    v
}

/// Writes `descs` into the 82576 descriptor ring `ring`, the first at
/// index 0.
pub fn put_descs<M: pfrag::dma::DmaMapper>(
    ring: &pfrag::dma::Coherent<M>,
    descs: impl IntoIterator<Item = vfio_nic::desc::Desc>,
) {
    for (i, d) in descs.into_iter().enumerate() {
        ring.write_u64s(i * vfio_nic::desc::SIZE, &d.encode())
            .unwrap();
    }
}
