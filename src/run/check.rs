//! The checks a run makes of its settings before it builds anything, which
//! a driver of many runs can make of them all before starting any: ranges,
//! the pool's own checks, and whether the run's largest packet is one its
//! queues can ever send in the descriptor format its device reads (its
//! payload, descriptors and buffers).

use vfio_nic::format::{igb, virtio, Format};

use super::*;

/// The largest MSS a run takes: a segment is one IPv4 packet of at most
/// 65,535 bytes, 40 of them the IPv4 and TCP headers (and the link's MTU,
/// which the run sets to hold a segment, is 16 bits).
pub const MAX_MSS: usize = u16::MAX as usize - 40;

/// Settings every backend needs in range, and that the run's largest packet
/// is one its queues send on the software device models, in the format the
/// model reads (the 82576's for `soft` and `null`, virtio-net's for
/// `virtio`): a payload within what one generated packet carries
/// ([`gen::max_payload`](vfio_nic::gen::max_payload), else
/// [`RunError::PayloadTooLarge`]), no more descriptors, at least, than the
/// ring holds ([`tx::Config::check_fits`](vfio_nic::tx::Config::check_fits),
/// else [`RunError::PacketTooLarge`]) and no more buffers, as the queue
/// counts them before carving, than a packet may have
/// ([`tx::Config::check_bufs`](vfio_nic::tx::Config::check_bufs), else
/// [`RunError::TooManyBuffers`]). Every run checks them first, and a driver
/// of many runs can check them all before starting any. A VFIO run checks
/// more ([`check_vfio`](super::check_vfio)).
pub fn check(cfg: &RunConfig) -> Result<(), RunError> {
    let chunk = Order::new(cfg.order)?.size();
    if cfg.mss == 0 || usize::from(cfg.mss) > MAX_MSS {
        return Err(RunError::Setting(format!(
            "mss {} out of range (1..={MAX_MSS}: a segment's IPv4 packet, its \
             40 bytes of IPv4 and TCP headers and the MSS, fits 65535 bytes)",
            cfg.mss
        )));
    }
    check_flows(cfg.flows)?;
    // The pool's own checks (queues, hysteresis sizes against the chunk):
    // the chunk size is not in the pool's message, so it is added here.
    cfg.pool_config()?.check().map_err(|e| {
        RunError::Setting(format!(
            "order {} (chunks of {chunk} B), queues {}, reclaim {}: {e}",
            cfg.order,
            cfg.queues,
            cfg.reclaim.name()
        ))
    })?;
    cfg.device.check(cfg.queues)?;
    if cfg.payload == 0 || cfg.packets == 0 || cfg.burst == 0 {
        return Err(RunError::Setting(format!(
            "payload {}, packets {} and burst {} must be > 0",
            cfg.payload, cfg.packets, cfg.burst
        )));
    }
    if cfg.queues == 0 || (cfg.packets as usize) < cfg.queues {
        return Err(RunError::Setting(format!(
            "queues {} must be >= 1 and <= packets {}",
            cfg.queues, cfg.packets
        )));
    }
    // Each queue's row is its own measurement: a queue the skew leaves
    // with no packet would have none.
    if let Some(i) =
        (0..cfg.queues).find(|&i| super::soft::share(cfg.packets, cfg.queues, i, cfg.skew) == 0)
    {
        return Err(RunError::Setting(format!(
            "skew {} leaves queue {i} of {} with none of the {} packets: each queue sends \
             at least one",
            cfg.skew.unwrap_or(0.0),
            cfg.queues,
            cfg.packets
        )));
    }
    if let Workload::Small { min, max } = cfg.workload {
        if min == 0 || min > max {
            return Err(RunError::Setting(format!(
                "send sizes {min}..={max} are not a range of positive sizes"
            )));
        }
    }
    // The software models' queues split no data buffer (`soft::run`).
    match cfg.model {
        DeviceModel::Soft | DeviceModel::Null => check_packet::<igb::Advanced>(cfg, None)?,
        DeviceModel::Virtio => {
            if cfg.touch != Touch::Checksum {
                return Err(RunError::Setting(
                    "the virtio-net model reads every payload byte: --touch pages is the software NIC's"
                        .into(),
                ));
            }
            if let Some(g) = cfg.device.line_rate_gbit {
                // Its device thread would refuse to start (`Unpaceable`),
                // after earlier runs of a sweep had run.
                return Err(RunError::Setting(format!(
                    "the virtio-net model takes whole available rings and cannot be paced: \
                     --line-rate {g} is for the software NIC and the null device"
                )));
            }
            check_packet::<virtio::Split>(cfg, None)?
        }
    }
    check_burst(cfg)?;
    check_wire(cfg)
}

/// A burst (packets posted before one doorbell) of at most the ring's
/// descriptors, checked once the ring is known to be one the queue takes:
/// a larger burst would ring the doorbell when the ring fills, not after
/// the burst, and is refused rather than run as something else.
fn check_burst(cfg: &RunConfig) -> Result<(), RunError> {
    if cfg.burst > u64::from(cfg.ring) {
        return Err(RunError::Setting(format!(
            "burst {} out of range (1..={}: a burst is posted before one doorbell, \
             and the ring of {} descriptors holds no more packets)",
            cfg.burst, cfg.ring, cfg.ring
        )));
    }
    Ok(())
}

/// With a line rate, one packet's frames, with their gaps, must leave
/// before the run gives up waiting for a completion.
fn check_wire(cfg: &RunConfig) -> Result<(), RunError> {
    let Some(g) = cfg.device.line_rate_gbit else {
        return Ok(());
    };
    let wire = softnic::line_bytes(HDR_LEN, cfg.payload, usize::from(cfg.mss));
    let secs = wire as f64 * 8.0 / g / 1e9;
    if secs >= STALL.as_secs_f64() {
        return Err(RunError::Setting(format!(
            "a {}-byte packet at mss {} takes {secs:.1} s on the wire at {g} Gbit/s; \
             a run gives up after {} s without a completion",
            cfg.payload,
            cfg.mss,
            STALL.as_secs()
        )));
    }
    Ok(())
}

/// Checks a flow count against the traffic generator's range
/// (1..=[`MAX_FLOWS`](vfio_nic::gen::flow::MAX_FLOWS), one source port
/// each).
pub fn check_flows(flows: usize) -> Result<(), RunError> {
    let max = vfio_nic::gen::flow::MAX_FLOWS;
    if flows == 0 || flows > max {
        return Err(RunError::Setting(format!(
            "flows {flows} out of range (1..={max})"
        )));
    }
    Ok(())
}

/// Refuses a run whose largest packet (the payload, or the small-sends
/// workload's largest) its queues (format `F`, data buffers cut at
/// `boundary`) refuse every time, by the checks they make before
/// allocating, made here without a queue:
///
/// - a payload past what one of the generator's packets carries on `F`
///   over the run's pool
///   ([`gen::max_payload`](vfio_nic::gen::max_payload): on virtio-net
///   what the IPv4 length leaves after the headers):
///   [`RunError::PayloadTooLarge`];
/// - more descriptors, at least, than the ring holds
///   ([`tx::Config::check_fits`](vfio_nic::tx::Config::check_fits): a
///   context descriptor for the generator's offload where `F` keeps one,
///   the header, and the payload's data descriptors over the run's
///   chunks): [`RunError::PacketTooLarge`];
/// - more buffers, as the queue counts them before carving, than a packet
///   may have ([`tx::Config::check_bufs`](vfio_nic::tx::Config::check_bufs)):
///   [`RunError::TooManyBuffers`].
///
/// A run that passes may still find a packet's exact descriptor count too
/// large once its frags are carved (the same error, from the queue).
pub(super) fn check_packet<F: Format>(
    cfg: &RunConfig,
    boundary: Option<usize>,
) -> Result<(), RunError> {
    let len = match cfg.workload {
        Workload::Fixed => cfg.payload,
        Workload::Small { max, .. } => max,
    };
    let order = Order::new(cfg.order)?;
    // Every generated packet asks for an offload (checksum, or TSO past
    // the MSS): either takes a context descriptor where `F` keeps one.
    let offload = vfio_nic::offload::Offload::Checksum;
    let tx = cfg.tx_config(0, boundary);
    vfio_nic::gen::check_payload::<F>(&cfg.pool_config()?, cfg.mss, len)
        .and_then(|()| tx.check_fits::<F>(order, len, offload))
        .and_then(|_| tx.check_bufs::<F>(order, len))
        .map(|_| ())
        .map_err(|e| refused::<F>(cfg, &tx, len, e))
}

/// The error of run `cfg` for a `len`-byte packet that a queue with
/// settings `tx` writing format `F` refused with `e`: a packet no retry
/// sends (too large a payload, more descriptors than the ring holds, more
/// buffers than a packet may have) with the run's numbers, anything else
/// as the queue said it.
pub(super) fn refused<F: Format>(
    cfg: &RunConfig,
    tx: &tx::Config,
    len: usize,
    e: vfio_nic::Error,
) -> RunError {
    match e {
        vfio_nic::Error::PayloadTooLarge { max, .. } => RunError::PayloadTooLarge {
            payload: len,
            max,
            format: F::NAME,
        },
        vfio_nic::Error::PacketTooLarge { needed, capacity } => RunError::PacketTooLarge {
            payload: len,
            needed,
            format: F::NAME,
            order: cfg.order,
            boundary: tx.boundary,
            ring: tx.ring,
            capacity,
        },
        vfio_nic::Error::TooManyBuffers { needed, max } => RunError::TooManyBuffers {
            payload: len,
            needed,
            max,
            format: F::NAME,
            order: cfg.order,
            boundary: tx.boundary,
            fit_whole: tx.fit_whole,
        },
        e => RunError::Nic(e),
    }
}
