//! Bit-exact ternary codecs: one module per source format, each decoding to (and, where the format
//! can hold it, encoding from) the [canonical](crate::canonical) form.
//!
//! Every GGUF block format implements [`BlockCodec`]: a `#[repr(C)]` block struct with a compile-time
//! size assertion, a plain scalar reference written straight from its docs/formats.md section (`decode_block_ref` /
//! `encode_block_ref`, one value at a time) and a fast path (`unpack_block` / `pack_block`, lookup
//! tables and 2-bit transposes on whole words) that the tests hold to the reference bit for bit.
//! The generic tensor-level block drivers (row-parallel, validating) are [`blocks`]; the dispatch by
//! format and regrouping live in [`crate::repack`].
//!
//! Formats that are not GGUF block formats (transformers BitNet, MLX affine packs, dense "unpacked"
//! ternary and dense-float ternarization) take their companion tensors explicitly: see [`bitnet`],
//! [`mlx`] and [`dense`].

pub mod base3;
pub mod bitnet;
pub mod blocks;
pub mod dense;
pub mod i2_s;
pub mod mlx;
pub mod pq2_0;
pub mod ptq1_0;
pub mod q1_0;
pub mod q2_0;
pub mod stq1_0;
pub mod tq1_0;
pub mod tq2_0;

use half::f16;

use crate::{Error, Result};

/// GGUF tensor types that hold ternary (or binary) weights, plus the non-GGUF packings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// Upstream TQ1_0 (id 34): base-3, 256 values in 54 bytes.
    Tq1_0,
    /// Upstream TQ2_0 (id 35): 2-bit, 256 values in 66 bytes, 32-byte chunk interleave.
    Tq2_0,
    /// Upstream Q2_0 (id 42): 2-bit consecutive, 64 values in 18 bytes.
    Q2_0,
    /// PrismML first-gen fork "Q2_0" (also id 42): same bytes as PQ2_0, 128 values in 34 bytes.
    Q2_0G128,
    /// PrismML PQ2_0 (id 142): 2-bit consecutive, 128 values in 34 bytes.
    Pq2_0,
    /// PrismML PTQ1_0 (id 143): base-3, 128 values in 28 bytes.
    Ptq1_0,
    /// Upstream Q1_0 (id 41): binary ±d, 128 values in 18 bytes (decodes to codes 0/2, no zeros).
    Q1_0,
    /// Tencent STQ1_0 (id 43, llama.cpp PR #22836): 3:4-sparse ternary codebook, 256 values in 42 bytes.
    Stq1_0,
    /// bitnet.cpp I2_S (id 36), x86 128-interleave, one f32 scale per tensor in a 32-byte tail.
    I2S,
    /// transformers BitNet packing: uint8 `[N/4, K]` along the output dim + one `weight_scale`.
    BitNet,
    /// MLX affine 2-bit pack: uint32 `[N, K/16]` + fp16 `scales`/`biases` with bias = −scale.
    Mlx,
    /// Dense fp16/bf16/fp32 tensor whose groups hold {−a, 0, +a} ("unpacked" checkpoints).
    Dense,
}

/// Names accepted by [`Format::from_name`] (case-insensitive), as the container layer reports them.
pub const FORMAT_NAMES: &str =
    "TQ1_0, TQ2_0, Q2_0, Q2_0_G128, PQ2_0, PTQ1_0, Q1_0, STQ1_0, I2_S, BITNET, MLX, DENSE";

impl Format {
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_uppercase().as_str() {
            "TQ1_0" => Format::Tq1_0,
            "TQ2_0" => Format::Tq2_0,
            "Q2_0" | "Q2_0_G64" => Format::Q2_0,
            "Q2_0_G128" => Format::Q2_0G128,
            "PQ2_0" => Format::Pq2_0,
            "PTQ1_0" => Format::Ptq1_0,
            "Q1_0" | "Q1_0_G128" => Format::Q1_0,
            "STQ1_0" => Format::Stq1_0,
            "I2_S" => Format::I2S,
            "BITNET" => Format::BitNet,
            "MLX" => Format::Mlx,
            "DENSE" | "F16" | "BF16" | "F32" => Format::Dense,
            "TL1" | "TL2" => {
                return Err(Error::invalid(format!(
                    "bitnet.cpp {name} (GGUF type {}) is a kernel-tiled LUT layout specific to one \
                     model's kernel_config.ini and cannot be decoded portably; convert the source \
                     checkpoint (or an I2_S / TQ2_0 file) instead",
                    if name.eq_ignore_ascii_case("TL1") { 38 } else { 39 }
                )))
            }
            _ => {
                return Err(Error::invalid(format!(
                    "unknown ternary format '{name}'; supported: {FORMAT_NAMES}"
                )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Tq1_0 => "TQ1_0",
            Format::Tq2_0 => "TQ2_0",
            Format::Q2_0 => "Q2_0",
            Format::Q2_0G128 => "Q2_0_G128",
            Format::Pq2_0 => "PQ2_0",
            Format::Ptq1_0 => "PTQ1_0",
            Format::Q1_0 => "Q1_0",
            Format::Stq1_0 => "STQ1_0",
            Format::I2S => "I2_S",
            Format::BitNet => "BITNET",
            Format::Mlx => "MLX",
            Format::Dense => "DENSE",
        }
    }

    /// The GGUF type id (None for non-GGUF packings).
    pub fn gguf_type_id(self) -> Option<u32> {
        match self {
            Format::Tq1_0 => Some(34),
            Format::Tq2_0 => Some(35),
            Format::Q2_0 | Format::Q2_0G128 => Some(42),
            Format::Pq2_0 => Some(142),
            Format::Ptq1_0 => Some(143),
            Format::Q1_0 => Some(41),
            Format::Stq1_0 => Some(43),
            Format::I2S => Some(36),
            _ => None,
        }
    }

    /// The group size a format stores one scale for (None: one scale per tensor, any group fits).
    pub fn native_group(self) -> Option<usize> {
        match self {
            Format::Tq1_0 | Format::Tq2_0 | Format::Stq1_0 => Some(256),
            Format::Q2_0 => Some(64),
            Format::Q2_0G128 | Format::Pq2_0 | Format::Ptq1_0 | Format::Q1_0 => Some(128),
            Format::I2S | Format::BitNet | Format::Mlx | Format::Dense => None,
        }
    }
}

/// A GGUF block format: one block of `BLOCK_VALUES` consecutive values of one row along K.
///
/// `unpack_block`/`pack_block` are the fast paths; `decode_block_ref`/`encode_block_ref` the scalar
/// references they must match bit for bit (also on bytes no encoder produces).
pub trait BlockCodec: Sync {
    const FORMAT: Format;
    const BLOCK_VALUES: usize;
    const BLOCK_BYTES: usize;
    /// Whether the block can hold code 3 (2-bit formats); base-3 and binary formats cannot.
    const CAN_HOLD_CODE3: bool;

    /// The block's scale `d`.
    fn scale(block: &[u8]) -> f16;
    /// Fast path: block bytes → `BLOCK_VALUES / 4` canonical bytes.
    fn unpack_block(block: &[u8], canon: &mut [u8]);
    /// Fast path over consecutive whole blocks (`canon.len() / (BLOCK_VALUES / 4)` of them): formats
    /// whose SIMD path handles several blocks per register override this.
    #[inline(always)]
    fn unpack_blocks(blocks: &[u8], canon: &mut [u8]) {
        for (blk, c) in blocks
            .chunks_exact(Self::BLOCK_BYTES)
            .zip(canon.chunks_exact_mut(Self::BLOCK_VALUES / 4))
        {
            Self::unpack_block(blk, c);
        }
    }
    /// Fast path: canonical bytes + scale → block bytes (codes must be 0..=2).
    fn pack_block(canon: &[u8], d: f16, block: &mut [u8]);

    /// Scalar reference: block bytes → one code (`t + 1`, 0..=3) per value, and the scale.
    fn decode_block_ref(block: &[u8], codes: &mut [u8]) -> f16;
    /// Scalar reference: codes (0..=2) + scale → block bytes.
    fn encode_block_ref(codes: &[u8], d: f16, block: &mut [u8]);
}

/// Read a little-endian fp16 at `at`.
#[inline(always)]
pub(crate) fn read_f16(bytes: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// Transpose a 4×4 matrix of 2-bit fields held in a little-endian word: field `j` of byte `i`
/// becomes field `i` of byte `j`. This one primitive turns TQ2_0, I2_S and BitNet's "4 values from 4
/// places in one byte" into the canonical "4 consecutive values in one byte" (and back: it is its own
/// inverse). Two delta swaps: 2×2 sub-blocks first (distance 6 bits), then the off-diagonal blocks
/// (distance 12 bits).
#[inline(always)]
pub const fn transpose_2bit_4x4(x: u32) -> u32 {
    let t = ((x >> 6) ^ x) & 0x00CC_00CC;
    let x = x ^ t ^ (t << 6);
    let t = ((x >> 12) ^ x) & 0x0000_F0F0;
    x ^ t ^ (t << 12)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_matches_definition_and_is_an_involution() {
        let field = |x: u32, byte: u32, f: u32| (x >> (8 * byte + 2 * f)) & 3;
        for seed in 0u32..2000 {
            let x = seed.wrapping_mul(0x9E37_79B9) ^ (seed << 7);
            let y = transpose_2bit_4x4(x);
            for i in 0..4 {
                for j in 0..4 {
                    assert_eq!(field(y, j, i), field(x, i, j));
                }
            }
            assert_eq!(transpose_2bit_4x4(y), x);
        }
    }

    #[test]
    fn tl1_tl2_refused_by_name() {
        let e = Format::from_name("TL2").unwrap_err().to_string();
        assert!(e.contains("TL2") && e.contains("39"), "{e}");
        assert!(Format::from_name("tl1")
            .unwrap_err()
            .to_string()
            .contains("38"));
    }
}
