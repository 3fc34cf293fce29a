//! Where a PCI device is in sysfs: its directory, checked to be a PCI
//! address; its IOMMU group; and whether VFIO holds that group.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The sysfs directory of the PCI device at `bdf`, which must be a PCI
/// address as sysfs names it, `DDDD:BB:DD.F` in lower-case hex (a domain
/// of 4 to 8 digits: Linux prints it with `%04x`, and a domain past 16
/// bits, as Intel VMD's from `10000` on, has more; device up to `1f`,
/// function up to 7); anything else is [`Error::BadBdf`]: a path
/// joined as it is would lead out of `/sys/bus/pci/devices`, to another
/// device opened under the name given, or to a file elsewhere.
pub(super) fn sysfs_dir(bdf: &str) -> Result<PathBuf> {
    // The value of lower-case hex digits, if `s` is all such digits.
    let hex = |s: &[u8]| {
        s.iter().try_fold(0u32, |v, &d| {
            let d = (d as char)
                .to_digit(16)
                .filter(|_| !d.is_ascii_uppercase())?;
            Some(v * 16 + d)
        })
    };
    // The domain's digits: all but the 8 bytes of `:BB:DD.F`.
    let d = bdf.len().wrapping_sub(8);
    let b = bdf.as_bytes();
    let ok = (4..=8).contains(&d)
        && (b[d], b[d + 3], b[d + 6]) == (b':', b':', b'.')
        && hex(&b[..d]).is_some()
        && hex(&b[d + 1..d + 3]).is_some()
        && hex(&b[d + 4..d + 6]).is_some_and(|dev| dev <= 0x1f)
        && hex(&b[d + 7..]).is_some_and(|func| func <= 7);
    if !ok {
        return Err(Error::BadBdf { bdf: bdf.into() });
    }
    Ok(PathBuf::from("/sys/bus/pci/devices").join(bdf))
}

/// The sysfs directory and IOMMU group of `bdf`, checking that it is
/// bound to vfio-pci (its group's node exists).
pub(super) fn bound(bdf: &str) -> Result<(PathBuf, u32)> {
    let sys = sysfs_dir(bdf)?;
    if !sys.exists() {
        return Err(Error::DeviceMissing { bdf: bdf.into() });
    }
    let group = iommu_group(&sys, bdf)?;
    if !PathBuf::from(format!("/dev/vfio/{group}")).exists() {
        let driver = std::fs::read_link(sys.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "none".into());
        return Err(Error::GroupMissing {
            bdf: bdf.into(),
            group,
            driver,
        });
    }
    Ok((sys, group))
}

/// The IOMMU group of the device whose sysfs directory is `sys`.
pub(super) fn iommu_group(sys: &Path, bdf: &str) -> Result<u32> {
    let link = std::fs::read_link(sys.join("iommu_group"))
        .map_err(|_| Error::NoIommuGroup { bdf: bdf.into() })?;
    link.file_name()
        .and_then(|s| s.to_str())
        .and_then(|s| s.parse().ok())
        .ok_or(Error::NoIommuGroup { bdf: bdf.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a PCI address as sysfs names it leads into
    /// `/sys/bus/pci/devices`: a path (absolute, or climbing out with
    /// `..`) used to be joined as it was, and opened another device, or
    /// a file elsewhere, under the name given.
    #[test]
    fn a_bdf_that_is_not_a_pci_address_is_refused() {
        let dir = sysfs_dir("0000:00:02.0").unwrap();
        assert_eq!(dir, Path::new("/sys/bus/pci/devices/0000:00:02.0"));
        assert!(sysfs_dir("10de:ff:1f.7").is_ok());
        // A domain past 16 bits (Intel VMD's start at 10000) has more
        // digits: Linux prints it with %04x, at least four.
        let vmd = sysfs_dir("10000:e0:06.0").unwrap();
        assert_eq!(vmd, Path::new("/sys/bus/pci/devices/10000:e0:06.0"));
        assert!(sysfs_dir("ffffffff:00:00.0").is_ok());
        for bad in [
            "/dev/vfio/5",
            "../../../../etc",
            "0000:00:02.0/../0000:00:03.0",
            "0000:00:02.0/",
            "..",
            "",
            "00:02.0",
            "0000:00:20.0",
            "0000:00:02.8",
            "0000:00:0A.0",
            "0000:00:02.0 ",
            "+000:00:02.0",
            "0000:000:02.0",
            "100000000:00:02.0",
            "000:00:02.0",
            "10000:0:02.0",
            "00\u{e9}:00:02.0",
        ] {
            match sysfs_dir(bad) {
                Err(Error::BadBdf { bdf }) => assert_eq!(bdf, bad),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
}
