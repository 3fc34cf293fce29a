//! Runs on a real NIC through VFIO: an 82576, or a virtio-net device.

use pfrag::dma::DmaMapper;
use vfio_nic::device::TxDevice;
use vfio_nic::hw::iommufd::IommufdMapper;
use vfio_nic::hw::virtio::{VirtioConfig, VirtioNetPci};

use super::*;

/// What the sweep needs of a NIC it drives through VFIO.
trait VfioNic: TxDevice + Sized {
    /// The `device_model` column.
    const NAME: &'static str;
    /// Opens and brings up the device.
    fn open(pci: VfioPci) -> Result<Self, RunError>;
    /// Writes a window mark an emulator's trace shows.
    fn mark(&self, v: u32) -> Result<(), RunError>;
    /// Packets the device counts as sent, if it counts them.
    fn sent(&mut self) -> Result<Option<u64>, RunError>;
    /// The largest buffer that may not cross a page of this size, if any.
    const BOUNDARY: Option<usize>;
}

impl VfioNic for Igb {
    const NAME: &'static str = "igb";
    // QEMU's emulated 82576 drops buffers that cross a 4 KiB page behind
    // an emulated IOMMU.
    const BOUNDARY: Option<usize> = Some(pfrag::PAGE_SIZE as usize);
    fn open(pci: VfioPci) -> Result<Self, RunError> {
        Ok(Igb::new(pci, IgbConfig::default())?)
    }
    fn mark(&self, v: u32) -> Result<(), RunError> {
        Ok(Igb::mark(self, v)?)
    }
    fn sent(&mut self) -> Result<Option<u64>, RunError> {
        Ok(Some(self.stats()?.good_packets))
    }
}

impl VfioNic for VirtioNetPci {
    const NAME: &'static str = "virtio";
    // A virtio device maps each descriptor through the IOMMU page by page.
    const BOUNDARY: Option<usize> = None;
    fn open(pci: VfioPci) -> Result<Self, RunError> {
        Ok(VirtioNetPci::new(pci, VirtioConfig::default())?)
    }
    fn mark(&self, v: u32) -> Result<(), RunError> {
        Ok(VirtioNetPci::mark(self, v)?)
    }
    fn sent(&mut self) -> Result<Option<u64>, RunError> {
        Ok(None)
    }
}

/// Runs `cfg` on the NIC at PCI address `bdf` through VFIO (the kernel's
/// type1 IOMMU driver, strict by construction: each unmap ioctl ends with
/// its IOTLB invalidation): the Intel 82576 for [`DeviceModel::Soft`]
/// (its format), a virtio-net device for [`DeviceModel::Virtio`]. For the
/// 82576, data buffers are split at 4 KiB, as QEMU's emulated 82576 needs
/// behind an emulated IOMMU.
///
/// The measured part is framed by two marks ([`Igb::mark`],
/// [`VirtioNetPci::mark`]) carrying `crate::vm::MARK_MAGIC | window << 1`
/// and `| 1`, so that the IOMMU events of an emulator's trace can be
/// counted per row. Payload bytes are not read back here
/// (`bytes_verified` is 0): the frames are checked where they are
/// captured.
///
/// `dma` says how the device is opened and its memory mapped: a type1
/// container ([`VfioMapper`]), or an iommufd IOAS through the device's
/// cdev ([`IommufdMapper`]); the `backend` column says which.
pub fn run_vfio(
    cfg: &RunConfig,
    bdf: &str,
    dma: DmaBackend,
    window: u32,
    tick: &mut dyn FnMut(u64),
) -> Result<Row, RunError> {
    /// The run, on the NIC type it picks.
    struct Open<'a> {
        cfg: &'a RunConfig,
        bdf: &'a str,
        dma: DmaBackend,
        window: u32,
        tick: &'a mut dyn FnMut(u64),
    }
    impl OnNic for Open<'_> {
        type Out = Row;
        fn on<N: VfioNic>(self) -> Result<Row, RunError> {
            open_on::<N>(self.cfg, self.bdf, self.dma, self.window, self.tick)
        }
    }
    on_nic(
        cfg,
        Open {
            cfg,
            bdf,
            dma,
            window,
            tick,
        },
    )
}

/// What a VFIO run of `cfg` refuses before it opens its device, which a
/// driver of many runs can check of them all before starting any:
/// [`check`]'s settings, a model that names a real NIC, what one queue of
/// it allows (a strict IOMMU, no memory limits, one queue, the device
/// inline), and that the run's largest packet is one a queue of that NIC
/// sends (its payload, descriptors against the ring and buffers, as
/// [`check`] checks them), in that NIC's format with its data buffers cut
/// where that NIC needs them (on the 82576, at 4 KiB: a packet takes more
/// descriptors and buffers there than on the software NIC).
pub fn check_vfio(cfg: &RunConfig) -> Result<(), RunError> {
    /// The checks, on the NIC type the model picks.
    struct Check<'a>(&'a RunConfig);
    impl OnNic for Check<'_> {
        type Out = ();
        fn on<N: VfioNic>(self) -> Result<(), RunError> {
            check_on::<N>(self.0)
        }
    }
    on_nic(cfg, Check(cfg))
}

/// Something done with the NIC type a VFIO run's model picks.
trait OnNic {
    /// What it gives.
    type Out;
    /// Does it with NIC type `N`.
    fn on<N: VfioNic>(self) -> Result<Self::Out, RunError>;
}

/// Does `job` with the NIC type `cfg.model` picks: the 82576 for
/// [`DeviceModel::Soft`], a virtio-net device for
/// [`DeviceModel::Virtio`]. The one place a VFIO run picks its NIC.
fn on_nic<J: OnNic>(cfg: &RunConfig, job: J) -> Result<J::Out, RunError> {
    match cfg.model {
        DeviceModel::Soft => job.on::<Igb>(),
        DeviceModel::Virtio => job.on::<VirtioNetPci>(),
        DeviceModel::Null => Err(RunError::Setting(
            "VFIO runs drive a real NIC: --model null does not apply".into(),
        )),
    }
}

/// [`check_vfio`] on NIC type `N`.
fn check_on<N: VfioNic>(cfg: &RunConfig) -> Result<(), RunError> {
    check(cfg)?;
    if cfg.iommu != IommuMode::Strict {
        return Err(RunError::Setting(format!(
            "VFIO runs under the kernel's IOMMU driver, which unmaps strictly; iommu {} is not available",
            cfg.iommu.name()
        )));
    }
    if cfg.limits != Limits::UNLIMITED || cfg.queues > 1 || cfg.device != DeviceSetup::default() {
        return Err(RunError::Setting(
            "VFIO runs drive one queue of the real NIC without memory limits: \
             --mem-limits, --queues, --model, --device-thread, --line-rate and \
             --iommu-latency do not apply"
                .into(),
        ));
    }
    check_packet::<<N as TxDevice>::Format>(cfg, N::BOUNDARY)
}

/// How a VFIO run opens its device and maps its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmaBackend {
    /// A type1 container: `VFIO_IOMMU_MAP_DMA`.
    Type1,
    /// An iommufd IOAS: `IOMMU_IOAS_MAP`.
    Iommufd,
}

impl DmaBackend {
    /// The `backend` column.
    pub fn name(self) -> &'static str {
        match self {
            DmaBackend::Type1 => "vfio",
            DmaBackend::Iommufd => "iommufd",
        }
    }
}

fn open_on<N: VfioNic>(
    cfg: &RunConfig,
    bdf: &str,
    dma: DmaBackend,
    window: u32,
    tick: &mut dyn FnMut(u64),
) -> Result<Row, RunError> {
    check_on::<N>(cfg)?;
    match dma {
        DmaBackend::Type1 => {
            let pci = VfioPci::open(bdf)?;
            let mapper = Arc::new(VfioMapper::new(&pci)?);
            run_on::<N, _>(cfg, pci, mapper, dma, window, tick)
        }
        DmaBackend::Iommufd => {
            let pci = VfioPci::open_iommufd(bdf)?;
            let mapper = Arc::new(IommufdMapper::new(&pci)?);
            run_on::<N, _>(cfg, pci, mapper, dma, window, tick)
        }
    }
}

fn run_on<N: VfioNic, M: DmaMapper>(
    cfg: &RunConfig,
    pci: VfioPci,
    mapper: Arc<M>,
    dma: DmaBackend,
    window: u32,
    tick: &mut dyn FnMut(u64),
) -> Result<Row, RunError> {
    let nic = N::open(pci)?;
    let domain = Arc::new(Domain::new(mapper.clone()));
    let pool = Pool::new(domain.clone(), cfg.pool_config()?)?;
    let tx = cfg.tx_config(0, N::BOUNDARY);
    // SAFETY: the NIC is the VFIO device in the container that `domain`
    // maps into.
    let mut q = unsafe { tx::Queue::new(domain, pool.clone(), nic, tx) }?;
    let mut gen = Traffic::new(cfg.flows, cfg.mss)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // The device keeps no fault counters here: the queue's error
    // completions are what the warm-up can lose.
    warm_up(&mut q, &mut gen, cfg, &mut rng, tick, |_| None)?;

    let magic = crate::vm::MARK_MAGIC | (window & 0x7f_ffff) << 1;
    let (m0, q0, c0, pool0) = (mapper.stats(), q.stats(), q.cache_stats(), pool.stats());
    // SAFETY: the device is only asked for its counters, never replaced
    // or re-pointed.
    let g0 = unsafe { q.device_mut() }.sent()?;
    let (done0, errors0) = (q.stats().completed, q.stats().device_errors);
    q.device().mark(magic)?;
    let (t0, cpu0) = (Instant::now(), thread_cpu_ns());
    let bytes = pump(&mut q, &mut gen, cfg, cfg.packets, &mut rng, tick)?;
    let ns = t0.elapsed().as_nanos() as f64;
    let driver_ns = thread_cpu_ns().saturating_sub(cpu0);
    q.device().mark(magic | 1)?;
    let m = mapper.stats().since(&m0);
    let (qs, cs) = (q.stats(), q.cache_stats());
    // SAFETY: as above.
    let counted = unsafe { q.device_mut() }.sent()?;
    // The device's own count where it keeps one; else the packets it
    // returned as used without an error (each one it sent).
    let sent = match (g0, counted) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => {
            let errors = qs.device_errors - errors0;
            (qs.completed - done0).saturating_sub(errors)
        }
    };
    let pool1 = pool.stats();
    // The device counts packets it sent whole; the frames themselves are
    // checked where they are captured.
    let delivered = sent.min(cfg.packets) * (bytes / cfg.packets.max(1));
    let common = Measured {
        map: m,
        packets: cfg.packets,
        bytes,
        delivered,
        descs: qs.since(&q0).descs,
        waste: cs.since(&c0).waste_bytes,
        ns,
        cpu: Some(Cpu {
            driver_ns,
            device_ns: 0,
        }),
        pool: pool1,
        delta: pool1.since(&pool0),
        iova_awaiting_flush: pool.domain().iova_awaiting_flush(),
    };
    Ok(wire_row(N::NAME, dma, cfg, common, sent))
}

/// The row of a run on a real NIC, whose device counted `sent` packets:
/// what the host cannot see there (the IOTLB, the pages read, the cost
/// model) is left empty.
fn wire_row(nic: &str, dma: DmaBackend, cfg: &RunConfig, common: Measured, sent: u64) -> Row {
    Row {
        // Packets the device did not count as sent (the 82576 counts each
        // TSO segment, QEMU's model each packet once: both reach `packets`).
        faults: cfg.packets.saturating_sub(sent),
        touch: "wire".into(),
        // The IOTLB and the pages the device read are out of sight here
        // (QEMU's trace gives them to `vm/run.sh sweep`).
        iotlb_misses_per_pkt: None,
        pages_per_pkt: None,
        model_iommu_ns_per_pkt: None,
        iotlb_entries: None,
        device_model: nic.into(),
        device_ns_per_pkt: None,
        cost_call_ns: None,
        cost_pte_ns: None,
        cost_inval_ns: None,
        cost_miss_ns: None,
        ..common.row(dma.name(), cfg)
    }
}
