//! The Rust mirror of `cuda/params.cuh`: one struct per kernel parameter list, its fields the
//! kernel's parameters in order. A launch pushes the fields one by one in that order
//! ([`KernelArgs`]), so the kernels keep plain positional parameters (what their code generation
//! was measured with) while each list is written once in the header and once here. Device
//! pointers are `u64` addresses (taken from borrows that last until the launch is queued, see
//! `op::cuda::module::Launch`), sizes `i32` / `i64`, scales `f32`. A test reads the header and
//! checks every struct's fields, order and types against it.

/// A kernel's arguments: pushes its fields, in the kernel's parameter order.
#[cfg(feature = "cuda")]
pub(crate) trait KernelArgs {
    /// Pushes every field onto `args`.
    fn push<'a>(&'a self, args: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>);
}

/// Two parameter lists, one after the other (the gradient kernel's pipe, see [`PipeParams`]).
#[cfg(feature = "cuda")]
impl<A: KernelArgs, B: KernelArgs> KernelArgs for (A, B) {
    fn push<'a>(&'a self, args: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
        self.0.push(args);
        self.1.push(args);
    }
}

macro_rules! kernel_params {
    ($(
        $(#[$doc:meta])*
        $name:ident = $cname:literal {
            $($field:ident: $ty:ident),* $(,)?
        }
    )*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, Default, PartialEq)]
            pub(crate) struct $name {
                $(pub $field: $ty),*
            }

            #[cfg(feature = "cuda")]
            impl KernelArgs for $name {
                fn push<'a>(
                    &'a self,
                    args: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
                ) {
                    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
                    $(args.arg(&self.$field);)*
                }
            }
        )*

        /// Every mirrored list: its X-macro in the header and its fields with their Rust types.
        #[cfg(test)]
        const MIRRORED: &[(&str, &[(&str, &str)])] = &[
            $(($cname, &[$((stringify!($field), stringify!($ty))),*])),*
        ];
    };
}

kernel_params! {
    /// `gdp_fwd_{f32,bf16,f16}`: the one-kernel forward.
    FusedFwdParams = "GDP_FUSED_FWD_FIELDS" {
        qk: u64, v: u64, aux: u64, seqs: u64, h0_override: u64, use_h0_override: i32, out: u64,
        batch: i32, tokens: i32, heads: i32, dk: i32, dv: i32, n: i32, has_h0: i32, scale: f32,
        bv: i32,
    }
    /// `gdp_bwd_{f32,bf16,f16}`: the per-value-tile backward and its summary modes.
    FusedBwdParams = "GDP_FUSED_BWD_FIELDS" {
        qk: u64, v: u64, aux: u64, table: u64, h0: u64, has_h0src: i32, dout: u64, dht: u64,
        hs: u64, out: u64, batch: i32, tokens: i32, heads: i32, dk: i32, dv: i32, n: i32,
        ext: i32, mode: i32, write_dh0: i32, scale: f32, bv: i32,
    }
    /// `gdp_fwd_wy_bf16`: the WY factors of every (chunk, head).
    WyParams = "GDP_WY_FIELDS" {
        q: u64, k: u64, split: i32, v: u64, aux: u64, table: u64, w: u64, u: u64, p: u64,
        coef: u64, ainv: u64, batch: i32, tokens: i32, heads: i32, dk: i32, dv: i32, n: i32,
        nseq: i32, scale: f32, order: u64, ready: u64,
    }
    /// `gdp_fwd_scan_bf16_*`, `gdp_fwd_states_bf16_*`: the forward's scan.
    ScanParams = "GDP_SCAN_FIELDS" {
        q: u64, k: u64, split: i32, aux: u64, table: u64, w: u64, u: u64, p: u64, coef: u64,
        h0_override: u64, use_h0_override: i32, out: u64, outb: u64, fin: u64, hs: u64, dn: u64,
        batch: i32, tokens: i32, heads: i32, dk: i32, dv: i32, dv_in: i32, wide_from: i32, wide_to: i32, n: i32,
        has_h0: i32,
        qr: i32,
        ns: i32, ready: u64,
    }
    /// `gdp_bwd_dh_bf16_*`: the backward's state-gradient scan.
    DhParams = "GDP_DH_FIELDS" {
        q: u64, k: u64, split: i32, table: u64, w: u64, p: u64, coef: u64, dob: u64, dht: u64,
        has_dht: i32, dhs: u64, ddn: u64, dh0: u64, write_dh0: i32, batch: i32, tokens: i32,
        heads: i32, dk: i32, dv: i32, dv_in: i32, wide_from: i32, wide_to: i32, n: i32, qr: i32,
        ns: i32, ready: u64,
        signal: u64,
    }
    /// `gdp_bwd_grads_bf16_*`: every gradient of a (chunk, head).
    GradsParams = "GDP_GRADS_FIELDS" {
        q: u64, k: u64, split: i32, v: u64, aux: u64, table: u64, ainv: u64, hs: u64, dhs: u64,
        dn: u64, ddn: u64, dob: u64, out: u64, dq: u64, dk_out: u64, dv_out: u64, dgates: u64,
        batch: i32, tokens: i32, heads: i32, dk: i32, dv: i32, n: i32, nseq: i32, scale: f32,
        qr: i32,
    }
    /// The `_pipe` gradient kernel's persistent blocks, after [`GradsParams`].
    PipeParams = "GDP_PIPE_FIELDS" {
        pipe: u64, order: u64, items: i32, ready_count: i32, beside: i32, scan_blocks: i32,
    }
    /// `gdp_cp_fix_{bf16,f32}`: a context-parallel rank's correction `x + x̃ S`.
    FixParams = "GDP_FIX_FIELDS" {
        x: u64, y: u64, s: u64, heads: i32, dk: i32, dv: i32, outer0: i64, outer_per_seq: i32,
        inner: i32,
    }
    /// `gdp_cp_widen_states`: `[x | I_K]` per (sequence, head).
    WidenParams = "GDP_WIDEN_FIELDS" {
        x: u64, out: u64, blocks: i64, dk: i32, dv: i32,
    }
    /// `gdp_fold_chains`: chains of segment summaries folded into states.
    FoldParams = "GDP_FOLD_FIELDS" {
        t: u64, s0: u64, steps: u64, chain_at: u64, rows: u64, out: u64, fin: u64, heads: i32,
        dk: i32, dv: i32, pass_cols: i32,
    }
    /// `gdp_step_{f32,bf16,f16}_k*`: one fused decode step.
    StepParams = "GDP_STEP_FIELDS" {
        state: u64, q: u64, k: u64, v: u64, g: u64, beta: u64, out: u64, batch: i32, heads: i32,
        dk: i32, dv: i32, n: i32, scale: f32,
    }
    /// `gdp_copy_rows`: rows of bytes between two strided buffers.
    CopyRowsParams = "GDP_COPY_ROWS_FIELDS" {
        src: u64, dst: u64, rows: i64, width: i64, src_ld: i64, dst_ld: i64,
    }
    /// `gdp_sum_groups_{bf16,f32}`: rows summed over groups of consecutive rows.
    SumGroupsParams = "GDP_SUM_GROUPS_FIELDS" {
        src: u64, dst: u64, rows: i64, r: i32, d: i32,
    }
    /// `gdp_f32_to_bf16`: an elementwise cast.
    CastParams = "GDP_CAST_FIELDS" {
        src: u64, dst: u64, len: i64,
    }
}

#[cfg(test)]
mod tests {
    use super::MIRRORED;

    /// The X-macro lists of `cuda/params.cuh` that declare fields: name and `(field, C type)`
    /// in order (lists made of other lists, like `GDP_GRADS_PIPE_FIELDS`, declare none).
    fn header_lists() -> Vec<(String, Vec<(String, String)>)> {
        let src = include_str!("../../cuda/params.cuh");
        let mut out: Vec<(String, Vec<(String, String)>)> = vec![];
        for line in src.lines().map(|l| l.trim().trim_end_matches('\\').trim()) {
            if let Some(rest) = line.strip_prefix("#define ") {
                if let Some((name, _)) = rest.split_once("(X, C, TY)") {
                    out.push((name.trim().to_string(), vec![]));
                }
                continue;
            }
            let Some(inner) = line.strip_prefix("X(C, ").and_then(|l| l.strip_suffix(')')) else {
                continue;
            };
            let (ty, name) = inner.rsplit_once(", ").expect("`X(C, type, name)`");
            let list = out.last_mut().expect("an X line inside a list");
            list.1.push((name.to_string(), ty.to_string()));
        }
        out.retain(|(_, fields)| !fields.is_empty());
        out
    }

    /// The Rust type that mirrors a C parameter type.
    fn rust_type(c: &str) -> &'static str {
        match c.trim_end_matches("__restrict__").trim() {
            t if t.ends_with('*') => "u64",
            "long long" => "i64",
            "int" => "i32",
            "float" => "f32",
            other => panic!("cuda/params.cuh: no mirror for the C type `{other}`"),
        }
    }

    #[test]
    fn the_mirror_matches_the_header() {
        let header = header_lists();
        let names: Vec<&str> = header.iter().map(|h| h.0.as_str()).collect();
        let mirrored: Vec<&str> = MIRRORED.iter().map(|m| m.0).collect();
        assert_eq!(
            names, mirrored,
            "lists of cuda/params.cuh vs kernel_params.rs"
        );
        for ((name, fields), (_, rust)) in header.iter().zip(MIRRORED) {
            let want: Vec<(&str, &str)> = fields
                .iter()
                .map(|(f, c)| (f.as_str(), rust_type(c)))
                .collect();
            assert_eq!(&want, rust, "fields of {name}");
        }
    }
}
