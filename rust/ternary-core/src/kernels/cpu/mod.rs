//! Fused ternary GEMV/GEMM on the CPU: `y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias)`, never materialising W.
//!
//! * Weights are permuted once into the kernel layout ([`layout`]: 4 rows interleaved, 64-weight byte
//!   sub-vectors one shift + AND away); scales stay f16.
//! * Four variants with the same contract, picked at run time ([`Variant::best`]) or forced by name:
//!   [`Variant::Amx`] (the AVX-512 kernels, with AMX-INT8 tiles for the int8 modes from
//!   [`AMX_MIN_M`] tokens: [`amx`]), [`Variant::Avx512`] (VNNI `vpdpbusd`, `vdpbf16ps` where present),
//!   [`Variant::Avx2`] (`vpmaddubsw`) and the portable [`Variant::Scalar`] reference every fast path
//!   is tested against.
//! * Activation modes ([`Precision`]):
//!   - `Int8Group` (the default for bf16/fp16 activations, as in every fast ternary CPU kernel —
//!     llama.cpp's Q8_K, bitnet.cpp, ik_llama.cpp): x is quantized to int8 per token **and per weight
//!     group** (`xs = max|x_group| / 127`, round half to even), dot products are exact integer sums of
//!     `code · q`, combined in f32 as `Σ_g s_g · xs_g · Σ t·q`. Extra error vs float64: each x moves by at
//!     most `xs_g / 2`, so `|Δy| ≤ Σ_g xs_g / 2 · Σ_{k∈g} |W[n,k]|` — at least as tight as llama.cpp's
//!     Q8_K (one scale per 256 values; here one per g ≤ 256).
//!   - `Int8Token`: one scale per token, exactly BitNet b1.58's `activation_quant` (transformers'
//!     `BitLinear`): `scale = 127 / max(max|x|, 1e-5)`, `q = clamp(round_half_even(x · scale))`, then
//!     `y = Σ_g s_g · Σ t·q / scale`. The BitNet architecture always runs this mode.
//!   - `Exact` (the default for f32 activations): x in f32 (lossless for bf16/fp16/fp32), products `t·x`
//!     exact, sums f32 accumulations per group, then `× scale`. Error vs float64:
//!     `|y − y64| ≤ K · 2⁻²³ · Σₖ |x_k · W[n,k]|`, plus one rounding to the output dtype. bf16 x on
//!     CPUs with AVX512_BF16 takes `vdpbf16ps` (exact products, f32 sums; |x| < 2⁻¹²⁶ counts as 0).
//! * Shapes: the int8 modes run one kernel for every M (row blocks × token tiles of up to
//!   [`INT8_TILE`] tokens: each 64-byte weight load is unpacked once per tile), or from [`AMX_MIN_M`]
//!   tokens AMX tiles (32-row groups × 16-token tiles, 8-token ones up to 8 tokens); on AVX-512 from
//!   [`WIDE_MIN_M`] tokens (below [`AMX_MIN_M`] on AMX) the rows-in-lanes kernel [`wide`] (16 rows per
//!   vector, the weight decoded once per call, one epilogue per 16 rows × group × token). The exact mode streams
//!   row blocks per token below [`GEMM_MIN_M`] and decodes f32 tiles for an FMA micro-kernel above.
//! * Prefill: inside torch, bf16 activations in the default mode with `M ≥` [`dense::DENSE_MIN_M`]
//!   go to torch's own bf16 GEMM on row chunks decoded exactly to bf16 by [`dense`] — where torch's
//!   bf16 GEMM is native and the int8 path is neither AMX's nor the rows-in-lanes kernel on full-width
//!   512-bit units ([`dense::prefill_pays`]).
//! * Mixture-of-Experts layers: [`moe`] runs a layer's routed experts as two grouped GEMMs (pairs sorted
//!   by expert, activations quantized once per projection, few-token experts in one parallel region).
//! * Threads: row blocks are split over a [`ParallelFor`] (the ternary-rs rayon pool by default; torch's
//!   intra-op pool inside torch), only when the weight is large enough to amortise the fork
//!   ([`PARALLEL_MIN_WEIGHTS`]).

pub mod dense;
pub mod half_linear;
mod lanes;
pub mod layout;
pub mod moe;
mod quant;
mod scalar;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod wide;

use std::cell::RefCell;

use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::canonical::check_shape;
use crate::threads::{DisjointWrites, ParallelFor};
use crate::{Error, Result};

pub use layout::{Layout, ROWS};
pub use quant::{quantize_row, INT8_MAX, TOKEN_SCALE_FLOOR};

/// Tokens one int8 kernel call handles together (each weight sub-vector is unpacked once for them).
pub const INT8_TILE: usize = 4;
/// Below this many x rows the exact mode streams the weight once per token (GEMV); from here on it
/// decodes f32 tiles once and reuses them for every token (GEMM).
pub const GEMM_MIN_M: usize = 4;
/// Rows of W per exact GEMM tile (a tile is decoded to f32 once and reused for all M rows).
pub const TILE_ROWS: usize = 16;
/// Columns of W per exact GEMM tile: 16 rows × 512 × 4 B = 32 KiB of decoded weights, which stays in L1.
pub const TILE_K: usize = 512;
/// x rows per exact GEMM micro-kernel call.
pub(crate) const MICRO_M: usize = 4;
/// f32 lanes per GEMM accumulator (one AVX-512 register; narrower variants use a prefix).
pub(crate) const LANES: usize = 16;
/// Distance between the accumulators of consecutive x rows in the GEMM accumulator buffer.
pub(crate) const ACC_STRIDE: usize = TILE_ROWS * LANES;
/// Accumulator floats one micro-kernel call touches.
pub(crate) const ACC_WINDOW: usize = (MICRO_M - 1) * ACC_STRIDE + ROWS * LANES;
/// From this many tokens the [`Variant::Amx`] int8 modes use AMX tiles (16 tokens × 16 rows per
/// instruction); below, the VNNI kernel. Measured on 6144 → 2048, one thread, weights in cache, µs
/// per call (AMX with 8-token tiles vs VNNI): M = 2 571 vs 333, 3 612 vs 524, 4 741 vs 770, 5 741 vs
/// 1014, 8 734 vs 1478.
pub const AMX_MIN_M: usize = 5;
/// From this many tokens the AVX-512 int8 modes (and the [`Variant::Amx`] ones below [`AMX_MIN_M`])
/// run the rows-in-lanes kernel ([`wide`]: the weight decoded once per call, one epilogue per 16 rows,
/// group and token) instead of the per-row GEMV.
pub const WIDE_MIN_M: usize = 4;

#[cfg(test)]
thread_local! {
    /// Tests lower [`WIDE_MIN_M`] on their thread to run the wide kernel at every M.
    static WIDE_MIN_M_OVERRIDE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

fn wide_min_m() -> usize {
    #[cfg(test)]
    if let Some(v) = WIDE_MIN_M_OVERRIDE.with(|c| c.get()) {
        return v;
    }
    WIDE_MIN_M
}
/// From this many output bytes the AMX paths write y with non-temporal stores. Their outputs go out
/// as 64-byte pieces of many token rows, and ordinary stores first read each line from DRAM, holding
/// line-fill buffers the tile loads need: 512 × 2048 → 6144 (6 MiB of y), one thread, 22.2 → 13.8 ms
/// (min of interleaved runs); 128 tokens (1.5 MiB) 5.3 → 3.7 ms; 8 tokens (96 KiB) 0.55 → 0.52 ms.
/// Smaller outputs (decode) stay cached for the next op.
pub const STREAM_Y_MIN_BYTES: usize = 256 << 10;
/// Row blocks of one run of the per-row int8 kernel ([`Job::int8_blocks`]): every token tile goes
/// through the run's blocks (in L2: 16 · Kp bytes) and writes its 64 outputs per token in one conversion.
const STORE_RUN_BLOCKS: usize = 16;
/// Below this many weights one thread does the whole product (forking costs more than it saves).
pub const PARALLEL_MIN_WEIGHTS: usize = 1 << 20;
/// Weights per parallel task at least (a task keeps its stream going for a while).
const TASK_MIN_WEIGHTS: usize = 1 << 18;

/// Split `units` units of `unit_weights` weights each, for `tokens` tokens, into contiguous ranges run on
/// `par` (one range on the calling thread when the work is small).
pub(crate) fn split_units(
    units: usize,
    unit_weights: usize,
    tokens: usize,
    par: &dyn ParallelFor,
    f: &(dyn Fn(std::ops::Range<usize>) + Sync),
) {
    let total = units
        .saturating_mul(unit_weights)
        .saturating_mul(tokens.min(16));
    let threads = par.threads().max(1);
    if total < PARALLEL_MIN_WEIGHTS || threads == 1 || units < 2 {
        f(0..units);
        return;
    }
    // Enough tasks to balance (4 per thread), each at least TASK_MIN_WEIGHTS.
    let per_task = (TASK_MIN_WEIGHTS / unit_weights.max(1))
        .max(units.div_ceil(4 * threads))
        .max(1);
    let tasks = units.div_ceil(per_task);
    par.run(tasks, &|range: std::ops::Range<usize>| {
        for t in range {
            f(t * per_task..((t + 1) * per_task).min(units));
        }
    });
}

/// A kernel implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Scalar,
    Avx2,
    Avx512,
    Amx,
}

impl Variant {
    pub const ALL: [Variant; 4] = [
        Variant::Scalar,
        Variant::Avx2,
        Variant::Avx512,
        Variant::Amx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Scalar => "scalar",
            Variant::Avx2 => "avx2",
            Variant::Avx512 => "avx512",
            Variant::Amx => "amx",
        }
    }

    /// Parse a variant name; `"auto"` (or `""`) means [`Variant::best`].
    pub fn parse(name: &str) -> Result<Variant> {
        match name {
            "" | "auto" => Ok(Variant::best()),
            "scalar" => Ok(Variant::Scalar),
            "avx2" => Ok(Variant::Avx2),
            "avx512" => Ok(Variant::Avx512),
            "amx" => Ok(Variant::Amx),
            other => Err(Error::invalid(format!(
                "unknown CPU kernel variant '{other}'; expected one of auto, scalar, avx2, avx512, amx"
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
            #[cfg(target_arch = "x86_64")]
            Variant::Amx => amx::is_supported(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest variant this CPU supports.
    pub fn best() -> Variant {
        [Variant::Amx, Variant::Avx512, Variant::Avx2]
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
            Variant::Amx => &avx512::KERNELS_AMX,
            #[cfg(target_arch = "x86_64")]
            Variant::Avx512 => avx512::kernels(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("is_supported is false off x86-64"),
        })
    }
}

/// The layout for weights that only the int8 modes will multiply with `variant` (what
/// `ops.prepare_weight` gives vLLM's bf16 / fp16 layers): [`Layout::Lanes16`] where the variant is
/// [`Variant::Avx512`] on full-width 512-bit units (not [`Variant::Amx`], whose tiles read row blocks;
/// not Zen 4, whose bf16 prefill goes through the dense path), else [`Layout::Rows4`].
/// `TERNARY_RS_CPU_LAYOUT` = `rows4` / `lanes16` / `auto` overrides (lanes16 runs with every variant,
/// through the plain reference where the AVX-512 lanes kernels are missing).
pub fn int8_layout_for(variant: Variant) -> Result<Layout> {
    match std::env::var("TERNARY_RS_CPU_LAYOUT") {
        Ok(v) if !v.is_empty() && v != "auto" => Layout::parse(&v),
        _ => Ok(default_int8_layout(variant)),
    }
}

fn default_int8_layout(variant: Variant) -> Layout {
    #[cfg(target_arch = "x86_64")]
    if variant == Variant::Avx512 && variant.is_supported() && !avx512::half_width_512() {
        return Layout::Lanes16;
    }
    let _ = variant;
    Layout::Rows4
}

/// How activations enter the dot products (see the module docs for the error bounds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f32 activations, exact products, f32 sums.
    Exact,
    /// int8 activations with one scale per token and weight group.
    Int8Group,
    /// int8 activations with one scale per token (BitNet b1.58's numerics).
    Int8Token,
}

impl Precision {
    /// The default for an activation dtype: int8 per group for bf16/fp16, exact for f32.
    pub fn default_for(dtype_is_f32: bool) -> Precision {
        if dtype_is_f32 {
            Precision::Exact
        } else {
            Precision::Int8Group
        }
    }

    fn is_int8(self) -> bool {
        self != Precision::Exact
    }
}

/// Activation element types: bf16, fp16, fp32 (x, bias and y share one).
pub trait Activation: Copy + Default + Send + Sync + 'static {
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
        #[cfg(target_arch = "x86_64")]
        if crate::cpu_features::avx512bw_available() {
            // SAFETY: AVX-512F is present (checked just above).
            return unsafe { avx512::f32_to_bf16(src, dst) };
        }
        #[cfg(target_arch = "x86_64")]
        if crate::cpu_features::avx2_available() {
            // SAFETY: AVX2 is present (checked just above).
            return unsafe { avx2::f32_to_bf16(src, dst) };
        }
        dst.convert_from_f32_slice(src);
    }
    fn bf16_bits(src: &[bf16]) -> Option<&[u16]> {
        Some(bytemuck::cast_slice(src))
    }
}

/// A weight in the kernel layout ([`layout::prepare`]).
#[derive(Clone, Copy, Debug)]
pub struct PreparedRef<'a> {
    pub rows: usize,
    pub cols: usize,
    pub group_size: usize,
    /// How `planes` and `scales` are arranged.
    pub layout: Layout,
    /// `layout.prepared_bytes(rows, cols)` code bytes.
    pub planes: &'a [u8],
    /// `layout.prepared_scales(rows, cols, group_size)` scales.
    pub scales: &'a [f16],
}

impl PreparedRef<'_> {
    /// Check the shape and the buffer lengths against it.
    pub fn check(&self) -> Result<()> {
        check_shape(self.rows, self.cols, self.group_size)?;
        let planes = self.layout.prepared_bytes(self.rows, self.cols);
        let scales = self
            .layout
            .prepared_scales(self.rows, self.cols, self.group_size);
        if Some(self.planes.len()) != planes || Some(self.scales.len()) != scales {
            return Err(Error::invalid(format!(
                "prepared weight [{}, {}] g{} ({}) needs {:?} code bytes and {:?} scales, got {} and {}",
                self.rows,
                self.cols,
                self.group_size,
                self.layout.name(),
                planes,
                scales,
                self.planes.len(),
                self.scales.len()
            )));
        }
        Ok(())
    }

    /// Refuse a weight in another layout than the 4-row one (the paths that read row blocks).
    pub fn require_rows4(&self, what: &str) -> Result<()> {
        if self.layout != Layout::Rows4 {
            return Err(Error::invalid(format!(
                "{what} needs weights in the {} layout, got {} (prepare them with layout rows4)",
                Layout::Rows4.name(),
                self.layout.name()
            )));
        }
        Ok(())
    }

    /// Codes and scales of row block `b` (4-row layout only).
    fn block(&self, b: usize) -> (&[u8], &[f16]) {
        assert_eq!(
            self.layout,
            Layout::Rows4,
            "row blocks of a {:?} weight",
            self.layout
        );
        let bb = layout::block_bytes(self.cols);
        let sb = layout::padded_groups(self.cols, self.group_size) * ROWS;
        (
            &self.planes[b * bb..(b + 1) * bb],
            &self.scales[b * sb..(b + 1) * sb],
        )
    }
}

/// One int8 kernel call: a row block against a tile of `tile` tokens.
pub(crate) struct Int8Tile<'a> {
    /// The row block's codes (`Kp` bytes).
    pub block: &'a [u8],
    /// Quantized activations of the tile's tokens (each `Kp` long, zero padded); unused entries repeat.
    pub x: [&'a [i8]; INT8_TILE],
    /// Combined scales `s[g][r] · xs[t][g]`, `[t][Gp][ROWS]` for the tile.
    pub cs: &'a [f32],
    pub group_size: usize,
}

/// `out[t][r] = Σ_g cs[t][g][r] · Σ_{k∈g} code(r, k) · q_t[k]` (codes are `t + 1`: the caller
/// subtracts `Σ_g cs · Σ_{k∈g} q` afterwards). Entry `i` handles tiles of `i + 1` tokens.
pub(crate) type Int8Fn = unsafe fn(&Int8Tile<'_>) -> [[f32; ROWS]; INT8_TILE];

/// `out[r] = Σ_g s[g][r] · Σ_{k∈g} t(r, k) · x[k]` for one row block (`x`: `Kp` f32, zero padded).
pub(crate) type ExactFn = unsafe fn(&[u8], &[f16], &[f32], usize) -> [f32; ROWS];

/// Same for bf16 activations given as raw bits (`Kp` long), where the variant has `vdpbf16ps`.
pub(crate) type ExactBf16Fn = unsafe fn(&[u8], &[f16], &[u16], usize) -> [f32; ROWS];

/// Decode columns `k0 .. k0 + out_stride` of a row block to f32 `t · s`: `out[r · stride + j]`;
/// `k0` and the stride are multiples of 256 within `Kp`.
pub(crate) type DecodeFn = unsafe fn(&[u8], &[f16], usize, usize, &mut [f32], usize);

/// The columns a SIMD [`DecodeFn`] writes (`kc`), after checking every bound its unchecked loads and
/// stores rely on: whole superblocks from `k0` inside the block, a scale for every group, and
/// `ROWS` rows of `kc` within `out` at `stride`. Panics (never reads out of bounds) otherwise.
pub(crate) fn decode_span(
    block: &[u8],
    scales: &[f16],
    g: usize,
    k0: usize,
    out: &[f32],
    stride: usize,
) -> usize {
    let kp = block.len();
    let kc = out.len() + stride - ROWS * stride;
    let sk = layout::SUPER_K;
    assert!(k0.is_multiple_of(sk) && kc.is_multiple_of(sk) && k0 + kc <= kp);
    assert!(scales.len() * g >= kp * ROWS && kc <= stride);
    kc
}

/// `acc[i · ACC_STRIDE + r · LANES + lane] += Σ_{j ≡ lane} x[i][j] · w[r][j]` (lane-partial sums)
/// for a [`MICRO_M`] × [`ROWS`] block; every `x[i]`, `w[r]` is `kc` long (a multiple of 64) and `acc`
/// is [`ACC_WINDOW`] long.
pub(crate) type MicroKernel = unsafe fn([&[f32]; MICRO_M], [&[f32]; ROWS], &mut [f32]);

/// Per row block and token: `cs[g·4 + r] = f32(s[g·4 + r]) · xs4[g·4 + r]`, returning
/// `corr[r] = Σ_g cs[g·4 + r] · qsum4[g·4 + r]` (the `+1` code offset). Slices are `Gp·4` long.
pub(crate) type PrepassFn = unsafe fn(&[f16], &[f32], &[f32], &mut [f32]) -> [f32; ROWS];

/// One variant's inner loops. Every slice argument is already bounds-checked by the caller; the
/// `unsafe` is only "this CPU has the variant's features" (guaranteed by [`Variant::kernels`]).
pub(crate) struct Kernels {
    pub int8: [Int8Fn; INT8_TILE],
    pub prepass: PrepassFn,
    pub exact: ExactFn,
    pub exact_bf16: Option<ExactBf16Fn>,
    pub decode: DecodeFn,
    pub micro: MicroKernel,
    pub quantize: quant::QuantizeFn,
    /// Whether the int8 modes take AMX tiles from [`AMX_MIN_M`] tokens.
    pub amx_int8: bool,
    /// Whether the int8 modes take the rows-in-lanes AVX-512 VNNI kernel from [`WIDE_MIN_M`] tokens.
    pub int8_wide: bool,
}

/// Scratch buffers of one call, reused across calls on the same thread (no page faults per call).
#[derive(Default)]
struct Scratch {
    xf: Vec<f32>,
    q: Vec<i8>,
    xs4: Vec<f32>,
    qsum4: Vec<f32>,
    xb: Vec<u16>,
    #[cfg(target_arch = "x86_64")]
    tiles: amx::TokenTiles,
    /// Per (token, group) `−Σq` and `xs`: the rows-in-lanes kernels' (`wide`, `lanes`) view of the
    /// quantized activations.
    tokens: lanes::Tokens,
}

/// The AMX kernel's token buffers (none off x86-64).
#[cfg(target_arch = "x86_64")]
type TileScratch = amx::TokenTiles;
#[cfg(not(target_arch = "x86_64"))]
type TileScratch = ();
type WideScratch = lanes::Tokens;

/// Activations quantized for the int8 kernels, `m` token rows: codes `[m][Kp]`, group scales and code
/// sums `[m][Gp][ROWS]` ([`quant`]).
#[derive(Clone, Copy)]
pub(crate) struct QuantizedRows<'a> {
    pub q: &'a [i8],
    pub xs4: &'a [f32],
    pub qsum4: &'a [f32],
}

impl<'a> QuantizedRows<'a> {
    /// Token rows `rows` of these, for a weight of `k` columns in groups of `g`.
    pub(crate) fn rows(
        self,
        rows: std::ops::Range<usize>,
        k: usize,
        g: usize,
    ) -> QuantizedRows<'a> {
        let (kp, gp4) = (layout::padded_cols(k), layout::padded_groups(k, g) * ROWS);
        QuantizedRows {
            q: &self.q[rows.start * kp..rows.end * kp],
            xs4: &self.xs4[rows.start * gp4..rows.end * gp4],
            qsum4: &self.qsum4[rows.start * gp4..rows.end * gp4],
        }
    }
}

/// The shape of [`quantize_rows`]' output in a [`Scratch`] (its buffers are borrowed afterwards).
#[derive(Clone, Copy)]
pub(crate) struct QuantizedShape {
    rows: usize,
    kp: usize,
    gp4: usize,
}

impl QuantizedShape {
    pub(crate) fn of<'a>(self, q: &'a [i8], xs4: &'a [f32], qsum4: &'a [f32]) -> QuantizedRows<'a> {
        QuantizedRows {
            q: &q[..self.rows * self.kp],
            xs4: &xs4[..self.rows * self.gp4],
            qsum4: &qsum4[..self.rows * self.gp4],
        }
    }
}

/// Quantize the `m` rows of `x` (`[m][K]`, K = `w.cols`) for `w`'s groups into `s.q`, `s.xs4` and
/// `s.qsum4` (per group, or per token when `per_token`).
fn quantize_rows<T: Activation>(
    kernels: &Kernels,
    w: PreparedRef<'_>,
    x: &[T],
    m: usize,
    per_token: bool,
    s: &mut Scratch,
) -> QuantizedShape {
    let k = w.cols;
    let kp = layout::padded_cols(k);
    let gp4 = layout::padded_groups(k, w.group_size) * ROWS;
    let (q, xs4, qsum4) = (
        resize(&mut s.q, m * kp),
        resize(&mut s.xs4, m * gp4),
        resize(&mut s.qsum4, m * gp4),
    );
    let xf = resize(&mut s.xf, kp);
    for mi in 0..m {
        T::to_f32_slice(&x[mi * k..(mi + 1) * k], &mut xf[..k]);
        let r = mi * gp4..(mi + 1) * gp4;
        // SAFETY: `kernels` comes from `Variant::kernels`, which checked the CPU features.
        unsafe {
            (kernels.quantize)(
                xf,
                &mut q[mi * kp..(mi + 1) * kp],
                w.group_size,
                per_token,
                &mut xs4[r.clone()],
                &mut qsum4[r],
            )
        };
    }
    QuantizedShape { rows: m, kp, gp4 }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn resize<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    v.clear();
    v.resize(n, T::default());
    v
}

/// Which kernels one [`gemm`] call runs: the instruction-set variant and the activation precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelChoice {
    pub variant: Variant,
    pub precision: Precision,
}

/// `y[M, N] = x[M, K] · Wᵀ + bias` with the given variant and precision, on `par`'s threads.
///
/// `x` is `M·K` row-major, `y` is `M·N`, `bias` (if any) is `N`; all share the activation type.
pub fn gemm<T: Activation>(
    w: PreparedRef<'_>,
    x: &[T],
    m: usize,
    bias: Option<&[T]>,
    y: &mut [T],
    choice: KernelChoice,
    par: &dyn ParallelFor,
) -> Result<()> {
    w.check()?;
    check_gemm_lengths(w, x.len(), m, bias.map(<[T]>::len), y.len())?;
    let kernels = choice.variant.kernels()?;
    let n = w.rows;
    if m == 0 || n == 0 {
        return Ok(());
    }
    // f32 bias only when there is one (an lm_head has 150k outputs: no per-call zeroed buffer).
    let bias_f = bias.map(|b| {
        let mut f = vec![0f32; n];
        T::to_f32_slice(b, &mut f);
        f
    });
    let job = Job {
        w,
        m,
        kernels,
        bias: bias_f.as_deref(),
        y: DisjointWrites::new(y),
        stream_y: std::mem::size_of_val(y) >= STREAM_Y_MIN_BYTES,
    };
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if w.layout == Layout::Lanes16 {
            job.run_lanes(&mut s, x, choice.precision, par);
        } else if choice.precision.is_int8() {
            job.run_int8(&mut s, x, choice.precision == Precision::Int8Token, par);
        } else {
            job.run_exact(&mut s, x, par);
        }
    });
    Ok(())
}

/// Refuse an x, y or bias whose length does not match `[m, k]`, `[m, n]` and `[n]`.
fn check_gemm_lengths(
    w: PreparedRef<'_>,
    x_len: usize,
    m: usize,
    bias_len: Option<usize>,
    y_len: usize,
) -> Result<()> {
    let (n, k) = (w.rows, w.cols);
    let want_x = m.checked_mul(k);
    let want_y = m.checked_mul(n);
    if Some(x_len) != want_x || Some(y_len) != want_y {
        return Err(Error::invalid(format!(
            "ternary GEMM [{m}, {k}] x [{n}, {k}]^T needs x of {want_x:?} and y of {want_y:?} elements, got {x_len} and {y_len}"
        )));
    }
    if let Some(b) = bias_len {
        if b != n {
            return Err(Error::invalid(format!(
                "bias has {b} elements, expected out_features = {n}"
            )));
        }
    }
    Ok(())
}

/// Where an AMX tile goes in y: tokens `m0 .. m0 + tokens`, rows `n0 .. n0 + rows`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct TileAt {
    m0: usize,
    tokens: usize,
    n0: usize,
    rows: usize,
}

/// What every task of one [`gemm`] call shares.
struct Job<'a, T> {
    w: PreparedRef<'a>,
    m: usize,
    kernels: &'static Kernels,
    bias: Option<&'a [f32]>,
    /// Tasks write disjoint (token, row) elements.
    y: DisjointWrites<T>,
    /// Whether [`Job::store_tile`] streams whole lines past the caches ([`STREAM_Y_MIN_BYTES`]).
    stream_y: bool,
}

impl<T: Activation> Job<'_, T> {
    /// int8 activations: x quantized per row (per group, or per token when `per_token`), then the
    /// AMX tiles, the wide kernel or the per-row int8 kernel, by what the CPU has and M.
    fn run_int8(&self, s: &mut Scratch, x: &[T], per_token: bool, par: &dyn ParallelFor) {
        let xq = quantize_rows(self.kernels, self.w, x, self.m, per_token, s);
        #[cfg(target_arch = "x86_64")]
        let tiles = &mut s.tiles;
        #[cfg(not(target_arch = "x86_64"))]
        let tiles = &mut ();
        self.run_quantized(xq.of(&s.q, &s.xs4, &s.qsum4), tiles, &mut s.tokens, par);
    }

    /// A rows-in-lanes weight ([`lanes`]): every mode through its AVX-512 lanes kernel, or the plain
    /// reference on other variants.
    fn run_lanes(&self, s: &mut Scratch, x: &[T], precision: Precision, par: &dyn ParallelFor) {
        let (w, m) = (self.w, self.m);
        let kp = layout::padded_cols(w.cols);
        let gp = layout::padded_groups(w.cols, w.group_size);
        let groups = Layout::Lanes16.units(w.rows);
        let unit_weights = layout::LANE_ROWS * kp;
        // The AVX-512 lanes kernels where the variant is an AVX-512 one, else the plain references.
        let simd = self.kernels.int8_wide;
        // `sums(grp, out)` for every row group (split over `par`), each stored (+ bias) to y.
        let row_groups = |sums: &(dyn Fn(usize, &mut Vec<[f32; layout::LANE_ROWS]>) + Sync)| {
            self.split(groups, unit_weights, par, &|range| {
                let mut out = Vec::new();
                for grp in range {
                    sums(grp, &mut out);
                    let n0 = grp * layout::LANE_ROWS;
                    let rows = layout::LANE_ROWS.min(w.rows - n0);
                    for (t, v) in out.iter_mut().enumerate() {
                        self.store_row(t, n0, &mut v[..rows]);
                    }
                }
            })
        };
        if !precision.is_int8() {
            let xf = resize(&mut s.xf, m * kp);
            for (dst, src) in xf.chunks_exact_mut(kp).zip(x.chunks_exact(w.cols)) {
                T::to_f32_slice(src, &mut dst[..w.cols]);
            }
            let xf = &*xf;
            row_groups(&|grp, out| lanes::exact(&w, grp, xf, m, simd, out));
            return;
        }
        let xq = quantize_rows(self.kernels, w, x, m, precision == Precision::Int8Token, s)
            .of(&s.q, &s.xs4, &s.qsum4);
        s.tokens.fill(xq.xs4, xq.qsum4, m, gp);
        let tokens = &s.tokens;
        row_groups(&|grp, out| lanes::int8(&w, grp, xq.q, tokens, m, simd, out));
    }

    /// Whether [`Job::run_quantized`] takes the per-row int8 kernel (not AMX tiles or the wide one).
    fn int8_is_per_row(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if (self.kernels.amx_int8 && self.m >= AMX_MIN_M)
            || (self.kernels.int8_wide && self.m >= wide_min_m())
        {
            return false;
        }
        true
    }

    /// The int8 modes on activations already quantized ([`quantize_rows`]).
    fn run_quantized(
        &self,
        xq: QuantizedRows<'_>,
        tiles: &mut TileScratch,
        wide: &mut WideScratch,
        par: &dyn ParallelFor,
    ) {
        let (w, m, kernels) = (self.w, self.m, self.kernels);
        let kp = layout::padded_cols(w.cols);
        let gp = layout::padded_groups(w.cols, w.group_size);
        #[cfg(target_arch = "x86_64")]
        if kernels.amx_int8 && m >= AMX_MIN_M {
            tiles.fill(xq.q, xq.xs4, m, kp, gp);
            self.int8_amx(tiles, par);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if kernels.int8_wide && m >= wide_min_m() {
            wide.fill(xq.xs4, xq.qsum4, m, gp);
            self.int8_wide(xq.q, wide, par);
            return;
        }
        let _ = (kernels, kp, gp, tiles, wide);
        self.int8(xq, par);
    }

    /// Exact activations: bf16 straight into the bf16 kernel for small M, else an f32 copy of x
    /// through the tiled (large M) or per-row kernel.
    fn run_exact(&self, s: &mut Scratch, x: &[T], par: &dyn ParallelFor) {
        let (w, m, kernels) = (self.w, self.m, self.kernels);
        let k = w.cols;
        let kp = layout::padded_cols(k);
        if let (Some(bits), Some(f), true) = (T::bf16_bits(x), kernels.exact_bf16, m < GEMM_MIN_M) {
            let xb = resize(&mut s.xb, m * kp); // zero padded, like xf below
            for (dst, src) in xb.chunks_exact_mut(kp).zip(bits.chunks_exact(k)) {
                dst[..k].copy_from_slice(src);
            }
            self.rows_per_token(par, |block, scales, mi| {
                // SAFETY: `kernels` comes from `Variant::kernels`, which checked the CPU features.
                unsafe { f(block, scales, &xb[mi * kp..(mi + 1) * kp], w.group_size) }
            });
            return;
        }
        // f32 copy of x, zero padded to whole superblocks (the kernels read whole 256-column chunks).
        let xf = resize(&mut s.xf, m * kp);
        for (dst, src) in xf.chunks_exact_mut(kp).zip(x.chunks_exact(k)) {
            T::to_f32_slice(src, &mut dst[..k]);
        }
        if m >= GEMM_MIN_M {
            self.exact_tiles(xf, par);
        } else {
            self.rows_per_token(par, |block, scales, mi| {
                // SAFETY: `kernels` comes from `Variant::kernels`, which checked the CPU features.
                unsafe { (kernels.exact)(block, scales, &xf[mi * kp..(mi + 1) * kp], w.group_size) }
            });
        }
    }

    /// [`split_units`] for this job's tokens.
    fn split(
        &self,
        units: usize,
        unit_weights: usize,
        par: &dyn ParallelFor,
        f: &(dyn Fn(std::ops::Range<usize>) + Sync),
    ) {
        split_units(units, unit_weights, self.m, par, f)
    }

    /// Write `vals[t][r]` (+ bias) for row block `b`, tokens `m0 .. m0 + tokens`.
    fn store(&self, b: usize, m0: usize, vals: &[[f32; ROWS]], tokens: usize) {
        let n = self.w.rows;
        let n0 = b * ROWS;
        let rows = ROWS.min(n - n0);
        for (t, v) in vals.iter().enumerate().take(tokens) {
            let mut out = *v;
            self.store_row(m0 + t, n0, &mut out[..rows]);
        }
    }

    /// Write `vals` (+ bias) to y[token][n0 ..]: one conversion for the whole run of rows.
    fn store_row(&self, token: usize, n0: usize, vals: &mut [f32]) {
        let n = self.w.rows;
        assert!(n0 + vals.len() <= n && token < self.m);
        if let Some(b) = self.bias {
            for (v, b) in vals.iter_mut().zip(&b[n0..]) {
                *v += b;
            }
        }
        // SAFETY: y has m·n elements; (token, n0 .. n0 + len) is in bounds (asserted) and written by
        // this task only (tasks own disjoint rows).
        let dst = unsafe { self.y.slice(token * n + n0, vals.len()) };
        T::from_f32_slice(vals, dst);
    }

    /// Write an AMX tile of sums `tile[r · width + t]` (`width = tile.len() / 32`; rows `n0 ..
    /// n0 + rows`, tokens `m0 .. m0 + tokens`) to y, plus bias: transposed and converted in one go per
    /// tile (per-token row writes were a sixth of an M = 512 call).
    #[cfg(target_arch = "x86_64")]
    fn store_tile(&self, at: TileAt, tile: &[f32], fbuf: &mut [f32], tbuf: &mut [T]) {
        let TileAt {
            m0,
            tokens,
            n0,
            rows,
        } = at;
        let n = self.w.rows;
        let width = tile.len() / amx::GROUP_ROWS;
        assert!(n0 + rows <= n && m0 + tokens <= self.m && tokens <= width);
        assert!(fbuf.len() >= tokens * rows && tbuf.len() >= tokens * rows);
        for t in 0..tokens {
            let dst = &mut fbuf[t * rows..(t + 1) * rows];
            for (r, v) in dst.iter_mut().enumerate() {
                *v = tile[r * width + t];
            }
            if let Some(b) = self.bias {
                for (v, b) in dst.iter_mut().zip(&b[n0..n0 + rows]) {
                    *v += b;
                }
            }
        }
        T::from_f32_slice(&fbuf[..tokens * rows], &mut tbuf[..tokens * rows]);
        let bytes = rows * std::mem::size_of::<T>();
        for t in 0..tokens {
            // SAFETY: y has m·n elements; (m0 + t, n0 .. n0 + rows) is in bounds (asserted) and
            // written by this task only (tasks own disjoint rows).
            let dst = unsafe { self.y.slice((m0 + t) * n + n0, rows) };
            let src = &tbuf[t * rows..(t + 1) * rows];
            if self.stream_y
                && bytes.is_multiple_of(64)
                && (dst.as_ptr() as usize).is_multiple_of(64)
            {
                // SAFETY: the AMX paths run only with AVX-512; whole lines of `dst` and `src`; the
                // task fences before it returns (`int8_amx`).
                unsafe {
                    avx512::stream_lines(dst.as_mut_ptr().cast(), src.as_ptr().cast(), bytes)
                };
            } else {
                dst.copy_from_slice(src);
            }
        }
    }

    /// Int8 modes: every row block against token tiles of up to [`INT8_TILE`].
    fn int8(&self, xq: QuantizedRows<'_>, par: &dyn ParallelFor) {
        let kp = layout::padded_cols(self.w.cols);
        let blocks = layout::row_blocks(self.w.rows);
        self.split(blocks, ROWS * kp, par, &|range| self.int8_blocks(xq, range));
    }

    /// [`Job::int8`] for row blocks `range` on the calling thread: runs of [`STORE_RUN_BLOCKS`] row
    /// blocks, each run token tile after token tile, so one store converts a tile's outputs of the whole
    /// run per token. (Block after block with every tile inside stored 4 values per token and block once
    /// M outgrew the buffer: at a 2048-token prefill on AVX2 the stores were an eighth of the time.)
    fn int8_blocks(&self, xq: QuantizedRows<'_>, range: std::ops::Range<usize>) {
        let (k, g) = (self.w.cols, self.w.group_size);
        let kp = layout::padded_cols(k);
        let gp = layout::padded_groups(k, g);
        let m = self.m;
        let QuantizedRows { q, xs4, qsum4 } = xq;
        let mut cs = vec![0f32; INT8_TILE * gp * ROWS];
        let mut corr = [[0f32; ROWS]; INT8_TILE];
        let run = STORE_RUN_BLOCKS * ROWS;
        let mut out = vec![0f32; INT8_TILE * run];
        let mut c0 = range.start;
        while c0 < range.end {
            let c1 = (c0 + STORE_RUN_BLOCKS).min(range.end);
            let n0 = c0 * ROWS;
            let rows = (c1 * ROWS).min(self.w.rows) - n0;
            for m0 in (0..m).step_by(INT8_TILE) {
                let tile = INT8_TILE.min(m - m0);
                let x: [&[i8]; INT8_TILE] = std::array::from_fn(|t| {
                    let mi = m0 + t.min(tile - 1);
                    &q[mi * kp..(mi + 1) * kp]
                });
                for b in c0..c1 {
                    let (block, scales) = self.w.block(b);
                    for t in 0..tile {
                        let r = (m0 + t) * gp * ROWS..(m0 + t + 1) * gp * ROWS;
                        // SAFETY: CPU features checked by `Variant::kernels`; slices are Gp·4 long.
                        corr[t] = unsafe {
                            (self.kernels.prepass)(
                                scales,
                                &xs4[r.clone()],
                                &qsum4[r],
                                &mut cs[t * gp * ROWS..(t + 1) * gp * ROWS],
                            )
                        };
                    }
                    let args = Int8Tile {
                        block,
                        x,
                        cs: &cs[..tile * gp * ROWS],
                        group_size: g,
                    };
                    // SAFETY: as above; every slice is Kp / Gp·4 long as the kernels expect.
                    let sums = unsafe { (self.kernels.int8[tile - 1])(&args) };
                    for t in 0..tile {
                        let dst = &mut out[t * run + (b - c0) * ROWS..][..ROWS];
                        for r in 0..ROWS {
                            dst[r] = sums[t][r] - corr[t][r];
                        }
                    }
                }
                for t in 0..tile {
                    self.store_row(m0 + t, n0, &mut out[t * run..][..rows]);
                }
            }
            c0 = c1;
        }
    }

    /// Int8 modes on AMX: 32-row groups of the weight against 16-token tiles ([`amx`]), token block
    /// after token block (a block's activations stay in L2 while every row group streams them).
    #[cfg(target_arch = "x86_64")]
    fn int8_amx(&self, tt: &amx::TokenTiles, par: &dyn ParallelFor) {
        let (k, g, m) = (self.w.cols, self.w.group_size, self.m);
        let kp = layout::padded_cols(k);
        let blocks = layout::row_blocks(self.w.rows);
        let per_group = amx::GROUP_ROWS / ROWS;
        let (per_block, width) = (tt.tiles_per_block(), tt.width);
        for j0 in (0..tt.tiles).step_by(per_block) {
            let tiles = j0..(j0 + per_block).min(tt.tiles);
            self.split(
                blocks.div_ceil(per_group),
                amx::GROUP_ROWS * kp,
                par,
                &|range| {
                    // SAFETY: `amx_int8` is set only in the kernels of `Variant::Amx`, which checked AMX.
                    let mut worker = unsafe { amx::Worker::new(g, width) };
                    let mut fbuf = [0f32; amx::GROUP_ROWS * amx::TILE_T];
                    let mut tbuf = [T::default(); amx::GROUP_ROWS * amx::TILE_T];
                    for grp in range.clone() {
                        let next = (grp + 1 < range.end).then_some(grp + 1);
                        let out = worker.group(&self.w, grp, tt, tiles.clone(), next);
                        let n0 = grp * amx::GROUP_ROWS;
                        let rows = amx::GROUP_ROWS.min(self.w.rows - n0);
                        for (o, j) in tiles.clone().enumerate() {
                            let tile =
                                &out[o * amx::GROUP_ROWS * width..][..amx::GROUP_ROWS * width];
                            let tokens = width.min(m - j * width);
                            let at = TileAt {
                                m0: j * width,
                                tokens,
                                n0,
                                rows,
                            };
                            self.store_tile(at, tile, &mut fbuf, &mut tbuf);
                        }
                    }
                    if self.stream_y {
                        // Non-temporal stores are weakly ordered: make them visible before the
                        // pool's join publishes this task's rows.
                        // SAFETY: SSE is part of x86-64.
                        unsafe { std::arch::x86_64::_mm_sfence() };
                    }
                },
            );
        }
    }

    /// Int8 modes, AVX-512 VNNI from [`WIDE_MIN_M`] tokens: 16-row groups of the weight, each decoded
    /// once per call, against every token ([`wide`]).
    #[cfg(target_arch = "x86_64")]
    fn int8_wide(&self, q: &[i8], tokens: &lanes::Tokens, par: &dyn ParallelFor) {
        let kp = layout::padded_cols(self.w.cols);
        let groups = self.w.rows.div_ceil(wide::GROUP_ROWS);
        self.split(groups, wide::GROUP_ROWS * kp, par, &|range| {
            let mut worker = wide::Worker::new();
            let r_max = if self.m >= wide::PAIR_MIN_M {
                wide::MAX_R
            } else {
                1
            };
            let mut grp = range.start;
            while grp < range.end {
                let r = r_max.min(range.end - grp);
                let out = worker.groups(&self.w, grp, r, q, tokens, self.m);
                for (ri, rows_out) in out.chunks_exact(self.m).enumerate() {
                    let n0 = (grp + ri) * wide::GROUP_ROWS;
                    let rows = wide::GROUP_ROWS.min(self.w.rows - n0);
                    for (t, vals) in rows_out.iter().enumerate() {
                        let mut v = *vals;
                        self.store_row(t, n0, &mut v[..rows]);
                    }
                }
                grp += r;
            }
        });
    }

    /// Exact GEMV: each row block streamed once per token (the block stays in L1 for the next token).
    fn rows_per_token<F>(&self, par: &dyn ParallelFor, dot: F)
    where
        F: Fn(&[u8], &[f16], usize) -> [f32; ROWS] + Sync,
    {
        let kp = layout::padded_cols(self.w.cols);
        let blocks = layout::row_blocks(self.w.rows);
        self.split(blocks, ROWS * kp, par, &|range| {
            for b in range {
                let (block, scales) = self.w.block(b);
                for mi in 0..self.m {
                    self.store(b, mi, &[dot(block, scales, mi)], 1);
                }
            }
        });
    }

    /// Exact GEMM: per tile of [`TILE_ROWS`] rows, decode [`TILE_K`] columns at a time to f32 (scale
    /// applied) and run the micro-kernel over all x rows; lane-partial sums live in `acc` until the end.
    fn exact_tiles(&self, xf: &[f32], par: &dyn ParallelFor) {
        let kernels = self.kernels;
        let (k, m) = (self.w.cols, self.m);
        let kp = layout::padded_cols(k);
        let blocks = layout::row_blocks(self.w.rows);
        const BLOCKS_PER_TILE: usize = TILE_ROWS / ROWS;
        let tiles = blocks.div_ceil(BLOCKS_PER_TILE);
        // Accumulators of one tile: m rounded up to whole micro-kernel blocks (repeated tail rows
        // accumulate into slots never read).
        let tile_acc = m.div_ceil(MICRO_M) * MICRO_M * ACC_STRIDE;
        self.split(tiles, TILE_ROWS * kp, par, &|range| {
            let mut wbuf = vec![0f32; TILE_ROWS * TILE_K];
            let mut acc = vec![0f32; tile_acc];
            let mut vals = vec![[0f32; ROWS]; m];
            for ti in range {
                acc.fill(0.0);
                let b0 = ti * BLOCKS_PER_TILE;
                let nb = BLOCKS_PER_TILE.min(blocks - b0);
                for k0 in (0..kp).step_by(TILE_K) {
                    let kc = TILE_K.min(kp - k0);
                    for bi in 0..nb {
                        let (block, scales) = self.w.block(b0 + bi);
                        // SAFETY: CPU features checked; k0, kc are multiples of 256 inside Kp, and the
                        // output window holds ROWS rows of stride TILE_K.
                        unsafe {
                            (kernels.decode)(
                                block,
                                scales,
                                self.w.group_size,
                                k0,
                                &mut wbuf[bi * ROWS * TILE_K..][..ROWS * TILE_K - (TILE_K - kc)],
                                TILE_K,
                            )
                        };
                    }
                    for mi in (0..m).step_by(MICRO_M) {
                        let xs: [&[f32]; MICRO_M] = std::array::from_fn(|i| {
                            let row = (mi + i).min(m - 1);
                            &xf[row * kp + k0..row * kp + k0 + kc]
                        });
                        for bi in 0..nb {
                            let ws: [&[f32]; ROWS] = std::array::from_fn(|r| {
                                let o = (bi * ROWS + r) * TILE_K;
                                &wbuf[o..o + kc]
                            });
                            let start = (mi * TILE_ROWS + bi * ROWS) * LANES;
                            let window = &mut acc[start..start + ACC_WINDOW];
                            // SAFETY: as above; every slice is kc long and the window spans MICRO_M strides.
                            unsafe { (kernels.micro)(xs, ws, window) };
                        }
                    }
                }
                for bi in 0..nb {
                    for (mi, v) in vals.iter_mut().enumerate() {
                        for r in 0..ROWS {
                            let lanes = &acc[(mi * TILE_ROWS + bi * ROWS + r) * LANES..][..LANES];
                            v[r] = sum_lanes(lanes);
                        }
                    }
                    self.store(b0 + bi, 0, &vals, m);
                }
            }
        });
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
