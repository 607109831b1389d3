//! AVX-512 kernels (F + BW + DQ + VL + VNNI, with FMA and F16C; `vdpbf16ps` where AVX512_BF16 is present).
//!
//! The layout makes every mode start the same way: one 64-byte load per row and superblock, then
//! `(chunk >> 2i) & 3` gives the 64 byte codes `c = t + 1` of sub-vector `i`.
//! (The small-M int8 GEMV gets the same codes from one `gf2p8affineqb` where GFNI pays, and at one or
//! two tokens and g ≥ 128 takes them as `4·c` / `64·c` so that one shift serves the four: `scaled_codes`.)
//! * int8: `vpdpbusd` multiplies those unsigned codes by the signed int8 activations, 64 weights per
//!   instruction, straight into i32 lanes; per scale unit (`min(g, 128)` weights) the lanes are converted
//!   to f32 and multiplied by the combined scale `s · xs` (one FMA with an embedded broadcast). The `+1`
//!   of the codes is removed afterwards with the per-group code sums (`prepass`).
//! * exact f32: `t = c − 1` sign-extended to i32 and converted, then FMA with x (exact products).
//! * exact bf16: `t` as bf16 ±1/0 through a 3-entry `vpermw` table, then `vdpbf16ps`.

// Register arrays (per row, per token) are indexed in lockstep; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::f16;

use super::layout::{CHUNK_BYTES, ROWS, SUB_K, SUPER_K};
use super::{Int8Tile, Kernels, ACC_STRIDE, INT8_TILE, LANES, MICRO_M};

pub(crate) const KERNELS: Kernels = Kernels {
    int8: [int8::<1>, int8::<2>, int8::<3>, int8::<4>],
    prepass,
    exact,
    exact_bf16: None,
    decode,
    micro,
    quantize,
    amx_int8: false,
    int8_wide: true,
};

/// The same kernels with the small-M int8 GEMV unpacking through GFNI ([`unpack_gfni`]).
const KERNELS_GFNI: Kernels = Kernels {
    int8: [
        int8_gfni::<1>,
        int8_gfni::<2>,
        int8_gfni::<3>,
        int8_gfni::<4>,
    ],
    ..KERNELS
};

/// Plus the `vdpbf16ps` GEMV for bf16 activations (CPUs with AVX512_BF16).
const KERNELS_BF16: Kernels = Kernels {
    exact_bf16: Some(exact_bf16),
    ..KERNELS
};

const KERNELS_BF16_GFNI: Kernels = Kernels {
    exact_bf16: Some(exact_bf16),
    ..KERNELS_GFNI
};

/// The bf16 + GFNI set with AMX-INT8 tiles for the int8 modes from [`super::AMX_MIN_M`] tokens
/// (`super::amx`; every AMX CPU has AVX512_BF16 and GFNI, and `amx::is_supported` checks both).
pub(crate) const KERNELS_AMX: Kernels = Kernels {
    amx_int8: true,
    ..KERNELS_BF16_GFNI
};

/// The AVX-512 set for this CPU (the caller checked [`is_supported`]): with `vdpbf16ps` where present
/// (Cooper Lake, Zen 4, Sapphire Rapids) and the GFNI unpack where it pays ([`gfni_unpack_pays`]).
pub(crate) fn kernels() -> &'static Kernels {
    match (has_bf16_dot(), gfni_unpack_pays()) {
        (true, true) => &KERNELS_BF16_GFNI,
        (true, false) => &KERNELS_BF16,
        (false, true) => &KERNELS_GFNI,
        (false, false) => &KERNELS,
    }
}

pub(crate) fn has_bf16_dot() -> bool {
    is_x86_feature_detected!("avx512bf16")
}

pub(crate) fn has_gfni() -> bool {
    is_x86_feature_detected!("gfni")
}

/// Whether the small-M GEMV should unpack with GFNI ([`unpack_gfni`]) rather than shift + AND: on
/// Intel cores the 512-bit shifts share a port with `vpdpbusd` and GFNI saves a quarter of the
/// instructions (Sapphire Rapids, M = 1: 1–7 % faster from DRAM, 1–10 % from cache). On AMD's Zen 4
/// it is the other way round — `gf2p8affineqb` competes with `vpdpbusd` and the FMAs for the
/// multiply pipes, while shifts and ANDs go to the others — and the shift unpack is faster (EPYC
/// Zen 4, one thread, min of interleaved runs, 5120 → 17408 / 17408 → 5120 / 5120 → 6144: from cache
/// 84 → 90, 78 → 88, 86 → 95 G weights/s; from DRAM 68 → 72, 51 → 52, 66 → 66). Zen 5 (full-width
/// 512-bit units) is unmeasured and keeps the AMD choice.
pub(crate) fn gfni_unpack_pays() -> bool {
    has_gfni() && !is_amd()
}

/// Whether the CPU runs 512-bit instructions as two halves on 256-bit units: AMD's Zen 4 (family
/// 0x19; Zen 3, the same family, has no AVX-512). Zen 5 (0x1A) and Intel's AVX-512 cores have
/// full-width units.
pub(crate) fn half_width_512() -> bool {
    is_amd() && display_family(__cpuid(1).eax) == 0x19
}

/// The x86 display family of cpuid leaf 1's `eax`: the base family, plus the extended family where
/// the base is 0xF.
fn display_family(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xF;
    if base == 0xF {
        base + ((eax >> 20) & 0xFF)
    } else {
        base
    }
}

/// Whether the CPU vendor string (cpuid leaf 0) is AMD's.
fn is_amd() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(|| {
        let l0 = __cpuid(0);
        // "AuthenticAMD" as ebx, edx, ecx.
        (l0.ebx, l0.edx, l0.ecx) == (0x6874_7541, 0x6974_6E65, 0x444D_4163)
    })
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

/// Copy `bytes` (a multiple of 64) from `src` to the 64-byte aligned `dst` with non-temporal stores
/// (no read-for-ownership of the destination lines). The caller must `_mm_sfence` before another
/// thread reads `dst`. SAFETY: AVX-512F present; both ranges valid for `bytes`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn stream_lines(dst: *mut u8, src: *const u8, bytes: usize) {
    debug_assert!((dst as usize).is_multiple_of(64) && bytes.is_multiple_of(64));
    for o in (0..bytes).step_by(64) {
        // SAFETY: as the caller promises.
        unsafe { _mm512_stream_si512(dst.add(o).cast(), _mm512_loadu_si512(src.add(o).cast())) };
    }
}

/// f32 → bf16 bits, rounded to nearest even, NaN kept NaN with the quiet bit set: bit for bit
/// `half::bf16::from_f32` (the results of every kernel go through this; half's slice conversion is
/// scalar). Needs AVX-512F only.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn f32_to_bf16(src: &[f32], dst: &mut [half::bf16]) {
    assert_eq!(src.len(), dst.len());
    let whole = src.len() / 16 * 16;
    let (one, round, abs, inf, quiet) = (
        _mm512_set1_epi32(1),
        _mm512_set1_epi32(0x7FFF),
        _mm512_set1_epi32(0x7FFF_FFFF),
        _mm512_set1_epi32(0x7F80_0000),
        _mm512_set1_epi32(0x0040_0000),
    );
    for i in (0..whole).step_by(16) {
        // SAFETY: i + 16 ≤ len for both slices.
        unsafe {
            let x = _mm512_loadu_si512(src.as_ptr().add(i).cast());
            // x + 0x7FFF + (bit 16 of x): carries into bit 16 exactly when RNE rounds up.
            let up = _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32::<16>(x), one));
            let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs), inf);
            let r = _mm512_mask_mov_epi32(_mm512_add_epi32(x, up), nan, _mm512_or_si512(x, quiet));
            let h = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(r));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
        }
    }
    for (d, &v) in dst[whole..].iter_mut().zip(&src[whole..]) {
        *d = half::bf16::from_f32(v);
    }
}

/// Byte codes of sub-vector `i` (0..4) of a loaded 64-byte chunk.
#[inline(always)]
pub(crate) unsafe fn unpack(w: __m512i, i: usize, mask: __m512i) -> __m512i {
    // A 16-bit shift moves bits across the byte boundary; the AND drops them again.
    match i {
        0 => _mm512_and_si512(w, mask),
        1 => _mm512_and_si512(_mm512_srli_epi16::<2>(w), mask),
        2 => _mm512_and_si512(_mm512_srli_epi16::<4>(w), mask),
        _ => _mm512_and_si512(_mm512_srli_epi16::<6>(w), mask),
    }
}

/// Software prefetch distance of the int8 GEMV in the weight stream. The hardware prefetchers alone
/// left a DRAM-bound M = 1 at 21–26 G weights/s on one thread; 2 KiB ahead gave 31, 4 KiB 30–41,
/// 8 KiB 27–34 (5120 → 17408 and 2048 → 12288, same run). On EPYC Zen 4 (~30 GB/s on one thread)
/// 2, 4, 8 and 12 KiB were within noise of each other.
pub(crate) const PREFETCH_BYTES: usize = 4096;

#[inline(always)]
unsafe fn load_chunk(block: *const u8, sb: usize, r: usize) -> __m512i {
    unsafe { _mm512_loadu_si512(block.add((sb * ROWS + r) * CHUNK_BYTES).cast()) }
}

/// The int8 GEMV of one row block against `T` tokens (`T ≤ INT8_TILE`), unpacking with shifts.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")]
pub(crate) unsafe fn int8<const T: usize>(a: &Int8Tile<'_>) -> [[f32; ROWS]; INT8_TILE] {
    // SAFETY: the caller's promise (CPU features, `Int8Tile` lengths) is the body's.
    unsafe { int8_body::<T, false>(a) }
}

/// The same with [`unpack_gfni`]: bit for bit the same results (the codes are the same integers).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,gfni")]
pub(crate) unsafe fn int8_gfni<const T: usize>(a: &Int8Tile<'_>) -> [[f32; ROWS]; INT8_TILE] {
    // SAFETY: as for `int8`, plus GFNI (in this function's features).
    unsafe { int8_body::<T, true>(a) }
}

/// Byte codes of sub-vector `i` (1..4) in one `gf2p8affineqb` instead of a 16-bit shift and an AND:
/// the M = 1 GEMV issues about 8 vector instructions per 128 weights and row, and on Intel cores the
/// 512-bit shifts compete with `vpdpbusd` for the same port, so this is a quarter fewer instructions
/// (Sapphire Rapids, M = 1: 1–7 % faster from DRAM, 1–10 % from cache; not on Zen 4:
/// [`gfni_unpack_pays`]). Matrix byte `7 − j` selects the input bits of result
/// bit `j`: bit 0 ← bit 2i, bit 1 ← bit 2i + 1, the rest 0. (Sub-vector 0 is a single AND already.)
#[inline(always)]
unsafe fn unpack_gfni(w: __m512i, i: usize) -> __m512i {
    let m = ((1u64 << (2 * i)) << 56) | ((2u64 << (2 * i)) << 48);
    // SAFETY: callers are compiled with GFNI (`int8_gfni`).
    unsafe { _mm512_gf2p8affine_epi64_epi8::<0>(w, _mm512_set1_epi64(m as i64)) }
}

/// [`unpack`], or [`unpack_gfni`] for the sub-vectors that need a shift when `GF`.
#[inline(always)]
unsafe fn unpack_codes<const GF: bool>(w: __m512i, i: usize, mask: __m512i) -> __m512i {
    // SAFETY: as the caller's (`GF` only inside `int8_gfni`).
    unsafe {
        if GF && i > 0 {
            unpack_gfni(w, i)
        } else {
            unpack(w, i, mask)
        }
    }
}

/// One row block (4 rows) per pass over the tokens' activations, the weight read front to back.
///
/// At one token the rate falls with K (EPYC Zen 4, one thread: K = 5120 95 G weights/s, 8192 82,
/// 12288 65, 17408 57) with the weight read from DRAM; from L3, 17408 → 5120 runs 93–95 like the
/// 5120-wide shapes. Confining the activations to 4 KiB gave 75 at 17408, so the activations'
/// L1 residency is most of that gap. What did not close it, measured and reverted:
/// K panels across row blocks (2× slower: the weight is no longer one sequential stream), software
/// prefetch of the activations (5–8 % slower), NTA prefetch of the weights (no change), and eight
/// rows per pass (two blocks as two streams, each activation vector loaded once per eight rows):
/// the same 56 G weights/s at 17408 → 5120 from DRAM, and half the rate at K = 5120 from DRAM.
#[inline(always)]
unsafe fn int8_body<const T: usize, const GF: bool>(a: &Int8Tile<'_>) -> [[f32; ROWS]; INT8_TILE] {
    let kp = a.block.len();
    let g = a.group_size;
    let gp = kp / g;
    let gshift = g.trailing_zeros(); // group sizes are powers of two: no division per 128 weights
    assert!(kp.is_multiple_of(SUPER_K) && a.cs.len() >= T * gp * ROWS);
    assert!(a.x.iter().take(T).all(|x| x.len() >= kp));
    let bp = a.block.as_ptr();
    let cs = a.cs.as_ptr();
    let xp: [*const i8; T] = std::array::from_fn(|t| a.x[t].as_ptr());
    let mask = _mm512_set1_epi8(3);
    let zero = _mm512_setzero_si512();
    let mut facc = [[_mm512_setzero_ps(); ROWS]; T];
    // The scaled-code path and its ×64 accumulators (unused, and optimized away, otherwise).
    let scaled = g >= 128 && T <= SCALED_MAX_T;
    let mut facc64 = [[_mm512_setzero_ps(); ROWS]; T];
    // Combined scale of (token t, group gi, row r): the FMA's broadcast operand.
    let scale = |t: usize, gi: usize, r: usize| -> __m512 {
        // SAFETY: t < T, gi < gp (asserted length above).
        unsafe { _mm512_set1_ps(*cs.add((t * gp + gi) * ROWS + r)) }
    };
    for sb in 0..kp / SUPER_K {
        // SAFETY (whole loop): sb < Kp/256, so the four 64-byte chunks and the x bytes
        // 256·sb .. 256·sb + 256 of every token are in bounds (asserts above).
        unsafe {
            let w: [__m512i; ROWS] = std::array::from_fn(|r| load_chunk(bp, sb, r));
            // The weight is one stream: ask for the lines PREFETCH_BYTES ahead (past this block's end
            // they are the next block's; a prefetch never faults).
            let ahead = bp.wrapping_add(sb * ROWS * CHUNK_BYTES + PREFETCH_BYTES);
            for r in 0..ROWS {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(r * CHUNK_BYTES).cast());
            }
            let k_sb = sb * SUPER_K;
            if scaled {
                // Scaled codes (see `scaled_codes`): 4·c for sub-vectors 0 and 1, 64·c for 2 and 3,
                // into the ×4 and ×64 accumulators.
                for r in 0..ROWS {
                    let [c0, c1, c2, c3] = scaled_codes::<GF>(w[r]);
                    for (half, (ca, cb)) in [(c0, c1), (c2, c3)].into_iter().enumerate() {
                        let k0 = k_sb + half * 128;
                        let gi = k0 >> gshift;
                        for t in 0..T {
                            let x0 = _mm512_loadu_si512(xp[t].add(k0).cast());
                            let x1 = _mm512_loadu_si512(xp[t].add(k0 + SUB_K).cast());
                            let i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, ca, x0), cb, x1);
                            let acc = if half == 0 {
                                &mut facc[t][r]
                            } else {
                                &mut facc64[t][r]
                            };
                            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale(t, gi, r), *acc);
                        }
                    }
                }
            } else if g >= 128 {
                // Scale units of 128 weights (two sub-vectors; g = 256 uses one scale for both).
                for half in 0..2 {
                    let k0 = k_sb + half * 128;
                    let gi = k0 >> gshift;
                    for r in 0..ROWS {
                        let c0 = unpack_codes::<GF>(w[r], 2 * half, mask);
                        let c1 = unpack_codes::<GF>(w[r], 2 * half + 1, mask);
                        for t in 0..T {
                            let x0 = _mm512_loadu_si512(xp[t].add(k0).cast());
                            let x1 = _mm512_loadu_si512(xp[t].add(k0 + SUB_K).cast());
                            let i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, c0, x0), c1, x1);
                            facc[t][r] =
                                _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale(t, gi, r), facc[t][r]);
                        }
                    }
                }
            } else {
                for sub in 0..4 {
                    let k0 = k_sb + sub * SUB_K;
                    for r in 0..ROWS {
                        let c = unpack_codes::<GF>(w[r], sub, mask);
                        for t in 0..T {
                            let x = _mm512_loadu_si512(xp[t].add(k0).cast());
                            let i = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, c, x));
                            let s = if g == 64 {
                                scale(t, k0 / 64, r)
                            } else {
                                // g = 32: lanes 0..8 summed weights k0..k0+32, lanes 8..16 the next group.
                                let gi = k0 / 32;
                                _mm512_insertf32x8::<1>(
                                    scale(t, gi, r),
                                    _mm512_castps512_ps256(scale(t, gi + 1, r)),
                                )
                            };
                            facc[t][r] = _mm512_fmadd_ps(i, s, facc[t][r]);
                        }
                    }
                }
            }
        }
    }
    let mut out = [[0f32; ROWS]; INT8_TILE];
    for t in 0..T {
        for r in 0..ROWS {
            out[t][r] = if scaled {
                // Exact powers of two: the sums of 4·c·x and 64·c·x back at the codes' scale.
                _mm512_reduce_add_ps(facc[t][r]) * 0.25
                    + _mm512_reduce_add_ps(facc64[t][r]) * (1.0 / 64.0)
            } else {
                _mm512_reduce_add_ps(facc[t][r])
            };
        }
    }
    out
}

/// Token counts up to which the int8 GEMV (g ≥ 128) uses [`scaled_codes`]: each token needs a
/// second set of `ROWS` accumulators. Measured at one token (5–13 % faster on Zen 4) and two (no
/// change); three would need 24 accumulators beside the codes and is left on the plain path, unmeasured.
const SCALED_MAX_T: usize = 2;

/// The codes of a 64-byte chunk's four sub-vectors, scaled so that one 16-bit shift serves all four:
/// `4·c` for sub-vectors 0 and 1 (bits 2–3 of `w << 2` and of `w`), `64·c` for 2 and 3 (bits 6–7 of
/// the same). `vpdpbusd` sums them exactly (products ≤ 192 · 128 fit its 16-bit intermediates), and
/// the sums stay exact in f32 (|64 · Σ_128 c·x| ≤ 64 · 128 · 3 · 128 < 2²⁴), so scaling the two
/// accumulators by ¼ and ¹⁄₆₄ at the end is exact: one shift and four ANDs instead of three shifts and
/// four ANDs per chunk (on Zen 4 the 512-bit shifts, like `vpdpbusd`, run on only two of the four
/// vector pipes). With `GF` the two shifted codes are one `gf2p8affineqb` each (bit for bit the same).
#[inline(always)]
unsafe fn scaled_codes<const GF: bool>(w: __m512i) -> [__m512i; 4] {
    // SAFETY: AVX-512 BW everywhere; `GF` only inside `int8_gfni` (GFNI).
    unsafe {
        let (lo, hi) = (_mm512_set1_epi8(0x0C), _mm512_set1_epi8(0xC0u8 as i8));
        let (c0, c2) = if GF {
            // Matrix byte 7 − j selects the input bits of result bit j: 2 ← 0, 3 ← 1; 6 ← 4, 7 ← 5.
            let m0 = (1u64 << 40) | (2u64 << 32);
            let m2 = (0x10u64 << 8) | 0x20;
            (
                _mm512_gf2p8affine_epi64_epi8::<0>(w, _mm512_set1_epi64(m0 as i64)),
                _mm512_gf2p8affine_epi64_epi8::<0>(w, _mm512_set1_epi64(m2 as i64)),
            )
        } else {
            // Bits pushed into the next byte land below bit 2 and are masked off.
            let s = _mm512_slli_epi16::<2>(w);
            (_mm512_and_si512(s, lo), _mm512_and_si512(s, hi))
        };
        [c0, _mm512_and_si512(w, lo), c2, _mm512_and_si512(w, hi)]
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
unsafe fn prepass(scales: &[f16], xs4: &[f32], qsum4: &[f32], cs: &mut [f32]) -> [f32; ROWS] {
    let n = cs.len();
    assert!(scales.len() >= n && xs4.len() >= n && qsum4.len() >= n);
    let mut corr = _mm512_setzero_ps();
    for i in (0..n).step_by(16) {
        let m: __mmask16 = if n - i >= 16 {
            0xFFFF
        } else {
            (1u16 << (n - i)) - 1
        };
        // SAFETY: masked loads/stores touch only indices < n (all slices are ≥ n long).
        unsafe {
            let s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scales.as_ptr().add(i).cast()));
            let c = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, xs4.as_ptr().add(i)));
            _mm512_mask_storeu_ps(cs.as_mut_ptr().add(i), m, c);
            corr = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(m, qsum4.as_ptr().add(i)), corr);
        }
    }
    let v: [f32; 16] = std::mem::transmute(corr);
    std::array::from_fn(|r| (v[r] + v[r + 4]) + (v[r + 8] + v[r + 12]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
unsafe fn exact(block: &[u8], scales: &[f16], x: &[f32], g: usize) -> [f32; ROWS] {
    let kp = block.len();
    assert!(kp.is_multiple_of(SUPER_K) && x.len() >= kp && scales.len() * g >= kp * ROWS);
    // Group sizes are powers of two: masks and shifts, not a division per 16 or 32 weights.
    let gshift = g.trailing_zeros();
    let bp = block.as_ptr();
    let xp = x.as_ptr();
    let mask = _mm512_set1_epi8(3);
    let one = _mm512_set1_epi8(1);
    let zero = _mm512_setzero_ps();
    let mut total = [zero; ROWS];
    let mut group = [zero; ROWS];
    let mut trits = [[0i8; SUB_K]; ROWS];
    for sb in 0..kp / SUPER_K {
        // SAFETY (whole loop): chunk and x offsets are inside Kp (asserts above); `trits` is 64 bytes
        // per row and read 16 at a time.
        unsafe {
            let w: [__m512i; ROWS] = std::array::from_fn(|r| load_chunk(bp, sb, r));
            for sub in 0..4 {
                for r in 0..ROWS {
                    let t = _mm512_sub_epi8(unpack(w[r], sub, mask), one);
                    _mm512_storeu_si512(trits[r].as_mut_ptr().cast(), t);
                }
                let k0 = sb * SUPER_K + sub * SUB_K;
                for piece in 0..4 {
                    let k = k0 + 16 * piece;
                    let xv = _mm512_loadu_ps(xp.add(k));
                    for r in 0..ROWS {
                        let t8 = _mm_loadu_si128(trits[r].as_ptr().add(16 * piece).cast());
                        let tf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(t8));
                        group[r] = _mm512_fmadd_ps(tf, xv, group[r]);
                    }
                    if (k + 16) & (g - 1) == 0 {
                        let gi = k >> gshift;
                        for r in 0..ROWS {
                            let s = _mm512_set1_ps(scales[gi * ROWS + r].to_f32());
                            total[r] = _mm512_fmadd_ps(group[r], s, total[r]);
                            group[r] = zero;
                        }
                    }
                }
            }
        }
    }
    total.map(|t| _mm512_reduce_add_ps(t))
}

/// bf16 activations: 32 weights become bf16 ±1/0 through a `vpermw` table, then one `vdpbf16ps` adds
/// `t·x` pairwise into f32 lanes — products are exact, sums are f32 (the instruction rounds each of its
/// two additions to nearest-even and treats subnormal inputs and results as zero, i.e. |x| below 2⁻¹²⁶
/// counts as 0).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,f16c")]
unsafe fn exact_bf16(block: &[u8], scales: &[f16], x: &[u16], g: usize) -> [f32; ROWS] {
    let kp = block.len();
    assert!(kp.is_multiple_of(SUPER_K) && x.len() >= kp && scales.len() * g >= kp * ROWS);
    // Group sizes are powers of two: masks and shifts, not a division per 16 or 32 weights.
    let gshift = g.trailing_zeros();
    let bp = block.as_ptr();
    let xp = x.as_ptr();
    let mask = _mm512_set1_epi8(3);
    // word table indexed by the code: 0 → bf16 −1.0, 1 → 0, 2 → bf16 +1.0
    let table = _mm512_setr_epi32(
        0x0000_BF80u32 as i32,
        0x3F80,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    );
    let zero = _mm512_setzero_ps();
    let mut total = [zero; ROWS];
    let mut group = [zero; ROWS];
    for sb in 0..kp / SUPER_K {
        // SAFETY (whole loop): chunk and x offsets are inside Kp (asserts above).
        unsafe {
            let w: [__m512i; ROWS] = std::array::from_fn(|r| load_chunk(bp, sb, r));
            for sub in 0..4 {
                let k0 = sb * SUPER_K + sub * SUB_K;
                for h in 0..2 {
                    let k = k0 + 32 * h;
                    let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(xp.add(k).cast()));
                    for r in 0..ROWS {
                        let c = unpack(w[r], sub, mask);
                        let half = if h == 0 {
                            _mm512_castsi512_si256(c)
                        } else {
                            _mm512_extracti64x4_epi64::<1>(c)
                        };
                        let tw = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(half), table);
                        group[r] = _mm512_dpbf16_ps(
                            group[r],
                            std::mem::transmute::<__m512i, __m512bh>(tw),
                            xv,
                        );
                    }
                    if (k + 32) & (g - 1) == 0 {
                        let gi = k >> gshift;
                        for r in 0..ROWS {
                            let s = _mm512_set1_ps(scales[gi * ROWS + r].to_f32());
                            total[r] = _mm512_fmadd_ps(group[r], s, total[r]);
                            group[r] = zero;
                        }
                    }
                }
            }
        }
    }
    total.map(|t| _mm512_reduce_add_ps(t))
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
unsafe fn decode(
    block: &[u8],
    scales: &[f16],
    g: usize,
    k0: usize,
    out: &mut [f32],
    stride: usize,
) {
    let kc = super::decode_span(block, scales, g, k0, out, stride);
    let gshift = g.trailing_zeros();
    let bp = block.as_ptr();
    let mask = _mm512_set1_epi8(3);
    let one = _mm512_set1_epi8(1);
    let mut trits = [0i8; SUB_K];
    for r in 0..ROWS {
        for sb in k0 / SUPER_K..(k0 + kc) / SUPER_K {
            // SAFETY: sb < Kp/256 (assert); out offsets r·stride + (k − k0) + 16 ≤ out.len().
            unsafe {
                let w = load_chunk(bp, sb, r);
                for sub in 0..4 {
                    let t = _mm512_sub_epi8(unpack(w, sub, mask), one);
                    _mm512_storeu_si512(trits.as_mut_ptr().cast(), t);
                    for piece in 0..4 {
                        let k = sb * SUPER_K + sub * SUB_K + 16 * piece;
                        let s = _mm512_set1_ps(scales[(k >> gshift) * ROWS + r].to_f32());
                        let t8 = _mm_loadu_si128(trits.as_ptr().add(16 * piece).cast());
                        let v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(t8)), s);
                        _mm512_storeu_ps(out.as_mut_ptr().add(r * stride + k - k0), v);
                    }
                }
            }
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

/// max |x| over 16-lane pieces as integer max of the absolute bit patterns: for non-negative floats
/// the integer order is the float order, and NaN patterns sort above Inf, so a NaN is never dropped.
#[inline(always)]
unsafe fn abs_bits_max(x: *const f32, n: usize) -> u32 {
    let abs = _mm512_set1_epi32(0x7FFF_FFFF);
    let mut m = _mm512_setzero_si512();
    for i in (0..n).step_by(16) {
        // SAFETY: the caller passes n (a multiple of 16) readable floats.
        let v = unsafe { _mm512_loadu_si512(x.add(i).cast()) };
        m = _mm512_max_epu32(m, _mm512_and_si512(v, abs));
    }
    _mm512_reduce_max_epu32(m)
}

/// Bit-for-bit [`super::quant::quantize_row`] (`vcvtps2dq` rounds half to even under the default MXCSR).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
unsafe fn quantize(
    x: &[f32],
    q: &mut [i8],
    g: usize,
    per_token: bool,
    xs4: &mut [f32],
    qsum4: &mut [f32],
) {
    use super::quant::{quantize_groups, INT8_MAX};
    let hi = _mm512_set1_epi32(INT8_MAX as i32);
    let lo = _mm512_set1_epi32(if per_token { -128 } else { -(INT8_MAX as i32) });
    assert!(q.len() >= x.len() && g.is_multiple_of(16));
    let (xp, qp) = (x.as_ptr(), q.as_mut_ptr());
    // SAFETY (both closures): quantize_groups asks for x[from .. from + n] and group gi's g values of x
    // and q, inside the slices it checked.
    let amax = |from: usize, n: usize| f32::from_bits(unsafe { abs_bits_max(xp.add(from), n) });
    let group = |gi: usize, mul: f32| -> i32 {
        unsafe {
            let (xg, qg) = (xp.add(gi * g), qp.add(gi * g));
            let mulv = _mm512_set1_ps(mul);
            let mut sum = _mm512_setzero_si512();
            for i in (0..g).step_by(16) {
                let v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg.add(i)), mulv));
                // NaN · 0 converts to the "integer indefinite" 0x80000000: the clamp makes it −128/−127,
                // but such a group's scale is NaN, so its value never matters — match the scalar 0 anyway.
                let v = _mm512_mask_blend_epi32(
                    _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(i32::MIN)),
                    v,
                    _mm512_setzero_si512(),
                );
                let v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
                sum = _mm512_add_epi32(sum, v);
                _mm_storeu_si128(qg.add(i).cast(), _mm512_cvtepi32_epi8(v));
            }
            _mm512_reduce_add_epi32(sum)
        }
    };
    quantize_groups(x, g, per_token, xs4, qsum4, amax, group);
}

#[cfg(test)]
mod family_tests {
    use super::display_family;

    #[test]
    fn display_family_of_known_signatures() {
        assert_eq!(display_family(0x00A1_0F11), 0x19); // EPYC 9004 (Genoa, Zen 4)
        assert_eq!(display_family(0x00B0_0F21), 0x1A); // EPYC 9005 (Turin, Zen 5)
        assert_eq!(display_family(0x0083_0F10), 0x17); // EPYC 7002 (Rome, Zen 2)
        assert_eq!(display_family(0x0008_06F8), 6); // Xeon 4th gen (Sapphire Rapids)
    }
}
