//! PrismML PTQ1_0 (GGUF type 143, Bonsai 2): `{ qs: [u8; 24], qh: [u8; 2], d: f16 }`, 28 bytes,
//! 128 values, 1.75 bpw (FORMATS.md §1.3.4): TQ1_0's base-3 packing at group 128 — stages of 16 and
//! 8 bytes (the 32-byte stage does not fit in 24), then 2 `qh` bytes; see [`super::base3`].

use half::f16;

use super::base3::Base3Layout;
use super::{read_f16, BlockCodec, Format};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockPtq1_0 {
    pub qs: [u8; 24],
    pub qh: [u8; 2],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockPtq1_0>() == 28);

const LAYOUT: Base3Layout = Base3Layout {
    values: 128,
    stages: &[16, 8],
    qs_bytes: 24,
    qh_bytes: 2,
    d_offset: 26,
};

impl BlockCodec for BlockPtq1_0 {
    const FORMAT: Format = Format::Ptq1_0;
    const BLOCK_VALUES: usize = 128;
    const BLOCK_BYTES: usize = 28;
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
