"""NumPy f32 baseline for the CPU benchmark: the same chunked (WY) GDP forward as the crate,
vectorised over heads and chunks with OpenBLAS, sequential only in the state scan.

    pip install numpy && python3 scripts/numpy_chunked_baseline.py [--check]

Shape: B1 T8192 H4 K=V=64 n=2 (the crate's `cargo bench --bench op` case). Prints the median
forward time; `--check` also compares against a float64 token loop on a small case.
"""
import sys
import time

import numpy as np

C = 64


def chunked_forward(q, k, v, g, beta, n, scale):
    """q [H,T,K], k [H,T*n,K], v [H,T*n,V], g [H,T], beta [H,T*n] (one sequence, no h0)."""
    H, T, K = q.shape
    V = v.shape[-1]
    L = T * n
    pad = (-L) % C
    gi = np.zeros((H, L), q.dtype)
    gi[:, 0::n] = g
    qi = np.zeros((H, L, K), q.dtype)
    qi[:, n - 1::n] = q
    P = lambda x: np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    kc, vc, qc = (P(x).reshape(H, -1, C, x.shape[-1]) for x in (k, v, qi))
    bc, gc = (P(x).reshape(H, -1, C) for x in (beta, gi))
    NC = kc.shape[1]
    G = np.cumsum(gc, axis=-1)
    D = G[..., :, None] - G[..., None, :]
    tril = np.tril(np.ones((C, C), bool))
    decay = np.where(tril, np.exp(np.where(tril, D, 0)), 0).astype(q.dtype)
    A = np.tril(bc[..., :, None] * (kc @ kc.swapaxes(-1, -2)) * decay, -1)
    Ainv = np.linalg.inv(np.eye(C, dtype=q.dtype) + A)
    eg = np.exp(G)
    W = Ainv @ (kc * (bc * eg)[..., None])
    U = Ainv @ (vc * bc[..., None])
    kdec = kc * np.exp(G[..., -1:] - G)[..., None]
    S = np.zeros((H, K, V), q.dtype)
    delta = np.empty_like(U)
    hs = np.empty((H, NC, K, V), q.dtype)
    for c in range(NC):  # the only sequential part: the state scan
        hs[:, c] = S
        delta[:, c] = U[:, c] - W[:, c] @ S
        S = np.exp(G[:, c, -1])[:, None, None] * S + kdec[:, c].swapaxes(-1, -2) @ delta[:, c]
    o = scale * (eg[..., None] * (qc @ hs) + ((qc @ kc.swapaxes(-1, -2)) * decay) @ delta)
    return o.reshape(H, -1, V)[:, :L][:, n - 1::n], S


def naive(q, k, v, g, beta, n, scale):
    H, T, K = q.shape
    S = np.zeros((H, K, v.shape[-1]))
    o = np.zeros((H, T, v.shape[-1]))
    for t in range(T):
        S = np.exp(g[:, t])[:, None, None] * S
        for j in range(n):
            p = t * n + j
            d = beta[:, p, None] * (v[:, p] - np.einsum("hk,hkv->hv", k[:, p], S))
            S = S + k[:, p, :, None] * d[:, None, :]
        o[:, t] = scale * np.einsum("hk,hkv->hv", q[:, t], S)
    return o, S


def inputs(T, H, K, V, n, dtype, rng):
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((H, T, K))).astype(dtype)
    k = unit(rng.standard_normal((H, T * n, K))).astype(dtype)
    v = rng.standard_normal((H, T * n, V)).astype(dtype)
    g = (-0.5 * rng.random((H, T))).astype(dtype)
    beta = rng.random((H, T * n)).astype(dtype)
    return q, k, v, g, beta


def main():
    rng = np.random.default_rng(0)
    if "--check" in sys.argv:
        x = inputs(150, 2, 16, 24, 3, np.float64, rng)
        o1, s1 = chunked_forward(*x, 3, 0.25)
        o0, s0 = naive(*x, 3, 0.25)
        print(f"check vs token loop: o {np.abs(o1 - o0).max():.1e}  S {np.abs(s1 - s0).max():.1e}")
    T, H, K, V, n = 8192, 4, 64, 64, 2
    x = inputs(T, H, K, V, n, np.float32, rng)
    chunked_forward(*x, n, K ** -0.5)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        chunked_forward(*x, n, K ** -0.5)
        times.append((time.perf_counter() - t0) * 1e3)
    ms = sorted(times)[len(times) // 2]
    print(f"numpy {np.__version__} f32 chunked forward B1 T{T} H{H} K=V={K} n={n}: {ms:.1f} ms  ({T / ms * 1e3:.0f} tokens/s)")


if __name__ == "__main__":
    main()
