//! Run-time CPU feature checks shared by the codecs, the canonical form and the kernels (the
//! kernels' own per-variant checks are `kernels::cpu::Variant::is_supported`).

/// Whether the AVX-512 (F + BW) fast paths can run here (std caches the CPU check).
#[inline]
pub(crate) fn avx512bw_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && !cfg!(miri)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX2 fast paths can run here.
#[inline]
pub(crate) fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && !cfg!(miri)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
