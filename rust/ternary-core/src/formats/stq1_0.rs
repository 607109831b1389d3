//! Tencent / AngelSlim STQ1_0 (GGUF type 43, llama.cpp PR #22836; Hy-MT2 1.8B, Hy4-preview):
//! `{ qs: [u8; 32], sign: [u8; 8], d: f16 }`, 42 bytes, 256 values, 1.3125 bpw (docs/formats.md).
//!
//! 3:4-sparse ternary: every 4-lane group holds exactly one zero and three ±d. Group `g` (0..64) has a
//! 4-bit slot code in nibble `g & 1` of `qs[g / 2]` (low nibble first) and a table-select bit `g % 8`
//! of `sign[g / 8]`; `qpack = CODEBOOK[(sign << 4) | slot]` holds lane `p` in bits `2p..2p + 2` as
//! `t + 1` (0b00 → −1, 0b01 → 0, 0b10 → +1) — already a canonical code. Lane `p` of group `g` is value
//! `64·(g / 16) + g % 16 + 16·p` of the block (stride 16 inside each 64-value chunk, not 4 consecutive
//! values). The scale `d` is the block's last two bytes.
//!
//! Upstream sources (read, not copied):
//! * codebook, block struct and field order: `ggml/src/ggml-common.h` of the PR branch
//!   (sjl623/llama.cpp `STQ_0`, commit 4ea7990d1833671c05ed5b98fca60df79272943d: `block_stq_0`
//!   `{ qs[QK_K/8]; sign[QK_K/32]; ggml_half d; }`, table `stq_0_codebook[32]`, renamed `stq1_0` in
//!   later commits);
//! * bit conventions (nibble order, sign bit order, lane bits): `dequantize_row_stq1_0` and
//!   `quantize_row_stq1_0_ref` in `ggml/src/ggml-quants.c`, sjl623/llama.cpp commit
//!   9b898c1f19b2b0da6db28c99ecea74017892c013;
//! * the stride-16 lane placement: the reference codec `vllm_gguf_plugin/gguf_stq.py` of
//!   vllm-project/vllm-gguf-plugin, commit bf83c94cecffa3f391b132ed6d6c62aa6ac71a3a
//!   (`dequantize_stq1_0`), which states that every codec of the patched llama.cpp
//!   (quantize/dequantize/vec_dot) and the shipped Hy4 files use it. The two PR-branch commits above
//!   still write lanes as `*y++` (4 consecutive values); the branch changed that before the files
//!   shipped, and this module follows the shipped layout.
//!
//! Decode is lossless: the canonical group is the block (256), the scale is `d`. Encode from
//! canonical needs every group to be one of the 32 patterns: [`encode`] refuses a tensor with any
//! other group, naming its row and group ([`first_unrepresentable`]). Mapping such tensors onto the
//! codebook is requantization: [`quantize`] / [`requantize`] run upstream's float quantizer
//! (`quantize_row_stq1_0_ref`) on the weights, and [`encode_gguf`] picks between the two.

use half::f16;
use rayon::prelude::*;

use super::blocks::{decode_blocks, encode_blocks};
use super::{read_f16, transpose_2bit_4x4, BlockCodec, Format};
use crate::canonical::{CanonicalRef, CanonicalTernary, Regrouped};
use crate::{threads, Error, Result};

/// Byte offset of `sign[8]` and of `d` in a block.
const SIGN_AT: usize = 32;
const D_AT: usize = 40;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockStq1_0 {
    pub qs: [u8; 32],
    pub sign: [u8; 8],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockStq1_0>() == 42);

/// `(sign << 4) | slot` → the group's four lane codes, lane `p` at bits `2p` (upstream
/// `stq1_0_codebook`). Slot = `(zero_lane << 2) | tail`, tail bit 0/1 = the sign of the 2nd/3rd
/// non-zero lane relative to the first (set: opposite); sign = 1 negates every non-zero lane.
pub const CODEBOOK: [u8; 32] = [
    // sign = 0: the first non-zero lane is +1
    0xA9, 0x89, 0x29, 0x09, 0xA6, 0x86, 0x26, 0x06, 0x9A, 0x92, 0x1A, 0x12, 0x6A, 0x62, 0x4A, 0x42,
    // sign = 1: every non-zero lane negated
    0x01, 0x21, 0x81, 0xA1, 0x04, 0x24, 0x84, 0xA4, 0x10, 0x18, 0x90, 0x98, 0x40, 0x48, 0x60, 0x68,
];

/// Marks a lane-code byte no codebook entry produces.
const NOT_IN_CODEBOOK: u8 = 0xFF;

/// Lane-code byte → its codebook index `(sign << 4) | slot`, or [`NOT_IN_CODEBOOK`].
const INDEX_OF: [u8; 256] = {
    let mut t = [NOT_IN_CODEBOOK; 256];
    let mut i = 0;
    while i < 32 {
        t[CODEBOOK[i] as usize] = i as u8;
        i += 1;
    }
    t
};

/// Value (0..256) of lane `p` of group `g` within a block.
#[inline(always)]
pub const fn lane_value(g: usize, p: usize) -> usize {
    64 * (g / 16) + g % 16 + 16 * p
}

/// Whether a group's four lane codes (lane `p` at bits `2p`) are one of the 32 patterns.
#[inline(always)]
pub fn representable(qpack: u8) -> bool {
    INDEX_OF[qpack as usize] != NOT_IN_CODEBOOK
}

/// The 64 lane-code bytes of a block, group `g` in byte `g` (portable: one table load per group).
#[inline(always)]
fn qpacks_portable(block: &[u8]) -> [u8; 64] {
    let sign = u64::from_le_bytes(block[SIGN_AT..D_AT].try_into().expect("8 sign bytes"));
    let mut q = [0u8; 64];
    for (j, &b) in block[..32].iter().enumerate() {
        let (lo, hi) = (2 * j, 2 * j + 1);
        q[lo] = CODEBOOK[(b & 15) as usize | (((sign >> lo) & 1) as usize) << 4];
        q[hi] = CODEBOOK[(b >> 4) as usize | (((sign >> hi) & 1) as usize) << 4];
    }
    q
}

/// Canonical bytes of a block from its lane-code bytes. Word `w = 4c + m` (chunk `c`) holds groups
/// `16c + 4m + i` in byte `i`; transposed, its byte `p` holds lane `p` of those four groups, i.e.
/// values `64c + 16p + 4m + i` — canonical byte `16c + 4p + m`.
#[inline(always)]
fn place(q: &[u8; 64], canon: &mut [u8]) {
    for (w, qw) in q.chunks_exact(4).enumerate() {
        let x = transpose_2bit_4x4(u32::from_le_bytes([qw[0], qw[1], qw[2], qw[3]]));
        let (c, m) = (w / 4, w % 4);
        for p in 0..4 {
            canon[16 * c + 4 * p + m] = (x >> (8 * p)) as u8;
        }
    }
}

/// The portable fast path (also the fallback where AVX-512BW is missing).
#[inline(always)]
fn unpack_block_portable(block: &[u8], canon: &mut [u8]) {
    place(&qpacks_portable(block), canon);
}

/// The 64 lane-code bytes (group `g` in byte `g`) of the block whose canonical bytes are `canon`:
/// the inverse of [`place`] (the transpose is its own inverse).
#[inline(always)]
fn gather(canon: &[u8]) -> [u8; 64] {
    let mut q = [0u8; 64];
    for (w, qw) in q.chunks_exact_mut(4).enumerate() {
        let (c, m) = (w / 4, w % 4);
        let x = u32::from_le_bytes(std::array::from_fn(|p| canon[16 * c + 4 * p + m]));
        qw.copy_from_slice(&transpose_2bit_4x4(x).to_le_bytes());
    }
    q
}

/// AVX-512BW unpack of one block (40 code bytes → 64 canonical bytes in one register): the 32 `qs`
/// bytes widen to 16-bit words whose two bytes are the low and high nibble (group `2j`, `2j + 1`),
/// two in-lane `vpshufb` look the slots up in the sign-0 and sign-1 halves of the codebook and the
/// 64 sign bits (one `u64`, bit `g` = group `g`) pick between them as a byte mask; then the 2-bit 4×4
/// transpose on every word (as TQ2_0's) and one in-lane `vpshufb` (byte `4p + m` ← byte `4m + p`:
/// a 128-bit lane is one 64-value chunk) give the canonical order of [`place`].
mod unpack_simd {
    /// `block`: at least the 40 code bytes; `canon`: the block's 64 canonical bytes.
    #[inline(always)]
    pub fn block(block: &[u8], canon: &mut [u8]) {
        assert!(block.len() >= 40 && canon.len() == 64);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers use this path only when `avx512bw_available()` saw avx512f and avx512bw;
        // `block` holds at least 40 bytes (32 loaded as one vector, 8 as a u64) and `canon` 64.
        unsafe {
            x86::block(block, canon)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no SIMD unpack on this architecture")
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        use super::super::CODEBOOK;

        /// In each 128-bit lane: byte `4p + m` ← byte `4m + p`.
        const ORDER: [i8; 64] = {
            let mut c = [0i8; 64];
            let mut k = 0;
            while k < 64 {
                let (p, m) = ((k % 16) / 4, k % 4);
                c[k] = (4 * m + p) as i8;
                k += 1;
            }
            c
        };

        #[target_feature(enable = "avx512f,avx512bw")]
        pub unsafe fn block(block: &[u8], canon: &mut [u8]) {
            let qs = _mm256_loadu_si256(block.as_ptr().cast());
            let sign = block.as_ptr().add(32).cast::<u64>().read_unaligned();
            // Word j = qs[j]; (w | w << 4) & 0x0F0F puts the low nibble in byte 2j, the high in 2j+1.
            let w = _mm512_cvtepu8_epi16(qs);
            let slots = _mm512_and_si512(
                _mm512_or_si512(w, _mm512_slli_epi16::<4>(w)),
                _mm512_set1_epi16(0x0F0F),
            );
            let pos = _mm512_broadcast_i32x4(_mm_loadu_si128(CODEBOOK.as_ptr().cast()));
            let neg = _mm512_broadcast_i32x4(_mm_loadu_si128(CODEBOOK.as_ptr().add(16).cast()));
            let x = _mm512_mask_blend_epi8(
                sign,
                _mm512_shuffle_epi8(pos, slots),
                _mm512_shuffle_epi8(neg, slots),
            );
            // transpose_2bit_4x4 on every 32-bit word.
            let t = _mm512_and_si512(
                _mm512_xor_si512(_mm512_srli_epi32::<6>(x), x),
                _mm512_set1_epi32(0x00CC_00CC),
            );
            let x = _mm512_xor_si512(_mm512_xor_si512(x, t), _mm512_slli_epi32::<6>(t));
            let t = _mm512_and_si512(
                _mm512_xor_si512(_mm512_srli_epi32::<12>(x), x),
                _mm512_set1_epi32(0x0000_F0F0),
            );
            let x = _mm512_xor_si512(_mm512_xor_si512(x, t), _mm512_slli_epi32::<12>(t));
            let y = _mm512_shuffle_epi8(x, _mm512_loadu_si512(ORDER.as_ptr().cast()));
            _mm512_storeu_si512(canon.as_mut_ptr().cast(), y);
        }
    }
}

impl BlockCodec for BlockStq1_0 {
    const FORMAT: Format = Format::Stq1_0;
    const BLOCK_VALUES: usize = 256;
    const BLOCK_BYTES: usize = 42;
    /// No codebook entry has a lane 0b11.
    const CAN_HOLD_CODE3: bool = false;

    #[inline(always)]
    fn scale(block: &[u8]) -> f16 {
        read_f16(block, D_AT)
    }
    #[inline(always)]
    fn unpack_block(block: &[u8], canon: &mut [u8]) {
        if crate::cpu_features::avx512bw_available() {
            unpack_simd::block(block, &mut canon[..64]);
            return;
        }
        unpack_block_portable(block, canon);
    }
    /// Every group of `canon` must be [`representable`] (callers check with
    /// [`first_unrepresentable`]; [`encode`] does); another pattern is written as index 0.
    #[inline(always)]
    fn pack_block(canon: &[u8], d: f16, block: &mut [u8]) {
        let q = gather(canon);
        block[..D_AT].fill(0);
        for (g, &qpack) in q.iter().enumerate() {
            let idx = INDEX_OF[qpack as usize];
            debug_assert!(
                idx != NOT_IN_CODEBOOK,
                "group {g}: {qpack:#04x} not in the codebook"
            );
            let idx = if idx == NOT_IN_CODEBOOK { 0 } else { idx };
            block[g / 2] |= (idx & 15) << (4 * (g & 1));
            block[SIGN_AT + g / 8] |= (idx >> 4) << (g % 8);
        }
        block[D_AT..].copy_from_slice(&d.to_le_bytes());
    }

    /// `for g in 0..64: slot = (qs[g/2] >> 4(g&1)) & 15; s = (sign[g/8] >> g%8) & 1;
    /// q = CODEBOOK[s<<4 | slot]; for p in 0..4: y[64(g/16) + g%16 + 16p] = (q >> 2p) & 3`
    fn decode_block_ref(block: &[u8], codes: &mut [u8]) -> f16 {
        for g in 0..64 {
            let slot = (block[g / 2] >> (4 * (g & 1))) & 0x0F;
            let s = (block[SIGN_AT + g / 8] >> (g % 8)) & 1;
            let qpack = CODEBOOK[((s << 4) | slot) as usize];
            for p in 0..4 {
                codes[lane_value(g, p)] = (qpack >> (2 * p)) & 3;
            }
        }
        read_f16(block, D_AT)
    }

    /// `q = Σ_p c[64(g/16) + g%16 + 16p] << 2p; (s, slot) = CODEBOOK⁻¹[q]` (representable groups only,
    /// as [`pack_block`](BlockCodec::pack_block)).
    fn encode_block_ref(codes: &[u8], d: f16, block: &mut [u8]) {
        block[..D_AT].fill(0);
        for g in 0..64 {
            let mut qpack = 0u8;
            for p in 0..4 {
                qpack |= codes[lane_value(g, p)] << (2 * p);
            }
            let idx = CODEBOOK.iter().position(|&c| c == qpack);
            debug_assert!(idx.is_some(), "group {g}: {qpack:#04x} not in the codebook");
            let idx = idx.unwrap_or(0) as u8;
            block[g / 2] |= (idx & 15) << (4 * (g & 1));
            block[SIGN_AT + g / 8] |= (idx >> 4) << (g % 8);
        }
        block[D_AT..].copy_from_slice(&d.to_le_bytes());
    }
}

/// A group the codebook cannot hold: where it is and what it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unrepresentable {
    pub row: usize,
    /// The group's index within its row (`64·block + g`).
    pub group: usize,
    /// The columns of its four lanes, lane 0 first.
    pub cols: [usize; 4],
    /// Its four trits, lane 0 first.
    pub trits: [i8; 4],
}

/// How many groups of `canon` (group size 256, K a multiple of 256; codes already validated) are
/// not one of the 32 STQ1_0 patterns, and the first of them (row-major, then by group).
pub fn first_unrepresentable(canon: CanonicalRef<'_>) -> (u64, Option<Unrepresentable>) {
    let row_bytes = canon.cols / 4;
    if row_bytes == 0 || canon.rows == 0 {
        return (0, None);
    }
    let per_row = |(row, q): (usize, &[u8])| {
        let mut count = 0u64;
        let mut first = None;
        for (b, blk) in q.chunks_exact(64).enumerate() {
            let groups = gather(blk);
            if groups.iter().all(|&x| representable(x)) {
                continue;
            }
            for (g, &x) in groups.iter().enumerate() {
                if representable(x) {
                    continue;
                }
                count += 1;
                first.get_or_insert_with(|| Unrepresentable {
                    row,
                    group: 64 * b + g,
                    cols: std::array::from_fn(|p| 256 * b + lane_value(g, p)),
                    trits: std::array::from_fn(|p| ((x >> (2 * p)) & 3) as i8 - 1),
                });
            }
        }
        (count, first)
    };
    threads::install(|| {
        canon.qweight[..canon.rows * row_bytes]
            .par_chunks(row_bytes)
            .enumerate()
            .map(per_row)
            .reduce(|| (0, None), |a, b| (a.0 + b.0, a.1.or(b.1)))
    })
}

/// Decode a whole STQ1_0 tensor `[rows, cols]` to canonical form (group 256; validated: a NaN/Inf
/// `d` is refused by block index).
pub fn decode(tensor: &str, data: &[u8], rows: usize, cols: usize) -> Result<CanonicalTernary> {
    decode_blocks::<BlockStq1_0>(tensor, data, rows, cols)
}

/// Encode a canonical tensor of group size 256 as STQ1_0 tensor data, refusing (with its row, group
/// and columns) any 4-lane group that is not exactly one zero and three ±1.
pub fn encode(tensor: &str, canon: CanonicalRef<'_>) -> Result<Vec<u8>> {
    canon.validate(tensor)?;
    if canon.group_size != BlockStq1_0::BLOCK_VALUES {
        return Err(Error::invalid(format!(
            "tensor '{tensor}': STQ1_0 encodes group size 256, got {} (regroup first)",
            canon.group_size
        )));
    }
    if canon.cols.is_multiple_of(BlockStq1_0::BLOCK_VALUES) && canon.cols > 0 {
        if let (count, Some(u)) = first_unrepresentable(canon) {
            return Err(Error::validation(
                tensor,
                format!(
                    "STQ1_0 stores exactly one zero and three ±1 per 4-lane group (columns k, k+16, \
                     k+32, k+48 of a 64-column chunk); row {} group {} (columns {:?}) holds trits \
                     {:?}, which its codebook cannot represent; pass requantize=True to requantize \
                     the tensor with llama.cpp's STQ1_0 quantizer",
                    u.row, u.group, u.cols, u.trits
                ),
                (u.row * canon.cols + u.cols[0]) as u64,
                count,
            ));
        }
    }
    encode_blocks::<BlockStq1_0>(tensor, canon)
}

/// Encode a canonical tensor (any group size) as STQ1_0 for GGUF output: regrouped losslessly to
/// 256 and encoded exactly where that is possible; otherwise the refusal of
/// [`Regrouped::exact_or_refuse`] or [`encode`] (naming the first merged group, or the row and group),
/// unless `requantize`, which runs [`requantize`] on the tensor's dequantized weights instead.
pub fn encode_gguf(tensor: &str, canon: CanonicalRef<'_>, requantize: bool) -> Result<Vec<u8>> {
    canon.validate(tensor)?;
    let regrouped;
    let exact = if canon.group_size == BlockStq1_0::BLOCK_VALUES {
        canon
    } else {
        let lossless = canon.try_regroup(BlockStq1_0::BLOCK_VALUES)?;
        if requantize && matches!(lossless, Regrouped::ScalesDiffer { .. }) {
            return self::requantize(tensor, canon);
        }
        regrouped =
            lossless.exact_or_refuse(tensor, canon.group_size, BlockStq1_0::BLOCK_VALUES)?;
        regrouped.as_ref()
    };
    match encode(tensor, exact) {
        // Codes are valid (checked above), so Validation is an unrepresentable group.
        Err(Error::Validation { .. }) if requantize => self::requantize(tensor, canon),
        r => r,
    }
}

// ------------------------------------------------------------------------------------ requantization
//
// The float quantizer is upstream's `quantize_row_stq1_0_ref` (ggml/src/ggml-quants.c of the PR
// branch, sjl623/llama.cpp commit 9b898c1f19b2b0da6db28c99ecea74017892c013), with the lanes of group
// `g` at the shipped stride-16 places ([`lane_value`]) instead of that commit's `x + 4g`:
// * `d = fp16(max |x|)` over the block (no least-squares refit);
// * per group, the zero lane is the lane of smallest `|x|` (the first on ties: a strict `<`);
// * every other lane is `x < 0 ? −1 : +1` (so +0.0 and −0.0 both give +1).
// Every weight is then off by at most `d` (`|x| ≤ max |x|`), and a block that already is one positive
// `d` times codebook patterns comes back bit for bit.

/// Scalar reference of the float quantizer, one block (`x`: 256 finite floats, `block`: 42 bytes),
/// written straight from upstream's loop (the codebook searched by value).
pub fn quantize_block_ref(x: &[f32], block: &mut [u8]) {
    let mut amax = 0.0f32;
    for &v in &x[..256] {
        let a = v.abs();
        if a > amax {
            amax = a;
        }
    }
    block[..D_AT].fill(0);
    for g in 0..64 {
        let xv = |p: usize| x[lane_value(g, p)];
        let mut zero_pos = 0;
        let mut min_abs = xv(0).abs();
        for p in 1..4 {
            let a = xv(p).abs();
            if a < min_abs {
                min_abs = a;
                zero_pos = p;
            }
        }
        let mut qpack = 0u8;
        for p in 0..4 {
            let lane = if p == zero_pos {
                1
            } else if xv(p) < 0.0 {
                0
            } else {
                2
            };
            qpack |= lane << (2 * p);
        }
        let idx = CODEBOOK
            .iter()
            .position(|&c| c == qpack)
            .expect("one zero lane and three ±1: every such group is in the codebook")
            as u8;
        block[g / 2] |= (idx & 15) << (4 * (g & 1));
        block[SIGN_AT + g / 8] |= (idx >> 4) << (g % 8);
    }
    block[D_AT..].copy_from_slice(&f16::from_f32(amax).to_le_bytes());
}

/// Fast path of [`quantize_block_ref`] (held to it bit for bit): a 64-value chunk's lane `p` is 16
/// consecutive floats (groups `0..16` of the chunk side by side), so the zero-lane search runs on
/// whole 16-wide rows that the compiler vectorizes; the codes land in canonical order and
/// [`BlockCodec::pack_block`] writes the block.
#[inline]
pub fn quantize_block(x: &[f32], block: &mut [u8]) {
    let x: &[f32; 256] = x[..256].try_into().expect("256 values");
    let amax = x
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m { v.abs() } else { m });
    let mut canon = [0u8; 64];
    for (c, chunk) in x.chunks_exact(64).enumerate() {
        let lane = |p: usize| -> &[f32; 16] { chunk[16 * p..16 * p + 16].try_into().expect("16") };
        let mut min = lane(0).map(f32::abs);
        let mut zero = [0u8; 16];
        for p in 1..4u8 {
            for ((m, z), &v) in min.iter_mut().zip(&mut zero).zip(lane(p as usize)) {
                if v.abs() < *m {
                    *m = v.abs();
                    *z = p;
                }
            }
        }
        for p in 0..4 {
            for (i, (&v, &z)) in lane(p).iter().zip(&zero).enumerate() {
                let code = if z as usize == p {
                    1
                } else if v < 0.0 {
                    0
                } else {
                    2
                };
                // Value 64c + 16p + i: canonical byte 16c + 4p + i/4, field i % 4.
                canon[16 * c + 4 * p + i / 4] |= code << (2 * (i % 4));
            }
        }
    }
    BlockStq1_0::pack_block(&canon, f16::from_f32(amax), block);
}

/// `K` must be a positive multiple of the block.
fn check_cols(tensor: &str, rows: usize, cols: usize) -> Result<usize> {
    if cols == 0 || !cols.is_multiple_of(BlockStq1_0::BLOCK_VALUES) {
        return Err(Error::invalid(format!(
            "tensor '{tensor}': STQ1_0 needs K (in_features = {cols}) to be a positive multiple of 256"
        )));
    }
    rows.checked_mul(cols / BlockStq1_0::BLOCK_VALUES)
        .and_then(|b| b.checked_mul(BlockStq1_0::BLOCK_BYTES))
        .ok_or_else(|| Error::invalid(format!("tensor '{tensor}': [{rows}, {cols}] overflows")))
}

/// Block scales that overflowed fp16 (`max |x|` ≥ 65520): refused by block index.
fn check_scales(tensor: &str, out: &[u8]) -> Result<()> {
    let bad = out
        .chunks_exact(BlockStq1_0::BLOCK_BYTES)
        .enumerate()
        .filter(|(_, b)| !BlockStq1_0::scale(b).is_finite());
    let (mut count, mut first) = (0u64, None);
    for (i, _) in bad {
        count += 1;
        first.get_or_insert(i as u64);
    }
    match first {
        Some(first) => Err(Error::validation(
            tensor,
            "STQ1_0 block absmax overflows its fp16 scale d",
            first,
            count,
        )),
        None => Ok(()),
    }
}

/// Quantize float weights `[rows, cols]` (row-major, `cols` a multiple of 256) to STQ1_0 tensor data
/// with upstream's float quantizer (see the section comment). NaN/Inf weights are refused by element
/// index, a block whose `max |x|` overflows fp16 by block index.
pub fn quantize(tensor: &str, x: &[f32], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let bytes = check_cols(tensor, rows, cols)?;
    if x.len() != rows * cols {
        return Err(Error::invalid(format!(
            "tensor '{tensor}': {} floats for shape [{rows}, {cols}]",
            x.len()
        )));
    }
    let non_finite = threads::install(|| x.par_iter().filter(|v| !v.is_finite()).count());
    if non_finite > 0 {
        let first = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(Error::validation(
            tensor,
            "non-finite (NaN/Inf) weight: STQ1_0 quantizes finite floats",
            first as u64,
            non_finite as u64,
        ));
    }
    let mut out = vec![0u8; bytes];
    let row_out = cols / BlockStq1_0::BLOCK_VALUES * BlockStq1_0::BLOCK_BYTES;
    threads::install(|| {
        out.par_chunks_mut(row_out)
            .zip(x.par_chunks(cols))
            .for_each(|(o, xr)| {
                for (blk, xb) in o
                    .chunks_exact_mut(BlockStq1_0::BLOCK_BYTES)
                    .zip(xr.chunks_exact(BlockStq1_0::BLOCK_VALUES))
                {
                    quantize_block(xb, blk);
                }
            })
    });
    check_scales(tensor, &out)?;
    Ok(out)
}

/// Requantize a canonical tensor (any group size) to STQ1_0: each row is dequantized to f32
/// (`(c − 1) · scale`, as [`CanonicalRef::dequantize_f32`]) and run through the float quantizer, one
/// row at a time (the whole tensor is never held as floats).
pub fn requantize(tensor: &str, canon: CanonicalRef<'_>) -> Result<Vec<u8>> {
    canon.validate(tensor)?;
    let (rows, cols, g) = (canon.rows, canon.cols, canon.group_size);
    let bytes = check_cols(tensor, rows, cols)?;
    let mut out = vec![0u8; bytes];
    let row_out = cols / BlockStq1_0::BLOCK_VALUES * BlockStq1_0::BLOCK_BYTES;
    threads::install(|| {
        out.par_chunks_mut(row_out)
            .zip(canon.qweight.par_chunks(cols / 4))
            .zip(canon.scales.par_chunks(cols / g))
            .for_each_init(
                || vec![0f32; cols],
                |x, ((o, q), s)| {
                    for ((xg, qg), &sc) in x.chunks_exact_mut(g).zip(q.chunks_exact(g / 4)).zip(s) {
                        let sc = sc.to_f32();
                        let lut = [-sc, 0.0 * sc, sc, 2.0 * sc];
                        for (x4, &b) in xg.chunks_exact_mut(4).zip(qg) {
                            for (j, v) in x4.iter_mut().enumerate() {
                                *v = lut[((b >> (2 * j)) & 3) as usize];
                            }
                        }
                    }
                    for (blk, xb) in o
                        .chunks_exact_mut(BlockStq1_0::BLOCK_BYTES)
                        .zip(x.chunks_exact(BlockStq1_0::BLOCK_VALUES))
                    {
                        quantize_block(xb, blk);
                    }
                },
            )
    });
    // Scales are finite fp16, so max |x| is too: no overflow check needed.
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests;
