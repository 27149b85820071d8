//! Reading the `run` input file: tensors `q k v g beta` (required) and `h0 cu_seqlens do dht`
//! (optional), by name, on the CPU, in their file dtypes. Other tensors in the file are ignored.

use crate::error::CliError;
use candle_core::safetensors::SliceSafetensors;
use candle_core::{DType, Device, Tensor};
use std::path::Path;

/// The tensors of one `run` input file, on the CPU, as stored (floats not yet cast).
#[derive(Debug, Clone)]
pub struct LoadedInput {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
    pub h0: Option<Tensor>,
    /// Packed-sequence offsets, read from any integer dtype.
    pub cu_seqlens: Option<Vec<usize>>,
    /// Cotangent of `o` (named `do` in the file).
    pub dout: Option<Tensor>,
    /// Cotangent of the final state.
    pub dht: Option<Tensor>,
}

impl LoadedInput {
    /// Whether gradients are requested (a `do` or `dht` cotangent is present).
    pub fn wants_grads(&self) -> bool {
        self.dout.is_some() || self.dht.is_some()
    }
}

/// Float dtypes the CLI can cast from (the sub-byte MX formats hold no convertible data).
fn castable_float(dt: DType) -> bool {
    matches!(
        dt,
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 | DType::F8E4M3
    )
}

/// Reads and checks the input file; errors name the flag `--input` or the offending tensor.
pub fn load(path: &Path) -> Result<LoadedInput, CliError> {
    let at = || format!("--input {}", path.display());
    let bytes =
        std::fs::read(path).map_err(|e| CliError::new(format!("{}: cannot read: {e}", at())))?;
    let st = SliceSafetensors::new(&bytes).map_err(|e| {
        CliError::new(format!(
            "{}: not a valid safetensors file: {}",
            at(),
            CliError::from_lib(&e)
        ))
    })?;
    let mut present: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).collect();
    present.sort();
    let get = |name: &str| -> Result<Option<Tensor>, CliError> {
        if !present.iter().any(|n| n == name) {
            return Ok(None);
        }
        st.load(name, &Device::Cpu)
            .map(Some)
            .map_err(|e| CliError::tensor(name, &e))
    };
    let float = |name: &str| -> Result<Option<Tensor>, CliError> {
        match get(name)? {
            Some(t) if !castable_float(t.dtype()) => Err(CliError::new(format!(
                "`{name}`: expected a float tensor (f32, f64, bf16, f16 or f8e4m3), got {:?}",
                t.dtype()
            ))),
            t => Ok(t),
        }
    };
    let required = |name: &str| -> Result<Tensor, CliError> {
        float(name)?.ok_or_else(|| {
            CliError::new(format!(
                "missing required tensor `{name}` in {} (it holds: {})",
                at(),
                if present.is_empty() {
                    "no tensors".to_string()
                } else {
                    present.join(", ")
                }
            ))
        })
    };
    let cu_seqlens = match get("cu_seqlens")? {
        Some(t) => Some(
            candle_gdp::op::cu_seqlens_from_tensor(&t)
                .map_err(|e| CliError::tensor("cu_seqlens", &e))?,
        ),
        None => None,
    };
    Ok(LoadedInput {
        q: required("q")?,
        k: required("k")?,
        v: required("v")?,
        g: required("g")?,
        beta: required("beta")?,
        h0: float("h0")?,
        cu_seqlens,
        dout: float("do")?,
        dht: float("dht")?,
    })
}
