//! Upstream GGUF Q2_0 (type 42, group 64): `{ d: f16, qs: [u8; 16] }`, 18 bytes.
//!
//! docs/formats.md#q2_0: value `j` is code `q = (qs[j/4] >> 2·(j%4)) & 3`, `y = (q − 1)·d`. That is the
//! canonical byte order, so decoding is a copy of `qs` plus the scale. The shared consecutive-2-bit
//! helpers here also serve [`super::pq2_0`] (same codec, 128-value blocks).

use half::f16;

use super::{read_f16, Format};

/// A consecutive 2-bit block format `{ d: f16, qs }` (size checked against `bytes`) and its
/// [`BlockCodec`](super::BlockCodec) impl: decoding is a copy of `qs` plus the scale. Q2_0 and PQ2_0 differ only in
/// these parameters.
macro_rules! consecutive_2bit_block {
    ($(#[$attr:meta])* $name:ident, $format:expr, values: $values:literal, bytes: $bytes:literal) => {
        $(#[$attr])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        pub struct $name {
            pub d: [u8; 2],
            pub qs: [u8; $values / 4],
        }
        const _: () = assert!(std::mem::size_of::<$name>() == $bytes);

        impl $crate::formats::BlockCodec for $name {
            const FORMAT: $crate::formats::Format = $format;
            const BLOCK_VALUES: usize = $values;
            const BLOCK_BYTES: usize = $bytes;
            const CAN_HOLD_CODE3: bool = true;

            #[inline(always)]
            fn scale(block: &[u8]) -> half::f16 {
                $crate::formats::read_f16(block, 0)
            }
            #[inline(always)]
            fn unpack_block(block: &[u8], canon: &mut [u8]) {
                canon.copy_from_slice(&block[2..Self::BLOCK_BYTES]);
            }
            #[inline(always)]
            fn pack_block(canon: &[u8], d: half::f16, block: &mut [u8]) {
                block[..2].copy_from_slice(&d.to_le_bytes());
                block[2..Self::BLOCK_BYTES].copy_from_slice(canon);
            }
            fn decode_block_ref(block: &[u8], codes: &mut [u8]) -> half::f16 {
                $crate::formats::q2_0::decode_consecutive_ref(block, codes)
            }
            fn encode_block_ref(codes: &[u8], d: half::f16, block: &mut [u8]) {
                $crate::formats::q2_0::encode_consecutive_ref(codes, d, block)
            }
        }
    };
}
pub(crate) use consecutive_2bit_block;

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

consecutive_2bit_block!(BlockQ2_0, Format::Q2_0, values: 64, bytes: 18);
