//! Upstream GGUF TQ2_0 (type 35): `{ qs: [u8; 64], d: f16 }`, 66 bytes, 256 values (FORMATS.md §2.3).
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
        unpack_chunk128(&block[..32], &mut canon[..32], false);
        unpack_chunk128(&block[32..64], &mut canon[32..64], false);
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
