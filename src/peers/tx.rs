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
//!   time per packet (the time inside the device model's doorbell handler
//!   taken out, timed on the harness's clock: [`Timed::wall`]) under a
//!   strict IOMMU and with the IOMMU off.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

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
use crate::timed::Timed;

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
    let nic = Timed::wall(VirtioNet::new(iommu, cfg).map_err(e)?);
    let qcfg = tx::Config {
        ring: 512,
        ..tx::Config::default()
    };
    // SAFETY: the model translates through `iommu`, which `domain` maps
    // through.
    let mut q = unsafe { Queue::new(domain, pool, nic, qcfg) }.map_err(e)?;
    let hdr = headers(false, SMALL_PAYLOAD);
    let payload = [0x5au8; SMALL_PAYLOAD];
    timed_bursts(h, &mut q, (&hdr, &payload, Offload::None), BURST, |d| {
        d.take()
    })
}

/// A queue on `iommu` over the device `dev` makes on it (the null device,
/// timed or not).
fn queue<M: DmaMapper + Translate + Clone, D: TxDevice>(
    iommu: M,
    ring: u16,
    dev: impl FnOnce(M) -> D,
) -> Result<Queue<M, D>, vfio_nic::Error> {
    let domain = Arc::new(Domain::new(iommu.clone()));
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(4)?, Policy::Persistent),
    )?;
    let cfg = tx::Config {
        ring,
        ..tx::Config::default()
    };
    // SAFETY: every `dev` here builds a null device (timed or not) that
    // translates through `iommu`, which `domain` maps through.
    unsafe { Queue::new(domain, pool, dev(iommu), cfg) }
}

/// One burst: `pkts` (at most [`BURST`]) in one `send_burst`, one
/// doorbell, one reap.
fn burst<M: DmaMapper, D: TxDevice>(
    q: &mut Queue<M, D>,
    pkts: &[TxPacket<'_>],
) -> Result<(), vfio_nic::Error> {
    let sent = q.send_burst(pkts)?;
    assert_eq!(
        sent,
        pkts.len(),
        "the ring holds a whole burst, reaped before the next"
    );
    q.kick()?;
    let done = q.reap()?;
    debug_assert_eq!(done, pkts.len());
    black_box(done);
    Ok(())
}

/// Checks that the device delivered every packet sent whole: as many
/// packets seen as the queue sent, one frame each (the null device puts a
/// TSO packet on the wire as one frame, uncut; the virtio rows offload
/// nothing), `per_packet` bytes each delivered intact, and no loss in its
/// counters ([`NicStats::losses`](softnic::NicStats::losses): no fault,
/// faulted packet, malformed descriptor, corrupt packet or stop). Bytes
/// alone do not show a loss: a device can count the bytes of every packet
/// and still report one of them malformed.
fn delivered<M: DmaMapper, D: TxDevice + Model>(
    q: &Queue<M, D>,
    per_packet: usize,
) -> Result<(), String> {
    let nic = q.device().counters();
    let sent = q.stats().packets;
    let bytes = sent * per_packet as u64;
    if nic.losses() != 0
        || nic.packets != sent
        || nic.frames != sent
        || nic.delivered_bytes != bytes
    {
        return Err(format!(
            "device delivered {} of {bytes} bytes, saw {} of {sent} packets, sent {} of \
             {sent} frames; {} faults, {} faulted packets, {} malformed, {} corrupt, {} stops",
            nic.delivered_bytes,
            nic.packets,
            nic.frames,
            nic.faults,
            nic.faulted_packets,
            nic.bad_desc,
            nic.bad_payload,
            nic.stops
        ));
    }
    Ok(())
}

/// 64-byte frames in bursts of 32 under a strict software IOMMU:
/// nanoseconds per packet, device model included, or (`driver_only`) the
/// driver's own time, with the time inside the device model's doorbell
/// handler left out, timed on wall time ([`Timed::wall`]).
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
    let hdr = headers(false, SMALL_PAYLOAD);
    let payload = [0x5au8; SMALL_PAYLOAD];
    let pkt = (&hdr[..], &payload[..], Offload::None);
    let e = |e: vfio_nic::Error| e.to_string();
    if driver_only {
        let mut q = queue(iommu, 512, |m| Timed::wall(NullNic::new(m))).map_err(e)?;
        timed_bursts(h, &mut q, pkt, BURST, |d| d.take())
    } else {
        // The whole loop: the bare device, no clock read in the loop.
        let mut q = queue(iommu, 512, NullNic::new).map_err(e)?;
        timed_bursts(h, &mut q, pkt, BURST, |_| Duration::ZERO)
    }
}

/// The driver's own time per 64 KB TSO packet on a queue over `mapper`.
fn tso_driver<M: DmaMapper + Translate + Clone>(h: &Harness, iommu: M) -> Result<Timing, String> {
    let new = |m| Timed::wall(NullNic::new(m));
    let mut q = queue(iommu, 256, new).map_err(|e| e.to_string())?;
    let hdr = headers(true, TSO_PAYLOAD);
    let payload = vec![0xa5u8; TSO_PAYLOAD];
    let tso = Offload::Tso { mss: 1448 };
    timed_bursts(h, &mut q, (&hdr, &payload, tso), TSO_BURST, |d| d.take())
}

/// Times bursts of `n` sends of one packet (headers, payload, offload) on
/// `q`, leaving out the time `model` says the device spent in its model
/// over each repetition (zero for the whole loop); then checks that the
/// device delivered every packet sent, whole ([`delivered`]).
fn timed_bursts<M: DmaMapper, D: TxDevice + Model>(
    h: &Harness,
    q: &mut Queue<M, D>,
    (hdr, payload, offload): (&[u8], &[u8], Offload),
    n: usize,
    model: impl Fn(&D) -> Duration,
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
            model(q.device());
            for _ in 0..iters {
                burst(q, &pkts)?;
            }
            Ok::<_, vfio_nic::Error>(model(q.device()))
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

    /// A clock for the tests: what the tests add.
    struct Fake;

    impl crate::timed::Clock for Fake {
        fn now(&self) -> Duration {
            Duration::from_nanos(FAKE_NS.get())
        }
    }

    thread_local! {
        static FAKE_NS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    /// The null device, its doorbell handler taking 1 µs of the fake clock.
    struct Slow(NullNic<Arc<SoftIommu>>);

    impl TxDevice for Slow {
        type Format = <NullNic<Arc<SoftIommu>> as TxDevice>::Format;
        fn format(&self) -> Self::Format {
            self.0.format()
        }
        unsafe fn attach(&mut self, ring: pfrag::Iova, len: u16) -> vfio_nic::Result<()> {
            // SAFETY: the caller's promise is passed on unchanged.
            unsafe { self.0.attach(ring, len) }
        }
        unsafe fn kick(&mut self, tail: u16) -> vfio_nic::Result<()> {
            FAKE_NS.set(FAKE_NS.get() + 1000);
            // SAFETY: the caller's promise is passed on unchanged.
            unsafe { self.0.kick(tail) }
        }
        fn check_running(&mut self) -> vfio_nic::Result<()> {
            Err(vfio_nic::Error::DeviceStopped {
                status: 0x40,
                cause: None,
            })
        }
    }

    /// A timed device says whether the device it wraps stopped: a wait on
    /// it reports the stop, not a bare timeout.
    #[test]
    fn a_timed_device_passes_on_whether_its_device_stopped() {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let mut dev = Timed::wall(Slow(NullNic::new(iommu)));
        let r = dev.check_running();
        assert!(
            matches!(r, Err(vfio_nic::Error::DeviceStopped { status: 0x40, .. })),
            "{r:?}"
        );
    }

    impl Model for Slow {
        fn counters(&self) -> softnic::NicStats {
            self.0.counters()
        }
    }

    /// What "the driver's time alone" leaves out is the time inside the
    /// model's doorbell handler, on the harness's clock, and nothing
    /// else: the queue's own part of the doorbell stays the driver's.
    #[test]
    fn driver_time_leaves_out_the_models_doorbell_only() {
        let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
        let dev = Timed::with_clock(Slow(NullNic::new(iommu.clone())), Fake);
        let mut q = queue(iommu, 512, |_| dev).unwrap();
        let hdr = headers(false, SMALL_PAYLOAD);
        let payload = [0x5au8; SMALL_PAYLOAD];
        let pkts: Vec<TxPacket<'_>> = (0..BURST as u64)
            .map(|token| TxPacket {
                headers: &hdr,
                payload: &payload,
                offload: Offload::None,
                token,
            })
            .collect();
        for _ in 0..5 {
            burst(&mut q, &pkts).unwrap();
        }
        assert_eq!(q.device().take(), Duration::from_micros(5));
        assert_eq!(q.device().take(), Duration::ZERO);
        delivered(&q, 64).unwrap();
    }

    /// The null device, its counters edited by `.1` when read.
    struct Miscounted(NullNic<Arc<SoftIommu>>, fn(&mut softnic::NicStats));

    impl TxDevice for Miscounted {
        type Format = <NullNic<Arc<SoftIommu>> as TxDevice>::Format;
        fn format(&self) -> Self::Format {
            self.0.format()
        }
        unsafe fn attach(&mut self, ring: pfrag::Iova, len: u16) -> vfio_nic::Result<()> {
            // SAFETY: the caller's promise is passed on unchanged.
            unsafe { self.0.attach(ring, len) }
        }
        unsafe fn kick(&mut self, tail: u16) -> vfio_nic::Result<()> {
            // SAFETY: the caller's promise is passed on unchanged.
            unsafe { self.0.kick(tail) }
        }
    }

    impl Model for Miscounted {
        fn counters(&self) -> softnic::NicStats {
            let mut c = self.0.counters();
            (self.1)(&mut c);
            c
        }
    }

    /// A row fails when its device reports a packet lost, a frame short, a
    /// malformed descriptor or a fault, even with every byte counted as
    /// delivered: throughput counts bytes delivered intact, and a device
    /// that reports losses did not deliver them all.
    #[test]
    fn a_row_whose_device_reports_a_loss_fails_though_its_bytes_match() {
        type Edit = fn(&mut softnic::NicStats);
        let cases: [(&str, Edit); 8] = [
            ("sound", |_| {}),
            ("a fault", |c| c.faults += 1),
            ("a faulted packet", |c| c.faulted_packets += 1),
            ("a malformed descriptor", |c| c.bad_desc += 1),
            ("a corrupt packet", |c| c.bad_payload += 1),
            ("a stop", |c| c.stops += 1),
            ("a packet short", |c| c.packets -= 1),
            ("a frame short", |c| c.frames -= 1),
        ];
        let hdr = headers(false, SMALL_PAYLOAD);
        let payload = [0x5au8; SMALL_PAYLOAD];
        let pkts: Vec<TxPacket<'_>> = (0..BURST as u64)
            .map(|token| TxPacket {
                headers: &hdr,
                payload: &payload,
                offload: Offload::None,
                token,
            })
            .collect();
        for (what, edit) in cases {
            let iommu = Arc::new(SoftIommu::new(SoftIommuConfig::default()).unwrap());
            let mut q = queue(iommu, 512, |m| Miscounted(NullNic::new(m), edit)).unwrap();
            burst(&mut q, &pkts).unwrap();
            let r = delivered(&q, 64);
            assert_eq!(r.is_ok(), what == "sound", "{what}: {r:?}");
        }
    }

    #[test]
    fn tx_rows_deliver_every_byte() {
        let h = quick();
        assert!(small_frames(&h, false).unwrap().median > 0.0);
        assert!(small_frames(&h, true).unwrap().median > 0.0);
        assert!(small_frames_virtio(&h).unwrap().median > 0.0);
        let (strict, off) = tso(&h).unwrap();
        assert!(strict.median > 0.0 && off.median > 0.0);
    }
}
