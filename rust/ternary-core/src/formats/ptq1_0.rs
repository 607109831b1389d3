//! PrismML PTQ1_0 (GGUF type 143, Bonsai 2): `{ qs: [u8; 24], qh: [u8; 2], d: f16 }`, 28 bytes,
//! 128 values, 1.75 bpw (docs/formats.md#ptq1_0): TQ1_0's base-3 packing at group 128 — stages of 16 and
//! 8 bytes (the 32-byte stage does not fit in 24), then 2 `qh` bytes; see [`super::base3`].

use super::base3::base3_block;
use super::Format;

base3_block!(BlockPtq1_0, Format::Ptq1_0, values: 128, bytes: 28, qs: 24, qh: 2, stages: [16, 8],
    fast: (unpack, unpack_run));

/// One block: AVX-512BW where the CPU has it, else the [`Base3Layout`](super::base3) table path.
#[inline(always)]
fn unpack(block: &[u8], canon: &mut [u8]) {
    if crate::cpu_features::avx512bw_available() {
        assert!(block.len() >= 26 && canon.len() == 32);
        // SAFETY: avx512f and avx512bw are present; the masked load reads the first 26 bytes of
        // `block` only, and `canon` holds 32 bytes.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            x86::blocks(block, canon, false)
        }
        return;
    }
    BlockPtq1_0::LAYOUT.unpack(block, canon)
}

/// A run of whole blocks, two per register on the AVX-512BW path.
#[inline(always)]
fn unpack_run(blocks: &[u8], canon: &mut [u8]) {
    let done = if crate::cpu_features::avx512bw_available() {
        for (b2, c2) in blocks.chunks_exact(56).zip(canon.chunks_exact_mut(64)) {
            // SAFETY: as in `unpack`, with 56 block bytes and 64 canonical bytes.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                x86::blocks(b2, c2, true)
            }
        }
        blocks.len() / 56 * 2
    } else {
        0
    };
    for (blk, c) in blocks[28 * done..]
        .chunks_exact(28)
        .zip(canon[32 * done..].chunks_exact_mut(32))
    {
        unpack(blk, c);
    }
}

/// AVX-512BW unpack of one or two blocks: their 26 data bytes each in one 256-bit half of a
/// register; digit `n` of byte `q` is `(3·q) >> 8` with `q ← 3·q mod 256` between digits, i.e.
/// `[q ≥ 86] + [q ≥ 171]`; four consecutive bytes' digits combine into one canonical byte with
/// `vpmaddubsw`/`vpmaddwd` (weights 1, 4, 16, 64), and one `vpshufb` puts the bytes in canonical order.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// (Per 256-bit half, one block.) After the loop, word `i` holds byte `n` = canonical byte of digit `n` (n < 4) of source word
    /// `i`. 128-bit lane 0 (words 0..4, stage 1): byte `4n + i` ← byte `n` of word `i`. Lane 1 (words
    /// 4..8): bytes 0..8 ← stage 2 `2n + i` (byte `n` of word `4 + i`), bytes 8..12 ← word 6 (`qh`).
    const ORDER: [i8; 64] = {
        let mut c = [-128i8; 64];
        let mut half = 0;
        while half < 64 {
            let mut p = 0;
            while p < 16 {
                c[half + p] = (4 * (p % 4) + p / 4) as i8;
                p += 1;
            }
            let mut p = 0;
            while p < 8 {
                c[half + 16 + p] = (4 * (p % 2) + p / 2) as i8;
                p += 1;
            }
            let mut p = 0;
            while p < 4 {
                c[half + 24 + p] = (8 + p) as i8;
                p += 1;
            }
            half += 32;
        }
        c
    };

    /// Block `b` (0 or 1) words 0..7 ← its bytes 0..26 (the scale is masked off).
    const SPLIT: [i32; 16] = [0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10, 11, 12, 13, 13];

    /// `two`: `block` holds 56 bytes (two blocks) and `canon` 64; else 26+ and 32.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn blocks(block: &[u8], canon: &mut [u8], two: bool) {
        let mask = if two {
            0x03FF_FFFF | 0x03FF_FFFF << 28
        } else {
            0x03FF_FFFF
        };
        let q = _mm512_maskz_loadu_epi8(mask, block.as_ptr().cast());
        let mut q = _mm512_permutexvar_epi32(_mm512_loadu_si512(SPLIT.as_ptr().cast()), q);
        let (ge1, ge2, one) = (
            _mm512_set1_epi8(86),
            _mm512_set1_epi8(171u8 as i8),
            _mm512_set1_epi8(1),
        );
        let (w_pair, w_quad) = (_mm512_set1_epi16(0x0401), _mm512_set1_epi32(0x0010_0001));
        let mut acc = _mm512_setzero_si512();
        let mut last = _mm512_setzero_si512();
        for n in 0..5 {
            let d = _mm512_maskz_mov_epi8(_mm512_cmpge_epu8_mask(q, ge1), one);
            let d = _mm512_mask_add_epi8(d, _mm512_cmpge_epu8_mask(q, ge2), d, one);
            // Per 32-bit word: d0 + 4·d1 + 16·d2 + 64·d3.
            let r = _mm512_madd_epi16(_mm512_maddubs_epi16(d, w_pair), w_quad);
            if n < 4 {
                acc = _mm512_or_si512(acc, _mm512_sllv_epi32(r, _mm512_set1_epi32(8 * n)));
            } else {
                last = r;
            }
            q = _mm512_add_epi8(q, _mm512_add_epi8(q, q));
        }
        // Straight from registers (a round trip through a stack buffer stalls store forwarding).
        let t = _mm512_shuffle_epi8(acc, _mm512_loadu_si512(ORDER.as_ptr().cast()));
        let l = _mm512_cvtepi32_epi8(last);
        store(canon.as_mut_ptr(), _mm512_castsi512_si256(t), l);
        if two {
            store(
                canon.as_mut_ptr().add(32),
                _mm512_extracti64x4_epi64::<1>(t),
                _mm_srli_si128::<8>(l),
            );
        }
    }

    /// One block's 32 canonical bytes from its ordered half `t` and its digit-4 bytes `l`.
    #[inline(always)]
    unsafe fn store(p: *mut u8, t: __m256i, l: __m128i) {
        let (lane0, lane1) = (_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
        // qh: canonical byte 30 = digits 0, 1 of qh[0], qh[1]; byte 31 = digits 2, 3.
        let h = _mm_extract_epi32::<2>(lane1) as u32;
        let h = h | (h >> 4);
        _mm_storeu_si128(p.cast(), lane0);
        p.add(16)
            .cast::<u32>()
            .write_unaligned(_mm_cvtsi128_si32(l) as u32);
        _mm_storel_epi64(p.add(20).cast(), lane1);
        p.add(28)
            .cast::<u16>()
            .write_unaligned(_mm_extract_epi16::<2>(l) as u16);
        *p.add(30) = h as u8;
        *p.add(31) = (h >> 16) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_unpack_matches_layout_on_any_bytes() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        for n in [1usize, 2, 3, 5, 8, 11] {
            for _ in 0..300 {
                let mut blocks = vec![0u8; 28 * n];
                for b in blocks.iter_mut() {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    *b = seed as u8;
                }
                let mut want = vec![0u8; 32 * n];
                for (blk, c) in blocks.chunks_exact(28).zip(want.chunks_exact_mut(32)) {
                    BlockPtq1_0::LAYOUT.unpack(blk, c);
                }
                let mut run = vec![0u8; 32 * n];
                unpack_run(&blocks, &mut run);
                assert_eq!(run, want, "{blocks:02x?}");
                let mut one = vec![0u8; 32 * n];
                for (blk, c) in blocks.chunks_exact(28).zip(one.chunks_exact_mut(32)) {
                    unpack(blk, c);
                }
                assert_eq!(one, want);
            }
        }
    }
}
