//! bitnet.cpp I2_S (GGUF type 36), x86 layout (`QK_I2_S = 128`, ACT_PARALLEL; docs/formats.md#i2_s).
//!
//! The tensor is `n/4` packed bytes followed by a 32-byte tail whose first 4 bytes are the one f32
//! scale of the whole tensor. Blocks of 128 values run over the row-major `[N, K]` tensor; value `j`
//! of a block is code `t + 1` in byte `j % 32` at bits `6 − 2·(j / 32)` — TQ2_0's chunk interleave
//! with the fields of each byte reversed, so the same 2-bit transpose serves both.
//!
//! The scale is rounded once to fp16 (round to nearest even), the canonical scale dtype; the
//! dequantized canonical tensor is exactly `t · fp16(scale)`.

use half::f16;
use rayon::prelude::*;

use super::tq2_0::{pack_chunk128, unpack_chunk128};
use crate::canonical::{check_shape, CanonicalRef, CanonicalTernary};
use crate::{threads, Error, Result};

/// Values per interleave block.
pub const BLOCK_VALUES: usize = 128;
/// Bytes after the packed codes (the f32 scale, then padding).
pub const TAIL_BYTES: usize = 32;

/// Bytes of an I2_S tensor of `rows × cols` values.
pub fn tensor_bytes(rows: usize, cols: usize) -> Option<usize> {
    rows.checked_mul(cols)?
        .checked_div(4)?
        .checked_add(TAIL_BYTES)
}

fn check_layout(tensor: &str, rows: usize, cols: usize) -> Result<usize> {
    let n = rows.checked_mul(cols).ok_or_else(|| {
        Error::invalid(format!(
            "tensor '{tensor}': shape [{rows}, {cols}] overflows"
        ))
    })?;
    if n == 0 || n % BLOCK_VALUES != 0 {
        return Err(Error::validation(
            tensor,
            format!("I2_S needs a positive element count that is a multiple of {BLOCK_VALUES}, got [{rows}, {cols}]"),
            (n - n % BLOCK_VALUES) as u64,
            (n % BLOCK_VALUES) as u64,
        ));
    }
    Ok(n)
}

/// Scalar reference: code of every value, row-major, and the f32 scale.
pub fn decode_ref(data: &[u8], n: usize) -> (Vec<u8>, f32) {
    let mut codes = vec![0u8; n];
    for (v, c) in codes.iter_mut().enumerate() {
        let (block, j) = (v / BLOCK_VALUES, v % BLOCK_VALUES);
        *c = (data[block * 32 + j % 32] >> (6 - 2 * (j / 32))) & 3;
    }
    let at = n / 4;
    let scale = f32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
    (codes, scale)
}

/// Decode to canonical form with `group_size` (every group gets the tensor's scale).
pub fn decode(
    tensor: &str,
    data: &[u8],
    rows: usize,
    cols: usize,
    group_size: usize,
) -> Result<CanonicalTernary> {
    check_shape(rows, cols, group_size)?;
    let n = check_layout(tensor, rows, cols)?;
    if data.len() != n / 4 + TAIL_BYTES {
        return Err(Error::format(
            format!("tensor '{tensor}'"),
            data.len() as u64,
            format!(
                "I2_S [{rows}, {cols}] needs {} bytes ({} packed + {TAIL_BYTES}-byte tail), got {}",
                n / 4 + TAIL_BYTES,
                n / 4,
                data.len()
            ),
        ));
    }
    let at = n / 4;
    let raw = f32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
    let scale = f16::from_f32(raw);
    if !scale.is_finite() {
        return Err(Error::validation(
            tensor,
            format!("I2_S tensor scale {raw} (at byte offset {at}) is not a finite fp16"),
            0,
            1,
        ));
    }
    let mut qweight = vec![0u8; n / 4];
    threads::install(|| {
        qweight
            .par_chunks_mut(32 * 256)
            .zip(data[..n / 4].par_chunks(32 * 256))
            .for_each(|(out, src)| {
                for (o, s) in out.chunks_exact_mut(32).zip(src.chunks_exact(32)) {
                    unpack_chunk128(s, o, true);
                }
            })
    });
    let t = CanonicalTernary {
        rows,
        cols,
        group_size,
        qweight,
        scales: vec![scale; n / group_size],
    };
    t.as_ref().validate(tensor)?;
    Ok(t)
}

/// Encode a canonical tensor whose scales are all equal (I2_S holds one scale per tensor).
pub fn encode(tensor: &str, canon: CanonicalRef<'_>) -> Result<Vec<u8>> {
    canon.validate(tensor)?;
    let n = check_layout(tensor, canon.rows, canon.cols)?;
    let scale = uniform_scale(tensor, canon.scales, "I2_S")?;
    let mut out = vec![0u8; n / 4 + TAIL_BYTES];
    let (packed, tail) = out.split_at_mut(n / 4);
    threads::install(|| {
        packed
            .par_chunks_mut(32 * 256)
            .zip(canon.qweight.par_chunks(32 * 256))
            .for_each(|(out, src)| {
                for (o, s) in out.chunks_exact_mut(32).zip(src.chunks_exact(32)) {
                    pack_chunk128(s, o, true);
                }
            })
    });
    tail[..4].copy_from_slice(&scale.to_f32().to_le_bytes());
    Ok(out)
}

/// The one scale of a per-tensor format; every group must hold it (scales of all-zero groups would
/// not matter, but a per-tensor format cannot tell them apart, so they must match too).
pub(crate) fn uniform_scale(tensor: &str, scales: &[f16], format: &str) -> Result<f16> {
    let first = *scales
        .first()
        .ok_or_else(|| Error::invalid(format!("tensor '{tensor}' has no scales")))?;
    let mut bad = scales.iter().enumerate().filter(|(_, s)| **s != first);
    if let Some((i, _)) = bad.next() {
        return Err(Error::validation(
            tensor,
            format!(
                "{format} holds one scale per tensor but the groups' scales differ (group 0 has {first}); \
                 requantize first (ternarize the dequantized weights per tensor)"
            ),
            i as u64,
            1 + bad.count() as u64,
        ));
    }
    Ok(first)
}
