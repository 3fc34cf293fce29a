//! Writes the fuzz targets' seed inputs (`pfrag_lab::harness::seeds`) into
//! `DIR/<target>/seed-N`, for `cargo fuzz run <target> DIR/<target>`.
//!
//! ```text
//! cargo run --example fuzz_seeds -- fuzz/corpus
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Writes the seed inputs of the fuzz targets (softnic, virtio, wire,
/// iommu_info) into DIR/<target>/seed-N.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The corpus directory (created if missing).
    dir: PathBuf,
}

fn main() -> ExitCode {
    let a = Args::parse();
    for target in ["softnic", "virtio", "wire", "iommu_info"] {
        let d = a.dir.join(target);
        if let Err(e) = std::fs::create_dir_all(&d) {
            eprintln!("error: {}: {e}", d.display());
            return ExitCode::FAILURE;
        }
        let seeds = pfrag_lab::harness::seeds(target);
        for (i, s) in seeds.iter().enumerate() {
            let p = d.join(format!("seed-{i}"));
            if let Err(e) = std::fs::write(&p, s) {
                eprintln!("error: {}: {e}", p.display());
                return ExitCode::FAILURE;
            }
        }
        println!("{}: {} seeds", d.display(), seeds.len());
    }
    ExitCode::SUCCESS
}
