//! The `gdp` command-line tool, run as a process on small safetensors files: its outputs equal
//! the library's, its timings print, and every bad input gives one `error:` line (exit 1 or 2,
//! never a panic) that names the tensor or the flag.
#![cfg(feature = "cli")]

mod common;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use common::{inputs, rel_rms, run_op, Case, Inputs};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

const GDP: &str = env!("CARGO_BIN_EXE_gdp");

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Result<Self> {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("gdp-cli-{}-{tag}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn save(path: &Path, tensors: &[(&str, Tensor)]) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    candle_core::safetensors::save(&map, path)?;
    Ok(())
}

fn gdp(args: &[&str]) -> Result<Output> {
    Ok(Command::new(GDP)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LIB_BACKTRACE", "1")
        .output()?)
}

/// The case's inputs as file tensors, in a mix of float dtypes (all exact for f32 values), with
/// `do`/`dht` when `grads`, and `cu_seqlens` in `cu_dtype`.
fn file_tensors(
    c: &Case,
    x: &Inputs,
    grads: bool,
    cu_dtype: DType,
) -> Result<Vec<(&'static str, Tensor)>> {
    let mut t = vec![
        ("q", x.q.clone()),
        ("k", x.k.to_dtype(DType::F32)?),
        ("v", x.v.to_dtype(DType::F32)?),
        ("g", x.g.clone()),
        ("beta", x.beta.to_dtype(DType::F32)?),
    ];
    if let Some(h0) = &x.h0 {
        t.push(("h0", h0.to_dtype(DType::F32)?));
    }
    if let Some(cu) = &c.cu {
        let cu: Vec<i64> = cu.iter().map(|&o| o as i64).collect();
        let n = cu.len();
        t.push((
            "cu_seqlens",
            Tensor::from_vec(cu, n, &Device::Cpu)?.to_dtype(cu_dtype)?,
        ));
    }
    if grads {
        t.push(("do", x.dout.clone()));
        t.push(("dht", x.dht.to_dtype(DType::F32)?));
    }
    Ok(t)
}

/// Runs `gdp run` on the case and compares every output with the library called directly.
fn check_against_library(c: &Case, cu_dtype: DType, grads: bool) -> Result<()> {
    let dir = TempDir::new("lib")?;
    let (inp, out) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let x = inputs(c, DType::F32)?;
    save(&inp, &file_tensors(c, &x, grads, cu_dtype)?)?;
    let r = gdp(&[
        "run",
        "--input",
        inp.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ])?;
    let stderr = String::from_utf8_lossy(&r.stderr);
    ensure!(r.status.success(), "{}: gdp run failed: {stderr}", c.name);
    ensure!(stderr.is_empty(), "{}: unexpected stderr: {stderr}", c.name);
    let got = candle_core::safetensors::load(&out, &Device::Cpu)?;
    let want = run_op(c, &x, DType::F32)?;
    let mut expected = vec![("o", want.o), ("ht", want.ht)];
    if grads {
        expected.extend(want.grads);
    }
    let mut names: Vec<&str> = got.keys().map(String::as_str).collect();
    names.sort();
    let mut want_names: Vec<&str> = expected.iter().map(|(n, _)| *n).collect();
    want_names.sort();
    ensure!(
        names == want_names,
        "{}: output tensors {names:?}, want {want_names:?}",
        c.name
    );
    for (name, w) in &expected {
        let g = &got[*name];
        ensure!(
            g.dtype() == DType::F32,
            "{}: `{name}` is {:?}",
            c.name,
            g.dtype()
        );
        ensure!(
            g.dims() == w.dims(),
            "{}: `{name}` shape {:?} vs {:?}",
            c.name,
            g.dims(),
            w.dims()
        );
        let e = rel_rms(g, w)?;
        ensure!(
            e <= 1e-5,
            "{}: `{name}` relative RMS {e:.2e} vs the library",
            c.name
        );
    }
    Ok(())
}

#[test]
fn run_matches_library_dense() -> Result<()> {
    check_against_library(
        &Case::new("dense n2 h0", 2, 40, 2, 16, 12, 2).h0(),
        DType::I64,
        true,
    )?;
    check_against_library(
        &Case::new("dense n1", 1, 33, 3, 8, 8, 1).strong_gates(),
        DType::I64,
        true,
    )?;
    // Grouped value heads: `q`, `k` with 2 heads, the rest with 6.
    check_against_library(
        &Case::new("grouped r3", 1, 30, 6, 8, 12, 1)
            .key_heads(2)
            .h0(),
        DType::I64,
        true,
    )
}

#[test]
fn run_matches_library_packed_i32_and_i64() -> Result<()> {
    let c = Case::new("packed n3 h0", 1, 50, 2, 12, 16, 3)
        .packed(&[0, 7, 7, 30, 50])
        .h0();
    check_against_library(&c, DType::I32, true)?;
    check_against_library(&c, DType::I64, true)?;
    let c = Case::new("packed n2", 1, 20, 1, 8, 8, 2).packed(&[0, 20]);
    check_against_library(&c, DType::U32, true)
}

#[test]
fn run_forward_only_writes_o_and_ht() -> Result<()> {
    check_against_library(
        &Case::new("fwd only h0", 1, 25, 2, 8, 16, 2).h0(),
        DType::I64,
        false,
    )?;
    let c = Case::new("fwd only packed", 1, 25, 2, 8, 16, 1).packed(&[0, 10, 25]);
    check_against_library(&c, DType::I32, false)
}

#[test]
fn run_scale_and_half_dtypes() -> Result<()> {
    let dir = TempDir::new("scale")?;
    let (inp, out) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let c = Case::new("scale", 1, 30, 2, 16, 8, 2).h0();
    let x = inputs(&c, DType::BF16)?;
    save(&inp, &file_tensors(&c, &x, false, DType::I64)?)?;
    let opts = candle_gdp::GdpOptions {
        scale: Some(-0.3),
        initial_state: x.h0.as_ref(),
        output_final_state: true,
        ..Default::default()
    };
    let (o, _) = candle_gdp::gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?;
    for (dtype, tol) in [("f32", 1e-5), ("bf16", 1e-2), ("f16", 1e-2)] {
        let r = gdp(&[
            "run",
            "--input",
            inp.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--scale",
            "-0.3",
            "--dtype",
            dtype,
        ])?;
        ensure!(
            r.status.success(),
            "{dtype}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        let got = candle_core::safetensors::load(&out, &Device::Cpu)?;
        let e = rel_rms(&got["o"], &o)?;
        ensure!(e <= tol, "{dtype}: o relative RMS {e:.2e} > {tol:.0e}");
        ensure!(got["o"].dtype() == DType::F32 && got["ht"].dtype() == DType::F32);
    }
    Ok(())
}

fn timing_lines(stdout: &[u8]) -> Vec<(String, f64)> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse::<f64>().ok()?)))
        .collect()
}

#[test]
fn repeat_prints_medians_and_still_writes() -> Result<()> {
    let dir = TempDir::new("repeat")?;
    let c = Case::new("repeat", 1, 64, 2, 16, 16, 2).h0();
    let x = inputs(&c, DType::F32)?;
    for grads in [true, false] {
        let (inp, out) = (
            dir.path(&format!("in{grads}.st")),
            dir.path(&format!("out{grads}.st")),
        );
        save(&inp, &file_tensors(&c, &x, grads, DType::I64)?)?;
        let r = gdp(&[
            "--threads",
            "2",
            "run",
            "--input",
            inp.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--repeat",
            "3",
        ])?;
        ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let lines = timing_lines(&r.stdout);
        let keys: Vec<&str> = lines.iter().map(|(k, _)| k.as_str()).collect();
        let want: &[&str] = if grads {
            &["fwd_ms", "fwd_bwd_ms"]
        } else {
            &["fwd_ms"]
        };
        ensure!(
            keys == want,
            "stdout {:?}",
            String::from_utf8_lossy(&r.stdout)
        );
        ensure!(lines.iter().all(|(_, v)| v.is_finite() && *v >= 0.0));
        let got = candle_core::safetensors::load(&out, &Device::Cpu)?;
        ensure!(got.contains_key("o") && got.contains_key("ht"));
        ensure!(got.contains_key("dq") == grads && got.contains_key("dh0") == grads);
    }
    Ok(())
}

/// A hand-written safetensors file (to store dtypes that Candle cannot write).
fn raw_safetensors(
    path: &Path,
    name: &str,
    dtype: &str,
    shape: &[usize],
    nbytes: usize,
) -> Result<()> {
    let header = format!(
        "{{\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[0,{nbytes}]}}}}"
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(vec![0u8; nbytes]);
    std::fs::write(path, bytes)?;
    Ok(())
}

/// Checks the failure: exit code 1 or 2 as given, one non-empty `error:` line naming `needle`.
fn expect_error(what: &str, r: &Output, code: i32, needle: &str) -> Result<()> {
    let stderr = String::from_utf8_lossy(&r.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    ensure!(
        r.status.code() == Some(code),
        "{what}: exit {:?}, want {code}; stderr: {stderr}",
        r.status.code()
    );
    ensure!(
        lines.len() == 1,
        "{what}: {} stderr lines: {stderr}",
        lines.len()
    );
    ensure!(
        lines[0].starts_with("error: ") && lines[0].len() > 7,
        "{what}: {stderr}"
    );
    println!("{what:<16} exit {code}  {}", lines[0]);
    ensure!(
        lines[0].contains(needle),
        "{what}: `{needle}` not named in: {stderr}"
    );
    ensure!(
        !stderr.contains("panicked") && !stderr.contains("initial_state"),
        "{what}: {stderr}"
    );
    Ok(())
}

#[test]
fn bad_inputs_give_one_line_naming_the_culprit() -> Result<()> {
    let dir = TempDir::new("bad")?;
    let c = Case::new("base", 1, 12, 2, 8, 4, 2).h0();
    let x = inputs(&c, DType::F32)?;
    let base = file_tensors(&c, &x, true, DType::I64)?;
    let dev = Device::Cpu;
    let ints = |v: &[i64], dt: DType| Tensor::new(v, &dev).and_then(|t| t.to_dtype(dt));
    let zeros = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev);
    // (what, tensor replaced or added (None value removes it), needle)
    let cases: Vec<(&str, &str, Option<Tensor>, &str)> = vec![
        ("missing q", "q", None, "`q`"),
        ("missing k", "k", None, "`k`"),
        ("missing beta", "beta", None, "`beta`"),
        ("q rank 3", "q", Some(zeros(&[1, 12, 2])?), "`q`"),
        ("q T=0", "q", Some(zeros(&[1, 0, 2, 8])?), "`q`"),
        ("k shape", "k", Some(zeros(&[1, 23, 2, 8])?), "`k`"),
        ("k rank 5", "k", Some(zeros(&[1, 12, 2, 2, 8])?), "`k`"),
        ("v shape", "v", Some(zeros(&[1, 24, 3, 4])?), "`v`"),
        ("g shape", "g", Some(zeros(&[1, 12])?), "`g`"),
        ("beta shape", "beta", Some(zeros(&[1, 12, 2])?), "`beta`"),
        ("h0 shape", "h0", Some(zeros(&[1, 2, 4, 8])?), "`h0`"),
        ("h0 rank", "h0", Some(zeros(&[2, 4, 8])?), "`h0`"),
        (
            "q int",
            "q",
            Some(ints(&[1, 2], DType::I64)?.reshape((1, 1, 1, 2))?),
            "`q`",
        ),
        (
            "g int",
            "g",
            Some(ints(&[0; 24], DType::U32)?.reshape((1, 12, 2))?),
            "`g`",
        ),
        (
            "beta u8",
            "beta",
            Some(ints(&[1; 48], DType::U8)?.reshape((1, 24, 2))?),
            "`beta`",
        ),
        (
            "h0 int",
            "h0",
            Some(ints(&[0; 64], DType::I32)?.reshape((1, 2, 8, 4))?),
            "`h0`",
        ),
        (
            "do int",
            "do",
            Some(ints(&[0; 96], DType::I64)?.reshape((1, 12, 2, 4))?),
            "`do`",
        ),
        (
            "cu start",
            "cu_seqlens",
            Some(ints(&[1, 12], DType::I32)?),
            "cu_seqlens",
        ),
        (
            "cu end",
            "cu_seqlens",
            Some(ints(&[0, 5, 11], DType::I64)?),
            "cu_seqlens",
        ),
        (
            "cu past end",
            "cu_seqlens",
            Some(ints(&[0, 5, 13], DType::I64)?),
            "cu_seqlens",
        ),
        (
            "cu decreasing",
            "cu_seqlens",
            Some(ints(&[0, 8, 4, 12], DType::I32)?),
            "cu_seqlens",
        ),
        (
            "cu negative",
            "cu_seqlens",
            Some(ints(&[0, -1, 12], DType::I64)?),
            "cu_seqlens",
        ),
        (
            "cu single",
            "cu_seqlens",
            Some(ints(&[0], DType::I64)?),
            "cu_seqlens",
        ),
        (
            "cu float",
            "cu_seqlens",
            Some(Tensor::new(&[0f32, 12.], &dev)?),
            "cu_seqlens",
        ),
        (
            "cu rank 2",
            "cu_seqlens",
            Some(ints(&[0, 12], DType::I64)?.reshape((1, 2))?),
            "cu_seqlens",
        ),
        ("do shape", "do", Some(zeros(&[1, 12, 2, 5])?), "`do`"),
        ("do rank", "do", Some(zeros(&[12, 2, 4])?), "`do`"),
        ("dht shape", "dht", Some(zeros(&[2, 2, 8, 4])?), "`dht`"),
    ];
    let out = dir.path("out.safetensors");
    for (i, (what, name, replacement, needle)) in cases.into_iter().enumerate() {
        let mut tensors: Vec<(&str, Tensor)> =
            base.iter().filter(|(n, _)| *n != name).cloned().collect();
        if let Some(t) = replacement {
            tensors.push((name, t));
        }
        let inp = dir.path(&format!("bad{i}.safetensors"));
        save(&inp, &tensors)?;
        let r = gdp(&[
            "run",
            "--input",
            inp.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ])?;
        expect_error(what, &r, 1, needle)?;
        ensure!(!out.exists(), "{what}: an output file was written");
    }

    // Packed sequences need B = 1.
    let c2 = Case::new("b2", 2, 6, 1, 4, 4, 1);
    let x2 = inputs(&c2, DType::F32)?;
    let mut t2 = file_tensors(&c2, &x2, false, DType::I64)?;
    t2.push(("cu_seqlens", ints(&[0, 6], DType::I64)?));
    let inp = dir.path("b2.safetensors");
    save(&inp, &t2)?;
    let r = gdp(&[
        "run",
        "--input",
        inp.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ])?;
    expect_error("cu with B=2", &r, 1, "cu_seqlens")?;

    // Files that are not (valid) safetensors, and unsupported stored dtypes.
    let good = dir.path("good.safetensors");
    save(&good, &base)?;
    let text = dir.path("text.safetensors");
    std::fs::write(&text, "hello, this is not a safetensors file")?;
    let empty = dir.path("empty.safetensors");
    std::fs::write(&empty, b"")?;
    let truncated = dir.path("truncated.safetensors");
    let bytes = std::fs::read(&good)?;
    std::fs::write(&truncated, &bytes[..bytes.len() - 10])?;
    let boolean = dir.path("bool.safetensors");
    raw_safetensors(&boolean, "q", "BOOL", &[1, 12, 2, 8], 192)?;
    let missing = dir.path("does-not-exist.safetensors");
    let g = good.to_str().unwrap();
    let o = out.to_str().unwrap();
    let flag_cases: Vec<(&str, Vec<&str>, i32, &str)> = vec![
        (
            "no such file",
            vec!["run", "--input", missing.to_str().unwrap(), "--output", o],
            1,
            "--input",
        ),
        (
            "text file",
            vec!["run", "--input", text.to_str().unwrap(), "--output", o],
            1,
            "--input",
        ),
        (
            "empty file",
            vec!["run", "--input", empty.to_str().unwrap(), "--output", o],
            1,
            "--input",
        ),
        (
            "truncated",
            vec!["run", "--input", truncated.to_str().unwrap(), "--output", o],
            1,
            "--input",
        ),
        (
            "directory",
            vec!["run", "--input", dir.0.to_str().unwrap(), "--output", o],
            1,
            "--input",
        ),
        (
            "bool q",
            vec!["run", "--input", boolean.to_str().unwrap(), "--output", o],
            1,
            "`q`",
        ),
        (
            "bad dtype",
            vec!["run", "--input", g, "--output", o, "--dtype", "f8"],
            2,
            "--dtype",
        ),
        (
            "bad device",
            vec!["run", "--input", g, "--output", o, "--device", "tpu"],
            2,
            "--device",
        ),
        (
            "bad cuda index",
            vec!["run", "--input", g, "--output", o, "--device", "cuda:x"],
            2,
            "--device",
        ),
        (
            "no cuda",
            vec!["run", "--input", g, "--output", o, "--device", "cuda:0"],
            1,
            "--device",
        ),
        (
            "repeat 0",
            vec!["run", "--input", g, "--output", o, "--repeat", "0"],
            2,
            "--repeat",
        ),
        (
            "repeat text",
            vec!["run", "--input", g, "--output", o, "--repeat", "x"],
            2,
            "--repeat",
        ),
        (
            "events on cpu",
            vec![
                "run", "--input", g, "--output", o, "--repeat", "1", "--timing", "events",
            ],
            1,
            "--timing events",
        ),
        (
            "events with cp",
            vec![
                "run",
                "--input",
                g,
                "--output",
                o,
                "--cp-size",
                "2",
                "--repeat",
                "1",
                "--timing",
                "events",
            ],
            1,
            "--timing events",
        ),
        (
            "timing text",
            vec![
                "run", "--input", g, "--output", o, "--repeat", "1", "--timing", "gpu",
            ],
            2,
            "--timing",
        ),
        (
            "scale nan",
            vec!["run", "--input", g, "--output", o, "--scale", "nan"],
            1,
            "--scale",
        ),
        (
            "scale text",
            vec!["run", "--input", g, "--output", o, "--scale", "big"],
            2,
            "--scale",
        ),
        (
            "threads 0",
            vec!["--threads", "0", "run", "--input", g, "--output", o],
            2,
            "--threads",
        ),
        ("no --input", vec!["run", "--output", o], 2, "--input"),
        ("no --output", vec!["run", "--input", g], 2, "--output"),
        (
            "unknown flag",
            vec!["run", "--input", g, "--output", o, "--frobnicate"],
            2,
            "--frobnicate",
        ),
        ("no subcommand", vec![], 2, "subcommand"),
        (
            "bad --output",
            vec!["run", "--input", g, "--output", "/nonexistent-dir/x/out.st"],
            1,
            "--output",
        ),
        (
            "demo bad dtype",
            vec!["demo", "--dtype", "f64x"],
            2,
            "--dtype",
        ),
    ];
    for (what, args, code, needle) in flag_cases {
        let r = gdp(&args)?;
        expect_error(what, &r, code, needle)?;
    }
    ensure!(!out.exists(), "an output file was written");
    Ok(())
}

#[test]
fn demo_runs_and_checks() -> Result<()> {
    let r = gdp(&["demo", "--tokens", "96", "--repeat", "1"])?;
    let stdout = String::from_utf8_lossy(&r.stdout);
    ensure!(
        r.status.success(),
        "demo failed: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    for word in ["check", "packed", "bench", "max rel RMS", "T96"] {
        ensure!(
            stdout.contains(word),
            "demo output lacks `{word}`:\n{stdout}"
        );
    }
    let r = gdp(&["demo", "--tokens", "64", "--repeat", "1", "--dtype", "bf16"])?;
    ensure!(
        r.status.success(),
        "bf16 demo failed: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    Ok(())
}

#[test]
fn help_and_version_exit_zero() -> Result<()> {
    for args in [
        &["--help"][..],
        &["run", "--help"],
        &["demo", "--help"],
        &["--version"],
    ] {
        let r = gdp(args)?;
        ensure!(r.status.success() && !r.stdout.is_empty(), "{args:?}");
    }
    Ok(())
}

#[test]
fn unexpected_panic_is_one_line() -> Result<()> {
    // Writing to a closed stdout panics inside `println!`; the hook must turn that into one
    // `error:` line and exit code 1.
    let mut child = Command::new(GDP)
        .args(["demo", "--tokens", "32", "--repeat", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    drop(child.stdout.take());
    let r = child.wait_with_output()?;
    expect_error("closed stdout", &r, 1, "internal error")
}

/// `gdp run` with the given extra flags; returns the written tensors and the stdout.
fn run_file(inp: &Path, out: &Path, extra: &[&str]) -> Result<(HashMap<String, Tensor>, String)> {
    let mut args = vec![
        "--threads",
        "2",
        "run",
        "--input",
        inp.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let r = gdp(&args)?;
    let stderr = String::from_utf8_lossy(&r.stderr);
    ensure!(r.status.success(), "gdp run {extra:?} failed: {stderr}");
    ensure!(
        stderr.is_empty(),
        "gdp run {extra:?}: unexpected stderr: {stderr}"
    );
    let got = candle_core::safetensors::load(out, &Device::Cpu)?;
    Ok((got, String::from_utf8_lossy(&r.stdout).into_owned()))
}

/// Saves `tensors` to `path` without those named in `drop`.
fn save_without(path: &Path, tensors: &[(&str, Tensor)], drop: &[&str]) -> Result<()> {
    let kept: Vec<(&str, Tensor)> = tensors
        .iter()
        .filter(|(n, _)| !drop.contains(n))
        .cloned()
        .collect();
    save(path, &kept)
}

/// The keys of `gdp run --repeat`'s timing lines, in order.
fn timing_keys(stdout: &str) -> Vec<String> {
    timing_lines(stdout.as_bytes())
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

/// Every tensor of `got` equals `want` (same names, f32, same shapes, rel RMS <= 1e-5).
fn same_outputs(
    what: &str,
    got: &HashMap<String, Tensor>,
    want: &HashMap<String, Tensor>,
) -> Result<()> {
    let mut names: Vec<&String> = got.keys().collect();
    let mut want_names: Vec<&String> = want.keys().collect();
    names.sort();
    want_names.sort();
    ensure!(
        names == want_names,
        "{what}: tensors {names:?}, want {want_names:?}"
    );
    for (name, w) in want {
        let g = &got[name];
        ensure!(
            g.dtype() == DType::F32,
            "{what}: `{name}` is {:?}",
            g.dtype()
        );
        ensure!(
            g.dims() == w.dims(),
            "{what}: `{name}` shape {:?} vs {:?}",
            g.dims(),
            w.dims()
        );
        let e = rel_rms(g, w)?;
        ensure!(
            e <= 1e-5,
            "{what}: `{name}` relative RMS {e:.2e} vs --cp-size 1"
        );
    }
    Ok(())
}

#[test]
fn cp_size_matches_plain_run() -> Result<()> {
    let dir = TempDir::new("cp")?;
    let out = dir.path("out.safetensors");
    let all = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"];
    // Dense B=2; packed: a sequence shorter than a shard, an empty one, one spanning several
    // ranks (T=24: shards of 3..24 tokens).
    let cases = [
        Case::new("cp dense", 2, 20, 2, 8, 8, 2).h0(),
        Case::new("cp packed", 1, 24, 2, 8, 8, 2)
            .packed(&[0, 2, 2, 19, 24])
            .h0(),
        Case::new("cp grouped", 1, 24, 4, 8, 8, 1)
            .key_heads(2)
            .packed(&[0, 5, 24])
            .h0(),
    ];
    for (i, c) in cases.iter().enumerate() {
        let x = inputs(c, DType::F32)?;
        let inp = dir.path(&format!("in{i}.safetensors"));
        let tensors = file_tensors(c, &x, true, DType::I64)?;
        save(&inp, &tensors)?;
        let (want, _) = run_file(&inp, &out, &[])?;
        let mut names: Vec<&str> = want.keys().map(String::as_str).collect();
        names.sort();
        let mut all_sorted = all.to_vec();
        all_sorted.sort();
        ensure!(names == all_sorted, "{}: plain run wrote {names:?}", c.name);
        for r in 1..=8 {
            let rs = r.to_string();
            let (got, _) = run_file(&inp, &out, &["--cp-size", &rs])?;
            same_outputs(&format!("{} cp={r}", c.name), &got, &want)?;
        }
        // Only `dht` (a zero `do`), and forward only, on 3 ranks, timed.
        for (tag, drop) in [("dht only", &["do"][..]), ("fwd only", &["do", "dht"])] {
            let part = dir.path(&format!("in{i}-{}.safetensors", drop.len()));
            save_without(&part, &tensors, drop)?;
            let (want, _) = run_file(&part, &out, &[])?;
            let (got, stdout) = run_file(&part, &out, &["--cp-size", "3", "--repeat", "1"])?;
            same_outputs(&format!("{} {tag} cp=3", c.name), &got, &want)?;
            let keys = timing_keys(&stdout);
            let want_keys: &[&str] = if drop.len() == 1 {
                &["fwd_ms", "fwd_bwd_ms"]
            } else {
                &["fwd_ms"]
            };
            ensure!(keys == want_keys, "{} {tag}: stdout {stdout:?}", c.name);
        }
    }

    // Bad rank counts: one line naming `--cp-size`.
    let c = &cases[0];
    let x = inputs(c, DType::F32)?;
    let inp = dir.path("bad.safetensors");
    save(&inp, &file_tensors(c, &x, true, DType::I64)?)?;
    let too_many = (c.t + 1).to_string();
    let (i, o) = (inp.to_str().unwrap(), out.to_str().unwrap());
    std::fs::remove_file(&out)?;
    for (what, r, code) in [
        ("cp-size 0", "0", 1),
        ("cp-size T+1", too_many.as_str(), 1),
        ("cp-size text", "x", 2),
        ("cp-size negative", "-1", 2),
    ] {
        let r = gdp(&["run", "--input", i, "--output", o, "--cp-size", r])?;
        expect_error(what, &r, code, "--cp-size")?;
        ensure!(!out.exists(), "{what}: an output file was written");
    }
    // Without CUDA in the build, opening the ranks' devices fails naming `--device`.
    let r = gdp(&[
        "run",
        "--input",
        i,
        "--output",
        o,
        "--cp-size",
        "2",
        "--device",
        "cuda:0",
    ])?;
    expect_error("cp no cuda", &r, 1, "--device")?;
    Ok(())
}

#[test]
fn explicit_backward_matches_autograd_run() -> Result<()> {
    let dir = TempDir::new("explicit")?;
    let out = dir.path("out.safetensors");
    let cases = [
        Case::new("explicit dense", 2, 20, 2, 8, 6, 2).h0(),
        Case::new("explicit packed", 1, 24, 2, 8, 8, 3).packed(&[0, 2, 2, 19, 24]),
    ];
    for (i, c) in cases.iter().enumerate() {
        let x = inputs(c, DType::F32)?;
        let tensors = file_tensors(c, &x, true, DType::I64)?;
        // Both cotangents, `do` only, `dht` only.
        for (tag, drop) in [
            ("both", &[][..]),
            ("do only", &["dht"]),
            ("dht only", &["do"]),
        ] {
            let inp = dir.path(&format!("in{i}-{}.safetensors", tag.replace(' ', "-")));
            save_without(&inp, &tensors, drop)?;
            let (want, _) = run_file(&inp, &out, &[])?;
            let (got, stdout) = run_file(&inp, &out, &["--backward", "explicit", "--repeat", "1"])?;
            same_outputs(&format!("{} {tag} explicit", c.name), &got, &want)?;
            let keys = timing_keys(&stdout);
            ensure!(
                keys == ["fwd_ms", "fwd_bwd_ms"],
                "{} {tag}: {stdout:?}",
                c.name
            );
        }
    }
    let inp = dir.path("in0-both.safetensors");
    let r = gdp(&[
        "run",
        "--input",
        inp.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--backward",
        "explicit",
        "--cp-size",
        "2",
    ])?;
    expect_error("explicit with cp", &r, 1, "--backward explicit")?;
    Ok(())
}

#[test]
fn cp_bench_times_a_rank_and_ends_with_json() -> Result<()> {
    let r = gdp(&[
        "cp-bench",
        "--ranks",
        "3",
        "--tokens",
        "200",
        "--heads",
        "2",
        "--dk",
        "16",
        "--dv",
        "12",
        "--householder",
        "2",
        "--iters",
        "2",
        "--warmup",
        "0",
    ])?;
    let stdout = String::from_utf8_lossy(&r.stdout);
    ensure!(
        r.status.success(),
        "cp-bench failed: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(last)
        .map_err(|e| anyhow::anyhow!("last line is not JSON ({e}): {last}"))?;
    for key in [
        "plain_ms",
        "rank_ms",
        "efficiency",
        "plain_fwd_ms",
        "rank_fwd_ms",
        "fwd_efficiency",
    ] {
        let x = json[key].as_f64();
        ensure!(
            x.is_some_and(|x| x.is_finite() && x > 0.0),
            "`{key}` missing or not positive in {last}"
        );
    }
    // The middle rank by default; its shard of 200 tokens over 3 ranks.
    ensure!(json["rank"] == 1 && json["shard_tokens"] == 67, "{last}");
    let r = gdp(&["cp-bench", "--ranks", "4", "--rank", "4"])?;
    expect_error("cp-bench rank", &r, 1, "--rank 4")?;
    let r = gdp(&["cp-bench", "--ranks", "4", "--tokens", "3"])?;
    expect_error("cp-bench tokens", &r, 1, "--tokens 3")?;
    Ok(())
}
