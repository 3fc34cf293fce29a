//! One configuration, measured: build the IOMMU, pool, TX queue and software
//! NIC, warm up, then time `packets` packets and turn counter differences
//! into per-packet figures.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pfrag::dma::{
    CostModel, DmaMapper, Domain, Identity, Invalidation, SoftIommu, SoftIommuConfig, Translate,
};
use pfrag::pool::{Policy, Pool, PoolConfig};
use pfrag::Order;
use vfio_nic::csum::Csum;
use vfio_nic::device::TxDevice;
use vfio_nic::igb::{Igb, IgbConfig};
use vfio_nic::pattern;
use vfio_nic::softnic::{SoftNic, SoftNicConfig, Touch};
use vfio_nic::txq::{HeaderMode, TxConfig, TxQueue};
use vfio_nic::vfio::{VfioMapper, VfioPci};

/// The IOMMU under the software NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IommuMode {
    /// No IOMMU (identity mapping).
    Off,
    /// Software IOMMU, strict invalidation.
    Strict,
    /// Software IOMMU, lazy invalidation (flush queue).
    Lazy,
}

impl IommuMode {
    /// The lab's name for it.
    pub fn name(self) -> &'static str {
        match self {
            IommuMode::Off => "off",
            IommuMode::Strict => "strict",
            IommuMode::Lazy => "lazy",
        }
    }
}

/// Everything that defines one measured configuration.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Chunk order.
    pub order: u32,
    /// Mapping policy.
    pub policy: Policy,
    /// IOMMU mode.
    pub iommu: IommuMode,
    /// Header placement.
    pub header: HeaderMode,
    /// Fit each payload whole in one chunk.
    pub fit_whole: bool,
    /// Payload bytes per packet.
    pub payload: usize,
    /// Flows, round robin.
    pub flows: usize,
    /// Packets measured.
    pub packets: u64,
    /// Packets sent before measuring.
    pub warmup: u64,
    /// TX ring descriptors.
    pub ring: u16,
    /// Packets posted per doorbell.
    pub burst: u64,
    /// IOTLB entries of the software IOMMU.
    pub iotlb_entries: usize,
    /// Back the pool with 2 MiB huge pages (and map superpages).
    pub hugepages: bool,
    /// How much payload the NIC reads.
    pub touch: Touch,
    /// Cost model for modelled IOMMU time.
    pub cost: CostModel,
}

/// One result row. Field names are the CSV column names.
#[derive(Clone, Debug, Default)]
pub struct Row {
    /// `soft` (software NIC) or `vfio`.
    pub backend: String,
    /// Chunk order (empty for the limit row).
    pub order: String,
    /// Mapping policy, or `limit`.
    pub policy: String,
    /// `off`, `strict` or `lazy`.
    pub iommu: String,
    /// `bounce` or `mapped`.
    pub header: String,
    /// Flows, round robin.
    pub flows: usize,
    /// Packets measured (after the warm-up).
    pub packets: u64,
    /// Payload bytes per packet.
    pub payload_bytes: usize,
    /// Map calls per packet (a batch is one call).
    pub maps_per_pkt: f64,
    /// Unmap calls per packet.
    pub unmaps_per_pkt: f64,
    /// Page-table entries written per packet.
    pub map_pages_per_pkt: f64,
    /// IOTLB invalidation operations per packet.
    pub invalidations_per_pkt: f64,
    /// NIC translations that missed the IOTLB, per packet.
    pub iotlb_misses_per_pkt: f64,
    /// Distinct 4 KiB pages the NIC read per packet.
    pub pages_per_pkt: f64,
    /// Descriptors per packet.
    pub descs_per_pkt: f64,
    /// Chunk bytes skipped (tails, alignment) per packet.
    pub waste_bytes_per_pkt: f64,
    /// Measured wall time per packet (driver + NIC model).
    pub ns_per_pkt: f64,
    /// Payload throughput from measured time.
    pub gbit_s: f64,
    /// Modelled IOMMU time per packet (cost model; not in `ns_per_pkt`).
    pub model_iommu_ns_per_pkt: f64,
    /// Packets dropped by DMA faults or found corrupt, whole run.
    pub faults: u64,
    /// Payload bytes the NIC read and matched, measured part.
    pub bytes_verified: u64,
    /// Whether payloads were fitted whole into chunks.
    pub fit_whole: bool,
    /// Pool memory mapped for DMA at the end.
    pub pool_bytes: u64,
    /// Packets sent before measuring.
    pub warmup: u64,
    /// `checksum` or `pages`.
    pub touch: String,
    /// `small`, `huge` or `huge-fallback`.
    pub backing: String,
}

/// Failures of a run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The NIC side failed.
    #[error(transparent)]
    Nic(#[from] vfio_nic::Error),
    /// The pool side failed.
    #[error(transparent)]
    Pool(#[from] pfrag::Error),
    /// A setting is out of range.
    #[error("invalid setting: {0}")]
    Setting(String),
}

fn header_name(h: HeaderMode) -> &'static str {
    match h {
        HeaderMode::Bounce(_) => "bounce",
        HeaderMode::Mapped => "mapped",
    }
}

fn touch_name(t: Touch) -> &'static str {
    match t {
        Touch::Checksum => "checksum",
        Touch::Pages => "pages",
    }
}

/// Runs `cfg` on the software NIC. `tick` is called with packet counts as
/// they are sent (for progress).
pub fn run(cfg: &RunConfig, tick: &mut dyn FnMut(u64)) -> Result<Row, RunError> {
    Order::new(cfg.order)?;
    if cfg.payload == 0 || cfg.packets == 0 || cfg.burst == 0 {
        return Err(RunError::Setting(format!(
            "payload {}, packets {} and burst {} must be > 0",
            cfg.payload, cfg.packets, cfg.burst
        )));
    }
    match cfg.iommu {
        IommuMode::Off => measure(cfg, Arc::new(Identity::new()), tick),
        mode => {
            let m = SoftIommu::new(SoftIommuConfig {
                iotlb_entries: cfg.iotlb_entries,
                invalidation: if mode == IommuMode::Lazy {
                    Invalidation::Lazy
                } else {
                    Invalidation::Strict
                },
                superpages: cfg.hugepages,
                cost: Some(cfg.cost),
                ..SoftIommuConfig::default()
            });
            measure(cfg, Arc::new(m), tick)
        }
    }
}

/// How long a queue may go without completing anything before the run
/// fails (a stuck device), instead of waiting forever.
const STALL: Duration = Duration::from_secs(10);

fn pump<M: DmaMapper, D: TxDevice>(
    q: &mut TxQueue<M, D>,
    cfg: &RunConfig,
    n: u64,
    tick: &mut dyn FnMut(u64),
) -> Result<(), RunError> {
    let mut since_tick = 0;
    for i in 0..n {
        let flow = (i % cfg.flows as u64) as usize;
        let mut full_since: Option<Instant> = None;
        loop {
            match q.send(flow, cfg.payload) {
                Ok(()) => break,
                Err(e) if e.is_backoff() => {
                    q.kick()?;
                    if q.reap()? > 0 {
                        full_since = None;
                        continue;
                    }
                    if q.in_flight() == 0 {
                        return Err(match e {
                            vfio_nic::Error::RingFull { .. } => RunError::Setting(format!(
                                "a {}-byte packet cannot fit a {}-descriptor ring",
                                cfg.payload, cfg.ring
                            )),
                            other => other.into(),
                        });
                    }
                    let t = *full_since.get_or_insert_with(Instant::now);
                    if t.elapsed() > STALL {
                        q.wait(Duration::ZERO)?;
                    }
                    std::hint::spin_loop();
                }
                Err(e) => return Err(e.into()),
            }
        }
        if (i + 1) % cfg.burst == 0 {
            q.kick()?;
        }
        since_tick += 1;
        if since_tick == 256 {
            tick(since_tick);
            since_tick = 0;
        }
    }
    q.kick()?;
    q.wait(STALL)?;
    tick(since_tick);
    Ok(())
}

fn measure<M: DmaMapper + Translate + 'static>(
    cfg: &RunConfig,
    mapper: Arc<M>,
    tick: &mut dyn FnMut(u64),
) -> Result<Row, RunError> {
    let domain = Arc::new(Domain::new(mapper.clone()));
    let mut pcfg = PoolConfig::new(Order::new(cfg.order)?, cfg.policy);
    pcfg.hugepages = cfg.hugepages;
    let pool = Pool::new(domain.clone(), pcfg)?;
    let nic = SoftNic::new(
        mapper.clone(),
        SoftNicConfig {
            touch: cfg.touch,
            capture: false,
        },
    );
    let tx = TxConfig {
        ring: cfg.ring,
        header: cfg.header,
        fit_whole: cfg.fit_whole,
        flows: cfg.flows,
        ..TxConfig::default()
    };
    let mut q = TxQueue::new(domain, pool.clone(), nic, tx)?;
    pump(&mut q, cfg, cfg.warmup, tick)?;

    let (m0, n0, q0, c0) = (
        mapper.stats(),
        q.device().stats(),
        q.stats(),
        q.cache().stats(),
    );
    let t0 = Instant::now();
    pump(&mut q, cfg, cfg.packets, tick)?;
    let ns = t0.elapsed().as_nanos() as f64;
    let (m, n) = (mapper.stats().since(&m0), q.device().stats());
    let (qs, cs) = (q.stats(), q.cache().stats());

    let p = cfg.packets as f64;
    let common = Measured {
        map: m,
        descs: qs.descs - q0.descs,
        waste: cs.waste_bytes - c0.waste_bytes,
        ns,
        pool: pool.stats(),
    };
    Ok(Row {
        iotlb_misses_per_pkt: m.iotlb_misses as f64 / p,
        pages_per_pkt: (n.pages - n0.pages) as f64 / (n.packets - n0.packets).max(1) as f64,
        model_iommu_ns_per_pkt: m.model_ns / p,
        faults: n.faults + n.bad_payload + n.bad_desc,
        bytes_verified: n.bytes_verified - n0.bytes_verified,
        touch: touch_name(cfg.touch).into(),
        ..common.row("soft", cfg)
    })
}

/// What both backends measure over a run's measured part.
struct Measured {
    map: pfrag::dma::MapStats,
    descs: u64,
    waste: u64,
    ns: f64,
    pool: pfrag::pool::PoolStats,
}

impl Measured {
    /// The row's columns common to both backends.
    fn row(&self, backend: &str, cfg: &RunConfig) -> Row {
        let p = cfg.packets as f64;
        let m = &self.map;
        Row {
            backend: backend.into(),
            order: cfg.order.to_string(),
            policy: cfg.policy.name().into(),
            iommu: cfg.iommu.name().into(),
            header: header_name(cfg.header).into(),
            flows: cfg.flows,
            packets: cfg.packets,
            payload_bytes: cfg.payload,
            maps_per_pkt: m.map_calls as f64 / p,
            unmaps_per_pkt: m.unmap_calls as f64 / p,
            map_pages_per_pkt: m.ptes_written as f64 / p,
            invalidations_per_pkt: m.invalidations as f64 / p,
            descs_per_pkt: self.descs as f64 / p,
            waste_bytes_per_pkt: self.waste as f64 / p,
            ns_per_pkt: self.ns / p,
            gbit_s: cfg.payload as f64 * 8.0 * p / self.ns,
            fit_whole: cfg.fit_whole,
            pool_bytes: self.pool.mapped_bytes,
            warmup: cfg.warmup,
            backing: backing_name(cfg.hugepages, self.pool.huge_fallbacks).into(),
            ..Row::default()
        }
    }
}

/// Runs `cfg` on the Intel 82576 at PCI address `bdf` through VFIO (the
/// kernel's type1 IOMMU driver, strict by construction: each unmap ioctl
/// ends with its IOTLB invalidation). Data buffers are split at 4 KiB, as
/// QEMU's emulated 82576 needs behind an emulated IOMMU.
///
/// The measured part is framed by two [`Igb::mark`] writes carrying
/// `crate::vm::MARK_MAGIC | window << 1` and `| 1`, so that the IOMMU events
/// of an emulator's trace can be counted per row. Payload bytes are not
/// read back here (`bytes_verified` is 0): the frames are checked where
/// they are captured.
pub fn run_vfio(
    cfg: &RunConfig,
    bdf: &str,
    window: u32,
    tick: &mut dyn FnMut(u64),
) -> Result<Row, RunError> {
    Order::new(cfg.order)?;
    if cfg.iommu != IommuMode::Strict {
        return Err(RunError::Setting(format!(
            "VFIO runs under the kernel's type1 IOMMU driver, which unmaps strictly; iommu {} is not available",
            cfg.iommu.name()
        )));
    }
    if cfg.payload == 0 || cfg.packets == 0 || cfg.burst == 0 {
        return Err(RunError::Setting(format!(
            "payload {}, packets {} and burst {} must be > 0",
            cfg.payload, cfg.packets, cfg.burst
        )));
    }
    let pci = VfioPci::open(bdf)?;
    let mapper = Arc::new(VfioMapper::new(&pci)?);
    let nic = Igb::new(pci, IgbConfig::default())?;
    let domain = Arc::new(Domain::new(mapper.clone()));
    let mut pcfg = PoolConfig::new(Order::new(cfg.order)?, cfg.policy);
    pcfg.hugepages = cfg.hugepages;
    let pool = Pool::new(domain.clone(), pcfg)?;
    let tx = TxConfig {
        ring: cfg.ring,
        header: cfg.header,
        fit_whole: cfg.fit_whole,
        flows: cfg.flows,
        boundary: Some(pfrag::PAGE_SIZE as usize),
        ..TxConfig::default()
    };
    let mut q = TxQueue::new(domain, pool.clone(), nic, tx)?;
    pump(&mut q, cfg, cfg.warmup, tick)?;

    let magic = crate::vm::MARK_MAGIC | (window & 0x7f_ffff) << 1;
    let (m0, q0, c0) = (mapper.stats(), q.stats(), q.cache().stats());
    let g0 = q.device_mut().stats()?.good_packets;
    q.device().mark(magic)?;
    let t0 = Instant::now();
    pump(&mut q, cfg, cfg.packets, tick)?;
    let ns = t0.elapsed().as_nanos() as f64;
    q.device().mark(magic | 1)?;
    let m = mapper.stats().since(&m0);
    let (qs, cs) = (q.stats(), q.cache().stats());
    let sent = q.device_mut().stats()?.good_packets - g0;
    let common = Measured {
        map: m,
        descs: qs.descs - q0.descs,
        waste: cs.waste_bytes - c0.waste_bytes,
        ns,
        pool: pool.stats(),
    };
    Ok(Row {
        // Packets the device did not count as sent (the 82576 counts each
        // TSO segment, QEMU's model each packet once: both reach `packets`).
        faults: cfg.packets.saturating_sub(sent),
        touch: "wire".into(),
        ..common.row("vfio", cfg)
    })
}

fn backing_name(hugepages: bool, fallbacks: u64) -> &'static str {
    if !hugepages {
        "small"
    } else if fallbacks > 0 {
        "huge-fallback"
    } else {
        "huge"
    }
}

/// The ceiling: the NIC's own work (read, verify and checksum each MSS
/// segment of the payload) on one plain preallocated buffer, with no driver,
/// pool or IOMMU.
pub fn limit(cfg: &RunConfig) -> Row {
    let mut buf = vec![0u8; cfg.payload];
    pattern::fill(0, 0, &mut buf);
    let mss = 1448;
    let t0 = Instant::now();
    let mut verified = 0u64;
    for _ in 0..cfg.packets {
        let b = black_box(&buf[..]);
        match cfg.touch {
            Touch::Checksum => {
                for (k, seg) in b.chunks(mss).enumerate() {
                    let mut c = Csum::new();
                    if pattern::verify(0, (k * mss) as u32, seg) {
                        verified += seg.len() as u64;
                    }
                    c.add(seg);
                    black_box(c.finish());
                }
            }
            Touch::Pages => {
                for (k, page) in b.chunks(4096).enumerate() {
                    let line = &page[..page.len().min(64)];
                    if pattern::verify(0, (k * 4096) as u32, line) {
                        verified += line.len() as u64;
                    }
                }
            }
        }
    }
    let ns = t0.elapsed().as_nanos() as f64;
    let p = cfg.packets as f64;
    Row {
        backend: "soft".into(),
        order: String::new(),
        policy: "limit".into(),
        iommu: "none".into(),
        header: "none".into(),
        flows: 1,
        packets: cfg.packets,
        payload_bytes: cfg.payload,
        ns_per_pkt: ns / p,
        gbit_s: cfg.payload as f64 * 8.0 * p / ns,
        bytes_verified: verified,
        touch: touch_name(cfg.touch).into(),
        backing: "small".into(),
        ..Row::default()
    }
}
