//! PCI configuration space: reads and writes of a VFIO device file's
//! config region that report what failed (`vfio-ioctls`' own only log
//! it), and the command register: what to write to turn on memory
//! decoding and bus mastering, and the check that they took.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;

use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vfio_ioctls::VfioDevice;

use crate::error::{Error, Result};

/// A VFIO device file's config region: where it starts in the file, and
/// its size.
#[derive(Clone, Copy, Debug)]
pub(super) struct ConfigRegion {
    /// Its offset in the device file.
    pub offset: u64,
    /// Its size in bytes.
    pub size: u64,
}

impl ConfigRegion {
    /// `device`'s file (a duplicate of its descriptor) and config region.
    pub(super) fn of(device: &VfioDevice) -> Result<(File, ConfigRegion)> {
        let fd = device.as_raw_fd();
        // SAFETY: the descriptor is `device`'s, open while it lives, and
        // the borrow ends before this function returns (the file is a
        // duplicate of it).
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let file = fd
            .try_clone_to_owned()
            .map_err(|e| config_error("dup", 0, 0, e))?;
        let region = ConfigRegion {
            offset: device.get_region_offset(VFIO_PCI_CONFIG_REGION_INDEX),
            size: device.get_region_size(VFIO_PCI_CONFIG_REGION_INDEX),
        };
        Ok((file.into(), region))
    }

    /// Reads `buf.len()` bytes at `at` of the region: all of them, or an
    /// error naming the access.
    pub(super) fn read(self, file: &File, at: u64, buf: &mut [u8]) -> Result<()> {
        let pos = self.place(at, buf.len())?;
        file.read_exact_at(buf, pos)
            .map_err(|source| config_error("read", at, buf.len(), source))
    }

    /// Writes `buf` at `at` of the region: all of it, or an error naming
    /// the access.
    pub(super) fn write(self, file: &File, at: u64, buf: &[u8]) -> Result<()> {
        let pos = self.place(at, buf.len())?;
        file.write_all_at(buf, pos)
            .map_err(|source| config_error("write", at, buf.len(), source))
    }

    /// Where `len` bytes at `at` of the region lie in the file, if the
    /// region holds them.
    fn place(self, at: u64, len: usize) -> Result<u64> {
        let fits = at
            .checked_add(len as u64)
            .is_some_and(|end| end <= self.size);
        match self.offset.checked_add(at) {
            Some(pos) if fits => Ok(pos),
            _ => Err(Error::OutOfRange {
                what: "PCI config space offset",
                value: at,
                min: 0,
                max: self.size.saturating_sub(len as u64),
            }),
        }
    }
}

/// A config-space access of `len` bytes at `at` that failed.
pub(super) fn config_error(op: &'static str, at: u64, len: usize, source: std::io::Error) -> Error {
    Error::ConfigSpace {
        op,
        offset: at,
        len,
        source,
    }
}

/// The command register's offset in config space.
pub(super) const COMMAND: u64 = 0x04;
/// Memory space decoding.
const MEMORY: u16 = 1 << 1;
/// Bus mastering (the device's DMA).
const MASTER: u16 = 1 << 2;
/// What a device that no longer answers returns for every config read:
/// a command register never reads so (its bits 11 to 15 are reserved,
/// zero).
pub(super) const UNREAD: u16 = 0xffff;

/// The value to write for memory decoding and bus mastering, the other
/// bits as `read` (the register as read).
pub(super) fn enabling(bdf: &str, read: u16) -> Result<u16> {
    if read == UNREAD {
        return Err(not_enabled(
            bdf,
            "PCI_COMMAND reads 0xffff: the device does not answer".into(),
        ));
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
        assert!(e.to_string().contains("does not answer"), "{e}");
    }

    /// A file standing in for a device file, whose config region is the
    /// 16 bytes at 8.
    fn device_file(name: &str) -> (File, ConfigRegion, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("vfio-nic-{name}-{}", std::process::id()));
        std::fs::write(&path, (0u8..32).collect::<Vec<u8>>()).unwrap();
        let file = File::options().read(true).write(true).open(&path).unwrap();
        (
            file,
            ConfigRegion {
                offset: 8,
                size: 16,
            },
            path,
        )
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads and writes a file at offsets (pread, pwrite)")]
    fn config_accesses_inside_the_region_reach_the_file_at_its_offset() {
        let (file, r, path) = device_file("cfg-ok");
        let mut b = [0u8; 4];
        r.read(&file, 4, &mut b).unwrap();
        assert_eq!(b, [12, 13, 14, 15]);
        r.write(&file, 12, &[0xaa; 4]).unwrap();
        r.read(&file, 12, &mut b).unwrap();
        assert_eq!(b, [0xaa; 4]);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads and writes a file at offsets (pread, pwrite)")]
    fn config_accesses_outside_the_region_or_short_are_errors() {
        let (file, r, path) = device_file("cfg-bad");
        let mut b = [0x55u8; 4];
        // Past the region's end, and past the end of the address space.
        for at in [13, u64::MAX - 1] {
            let e = r.read(&file, at, &mut b).unwrap_err();
            assert!(
                matches!(e, Error::OutOfRange { value, max: 12, .. } if value == at),
                "{e}"
            );
            assert!(r.write(&file, at, &b).is_err());
        }
        assert_eq!(b, [0x55; 4], "a refused read leaves the buffer");
        // A region the file does not hold: the read comes up short.
        let past = ConfigRegion {
            offset: 30,
            size: 16,
        };
        let e = past.read(&file, 0, &mut b).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::ConfigSpace {
                    op: "read",
                    offset: 0,
                    len: 4,
                    ..
                }
            ),
            "{e}"
        );
        std::fs::remove_file(path).unwrap();
    }

    /// A config access that failed says its errno through
    /// [`Error::errno`], as its message does.
    #[test]
    fn a_failed_config_access_gives_its_errno() {
        let e = config_error("write", 4, 2, std::io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(e.errno(), Some(libc::EIO), "{e}");
        let short = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        assert_eq!(config_error("read", 0, 4, short).errno(), None);
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
