//! The checks a run makes of its settings before it builds anything, which
//! a driver of many runs can make of them all before starting any: ranges,
//! the pool's own checks, and whether the run's largest packet can ever fit
//! its ring in the descriptor format its device reads.

use vfio_nic::format::{igb, virtio, Format};

use super::*;

/// Settings every backend needs in range, and that the run's largest packet
/// can fit its ring on the software device models: the least descriptors
/// it takes in the format the model reads (the 82576's for `soft` and
/// `null`, virtio-net's for `virtio`), by
/// [`tx::Config::check_fits`](vfio_nic::tx::Config::check_fits), at most
/// what the ring holds, else [`RunError::PacketTooLarge`]. Every run checks
/// them first, and a driver of many runs can check them all before
/// starting any. A VFIO run checks more
/// ([`check_vfio`](super::check_vfio)).
pub fn check(cfg: &RunConfig) -> Result<(), RunError> {
    let chunk = Order::new(cfg.order)?.size();
    if cfg.payload > vfio_nic::desc::MAX_PAYLEN {
        return Err(RunError::Setting(format!(
            "payload {} is more than one packet carries (1..={}: the 82576's PAYLEN is 18 bits)",
            cfg.payload,
            vfio_nic::desc::MAX_PAYLEN
        )));
    }
    if cfg.mss == 0 {
        return Err(RunError::Setting("mss must be > 0".into()));
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
    if let Some(g) = cfg.device.line_rate_gbit {
        // One packet's frames, with their gaps, must leave before the run
        // gives up waiting for a completion.
        let segs = cfg.payload.div_ceil(usize::from(cfg.mss)).max(1) as u64;
        let wire = softnic::wire_bytes(segs, HDR_LEN, cfg.payload) + segs * softnic::WIRE_GAP;
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
    }
    if cfg.payload == 0 || cfg.packets == 0 || cfg.burst == 0 {
        return Err(RunError::Setting(format!(
            "payload {}, packets {} and burst {} must be > 0",
            cfg.payload, cfg.packets, cfg.burst
        )));
    }
    // The software models' queues split no data buffer (`soft::run`).
    match cfg.model {
        DeviceModel::Soft | DeviceModel::Null => check_ring::<igb::Advanced>(cfg, None),
        DeviceModel::Virtio => check_ring::<virtio::Split>(cfg, None),
    }
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

/// Refuses a run whose largest packet can never fit its ring: on the
/// queues of the run (format `F`, data buffers cut at `boundary`), the
/// least descriptors it takes
/// ([`tx::Config::check_fits`](vfio_nic::tx::Config::check_fits): a
/// context descriptor for the generator's offload where `F` keeps one, the
/// header, and the payload's data descriptors over the run's chunks) are
/// more than the ring holds: [`RunError::PacketTooLarge`]. A run that
/// passes may still find a packet's exact count too large once its frags
/// are carved (the same error, from the queue).
pub(super) fn check_ring<F: Format>(
    cfg: &RunConfig,
    boundary: Option<usize>,
) -> Result<(), RunError> {
    let len = match cfg.workload {
        Workload::Fixed => cfg.payload,
        Workload::Small { max, .. } => max,
    };
    // Every generated packet asks for an offload (checksum, or TSO past
    // the MSS): either takes a context descriptor where `F` keeps one.
    let offload = vfio_nic::offload::Offload::Checksum;
    let tx = cfg.tx_config(0, boundary);
    match tx.check_fits::<F>(Order::new(cfg.order)?, len, offload) {
        Err(vfio_nic::Error::PacketTooLarge { needed, capacity }) => {
            Err(too_large::<F>(cfg, &tx, len, needed, capacity))
        }
        other => other.map(|_| ()).map_err(RunError::from),
    }
}

/// The error of a `len`-byte packet of run `cfg` that needs `needed`
/// descriptors on the format `F` of a queue with settings `tx`, whose
/// ring holds `capacity`.
pub(super) fn too_large<F: Format>(
    cfg: &RunConfig,
    tx: &tx::Config,
    len: usize,
    needed: usize,
    capacity: usize,
) -> RunError {
    RunError::PacketTooLarge {
        payload: len,
        needed,
        format: F::NAME,
        order: cfg.order,
        boundary: tx.boundary,
        ring: tx.ring,
        capacity,
    }
}
