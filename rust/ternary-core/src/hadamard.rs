//! Blockwise normalized fast Walsh–Hadamard transform (FWHT), the activation rotation of Bonsai 2.
//!
//! PrismML stores Bonsai 2 weights folded with a rotation: `W' = W·D·H`, where `D = diag(s)` is a ±1 sign
//! vector per input width and `H` is block-diagonal with normalized Sylvester–Hadamard blocks
//! (`H_b / sqrt(b)`, natural order; `H = H⁻¹ = Hᵀ`). A ternary kernel keeps `W'` ternary and rotates the
//! activation instead: `y = W'·(H·D·x)` (docs/formats.md#bonsai2-rotation). Two directions are needed:
//!
//! * [`Direction::Forward`] (linear-layer input): optional gather `x[gather[i]]`, times `s`, then `H`.
//! * [`Direction::Inverse`] (embedding rows stored inverse-rotated): `H` first, then times `s`.
//!
//! Each row is loaded once into an f32 scratch (gather, signs and dtype conversion fused into the load),
//! transformed in place, and stored once (normalization — and for `Inverse` the signs — fused into the
//! store). [`fwht_block_reference`] is the plain textbook butterfly; the fast path [`fwht_block`] performs
//! the very same additions in the same order (a fused 8-point kernel for the first three stages, then
//! contiguous, auto-vectorizable half-block loops), so both agree bit for bit. Many rows run on a
//! [`ParallelFor`] ([`Transform::apply_on`]: inside torch its own pool, whose threads are awake after the
//! previous op; [`Transform::apply`]: the ternary-rs rayon pool); a few rows (decode) run on the calling
//! thread.

use crate::threads::{DisjointWrites, ParallelFor, Rayon};
use crate::{Error, Result};

/// Largest block size accepted (2^16): far above Bonsai 2's 1024, and keeps the f32 scratch small.
pub const MAX_BLOCK_SIZE: usize = 1 << 16;
/// Rows below this many total elements are done on the calling thread (a fork costs more).
const PARALLEL_MIN_ELEMENTS: usize = 1 << 15;

/// Which way the transform goes (see module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// `x → gather → ·s → H` — the input transform of a rotated linear layer.
    Forward,
    /// `x → H → ·s` — undoes an inverse-rotated embedding row.
    Inverse,
}

pub use crate::element::Element;

/// A validated transform over rows of `width` values: block size, optional signs, optional gather.
#[derive(Clone, Debug)]
pub struct Transform<'a> {
    width: usize,
    block_size: usize,
    direction: Direction,
    signs: Option<&'a [f32]>,
    gather: Option<&'a [u32]>,
    norm: f32,
}

impl<'a> Transform<'a> {
    /// Validate everything once: `block_size` a power of two in `1..=MAX_BLOCK_SIZE` dividing `width`,
    /// `signs` of length `width` holding only ±1, `gather` (Forward only) a permutation of `0..width`.
    pub fn new(
        width: usize,
        block_size: usize,
        direction: Direction,
        signs: Option<&'a [f32]>,
        gather: Option<&'a [u32]>,
    ) -> Result<Self> {
        if block_size == 0 || !block_size.is_power_of_two() || block_size > MAX_BLOCK_SIZE {
            return Err(Error::invalid(format!(
                "hadamard block size {block_size} must be a power of two in 1..={MAX_BLOCK_SIZE}"
            )));
        }
        if width == 0 || !width.is_multiple_of(block_size) {
            return Err(Error::invalid(format!(
                "hadamard row width {width} is not a positive multiple of the block size {block_size}"
            )));
        }
        if let Some(s) = signs {
            if s.len() != width {
                return Err(Error::invalid(format!(
                    "hadamard sign vector has {} entries, row width is {width}",
                    s.len()
                )));
            }
            // Checked on every call, so it must be cheap: `all` stops at the first offender and so
            // never vectorized (half of a 17408-wide M = 1 transform's time went here). A fold over
            // 256-value chunks without an early exit vectorizes; the offenders are only counted on failure.
            let not_sign = |v: f32| (v.to_bits() & 0x7FFF_FFFF) != 0x3F80_0000; // |v| != 1.0 bitwise
            if s.chunks(256)
                .any(|c| c.iter().fold(false, |bad, &v| bad | not_sign(v)))
            {
                let bad: Vec<usize> = (0..s.len()).filter(|&i| not_sign(s[i])).collect();
                let first = bad[0];
                return Err(Error::validation(
                    "hadamard signs",
                    format!("sign value {} is not +1 or -1", s[first]),
                    first as u64,
                    bad.len() as u64,
                ));
            }
        }
        if let Some(g) = gather {
            if direction != Direction::Forward {
                return Err(Error::invalid(
                    "a gather permutation applies only to the forward (activation) transform",
                ));
            }
            if g.len() != width {
                return Err(Error::invalid(format!(
                    "hadamard gather permutation has {} entries, row width is {width}",
                    g.len()
                )));
            }
            let mut seen = vec![false; width];
            for (i, &src) in g.iter().enumerate() {
                let src = src as usize;
                if src >= width || seen[src] {
                    return Err(Error::validation(
                        "hadamard gather permutation",
                        format!("entry {src} is out of range or repeated (not a permutation of 0..{width})"),
                        i as u64,
                        1,
                    ));
                }
                seen[src] = true;
            }
        }
        Ok(Self {
            width,
            block_size,
            direction,
            signs,
            gather,
            norm: 1.0 / (block_size as f32).sqrt(),
        })
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// Transform every row of `input` (row-major, `rows × width`) into `output` (same shape), many
    /// rows on the ternary-rs rayon pool.
    pub fn apply<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.apply_on(input, output, &Rayon)
    }

    /// [`Transform::apply`] with many rows split over `par`.
    pub fn apply_on<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        par: &dyn ParallelFor,
    ) -> Result<()> {
        if input.len() != output.len() || !input.len().is_multiple_of(self.width) {
            return Err(Error::invalid(format!(
                "hadamard input has {} values and output {}; both must be the same multiple of the row width {}",
                input.len(),
                output.len(),
                self.width
            )));
        }
        let rows = input.len() / self.width;
        let threads = par.threads().max(1);
        if input.len() < PARALLEL_MIN_ELEMENTS || threads == 1 || rows < 2 {
            let mut scratch = vec![0f32; self.width];
            for (src, dst) in input
                .chunks_exact(self.width)
                .zip(output.chunks_exact_mut(self.width))
            {
                self.row(src, dst, &mut scratch);
            }
            return Ok(());
        }
        // A few tasks per thread, each with one scratch row.
        let per_task = rows.div_ceil(4 * threads);
        let out = DisjointWrites::new(output);
        let w = self.width;
        par.run(rows.div_ceil(per_task), &|tasks| {
            let mut scratch = vec![0f32; w];
            for r in tasks.start * per_task..(tasks.end * per_task).min(rows) {
                // SAFETY: `output` has rows · w elements; each row is written by one task only.
                let dst = unsafe { out.slice(r * w, w) };
                self.row(&input[r * w..(r + 1) * w], dst, &mut scratch);
            }
        });
        Ok(())
    }

    /// One row: load into `scratch`, transform, store — the same source built for the widest vector ISA
    /// the CPU has (the row's loads and stores are a third of a decode-size transform; in the baseline
    /// build they ran four floats at a time). Only additions, subtractions and exact multiplications
    /// by ±1 and the one normalization product: every build gives the same bits.
    #[inline]
    fn row<T: Element>(&self, src: &[T], dst: &mut [T], scratch: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::cpu_features::avx512bw_available() {
                // SAFETY: the CPU supports AVX-512 F + BW (checked just above).
                return unsafe { self.row_avx512(src, dst, scratch) };
            }
            if crate::cpu_features::avx2_available() {
                // SAFETY: the CPU supports AVX2 (checked just above).
                return unsafe { self.row_avx2(src, dst, scratch) };
            }
        }
        self.row_portable(src, dst, scratch)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn row_avx512<T: Element>(&self, src: &[T], dst: &mut [T], scratch: &mut [f32]) {
        self.row_portable(src, dst, scratch)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn row_avx2<T: Element>(&self, src: &[T], dst: &mut [T], scratch: &mut [f32]) {
        self.row_portable(src, dst, scratch)
    }

    #[inline(always)]
    fn row_portable<T: Element>(&self, src: &[T], dst: &mut [T], scratch: &mut [f32]) {
        // Load: gather and (Forward) signs fused with the dtype conversion.
        match (self.direction, self.gather, self.signs) {
            (Direction::Forward, Some(g), Some(s)) => {
                for ((o, &i), &si) in scratch.iter_mut().zip(g).zip(s) {
                    *o = src[i as usize].to_f32() * si;
                }
            }
            (Direction::Forward, Some(g), None) => {
                for (o, &i) in scratch.iter_mut().zip(g) {
                    *o = src[i as usize].to_f32();
                }
            }
            (Direction::Forward, None, Some(s)) => {
                for ((o, &v), &si) in scratch.iter_mut().zip(src).zip(s) {
                    *o = v.to_f32() * si;
                }
            }
            _ => {
                for (o, &v) in scratch.iter_mut().zip(src) {
                    *o = v.to_f32();
                }
            }
        }
        for block in scratch.chunks_exact_mut(self.block_size) {
            fwht_block(block);
        }
        // Store: normalization and (Inverse) signs fused with the dtype conversion.
        let norm = self.norm;
        match (self.direction, self.signs) {
            (Direction::Inverse, Some(s)) => {
                for ((o, &v), &si) in dst.iter_mut().zip(scratch.iter()).zip(s) {
                    *o = T::from_f32(v * norm * si);
                }
            }
            _ => {
                for (o, &v) in dst.iter_mut().zip(scratch.iter()) {
                    *o = T::from_f32(v * norm);
                }
            }
        }
    }
}

/// Unnormalized Sylvester–Hadamard transform of one block in place (textbook butterfly; the reference).
/// `block.len()` must be a power of two.
pub fn fwht_block_reference(block: &mut [f32]) {
    let n = block.len();
    let mut h = 1;
    while h < n {
        let mut i = 0;
        while i < n {
            for j in i..i + h {
                let a = block[j];
                let b = block[j + h];
                block[j] = a + b;
                block[j + h] = a - b;
            }
            i += 2 * h;
        }
        h *= 2;
    }
}

/// Fast unnormalized transform of one block in place; bit-identical to [`fwht_block_reference`].
///
/// Inlined into [`Transform`]'s row, which is built for the CPU's widest vectors; the butterflies are only
/// additions and subtractions, so every build gives the same bits.
#[inline(always)]
pub fn fwht_block(block: &mut [f32]) {
    let n = block.len();
    if n < 8 {
        fwht_block_reference(block);
        return;
    }
    // Stages h = 1, 2, 4 fused per 8 contiguous values (same pairs, same order as the reference).
    for c in block.chunks_exact_mut(8) {
        let (a0, a1) = (c[0] + c[1], c[0] - c[1]);
        let (a2, a3) = (c[2] + c[3], c[2] - c[3]);
        let (a4, a5) = (c[4] + c[5], c[4] - c[5]);
        let (a6, a7) = (c[6] + c[7], c[6] - c[7]);
        let (b0, b2) = (a0 + a2, a0 - a2);
        let (b1, b3) = (a1 + a3, a1 - a3);
        let (b4, b6) = (a4 + a6, a4 - a6);
        let (b5, b7) = (a5 + a7, a5 - a7);
        c[0] = b0 + b4;
        c[4] = b0 - b4;
        c[1] = b1 + b5;
        c[5] = b1 - b5;
        c[2] = b2 + b6;
        c[6] = b2 - b6;
        c[3] = b3 + b7;
        c[7] = b3 - b7;
    }
    // Remaining stages: contiguous halves, which the compiler vectorizes.
    let mut h = 8;
    while h < n {
        for pair in block.chunks_exact_mut(2 * h) {
            let (lo, hi) = pair.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        h *= 2;
    }
}

/// Convenience: transform `rows × width` values of `T` in place semantics (`input` → `output`).
pub fn fwht_rows<T: Element>(
    input: &[T],
    output: &mut [T],
    width: usize,
    block_size: usize,
    direction: Direction,
    signs: Option<&[f32]>,
    gather: Option<&[u32]>,
) -> Result<()> {
    Transform::new(width, block_size, direction, signs, gather)?.apply(input, output)
}

/// The GDN value-head permutation of Prism `qwen35` files: a row laid out "tiled" as `[rep, nk, unit]`
/// becomes "grouped" `[nk, rep, unit]`. Returned as a gather: `grouped[i] = tiled[perm[i]]`
/// (= `arange(nv·unit).reshape(rep, nk, unit).transpose(1, 0, 2).ravel()`, docs/formats.md#gdn-head-order).
pub fn gdn_tiled_to_grouped(
    num_v_heads: usize,
    num_k_heads: usize,
    unit: usize,
) -> Result<Vec<u32>> {
    if num_k_heads == 0 || !num_v_heads.is_multiple_of(num_k_heads) || unit == 0 {
        return Err(Error::invalid(format!(
            "GDN permutation needs value heads ({num_v_heads}) to be a multiple of key heads ({num_k_heads}) and a head dim > 0"
        )));
    }
    let total = num_v_heads
        .checked_mul(unit)
        .filter(|&t| t <= u32::MAX as usize)
        .ok_or_else(|| Error::invalid("GDN permutation size overflows u32"))?;
    let rep = num_v_heads / num_k_heads;
    let mut perm = Vec::with_capacity(total);
    for k in 0..num_k_heads {
        for r in 0..rep {
            let base = (r * num_k_heads + k) * unit;
            perm.extend((base..base + unit).map(|v| v as u32));
        }
    }
    Ok(perm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
    use proptest::prelude::*;

    /// Dense Sylvester matrix entry: H[i][j] = (-1)^popcount(i & j).
    fn dense_transform(x: &[f64], block: usize) -> Vec<f64> {
        let mut out = vec![0f64; x.len()];
        for (b, chunk) in x.chunks(block).enumerate() {
            for i in 0..block {
                let mut acc = 0f64;
                for (j, &v) in chunk.iter().enumerate() {
                    let sign = if (i & j).count_ones() % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    };
                    acc += sign * v;
                }
                out[b * block + i] = acc / (block as f64).sqrt();
            }
        }
        out
    }

    fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_dense_hadamard() {
        for &(width, block) in &[
            (8, 8),
            (64, 16),
            (256, 128),
            (2048, 1024),
            (12, 4),
            (6, 2),
            (5, 1),
        ] {
            let x = lcg(width as u64, width);
            let mut y = vec![0f32; width];
            fwht_rows(&x, &mut y, width, block, Direction::Forward, None, None).unwrap();
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let want = dense_transform(&x64, block);
            for (a, b) in y.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-4, "{width}/{block}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn signs_gather_and_inverse_order() {
        let width = 32;
        let block = 16;
        let x = lcg(7, width);
        let signs: Vec<f32> = (0..width)
            .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        let gather: Vec<u32> = (0..width as u32).rev().collect();
        let mut y = vec![0f32; width];
        fwht_rows(
            &x,
            &mut y,
            width,
            block,
            Direction::Forward,
            Some(&signs),
            Some(&gather),
        )
        .unwrap();
        let pre: Vec<f64> = (0..width)
            .map(|i| x[gather[i] as usize] as f64 * signs[i] as f64)
            .collect();
        let want = dense_transform(&pre, block);
        for (a, b) in y.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5);
        }
        // Inverse: WHT first, then signs; and it undoes Forward (H·D·D·H = I).
        let mut back = vec![0f32; width];
        fwht_rows(
            &y,
            &mut back,
            width,
            block,
            Direction::Inverse,
            Some(&signs),
            None,
        )
        .unwrap();
        for i in 0..width {
            assert!((back[i] - x[gather[i] as usize]).abs() < 1e-5);
        }
    }

    #[test]
    fn half_types_round_trip() {
        let width = 2048;
        let x = lcg(3, width * 3);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let mut yb = vec![bf16::ZERO; xb.len()];
        let mut yh = vec![f16::ZERO; xh.len()];
        fwht_rows(&xb, &mut yb, width, 1024, Direction::Forward, None, None).unwrap();
        fwht_rows(&xh, &mut yh, width, 1024, Direction::Forward, None, None).unwrap();
        let mut rb = vec![bf16::ZERO; xb.len()];
        fwht_rows(&yb, &mut rb, width, 1024, Direction::Forward, None, None).unwrap();
        for (a, b) in rb.iter().zip(&xb) {
            assert!((a.to_f32() - b.to_f32()).abs() < 2e-2);
        }
        let xf: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        let mut yf = vec![0f32; xf.len()];
        fwht_rows(&xf, &mut yf, width, 1024, Direction::Forward, None, None).unwrap();
        for (a, b) in yh.iter().zip(&yf) {
            assert_eq!(*a, f16::from_f32(*b));
        }
    }

    #[test]
    fn rejects_bad_arguments() {
        let x = vec![0f32; 24];
        let mut y = vec![0f32; 24];
        assert!(fwht_rows(&x, &mut y, 24, 16, Direction::Forward, None, None).is_err());
        assert!(fwht_rows(&x, &mut y, 24, 3, Direction::Forward, None, None).is_err());
        assert!(fwht_rows(&x, &mut y, 24, 0, Direction::Forward, None, None).is_err());
        assert!(fwht_rows(&x, &mut y[..8], 8, 8, Direction::Forward, None, None).is_err());
        // One 8-wide row: signs that are not ±1 or too short, a gather that is no permutation, and a
        // gather on the inverse.
        let mut rejects = |direction, signs: Option<&[f32]>, gather: Option<&[u32]>| {
            fwht_rows(&x[..8], &mut y[..8], 8, 8, direction, signs, gather).is_err()
        };
        let bad_signs = vec![0.5f32; 8];
        assert!(rejects(Direction::Forward, Some(&bad_signs), None));
        let short = vec![1.0f32; 4];
        assert!(rejects(Direction::Forward, Some(&short), None));
        // The bitwise sign check: exactly ±1.0 passes; ±0, NaN, ±inf and near-ones fail, also as the
        // only offender far into a long vector (past the first 256-value chunk).
        let w = 1024;
        let (xl, mut yl) = (vec![0f32; w], vec![0f32; w]);
        let mut signs: Vec<f32> = (0..w)
            .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        assert!(fwht_rows(&xl, &mut yl, w, 256, Direction::Forward, Some(&signs), None).is_ok());
        for bad in [
            0.0f32,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            1.0 + f32::EPSILON,
            -0.999_999_9,
        ] {
            signs[777] = bad;
            let err = fwht_rows(&xl, &mut yl, w, 256, Direction::Forward, Some(&signs), None);
            assert!(err.is_err(), "sign {bad} accepted");
            signs[777] = 1.0;
        }
        let dup: Vec<u32> = vec![0, 0, 1, 2, 3, 4, 5, 6];
        assert!(rejects(Direction::Forward, None, Some(&dup)));
        let oob: Vec<u32> = vec![8, 1, 2, 3, 4, 5, 6, 7];
        assert!(rejects(Direction::Forward, None, Some(&oob)));
        let id: Vec<u32> = (0..8).collect();
        assert!(rejects(Direction::Inverse, None, Some(&id)));
    }

    #[test]
    fn gdn_permutation_matches_reshape_transpose() {
        // nv = 6, nk = 2 (rep = 3), unit = 2: tiled head h = r*nk + k, grouped head = k*rep + r.
        let p = gdn_tiled_to_grouped(6, 2, 2).unwrap();
        assert_eq!(p, vec![0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]);
        assert!(gdn_tiled_to_grouped(5, 2, 2).is_err());
    }

    #[test]
    fn many_rows_parallel_equals_serial() {
        let width = 1024;
        let rows = 64;
        let x = lcg(11, width * rows);
        let signs: Vec<f32> = lcg(12, width)
            .iter()
            .map(|&v| if v < 0.0 { -1.0 } else { 1.0 })
            .collect();
        let mut all = vec![0f32; x.len()];
        fwht_rows(
            &x,
            &mut all,
            width,
            256,
            Direction::Forward,
            Some(&signs),
            None,
        )
        .unwrap();
        for r in 0..rows {
            let mut one = vec![0f32; width];
            let src = &x[r * width..(r + 1) * width];
            fwht_rows(
                src,
                &mut one,
                width,
                256,
                Direction::Forward,
                Some(&signs),
                None,
            )
            .unwrap();
            assert_eq!(&all[r * width..(r + 1) * width], &one[..]);
        }
    }

    /// Every build of a row (baseline, AVX2, AVX-512 where the CPU has them) against the baseline one,
    /// bit for bit, for each element type, direction, signs and gather; values include ±0, subnormal,
    /// huge, infinite and NaN inputs (NaN payloads and bf16 / f16 rounding go through every store).
    fn rows_of_every_build_match<T: Element>(x: &[f32], block: usize) {
        let width = x.len();
        let src: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
        let signs: Vec<f32> = (0..width)
            .map(|i| if i % 3 == 1 { -1.0 } else { 1.0 })
            .collect();
        let gather: Vec<u32> = (0..width as u32)
            .map(|i| (i * 7 + 3) % width as u32)
            .collect();
        for (direction, signs, gather) in [
            (Direction::Forward, Some(&signs[..]), Some(&gather[..])),
            (Direction::Forward, None, Some(&gather[..])),
            (Direction::Forward, Some(&signs[..]), None),
            (Direction::Forward, None, None),
            (Direction::Inverse, Some(&signs[..]), None),
        ] {
            let t = Transform::new(width, block, direction, signs, gather).unwrap();
            let mut scratch = vec![0f32; width];
            let mut want = vec![T::from_f32(0.0); width];
            t.row_portable(&src, &mut want, &mut scratch);
            let mut builds: Vec<(&str, Vec<T>)> = Vec::new();
            #[cfg(target_arch = "x86_64")]
            {
                if crate::cpu_features::avx2_available() {
                    let mut y = vec![T::from_f32(0.0); width];
                    // SAFETY: AVX2 is present (checked just above).
                    unsafe { t.row_avx2(&src, &mut y, &mut scratch) };
                    builds.push(("avx2", y));
                }
                if crate::cpu_features::avx512bw_available() {
                    let mut y = vec![T::from_f32(0.0); width];
                    // SAFETY: AVX-512 F + BW are present (checked just above).
                    unsafe { t.row_avx512(&src, &mut y, &mut scratch) };
                    builds.push(("avx512", y));
                }
            }
            let mut y = vec![T::from_f32(0.0); width];
            t.row(&src, &mut y, &mut scratch);
            builds.push(("dispatched", y));
            for (name, y) in builds {
                // Widening is exact, so equal f32 bits are equal element bits (±0 and NaNs told apart).
                let same = y
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
                assert!(
                    same,
                    "{name} row differs from the baseline build ({direction:?})"
                );
            }
        }
    }

    #[test]
    fn every_row_build_gives_the_same_bits() {
        let width = 2048;
        let mut x = lcg(21, width);
        let specials = [
            0.0,
            -0.0,
            f32::MIN_POSITIVE / 4.0,
            -f32::MIN_POSITIVE / 3.0,
            3.0e38,
            -3.0e38,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            65504.0,
            1.0e-8,
        ];
        for (i, v) in specials.iter().enumerate() {
            x[i * 97 % width] = *v;
        }
        rows_of_every_build_match::<f32>(&x, 256);
        rows_of_every_build_match::<bf16>(&x, 256);
        rows_of_every_build_match::<f16>(&x, 256);
        // And finite values only (no NaN spreading through whole blocks).
        let finite = lcg(22, width);
        rows_of_every_build_match::<f32>(&finite, 256);
        rows_of_every_build_match::<bf16>(&finite, 256);
        rows_of_every_build_match::<f16>(&finite, 256);
    }

    proptest! {
        #[test]
        fn fast_block_is_bit_identical_to_reference(log_n in 0u32..12, seed in any::<u64>()) {
            let n = 1usize << log_n;
            let x = lcg(seed, n);
            let mut a = x.clone();
            let mut b = x;
            fwht_block(&mut a);
            fwht_block_reference(&mut b);
            prop_assert_eq!(a, b);
        }

        /// The builds of a row at every block size (the 8-point kernel, and the reference below 8).
        #[test]
        fn row_builds_agree_at_every_block_size(log_b in 0u32..12, blocks in 1usize..4, seed in any::<u64>()) {
            let b = 1usize << log_b;
            let x = lcg(seed, b * blocks);
            rows_of_every_build_match::<f32>(&x, b);
            rows_of_every_build_match::<bf16>(&x, b);
        }

        #[test]
        fn forward_then_forward_is_identity(log_b in 0u32..11, blocks in 1usize..4, seed in any::<u64>()) {
            let b = 1usize << log_b;
            let w = b * blocks;
            let x = lcg(seed, w);
            let mut y = vec![0f32; w];
            let mut z = vec![0f32; w];
            fwht_rows(&x, &mut y, w, b, Direction::Forward, None, None).unwrap();
            fwht_rows(&y, &mut z, w, b, Direction::Forward, None, None).unwrap();
            for (p, q) in z.iter().zip(&x) {
                prop_assert!((p - q).abs() < 1e-4);
            }
        }
    }
}
