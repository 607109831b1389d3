//! Dense half-precision linear layers: `y = x · Wᵀ (+ bias)` for bf16 or f16 `x`, `W` and `y`, with
//! f32 products and sums.
//!
//! A ternary checkpoint keeps some layers dense (BitNet's and Falcon3's embeddings and tied `lm_head`,
//! Qwen3.5's small `in_proj_ba`). On a CPU without native bf16 dot products (no AVX512_BF16 / AMX:
//! Zen 2/3, AVX2-only laptops, AVX-512 before Cooper Lake) vLLM's oneDNN path refuses bf16 and falls
//! back to torch's GEMM, which converts element by element: ~1 GB/s of weight from 4 tokens up (EPYC
//! Zen 2, 2 threads, 2048 → 151936 at 16 tokens: 627 ms per call, several whole decode steps). This
//! kernel streams the weight once per call and widens it in registers (bf16: a 16-bit shift; f16:
//! F16C): 21.6 ms at one token (93 % of the streaming bandwidth), 96.8 ms at 16 (`benches/bench_dense.py`).
//!
//! Sums: per (token, row), eight f32 lanes of fused multiply-adds over `k` in steps of 8, added in the
//! fixed tree `((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))`, then the `k % 8` tail by scalar fused
//! multiply-adds. [`reference`] is that order written plainly; the AVX2 variant matches it bit for
//! bit. Extra error vs float64: at most `k · 2⁻²³ · Σₖ |x_k · W[n,k]|` (f32 sums of exact products),
//! then the one rounding of y to the half type.

use half::{bf16, f16};

use super::Activation;
use crate::threads::{DisjointWrites, ParallelFor};
use crate::{Error, Result};

/// Rows per tile: four rows share each load of a token's activations.
const TILE_ROWS: usize = 4;
/// Tokens per tile: 4 rows × 2 tokens = 8 independent FMA chains in 16 ymm registers.
const TILE_TOKENS: usize = 2;
/// Tiles whose outputs are converted to the half type together.
const RUN_TILES: usize = 64;
/// A half-precision element type of the weight (and of x and y).
pub trait Half: Activation {
    fn to_f32(self) -> f32;
    /// Eight elements at `p`, widened.
    ///
    /// # Safety
    /// AVX2 (and F16C for f16) are available; `p .. p + 8` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Half for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: per the contract; bf16 is the top half of an f32.
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
}

impl Half for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: per the contract.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// Which implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfVariant {
    Scalar,
    Avx2,
}

impl HalfVariant {
    /// The fastest this CPU runs (AVX2 needs what the int8 AVX2 kernels need: AVX2, FMA, F16C).
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if super::avx2::is_supported() {
            return HalfVariant::Avx2;
        }
        HalfVariant::Scalar
    }

    pub fn is_supported(self) -> bool {
        self == HalfVariant::Scalar || Self::best() == HalfVariant::Avx2
    }
}

/// `y[t][r] = Σₖ x[t][k] · w[r][k] (+ bias[r])` for `x [m, k]`, `w [n, k]`, `y [m, n]`, all row-major;
/// rows split over `pool`.
#[allow(clippy::too_many_arguments)]
pub fn linear<T: Half>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    y: &mut [T],
    m: usize,
    n: usize,
    k: usize,
    variant: HalfVariant,
    pool: &dyn ParallelFor,
) -> Result<()> {
    let sizes = |a: usize, b: usize, what: &str| {
        a.checked_mul(b)
            .ok_or_else(|| Error::invalid(format!("half_linear: {what} size overflows")))
    };
    let (xn, wn, yn) = (sizes(m, k, "x")?, sizes(n, k, "weight")?, sizes(m, n, "y")?);
    if x.len() != xn || w.len() != wn || y.len() != yn {
        return Err(Error::invalid(format!(
            "half_linear: x has {} elements, weight {}, y {}; [{m}, {k}] x [{n}, {k}] needs {xn}, {wn}, {yn}",
            x.len(),
            w.len(),
            y.len()
        )));
    }
    if bias.is_some_and(|b| b.len() != n) {
        return Err(Error::invalid(format!(
            "half_linear: bias must have {n} elements"
        )));
    }
    if !variant.is_supported() {
        return Err(Error::invalid(format!(
            "half_linear: the {variant:?} kernel needs CPU features this machine lacks"
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let mut xf = vec![0f32; xn];
    T::to_f32_slice(x, &mut xf);
    let bias: Option<Vec<f32>> = bias.map(|b| b.iter().map(|v| v.to_f32()).collect());
    let tiles = n.div_ceil(TILE_ROWS);
    // Each task writes only its own tiles' elements.
    let y_at = DisjointWrites::new(y);
    let job = |range: std::ops::Range<usize>| {
        let mut sums = vec![0f32; m * TILE_ROWS];
        // A run of tiles' outputs per token, converted to T in one call per token and run (one call per
        // element cost as much as the products at many tokens).
        let run_rows = RUN_TILES * TILE_ROWS;
        let mut run = vec![0f32; m * run_rows];
        for first in range.clone().step_by(RUN_TILES) {
            let last = (first + RUN_TILES).min(range.end);
            let (n0, n1) = (first * TILE_ROWS, (last * TILE_ROWS).min(n));
            for tile in first..last {
                let r0 = tile * TILE_ROWS;
                let rows = TILE_ROWS.min(n - r0);
                // Rows past n repeat the last one (their sums are dropped).
                let ws: [&[T]; TILE_ROWS] = std::array::from_fn(|r| {
                    let r = r0 + r.min(rows - 1);
                    &w[r * k..(r + 1) * k]
                });
                tile_sums(&xf, ws, m, k, variant, &mut sums);
                for t in 0..m {
                    for r in 0..rows {
                        let b = bias.as_ref().map_or(0.0, |b| b[r0 + r]);
                        run[t * run_rows + r0 - n0 + r] = sums[t * TILE_ROWS + r] + b;
                    }
                }
            }
            for t in 0..m {
                // SAFETY: tile ranges are disjoint, so y[t][n0..n1] is written by this task only, and
                // it lies inside y's m·n elements (t < m, n1 <= n).
                let dst = unsafe { y_at.slice(t * n + n0, n1 - n0) };
                T::from_f32_slice(&run[t * run_rows..][..n1 - n0], dst);
            }
        }
    };
    super::split_units(tiles, TILE_ROWS * k, m, pool, &job);
    Ok(())
}

/// `sums[t · 4 + r] = Σₖ xf[t][k] · ws[r][k]` for every token t.
fn tile_sums<T: Half>(
    xf: &[f32],
    ws: [&[T]; TILE_ROWS],
    m: usize,
    k: usize,
    variant: HalfVariant,
    sums: &mut [f32],
) {
    let mut t = 0;
    while t < m {
        let tokens = TILE_TOKENS.min(m - t);
        let xs: [&[f32]; TILE_TOKENS] =
            std::array::from_fn(|i| &xf[(t + i.min(tokens - 1)) * k..][..k]);
        let out = match variant {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `linear` checked the variant is supported.
            HalfVariant::Avx2 => unsafe {
                if tokens == 2 {
                    avx2::tile::<T, 2>(xs, ws)
                } else {
                    let one = avx2::tile::<T, 1>([xs[0]], ws);
                    [one[0], [0.0; TILE_ROWS]]
                }
            },
            _ => reference(xs, ws),
        };
        for i in 0..tokens {
            sums[(t + i) * TILE_ROWS..][..TILE_ROWS].copy_from_slice(&out[i]);
        }
        t += tokens;
    }
}

/// The summation order every variant follows, plainly: eight lanes of fused multiply-adds, the fixed
/// lane tree, then the tail.
pub fn reference<T: Half, const N: usize>(
    xs: [&[f32]; N],
    ws: [&[T]; TILE_ROWS],
) -> [[f32; TILE_ROWS]; N] {
    let mut out = [[0f32; TILE_ROWS]; N];
    for (t, x) in xs.iter().enumerate() {
        for (r, w) in ws.iter().enumerate() {
            let k = x.len().min(w.len());
            let body = k - k % 8;
            let mut l = [0f32; 8];
            for c in (0..body).step_by(8) {
                for j in 0..8 {
                    l[j] = x[c + j].mul_add(w[c + j].to_f32(), l[j]);
                }
            }
            let a = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
            let mut s = (a[0] + a[2]) + (a[1] + a[3]);
            for c in body..k {
                s = x[c].mul_add(w[c].to_f32(), s);
            }
            out[t][r] = s;
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::avx2::hsum;
    use super::{Half, TILE_ROWS};

    /// # Safety
    /// AVX2, FMA and F16C are available; every slice has the same length.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<T: Half, const N: usize>(
        xs: [&[f32]; N],
        ws: [&[T]; TILE_ROWS],
    ) -> [[f32; TILE_ROWS]; N] {
        let k = xs[0].len();
        assert!(xs.iter().all(|x| x.len() == k) && ws.iter().all(|w| w.len() == k));
        let body = k - k % 8;
        let mut out = [[0f32; TILE_ROWS]; N];
        // SAFETY: c + 8 <= body <= k for every slice (asserted equal lengths).
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); TILE_ROWS]; N];
            for c in (0..body).step_by(8) {
                // Plain loops, not `array::from_fn`: a closure does not inherit the target features,
                // and the intrinsics inside it would become calls.
                let mut w = [_mm256_setzero_ps(); TILE_ROWS];
                for r in 0..TILE_ROWS {
                    w[r] = T::load8(ws[r].as_ptr().add(c));
                }
                for t in 0..N {
                    let x = _mm256_loadu_ps(xs[t].as_ptr().add(c));
                    for r in 0..TILE_ROWS {
                        acc[t][r] = _mm256_fmadd_ps(x, w[r], acc[t][r]);
                    }
                }
            }
            for t in 0..N {
                for r in 0..TILE_ROWS {
                    let mut s = hsum(acc[t][r]);
                    for c in body..k {
                        s = xs[t][c].mul_add(ws[r][c].to_f32(), s);
                    }
                    out[t][r] = s;
                }
            }
        }
        out
    }

    #[cfg(test)]
    pub(super) fn tile_for_test<T: Half, const N: usize>(
        xs: [&[f32]; N],
        ws: [&[T]; TILE_ROWS],
    ) -> [[f32; TILE_ROWS]; N] {
        // SAFETY: the tests call this only when the variant is supported.
        unsafe { tile::<T, N>(xs, ws) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads::{Rayon, Serial};

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn data<T: Half>(len: usize, seed: u64, scale: f32) -> Vec<T> {
        let mut s = seed;
        let f: Vec<f32> = (0..len).map(|_| lcg(&mut s) * scale).collect();
        let mut out = vec![T::default(); len];
        T::from_f32_slice(&f, &mut out);
        out
    }

    /// Float64 products and sums, the bound of the module docs, for every variant and shape.
    fn check<T: Half>(m: usize, n: usize, k: usize, with_bias: bool, variant: HalfVariant) {
        let x = data::<T>(m * k, 1 + m as u64, 3.0);
        let w = data::<T>(n * k, 2 + n as u64, 0.05);
        let b = data::<T>(n, 3, 1.0);
        let bias = with_bias.then_some(&b[..]);
        let mut y = vec![T::default(); m * n];
        let mut y_serial = vec![T::default(); m * n];
        linear(&x, &w, bias, &mut y, m, n, k, variant, &Rayon).unwrap();
        linear(&x, &w, bias, &mut y_serial, m, n, k, variant, &Serial).unwrap();
        assert!(
            y.iter()
                .zip(&y_serial)
                .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
            "threads change the result"
        );
        for t in 0..m {
            for r in 0..n {
                let (mut exact, mut mass) = (0f64, 0f64);
                for c in 0..k {
                    let p = x[t * k + c].to_f32() as f64 * w[r * k + c].to_f32() as f64;
                    exact += p;
                    mass += p.abs();
                }
                if let Some(b) = bias {
                    exact += b[r].to_f32() as f64;
                    mass += b[r].to_f32().abs() as f64;
                }
                let got = y[t * n + r].to_f32() as f64;
                // f32 sums, then one rounding to the half type (at most 2⁻⁸ relative for bf16 and
                // f16 alike; f16's subnormals: an absolute 2⁻²⁴).
                let sum_bound = (k + 2) as f64 * 2f64.powi(-23) * mass;
                let bound = sum_bound + (exact.abs() + sum_bound) * 2f64.powi(-8) + 2f64.powi(-24);
                assert!(
                    (got - exact).abs() <= bound,
                    "{variant:?} m={m} n={n} k={k} t={t} r={r}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn matches_float64_over_shapes() {
        let variants = [HalfVariant::Scalar, HalfVariant::best()];
        for variant in variants {
            for (m, n, k) in [
                (1, 1, 1),
                (1, 5, 7),
                (2, 4, 8),
                (3, 9, 17),
                (5, 13, 64),
                (1, 130, 256),
                (17, 33, 100),
                (16, 1027, 520),
            ] {
                check::<bf16>(m, n, k, false, variant);
                check::<bf16>(m, n, k, true, variant);
                check::<f16>(m, n, k, true, variant);
            }
        }
    }

    #[test]
    fn avx2_matches_the_reference_bit_for_bit() {
        if HalfVariant::best() != HalfVariant::Avx2 {
            return; // nothing but the reference on this CPU
        }
        for k in [1, 7, 8, 9, 31, 64, 1000, 2051] {
            let x1 = data::<bf16>(k, 5, 4.0);
            let x2 = data::<bf16>(k, 6, 4.0);
            let (mut f1, mut f2) = (vec![0f32; k], vec![0f32; k]);
            bf16::to_f32_slice(&x1, &mut f1);
            bf16::to_f32_slice(&x2, &mut f2);
            let wb: Vec<Vec<bf16>> = (0..4).map(|r| data::<bf16>(k, 10 + r, 0.1)).collect();
            let wh: Vec<Vec<f16>> = (0..4).map(|r| data::<f16>(k, 20 + r, 0.1)).collect();
            let wbs: [&[bf16]; 4] = std::array::from_fn(|r| &wb[r][..]);
            let whs: [&[f16]; 4] = std::array::from_fn(|r| &wh[r][..]);
            let bits = |a: [[f32; 4]; 2]| a.map(|row| row.map(f32::to_bits));
            assert_eq!(
                bits(avx2::tile_for_test([&f1[..], &f2[..]], wbs)),
                bits(reference([&f1[..], &f2[..]], wbs)),
                "bf16 k={k}"
            );
            assert_eq!(
                bits(avx2::tile_for_test([&f1[..], &f2[..]], whs)),
                bits(reference([&f1[..], &f2[..]], whs)),
                "f16 k={k}"
            );
            assert_eq!(
                avx2::tile_for_test([&f1[..]], wbs)[0].map(f32::to_bits),
                reference([&f1[..]], wbs)[0].map(f32::to_bits),
                "one token, k={k}"
            );
        }
    }

    #[test]
    fn refuses_mismatched_sizes() {
        let (x, w, b) = (
            vec![bf16::ZERO; 6],
            vec![bf16::ZERO; 12],
            vec![bf16::ZERO; 3],
        );
        let mut y = vec![bf16::ZERO; 7]; // [2, 3] x [4, 3] gives 8
        let e = linear(&x, &w, None, &mut y, 2, 4, 3, HalfVariant::Scalar, &Serial).unwrap_err();
        assert!(
            e.to_string().contains("y 7") && e.to_string().contains("needs 6, 12, 8"),
            "{e}"
        );
        let mut y = vec![bf16::ZERO; 8];
        let e = linear(
            &x,
            &w,
            Some(&b),
            &mut y,
            2,
            4,
            3,
            HalfVariant::Scalar,
            &Serial,
        )
        .unwrap_err();
        assert!(e.to_string().contains("bias must have 4"), "{e}");
        linear(&x, &w, None, &mut y, 2, 4, 3, HalfVariant::Scalar, &Serial).unwrap();
    }
}
