//! The float element types the f32 kernels read and write (f32, bf16, f16): arithmetic is always f32.

use half::{bf16, f16, slice::HalfFloatSliceExt};

/// An element type a kernel reads and writes; its arithmetic is always f32 (bf16 and f16 widen exactly).
pub trait Element: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// `dst[i] = src[i].to_f32()` for a whole row (the kernels' hot loads: vectorizable per type).
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst[..src.len()].copy_from_slice(src);
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift, which the compiler vectorizes
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
}

impl Element for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        // half's slice conversion checks for F16C once per row, not once per element
        src.convert_to_f32_slice(&mut dst[..src.len()]);
    }
}
