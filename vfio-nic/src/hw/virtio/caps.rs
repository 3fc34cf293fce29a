//! Where a virtio PCI device keeps its structures: the vendor-specific
//! capabilities of its configuration space (virtio 1.x, section 4.1.4),
//! each naming a BAR, an offset and a length. Parsed from the bytes of
//! configuration space, so the walk is tested without a device.
//!
//! `virtio-bindings` carries no PCI transport bindings, so the layout
//! below follows the spec's `struct virtio_pci_cap` and
//! `struct virtio_pci_notify_cap`.

use crate::error::{Error, Result};

/// PCI status register, and its capability-list bit.
const PCI_STATUS: usize = 0x06;
const PCI_STATUS_CAP_LIST: u16 = 1 << 4;
/// The first capability's offset.
const PCI_CAPABILITY_LIST: usize = 0x34;
/// A vendor-specific capability.
const PCI_CAP_ID_VNDR: u8 = 0x09;

/// `cfg_type` of the common configuration.
pub const COMMON_CFG: u8 = 1;
/// `cfg_type` of the notification area.
pub const NOTIFY_CFG: u8 = 2;
/// `cfg_type` of the ISR status byte.
pub const ISR_CFG: u8 = 3;
/// `cfg_type` of the device-specific configuration.
pub const DEVICE_CFG: u8 = 4;

/// Offsets in `struct virtio_pci_cap`.
const CAP_LEN: usize = 2;
const CAP_TYPE: usize = 3;
const CAP_BAR: usize = 4;
const CAP_OFFSET: usize = 8;
const CAP_LENGTH: usize = 12;
/// `notify_off_multiplier`, after `struct virtio_pci_cap` in the notify
/// capability.
const CAP_NOTIFY_MULT: usize = 16;

/// One structure: `length` bytes at `offset` of BAR `bar`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The BAR.
    pub bar: u8,
    /// Offset in the BAR.
    pub offset: u32,
    /// Bytes.
    pub length: u32,
}

/// The structures a driver needs, as the device's capabilities place them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Common configuration.
    pub common: Region,
    /// Notification area.
    pub notify: Region,
    /// Bytes between two queues' notification addresses, per
    /// `queue_notify_off`.
    pub notify_mult: u32,
    /// ISR status, if the device has one.
    pub isr: Option<Region>,
    /// Device-specific configuration, if any.
    pub device: Option<Region>,
}

fn u16_at(cfg: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(cfg.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(cfg: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(cfg.get(at..at + 4)?.try_into().ok()?))
}

/// Walks the capability list of configuration space `cfg` (256 bytes or
/// more) and keeps the first structure of each type, as the spec asks a
/// driver to. A list that loops, or a capability that runs out of `cfg`,
/// ends the walk; a device without common configuration or notification
/// area is [`Error::VirtioCap`].
pub fn parse(cfg: &[u8]) -> Result<Caps> {
    let missing = |what| Error::VirtioCap { what };
    if u16_at(cfg, PCI_STATUS).unwrap_or(0) & PCI_STATUS_CAP_LIST == 0 {
        return Err(missing("a PCI capability list"));
    }
    let (mut common, mut notify, mut isr, mut device) = (None, None, None, None);
    let mut mult = None;
    let mut at = usize::from(*cfg.get(PCI_CAPABILITY_LIST).unwrap_or(&0)) & !3;
    // At most one visit per 4-byte slot of the standard space: a list that
    // loops ends here.
    for _ in 0..64 {
        if at < 0x40 || at + CAP_LENGTH + 4 > cfg.len() {
            break;
        }
        let (id, next) = (cfg[at], cfg[at + 1]);
        let len = usize::from(cfg[at + CAP_LEN]);
        // A structure in a reserved BAR (above 5) is one to skip.
        if id == PCI_CAP_ID_VNDR && len >= CAP_LENGTH + 4 && cfg[at + CAP_BAR] <= 5 {
            let r = Region {
                bar: cfg[at + CAP_BAR],
                offset: u32_at(cfg, at + CAP_OFFSET).unwrap_or(0),
                length: u32_at(cfg, at + CAP_LENGTH).unwrap_or(0),
            };
            let slot = match cfg[at + CAP_TYPE] {
                COMMON_CFG => Some(&mut common),
                // Its multiplier must be there too.
                NOTIFY_CFG if notify.is_none() && len >= CAP_NOTIFY_MULT + 4 => {
                    mult = u32_at(cfg, at + CAP_NOTIFY_MULT);
                    mult.map(|_| &mut notify)
                }
                ISR_CFG => Some(&mut isr),
                DEVICE_CFG => Some(&mut device),
                _ => None,
            };
            if let Some(s) = slot.filter(|s| s.is_none()) {
                *s = Some(r);
            }
        }
        at = usize::from(next) & !3;
    }
    Ok(Caps {
        common: common.ok_or(missing("a common configuration capability"))?,
        notify: notify.ok_or(missing("a notification capability"))?,
        notify_mult: mult.unwrap_or(0),
        isr,
        device,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Configuration space with vendor capabilities `(at, type, bar,
    /// offset, length)` chained in order.
    fn space(caps: &[(usize, u8, u8, u32, u32)]) -> Vec<u8> {
        let mut c = vec![0u8; 256];
        c[PCI_STATUS] = PCI_STATUS_CAP_LIST as u8;
        c[PCI_CAPABILITY_LIST] = caps.first().map_or(0, |x| x.0 as u8);
        for (i, &(at, ty, bar, off, len)) in caps.iter().enumerate() {
            c[at] = PCI_CAP_ID_VNDR;
            c[at + 1] = caps.get(i + 1).map_or(0, |x| x.0 as u8);
            c[at + CAP_LEN] = if ty == NOTIFY_CFG { 20 } else { 16 };
            c[at + CAP_TYPE] = ty;
            c[at + CAP_BAR] = bar;
            c[at + 8..at + 12].copy_from_slice(&off.to_le_bytes());
            c[at + 12..at + 16].copy_from_slice(&len.to_le_bytes());
            if ty == NOTIFY_CFG {
                c[at + 16..at + 20].copy_from_slice(&4u32.to_le_bytes());
            }
        }
        c
    }

    #[test]
    fn finds_each_structure_as_qemu_places_them() {
        let c = space(&[
            (0x84, COMMON_CFG, 4, 0, 0x1000),
            (0x70, ISR_CFG, 4, 0x1000, 0x1000),
            (0x60, DEVICE_CFG, 4, 0x2000, 0x1000),
            (0x40, NOTIFY_CFG, 4, 0x3000, 0x1000),
        ]);
        let caps = parse(&c).unwrap();
        assert_eq!(
            caps.common,
            Region {
                bar: 4,
                offset: 0,
                length: 0x1000
            }
        );
        assert_eq!(caps.notify.offset, 0x3000);
        assert_eq!(caps.notify_mult, 4);
        assert_eq!(caps.isr.unwrap().offset, 0x1000);
        assert_eq!(caps.device.unwrap().offset, 0x2000);
    }

    #[test]
    fn the_first_of_a_type_wins_and_a_loop_ends_the_walk() {
        let mut c = space(&[
            (0x40, COMMON_CFG, 2, 0x100, 0x38),
            (0x50, COMMON_CFG, 4, 0, 0x38),
            (0x60, NOTIFY_CFG, 4, 0x3000, 0x1000),
        ]);
        c[0x61] = 0x40; // back to the first: a loop
        let caps = parse(&c).unwrap();
        assert_eq!(caps.common.bar, 2);
    }

    #[test]
    fn a_notify_capability_cut_short_or_in_a_reserved_bar_is_skipped() {
        let mut c = space(&[
            (0x40, COMMON_CFG, 4, 0, 0x38),
            (0x50, NOTIFY_CFG, 6, 0x3000, 0x1000),
            (0xec, NOTIFY_CFG, 4, 0x3000, 0x1000),
        ]);
        c.truncate(0x100 - 4); // the second notify's multiplier runs past the end
        let e = parse(&c).unwrap_err();
        assert!(e.to_string().contains("notification"), "{e}");
    }

    #[test]
    fn a_device_without_the_structures_is_refused() {
        let c = space(&[(0x40, ISR_CFG, 4, 0, 4)]);
        let e = parse(&c).unwrap_err();
        assert!(e.to_string().contains("common configuration"), "{e}");
        let mut bare = vec![0u8; 256];
        assert!(parse(&bare).is_err());
        bare[PCI_STATUS] = PCI_STATUS_CAP_LIST as u8;
        bare[PCI_CAPABILITY_LIST] = 0xfc; // runs past the end
        assert!(parse(&bare).is_err());
        assert!(parse(&[]).is_err());
    }
}
