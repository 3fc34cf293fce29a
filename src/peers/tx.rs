//! pfrag's TX rows of the peers table: the TX queue on the null device
//! model (which translates every buffer through the IOMMU and writes back
//! descriptor-done, reading no payload), sending the caller's bytes with
//! `send_burst`, in bursts of 32 with one doorbell.
//!
//! - 64-byte frames (Ethernet + IPv4 + UDP headers and 22 bytes of
//!   payload, no offload), strict IOMMU, persistent order-4 pool, bounce
//!   headers: packets per second, device model included, against
//!   `dpdk-testpmd` txonly on `net_null`.
//! - 64 KB TSO packets (65,160 payload bytes, MSS 1448): the driver's own
//!   time per packet (the time inside the device model's `kick` taken out)
//!   under a strict IOMMU and with the IOMMU off.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pfrag::dma::{DmaMapper, Domain, Identity, SoftIommu, SoftIommuConfig, Translate};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::device::TxDevice;
use vfio_nic::model::null::NullNic;
use vfio_nic::model::softnic;
use vfio_nic::model::virtio::VirtioNet;
use vfio_nic::model::Model;
use vfio_nic::offload::Offload;
use vfio_nic::tx::{self, Queue, TxPacket};

use super::bench::{Harness, Timing};

/// Packets per doorbell.
pub const BURST: usize = 32;
/// Payload of a 64-byte frame after its 42 header bytes.
pub const SMALL_PAYLOAD: usize = 22;
/// Payload of a TSO packet: 45 segments of 1448 bytes.
pub const TSO_PAYLOAD: usize = 65160;
/// Packets per doorbell of the TSO row.
const TSO_BURST: usize = 8;

/// Ethernet + IPv4 + UDP (`tcp == false`, 42 bytes) or TCP (54 bytes)
/// headers for a payload of `payload` bytes, built with etherparse.
pub fn headers(tcp: bool, payload: usize) -> Vec<u8> {
    let b = etherparse::PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]).ipv4(
        [10, 0, 0, 1],
        [10, 0, 0, 2],
        64,
    );
    let body = vec![0u8; payload];
    let mut out = Vec::new();
    let hlen = if tcp {
        let b = b.tcp(4000, 5000, 1, 65535);
        b.write(&mut out, &body).expect("writing to a Vec");
        54
    } else {
        let b = b.udp(4000, 5000);
        b.write(&mut out, &body).expect("writing to a Vec");
        42
    };
    out.truncate(hlen);
    out
}

type NullQueue<M, T> = Queue<M, NullNic<T>>;

/// 64-byte frames in the virtio-net format (`virtio_net_hdr` and split
/// virtqueue) under a strict software IOMMU: the driver's own time per
/// packet, the virtio model's (`VirtioNet`, not a null device: it reads
/// every byte) left out.
pub fn small_frames_virtio(h: &Harness) -> Result<Timing, String> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).map_err(|e| e.to_string())?);
    let domain = Arc::new(Domain::new(iommu.clone()));
    let e = |e: vfio_nic::Error| e.to_string();
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(
            Order::new(4).map_err(|e| e.to_string())?,
            Policy::Persistent,
        ),
    )
    .map_err(|e| e.to_string())?;
    let cfg = softnic::Config {
        verify: false,
        capture: false,
        ..softnic::Config::default()
    };
    let nic = VirtioNet::new(iommu, cfg).map_err(e)?;
    let qcfg = tx::Config {
        ring: 512,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through `iommu`, which `domain` maps
    // through.
    let mut q = unsafe { Queue::new(domain, pool, nic, qcfg) }.map_err(e)?;
    let hdr = headers(false, SMALL_PAYLOAD);
    let payload = [0x5au8; SMALL_PAYLOAD];
    timed_bursts(h, &mut q, (&hdr, &payload, Offload::None), BURST, true)
}

/// A queue over the null device, both on `iommu`.
fn queue<M: DmaMapper + Translate + Clone>(
    iommu: M,
    ring: u16,
) -> Result<NullQueue<M, M>, vfio_nic::Error> {
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(4)?, Policy::Persistent),
    )?;
    let cfg = tx::Config {
        ring,
        ..tx::Config::default()
    };
    // SAFETY: the null device translates through `iommu`, which `domain`
    // maps through.
    unsafe { Queue::new(domain, pool, NullNic::new(iommu), cfg) }
}

/// One burst: `pkts` (at most [`BURST`]) in one `send_burst`, one
/// doorbell, one reap. Returns the time spent in the device model (the
/// doorbell runs it inline) if `timed`, else zero: the clock is read only
/// where that time is taken out, since its own cost counts as the
/// driver's.
fn burst<M: DmaMapper, D: TxDevice>(
    q: &mut Queue<M, D>,
    pkts: &[TxPacket<'_>],
    timed: bool,
) -> Result<Duration, vfio_nic::Error> {
    let sent = q.send_burst(pkts)?;
    assert_eq!(
        sent,
        pkts.len(),
        "the ring holds a whole burst, reaped before the next"
    );
    let dev = if timed {
        let t = Instant::now();
        q.kick()?;
        t.elapsed()
    } else {
        q.kick()?;
        Duration::ZERO
    };
    let done = q.reap()?;
    debug_assert_eq!(done, pkts.len());
    black_box(done);
    Ok(dev)
}

/// Checks that the device delivered every byte sent and faulted on none.
fn delivered<M: DmaMapper, D: TxDevice + Model>(
    q: &Queue<M, D>,
    per_packet: usize,
) -> Result<(), String> {
    let nic = q.device().counters();
    let sent = q.stats().packets;
    if nic.faults != 0 || nic.delivered_bytes != sent * per_packet as u64 {
        return Err(format!(
            "device delivered {} of {} bytes, {} faults",
            nic.delivered_bytes,
            sent * per_packet as u64,
            nic.faults
        ));
    }
    Ok(())
}

/// 64-byte frames in bursts of 32 under a strict software IOMMU:
/// nanoseconds per packet, device model included, or (`driver_only`) the
/// driver's own time, with the time inside the device model's `kick` left
/// out.
pub fn small_frames(h: &Harness, driver_only: bool) -> Result<Timing, String> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).map_err(|e| e.to_string())?);
    small_frames_on(h, iommu, driver_only)
}

/// 64-byte frames in bursts of 32 with the IOMMU off (identity mapping):
/// nanoseconds per packet, device model included.
pub fn small_frames_off(h: &Harness) -> Result<Timing, String> {
    small_frames_on(h, Arc::new(Identity::new()), false)
}

fn small_frames_on<M: DmaMapper + Translate + Clone>(
    h: &Harness,
    iommu: M,
    driver_only: bool,
) -> Result<Timing, String> {
    let mut q = queue(iommu, 512).map_err(|e| e.to_string())?;
    let hdr = headers(false, SMALL_PAYLOAD);
    let payload = [0x5au8; SMALL_PAYLOAD];
    timed_bursts(
        h,
        &mut q,
        (&hdr, &payload, Offload::None),
        BURST,
        driver_only,
    )
}

/// The driver's own time per 64 KB TSO packet on a queue over `mapper`.
fn tso_driver<M: DmaMapper + Translate + Clone>(h: &Harness, iommu: M) -> Result<Timing, String> {
    let mut q = queue(iommu, 256).map_err(|e| e.to_string())?;
    let hdr = headers(true, TSO_PAYLOAD);
    let payload = vec![0xa5u8; TSO_PAYLOAD];
    let tso = Offload::Tso { mss: 1448 };
    timed_bursts(h, &mut q, (&hdr, &payload, tso), TSO_BURST, true)
}

/// Times bursts of `n` sends of one packet (headers, payload, offload) on
/// `q`, leaving the device model's time out if `driver_only`; then checks
/// that the device delivered every byte sent.
fn timed_bursts<M: DmaMapper, D: TxDevice + Model>(
    h: &Harness,
    q: &mut Queue<M, D>,
    (hdr, payload, offload): (&[u8], &[u8], Offload),
    n: usize,
    driver_only: bool,
) -> Result<Timing, String> {
    // The same packets every burst, tokens 0 to n - 1: described once,
    // as an application keeps its packet array.
    let pkts: Vec<TxPacket<'_>> = (0..n as u64)
        .map(|token| TxPacket {
            headers: hdr,
            payload,
            offload,
            token,
        })
        .collect();
    let t = h
        .try_time_excluding(n as u64, |iters| {
            let mut dev = Duration::ZERO;
            for _ in 0..iters {
                dev += burst(q, &pkts, driver_only)?;
            }
            Ok::<_, vfio_nic::Error>(dev)
        })
        .map_err(|e| e.to_string())?;
    // Without an offload the device carries the whole frame; with one, the
    // payload after the headers.
    let per_packet = match offload {
        Offload::None => hdr.len() + payload.len(),
        _ => payload.len(),
    };
    delivered(q, per_packet).map(|()| t)
}

/// The driver's time per 64 KB TSO packet: strict software IOMMU, then
/// the IOMMU off (identity mapping).
pub fn tso(h: &Harness) -> Result<(Timing, Timing), String> {
    let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).map_err(|e| e.to_string())?);
    let strict = tso_driver(h, iommu)?;
    let id = Arc::new(Identity::new());
    let off = tso_driver(h, id)?;
    Ok((strict, off))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick() -> Harness {
        Harness {
            reps: 1,
            target: Duration::from_millis(2),
        }
    }

    #[test]
    fn headers_make_64_byte_frames_and_tso_headers() {
        assert_eq!(headers(false, SMALL_PAYLOAD).len() + SMALL_PAYLOAD, 64);
        assert_eq!(headers(true, TSO_PAYLOAD).len(), 54);
    }

    #[test]
    fn tx_rows_deliver_every_byte() {
        let h = quick();
        assert!(small_frames(&h, false).unwrap().median > 0.0);
        assert!(small_frames(&h, true).unwrap().median > 0.0);
        let (strict, off) = tso(&h).unwrap();
        assert!(strict.median > 0.0 && off.median > 0.0);
    }
}
