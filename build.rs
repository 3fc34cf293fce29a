//! Builds the DPDK side of the peers comparison (`src/peers/dpdk.c`) when
//! `pkg-config` finds `libdpdk`, and sets `cfg(pfrag_dpdk)`; without DPDK
//! the lab builds as before and the peers example prints DPDK's rows as
//! skipped.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pfrag_dpdk)");
    println!("cargo::rerun-if-changed=src/peers/dpdk.c");
    println!("cargo::rerun-if-env-changed=PFRAG_NO_DPDK");
    if std::env::var_os("PFRAG_NO_DPDK").is_some() {
        return;
    }
    let Ok(dpdk) = pkg_config::Config::new()
        .atleast_version("22.11")
        .probe("libdpdk")
    else {
        println!("cargo::warning=libdpdk not found: the peers example will skip DPDK");
        return;
    };
    let mut build = cc::Build::new();
    build.file("src/peers/dpdk.c").opt_level(3).warnings(false);
    for dir in &dpdk.include_paths {
        build.include(dir);
    }
    // The rest of DPDK's cflags: its configuration header (`-include
    // rte_config.h`) and the target it was built for (`-march=...`).
    let cflags = std::process::Command::new("pkg-config")
        .args(["--cflags-only-other", "libdpdk"])
        .output()
        .expect("pkg-config ran for the probe");
    for flag in String::from_utf8_lossy(&cflags.stdout).split_whitespace() {
        build.flag(flag);
    }
    build.compile("pfrag_peers_dpdk");
    println!("cargo::rustc-cfg=pfrag_dpdk");
}
