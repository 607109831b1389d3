//! Upstream GGUF TQ2_0 (type 35): `{ qs: [u8; 64], d: f16 }`, 66 bytes, 256 values (docs/formats.md#tq2_0).
//!
//! In each 32-byte chunk (128 values) byte `m` holds values `m, m+32, m+64, m+96` at bits 0, 2, 4, 6.
//! The fast path turns 4 source bytes into 4 canonical bytes with one 2-bit 4×4 transpose.

use half::f16;

use super::{read_f16, transpose_2bit_4x4, BlockCodec, Format};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockTq2_0 {
    pub qs: [u8; 64],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockTq2_0>() == 66);

/// Canonical bytes ← one 32-byte interleaved chunk of 128 values (shared with I2_S, whose fields are
/// in the reverse order within a byte: `reversed`).
#[inline(always)]
pub(crate) fn unpack_chunk128(qs: &[u8], canon: &mut [u8], reversed: bool) {
    // Transpose all eight words first, then write the canonical bytes plane by plane: both loops
    // have fixed trip counts and no cross-iteration dependence, so they vectorize.
    let mut words = [0u32; 8];
    for (w, q) in words.iter_mut().zip(qs.chunks_exact(4)) {
        *w = transpose_2bit_4x4(u32::from_le_bytes([q[0], q[1], q[2], q[3]]));
    }
    for l in 0..4 {
        let shift = 8 * if reversed { 3 - l } else { l };
        for (c, w) in canon[l * 8..l * 8 + 8].iter_mut().zip(&words) {
            *c = (w >> shift) as u8;
        }
    }
}

/// One 32-byte interleaved chunk ← 32 canonical bytes (inverse of [`unpack_chunk128`]).
#[inline(always)]
pub(crate) fn pack_chunk128(canon: &[u8], qs: &mut [u8], reversed: bool) {
    for m in (0..32).step_by(4) {
        let mut x = [0u8; 4];
        for (l, xb) in x.iter_mut().enumerate() {
            let src = if reversed { 3 - l } else { l };
            *xb = canon[src * 8 + m / 4];
        }
        let y = transpose_2bit_4x4(u32::from_le_bytes(x)).to_le_bytes();
        qs[m..m + 4].copy_from_slice(&y);
    }
}

/// The portable fast path (also the fallback where AVX-512 is missing; the tests hold the SIMD path
/// to it and both to the reference).
#[inline(always)]
fn unpack_block_portable(block: &[u8], canon: &mut [u8]) {
    unpack_chunk128(&block[..32], &mut canon[..32], false);
    unpack_chunk128(&block[32..64], &mut canon[32..64], false);
}

/// AVX-512BW unpack of a whole block (64 `qs` bytes → 64 canonical bytes in one register): the
/// 2-bit 4×4 transpose of [`transpose_2bit_4x4`] on all 16 words at once, then `vpshufb` gathers
/// byte `l` of four words into one word and `vpermd` puts those words in canonical order.
mod unpack_simd {
    /// `qs`: the block's 64 code bytes; `canon`: its 64 canonical bytes.
    #[inline(always)]
    pub fn block(qs: &[u8], canon: &mut [u8]) {
        assert!(qs.len() == 64 && canon.len() == 64);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers use this path only when `avx512bw_available()` saw avx512f and avx512bw; both
        // slices hold exactly 64 bytes.
        unsafe {
            x86::block(qs, canon)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no SIMD unpack on this architecture")
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        /// Within each 128-bit lane (4 transposed words, byte `l` of word `d` = plane `l` of
        /// index `d`): word `l` ← byte `l` of words 0..4.
        const GATHER: [i8; 64] = {
            let mut c = [0i8; 64];
            let mut p = 0;
            while p < 64 {
                let (l, d) = ((p % 16) / 4, p % 4);
                c[p] = (4 * d + l) as i8;
                p += 1;
            }
            c
        };
        /// Output word `8c + 2l + h` (chunk `c`, plane `l`, half `h`) ← gathered word `4(2c + h) + l`.
        const PLACE: [i32; 16] = {
            let mut t = [0i32; 16];
            let mut o = 0;
            while o < 16 {
                let (c, l, h) = (o / 8, (o % 8) / 2, o % 2);
                t[o] = (4 * (2 * c + h) + l) as i32;
                o += 1;
            }
            t
        };

        #[target_feature(enable = "avx512f,avx512bw")]
        pub unsafe fn block(qs: &[u8], canon: &mut [u8]) {
            let x = _mm512_loadu_si512(qs.as_ptr().cast());
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
            let g = _mm512_shuffle_epi8(x, _mm512_loadu_si512(GATHER.as_ptr().cast()));
            let y = _mm512_permutexvar_epi32(_mm512_loadu_si512(PLACE.as_ptr().cast()), g);
            _mm512_storeu_si512(canon.as_mut_ptr().cast(), y);
        }
    }
}

impl BlockCodec for BlockTq2_0 {
    const FORMAT: Format = Format::Tq2_0;
    const BLOCK_VALUES: usize = 256;
    const BLOCK_BYTES: usize = 66;
    const CAN_HOLD_CODE3: bool = true;

    #[inline(always)]
    fn scale(block: &[u8]) -> f16 {
        read_f16(block, 64)
    }
    #[inline(always)]
    fn unpack_block(block: &[u8], canon: &mut [u8]) {
        if crate::cpu_features::avx512bw_available() {
            unpack_simd::block(&block[..64], &mut canon[..64]);
            return;
        }
        unpack_block_portable(block, canon);
    }
    #[inline(always)]
    fn pack_block(canon: &[u8], d: f16, block: &mut [u8]) {
        pack_chunk128(&canon[..32], &mut block[..32], false);
        pack_chunk128(&canon[32..64], &mut block[32..64], false);
        block[64..66].copy_from_slice(&d.to_le_bytes());
    }

    /// `for j in {0,32}: for l in 0..4: for m in 0..32: y[j*4 + 32l + m] = ((qs[j+m] >> 2l) & 3) − 1`
    fn decode_block_ref(block: &[u8], codes: &mut [u8]) -> f16 {
        for j in [0usize, 32] {
            for l in 0..4 {
                for m in 0..32 {
                    codes[j * 4 + 32 * l + m] = (block[j + m] >> (2 * l)) & 3;
                }
            }
        }
        read_f16(block, 64)
    }

    /// `qs[j+m] = Σ_{n<4} c[j*4 + m + 32n] << 2n`
    fn encode_block_ref(codes: &[u8], d: f16, block: &mut [u8]) {
        for j in [0usize, 32] {
            for m in 0..32 {
                let mut q = 0u8;
                for n in 0..4 {
                    q |= codes[j * 4 + m + 32 * n] << (2 * n);
                }
                block[j + m] = q;
            }
        }
        block[64..66].copy_from_slice(&d.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_unpack_matches_portable_on_any_bytes() {
        if !crate::cpu_features::avx512bw_available() {
            return;
        }
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2000 {
            let mut block = [0u8; 66];
            for b in block.iter_mut() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *b = seed as u8;
            }
            let (mut fast, mut portable) = ([0u8; 64], [0u8; 64]);
            unpack_simd::block(&block[..64], &mut fast);
            unpack_block_portable(&block, &mut portable);
            assert_eq!(fast, portable);
        }
    }
}
