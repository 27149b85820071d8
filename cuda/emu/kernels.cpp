// Checks the CUDA kernels of cuda/ on the CPU (cuda/emu/emu.h) against a float64 token-by-token
// reference: the f32 forward and backward (every gradient), the two CP summaries, the bf16
// forwards (one-kernel and two-kernel) and the split bf16 backward (every gradient), the decode
// step, context parallelism's row correction and widened states and the segments' fold
// (cp_fix.cuh), and the forward and backward in segments of long sequences. Build and run:
// `sh cuda/emu/run.sh` (C++20 compiler).
#include "gdp.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

thread_local dim3 threadIdx;
dim3 blockIdx, blockDim, gridDim;
EmuBlock* g_block;
alignas(16) unsigned char smem_raw[256 * 1024];
alignas(16) unsigned char gdpb_smem[256 * 1024];
alignas(16) unsigned char gdpc_smem[256 * 1024];
alignas(16) unsigned char gdpcs_smem[256 * 1024];
alignas(16) unsigned char gdpg_smem[256 * 1024];
alignas(16) unsigned char gdps_smem[48 * 1024];
// cp_fix.cuh's correction kernel (run_cp_fix).
alignas(16) unsigned char gdp_fix_smem[256 * 1024];
// gdp_fold_chains (run_fold, and the folds of the op in segments), passes of x̃ up to
// g_fold_pass key columns (what an H100's shared memory takes at K = 256: 128).
alignas(16) unsigned char gdp_fold_smem[gdp_fold_smem_bytes(GDP_FOLD_MAX_K, 128)];
static int g_fold_pass = 128;

static bool g_reverse = false;
// `f32dg`: run_case checks only the f32 backward (no forward, no summaries).
static bool g_bwd_only = false;

// Runs `f` as the kernel body for every block of the grid (gx, gy, gz), one std::thread per
// CUDA thread.
template <class F>
void launch(unsigned gx, unsigned gy, int nthr, F f, unsigned gz = 1) {
  for (unsigned z = 0; z < gz; ++z)
  for (unsigned y = 0; y < gy; ++y)
    for (unsigned x = 0; x < gx; ++x) {
      blockIdx.x = x;
      blockIdx.y = y;
      blockIdx.z = z;
      blockDim.x = nthr;
      gridDim.x = gx;
      gridDim.y = gy;
      gridDim.z = gz;
      // Poison shared memory (large floats): a read of something nothing wrote shows.
      memset(smem_raw, 0x7f, sizeof(smem_raw));
      memset(gdpb_smem, 0x7f, sizeof(gdpb_smem));
      memset(gdpc_smem, 0x7f, sizeof(gdpc_smem));
      memset(gdpcs_smem, 0x7f, sizeof(gdpcs_smem));
      memset(gdpg_smem, 0x7f, sizeof(gdpg_smem));
      memset(gdp_fix_smem, 0x7f, sizeof(gdp_fix_smem));
      memset(gdp_fold_smem, 0x7f, sizeof(gdp_fold_smem));
      EmuBlock blk;
      blk.sync = std::make_unique<std::barrier<>>(nthr);
      for (int w = 0; w < nthr / 32; ++w) blk.warps.push_back(std::make_unique<std::barrier<>>(32));
      blk.frag_a.assign(2 * nthr * 4, 0);
      blk.frag_b.assign(2 * nthr * 2, 0);
      blk.ldsm_rows.assign(2 * nthr, nullptr);
      blk.shfl.assign(2 * nthr, 0.f);
      g_block = &blk;
      std::vector<std::thread> ts;
      for (int t = 0; t < nthr; ++t)
        ts.emplace_back([&, t] {
          threadIdx.x = g_reverse ? nthr - 1 - t : t;
          f();
        });
      for (auto& t : ts) t.join();
    }
}

struct Seq { int b, start, len; };
// grp: value heads per key head (grouped value heads): the queries and keys of heads
// h = j·grp .. j·grp + grp − 1 are the same (key head j), so that the packed qk with H heads is
// the problem's expansion, and the kernels reading q, k in place read Hk = H / grp heads.
struct Case { const char* name; int B, T, H, K, V, n; bool h0; std::vector<int> cu; float gmax; int BV; int grp = 1; };

struct Prob {
  Case c; std::vector<Seq> seqs; int N; long BTH;
  std::vector<float> qk, v, aux, dout, dht;
};

Prob make(const Case& c, unsigned seed) {
  Prob p; p.c = c;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0, 1);
  std::uniform_real_distribution<float> ud(0, 1);
  if (c.cu.empty()) for (int b = 0; b < c.B; ++b) p.seqs.push_back({b, 0, c.T});
  else for (size_t i = 0; i + 1 < c.cu.size(); ++i) p.seqs.push_back({0, c.cu[i], c.cu[i + 1] - c.cu[i]});
  p.N = p.seqs.size();
  p.BTH = (long)c.B * c.T * c.H;
  long K = c.K, V = c.V, n = c.n;
  p.qk.resize(p.BTH * (n + 1) * K);
  for (long r = 0; r < p.BTH * (n + 1); ++r) {
    double s = 0; for (int k = 0; k < K; ++k) { float x = nd(rng); p.qk[r * K + k] = x; s += x * x; }
    for (int k = 0; k < K; ++k) p.qk[r * K + k] /= sqrt(s);
  }
  // Grouped heads: every head a copy of the first of its group (rows are [.., H, K]).
  for (long r = 0; c.grp > 1 && r < p.BTH * (n + 1); ++r)
    if (long h = r % c.H; h % c.grp != 0)
      std::copy_n(&p.qk[(r - h % c.grp) * K], K, &p.qk[r * K]);
  p.v.resize(p.BTH * n * V); for (auto& x : p.v) x = nd(rng);
  long sl = (long)p.N * c.H * K * V;
  p.aux.resize(p.BTH * (1 + n) + (c.h0 ? sl : 0));
  for (long i = 0; i < p.BTH; ++i) p.aux[i] = ud(rng) < 0.2 ? 0.f : -ud(rng) * c.gmax;
  for (long i = 0; i < p.BTH * n; ++i) p.aux[p.BTH + i] = 2.f / (1.f + expf(-nd(rng)));
  if (c.h0) for (long i = 0; i < sl; ++i) p.aux[p.BTH * (1 + n) + i] = 0.5f * nd(rng);
  p.dout.resize(p.BTH * V); for (auto& x : p.dout) x = nd(rng);
  p.dht.resize(sl); for (auto& x : p.dht) x = nd(rng);
  return p;
}

// Naive f64 reference on one (seq, head). h0s/dhts: K*V (or null = zeros). Fills o (global),
// final state, and the gradients in the packed output layout.
struct Ref { std::vector<double> o, fin, grads; };
void naive(const Prob& P, const double* h0all, const double* dhtall, Ref& R, bool want_bwd,
           std::vector<int> only = {}) {
  const Case& c = P.c; long K = c.K, V = c.V, n = c.n, H = c.H, T = c.T;
  long BTH = P.BTH, qk_len = BTH * (n + 1) * K, v_len = BTH * n * V;
  R.o.assign(BTH * V, 0); R.fin.assign((long)P.N * H * K * V, 0);
  R.grads.assign(qk_len + v_len + BTH * (1 + n) + (long)P.N * H * K * V, 0);
  double scale = 1.0 / sqrt((double)K);
  for (int si = 0; si < P.N; ++si) for (int h = 0; h < H; ++h) {
    const Seq& sq = P.seqs[si]; long tok0 = (long)sq.b * T + sq.start; long rows = (long)sq.len * n;
    long slot = ((long)si * H + h) * K * V;
    auto kp = [&](long p) { long tok = tok0 + p / n; return &P.qk[((tok * (n + 1) + 1 + p % n) * H + h) * K]; };
    auto qp = [&](long t) { long tok = tok0 + t; return &P.qk[((tok * (n + 1)) * H + h) * K]; };
    auto vrow = [&](long p) { return ((tok0 * n + p) * H + h); };
    std::vector<double> S(K * V, 0.0);
    if (h0all) for (long i = 0; i < K * V; ++i) S[i] = h0all[slot + i];
    std::vector<std::vector<double>> st(rows), dl(rows);
    for (long p = 0; p < rows; ++p) {
      long tok = tok0 + p / n;
      if (p % n == 0) { double gt = exp((double)P.aux[tok * H + h]); for (auto& e : S) e *= gt; }
      const float* k = kp(p); long r = vrow(p); double b = P.aux[BTH + r];
      std::vector<double> d(V);
      for (long cc = 0; cc < V; ++cc) { double pr = 0; for (long kk = 0; kk < K; ++kk) pr += S[kk * V + cc] * k[kk]; d[cc] = b * (P.v[r * V + cc] - pr); }
      st[p] = S; dl[p] = d;
      for (long kk = 0; kk < K; ++kk) for (long cc = 0; cc < V; ++cc) S[kk * V + cc] += k[kk] * d[cc];
      if (p % n == n - 1) { const float* q = qp(p / n); for (long cc = 0; cc < V; ++cc) { double a = 0; for (long kk = 0; kk < K; ++kk) a += S[kk * V + cc] * q[kk]; R.o[(tok * H + h) * V + cc] = scale * a; } }
    }
    for (long i = 0; i < K * V; ++i) R.fin[slot + i] = S[i];
    if (!want_bwd) continue;
    std::vector<double> ds(K * V, 0.0);
    if (dhtall) for (long i = 0; i < K * V; ++i) ds[i] = dhtall[slot + i];
    double* G = R.grads.data();
    for (long p = rows - 1; p >= 0; --p) {
      long tok = tok0 + p / n; const float* k = kp(p); long r = vrow(p); double b = P.aux[BTH + r];
      auto& s = st[p]; auto& d = dl[p];
      if (p % n == n - 1) {
        const float* q = qp(p / n); const float* dO = &P.dout[(tok * H + h) * V];
        long qoff = ((tok * (n + 1)) * H + h) * K;
        for (long kk = 0; kk < K; ++kk) { double a = 0; for (long cc = 0; cc < V; ++cc) { double sp = s[kk * V + cc] + k[kk] * d[cc]; a += sp * dO[cc]; ds[kk * V + cc] += scale * q[kk] * dO[cc]; } G[qoff + kk] = scale * a; }
      }
      std::vector<double> dd(V, 0), pred(V, 0);
      for (long cc = 0; cc < V; ++cc) for (long kk = 0; kk < K; ++kk) { dd[cc] += ds[kk * V + cc] * k[kk]; pred[cc] += s[kk * V + cc] * k[kk]; }
      long koff = ((tok * (n + 1) + 1 + p % n) * H + h) * K;
      for (long kk = 0; kk < K; ++kk) { double a = 0; for (long cc = 0; cc < V; ++cc) a += ds[kk * V + cc] * d[cc]; G[koff + kk] = a; }
      for (long cc = 0; cc < V; ++cc) G[qk_len + r * V + cc] = b * dd[cc];
      double db = 0; for (long cc = 0; cc < V; ++cc) db += (P.v[r * V + cc] - pred[cc]) * dd[cc];
      G[qk_len + v_len + BTH + r] = db;
      for (long kk = 0; kk < K; ++kk) { double a = 0; for (long cc = 0; cc < V; ++cc) { double dr = -b * dd[cc]; ds[kk * V + cc] += k[kk] * dr; a += s[kk * V + cc] * dr; } G[koff + kk] += a; }
      if (p % n == 0) { double gt = exp((double)P.aux[tok * H + h]); double a = 0; for (long i = 0; i < K * V; ++i) a += s[i] * ds[i]; G[qk_len + v_len + tok * H + h] = a; for (auto& e : ds) e *= gt; }
    }
    for (long i = 0; i < K * V; ++i) G[qk_len + v_len + BTH * (1 + n) + slot + i] = ds[i];
  }
}

double rel(const float* a, const double* b, long len) {
  double num = 0, den = 0; for (long i = 0; i < len; ++i) { double d = a[i] - b[i]; num += d * d; den += b[i] * b[i]; }
  if (!(num == num)) return 1e9;
  return den == 0 ? sqrt(num) : sqrt(num / den);
}

int fails = 0;
void report(const char* cn, const char* what, double e, double tol) {
  printf("%-26s %-8s %.2e %s\n", cn, what, e, e <= tol ? "" : "  <-- FAIL");
  if (!(e <= tol)) ++fails;
}

void run_case(const Case& c) {
  Prob P = make(c, 1234 + c.K + c.T);
  long K = c.K, V = c.V, n = c.n, H = c.H, N = P.N, BTH = P.BTH;
  long qk_len = BTH * (n + 1) * K, v_len = BTH * n * V, sl = N * H * K * V;
  std::vector<double> h0d, dhtd(P.dht.begin(), P.dht.end());
  if (c.h0) h0d.assign(P.aux.begin() + BTH * (1 + n), P.aux.end());
  Ref R; naive(P, c.h0 ? h0d.data() : nullptr, dhtd.data(), R, true);
  // table
  std::vector<int> tab; int coff = 0;
  for (int s = 0; s < N; ++s) { tab.insert(tab.end(), {P.seqs[s].b, P.seqs[s].start, P.seqs[s].len, s, coff}); coff += (P.seqs[s].len * n + 63) / 64; }
  int BV = c.BV; unsigned gy = (V + BV - 1) / BV;
  // forward kernel sanity
  if (!g_bwd_only) {
    std::vector<int> s3; for (auto& s : P.seqs) s3.insert(s3.end(), {s.b, s.start, s.len});
    std::vector<float> out(BTH * V + sl, 0.f);
    float scale = 1.f / sqrtf((float)K);
    GdpFusedFwdParams<float> fp{};
    fp.qk = P.qk.data(); fp.v = P.v.data(); fp.aux = P.aux.data(); fp.seqs = s3.data();
    fp.h0_override = P.aux.data(); fp.use_h0_override = 0; fp.out = out.data();
    fp.batch = c.B; fp.tokens = c.T; fp.heads = c.H; fp.dk = c.K; fp.dv = c.V; fp.n = c.n;
    fp.has_h0 = c.h0; fp.scale = scale; fp.bv = BV;
    launch(N * H, gy, 256, [&] { gdp_fwd_f32(GDP_ARGS_OF(GDP_FUSED_FWD_FIELDS, fp)); });
    report(c.name, "fwd o", rel(out.data(), R.o.data(), BTH * V), 1e-5);
    report(c.name, "fwd ht", rel(out.data() + BTH * V, R.fin.data(), sl), 1e-5);
  }
  std::vector<float> hs((long)coff * H * K * V + 1);
  long total = qk_len + v_len + BTH * (1 + n) + (c.h0 ? sl : 0);
  std::vector<float> out(total, 0.f);
  float scale = 1.f / sqrtf((float)K);
  // The backward's parameters (the summaries below change ext, mode and the buffers).
  GdpFusedBwdParams<float> bp{};
  bp.qk = P.qk.data(); bp.v = P.v.data(); bp.aux = P.aux.data(); bp.table = tab.data();
  bp.h0 = c.h0 ? P.aux.data() + BTH * (1 + n) : P.aux.data(); bp.dout = P.dout.data();
  bp.dht = P.dht.data(); bp.hs = hs.data(); bp.out = out.data(); bp.has_h0src = c.h0;
  bp.batch = c.B; bp.tokens = c.T; bp.heads = c.H; bp.dk = c.K; bp.dv = c.V; bp.n = c.n;
  bp.ext = 0; bp.mode = GDPB_FULL; bp.write_dh0 = c.h0; bp.scale = scale; bp.bv = BV;
  launch(N * H, gy, 256, [&] { gdp_bwd_f32(GDP_ARGS_OF(GDP_FUSED_BWD_FIELDS, bp)); });
  // dq / dk separately
  std::vector<float> gq, gk; std::vector<double> rq, rk;
  for (long tk = 0; tk < BTH / H; ++tk) for (long s = 0; s <= n; ++s) for (long h = 0; h < H; ++h) for (long kk = 0; kk < K; ++kk) {
    long i = ((tk * (n + 1) + s) * H + h) * K + kk;
    if (s == 0) { gq.push_back(out[i]); rq.push_back(R.grads[i]); } else { gk.push_back(out[i]); rk.push_back(R.grads[i]); }
  }
  report(c.name, "dq", rel(gq.data(), rq.data(), gq.size()), 1e-5);
  report(c.name, "dk", rel(gk.data(), rk.data(), gk.size()), 1e-5);
  report(c.name, "dv", rel(out.data() + qk_len, R.grads.data() + qk_len, v_len), 1e-5);
  report(c.name, "dg", rel(out.data() + qk_len + v_len, R.grads.data() + qk_len + v_len, BTH), 1e-5);
  report(c.name, "dbeta", rel(out.data() + qk_len + v_len + BTH, R.grads.data() + qk_len + v_len + BTH, BTH * n), 1e-5);
  if (c.h0) report(c.name, "dh0", rel(out.data() + qk_len + v_len + BTH * (1 + n), R.grads.data() + qk_len + v_len + BTH * (1 + n), sl), 1e-5);

  // Summaries over every sequence of the table: forward with h0 = 0 -> [N(v) | M]; check
  // M s1 + N == naive final from s1 (random s1 = the dht buffer as a state).
  if (!g_bwd_only) {
    long Vw = V + K; unsigned gyw = (Vw + BV - 1) / BV;
    std::vector<float> sum(N * H * K * Vw, -7.f);
    GdpFusedBwdParams<float> fs = bp;
    fs.h0 = P.aux.data(); fs.has_h0src = 0; fs.dht = P.dht.data(); fs.out = sum.data();
    fs.ext = c.K; fs.mode = GDPB_FWD_SUM; fs.write_dh0 = 0;
    launch(N * H, gyw, 256, [&] { gdp_bwd_f32(GDP_ARGS_OF(GDP_FUSED_BWD_FIELDS, fs)); });
    Ref R1; naive(P, dhtd.data(), nullptr, R1, false);
    std::vector<float> got(sl);
    for (long sh = 0; sh < N * H; ++sh) {
      const float* Pm = &sum[sh * K * Vw];
      for (long r = 0; r < K; ++r) for (long cc = 0; cc < V; ++cc) {
        double a = Pm[r * Vw + cc];
        for (long m = 0; m < K; ++m) a += Pm[r * Vw + V + m] * P.dht[sh * K * V + m * V + cc];
        got[sh * K * V + r * V + cc] = a;
      }
    }
    report(c.name, "fwd sum", rel(got.data(), R1.fin.data(), sl), 1e-5);
    // backward summary with dht = 0 -> [γ | Mᵀ]; γ + Mᵀ dht == naive dh0 with dht (h0 irrelevant).
    std::vector<float> zeros(sl, 0.f);
    std::fill(sum.begin(), sum.end(), -7.f);
    GdpFusedBwdParams<float> bs = fs;
    bs.dht = zeros.data(); bs.mode = GDPB_BWD_SUM;
    launch(N * H, gyw, 256, [&] { gdp_bwd_f32(GDP_ARGS_OF(GDP_FUSED_BWD_FIELDS, bs)); });
    for (long sh = 0; sh < N * H; ++sh) {
      const float* Pm = &sum[sh * K * Vw];
      for (long r = 0; r < K; ++r) for (long cc = 0; cc < V; ++cc) {
        double a = Pm[r * Vw + cc];
        for (long m = 0; m < K; ++m) a += Pm[r * Vw + V + m] * P.dht[sh * K * V + m * V + cc];
        got[sh * K * V + r * V + cc] = a;
      }
    }
    long o = qk_len + v_len + BTH * (1 + n);
    report(c.name, "bwd sum", rel(got.data(), R.grads.data() + o, sl), 1e-5);
  }
}

// The table of the split bf16 kernels: per sequence (batch, start, len, first chunk), then per
// chunk (sequence, index); `total` gets the number of chunks.
static std::vector<int> chunk_table(const Prob& P, long& total) {
  std::vector<int> tab, chunks;
  for (int si = 0; si < P.N; ++si) {
    const int nch = (P.seqs[si].len * P.c.n + 63) / 64;
    tab.insert(tab.end(), {P.seqs[si].b, P.seqs[si].start, P.seqs[si].len, (int)chunks.size() / 2});
    for (int ci = 0; ci < nch; ++ci) chunks.insert(chunks.end(), {si, ci});
  }
  total = chunks.size() / 2;
  tab.insert(tab.end(), chunks.begin(), chunks.end());
  return tab;
}

// The WY kernel's chunk order as the op builds it (GdpShape::chunks_time_major and
// chunks_from_the_end in src/op/shape.rs): every sequence's d-th chunk for d = 0, 1, ...,
// counted from the sequence's start, or from its end; ids of chunk_table's table `tab`.
static std::vector<int> wy_chunk_order(const Prob& P, const std::vector<int>& tab, bool from_end) {
  auto nch = [&](int si) { return (P.seqs[si].len * P.c.n + 63) / 64; };
  int most = 0;
  for (int si = 0; si < P.N; ++si) most = std::max(most, nch(si));
  std::vector<int> order;
  for (int d = 0; d < most; ++d)
    for (int si = 0; si < P.N; ++si)
      if (d < nch(si)) order.push_back(tab[4 * si + 3] + (from_end ? nch(si) - 1 - d : d));
  return order;
}

// Rounds `x` to bf16 in place (so that the f64 reference sees the kernel's inputs) and returns
// the bf16 copy.
static std::vector<__nv_bfloat16> to_bf16(std::vector<float>& x) {
  std::vector<__nv_bfloat16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = __float2bfloat16_rn(x[i]);
    x[i] = __bfloat162float(out[i]);
  }
  return out;
}

// FLA's separate q [B·T, Hk, K] and k [B·T·n, Hk, K] cut out of a packed qk [B·T, n+1, H, K]:
// heads 0, grp, 2·grp, ... (Hk = H / grp; the others are copies, `make`).
struct SplitQk {
  std::vector<__nv_bfloat16> q, k;
  int grp;
  SplitQk(const std::vector<__nv_bfloat16>& qk, long BT, long n, long H, long K, int grp_ = 1)
      : grp(grp_) {
    for (long tk = 0; tk < BT; ++tk)
      for (long s = 0; s <= n; ++s)
        for (long h = 0; h < H; h += grp) {
          const auto* row = &qk[((tk * (n + 1) + s) * H + h) * K];
          (s == 0 ? q : k).insert((s == 0 ? q : k).end(), row, row + K);
        }
  }
};

// The kernels' (q, k, split) parameters for the packed qk or for `sq` (split = its group size).
struct QkArgs {
  const __nv_bfloat16 *q, *k;
  int split;
};
static QkArgs qk_args(const std::vector<__nv_bfloat16>& qk, const SplitQk& sq, bool split,
                      long H, long K) {
  return split ? QkArgs{sq.q.data(), sq.k.data(), sq.grp}
               : QkArgs{qk.data(), qk.data() + H * K, 0};
}

// The WY kernel's parameters (ainv, order, ready may be null).
static GdpWyParams wy_params(const Prob& P, const QkArgs& a, const std::vector<__nv_bfloat16>& vb,
                             const std::vector<int>& tab, std::vector<__nv_bfloat16>& wg,
                             std::vector<__nv_bfloat16>& ug, std::vector<__nv_bfloat16>& pg,
                             std::vector<float>& cg, __nv_bfloat16* ainv, float scale,
                             const int* order, int* ready) {
  const Case& c = P.c;
  GdpWyParams p{};
  p.q = a.q; p.k = a.k; p.v = vb.data(); p.aux = P.aux.data(); p.table = tab.data();
  p.w = wg.data(); p.u = ug.data(); p.p = pg.data(); p.coef = cg.data(); p.ainv = ainv;
  p.order = order; p.ready = ready; p.split = a.split; p.batch = c.B; p.tokens = c.T;
  p.heads = c.H; p.dk = c.K; p.dv = c.V; p.n = c.n; p.nseq = P.N; p.scale = scale;
  return p;
}

// The forward scan's (and the states-only kernel's) parameters: h0 from aux where the case has
// one, no override.
static GdpScanParams scan_params(const Prob& P, const QkArgs& a, const std::vector<int>& tab,
                                 const std::vector<__nv_bfloat16>& wg,
                                 const std::vector<__nv_bfloat16>& ug,
                                 const std::vector<__nv_bfloat16>& pg,
                                 const std::vector<float>& cg, float* out, __nv_bfloat16* outb,
                                 float* fin, __nv_bfloat16* hs, __nv_bfloat16* dn, int qr, int ns,
                                 const int* ready) {
  const Case& c = P.c;
  GdpScanParams p{};
  p.q = a.q; p.k = a.k; p.aux = P.aux.data(); p.table = tab.data(); p.w = wg.data();
  p.u = ug.data(); p.p = pg.data(); p.coef = cg.data(); p.h0_override = P.aux.data();
  p.out = out; p.outb = outb; p.fin = fin; p.hs = hs; p.dn = dn; p.ready = ready;
  p.split = a.split; p.use_h0_override = 0; p.batch = c.B; p.tokens = c.T; p.heads = c.H;
  p.dk = c.K; p.dv = c.V; p.dv_in = c.V; p.wide_from = 0; p.wide_to = P.N; p.n = c.n;
  p.has_h0 = c.h0; p.qr = qr; p.ns = ns;
  return p;
}

// The kernel PREFIX_<bv>_<KPT> called with ARGS, for the tiles every scan has (BV 16, 32, 64;
// KPT 64, 128); each launcher adds its own others.
#define GDP_EMU_SCAN_TILES(PREFIX, ARGS)            \
  if (bv == 16 && KPT == 64) PREFIX##_16_64(ARGS);   \
  if (bv == 16 && KPT == 128) PREFIX##_16_128(ARGS); \
  if (bv == 32 && KPT == 64) PREFIX##_32_64(ARGS);   \
  if (bv == 32 && KPT == 128) PREFIX##_32_128(ARGS); \
  if (bv == 64 && KPT == 64) PREFIX##_64_64(ARGS);   \
  if (bv == 64 && KPT == 128) PREFIX##_64_128(ARGS);

// Launches the forward scan gdp_fwd_scan_bf16_<bv>_<KPT> with `sp` over `rows` (sequence,
// head) blocks and `cols` value columns.
static void launch_fwd_scan(const GdpScanParams& sp, long rows, long cols, int bv, int KPT) {
  launch(rows, (cols + bv - 1) / bv, bv == 16 ? 128 : 256, [&] {
#define ARGS GDP_ARGS_OF(GDP_SCAN_FIELDS, sp)
    GDP_EMU_SCAN_TILES(gdp_fwd_scan_bf16, ARGS)
    if (bv == 16 && KPT == 256) gdp_fwd_scan_bf16_16_256(ARGS);
    if (bv == 32 && KPT == 256) gdp_fwd_scan_bf16_32_256(ARGS);
#undef ARGS
  });
}

// Launches the states-only rerun gdp_fwd_states_bf16_<bv>_<KPT> with `sp` over `rows`
// (sequence, head) blocks and `cols` value columns.
static void launch_states_scan(const GdpScanParams& sp, long rows, long cols, int bv, int KPT) {
  launch(rows, (cols + bv - 1) / bv, bv == 16 ? 128 : 256, [&] {
#define ARGS GDP_ARGS_OF(GDP_SCAN_FIELDS, sp)
    GDP_EMU_SCAN_TILES(gdp_fwd_states_bf16, ARGS)
    if (bv == 128 && KPT == 64) gdp_fwd_states_bf16_128_64(ARGS);
    if (bv == 128 && KPT == 128) gdp_fwd_states_bf16_128_128(ARGS);
#undef ARGS
  });
}

// Launches the state-gradient scan gdp_bwd_dh_bf16_<bv>_<KPT> with `dp` over `rows` (sequence,
// head) blocks and `cols` value columns.
static void launch_dh_scan(const GdpDhParams& dp, long rows, long cols, int bv, int KPT) {
  launch(rows, (cols + bv - 1) / bv, bv == 16 ? 128 : 256, [&] {
#define ARGS GDP_ARGS_OF(GDP_DH_FIELDS, dp)
    GDP_EMU_SCAN_TILES(gdp_bwd_dh_bf16, ARGS)
    if (bv == 128 && KPT == 64) gdp_bwd_dh_bf16_128_64(ARGS);
    if (bv == 128 && KPT == 128) gdp_bwd_dh_bf16_128_128(ARGS);
#undef ARGS
  });
}

// The bf16 forwards: gdp_fwd_bf16 (one kernel) and gdp_fwd_wy_bf16 + gdp_fwd_scan_bf16 (two
// kernels, BV = 32 and 64) against the f64 reference on the bf16-rounded inputs.
void run_bf16(const Case& c) {
  Prob P = make(c, 4321 + c.K + c.T);
  const auto qkb = to_bf16(P.qk);
  const auto vb = to_bf16(P.v);
  const long K = c.K, V = c.V, n = c.n, H = c.H, N = P.N, BTH = P.BTH, sl = N * H * K * V;
  std::vector<double> h0d;
  if (c.h0) h0d.assign(P.aux.begin() + BTH * (1 + n), P.aux.end());
  Ref R;
  naive(P, c.h0 ? h0d.data() : nullptr, nullptr, R, false);
  const float scale = 1.f / sqrtf((float)K);
  std::vector<int> s3;
  for (auto& q : P.seqs) s3.insert(s3.end(), {q.b, q.start, q.len});
  std::vector<float> fused(BTH * V + sl, 0.f);
  GdpFusedFwdParams<__nv_bfloat16> fp{};
  fp.qk = qkb.data(); fp.v = vb.data(); fp.aux = P.aux.data(); fp.seqs = s3.data();
  fp.h0_override = P.aux.data(); fp.use_h0_override = 0; fp.out = fused.data();
  fp.batch = c.B; fp.tokens = c.T; fp.heads = c.H; fp.dk = c.K; fp.dv = c.V; fp.n = c.n;
  fp.has_h0 = c.h0; fp.scale = scale; fp.bv = c.BV;
  launch(N * H, (V + c.BV - 1) / c.BV, 256,
         [&] { gdp_fwd_bf16(GDP_ARGS_OF(GDP_FUSED_FWD_FIELDS, fp)); });
  report(c.name, "bf16 1k o", rel(fused.data(), R.o.data(), BTH * V), 1e-2);
  report(c.name, "bf16 1k ht", rel(fused.data() + BTH * V, R.fin.data(), sl), 1e-2);

  long total = 0;
  const std::vector<int> tab = chunk_table(P, total);
  const long slots = std::max(total, 1L) * H;
  std::vector<__nv_bfloat16> wg(slots * 64 * K, {0x7f7f}), ug(slots * 64 * V, {0x7f7f}),
      pg(slots * 64 * 64, {0x7f7f});
  std::vector<float> cg(slots * 3 * 64, 3e38f);
  const SplitQk sq(qkb, BTH / H, n, H, K, c.grp);
  // The WY factors from the packed qk and from q, k in place (Hk = H / grp heads where the
  // heads are grouped): the same bits.
  auto wy_factors = [&](bool split) {
    const QkArgs a = qk_args(qkb, sq, split, H, K);
    const GdpWyParams wp = wy_params(P, a, vb, tab, wg, ug, pg, cg, nullptr, scale, nullptr,
                                     nullptr);
    if (total > 0)
      launch(total, H, 128, [&] { gdp_fwd_wy_bf16(GDP_ARGS_OF(GDP_WY_FIELDS, wp)); });
  };
  wy_factors(true);
  const auto wg1 = wg, ug1 = ug, pg1 = pg;
  const auto cg1 = cg;
  wy_factors(false);
  auto same_bits = [](const auto& x, const auto& y) {
    return x.size() == y.size() && memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  const bool same = same_bits(wg, wg1) && same_bits(ug, ug1) && same_bits(pg, pg1) &&
                    same_bits(cg, cg1);
  printf("%-26s %-8s %s\n", c.name, "bf16 wy", same ? "q, k in place: identical" : "q, k in place: DIFFERENT");
  if (!same) ++fails;
  const int QR = 16 * (((64 + c.n - 1) / c.n + 15) / 16);
  const int KPT = c.K <= 64 ? 64 : c.K <= 128 ? 128 : 256;
  for (int cfg = 0; cfg < 6; ++cfg) {
    const int bv = 16 << (cfg % 3), NS = 2 + cfg / 3;
    if (bv == 64 && KPT == 256) continue;
    // Odd configurations write o in bf16 (the op's plain output), even ones the packed f32;
    // configurations 1 to 3 read q and k in place, the others the packed qk.
    const bool plain = cfg % 2 == 1, split = cfg >= 1 && cfg <= 3;
    const QkArgs a = qk_args(qkb, sq, split, H, K);
    std::vector<float> out(BTH * V + sl, 0.f);
    std::vector<__nv_bfloat16> ob(plain ? BTH * V : 0, __nv_bfloat16{0x7f7f});
    const GdpScanParams sp =
        scan_params(P, a, tab, wg, ug, pg, cg, plain ? nullptr : out.data(),
                    plain ? ob.data() : nullptr, out.data() + BTH * V, nullptr, nullptr, QR, NS,
                    nullptr);
    launch_fwd_scan(sp, N * H, V, bv, KPT);
    for (long i = 0; plain && i < BTH * V; ++i) out[i] = __bfloat162float(ob[i]);
    char what[32];
    snprintf(what, sizeof what, "bf16 2k%d/%d%s o%s", bv, NS, split ? " q,k" : "", plain ? " bf16" : "");
    report(c.name, what, rel(out.data(), R.o.data(), BTH * V), 1e-2);
    snprintf(what, sizeof what, "bf16 2k%d/%d ht", bv, NS);
    report(c.name, what, rel(out.data() + BTH * V, R.fin.data(), sl), 1e-2);
  }

  // The overlapped forward (src/op/cuda/pipeline.rs): the WY kernel over the chunks in the
  // time-major order the op builds (a 1-D grid), counting each group of chunks as ready, and
  // the scan checking the counts (the emulation runs the WY kernel first, so this checks the
  // order's indexing and that every group is complete when the scan asks, not the timing).
  // Bit-identical to the plain launches.
  {
    if (KPT == 256 || total == 0) return;
    const QkArgs a = qk_args(qkb, sq, true, H, K);
    auto scan = [&](std::vector<float>& out, const int* ready) {
      const GdpScanParams sp = scan_params(P, a, tab, wg, ug, pg, cg, out.data(), nullptr,
                                           out.data() + BTH * V, nullptr, nullptr, QR, 3, ready);
      launch_fwd_scan(sp, N * H, V, 32, KPT);
    };
    wy_factors(true);
    std::vector<float> plain(BTH * V + sl, 0.f), overlapped(BTH * V + sl, 0.f);
    scan(plain, nullptr);
    const std::vector<int> order = wy_chunk_order(P, tab, false);
    std::fill(wg.begin(), wg.end(), __nv_bfloat16{0x7f7f});
    std::fill(ug.begin(), ug.end(), __nv_bfloat16{0x7f7f});
    std::vector<int> ready((total / GDPC_READY_GROUP + N + 1) * H, 0);
    const GdpWyParams wp = wy_params(P, a, vb, tab, wg, ug, pg, cg, nullptr, scale,
                                     order.data(), ready.data());
    launch((long)order.size() * H, 1, 128,
           [&] { gdp_fwd_wy_bf16(GDP_ARGS_OF(GDP_WY_FIELDS, wp)); });
    const bool all_set = (long)order.size() == total;
    scan(overlapped, ready.data());  // asserts each group's count
    const bool same = memcmp(plain.data(), overlapped.data(), plain.size() * sizeof(float)) == 0;
    printf("%-26s %-8s %s\n", c.name, "bf16 ovl",
           same && all_set ? "groups ready, identical" : "order or results DIFFERENT");
    if (!same || !all_set) ++fails;
  }
}


// The split bf16 backward (gdp_bwd_chunked.cuh): WY with Ainv, the forward scan writing h and
// Delta, the state-gradient scan, the gradient kernel; every gradient against the f64 reference
// on the bf16-rounded inputs (dO rounded too: the kernels read it in bf16).
void run_bf16_bwd(const Case& c, int bv, int NS, bool misalign_do = false) {
  Prob P = make(c, 777 + c.K + c.T);
  const auto qkb = to_bf16(P.qk);
  const auto vb = to_bf16(P.v);
  const long K = c.K, V = c.V, n = c.n, H = c.H, N = P.N, BTH = P.BTH, sl = N * H * K * V;
  // With misalign_do, dO starts one element past a 16-byte boundary (a view of a larger tensor
  // may start anywhere): the kernels must not copy it 16 bytes at a time (cp_async16 asserts).
  const auto dob_at = to_bf16(P.dout);
  std::vector<__nv_bfloat16> dob_buf(dob_at.size() + 1);
  std::copy(dob_at.begin(), dob_at.end(), dob_buf.begin() + (misalign_do ? 1 : 0));
  const __nv_bfloat16* dob_ptr = dob_buf.data() + (misalign_do ? 1 : 0);
  const long qk_len = BTH * (n + 1) * K, v_len = BTH * n * V;
  std::vector<double> h0d, dhtd(P.dht.begin(), P.dht.end());
  if (c.h0) h0d.assign(P.aux.begin() + BTH * (1 + n), P.aux.end());
  Ref R;
  naive(P, c.h0 ? h0d.data() : nullptr, dhtd.data(), R, true);
  const float scale = 1.f / sqrtf((float)K);
  long total = 0;
  const std::vector<int> tab = chunk_table(P, total);
  const long slots = std::max(total, 1L) * H;
  const __nv_bfloat16 poison{0x7f7f};
  std::vector<__nv_bfloat16> wg(slots * 64 * K, poison), ug(slots * 64 * V, poison),
      pg(slots * 64 * 64, poison), ag(slots * 64 * 64, poison), hs(slots * K * V, poison),
      dn(slots * 64 * V, poison), dhs(slots * K * V, poison), ddn(slots * 64 * V, poison);
  std::vector<float> cg(slots * 3 * 64, 3e38f);
  const int QR = 16 * (((64 + c.n - 1) / c.n + 15) / 16);
  const int KPT = c.K <= 64 ? 64 : 128;
  const int VPT = c.V <= 64 ? 64 : 128;
  // BV = 32 runs write dq, dk, dv in bf16 and dg, dβ apart (the op's parts) and read q and k in
  // place (FLA's layout); others read the packed qk and write the packed f32.
  const bool parts = bv == 32;
  const SplitQk sq(qkb, BTH / H, n, H, K, c.grp);
  const QkArgs a = qk_args(qkb, sq, parts, H, K);
  if (total > 0) {
    const GdpWyParams wp = wy_params(P, a, vb, tab, wg, ug, pg, cg, ag.data(), scale, nullptr,
                                     nullptr);
    launch(total, H, 128, [&] { gdp_fwd_wy_bf16(GDP_ARGS_OF(GDP_WY_FIELDS, wp)); });
  }
  // The states rerun as the op runs it: the states-only kernel (no query rows staged, QR = 0)
  // into hs, dn; then the forward scan with its output (as the forward of save_intermediates
  // runs it: at n >= 2 and BV 64 the warps without output rows store the states) into hs2,
  // dn2, which must be bit-identical (the same products on the same staged values; there is no
  // forward scan of 128 columns, so at BV 128 the one of 64, on twice as many blocks).
  std::vector<__nv_bfloat16> o_scan(BTH * V);
  // (u_in, vin: U read from u_in with rows of vin elements instead of ug's V.)
  auto rerun = [&](bool states_only, __nv_bfloat16* hs_to, __nv_bfloat16* dn_to,
                   const __nv_bfloat16* u_in = nullptr, int vin = 0, int wide_to = -1) {
    const int lbv = states_only ? bv : std::min(bv, 64);
    GdpScanParams sp = scan_params(P, a, tab, wg, ug, pg, cg, nullptr,
                                   states_only ? nullptr : o_scan.data(), nullptr, hs_to, dn_to,
                                   states_only ? 0 : QR, NS, nullptr);
    if (u_in != nullptr) sp.u = u_in, sp.dv_in = vin;
    if (wide_to >= 0) sp.wide_to = wide_to;
    if (states_only) launch_states_scan(sp, N * H, V, lbv, KPT);
    else launch_fwd_scan(sp, N * H, V, lbv, KPT);
  };
  rerun(true, hs.data(), dn.data());
  {
    std::vector<__nv_bfloat16> hs2(hs.size(), poison), dn2(dn.size(), poison);
    rerun(false, hs2.data(), dn2.data());
    const bool same = memcmp(hs.data(), hs2.data(), hs.size() * sizeof(__nv_bfloat16)) == 0 &&
                      memcmp(dn.data(), dn2.data(), dn.size() * sizeof(__nv_bfloat16)) == 0;
    printf("%-26s %-8s %s\n", c.name, "states",
           same ? "states-only kernel identical to the scan" : "states-only kernel DIFFERENT");
    if (!same) ++fails;
    // The scan's output with the states stored beside it, against the scan without them.
    const std::vector<__nv_bfloat16> o_states = o_scan;
    rerun(false, nullptr, nullptr);
    const bool same_o =
        memcmp(o_states.data(), o_scan.data(), o_scan.size() * sizeof(__nv_bfloat16)) == 0;
    printf("%-26s %-8s %s\n", c.name, "scan out",
           same_o ? "identical with and without the states" : "output DIFFERENT with the states");
    if (!same_o) ++fails;
  }
  std::vector<float> out(qk_len + v_len + BTH * (1 + n) + (c.h0 ? sl : 0), 0.f);
  float* dh0 = out.data() + qk_len + v_len + BTH * (1 + n);
  // (do_in, vin: dO read from do_in with rows of vin elements instead of V.)
  auto dh_scan = [&](__nv_bfloat16* dhs_to, __nv_bfloat16* ddn_to, float* dh0_to, const int* rdy,
                     int* signal, const __nv_bfloat16* do_in = nullptr, int vin = 0,
                     int wide_to = -1) {
    GdpDhParams dp{};
    dp.q = a.q; dp.k = a.k; dp.table = tab.data(); dp.w = wg.data(); dp.p = pg.data();
    dp.coef = cg.data(); dp.dob = dob_ptr; dp.dht = P.dht.data(); dp.dhs = dhs_to;
    dp.ddn = ddn_to; dp.dh0 = dh0_to; dp.ready = rdy; dp.signal = signal; dp.split = a.split;
    dp.has_dht = 1; dp.write_dh0 = c.h0; dp.batch = c.B; dp.tokens = c.T; dp.heads = c.H;
    dp.dk = c.K; dp.dv = c.V; dp.dv_in = c.V; dp.wide_from = 0; dp.wide_to = N; dp.n = c.n;
    dp.qr = QR; dp.ns = NS;
    if (do_in != nullptr) dp.dob = do_in, dp.dv_in = vin;
    if (wide_to >= 0) dp.wide_to = wide_to;
    launch_dh_scan(dp, N * H, V, bv, KPT);
  };
  dh_scan(dhs.data(), ddn.data(), dh0, nullptr, nullptr);
  // The value-side inputs narrower than the scans' columns (a context-parallel rank's [U | 0_K]
  // and [dO | 0_K] read in place: dv_in < V, the columns past it zero): bit-identical to the
  // scans on the inputs with those columns zeroed, for a width in the middle of a value tile,
  // an odd one (no 16-byte rows) and none.
  for (const long vin : {V / 2, V - 3, 0L}) {
    if (vin < 0 || vin >= V) continue;
    // x's rows [rows, V] with the columns from vin on zeroed, and its first vin columns alone.
    auto narrow = [&](const std::vector<__nv_bfloat16>& x, long rows) {
      std::vector<__nv_bfloat16> pad(x.begin(), x.begin() + rows * V), thin(rows * vin + 1);
      for (long r = 0; r < rows; ++r)
        for (long j = 0; j < V; ++j) {
          if (j < vin) thin[r * vin + j] = x[r * V + j];
          else pad[r * V + j] = __float2bfloat16_rn(0.f);
        }
      return std::make_pair(pad, thin);
    };
    const auto [u_pad, u_thin] = narrow(ug, slots * 64);
    std::vector<__nv_bfloat16> hs_a(hs.size(), poison), dn_a(dn.size(), poison);
    std::vector<__nv_bfloat16> hs_b(hs.size(), poison), dn_b(dn.size(), poison);
    std::fill(o_scan.begin(), o_scan.end(), poison);
    rerun(false, hs_a.data(), dn_a.data(), u_pad.data(), (int)V);
    const std::vector<__nv_bfloat16> o_a = o_scan;
    rerun(false, hs_b.data(), dn_b.data(), u_thin.data(), (int)vin);
    auto bits = [](const auto& x, const auto& y) {
      return x.size() == y.size() && memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
    };
    const bool same_fwd = bits(o_a, o_scan) && bits(hs_a, hs_b) && bits(dn_a, dn_b);
    const auto [do_pad, do_thin] = narrow(dob_at, BTH);
    std::vector<__nv_bfloat16> dhs_a(dhs.size(), poison), ddn_a(ddn.size(), poison);
    std::vector<__nv_bfloat16> dhs_b(dhs.size(), poison), ddn_b(ddn.size(), poison);
    std::vector<float> dh0_a(sl, 0.f), dh0_b(sl, 0.f);
    dh_scan(dhs_a.data(), ddn_a.data(), dh0_a.data(), nullptr, nullptr, do_pad.data(), (int)V);
    dh_scan(dhs_b.data(), ddn_b.data(), dh0_b.data(), nullptr, nullptr, do_thin.data(), (int)vin);
    bool same_dh = bits(dhs_a, dhs_b) && bits(ddn_a, ddn_b) && bits(dh0_a, dh0_b);
    // The widened columns wanted by the first sequence only (wide_to = 1): its blocks past vin
    // run, the others' exit at once; the columns below vin are the same, and so are the first
    // sequence's past it (and the others' past it are not written: their poison stays).
    if (vin > 0) {
      // x and y agree where wanted; y keeps its poison from the first value tile of `tile`
      // columns wholly past vin on, in the rows nobody wants widened.
      auto cols_same = [&](const auto& x, const auto& y, long width, long tile, auto wide_row) {
        const long skipped = (vin + tile - 1) / tile * tile;
        for (size_t i = 0; i < x.size(); ++i) {
          const long col = (long)(i % width);
          const bool wide = wide_row((long)(i / width));
          if ((col < vin || wide) && memcmp(&x[i], &y[i], sizeof(x[i])) != 0) return false;
          if (!wide && col >= skipped && memcmp(&y[i], &poison, sizeof(poison)) != 0)
            return false;
        }
        return true;
      };
      const long fbv = std::min(bv, 64);  // the forward scan's tile in rerun
      const long tok1 = P.seqs.empty() ? 0 : (long)P.seqs[0].b * c.T + P.seqs[0].start + P.seqs[0].len;
      const long tok0 = P.seqs.empty() ? 0 : (long)P.seqs[0].b * c.T + P.seqs[0].start;
      const long slot1 = P.N >= 2 ? (long)tab[4 + 3] * H : slots;  // the second sequence's first slot
      auto first_tok = [&](long row) { const long tk = row / H; return tk >= tok0 && tk < tok1; };
      auto first_slot = [&](long rows_per_slot) {
        return [=](long row) { return row / rows_per_slot < slot1; };
      };
      std::fill(o_scan.begin(), o_scan.end(), poison);
      std::vector<__nv_bfloat16> hs_c(hs.size(), poison), dn_c(dn.size(), poison);
      rerun(false, hs_c.data(), dn_c.data(), u_thin.data(), (int)vin, 1);
      const bool fwd_one = cols_same(o_a, o_scan, V, fbv, first_tok) &&
                           cols_same(hs_a, hs_c, V, fbv, first_slot(K)) &&
                           cols_same(dn_a, dn_c, V, fbv, first_slot(64));
      std::vector<__nv_bfloat16> dhs_c(dhs.size(), poison), ddn_c(ddn.size(), poison);
      std::vector<float> dh0_c(sl, 0.f);
      dh_scan(dhs_c.data(), ddn_c.data(), dh0_c.data(), nullptr, nullptr, do_thin.data(),
              (int)vin, 1);
      const bool dh_one = cols_same(dhs_a, dhs_c, V, (long)bv, first_slot(K)) &&
                          cols_same(ddn_a, ddn_c, V, (long)bv, first_slot(64));
      if (!fwd_one || !dh_one) {
        printf("%-26s %-8s widened columns of the first sequence only: %s DIFFERENT\n", c.name,
               "narrow", fwd_one ? "dh scan" : "forward scan");
        same_dh = false;
      }
    }
    char what[64];
    snprintf(what, sizeof what, "narrow %ld", vin);
    printf("%-26s %-8s %s\n", c.name, what,
           same_fwd && same_dh ? "U, dO narrower: identical"
                               : (same_fwd ? "dO narrower: DIFFERENT" : "U narrower: DIFFERENT"));
    if (!same_fwd || !same_dh) ++fails;
  }
  // The gradient kernel's pipe (GDPG_PIPE_COUNTERS, then a counter per group and head), filled
  // by the scan beside the WY kernel below.
  const int scan_blocks = N * H * ((V + bv - 1) / bv);
  std::vector<int> pipe(GDPG_PIPE_COUNTERS + (total / GDPC_READY_GROUP + N + 1) * H, 0);
  // The state-gradient scan beside a WY kernel that takes the chunks from the sequences' ends,
  // counting them ready per group (as the op runs the two at small B·H): the WY factors
  // poisoned and written again in that order, the scan waiting on the counters (the
  // emulation's wait asserts each group complete), dS, dDelta and dh0 bit-identical.
  if (total > 0) {
    const std::vector<int> order = wy_chunk_order(P, tab, true);
    std::fill(wg.begin(), wg.end(), poison);
    std::fill(pg.begin(), pg.end(), poison);
    std::fill(cg.begin(), cg.end(), 3e38f);
    std::vector<int> ready((total / GDPC_READY_GROUP + N + 1) * H, 0);
    const GdpWyParams wp = wy_params(P, a, vb, tab, wg, ug, pg, cg, nullptr, scale,
                                     order.data(), ready.data());
    launch((long)order.size() * H, 1, 128,
           [&] { gdp_fwd_wy_bf16(GDP_ARGS_OF(GDP_WY_FIELDS, wp)); });
    std::vector<__nv_bfloat16> dhs2(dhs.size(), poison), ddn2(ddn.size(), poison);
    std::vector<float> dh0b(c.h0 ? sl : 1, 0.f);
    dh_scan(dhs2.data(), ddn2.data(), dh0b.data(), ready.data(), pipe.data());
    const bool same =
        (long)order.size() == total && pipe[1] == scan_blocks &&
        memcmp(dhs.data(), dhs2.data(), dhs.size() * sizeof(__nv_bfloat16)) == 0 &&
        memcmp(ddn.data(), ddn2.data(), ddn.size() * sizeof(__nv_bfloat16)) == 0 &&
        (!c.h0 || memcmp(dh0, dh0b.data(), sl * sizeof(float)) == 0);
    printf("%-26s %-8s %s\n", c.name, "bwd ovl",
           same ? "groups ready, identical" : "order or results DIFFERENT");
    if (!same) ++fails;
  }
  std::vector<__nv_bfloat16> dqb(parts ? BTH * K : 0, poison), dkb(parts ? BTH * n * K : 0, poison),
      dvb(parts ? v_len : 0, poison);
  const std::vector<int> order = wy_chunk_order(P, tab, true);
  // The gradient kernel into `o` (the packed f32 or its gates part) and dq, dk, dv: one block
  // per (chunk, head), or (pipe) `blocks` persistent blocks taking the pairs from `pipe`.
  auto grads = [&](float* o, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                   int* pp, int blocks, int beside, int done_at) {
    GdpGradsPipeParams gp{};
    gp.q = a.q; gp.k = a.k; gp.v = vb.data(); gp.aux = P.aux.data(); gp.table = tab.data();
    gp.ainv = ag.data(); gp.hs = hs.data(); gp.dhs = dhs.data(); gp.dn = dn.data();
    gp.ddn = ddn.data(); gp.dob = dob_ptr; gp.out = parts ? nullptr : o;
    gp.dq = parts ? dq : nullptr; gp.dk_out = parts ? dk : nullptr;
    gp.dv_out = parts ? dv : nullptr; gp.dgates = o + qk_len + v_len; gp.split = a.split;
    gp.batch = c.B; gp.tokens = c.T; gp.heads = c.H; gp.dk = c.K; gp.dv = c.V; gp.n = c.n;
    gp.nseq = N; gp.scale = scale; gp.qr = QR;
    // The persistent kernel's fields (GDP_GRADS_FIELDS leaves them out for the others).
    gp.pipe = pp; gp.order = order.data(); gp.items = (int)total * H;
    gp.ready_count = (V + bv - 1) / bv; gp.beside = beside; gp.scan_blocks = done_at;
    launch(pp ? blocks : total, pp ? 1 : H, GDPG_THREADS, [&] {
      if (pp != nullptr) {  // only the `_tiles` kernel has persistent blocks
        gdp_bwd_grads_bf16_128_128_tiles_pipe(GDP_ARGS_OF(GDP_GRADS_PIPE_FIELDS, gp));
        return;
      }
#define ARGS GDP_ARGS_OF(GDP_GRADS_FIELDS, gp)
      if (KPT == 64 && VPT == 64) gdp_bwd_grads_bf16_64_64(ARGS);
      if (KPT == 64 && VPT == 128) gdp_bwd_grads_bf16_64_128(ARGS);
      if (KPT == 128 && VPT == 64) gdp_bwd_grads_bf16_128_64(ARGS);
      if (KPT == 128 && VPT == 128 && c.n == 1) gdp_bwd_grads_bf16_128_128(ARGS);
      if (KPT == 128 && VPT == 128 && c.n >= 2) gdp_bwd_grads_bf16_128_128_tiles(ARGS);
#undef ARGS
    });
  };
  if (total > 0) grads(out.data(), dqb.data(), dkb.data(), dvb.data(), nullptr, 0, 0, 0);
  // The gradients do not depend on the threads' timing (no float atomics): again with the
  // thread ids reversed (the threads start in the other order), the same bits, dg and dβ too.
  if (total > 0) {
    std::vector<float> o3(out.size(), 0.f);
    std::vector<__nv_bfloat16> dq3(dqb.size(), poison), dk3(dkb.size(), poison),
        dv3(dvb.size(), poison);
    g_reverse = !g_reverse;
    grads(o3.data(), dq3.data(), dk3.data(), dv3.data(), nullptr, 0, 0, 0);
    g_reverse = !g_reverse;
    auto bits = [](const auto& x, const auto& y) {
      return x.size() == y.size() && memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
    };
    // (out's dh0 part is the state-gradient scan's, not the gradient kernel's.)
    const long glen = qk_len + v_len + BTH * (1 + n);
    const bool same = memcmp(o3.data(), out.data(), glen * sizeof(float)) == 0 &&
                      bits(dq3, dqb) && bits(dk3, dkb) && bits(dv3, dvb);
    printf("%-26s %-8s %s\n", c.name, "grads rev",
           same ? "thread order reversed: the same bits" : "thread order reversed: DIFFERENT");
    if (!same) ++fails;
  }
  // The persistent blocks of the `_tiles` kernel (as the op runs them beside the scan at small
  // B·H, then after it) must write the same gradients: three blocks after the scan taking every
  // pair; three beside it, told it is still running (each waits for its chunk's group: the
  // emulation's wait asserts it complete); and three beside it told it is done, which compute
  // the pairs they hold and leave, then three after it taking the rest.
  if (total > 0 && KPT == 128 && VPT == 128 && c.n >= 2) {
    bool same = true;
    for (int mode = 0; mode <= 2; ++mode) {
      std::vector<float> o2(out.size(), 0.f);
      std::vector<__nv_bfloat16> dq2(dqb.size(), poison), dk2(dkb.size(), poison),
          dv2(dvb.size(), poison);
      pipe[0] = 0;
      if (mode > 0)
        grads(o2.data(), dq2.data(), dk2.data(), dv2.data(), pipe.data(), 3, 1,
              mode == 1 ? scan_blocks + 1 : scan_blocks);
      if (mode == 2) same = same && pipe[0] > 0 && pipe[0] <= 9;
      if (mode != 1)
        grads(o2.data(), dq2.data(), dk2.data(), dv2.data(), pipe.data(), 3, 0, scan_blocks);
      // Every gradient bit-identical, dg and dβ too: their partial sums are added in a fixed
      // order, not by float atomics, whatever the threads' timing.
      const long glen = BTH * (1 + n);
      const long from = parts ? qk_len + v_len : 0;
      same = same &&
             memcmp(o2.data() + from, out.data() + from,
                    (qk_len + v_len + glen - from) * sizeof(float)) == 0 &&
             memcmp(dq2.data(), dqb.data(), dqb.size() * sizeof(__nv_bfloat16)) == 0 &&
             memcmp(dk2.data(), dkb.data(), dkb.size() * sizeof(__nv_bfloat16)) == 0 &&
             memcmp(dv2.data(), dvb.data(), dvb.size() * sizeof(__nv_bfloat16)) == 0;
    }
    printf("%-26s %-8s %s\n", c.name, "grads pipe",
           same ? "persistent blocks: the same gradients" : "persistent blocks DIFFERENT");
    if (!same) ++fails;
  }
  // dq, dk back into the packed layout of the reference.
  for (long tk = 0; parts && tk < BTH / H; ++tk)
    for (long s = 0; s <= n; ++s)
      for (long i = 0; i < H * K; ++i)
        out[(tk * (n + 1) + s) * H * K + i] = __bfloat162float(
            s == 0 ? dqb[tk * H * K + i] : dkb[(tk * n + s - 1) * H * K + i]);
  for (long i = 0; parts && i < v_len; ++i) out[qk_len + i] = __bfloat162float(dvb[i]);
  std::vector<float> gq, gk;
  std::vector<double> rq, rk;
  for (long tk = 0; tk < BTH / H; ++tk)
    for (long s = 0; s <= n; ++s)
      for (long h = 0; h < H; ++h)
        for (long kk = 0; kk < K; ++kk) {
          long i = ((tk * (n + 1) + s) * H + h) * K + kk;
          if (s == 0) gq.push_back(out[i]), rq.push_back(R.grads[i]);
          else gk.push_back(out[i]), rk.push_back(R.grads[i]);
        }
  char name[64];
  snprintf(name, sizeof name, "%s bwd%d/%d%s%s", c.name, bv, NS, parts ? " parts q,k" : "",
           misalign_do ? " dO+1" : "");
  // Grouped value heads: dq and dk per value head summed into the key heads, as the op does
  // after the kernel (gdp_sum_groups_bf16), against the reference's group sums.
  if (parts && c.grp > 1) {
    const long Hk = H / c.grp;
    auto group_sum = [&](const std::vector<__nv_bfloat16>& x, long rows, int slot0,
                         const char* what) {
      std::vector<__nv_bfloat16> y(rows * Hk * K, poison);
      const GdpSumGroupsParams<__nv_bfloat16> sp{x.data(), y.data(), rows * Hk, c.grp, (int)K};
      launch(3, 1, 64, [&] { gdp_sum_groups_bf16(GDP_ARGS_OF(GDP_SUM_GROUPS_FIELDS, sp)); });
      std::vector<float> got(y.size());
      std::vector<double> want(y.size(), 0.0);
      for (long i = 0; i < (long)y.size(); ++i) got[i] = __bfloat162float(y[i]);
      // Reference row (token tk, slot s) of the packed [.., n + 1, H, K] gradient.
      for (long r = 0; r < rows; ++r) {
        const long tk = slot0 == 0 ? r : r / n, s = slot0 == 0 ? 0 : 1 + r % n;
        for (long h = 0; h < H; ++h)
          for (long kk = 0; kk < K; ++kk)
            want[(r * Hk + h / c.grp) * K + kk] += R.grads[((tk * (n + 1) + s) * H + h) * K + kk];
      }
      report(name, what, rel(got.data(), want.data(), got.size()), 1e-2);
    };
    group_sum(dqb, BTH / H, 0, "bf16 dq grp");
    group_sum(dkb, BTH / H * n, 1, "bf16 dk grp");
  }
  report(name, "bf16 dq", rel(gq.data(), rq.data(), gq.size()), 1e-2);
  report(name, "bf16 dk", rel(gk.data(), rk.data(), gk.size()), 1e-2);
  report(name, "bf16 dv", rel(out.data() + qk_len, R.grads.data() + qk_len, v_len), 1e-2);
  report(name, "bf16 dg", rel(out.data() + qk_len + v_len, R.grads.data() + qk_len + v_len, BTH), 1e-2);
  report(name, "bf16 db", rel(out.data() + qk_len + v_len + BTH, R.grads.data() + qk_len + v_len + BTH, BTH * n), 1e-2);
  if (c.h0) report(name, "bf16 dh0", rel(dh0, R.grads.data() + qk_len + v_len + BTH * (1 + n), sl), 1e-2);
}

// The fused decode step gdp_step_{f32,bf16}_k* against a float64 loop: q, k, v (and the f32
// gates) are rounded to bf16 first, so that both kernels see the reference's inputs.
void run_step(int B, int H, int K, int V, int n) {
  std::mt19937 rng(99 + K + V + n);
  std::normal_distribution<float> nd(0, 1);
  std::uniform_real_distribution<float> ud(0, 1);
  const long BH = (long)B * H;
  std::vector<float> state(BH * K * V), small(BH * K * (1 + n) + BH * n * V + BH * (1 + n));
  for (auto& x : state) x = nd(rng);
  for (auto& x : small) x = nd(rng) / sqrtf((float)K);
  float* g = small.data() + BH * K * (1 + n) + BH * n * V;
  float* beta = g + BH;
  for (long i = 0; i < BH; ++i) g[i] = -2.f * ud(rng);
  for (long i = 0; i < BH * n; ++i) beta[i] = 2.f * ud(rng);
  const std::vector<__nv_bfloat16> small16 = to_bf16(small);
  // Offsets of q [B, H, K], k [B, n, H, K], v [B, n, H, V], g [B, H], beta [B, n, H] in `small`.
  const long at[5] = {0, BH * K, BH * K * (1 + n), BH * K * (1 + n) + BH * n * V,
                      BH * K * (1 + n) + BH * n * V + BH};
  const float scale = 1.f / sqrtf((float)K);
  std::vector<float> out(BH * V + BH * K * V), out16(BH * V + BH * K * V);
  auto run = [&](auto* x, float* dst) {
    std::fill(dst, dst + out.size(), -7.f);
    launch(BH, (V + GDP_STEP_COLS - 1) / GDP_STEP_COLS, GDP_STEP_THREADS, [&] {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
      GdpStepParams<T> sp{};
      sp.state = state.data(); sp.q = x + at[0]; sp.k = x + at[1]; sp.v = x + at[2];
      sp.g = small.data() + at[3]; sp.beta = small.data() + at[4]; sp.out = dst;
      sp.batch = B; sp.heads = H; sp.dk = K; sp.dv = V; sp.n = n; sp.scale = scale;
      if constexpr (std::is_same_v<T, float>) {
        if (K <= 32) gdp_step_f32_k32(GDP_ARGS_OF(GDP_STEP_FIELDS, sp));
        else if (K <= 64) gdp_step_f32_k64(GDP_ARGS_OF(GDP_STEP_FIELDS, sp));
        else if (K <= 128) gdp_step_f32_k128(GDP_ARGS_OF(GDP_STEP_FIELDS, sp));
        else gdp_step_f32_k256(GDP_ARGS_OF(GDP_STEP_FIELDS, sp));
      } else {
        if (K <= 32) gdp_step_bf16_k32(GDP_ARGS_OF(GDP_STEP_FIELDS, sp));
        else if (K <= 64) gdp_step_bf16_k64(GDP_ARGS_OF(GDP_STEP_FIELDS, sp));
        else if (K <= 128) gdp_step_bf16_k128(GDP_ARGS_OF(GDP_STEP_FIELDS, sp));
        else gdp_step_bf16_k256(GDP_ARGS_OF(GDP_STEP_FIELDS, sp));
      }
    });
  };
  run(small.data(), out.data());
  run(small16.data(), out16.data());
  std::vector<double> o(BH * V), S(BH * K * V);
  const float* q = small.data();
  const float* k = q + BH * K;
  const float* v = k + BH * n * K;
  for (long bh = 0; bh < BH; ++bh) {
    const long b = bh / H, h = bh % H;
    double* s = &S[bh * K * V];
    for (long i = 0; i < K * V; ++i) s[i] = state[bh * K * V + i] * exp((double)g[bh]);
    for (int j = 0; j < n; ++j) {
      const long row = (b * n + j) * H + h;
      for (long c = 0; c < V; ++c) {
        double pred = 0;
        for (long r = 0; r < K; ++r) pred += k[row * K + r] * s[r * V + c];
        const double d = beta[row] * (v[row * V + c] - pred);
        for (long r = 0; r < K; ++r) s[r * V + c] += k[row * K + r] * d;
      }
    }
    for (long c = 0; c < V; ++c) {
      double a = 0;
      for (long r = 0; r < K; ++r) a += q[bh * K + r] * s[r * V + c];
      o[bh * V + c] = scale * a;
    }
  }
  char name[64];
  snprintf(name, sizeof name, "step B%d H%d K%d V%d n%d", B, H, K, V, n);
  report(name, "o", rel(out.data(), o.data(), BH * V), 1e-5);
  report(name, "state", rel(out.data() + BH * V, S.data(), BH * K * V), 1e-5);
  report(name, "bf16 in o", rel(out16.data(), o.data(), BH * V), 1e-5);
  report(name, "bf16 in state", rel(out16.data() + BH * V, S.data(), BH * K * V), 1e-5);
}

// Every sequence of `P` cut into segments of `len` tokens (a multiple of 64; the last one
// shorter, an empty sequence one empty segment), as src/op/segments.rs cuts them: the segments
// as the sequences of a problem, and each sequence's segments [first, end) in `owners`.
static Prob segments_of(const Prob& P, int len, std::vector<std::pair<long, long>>& owners) {
  Prob S = P;
  S.seqs.clear();
  owners.clear();
  for (const Seq& q : P.seqs) {
    const long first = S.seqs.size();
    int at = 0;
    do {
      const int l = std::min(len, q.len - at);
      S.seqs.push_back({q.b, q.start + at, l});
      at += l;
    } while (at < q.len);
    owners.push_back({first, (long)S.seqs.size()});
  }
  S.N = S.seqs.size();
  return S;
}

// The WY factors of the bf16 kernels (w, u, p in bf16, the gate coefficients in f32) and, where
// the backward reads it, Ainv.
struct Wy {
  std::vector<__nv_bfloat16> w, u, p, ainv;
  std::vector<float> c;
};
static Wy wy_of(const Prob& Q, const QkArgs& a, const std::vector<__nv_bfloat16>& vb,
                const std::vector<int>& t, long chunks, long slots, float scale, bool ainv) {
  const long K = Q.c.K, V = Q.c.V;
  const __nv_bfloat16 poison{0x7f7f};
  Wy f{std::vector<__nv_bfloat16>(slots * 64 * K, poison),
       std::vector<__nv_bfloat16>(slots * 64 * V, poison),
       std::vector<__nv_bfloat16>(slots * 64 * 64, poison),
       std::vector<__nv_bfloat16>(ainv ? slots * 64 * 64 : 0, poison),
       std::vector<float>(slots * 3 * 64, 3e38f)};
  const GdpWyParams wp = wy_params(Q, a, vb, t, f.w, f.u, f.p, f.c,
                                   ainv ? f.ainv.data() : nullptr, scale, nullptr, nullptr);
  if (chunks > 0)
    launch(chunks, Q.c.H, 128, [&] { gdp_fwd_wy_bf16(GDP_ARGS_OF(GDP_WY_FIELDS, wp)); });
  return f;
}

// Chains of segment summaries for gdp_fold_chains, as src/op/segments.rs plans them: per step
// a segment id (-1 - id: an empty segment, passed), per chain its first step, per step the
// output row of the state before it (-1: none).
struct Chains {
  std::vector<int> steps, chain_at{0}, rows;
};
// The forward's: each sequence's segments in order, every incoming state to its segment's row.
static Chains forward_chains(const std::vector<std::pair<long, long>>& owners, const Prob& S) {
  Chains ch;
  for (auto [first, end] : owners) {
    for (long j = first; j < end; ++j) {
      ch.steps.push_back(S.seqs[j].len == 0 ? -1 - (int)j : (int)j);
      ch.rows.push_back((int)j);
    }
    ch.chain_at.push_back((int)ch.steps.size());
  }
  return ch;
}
// The backward's: from each sequence's last segment back, the end-state gradient of every
// segment but the last to its row (numbered in segment order); `rows` returns that count.
static Chains backward_chains(const std::vector<std::pair<long, long>>& owners, long segments,
                              long& rows) {
  std::vector<int> row_of(segments, -1);
  rows = 0;
  for (auto [first, end] : owners)
    for (long j = first; j + 1 < end; ++j) row_of[j] = (int)rows++;
  Chains ch;
  for (auto [first, end] : owners) {
    for (long j = end - 1; j >= first; --j) {
      ch.steps.push_back((int)j);
      ch.rows.push_back(row_of[j]);
    }
    ch.chain_at.push_back((int)ch.steps.size());
  }
  return ch;
}
// gdp_fold_chains as src/op/cuda/fold.rs launches it: block (chain, head, 16 value columns),
// passes of x̃ of up to g_fold_pass key columns.
static void launch_fold(const float* t, const float* s0, const Chains& ch, float* out,
                        float* fin, int H, int K, int V) {
  GdpFoldParams p{};
  p.t = t; p.s0 = s0; p.steps = ch.steps.data(); p.chain_at = ch.chain_at.data();
  p.rows = ch.rows.data(); p.out = out; p.fin = fin; p.heads = H; p.dk = K; p.dv = V;
  p.pass_cols = 1;
  while (p.pass_cols < K && p.pass_cols < g_fold_pass) p.pass_cols *= 2;
  const unsigned chains = (unsigned)ch.chain_at.size() - 1;
  launch(chains, H, GDP_FOLD_THREADS, [&] { gdp_fold_chains(GDP_ARGS_OF(GDP_FOLD_FIELDS, p)); },
         (V + GDP_FOLD_COLS - 1) / GDP_FOLD_COLS);
}

// The forward in segments up to its correction, as src/op/cuda/segmented.rs runs it: one
// widened forward scan of BV `bv` over every segment of `S` from [0 | I_K] on [U | 0_K] into
// [o⁰ | Q̃] (bf16, `ow`) and [ΔS | M] (f32), then the segments' incoming states by the f32 fold
// S_{j+1} = ΔS_j + M_j S_j from h0 (`incoming`, zero where `has_in` is not set: a sequence's
// first segment without h0) and the sequences' final states `ht`.
struct SegForward {
  std::vector<__nv_bfloat16> ow;
  std::vector<float> incoming, ht;
  std::vector<char> has_in;
};
static SegForward segment_forward(const Prob& P, const Prob& S,
                                  const std::vector<std::pair<long, long>>& owners,
                                  const QkArgs& a, const std::vector<int>& tab_s, const Wy& wy,
                                  int bv) {
  const Case& c = P.c;
  const long K = c.K, V = c.V, n = c.n, H = c.H, N = P.N, BTH = P.BTH, W = V + K, Ns = S.N;
  const long KV = K * V;
  std::vector<float> h0w(Ns * H * K * W, 0.f), fin(Ns * H * K * W, 3e38f);
  for (long b = 0; b < Ns * H; ++b)
    for (long k = 0; k < K; ++k) h0w[(b * K + k) * W + V + k] = 1.f;
  SegForward f{std::vector<__nv_bfloat16>(BTH * W, __nv_bfloat16{0x7f7f}),
               std::vector<float>(Ns * H * KV, 0.f), std::vector<float>(N * H * KV, 0.f),
               std::vector<char>(Ns, 0)};
  const int QR = 16 * (((64 + c.n - 1) / c.n + 15) / 16);
  const int KPT = c.K <= 64 ? 64 : c.K <= 128 ? 128 : 256;
  GdpScanParams sp = scan_params(S, a, tab_s, wy.w, wy.u, wy.p, wy.c, nullptr, f.ow.data(),
                                 fin.data(), nullptr, nullptr, QR, 2, nullptr);
  sp.h0_override = h0w.data(); sp.use_h0_override = 1; sp.dv = W; sp.dv_in = V;
  sp.wide_from = 0; sp.wide_to = Ns;
  launch_fwd_scan(sp, Ns * H, W, bv, KPT);
  // The fold on the device (gdp_fold_chains) from h0, and which segments have a state.
  launch_fold(fin.data(), c.h0 ? P.aux.data() + BTH * (1 + n) : nullptr, forward_chains(owners, S),
              f.incoming.data(), f.ht.data(), (int)H, (int)K, (int)V);
  for (long i = 0; i < N; ++i) {
    bool has = c.h0;
    for (long j = owners[i].first; j < owners[i].second; ++j) {
      f.has_in[j] = has;
      has = has || S.seqs[j].len > 0;
    }
  }
  return f;
}

// y = x[.., :V] + x[.., V:] · s over `ops` outer indices of `inner` rows from `outer0` on, for
// one sequence (gdp_cp_fix_*, rows of width V + K; a copy where s is null).
template <typename TO>
static void fix_one(const __nv_bfloat16* x, TO* y, const float* s, long H, long K, long V,
                    long outer0, long ops, long inner) {
  if (ops == 0) return;
  GdpFixParams<TO> fp{};
  fp.x = x; fp.y = y; fp.s = s; fp.heads = H; fp.dk = K; fp.dv = V; fp.outer0 = outer0;
  fp.outer_per_seq = ops; fp.inner = inner;
  launch((ops * inner + 127) / 128, (V + GDP_FIX_COLS - 1) / GDP_FIX_COLS, GDP_FIX_THREADS, [&] {
    if constexpr (std::is_same_v<TO, float>) gdp_cp_fix_f32(GDP_ARGS_OF(GDP_FIX_FIELDS, fp));
    else gdp_cp_fix_bf16(GDP_ARGS_OF(GDP_FIX_FIELDS, fp));
  }, (unsigned)H);
}

// The forward in segments (src/op/cuda/segmented.rs), as the op runs it: the segments' WY
// factors (which must be the unsplit table's bit for bit: the backward reads them), the
// widened scan and the fold (segment_forward), and o = o⁰ + Q̃ S_j per segment
// (gdp_cp_fix_f32; a copy where S_j is zero). o and the final states against the f64 reference
// of the unsplit problem; `split`: q, k read in place (FLA's layout, grouped heads where the
// case has them).
void run_bf16_segments(const Case& c, int len, int bv, bool split) {
  Prob P = make(c, 4321 + c.K + c.T);
  const auto qkb = to_bf16(P.qk);
  const auto vb = to_bf16(P.v);
  const long K = c.K, V = c.V, n = c.n, H = c.H, N = P.N, BTH = P.BTH;
  const long sl = N * H * K * V, KV = K * V;
  std::vector<double> h0d;
  if (c.h0) h0d.assign(P.aux.begin() + BTH * (1 + n), P.aux.end());
  Ref R;
  naive(P, c.h0 ? h0d.data() : nullptr, nullptr, R, false);
  const float scale = 1.f / sqrtf((float)K);
  std::vector<std::pair<long, long>> owners;
  const Prob S = segments_of(P, len, owners);
  const long Ns = S.N;
  long total = 0, total_s = 0;
  const std::vector<int> tab = chunk_table(P, total), tab_s = chunk_table(S, total_s);
  const long slots = std::max(total, 1L) * H;
  const SplitQk sq(qkb, BTH / H, n, H, K, c.grp);
  const QkArgs a = qk_args(qkb, sq, split, H, K);
  const Wy whole = wy_of(P, a, vb, tab, total, slots, scale, false);
  const Wy wy = wy_of(S, a, vb, tab_s, total_s, slots, scale, false);
  auto bits = [](const auto& x, const auto& y) {
    return x.size() == y.size() && memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  const bool same_wy = total == total_s && bits(whole.w, wy.w) && bits(whole.u, wy.u) &&
                       bits(whole.p, wy.p) && bits(whole.c, wy.c);
  char name[48];
  snprintf(name, sizeof name, "%s /%d", c.name, len);
  printf("%-26s %-8s %s\n", name, "seg wy",
         same_wy ? "the unsplit table's, identical" : "DIFFERENT from the unsplit table's");
  if (!same_wy) ++fails;
  const SegForward f = segment_forward(P, S, owners, a, tab_s, wy, bv);
  std::vector<float> o(BTH * V, 3e38f);
  for (long j = 0; j < Ns; ++j) {
    const Seq& q = S.seqs[j];
    fix_one(f.ow.data(), o.data(), f.has_in[j] ? &f.incoming[j * H * KV] : nullptr, H, K, V,
            (long)q.b * c.T + q.start, q.len, 1);
  }
  // The unsplit two-kernel forward on the same inputs, for scale: bf16's own error here.
  std::vector<float> base(BTH * V + sl, 0.f);
  {
    const int QR = 16 * (((64 + c.n - 1) / c.n + 15) / 16);
    const int KPT = c.K <= 64 ? 64 : c.K <= 128 ? 128 : 256;
    const GdpScanParams bp = scan_params(P, a, tab, whole.w, whole.u, whole.p, whole.c,
                                         base.data(), nullptr, base.data() + BTH * V, nullptr,
                                         nullptr, QR, 2, nullptr);
    launch_fwd_scan(bp, N * H, V, 16, KPT);
  }
  char what[32];
  report(name, "unsplit o", rel(base.data(), R.o.data(), BTH * V), 1e-2);
  report(name, "unsplit ht", rel(base.data() + BTH * V, R.fin.data(), sl), 1e-2);
  snprintf(what, sizeof what, "seg %ldx%d%s o", Ns, bv, split ? " q,k" : "");
  report(name, what, rel(o.data(), R.o.data(), BTH * V), 1e-2);
  snprintf(what, sizeof what, "seg %ldx%d ht", Ns, bv);
  report(name, what, rel(f.ht.data(), R.fin.data(), sl), 1e-2);
}

// The backward in segments (src/op/cuda/segmented.rs), as the op runs it after a forward in
// segments that kept the segments' WY factors (with Ainv) and incoming states: the states
// rerun over every segment from its incoming state (gdp_fwd_states_bf16, h0 overridden), one
// widened state-gradient scan of BV `bv` over every segment from [dht | I_K] (dht at a
// sequence's last segment, zero elsewhere) on [dO | 0_K] into chunk rows [x⁰ | x̃] and
// [γ | Mᵀ], the reverse f32 fold e_j = γ_{j+1} + Mᵀ_{j+1} e_{j+1} (the end-state gradient
// that segment j's scan lacked), the chunk rows corrected x = x⁰ + x̃ e_j (gdp_cp_fix_bf16; a
// copy at a sequence's last segment), dh0 of each sequence its first segment's corrected γ,
// and the gradient kernel over the segments' chunks. Every gradient against the f64 reference
// of the unsplit problem.
struct SegGrads {
  std::vector<float> out, dh0;
  long segments;
};
static SegGrads segments_bwd(Prob& P, int len, int bv) {
  const Case& c = P.c;
  auto qkb = to_bf16(P.qk);
  auto vb = to_bf16(P.v);
  auto dob = to_bf16(P.dout);
  const long K = c.K, V = c.V, n = c.n, H = c.H, N = P.N, BTH = P.BTH, W = V + K;
  const long sl = N * H * K * V, KV = K * V;
  const long qk_len = BTH * (n + 1) * K, v_len = BTH * n * V;
  const float scale = 1.f / sqrtf((float)K);
  std::vector<std::pair<long, long>> owners;
  const Prob S = segments_of(P, len, owners);
  const long Ns = S.N;
  long total = 0;
  const std::vector<int> tab = chunk_table(S, total);
  const long slots = std::max(total, 1L) * H;
  const SplitQk sq(qkb, BTH / H, n, H, K, c.grp);
  const QkArgs a = qk_args(qkb, sq, false, H, K);
  const Wy wy = wy_of(S, a, vb, tab, total, slots, scale, true);
  const SegForward f = segment_forward(P, S, owners, a, tab, wy, std::min(bv, 64));
  const int QR = 16 * (((64 + c.n - 1) / c.n + 15) / 16);
  const int KPT = c.K <= 64 ? 64 : 128;
  const int VPT = c.V <= 64 ? 64 : 128;
  const __nv_bfloat16 poison{0x7f7f};
  // The states rerun from the incoming states.
  std::vector<__nv_bfloat16> hs(slots * KV, poison), dn(slots * 64 * V, poison);
  {
    GdpScanParams sp = scan_params(S, a, tab, wy.w, wy.u, wy.p, wy.c, nullptr, nullptr, nullptr,
                                   hs.data(), dn.data(), 0, 2, nullptr);
    sp.h0_override = f.incoming.data(); sp.use_h0_override = 1;
    launch_states_scan(sp, Ns * H, V, bv, KPT);
  }
  // [dht | I_K] at each sequence's last segment, [0 | I_K] before it; the widened scan.
  std::vector<float> dhtw(Ns * H * K * W, 0.f), dh0w(Ns * H * K * W, 3e38f);
  for (long i = 0; i < N; ++i)
    for (long j = owners[i].first; j < owners[i].second; ++j)
      for (long hk = 0; hk < H * K; ++hk) {
        float* row = &dhtw[(j * H * K + hk) * W];
        row[V + hk % K] = 1.f;
        if (j + 1 == owners[i].second) std::copy_n(&P.dht[i * H * KV + hk * V], V, row);
      }
  std::vector<__nv_bfloat16> dhs_w(slots * K * W, poison), ddn_w(slots * 64 * W, poison);
  {
    GdpDhParams dp{};
    dp.q = a.q; dp.k = a.k; dp.table = tab.data(); dp.w = wy.w.data(); dp.p = wy.p.data();
    dp.coef = wy.c.data(); dp.dob = dob.data(); dp.dht = dhtw.data(); dp.dhs = dhs_w.data();
    dp.ddn = ddn_w.data(); dp.dh0 = dh0w.data(); dp.split = a.split; dp.has_dht = 1;
    dp.write_dh0 = 1; dp.batch = c.B; dp.tokens = c.T; dp.heads = c.H; dp.dk = c.K;
    dp.dv = W; dp.dv_in = V; dp.wide_from = 0; dp.wide_to = Ns; dp.n = c.n; dp.qr = QR;
    dp.ns = 2;
    launch_dh_scan(dp, Ns * H, W, bv, KPT);
  }
  // The reverse fold on the device (gdp_fold_chains): e_j, the end-state gradient segment j
  // lacked (none at a last segment), in rows of segment order, and each sequence's dh0, its
  // first segment's corrected γ (the chain's final state).
  long rows = 0;
  const Chains back = backward_chains(owners, Ns, rows);
  std::vector<float> e(std::max(rows, 1L) * H * KV, 0.f), dh0(sl, 0.f);
  launch_fold(dh0w.data(), nullptr, back, e.data(), dh0.data(), (int)H, (int)K, (int)V);
  std::vector<long> row_of(Ns, -1);
  for (size_t p = 0; p < back.steps.size(); ++p) row_of[back.steps[p]] = back.rows[p];
  // The chunk rows corrected per segment: chunk states (K rows per slot), dDelta (64 rows).
  std::vector<__nv_bfloat16> dhs(slots * KV, poison), ddn(slots * 64 * V, poison);
  for (long j = 0; j < Ns; ++j) {
    const long first = tab[4 * j + 3], chunks = (S.seqs[j].len * n + 63) / 64;
    const float* ej = row_of[j] >= 0 ? &e[row_of[j] * H * KV] : nullptr;
    fix_one(dhs_w.data(), dhs.data(), ej, H, K, V, first, chunks, K);
    fix_one(ddn_w.data(), ddn.data(), ej, H, K, V, first, chunks, 64);
  }
  // Every gradient over the segments' chunks, into the packed f32.
  std::vector<float> out(qk_len + v_len + BTH * (1 + n), 0.f);
  if (total > 0) {
    GdpGradsPipeParams gp{};
    gp.q = a.q; gp.k = a.k; gp.v = vb.data(); gp.aux = P.aux.data(); gp.table = tab.data();
    gp.ainv = wy.ainv.data(); gp.hs = hs.data(); gp.dhs = dhs.data(); gp.dn = dn.data();
    gp.ddn = ddn.data(); gp.dob = dob.data(); gp.out = out.data();
    gp.dgates = out.data() + qk_len + v_len; gp.split = a.split; gp.batch = c.B;
    gp.tokens = c.T; gp.heads = c.H; gp.dk = c.K; gp.dv = c.V; gp.n = c.n; gp.nseq = Ns;
    gp.scale = scale; gp.qr = QR;
    launch(total, H, GDPG_THREADS, [&] {
#define ARGS GDP_ARGS_OF(GDP_GRADS_FIELDS, gp)
      if (KPT == 64 && VPT == 64) gdp_bwd_grads_bf16_64_64(ARGS);
      if (KPT == 64 && VPT == 128) gdp_bwd_grads_bf16_64_128(ARGS);
      if (KPT == 128 && VPT == 64) gdp_bwd_grads_bf16_128_64(ARGS);
      if (KPT == 128 && VPT == 128 && c.n == 1) gdp_bwd_grads_bf16_128_128(ARGS);
      if (KPT == 128 && VPT == 128 && c.n >= 2) gdp_bwd_grads_bf16_128_128_tiles(ARGS);
#undef ARGS
    });
  }
  return {out, dh0, Ns};
}

void run_bf16_segments_bwd(const Case& c, int len, int bv) {
  Prob P = make(c, 8765 + c.K + c.T);
  // Rounded to bf16 once (segments_bwd rounds again: a no-op), so that the reference sees the
  // kernels' inputs.
  for (auto* x : {&P.qk, &P.v, &P.dout}) to_bf16(*x);
  const long K = c.K, V = c.V, n = c.n, H = c.H, N = P.N, BTH = P.BTH, sl = N * H * K * V;
  const long qk_len = BTH * (n + 1) * K, v_len = BTH * n * V, ga = qk_len + v_len;
  std::vector<double> h0d, dhtd(P.dht.begin(), P.dht.end());
  if (c.h0) h0d.assign(P.aux.begin() + BTH * (1 + n), P.aux.end());
  Ref R;
  naive(P, c.h0 ? h0d.data() : nullptr, dhtd.data(), R, true);
  // One segment per sequence (the unsplit backward's arithmetic: bf16's own error here), then
  // `len`.
  const int whole = (c.T + 63) / 64 * 64;
  for (const int l : {whole, len}) {
    const SegGrads g = segments_bwd(P, l, bv);
    std::vector<float> gq, gk;
    std::vector<double> rq, rk;
    for (long tk = 0; tk < BTH / H; ++tk)
      for (long s = 0; s <= n; ++s)
        for (long i = 0; i < H * K; ++i) {
          const long at = (tk * (n + 1) + s) * H * K + i;
          (s == 0 ? gq : gk).push_back(g.out[at]);
          (s == 0 ? rq : rk).push_back(R.grads[at]);
        }
    char name[64], what[32];
    snprintf(name, sizeof name, "%s /%d bwd%d", c.name, len, bv);
    auto rep = [&](const char* grad, double e) {
      if (l == whole) snprintf(what, sizeof what, "unsplit %s", grad);
      else snprintf(what, sizeof what, "seg %ld %s", g.segments, grad);
      report(name, what, e, 1e-2);
    };
    rep("dq", rel(gq.data(), rq.data(), gq.size()));
    rep("dk", rel(gk.data(), rk.data(), gk.size()));
    rep("dv", rel(g.out.data() + qk_len, R.grads.data() + qk_len, v_len));
    rep("dg", rel(g.out.data() + ga, R.grads.data() + ga, BTH));
    rep("db", rel(g.out.data() + ga + BTH, R.grads.data() + ga + BTH, BTH * n));
    if (c.h0) rep("dh0", rel(g.dh0.data(), R.grads.data() + ga + BTH * (1 + n), sl));
  }
}

// Context parallelism's row correction (cp_fix.cuh, launched as src/op/cuda/cp_fix.rs does):
// y[row, :V] = x[row, :V] + x[row, V:V+K] · S[seq, head] over the rows of `seqs` sequences of
// `ops` outer indices of `inner` rows each from `outer0` on, against a float64 loop on the same
// bf16 x. The kernel rounds S to bf16 (MmaBf16::pack: S is the mma's B operand) and accumulates
// in f32, so the reference reads S rounded to bf16 too. Rows outside the range (an outer index
// below `outer0` and one past the last) and `yoff` elements before y must keep their poison.
// With `with_s` false: a plain copy of the first V columns (exact). `gx`: the row groups of the
// grid (fewer than the tiles: blocks walk several 16-row tiles; more: some blocks get none).
static void run_cp_fix(int H, int K, int V, int seqs, long outer0, int ops, int inner, int gx,
                       bool with_s, int yoff = 0) {
  std::mt19937 rng(2024 + K + V + inner + ops);
  std::normal_distribution<float> nd(0, 1);
  const long W = V + K, outers = outer0 + (long)seqs * ops + 1, nrows = outers * H * inner;
  std::vector<float> xf(nrows * W);
  for (auto& e : xf) e = nd(rng);
  const std::vector<__nv_bfloat16> xb = to_bf16(xf);
  std::vector<float> s(with_s ? (long)seqs * H * K * V : 0);
  for (auto& e : s) e = nd(rng) / sqrtf((float)K);
  std::vector<double> sr(s.size());  // S as the kernel's mma reads it: rounded to bf16
  for (size_t i = 0; i < s.size(); ++i) sr[i] = __bfloat162float(__float2bfloat16_rn(s[i]));
  std::vector<double> ref(nrows * V, 0.0);
  std::vector<char> covered(nrows, 0);
  for (long sq = 0; sq < seqs; ++sq)
    for (long h = 0; h < H; ++h)
      for (long i = 0; i < (long)ops * inner; ++i) {
        const long outer = outer0 + sq * ops + i / inner, row = (outer * H + h) * inner + i % inner;
        covered[row] = 1;
        const float* xr = &xf[row * W];
        const double* sh = with_s ? &sr[(sq * H + h) * K * V] : nullptr;
        for (long j = 0; j < V; ++j) {
          double a = xr[j];
          for (long k = 0; sh && k < K; ++k) a += (double)xr[V + k] * sh[k * V + j];
          ref[row * V + j] = a;
        }
      }
  char name[64];
  snprintf(name, sizeof name, "cp fix H%d K%d V%d %dx%dx%d@%ld", H, K, V, seqs, ops, inner, outer0);
  auto check = [&](auto zero) {
    using TO = decltype(zero);
    constexpr bool f32 = std::is_same_v<TO, float>;
    TO poison;
    memset(&poison, 0x7f, sizeof poison);
    std::vector<TO> ybuf(yoff + nrows * V, poison);
    TO* y = ybuf.data() + yoff;
    GdpFixParams<TO> p{};
    p.x = xb.data(); p.y = y; p.s = with_s ? s.data() : nullptr; p.heads = H; p.dk = K;
    p.dv = V; p.outer0 = outer0; p.outer_per_seq = ops; p.inner = inner;
    launch(gx, (V + GDP_FIX_COLS - 1) / GDP_FIX_COLS, GDP_FIX_THREADS, [&] {
      if constexpr (f32) gdp_cp_fix_f32(GDP_ARGS_OF(GDP_FIX_FIELDS, p));
      else gdp_cp_fix_bf16(GDP_ARGS_OF(GDP_FIX_FIELDS, p));
    }, (unsigned)(seqs * H));
    std::vector<float> got;
    std::vector<double> want;
    bool kept = true;
    for (int i = 0; i < yoff; ++i) kept = kept && !memcmp(&ybuf[i], &poison, sizeof poison);
    for (long r = 0; r < nrows; ++r)
      for (long j = 0; j < V; ++j) {
        const TO v = y[r * V + j];
        if (!covered[r]) {
          kept = kept && !memcmp(&v, &poison, sizeof poison);
          continue;
        }
        if constexpr (f32) got.push_back(v);
        else got.push_back(__bfloat162float(v));
        want.push_back(ref[r * V + j]);
      }
    char what[32];
    snprintf(what, sizeof what, "%s%s%s", f32 ? "f32" : "bf16", with_s ? "" : " copy",
             yoff ? " y+1" : "");
    double e = rel(got.data(), want.data(), got.size());
    if (!kept) {
      printf("%-26s %-8s wrote outside its rows\n", name, what);
      e = 1e9;
    }
    // A plain copy is exact; the product within f32 accumulation, or bf16 output rounding.
    report(name, what, e, !with_s ? 0.0 : f32 ? 1e-5 : 1e-2);
  };
  check(0.f);
  check(__nv_bfloat16{0});
}

// [x | I_K] per (sequence, head) (gdp_cp_widen_states): out [blocks, K, V + K] f32, x (or
// zeros where null) in the first V columns, the identity in the last K; exact. `gx` blocks of
// 256 threads (fewer than the elements: the grid-stride loop); nothing past out's end written.
static void run_cp_widen(long blocks, int K, int V, bool with_x, unsigned gx) {
  std::mt19937 rng(77 + K + V);
  std::normal_distribution<float> nd(0, 1);
  const long W = V + K, total = blocks * K * W;
  std::vector<float> x(with_x ? blocks * K * V : 0), out(total + 1, -7.f);
  for (auto& e : x) e = nd(rng);
  std::vector<double> ref(total);
  for (long row = 0; row < blocks * K; ++row)
    for (long c = 0; c < W; ++c)
      ref[row * W + c] = c < V ? (with_x ? x[row * V + c] : 0.0) : (c - V == row % K ? 1.0 : 0.0);
  GdpWidenParams p{};
  p.x = with_x ? x.data() : nullptr; p.out = out.data(); p.blocks = blocks; p.dk = K; p.dv = V;
  launch(gx, 1, 256, [&] { gdp_cp_widen_states(GDP_ARGS_OF(GDP_WIDEN_FIELDS, p)); });
  char name[64];
  snprintf(name, sizeof name, "cp widen %ldx K%d V%d", blocks, K, V);
  double e = rel(out.data(), ref.data(), total);
  if (out[total] != -7.f) {
    printf("%-26s %-8s wrote past its end\n", name, with_x ? "x" : "null x");
    e = 1e9;
  }
  report(name, with_x ? "x" : "null x", e, 0.0);
}

// gdp_fold_chains against the folds in float64: random summaries [x⁰ | x̃] (x̃ scaled so that
// the states stay of order one), chains of several lengths with an empty segment passed on,
// start states or none, output rows left out (-1); `out` rows past the written ones and `fin`
// must hold what the kernel was to write, and nothing past their ends.
static void run_fold(int H, int K, int V, bool with_s0) {
  std::mt19937 rng(91 + K * 3 + V + with_s0);
  std::normal_distribution<float> nd(0, 1);
  const long W = V + K, KV = (long)K * V, segments = 7;
  Chains ch;
  ch.steps = {0, 1, -3, 3, 4, 6, 5};   // chains: 0 1 (2 passed) 3 | 4 | 6 5
  ch.chain_at = {0, 4, 5, 7};
  ch.rows = {0, 1, 2, -1, 3, 4, 5};
  const long chains = 3, rows = 6;
  std::vector<float> t(segments * H * K * W), s0(with_s0 ? chains * H * KV : 0);
  for (long i = 0; i < (long)t.size(); ++i) t[i] = nd(rng) / ((i % W) < V ? 1.f : sqrtf((float)K));
  for (auto& x : s0) x = nd(rng);
  std::vector<float> out(rows * H * KV + 1, -7.f), fin(chains * H * KV + 1, -7.f);
  std::vector<double> ref_out(rows * H * KV, 0.0), ref_fin(chains * H * KV, 0.0);
  for (long c = 0; c < chains; ++c)
    for (long h = 0; h < H; ++h) {
      std::vector<double> st(KV, 0.0);
      bool has = with_s0;
      if (has) for (long e = 0; e < KV; ++e) st[e] = s0[(c * H + h) * KV + e];
      for (int p = ch.chain_at[c]; p < ch.chain_at[c + 1]; ++p) {
        if (ch.rows[p] >= 0) std::copy(st.begin(), st.end(), &ref_out[(ch.rows[p] * H + h) * KV]);
        if (ch.steps[p] < 0) continue;
        const float* x = &t[((long)ch.steps[p] * H + h) * K * W];
        std::vector<double> nx(KV);
        for (long r = 0; r < K; ++r)
          for (long v = 0; v < V; ++v) {
            double acc = x[r * W + v];
            for (long m = 0; has && m < K; ++m) acc += (double)x[r * W + V + m] * st[m * V + v];
            nx[r * V + v] = acc;
          }
        st = nx;
        has = true;
      }
      std::copy(st.begin(), st.end(), &ref_fin[(c * H + h) * KV]);
    }
  launch_fold(t.data(), with_s0 ? s0.data() : nullptr, ch, out.data(), fin.data(), H, K, V);
  char name[64];
  snprintf(name, sizeof name, "fold H%d K%d V%d", H, K, V);
  double e = std::max(rel(out.data(), ref_out.data(), rows * H * KV),
                      rel(fin.data(), ref_fin.data(), chains * H * KV));
  if (out[rows * H * KV] != -7.f || fin[chains * H * KV] != -7.f) {
    printf("%-26s %-8s wrote past its end\n", name, with_s0 ? "s0" : "no s0");
    e = 1e9;
  }
  report(name, with_s0 ? "s0" : "no s0", e, 1e-5);
}

// Context parallelism's kernels on small odd shapes: K not a multiple of 16 (12, 40, 13),
// V over one tile of GDP_FIX_COLS (136, 260), H 2 and 3, several sequences, o-like (inner 1),
// chunk-state-like (inner K) and dDelta-like (inner 64) rows from a nonzero outer0, an odd row
// width (K 13: unpaired loads), S null (the copies of the uncorrected sequences), and outputs
// the kernel must store one element at a time: odd V, and a y one element off its pair
// alignment (these found that unpaired stores wrote only every other column).
static void run_cp() {
  run_cp_fix(2, 12, 20, 3, 1, 3, 12, 2, true);   // inner K; the second row group idle
  run_cp_fix(3, 40, 136, 2, 2, 3, 64, 1, true);  // inner 64: 12 tiles on one block's 8 warps
  run_cp_fix(3, 40, 260, 2, 1, 37, 1, 1, true);  // inner 1, three value tiles
  run_cp_fix(2, 13, 20, 2, 3, 5, 4, 1, true);    // odd K and row width: unpaired loads
  run_cp_fix(2, 12, 136, 1, 4, 3, 12, 1, false); // copy (S null) of the rows after the others
  run_cp_widen(6, 12, 20, true, 3);
  run_cp_widen(6, 40, 136, true, 8);
  run_cp_widen(6, 40, 136, false, 8);
  run_cp_widen(5, 13, 21, true, 3);   // K, V not multiples of 4: one element a thread
  run_cp_fix(2, 13, 21, 2, 3, 5, 4, 1, true);     // odd V
  run_cp_fix(3, 40, 260, 2, 1, 37, 1, 1, true, 1);  // y one element off
  run_cp_fix(2, 128, 128, 2, 1, 21, 1, 2, true);   // K = V = 128: 16-byte rows, 4 k groups
  run_cp_fix(2, 64, 40, 1, 2, 3, 64, 1, false);    // a copy in 16-byte rows
  run_cp_fix(2, 256, 64, 1, 1, 40, 1, 1, true);    // K = 256: key groups past the first four
  // The segments' fold: K over one pass of 16 and not a multiple of it, V over one tile of 32
  // and odd, the largest K (K and V multiples of 4: 16-byte copies; else 4-byte).
  run_fold(2, 13, 20, true);
  run_fold(2, 40, 33, false);
  run_fold(1, 128, 64, true);
  run_fold(1, 256, 40, true);
  run_fold(2, 12, 36, true);  // 16-byte copies of a pass wider than K, V a multiple of 4 not 8
  // Passes of 16 key columns, as on a GPU with less shared memory: the same sums, in the same
  // order (the errors equal the full passes' above).
  g_fold_pass = 16;
  run_fold(2, 40, 33, false);
  run_fold(1, 128, 64, true);
  run_fold(1, 256, 40, true);
  g_fold_pass = 128;
}

// The forward in segments (run_bf16_segments) on lengths that are no multiple of the segment
// length: dense batches with h0, packed sequences with an empty one and strong gates, n = 1..3,
// K = V = 128 (the widened scan's 64-column tiles), odd V, grouped heads read in place. Weak
// gates elsewhere (gmax 0.02-0.05), so that a segment's transition M is far from zero and a
// wrong fold shows in o and the final states.
static void run_segments() {
  run_bf16_segments({"seg n1 T300 K32 V48 h0", 2, 300, 2, 32, 48, 1, true, {}, 0.02f, 16}, 128, 32, false);
  run_bf16_segments({"seg packed n3 K24 V20", 1, 400, 2, 24, 20, 3, false, {0, 130, 130, 333, 400},
                     20.f, 16}, 64, 16, false);
  run_bf16_segments({"seg n2 T200 K128 V128 h0", 1, 200, 2, 128, 128, 2, true, {}, 0.02f, 64}, 64,
                    64, false);
  run_bf16_segments({"seg odd V n2 T150 K12 V13 h0", 1, 150, 2, 12, 13, 2, true, {}, 0.05f, 16}, 64,
                    16, false);
  run_bf16_segments({"seg grp2 n1 T260 K24 V40 h0", 1, 260, 4, 24, 40, 1, true, {}, 0.02f, 16, 2},
                    128, 32, true);
}

// The backward in segments (run_bf16_segments_bwd): the same kinds of cases as the forward's.
static void run_segments_bwd() {
  run_bf16_segments_bwd({"seg n1 T300 K32 V48 h0", 2, 300, 2, 32, 48, 1, true, {}, 0.02f, 16}, 128,
                        32);
  run_bf16_segments_bwd({"seg packed n3 K24 V20", 1, 400, 2, 24, 20, 3, false,
                         {0, 130, 130, 333, 400}, 20.f, 16}, 64, 16);
  run_bf16_segments_bwd({"seg n2 T200 K128 V128 h0", 1, 200, 2, 128, 128, 2, true, {}, 0.02f, 64},
                        64, 64);
  // K 20, not the forward's 12: at K 12 V 13 with these weak gates the unsplit bf16 backward's
  // own dg error is 1.0-1.3e-2 (the segmented one's the same), over the bf16 tolerance.
  run_bf16_segments_bwd({"seg odd V n2 T150 K20 V13 h0", 1, 150, 2, 20, 13, 2, true, {}, 0.05f, 16},
                        64, 16);
}

// gdp_sum_groups_{bf16,f32} against their definition (f32 sums in group order, rounded to T),
// bit for bit: 16-byte bf16 rows, odd widths, and a source one element off 16-byte alignment.
template <class T>
static void run_sum_groups(long rows, int r, int d, int offset) {
  std::mt19937 rng(rows * 31 + r * 7 + d);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> x(rows * r * d + offset);
  for (auto& e : x) e = gdp_round_to<T>(nd(rng));
  std::vector<T> y(rows * d, gdp_round_to<T>(1e30f));
  const GdpSumGroupsParams<T> sp{x.data() + offset, y.data(), rows, r, d};
  launch(2, 1, 32, [&] {
    if constexpr (sizeof(T) == 2)
      gdp_sum_groups_bf16(GDP_ARGS_OF(GDP_SUM_GROUPS_FIELDS, sp));
    else
      gdp_sum_groups_f32(GDP_ARGS_OF(GDP_SUM_GROUPS_FIELDS, sp));
  });
  long diff = 0;
  for (long o = 0; o < rows; ++o)
    for (int c = 0; c < d; ++c) {
      float acc = 0.f;
      for (int j = 0; j < r; ++j) acc += to_f(x[offset + (o * r + j) * d + c]);
      diff += to_f(gdp_round_to<T>(acc)) != to_f(y[o * d + c]);
    }
  printf("sum groups %s rows %ld r %d d %d +%d: %s\n", sizeof(T) == 2 ? "bf16" : "f32", rows, r,
         d, offset, diff == 0 ? "the same bits" : "DIFFERENT");
  if (diff != 0) ++fails;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // Arguments: `rev` (reversed thread ids), `bf16` (only the bf16 kernels), `bwd` (with `bf16`:
  // only the split bf16 backward).
  bool only_bf16 = false, only_bwd = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "bwd")) only_bwd = true;
    if (!strcmp(argv[i], "rev")) g_reverse = true;
    if (!strcmp(argv[i], "bf16")) only_bf16 = true;
  }
  std::vector<Case> cases = {
    {"n1 T100 K32 V48 h0", 2, 100, 2, 32, 48, 1, true, {}, 1.f, 16},
    {"n2 T77 K20 V12 h0 BV8", 1, 77, 3, 20, 12, 2, true, {}, 1.f, 8},
    {"n3 T70 K16 V16", 2, 70, 2, 16, 16, 3, false, {}, 1.f, 16},
    {"n2 T1 K8 V8 h0", 2, 1, 2, 8, 8, 2, true, {}, 1.f, 8},
    {"packed n2 empty h0", 1, 150, 2, 12, 10, 2, true, {0, 37, 37, 150}, 1.f, 8},
    {"packed n3 strong", 1, 129, 2, 24, 20, 3, false, {0, 1, 64, 64, 129}, 20.f, 16},
    // Odd widths: rows of V (K) elements start at odd offsets, so pair and vector accesses must
    // fall back where they would be misaligned (run.sh builds with -fsanitize=alignment).
    {"odd V n2 T45 K12 V13 h0", 1, 45, 2, 12, 13, 2, true, {}, 1.f, 8},
    {"odd K n1 T50 K13 V10", 1, 50, 2, 13, 10, 1, false, {}, 1.f, 8},
  };
  // Arguments: `step` (only the decode step).
  // `cp` (only context parallelism's kernels, gdp_cp_fix_*, gdp_cp_widen_states and the
  // segments' gdp_fold_chains, with the unpaired outputs that the default run leaves out: see
  // run_cp).
  bool only_step = false, only_cp = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "step")) only_step = true;
    if (!strcmp(argv[i], "cp")) only_cp = true;
  }
  // Arguments: `f32dg` (only the f32 backward at K = 256 with strong gates, four times: its
  // gate gradient depends on the order of the block's float atomics).
  for (int i = 1; i < argc; ++i)
    if (!strcmp(argv[i], "f32dg")) g_bwd_only = true;
  if (g_bwd_only) {
    const Case c{"K256 V200 n1 strong", 1, 70, 2, 256, 200, 1, false, {}, 20.f, 8};
    for (int r = 0; r < 4; ++r) run_case(c);
    printf("fails: %d\n", fails);
    return fails != 0;
  }
  for (int i = 1; i < argc; ++i)
    if (!strcmp(argv[i], "seg")) {
      if (!only_bwd) run_segments();
      run_segments_bwd();
      printf("fails: %d\n", fails);
      return fails != 0;
    }
  if (only_cp) {
    run_cp();
    printf("fails: %d\n", fails);
    return fails != 0;
  }
  for (auto d : {std::vector<int>{2, 3, 16, 24, 1}, {1, 2, 40, 70, 2}, {1, 2, 100, 130, 2},
                 {1, 1, 256, 33, 3}})
    run_step(d[0], d[1], d[2], d[3], d[4]);
  if (only_step) {
    printf("fails: %d\n", fails);
    return fails != 0;
  }
  if (!only_bwd) run_cp();
  for (auto d : {std::vector<int>{37, 2, 128, 0}, {20, 3, 24, 0}, {9, 4, 13, 0}, {11, 2, 64, 1}})
    run_sum_groups<__nv_bfloat16>(d[0], d[1], d[2], d[3]);
  run_sum_groups<float>(13, 3, 24, 0);
  run_sum_groups<float>(7, 2, 13, 1);
  if (!only_bf16)
    for (auto& c : cases) run_case(c);
  cases.push_back({"n2 T90 K128 V128 h0", 1, 90, 2, 128, 128, 2, true, {}, 1.f, 64});
  for (size_t i = 0; i < cases.size(); ++i) {
    const int cfg = (int)i % 3;
    run_bf16_bwd(cases[i], 16 << cfg, 2 + (int)(i % 2));
  }
  run_bf16_bwd(cases.back(), 32, 3, true);
  // Rows exactly as wide as the kernels' tiles (K = 64, V = 128), packed and as q, k parts: the
  // gradient kernel stages them through the compile-time tile copies.
  const Case tiles{"n3 T100 K64 V128 strong", 1, 100, 2, 64, 128, 3, false, {0, 37, 100}, 20.f, 32};
  run_bf16_bwd(tiles, 16, 2);
  run_bf16_bwd(tiles, 32, 3);
  // The scans of 128 value columns (two stages), as the op runs them side by side at B4 H16.
  run_bf16_bwd(cases.back(), 128, 2);
  run_bf16_bwd(tiles, 128, 2);
  // Grouped value heads (Qwen3.5 / Qwen3-Next): q and k read in place with Hk = H / grp heads
  // (BV 32 runs read them so), dq and dk written per value head. Packed sequences, odd widths,
  // and the persistent gradient kernel (K = V = 128, n = 2).
  const std::vector<Case> grouped = {
    {"grp2 n2 T77 K24 V40 h0", 1, 77, 4, 24, 40, 2, true, {}, 1.f, 8, 2},
    {"grp3 n1 packed K32 V13", 1, 100, 6, 32, 13, 1, false, {0, 30, 30, 100}, 5.f, 8, 3},
    {"grp2 n2 T70 K128 V128", 1, 70, 4, 128, 128, 2, false, {}, 1.f, 32, 2},
  };
  for (auto& c : grouped) run_bf16_bwd(c, 32, 3);
  if (only_bwd) {
    printf("fails: %d\n", fails);
    return fails != 0;
  }
  cases.push_back({"n1 T70 K200 V40 h0", 1, 70, 1, 200, 40, 1, true, {}, 1.f, 8});
  cases.insert(cases.end(), grouped.begin(), grouped.end());
  for (auto& c : cases) run_bf16(c);
  run_segments();
  run_segments_bwd();
  printf("fails: %d\n", fails);
  return fails != 0;
}
