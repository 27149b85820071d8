// The kernels' parameters, declared once per kernel family as an X-macro: `FIELDS(X, C, TY)`
// calls `X(C, type, name)` for every parameter in order (`TY`: the element type of the
// dtype-generic families, `C`: a context the caller passes through). From one list come:
// - the kernel's parameter list, `GDP_KERNEL_PARAMS(FIELDS, TY)`: plain scalar and pointer
//   parameters, so that the compiler keeps treating the pointers as kernel arguments (read-only
//   loads through the non-coherent cache, arguments rematerialised from the constant bank; a
//   `__grid_constant__` struct measured 124 -> 172 registers in the forward scan and lost every
//   `ld.global.nc`);
// - a struct of the same fields, `GDP_PARAMS_STRUCT(FIELDS, TY)`, which the CPU emulator
//   (cuda/emu) and the kernel benchmark (cuda/bench) fill by name and pass with
//   `GDP_ARGS_OF(FIELDS, p)`;
// - the Rust mirror in `src/op/kernel_params.rs` (one struct per list, same names, same order;
//   a test there reads this file), whose launches push the fields in this order.
// One `X(...)` per line; types are pointers, `int`, `float` or `long long` (64-bit).
#pragma once

#define GDP_EXPAND_(...) __VA_ARGS__
#define GDP_DROP_FIRST_(first, ...) __VA_ARGS__
#define GDP_DROP_FIRST(...) GDP_DROP_FIRST_(__VA_ARGS__)
#define GDP_PARAM_(C, T, name) , T name
#define GDP_MEMBER_(C, T, name) T name;
#define GDP_FROM_(C, T, name) , C.name
// The kernel's parameter list.
#define GDP_KERNEL_PARAMS(FIELDS, TY) GDP_DROP_FIRST(FIELDS(GDP_PARAM_, _, TY))
// The members of the struct.
#define GDP_PARAMS_STRUCT(FIELDS, TY) FIELDS(GDP_MEMBER_, _, TY)
// The struct `p`'s fields as the kernel's arguments.
#define GDP_ARGS_OF(FIELDS, p) GDP_DROP_FIRST(FIELDS(GDP_FROM_, p, _))

// gdp_fwd_{f32,bf16,f16} (fused_fwd.cuh): the one-kernel forward.
#define GDP_FUSED_FWD_FIELDS(X, C, TY) \
  X(C, const TY*, qk)                  \
  X(C, const TY*, v)                   \
  X(C, const float*, aux)              \
  X(C, const int*, seqs)               \
  X(C, const float*, h0_override)      \
  X(C, int, use_h0_override)           \
  X(C, float*, out)                    \
  X(C, int, batch)                     \
  X(C, int, tokens)                    \
  X(C, int, heads)                     \
  X(C, int, dk)                        \
  X(C, int, dv)                        \
  X(C, int, n)                         \
  X(C, int, has_h0)                    \
  X(C, float, scale)                   \
  X(C, int, bv)

// gdp_bwd_{f32,bf16,f16} (gdp_bwd.cuh): the per-value-tile backward and its summary modes.
#define GDP_FUSED_BWD_FIELDS(X, C, TY) \
  X(C, const TY*, qk)                  \
  X(C, const TY*, v)                   \
  X(C, const float*, aux)              \
  X(C, const int*, table)              \
  X(C, const float*, h0)               \
  X(C, int, has_h0src)                 \
  X(C, const float*, dout)             \
  X(C, const float*, dht)              \
  X(C, float*, hs)                     \
  X(C, float*, out)                    \
  X(C, int, batch)                     \
  X(C, int, tokens)                    \
  X(C, int, heads)                     \
  X(C, int, dk)                        \
  X(C, int, dv)                        \
  X(C, int, n)                         \
  X(C, int, ext)                       \
  X(C, int, mode)                      \
  X(C, int, write_dh0)                 \
  X(C, float, scale)                   \
  X(C, int, bv)

// gdp_fwd_wy_bf16 (gdp_fwd_chunked.cuh): the WY factors of every (chunk, head).
#define GDP_WY_FIELDS(X, C, TY)                     \
  X(C, const __nv_bfloat16* __restrict__, q)        \
  X(C, const __nv_bfloat16* __restrict__, k)        \
  X(C, int, split)                                  \
  X(C, const __nv_bfloat16* __restrict__, v)        \
  X(C, const float* __restrict__, aux)              \
  X(C, const int* __restrict__, table)              \
  X(C, __nv_bfloat16* __restrict__, w)              \
  X(C, __nv_bfloat16* __restrict__, u)              \
  X(C, __nv_bfloat16* __restrict__, p)              \
  X(C, float* __restrict__, coef)                   \
  X(C, __nv_bfloat16* __restrict__, ainv)           \
  X(C, int, batch)                                  \
  X(C, int, tokens)                                 \
  X(C, int, heads)                                  \
  X(C, int, dk)                                     \
  X(C, int, dv)                                     \
  X(C, int, n)                                      \
  X(C, int, nseq)                                   \
  X(C, float, scale)                                \
  X(C, const int* __restrict__, order)              \
  X(C, int* __restrict__, ready)

// gdp_fwd_scan_bf16_* and gdp_fwd_states_bf16_* (gdp_fwd_chunked.cuh): the forward's scan.
#define GDP_SCAN_FIELDS(X, C, TY)   \
  X(C, const __nv_bfloat16*, q)     \
  X(C, const __nv_bfloat16*, k)     \
  X(C, int, split)                  \
  X(C, const float*, aux)           \
  X(C, const int*, table)           \
  X(C, const __nv_bfloat16*, w)     \
  X(C, const __nv_bfloat16*, u)     \
  X(C, const __nv_bfloat16*, p)     \
  X(C, const float*, coef)          \
  X(C, const float*, h0_override)   \
  X(C, int, use_h0_override)        \
  X(C, float*, out)                 \
  X(C, __nv_bfloat16*, outb)        \
  X(C, float*, fin)                 \
  X(C, __nv_bfloat16*, hs)          \
  X(C, __nv_bfloat16*, dn)          \
  X(C, int, batch)                  \
  X(C, int, tokens)                 \
  X(C, int, heads)                  \
  X(C, int, dk)                     \
  X(C, int, dv)                     \
  X(C, int, dv_in)                  \
  X(C, int, wide_from)              \
  X(C, int, wide_to)                \
  X(C, int, n)                      \
  X(C, int, has_h0)                 \
  X(C, int, qr)                     \
  X(C, int, ns)                     \
  X(C, const int*, ready)

// gdp_bwd_dh_bf16_* (gdp_bwd_chunked.cuh): the backward's state-gradient scan.
#define GDP_DH_FIELDS(X, C, TY)     \
  X(C, const __nv_bfloat16*, q)     \
  X(C, const __nv_bfloat16*, k)     \
  X(C, int, split)                  \
  X(C, const int*, table)           \
  X(C, const __nv_bfloat16*, w)     \
  X(C, const __nv_bfloat16*, p)     \
  X(C, const float*, coef)          \
  X(C, const __nv_bfloat16*, dob)   \
  X(C, const float*, dht)           \
  X(C, int, has_dht)                \
  X(C, __nv_bfloat16*, dhs)         \
  X(C, __nv_bfloat16*, ddn)         \
  X(C, float*, dh0)                 \
  X(C, int, write_dh0)              \
  X(C, int, batch)                  \
  X(C, int, tokens)                 \
  X(C, int, heads)                  \
  X(C, int, dk)                     \
  X(C, int, dv)                     \
  X(C, int, dv_in)                  \
  X(C, int, wide_from)              \
  X(C, int, wide_to)                \
  X(C, int, n)                      \
  X(C, int, qr)                     \
  X(C, int, ns)                     \
  X(C, const int*, ready)           \
  X(C, int*, signal)

// gdp_bwd_grads_bf16_* (gdp_bwd_chunked.cuh): every gradient of a (chunk, head).
#define GDP_GRADS_FIELDS(X, C, TY)  \
  X(C, const __nv_bfloat16*, q)     \
  X(C, const __nv_bfloat16*, k)     \
  X(C, int, split)                  \
  X(C, const __nv_bfloat16*, v)     \
  X(C, const float*, aux)           \
  X(C, const int*, table)           \
  X(C, const __nv_bfloat16*, ainv)  \
  X(C, const __nv_bfloat16*, hs)    \
  X(C, const __nv_bfloat16*, dhs)   \
  X(C, const __nv_bfloat16*, dn)    \
  X(C, const __nv_bfloat16*, ddn)   \
  X(C, const __nv_bfloat16*, dob)   \
  X(C, float*, out)                 \
  X(C, __nv_bfloat16*, dq)          \
  X(C, __nv_bfloat16*, dk_out)      \
  X(C, __nv_bfloat16*, dv_out)      \
  X(C, float*, dgates)              \
  X(C, int, batch)                  \
  X(C, int, tokens)                 \
  X(C, int, heads)                  \
  X(C, int, dk)                     \
  X(C, int, dv)                     \
  X(C, int, n)                      \
  X(C, int, nseq)                   \
  X(C, float, scale)                \
  X(C, int, qr)

// gdp_bwd_grads_bf16_128_128_tiles_pipe: GDP_GRADS_FIELDS, then its persistent blocks' pipe.
#define GDP_PIPE_FIELDS(X, C, TY) \
  X(C, int*, pipe)                \
  X(C, const int*, order)         \
  X(C, int, items)                \
  X(C, int, ready_count)          \
  X(C, int, beside)               \
  X(C, int, scan_blocks)
#define GDP_GRADS_PIPE_FIELDS(X, C, TY) GDP_GRADS_FIELDS(X, C, TY) GDP_PIPE_FIELDS(X, C, TY)

// gdp_cp_fix_{bf16,f32} (cp_fix.cuh): a context-parallel rank's correction x + x~ S; TY is
// the output's element type.
#define GDP_FIX_FIELDS(X, C, TY)    \
  X(C, const __nv_bfloat16*, x)     \
  X(C, TY*, y)                      \
  X(C, const float*, s)             \
  X(C, int, heads)                  \
  X(C, int, dk)                     \
  X(C, int, dv)                     \
  X(C, long long, outer0)           \
  X(C, int, outer_per_seq)          \
  X(C, int, inner)

// gdp_cp_widen_states (cp_fix.cuh): [x | I_K] per (sequence, head).
#define GDP_WIDEN_FIELDS(X, C, TY)       \
  X(C, const float* __restrict__, x)     \
  X(C, float* __restrict__, out)         \
  X(C, long long, blocks)                \
  X(C, int, dk)                          \
  X(C, int, dv)

// gdp_fold_chains (cp_fix.cuh): chains of summaries `[x⁰ | x̃]` folded into states.
#define GDP_FOLD_FIELDS(X, C, TY)        \
  X(C, const float* __restrict__, t)     \
  X(C, const float* __restrict__, s0)    \
  X(C, const int* __restrict__, steps)   \
  X(C, const int* __restrict__, chain_at) \
  X(C, const int* __restrict__, rows)    \
  X(C, float* __restrict__, out)         \
  X(C, float* __restrict__, fin)         \
  X(C, int, heads)                       \
  X(C, int, dk)                          \
  X(C, int, dv)                          \
  X(C, int, pass_cols)

// gdp_step_{f32,bf16,f16}_k* (step.cuh): one fused decode step.
#define GDP_STEP_FIELDS(X, C, TY) \
  X(C, const float*, state)       \
  X(C, const TY*, q)              \
  X(C, const TY*, k)              \
  X(C, const TY*, v)              \
  X(C, const float*, g)           \
  X(C, const float*, beta)        \
  X(C, float*, out)               \
  X(C, int, batch)                \
  X(C, int, heads)                \
  X(C, int, dk)                   \
  X(C, int, dv)                   \
  X(C, int, n)                    \
  X(C, float, scale)

// gdp_copy_rows (copy.cuh): rows of bytes between two strided buffers.
#define GDP_COPY_ROWS_FIELDS(X, C, TY)            \
  X(C, const unsigned char* __restrict__, src)    \
  X(C, unsigned char* __restrict__, dst)          \
  X(C, long long, rows)                           \
  X(C, long long, width)                          \
  X(C, long long, src_ld)                         \
  X(C, long long, dst_ld)

// gdp_sum_groups_{bf16,f32} (copy.cuh): `rows` rows of `d` values, each the f32 sum of
// `r` consecutive source rows, rounded to TY.
#define GDP_SUM_GROUPS_FIELDS(X, C, TY)  \
  X(C, const TY* __restrict__, src)      \
  X(C, TY* __restrict__, dst)            \
  X(C, long long, rows)                  \
  X(C, int, r)                           \
  X(C, int, d)

// gdp_f32_to_bf16 (gdp_bwd_chunked.cuh): an elementwise cast.
#define GDP_CAST_FIELDS(X, C, TY)          \
  X(C, const float* __restrict__, src)     \
  X(C, __nv_bfloat16* __restrict__, dst)   \
  X(C, long long, len)

// The structs the emulator and the benchmark fill (TY-generic families as templates).
template <class TY>
struct GdpFusedFwdParams {
  GDP_PARAMS_STRUCT(GDP_FUSED_FWD_FIELDS, TY)
};
template <class TY>
struct GdpFusedBwdParams {
  GDP_PARAMS_STRUCT(GDP_FUSED_BWD_FIELDS, TY)
};
struct GdpWyParams {
  GDP_PARAMS_STRUCT(GDP_WY_FIELDS, _)
};
struct GdpScanParams {
  GDP_PARAMS_STRUCT(GDP_SCAN_FIELDS, _)
};
struct GdpDhParams {
  GDP_PARAMS_STRUCT(GDP_DH_FIELDS, _)
};
struct GdpGradsParams {
  GDP_PARAMS_STRUCT(GDP_GRADS_FIELDS, _)
};
struct GdpGradsPipeParams {
  GDP_PARAMS_STRUCT(GDP_GRADS_PIPE_FIELDS, _)
};
template <class TY>
struct GdpFixParams {
  GDP_PARAMS_STRUCT(GDP_FIX_FIELDS, TY)
};
struct GdpWidenParams {
  GDP_PARAMS_STRUCT(GDP_WIDEN_FIELDS, _)
};
struct GdpFoldParams {
  GDP_PARAMS_STRUCT(GDP_FOLD_FIELDS, _)
};
template <class TY>
struct GdpStepParams {
  GDP_PARAMS_STRUCT(GDP_STEP_FIELDS, TY)
};
struct GdpCopyRowsParams {
  GDP_PARAMS_STRUCT(GDP_COPY_ROWS_FIELDS, _)
};
template <class TY>
struct GdpSumGroupsParams {
  GDP_PARAMS_STRUCT(GDP_SUM_GROUPS_FIELDS, TY)
};
struct GdpCastParams {
  GDP_PARAMS_STRUCT(GDP_CAST_FIELDS, _)
};
