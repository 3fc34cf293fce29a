//! Runs on the software device models: one thread per queue, sharing one
//! pool and one mapper, barriers around the measured part.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Barrier;

use super::gate::Gate;
use super::*;
use vfio_nic::model::{self, thread, thread::Threaded};

#[cfg(test)]
#[path = "warm_up_tests.rs"]
mod warm_up_tests;

/// Runs `cfg` on the software NIC, one thread per queue. Returns the total
/// row first, then (with more than one queue) one row per queue. `tick` is
/// called with packet counts as they are sent (for progress).
pub fn run(cfg: &RunConfig, tick: &mut dyn FnMut(u64)) -> Result<Vec<Row>, RunError> {
    check(cfg)?;
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
                inject: cfg.device.iommu_latency,
                ..SoftIommuConfig::default()
            })?;
            measure(cfg, Arc::new(m), tick)
        }
    }
}

/// Packets queue `i` of `n` sends out of `total`.
pub(super) fn share(total: u64, n: usize, i: usize, skew: Option<f64>) -> u64 {
    let n64 = n as u64;
    match skew {
        Some(f) if n > 1 => {
            let first = ((total as f64) * f.clamp(0.0, 1.0)).round() as u64;
            let rest = total - first.min(total);
            if i == 0 {
                first.min(total)
            } else {
                rest / (n64 - 1) + u64::from(((i - 1) as u64) < rest % (n64 - 1))
            }
        }
        _ => total / n64 + u64::from((i as u64) < total % n64),
    }
}

/// One queue's figures over the measured part.
struct QueueRun {
    packets: u64,
    bytes: u64,
    descs: u64,
    waste: u64,
    nic: model::Stats,
    faults: u64,
    cpu: Cpu,
    start: Instant,
    end: Instant,
}

impl QueueRun {
    /// Wall time of its measured part.
    fn ns(&self) -> f64 {
        (self.end - self.start).as_nanos() as f64
    }
}

/// Runs `cfg` on the device model it names.
fn measure<M: DmaMapper + Translate + 'static>(
    cfg: &RunConfig,
    mapper: Arc<M>,
    tick: &mut dyn FnMut(u64),
) -> Result<Vec<Row>, RunError> {
    match cfg.model {
        DeviceModel::Soft => {
            let nic = |m: Arc<M>| {
                SoftNic::new(
                    m,
                    softnic::Config {
                        touch: cfg.touch,
                        capture: false,
                        verify: true,
                    },
                )
            };
            measure_on(cfg, mapper, &nic, tick)
        }
        DeviceModel::Null => measure_on(cfg, mapper, &NullNic::new, tick),
        DeviceModel::Virtio => {
            let ncfg = softnic::Config {
                touch: Touch::Checksum,
                capture: false,
                verify: true,
            };
            // `run`'s check refused any other `--touch` for this model.
            // Every feature the TX path uses is offered: the negotiation
            // cannot fail.
            let nic = |m: Arc<M>| VirtioNet::new(m, ncfg).expect("every feature offered");
            measure_on(cfg, mapper, &nic, tick)
        }
    }
}

/// What the queue threads of one run share.
struct Bench<'a, M: DmaMapper, D> {
    cfg: &'a RunConfig,
    mapper: Arc<M>,
    domain: Arc<Domain<Arc<M>>>,
    pool: Pool<Arc<M>>,
    make_nic: &'a (dyn Fn(Arc<M>) -> D + Sync),
    progress: AtomicU64,
    /// Phases: all warmed up (main snapshots the counters), go, all done
    /// (main snapshots again before any queue is dropped, since dropping
    /// unmaps its ring), release.
    warmed: Barrier,
    go: Barrier,
    done: Barrier,
    release: Barrier,
    finished: AtomicUsize,
}

impl<M: DmaMapper + Translate + 'static, D: Model + Send + 'static> Bench<'_, M, D> {
    /// Queue `i`'s thread: set up and warm up, then the measured part
    /// between the barriers. Every thread passes every barrier, even after
    /// an error, so that none waits forever.
    fn queue(&self, i: usize) -> Result<QueueRun, RunError> {
        let nic = Timed::cpu((self.make_nic)(self.mapper.clone()));
        if self.cfg.device.thread {
            let tc = thread::Config {
                line_rate_gbit: self.cfg.device.line_rate_gbit,
            };
            self.queue_on(i, Threaded::spawn(nic, tc))
        } else {
            self.queue_on(i, Ok(nic))
        }
    }

    /// [`queue`](Self::queue) on the device `nic` (or its error).
    fn queue_on<N: DeviceTime>(
        &self,
        i: usize,
        nic: Result<N, vfio_nic::Error>,
    ) -> Result<QueueRun, RunError> {
        let cfg = self.cfg;
        let tx = cfg.tx_config(i, None);
        let mut tick = |n| {
            self.progress.fetch_add(n, Ordering::Relaxed);
        };
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1));
        // SAFETY: every `make_nic` of this crate builds its model on the
        // mapper it is handed, `self.mapper`, which `self.domain` maps
        // through.
        let setup = nic
            .and_then(|nic| unsafe {
                tx::Queue::new(self.domain.clone(), self.pool.clone(), nic, tx)
            })
            .and_then(|q| Ok((q, Traffic::new(cfg.flows, cfg.mss)?)))
            .map_err(RunError::from)
            .and_then(|(mut q, mut g)| {
                let counters = |d: &N| Some(d.counters());
                warm_up(&mut q, &mut g, cfg, &mut rng, &mut tick, counters).map(|()| (q, g))
            });
        self.warmed.wait();
        self.go.wait();
        let t0 = Instant::now();
        let measured = setup.and_then(|(mut q, mut g)| {
            let snap = (q.device().counters(), q.stats(), q.cache_stats());
            let cpu0 = (thread_cpu_ns(), q.device().device_ns());
            let packets = share(cfg.packets, cfg.queues.max(1), i, cfg.skew);
            let bytes = pump(&mut q, &mut g, cfg, packets, &mut rng, &mut tick)?;
            let end = Instant::now();
            let cpu = cpu_since(cpu0, thread_cpu_ns(), q.device());
            Ok((q, snap, packets, bytes, end, cpu))
        });
        self.finished.fetch_add(1, Ordering::Release);
        self.done.wait();
        self.release.wait();
        let (q, (n0, q0, c0), packets, bytes, end, cpu) = measured?;
        let (n, qs, cs) = (
            q.device().counters().since(&n0),
            q.stats().since(&q0),
            q.cache_stats(),
        );
        Ok(QueueRun {
            cpu,
            packets,
            bytes,
            descs: qs.descs,
            waste: cs.since(&c0).waste_bytes,
            faults: lost(Some(&n), &qs),
            nic: n,
            start: t0,
            end,
        })
    }

    fn queue_stats(&self) -> Vec<pool::QueueStats> {
        (0..self.cfg.queues.max(1))
            .map(|i| self.pool.queue_stats(i).unwrap_or_default())
            .collect()
    }
}

/// The driver's and the device's CPU time since `(thread_ns, device_ns)`:
/// an inline device's time is taken out of the driver thread's.
fn cpu_since<N: DeviceTime>(start: (u64, u64), thread_now: u64, dev: &N) -> Cpu {
    let device_ns = dev.device_ns().saturating_sub(start.1);
    let thread_ns = thread_now.saturating_sub(start.0);
    Cpu {
        driver_ns: if dev.own_thread() {
            thread_ns
        } else {
            thread_ns.saturating_sub(device_ns)
        },
        device_ns,
    }
}

/// Counters of the shared mapper and pool over the measured part.
struct Shared {
    map: pfrag::dma::MapStats,
    pool0: pool::Stats,
    pool1: pool::Stats,
    /// The domain's IOVA bytes awaiting their flush at the end.
    awaiting: u64,
    queues: Vec<pool::QueueStats>,
}

fn measure_on<M: DmaMapper + Translate + 'static, D: Model + Send + 'static>(
    cfg: &RunConfig,
    mapper: Arc<M>,
    make_nic: &(dyn Fn(Arc<M>) -> D + Sync),
    tick: &mut dyn FnMut(u64),
) -> Result<Vec<Row>, RunError> {
    let queues = cfg.queues.max(1);
    let domain = Arc::new(Domain::new(mapper.clone()));
    let account = MemAccount::new(cfg.limits, CountHooks::default())?;
    let pool = Pool::with_account(domain.clone(), cfg.pool_config()?, account.clone())?;
    let b = Bench {
        cfg,
        mapper,
        domain,
        pool,
        make_nic,
        progress: AtomicU64::new(0),
        warmed: Barrier::new(queues + 1),
        go: Barrier::new(queues + 1),
        done: Barrier::new(queues + 1),
        release: Barrier::new(queues + 1),
        finished: AtomicUsize::new(0),
    };
    let (runs, shared) = drive(&b, tick)?;
    let runs = runs.into_iter().collect::<Result<Vec<_>, _>>()?;
    let mut top = row(cfg, &total(&runs), None, &shared);
    let acct = account.stats();
    top.pressure_hook_calls = account.hooks().calls();
    top.pressure_transitions = acct.entered + acct.left;
    top.peak_bytes = acct.peak;
    let mut rows = vec![top];
    if queues > 1 {
        for (i, r) in runs.iter().enumerate() {
            rows.push(row(cfg, r, Some(i), &shared));
        }
    }
    Ok(rows)
}

/// Runs the queue threads, snapshotting the shared counters between the
/// barriers, and reports progress while they run. The threads start work
/// only once all of them exist: if one cannot be created, those already
/// started leave without touching the barriers, and the run fails with
/// [`RunError::Spawn`].
fn drive<M: DmaMapper + Translate + 'static, D: Model + Send + 'static>(
    b: &Bench<'_, M, D>,
    tick: &mut dyn FnMut(u64),
) -> Result<(Vec<Result<QueueRun, RunError>>, Shared), RunError> {
    let queues = b.cfg.queues.max(1);
    let started = Gate::new(queues + 1);
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(queues);
        for i in 0..queues {
            let started = &started;
            let body = move || started.wait().ok().map(|()| b.queue(i));
            match std::thread::Builder::new().spawn_scoped(s, body) {
                Ok(h) => handles.push(h),
                Err(source) => {
                    started.abort();
                    return Err(RunError::Spawn {
                        queue: i,
                        queues,
                        source,
                    });
                }
            }
        }
        // Only this thread aborts the gate, and it has not: it opens.
        let _ = started.wait();
        let mut seen = 0;
        let mut poll = |seen: &mut u64| {
            let now = b.progress.load(Ordering::Relaxed);
            tick(now - *seen);
            *seen = now;
        };
        b.warmed.wait();
        let (m0, pool0, q0) = (b.mapper.stats(), b.pool.stats(), b.queue_stats());
        b.go.wait();
        while b.finished.load(Ordering::Acquire) < queues {
            std::thread::sleep(Duration::from_millis(20));
            poll(&mut seen);
        }
        b.done.wait();
        let (map, pool1, q1) = (b.mapper.stats().since(&m0), b.pool.stats(), b.queue_stats());
        let awaiting = b.domain.iova_awaiting_flush();
        b.release.wait();
        poll(&mut seen);
        let runs = handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| match h.join() {
                Ok(Some(run)) => run,
                _ => Err(RunError::Panicked { queue: i }),
            })
            .collect();
        let queues = q0.iter().zip(&q1).map(|(a, b)| b.since(a)).collect();
        Ok((
            runs,
            Shared {
                map,
                pool0,
                pool1,
                awaiting,
                queues,
            },
        ))
    })
}

/// All queues together: the measured part runs from the first start to the
/// last end.
fn total(runs: &[QueueRun]) -> QueueRun {
    let now = Instant::now();
    QueueRun {
        packets: runs.iter().map(|r| r.packets).sum(),
        bytes: runs.iter().map(|r| r.bytes).sum(),
        descs: runs.iter().map(|r| r.descs).sum(),
        waste: runs.iter().map(|r| r.waste).sum(),
        faults: runs.iter().map(|r| r.faults).sum(),
        cpu: Cpu {
            driver_ns: runs.iter().map(|r| r.cpu.driver_ns).sum(),
            device_ns: runs.iter().map(|r| r.cpu.device_ns).sum(),
        },
        nic: runs
            .iter()
            .fold(model::Stats::default(), |a, r| a.plus(&r.nic)),
        start: runs.iter().map(|r| r.start).min().unwrap_or(now),
        end: runs.iter().map(|r| r.end).max().unwrap_or(now),
    }
}

/// The row of the total (`queue` = `None`) or of one queue.
fn row(cfg: &RunConfig, r: &QueueRun, queue: Option<usize>, sh: &Shared) -> Row {
    let p = r.packets.max(1) as f64;
    let (map, delta) = match queue {
        None => (sh.map, sh.pool1.since(&sh.pool0)),
        Some(_) => (pfrag::dma::MapStats::default(), pool::Stats::default()),
    };
    let common = Measured {
        map,
        packets: r.packets,
        bytes: r.bytes,
        delivered: r.nic.delivered_bytes,
        descs: r.descs,
        waste: r.waste,
        ns: r.ns(),
        cpu: Some(r.cpu),
        pool: sh.pool1,
        delta,
        iova_awaiting_flush: sh.awaiting,
    };
    let mut row = Row {
        iotlb_misses_per_pkt: Some(map.iotlb_misses as f64 / p),
        pages_per_pkt: Some(r.nic.pages as f64 / r.nic.packets.max(1) as f64),
        // The null device fetches no segment's payload: not measured.
        pages_per_segment: (r.nic.frames > 0 && cfg.model != DeviceModel::Null)
            .then(|| r.nic.segment_pages as f64 / r.nic.frames as f64),
        model_iommu_ns_per_pkt: Some(map.model_ns / p),
        faults: r.faults,
        bytes_verified: r.nic.bytes_verified,
        // The null device reads no payload, whatever the touch asked.
        touch: if cfg.model == DeviceModel::Null {
            "none".into()
        } else {
            cfg.touch.name().into()
        },
        ..common.row("soft", cfg)
    };
    if let Some(i) = queue {
        // The mapper is shared by all queues: its counters belong to the
        // total row only.
        row.maps_per_pkt = None;
        row.unmaps_per_pkt = None;
        row.map_pages_per_pkt = None;
        row.invalidations_per_pkt = None;
        row.iotlb_misses_per_pkt = None;
        row.model_iommu_ns_per_pkt = None;
        let qs = sh.queues[i];
        row.queue = i.to_string();
        row.borrows_per_pkt = qs.borrows as f64 / p;
        row.skipped_pressured_per_pkt = qs.skipped_pressured as f64 / p;
        row.reclaim_calls_per_pkt = qs.reclaim_calls as f64 / p;
        row.shared_pool_ops_per_pkt = qs.shared_ops as f64 / p;
    }
    row
}
