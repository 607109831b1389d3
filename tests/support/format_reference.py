"""Plain NumPy reference codecs, written straight from docs/formats.md (docs/formats.md#summary) — the tests' oracle (not shipped in the wheel).

Nothing here calls into the Rust extension: these functions are the independent oracle the Rust
codecs are checked against. They favour the spec's literal formulas (value index → byte, bits) over
speed. Conventions: ``trits`` int8 ``[N, K]`` in {-1, 0, 1} (binary Q1_0 also allows the sign form),
``scales`` float16 ``[N, K/block]``, encoded GGUF tensors are flat uint8 arrays of row-major blocks.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


# -- canonical ----------------------------------------------------------------------------------

def pack_canonical(trits: np.ndarray) -> np.ndarray:
    """Canonical qweight: code t+1 of W[n, k] in byte k//4 at bits 2·(k%4)."""
    codes = (trits.astype(np.int16) + 1).astype(np.uint8)
    n, k = codes.shape
    c = codes.reshape(n, k // 4, 4)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).astype(np.uint8)


def unpack_canonical(qweight: np.ndarray) -> np.ndarray:
    q = qweight.astype(np.uint8)
    parts = [((q >> (2 * j)) & 3) for j in range(4)]
    codes = np.stack(parts, axis=-1).reshape(q.shape[0], q.shape[1] * 4)
    return codes.astype(np.int8) - 1


def dequantize(trits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """W = t · scale in float32 (exact), scales broadcast over their groups."""
    n, k = trits.shape
    g = k // scales.shape[1]
    s = np.repeat(scales.astype(np.float32), g, axis=1)
    return trits.astype(np.float32) * s


# -- consecutive 2-bit: Q2_0 (g64, 18 B) and PQ2_0 / fork Q2_0 (g128, 34 B) — docs/formats.md#q2_0 -----

def encode_consecutive(trits: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """Block = d (f16 LE) + qs[block/4]; value j → qs[j/4] bits 2·(j%4)."""
    n, k = trits.shape
    codes = (trits.astype(np.int16) + 1).astype(np.uint8).reshape(n * k // block, block)
    qs = np.zeros((codes.shape[0], block // 4), np.uint8)
    for j in range(block):
        qs[:, j // 4] |= codes[:, j] << (2 * (j % 4))
    d = scales.astype("<f2").reshape(-1, 1).view(np.uint8)
    return np.concatenate([d, qs], axis=1).reshape(-1)


def decode_consecutive(data: np.ndarray, shape, block: int):
    """→ (codes uint8 [N, K] 0..3, scales float16 [N, K/block])."""
    n, k = shape
    blocks = np.asarray(data, np.uint8).reshape(-1, 2 + block // 4)
    d = blocks[:, :2].copy().view("<f2").reshape(n, k // block)
    qs = blocks[:, 2:]
    codes = np.zeros((blocks.shape[0], block), np.uint8)
    for j in range(block):
        codes[:, j] = (qs[:, j // 4] >> (2 * (j % 4))) & 3
    return codes.reshape(n, k), d


# -- TQ2_0 (66 B / 256) — docs/formats.md#tq2_0 ----------------------------------------------------------

def encode_tq2_0(trits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n, k = trits.shape
    c = (trits.astype(np.int16) + 1).astype(np.uint8).reshape(-1, QK_K)
    qs = np.zeros((c.shape[0], 64), np.uint8)
    for j in (0, 32):
        for m in range(32):
            for nn in range(4):
                qs[:, j + m] |= c[:, j * 4 + m + 32 * nn] << (2 * nn)
    d = scales.astype("<f2").reshape(-1, 1).view(np.uint8)
    return np.concatenate([qs, d], axis=1).reshape(-1)


def decode_tq2_0(data: np.ndarray, shape):
    n, k = shape
    b = np.asarray(data, np.uint8).reshape(-1, 66)
    codes = np.zeros((b.shape[0], QK_K), np.uint8)
    for j in (0, 32):
        for lane in range(4):
            for m in range(32):
                codes[:, j * 4 + 32 * lane + m] = (b[:, j + m] >> (2 * lane)) & 3
    d = b[:, 64:66].copy().view("<f2").reshape(n, k // QK_K)
    return codes.reshape(n, k), d


# -- base-3: TQ1_0 (54 B / 256) and PTQ1_0 (28 B / 128) — docs/formats.md#base3 -------------------

_POW3 = np.array([1, 3, 9, 27, 81], np.uint32)


def _digit(b: np.ndarray, n: int) -> np.ndarray:
    """n-th trit (most significant first): q = (uint8)(b·3ⁿ); trit = (q·3) >> 8."""
    q = (b.astype(np.uint32) * _POW3[n]) & 0xFF
    return ((q * 3) >> 8).astype(np.uint8)


def _base3_value_map(stages, qs_bytes, qh_bytes):
    """List of (value index, byte index within block, digit n) from the spec's stage rule."""
    out = []
    o = 0
    for c in stages:
        for nn in range(5):
            for m in range(c):
                out.append((5 * o + nn * c + m, o + m, nn))
        o += c
    for nn in range(4):
        for h in range(qh_bytes):
            out.append((5 * qs_bytes + nn * qh_bytes + h, qs_bytes + h, nn))
    return out


_TQ1 = dict(values=256, stages=(32, 16), qs=48, qh=4, d=52, size=54)
_PTQ1 = dict(values=128, stages=(16, 8), qs=24, qh=2, d=26, size=28)


def _encode_base3(trits, scales, L):
    codes = (trits.astype(np.int16) + 1).astype(np.uint32).reshape(-1, L["values"])
    nb = codes.shape[0]
    out = np.zeros((nb, L["size"]), np.uint8)
    o = 0
    for c in L["stages"]:
        for m in range(c):
            v = np.zeros(nb, np.uint32)
            for nn in range(5):  # first value most significant: v = Σ c_k·3^(4−k)
                v = v * 3 + codes[:, 5 * o + nn * c + m]
            out[:, o + m] = (v * 256 + 242) // 243
        o += c
    for h in range(L["qh"]):
        v = np.zeros(nb, np.uint32)
        for nn in range(4):
            v = v * 3 + codes[:, 5 * L["qs"] + nn * L["qh"] + h]
        out[:, L["qs"] + h] = (v * 3 * 256 + 242) // 243
    out[:, L["d"]:L["d"] + 2] = scales.astype("<f2").reshape(-1, 1).view(np.uint8)
    return out.reshape(-1)


def _decode_base3(data, shape, L):
    n, k = shape
    b = np.asarray(data, np.uint8).reshape(-1, L["size"])
    codes = np.zeros((b.shape[0], L["values"]), np.uint8)
    for v, byte, nn in _base3_value_map(L["stages"], L["qs"], L["qh"]):
        codes[:, v] = _digit(b[:, byte], nn)
    d = b[:, L["d"]:L["d"] + 2].copy().view("<f2").reshape(n, k // L["values"])
    return codes.reshape(n, k), d


def encode_tq1_0(trits, scales):
    return _encode_base3(trits, scales, _TQ1)


def decode_tq1_0(data, shape):
    return _decode_base3(data, shape, _TQ1)


def encode_ptq1_0(trits, scales):
    return _encode_base3(trits, scales, _PTQ1)


def decode_ptq1_0(data, shape):
    return _decode_base3(data, shape, _PTQ1)


# -- Q1_0 (18 B / 128, binary) — docs/formats.md#q1_0 -------------------------------------------------

def encode_q1_0(signs: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """signs in {-1, +1}; bit j of qs[j/8] set ⇔ +d."""
    bits = (signs.reshape(-1, 128) > 0).astype(np.uint8)
    qs = np.zeros((bits.shape[0], 16), np.uint8)
    for j in range(128):
        qs[:, j // 8] |= bits[:, j] << (j % 8)
    d = scales.astype("<f2").reshape(-1, 1).view(np.uint8)
    return np.concatenate([d, qs], axis=1).reshape(-1)


def decode_q1_0(data, shape):
    n, k = shape
    b = np.asarray(data, np.uint8).reshape(-1, 18)
    codes = np.zeros((b.shape[0], 128), np.uint8)
    for j in range(128):
        codes[:, j] = np.where((b[:, 2 + j // 8] >> (j % 8)) & 1, 2, 0)
    d = b[:, :2].copy().view("<f2").reshape(n, k // 128)
    return codes.reshape(n, k), d


# -- I2_S (x86, QK 128, f32 scale in a 32-byte tail) — docs/formats.md#i2_s ------------------------------

def encode_i2_s(trits: np.ndarray, scale: float) -> np.ndarray:
    """out[i·32 + j%32] |= code[i·128+j] << (6 − 2·(j/32)); then f32 scale, 28 zero bytes."""
    codes = (trits.astype(np.int16) + 1).astype(np.uint8).reshape(-1, 128)
    out = np.zeros((codes.shape[0], 32), np.uint8)
    for j in range(128):
        out[:, j % 32] |= codes[:, j] << (6 - 2 * (j // 32))
    tail = np.zeros(32, np.uint8)
    tail[:4] = np.array([scale], "<f4").view(np.uint8)
    return np.concatenate([out.reshape(-1), tail])


def decode_i2_s(data, shape):
    """→ (codes [N, K], f32 scale)."""
    n, k = shape
    data = np.asarray(data, np.uint8)
    packed = data[: n * k // 4].reshape(-1, 32)
    codes = np.zeros((packed.shape[0], 128), np.uint8)
    for j in range(128):
        codes[:, j] = (packed[:, j % 32] >> (6 - 2 * (j // 32))) & 3
    scale = data[n * k // 4: n * k // 4 + 4].copy().view("<f4")[0]
    return codes.reshape(n, k), scale


# -- transformers BitNet — docs/formats.md#bitnet-packing --------------------------------------------------------

def pack_bitnet(trits: np.ndarray) -> np.ndarray:
    """packed[r, k] = Σ_i (W[i·R + r, k] + 1) << 2i, R = N/4."""
    n, k = trits.shape
    r = n // 4
    codes = (trits.astype(np.int16) + 1).astype(np.uint8)
    packed = np.zeros((r, k), np.uint8)
    for i in range(4):
        packed |= codes[i * r:(i + 1) * r] << (2 * i)
    return packed


def unpack_bitnet(packed: np.ndarray) -> np.ndarray:
    """W[i·R + r, k] = ((packed[r, k] >> 2i) & 3) − 1."""
    return np.concatenate([((packed >> (2 * i)) & 3).astype(np.int8) - 1 for i in range(4)], axis=0)


def bitnet_scale(weight_scale: float, linear_class: str = "bitlinear") -> np.float16:
    """bitlinear: W = W_t / weight_scale; autobitlinear: W = W_t · weight_scale (rounded once to fp16)."""
    ws = np.float64(np.float32(weight_scale))
    return np.float16(1.0 / ws) if linear_class == "bitlinear" else np.float16(ws)


# -- MLX affine 2-bit — docs/formats.md#mlx-2bit ---------------------------------------------------------

def pack_mlx(trits: np.ndarray) -> np.ndarray:
    """uint32 [N, K/16]: code k at bits 2k (q = t + 1), LSB first."""
    n, k = trits.shape
    codes = (trits.astype(np.int16) + 1).astype(np.uint32).reshape(n, k // 16, 16)
    w = np.zeros((n, k // 16), np.uint32)
    for j in range(16):
        w |= codes[..., j] << np.uint32(2 * j)
    return w


def dequantize_mlx(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """w = scale·q + bias (MLX's affine dequantization), in float32."""
    n = weight.shape[0]
    q = np.stack([(weight >> np.uint32(2 * j)) & 3 for j in range(16)], axis=-1).reshape(n, -1)
    g = q.shape[1] // scales.shape[1]
    s = np.repeat(scales.astype(np.float32), g, axis=1)
    b = np.repeat(biases.astype(np.float32), g, axis=1)
    return s * q.astype(np.float32) + b


# -- ternarization (ternary-qat absmax, BitNet absmean) -------------------------------------------

def ternarize_absmax(w: np.ndarray, g: int):
    """ternary-qat `ternarize_weight`: a = amax|g|.clamp(1e-8); t = round(clamp(w/a, −1, 1)), f32,
    round half to even (torch.round). → (trits, fp16 scales)."""
    n, k = w.shape
    wg = w.astype(np.float32).reshape(n, k // g, g)
    a = np.maximum(np.abs(wg).max(axis=-1, keepdims=True), np.float32(1e-8))
    t = np.rint(np.clip(wg / a, np.float32(-1), np.float32(1)))
    return t.reshape(n, k).astype(np.int8), a[..., 0].astype(np.float16)


def ternarize_absmean(w: np.ndarray, g: int | None):
    """BitNet absmean: s = mean|W| (per group of g, or per tensor when g is None; clamp 1e-5);
    t = clamp(round(w/s), −1, 1). The mean is taken in f64, then rounded to f32."""
    n, k = w.shape
    w32 = w.astype(np.float32)
    if g is None:
        s = np.float32(np.abs(w32.astype(np.float64)).sum() / w32.size)
        s = np.maximum(s, np.float32(1e-5))
        t = np.clip(np.rint(w32 / s), -1, 1)
        return t.astype(np.int8), np.full((n, 1), s, np.float32).astype(np.float16)
    wg = w32.reshape(n, k // g, g)
    s = (np.abs(wg.astype(np.float64)).sum(axis=-1, keepdims=True) / g).astype(np.float32)
    s = np.maximum(s, np.float32(1e-5))
    t = np.clip(np.rint(wg / s), -1, 1)
    return t.reshape(n, k).astype(np.int8), s[..., 0].astype(np.float16)


# -- STQ1_0 (GGUF type 43, llama.cpp PR #22836; Tencent Hy-MT2 / Hy4) — 3:4-sparse codebook -------
# Written from the upstream description (ggml-common.h / ggml-quants.c of the PR branch, and the
# stride-16 layout note of vllm-project/vllm-gguf-plugin's gguf_stq.py), not from the Rust code.

def stq1_0_codebook() -> np.ndarray:
    """The 32 group patterns, derived from the PR's rule rather than copied: index = (sign << 4) | slot,
    slot = (zero_pos << 2) | tail; lanes left of/after the zero: the 1st non-zero lane is +1, tail bit
    0/1 makes the 2nd/3rd non-zero lane −1; sign = 1 negates every non-zero lane. Lane p (t ∈ {−1, 0,
    1} as t+1) sits at bits 2p of the pattern byte."""
    book = np.zeros(32, np.uint8)
    for sign in range(2):
        for slot in range(16):
            zero, tail = slot >> 2, slot & 3
            lanes, nz = [], 0
            for p in range(4):
                if p == zero:
                    lanes.append(0)
                    continue
                t = -1 if nz > 0 and (tail >> (nz - 1)) & 1 else 1
                lanes.append(-t if sign else t)
                nz += 1
            book[(sign << 4) | slot] = sum((t + 1) << (2 * p) for p, t in enumerate(lanes))
    return book


def stq1_0_value_of(g: int, p: int) -> int:
    """Value index (0..256) in its block of lane p of group g: chunk g//16, position g%16, stride 16."""
    return 64 * (g // 16) + g % 16 + 16 * p


def decode_stq1_0(data, shape):
    """Block (42 B) = qs[32] | sign[8] | d (f16 LE). Group g: slot = (qs[g//2] >> 4·(g%2)) & 15 (low nibble
    first), sign = (sign[g//8] >> g%8) & 1, pattern = codebook[sign<<4 | slot]; lane p = (pattern >> 2p)
    & 3 is the code of value stq1_0_value_of(g, p). → (codes uint8 [N, K] 0..2, scales float16
    [N, K/256])."""
    n, k = shape
    blocks = np.asarray(data, np.uint8).reshape(-1, 42)
    book = stq1_0_codebook()
    d = blocks[:, 40:42].copy().view("<f2").reshape(n, k // 256)
    codes = np.zeros((blocks.shape[0], 256), np.uint8)
    for g in range(64):
        slot = (blocks[:, g // 2] >> (4 * (g % 2))) & 0xF
        sign = (blocks[:, 32 + g // 8] >> (g % 8)) & 1
        pattern = book[(sign.astype(np.int64) << 4) | slot]
        for p in range(4):
            codes[:, stq1_0_value_of(g, p)] = (pattern >> (2 * p)) & 3
    return codes.reshape(n, k), d


def encode_stq1_0(trits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of decode_stq1_0 for trits with exactly one zero per group (lanes at stride 16);
    raises ValueError naming the first (row, group) that has another pattern."""
    n, k = trits.shape
    book = [int(b) for b in stq1_0_codebook()]
    codes = (trits.astype(np.int16) + 1).astype(np.uint8).reshape(n, k // 256, 256)
    out = np.zeros((n, k // 256, 42), np.uint8)
    for r in range(n):
        for b in range(k // 256):
            for g in range(64):
                pattern = sum(int(codes[r, b, stq1_0_value_of(g, p)]) << (2 * p) for p in range(4))
                if pattern not in book:
                    raise ValueError(f"STQ1_0: row {r} group {64 * b + g} is not one of the 32 patterns")
                idx = book.index(pattern)
                out[r, b, g // 2] |= (idx & 15) << (4 * (g % 2))
                out[r, b, 32 + g // 8] |= (idx >> 4) << (g % 8)
    out[:, :, 40:42] = scales.astype("<f2").reshape(n, k // 256, 1).view(np.uint8)
    return out.reshape(-1)


def quantize_stq1_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's float quantizer ``quantize_row_stq1_0_ref`` (ggml-quants.c of the PR branch, sjl623/llama.cpp
    commit 9b898c1f19b2b0da6db28c99ecea74017892c013) with the lanes at the shipped stride-16 places:
    d = fp16(max |x|) per 256-value block; in each group the zero lane is the first lane of smallest |x|,
    every other lane is x < 0 ? −1 : +1. → (trits int8 [N, K], scales float16 [N, K/256]) for encode_stq1_0."""
    n, k = x.shape
    xb = np.asarray(x, np.float32).reshape(n, k // 256, 4, 4, 16)  # [row, block, chunk, lane p, group in chunk]
    zero = np.argmin(np.abs(xb), axis=3)  # the first minimum on ties, as upstream's strict <
    t = np.where(xb < 0, -1, 1).astype(np.int8)
    np.put_along_axis(t, zero[:, :, :, None, :], 0, axis=3)
    d = np.abs(xb).reshape(n, k // 256, 256).max(axis=-1).astype(np.float16)
    return t.reshape(n, k), d
