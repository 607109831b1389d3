//! The int8 modes on AVX-512 VNNI for M ≥ [`super::WIDE_MIN_M`] tokens: rows in the vector lanes.
//!
//! The GEMV kernel (`avx512::int8`) puts 64 weights of **one row** in a vector: every `vpdpbusd`
//! leaves 16 lane-partial sums of one (row, token), so each (row, group, token) needs its own int32 →
//! f32 conversion and FMA (one epilogue per two `vpdpbusd` at g = 128), and the weight is unpacked
//! again for every tile of [`super::INT8_TILE`] tokens. At M = 8 on 5120 → 17408 (one thread, cold)
//! that ran at 5.9 G weights/s (47 G weight-tokens/s), an eighth of M = 1.
//!
//! Here a vector holds 4 consecutive weights of each of **16 rows** (lane n = row n), and the
//! activation operand is 4 int8 codes of one token broadcast to every lane (`vpdpbusd`'s embedded
//! `{1to16}` broadcast, no extra instruction): one `vpdpbusd` adds 16 rows × 4 weights of one token
//! straight into that token's 16 row sums. So the epilogue of a group costs one conversion, one
//! multiply and one FMA per 16 rows and token (per 32 `vpdpbusd` at g = 128), and nothing needs a
//! horizontal reduction.
//!
//! The layout keeps 4 rows interleaved; per 16 rows (4 row blocks) × [`CHUNK_K`] columns the weight is
//! decoded once per call into such vectors — a 16 × 16 transpose of 32-bit words of the packed chunks
//! (4 sub-vectors travel together in each byte), then the usual shift + AND — into an 8 KiB buffer that
//! stays in L1 while every token tile uses it. From [`PAIR_MIN_M`] tokens a pass takes two such groups,
//! so each token's broadcast codes feed two `vpdpbusd`s (more independent sums in flight, half the
//! broadcast loads). The `+1` of the codes is removed in the integers (each
//! group's sum starts at `−Σq`), so per group and (row, token) the sum is `Σ t·q` exactly, and the f32
//! combination is `v = fma(f32(Σ t·q), f32(s) · xs, v)` group after group from 0: the AMX path's
//! numerics (`amx::Epilogue`) bit for bit (tested against a scalar model of it, and against float64
//! like every path).

// Register arrays (per token) are indexed in lockstep; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::avx512::unpack;
use super::lanes::Tokens;
use super::layout::{padded_cols, padded_groups, row_blocks, CHUNK_BYTES, ROWS, SUB_K, SUPER_K};
use super::PreparedRef;

/// Rows per group (one per f32 / int32 lane).
pub const GROUP_ROWS: usize = 16;
/// Row blocks of the layout per group.
const BLOCKS: usize = GROUP_ROWS / ROWS;
/// Most tokens one pass over the decoded chunks handles (an int32 sum per token and row group in
/// registers).
pub const MAX_T: usize = 8;
/// Most row groups one pass handles: each token's broadcast codes feed `R` `vpdpbusd`s.
pub const MAX_R: usize = 2;
/// From this many tokens a pass takes [`MAX_R`] row groups (fewer tokens: one, its totals in registers).
/// Zen 5, one thread, weights cold, G weight-tokens/s, one row group vs two: 5120 → 17408 M = 8 270 vs
/// 232, M = 16 310 vs 297, M = 64 364 vs 401, M = 256 355 vs 432; 17408 → 5120 M = 8 274 vs 278, M = 16
/// 313 vs 335; 2048 → 12288 M = 256 357 vs 399.
pub const PAIR_MIN_M: usize = 16;
/// Columns decoded per buffer refill: 16 rows × 512 codes = 8 KiB (with 512 bytes of x per token, all
/// in L1 while every token tile uses them).
const CHUNK_K: usize = 512;
/// Software prefetch distance in each of the 4 block streams of a group.
const STREAM_AHEAD: usize = 1024;

/// One cache line (the decode buffer's rows are whole lines).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([i32; 16]);

// SAFETY: plain 32-bit words, no padding (64 bytes, align 64).
unsafe impl bytemuck::Zeroable for Line {}
unsafe impl bytemuck::Pod for Line {}

/// One task's scratch: the decoded chunks, the 16-lane f32 scales and the running f32 totals of up to
/// [`MAX_R`] row groups.
pub(crate) struct Worker {
    /// `[R][CHUNK_K/4][16 rows]` words of 4 byte codes `c = t + 1`.
    a: Vec<Line>,
    /// `[R][Gp][16 rows]` f32 scales (missing rows 0).
    scales: Vec<Line>,
    /// `[R][m][16 rows]` f32 totals.
    tot: Vec<Line>,
}

impl Worker {
    pub fn new() -> Worker {
        Worker {
            a: vec![Line([0; 16]); MAX_R * CHUNK_K / 4],
            scales: Vec::new(),
            tot: Vec::new(),
        }
    }

    /// `out[r·m + t][n] = Σ_g fma-chain f32(Σ_{k∈g} t(n, k) · q_t[k]) · (f32(s[n][g]) · xs[t][g])` for
    /// the `r` (1 ..= [`MAX_R`]) row groups `grp0 ..` of `w` (16 rows each) and all `m` tokens (`q`:
    /// `m · Kp` codes); returns `r · m` rows of 16 f32 (rows past `w.rows` are garbage). `w` must be
    /// checked ([`PreparedRef::check`]).
    pub fn groups(
        &mut self,
        w: &PreparedRef<'_>,
        grp0: usize,
        r: usize,
        q: &[i8],
        tokens: &Tokens,
        m: usize,
    ) -> &[[f32; 16]] {
        let (kp, gp) = (padded_cols(w.cols), padded_groups(w.cols, w.group_size));
        assert!(tokens.gp == gp && tokens.xs.len() >= m * gp && q.len() >= m * kp);
        assert!((1..=MAX_R).contains(&r) && (grp0 + r - 1) * GROUP_ROWS < w.rows.max(1) && m > 0);
        // SAFETY: the worker is only used with AVX-512 VNNI present (`Kernels::int8_wide` is set only
        // in the AVX-512 kernel sets); sizes asserted above.
        unsafe { self.groups_inner(w, grp0, r, q, tokens, m) };
        bytemuck::cast_slice(&self.tot[..r * m])
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn groups_inner(
        &mut self,
        w: &PreparedRef<'_>,
        grp0: usize,
        r: usize,
        q: &[i8],
        tokens: &Tokens,
        m: usize,
    ) {
        let (kp, g, gp) = (padded_cols(w.cols), w.group_size, tokens.gp);
        let blocks = row_blocks(w.rows);
        self.scales.clear();
        self.scales.resize(r * gp, Line([0; 16]));
        for ri in 0..r {
            let b0 = (grp0 + ri) * BLOCKS;
            // 16-lane f32 scales per group: lane 4·bi + r = row r of block b0 + bi (missing blocks 0).
            let sp: [Option<*const u64>; BLOCKS] = std::array::from_fn(|bi| {
                (b0 + bi < blocks).then(|| w.block(b0 + bi).1.as_ptr().cast::<u64>())
            });
            for (gi, line) in self.scales[ri * gp..(ri + 1) * gp].iter_mut().enumerate() {
                // SAFETY: a block holds Gp·4 scales, so the 4 of group gi (8 bytes) are in bounds.
                unsafe {
                    let four = |bi: usize| sp[bi].map_or(0, |p| p.add(gi).read_unaligned() as i64);
                    let h = _mm256_set_epi64x(four(3), four(2), four(1), four(0));
                    _mm512_store_ps(line.0.as_mut_ptr().cast(), _mm512_cvtph_ps(h));
                }
            }
        }
        self.tot.clear();
        self.tot.resize(r * m, Line([0; 16]));
        let tiles = m.div_ceil(MAX_T);
        let per = m.div_ceil(tiles);
        for kc0 in (0..kp).step_by(CHUNK_K) {
            let kc = CHUNK_K.min(kp - kc0);
            for ri in 0..r {
                let a = &mut self.a[ri * CHUNK_K / 4..(ri + 1) * CHUNK_K / 4];
                // SAFETY: kc0 + kc ≤ Kp; `a` holds CHUNK_K/4 words per lane.
                unsafe { decode(w, (grp0 + ri) * BLOCKS, kc0, kc, r, a) };
            }
            for m0 in (0..m).step_by(per) {
                let t = per.min(m - m0);
                let args = Tile {
                    a: self.a.as_ptr().cast(),
                    kc0,
                    kc,
                    g,
                    gp,
                    kp,
                    m,
                    q: q.as_ptr(),
                    neg_qsum: tokens.neg_qsum.as_ptr(),
                    xs: tokens.xs.as_ptr(),
                    scales: self.scales.as_ptr().cast(),
                    m0,
                    tot: self.tot.as_mut_ptr().cast(),
                };
                // SAFETY: every pointer covers what `Tile` says (asserted sizes, m0 + t ≤ m, r
                // decoded chunks, r · Gp scale lines and r · m total lines).
                unsafe { TILE_FNS[r - 1][t - 1](&args) };
            }
        }
    }
}

/// One pass of `T` tokens (`m0 ..`) over `R` decoded chunks (row groups).
struct Tile {
    /// `[R][CHUNK_K/4][16]` words of the decoded chunks (`kc/4` used).
    a: *const i32,
    kc0: usize,
    kc: usize,
    g: usize,
    gp: usize,
    kp: usize,
    /// Tokens of the call (the totals' stride per row group).
    m: usize,
    /// Codes, `[m][Kp]`.
    q: *const i8,
    /// `[m][Gp]`.
    neg_qsum: *const i32,
    /// `[m][Gp]`.
    xs: *const f32,
    /// `[R][Gp][16]` f32.
    scales: *const f32,
    m0: usize,
    /// `[R][m][16]` f32 running totals.
    tot: *mut f32,
}

type TileFn = unsafe fn(&Tile);

const TILE_FNS: [[TileFn; MAX_T]; MAX_R] = [
    [
        tile::<1, 1>,
        tile::<1, 2>,
        tile::<1, 3>,
        tile::<1, 4>,
        tile::<1, 5>,
        tile::<1, 6>,
        tile::<1, 7>,
        tile::<1, 8>,
    ],
    [
        tile::<2, 1>,
        tile::<2, 2>,
        tile::<2, 3>,
        tile::<2, 4>,
        tile::<2, 5>,
        tile::<2, 6>,
        tile::<2, 7>,
        tile::<2, 8>,
    ],
];

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")]
unsafe fn tile<const R: usize, const T: usize>(p: &Tile) {
    // SAFETY (whole body): the caller's pointers cover the R chunks (kc/4 words × 16 each), tokens
    // m0 .. m0 + T of q (Kp each: kc0 + kc ≤ Kp), their groups (Gp each), the scales (R × Gp × 16)
    // and totals (R × m × 16).
    unsafe {
        let x: [*const i8; T] = std::array::from_fn(|t| p.q.add((p.m0 + t) * p.kp + p.kc0));
        let a: [*const i32; R] = std::array::from_fn(|ri| p.a.add(ri * CHUNK_K / 4 * 16));
        let tot_at = |ri: usize, t: usize| p.tot.add((ri * p.m + p.m0 + t) * 16);
        // One row group: the totals live in registers for the whole pass (8 + 8 of them); more: in L1,
        // read and written once per group.
        let mut tot_reg: [__m512; T] = std::array::from_fn(|t| {
            if R == 1 {
                _mm512_loadu_ps(tot_at(0, t))
            } else {
                _mm512_setzero_ps()
            }
        });
        let k4_per_group = p.g / 4;
        for gl in 0..p.kc / p.g {
            let gi = p.kc0 / p.g + gl;
            let mut acc: [[__m512i; T]; R] = [std::array::from_fn(|t| {
                _mm512_set1_epi32(*p.neg_qsum.add((p.m0 + t) * p.gp + gi))
            }); R];
            let k4_0 = gl * k4_per_group;
            for k4 in k4_0..k4_0 + k4_per_group {
                let wv: [__m512i; R] =
                    std::array::from_fn(|ri| _mm512_load_si512(a[ri].add(k4 * 16).cast()));
                for t in 0..T {
                    // Each token's 4 codes are loaded once and used against every row group.
                    let xq = _mm512_set1_epi32(x[t].add(4 * k4).cast::<i32>().read_unaligned());
                    for ri in 0..R {
                        acc[ri][t] = _mm512_dpbusd_epi32(acc[ri][t], wv[ri], xq);
                    }
                }
            }
            for ri in 0..R {
                let s = _mm512_loadu_ps(p.scales.add((ri * p.gp + gi) * 16));
                for t in 0..T {
                    let cs = _mm512_mul_ps(s, _mm512_set1_ps(*p.xs.add((p.m0 + t) * p.gp + gi)));
                    let v = _mm512_cvtepi32_ps(acc[ri][t]);
                    if R == 1 {
                        tot_reg[t] = _mm512_fmadd_ps(v, cs, tot_reg[t]);
                    } else {
                        let at = tot_at(ri, t);
                        _mm512_storeu_ps(at, _mm512_fmadd_ps(v, cs, _mm512_loadu_ps(at)));
                    }
                }
            }
        }
        if R == 1 {
            for t in 0..T {
                _mm512_storeu_ps(tot_at(0, t), tot_reg[t]);
            }
        }
    }
}

/// Columns `kc0 .. kc0 + kc` of the 16 rows of row blocks `b0 .. b0 + 4` into `a`: word `k4 · 16 + n`
/// holds the byte codes of row n, columns `kc0 + 4·k4 .. + 4`. Missing blocks (past the last row) give
/// codes 0 (their rows are never stored).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn decode(
    w: &PreparedRef<'_>,
    b0: usize,
    kc0: usize,
    kc: usize,
    groups_on: usize,
    a: &mut [Line],
) {
    debug_assert!(a.len() * 4 >= kc && kc0.is_multiple_of(SUPER_K) && kc.is_multiple_of(SUPER_K));
    let blocks = row_blocks(w.rows);
    let kp = padded_cols(w.cols);
    let ptrs: [Option<*const u8>; BLOCKS] =
        std::array::from_fn(|bi| (b0 + bi < blocks).then(|| w.block(b0 + bi).0.as_ptr()));
    let mask = _mm512_set1_epi8(3);
    let ap = a.as_mut_ptr();
    for (sl, sb) in (kc0 / SUPER_K..(kc0 + kc) / SUPER_K).enumerate() {
        // SAFETY: sb < Kp/256, so every chunk read is inside its block; prefetches never fault; the
        // stores stay inside the CHUNK_K/4 lines of `a`.
        unsafe {
            let mut r = [_mm512_setzero_si512(); 16];
            for (bi, p) in ptrs.iter().enumerate() {
                if let Some(p) = *p {
                    let base = p.add(sb * ROWS * CHUNK_BYTES);
                    // Each block is a stream of its own: prefetch STREAM_AHEAD bytes ahead in it,
                    // or past its end in the block at the same place of the group this worker
                    // decodes next there (`groups_on` groups, 4 blocks each, on).
                    let o = sb * ROWS * CHUNK_BYTES + STREAM_AHEAD;
                    let far = if o < kp {
                        STREAM_AHEAD
                    } else {
                        STREAM_AHEAD + (BLOCKS * groups_on - 1) * kp
                    };
                    for l in 0..ROWS {
                        let ahead = base.wrapping_add(far + l * CHUNK_BYTES);
                        _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    }
                    for rr in 0..ROWS {
                        r[bi * ROWS + rr] = _mm512_loadu_si512(base.add(rr * CHUNK_BYTES).cast());
                    }
                }
            }
            // 16 × 16 transpose of 32-bit words: o[c] lane n = word c of row n's chunk, i.e. the packed
            // codes of columns 256·sb + 64·i + 4c .. + 4 of row n (sub-vector i at bits 2i).
            let mut u = [_mm512_setzero_si512(); 16];
            for q4 in 0..4 {
                let (r0, r1, r2, r3) = (r[4 * q4], r[4 * q4 + 1], r[4 * q4 + 2], r[4 * q4 + 3]);
                let t0 = _mm512_unpacklo_epi32(r0, r1);
                let t1 = _mm512_unpackhi_epi32(r0, r1);
                let t2 = _mm512_unpacklo_epi32(r2, r3);
                let t3 = _mm512_unpackhi_epi32(r2, r3);
                // u[4·q4 + j] 128-bit lane L: rows 4·q4 .. + 4, word 4L + j.
                u[4 * q4] = _mm512_unpacklo_epi64(t0, t2);
                u[4 * q4 + 1] = _mm512_unpackhi_epi64(t0, t2);
                u[4 * q4 + 2] = _mm512_unpacklo_epi64(t1, t3);
                u[4 * q4 + 3] = _mm512_unpackhi_epi64(t1, t3);
            }
            let base_k4 = sl * (SUPER_K / 4);
            for j in 0..4 {
                let (ua, ub, uc, ud) = (u[j], u[4 + j], u[8 + j], u[12 + j]);
                let v0 = _mm512_shuffle_i32x4::<0x44>(ua, ub);
                let v1 = _mm512_shuffle_i32x4::<0xEE>(ua, ub);
                let v2 = _mm512_shuffle_i32x4::<0x44>(uc, ud);
                let v3 = _mm512_shuffle_i32x4::<0xEE>(uc, ud);
                // Word c = 4L + j for L = 0..4.
                let o = [
                    _mm512_shuffle_i32x4::<0x88>(v0, v2),
                    _mm512_shuffle_i32x4::<0xDD>(v0, v2),
                    _mm512_shuffle_i32x4::<0x88>(v1, v3),
                    _mm512_shuffle_i32x4::<0xDD>(v1, v3),
                ];
                for (l, &ov) in o.iter().enumerate() {
                    let c = 4 * l + j;
                    for i in 0..SUPER_K / SUB_K {
                        // Columns 64·i + 4c: k4 = 16·i + c within the superblock.
                        let k4 = base_k4 + 16 * i + c;
                        _mm512_store_si512(ap.add(k4).cast(), unpack(ov, i, mask));
                    }
                }
            }
        }
    }
}
