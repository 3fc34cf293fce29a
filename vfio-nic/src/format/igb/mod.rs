//! The Intel 82576's advanced TX descriptors ([`desc`]): a context
//! descriptor that the device keeps per queue (header lengths, MSS, L4
//! type), data descriptors whose first carries PAYLEN and the checksum
//! options, and `DD` written back into the last descriptor of a packet.

pub mod desc;

use super::{Buf, Format, Packet, Status};
use crate::offload::{Ip, Layout, Offload, L4};
use desc::{Context, Data, Dcmd, Desc, Popts, Sta};

/// The 82576 advanced descriptor format (datasheet 7.2.2), read by the
/// real NIC ([`Igb`], with the `vfio` feature), the software NIC and the
/// null device.
///
#[cfg_attr(feature = "vfio", doc = "[`Igb`]: crate::hw::igb::Igb")]
#[cfg_attr(not(feature = "vfio"), doc = "[`Igb`]: crate#features")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Advanced;

// SAFETY: a data descriptor names `buf.iova` and `buf.len` (DTALEN; the
// engine never hands a buffer longer than `MAX_BUF`), a context descriptor
// names no memory, and the 82576 writes back only the status dword. It
// fetches and processes a queue's descriptors in ring order and writes DD
// into a descriptor with RS only once it has read that packet's data, so
// DD there also says every earlier packet was read (`DEFERRED_REPORT`).
unsafe impl Format for Advanced {
    const NAME: &'static str = "82576 advanced";
    const DESC_SIZE: usize = desc::SIZE;
    /// DTALEN is 16 bits.
    const MAX_BUF: usize = u16::MAX as usize;
    /// PAYLEN is 18 bits.
    const MAX_PAYLOAD: usize = desc::MAX_PAYLEN;
    const STATUS_OFFSET: usize = desc::STATUS_OFFSET;
    const HAS_CONTEXT: bool = true;
    /// RS only every `report_every` packets and before each doorbell, as
    /// DPDK's ixgbe and i40e drivers set it every `tx_rs_thresh`
    /// descriptors (its igb driver sets it on every packet).
    const DEFERRED_REPORT: bool = true;
    /// The 82576 sums the L4 header and payload, the checksum field
    /// included: the field holds the pseudo-header sum, over the packet's
    /// L4 length without TSO, and over none with it (it adds each
    /// segment's).
    const PSEUDO_HEADER_SUM: bool = true;
    const TSO_PSEUDO_LENGTH: bool = false;

    type Context = Context;

    fn context(&self, l: &Layout, offload: Offload) -> Context {
        let mss = match offload {
            Offload::Tso { mss } => mss,
            _ => 0,
        };
        let ipv4 = l.ip == Ip::V4;
        Context::new(ipv4, l.maclen, l.iplen, l.l4len, mss, l.l4 == L4::Tcp)
    }

    fn write_context(&self, d: &mut [u64], ctx: &Context) {
        d.copy_from_slice(&Desc::Context(*ctx).encode());
    }

    /// The first buffer carries PAYLEN (the payload for TSO, the whole
    /// frame otherwise) and the checksum options (the IP checksum for
    /// IPv4 only); the last ends the packet and asks for the write-back.
    fn write_data(&self, d: &mut [u64], buf: Buf, pkt: &Packet) {
        let sums = match pkt.layout.map(|l| l.ip) {
            Some(Ip::V4) => Popts::IXSM | Popts::TXSM,
            _ => Popts::TXSM,
        };
        let (tso, popts) = match pkt.offload {
            Offload::Tso { .. } => (Dcmd::TSE, sums),
            Offload::Checksum => (Dcmd::empty(), sums),
            Offload::None => (Dcmd::empty(), Popts::empty()),
        };
        let (paylen, popts) = match (buf.first, pkt.offload) {
            (false, _) => (0, Popts::empty()),
            (true, Offload::Tso { .. }) => (pkt.len, popts),
            (true, _) => (pkt.hlen + pkt.len, popts),
        };
        let end = match (buf.last, buf.report) {
            (true, true) => Dcmd::EOP | Dcmd::RS,
            (true, false) => Dcmd::EOP,
            (false, _) => Dcmd::empty(),
        };
        let data = Data::new(
            buf.iova.raw(),
            buf.len as u16,
            Dcmd::IFCS | tso | end,
            paylen as u32,
            popts,
        );
        d.copy_from_slice(&Desc::Data(data).encode());
    }

    /// A packet's last descriptor is a data descriptor (the engine writes
    /// a context descriptor only before a packet's data); anything else is
    /// a broken invariant, which panics rather than leave the packet
    /// unreported.
    fn ask_report(&self, d: &mut [u64]) {
        let desc = Desc::decode([d[0], d[1]]);
        let Desc::Data(mut data) = desc else {
            panic!("asked to report a packet whose last descriptor is not data: {desc:?}");
        };
        data.cmd_type_len |= Dcmd::RS.bits();
        d.copy_from_slice(&Desc::Data(data).encode());
    }

    fn status(&self, word: u32) -> Option<Status> {
        (word & Sta::DD.bits() != 0).then_some(Status::Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pfrag::Iova;

    /// Asking a descriptor written without a report for one gives the
    /// descriptor written with it: RS set, every other field as it was;
    /// asking twice is asking once.
    #[test]
    fn asking_for_a_report_sets_rs_and_nothing_else() {
        let layout = Layout {
            maclen: 14,
            ip: Ip::V4,
            iplen: 20,
            l4len: 20,
            l4: L4::Tcp,
        };
        let offloads = [
            (Offload::None, None),
            (Offload::Checksum, Some(layout)),
            (Offload::Tso { mss: 1448 }, Some(layout)),
        ];
        for (offload, layout) in offloads {
            for first in [false, true] {
                let pkt = Packet {
                    offload,
                    hlen: 54,
                    len: 9000,
                    layout,
                };
                let buf = |report| Buf {
                    iova: Iova(0x1234_5000),
                    len: 1500,
                    first,
                    last: true,
                    next: 0,
                    report,
                };
                let (mut asked, mut want) = ([0u64; 2], [0u64; 2]);
                Advanced.write_data(&mut asked, buf(false), &pkt);
                let Desc::Data(d) = Desc::decode(asked) else {
                    panic!("a data descriptor");
                };
                assert!(!d.cmd().contains(Dcmd::RS));
                Advanced.ask_report(&mut asked);
                Advanced.write_data(&mut want, buf(true), &pkt);
                assert_eq!(asked, want, "{offload:?}, first {first}");
                // Asking again (after a failed doorbell) changes nothing.
                Advanced.ask_report(&mut asked);
                assert_eq!(asked, want, "twice: {offload:?}, first {first}");
            }
        }
    }
}
