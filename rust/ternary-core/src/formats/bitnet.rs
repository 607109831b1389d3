//! transformers BitNet packing (safetensors; docs/formats.md#bitnet-packing): `weight` uint8 `[N/4, K]` packed along
//! the OUTPUT dim, plus one `weight_scale`.
//!
//! With `R = N/4`, `packed[r, k]` holds `W[i·R + r, k]` as code `t + 1` at bits `2i`. Four consecutive
//! packed bytes of one packed row are a 4×4 matrix of 2-bit fields (byte = column, field = plane);
//! transposed, byte `i` is the canonical byte of row `i·R + r` — one word op per 16 values.
//!
//! The scale's meaning depends on `quantization_config.linear_class`: `bitlinear` (transformers'
//! default) stores the reciprocal (`W = W_t / weight_scale`), `autobitlinear` the direct scale
//! (`W = W_t · weight_scale`). The canonical scale is fp16, rounded once (nearest even) from the exact
//! value (`1/weight_scale` computed in f64), so the dequantized canonical tensor is `t · that fp16`.

use half::f16;
use rayon::prelude::*;

use super::i2_s::uniform_scale;
use super::transpose_2bit_4x4;
use crate::canonical::{check_shape, CanonicalRef, CanonicalTernary};
use crate::{threads, Error, Result};

/// Which `weight_scale` convention a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleConvention {
    /// `BitLinear`: `weight_scale` = 1 / mean|W| (reciprocal).
    BitLinear,
    /// `AutoBitLinear`: `weight_scale` = mean|W| (direct).
    AutoBitLinear,
}

impl ScaleConvention {
    /// From `quantization_config.linear_class` (None → transformers' default, `bitlinear`).
    pub fn from_linear_class(linear_class: Option<&str>) -> Result<Self> {
        match linear_class.map(|s| s.to_ascii_lowercase()) {
            None => Ok(Self::BitLinear),
            Some(s) if s == "bitlinear" => Ok(Self::BitLinear),
            Some(s) if s == "autobitlinear" => Ok(Self::AutoBitLinear),
            Some(s) => Err(Error::invalid(format!(
                "unknown BitNet linear_class '{s}'; expected 'bitlinear' or 'autobitlinear'"
            ))),
        }
    }

    /// The canonical (direct) scale for a stored `weight_scale`.
    pub fn canonical_scale(self, tensor: &str, weight_scale: f32) -> Result<f16> {
        let direct = match self {
            Self::AutoBitLinear => weight_scale as f64,
            Self::BitLinear => 1.0 / weight_scale as f64,
        };
        let s = f16::from_f64(direct);
        if !weight_scale.is_finite() || !s.is_finite() {
            return Err(Error::validation(
                tensor,
                format!(
                    "BitNet weight_scale {weight_scale} ({self:?} convention) gives a scale that is not a finite fp16"
                ),
                0,
                1,
            ));
        }
        Ok(s)
    }

    /// The stored `weight_scale` (f32) for a canonical scale.
    pub fn stored_scale(self, scale: f16) -> f32 {
        match self {
            Self::AutoBitLinear => scale.to_f32(),
            Self::BitLinear => (1.0 / scale.to_f64()) as f32,
        }
    }
}

fn check_rows(tensor: &str, rows: usize) -> Result<()> {
    if rows == 0 || !rows.is_multiple_of(4) {
        return Err(Error::validation(
            tensor,
            format!(
                "BitNet packing needs out_features (N = {rows}) to be a positive multiple of 4"
            ),
            (rows - rows % 4) as u64,
            (rows % 4) as u64,
        ));
    }
    Ok(())
}

/// Scalar reference: `W[i·R + r, k] = ((packed[r, k] >> 2i) & 3) − 1`, as codes, row-major `[N, K]`.
pub fn decode_ref(packed: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let r_planes = rows / 4;
    let mut codes = vec![0u8; rows * cols];
    for i in 0..4 {
        for r in 0..r_planes {
            for k in 0..cols {
                codes[(i * r_planes + r) * cols + k] = (packed[r * cols + k] >> (2 * i)) & 3;
            }
        }
    }
    codes
}

/// Decode `weight` (`[rows/4, cols]` bytes) + `weight_scale` to canonical form with `group_size`.
pub fn decode(
    tensor: &str,
    packed: &[u8],
    rows: usize,
    cols: usize,
    weight_scale: f32,
    convention: ScaleConvention,
    group_size: usize,
) -> Result<CanonicalTernary> {
    check_shape(rows, cols, group_size)?;
    check_rows(tensor, rows)?;
    let plane_rows = rows / 4;
    if packed.len() != plane_rows * cols {
        return Err(Error::format(
            format!("tensor '{tensor}'"),
            packed.len() as u64,
            format!(
                "BitNet weight for W[{rows}, {cols}] must be uint8 [{plane_rows}, {cols}] ({} bytes), got {} bytes",
                plane_rows * cols,
                packed.len()
            ),
        ));
    }
    let scale = convention.canonical_scale(tensor, weight_scale)?;
    let row_bytes = cols / 4;
    let mut qweight = vec![0u8; rows * row_bytes];
    {
        let plane_len = plane_rows * row_bytes;
        let (p0, rest) = qweight.split_at_mut(plane_len);
        let (p1, rest) = rest.split_at_mut(plane_len);
        let (p2, p3) = rest.split_at_mut(plane_len);
        threads::install(|| {
            (
                p0.par_chunks_mut(row_bytes),
                p1.par_chunks_mut(row_bytes),
                p2.par_chunks_mut(row_bytes),
                p3.par_chunks_mut(row_bytes),
                packed.par_chunks(cols),
            )
                .into_par_iter()
                .with_min_len(8)
                .for_each(|(o0, o1, o2, o3, src)| {
                    for (kb, w) in src.chunks_exact(4).enumerate() {
                        let y = transpose_2bit_4x4(u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                            .to_le_bytes();
                        o0[kb] = y[0];
                        o1[kb] = y[1];
                        o2[kb] = y[2];
                        o3[kb] = y[3];
                    }
                })
        });
    }
    let t = CanonicalTernary {
        rows,
        cols,
        group_size,
        qweight,
        scales: vec![scale; rows * cols / group_size],
    };
    t.as_ref().validate(tensor)?;
    Ok(t)
}

/// Encode a canonical tensor whose scales are all equal: (`weight` `[rows/4, cols]`, `weight_scale`).
pub fn encode(
    tensor: &str,
    canon: CanonicalRef<'_>,
    convention: ScaleConvention,
) -> Result<(Vec<u8>, f32)> {
    canon.validate(tensor)?;
    check_rows(tensor, canon.rows)?;
    let scale = uniform_scale(tensor, canon.scales, "BitNet")?;
    let (rows, cols) = (canon.rows, canon.cols);
    let row_bytes = cols / 4;
    let plane_len = rows / 4 * row_bytes;
    let q = canon.qweight;
    let mut packed = vec![0u8; rows / 4 * cols];
    threads::install(|| {
        packed
            .par_chunks_mut(cols)
            .enumerate()
            .with_min_len(8)
            .for_each(|(r, out)| {
                let rows4 = [
                    &q[r * row_bytes..][..row_bytes],
                    &q[plane_len + r * row_bytes..][..row_bytes],
                    &q[2 * plane_len + r * row_bytes..][..row_bytes],
                    &q[3 * plane_len + r * row_bytes..][..row_bytes],
                ];
                for (kb, o) in out.chunks_exact_mut(4).enumerate() {
                    let x = u32::from_le_bytes([
                        rows4[0][kb],
                        rows4[1][kb],
                        rows4[2][kb],
                        rows4[3][kb],
                    ]);
                    o.copy_from_slice(&transpose_2bit_4x4(x).to_le_bytes());
                }
            })
    });
    Ok((packed, convention.stored_scale(scale)))
}
