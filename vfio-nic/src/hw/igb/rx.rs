//! The 82576's receive queue 0: a ring of advanced one-buffer
//! descriptors ([`RxRing`]) and the calls that hand it to the NIC, used
//! with MAC loopback so that the guest can receive what it sent.

use std::sync::Arc;

use pfrag::dma::{Coherent, Dir, DmaMapper, Domain};
use pfrag::Iova;

use super::*;

/// RX queue 0's ring registers, as [`Igb::start_rx_at`] writes them:
/// base low and high, length, buffer size and descriptor type, head and
/// tail.
const RX_RING_REGS: [Reg; 6] = [
    regs::rdbal(0),
    regs::rdbah(0),
    regs::rdlen(0),
    regs::srrctl(0),
    regs::rdh(0),
    regs::rdt(0),
];

/// Accepts an RX ring length the 82576 takes ([`check_ring_len`]).
fn check_rx_len(len: u16) -> Result<()> {
    check_ring_len("RX ring length (multiple of 8, 8..=4096)", len)
}

/// Receive queue 0 with advanced one-buffer descriptors and one 2 KiB
/// buffer each, all
/// in two coherent regions mapped through the IOMMU. Used with MAC
/// loopback ([`Igb::start_rx`]) so that the guest can receive what it sent.
pub struct RxRing<M: DmaMapper> {
    pub(super) ring: Coherent<M>,
    bufs: Coherent<M>,
    pub(super) len: u16,
    next: u16,
}

impl<M: DmaMapper> std::fmt::Debug for RxRing<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxRing")
            .field("len", &self.len)
            .field("next", &self.next)
            .finish()
    }
}

impl<M: DmaMapper> RxRing<M> {
    /// A ring of `len` descriptors (a multiple of 8, 8..=4096), each with
    /// its buffer, mapped in `domain`.
    pub fn new(domain: Arc<Domain<M>>, len: u16) -> Result<RxRing<M>> {
        check_rx_len(len)?;
        let n = usize::from(len);
        let ring = Coherent::new(domain.clone(), n * crate::desc::SIZE, Dir::BIDIRECTIONAL)?;
        let bufs = Coherent::new(domain, n * RX_BUF, Dir::FROM_DEVICE)?;
        let mut rx = RxRing {
            ring,
            bufs,
            len,
            next: 0,
        };
        rx.rearm()?;
        Ok(rx)
    }

    /// Arms every descriptor and reads from descriptor 0 next, where the
    /// device starts writing: frames written back and not read are
    /// dropped, their descriptors and buffers handed to the device again.
    fn rearm(&mut self) -> Result<()> {
        for i in 0..self.len {
            self.arm(i)?;
        }
        self.next = 0;
        Ok(())
    }

    /// Writes descriptor `i` in its read format: packet buffer address, and
    /// a zero header address (which also clears the write-back status).
    fn arm(&self, i: u16) -> Result<()> {
        let off = usize::from(i) * crate::desc::SIZE;
        let addr = self.bufs.iova().raw() + (usize::from(i) * RX_BUF) as u64;
        self.ring.write_u64(off, addr)?;
        self.ring.write_u64(off + 8, 0)?;
        Ok(())
    }

    /// The next received frame, if its descriptor is done: its bytes (CRC
    /// stripped), after which the descriptor is re-armed. Returns the tail
    /// to hand back to the device with [`Igb::rx_tail`].
    pub fn next_frame(&mut self) -> Result<Option<(Vec<u8>, u16)>> {
        let off = usize::from(self.next) * crate::desc::SIZE;
        // Write-back format, upper half: status/error (32 bits), length
        // (16), VLAN (16).
        let w1 = self.ring.read_u64(off + 8)?;
        let status = RxSta::from_bits_truncate(w1 as u32);
        if !status.contains(RxSta::DD) {
            return Ok(None);
        }
        // Descriptor fields before the buffer: pairs with the device's write.
        fence(Ordering::Acquire);
        let len = ((w1 >> 32) & 0xffff) as usize;
        let mut frame = vec![0u8; len.min(RX_BUF)];
        self.bufs
            .read(usize::from(self.next) * RX_BUF, &mut frame)?;
        let done = self.next;
        self.arm(done)?;
        self.next = (self.next + 1) % self.len;
        Ok(Some((frame, done)))
    }

    /// Descriptors in the ring.
    pub fn len(&self) -> u16 {
        self.len
    }

    /// Never true: a ring has at least 8 descriptors.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the ring and its buffers allocated and mapped for good, for a
    /// device whose receiver could not be stopped (a [`stop_rx`] that
    /// failed, or an [`Igb`] dropped first, whose drop cannot report one):
    /// it may still write them. Counted in the domain's
    /// [`pinned`](pfrag::dma::Domain::pinned) host and IOVA bytes.
    ///
    /// [`stop_rx`]: Igb::stop_rx
    pub fn pin(self) {
        self.ring.pin();
        self.bufs.pin();
    }
}

impl<R: Regs> Igb<R> {
    /// Points receive queue 0 at `rx`, hands the device all but one of its
    /// descriptors and enables the receiver, promiscuous, CRC stripped, and
    /// with `loopback` in MAC loopback: transmitted frames come back to this
    /// queue instead of going to the wire. Call [`stop_rx`](Self::stop_rx)
    /// before dropping `rx`; if it fails, keep `rx` with [`RxRing::pin`].
    ///
    /// A receiver already running is stopped first, as
    /// [`start_rx_at`](Self::start_rx_at) does; one that does not stop is
    /// [`Error::DeviceTimeout`], with `rx` untouched and the receiver on.
    /// The device then starts at descriptor 0, so `rx` is re-armed and
    /// read from there: frames a ring started before holds unread are
    /// dropped (on a later error too).
    ///
    /// # Safety
    /// `rx` stays alive, and its buffers the device's, until a
    /// [`stop_rx`](Self::stop_rx) that returned `Ok`: the NIC writes
    /// received frames into them. Without one (it failed, or the `Igb` was
    /// dropped first: its drop tries to stop the receiver but cannot report
    /// a failure), `rx` is the device's for good ([`RxRing::pin`]).
    pub unsafe fn start_rx<M: DmaMapper>(
        &mut self,
        rx: &mut RxRing<M>,
        loopback: bool,
    ) -> Result<()> {
        // The device may still write `rx`: it is re-armed once stopped.
        self.quiesce_rx()?;
        rx.rearm()?;
        // SAFETY: `rx`'s ring and buffers are what the caller handed over.
        unsafe { self.start_rx_at(rx.ring.iova(), rx.len, loopback) }
    }

    /// As [`start_rx`](Self::start_rx), for a ring the caller built: `len`
    /// advanced one-buffer RX descriptors (a multiple of 8, 8..=4096) at
    /// `ring` (128-byte aligned, [`Error::BadConfig`] otherwise), each
    /// pointing at a 2 KiB buffer ([`RX_BUF`]). The ring and every buffer
    /// must stay mapped, writable by the device, until
    /// [`stop_rx`](Self::stop_rx) returns `Ok`. A receiver already running
    /// is stopped before the queue is re-pointed; one that does not stop
    /// is [`Error::DeviceTimeout`], the receiver left on its old ring. A
    /// start that fails after the queue was pointed at `ring` stops the
    /// receiver again, waiting until the queue reads disabled, and puts
    /// the ring registers back as they were; a queue that does not stop
    /// then is [`Error::StopFailed`], and it may still write `ring`,
    /// which the caller keeps for good.
    ///
    /// # Safety
    /// `ring` is `len` RX descriptors, and the buffers they name, that the
    /// caller keeps for the device until a [`stop_rx`](Self::stop_rx) that
    /// returned `Ok` (for good without one, as for
    /// [`start_rx`](Self::start_rx)): the NIC writes received frames where
    /// they point.
    pub unsafe fn start_rx_at(&mut self, ring: Iova, len: u16, loopback: bool) -> Result<()> {
        check_rx_len(len)?;
        // RDBAL's low 7 bits are ignored: the device would use the ring
        // at the address rounded down, memory not handed to it.
        if !ring.raw().is_multiple_of(128) {
            return Err(Error::BadConfig {
                what: "igb RX ring address (128-byte aligned)",
                value: ring.raw(),
            });
        }
        self.quiesce_rx()?;
        let saved = self.save(RX_RING_REGS)?;
        // SAFETY: the caller's promise for `ring` is passed on unchanged.
        if let Err(error) = unsafe { self.program_rx(ring, len, loopback) } {
            return Err(self.undo(|| self.stop_rx(), (RX_RING_REGS, saved), error));
        }
        Ok(())
    }

    /// Points RX queue 0 at the `len` descriptors at `ring`, enables it,
    /// waits (bounded) until the enable reads back, hands the device every
    /// descriptor but one and turns the receiver on.
    ///
    /// # Safety
    /// As [`start_rx_at`](Self::start_rx_at), for `ring`.
    unsafe fn program_rx(&self, ring: Iova, len: u16, loopback: bool) -> Result<()> {
        let base = ring.raw();
        let bytes = u32::from(len) * crate::desc::SIZE as u32;
        let buf = SRRCTL_BSIZEPKT_2K | SRRCTL_DESCTYPE_ADV_ONEBUF;
        let values = [base as u32, (base >> 32) as u32, bytes, buf, 0, 0];
        for (r, v) in RX_RING_REGS.into_iter().zip(values) {
            self.reg(r, v)?;
        }
        self.reg(regs::rxdctl(0), Rxdctl::ENABLE.bits())?;
        wait_for("RX queue enable", self.cfg.enable_timeout, || {
            Ok(self.read(regs::rxdctl(0))? & Rxdctl::ENABLE.bits() != 0)
        })?;
        fence(Ordering::SeqCst);
        self.reg(regs::rdt(0), u32::from(len - 1))?;
        let mut rctl = Rctl::EN | Rctl::UPE | Rctl::MPE | Rctl::BAM | Rctl::SECRC;
        if loopback {
            rctl |= Rctl::LBM_MAC;
        }
        self.reg(regs::RCTL, rctl.bits())
    }

    /// Gives descriptors up to (not including) `tail` back to the device.
    ///
    /// # Safety
    /// The descriptors up to `tail`, and their buffers, are the device's
    /// (as for [`start_rx_at`](Self::start_rx_at)).
    pub unsafe fn rx_tail(&self, tail: u16) -> Result<()> {
        fence(Ordering::SeqCst);
        self.reg(regs::rdt(0), u32::from(tail))
    }

    /// [`stop_rx`](Self::stop_rx), or, if the queue does not read back
    /// disabled, the receiver and the queue put back as they were: the
    /// device keeps the ring it has.
    fn quiesce_rx(&self) -> Result<()> {
        let (rctl, rxdctl) = (self.read(regs::RCTL)?, self.read(regs::rxdctl(0))?);
        if let Err(e) = self.stop_rx() {
            // Best effort: the error that stopped the call is the one
            // reported.
            let _ = self.reg(regs::rxdctl(0), rxdctl);
            let _ = self.reg(regs::RCTL, rctl);
            return Err(e);
        }
        Ok(())
    }

    /// Turns the receiver (and loopback) off and waits (bounded by the
    /// enable timeout) until the queue's enable bit reads 0: the device
    /// no longer writes the ring. [`Error::DeviceTimeout`] if it does not.
    pub fn stop_rx(&self) -> Result<()> {
        self.reg(regs::RCTL, 0)?;
        self.reg(regs::rxdctl(0), 0)?;
        self.wait_stopped("RX queue disable", regs::rxdctl(0), Rxdctl::ENABLE.bits())
    }
}
