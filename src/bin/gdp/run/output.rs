//! What a run returns ([`RunOutput`]: named f32 CPU tensors and timings) and how it is written.

use crate::error::CliError;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// Timings in milliseconds: medians, or means with `--timing events`.
#[derive(Debug, Clone, Default)]
pub struct Timings {
    pub fwd_ms: f64,
    pub fwd_bwd_ms: Option<f64>,
}

/// What `run` computed: named f32 CPU tensors, in output order, and timings under `--repeat`.
#[derive(Debug, Clone)]
pub struct RunOutput {
    pub tensors: Vec<(String, Tensor)>,
    pub timings: Option<Timings>,
}

impl RunOutput {
    /// `fwd_ms=<median>` and `fwd_bwd_ms=<median>` lines (empty without `--repeat`).
    pub fn timing_lines(&self) -> Vec<String> {
        let Some(t) = &self.timings else {
            return vec![];
        };
        let mut lines = vec![format!("fwd_ms={:.3}", t.fwd_ms)];
        if let Some(fb) = t.fwd_bwd_ms {
            lines.push(format!("fwd_bwd_ms={fb:.3}"));
        }
        lines
    }
}

/// The outputs as f32 CPU tensors.
pub(super) fn finish(
    tensors: Vec<(String, Tensor)>,
    timings: Option<Timings>,
) -> Result<RunOutput, CliError> {
    let tensors = tensors
        .into_iter()
        .map(|(name, t)| {
            let t = t
                .to_dtype(DType::F32)
                .and_then(|t| t.to_device(&Device::Cpu))
                .map_err(|e| CliError::tensor(&name, &e))?;
            Ok((name, t))
        })
        .collect::<Result<Vec<_>, CliError>>()?;
    Ok(RunOutput { tensors, timings })
}

/// Writes the outputs with `candle_core::safetensors::save`.
pub fn write_output(path: &Path, out: &RunOutput) -> Result<(), CliError> {
    let map: HashMap<String, Tensor> = out.tensors.iter().cloned().collect();
    candle_core::safetensors::save(&map, path).map_err(|e| {
        CliError::new(format!(
            "--output {}: cannot write: {}",
            path.display(),
            CliError::from_lib(&e)
        ))
    })
}
