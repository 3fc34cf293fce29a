//! Writes the fuzz targets' seed inputs (`pfrag_lab::harness::seeds`) into
//! `DIR/<target>/seed-N`, for `cargo fuzz run <target> DIR/<target>`.
//!
//! ```text
//! cargo run --example fuzz_seeds -- fuzz/corpus
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: fuzz_seeds DIR");
        return ExitCode::from(2);
    };
    for target in ["softnic", "virtio", "wire", "iommu_info"] {
        let d = dir.join(target);
        if let Err(e) = std::fs::create_dir_all(&d) {
            eprintln!("error: {}: {e}", d.display());
            return ExitCode::FAILURE;
        }
        for (i, s) in pfrag_lab::harness::seeds(target).iter().enumerate() {
            let p = d.join(format!("seed-{i}"));
            if let Err(e) = std::fs::write(&p, s) {
                eprintln!("error: {}: {e}", p.display());
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
