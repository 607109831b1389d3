//! Upstream GGUF TQ1_0 (type 34): `{ qs: [u8; 48], qh: [u8; 4], d: f16 }`, 54 bytes, 256 values
//! (FORMATS.md §2.4): base-3 stages of 32 and 16 bytes, then 4 `qh` bytes; see [`super::base3`].

use half::f16;

use super::base3::Base3Layout;
use super::{read_f16, BlockCodec, Format};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockTq1_0 {
    pub qs: [u8; 48],
    pub qh: [u8; 4],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockTq1_0>() == 54);

const LAYOUT: Base3Layout = Base3Layout {
    values: 256,
    stages: &[32, 16],
    qs_bytes: 48,
    qh_bytes: 4,
    d_offset: 52,
};

impl BlockCodec for BlockTq1_0 {
    const FORMAT: Format = Format::Tq1_0;
    const BLOCK_VALUES: usize = 256;
    const BLOCK_BYTES: usize = 54;
    const CAN_HOLD_CODE3: bool = false;

    #[inline(always)]
    fn scale(block: &[u8]) -> f16 {
        read_f16(block, LAYOUT.d_offset)
    }
    #[inline(always)]
    fn unpack_block(block: &[u8], canon: &mut [u8]) {
        LAYOUT.unpack(block, canon)
    }
    #[inline(always)]
    fn pack_block(canon: &[u8], d: f16, block: &mut [u8]) {
        LAYOUT.pack(canon, d, block)
    }
    fn decode_block_ref(block: &[u8], codes: &mut [u8]) -> f16 {
        LAYOUT.decode_ref(block, codes)
    }
    fn encode_block_ref(codes: &[u8], d: f16, block: &mut [u8]) {
        LAYOUT.encode_ref(codes, d, block)
    }
}
