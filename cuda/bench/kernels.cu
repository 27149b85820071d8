// Kernel-only timings (CUDA events, median of repeated launches) of the bf16 two-kernel forward
// (gdp_fwd_wy_bf16, gdp_fwd_scan_bf16_<BV>_128), of the split bf16 backward (the same two with
// the states kept, gdp_bwd_dh_bf16_<BV>_128, gdp_bwd_grads_bf16_128_128[_tiles]) at the
// benchmark shapes of docs/benchmarks.md (with the WY kernel beside the scan, and the gradient
// kernel beside the state-gradient scan, where the op overlaps them), and of the fused decode step
// (gdp_step_f32_k128) at B64 H16 K=V=128 n = 1..3 and at Qwen3.5's GDN shapes, with achieved
// bandwidth. No Rust needed, so it separates kernel time from the op's host-side work:
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icuda cuda/bench/kernels.cu -o kbench && ./kbench
#include "gdp.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

// KB_PROFILE=1: one launch per timing, no warm-up (for ncu, which replays each launch). Under
// `ncu -k regex:gdp_fwd_scan_bf16_32` with KB_ONLY_B1=1 the BV 32 forward scan then runs once per
// row that times it, in this order: with its output (`scan`), beside the WY kernel
// (`overlapped`), with the states and Delta and no output (`scan-no-out`), with the output and
// both (`scan+states`), the output and the states (`scan+hs`), the output and Delta (`scan+dn`).
static const bool kb_profile = getenv("KB_PROFILE") != nullptr;

template <class F>
static float median_ms(F launch, int reps = 20) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  if (kb_profile) reps = 1;
  for (int i = 0; i < (kb_profile ? 0 : 3); ++i) launch();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

template <class T>
static T* upload(const std::vector<T>& h) {
  T* d;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

static void forward(int B, int T, int H, int n) {
  const int K = 128, V = 128, C = 64;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0, 1);
  const long BT = (long)B * T, BTH = BT * H;
  // q [B, T, H, K] and k [B, T·n, H, K] apart, as the op passes FLA's inputs (read in place).
  std::vector<__nv_bfloat16> q(BTH * K), k(BTH * n * K), v(BT * n * H * V);
  for (auto& x : q) x = __float2bfloat16_rn(nd(rng) / sqrtf((float)K));
  for (auto& x : k) x = __float2bfloat16_rn(nd(rng) / sqrtf((float)K));
  for (auto& x : v) x = __float2bfloat16_rn(nd(rng));
  std::vector<float> aux(BTH * (1 + n));
  for (long i = 0; i < BTH; ++i) aux[i] = -log1pf(expf(-nd(rng)));  // logsigmoid
  for (long i = BTH; i < (long)aux.size(); ++i) aux[i] = 1.f / (1.f + expf(-nd(rng)));
  std::vector<int> tab, chunks;
  for (int s = 0; s < B; ++s) {
    const int nch = (T * n + C - 1) / C;
    tab.insert(tab.end(), {s, 0, T, (int)chunks.size() / 2});
    for (int c = 0; c < nch; ++c) chunks.insert(chunks.end(), {s, c});
  }
  const long total = chunks.size() / 2, slots = total * H;
  tab.insert(tab.end(), chunks.begin(), chunks.end());
  auto* dq = upload(q);
  auto* dk = upload(k);
  auto* dv = upload(v);
  auto* daux = upload(aux);
  auto* dtab = upload(tab);
  __nv_bfloat16 *w, *u, *p;
  float* cf;
  CK(cudaMalloc(&w, slots * C * K * 2));
  CK(cudaMalloc(&u, slots * C * V * 2));
  CK(cudaMalloc(&p, slots * C * C * 2));
  CK(cudaMalloc(&cf, slots * 3 * C * 4));
  __nv_bfloat16* ob;
  CK(cudaMalloc(&ob, BTH * V * 2));
  const float scale = 1.f / sqrtf((float)K);
  const int KP = K, VP = V;
  const int QR = 16 * (((C + n - 1) / n + 15) / 16);
  // The kernels' parameters (cuda/params.cuh, passed with GDP_ARGS_OF) for these buffers: the WY
  // kernel (with or without Ainv, the chunk order and the ready counters) and the forward scan
  // or states-only kernel (outb: o in bf16; hs, dn: the backward's states and Delta; qr 0: no
  // query rows).
  auto wy_params = [&](__nv_bfloat16* ainv, const int* order, int* ready) {
    GdpWyParams a{};
    a.q = dq; a.k = dk; a.v = dv; a.aux = daux; a.table = dtab; a.w = w; a.u = u; a.p = p;
    a.coef = cf; a.ainv = ainv; a.order = order; a.ready = ready; a.split = 1; a.batch = B;
    a.tokens = T; a.heads = H; a.dk = K; a.dv = V; a.n = n; a.nseq = B; a.scale = scale;
    return a;
  };
  auto scan_params = [&](__nv_bfloat16* outb, __nv_bfloat16* hs_out, __nv_bfloat16* dn_out,
                         int qr, int ns, const int* ready) {
    GdpScanParams a{};
    a.q = dq; a.k = dk; a.aux = daux; a.table = dtab; a.w = w; a.u = u; a.p = p; a.coef = cf;
    a.h0_override = daux; a.out = nullptr; a.outb = outb; a.fin = nullptr; a.hs = hs_out;
    a.dn = dn_out; a.ready = ready; a.split = 1; a.use_h0_override = 0; a.batch = B;
    a.tokens = T; a.heads = H; a.dk = K; a.dv = V; a.dv_in = V; a.n = n; a.has_h0 = 0; a.qr = qr;
    a.ns = ns;
    return a;
  };
  const int wy_smem = 4 * (C * GDP_INV_LD + 6 * C) + 2 * C * ((KP + 8) + std::max(KP, VP) + 8);
  CK(cudaFuncSetAttribute(gdp_fwd_wy_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize, wy_smem));
  const float t_wy = median_ms([&] {
    const GdpWyParams wp = wy_params(nullptr, nullptr, nullptr);
    gdp_fwd_wy_bf16<<<dim3(total, H), 128, wy_smem>>>(GDP_ARGS_OF(GDP_WY_FIELDS, wp));
  });
  printf("B%d T%d H%d n%d: wy %.3f ms", B, T, H, n, t_wy);
  if (getenv("KB_ONLY_WY") != nullptr) {  // the WY kernel alone, also as the backward runs it
    __nv_bfloat16* ag;
    CK(cudaMalloc(&ag, slots * C * C * 2));
    const float t_ag = median_ms([&] {
      const GdpWyParams wp = wy_params(ag, nullptr, nullptr);
      gdp_fwd_wy_bf16<<<dim3(total, H), 128, wy_smem>>>(GDP_ARGS_OF(GDP_WY_FIELDS, wp));
    });
    printf(" | storing Ainv too (the backward's) %.3f ms\n", t_ag);
    for (void* x : {(void*)ag, (void*)dq, (void*)dk, (void*)dv, (void*)daux, (void*)dtab, (void*)w,
                    (void*)u, (void*)p, (void*)cf, (void*)ob})
      CK(cudaFree(x));
    return;
  }
  // The forward scan with BV value columns: writing the output (o in bf16, o_out, as the op
  // without a final state), or each chunk's start state and Delta (the backward's rerun, into
  // hs_out and dn_out); qr query rows staged per chunk (0: the states-only kernels), at most
  // max_ns stages; returns ms and the stages.
  auto time_scan = [&](auto kern, int bv, __nv_bfloat16* o_out, __nv_bfloat16* hs_out,
                       __nv_bfloat16* dn_out, int qr, int max_ns, int& NS) {
    // KB_NS2=1: two stages even where three fit.
    const bool three =
        max_ns >= 3 && gdpc_scan_smem_bytes(KP, qr, bv, 3) <= 232448 && !getenv("KB_NS2");
    NS = three ? 3 : 2;
    const int smem = gdpc_scan_smem_bytes(KP, qr, bv, NS);
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return median_ms([&] {
      const GdpScanParams sp = scan_params(o_out, hs_out, dn_out, qr, NS, nullptr);
      kern<<<dim3(B * H, V / bv), bv == 16 ? 128 : 256, smem>>>(
          GDP_ARGS_OF(GDP_SCAN_FIELDS, sp));
    });
  };
  auto scan = [&](auto kern, int bv) {
    int NS;
    const float t = time_scan(kern, bv, ob, nullptr, nullptr, QR, 3, NS);
    printf(" | scan BV%d/%d stages %.3f ms (%d blocks)", bv, NS, t, B * H * V / bv);
  };
  scan(gdp_fwd_scan_bf16_16_128, 16);
  scan(gdp_fwd_scan_bf16_32_128, 32);
  scan(gdp_fwd_scan_bf16_64_128, 64);
  printf("\n");

  // The WY kernel beside the scan (src/op/cuda/pipeline.rs) where the scan's blocks (BV 32)
  // fill fewer than half the multiprocessors: the counters zeroed, the WY kernel over the
  // chunks time-major on the default stream, the scan on a high-priority stream waiting for
  // them; timed from before the zeroing to the scan's end.
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (2 * B * H * (V / 32) < sms) {
    const int nch = (T * n + C - 1) / C;
    std::vector<int> order;
    for (int c = 0; c < nch; ++c)
      for (int s = 0; s < B; ++s) order.push_back(s * nch + c);
    int* dorder = upload(order);
    const size_t counters = (total / GDPC_READY_GROUP + B + 1) * H;
    int* ready;
    CK(cudaMalloc(&ready, counters * sizeof(int)));
    int least, greatest;
    CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t urgent;
    CK(cudaStreamCreateWithPriority(&urgent, cudaStreamNonBlocking, greatest));
    cudaEvent_t zeroed, done;
    CK(cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    const int NS = gdpc_scan_smem_bytes(KP, QR, 32, 3) <= 232448 ? 3 : 2;
    const int smem = gdpc_scan_smem_bytes(KP, QR, 32, NS);
    CK(cudaFuncSetAttribute(gdp_fwd_scan_bf16_32_128, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            smem));
    // The WY kernel's shared memory padded so that at most 3, 2 or 1 of its blocks share a
    // multiprocessor (4 by default): fewer WY blocks at a time beside the scan.
    CK(cudaFuncSetAttribute(gdp_fwd_wy_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            150 * 1024));
    for (const int wy_pad : {wy_smem, 72 * 1024, 100 * 1024, 150 * 1024}) {
      if (wy_pad != wy_smem && (n < 2 || getenv("KB_WY_PAD") == nullptr)) continue;
      const float t_pad = median_ms([&] {
        const GdpWyParams wp = wy_params(nullptr, dorder, nullptr);
        gdp_fwd_wy_bf16<<<total * H, 128, wy_pad, 0>>>(GDP_ARGS_OF(GDP_WY_FIELDS, wp));
      });
      const float t = median_ms([&] {
        CK(cudaMemsetAsync(ready, 0, counters * sizeof(int), 0));
        CK(cudaEventRecord(zeroed, 0));
        CK(cudaStreamWaitEvent(urgent, zeroed, 0));
        const GdpWyParams wp = wy_params(nullptr, dorder, ready);
        gdp_fwd_wy_bf16<<<total * H, 128, wy_pad, 0>>>(GDP_ARGS_OF(GDP_WY_FIELDS, wp));
        const GdpScanParams sp = scan_params(ob, nullptr, nullptr, QR, NS, ready);
        gdp_fwd_scan_bf16_32_128<<<dim3(B * H, V / 32), 256, smem, urgent>>>(
            GDP_ARGS_OF(GDP_SCAN_FIELDS, sp));
        CK(cudaEventRecord(done, urgent));
        CK(cudaStreamWaitEvent(0, done, 0));
      });
      printf("  overlapped wy + scan BV32/%d %.3f ms (wy %.3f + scan alone, above); wy smem %d "
             "bytes: alone %.3f ms\n",
             NS, t, t_wy, wy_pad, t_pad);
    }
    CK(cudaStreamDestroy(urgent));
    CK(cudaFree(dorder));
    CK(cudaFree(ready));
  }

  // ---- The split backward (with dO random, dht zero).
  __nv_bfloat16 *ag, *hs, *dn, *dhs, *ddn, *dob;
  float *dht, *gout;
  CK(cudaMalloc(&ag, slots * C * C * 2));
  CK(cudaMalloc(&hs, slots * K * V * 2));
  CK(cudaMalloc(&dn, slots * C * V * 2));
  CK(cudaMalloc(&dhs, slots * K * V * 2));
  CK(cudaMalloc(&ddn, slots * C * V * 2));
  std::vector<__nv_bfloat16> hdo(BTH * V);
  for (auto& x : hdo) x = __float2bfloat16_rn(nd(rng));
  dob = upload(hdo);
  CK(cudaMalloc(&dht, (long)B * H * K * V * 4));
  CK(cudaMemset(dht, 0, (long)B * H * K * V * 4));
  // The op's gradient parts: bf16 dq, dk and dv, f32 [dg | dβ].
  __nv_bfloat16 *gq, *gk, *gv;
  CK(cudaMalloc(&gq, BTH * K * 2));
  CK(cudaMalloc(&gk, BTH * n * K * 2));
  CK(cudaMalloc(&gv, BTH * n * V * 2));
  CK(cudaMalloc(&gout, BTH * (1 + n) * 4));
  // The state-gradient scan's parameters (dht zero, no dh0; ready and signal may be null) and
  // the gradient kernel's (into the op's parts; the pipe fields, GDP_PIPE_FIELDS, go only to
  // the persistent kernel: the others get GDP_GRADS_FIELDS).
  auto dh_params = [&](int ns, const int* ready, int* signal) {
    GdpDhParams a{};
    a.q = dq; a.k = dk; a.table = dtab; a.w = w; a.p = p; a.coef = cf; a.dob = dob; a.dht = dht;
    a.dhs = dhs; a.ddn = ddn; a.dh0 = nullptr; a.ready = ready; a.signal = signal; a.split = 1;
    a.has_dht = 1; a.write_dh0 = 0; a.batch = B; a.tokens = T; a.heads = H; a.dk = K; a.dv = V;
    a.dv_in = V; a.n = n; a.qr = QR; a.ns = ns;
    return a;
  };
  auto grads_params = [&](int* pipe, const int* order, int items, int ready_count, int beside,
                          int scan_blocks) {
    GdpGradsPipeParams a{};
    a.q = dq; a.k = dk; a.v = dv; a.aux = daux; a.table = dtab; a.ainv = ag; a.hs = hs;
    a.dhs = dhs; a.dn = dn; a.ddn = ddn; a.dob = dob; a.out = nullptr; a.dq = gq; a.dk_out = gk;
    a.dv_out = gv; a.dgates = gout; a.pipe = pipe; a.order = order; a.split = 1; a.batch = B;
    a.tokens = T; a.heads = H; a.dk = K; a.dv = V; a.n = n; a.nseq = B; a.scale = scale;
    a.qr = QR; a.items = items; a.ready_count = ready_count; a.beside = beside;
    a.scan_blocks = scan_blocks;
    return a;
  };
  const float t_wya = median_ms([&] {
    const GdpWyParams wp = wy_params(ag, nullptr, nullptr);
    gdp_fwd_wy_bf16<<<dim3(total, H), 128, wy_smem>>>(GDP_ARGS_OF(GDP_WY_FIELDS, wp));
  });
  printf("  bwd: wy+Ainv %.3f ms", t_wya);
  float best_states = 1e9, best_dh = 1e9;
  // The states rerun: the states-only kernel as the op runs it (no query rows, two stages),
  // then the forward scan without an output (the op's earlier rerun) for comparison.
  auto states = [&](auto kern, int bv, int qr, int max_ns, const char* what) {
    int NS;
    const float t = time_scan(kern, bv, nullptr, hs, dn, qr, max_ns, NS);
    if (qr == 0) best_states = std::min(best_states, t);
    printf(" | %s BV%d/%d %.3f", what, bv, NS, t);
  };
  states(gdp_fwd_states_bf16_16_128, 16, 0, 2, "states");
  states(gdp_fwd_states_bf16_32_128, 32, 0, 2, "states");
  states(gdp_fwd_states_bf16_64_128, 64, 0, 2, "states");
  states(gdp_fwd_scan_bf16_32_128, 32, QR, 3, "scan-no-out");
  states(gdp_fwd_scan_bf16_64_128, 64, QR, 3, "scan-no-out");
  // The forward scan writing its output and the states (the forward of save_intermediates),
  // then its output with the start states (hs) only and with Delta (dn) only.
  {
    int NS;
    const float t32 = time_scan(gdp_fwd_scan_bf16_32_128, 32, ob, hs, dn, QR, 3, NS);
    printf(" | scan+states BV32/%d %.3f", NS, t32);
    const float t64 = time_scan(gdp_fwd_scan_bf16_64_128, 64, ob, hs, dn, QR, 3, NS);
    printf(" | scan+states BV64/%d %.3f", NS, t64);
    const float h32 = time_scan(gdp_fwd_scan_bf16_32_128, 32, ob, hs, nullptr, QR, 3, NS);
    const float d32 = time_scan(gdp_fwd_scan_bf16_32_128, 32, ob, nullptr, dn, QR, 3, NS);
    printf(" | scan+hs BV32/%d %.3f | scan+dn BV32/%d %.3f", NS, h32, NS, d32);
  }
  // The state-gradient scan's stages (three where they fit, unless KB_NS2) and shared memory
  // at value tile bv (dh_smem_bytes in src/op/cuda/plan.rs).
  auto dh_stages = [&](int bv, int& smem) {
    const int LB = bv + 8;
    auto smem_of = [&](int ns) {
      return ns * gdpd_stage_bytes(KP, QR, bv) + 2 * (2 * KP * LB + C * LB + QR * LB) + 8 * ns * 3 * C + 12 * ns;
    };
    const int NS = smem_of(3) <= 232448 && !getenv("KB_NS2") ? 3 : 2;
    smem = smem_of(NS);
    return NS;
  };
  auto dh = [&](auto kern, int bv) {
    int smem;
    const int NS = dh_stages(bv, smem);
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const float t = median_ms([&] {
      const GdpDhParams dp = dh_params(NS, nullptr, nullptr);
      kern<<<dim3(B * H, V / bv), bv == 16 ? 128 : 256, smem>>>(
          GDP_ARGS_OF(GDP_DH_FIELDS, dp));
    });
    best_dh = std::min(best_dh, t);
    printf(" | dh BV%d/%d %.3f", bv, NS, t);
  };
  dh(gdp_bwd_dh_bf16_16_128, 16);
  dh(gdp_bwd_dh_bf16_32_128, 32);
  dh(gdp_bwd_dh_bf16_64_128, 64);
  // Where the op runs the states rerun and the state-gradient scan side by side at BV 32 (both
  // fit on the GPU at once, scan_pair_plan in src/op/cuda/plan.rs: B1 T32768 H16): the two
  // on two streams, joined.
  if (2 * B * H * (V / 32) <= sms && 20 * B * H * (V / 32) >= 9 * sms) {
    const int ssmem = gdpc_scan_smem_bytes(KP, 0, 32, 2);
    int dsmem;
    const int dns = dh_stages(32, dsmem);
    cudaStream_t sa, sb;
    CK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
    cudaEvent_t go, da, db;
    for (cudaEvent_t* ev : {&go, &da, &db})
      CK(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
    const float t = median_ms([&] {
      CK(cudaEventRecord(go, 0));
      CK(cudaStreamWaitEvent(sa, go, 0));
      CK(cudaStreamWaitEvent(sb, go, 0));
      const GdpScanParams sp = scan_params(nullptr, hs, dn, 0, 2, nullptr);
      gdp_fwd_states_bf16_32_128<<<dim3(B * H, V / 32), 256, ssmem, sa>>>(
          GDP_ARGS_OF(GDP_SCAN_FIELDS, sp));
      const GdpDhParams dp = dh_params(dns, nullptr, nullptr);
      gdp_bwd_dh_bf16_32_128<<<dim3(B * H, V / 32), 256, dsmem, sb>>>(
          GDP_ARGS_OF(GDP_DH_FIELDS, dp));
      CK(cudaEventRecord(da, sa));
      CK(cudaEventRecord(db, sb));
      CK(cudaStreamWaitEvent(0, da, 0));
      CK(cudaStreamWaitEvent(0, db, 0));
    });
    printf(" | states BV32/2 + dh BV32/%d side by side %.3f", dns, t);
    CK(cudaStreamDestroy(sa));
    CK(cudaStreamDestroy(sb));
    for (cudaEvent_t ev : {go, da, db}) CK(cudaEventDestroy(ev));
  }
  const int gsmem = gdpg_smem_bytes(KP, V, QR);
  // The launch's choice: dv and dk through shared memory at n >= 2.
  const auto grads = n >= 2 ? gdp_bwd_grads_bf16_128_128_tiles : gdp_bwd_grads_bf16_128_128;
  CK(cudaFuncSetAttribute(grads, cudaFuncAttributeMaxDynamicSharedMemorySize, gsmem));
  const float t_gr = median_ms([&] {
    const GdpGradsPipeParams gp = grads_params(nullptr, nullptr, 0, 0, 0, 0);
    grads<<<dim3(total, H), GDPG_THREADS, gsmem>>>(GDP_ARGS_OF(GDP_GRADS_FIELDS, gp));
  });
  printf(" | grads %.3f ms (smem %d) | bwd total %.3f ms\n", t_gr, gsmem,
         t_wya + best_states + best_dh + t_gr);
  // KB_GRADS_PIPE=1 (n >= 2): the persistent gradient kernel after the scan (a block per
  // multiprocessor, the chunks in the table's order), against the grid the op launches there.
  if (getenv("KB_GRADS_PIPE") != nullptr && n >= 2) {
    int *counters, *table_order;
    CK(cudaMalloc(&counters, GDPG_PIPE_COUNTERS * sizeof(int)));
    std::vector<int> identity(total);
    std::iota(identity.begin(), identity.end(), 0);
    CK(cudaMalloc(&table_order, total * sizeof(int)));
    CK(cudaMemcpy(table_order, identity.data(), total * sizeof(int), cudaMemcpyHostToDevice));
    const auto kern = gdp_bwd_grads_bf16_128_128_tiles_pipe;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, gsmem));
    const float t = median_ms([&] {
      CK(cudaMemsetAsync(counters, 0, GDPG_PIPE_COUNTERS * sizeof(int), 0));
      const GdpGradsPipeParams gp = grads_params(counters, table_order, total * H, 1, 0, 0);
      kern<<<sms, GDPG_THREADS, gsmem>>>(GDP_ARGS_OF(GDP_GRADS_PIPE_FIELDS, gp));
    });
    printf("  grads persistent (%d blocks) %.3f ms\n", sms, t);
    CK(cudaFree(counters));
    CK(cudaFree(table_order));
  }

  // KB_CORES=1, where the scans' blocks fill the GPU (B4): the WY kernel beside a scan of two
  // stages, which leaves room for one unpadded WY block next to each scan block, against the
  // launches one after the other. Forward: WY (time-major, counting) with the forward scan
  // waiting on it. Backward: WY (+ Ainv) with the state-gradient scan (chunks from the ends) or
  // the states rerun beside it, the other scan after the WY kernel; against the op's order (WY,
  // then the rerun and the state-gradient scan on two streams).
  if (getenv("KB_CORES") != nullptr && 2 * B * H * (V / 32) >= sms) {
    const int nch = (T * n + C - 1) / C;
    std::vector<int> fo, bo;
    for (int c = 0; c < nch; ++c)
      for (int s = 0; s < B; ++s) fo.push_back(s * nch + c);
    for (int c = nch - 1; c >= 0; --c)
      for (int s = 0; s < B; ++s) bo.push_back(s * nch + c);
    int* dfo = upload(fo);
    int* dbo = upload(bo);
    const size_t counters = (total / GDPC_READY_GROUP + B + 1) * H;
    int* ready;
    CK(cudaMalloc(&ready, counters * sizeof(int)));
    int least, greatest;
    CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t urgent, side;
    CK(cudaStreamCreateWithPriority(&urgent, cudaStreamNonBlocking, greatest));
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t zeroed, done;
    CK(cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    auto wy = [&](int* order, int* rdy, __nv_bfloat16* ainv) {
      const GdpWyParams wp = wy_params(ainv, order, rdy);
      if (order == nullptr)
        gdp_fwd_wy_bf16<<<dim3(total, H), 128, wy_smem, 0>>>(GDP_ARGS_OF(GDP_WY_FIELDS, wp));
      else
        gdp_fwd_wy_bf16<<<total * H, 128, wy_smem, 0>>>(GDP_ARGS_OF(GDP_WY_FIELDS, wp));
    };
    // `first` on the device's stream (the WY kernel), `second` on `st` once the counters are
    // zeroed, then `after` on the device's stream; joined.
    auto run = [&](cudaStream_t st, auto first, auto second, auto after) {
      CK(cudaMemsetAsync(ready, 0, counters * sizeof(int), 0));
      CK(cudaEventRecord(zeroed, 0));
      CK(cudaStreamWaitEvent(st, zeroed, 0));
      first();
      second();
      after();
      CK(cudaEventRecord(done, st));
      CK(cudaStreamWaitEvent(0, done, 0));
    };
    auto fscan = [&](auto kern, int bv, int ns, cudaStream_t st, int* rdy) {
      const int smem = gdpc_scan_smem_bytes(KP, QR, bv, ns);
      const GdpScanParams sp = scan_params(ob, nullptr, nullptr, QR, ns, rdy);
      kern<<<dim3(B * H, V / bv), 256, smem, st>>>(GDP_ARGS_OF(GDP_SCAN_FIELDS, sp));
    };
    auto nothing = [] {};
    printf("  co-resident (WY %d bytes beside a two-stage scan):", wy_smem);
    auto fwd_pair = [&](auto kern, int bv) {
      const float t_seq = median_ms([&] {
        wy(dfo, nullptr, nullptr);
        fscan(kern, bv, 2, 0, nullptr);
      });
      const float t_ovl = median_ms([&] {
        run(urgent, [&] { wy(dfo, ready, nullptr); },
            [&] { fscan(kern, bv, 2, urgent, ready); }, nothing);
      });
      printf(" | fwd BV%d/2 one after the other %.3f, beside %.3f", bv, t_seq, t_ovl);
    };
    fwd_pair(gdp_fwd_scan_bf16_64_128, 64);
    printf("\n");
    auto dh64 = [&](int ns, cudaStream_t st, int* rdy) {
      const int LB = 64 + 8;
      const int smem = ns * gdpd_stage_bytes(KP, QR, 64) + 2 * (2 * KP * LB + C * LB + QR * LB) +
                       8 * ns * 3 * C + 12 * ns;
      const GdpDhParams dp = dh_params(ns, rdy, nullptr);
      gdp_bwd_dh_bf16_64_128<<<dim3(B * H, V / 64), 256, smem, st>>>(
          GDP_ARGS_OF(GDP_DH_FIELDS, dp));
    };
    auto states64 = [&](cudaStream_t st, int* rdy) {
      const int smem = gdpc_scan_smem_bytes(KP, 0, 64, 2);
      const GdpScanParams sp = scan_params(nullptr, hs, dn, 0, 2, rdy);
      gdp_fwd_states_bf16_64_128<<<dim3(B * H, V / 64), 256, smem, st>>>(
          GDP_ARGS_OF(GDP_SCAN_FIELDS, sp));
    };
    // (Shared-memory limits set above, at least as large: three-stage dS and forward scans.)
    const float t_op = median_ms([&] {
      wy(nullptr, nullptr, ag);
      CK(cudaEventRecord(zeroed, 0));
      CK(cudaStreamWaitEvent(side, zeroed, 0));
      dh64(3, side, nullptr);
      states64(0, nullptr);
      CK(cudaEventRecord(done, side));
      CK(cudaStreamWaitEvent(0, done, 0));
    });
    const float t_dh = median_ms([&] {
      run(urgent, [&] { wy(dbo, ready, ag); }, [&] { dh64(2, urgent, ready); },
          [&] { states64(0, nullptr); });
    });
    const float t_st = median_ms([&] {
      run(urgent, [&] { wy(dfo, ready, ag); }, [&] { states64(urgent, ready); },
          [&] { dh64(3, 0, nullptr); });
    });
    printf("  bwd WY + both scans: the op's order %.3f | dS scan BV64/2 beside WY %.3f | states "
           "BV64/2 beside WY %.3f ms\n",
           t_op, t_dh, t_st);
    // The two scans side by side without the WY kernel: the op's tiles (BV 64; 128 blocks each,
    // which cannot share a multiprocessor) against BV 128 (64 blocks each, two stages), with
    // the BV 128 results checked against the BV 64 ones.
    const int LB128 = 128 + 8;
    const int dh128_smem = 2 * gdpd_stage_bytes(KP, QR, 128) +
                           2 * (2 * KP * LB128 + C * LB128 + QR * LB128) + 8 * 2 * 3 * C + 12 * 2;
    const int st128_smem = gdpc_scan_smem_bytes(KP, 0, 128, 2);
    CK(cudaFuncSetAttribute(gdp_bwd_dh_bf16_128_128, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            dh128_smem));
    CK(cudaFuncSetAttribute(gdp_fwd_states_bf16_128_128,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, st128_smem));
    auto dh128 = [&](cudaStream_t st) {
      const GdpDhParams dp = dh_params(2, nullptr, nullptr);
      gdp_bwd_dh_bf16_128_128<<<dim3(B * H, 1), 256, dh128_smem, st>>>(
          GDP_ARGS_OF(GDP_DH_FIELDS, dp));
    };
    auto states128 = [&](cudaStream_t st) {
      const GdpScanParams sp = scan_params(nullptr, hs, dn, 0, 2, nullptr);
      gdp_fwd_states_bf16_128_128<<<dim3(B * H, 1), 256, st128_smem, st>>>(
          GDP_ARGS_OF(GDP_SCAN_FIELDS, sp));
    };
    auto pair = [&](auto a, auto b) {  // a on the device's stream, b on `side`
      return median_ms([&] {
        CK(cudaEventRecord(zeroed, 0));
        CK(cudaStreamWaitEvent(side, zeroed, 0));
        a();
        b();
        CK(cudaEventRecord(done, side));
        CK(cudaStreamWaitEvent(0, done, 0));
      });
    };
    const size_t nst = slots * K * V, ndn = slots * C * V;
    auto fetch = [&](const __nv_bfloat16* d, size_t len) {
      std::vector<__nv_bfloat16> h(len);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(h.data(), d, len * 2, cudaMemcpyDeviceToHost));
      return h;
    };
    auto max_diff = [](const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
      float m = 0.f;
      for (size_t i = 0; i < a.size(); ++i)
        m = std::max(m, fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i])));
      return m;
    };
    wy(nullptr, nullptr, ag);
    states64(0, nullptr);
    dh64(3, 0, nullptr);
    const auto hs64 = fetch(hs, nst), dn64 = fetch(dn, ndn), dhs64 = fetch(dhs, nst),
               ddn64 = fetch(ddn, ndn);
    states128(0);
    dh128(0);
    const float e_st = std::max(max_diff(hs64, fetch(hs, nst)), max_diff(dn64, fetch(dn, ndn)));
    const float e_dh =
        std::max(max_diff(dhs64, fetch(dhs, nst)), max_diff(ddn64, fetch(ddn, ndn)));
    const float t_pair64 = pair([&] { states64(0, nullptr); }, [&] { dh64(3, side, nullptr); });
    const float t_st128 = median_ms([&] { states128(0); });
    const float t_dh128 = median_ms([&] { dh128(0); });
    const float t_pair128 = pair([&] { states128(0); }, [&] { dh128(side); });
    const float t_mixed = pair([&] { states128(0); }, [&] { dh64(3, side, nullptr); });
    printf("  bwd scans side by side: BV64 (op) %.3f | BV128/2 %.3f (states alone %.3f, dS alone "
           "%.3f; max diff to BV64 %.2g / %.2g) | states BV128 + dS BV64/3 %.3f ms\n",
           t_pair64, t_pair128, t_st128, t_dh128, e_st, e_dh, t_mixed);
    CK(cudaEventDestroy(zeroed));
    CK(cudaEventDestroy(done));
    CK(cudaStreamDestroy(urgent));
    CK(cudaStreamDestroy(side));
    for (void* x : {(void*)dfo, (void*)dbo, (void*)ready}) CK(cudaFree(x));
  }

  // The gradient kernel beside the state-gradient scan (BV 32, src/op/cuda/backward.rs)
  // where the scan's blocks fill fewer than half the multiprocessors: the scan on a
  // high-priority stream counting its groups done, persistent gradient blocks on the
  // multiprocessors it leaves, then (after the scan) on all of them; against the scan and the
  // gradient kernel one after the other. Timed from before the counters' zeroing.
  const int scan_blocks = B * H * (V / 32);
  if (2 * scan_blocks < sms && n >= 2) {
    const int nch = (T * n + C - 1) / C;
    std::vector<int> order;  // from the sequences' ends
    for (int c = nch - 1; c >= 0; --c)
      for (int s = 0; s < B; ++s) order.push_back(s * nch + c);
    int* dorder = upload(order);
    const size_t counters = GDPG_PIPE_COUNTERS + (total / GDPC_READY_GROUP + B + 1) * H;
    int* pipe;
    CK(cudaMalloc(&pipe, counters * sizeof(int)));
    int least, greatest;
    CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t urgent;
    CK(cudaStreamCreateWithPriority(&urgent, cudaStreamNonBlocking, greatest));
    cudaEvent_t zeroed, done;
    CK(cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    int dsmem;
    const int NS = dh_stages(32, dsmem);
    const auto pipe_kern = gdp_bwd_grads_bf16_128_128_tiles_pipe;
    CK(cudaFuncSetAttribute(pipe_kern, cudaFuncAttributeMaxDynamicSharedMemorySize, gsmem));
    const int items = total * H;
    auto dh32 = [&](cudaStream_t st, int* signal) {
      const GdpDhParams dp = dh_params(NS, nullptr, signal);
      gdp_bwd_dh_bf16_32_128<<<dim3(B * H, V / 32), 256, dsmem, st>>>(
          GDP_ARGS_OF(GDP_DH_FIELDS, dp));
    };
    auto grads_pipe = [&](int blocks, int beside) {
      const GdpGradsPipeParams gp =
          grads_params(pipe, dorder, items, V / 32, beside, scan_blocks);
      pipe_kern<<<std::min(blocks, items), GDPG_THREADS, gsmem, 0>>>(
          GDP_ARGS_OF(GDP_GRADS_PIPE_FIELDS, gp));
    };
    const float t_seq = median_ms([&] {
      dh32(0, nullptr);
      const GdpGradsPipeParams gp = grads_params(nullptr, nullptr, 0, 0, 0, 0);
      grads<<<dim3(total, H), GDPG_THREADS, gsmem>>>(GDP_ARGS_OF(GDP_GRADS_FIELDS, gp));
    });
    const float t_pipe = median_ms([&] {
      CK(cudaMemsetAsync(pipe, 0, counters * sizeof(int), 0));
      CK(cudaEventRecord(zeroed, 0));
      CK(cudaStreamWaitEvent(urgent, zeroed, 0));
      dh32(urgent, pipe);
      grads_pipe(sms - scan_blocks, 1);
      CK(cudaEventRecord(done, urgent));
      CK(cudaStreamWaitEvent(0, done, 0));
      grads_pipe(2 * sms, 0);
    });
    printf("  dh BV32/%d + grads: one after the other %.3f ms, beside %.3f ms\n", NS, t_seq,
           t_pipe);
    CK(cudaEventDestroy(zeroed));
    CK(cudaEventDestroy(done));
    CK(cudaStreamDestroy(urgent));
    CK(cudaFree(dorder));
    CK(cudaFree(pipe));
  }
  for (void* x : {(void*)dq, (void*)dk, (void*)dv, (void*)daux, (void*)dtab, (void*)w, (void*)u, (void*)p,
                  (void*)cf, (void*)ag, (void*)hs, (void*)dn, (void*)dhs, (void*)ddn,
                  (void*)dob, (void*)dht, (void*)gout, (void*)gq, (void*)gk, (void*)gv, (void*)ob})
    CK(cudaFree(x));
}

// The decode step at B, H, K = V = 128 and n = n0..n1, with the bandwidth of the state read
// and written.
static void step_at(int B, int H, int n0, int n1) {
  const int K = 128, V = 128;
  const long BH = (long)B * H;
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> state(BH * K * V),
      small(BH * K * (1 + n1) + BH * n1 * V + BH * (1 + n1));
  for (auto& x : state) x = nd(rng);
  for (auto& x : small) x = nd(rng) / sqrtf((float)K);
  auto* ds = upload(state);
  auto* dsm = upload(small);
  float* out;
  CK(cudaMalloc(&out, (BH * V + BH * K * V) * 4));
  const double bytes = 2.0 * BH * K * V * 4;
  for (int n = n0; n <= n1; ++n) {
    const float t = median_ms([&] {
      const float *q = dsm, *k = q + BH * K, *v = k + BH * n * K, *g = v + BH * n * V;
      GdpStepParams<float> a{};
      a.state = ds; a.q = q; a.k = k; a.v = v; a.g = g; a.beta = g + BH; a.out = out;
      a.batch = B; a.heads = H; a.dk = K; a.dv = V; a.n = n; a.scale = 0.1f;
      gdp_step_f32_k128<<<dim3(BH, (V + GDP_STEP_COLS - 1) / GDP_STEP_COLS), GDP_STEP_THREADS,
                          4 * gdp_step_smem_floats(K, n)>>>(GDP_ARGS_OF(GDP_STEP_FIELDS, a));
    }, 50);
    printf("step B%d H%d K%d V%d n%d: %.4f ms, %.0f GB/s (state read + written)\n", B, H, K, V,
           n, t, bytes / t / 1e6);
  }
  const float tc = median_ms([&] {
    CK(cudaMemcpyAsync(out + BH * V, ds, BH * K * V * 4, cudaMemcpyDeviceToDevice));
  }, 50);
  printf("copy of the state (B%d H%d): %.4f ms, %.0f GB/s\n", B, H, tc, bytes / tc / 1e6);
  for (void* x : {(void*)ds, (void*)dsm, (void*)out}) CK(cudaFree(x));
}

// The decode step at B64 H16 n = 1, 2, 3 and at the GDN layers of Qwen3.5-9B / 27B (n = 1,
// 32 and 48 value heads; the op repeats the 16 key heads, which the step reads as its q, k)
// for batches of 1 to 128, against device copies of the state (same bytes) and a large copy
// (8.6 GB moved, the ceiling of KINDS.md).
static void step() {
  step_at(64, 16, 1, 3);
  for (int h : {32, 48})
    for (int b : {1, 8, 32, 128}) step_at(b, h, 1, 1);
  const size_t big = 4300000000ull;
  void *a, *b;
  if (cudaMalloc(&a, big) == cudaSuccess && cudaMalloc(&b, big) == cudaSuccess) {
    CK(cudaMemset(a, 1, big));
    const float tb = median_ms([&] { CK(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice)); }, 10);
    printf("copy of 4.3 GB: %.3f ms, %.0f GB/s\n", tb, 2.0 * big / tb / 1e6);
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
}

// KB_ONLY_N2=1 skips the n = 1 shape; KB_ONLY_B1=1 runs only B1 T32768 n2 (for profilers);
// KB_ONLY_SCANS=1 runs the forward shapes B1 T32768 n1, n2, B4 T4096 n1, n2 and B2 T4096 n4;
// KB_ONLY_STEP=1 only the decode step; KB_ONLY_WY=1 only the WY kernel's times; KB_WY_PAD=1
// adds the overlap with the WY kernel's shared memory padded (at most 3, 2, 1 blocks per SM);
// KB_NS2=1 gives the forward and state-gradient scans two stages where three fit; KB_CORES=1
// adds, at B4, the WY kernel beside two-stage scans that leave it room (co-resident blocks),
// and the backward's two scans side by side at BV 64 (128 blocks each) and 128 (64 each, the
// op's choice there); KB_GRADS_PIPE=1 adds, at n >= 2, the persistent gradient kernel after the
// scan, for comparison with the op's launch there (one block per chunk and head, 5% faster).
int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a pipe even if a timeout stops the run
  if (getenv("KB_ONLY_STEP") != nullptr) {  // the decode step only
    step();
    return 0;
  }
  if (getenv("KB_ONLY_SCANS") != nullptr) {  // one and few sequences, n = 1, 2, 4
    forward(1, 32768, 16, 1);
    forward(1, 32768, 16, 2);
    forward(4, 4096, 16, 1);
    forward(4, 4096, 16, 2);
    forward(2, 4096, 16, 4);
    return 0;
  }
  if (getenv("KB_ONLY_B1") == nullptr) {
    if (getenv("KB_ONLY_WY") == nullptr) step();
    if (getenv("KB_ONLY_N2") == nullptr) forward(4, 4096, 16, 1);
    forward(4, 4096, 16, 2);
    forward(4, 4096, 16, 3);
  }
  forward(1, 32768, 16, 2);
  return 0;
}
