//! The rows-in-lanes layout's kernels ([`Layout::Lanes16`](super::layout::Layout)): 16 rows per vector,
//! every M from one token up, the weight read once per call and unpacked once per pass of up to
//! [`MAX_T`] tokens; [`int8`] for the int8 modes, [`exact`] for the exact ones.
//!
//! [`wide`](super::wide) runs the same arithmetic on the 4-row layout, but has to transpose every
//! 16-row × 512-column chunk into this arrangement first (a 16 × 16 transpose of 32-bit words per
//! 1 KiB of codes, stored to an L1 buffer and loaded back: ~14 cycles per 64 bytes of codes on Zen 5,
//! as much as 28 `vpdpbusd`); and the 4-row GEMV below 4 tokens needs an f32 epilogue per row and
//! group (one conversion and FMA per two `vpdpbusd` at g = 128). Prepared in lanes, a line is one
//! load, a 16-bit shift and an AND per 4 columns of 16 rows, and the epilogue is per 16 rows.
//!
//! Per 16-row group and weight group, for each token `t` of a pass of up to [`MAX_T`]: the int32 sum
//! starts at `−Σq` (removing the `+1` of the codes in the integers) and adds `vpdpbusd(codes, q)`
//! with the token's 4 codes broadcast; then `v = fma(f32(Σ t·q), f32(s) · xs, v)`, group after group
//! from 0 — the numerics of [`wide`](super::wide) and of the AMX path, bit for bit, at every M (a
//! token's result does not depend on the batch it is in). [`reference`] is the same in plain Rust
//! (the fallback on CPUs without AVX-512 VNNI and what the SIMD kernel is tested against).

// Register arrays (per row group, per token) are indexed in lockstep; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use half::f16;

use super::layout::{lanes_code, padded_cols, padded_groups, Layout, LANE_ROWS, LINE_K};
use super::PreparedRef;

/// Most tokens one pass over a row group handles (an int32 sum and an f32 total per token in registers).
/// More tokens take more passes, the row group's codes then read again from L2. (Two row groups per
/// pass, each broadcast feeding two `vpdpbusd`, as `wide.rs` does from 16 tokens: 0-8 % slower here —
/// Zen 5, 27B shapes, M = 8 and 16, one and two threads.)
pub const MAX_T: usize = 8;

/// Per token and weight group, what the rows-in-lanes kernels (these and `wide`) need of the quantized
/// activations: `−Σq` and `xs`, `[m][Gp]` (the codes themselves are the quantizer's rows, `m · Kp`).
/// Kept per thread.
#[derive(Default)]
pub(crate) struct Tokens {
    pub neg_qsum: Vec<i32>,
    pub xs: Vec<f32>,
    pub gp: usize,
}

impl Tokens {
    /// Refill from the quantizer's `xs4` and `qsum4` (`m · Gp · 4`, each value repeated 4 times).
    pub fn fill(&mut self, xs4: &[f32], qsum4: &[f32], m: usize, gp: usize) {
        let rep = super::ROWS;
        assert!(xs4.len() >= m * gp * rep && qsum4.len() >= m * gp * rep);
        self.gp = gp;
        self.neg_qsum.clear();
        self.xs.clear();
        for i in 0..m * gp {
            // Σq of a group is an integer of at most 256 · 128 in magnitude: exact in f32.
            self.neg_qsum.push(-(qsum4[i * rep] as i32));
            self.xs.push(xs4[i * rep]);
        }
    }
}

/// Codes and scales of row group `grp` of a rows-in-lanes weight.
pub(crate) fn group<'a>(w: &PreparedRef<'a>, grp: usize) -> (&'a [u8], &'a [f16]) {
    debug_assert_eq!(w.layout, Layout::Lanes16);
    let unit = Layout::Lanes16.unit_bytes(w.cols);
    let su = padded_groups(w.cols, w.group_size) * LANE_ROWS;
    (
        &w.planes[grp * unit..(grp + 1) * unit],
        &w.scales[grp * su..(grp + 1) * su],
    )
}

/// `out[t][n]` (`m` lines) of the int8 modes for the 16 rows of row group `grp` of the checked weight
/// `w` and all `m` tokens (`q`: `m · Kp` codes): the AVX-512 VNNI kernel where `simd` (the caller
/// checked the CPU: `Kernels::int8_wide`), else [`reference`] — the same numbers, bit for bit.
pub(crate) fn int8(
    w: &PreparedRef<'_>,
    grp: usize,
    q: &[i8],
    tokens: &Tokens,
    m: usize,
    simd: bool,
    out: &mut Vec<[f32; LANE_ROWS]>,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        return simd::int8(w, grp, q, tokens, m, out);
    }
    let _ = simd;
    reference(w, grp, q, tokens, m, out);
}

/// `out[t][n]` of the exact modes for row group `grp` and all `m` tokens (`x`: `m` rows of `Kp` f32, zero
/// padded): the AVX-512 kernel where `simd` (AVX-512F / F16C, as `Kernels::int8_wide` implies), else
/// [`reference_exact`] — the same numbers, bit for bit.
pub(crate) fn exact(
    w: &PreparedRef<'_>,
    grp: usize,
    x: &[f32],
    m: usize,
    simd: bool,
    out: &mut Vec<[f32; LANE_ROWS]>,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        return simd::exact(w, grp, x, m, out);
    }
    let _ = simd;
    reference_exact(w, grp, x, m, out);
}

/// Token passes of a call of `m` tokens: `(first token, tokens)`, at most [`MAX_T`] each, as even as
/// possible (9 tokens: 5 + 4, not 8 + 1).
fn passes(m: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = m.div_ceil(m.div_ceil(MAX_T).max(1)).max(1);
    (0..m).step_by(per).map(move |m0| (m0, per.min(m - m0)))
}

/// The plain int8 kernel: `out[t][n]` for the 16 rows of row group `grp` and all `m` tokens (`q`:
/// `m · Kp` codes), with the SIMD kernel's numerics (see the module docs).
pub(crate) fn reference(
    w: &PreparedRef<'_>,
    grp: usize,
    q: &[i8],
    tokens: &Tokens,
    m: usize,
    out: &mut Vec<[f32; LANE_ROWS]>,
) {
    let (kp, g, gp) = (padded_cols(w.cols), w.group_size, tokens.gp);
    let (codes, scales) = group(w, grp);
    out.clear();
    for t in 0..m {
        let mut v = [0f32; LANE_ROWS];
        for (n, vn) in v.iter_mut().enumerate() {
            for gi in 0..gp {
                let mut sum = tokens.neg_qsum[t * gp + gi];
                for k in gi * g..(gi + 1) * g {
                    sum += lanes_code(codes, n, k) as i32 * q[t * kp + k] as i32;
                }
                let cs = scales[gi * LANE_ROWS + n].to_f32() * tokens.xs[t * gp + gi];
                *vn = (sum as f32).mul_add(cs, *vn);
            }
        }
        out.push(v);
    }
}

/// The exact modes on a rows-in-lanes weight, plain: `out[t][n] = Σ_g s · Σ_{k∈g} t·x` for row group
/// `grp`, `x`: `m` rows of `Kp` f32 (zero padded). Per group `sum = fma(t, x, sum)` in column order (the
/// product is exact, so this is `sum ± x`; a NaN or infinite x reaches the sum through `t = 0` too, as
/// in a dense product), then `total = fma(sum, s, total)`: the SIMD kernel's numbers, bit for bit.
pub(crate) fn reference_exact(
    w: &PreparedRef<'_>,
    grp: usize,
    x: &[f32],
    m: usize,
    out: &mut Vec<[f32; LANE_ROWS]>,
) {
    let (kp, g) = (padded_cols(w.cols), w.group_size);
    let gp = padded_groups(w.cols, g);
    let (codes, scales) = group(w, grp);
    out.clear();
    for t in 0..m {
        let xt = &x[t * kp..(t + 1) * kp];
        let v: [f32; LANE_ROWS] = std::array::from_fn(|n| {
            let mut total = 0f32;
            for gi in 0..gp {
                let mut sum = 0f32;
                for k in gi * g..(gi + 1) * g {
                    let trit = lanes_code(codes, n, k) as f32 - 1.0;
                    sum = trit.mul_add(xt[k], sum);
                }
                total = sum.mul_add(scales[gi * LANE_ROWS + n].to_f32(), total);
            }
            total
        });
        out.push(v);
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;

    use super::*;
    use crate::canonical::GROUP_SIZES;
    use crate::kernels::cpu::layout::LINE_BYTES;

    /// Software prefetch distance in each row group's stream of lines.
    const STREAM_AHEAD: usize = 4096;

    /// [`super::int8`] on AVX-512 VNNI (the caller checked the CPU).
    pub(super) fn int8(
        w: &PreparedRef<'_>,
        grp: usize,
        q: &[i8],
        tokens: &Tokens,
        m: usize,
        out: &mut Vec<[f32; LANE_ROWS]>,
    ) {
        let (kp, gp) = (padded_cols(w.cols), padded_groups(w.cols, w.group_size));
        assert_eq!(w.layout, Layout::Lanes16);
        // A tile function per canonical group size (each a whole number of line pairs).
        let by_group = GROUP_SIZES.iter().position(|&g| g == w.group_size);
        let fns = &TILE_FNS[by_group.expect("a canonical group size (checked with the weight)")];
        assert!(tokens.gp == gp && tokens.xs.len() >= m * gp && tokens.neg_qsum.len() >= m * gp);
        assert!(q.len() >= m * kp && grp < Layout::Lanes16.units(w.rows));
        let (codes, scales) = group(w, grp);
        out.clear();
        out.resize(m, [0.0; LANE_ROWS]);
        for (m0, t) in passes(m) {
            let args = Tile {
                codes: codes.as_ptr(),
                scales: scales.as_ptr(),
                gp,
                kp,
                q: q.as_ptr(),
                neg_qsum: tokens.neg_qsum.as_ptr(),
                xs: tokens.xs.as_ptr(),
                m0,
                tot: out[m0..].as_mut_ptr().cast(),
            };
            // SAFETY: the caller checked AVX-512 VNNI; every pointer covers what `Tile` says (asserted
            // sizes: the row group's 4·Kp code bytes and Gp·16 scales, tokens m0 .. m0 + t ≤ m of Kp
            // codes and Gp sums / scales, t output lines from m0).
            unsafe { fns[t - 1](&args) };
        }
    }

    /// One pass of `T` tokens (`m0 ..`) over a row group.
    struct Tile {
        /// The row group's `4 · Kp` code bytes.
        codes: *const u8,
        /// The row group's `[Gp][16]` scales.
        scales: *const f16,
        gp: usize,
        kp: usize,
        /// Codes, `[m][Kp]`.
        q: *const i8,
        /// `[m][Gp]`.
        neg_qsum: *const i32,
        /// `[m][Gp]`.
        xs: *const f32,
        m0: usize,
        /// `[T][16]` f32 totals of tokens m0 ...
        tot: *mut f32,
    }

    /// Per group size and token count, its tile: the lines of a weight group a constant, so each group's
    /// lines are one straight run of loads and `vpdpbusd` and the loop around them a pointer step. (With
    /// the count known only at run time, the loop bounds took ~40 scalar instructions per 128-weight group
    /// beside the 80 of its lines.)
    const TILE_FNS: [[unsafe fn(&Tile); MAX_T]; GROUP_SIZES.len()] = [
        tile_fns::<{ GROUP_SIZES[0] / LINE_K }>(),
        tile_fns::<{ GROUP_SIZES[1] / LINE_K }>(),
        tile_fns::<{ GROUP_SIZES[2] / LINE_K }>(),
        tile_fns::<{ GROUP_SIZES[3] / LINE_K }>(),
    ];

    const _: () = {
        let mut i = 0;
        while i < GROUP_SIZES.len() {
            assert!(
                GROUP_SIZES[i].is_multiple_of(2 * LINE_K),
                "whole line pairs per group"
            );
            i += 1;
        }
    };

    const fn tile_fns<const LINES: usize>() -> [unsafe fn(&Tile); MAX_T] {
        [
            tile_in_place::<1, LINES>,
            tile_in_place::<2, LINES>,
            tile::<3, LINES>,
            tile::<4, LINES>,
            tile::<5, LINES>,
            tile::<6, LINES>,
            tile::<7, LINES>,
            tile::<8, LINES>,
        ]
    }
    const _: () = assert!(
        IN_PLACE_MAX_T == 2,
        "tile_fns picks the in-place tile for 1 and 2 tokens"
    );

    /// A line's byte codes for its four sub-steps: `line & 3` and `(line >> 4) & 3` (sub-steps 0 and 2),
    /// `line & 12` and `(line >> 4) & 12` (sub-steps 1 and 3, each code times 4, in place): one shift and
    /// four ANDs. (A 16-bit shift moves bits across the byte boundary; the AND drops them again.)
    #[inline(always)]
    unsafe fn unpack(w: __m512i) -> [__m512i; 4] {
        let (low, in_place) = (_mm512_set1_epi8(3), _mm512_set1_epi8(12));
        let high = _mm512_srli_epi16::<4>(w);
        [
            _mm512_and_si512(w, low),
            _mm512_and_si512(w, in_place),
            _mm512_and_si512(high, low),
            _mm512_and_si512(high, in_place),
        ]
    }

    /// `p`, hidden from the optimizer: a pointer it cannot relate to the loop counter stays a base
    /// register of its own, so the broadcasts address `[base + disp]`. Derived from the counter, they
    /// became `[base + index · scale + disp]` (with per-line address arithmetic for each token), and an
    /// indexed memory operand costs `vpdpbusd` an extra issue slot on Intel cores (un-lamination): in a
    /// microbenchmark of the kernel's loop 264 against 272-275 G weight-tokens/s (Emerald Rapids), the same
    /// with one pointer per token or one for all.
    #[inline(always)]
    fn opaque<P>(mut p: *const P) -> *const P {
        // SAFETY: an empty template; the register passes through unchanged.
        unsafe {
            std::arch::asm!("/* {0} */", inout(reg) p, options(pure, readonly, nostack, preserves_flags));
        }
        p
    }

    /// Passes of up to this many tokens take the codes in place ([`tile_in_place`]), longer ones shifted
    /// ([`tile`]).
    const IN_PLACE_MAX_T: usize = 2;

    /// A pass of 3 or more tokens: per line the four sub-steps' codes (`unpack`), shared by every token;
    /// the odd sub-steps, whose codes are times 4, go to a second set of sums, shifted right by 2 and
    /// added in the integers at the epilogue (exact: each of their terms is a multiple of 4): twice the
    /// independent `vpdpbusd` chains. Zen 5, 27B shapes, one thread: M = 4 12-14 %, M = 8 3-4 %, M = 16
    /// 2-3 % faster than one chain per token (~85 % of the `vpdpbusd` issue rate at 8-16). Codes for the
    /// odd sub-steps taken in place (one shift per line instead of three): the kernel's group loop 3.6 %
    /// faster in a microbenchmark (Emerald Rapids, 274 → 284 G weight-tokens/s).
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn tile<const T: usize, const LINES: usize>(p: &Tile) {
        // SAFETY (whole body): the caller's pointers cover the row group (4·Kp code bytes, Gp·16
        // scales), tokens m0 .. m0 + T of q (Kp each), their groups (Gp each) and T total lines; line
        // reads stay below Kp / 16 lines; prefetches never fault.
        unsafe {
            // Each token's codes of the current line (see `opaque`).
            let mut x: [*const i8; T] = std::array::from_fn(|t| p.q.add((p.m0 + t) * p.kp));
            let mut tot: [__m512; T] = std::array::from_fn(|_| _mm512_setzero_ps());
            let mut at = p.codes;
            for gi in 0..p.gp {
                let mut acc: [__m512i; T] = std::array::from_fn(|t| {
                    _mm512_set1_epi32(*p.neg_qsum.add((p.m0 + t) * p.gp + gi))
                });
                let mut acc_odd = [_mm512_setzero_si512(); T];
                for _ in 0..LINES {
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(STREAM_AHEAD).cast());
                    let codes = unpack(_mm512_loadu_si512(at.cast()));
                    for (i, &c) in codes.iter().enumerate() {
                        for t in 0..T {
                            // The token's 4 codes of the line's columns 4·i .. + 4 (the broadcast folds
                            // into `vpdpbusd`'s memory operand).
                            let xq =
                                _mm512_set1_epi32(x[t].add(4 * i).cast::<i32>().read_unaligned());
                            if i % 2 == 1 {
                                acc_odd[t] = _mm512_dpbusd_epi32(acc_odd[t], c, xq);
                            } else {
                                acc[t] = _mm512_dpbusd_epi32(acc[t], c, xq);
                            }
                        }
                    }
                    at = at.add(LINE_BYTES);
                    for t in 0..T {
                        x[t] = opaque(x[t].add(LINE_K));
                    }
                }
                let sums = std::array::from_fn(|t| {
                    _mm512_add_epi32(acc[t], _mm512_srai_epi32::<2>(acc_odd[t]))
                });
                finish_group(p, gi, &sums, &mut tot);
            }
            store_totals(p, &tot);
        }
    }

    /// A pass of 1 or 2 tokens, where [`tile`]'s per-line shifts and two chains per token (each `vpdpbusd`
    /// waiting ~3-4 cycles for the previous one) held one token to ~225 G weights/s per core from L3:
    /// sub-step `i` takes its codes in place — `line & (3 << 2i)`, each code times 4^i — into a chain of its
    /// own per line of a pair (8 per token), and the weight group's epilogue shifts chain `i` right by
    /// `2i` (exact: every term is a multiple of 4^i, so the totals are [`tile`]'s bit for bit). No shift
    /// per line and the latency hidden: ~255 G weights/s.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn tile_in_place<const T: usize, const LINES: usize>(p: &Tile) {
        // SAFETY (whole body): as `tile`'s; line pairs stay inside the group (an even number of lines).
        unsafe {
            let mut x: [*const i8; T] = std::array::from_fn(|t| p.q.add((p.m0 + t) * p.kp));
            let masks: [__m512i; 4] =
                std::array::from_fn(|i| _mm512_set1_epi8((3u8 << (2 * i)) as i8));
            let mut tot: [__m512; T] = std::array::from_fn(|_| _mm512_setzero_ps());
            let mut at = p.codes;
            for gi in 0..p.gp {
                // acc[t][4·h + i]: chain 0 starts from −Σq (the codes are t + 1), the others from 0.
                let mut acc: [[__m512i; 8]; T] = std::array::from_fn(|t| {
                    let mut a = [_mm512_setzero_si512(); 8];
                    a[0] = _mm512_set1_epi32(*p.neg_qsum.add((p.m0 + t) * p.gp + gi));
                    a
                });
                for _pair in 0..LINES / 2 {
                    for h in 0..2 {
                        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(STREAM_AHEAD).cast());
                        let wv = _mm512_loadu_si512(at.cast());
                        for i in 0..4 {
                            let c = _mm512_and_si512(wv, masks[i]);
                            for t in 0..T {
                                let xq = _mm512_set1_epi32(
                                    x[t].add(4 * i).cast::<i32>().read_unaligned(),
                                );
                                acc[t][4 * h + i] = _mm512_dpbusd_epi32(acc[t][4 * h + i], c, xq);
                            }
                        }
                        at = at.add(LINE_BYTES);
                        for t in 0..T {
                            x[t] = opaque(x[t].add(LINE_K));
                        }
                    }
                }
                let sums = std::array::from_fn(|t| {
                    let a = &acc[t];
                    let step = |i: usize| _mm512_add_epi32(a[i], a[4 + i]);
                    _mm512_add_epi32(
                        _mm512_add_epi32(step(0), _mm512_srai_epi32::<2>(step(1))),
                        _mm512_add_epi32(
                            _mm512_srai_epi32::<4>(step(2)),
                            _mm512_srai_epi32::<6>(step(3)),
                        ),
                    )
                });
                finish_group(p, gi, &sums, &mut tot);
            }
            store_totals(p, &tot);
        }
    }

    /// The end of weight group `gi` for every token of a pass, given its integer sums `Σ t·q`:
    /// `tot = fma(f32(Σ t·q), f32(s) · xs, tot)` — one home for both tiles' rounding, which must agree
    /// bit for bit.
    #[inline(always)]
    unsafe fn finish_group<const T: usize>(
        p: &Tile,
        gi: usize,
        sums: &[__m512i; T],
        tot: &mut [__m512; T],
    ) {
        // SAFETY: the caller's `Tile` covers the row group's Gp·16 scales and tokens m0 .. m0 + T's Gp
        // scales; gi < Gp.
        unsafe {
            let s = _mm512_cvtph_ps(_mm256_loadu_si256(p.scales.add(gi * LANE_ROWS).cast()));
            for t in 0..T {
                let cs = _mm512_mul_ps(s, _mm512_set1_ps(*p.xs.add((p.m0 + t) * p.gp + gi)));
                tot[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t]), cs, tot[t]);
            }
        }
    }

    /// A pass's `T` lines of 16 totals to `p.tot`.
    #[inline(always)]
    unsafe fn store_totals<const T: usize>(p: &Tile, tot: &[__m512; T]) {
        // SAFETY: the caller's `Tile` covers T output lines.
        unsafe {
            for t in 0..T {
                _mm512_storeu_ps(p.tot.add(t * LANE_ROWS), tot[t]);
            }
        }
    }

    /// [`super::exact`] on AVX-512: per line and sub-step, byte `b` of every lane is the code of one
    /// weight of each of the 16 rows: a shift, an AND and a `vpermps` from the table `[−1, 0, 1]` give
    /// the 16 rows' trits as f32, then one FMA per token with its broadcast activation.
    pub(super) fn exact(
        w: &PreparedRef<'_>,
        grp: usize,
        x: &[f32],
        m: usize,
        out: &mut Vec<[f32; LANE_ROWS]>,
    ) {
        let (kp, g) = (padded_cols(w.cols), w.group_size);
        let gp = padded_groups(w.cols, g);
        assert_eq!(w.layout, Layout::Lanes16);
        assert!(x.len() >= m * kp && grp < Layout::Lanes16.units(w.rows));
        let (codes, scales) = group(w, grp);
        out.clear();
        out.resize(m, [0.0; LANE_ROWS]);
        for (m0, t) in passes(m) {
            let args = ExactTile {
                codes: codes.as_ptr(),
                scales: scales.as_ptr(),
                x: x[m0 * kp..].as_ptr(),
                kp,
                g,
                gp,
                out: out[m0..].as_mut_ptr().cast(),
            };
            // SAFETY: the caller checked AVX-512F / F16C; the row group's 4·Kp code bytes and Gp·16
            // scales, t ≤ MAX_T token rows of Kp f32 from m0 and t output lines (asserted above).
            unsafe { EXACT_FNS[t - 1](&args) };
        }
    }

    struct ExactTile {
        codes: *const u8,
        scales: *const f16,
        /// `T` rows of `Kp` f32.
        x: *const f32,
        kp: usize,
        g: usize,
        gp: usize,
        /// `T` lines of 16 f32.
        out: *mut f32,
    }

    const EXACT_FNS: [unsafe fn(&ExactTile); MAX_T] = [
        exact_tile::<1>,
        exact_tile::<2>,
        exact_tile::<3>,
        exact_tile::<4>,
        exact_tile::<5>,
        exact_tile::<6>,
        exact_tile::<7>,
        exact_tile::<8>,
    ];

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
    unsafe fn exact_tile<const T: usize>(p: &ExactTile) {
        // SAFETY (whole body): the caller's pointers cover the row group (Kp / 16 lines, Gp·16 scales),
        // T rows of Kp activations and T output lines; prefetches never fault.
        unsafe {
            let table = _mm512_setr_ps(
                -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
            );
            let three = _mm512_set1_epi32(3);
            let x: [*const f32; T] = std::array::from_fn(|t| p.x.add(t * p.kp));
            let mut tot = [_mm512_setzero_ps(); T];
            let lines = p.g / LINE_K;
            for gi in 0..p.gp {
                let mut sum = [_mm512_setzero_ps(); T];
                for j in gi * lines..(gi + 1) * lines {
                    let at = p.codes.add(j * LINE_BYTES);
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(STREAM_AHEAD).cast());
                    let wv = _mm512_loadu_si512(at.cast());
                    for i in 0..4 {
                        for b in 0..4 {
                            // Lane n: the code of row n, weight 16·j + 4·i + b at bits 8·b + 2·i.
                            let idx = _mm512_and_si512(
                                _mm512_srlv_epi32(wv, _mm512_set1_epi32((8 * b + 2 * i) as i32)),
                                three,
                            );
                            let tv = _mm512_permutexvar_ps(idx, table);
                            let k = LINE_K * j + 4 * i + b;
                            for t in 0..T {
                                sum[t] = _mm512_fmadd_ps(tv, _mm512_set1_ps(*x[t].add(k)), sum[t]);
                            }
                        }
                    }
                }
                let s = _mm512_cvtph_ps(_mm256_loadu_si256(p.scales.add(gi * LANE_ROWS).cast()));
                for t in 0..T {
                    tot[t] = _mm512_fmadd_ps(sum[t], s, tot[t]);
                }
            }
            for t in 0..T {
                _mm512_storeu_ps(p.out.add(t * LANE_ROWS), tot[t]);
            }
        }
    }
}
