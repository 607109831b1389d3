//! Upstream GGUF Q2_0 (type 42, group 64): `{ d: f16, qs: [u8; 16] }`, 18 bytes.
//!
//! FORMATS.md §1.3.2: value `j` is code `q = (qs[j/4] >> 2·(j%4)) & 3`, `y = (q − 1)·d`. That is the
//! canonical byte order, so decoding is a copy of `qs` plus the scale. The shared consecutive-2-bit
//! helpers here also serve [`super::pq2_0`] (same codec, 128-value blocks).

use half::f16;

use super::{read_f16, BlockCodec, Format};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ2_0 {
    pub d: [u8; 2],
    pub qs: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ2_0>() == 18);

/// Scalar reference of the consecutive 2-bit codec (`d` first, then `values/4` code bytes).
pub(crate) fn decode_consecutive_ref(block: &[u8], codes: &mut [u8]) -> f16 {
    let d = read_f16(block, 0);
    let qs = &block[2..];
    for (j, c) in codes.iter_mut().enumerate() {
        *c = (qs[j / 4] >> (2 * (j % 4))) & 3;
    }
    d
}

pub(crate) fn encode_consecutive_ref(codes: &[u8], d: f16, block: &mut [u8]) {
    block[..2].copy_from_slice(&d.to_le_bytes());
    let qs = &mut block[2..];
    qs.fill(0);
    for (j, &c) in codes.iter().enumerate() {
        qs[j / 4] |= c << (2 * (j % 4));
    }
}

impl BlockCodec for BlockQ2_0 {
    const FORMAT: Format = Format::Q2_0;
    const BLOCK_VALUES: usize = 64;
    const BLOCK_BYTES: usize = 18;
    const CAN_HOLD_CODE3: bool = true;

    #[inline(always)]
    fn scale(block: &[u8]) -> f16 {
        read_f16(block, 0)
    }
    #[inline(always)]
    fn unpack_block(block: &[u8], canon: &mut [u8]) {
        canon.copy_from_slice(&block[2..Self::BLOCK_BYTES]);
    }
    #[inline(always)]
    fn pack_block(canon: &[u8], d: f16, block: &mut [u8]) {
        block[..2].copy_from_slice(&d.to_le_bytes());
        block[2..Self::BLOCK_BYTES].copy_from_slice(canon);
    }
    fn decode_block_ref(block: &[u8], codes: &mut [u8]) -> f16 {
        decode_consecutive_ref(block, codes)
    }
    fn encode_block_ref(codes: &[u8], d: f16, block: &mut [u8]) {
        encode_consecutive_ref(codes, d, block)
    }
}
