//! AVX2 kernels (with FMA and F16C), for x86-64 CPUs without AVX-512.
//!
//! No mask registers here: a plane byte is broadcast and shifted per lane (`vpsllvd`) so that the bit of
//! lane i lands in the sign bit, which `vblendvps` uses as its selector. The int8 mode expands 32 plane
//! bits to 32 byte masks (`vpshufb` + compare) and sums signed bytes with `vpmaddubsw`/`vpmaddwd`.

// Register arrays (per row, per x row) are indexed in lockstep; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::f16;

use super::layout::{CHUNK_BYTES, CHUNK_K, MINUS_OFFSET};
use super::{Kernels, RowBlock, ACC_STRIDE, LANES, MICRO_M, ROWS};

pub(crate) static KERNELS: Kernels = Kernels {
    gemv_exact,
    gemv_bf16: None,
    gemv_int8,
    decode_row,
    micro,
};

pub(crate) fn is_supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// One fp16 → f32 conversion (`vcvtph2ps`); the AVX-512 kernels share it.
#[inline]
#[target_feature(enable = "f16c")]
pub(super) fn f16_to_f32(h: f16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
}

/// Byte offset, inside a prepared row, of the plus-plane bits of column `k` (k a multiple of 8).
/// Shared with the AVX-512 kernels.
#[inline(always)]
pub(super) fn plane_offset(k: usize) -> usize {
    (k / CHUNK_K) * CHUNK_BYTES + (k % CHUNK_K) / 8
}

/// Per-lane shift that moves bit `first + lane` of a broadcast word into the sign bit.
#[inline]
#[target_feature(enable = "avx2")]
fn sign_shifts(first: i32) -> __m256i {
    _mm256_setr_epi32(
        31 - first,
        30 - first,
        29 - first,
        28 - first,
        27 - first,
        26 - first,
        25 - first,
        24 - first,
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_exact(block: &RowBlock<'_>, x: &[f32], g: usize) -> [f32; ROWS] {
    let groups = block.scales[0].len();
    let cols = groups * g;
    assert!(x.len() >= cols && block.planes.iter().all(|p| p.len() * 4 >= cols));
    let xp = x.as_ptr();
    let zero = _mm256_setzero_ps();
    let shifts: [__m256i; 4] = std::array::from_fn(|j| sign_shifts(8 * j as i32));
    let mut total = [zero; ROWS];
    for gi in 0..groups {
        let mut plus = [zero; ROWS];
        let mut minus = [zero; ROWS];
        for k in (gi * g..(gi + 1) * g).step_by(32) {
            // SAFETY: k + 32 ≤ cols ≤ x.len(); plane bytes of columns k..k+32 are in the row (assert).
            unsafe {
                let xs: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(xp.add(k + 8 * j)));
                let off = plane_offset(k);
                for r in 0..ROWS {
                    let p = block.planes[r].as_ptr().add(off);
                    let pw = _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
                    let mw = _mm256_set1_epi32(p.add(MINUS_OFFSET).cast::<i32>().read_unaligned());
                    for j in 0..4 {
                        let ps = _mm256_castsi256_ps(_mm256_sllv_epi32(pw, shifts[j]));
                        let ms = _mm256_castsi256_ps(_mm256_sllv_epi32(mw, shifts[j]));
                        plus[r] = _mm256_add_ps(plus[r], _mm256_blendv_ps(zero, xs[j], ps));
                        minus[r] = _mm256_add_ps(minus[r], _mm256_blendv_ps(zero, xs[j], ms));
                    }
                }
            }
        }
        for r in 0..ROWS {
            let s = _mm256_set1_ps(f16_to_f32(block.scales[r][gi]));
            total[r] = _mm256_fmadd_ps(_mm256_sub_ps(plus[r], minus[r]), s, total[r]);
        }
    }
    total.map(|t| hsum(t))
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 32 plane bits → 32 byte masks (0xFF where the bit is set).
#[inline]
#[target_feature(enable = "avx2")]
fn byte_masks(bits: u32) -> __m256i {
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let rep = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
    _mm256_cmpeq_epi8(_mm256_and_si256(rep, select), select)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_int8(block: &RowBlock<'_>, q: &[i8], neg_q: &[i8], g: usize) -> [f32; ROWS] {
    let groups = block.scales[0].len();
    let cols = groups * g;
    assert!(
        neg_q.len() == q.len()
            && q.len() >= cols
            && block.planes.iter().all(|p| p.len() * 4 >= cols)
    );
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    let mut total = [_mm256_setzero_ps(); ROWS];
    for gi in 0..groups {
        let mut acc = [_mm256_setzero_si256(); ROWS];
        for k in (gi * g..(gi + 1) * g).step_by(32) {
            // SAFETY: k + 32 ≤ cols ≤ q.len(); plane bytes of columns k..k+32 are in the row (assert).
            unsafe {
                let xq = _mm256_loadu_si256(q.as_ptr().add(k).cast());
                let xn = _mm256_loadu_si256(neg_q.as_ptr().add(k).cast());
                let off = plane_offset(k);
                for r in 0..ROWS {
                    let p = block.planes[r].as_ptr().add(off);
                    let pm = byte_masks(p.cast::<u32>().read_unaligned());
                    let mm = byte_masks(p.add(MINUS_OFFSET).cast::<u32>().read_unaligned());
                    let signed =
                        _mm256_or_si256(_mm256_and_si256(pm, xq), _mm256_and_si256(mm, xn));
                    // |pair sums| ≤ 254, so the i16 stage cannot saturate.
                    let pairs = _mm256_maddubs_epi16(ones8, signed);
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones16));
                }
            }
        }
        for r in 0..ROWS {
            let s = _mm256_set1_ps(f16_to_f32(block.scales[r][gi]));
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), s, total[r]);
        }
    }
    total.map(|t| hsum(t))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_row(planes: &[u8], scales: &[f16], g: usize, k0: usize, out: &mut [f32]) {
    assert!(k0.is_multiple_of(CHUNK_K) && out.len().is_multiple_of(CHUNK_K));
    assert!((k0 + out.len()) / CHUNK_K * CHUNK_BYTES <= planes.len() && !scales.is_empty());
    let zero = _mm256_setzero_ps();
    let plus_shift = sign_shifts(0);
    let minus_shift = sign_shifts(8);
    let end = k0 + out.len();
    // Walk group by group (no division in the loop); columns past K use the last scale (their masks are 0).
    let mut k = k0;
    while k < end {
        let gi = (k / g).min(scales.len() - 1);
        let group_end = if gi + 1 == scales.len() {
            end
        } else {
            ((gi + 1) * g).min(end)
        };
        let s = f16_to_f32(scales[gi]);
        let (plus_s, minus_s) = (_mm256_set1_ps(s), _mm256_set1_ps(-s));
        while k < group_end {
            let off = plane_offset(k);
            // Plus bits in byte 0, minus bits in byte 1 of one broadcast word.
            let word = planes[off] as i32 | (planes[off + MINUS_OFFSET] as i32) << 8;
            let w = _mm256_set1_epi32(word);
            let v = _mm256_blendv_ps(
                zero,
                plus_s,
                _mm256_castsi256_ps(_mm256_sllv_epi32(w, plus_shift)),
            );
            let v = _mm256_blendv_ps(
                v,
                minus_s,
                _mm256_castsi256_ps(_mm256_sllv_epi32(w, minus_shift)),
            );
            // SAFETY: k − k0 + 8 ≤ out.len().
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(k - k0), v) };
            k += 8;
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
