//! The PCI command register: what to write to turn on memory decoding and
//! bus mastering, and the check that they took. VFIO's config-space
//! accesses (in [`vfio`](super::vfio)) report no failure of their own, so
//! the values read are checked instead.

use crate::error::{Error, Result};

/// The command register's offset in config space.
pub(super) const COMMAND: u64 = 0x04;
/// Memory space decoding.
const MEMORY: u16 = 1 << 1;
/// Bus mastering (the device's DMA).
const MASTER: u16 = 1 << 2;
/// What a read of config space that failed leaves in a buffer filled
/// with ones beforehand: a command register never reads so (its bits 11
/// to 15 are reserved, zero).
pub(super) const UNREAD: u16 = 0xffff;

/// The value to write for memory decoding and bus mastering, the other
/// bits as `read` (the register as read, [`UNREAD`] if the read failed).
pub(super) fn enabling(bdf: &str, read: u16) -> Result<u16> {
    if read == UNREAD {
        return Err(not_enabled(bdf, "the read of PCI_COMMAND failed".into()));
    }
    Ok(read | MEMORY | MASTER)
}

/// Checks that `now`, the register read back after writing `wrote`, has
/// memory decoding and bus mastering on.
pub(super) fn check_enabled(bdf: &str, wrote: u16, now: u16) -> Result<()> {
    if now == UNREAD || now & (MEMORY | MASTER) != MEMORY | MASTER {
        return Err(not_enabled(
            bdf,
            format!("PCI_COMMAND reads {now:#06x} after writing {wrote:#06x}"),
        ));
    }
    Ok(())
}

fn not_enabled(bdf: &str, detail: String) -> Error {
    Error::VfioOpen {
        what: format!("bus mastering of {bdf} (the PCI command register)"),
        errno: None,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_other_bits_are_kept_and_a_failed_read_writes_nothing() {
        // INTx disabled (bit 10) and SERR (bit 8) stay as they were.
        assert_eq!(enabling("b", 0x0500).unwrap(), 0x0506);
        let e = enabling("0000:00:02.0", UNREAD).unwrap_err();
        assert!(e.to_string().contains("0000:00:02.0"), "{e}");
        assert!(e.to_string().contains("read of PCI_COMMAND failed"), "{e}");
    }

    #[test]
    fn bits_that_did_not_take_are_an_error_with_both_values() {
        check_enabled("b", 0x0506, 0x0506).unwrap();
        for now in [0x0502, 0x0504, 0x0000, UNREAD] {
            let e = check_enabled("b", 0x0506, now).unwrap_err();
            let s = e.to_string();
            assert!(
                s.contains(&format!("{now:#06x}")) && s.contains("0x0506"),
                "{s}"
            );
        }
    }
}
