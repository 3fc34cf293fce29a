//! Intel 82576 advanced transmit descriptors (datasheet section 7.2.2):
//! the data descriptor (read format), the context descriptor and the
//! write-back format, with their command and status bits.

use bitflags::bitflags;

/// Advanced transmit data descriptor, read format (7.2.2.3).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Data {
    /// Buffer address (an IOVA).
    pub addr: u64,
    /// DTALEN (15:0), DTYP (23:20), DCMD (31:24).
    pub cmd_type_len: u32,
    /// STA (3:0), IDX (6:4), POPTS (13:8), PAYLEN (31:14).
    pub olinfo_status: u32,
}

/// Advanced transmit context descriptor (7.2.2.2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Context {
    /// IPLEN (8:0), MACLEN (15:9), VLAN (31:16).
    pub vlan_macip_lens: u32,
    /// Reserved on the 82576 (IPsec SA index on later parts).
    pub seqnum_seed: u32,
    /// TUCMD (19:9), DTYP (23:20), DCMD (31:24).
    pub type_tucmd_mlhl: u32,
    /// IDX (6:4), L4LEN (15:8), MSS (31:16).
    pub mss_l4len_idx: u32,
}

const _: () = assert!(std::mem::size_of::<Data>() == 16);
const _: () = assert!(std::mem::size_of::<Context>() == 16);

/// Bytes per descriptor.
pub const SIZE: usize = 16;
/// Byte offset of the status dword in a descriptor.
pub const STATUS_OFFSET: usize = 12;

/// DTYP field (bits 23:20 of the third dword).
pub const DTYP_MASK: u32 = 0xf << 20;
/// DTYP of a context descriptor.
pub const DTYP_CTXT: u32 = 0x2 << 20;
/// DTYP of a data descriptor.
pub const DTYP_DATA: u32 = 0x3 << 20;
/// DTALEN mask (buffer length).
pub const DTALEN_MASK: u32 = 0xffff;
/// Largest PAYLEN (18 bits): the most payload bytes of one TSO packet, or
/// bytes of one plain packet.
pub const MAX_PAYLEN: usize = (1 << 18) - 1;
/// PAYLEN shift in `olinfo_status`.
pub const PAYLEN_SHIFT: u32 = 14;
/// MACLEN shift in `vlan_macip_lens`.
pub const MACLEN_SHIFT: u32 = 9;
/// IPLEN mask in `vlan_macip_lens`.
pub const IPLEN_MASK: u32 = 0x1ff;
/// L4LEN shift in `mss_l4len_idx`.
pub const L4LEN_SHIFT: u32 = 8;
/// MSS shift in `mss_l4len_idx`.
pub const MSS_SHIFT: u32 = 16;

bitflags! {
    /// DCMD: descriptor command bits (31:24 of the third dword).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Dcmd: u32 {
        /// End of packet: the last descriptor of a packet.
        const EOP = 1 << 24;
        /// Insert the Ethernet FCS.
        const IFCS = 1 << 25;
        /// Report status: write back DD when done.
        const RS = 1 << 27;
        /// Descriptor extension: advanced format.
        const DEXT = 1 << 29;
        /// Insert the VLAN tag.
        const VLE = 1 << 30;
        /// TCP segmentation enable.
        const TSE = 1 << 31;
    }
}

bitflags! {
    /// POPTS: packet options in `olinfo_status` (bits 13:8).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Popts: u32 {
        /// Insert the IPv4 header checksum.
        const IXSM = 1 << 8;
        /// Insert the TCP/UDP checksum.
        const TXSM = 1 << 9;
    }
}

bitflags! {
    /// TUCMD in `type_tucmd_mlhl` (bits 19:9).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Tucmd: u32 {
        /// The packet is IPv4.
        const IPV4 = 1 << 10;
        /// The L4 protocol is TCP.
        const L4T_TCP = 1 << 11;
    }
}

bitflags! {
    /// STA: status bits written back by the device.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Sta: u32 {
        /// Descriptor done.
        const DD = 1 << 0;
    }
}

impl Data {
    /// A data descriptor for `len` bytes at `addr`.
    pub fn new(addr: u64, len: u16, cmd: Dcmd, paylen: u32, popts: Popts) -> Data {
        Data {
            addr,
            cmd_type_len: u32::from(len) | DTYP_DATA | (cmd | Dcmd::DEXT).bits(),
            olinfo_status: (paylen << PAYLEN_SHIFT) | popts.bits(),
        }
    }
    /// Buffer length.
    pub fn len(&self) -> u16 {
        (self.cmd_type_len & DTALEN_MASK) as u16
    }
    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Command bits.
    pub fn cmd(&self) -> Dcmd {
        Dcmd::from_bits_truncate(self.cmd_type_len)
    }
    /// PAYLEN.
    pub fn paylen(&self) -> u32 {
        self.olinfo_status >> PAYLEN_SHIFT
    }
    /// POPTS.
    pub fn popts(&self) -> Popts {
        Popts::from_bits_truncate(self.olinfo_status)
    }
}

impl Context {
    /// A TCP/IPv4 context: header lengths and, for TSO, the MSS.
    pub fn tcp_ipv4(maclen: u8, iplen: u16, l4len: u8, mss: u16) -> Context {
        Context::ipv4(maclen, iplen, l4len, mss, true)
    }
    /// An IPv4 context for TCP (`tcp`) or UDP: header lengths and, for TSO,
    /// the MSS.
    pub fn ipv4(maclen: u8, iplen: u16, l4len: u8, mss: u16, tcp: bool) -> Context {
        Context::new(true, maclen, iplen, l4len, mss, tcp)
    }
    /// A context for IPv4 (`ipv4`) or IPv6, TCP (`tcp`) or UDP: header
    /// lengths and, for TSO, the MSS.
    pub fn new(ipv4: bool, maclen: u8, iplen: u16, l4len: u8, mss: u16, tcp: bool) -> Context {
        let l4t = if tcp { Tucmd::L4T_TCP } else { Tucmd::empty() };
        let ip = if ipv4 { Tucmd::IPV4 } else { Tucmd::empty() };
        Context {
            vlan_macip_lens: (u32::from(maclen) << MACLEN_SHIFT) | (u32::from(iplen) & IPLEN_MASK),
            seqnum_seed: 0,
            type_tucmd_mlhl: (ip | l4t).bits() | DTYP_CTXT | Dcmd::DEXT.bits(),
            mss_l4len_idx: (u32::from(mss) << MSS_SHIFT) | (u32::from(l4len) << L4LEN_SHIFT),
        }
    }
    /// Whether the packet is IPv4 (else IPv6).
    pub fn is_ipv4(&self) -> bool {
        Tucmd::from_bits_truncate(self.type_tucmd_mlhl).contains(Tucmd::IPV4)
    }
    /// Whether the L4 protocol is TCP (else UDP).
    pub fn is_tcp(&self) -> bool {
        Tucmd::from_bits_truncate(self.type_tucmd_mlhl).contains(Tucmd::L4T_TCP)
    }
    /// MACLEN.
    pub fn maclen(&self) -> usize {
        (self.vlan_macip_lens >> MACLEN_SHIFT & 0x7f) as usize
    }
    /// IPLEN.
    pub fn iplen(&self) -> usize {
        (self.vlan_macip_lens & IPLEN_MASK) as usize
    }
    /// L4LEN.
    pub fn l4len(&self) -> usize {
        (self.mss_l4len_idx >> L4LEN_SHIFT & 0xff) as usize
    }
    /// MSS.
    pub fn mss(&self) -> usize {
        (self.mss_l4len_idx >> MSS_SHIFT) as usize
    }
}

/// A descriptor as the device sees it in the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Desc {
    /// A data descriptor.
    Data(Data),
    /// A context descriptor.
    Context(Context),
    /// Anything else (legacy format, reserved DTYP).
    Other([u64; 2]),
}

impl Desc {
    /// Decodes the two little-endian quadwords of a ring entry.
    pub fn decode(w: [u64; 2]) -> Desc {
        let dw2 = w[1] as u32;
        let dw3 = (w[1] >> 32) as u32;
        if dw2 & Dcmd::DEXT.bits() == 0 {
            return Desc::Other(w);
        }
        match dw2 & DTYP_MASK {
            DTYP_DATA => Desc::Data(Data {
                addr: w[0],
                cmd_type_len: dw2,
                olinfo_status: dw3,
            }),
            DTYP_CTXT => Desc::Context(Context {
                vlan_macip_lens: w[0] as u32,
                seqnum_seed: (w[0] >> 32) as u32,
                type_tucmd_mlhl: dw2,
                mss_l4len_idx: dw3,
            }),
            _ => Desc::Other(w),
        }
    }
    /// The two quadwords to store in the ring.
    pub fn encode(&self) -> [u64; 2] {
        match *self {
            Desc::Data(d) => [
                d.addr,
                u64::from(d.cmd_type_len) | u64::from(d.olinfo_status) << 32,
            ],
            Desc::Context(c) => [
                u64::from(c.vlan_macip_lens) | u64::from(c.seqnum_seed) << 32,
                u64::from(c.type_tucmd_mlhl) | u64::from(c.mss_l4len_idx) << 32,
            ],
            Desc::Other(w) => w,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_descriptor_round_trips() {
        let d = Data::new(
            0x1234_5000,
            1448,
            Dcmd::EOP | Dcmd::RS | Dcmd::IFCS,
            65160,
            Popts::TXSM,
        );
        assert_eq!(d.len(), 1448);
        assert_eq!(d.paylen(), 65160);
        assert!(d.cmd().contains(Dcmd::EOP | Dcmd::RS | Dcmd::DEXT));
        assert_eq!(Desc::decode(Desc::Data(d).encode()), Desc::Data(d));
        // Status (DD) starts clear.
        assert_eq!(d.olinfo_status & Sta::DD.bits(), 0);
    }

    #[test]
    fn context_descriptor_round_trips() {
        let c = Context::tcp_ipv4(14, 20, 20, 1448);
        assert_eq!(
            (c.maclen(), c.iplen(), c.l4len(), c.mss()),
            (14, 20, 20, 1448)
        );
        assert_eq!(Desc::decode(Desc::Context(c).encode()), Desc::Context(c));
    }

    #[test]
    fn legacy_descriptor_is_other() {
        assert!(matches!(Desc::decode([0, 0]), Desc::Other(_)));
    }
}
