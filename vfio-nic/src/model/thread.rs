//! A device model on a thread of its own, polling its doorbell the way a
//! NIC's DMA engine runs beside the driver: the queue's
//! [`kick`](TxDevice::kick) only stores the tail (one atomic store, the
//! doorbell), the device thread sees it, consumes the descriptors and
//! writes back descriptor-done while the driver goes on posting.
//! Throughput is then set by the slower of the two, as on a real NIC.
//!
//! With a line rate ([`Config::line_rate_gbit`]) the device also paces
//! itself: after each doorbell's packets it does not take the next before
//! their frames would have left the wire (frame bytes plus
//! [`WIRE_GAP`] per frame, at the configured rate).
//!
//! Soundness: descriptors and payloads are published to the device by the
//! doorbell (release store, acquire load); the device hands them back with
//! its descriptor-done write, a release store the driver reads with an
//! acquire load ([`pfrag::dma::Translate::write_u32`]). Attach, detach and
//! the counters take the device's lock, so they never run beside a
//! doorbell being served.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use pfrag::Iova;

use super::softnic::{NicStats, WIRE_GAP};
use super::Model;
use crate::device::TxDevice;
use crate::error::{Error, Result};

/// Settings of a device thread. [`Config::default()`] does not pace.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Config {
    /// Wire rate to pace to, in Gbit/s; `None` (the default) runs as fast
    /// as the model can.
    pub line_rate_gbit: Option<f64>,
}

/// No doorbell rung since the ring was attached.
const NO_DOORBELL: u64 = u64::MAX;

/// What the driver's side and the device thread share.
#[derive(Debug)]
struct Shared<D> {
    dev: Mutex<D>,
    /// The last doorbell: a sequence number above the tail's 16 bits, so
    /// that ringing the same tail twice is seen twice (and never confused
    /// with a doorbell from before an attach).
    doorbell: AtomicU64,
    stop: AtomicBool,
    /// The device thread's first error since the ring was attached,
    /// reported by the next doorbell.
    error: Mutex<Option<Error>>,
    /// Ns the device thread waited for the wire (pacing).
    paced_ns: AtomicU64,
    /// Descriptors in the attached ring (written under `dev`'s lock).
    len: AtomicU16,
}

/// A device model run by its own thread; see the module docs.
#[derive(Debug)]
pub struct Threaded<D: Model + Send + 'static> {
    shared: Arc<Shared<D>>,
    seq: u64,
    thread: Option<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic on the device thread poisons the lock; the state it guards
    // (a model's counters and ring view) stays readable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<D: Model + Send + 'static> Threaded<D> {
    /// Starts a thread that serves `dev`'s doorbells. Fails with
    /// [`Error::BadConfig`] for a line rate that is not a finite number
    /// above 0.
    pub fn spawn(dev: D, cfg: Config) -> Result<Threaded<D>> {
        let gap_ns_per_byte = match cfg.line_rate_gbit {
            None => None,
            Some(g) if g.is_finite() && g > 0.0 => Some(8.0 / g),
            Some(gbit) => return Err(Error::BadLineRate { gbit }),
        };
        if gap_ns_per_byte.is_some() && !dev.paceable() {
            return Err(Error::Unpaceable);
        }
        let shared = Arc::new(Shared {
            dev: Mutex::new(dev),
            doorbell: AtomicU64::new(NO_DOORBELL),
            stop: AtomicBool::new(false),
            error: Mutex::new(None),
            paced_ns: AtomicU64::new(0),
            len: AtomicU16::new(0),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("pfrag-device".into())
            .spawn(move || serve(&s, gap_ns_per_byte))
            .map_err(Error::DeviceThread)?;
        Ok(Threaded {
            shared,
            seq: 0,
            thread: Some(thread),
        })
    }

    /// Runs `f` on the model, between doorbells.
    ///
    /// # Safety
    /// As for [`Queue::device_mut`](crate::tx::Queue::device_mut): `f`
    /// neither replaces the model (`mem::swap` with another queue's model)
    /// nor re-points it. [`Model::take_frames`] and
    /// [`Model::counters`] are the safe ways in.
    pub unsafe fn with<R>(&self, f: impl FnOnce(&mut D) -> R) -> R {
        f(&mut lock(&self.shared.dev))
    }

    /// Ns the device waited for the wire so far (0 without a line rate).
    pub fn paced_ns(&self) -> u64 {
        self.shared.paced_ns.load(Ordering::Relaxed)
    }
}

/// The device thread: polls the doorbell and serves each new one.
fn serve<D: Model>(s: &Shared<D>, ns_per_byte: Option<f64>) {
    let mut seen = NO_DOORBELL;
    let mut idle = 0u32;
    let mut wire = Wire {
        base: Instant::now(),
        free_ns: 0.0,
    };
    while !s.stop.load(Ordering::Acquire) {
        let bell = s.doorbell.load(Ordering::Acquire);
        if bell == seen || bell == NO_DOORBELL {
            seen = bell;
            idle = idle.saturating_add(1);
            if idle < 1024 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            continue;
        }
        idle = 0;
        seen = match ns_per_byte {
            None => serve_all(s),
            Some(k) => serve_paced(s, k, &mut wire),
        };
    }
}

/// Serves the latest doorbell in one go; returns the doorbell served.
fn serve_all<D: Model>(s: &Shared<D>) -> u64 {
    let mut d = lock(&s.dev);
    // Read again under the lock: an attach or detach in between voided
    // the doorbell, and a later one covers this one.
    let bell = s.doorbell.load(Ordering::Acquire);
    if bell != NO_DOORBELL {
        // SAFETY: `bell` was stored by `Threaded::kick`, whose caller
        // handed the descriptors up to its tail to the device, for the
        // ring attached now (attach and detach void the doorbell).
        if let Err(e) = unsafe { d.kick(bell as u16) } {
            lock(&s.error).get_or_insert(e);
        }
    }
    bell
}

/// When the modelled wire is free again, in ns since `base`.
struct Wire {
    base: Instant,
    free_ns: f64,
}

impl Wire {
    fn now_ns(&self) -> f64 {
        self.base.elapsed().as_nanos() as f64
    }
}

/// Serves the latest doorbell one descriptor at a time, taking each one
/// only once the wire is free of the frames before it: a packet's
/// descriptor-done is written when it starts on the wire, so the driver
/// never sees completions faster than the line rate allows. Returns the
/// doorbell served.
fn serve_paced<D: Model>(s: &Shared<D>, ns_per_byte: f64, wire: &mut Wire) -> u64 {
    while !s.stop.load(Ordering::Acquire) {
        let waited = wire.now_ns();
        let mut now = waited;
        while now < wire.free_ns && !s.stop.load(Ordering::Acquire) {
            std::hint::spin_loop();
            now = wire.now_ns();
        }
        s.paced_ns
            .fetch_add((now - waited) as u64, Ordering::Relaxed);
        let mut d = lock(&s.dev);
        let bell = s.doorbell.load(Ordering::Acquire);
        let tail = bell as u16;
        let len = s.len.load(Ordering::Relaxed);
        let head = match d.head() {
            Some(h) if bell != NO_DOORBELL && h != tail && len > 0 => h,
            _ => return bell,
        };
        if tail >= len {
            // A tail outside the ring: the head would never reach it, and
            // the walk would take descriptors never handed over, round and
            // round. Refused as the model's own doorbell refuses it.
            let e = Error::BadConfig {
                what: "tail",
                value: u64::from(tail),
            };
            lock(&s.error).get_or_insert(e);
            return bell;
        }
        let before = d.counters();
        let next = ((u32::from(head) + 1) % u32::from(len)) as u16;
        // SAFETY: the descriptor at `head` lies before `tail`, the latest
        // doorbell of this attachment: its caller handed it over.
        if let Err(e) = unsafe { d.kick(next) } {
            lock(&s.error).get_or_insert(e);
            return bell;
        }
        let sent = d.counters().since(&before);
        drop(d);
        // The frames start on the wire when the device took them (their
        // DMA overlaps the frames before), or once the wire is free.
        wire.free_ns = wire.free_ns.max(now) + wire_of(&sent) as f64 * ns_per_byte;
    }
    s.doorbell.load(Ordering::Acquire)
}

/// Wire bytes of what one doorbell sent: frames with their gaps.
fn wire_of(d: &NicStats) -> u64 {
    d.wire_bytes + d.frames * WIRE_GAP
}

impl<D: Model + Send + 'static> TxDevice for Threaded<D> {
    type Format = D::Format;
    fn format(&self) -> D::Format {
        lock(&self.shared.dev).format()
    }

    unsafe fn attach(&mut self, ring: Iova, len: u16) -> Result<()> {
        let mut d = lock(&self.shared.dev);
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { d.attach(ring, len) }?;
        self.shared.len.store(len, Ordering::Relaxed);
        self.shared.doorbell.store(NO_DOORBELL, Ordering::Release);
        *lock(&self.shared.error) = None;
        Ok(())
    }

    /// The doorbell: stores `tail` for the device thread (release), after
    /// reporting an error the device thread met since the last doorbell.
    /// The device thread serves it later; the caller's promise lasts until
    /// the packets are reported done, so it covers that.
    unsafe fn kick(&mut self, tail: u16) -> Result<()> {
        if let Some(e) = lock(&self.shared.error).take() {
            return Err(e);
        }
        self.seq = (self.seq + 1) & 0xffff_ffff_ffff;
        let bell = (self.seq << 16) | u64::from(tail);
        self.shared.doorbell.store(bell, Ordering::Release);
        Ok(())
    }

    fn detach(&mut self) -> Result<()> {
        let mut d = lock(&self.shared.dev);
        d.detach()?;
        // Only once detached: a detach that fails leaves the last doorbell
        // for the thread to serve, the ring still attached.
        self.shared.doorbell.store(NO_DOORBELL, Ordering::Release);
        Ok(())
    }

    fn head(&mut self) -> Option<u16> {
        lock(&self.shared.dev).head()
    }

    fn check_running(&mut self) -> Result<()> {
        lock(&self.shared.dev).check_running()
    }
}

impl<D: Model + Send + 'static> Model for Threaded<D> {
    fn counters(&self) -> NicStats {
        lock(&self.shared.dev).counters()
    }
    fn take_frames(&mut self) -> Vec<Vec<u8>> {
        lock(&self.shared.dev).take_frames()
    }
}

impl<D: Model + Send + 'static> Drop for Threaded<D> {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            // A panic of the device thread was a bug in the model; the
            // queue has already detached, so there is nothing to undo.
            let _ = t.join();
        }
    }
}
