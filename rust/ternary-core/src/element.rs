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

    /// [`Element::widen`] of 16 values, by value, in a kernel built for a CPU with F16C (f16 converts with
    /// `vcvtph2ps` there; the default is the plain widen).
    ///
    /// # Safety
    /// The CPU supports F16C (x86-64).
    #[inline(always)]
    unsafe fn widen16_f16c(src: &[Self; 16]) -> [f32; 16] {
        let mut out = [0f32; 16];
        Self::widen(src, &mut out);
        out
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

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn widen16_f16c(src: &[Self; 16]) -> [f32; 16] {
        use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
        let p = src.as_ptr().cast::<__m128i>();
        let mut out = [0f32; 16];
        // SAFETY: the caller guarantees F16C (which implies AVX); 16 f16 are two unaligned 128-bit loads
        // and 16 f32 two unaligned 256-bit stores.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(p)));
            _mm256_storeu_ps(
                out.as_mut_ptr().add(8),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            );
        }
        out
    }
}
