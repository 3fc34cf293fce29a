//! Runs on a real 82576 through VFIO.

use super::*;

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
    check(cfg)?;
    if cfg.iommu != IommuMode::Strict {
        return Err(RunError::Setting(format!(
            "VFIO runs under the kernel's type1 IOMMU driver, which unmaps strictly; iommu {} is not available",
            cfg.iommu.name()
        )));
    }
    if cfg.limits != Limits::UNLIMITED
        || cfg.queues > 1
        || cfg.model != DeviceModel::Soft
        || cfg.device != DeviceSetup::default()
    {
        return Err(RunError::Setting(
            "VFIO runs drive one queue of the real NIC without memory limits: \
             --mem-limits, --queues, --model, --device-thread, --line-rate and \
             --iommu-latency do not apply"
                .into(),
        ));
    }
    let pci = VfioPci::open(bdf)?;
    let mapper = Arc::new(VfioMapper::new(&pci)?);
    let nic = Igb::new(pci, IgbConfig::default())?;
    let domain = Arc::new(Domain::new(mapper.clone()));
    let pool = Pool::new(domain.clone(), cfg.pool_config()?)?;
    // No buffer may cross a 4 KiB page: QEMU's emulated 82576 drops them
    // behind an emulated IOMMU.
    let tx = cfg.tx_config(0, Some(pfrag::PAGE_SIZE as usize));
    // SAFETY: the NIC is the VFIO device in the container that `domain`
    // maps into.
    let mut q = unsafe { tx::Queue::new(domain, pool.clone(), nic, tx) }?;
    let mut gen = Traffic::new(cfg.flows, cfg.mss)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    pump(&mut q, &mut gen, cfg, cfg.warmup, &mut rng, tick)?;

    let magic = crate::vm::MARK_MAGIC | (window & 0x7f_ffff) << 1;
    let (m0, q0, c0, pool0) = (mapper.stats(), q.stats(), q.cache().stats(), pool.stats());
    // SAFETY: the device is only asked for its counters, never replaced
    // or re-pointed.
    let g0 = unsafe { q.device_mut() }.stats()?.good_packets;
    q.device().mark(magic)?;
    let (t0, cpu0) = (Instant::now(), thread_cpu_ns());
    let bytes = pump(&mut q, &mut gen, cfg, cfg.packets, &mut rng, tick)?;
    let ns = t0.elapsed().as_nanos() as f64;
    let driver_ns = thread_cpu_ns().saturating_sub(cpu0);
    q.device().mark(magic | 1)?;
    let m = mapper.stats().since(&m0);
    let (qs, cs) = (q.stats(), q.cache().stats());
    // SAFETY: as above.
    let sent = unsafe { q.device_mut() }.stats()?.good_packets - g0;
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
    };
    Ok(Row {
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
        device_model: "igb".into(),
        device_ns_per_pkt: None,
        cost_call_ns: None,
        cost_pte_ns: None,
        cost_inval_ns: None,
        cost_miss_ns: None,
        ..common.row("vfio", cfg)
    })
}
