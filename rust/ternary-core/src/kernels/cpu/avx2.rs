//! AVX2 kernels (with FMA and F16C), for x86-64 CPUs without AVX-512.
//!
//! A 64-byte chunk is two 32-byte halves; `(half >> 2i) & 3` gives 32 byte codes. The int8 mode sums
//! `code · q` with `vpmaddubsw` (pairs into i16: at most 2·2·128, no saturation), adds a group's
//! vectors in i16 and widens once per group with `vpmaddwd` against ones; the exact mode sign-extends
//! `t = code − 1` 8 at a time and uses FMA. With only 16 ymm registers the kernels walk one row of the
//! block at a time (the int8 GEMV one panel of columns at a time, so the activations stay in L1).
//!
//! Every loop that decides per 32 weights whether a group ends is monomorphized per group size: a
//! run-time `k % g` there is a 64-bit division per 32 weights, and it was what bounded these kernels
//! (EPYC Zen 2, one thread, M = 1, 5120 → 17408 from DRAM: 6.6 → 43.5 G weights/s with the panels and
//! the prefetch below).

// Register arrays (per token) are indexed in lockstep; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::f16;

use super::layout::{CHUNK_BYTES, ROWS, SUB_K, SUPER_K};
use super::{Int8Tile, Kernels, ACC_STRIDE, INT8_TILE, LANES, MICRO_M};

/// The scalar table with its hot loops replaced (the flags stay the scalar ones).
pub(crate) static KERNELS: Kernels = Kernels {
    int8: [int8::<1>, int8::<2>, int8::<3>, int8::<4>],
    prepass,
    exact,
    decode,
    micro,
    quantize,
    ..super::scalar::KERNELS
};

pub(crate) fn is_supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Byte codes of sub-vector `i` of one 32-byte half-chunk.
#[inline(always)]
unsafe fn unpack(w: __m256i, i: usize, mask: __m256i) -> __m256i {
    match i {
        0 => _mm256_and_si256(w, mask),
        1 => _mm256_and_si256(_mm256_srli_epi16::<2>(w), mask),
        2 => _mm256_and_si256(_mm256_srli_epi16::<4>(w), mask),
        _ => _mm256_and_si256(_mm256_srli_epi16::<6>(w), mask),
    }
}

/// Half `h` (0, 1) of row `r`'s chunk of superblock `sb`.
#[inline(always)]
unsafe fn load_half(block: *const u8, sb: usize, r: usize, h: usize) -> __m256i {
    unsafe { _mm256_loadu_si256(block.add((sb * ROWS + r) * CHUNK_BYTES + 32 * h).cast()) }
}

/// The eight lanes' sum, in the fixed order `((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))` (the dense
/// kernel's reference, `half_linear::reference`, spells it out).
#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// The int8 GEMV for a tile of `T` tokens, monomorphized per group size (a run-time `k % g` per 32
/// weights was a 64-bit division each: 6.6 G weights/s at M = 1 on Zen 2).
#[target_feature(enable = "avx2,fma")]
unsafe fn int8<const T: usize>(a: &Int8Tile<'_>) -> [[f32; ROWS]; INT8_TILE] {
    // SAFETY: same features; `int8_body` checks its own bounds.
    unsafe {
        match a.group_size {
            32 => int8_body::<T, 1>(a),
            64 => int8_body::<T, 2>(a),
            128 => int8_body::<T, 4>(a),
            _ => int8_body::<T, 8>(a),
        }
    }
}

/// Superblocks per panel of [`int8_body`]: the four rows walk a panel one after another, so the tile's
/// activations for the panel (T · 2 KiB) and the panel's codes (2 KiB) stay in L1 while the rows reuse
/// them. Walking whole rows re-read every token's activations from L2 once per row once they
/// outgrew L1 beside the block (Zen 2, 32 KiB L1: K = 14336 ran at half the rate of K = 5120).
const PANEL_SB: usize = 8;
/// Independent f32 totals per (row, token) in [`int8_body`], by tile size and vectors per group: the
/// groups of a superblock take turns, so the FMAs (5 cycles each) do not form one chain per row. One
/// chain bounded small groups at few tokens (Zen 2, one thread, hot, K = 14336, T = 1: g = 32 26.7 →
/// 43.2 G weights/s, g = 64 47.9 → 52.5; g ≥ 128 unchanged). Groups of a superblock: `8 / V`.
const fn fma_chains(tokens: usize, vectors_per_group: usize) -> usize {
    let groups = SUPER_K / 32 / vectors_per_group;
    if tokens > 2 {
        1 // the tokens' own chains overlap; more totals would spill (g = 32, T = 4: 45.9 → 34.7)
    } else if groups < MAX_CHAINS {
        groups
    } else {
        MAX_CHAINS
    }
}
const MAX_CHAINS: usize = 4;

/// How far ahead (in superblocks, 256 bytes each: 4 KiB) each row of a panel prefetches its line of the
/// weight. 8 to 48 were within noise of each other (Zen 2, M = 1, from DRAM).
const PREFETCH_SB: usize = 16;

/// One row of the block at a time within a panel of [`PANEL_SB`] superblocks, `V` 32-weight vectors per
/// group. `vpmaddubsw` gives pairwise `code · q` sums in i16 lanes; a group's vectors are added in i16
/// (at most 8 vectors × 2 × 2 × 128 = 4096 per lane: no overflow) and widened once per group with
/// `vpmaddwd`, so the multiply pipe does one `vpmaddubsw` per 32 weight-tokens plus one widening per
/// group instead of one of each per 32.
#[inline(always)]
unsafe fn int8_body<const T: usize, const V: usize>(a: &Int8Tile<'_>) -> [[f32; ROWS]; INT8_TILE] {
    let kp = a.block.len();
    let g = 32 * V;
    assert_eq!(
        a.group_size, g,
        "group size {} is not 32 · {V}",
        a.group_size
    );
    let gp = kp / g;
    assert!(kp.is_multiple_of(SUPER_K) && a.cs.len() >= T * gp * ROWS);
    assert!(a.x.iter().take(T).all(|x| x.len() >= kp));
    let bp = a.block.as_ptr();
    let cs = a.cs.as_ptr();
    let xp: [*const i8; T] = std::array::from_fn(|t| a.x[t].as_ptr());
    let mut out = [[0f32; ROWS]; INT8_TILE];
    // SAFETY (whole body): AVX2 and FMA (the caller's target features); sb < Kp/256, so the chunk
    // halves and the x bytes 256·sb + 32·v .. + 32 of every token are in bounds, and the scale index
    // (t·Gp + gi)·4 + r < T·Gp·4 (asserts above).
    unsafe {
        let mask = _mm256_set1_epi8(3);
        let ones = _mm256_set1_epi16(1);
        let mut facc = [[[_mm256_setzero_ps(); MAX_CHAINS]; T]; ROWS];
        let chains = fma_chains(T, V);
        let sbs = kp / SUPER_K;
        for sb0 in (0..sbs).step_by(PANEL_SB) {
            for r in 0..ROWS {
                let mut f = facc[r];
                let mut acc = [_mm256_setzero_si256(); T];
                for sb in sb0..(sb0 + PANEL_SB).min(sbs) {
                    // Row r asks for its own line of the superblock PREFETCH_SB ahead, so the panel's
                    // four walks together fetch every line once and the requests are spread over the
                    // whole panel (past the block's end it is the next block's weight or nothing; a
                    // prefetch never faults). Row 0 asking for all four lines sent them in bursts the
                    // memory could not follow: Zen 2, M = 1, 2048 → 151936 from DRAM, one thread
                    // 8.3 → 7.1-7.3 ms, two threads 4.4 → 3.7-3.8 ms.
                    let ahead = bp.wrapping_add(((sb + PREFETCH_SB) * ROWS + r) * CHUNK_BYTES);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    let w = [load_half(bp, sb, r, 0), load_half(bp, sb, r, 1)];
                    // Vector v of the superblock is sub-vector v / 2, half v % 2: weights 256·sb + 32·v ..
                    for v in 0..SUPER_K / 32 {
                        let c = unpack(w[v % 2], v / 2, mask);
                        let k = sb * SUPER_K + 32 * v;
                        for t in 0..T {
                            let p =
                                _mm256_maddubs_epi16(c, _mm256_loadu_si256(xp[t].add(k).cast()));
                            acc[t] = if v % V == 0 {
                                p
                            } else {
                                _mm256_add_epi16(acc[t], p)
                            };
                        }
                        if (v + 1) % V == 0 {
                            let gi = sb * (SUPER_K / g) + v / V;
                            for t in 0..T {
                                let i = _mm256_madd_epi16(acc[t], ones);
                                let s = _mm256_set1_ps(*cs.add((t * gp + gi) * ROWS + r));
                                let j = (v / V) % chains;
                                f[t][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), s, f[t][j]);
                            }
                        }
                    }
                }
                facc[r] = f;
            }
        }
        for r in 0..ROWS {
            for t in 0..T {
                let [a, b, c, d] = facc[r][t];
                out[t][r] = hsum(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
            }
        }
    }
    out
}

/// Eight combined scales per step, the correction summed in two chains (one chain of 4-wide FMAs was
/// latency-bound: a tenth of an M = 1 GEMV at K = 4096 on Zen 2).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prepass(scales: &[f16], xs4: &[f32], qsum4: &[f32], cs: &mut [f32]) -> [f32; ROWS] {
    let n = cs.len();
    assert!(n.is_multiple_of(ROWS) && scales.len() >= n && xs4.len() >= n && qsum4.len() >= n);
    let (sp, xp, qp, cp) = (
        scales.as_ptr(),
        xs4.as_ptr(),
        qsum4.as_ptr(),
        cs.as_mut_ptr(),
    );
    let mut corr = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY (both loops): i + 8 (then i + 4) ≤ n ≤ every slice's length.
    unsafe {
        while i + 16 <= n {
            for j in 0..2 {
                let o = i + 8 * j;
                let s = _mm256_cvtph_ps(_mm_loadu_si128(sp.add(o).cast()));
                let c = _mm256_mul_ps(s, _mm256_loadu_ps(xp.add(o)));
                _mm256_storeu_ps(cp.add(o), c);
                corr[j] = _mm256_fmadd_ps(c, _mm256_loadu_ps(qp.add(o)), corr[j]);
            }
            i += 16;
        }
        let mut tail = _mm_setzero_ps();
        while i < n {
            let s = _mm_cvtph_ps(_mm_loadl_epi64(sp.add(i).cast()));
            let c = _mm_mul_ps(s, _mm_loadu_ps(xp.add(i)));
            _mm_storeu_ps(cp.add(i), c);
            tail = _mm_fmadd_ps(c, _mm_loadu_ps(qp.add(i)), tail);
            i += ROWS;
        }
        let both = _mm256_add_ps(corr[0], corr[1]);
        let four = _mm_add_ps(
            _mm_add_ps(
                _mm256_castps256_ps128(both),
                _mm256_extractf128_ps::<1>(both),
            ),
            tail,
        );
        std::mem::transmute::<__m128, [f32; ROWS]>(four)
    }
}

/// The exact GEMV, monomorphized per group size like [`int8`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exact(block: &[u8], scales: &[f16], x: &[f32], g: usize) -> [f32; ROWS] {
    // SAFETY: same features; `exact_body` checks its own bounds.
    unsafe {
        match g {
            32 => exact_body::<1>(block, scales, x),
            64 => exact_body::<2>(block, scales, x),
            128 => exact_body::<4>(block, scales, x),
            _ => exact_body::<8>(block, scales, x),
        }
    }
}

/// `t = code − 1` sign-extended 8 at a time and FMAs with x, into four accumulators per group (one
/// chain of dependent FMAs ran at one 8-wide FMA per latency: 5.4 G weights/s on Zen 2).
#[inline(always)]
unsafe fn exact_body<const V: usize>(block: &[u8], scales: &[f16], x: &[f32]) -> [f32; ROWS] {
    let g = 32 * V;
    let kp = block.len();
    assert!(kp.is_multiple_of(SUPER_K) && x.len() >= kp && scales.len() * g >= kp * ROWS);
    let (bp, xp) = (block.as_ptr(), x.as_ptr());
    // SAFETY (whole body): AVX2, FMA and F16C (the caller's target features); chunk and x offsets are
    // inside Kp and the scale index (Kp/g − 1)·4 + r is inside `scales` (asserts above).
    unsafe {
        let mask = _mm256_set1_epi8(3);
        let one = _mm256_set1_epi8(1);
        // A loop, not `array::from_fn`: a closure here would not inherit the caller's target features,
        // and the intrinsics in it would stay out-of-line calls.
        let mut out = [0f32; ROWS];
        for r in 0..ROWS {
            let mut total = _mm256_setzero_ps();
            let mut group = [_mm256_setzero_ps(); 4];
            for sb in 0..kp / SUPER_K {
                let w = [load_half(bp, sb, r, 0), load_half(bp, sb, r, 1)];
                for v in 0..SUPER_K / 32 {
                    let t = _mm256_sub_epi8(unpack(w[v % 2], v / 2, mask), one);
                    let k0 = sb * SUPER_K + 32 * v;
                    let halves = [_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t)];
                    for piece in 0..4 {
                        let t8 = if piece % 2 == 0 {
                            halves[piece / 2]
                        } else {
                            _mm_unpackhi_epi64(halves[piece / 2], halves[piece / 2])
                        };
                        let tf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(t8));
                        let xv = _mm256_loadu_ps(xp.add(k0 + 8 * piece));
                        group[piece] = _mm256_fmadd_ps(tf, xv, group[piece]);
                    }
                    if (v + 1) % V == 0 {
                        let gi = sb * (SUPER_K / g) + v / V;
                        let s = _mm256_set1_ps(scales.get_unchecked(gi * ROWS + r).to_f32());
                        let sum = _mm256_add_ps(
                            _mm256_add_ps(group[0], group[1]),
                            _mm256_add_ps(group[2], group[3]),
                        );
                        total = _mm256_fmadd_ps(sum, s, total);
                        group = [_mm256_setzero_ps(); 4];
                    }
                }
            }
            out[r] = hsum(total);
        }
        out
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode(
    block: &[u8],
    scales: &[f16],
    g: usize,
    k0: usize,
    out: &mut [f32],
    stride: usize,
) {
    let kc = super::decode_span(block, scales, g, k0, out, stride);
    // Group sizes are powers of two: a shift, not a division per 32 weights.
    let gshift = g.trailing_zeros();
    let bp = block.as_ptr();
    let mask = _mm256_set1_epi8(3);
    let one = _mm256_set1_epi8(1);
    let mut trits = [0i8; 32];
    for r in 0..ROWS {
        for sb in k0 / SUPER_K..(k0 + kc) / SUPER_K {
            for h in 0..2 {
                // SAFETY: sb < Kp/256 (assert); out offsets r·stride + (k − k0) + 8 ≤ out.len().
                unsafe {
                    let w = load_half(bp, sb, r, h);
                    for sub in 0..4 {
                        let t = _mm256_sub_epi8(unpack(w, sub, mask), one);
                        _mm256_storeu_si256(trits.as_mut_ptr().cast(), t);
                        let kb = sb * SUPER_K + sub * SUB_K + 32 * h;
                        let s = _mm256_set1_ps(scales[(kb >> gshift) * ROWS + r].to_f32());
                        for piece in 0..4 {
                            let t8 = _mm_loadl_epi64(trits.as_ptr().add(8 * piece).cast());
                            let v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(t8)), s);
                            _mm256_storeu_ps(
                                out.as_mut_ptr().add(r * stride + kb + 8 * piece - k0),
                                v,
                            );
                        }
                    }
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn micro(x: [&[f32]; MICRO_M], w: [&[f32]; ROWS], acc: &mut [f32]) {
    let kc = x[0].len();
    assert!(kc.is_multiple_of(8) && x.iter().chain(w.iter()).all(|s| s.len() == kc));
    assert!(acc.len() >= (MICRO_M - 1) * ACC_STRIDE + ROWS * LANES);
    // 16 ymm registers: do the rows in two halves (8 accumulators + 2 weights + 1 activation each).
    for r0 in (0..ROWS).step_by(2) {
        let mut a = [[_mm256_setzero_ps(); 2]; MICRO_M];
        for j in (0..kc).step_by(8) {
            // SAFETY: j + 8 ≤ kc = every slice's length.
            unsafe {
                let w0 = _mm256_loadu_ps(w[r0].as_ptr().add(j));
                let w1 = _mm256_loadu_ps(w[r0 + 1].as_ptr().add(j));
                for i in 0..MICRO_M {
                    let xv = _mm256_loadu_ps(x[i].as_ptr().add(j));
                    a[i][0] = _mm256_fmadd_ps(xv, w0, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(xv, w1, a[i][1]);
                }
            }
        }
        for i in 0..MICRO_M {
            for h in 0..2 {
                // SAFETY: the window holds MICRO_M strides of ROWS · LANES floats (assert above);
                // this variant uses the first 8 of each accumulator's 16 lanes.
                unsafe {
                    let p = acc.as_mut_ptr().add(i * ACC_STRIDE + (r0 + h) * LANES);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), a[i][h]));
                }
            }
        }
    }
}

/// max of the absolute values' bit patterns over `n` floats (a multiple of 8): NaN (above every
/// infinity as an integer) propagates, as in the scalar `abs_max`.
#[target_feature(enable = "avx2")]
unsafe fn abs_bits_max(x: *const f32, n: usize) -> u32 {
    let abs = _mm256_set1_epi32(0x7FFF_FFFF);
    let mut m = _mm256_setzero_si256();
    for i in (0..n).step_by(8) {
        // SAFETY: the caller passes n readable floats.
        let v = unsafe { _mm256_loadu_si256(x.add(i).cast()) };
        m = _mm256_max_epu32(m, _mm256_and_si256(v, abs));
    }
    let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
    _mm_cvtsi128_si32(m) as u32
}

/// Bit-for-bit [`super::quant::quantize_row`], 32 values per step (`vcvtps2dq` rounds half to even
/// under the default MXCSR; the scalar one was a libm `rintf` call per value).
#[target_feature(enable = "avx2")]
unsafe fn quantize(
    x: &[f32],
    q: &mut [i8],
    g: usize,
    per_token: bool,
    xs4: &mut [f32],
    qsum4: &mut [f32],
) {
    use super::quant::{quantize_groups, INT8_MAX};
    let hi = _mm256_set1_epi32(INT8_MAX as i32);
    let lo = _mm256_set1_epi32(if per_token { -128 } else { -(INT8_MAX as i32) });
    let indefinite = _mm256_set1_epi32(i32::MIN);
    // packs leave the dwords of four 8-value vectors as v0[0..4] v1[0..4] v2[0..4] v3[0..4] v0[4..8] ...
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    assert!(q.len() >= x.len() && g.is_multiple_of(32));
    let (xp, qp) = (x.as_ptr(), q.as_mut_ptr());
    // SAFETY (both closures): quantize_groups asks for x[from .. from + n] and group gi's g values of x
    // and q, inside the slices it checked.
    let amax = |from: usize, n: usize| f32::from_bits(unsafe { abs_bits_max(xp.add(from), n) });
    let group = |gi: usize, mul: f32| -> i32 {
        unsafe {
            let (xg, qg) = (xp.add(gi * g), qp.add(gi * g));
            let mulv = _mm256_set1_ps(mul);
            let mut sum = _mm256_setzero_si256();
            for i in (0..g).step_by(32) {
                let v: [__m256i; 4] = std::array::from_fn(|j| {
                    let v =
                        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg.add(i + 8 * j)), mulv));
                    // NaN · 0 converts to the "integer indefinite" 0x80000000; such a group's scale is
                    // NaN, so its codes never matter — but match the scalar 0 anyway.
                    let v = _mm256_andnot_si256(_mm256_cmpeq_epi32(v, indefinite), v);
                    _mm256_min_epi32(_mm256_max_epi32(v, lo), hi)
                });
                sum = _mm256_add_epi32(
                    sum,
                    _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])),
                );
                // Values are within [−128, 127]: the saturating packs are exact.
                let w = _mm256_packs_epi16(
                    _mm256_packs_epi32(v[0], v[1]),
                    _mm256_packs_epi32(v[2], v[3]),
                );
                _mm256_storeu_si256(qg.add(i).cast(), _mm256_permutevar8x32_epi32(w, order));
            }
            let s = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256::<1>(sum),
            );
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            _mm_cvtsi128_si32(s)
        }
    };
    quantize_groups(x, g, per_token, xs4, qsum4, amax, group);
}

/// f32 → bf16 bits, 16 at a time: bit for bit `half::bf16::from_f32` (rounded to nearest even, NaN kept
/// NaN with the quiet bit set), as `avx512::f32_to_bf16` does; half's slice conversion is scalar, and
/// every bf16 result of the kernels goes through this (2 % of a batch-16 decode step on Zen 2).
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn f32_to_bf16(src: &[f32], dst: &mut [half::bf16]) {
    assert_eq!(src.len(), dst.len());
    let whole = src.len() / 16 * 16;
    let (one, round, abs, inf, quiet) = (
        _mm256_set1_epi32(1),
        _mm256_set1_epi32(0x7FFF),
        _mm256_set1_epi32(0x7FFF_FFFF),
        _mm256_set1_epi32(0x7F80_0000),
        _mm256_set1_epi32(0x0040_0000),
    );
    let to_bits = |x: __m256i| -> __m256i {
        // x + 0x7FFF + (bit 16 of x): carries into bit 16 exactly when RNE rounds up. |x| as an i32 is
        // never negative, so the signed compare finds the NaNs.
        let up = _mm256_add_epi32(round, _mm256_and_si256(_mm256_srli_epi32::<16>(x), one));
        let nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs), inf);
        let r = _mm256_blendv_epi8(_mm256_add_epi32(x, up), _mm256_or_si256(x, quiet), nan);
        _mm256_srli_epi32::<16>(r)
    };
    for i in (0..whole).step_by(16) {
        // SAFETY: i + 16 ≤ len for both slices; AVX2 (this function's target feature).
        unsafe {
            let a = to_bits(_mm256_loadu_si256(src.as_ptr().add(i).cast()));
            let b = to_bits(_mm256_loadu_si256(src.as_ptr().add(i + 8).cast()));
            // Values ≤ 0xFFFF: the unsigned saturating pack is exact; it interleaves 128-bit lanes.
            let h = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
        }
    }
    for (d, &v) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *d = half::bf16::from_f32(v);
    }
}
