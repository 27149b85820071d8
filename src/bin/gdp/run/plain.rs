//! The plain (single-device) op on inputs prepared for repeated calls ([`Prepared`]): the
//! forward, and the forward and backward through Candle's autograd or the explicit backward.

use super::args::BackwardArg;
use crate::error::CliError;
use crate::input::LoadedInput;
use crate::kernels::KernelArgs;
use candle_core::{DType, Device, Tensor, Var};
use candle_gdp::op::KernelConfig;
use candle_gdp::{gated_delta_product, GdpOptions, SaveIntermediates};

/// The inputs cast and placed on the device, ready for repeated calls.
pub struct Prepared<'a> {
    q: Var,
    k: Var,
    v: Var,
    g: Var,
    beta: Var,
    h0: Option<Var>,
    dout: Option<Tensor>,
    dht: Option<Tensor>,
    cu_seqlens: Option<&'a [usize]>,
    scale: Option<f64>,
    backward: BackwardArg,
    kernels: KernelConfig,
    save: SaveIntermediates,
}

impl<'a> Prepared<'a> {
    pub fn new(
        x: &'a LoadedInput,
        dtype: DType,
        device: &Device,
        scale: Option<f64>,
    ) -> Result<Self, CliError> {
        let put = |t: &Tensor, name: &str, dt: DType| -> Result<Tensor, CliError> {
            t.to_dtype(dt)
                .and_then(|t| t.to_device(device))
                .map_err(|e| CliError::tensor(name, &e))
        };
        let var = |t: &Tensor, name: &str, dt: DType| -> Result<Var, CliError> {
            Var::from_tensor(&put(t, name, dt)?).map_err(|e| CliError::tensor(name, &e))
        };
        Ok(Self {
            q: var(&x.q, "q", dtype)?,
            k: var(&x.k, "k", dtype)?,
            v: var(&x.v, "v", dtype)?,
            g: var(&x.g, "g", DType::F32)?,
            beta: var(&x.beta, "beta", dtype)?,
            h0: x.h0.as_ref().map(|t| var(t, "h0", dtype)).transpose()?,
            // In the dtypes of `o` and of the final state (f32).
            dout: x.dout.as_ref().map(|t| put(t, "do", dtype)).transpose()?,
            dht: x
                .dht
                .as_ref()
                .map(|t| put(t, "dht", DType::F32))
                .transpose()?,
            cu_seqlens: x.cu_seqlens.as_deref(),
            scale,
            backward: BackwardArg::Autograd,
            kernels: KernelConfig::default(),
            save: SaveIntermediates::default(),
        })
    }

    /// The same, with the kernel choices and the save level of `k`.
    pub fn with_kernels(self, k: &KernelArgs) -> Self {
        Self {
            kernels: k.config(),
            save: k.save(),
            ..self
        }
    }

    /// The same, with the gradients computed by `backward`.
    pub fn with_backward(self, backward: BackwardArg) -> Self {
        Self { backward, ..self }
    }

    fn options(&self, final_state: bool) -> GdpOptions<'_> {
        GdpOptions {
            scale: self.scale,
            initial_state: self.h0.as_ref().map(|v| v.as_tensor()),
            output_final_state: final_state,
            cu_seqlens: self.cu_seqlens,
            kernels: self.kernels,
            save_intermediates: self.save,
            ..Default::default()
        }
    }

    /// `o` in the compute dtype and, with `final_state`, the final state (f32). Without it
    /// this is the call FLA's benchmark times (`output_final_state=False`).
    pub fn forward(&self, final_state: bool) -> Result<(Tensor, Option<Tensor>), CliError> {
        let opts = self.options(final_state);
        let (o, ht) = gated_delta_product(&self.q, &self.k, &self.v, &self.g, &self.beta, &opts)
            .map_err(|e| CliError::from_lib(&e))?;
        if final_state && ht.is_none() {
            return Err(CliError::new("the op returned no final state"));
        }
        Ok((o, ht))
    }

    /// `(o, final state)`, for the outputs.
    pub fn outputs(&self) -> Result<Vec<(String, Tensor)>, CliError> {
        let (o, ht) = self.forward(true)?;
        let ht = ht.ok_or_else(|| CliError::new("the op returned no final state"))?;
        Ok(vec![("o".to_string(), o), ("ht".to_string(), ht)])
    }

    /// Forward, then the gradients of `L = Σ do·o + Σ dht·ht` (a missing cotangent is zero;
    /// the final state is only computed when `dht` is given). Returns `o`, the final state
    /// when computed, then `dq dk dv dg dbeta` and `dh0` when there is an initial state.
    pub fn forward_backward(&self) -> Result<Vec<(String, Tensor)>, CliError> {
        if self.backward == BackwardArg::Explicit {
            return self.forward_backward_explicit();
        }
        let (o, ht) = self.forward(self.dht.is_some())?;
        let lib = |e: candle_core::Error| CliError::from_lib(&e);
        self.check_cotangents_of(&o, ht.as_ref())?;
        let mut pairs = vec![];
        if let Some(cot) = &self.dout {
            pairs.push((&o, cot));
        }
        if let (Some(cot), Some(ht)) = (&self.dht, &ht) {
            pairs.push((ht, cot));
        }
        let grads = candle_gdp::backward_with(&pairs).map_err(lib)?;
        let gradient = |var: &Var| match grads.get(var.as_tensor()) {
            Some(gr) => Ok(gr.clone()),
            None => var.zeros_like().map_err(lib),
        };
        let inputs = [&self.q, &self.k, &self.v, &self.g, &self.beta];
        let dh0 = self.h0.as_ref().map(gradient).transpose()?;
        let [dq, dk, dv, dg, dbeta] = inputs.map(gradient);
        Ok(named_outputs(o, ht, [dq?, dk?, dv?, dg?, dbeta?], dh0))
    }

    /// [`Prepared::forward_backward`] through the op's explicit backward.
    fn forward_backward_explicit(&self) -> Result<Vec<(String, Tensor)>, CliError> {
        let lib = |e: candle_core::Error| CliError::from_lib(&e);
        let opts = self.options(self.dht.is_some());
        let vjp = candle_gdp::gated_delta_product_vjp(
            &self.q, &self.k, &self.v, &self.g, &self.beta, &opts,
        )
        .map_err(lib)?;
        self.check_cotangents_of(&vjp.o, vjp.final_state.as_ref())?;
        let d_o = match &self.dout {
            Some(d) => d.clone(),
            None => vjp.o.zeros_like().map_err(lib)?,
        };
        let (o, ht) = (vjp.o.clone(), vjp.final_state.clone());
        let gr = vjp.backward(&d_o, self.dht.as_ref()).map_err(lib)?;
        let grads = [gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta];
        Ok(named_outputs(o, ht, grads, gr.dh0))
    }

    /// Checks the cotangents `do` and `dht` against the forward's `o` and final state `ht`
    /// (when computed): their shapes, and that at least one is given.
    fn check_cotangents_of(&self, o: &Tensor, ht: Option<&Tensor>) -> Result<(), CliError> {
        let ht_dims = ht.map_or(vec![], |t| t.dims().to_vec());
        check_cotangents(&self.dout, &self.dht, o.dims(), &ht_dims)?;
        if self.dout.is_none() && self.dht.is_none() {
            return Err(CliError::new("gradients need a `do` or `dht` tensor"));
        }
        Ok(())
    }
}

/// A forward+backward run's outputs by name: `o`, the final state `ht` when computed, the
/// gradients `dq dk dv dg dbeta`, and `dh0` when there is an initial state.
fn named_outputs(
    o: Tensor,
    ht: Option<Tensor>,
    grads: [Tensor; 5],
    dh0: Option<Tensor>,
) -> Vec<(String, Tensor)> {
    let names = ["dq", "dk", "dv", "dg", "dbeta"];
    let mut out = vec![("o".to_string(), o)];
    out.extend(ht.map(|ht| ("ht".to_string(), ht)));
    out.extend(
        names
            .into_iter()
            .zip(grads)
            .map(|(n, t)| (n.to_string(), t)),
    );
    out.extend(dh0.map(|t| ("dh0".to_string(), t)));
    out
}

/// Checks the shapes of the cotangents `do` and `dht` against those of `o` and the final state.
pub(super) fn check_cotangents(
    dout: &Option<Tensor>,
    dht: &Option<Tensor>,
    o_dims: &[usize],
    ht_dims: &[usize],
) -> Result<(), CliError> {
    for (name, cot, want, layout) in [
        ("do", dout, o_dims, "[B, T, H, V] (the shape of o)"),
        ("dht", dht, ht_dims, "[N, H, K, V] (the shape of ht)"),
    ] {
        let Some(cot) = cot else { continue };
        if cot.dims() != want {
            return Err(CliError::new(format!(
                "`{name}`: expected shape {want:?} {layout}, got {:?}",
                cot.dims()
            )));
        }
    }
    Ok(())
}

/// `forward_backward`'s outputs with the final state after `o` (computed apart when no `dht`
/// asked for it).
pub fn with_final_state(
    p: &Prepared,
    mut all: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, CliError> {
    if !all.iter().any(|(name, _)| name == "ht") {
        let mut outs = p.outputs()?;
        all.insert(1, outs.remove(1));
    }
    Ok(all)
}
