//! The sweep's own tests: its command line and its jobs.

use super::*;

/// `check_args` of the command line `args`, or clap's refusal.
fn checked(args: &[&str]) -> Result<(), String> {
    let a = Args::try_parse_from(std::iter::once("sweep").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    check_args(&a)
}

#[test]
fn a_threshold_without_hysteresis_is_refused_not_ignored() {
    let e = checked(&["--threshold-mib", "5"]).unwrap_err();
    assert!(
        e.contains("--threshold-mib 5") && e.contains("--reclaim hysteresis"),
        "{e}"
    );
    checked(&["--threshold-mib", "5", "--reclaim", "hysteresis"]).unwrap();
    checked(&["--reclaim", "hysteresis"]).unwrap();
    checked(&[]).unwrap();
}

/// The software NIC has no PCI address: a `--device` given with it is
/// refused, not ignored; with `--backend vfio` or `iommufd` it is the
/// NIC's address, 0000:00:02.0 when not given.
#[test]
fn a_device_on_the_software_nic_is_refused_not_ignored() {
    let e = checked(&["--backend", "soft", "--device", "0000:00:03.0"]).unwrap_err();
    assert!(
        e.contains("--device 0000:00:03.0 is the PCI address"),
        "{e}"
    );
    checked(&["--device", "0000:00:03.0"]).unwrap_err();
    for backend in ["vfio", "iommufd"] {
        checked(&["--backend", backend, "--device", "0000:00:03.0"]).unwrap();
        let a = Args::try_parse_from(["sweep", "--backend", backend]).unwrap();
        assert_eq!((check_args(&a), a.device()), (Ok(()), "0000:00:02.0"));
    }
}
