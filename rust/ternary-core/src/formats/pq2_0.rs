//! PrismML PQ2_0 (GGUF type 142) and the first-gen fork "Q2_0" (type 42 with 128-value blocks, also
//! called Q2_0_G128): `{ d: f16, qs: [u8; 32] }`, 34 bytes, the consecutive 2-bit codec of
//! [`super::q2_0`] at group 128 (FORMATS.md §1.3.2). Both names share these bytes; the container
//! layer tells the two id-42 variants apart by byte span.

use half::f16;

use super::q2_0::{decode_consecutive_ref, encode_consecutive_ref};
use super::{read_f16, BlockCodec, Format};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockPq2_0 {
    pub d: [u8; 2],
    pub qs: [u8; 32],
}
const _: () = assert!(std::mem::size_of::<BlockPq2_0>() == 34);

impl BlockCodec for BlockPq2_0 {
    const FORMAT: Format = Format::Pq2_0;
    const BLOCK_VALUES: usize = 128;
    const BLOCK_BYTES: usize = 34;
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
