//! AVX-512 kernels (F + BW + DQ + VL + VNNI, with FMA and F16C).
//!
//! The bit-planes are mask registers: a 16-bit slice of the plus plane selects the lanes where
//! `t = +1`, so `acc = acc + x` under that mask is exactly `Σ_{t=+1} x` — no decode instruction at all,
//! two masked adds per 16 weights (`kmovw k, m16` loads the mask straight from the plane). The int8 mode
//! builds signed bytes with two masked byte moves (`q` where +1, `−q` where −1, 0 elsewhere) and sums
//! them with `vpdpbusd` against a vector of ones, 64 weights per instruction.

// Register arrays (per row, per x row) are indexed in lockstep; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::f16;

use super::avx2::{f16_to_f32, plane_offset};
use super::layout::{CHUNK_BYTES, CHUNK_K, MINUS_OFFSET};
use super::{Kernels, RowBlock, ACC_STRIDE, LANES, MICRO_M, ROWS};

pub(crate) static KERNELS: Kernels = Kernels {
    gemv_exact,
    gemv_bf16: None,
    gemv_int8,
    decode_row,
    micro,
};

/// The same kernels plus the `vdpbf16ps` GEMV for bf16 activations (CPUs with AVX512_BF16).
pub(crate) static KERNELS_BF16: Kernels = Kernels {
    gemv_bf16: Some(gemv_bf16),
    ..KERNELS
};

pub(crate) fn has_bf16_dot() -> bool {
    is_x86_feature_detected!("avx512bf16")
}

pub(crate) fn is_supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Read a little-endian mask of `T` bits at `p + off`.
///
/// # Safety
/// `off + size_of::<T>()` bytes must be inside the allocation `p` points into.
#[inline(always)]
unsafe fn mask_at<T: Copy>(p: *const u8, off: usize) -> T {
    unsafe { p.add(off).cast::<T>().read_unaligned() }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
unsafe fn gemv_exact(block: &RowBlock<'_>, x: &[f32], g: usize) -> [f32; ROWS] {
    let groups = block.scales[0].len();
    let cols = groups * g;
    assert!(x.len() >= cols && block.planes.iter().all(|p| p.len() * 4 >= cols));
    let xp = x.as_ptr();
    let pp: [*const u8; ROWS] = block.planes.map(|p| p.as_ptr());
    let zero = _mm512_setzero_ps();
    let mut total = [zero; ROWS];
    for gi in 0..groups {
        // Two accumulators per sign and per half of the 32-column step: independent add chains.
        let mut plus = [[zero; 2]; ROWS];
        let mut minus = [[zero; 2]; ROWS];
        for k in (gi * g..(gi + 1) * g).step_by(32) {
            // SAFETY: k + 32 ≤ cols ≤ x.len(), and the plane bytes of columns k..k+32 lie in the row
            // (checked by the assert above: a row holds at least cols/4 bytes, laid out per 64-chunk).
            unsafe {
                let x0 = _mm512_loadu_ps(xp.add(k));
                let x1 = _mm512_loadu_ps(xp.add(k + 16));
                let off = plane_offset(k);
                for r in 0..ROWS {
                    let p = pp[r];
                    let (p0, p1) = (mask_at::<u16>(p, off), mask_at::<u16>(p, off + 2));
                    let m0 = mask_at::<u16>(p, off + MINUS_OFFSET);
                    let m1 = mask_at::<u16>(p, off + MINUS_OFFSET + 2);
                    plus[r][0] = _mm512_mask_add_ps(plus[r][0], p0, plus[r][0], x0);
                    plus[r][1] = _mm512_mask_add_ps(plus[r][1], p1, plus[r][1], x1);
                    minus[r][0] = _mm512_mask_add_ps(minus[r][0], m0, minus[r][0], x0);
                    minus[r][1] = _mm512_mask_add_ps(minus[r][1], m1, minus[r][1], x1);
                }
            }
        }
        for r in 0..ROWS {
            let s = _mm512_set1_ps(f16_to_f32(block.scales[r][gi]));
            let d = _mm512_sub_ps(
                _mm512_add_ps(plus[r][0], plus[r][1]),
                _mm512_add_ps(minus[r][0], minus[r][1]),
            );
            total[r] = _mm512_fmadd_ps(d, s, total[r]);
        }
    }
    total.map(|t| _mm512_reduce_add_ps(t))
}

/// bf16 activations: 32 weights become bf16 ±1/0 with two masked word moves, then one `vdpbf16ps`
/// adds `t·x` pairwise into f32 lanes — products are exact, sums are f32 (the instruction rounds each
/// of its two additions to nearest-even; it treats subnormal inputs and results as zero, i.e. |x| below
/// 2⁻¹²⁶ counts as 0). 3 vector ops per 32 weights instead of 4 for the f32 masked adds.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,f16c")]
unsafe fn gemv_bf16(block: &RowBlock<'_>, x: &[u16], g: usize) -> [f32; ROWS] {
    let groups = block.scales[0].len();
    let cols = groups * g;
    assert!(x.len() >= cols && block.planes.iter().all(|p| p.len() * 4 >= cols));
    let pp: [*const u8; ROWS] = block.planes.map(|p| p.as_ptr());
    let one = _mm512_set1_epi16(0x3F80); // bf16 +1.0
    let minus_one = _mm512_set1_epi16(0xBF80u16 as i16); // bf16 −1.0
    let zero = _mm512_setzero_ps();
    let mut total = [zero; ROWS];
    // One 32-column step into accumulator `h` (two per row: independent dependency chains).
    macro_rules! step {
        ($acc:ident, $k:expr, $h:expr) => {{
            let k = $k;
            // SAFETY: k + 32 ≤ cols ≤ x.len(); the plane bytes of columns k..k+32 are in every row.
            unsafe {
                let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.as_ptr().add(k).cast()));
                let off = plane_offset(k);
                for r in 0..ROWS {
                    let kp = mask_at::<u32>(pp[r], off);
                    let km = mask_at::<u32>(pp[r], off + MINUS_OFFSET);
                    let w = _mm512_mask_mov_epi16(_mm512_maskz_mov_epi16(kp, one), km, minus_one);
                    let w: __m512bh = std::mem::transmute(w);
                    $acc[r][$h] = _mm512_dpbf16_ps($acc[r][$h], w, xv);
                }
            }
        }};
    }
    for gi in 0..groups {
        let mut acc = [[zero; 2]; ROWS];
        let (mut k, end) = (gi * g, (gi + 1) * g);
        while k + 64 <= end {
            step!(acc, k, 0);
            step!(acc, k + 32, 1);
            k += 64;
        }
        if k < end {
            step!(acc, k, 0); // g = 32
        }
        for r in 0..ROWS {
            let s = _mm512_set1_ps(f16_to_f32(block.scales[r][gi]));
            total[r] = _mm512_fmadd_ps(_mm512_add_ps(acc[r][0], acc[r][1]), s, total[r]);
        }
    }
    total.map(|t| _mm512_reduce_add_ps(t))
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")]
unsafe fn gemv_int8(block: &RowBlock<'_>, q: &[i8], neg_q: &[i8], g: usize) -> [f32; ROWS] {
    let groups = block.scales[0].len();
    let chunks = q.len() / CHUNK_K;
    assert!(
        neg_q.len() == q.len()
            && chunks * CHUNK_K >= groups * g
            && block.planes.iter().all(|p| p.len() >= chunks * CHUNK_BYTES)
    );
    let pp: [*const u8; ROWS] = block.planes.map(|p| p.as_ptr());
    let ones = _mm512_set1_epi8(1);
    let mut total = [_mm512_setzero_ps(); ROWS];
    let mut acc = [_mm512_setzero_si512(); ROWS];
    let chunks_per_group = (g / CHUNK_K).max(1);
    // Countdown to the group end and the group index (no division per chunk).
    let (mut chunks_left, mut group) = (chunks_per_group, 0);
    let scale = |r: usize, gi: usize| -> f32 {
        // A 32-group past the end (K an odd multiple of 32) covers only padding: weight 0.
        block.scales[r].get(gi).map_or(0.0, |&s| f16_to_f32(s))
    };
    for c in 0..chunks {
        // SAFETY: c < chunks, so the 64 bytes of q/neg_q and the 16 plane bytes of chunk c are in bounds.
        unsafe {
            let xq = _mm512_loadu_si512(q.as_ptr().add(c * CHUNK_K).cast());
            let xn = _mm512_loadu_si512(neg_q.as_ptr().add(c * CHUNK_K).cast());
            for r in 0..ROWS {
                let kp = mask_at::<u64>(pp[r], c * CHUNK_BYTES);
                let km = mask_at::<u64>(pp[r], c * CHUNK_BYTES + MINUS_OFFSET);
                let signed = _mm512_mask_mov_epi8(_mm512_maskz_mov_epi8(kp, xq), km, xn);
                acc[r] = _mm512_dpbusd_epi32(acc[r], ones, signed);
            }
        }
        if g == 32 {
            // Lanes 0..8 summed columns 0..32 of the chunk (group 2c), lanes 8..16 group 2c + 1.
            for r in 0..ROWS {
                let s = _mm512_mask_blend_ps(
                    0xFF00,
                    _mm512_set1_ps(scale(r, 2 * c)),
                    _mm512_set1_ps(scale(r, 2 * c + 1)),
                );
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), s, total[r]);
                acc[r] = _mm512_setzero_si512();
            }
        } else {
            chunks_left -= 1;
            if chunks_left == 0 {
                chunks_left = chunks_per_group;
                for r in 0..ROWS {
                    let s = _mm512_set1_ps(scale(r, group));
                    total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), s, total[r]);
                    acc[r] = _mm512_setzero_si512();
                }
                group += 1;
            }
        }
    }
    total.map(|t| _mm512_reduce_add_ps(t))
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
unsafe fn decode_row(planes: &[u8], scales: &[f16], g: usize, k0: usize, out: &mut [f32]) {
    assert!(k0.is_multiple_of(CHUNK_K) && out.len().is_multiple_of(CHUNK_K));
    assert!((k0 + out.len()) / CHUNK_K * CHUNK_BYTES <= planes.len() && !scales.is_empty());
    let p = planes.as_ptr();
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
        let (plus_s, minus_s) = (_mm512_set1_ps(s), _mm512_set1_ps(-s));
        while k < group_end {
            // SAFETY: k + 16 ≤ end, whose plane bytes are in bounds (assert above); k − k0 + 16 ≤ out.len().
            unsafe {
                let off = plane_offset(k);
                let kp = mask_at::<u16>(p, off);
                let km = mask_at::<u16>(p, off + MINUS_OFFSET);
                let v = _mm512_mask_mov_ps(_mm512_maskz_mov_ps(kp, plus_s), km, minus_s);
                _mm512_storeu_ps(out.as_mut_ptr().add(k - k0), v);
            }
            k += 16;
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma")]
unsafe fn micro(x: [&[f32]; MICRO_M], w: [&[f32]; ROWS], acc: &mut [f32]) {
    let kc = x[0].len();
    assert!(kc.is_multiple_of(16) && x.iter().chain(w.iter()).all(|s| s.len() == kc));
    assert!(acc.len() >= (MICRO_M - 1) * ACC_STRIDE + ROWS * LANES);
    let zero = _mm512_setzero_ps();
    let mut a = [[zero; ROWS]; MICRO_M];
    for j in (0..kc).step_by(16) {
        // SAFETY: j + 16 ≤ kc = every slice's length.
        unsafe {
            let wv: [__m512; ROWS] = std::array::from_fn(|r| _mm512_loadu_ps(w[r].as_ptr().add(j)));
            for i in 0..MICRO_M {
                let xv = _mm512_loadu_ps(x[i].as_ptr().add(j));
                for r in 0..ROWS {
                    a[i][r] = _mm512_fmadd_ps(xv, wv[r], a[i][r]);
                }
            }
        }
    }
    for i in 0..MICRO_M {
        for r in 0..ROWS {
            // SAFETY: the window holds MICRO_M strides of ROWS · LANES floats (assert above).
            unsafe {
                let p = acc.as_mut_ptr().add(i * ACC_STRIDE + r * LANES);
                _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), a[i][r]));
            }
        }
    }
}
