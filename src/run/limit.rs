//! The two ceilings: `limit`, the per-byte work every configuration must do
//! on both sides with no pool, IOMMU or descriptors; and `driver-limit`, the
//! driver's side of it alone.

use super::*;

/// The ceiling: per packet the producer writes the payload's pattern into
/// one plain preallocated buffer (the driver's copy), and the device reads
/// it, verifying and checksumming each MSS segment (or, with
/// [`Touch::Pages`], reading a line per page): the same per-byte work as
/// every configuration, with no pool, IOMMU or descriptors.
pub fn limit(cfg: &RunConfig) -> Row {
    ceiling(cfg, true)
}

/// The driver's ceiling: the payload write alone.
pub fn driver_limit(cfg: &RunConfig) -> Row {
    ceiling(cfg, false)
}

fn ceiling(cfg: &RunConfig, device: bool) -> Row {
    let mut buf = vec![0u8; cfg.payload];
    let mss = usize::from(cfg.mss);
    let (t0, cpu0) = (Instant::now(), thread_cpu_ns());
    let (mut verified, mut delivered) = (0u64, 0u64);
    for i in 0..cfg.packets {
        // Each packet's bytes differ (its stream offset), so neither side
        // can be skipped.
        let off = (i as u32).wrapping_mul(cfg.payload as u32);
        pattern::fill(0, off, &mut buf);
        if device {
            let (v, ok) = read(cfg.touch, black_box(&buf[..]), off, mss);
            verified += v;
            delivered += if ok { cfg.payload as u64 } else { 0 };
        } else {
            black_box(&buf);
            delivered += cfg.payload as u64;
        }
    }
    let ns = t0.elapsed().as_nanos() as f64;
    let cpu = thread_cpu_ns().saturating_sub(cpu0) as f64;
    let p = cfg.packets.max(1) as f64;
    // Payload bits delivered intact (every checked byte matched) per ns.
    let gbit = delivered as f64 * 8.0 / ns.max(1.0);
    Row {
        backend: "soft".into(),
        order: String::new(),
        policy: if device { "limit" } else { "driver-limit" }.into(),
        iommu: "none".into(),
        header: "none".into(),
        flows: 1,
        packets: cfg.packets,
        payload_bytes: cfg.payload,
        ns_per_pkt: ns / p,
        gbit_s: gbit,
        bytes_verified: verified,
        bytes_sent: cfg.packets * cfg.payload as u64,
        touch: cfg.touch.name().into(),
        backing: "small".into(),
        queues: 1,
        queue: "all".into(),
        mss: cfg.mss,
        driver_ns_per_pkt: (!device).then_some(cpu / p),
        ..Row::default()
    }
    .single()
}

/// The device's read of one payload whose pattern starts at stream offset
/// `off`: bytes verified, and whether all of them matched.
fn read(touch: Touch, b: &[u8], off: u32, mss: usize) -> (u64, bool) {
    let mut verified = 0u64;
    let mut ok = true;
    match touch {
        Touch::Pages => {
            for (k, page) in b.chunks(4096).enumerate() {
                let line = &page[..page.len().min(64)];
                if pattern::verify(0, off.wrapping_add((k * 4096) as u32), line) {
                    verified += line.len() as u64;
                } else {
                    ok = false;
                }
            }
        }
        // `Touch::Checksum`, and any mode added later until this model
        // learns it: every byte, the most a device reads.
        _ => {
            for (k, seg) in b.chunks(mss).enumerate() {
                let mut c = Csum::new();
                if pattern::verify(0, off.wrapping_add((k * mss) as u32), seg) {
                    verified += seg.len() as u64;
                } else {
                    ok = false;
                }
                c.add(seg);
                black_box(c.finish());
            }
        }
    }
    (verified, ok)
}
