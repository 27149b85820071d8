//! Build script: compiles the CUDA kernels (`cuda/gdp.cu` and the headers it includes) into one
//! fat binary, `$OUT_DIR/gdp.fatbin`, only when the `cuda` feature is on. The default (CPU) build
//! never needs nvcc. `src/op/cuda/module.rs` embeds the file and loads it through cudarc
//! (`Ptx::from_binary`), so the driver picks the machine code of the GPU it runs on.
//!
//! # What the fat binary holds
//!
//! Machine code (SASS) for every architecture of the build, and the PTX of the highest one. By
//! default that is sm_80 (A100; its code also runs on sm_86/sm_87), sm_89 (L4, RTX 4090) and sm_90
//! (H100, H200), plus compute_90 PTX that the driver JIT-compiles on newer GPUs. Machine code
//! matters: ptxas needs about 50 s per architecture for these kernels on a 2-core machine, and the
//! driver's JIT would repeat that in every process that has no warm JIT cache. The kernels use
//! nothing newer than sm_80 (bf16/tf32 `mma.sync`, `ldmatrix`, `cp.async`), and no `a`-suffixed
//! architecture, so the compute_90 PTX still runs on later GPUs.
//!
//! # Choosing the architectures, first match wins
//!
//! 1. `GDP_CUDA_COMPUTE_CAP`: this crate's kernels only. Same syntax as below, or `default`.
//!    It exists because Candle's own build (candle-kernels, through cudaforge) reads
//!    `CUDA_COMPUTE_CAP` too, accepts one architecture only, and without it needs `nvidia-smi`.
//!    On a machine without a GPU (CI, Docker) `CUDA_COMPUTE_CAP` must therefore name one
//!    architecture, and `GDP_CUDA_COMPUTE_CAP=default` still gets this crate the full set.
//! 2. `CUDA_COMPUTE_CAP`, as in Candle: `90`, `sm_90`, `90a`, `9.0`, or a list `80,89,90`. A single
//!    `XX` builds sm_XX plus compute_XX PTX; a list builds each plus the PTX of the highest. An
//!    `a` or `f` suffix is dropped (plain sm_90 code runs on every sm_90 GPU, and its PTX on later
//!    ones). A list stops candle-kernels' build, so in practice a list goes to
//!    `GDP_CUDA_COMPUTE_CAP`.
//! 3. Neither set: the default set above. Here, unlike Candle, `nvidia-smi` does not choose the
//!    architecture (a build on an H100 would otherwise fail on an A100). It is asked only to add
//!    machine code for a GPU of this machine that no architecture of the set can run without JIT
//!    (a Blackwell sm_100 or sm_120), and its absence is no error.
//!
//! Architectures below sm_80 are refused, and every architecture is checked against
//! `nvcc --list-gpu-code` first, so an unknown one fails with the list of those nvcc knows.
//!
//! # Why a direct nvcc call, not `bindgen_cuda` (nor cudaforge)
//!
//! Checked with bindgen_cuda 0.1.6 (the latest on crates.io) and nvcc 13.0.88, on a scratch crate:
//! - `Builder::default()` reads `CUDA_COMPUTE_CAP` with `parse::<usize>()` and panics ("Could not
//!   parse code") on `80,89,90`, `90a` and `sm_90`; unset, it panics when `nvidia-smi` is missing
//!   (CI, Docker). Both happen inside `default()`, before `.compute_cap(n)` could override them.
//! - `build_ptx` runs `nvcc --gpu-architecture=sm_XX --ptx`: PTX for one architecture, no machine
//!   code. Extra `-gencode` arguments (`.arg(..)`), or `--fatbin`, make nvcc stop with "Option
//!   '--ptx (-ptx)' is not allowed when compiling for multiple GPU architectures".
//! - `build_ptx` skips nvcc when the `.ptx` is newer than the `.cu`, looking neither at the
//!   included headers nor at the compute cap: after an edit of the included `.cuh`, and after
//!   `CUDA_COMPUTE_CAP` went from 90 to 80, it kept the old PTX (`.target sm_90`). All of this
//!   crate's kernel code is in headers that `gdp.cu` includes.
//! - `build_lib` with extra `-gencode` arguments does give sm_80, sm_89 and sm_90 machine code plus
//!   PTX, but inside a host object of a static library, registered with the CUDA runtime when the
//!   program starts. The kernels would then be launched through `extern "C"` host launchers linked
//!   against libcudart instead of being looked up by name in a cudarc module: every launch in
//!   `src/op/cuda` rewritten, for the same machine code.
//! - It finds the toolkit through `CUDA_PATH` and others but not `CUDA_HOME` (set by the pinned
//!   toolchain), and runs the `nvcc` on `PATH`, ignoring `NVCC`.
//!
//! cudaforge 0.1.6, which Candle's own kernels (candle-kernels 0.11) and candle-flash-attn use
//! since Candle left bindgen_cuda, has the same shape (read, not run): one `-gencode` per kernel
//! file, `build_ptx` or `build_lib`, and `90` becomes `sm_90a`, whose PTX runs on no later GPU.
//!
//! What this script takes from them: nvcc's discovery order (`NVCC`, then `nvcc` on `PATH`, then
//! `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`), `NVCC_CCBIN`, the compute-cap parsing and its
//! check against `nvcc --list-gpu-code`, and a `rerun-if-changed` for every `.cu`/`.cuh` instead of
//! the whole folder (whose `emu/` and `bench/` do not go into the binary).
//!
//! # Parallel compilation
//!
//! One nvcc call with a `-gencode` per architecture; `--threads` lets it run the architectures'
//! pipelines in parallel, at most `NUM_JOBS` (cargo's `-j`) of them. Measured on the 2-core
//! build machine (shared, load 2 to 5), nvcc 13.0, the default three architectures: 230 s with
//! `--threads=2`, 319 s with `--threads=1`. One call also writes the container itself, where
//! one call per architecture would need a `fatbinary` step to join the outputs.
//!
//! # Environment
//!
//! - `NVCC`: the nvcc to run (else `PATH`, `CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda`).
//! - `NVCC_CCBIN`: the host compiler (`-ccbin`), as in Candle's builders.
//! - `CUDA_COMPUTE_CAP`, `GDP_CUDA_COMPUTE_CAP`: the architectures (above).
//! - `GDP_NVCC_FLAGS`: extra nvcc flags, whitespace-separated.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The kernel files `cuda/<name>.cu`, each compiled to `$OUT_DIR/<name>.fatbin`.
const KERNELS: &[&str] = &["gdp"];

/// Architectures of a build that names none: A100, L4 / RTX 4090, H100 / H200.
const DEFAULT_ARCHS: &[u32] = &[80, 89, 90];

/// The oldest architecture the kernels compile for (bf16 `mma.sync`, `cp.async`).
const MIN_ARCH: u32 = 80;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    for var in [
        "NVCC",
        "NVCC_CCBIN",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_COMPUTE_CAP",
        "GDP_CUDA_COMPUTE_CAP",
        "GDP_NVCC_FLAGS",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Err(e) = build() {
        // A build script reports failure by exiting non-zero; say why first.
        eprintln!("candle-gdp build.rs: {e}");
        std::process::exit(1);
    }
}

/// The architectures to build.
struct Archs {
    /// Machine code (`sm_XX`) for each, in increasing order.
    sass: Vec<u32>,
    /// The virtual architecture whose PTX goes in (`compute_XX`): the highest that a variable
    /// named, or of the default set.
    ptx: u32,
    /// Where the choice came from, for the build log.
    source: String,
}

fn build() -> Result<(), String> {
    let root = PathBuf::from(env("CARGO_MANIFEST_DIR")?);
    let cuda = root.join("cuda");
    watch_sources(&cuda)?;
    let out = PathBuf::from(env("OUT_DIR")?);
    let nvcc = find_nvcc();
    let known = nvcc_gpu_codes(&nvcc);
    let archs = choose_archs(&known)?;
    let extra = std::env::var("GDP_NVCC_FLAGS").unwrap_or_default();
    let ccbin = std::env::var("NVCC_CCBIN").ok();
    // nvcc compiles one architecture per thread; cargo's `-j` (NUM_JOBS) bounds them.
    let jobs = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse::<usize>().ok());
    let threads = jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, archs.sass.len());

    let mut gencode: Vec<String> = archs
        .sass
        .iter()
        .filter(|&&a| a != archs.ptx)
        .map(|a| format!("-gencode=arch=compute_{a},code=sm_{a}"))
        .collect();
    gencode.push(format!(
        "-gencode=arch=compute_{p},code=[sm_{p},compute_{p}]",
        p = archs.ptx
    ));

    // Each kernel file in its own nvcc process, all at once (there is one today).
    let start = Instant::now();
    let children = KERNELS
        .iter()
        .map(|name| {
            let src = cuda.join(format!("{name}.cu"));
            let dst = out.join(format!("{name}.fatbin"));
            let mut cmd = Command::new(&nvcc);
            cmd.arg("--fatbin")
                .args(&gencode)
                .arg(format!("--threads={threads}"))
                .args(["-O3", "-std=c++17", "-lineinfo"])
                .arg(format!("-I{}", cuda.display()));
            if let Some(ccbin) = &ccbin {
                cmd.args(["-allow-unsupported-compiler", "-ccbin", ccbin]);
            }
            cmd.args(extra.split_whitespace())
                .arg("-o")
                .arg(&dst)
                .arg(&src);
            let child = cmd
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| {
                    format!(
                        "cannot run `{}` (set NVCC or put nvcc on PATH): {e}",
                        nvcc.display()
                    )
                })?;
            Ok((format!("{cmd:?}"), child))
        })
        .collect::<Result<Vec<_>, String>>()?;
    for (cmd, child) in children {
        let output = child
            .wait_with_output()
            .map_err(|e| format!("waiting for {cmd}: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "nvcc failed ({}): {cmd}\n{}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    // A plain stdout line (not a `cargo::` directive) lands in the build script's `output` file.
    let sass: Vec<String> = archs.sass.iter().map(|a| format!("sm_{a}")).collect();
    println!(
        "candle-gdp: {} -> {}: {} + compute_{} PTX ({}), nvcc --threads={threads}, {:.0} s",
        KERNELS.join(", "),
        out.display(),
        sass.join(" "),
        archs.ptx,
        archs.source,
        start.elapsed().as_secs_f64()
    );
    // For the error message of a module that has no code for the GPU (module.rs).
    println!(
        "cargo::rustc-env=GDP_CUDA_ARCHS={} + compute_{} PTX",
        sass.join(" "),
        archs.ptx
    );
    Ok(())
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|e| format!("{name}: {e}"))
}

/// `rerun-if-changed` for every `.cu` and `.cuh` directly in `cuda/` (what `gdp.cu` includes).
fn watch_sources(cuda: &Path) -> Result<(), String> {
    let entries =
        std::fs::read_dir(cuda).map_err(|e| format!("cannot list {}: {e}", cuda.display()))?;
    for entry in entries {
        let path = entry
            .map_err(|e| format!("{}: {e}", cuda.display()))?
            .path();
        if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("cu" | "cuh")
        ) {
            println!("cargo::rerun-if-changed={}", path.display());
        }
    }
    Ok(())
}

/// nvcc: `NVCC`, else `nvcc` on `PATH`, else the toolkit under `CUDA_HOME`, `CUDA_PATH` or
/// `/usr/local/cuda` (cudaforge's order); plain `nvcc` when none exists, so the error names it.
fn find_nvcc() -> PathBuf {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return nvcc.into();
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("nvcc"))
        .find(|p| p.is_file());
    let toolkits = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")])
        .map(|root| root.join("bin").join("nvcc"));
    on_path
        .into_iter()
        .chain(toolkits)
        .find(|p| p.is_file())
        .unwrap_or_else(|| "nvcc".into())
}

/// The `sm_XX` codes nvcc can emit (`nvcc --list-gpu-code`); empty if it cannot say.
fn nvcc_gpu_codes(nvcc: &Path) -> Vec<u32> {
    let Ok(out) = Command::new(nvcc).arg("--list-gpu-code").output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("sm_")?.parse().ok())
        .collect()
}

/// The architectures of this build (see the module doc for the order of the variables).
fn choose_archs(known: &[u32]) -> Result<Archs, String> {
    let (var, value) = match (
        std::env::var("GDP_CUDA_COMPUTE_CAP"),
        std::env::var("CUDA_COMPUTE_CAP"),
    ) {
        (Ok(v), _) => ("GDP_CUDA_COMPUTE_CAP", v),
        (_, Ok(v)) => ("CUDA_COMPUTE_CAP", v),
        _ => ("", String::new()),
    };
    let named = !var.is_empty() && !value.trim().eq_ignore_ascii_case("default");
    let mut sass = if named {
        parse_caps(&value).map_err(|e| format!("{var}={value:?}: {e}"))?
    } else {
        DEFAULT_ARCHS.to_vec()
    };
    let ptx = *sass
        .last()
        .ok_or_else(|| format!("{var}={value:?} names no architecture"))?;
    let mut source = if named {
        format!("{var}={value}")
    } else if var.is_empty() {
        "default".to_string()
    } else {
        format!("{var}=default")
    };
    if var.is_empty() {
        add_local_gpus(&mut sass, known, ptx, &mut source);
    }
    let unknown: Vec<u32> = sass
        .iter()
        .copied()
        .filter(|a| !known.is_empty() && !known.contains(a))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "nvcc cannot target {unknown:?} ({source}); it knows {known:?}"
        ));
    }
    Ok(Archs { sass, ptx, source })
}

/// No variable set: adds machine code for each GPU of this machine (`nvidia-smi`) that no
/// architecture of `sass` can run (a newer major version, such as Blackwell's sm_100 / sm_120),
/// so that it does not JIT-compile the PTX in every process. Without `nvidia-smi`, adds nothing.
fn add_local_gpus(sass: &mut Vec<u32>, known: &[u32], ptx: u32, source: &mut String) {
    for gpu in nvidia_smi_caps() {
        // sm_XY machine code runs on sm_XZ for Z >= Y.
        if sass.iter().any(|&a| a / 10 == gpu / 10 && a <= gpu) {
            continue;
        }
        if gpu < MIN_ARCH {
            println!("cargo::warning=nvidia-smi reports sm_{gpu}; the kernels need sm_{MIN_ARCH}+");
        } else if known.is_empty() || known.contains(&gpu) {
            sass.push(gpu);
            source.push_str(&format!(", sm_{gpu} from nvidia-smi"));
        } else {
            println!(
                "cargo::warning=nvidia-smi reports sm_{gpu}, which this nvcc cannot target; \
                 that GPU will JIT-compile the compute_{ptx} PTX"
            );
        }
    }
    sass.sort_unstable();
    sass.dedup();
}

/// `90`, `sm_90`, `compute_90`, `90a`, `9.0`, or a comma-separated list of them, sorted and
/// deduplicated. An `a`/`f` suffix is dropped (see the module doc).
fn parse_caps(value: &str) -> Result<Vec<u32>, String> {
    let mut caps = Vec::new();
    for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let lower = item.to_ascii_lowercase();
        let digits = lower
            .trim_start_matches("sm_")
            .trim_start_matches("compute_")
            .trim_end_matches(['a', 'f'])
            .replace('.', "");
        let cap: u32 = digits
            .parse()
            .map_err(|_| format!("cannot read {item:?} as a compute capability"))?;
        if cap < MIN_ARCH {
            return Err(format!(
                "sm_{cap}: the kernels need sm_{MIN_ARCH} or newer (bf16 mma.sync, cp.async)"
            ));
        }
        caps.push(cap);
    }
    caps.sort_unstable();
    caps.dedup();
    Ok(caps)
}

/// Compute capabilities of this machine's GPUs (`nvidia-smi`); empty without one.
fn nvidia_smi_caps() -> Vec<u32> {
    let Ok(out) = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output()
    else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().replace('.', "").parse().ok())
        .collect()
}
