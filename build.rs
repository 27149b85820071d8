//! Build script: compiles the CUDA kernels (`cuda/*.cu`) to a fat binary, only when the `cuda`
//! feature is on. The default (CPU) build never needs nvcc.
//!
//! The fat binary holds machine code for `sm_XX` (so that no kernel is JIT-compiled when a
//! process first uses the op: compiling this PTX to machine code takes ptxas about 50 s on a
//! 2-core machine, which the driver's JIT would repeat in every process without a warm JIT
//! cache) and the `compute_XX` PTX (JIT-compiled on newer GPUs).
//!
//! Environment: `NVCC` (default: `nvcc` on PATH), `CUDA_COMPUTE_CAP` (default 90; `90`, `90a`
//! and `sm_90a` are accepted, the plain `XX` architecture is used), `GDP_NVCC_FLAGS` (extra
//! flags, whitespace-separated).

use std::path::PathBuf;
use std::process::Command;

/// The kernel files `cuda/<name>.cu`, each compiled to `$OUT_DIR/<name>.fatbin`.
const KERNELS: &[&str] = &["gdp"];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=GDP_NVCC_FLAGS");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Err(e) = build_fatbin() {
        // A build script reports failure by exiting non-zero; say why first.
        eprintln!("candle-gdp build.rs: {e}");
        std::process::exit(1);
    }
}

fn build_fatbin() -> Result<(), String> {
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| format!("OUT_DIR: {e}"))?);
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap_raw = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap_raw
        .trim()
        .trim_start_matches("sm_")
        .trim_start_matches("compute_")
        .chars()
        .filter(|c| c.is_ascii_digit())
        .collect();
    if cap.is_empty() {
        return Err(format!("cannot parse CUDA_COMPUTE_CAP={cap_raw:?}"));
    }
    let extra = std::env::var("GDP_NVCC_FLAGS").unwrap_or_default();
    for name in KERNELS {
        let src = format!("cuda/{name}.cu");
        let dst = out.join(format!("{name}.fatbin"));
        let output = Command::new(&nvcc)
            .arg("--fatbin")
            .arg(format!(
                "-gencode=arch=compute_{cap},code=[sm_{cap},compute_{cap}]"
            ))
            .args(["-O3", "-std=c++17", "-lineinfo", "-Icuda"])
            .args(extra.split_whitespace())
            .arg("-o")
            .arg(&dst)
            .arg(&src)
            .output()
            .map_err(|e| format!("cannot run `{nvcc}` (set NVCC or put nvcc on PATH): {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "`{nvcc}` failed on {src} ({}):\n{}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    Ok(())
}
