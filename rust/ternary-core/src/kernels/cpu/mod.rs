//! Fused ternary GEMV/GEMM on the CPU: `y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias)`, never materialising W.
//!
//! * Weights are first permuted once into sign bit-planes ([`layout`]); scales stay f16 `[N, K/g]`.
//! * Three variants with the same contract, picked at run time ([`Variant::best`]) or forced by name:
//!   [`Variant::Avx512`] (mask registers; VNNI for the int8 mode), [`Variant::Avx2`] and the portable
//!   [`Variant::Scalar`] reference every fast path is tested against.
//! * Two activation modes ([`Precision`]):
//!   - `Exact` (default): x is converted to f32 (lossless for bf16/fp16/fp32), each product `t·x` is
//!     exact, sums are **f32 accumulations** — per group `Σ t·x`, then `× scale` and accumulated over
//!     groups (the GEMM path multiplies the scale into the decoded weight first, `x · (t·s)`, which is
//!     also exact per product). Error vs float64: `|y − y64| ≤ K · 2⁻²³ · Σₖ |x_k · W[n,k]|` (in practice
//!     far smaller), plus one rounding to the output dtype.
//!   - `Int8` (opt-in): x is quantized per row (per token) to int8 with `xs = max|x| / 127`, integer
//!     dot products per group (VNNI `vpdpbusd` on AVX-512), then `× scale × xs` in f32. Extra error vs
//!     float64: `≤ xs / 2 · Σₖ |W[n,k]|` (each x moves by at most half a quantization step).
//!   - bf16 activations on CPUs with AVX512_BF16 take a `vdpbf16ps` GEMV (exact products, f32 sums;
//!     the instruction treats subnormal inputs/results as zero, i.e. |x| < 2⁻¹²⁶ counts as 0).
//! * Shapes: M < [`GEMM_MIN_M`] streams the bit-planes once per block of [`ROWS`] rows and applies
//!   them to every x row while they sit in L1 (the GEMV path; at M = 1 its cost is the mask loads and
//!   masked adds, two of each per 16 weights); larger M decodes a tile of [`TILE_ROWS`] × [`TILE_K`]
//!   weights to f32 once and runs a 4 × 4 FMA micro-kernel over all x rows.
//! * Threads: work is split over N on the ternary-rs pool (`crate::threads`), only when the weight is
//!   large enough to amortise the fork ([`PARALLEL_MIN_WEIGHTS`]).

pub mod layout;
mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

use crate::canonical::check_shape;
use crate::{Error, Result};

/// Rows one GEMV call handles together (their x loads are shared).
pub const ROWS: usize = 4;
/// Below this many x rows the GEMV path is used; from here on weights are decoded once per tile.
/// Measured crossover: the GEMM path costs a fixed decode plus a 4-row micro-kernel (so M = 2..4
/// cost about the same), while the GEMV path costs one pass per x row; they meet near M = 3–4.
/// The int8 mode always uses the GEMV path (its integer dot products need no decode).
pub const GEMM_MIN_M: usize = 4;
/// Rows of W per GEMM tile (a tile is decoded to f32 once and reused for all M rows).
pub const TILE_ROWS: usize = 16;
/// Columns of W per GEMM tile: 16 rows × 512 × 4 B = 32 KiB of decoded weights, which stays in L1.
pub const TILE_K: usize = 512;
/// GEMM tiles per task: they share each K-slice of x while it is in L2.
pub const TILES_PER_TASK: usize = 8;
/// x rows per GEMM micro-kernel call.
pub(crate) const MICRO_M: usize = 4;
/// f32 lanes per GEMM accumulator (one AVX-512 register; narrower variants use a prefix).
pub(crate) const LANES: usize = 16;
/// Distance between the accumulators of consecutive x rows in the GEMM accumulator buffer.
pub(crate) const ACC_STRIDE: usize = TILE_ROWS * LANES;
/// Accumulator floats one micro-kernel call touches.
pub(crate) const ACC_WINDOW: usize = (MICRO_M - 1) * ACC_STRIDE + ROWS * LANES;
/// Below this many weights one thread does the whole product (forking costs more than it saves).
pub const PARALLEL_MIN_WEIGHTS: usize = 1 << 20;
/// Rows per parallel GEMV task (keeps a task's bit-planes streaming for a while).
const GEMV_ROWS_PER_TASK: usize = 64;

/// Largest |q| of the int8 activation quantization (symmetric; −128 is never used, so −q is int8 too).
pub const INT8_MAX: f32 = 127.0;

/// A kernel implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Scalar,
    Avx2,
    Avx512,
}

impl Variant {
    pub const ALL: [Variant; 3] = [Variant::Scalar, Variant::Avx2, Variant::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Scalar => "scalar",
            Variant::Avx2 => "avx2",
            Variant::Avx512 => "avx512",
        }
    }

    /// Parse a variant name; `"auto"` (or `""`) means [`Variant::best`].
    pub fn parse(name: &str) -> Result<Variant> {
        match name {
            "" | "auto" => Ok(Variant::best()),
            "scalar" => Ok(Variant::Scalar),
            "avx2" => Ok(Variant::Avx2),
            "avx512" => Ok(Variant::Avx512),
            other => Err(Error::invalid(format!(
                "unknown CPU kernel variant '{other}'; expected one of auto, scalar, avx2, avx512"
            ))),
        }
    }

    /// Whether this CPU can run the variant (detected at run time).
    pub fn is_supported(self) -> bool {
        match self {
            Variant::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Variant::Avx2 => avx2::is_supported(),
            #[cfg(target_arch = "x86_64")]
            Variant::Avx512 => avx512::is_supported(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest variant this CPU supports.
    pub fn best() -> Variant {
        [Variant::Avx512, Variant::Avx2]
            .into_iter()
            .find(|v| v.is_supported())
            .unwrap_or(Variant::Scalar)
    }

    fn kernels(self) -> Result<&'static Kernels> {
        if !self.is_supported() {
            return Err(Error::invalid(format!(
                "CPU kernel variant '{}' is not supported by this CPU (supported: {})",
                self.name(),
                Variant::ALL
                    .iter()
                    .filter(|v| v.is_supported())
                    .map(|v| v.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(match self {
            Variant::Scalar => &scalar::KERNELS,
            #[cfg(target_arch = "x86_64")]
            Variant::Avx2 => &avx2::KERNELS,
            #[cfg(target_arch = "x86_64")]
            Variant::Avx512 if avx512::has_bf16_dot() => &avx512::KERNELS_BF16,
            #[cfg(target_arch = "x86_64")]
            Variant::Avx512 => &avx512::KERNELS,
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("is_supported is false off x86-64"),
        })
    }
}

/// How activations enter the dot products (see the module docs for the error bounds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    Exact,
    Int8,
}

/// Activation element types: bf16, fp16, fp32 (x, bias and y share one).
pub trait Activation: Copy + Send + Sync + 'static {
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);
    /// The raw bits when the type is bf16 (the kernels' bf16 dot-product path takes them as is).
    fn bf16_bits(_src: &[Self]) -> Option<&[u16]> {
        None
    }
}

impl Activation for f32 {
    fn to_f32_slice(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn from_f32_slice(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Activation for f16 {
    fn to_f32_slice(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn from_f32_slice(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Activation for bf16 {
    fn to_f32_slice(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn from_f32_slice(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }
    fn bf16_bits(src: &[bf16]) -> Option<&[u16]> {
        Some(bytemuck::cast_slice(src))
    }
}

/// A weight in the kernel layout: bit-planes from [`layout::prepare`] and the canonical f16 scales.
#[derive(Clone, Copy, Debug)]
pub struct PreparedRef<'a> {
    pub rows: usize,
    pub cols: usize,
    pub group_size: usize,
    pub planes: &'a [u8],
    pub scales: &'a [f16],
}

impl PreparedRef<'_> {
    /// Check the shape and the buffer lengths against it.
    pub fn check(&self) -> Result<()> {
        check_shape(self.rows, self.cols, self.group_size)?;
        let planes = layout::prepared_bytes(self.rows, self.cols);
        let scales = self.rows.checked_mul(self.cols / self.group_size);
        if Some(self.planes.len()) != planes || Some(self.scales.len()) != scales {
            return Err(Error::invalid(format!(
                "prepared weight [{}, {}] g{} needs {:?} plane bytes and {:?} scales, got {} and {}",
                self.rows,
                self.cols,
                self.group_size,
                planes,
                scales,
                self.planes.len(),
                self.scales.len()
            )));
        }
        Ok(())
    }

    fn row(&self, n: usize) -> (&[u8], &[f16]) {
        let rb = layout::row_bytes(self.cols);
        let gs = self.cols / self.group_size;
        (
            &self.planes[n * rb..(n + 1) * rb],
            &self.scales[n * gs..(n + 1) * gs],
        )
    }

    /// Planes and scales of rows `n0 .. n0 + ROWS`, repeating the last row past the end (tail blocks).
    fn block(&self, n0: usize) -> RowBlock<'_> {
        let last = self.rows - 1;
        let rows: [(&[u8], &[f16]); ROWS] = std::array::from_fn(|r| self.row((n0 + r).min(last)));
        RowBlock {
            planes: rows.map(|r| r.0),
            scales: rows.map(|r| r.1),
        }
    }
}

/// [`ROWS`] rows of a prepared weight (each `planes[r]` is `row_bytes(K)` long, `scales[r]` is `K/g`).
pub(crate) struct RowBlock<'a> {
    pub planes: [&'a [u8]; ROWS],
    pub scales: [&'a [f16]; ROWS],
}

/// One variant's inner loops. Every slice argument is already bounds-checked by the caller; the
/// `unsafe` is only "this CPU has the variant's features" (guaranteed by [`Variant::kernels`]).
pub(crate) struct Kernels {
    /// `Σ_g s_g · Σ_{k∈g} t·x` for the block's rows; `x.len() ≥ padded_cols(K)` (zero padded), `g` the group.
    pub gemv_exact: unsafe fn(&RowBlock<'_>, &[f32], usize) -> [f32; ROWS],
    /// Same for bf16 activations given as raw bits (`x.len() ≥ padded_cols(K)`), where the variant has
    /// a bf16 dot-product instruction; otherwise bf16 goes through `gemv_exact` after widening.
    pub gemv_bf16: Option<GemvBf16>,
    /// `Σ_g s_g · Σ_{k∈g} t·q` (int sums, f32 combination); `q`, `neg_q` = −q, both `padded_cols(K)` long.
    pub gemv_int8: unsafe fn(&RowBlock<'_>, &[i8], &[i8], usize) -> [f32; ROWS],
    /// `out[j] = t[k0 + j] · s` for one row's planes/scales; `k0` and `out.len()` are multiples of 64.
    pub decode_row: unsafe fn(&[u8], &[f16], usize, usize, &mut [f32]),
    /// `acc[i · ACC_STRIDE + r · LANES + lane] += Σ_{j ≡ lane} x[i][j] · w[r][j]` (lane-partial sums)
    /// for a [`MICRO_M`] × [`ROWS`] block; every `x[i]`, `w[r]` is `kc` long (a multiple of 64) and
    /// `acc` is [`ACC_WINDOW`] long.
    pub micro: MicroKernel,
}

/// See [`Kernels::gemv_bf16`].
pub(crate) type GemvBf16 = unsafe fn(&RowBlock<'_>, &[u16], usize) -> [f32; ROWS];

/// See [`Kernels::micro`].
pub(crate) type MicroKernel = unsafe fn([&[f32]; MICRO_M], [&[f32]; ROWS], &mut [f32]);

/// Quantize one activation row to int8 (per-row scale). Returns `xs` with `x ≈ xs · q`. Shared by all
/// variants so their integer sums are identical.
pub fn quantize_row_int8(x: &[f32], q: &mut [i8], neg_q: &mut [i8]) -> f32 {
    // Not `f32::max`: it drops NaN, and a NaN activation must poison the row.
    let amax = x.iter().fold(0f32, |a, &v| {
        if v.is_nan() || v.abs() > a {
            v.abs()
        } else {
            a
        }
    });
    if amax.is_nan() || amax.is_infinite() {
        q.fill(0);
        neg_q.fill(0);
        return f32::NAN; // propagates: a non-finite activation gives a NaN row, as the exact path would
    }
    let inv = if amax > 0.0 { INT8_MAX / amax } else { 0.0 };
    for ((qv, nv), &v) in q.iter_mut().zip(neg_q.iter_mut()).zip(x) {
        let r = (v * inv).round().clamp(-INT8_MAX, INT8_MAX) as i8;
        *qv = r;
        *nv = -r;
    }
    amax / INT8_MAX
}

/// `y[M, N] = x[M, K] · Wᵀ + bias` with the given variant and precision.
///
/// `x` is `M·K` row-major, `y` is `M·N`, `bias` (if any) is `N`; all share the activation type.
pub fn gemm<T: Activation>(
    w: PreparedRef<'_>,
    x: &[T],
    m: usize,
    bias: Option<&[T]>,
    y: &mut [T],
    variant: Variant,
    precision: Precision,
) -> Result<()> {
    w.check()?;
    let (n, k) = (w.rows, w.cols);
    let x_len = m.checked_mul(k);
    let y_len = m.checked_mul(n);
    if Some(x.len()) != x_len || Some(y.len()) != y_len {
        return Err(Error::invalid(format!(
            "ternary GEMM [{m}, {k}] x [{n}, {k}]^T needs x of {x_len:?} and y of {y_len:?} elements, got {} and {}",
            x.len(),
            y.len()
        )));
    }
    if let Some(b) = bias {
        if b.len() != n {
            return Err(Error::invalid(format!(
                "bias has {} elements, expected out_features = {n}",
                b.len()
            )));
        }
    }
    let kernels = variant.kernels()?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let kpad = layout::padded_cols(k);
    // yt[n][m]: rows of W are the unit of parallel work, so each task owns a contiguous slice.
    let mut yt = vec![0f32; n * m];
    let parallel = n.saturating_mul(k) >= PARALLEL_MIN_WEIGHTS;
    let bf16_gemv = match (T::bf16_bits(x), kernels.gemv_bf16) {
        (Some(bits), Some(f)) if precision == Precision::Exact && m < GEMM_MIN_M => Some((bits, f)),
        _ => None,
    };
    if let Some((bits, gemv_bf16)) = bf16_gemv {
        let mut xb = vec![0u16; m * kpad]; // zero padded like xf below
        for (dst, src) in xb.chunks_exact_mut(kpad).zip(bits.chunks_exact(k)) {
            dst[..k].copy_from_slice(src);
        }
        gemv_blocks(&w, m, &mut yt, parallel, |block, mi| {
            // SAFETY: `kernels` comes from `Variant::kernels`, which checked the CPU features.
            unsafe { gemv_bf16(block, &xb[mi * kpad..(mi + 1) * kpad], w.group_size) }
        });
        return finish(&yt, m, n, bias, y);
    }
    // f32 copy of x, zero padded to whole chunks (the kernels read whole 64-column chunks).
    let mut xf = vec![0f32; m * kpad];
    for (dst, src) in xf.chunks_exact_mut(kpad).zip(x.chunks_exact(k)) {
        T::to_f32_slice(src, &mut dst[..k]);
    }
    match precision {
        Precision::Exact if m >= GEMM_MIN_M => gemm_tiles(kernels, &w, &xf, m, &mut yt, parallel),
        Precision::Exact => gemv_blocks(&w, m, &mut yt, parallel, |block, mi| {
            let xr = &xf[mi * kpad..(mi + 1) * kpad];
            // SAFETY: `kernels` comes from `Variant::kernels`, which checked the CPU features.
            unsafe { (kernels.gemv_exact)(block, xr, w.group_size) }
        }),
        Precision::Int8 => {
            let mut q = vec![0i8; m * kpad];
            let mut neg_q = vec![0i8; m * kpad];
            let xs: Vec<f32> = (0..m)
                .map(|mi| {
                    let r = mi * kpad..(mi + 1) * kpad;
                    quantize_row_int8(&xf[r.clone()], &mut q[r.clone()], &mut neg_q[r])
                })
                .collect();
            gemv_blocks(&w, m, &mut yt, parallel, |block, mi| {
                let r = mi * kpad..(mi + 1) * kpad;
                // SAFETY: as above.
                let sums =
                    unsafe { (kernels.gemv_int8)(block, &q[r.clone()], &neg_q[r], w.group_size) };
                sums.map(|s| s * xs[mi])
            })
        }
    }
    finish(&yt, m, n, bias, y)
}

/// Transpose `yt[n][m]` back to `y[M, N]`, add the bias in f32 and round once to the output type.
fn finish<T: Activation>(
    yt: &[f32],
    m: usize,
    n: usize,
    bias: Option<&[T]>,
    y: &mut [T],
) -> Result<()> {
    let mut bias_f = vec![0f32; n];
    if let Some(b) = bias {
        T::to_f32_slice(b, &mut bias_f);
    }
    if m == 1 {
        for (v, b) in bias_f.iter_mut().zip(yt) {
            *v += b;
        }
        T::from_f32_slice(&bias_f, y);
        return Ok(());
    }
    // Transpose in blocks of TRANSPOSE_BLOCK x rows, so the strided reads of yt stay in cache.
    const TRANSPOSE_BLOCK: usize = 16;
    let mut rows = vec![0f32; TRANSPOSE_BLOCK * n];
    for (bi, y_block) in y.chunks_mut(TRANSPOSE_BLOCK * n).enumerate() {
        let (m0, mb) = (bi * TRANSPOSE_BLOCK, y_block.len() / n);
        for j in 0..n {
            let src = &yt[j * m + m0..j * m + m0 + mb];
            for (i, &v) in src.iter().enumerate() {
                rows[i * n + j] = v + bias_f[j];
            }
        }
        T::from_f32_slice(&rows[..mb * n], y_block);
    }
    Ok(())
}

/// GEMV path: for each block of [`ROWS`] rows call `dot(block, mi)` for every x row `mi`, writing `yt[n][mi]`.
fn gemv_blocks<F>(w: &PreparedRef<'_>, m: usize, yt: &mut [f32], parallel: bool, dot: F)
where
    F: Fn(&RowBlock<'_>, usize) -> [f32; ROWS] + Sync,
{
    let run_block = |(bi, out): (usize, &mut [f32])| {
        let block = w.block(bi * ROWS);
        let rows_here = out.len() / m;
        for mi in 0..m {
            let sums = dot(&block, mi);
            for (r, &s) in sums.iter().take(rows_here).enumerate() {
                out[r * m + mi] = s;
            }
        }
    };
    if parallel {
        crate::threads::install(|| {
            yt.par_chunks_mut(ROWS * m)
                .enumerate()
                .with_min_len(GEMV_ROWS_PER_TASK / ROWS)
                .for_each(run_block)
        });
    } else {
        yt.chunks_mut(ROWS * m).enumerate().for_each(run_block);
    }
}

/// GEMM path: per tile of [`TILE_ROWS`] rows, decode [`TILE_K`] columns at a time to f32 (scale
/// applied) and run the micro-kernel over all x rows; lane-partial sums live in `acc` until the end.
fn gemm_tiles(
    kernels: &Kernels,
    w: &PreparedRef<'_>,
    xf: &[f32],
    m: usize,
    yt: &mut [f32],
    parallel: bool,
) {
    let kpad = layout::padded_cols(w.cols);
    // Accumulators of one tile: m rounded up to whole micro-kernel blocks (repeated tail rows
    // accumulate into slots never read).
    let tile_acc = m.div_ceil(MICRO_M) * MICRO_M * ACC_STRIDE;
    let task_rows = TILE_ROWS * TILES_PER_TASK;
    let run_task = |(ti, out): (usize, &mut [f32]), wbuf: &mut Vec<f32>, acc: &mut Vec<f32>| {
        let n0 = ti * task_rows;
        let rows_task = out.len() / m;
        let tiles = rows_task.div_ceil(TILE_ROWS);
        wbuf.clear();
        wbuf.resize(TILE_ROWS * TILE_K, 0.0);
        acc.clear();
        acc.resize(tiles * tile_acc, 0.0);
        // K outermost: the x columns k0..k0+kc of all M rows stay in L2 while every tile of the
        // task uses them (with x re-read per tile, large M streams x from L3 once per 16 rows).
        for k0 in (0..kpad).step_by(TILE_K) {
            let kc = TILE_K.min(kpad - k0);
            for t in 0..tiles {
                let rows_here = TILE_ROWS.min(rows_task - t * TILE_ROWS);
                for r in 0..rows_here {
                    let (planes, scales) = w.row(n0 + t * TILE_ROWS + r);
                    // SAFETY: CPU features checked by `Variant::kernels`; lengths are multiples of 64.
                    unsafe {
                        (kernels.decode_row)(
                            planes,
                            scales,
                            w.group_size,
                            k0,
                            &mut wbuf[r * TILE_K..r * TILE_K + kc],
                        )
                    };
                }
                // Rows past the end of a short tile feed accumulators nobody reads; keep them zero.
                wbuf[rows_here * TILE_K..].fill(0.0);
                let tacc = &mut acc[t * tile_acc..(t + 1) * tile_acc];
                for mi in (0..m).step_by(MICRO_M) {
                    let xs: [&[f32]; MICRO_M] = std::array::from_fn(|i| {
                        let row = (mi + i).min(m - 1);
                        &xf[row * kpad + k0..row * kpad + k0 + kc]
                    });
                    for r0 in (0..rows_here).step_by(ROWS) {
                        let ws: [&[f32]; ROWS] = std::array::from_fn(|r| {
                            &wbuf[(r0 + r) * TILE_K..(r0 + r) * TILE_K + kc]
                        });
                        let start = (mi * TILE_ROWS + r0) * LANES;
                        let window = &mut tacc[start..start + ACC_WINDOW];
                        // SAFETY: as above; every slice is kc long and the window spans MICRO_M strides.
                        unsafe { (kernels.micro)(xs, ws, window) };
                    }
                }
            }
        }
        for r in 0..rows_task {
            let (t, rt) = (r / TILE_ROWS, r % TILE_ROWS);
            for mi in 0..m {
                let lanes = &acc[t * tile_acc + (mi * TILE_ROWS + rt) * LANES..][..LANES];
                out[r * m + mi] = sum_lanes(lanes);
            }
        }
    };
    if parallel {
        crate::threads::install(|| {
            yt.par_chunks_mut(task_rows * m).enumerate().for_each_init(
                || (Vec::new(), Vec::new()),
                |(wbuf, acc), item| run_task(item, wbuf, acc),
            )
        });
    } else {
        let (mut wbuf, mut acc) = (Vec::new(), Vec::new());
        for item in yt.chunks_mut(task_rows * m).enumerate() {
            run_task(item, &mut wbuf, &mut acc);
        }
    }
}

/// Pairwise sum of 16 lane-partial sums (a fixed tree, so it vectorises and is deterministic).
#[inline]
fn sum_lanes(l: &[f32]) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let b: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
    (b[0] + b[2]) + (b[1] + b[3])
}

#[cfg(test)]
mod tests;
