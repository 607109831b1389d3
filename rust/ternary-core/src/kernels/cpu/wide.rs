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
//! stays in L1 while every token tile uses it. The `+1` of the codes is removed in the integers (each
//! group's sum starts at `−Σq`), so per group and (row, token) the sum is `Σ t·q` exactly, and the f32
//! combination is `v = fma(f32(Σ t·q), f32(s) · xs, v)` group after group from 0: the AMX path's
//! numerics (`amx::Epilogue`) bit for bit (tested against a scalar model of it, and against float64
//! like every path).

// Register arrays (per token) are indexed in lockstep; index loops say that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::avx512::unpack;
use super::layout::{padded_cols, padded_groups, row_blocks, CHUNK_BYTES, ROWS, SUB_K, SUPER_K};
use super::PreparedRef;

/// Rows per group (one per f32 / int32 lane).
pub const GROUP_ROWS: usize = 16;
/// Row blocks of the layout per group.
const BLOCKS: usize = GROUP_ROWS / ROWS;
/// Most tokens one pass over a decoded chunk handles (an int32 sum and an f32 total each in registers).
pub const MAX_T: usize = 8;
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

/// The activations of one call as the tile kernels read them: per token, `−Σq` (int32) and `xs` of
/// every group, `[m][Gp]`. The codes themselves are the quantizer's rows (`m · Kp`). Kept per thread.
#[derive(Default)]
pub(crate) struct Tokens {
    neg_qsum: Vec<i32>,
    xs: Vec<f32>,
    gp: usize,
}

impl Tokens {
    /// Refill from the quantizer's `xs4` and `qsum4` (`m · Gp · 4`, each value repeated 4 times).
    pub fn fill(&mut self, xs4: &[f32], qsum4: &[f32], m: usize, gp: usize) {
        assert!(xs4.len() >= m * gp * ROWS && qsum4.len() >= m * gp * ROWS);
        self.gp = gp;
        self.neg_qsum.clear();
        self.xs.clear();
        for i in 0..m * gp {
            // Σq of a group is an integer of at most 256 · 128 in magnitude: exact in f32.
            self.neg_qsum.push(-(qsum4[i * ROWS] as i32));
            self.xs.push(xs4[i * ROWS]);
        }
    }
}

/// One task's scratch: the decoded chunk, the 16-lane f32 scales of the current group and the running
/// f32 totals of every token.
pub(crate) struct Worker {
    /// `[CHUNK_K/4][16 rows]` words of 4 byte codes `c = t + 1`.
    a: Vec<Line>,
    /// `[Gp][16 rows]` f32 scales of the current 16 rows (missing rows 0).
    scales: Vec<Line>,
    /// `[m][16 rows]` f32 totals.
    tot: Vec<Line>,
}

impl Worker {
    pub fn new() -> Worker {
        Worker {
            a: vec![Line([0; 16]); CHUNK_K / 4],
            scales: Vec::new(),
            tot: Vec::new(),
        }
    }

    /// `out[t][n] = Σ_g fma-chain f32(Σ_{k∈g} t(n, k) · q_t[k]) · (f32(s[n][g]) · xs[t][g])` for the
    /// rows `16·grp ..` of `w` and all `m` tokens (`q`: `m · Kp` codes); returns `m` rows of 16 f32
    /// (rows past `w.rows` are garbage). `w` must be checked ([`PreparedRef::check`]).
    pub fn group(
        &mut self,
        w: &PreparedRef<'_>,
        grp: usize,
        q: &[i8],
        tokens: &Tokens,
        m: usize,
    ) -> &[[f32; 16]] {
        let (kp, gp) = (padded_cols(w.cols), padded_groups(w.cols, w.group_size));
        assert!(tokens.gp == gp && tokens.xs.len() >= m * gp && q.len() >= m * kp);
        assert!(grp * GROUP_ROWS < w.rows.max(1) && m > 0);
        // SAFETY: the worker is only used with AVX-512 VNNI present (`Kernels::int8_wide` is set only
        // in the AVX-512 kernel sets); sizes asserted above.
        unsafe { self.group_inner(w, grp, q, tokens, m) };
        bytemuck::cast_slice(&self.tot[..m])
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")]
    unsafe fn group_inner(
        &mut self,
        w: &PreparedRef<'_>,
        grp: usize,
        q: &[i8],
        tokens: &Tokens,
        m: usize,
    ) {
        let (kp, g, gp) = (padded_cols(w.cols), w.group_size, tokens.gp);
        let blocks = row_blocks(w.rows);
        let b0 = grp * BLOCKS;
        // 16-lane f32 scales per group: lane 4·bi + r = row r of block b0 + bi (missing blocks 0).
        let sp: [Option<*const u64>; BLOCKS] = std::array::from_fn(|bi| {
            (b0 + bi < blocks).then(|| w.block(b0 + bi).1.as_ptr().cast::<u64>())
        });
        self.scales.clear();
        self.scales.resize(gp, Line([0; 16]));
        for (gi, line) in self.scales.iter_mut().enumerate() {
            // SAFETY: a block holds Gp·4 scales, so the 4 of group gi (8 bytes) are in bounds.
            unsafe {
                let four = |bi: usize| sp[bi].map_or(0, |p| p.add(gi).read_unaligned() as i64);
                let h = _mm256_set_epi64x(four(3), four(2), four(1), four(0));
                _mm512_store_ps(line.0.as_mut_ptr().cast(), _mm512_cvtph_ps(h));
            }
        }
        self.tot.clear();
        self.tot.resize(m, Line([0; 16]));
        let tiles = m.div_ceil(MAX_T);
        let per = m.div_ceil(tiles);
        for kc0 in (0..kp).step_by(CHUNK_K) {
            let kc = CHUNK_K.min(kp - kc0);
            // SAFETY: kc0 + kc ≤ Kp; `a` holds CHUNK_K/4 words per lane.
            unsafe { decode(w, b0, kc0, kc, &mut self.a) };
            for m0 in (0..m).step_by(per) {
                let t = per.min(m - m0);
                let args = Tile {
                    a: self.a.as_ptr().cast(),
                    kc0,
                    kc,
                    g,
                    gp,
                    kp,
                    q: q.as_ptr(),
                    neg_qsum: tokens.neg_qsum.as_ptr(),
                    xs: tokens.xs.as_ptr(),
                    scales: self.scales.as_ptr().cast(),
                    m0,
                    tot: self.tot.as_mut_ptr().cast(),
                };
                // SAFETY: every pointer covers what `Tile` says (asserted sizes, m0 + t ≤ m).
                unsafe { TILE_FNS[t - 1](&args) };
            }
        }
    }
}

/// One pass of `T` tokens (`m0 ..`) over a decoded chunk.
struct Tile {
    /// `[kc/4][16]` words of the decoded chunk.
    a: *const i32,
    kc0: usize,
    kc: usize,
    g: usize,
    gp: usize,
    kp: usize,
    /// Codes, `[m][Kp]`.
    q: *const i8,
    /// `[m][Gp]`.
    neg_qsum: *const i32,
    /// `[m][Gp]`.
    xs: *const f32,
    /// `[Gp][16]` f32.
    scales: *const f32,
    m0: usize,
    /// `[m][16]` f32 running totals.
    tot: *mut f32,
}

type TileFn = unsafe fn(&Tile);

const TILE_FNS: [TileFn; MAX_T] = [
    tile::<1>, tile::<2>, tile::<3>, tile::<4>, tile::<5>, tile::<6>, tile::<7>, tile::<8>,
];

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")]
unsafe fn tile<const T: usize>(p: &Tile) {
    // SAFETY (whole body): the caller's pointers cover the chunk (kc/4 words × 16), tokens m0 .. m0 + T
    // of q (Kp each: kc0 + kc ≤ Kp), their groups (Gp each), the scales (Gp × 16) and totals.
    unsafe {
        let x: [*const i8; T] = std::array::from_fn(|t| p.q.add((p.m0 + t) * p.kp + p.kc0));
        let mut tot: [__m512; T] =
            std::array::from_fn(|t| _mm512_loadu_ps(p.tot.add((p.m0 + t) * 16)));
        let k4_per_group = p.g / 4;
        for gl in 0..p.kc / p.g {
            let gi = p.kc0 / p.g + gl;
            let mut acc: [__m512i; T] =
                std::array::from_fn(|t| _mm512_set1_epi32(*p.neg_qsum.add((p.m0 + t) * p.gp + gi)));
            let k4_0 = gl * k4_per_group;
            for k4 in k4_0..k4_0 + k4_per_group {
                let wv = _mm512_load_si512(p.a.add(k4 * 16).cast());
                for t in 0..T {
                    let xq = _mm512_set1_epi32(x[t].add(4 * k4).cast::<i32>().read_unaligned());
                    acc[t] = _mm512_dpbusd_epi32(acc[t], wv, xq);
                }
            }
            let s = _mm512_loadu_ps(p.scales.add(gi * 16));
            for t in 0..T {
                let cs = _mm512_mul_ps(s, _mm512_set1_ps(*p.xs.add((p.m0 + t) * p.gp + gi)));
                tot[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t]), cs, tot[t]);
            }
        }
        for t in 0..T {
            _mm512_storeu_ps(p.tot.add((p.m0 + t) * 16), tot[t]);
        }
    }
}

/// Columns `kc0 .. kc0 + kc` of the 16 rows of row blocks `b0 .. b0 + 4` into `a`: word `k4 · 16 + n`
/// holds the byte codes of row n, columns `kc0 + 4·k4 .. + 4`. Missing blocks (past the last row) give
/// codes 0 (their rows are never stored).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn decode(w: &PreparedRef<'_>, b0: usize, kc0: usize, kc: usize, a: &mut [Line]) {
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
                    // or past its end in the next group's block at the same place (3 blocks on).
                    let o = sb * ROWS * CHUNK_BYTES + STREAM_AHEAD;
                    let far = if o < kp {
                        STREAM_AHEAD
                    } else {
                        STREAM_AHEAD + 3 * kp
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
