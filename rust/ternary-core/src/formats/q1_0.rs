//! Upstream GGUF Q1_0 (type 41, 1-bit Bonsai): `{ d: f16, qs: [u8; 16] }`, 18 bytes, 128 values
//! (docs/formats.md#q1_0): bit `j` of `qs[j/8]` (LSB first) set → `+d`, clear → `−d`.
//!
//! A binary tensor is a ternary tensor without zeros: it decodes to codes 2 / 0. Encoding back is
//! only possible when the canonical tensor has no zero (code 1); the driver refuses otherwise.

use half::f16;

use super::{read_f16, BlockCodec, Format};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ1_0 {
    pub d: [u8; 2],
    pub qs: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ1_0>() == 18);

/// Nibble of 4 sign bits → canonical byte of codes 2 (bit set) / 0 (bit clear).
const NIBBLE_TO_CODES: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut n = 0;
    while n < 16 {
        let mut i = 0;
        while i < 4 {
            if (n >> i) & 1 == 1 {
                t[n] |= 2 << (2 * i);
            }
            i += 1;
        }
        n += 1;
    }
    t
};

impl BlockCodec for BlockQ1_0 {
    const FORMAT: Format = Format::Q1_0;
    const BLOCK_VALUES: usize = 128;
    const BLOCK_BYTES: usize = 18;
    const CAN_HOLD_CODE3: bool = false;

    #[inline(always)]
    fn scale(block: &[u8]) -> f16 {
        read_f16(block, 0)
    }
    #[inline(always)]
    fn unpack_block(block: &[u8], canon: &mut [u8]) {
        for (i, &b) in block[2..18].iter().enumerate() {
            canon[2 * i] = NIBBLE_TO_CODES[(b & 0xF) as usize];
            canon[2 * i + 1] = NIBBLE_TO_CODES[(b >> 4) as usize];
        }
    }
    #[inline(always)]
    fn pack_block(canon: &[u8], d: f16, block: &mut [u8]) {
        block[..2].copy_from_slice(&d.to_le_bytes());
        for i in 0..16 {
            // The high bit of each code (2 = +d) is the sign bit.
            let hi = |c: u8| {
                let x = (c >> 1) & 0x55;
                (x & 1) | ((x >> 1) & 2) | ((x >> 2) & 4) | ((x >> 3) & 8)
            };
            block[2 + i] = hi(canon[2 * i]) | hi(canon[2 * i + 1]) << 4;
        }
    }
    /// `y[j] = ((qs[j/8] >> (j%8)) & 1) ? +d : −d`
    fn decode_block_ref(block: &[u8], codes: &mut [u8]) -> f16 {
        for (j, c) in codes.iter_mut().enumerate() {
            *c = if (block[2 + j / 8] >> (j % 8)) & 1 == 1 {
                2
            } else {
                0
            };
        }
        read_f16(block, 0)
    }
    fn encode_block_ref(codes: &[u8], d: f16, block: &mut [u8]) {
        block[..2].copy_from_slice(&d.to_le_bytes());
        block[2..18].fill(0);
        for (j, &c) in codes.iter().enumerate() {
            if c == 2 {
                block[2 + j / 8] |= 1 << (j % 8);
            }
        }
    }
}
