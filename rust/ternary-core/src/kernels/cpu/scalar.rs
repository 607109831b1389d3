//! Portable scalar kernels: the reference every SIMD variant is tested against, and the fallback on
//! CPUs without AVX2. Plain loops over the layout's `code(r, k)`, in the order the module docs describe
//! (per-group sums × scale).

// Outputs are indexed by (token, row) in lockstep with the inputs; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use half::f16;

use super::layout::{code, padded_groups, ROWS, SUPER_K};
use super::{quant, Int8Tile, Kernels, ACC_STRIDE, INT8_TILE, LANES, MICRO_M};

pub(crate) const KERNELS: Kernels = Kernels {
    int8: [int8::<1>, int8::<2>, int8::<3>, int8::<4>],
    prepass,
    exact,
    exact_bf16: None,
    decode,
    micro,
    quantize: quant::quantize_row_fn,
    amx_int8: false,
    int8_wide: false,
};

/// Columns of a row block (`Kp`): the block is `Kp` bytes.
fn block_cols(block: &[u8]) -> usize {
    block.len()
}

unsafe fn int8<const T: usize>(a: &Int8Tile<'_>) -> [[f32; ROWS]; INT8_TILE] {
    let (kp, g) = (block_cols(a.block), a.group_size);
    let gp = kp / g;
    let mut out = [[0f32; ROWS]; INT8_TILE];
    for t in 0..T {
        for r in 0..ROWS {
            let mut total = 0f32;
            for gi in 0..gp {
                let sum: i32 = (gi * g..(gi + 1) * g)
                    .map(|k| code(a.block, r, k) as i32 * a.x[t][k] as i32)
                    .sum();
                total += sum as f32 * a.cs[t * gp * ROWS + gi * ROWS + r];
            }
            out[t][r] = total;
        }
    }
    out
}

unsafe fn prepass(scales: &[f16], xs4: &[f32], qsum4: &[f32], cs: &mut [f32]) -> [f32; ROWS] {
    let mut corr = [0f32; ROWS];
    for (i, c) in cs.iter_mut().enumerate() {
        *c = scales[i].to_f32() * xs4[i];
        corr[i % ROWS] += *c * qsum4[i];
    }
    corr
}

unsafe fn exact(block: &[u8], scales: &[f16], x: &[f32], g: usize) -> [f32; ROWS] {
    let kp = block_cols(block);
    std::array::from_fn(|r| {
        let mut total = 0f32;
        for gi in 0..kp / g {
            let mut group = 0f32;
            for (k, &xk) in x.iter().enumerate().take((gi + 1) * g).skip(gi * g) {
                match code(block, r, k) {
                    2 => group += xk,
                    0 => group -= xk,
                    _ => {}
                }
            }
            total += group * scales[gi * ROWS + r].to_f32();
        }
        total
    })
}

unsafe fn decode(
    block: &[u8],
    scales: &[f16],
    g: usize,
    k0: usize,
    out: &mut [f32],
    stride: usize,
) {
    let gp = padded_groups(block_cols(block), g);
    debug_assert!(k0.is_multiple_of(SUPER_K) && gp * g == block_cols(block));
    let kc = out.len() - (ROWS - 1) * stride;
    for r in 0..ROWS {
        for j in 0..kc {
            let k = k0 + j;
            let s = scales[(k / g) * ROWS + r].to_f32();
            out[r * stride + j] = (code(block, r, k) as f32 - 1.0) * s;
        }
    }
}

unsafe fn micro(x: [&[f32]; MICRO_M], w: [&[f32]; ROWS], acc: &mut [f32]) {
    for (i, xi) in x.iter().enumerate() {
        for (r, wr) in w.iter().enumerate() {
            let lanes = &mut acc[i * ACC_STRIDE + r * LANES..][..LANES];
            for (j, (a, b)) in xi.iter().zip(wr.iter()).enumerate() {
                lanes[j % LANES] += a * b;
            }
        }
    }
}
