//! Float functions written to vectorize (only float operations and bit casts, no calls), shared by the
//! kernels that need them inside their vector loops.

/// Lowest `exp` argument computed (e⁻⁸⁶ ≈ 4·10⁻³⁸ is still a normal f32).
pub(crate) const EXP_MIN_ARG: f32 = -86.0;

/// `eˣ` for `x ≤ 0` (Cephes' `expf`: `x = n·ln2 + r`, `|r| ≤ ln2/2`, a degree-6 polynomial in `r`, times
/// `2ⁿ`); `x < −86` is taken as −86. Only float operations and bit casts, so it vectorizes; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding it rounds to an integer held in the low mantissa bits
    const ROUND: f32 = 12_582_912.0;
    let x = if x < EXP_MIN_ARG { EXP_MIN_ARG } else { x };
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2ⁿ from n's integer bits (n ∈ [−125, 0] for x ∈ [−86, 0])
    let ni = t.to_bits().wrapping_sub(ROUND.to_bits());
    y * f32::from_bits(ni.wrapping_add(127) << 23)
}

/// Which build of a float kernel runs (the decode attention, the Gated DeltaNet step): the same code
/// compiled three ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// 16-lane AVX-512F with FMA.
    Avx512,
    /// 8-lane AVX2 with FMA and F16C.
    Avx2,
    /// Whatever the baseline target gives, without fused multiply-adds.
    Portable,
}

impl Kernel {
    /// The fastest build this CPU runs.
    pub fn best() -> Self {
        [Kernel::Avx512, Kernel::Avx2]
            .into_iter()
            .find(|k| k.is_supported())
            .unwrap_or(Kernel::Portable)
    }

    /// Whether this CPU can run it.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        let fma_f16c = || {
            std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
                && !cfg!(miri)
        };
        match self {
            Kernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => std::arch::is_x86_feature_detected!("avx512f") && fma_f16c(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => std::arch::is_x86_feature_detected!("avx2") && fma_f16c(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulp_over_its_range_and_keeps_nan() {
        let mut worst = 0f64;
        for i in 0..=860_000 {
            let x = -(i as f32) * 1e-4;
            let got = f64::from(exp_nonpositive(x));
            let want = f64::from(x).exp();
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert!(exp_nonpositive(f32::NAN).is_nan());
        assert_eq!(
            exp_nonpositive(f32::NEG_INFINITY),
            exp_nonpositive(EXP_MIN_ARG)
        );
        assert!(exp_nonpositive(-1000.0) < 1e-37);
    }
}
