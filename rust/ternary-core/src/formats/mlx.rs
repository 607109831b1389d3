//! MLX affine 2-bit packs (PrismML `*-mlx-2bit`; docs/formats.md#mlx-2bit, docs/formats.md#bonsai2-mlx-pack): `weight` uint32 `[N, K/16]`
//! (16 codes per word, code `k` at bits `2k`, little-endian), `scales` and `biases` fp16 `[N, K/g]`,
//! `w = scale·q + bias`.
//!
//! It is ternary exactly when `bias = −scale` in every group (then `w = (q − 1)·scale`); anything else
//! is a general 2-bit affine quantization and is refused, naming the first offending group. The
//! little-endian words *are* the canonical bytes, so the Python layer returns views after
//! [`validate`]; [`decode`] is the copying form for Rust callers.

use half::f16;
use rayon::prelude::*;

use crate::canonical::{check_shape, count_code3, merge_first, CanonicalRef, CanonicalTernary};
use crate::{threads, Error, Result};

/// Check an MLX pack for ternarity: shapes, finite scales, `bias == −scale`, no code 3.
/// Returns the group size (`K / scales per row`).
pub fn validate(
    tensor: &str,
    weight: &[u8],
    scales: &[f16],
    biases: &[f16],
    rows: usize,
    cols: usize,
) -> Result<usize> {
    let groups_per_row = scales.len().checked_div(rows).unwrap_or(0);
    if rows == 0 || groups_per_row == 0 || !cols.is_multiple_of(groups_per_row) {
        return Err(Error::validation(
            tensor,
            format!(
                "MLX scales hold {} values, which is not [N = {rows}, K/g] for K = {cols}",
                scales.len()
            ),
            0,
            1,
        ));
    }
    let group_size = cols / groups_per_row;
    check_shape(rows, cols, group_size)?;
    if scales.len() != rows * groups_per_row || biases.len() != scales.len() {
        return Err(Error::validation(
            tensor,
            format!(
                "MLX scales/biases must both be [{rows}, {groups_per_row}], got {} and {} values",
                scales.len(),
                biases.len()
            ),
            0,
            1,
        ));
    }
    if weight.len() != rows * cols / 4 {
        return Err(Error::format(
            format!("tensor '{tensor}'"),
            weight.len() as u64,
            format!(
                "MLX 2-bit weight for W[{rows}, {cols}] must be uint32 [{rows}, {}] ({} bytes), got {} bytes",
                cols / 16,
                rows * cols / 4,
                weight.len()
            ),
        ));
    }
    let mut non_finite = scales.iter().enumerate().filter(|(_, s)| !s.is_finite());
    if let Some((i, _)) = non_finite.next() {
        return Err(Error::validation(
            tensor,
            "non-finite (NaN/Inf) MLX scale in group",
            i as u64,
            1 + non_finite.count() as u64,
        ));
    }
    let mut not_ternary = scales
        .iter()
        .zip(biases)
        .enumerate()
        .filter(|(_, (s, b))| **b != -**s);
    if let Some((i, (s, b))) = not_ternary.next() {
        return Err(Error::validation(
            tensor,
            format!(
                "MLX pack is not ternary: bias must equal −scale in every group, group {i} has scale {s} and bias {b}"
            ),
            i as u64,
            1 + not_ternary.count() as u64,
        ));
    }
    let (count, first) = threads::install(|| {
        weight
            .par_chunks(1 << 16)
            .enumerate()
            .map(|(c, chunk)| {
                let (n, f) = count_code3(chunk);
                (n, f.map(|f| f + (c as u64) * (1 << 18)))
            })
            .reduce(|| (0, None), merge_first)
    });
    if let Some(first) = first {
        return Err(Error::validation(
            tensor,
            "code 3 (+2·scale) is not ternary; the kernels are ternary-only",
            first,
            count,
        ));
    }
    Ok(group_size)
}

/// Validate and copy into an owned canonical tensor.
pub fn decode(
    tensor: &str,
    weight: &[u8],
    scales: &[f16],
    biases: &[f16],
    rows: usize,
    cols: usize,
) -> Result<CanonicalTernary> {
    let group_size = validate(tensor, weight, scales, biases, rows, cols)?;
    Ok(CanonicalTernary {
        rows,
        cols,
        group_size,
        qweight: weight.to_vec(),
        scales: scales.to_vec(),
    })
}

/// Encode: (`weight` bytes of uint32 `[N, K/16]`, `scales`, `biases = −scales`).
pub fn encode(tensor: &str, canon: CanonicalRef<'_>) -> Result<(Vec<u8>, Vec<f16>, Vec<f16>)> {
    canon.validate(tensor)?;
    if !canon.cols.is_multiple_of(16) {
        return Err(Error::validation(
            tensor,
            format!(
                "MLX packs 16 codes per uint32: K = {} is not a multiple of 16",
                canon.cols
            ),
            (canon.cols - canon.cols % 16) as u64,
            (canon.cols % 16) as u64,
        ));
    }
    let biases = canon.scales.iter().map(|s| -*s).collect();
    Ok((canon.qweight.to_vec(), canon.scales.to_vec(), biases))
}
