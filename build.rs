//! Builds the DPDK side of the peers comparison (`src/peers/dpdk.c`) when
//! `pkg-config` finds `libdpdk`, and sets `cfg(pfrag_dpdk)`; without DPDK
//! the lab builds as before and the peers example prints DPDK's rows as
//! skipped.
//!
//! The answer is not cached for good: the script runs again when the
//! pkg-config search path changes (its environment variables, or a `.pc`
//! file added to or removed from one of its directories), so installing
//! `libdpdk-dev` after a first build is noticed by the next build.

use std::path::Path;

/// The environment variables that change where pkg-config looks or what it
/// answers.
const PKG_CONFIG_ENV: [&str; 6] = [
    "PKG_CONFIG",
    "PKG_CONFIG_PATH",
    "PKG_CONFIG_LIBDIR",
    "PKG_CONFIG_SYSROOT_DIR",
    "LIBDPDK_NO_PKG_CONFIG",
    "PKG_CONFIG_ALL_STATIC",
];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pfrag_dpdk)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/peers/dpdk.c");
    println!("cargo::rerun-if-env-changed=PFRAG_NO_DPDK");
    watch_pkg_config();
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

/// Reruns this script when pkg-config's answer about `libdpdk` may have
/// changed: on its environment variables and on the directories it
/// searches (a directory's time changes when a `.pc` file is added to it or
/// removed). Only directories that exist are named: cargo would take a
/// missing one as changed on every build.
fn watch_pkg_config() {
    for var in PKG_CONFIG_ENV {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let mut dirs: Vec<String> = Vec::new();
    for var in ["PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.extend(std::env::split_paths(&v).map(|p| p.display().to_string()));
        }
    }
    // pkg-config's built-in search path (`pc_path`); without the tool, the
    // usual Debian and /usr/local places.
    let builtin = std::process::Command::new("pkg-config")
        .args(["--variable", "pc_path", "pkg-config"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| {
            "/usr/local/lib/pkgconfig:/usr/lib/x86_64-linux-gnu/pkgconfig:\
             /usr/lib/pkgconfig:/usr/share/pkgconfig"
                .to_string()
        });
    dirs.extend(builtin.split(':').map(str::to_string));
    dirs.sort();
    dirs.dedup();
    for dir in dirs {
        if !dir.is_empty() && Path::new(&dir).is_dir() {
            println!("cargo::rerun-if-changed={dir}");
        }
    }
}
