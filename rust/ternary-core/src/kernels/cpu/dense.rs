//! Decoding a prepared weight back to dense bf16 rows, for the large-M (prefill) path.
//!
//! At large M the product is compute-bound. Where the int8 modes have no rows-in-lanes VNNI kernel of
//! their own to run (`super::wide`: AVX2 or the scalar reference forced on a CPU with AVX512_BF16), and
//! on Zen 4, whose 512-bit units are half width, torch's bf16 GEMM (oneDNN with AVX512_BF16) is the
//! faster way through a prefill. So for bf16 activations and `M ≥` [`DENSE_MIN_M`] there
//! ([`prefill_pays`]) the torch op decodes row chunks of the weight to bf16 (this module) and hands each
//! chunk to torch's own GEMM: the weight is still stored (and streamed from DRAM) at 2 bits, only a
//! cache-sized chunk exists dense at a time.
//!
//! The decode is exact: `bf16(t · s) = t · bf16(s)` for `t ∈ {−1, 0, +1}` (rounding is symmetric), so
//! each output is the group's scale rounded once to bf16, with the sign of the code. Extra error vs
//! float64 beyond the GEMM's own: each weight moves by at most `2⁻⁹ · |W[n,k]|` (f16 → bf16 scale).

use std::ops::Range;

use half::{bf16, f16};

use super::layout::{padded_groups, row_blocks, CHUNK_BYTES, ROWS, SUB_K, SUPER_K};
use super::PreparedRef;
use crate::threads::ParallelFor;
use crate::{Error, Result};

/// Smallest M for which the torch op takes the dense-tile path (bf16 activations, default mode):
/// measured crossover of the per-row int8 GEMV and decode + torch bf16 GEMM on the 27B shapes (EPYC
/// Zen 4, 5120 → 17408, one thread: int8 28.5 ms vs 35.8 ms at M = 32, 56.1 ms vs 43.2 ms at M = 64),
/// before the rows-in-lanes kernel (`super::wide`, 9.6 ms at M = 16 there) existed.
pub const DENSE_MIN_M: usize = 48;

/// Whether the dense prefill beats the int8 kernels of `variant` on this CPU. Only where the CPU has
/// native bf16 dot products (AVX512_BF16) for torch's GEMM to use, and then:
/// * never against AMX-INT8 tiles (faster still);
/// * never against the AVX-512 VNNI rows-in-lanes kernel on CPUs with full-width 512-bit units: one
///   `vpdpbusd` is 64 multiply-adds where `vdpbf16ps` is 32. EPYC Zen 5, decode + torch bf16 GEMM vs the
///   int8 kernel, min of interleaved calls, 2 threads: 5120 → 17408 at M = 48 / 64 / 128 / 512 / 2048:
///   16.7 / 19.8 / 32.3 / 108 / 437 ms vs 8.7 / 10.5 / 19.9 / 71.5 / 277 ms; 2048 → 6144 at M = 2048:
///   57.6 vs 49.8 ms (one thread, M = 48 to 256: 1.6–2.6× slower). Intel's AVX-512 cores without
///   AMX (Cooper Lake; or `TERNARY_RS_CPU_KERNEL=avx512` on an AMX CPU) are full width too: unmeasured;
/// * on Zen 4 (512-bit work split over 256-bit units) from [`DENSE_MIN_M`], as measured there (not
///   measured again since the rows-in-lanes kernel);
/// * always against AVX2 or the scalar reference when those are forced on such a CPU.
///
/// Without native bf16 (AVX2 CPUs) torch converts bf16 and its GEMM crawls: EPYC Zen 2, 5120 → 17408,
/// one thread, M = 64 / 512: 1382 / 10910 ms through torch against the AVX2 int8 kernel's ~60 G
/// weight-tokens/s (~95 / ~750 ms).
pub fn prefill_pays(variant: super::Variant) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use super::Variant;
        std::arch::is_x86_feature_detected!("avx512bf16")
            && match variant {
                Variant::Amx => false,
                Variant::Avx512 => super::avx512::half_width_512(),
                Variant::Avx2 | Variant::Scalar => true,
            }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = variant;
        false
    }
}

/// Lanes sharing one scale at least (every group size is a multiple of 32).
const HALF: usize = 32;

/// Decode row blocks `blocks` of `w` into `out`: rows `4·blocks.start ..` (only rows `< w.rows`), each
/// `w.cols` bf16 values, row after row (`out.len()` = rows · cols). Blocks are split over `pool`.
pub fn decode_blocks_bf16(
    w: &PreparedRef<'_>,
    blocks: Range<usize>,
    out: &mut [bf16],
    pool: &dyn ParallelFor,
) -> Result<()> {
    w.check()?;
    w.require_rows4("decode_blocks_bf16")?;
    let (n, k) = (w.rows, w.cols);
    if blocks.start > blocks.end || blocks.end > row_blocks(n) {
        return Err(Error::invalid(format!(
            "row blocks {blocks:?} outside the weight's {}",
            row_blocks(n)
        )));
    }
    let first_row = blocks.start * ROWS;
    let rows = (blocks.end * ROWS).min(n).saturating_sub(first_row);
    if out.len() != rows * k {
        return Err(Error::invalid(format!(
            "output holds {} values, rows {first_row}..{} of {k} need {}",
            out.len(),
            first_row + rows,
            rows * k
        )));
    }
    let count = blocks.end - blocks.start;
    let base = out.as_mut_ptr() as usize;
    let avx512 = has_avx512bw();
    let task = |range: Range<usize>| {
        for b in range.start + blocks.start..range.end + blocks.start {
            let row0 = b * ROWS - first_row;
            let in_block = ROWS.min(n - b * ROWS);
            // SAFETY: block b owns rows row0..row0+in_block of `out` (disjoint per block, inside
            // `out` as checked above), and `out` outlives the pool call.
            let dst = unsafe {
                std::slice::from_raw_parts_mut((base as *mut bf16).add(row0 * k), in_block * k)
            };
            decode_block(w, b, dst, avx512);
        }
    };
    if count * ROWS * k >= super::PARALLEL_MIN_WEIGHTS && pool.threads() > 1 {
        pool.run(count, &task);
    } else {
        task(0..count);
    }
    Ok(())
}

fn has_avx512bw() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn decode_block(w: &PreparedRef<'_>, b: usize, dst: &mut [bf16], avx512: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx512 {
        // SAFETY: the CPU has AVX-512 F and BW (checked by the caller).
        return unsafe { decode_block_avx512(w, b, dst) };
    }
    let _ = avx512;
    decode_block_plain(w, b, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn decode_block_avx512(w: &PreparedRef<'_>, b: usize, dst: &mut [bf16]) {
    // The same code; compiled for AVX-512 the 32-lane selects become masked word moves.
    decode_block_plain(w, b, dst)
}

/// Block `b`'s rows (`dst.len() / cols` of them) as bf16, exactly `t · bf16(s)`.
#[inline(always)]
fn decode_block_plain(w: &PreparedRef<'_>, b: usize, dst: &mut [bf16]) {
    let k = w.cols;
    let kp = super::layout::padded_cols(k);
    let gp = padded_groups(k, w.group_size);
    let block = &w.planes[b * kp..(b + 1) * kp];
    let scales = &w.scales[b * gp * ROWS..(b + 1) * gp * ROWS];
    let dst: &mut [u16] = bytemuck_u16(dst);
    for (r, row) in dst.chunks_exact_mut(k).enumerate() {
        for sb in 0..k.div_ceil(SUPER_K) {
            let chunk = &block[(sb * ROWS + r) * CHUNK_BYTES..][..CHUNK_BYTES];
            for sub in 0..SUPER_K / SUB_K {
                for half in 0..SUB_K / HALF {
                    let k0 = sb * SUPER_K + sub * SUB_K + half * HALF;
                    if k0 >= k {
                        break;
                    }
                    let s = scale_bits(scales[(k0 / w.group_size) * ROWS + r]);
                    let (pos, neg) = (s, s ^ 0x8000);
                    let src: &[u8; HALF] = chunk[half * HALF..][..HALF].try_into().unwrap();
                    let out: &mut [u16; HALF] = (&mut row[k0..k0 + HALF]).try_into().unwrap();
                    let shift = 2 * sub as u32;
                    for j in 0..HALF {
                        // Branch-free (codes are random: a branch mispredicts half the time).
                        let c = (src[j] >> shift) & 3;
                        let is_pos = ((c == 2) as u16).wrapping_neg();
                        let is_neg = ((c == 0) as u16).wrapping_neg();
                        out[j] = (pos & is_pos) | (neg & is_neg);
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn scale_bits(s: f16) -> u16 {
    bf16::from_f32(s.to_f32()).to_bits()
}

fn bytemuck_u16(x: &mut [bf16]) -> &mut [u16] {
    // SAFETY: bf16 is a repr(transparent) u16.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u16>(), x.len()) }
}
