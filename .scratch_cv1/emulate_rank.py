"""Emulates the rank part of flush.cu's factored S^T q0 (A^T q0 on threads 96-255, B^T (A^T q0) in the B build) and
the warp-0 combine, thread by thread in float32; the codes part is taken exact (emulate_imma.py checks it)."""
import numpy as np
import torch

rng = np.random.default_rng(7)
V = K = 128; L = 16; R = 4
f32 = np.float32
for trial in range(3):
    codes = rng.integers(-127, 128, size=(V, K))
    s_k = (rng.random(K) + 0.5).astype(f32); s_v = (rng.random(V) + 0.5).astype(f32)
    pcum = (-20 * rng.random(K)).astype(f32); w = rng.random(L).astype(f32)
    kbuf = torch.tensor(rng.standard_normal((L, K)) * 0.1).to(torch.bfloat16).float().numpy()
    ubuf = torch.tensor(rng.standard_normal((L, V))).to(torch.bfloat16).float().numpy()
    gbuf = torch.tensor(0.5 + 0.5 * rng.random((L, K))).to(torch.float16).float().numpy()
    u = torch.tensor(rng.standard_normal((R, K))).to(torch.float16).float().numpy()
    q = torch.tensor(rng.standard_normal((R, V)) * 0.1).to(torch.float16).float().numpy()
    q0 = rng.standard_normal((V, R)).astype(f32)
    # A^T q0: thread tid in [96, 256): j = (tid - 96) >> 3, c = tid & 7, v = c + 8 i; then the sum over the 8 lanes
    atq0 = np.zeros((L + R, R), dtype=f32)
    for j in range(L + R):
        row = ubuf[j] if j < L else q[j - L]
        parts = []
        for c in range(8):
            d = np.zeros(R, dtype=f32)
            for i in range(V // 8):
                v = c + 8 * i
                d = (d + f32(row[v]) * q0[v]).astype(f32)
            parts.append(d)
        for m in (4, 2, 1):                          # butterfly over the 8 lanes
            parts = [(parts[c] + parts[c ^ m]).astype(f32) for c in range(8)]
        atq0[j] = parts[0]
    # the B build: thread (k, half)
    pst = np.zeros((4, R, K), dtype=np.float64)
    cs = np.zeros(K, dtype=f32)
    for tid in range(256):
        idx, half = tid & 127, tid >> 7
        k = (idx & 1) | (((idx >> 1) & 3) << 4) | (((idx >> 3) & 7) << 1) | ((idx >> 6) << 6)
        dec = f32(np.exp(np.float64(pcum[k])))
        D = f32(1)
        if half == 0:
            for j in range(L - 1, 7, -1): D = f32(D * gbuf[j, k])
        jtop = 15 if half else 7
        bt = np.zeros(R, dtype=f32)
        for pp in range(4):
            for e in range(2):
                j = jtop - 2 * pp - e
                val = f32(w[j] * f32(kbuf[j, k] * D))
                D = f32(D * gbuf[j, k])
                bt = (bt + val * atq0[j]).astype(f32)
        if half == 1:
            for r in range(R):
                ud = f32(u[r, k] * dec)
                bt = (bt + ud * atq0[L + r]).astype(f32)
        else:
            cs[k] = f32(f32(s_k[k] * f32(1 / 127)) * dec)
        pst[2 + half, :, k] = bt
    codes_part = codes.T.astype(np.float64) @ (s_v.astype(np.float64)[:, None] * q0.astype(np.float64))   # [K, R]
    got = cs.astype(np.float64)[:, None] * codes_part + (pst[2] + pst[3]).T
    # the exact S (float64) and S^T q0
    dec64 = np.exp(pcum.astype(np.float64))
    Dm = np.ones((L, K))
    for j in range(L - 2, -1, -1): Dm[j] = Dm[j + 1] * gbuf[j + 1]
    S = (q.T.astype(np.float64) @ u.astype(np.float64) + codes * (s_k / 127.0)[None, :] * s_v[:, None]) * dec64[None, :]
    S += ubuf.T.astype(np.float64) @ (w[:, None] * kbuf * Dm)
    want = S.T @ q0.astype(np.float64)
    print(f"trial {trial}: max |got - want| / max |want| = {np.abs(got - want).max() / np.abs(want).max():.2e}")
