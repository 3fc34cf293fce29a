//! Intel 82576 (igb) TX driver over VFIO.
//!
//! [`Igb`] resets the controller, waits (bounded) for link, and runs TX
//! queue 0 as a [`TxDevice`]: the [`tx::Queue`](crate::tx::Queue) that
//! drives the software NIC drives this one unchanged. Completions come from
//! the descriptor-done write-back of the report-status descriptor (head
//! write-back stays off). An optional receive queue ([`RxRing`],
//! [`Igb::start_rx`]) with MAC loopback lets a test receive what it sent.
//!
//! Register names and bits follow the 82576 datasheet (section 8); only the
//! registers this driver uses are named.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use pfrag::dma::Domain;
//! use pfrag::pool::{self, Policy, Pool};
//! use pfrag::Order;
//! use vfio_nic::hw::igb::{Igb, IgbConfig};
//! use vfio_nic::tx::{self};
//! use vfio_nic::hw::vfio::{VfioMapper, VfioPci};
//!
//! let pci = VfioPci::open("0000:00:02.0")?;
//! let domain = Arc::new(Domain::new(VfioMapper::new(&pci)?));
//! let nic = Igb::new(pci, IgbConfig::default())?;
//! let pool = Pool::new(domain.clone(), pool::Config::new(Order::new(4)?, Policy::Persistent))?;
//! // SAFETY: the NIC is the VFIO device in the container `domain` maps into.
//! let mut q = unsafe { tx::Queue::new(domain, pool, nic, tx::Config::default()) }?;
//! let headers = [0u8; 14]; // a raw frame start: no offload asked for
//! q.send(&headers, &[0u8; 1000], vfio_nic::offload::Offload::None, 1)?;
//! q.kick()?;
//! q.wait(Duration::from_secs(1))?;
//! # Ok::<(), vfio_nic::Error>(())
//! ```

use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

use pfrag::Iova;

use crate::device::TxDevice;
use crate::error::{Error, Result};
use crate::hw::mmio::{Reg, Regs};
use crate::hw::vfio::VfioPci;
use crate::hw::wait_for;

pub mod regs;

bitflags::bitflags! {
    /// CTRL bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Ctrl: u32 {
        /// Full duplex.
        const FD = 1 << 0;
        /// GIO master disable: the device issues no new bus-master
        /// requests (STATUS.GIO_MASTER_ENABLE clears once none is pending).
        const GIO_MASTER_DISABLE = 1 << 2;
        /// Set Link Up.
        const SLU = 1 << 6;
        /// Device reset (self-clearing).
        const RST = 1 << 26;
        /// PHY reset.
        const PHY_RST = 1 << 31;
    }

    /// STATUS bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Status: u32 {
        /// Full duplex.
        const FD = 1 << 0;
        /// Link up.
        const LU = 1 << 1;
        /// GIO master enable: bus-master requests may be pending (set
        /// unless CTRL.GIO_MASTER_DISABLE is set and none is).
        const GIO_MASTER_ENABLE = 1 << 19;
    }

    /// TCTL bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Tctl: u32 {
        /// Transmit enable.
        const EN = 1 << 1;
        /// Pad short packets.
        const PSP = 1 << 3;
    }

    /// MDIC bits (the data, register and PHY address fields are shifts
    /// below).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Mdic: u32 {
        /// Opcode write.
        const OP_WRITE = 1 << 26;
        /// Opcode read.
        const OP_READ = 2 << 26;
        /// Ready: the access completed.
        const READY = 1 << 28;
        /// Error: the PHY did not answer.
        const ERROR = 1 << 30;
    }

    /// PHY Control register (MII register 0) bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct PhyCtrl: u16 {
        /// Restart auto-negotiation.
        const RESTART_AN = 1 << 9;
        /// Auto-negotiation enable.
        const AN_ENABLE = 1 << 12;
    }

    /// TXDCTL bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Txdctl: u32 {
        /// Queue enable.
        const ENABLE = 1 << 25;
    }

    /// RCTL bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Rctl: u32 {
        /// Receiver enable.
        const EN = 1 << 1;
        /// Unicast promiscuous.
        const UPE = 1 << 3;
        /// Multicast promiscuous.
        const MPE = 1 << 4;
        /// Loopback mode: MAC loopback (LBM = 01b).
        const LBM_MAC = 1 << 6;
        /// Broadcast accept.
        const BAM = 1 << 15;
        /// Strip the Ethernet CRC.
        const SECRC = 1 << 26;
    }

    /// RXDCTL bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Rxdctl: u32 {
        /// Queue enable.
        const ENABLE = 1 << 25;
    }

    /// Advanced receive descriptor write-back status bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct RxSta: u32 {
        /// Descriptor done.
        const DD = 1 << 0;
        /// End of packet.
        const EOP = 1 << 1;
    }
}

/// The register [`Igb::mark`] writes: Receive Address Low, entry 15.
pub const MARK_REG: Reg = regs::ral(15);

/// The registers [`Igb::reset`] changes before CTRL.RST, other than
/// CTRL: the interrupt masks (which IMC and EIMC clear), the receive and
/// transmit controls. Their values, read first, are what a failure before
/// the RST puts back.
const QUIESCED: [Reg; 4] = [regs::IMS, regs::EIMS, regs::RCTL, regs::TCTL];

/// MDIC register-address field shift.
const MDIC_REG_SHIFT: u32 = 16;
/// MDIC PHY-address field shift.
const MDIC_PHY_SHIFT: u32 = 21;
/// The internal PHY's MDIO address.
const PHY_ADDR: u32 = 1;
/// PHY Control, MII register 0.
const PHY_CTRL: u32 = 0;

/// SRRCTL packet buffer size field, in 1 KiB units (bits 6:0).
const SRRCTL_BSIZEPKT_2K: u32 = 2;
/// SRRCTL descriptor type (bits 27:25): advanced, one buffer.
const SRRCTL_DESCTYPE_ADV_ONEBUF: u32 = 1 << 25;

/// Bytes per receive buffer.
pub const RX_BUF: usize = 2048;

/// TCTL collision threshold field (bits 11:4); the datasheet's value 0xF.
const TCTL_CT: u32 = 0xF << 4;
/// TCTL collision distance field (bits 21:12); 0x3F for full duplex.
const TCTL_COLD: u32 = 0x3F << 12;

/// The most descriptors a TX or RX ring may have. TDLEN and RDLEN count
/// bytes in multiples of 128 (8 descriptors) in bits 19:7, so the field
/// itself would hold longer rings; 4,096 is the most the 82576's own
/// drivers (Linux's igb: `IGB_MAX_TXD`, `IGB_MAX_RXD`) and the
/// [`tx::Queue`](crate::tx::Queue)'s configuration ask of it.
pub const MAX_RING: u16 = 4096;

/// [`Error::BadConfig`] naming `what` unless a ring of `len` descriptors
/// is one the 82576 takes: a multiple of 8 (the length registers count
/// whole 128-byte blocks), 8..=[`MAX_RING`].
fn check_ring_len(what: &'static str, len: u16) -> Result<()> {
    if !(8..=MAX_RING).contains(&len) || !len.is_multiple_of(8) {
        return Err(Error::BadConfig {
            what,
            value: u64::from(len),
        });
    }
    Ok(())
}

/// Timeouts of the bring-up steps.
#[derive(Clone, Copy, Debug)]
pub struct IgbConfig {
    /// How long a reset may take to self-clear, and the device's pending
    /// bus-master requests to drain before it. Default
    /// [`IgbConfig::DEFAULT_RESET_TIMEOUT`] (1 s).
    pub reset_timeout: Duration,
    /// How long to wait for link after reset. Default
    /// [`IgbConfig::DEFAULT_LINK_TIMEOUT`] (10 s).
    pub link_timeout: Duration,
    /// How long a queue enable may take to read back. Default
    /// [`IgbConfig::DEFAULT_ENABLE_TIMEOUT`] (1 s).
    pub enable_timeout: Duration,
}

impl IgbConfig {
    /// The default time a reset may take to self-clear (and master
    /// requests to drain before it).
    pub const DEFAULT_RESET_TIMEOUT: Duration = Duration::from_secs(1);
    /// The default wait for link after reset.
    pub const DEFAULT_LINK_TIMEOUT: Duration = Duration::from_secs(10);
    /// The default time a queue enable may take to read back.
    pub const DEFAULT_ENABLE_TIMEOUT: Duration = Duration::from_secs(1);
}

impl Default for IgbConfig {
    fn default() -> Self {
        IgbConfig {
            reset_timeout: IgbConfig::DEFAULT_RESET_TIMEOUT,
            link_timeout: IgbConfig::DEFAULT_LINK_TIMEOUT,
            enable_timeout: IgbConfig::DEFAULT_ENABLE_TIMEOUT,
        }
    }
}

/// Device-side counters, accumulated from the clear-on-read registers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IgbStats {
    /// Good packets transmitted (frames on the wire, after TSO).
    pub good_packets: u64,
    /// Good octets transmitted.
    pub good_octets: u64,
    /// Total packets transmitted.
    pub total_packets: u64,
}

/// An 82576 running TX queue 0, through its registers `R`: the BAR of a
/// device opened with VFIO, or an in-memory model in tests.
#[derive(Debug)]
pub struct Igb<R: Regs = VfioPci> {
    dev: R,
    cfg: IgbConfig,
    ring_len: Option<u16>,
    stats: IgbStats,
    link_wait: Duration,
}

impl<R: Regs> Igb<R> {
    /// Takes the device, resets it and waits for link.
    pub fn new(dev: R, cfg: IgbConfig) -> Result<Igb<R>> {
        let mut nic = Igb {
            dev,
            cfg,
            ring_len: None,
            stats: IgbStats::default(),
            link_wait: Duration::ZERO,
        };
        nic.reset()?;
        Ok(nic)
    }

    /// Reads a register.
    pub fn read(&self, r: Reg) -> Result<u32> {
        self.dev.read(r)
    }

    /// Writes a register.
    ///
    /// # Safety
    /// A register write can point the device's DMA engines at any IOVA and
    /// ring their doorbells (an 82576's TDBAL/TDT, RDBAL/RDT): the caller
    /// promises that the write makes the device read or write no memory
    /// that was not handed to it (a ring or buffer the caller keeps for the
    /// device until it stops it).
    pub unsafe fn write(&self, r: Reg, v: u32) -> Result<()> {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe { self.dev.write(r, v) }
    }

    /// The driver's own register programming. It points the DMA engines
    /// only at rings its callers handed over (`attach`, `start_rx`,
    /// `start_rx_at`, all `unsafe`) and rings their doorbells only for
    /// what they handed over (`kick`, `rx_tail`, `unsafe` too).
    fn reg(&self, r: Reg, v: u32) -> Result<()> {
        // SAFETY: see above: every write the driver makes keeps within
        // what its callers handed to the device.
        unsafe { self.dev.write(r, v) }
    }

    /// Stops the device's bus mastering, masks interrupts, stops RX and
    /// TX, resets the MAC, clears the statistics and waits (bounded) for
    /// link.
    ///
    /// What a failure leaves depends on whether CTRL.RST was written:
    /// - Before it (bus-master requests that do not drain in the reset
    ///   timeout: [`Error::MasterRequestsPending`]; a register access
    ///   masking interrupts, stopping RX or TX, or writing RST itself):
    ///   the device is not reset, and every register the reset changed
    ///   is put back: mastering enabled again, the interrupt masks,
    ///   receiver and transmitter as they were, every ring it was given
    ///   still its own until its queue is stopped
    ///   ([`detach`](TxDevice::detach), [`stop_rx`](Self::stop_rx)). A
    ///   write putting them back that fails too is
    ///   [`Error::UndoFailed`], carrying both: the device may be left
    ///   with mastering disabled (no DMA), interrupts masked, its
    ///   receiver or transmitter off.
    /// - After it (the reset not self-clearing, a register or PHY access,
    ///   no link in the link timeout): the device was reset, whatever
    ///   step failed. Its queues are off and forget their rings (the TX
    ///   queue reads as not attached: [`Error::NotAttached`] until the
    ///   next [`attach`](TxDevice::attach)), the driver's counters start
    ///   from zero (what the device counted before the reset is read and
    ///   dropped as soon as the reset has self-cleared); mastering, the interrupt masks and the link are wherever
    ///   the failed step left them, and a reset that succeeds sets them.
    pub fn reset(&mut self) -> Result<()> {
        self.quiesce_and_reset()?;
        // The device forgot its rings; the driver's counts start again.
        self.ring_len = None;
        self.stats = IgbStats::default();
        wait_for("reset", self.cfg.reset_timeout, || {
            Ok(self.read(regs::CTRL)? & Ctrl::RST.bits() == 0)
        })?;
        // Whatever the reset did to the device's own counters (which clear
        // when read), what they hold now is from before it: read and
        // dropped, before anything later can fail. (Linux's igb reads every
        // statistics register after its reset too, in its hardware init.)
        self.read_stats()?;
        self.stats = IgbStats::default();
        // Interrupts come back unmasked after a reset.
        self.reg(regs::IMC, u32::MAX)?;
        self.reg(regs::EIMC, u32::MAX)?;
        self.read(regs::ICR)?;
        // The reset clears the master disable; written clear all the same,
        // so that the device masters again whatever the reset left.
        let ctrl = self.read(regs::CTRL)? & !Ctrl::GIO_MASTER_DISABLE.bits();
        self.reg(regs::CTRL, ctrl | Ctrl::SLU.bits())?;
        // Copper link comes up through auto-negotiation, restarted in the PHY.
        let bmcr = self.phy_read(PHY_CTRL)?;
        self.phy_write(
            PHY_CTRL,
            bmcr | (PhyCtrl::AN_ENABLE | PhyCtrl::RESTART_AN).bits(),
        )?;
        self.link_wait = wait_for("link up", self.cfg.link_timeout, || {
            Ok(self.read(regs::STATUS)? & Status::LU.bits() != 0)
        })?;
        Ok(())
    }

    /// The reset up to and with the RST write: disables bus mastering
    /// ([`disable_master`](Self::disable_master)), masks interrupts,
    /// turns RX and TX off, then writes CTRL.RST. A failure before the
    /// RST took puts [`QUIESCED`] and CTRL back as they were
    /// ([`put_back`](Self::put_back)).
    fn quiesce_and_reset(&self) -> Result<()> {
        let saved = self.save(QUIESCED)?;
        let ctrl = self.disable_master()?;
        let steps = || {
            self.reg(regs::IMC, u32::MAX)?;
            self.reg(regs::EIMC, u32::MAX)?;
            self.reg(regs::RCTL, 0)?;
            self.reg(regs::TCTL, 0)?;
            let off = Ctrl::GIO_MASTER_DISABLE | Ctrl::RST;
            self.reg(regs::CTRL, ctrl | off.bits())
        };
        steps().map_err(|error| {
            // The masks are put back through IMS and EIMS, whose writes
            // set the bits the reads returned; mastering last.
            let back = QUIESCED.into_iter().zip(saved).rev();
            self.put_back(back.chain([(regs::CTRL, ctrl)]), error)
        })
    }

    /// After a step that failed with `error`: writes each register of
    /// `back` its value, in order, every write tried. `error` comes
    /// back, or, if a write failed, [`Error::UndoFailed`] with the first
    /// that did.
    fn put_back(&self, back: impl IntoIterator<Item = (Reg, u32)>, error: Error) -> Error {
        let mut failed = None;
        for (r, v) in back {
            if let Err(e) = self.reg(r, v) {
                failed.get_or_insert(e);
            }
        }
        match failed {
            None => error,
            Some(undo) => Error::UndoFailed {
                error: Box::new(error),
                undo: Box::new(undo),
            },
        }
    }

    /// Sets CTRL.GIO_MASTER_DISABLE and waits, bounded by the reset
    /// timeout, until STATUS.GIO_MASTER_ENABLE reads clear: no bus-master
    /// request (DMA) of the device is pending, none is issued from then
    /// on, and none is in flight across the reset that follows. CTRL as
    /// it was read before comes back.
    ///
    /// Requests that do not drain are [`Error::MasterRequestsPending`],
    /// with STATUS as last read, and the master disable is taken back:
    /// the device is left as it was, not reset (or, if taking it back
    /// fails, [`Error::UndoFailed`]). Resetting it anyway (which other
    /// 82576 drivers do, logging the timeout) would reset a device in
    /// the middle of DMA, as the datasheet warns against, and say
    /// nothing to the caller. Refused, every ring the device was given
    /// stays the caller's to stop ([`detach`](TxDevice::detach),
    /// [`stop_rx`](Self::stop_rx)), and none is freed until the device
    /// confirms its queue stopped.
    fn disable_master(&self) -> Result<u32> {
        let ctrl = self.read(regs::CTRL)?;
        self.reg(regs::CTRL, ctrl | Ctrl::GIO_MASTER_DISABLE.bits())?;
        let mut status = 0;
        let r = wait_for("master disable", self.cfg.reset_timeout, || {
            status = self.read(regs::STATUS)?;
            Ok(status & Status::GIO_MASTER_ENABLE.bits() == 0)
        });
        let error = match r {
            Ok(_) => return Ok(ctrl),
            Err(Error::DeviceTimeout { waited_ms, .. }) => {
                Error::MasterRequestsPending { status, waited_ms }
            }
            Err(e) => e,
        };
        Err(self.put_back([(regs::CTRL, ctrl)], error))
    }

    fn mdic(&self, v: u32) -> Result<u32> {
        self.reg(regs::MDIC, v)?;
        let mut out = 0;
        wait_for("PHY access", self.cfg.enable_timeout, || {
            out = self.read(regs::MDIC)?;
            Ok(out & Mdic::READY.bits() != 0)
        })?;
        if out & Mdic::ERROR.bits() != 0 {
            return Err(Error::Mdic { mdic: out });
        }
        Ok(out)
    }

    /// Reads PHY register `reg` through MDIC.
    pub fn phy_read(&self, reg: u32) -> Result<u16> {
        let v = self
            .mdic(Mdic::OP_READ.bits() | (reg << MDIC_REG_SHIFT) | (PHY_ADDR << MDIC_PHY_SHIFT))?;
        Ok(v as u16)
    }

    /// Writes PHY register `reg` through MDIC.
    pub fn phy_write(&self, reg: u32, v: u16) -> Result<()> {
        self.mdic(
            Mdic::OP_WRITE.bits()
                | (reg << MDIC_REG_SHIFT)
                | (PHY_ADDR << MDIC_PHY_SHIFT)
                | u32::from(v),
        )?;
        Ok(())
    }

    /// How long the last reset waited for link.
    pub fn link_wait(&self) -> Duration {
        self.link_wait
    }

    /// The permanent MAC address (receive address 0).
    pub fn mac(&self) -> Result<[u8; 6]> {
        let lo = self.read(regs::RAL0)?.to_le_bytes();
        let hi = self.read(regs::RAH0)?.to_le_bytes();
        Ok([lo[0], lo[1], lo[2], lo[3], hi[0], hi[1]])
    }

    fn read_stats(&mut self) -> Result<()> {
        self.stats.good_packets += u64::from(self.read(regs::GPTC)?);
        let lo = u64::from(self.read(regs::GOTCL)?);
        let hi = u64::from(self.read(regs::GOTCH)?);
        self.stats.good_octets += (hi << 32) | lo;
        self.stats.total_packets += u64::from(self.read(regs::TPT)?);
        Ok(())
    }

    /// Device counters since the last reset.
    pub fn stats(&mut self) -> Result<IgbStats> {
        self.read_stats()?;
        Ok(self.stats)
    }

    /// Writes `value` to [`MARK_REG`], a receive-address entry this driver
    /// never enables (its address-valid bit stays clear): harmless for the
    /// device, and visible in an emulator's register trace, so it delimits
    /// measurement windows there (`vm/run.sh sweep` counts the IOMMU events
    /// between two marks).
    pub fn mark(&self, value: u32) -> Result<()> {
        self.reg(MARK_REG, value)
    }

    /// Waits, bounded by the enable timeout, until the queue control
    /// register `r` reads its enable bit `enable` clear (a queue finishes
    /// what it is doing before it stops); [`Error::DeviceTimeout`] naming
    /// `what` if it does not.
    fn wait_stopped(&self, what: &'static str, r: Reg, enable: u32) -> Result<()> {
        wait_for(what, self.cfg.enable_timeout, || {
            Ok(self.read(r)? & enable == 0)
        })?;
        Ok(())
    }

    /// The values of `regs`, read now: what [`undo`](Self::undo) puts
    /// back.
    fn save<const N: usize>(&self, regs: [Reg; N]) -> Result<[u32; N]> {
        let mut saved = [0; N];
        for (v, r) in saved.iter_mut().zip(regs) {
            *v = self.read(r)?;
        }
        Ok(saved)
    }

    /// After a queue's programming failed with `error`: `stop`s the queue,
    /// waiting until it reads disabled, and puts its ring registers `regs`
    /// back to `saved`; `error` comes back. A queue that does not stop
    /// may reach the ring the registers name, which stay:
    /// [`Error::StopFailed`].
    fn undo<const N: usize>(
        &self,
        stop: impl FnOnce() -> Result<()>,
        (regs, saved): ([Reg; N], [u32; N]),
        error: Error,
    ) -> Error {
        if let Err(stop) = stop() {
            return Error::StopFailed {
                error: Box::new(error),
                stop: Box::new(stop),
            };
        }
        for (r, v) in regs.into_iter().zip(saved) {
            // Best effort: the queue is stopped, so these registers lead
            // the device to no memory; `error` is the one reported.
            let _ = self.reg(r, v);
        }
        error
    }

    /// The VFIO device.
    pub fn regs(&self) -> &R {
        &self.dev
    }
}

impl<R: Regs> Drop for Igb<R> {
    fn drop(&mut self) {
        // Stop DMA before the rings and buffers the device may still use
        // are unmapped and freed. A failure cannot be reported here: the
        // TX queue that owned this device pinned its ring when its own
        // detach failed, and `start_rx`'s caller keeps its RX ring until
        // a `stop_rx` that returned `Ok`, for good without one.
        let _ = self.stop_tx();
        let _ = self.stop_rx();
    }
}

mod rx;
mod tx;

pub use rx::RxRing;

#[cfg(test)]
mod tests;
