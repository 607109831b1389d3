//! The base-3 ("5 trits per byte") packing shared by TQ1_0 and PTQ1_0 (docs/formats.md#base3).
//!
//! A block is `qs` (5 trits per byte) in *stages*, then `qh` (4 trits per byte), then `d: f16`. In a
//! stage of `c` bytes starting at `qs[o]`, value `5·o + n·c + m` is digit `n` of `qs[o + m]`; in `qh`
//! (H bytes) value `5·|qs| + n·H + h` is digit `n` of `qh[h]`. Digit `n` (most significant first) of
//! byte `b` is `((b·3ⁿ mod 256)·3) >> 8`; the encoder stores `⌈v·256/243⌉` with `v = Σ c_k·3^(4−k)`
//! (qh: `v = 3·Σ c_k·3^(3−k)`). Every byte decodes to digits in {0,1,2}, so code 3 cannot occur;
//! bytes no encoder wrote decode exactly as the reference dequantizer does.

use half::f16;

use super::read_f16;

/// Geometry of one base-3 block format.
pub(crate) struct Base3Layout {
    pub values: usize,
    /// Byte counts of the `qs` stages, in order.
    pub stages: &'static [usize],
    pub qs_bytes: usize,
    pub qh_bytes: usize,
    pub d_offset: usize,
}

/// A base-3 block format: its `#[repr(C)]` struct `{ qs, qh, d: f16 }` (size checked against
/// `bytes`) and a [`BlockCodec`](super::BlockCodec) impl that runs its [`Base3Layout`] (`fast`:
/// unpackers of one block and of a run of blocks that replace it, e.g. SIMD ones). TQ1_0 and PTQ1_0
/// differ only in these parameters.
macro_rules! base3_block {
    ($(#[$attr:meta])* $name:ident, $format:expr, values: $values:literal, bytes: $bytes:literal,
     qs: $qs:literal, qh: $qh:literal, stages: $stages:expr
     $(, fast: ($unpack:path, $unpack_blocks:path))?) => {
        $(#[$attr])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        pub struct $name {
            pub qs: [u8; $qs],
            pub qh: [u8; $qh],
            pub d: [u8; 2],
        }
        const _: () = assert!(std::mem::size_of::<$name>() == $bytes);

        impl $name {
            const LAYOUT: $crate::formats::base3::Base3Layout =
                $crate::formats::base3::Base3Layout {
                    values: $values,
                    stages: &$stages,
                    qs_bytes: $qs,
                    qh_bytes: $qh,
                    d_offset: $qs + $qh,
                };
        }

        impl $crate::formats::BlockCodec for $name {
            const FORMAT: $crate::formats::Format = $format;
            const BLOCK_VALUES: usize = $values;
            const BLOCK_BYTES: usize = $bytes;
            const CAN_HOLD_CODE3: bool = false;

            #[inline(always)]
            fn scale(block: &[u8]) -> half::f16 {
                $crate::formats::read_f16(block, Self::LAYOUT.d_offset)
            }
            #[inline(always)]
            #[allow(unreachable_code)] // with `fast`, the layout's own unpack is not reached
            fn unpack_block(block: &[u8], canon: &mut [u8]) {
                $(return $unpack(block, canon);)?
                Self::LAYOUT.unpack(block, canon)
            }
            $(
            #[inline(always)]
            fn unpack_blocks(blocks: &[u8], canon: &mut [u8]) {
                $unpack_blocks(blocks, canon)
            }
            )?
            #[inline(always)]
            fn pack_block(canon: &[u8], d: half::f16, block: &mut [u8]) {
                Self::LAYOUT.pack(canon, d, block)
            }
            fn decode_block_ref(block: &[u8], codes: &mut [u8]) -> half::f16 {
                Self::LAYOUT.decode_ref(block, codes)
            }
            fn encode_block_ref(codes: &[u8], d: half::f16, block: &mut [u8]) {
                Self::LAYOUT.encode_ref(codes, d, block)
            }
        }
    };
}
pub(crate) use base3_block;

/// Digit `n` (0 = most significant) of a packed byte — the reference formula.
#[inline(always)]
pub(crate) const fn digit(b: u8, n: u32) -> u8 {
    let q = (b as u32 * 3u32.pow(n)) as u8;
    ((q as u32 * 3) >> 8) as u8
}

/// Packed byte of up to five codes `v = Σ c_k·3^(4−k)`: `⌈v·256/243⌉`.
#[inline(always)]
pub(crate) const fn pack_value(v: u32) -> u8 {
    (v * 256).div_ceil(243) as u8
}

/// byte → its five digits, digit `n` in byte `n` of the word (so four bytes shifted by 0, 2, 4, 6 and
/// OR-ed give, in byte `n`, the canonical byte of their digit-`n` values).
const DIGITS: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut n = 0;
        let mut w = 0u64;
        while n < 5 {
            w |= (digit(b as u8, n) as u64) << (8 * n);
            n += 1;
        }
        t[b] = w;
        b += 1;
    }
    t
};

/// `WEIGHTED[n][canonical byte]`: lane `i` (8 bits) holds `code_i · 3^(4−n)`; summing the five tables
/// gives in lane `i` the value `v` of packed byte `i` (≤ 242, so lanes never carry).
const WEIGHTED: [[u32; 256]; 5] = {
    let mut t = [[0u32; 256]; 5];
    let mut n = 0;
    while n < 5 {
        let w = 3u32.pow(4 - n as u32);
        let mut b = 0;
        while b < 256 {
            let mut i = 0;
            let mut lanes = 0u32;
            while i < 4 {
                lanes |= (((b >> (2 * i)) & 3) as u32 * w) << (8 * i);
                i += 1;
            }
            t[n][b] = lanes;
            b += 1;
        }
        n += 1;
    }
    t
};

/// `v` → packed byte, for every lane value an 8-bit lane can hold.
const PACK: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut v = 0;
    while v < 256 {
        t[v] = if v < 243 { pack_value(v as u32) } else { 0 };
        v += 1;
    }
    t
};

impl Base3Layout {
    /// Reference decode, one value at a time.
    pub fn decode_ref(&self, block: &[u8], codes: &mut [u8]) -> f16 {
        let mut o = 0;
        for &c in self.stages {
            for n in 0..5 {
                for m in 0..c {
                    codes[5 * o + n * c + m] = digit(block[o + m], n as u32);
                }
            }
            o += c;
        }
        let (h_bytes, vq) = (self.qh_bytes, 5 * self.qs_bytes);
        for n in 0..4 {
            for h in 0..h_bytes {
                codes[vq + n * h_bytes + h] = digit(block[self.qs_bytes + h], n as u32);
            }
        }
        read_f16(block, self.d_offset)
    }

    /// Reference encode, one byte at a time.
    pub fn encode_ref(&self, codes: &[u8], d: f16, block: &mut [u8]) {
        let mut o = 0;
        for &c in self.stages {
            for m in 0..c {
                let mut v = 0u32;
                for n in 0..5 {
                    v = v * 3 + codes[5 * o + n * c + m] as u32;
                }
                block[o + m] = pack_value(v);
            }
            o += c;
        }
        let (h_bytes, vq) = (self.qh_bytes, 5 * self.qs_bytes);
        for h in 0..h_bytes {
            let mut v = 0u32;
            for n in 0..4 {
                v = v * 3 + codes[vq + n * h_bytes + h] as u32;
            }
            block[self.qs_bytes + h] = pack_value(v * 3);
        }
        block[self.d_offset..self.d_offset + 2].copy_from_slice(&d.to_le_bytes());
    }

    /// Fast decode to canonical bytes: four packed bytes at a time through [`DIGITS`].
    #[inline(always)]
    pub fn unpack(&self, block: &[u8], canon: &mut [u8]) {
        let mut o = 0;
        for &c in self.stages {
            for m in (0..c).step_by(4) {
                let q = &block[o + m..o + m + 4];
                let comb = DIGITS[q[0] as usize]
                    | DIGITS[q[1] as usize] << 2
                    | DIGITS[q[2] as usize] << 4
                    | DIGITS[q[3] as usize] << 6;
                for n in 0..5 {
                    canon[(5 * o + n * c + m) / 4] = (comb >> (8 * n)) as u8;
                }
            }
            o += c;
        }
        let (h_bytes, vq) = (self.qh_bytes, 5 * self.qs_bytes);
        canon[vq / 4..self.values / 4].fill(0);
        for h in 0..h_bytes {
            let digits = DIGITS[block[self.qs_bytes + h] as usize];
            for n in 0..4 {
                let v = vq + n * h_bytes + h;
                canon[v / 4] |= (((digits >> (8 * n)) & 3) as u8) << (2 * (v % 4));
            }
        }
    }

    /// Fast encode from canonical bytes (codes must be 0..=2): lane sums through [`WEIGHTED`].
    #[inline(always)]
    pub fn pack(&self, canon: &[u8], d: f16, block: &mut [u8]) {
        let mut o = 0;
        for &c in self.stages {
            for m in (0..c).step_by(4) {
                let mut lanes = 0u32;
                for (n, table) in WEIGHTED.iter().enumerate() {
                    lanes += table[canon[(5 * o + n * c + m) / 4] as usize];
                }
                for i in 0..4 {
                    block[o + m + i] = PACK[((lanes >> (8 * i)) & 0xFF) as usize];
                }
            }
            o += c;
        }
        let (h_bytes, vq) = (self.qh_bytes, 5 * self.qs_bytes);
        for h in 0..h_bytes {
            let mut v = 0u32;
            for n in 0..4 {
                let idx = vq + n * h_bytes + h;
                v = v * 3 + ((canon[idx / 4] >> (2 * (idx % 4))) & 3) as u32;
            }
            block[self.qs_bytes + h] = PACK[(v * 3).min(255) as usize];
        }
        block[self.d_offset..self.d_offset + 2].copy_from_slice(&d.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_five_digit_value_round_trips() {
        for v in 0..243u32 {
            let b = pack_value(v);
            let mut back = 0u32;
            for n in 0..5 {
                back = back * 3 + digit(b, n) as u32;
            }
            assert_eq!(back, v, "byte {b:#04x}");
        }
    }

    #[test]
    fn any_byte_decodes_to_digits_0_to_2() {
        for b in 0..=255u8 {
            for n in 0..5 {
                assert!(digit(b, n) <= 2);
            }
        }
    }
}
