//! Register offsets of the 82576 (datasheet section 8): only the registers
//! this driver uses, named as in the datasheet.

use crate::hw::mmio::Reg;

/// Device Control.
pub const CTRL: Reg = Reg(0x0_0000);
/// Device Status.
pub const STATUS: Reg = Reg(0x0_0008);
/// MDI Control: PHY register access.
pub const MDIC: Reg = Reg(0x0_0020);
/// Interrupt Cause Read.
pub const ICR: Reg = Reg(0x0_00C0);
/// Interrupt Mask Set/Read: reads the mask, a write sets bits of it.
pub const IMS: Reg = Reg(0x0_00D0);
/// Interrupt Mask Clear.
pub const IMC: Reg = Reg(0x0_00D8);
/// Extended Interrupt Mask Set/Read: reads the mask, a write sets bits
/// of it.
pub const EIMS: Reg = Reg(0x0_1524);
/// Extended Interrupt Mask Clear.
pub const EIMC: Reg = Reg(0x0_1528);
/// Receive Control.
pub const RCTL: Reg = Reg(0x0_0100);
/// Transmit Control.
pub const TCTL: Reg = Reg(0x0_0400);
/// Receive Address Low, entry 0.
pub const RAL0: Reg = ral(0);
/// Receive Address High, entry 0.
pub const RAH0: Reg = Reg(0x0_5404);

/// Receive Address Low, entry `n` (0..16).
pub const fn ral(n: u32) -> Reg {
    Reg(0x0_5400 + 8 * n)
}
/// Good Packets Transmitted Count (clear on read).
pub const GPTC: Reg = Reg(0x0_4080);
/// Good Octets Transmitted Count, low (clear on read of the high half).
pub const GOTCL: Reg = Reg(0x0_4090);
/// Good Octets Transmitted Count, high.
pub const GOTCH: Reg = Reg(0x0_4094);
/// Total Packets Transmitted (clear on read).
pub const TPT: Reg = Reg(0x0_40D4);

const TX_BASE: u32 = 0x0_E000;
const TX_STRIDE: u32 = 0x40;
const RX_BASE: u32 = 0x0_C000;
const RX_STRIDE: u32 = 0x40;

/// Receive Descriptor Base Address Low, queue `n`.
pub const fn rdbal(n: u32) -> Reg {
    Reg(RX_BASE + RX_STRIDE * n)
}
/// Receive Descriptor Base Address High, queue `n`.
pub const fn rdbah(n: u32) -> Reg {
    Reg(RX_BASE + 0x04 + RX_STRIDE * n)
}
/// Receive Descriptor Ring Length (bytes), queue `n`.
pub const fn rdlen(n: u32) -> Reg {
    Reg(RX_BASE + 0x08 + RX_STRIDE * n)
}
/// Split and Replication Receive Control, queue `n`.
pub const fn srrctl(n: u32) -> Reg {
    Reg(RX_BASE + 0x0C + RX_STRIDE * n)
}
/// Receive Descriptor Head, queue `n`.
pub const fn rdh(n: u32) -> Reg {
    Reg(RX_BASE + 0x10 + RX_STRIDE * n)
}
/// Receive Descriptor Tail, queue `n`.
pub const fn rdt(n: u32) -> Reg {
    Reg(RX_BASE + 0x18 + RX_STRIDE * n)
}
/// Receive Descriptor Control, queue `n`.
pub const fn rxdctl(n: u32) -> Reg {
    Reg(RX_BASE + 0x28 + RX_STRIDE * n)
}

/// Transmit Descriptor Base Address Low, queue `n`.
pub const fn tdbal(n: u32) -> Reg {
    Reg(TX_BASE + TX_STRIDE * n)
}
/// Transmit Descriptor Base Address High, queue `n`.
pub const fn tdbah(n: u32) -> Reg {
    Reg(TX_BASE + 0x04 + TX_STRIDE * n)
}
/// Transmit Descriptor Ring Length (bytes), queue `n`.
pub const fn tdlen(n: u32) -> Reg {
    Reg(TX_BASE + 0x08 + TX_STRIDE * n)
}
/// Transmit Descriptor Head, queue `n`.
pub const fn tdh(n: u32) -> Reg {
    Reg(TX_BASE + 0x10 + TX_STRIDE * n)
}
/// Transmit Descriptor Tail, queue `n`.
pub const fn tdt(n: u32) -> Reg {
    Reg(TX_BASE + 0x18 + TX_STRIDE * n)
}
/// Transmit Descriptor Control, queue `n`.
pub const fn txdctl(n: u32) -> Reg {
    Reg(TX_BASE + 0x28 + TX_STRIDE * n)
}
