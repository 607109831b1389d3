//! Activation quantization for the int8 modes: one row (token) of f32 activations → int8 codes, the
//! scale of each weight group and the sum of each group's codes (which cancels the `+1` of the weight
//! codes). The scalar [`quantize_row`] is the reference; SIMD variants match it bit for bit (both round
//! half to even, as `vcvtps2dq` does under the default MXCSR).

/// Largest |q| of the per-group mode (symmetric, so −q is an int8 too).
pub const INT8_MAX: f32 = 127.0;
/// BitNet's `activation_quant` clamps max|x| at this before `scale = 127 / max|x|`.
pub const TOKEN_SCALE_FLOOR: f32 = 1e-5;

/// `(x, q, group_size, per_token, xs4, qsum4)`: `x` and `q` are `Kp` long (x zero padded past K);
/// `xs4[g·4 + r]` and `qsum4[g·4 + r]` (`Gp·4` long) receive the group's scale and code sum, repeated
/// for the four rows of a row block so the prepass reads them as vectors.
pub(crate) type QuantizeFn = unsafe fn(&[f32], &mut [i8], usize, bool, &mut [f32], &mut [f32]);

/// max |x| that propagates NaN (`f32::max` would drop it) and Inf.
pub(crate) fn abs_max(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |a, &v| {
        if v.is_nan() || v.abs() > a {
            v.abs()
        } else {
            a
        }
    })
}

/// Scale for a quantization domain with maximum `amax`: `(multiplier, xs)` with `x ≈ xs · q`,
/// `q = round(x · multiplier)`. A non-finite activation gives `xs = NaN`, so the whole output row is
/// NaN as the exact path would make it. A group whose `127 / amax` is not finite — all zeros, or
/// `amax` < 127 / f32::MAX ≈ 3.7e-37, where `x · inf` would be inf or NaN and the SIMD conversions
/// would disagree with this one — quantizes to zeros (its contribution is below 3.7e-37 · Σ|W|).
pub(crate) fn domain_scale(amax: f32, per_token: bool) -> (f32, f32) {
    if !amax.is_finite() {
        return (0.0, f32::NAN);
    }
    if per_token {
        let scale = INT8_MAX / amax.max(TOKEN_SCALE_FLOOR);
        return (scale, 1.0 / scale);
    }
    let mul = INT8_MAX / amax;
    if mul.is_finite() {
        (mul, amax / INT8_MAX)
    } else {
        (0.0, 0.0)
    }
}

/// Quantize one activation row (see [`QuantizeFn`]); the reference every variant matches exactly.
pub fn quantize_row(
    x: &[f32],
    q: &mut [i8],
    group_size: usize,
    per_token: bool,
    xs4: &mut [f32],
    qsum4: &mut [f32],
) {
    let token = per_token.then(|| domain_scale(abs_max(x), true));
    for (gi, (xg, qg)) in x
        .chunks_exact(group_size)
        .zip(q.chunks_exact_mut(group_size))
        .enumerate()
    {
        let (mul, xs) = token.unwrap_or_else(|| domain_scale(abs_max(xg), false));
        let lo = if per_token { -128.0 } else { -INT8_MAX };
        let mut sum = 0i32;
        for (qv, &v) in qg.iter_mut().zip(xg) {
            let r = (v * mul).round_ties_even().clamp(lo, INT8_MAX) as i8;
            *qv = r;
            sum += r as i32;
        }
        xs4[gi * 4..gi * 4 + 4].fill(xs);
        qsum4[gi * 4..gi * 4 + 4].fill(sum as f32);
    }
}

/// The frame every SIMD quantizer shares with [`quantize_row`]: the token's or each group's scale
/// ([`domain_scale`] of `amax(from, n)` = max |x| over `x[from .. from + n]`, NaN propagating) and the
/// `xs4` / `qsum4` fill. `group(gi, mul)` writes the codes of group `gi` (`q[gi·g .. (gi+1)·g]`, clamped
/// to [−128, 127] per token, [−127, 127] per group) at multiplier `mul` and returns their sum; the caller
/// checks `q` is `x.len()` long and `g` a multiple of its step.
pub(crate) fn quantize_groups(
    x: &[f32],
    g: usize,
    per_token: bool,
    xs4: &mut [f32],
    qsum4: &mut [f32],
    amax: impl Fn(usize, usize) -> f32,
    mut group: impl FnMut(usize, f32) -> i32,
) {
    let kp = x.len();
    assert!(kp.is_multiple_of(g) && xs4.len() >= kp / g * 4 && qsum4.len() >= kp / g * 4);
    let token = per_token.then(|| domain_scale(amax(0, kp), true));
    for gi in 0..kp / g {
        let (mul, xs) = token.unwrap_or_else(|| domain_scale(amax(gi * g, g), false));
        let total = group(gi, mul) as f32;
        xs4[gi * 4..gi * 4 + 4].fill(xs);
        qsum4[gi * 4..gi * 4 + 4].fill(total);
    }
}

/// [`quantize_row`] as a [`QuantizeFn`] (the scalar variant's; AVX2 and AVX-512 have their own).
pub(crate) unsafe fn quantize_row_fn(
    x: &[f32],
    q: &mut [i8],
    group_size: usize,
    per_token: bool,
    xs4: &mut [f32],
    qsum4: &mut [f32],
) {
    quantize_row(x, q, group_size, per_token, xs4, qsum4)
}
