//! AVX2 kernels (with FMA and F16C), for x86-64 CPUs without AVX-512.
//!
//! A 64-byte chunk is two 32-byte halves; `(half >> 2i) & 3` gives 32 byte codes. The int8 mode sums
//! `code · q` with `vpmaddubsw` (pairs into i16: at most 2·2·128, no saturation) and `vpmaddwd` against
//! ones (into i32); the exact mode sign-extends `t = code − 1` 8 at a time and uses FMA. With only 16
//! ymm registers the kernels walk one row of the block at a time (the block stays in L1 meanwhile).

// Register arrays (per token) are indexed in lockstep; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::f16;

use super::layout::{CHUNK_BYTES, ROWS, SUB_K, SUPER_K};
use super::{Int8Tile, Kernels, ACC_STRIDE, INT8_TILE, LANES, MICRO_M};

/// The scalar table with its hot loops replaced (the row quantizer and the flags stay the scalar ones).
pub(crate) static KERNELS: Kernels = Kernels {
    int8: [int8::<1>, int8::<2>, int8::<3>, int8::<4>],
    prepass,
    exact,
    decode,
    micro,
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

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

#[target_feature(enable = "avx2,fma")]
unsafe fn int8<const T: usize>(a: &Int8Tile<'_>) -> [[f32; ROWS]; INT8_TILE] {
    let kp = a.block.len();
    let g = a.group_size;
    let gp = kp / g;
    assert!(kp.is_multiple_of(SUPER_K) && a.cs.len() >= T * gp * ROWS);
    assert!(a.x.iter().take(T).all(|x| x.len() >= kp));
    let bp = a.block.as_ptr();
    let xp: [*const i8; T] = std::array::from_fn(|t| a.x[t].as_ptr());
    let mask = _mm256_set1_epi8(3);
    let ones = _mm256_set1_epi16(1);
    let mut out = [[0f32; ROWS]; INT8_TILE];
    for r in 0..ROWS {
        let mut facc = [_mm256_setzero_ps(); T];
        let mut iacc = [_mm256_setzero_si256(); T];
        for sb in 0..kp / SUPER_K {
            // SAFETY (whole loop): sb < Kp/256; x offsets k + 32 ≤ Kp; cs index < T·Gp·4 (asserts).
            unsafe {
                let w = [load_half(bp, sb, r, 0), load_half(bp, sb, r, 1)];
                for sub in 0..4 {
                    for h in 0..2 {
                        let c = unpack(w[h], sub, mask);
                        let k = sb * SUPER_K + sub * SUB_K + 32 * h;
                        for t in 0..T {
                            let x = _mm256_loadu_si256(xp[t].add(k).cast());
                            let d = _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), ones);
                            iacc[t] = _mm256_add_epi32(iacc[t], d);
                        }
                        if (k + 32).is_multiple_of(g) {
                            let gi = k / g;
                            for t in 0..T {
                                let s = _mm256_set1_ps(a.cs[(t * gp + gi) * ROWS + r]);
                                facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[t]), s, facc[t]);
                                iacc[t] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
            }
        }
        for t in 0..T {
            out[t][r] = hsum(facc[t]);
        }
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prepass(scales: &[f16], xs4: &[f32], qsum4: &[f32], cs: &mut [f32]) -> [f32; ROWS] {
    let n = cs.len();
    assert!(n.is_multiple_of(ROWS) && scales.len() >= n && xs4.len() >= n && qsum4.len() >= n);
    let mut corr = _mm_setzero_ps();
    for i in (0..n).step_by(ROWS) {
        // SAFETY: i + 4 ≤ n ≤ every slice's length.
        unsafe {
            let s = _mm_cvtph_ps(_mm_loadl_epi64(scales.as_ptr().add(i).cast()));
            let c = _mm_mul_ps(s, _mm_loadu_ps(xs4.as_ptr().add(i)));
            _mm_storeu_ps(cs.as_mut_ptr().add(i), c);
            corr = _mm_fmadd_ps(c, _mm_loadu_ps(qsum4.as_ptr().add(i)), corr);
        }
    }
    std::mem::transmute(corr)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exact(block: &[u8], scales: &[f16], x: &[f32], g: usize) -> [f32; ROWS] {
    let kp = block.len();
    assert!(kp.is_multiple_of(SUPER_K) && x.len() >= kp && scales.len() * g >= kp * ROWS);
    let bp = block.as_ptr();
    let mask = _mm256_set1_epi8(3);
    let one = _mm256_set1_epi8(1);
    let mut trits = [0i8; 32];
    std::array::from_fn(|r| {
        let (mut total, mut group) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for sb in 0..kp / SUPER_K {
            // SAFETY (whole loop): chunk and x offsets are inside Kp (asserts); `trits` is read 8 at a time.
            unsafe {
                let w = [load_half(bp, sb, r, 0), load_half(bp, sb, r, 1)];
                for sub in 0..4 {
                    for h in 0..2 {
                        let t = _mm256_sub_epi8(unpack(w[h], sub, mask), one);
                        _mm256_storeu_si256(trits.as_mut_ptr().cast(), t);
                        let k0 = sb * SUPER_K + sub * SUB_K + 32 * h;
                        for piece in 0..4 {
                            let t8 = _mm_loadl_epi64(trits.as_ptr().add(8 * piece).cast());
                            let tf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(t8));
                            let xv = _mm256_loadu_ps(x.as_ptr().add(k0 + 8 * piece));
                            group = _mm256_fmadd_ps(tf, xv, group);
                        }
                        if (k0 + 32).is_multiple_of(g) {
                            let s = _mm256_set1_ps(scales[(k0 / g) * ROWS + r].to_f32());
                            total = _mm256_fmadd_ps(group, s, total);
                            group = _mm256_setzero_ps();
                        }
                    }
                }
            }
        }
        // SAFETY: AVX available (target feature of this function).
        unsafe { hsum(total) }
    })
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
                        let s = _mm256_set1_ps(scales[(kb / g) * ROWS + r].to_f32());
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
