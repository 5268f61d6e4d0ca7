"""Emulates flush.cu's factored codes^T (s_v q0): stage_pieces, the swizzled staging, the byte transposes and the
m16n8k32 fragment layouts (PTX ISA), lane by lane; compares with float64."""
import numpy as np

rng = np.random.default_rng(5)
V = K = 128
f32 = np.float32

def byte_perm(x, y, s):
    b = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(b[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))

def transpose_bytes(w):
    x0, x1 = byte_perm(w[0], w[1], 0x5140), byte_perm(w[0], w[1], 0x7362)
    y0, y1 = byte_perm(w[2], w[3], 0x5140), byte_perm(w[2], w[3], 0x7362)
    return [byte_perm(x0, y0, 0x5410), byte_perm(x0, y0, 0x7632), byte_perm(x1, y1, 0x5410), byte_perm(x1, y1, 0x7632)]

def s8(word, j):
    b = (word >> (8 * j)) & 0xFF
    return b - 256 if b >= 128 else b

def codes_chunk(v, c):
    return c ^ ((v & 1) << 2) ^ (((v >> 2) & 3) << 1)

def pack_low_bytes(ys):
    return sum((y & 0xFF) << (8 * i) for i, y in enumerate(ys))

for trial, scale in enumerate([1.0, 1e-30, 1e20, 0.0]):
    codes = rng.integers(-127, 128, size=(V, K)).astype(np.int64)
    s_v = (rng.random(V) * 3 + 0.1).astype(f32) * f32(scale if scale else 1)
    q0 = rng.standard_normal((V, 4)).astype(f32)
    if scale == 0.0:
        q0[:, 2] = 0
    # staging: 16-byte chunks as 4 words
    st = np.zeros((V, 8, 4), dtype=np.int64)
    for v in range(V):
        for c in range(8):
            for w in range(4):
                st[v, codes_chunk(v, c), w] = sum((int(codes[v, 16 * c + 4 * w + b]) & 0xFF) << (8 * b) for b in range(4))
    # stage_pieces: warp n, lane l rows 4 l + i
    yq = np.zeros((16, 36), dtype=np.int64)
    ysc = np.zeros(4, dtype=f32)
    for n in range(4):
        r = (s_v * q0[:, n]).astype(f32)
        m = np.max(np.abs(r))
        mm = max(m, f32(7.8886091e-31))
        e = int((np.frombuffer(np.float32(mm).tobytes(), np.uint32)[0] >> 23) & 0xFF) - 126
        sc = np.frombuffer(np.uint32((127 + 6 - e) << 23).tobytes(), np.float32)[0]
        ysc[n] = np.frombuffer(np.uint32((127 - 6 + e) << 23).tobytes(), np.float32)[0]
        r = (r * sc).astype(f32)
        for pc in range(4):
            t = (r + f32(12582912.0)).astype(f32)
            bits = t.view(np.uint32).astype(np.int64)
            r = ((r - (t - f32(12582912.0)).astype(f32)).astype(f32) * f32(128.0)).astype(f32)
            for l in range(32):
                yq[8 * (pc >> 1) + 2 * n + (pc & 1), l] = pack_low_bytes([int(bits[4 * l + i]) for i in range(4)])
    # the IMMA block, per warp and lane
    pst = np.zeros((2, 4, K), dtype=np.float64)
    for w in range(8):
        A = {}; B = {}; D = {}
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            kb = 32 * (w & 3) + 4 * g
            vh = w >> 2
            d = np.zeros((2, 2, 4), dtype=np.int64)
            for s in range(2):
                v0 = 64 * vh + 32 * s
                a0 = [int(st[v0 + 4 * t + i, codes_chunk(v0 + 4 * t + i, kb >> 4), (kb >> 2) & 3]) for i in range(4)]
                a1 = [int(st[v0 + 16 + 4 * t + i, codes_chunk(v0 + 16 + 4 * t + i, kb >> 4), (kb >> 2) & 3]) for i in range(4)]
                a0, a1 = transpose_bytes(a0), transpose_bytes(a1)
                for nt in range(2):
                    b0, b1 = int(yq[8 * nt + g, v0 // 4 + t]), int(yq[8 * nt + g, v0 // 4 + 4 + t])
                    A[(s, 0, lane)] = (a0[0], a0[1], a1[0], a1[1]); A[(s, 1, lane)] = (a0[2], a0[3], a1[2], a1[3])
                    B[(s, nt, lane)] = (b0, b1)
        # execute the warp's MMAs from the fragments (PTX layouts)
        d = np.zeros((2, 2, 32, 4), dtype=np.int64)
        for s in range(2):
            for mt in range(2):
                for nt in range(2):
                    Am = np.zeros((16, 32), dtype=np.int64); Bm = np.zeros((32, 8), dtype=np.int64)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        a = A[(s, mt, lane)]
                        for j in range(4):
                            Am[g, 4 * t + j] = s8(a[0], j); Am[g + 8, 4 * t + j] = s8(a[1], j)
                            Am[g, 16 + 4 * t + j] = s8(a[2], j); Am[g + 8, 16 + 4 * t + j] = s8(a[3], j)
                        b = B[(s, nt, lane)]
                        for j in range(4):
                            Bm[4 * t + j, g] = s8(b[0], j); Bm[16 + 4 * t + j, g] = s8(b[1], j)
                    C = Am @ Bm
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        d[mt, nt, lane] += [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            kb = 32 * (w & 3) + 4 * g
            o = []
            for mt in range(2):
                for h in range(2):
                    p01 = d[mt, 0, lane, 2 * h:2 * h + 2]; p23 = d[mt, 1, lane, 2 * h:2 * h + 2]
                    x = f32(np.fma if False else 0)
                    x = f32(f32(f32(f32(p23[1]) * f32(0.0078125) + f32(p23[0])) * f32(0.0078125) + f32(p01[1])) * f32(0.0078125) + f32(p01[0]))
                    o.append(x)
            pst[w >> 2, t, kb:kb + 4] = np.array(o, dtype=f32) * ysc[t]
    got = pst[0] + pst[1]                                   # [n][k], before cs
    want = (codes.T.astype(np.float64) @ (s_v.astype(np.float64)[:, None] * q0.astype(np.float64))).T
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-300)
    print(f"trial {trial} (scale {scale}): max |got - want| / max |want| = {err:.2e}", "zero vector ok" if scale == 0.0 and np.all(got[2] == 0) else "")
