//! The `limit` row: the device's per-byte work alone.

use super::*;

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
        queues: 1,
        queue: "all".into(),
        ..Row::default()
    }
}
