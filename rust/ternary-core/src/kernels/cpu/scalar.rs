//! Portable scalar kernels: the reference every SIMD variant is tested against, and the fallback on
//! CPUs without AVX2. Plain loops in the order the module docs describe (per-group f32 sums × scale).

use half::f16;

use super::layout::trit;
use super::{Kernels, RowBlock, ACC_STRIDE, LANES, MICRO_M, ROWS};

pub(crate) static KERNELS: Kernels = Kernels {
    gemv_exact,
    gemv_bf16: None,
    gemv_int8,
    decode_row,
    micro,
};

/// Scale of the group holding column `k` (padded columns past K reuse the last group; their trit is 0).
#[inline]
fn scale_at(scales: &[f16], g: usize, k: usize) -> f32 {
    scales[(k / g).min(scales.len() - 1)].to_f32()
}

fn gemv_exact(block: &RowBlock<'_>, x: &[f32], g: usize) -> [f32; ROWS] {
    std::array::from_fn(|r| {
        let (planes, scales) = (block.planes[r], block.scales[r]);
        let mut total = 0f32;
        for (gi, s) in scales.iter().enumerate() {
            let mut group = 0f32;
            for (k, &xk) in x.iter().enumerate().take((gi + 1) * g).skip(gi * g) {
                match trit(planes, k) {
                    1 => group += xk,
                    -1 => group -= xk,
                    _ => {}
                }
            }
            total += group * s.to_f32();
        }
        total
    })
}

fn gemv_int8(block: &RowBlock<'_>, q: &[i8], _neg_q: &[i8], g: usize) -> [f32; ROWS] {
    std::array::from_fn(|r| {
        let (planes, scales) = (block.planes[r], block.scales[r]);
        let mut total = 0f32;
        for (gi, s) in scales.iter().enumerate() {
            let group: i32 = (gi * g..(gi + 1) * g)
                .map(|k| trit(planes, k) as i32 * q[k] as i32)
                .sum();
            total += group as f32 * s.to_f32();
        }
        total
    })
}

fn decode_row(planes: &[u8], scales: &[f16], g: usize, k0: usize, out: &mut [f32]) {
    for (j, v) in out.iter_mut().enumerate() {
        let k = k0 + j;
        *v = trit(planes, k) as f32 * scale_at(scales, g, k);
    }
}

fn micro(x: [&[f32]; MICRO_M], w: [&[f32]; ROWS], acc: &mut [f32]) {
    for (i, xi) in x.iter().enumerate() {
        for (r, wr) in w.iter().enumerate() {
            let lanes = &mut acc[i * ACC_STRIDE + r * LANES..][..LANES];
            for (j, (a, b)) in xi.iter().zip(wr.iter()).enumerate() {
                lanes[j % LANES] += a * b;
            }
        }
    }
}
