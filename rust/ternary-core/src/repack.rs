//! Multithreaded conversion between formats through the canonical form: the tensor-level
//! dispatch by [`Format`] over the block drivers of [`crate::formats::blocks`], and regrouping.

use crate::canonical::{CanonicalRef, CanonicalTernary, Regrouped, GROUP_SIZES};
use crate::formats::blocks::{block_layout, decode_blocks, encode_blocks};
use crate::formats::dense::{self, Method};
use crate::formats::pq2_0::BlockPq2_0;
use crate::formats::ptq1_0::BlockPtq1_0;
use crate::formats::q1_0::BlockQ1_0;
use crate::formats::q2_0::BlockQ2_0;
use crate::formats::stq1_0::{self, BlockStq1_0};
use crate::formats::tq1_0::BlockTq1_0;
use crate::formats::tq2_0::BlockTq2_0;
use crate::formats::{i2_s, Format};
use crate::{Error, Result};

/// Bytes of a GGUF tensor of `format` with shape `[rows, cols]`.
pub fn gguf_tensor_bytes(format: Format, rows: usize, cols: usize) -> Result<usize> {
    match format {
        Format::Tq1_0 => block_layout::<BlockTq1_0>("", rows, cols).map(|x| x.1),
        Format::Tq2_0 => block_layout::<BlockTq2_0>("", rows, cols).map(|x| x.1),
        Format::Q2_0 => block_layout::<BlockQ2_0>("", rows, cols).map(|x| x.1),
        Format::Q2_0G128 | Format::Pq2_0 => block_layout::<BlockPq2_0>("", rows, cols).map(|x| x.1),
        Format::Ptq1_0 => block_layout::<BlockPtq1_0>("", rows, cols).map(|x| x.1),
        Format::Q1_0 => block_layout::<BlockQ1_0>("", rows, cols).map(|x| x.1),
        Format::Stq1_0 => block_layout::<BlockStq1_0>("", rows, cols).map(|x| x.1),
        Format::I2S => i2_s::tensor_bytes(rows, cols)
            .ok_or_else(|| Error::invalid(format!("[{rows}, {cols}] overflows"))),
        f => Err(Error::invalid(format!(
            "{} is not a GGUF tensor type",
            f.name()
        ))),
    }
}

/// The largest canonical group size dividing `cols` (for per-tensor formats, where any group fits).
pub fn default_group_for(cols: usize) -> Result<usize> {
    GROUP_SIZES
        .iter()
        .rev()
        .copied()
        .find(|g| cols.is_multiple_of(*g))
        .ok_or_else(|| {
            Error::invalid(format!(
                "K = {cols} is not a multiple of any group size {GROUP_SIZES:?}"
            ))
        })
}

/// Change the group size of a canonical tensor ([`CanonicalRef::try_regroup`]). A merge that would
/// change values is refused with a [`Error::Validation`] naming the first merged group, unless
/// `requantize`, which re-ternarizes the dequantized weights at the new group size with absmax.
pub fn regroup(
    canon: CanonicalRef<'_>,
    tensor: &str,
    group_size: usize,
    requantize: bool,
) -> Result<CanonicalTernary> {
    match canon.try_regroup(group_size)? {
        Regrouped::ScalesDiffer { .. } if requantize => {
            let values = canon.dequantize_f32()?;
            dense::ternarize(
                tensor,
                &values,
                canon.rows,
                canon.cols,
                group_size,
                Method::Absmax,
            )
        }
        lossless => lossless.exact_or_refuse(tensor, canon.group_size, group_size),
    }
}

/// Decode a GGUF tensor of `format` (shape `[rows, cols]` in PyTorch order) to canonical form, at
/// the format's own group size unless `group_size` asks for another (see [`regroup`]).
pub fn decode_gguf(
    format: Format,
    tensor: &str,
    data: &[u8],
    rows: usize,
    cols: usize,
    group_size: Option<usize>,
    requantize: bool,
) -> Result<CanonicalTernary> {
    let native = match format {
        Format::Tq1_0 => decode_blocks::<BlockTq1_0>(tensor, data, rows, cols)?,
        Format::Tq2_0 => decode_blocks::<BlockTq2_0>(tensor, data, rows, cols)?,
        Format::Q2_0 => decode_blocks::<BlockQ2_0>(tensor, data, rows, cols)?,
        Format::Q2_0G128 | Format::Pq2_0 => decode_blocks::<BlockPq2_0>(tensor, data, rows, cols)?,
        Format::Ptq1_0 => decode_blocks::<BlockPtq1_0>(tensor, data, rows, cols)?,
        Format::Q1_0 => decode_blocks::<BlockQ1_0>(tensor, data, rows, cols)?,
        Format::Stq1_0 => decode_blocks::<BlockStq1_0>(tensor, data, rows, cols)?,
        Format::I2S => {
            let g = match group_size {
                Some(g) => g,
                None => default_group_for(cols)?,
            };
            return i2_s::decode(tensor, data, rows, cols, g);
        }
        f => {
            return Err(Error::invalid(format!(
                "tensor '{tensor}': {} is not a GGUF tensor type (it needs companion tensors)",
                f.name()
            )))
        }
    };
    match group_size {
        Some(g) if g != native.group_size => regroup(native.as_ref(), tensor, g, requantize),
        _ => Ok(native),
    }
}

/// Encode a canonical tensor as GGUF tensor data of `format`, regrouping to the format's block size
/// first (lossless, or refused unless `requantize`; see [`regroup`]). STQ1_0 also
/// refuses groups its codebook lacks; its `requantize` runs its own quantizer on the dequantized
/// weights instead of the absmax regroup ([`stq1_0::encode_gguf`]).
pub fn encode_gguf(
    format: Format,
    tensor: &str,
    canon: CanonicalRef<'_>,
    requantize: bool,
) -> Result<Vec<u8>> {
    canon.check()?;
    if format == Format::Stq1_0 {
        return stq1_0::encode_gguf(tensor, canon, requantize);
    }
    let regrouped;
    let canon = match format.native_group() {
        Some(g) if g != canon.group_size => {
            regrouped = regroup(canon, tensor, g, requantize)?;
            regrouped.as_ref()
        }
        _ => canon,
    };
    match format {
        Format::Tq1_0 => encode_blocks::<BlockTq1_0>(tensor, canon),
        Format::Tq2_0 => encode_blocks::<BlockTq2_0>(tensor, canon),
        Format::Q2_0 => encode_blocks::<BlockQ2_0>(tensor, canon),
        Format::Q2_0G128 | Format::Pq2_0 => encode_blocks::<BlockPq2_0>(tensor, canon),
        Format::Ptq1_0 => encode_blocks::<BlockPtq1_0>(tensor, canon),
        Format::Q1_0 => encode_blocks::<BlockQ1_0>(tensor, canon),
        Format::I2S => i2_s::encode(tensor, canon),
        f => Err(Error::invalid(format!(
            "tensor '{tensor}': {} is not a GGUF tensor type",
            f.name()
        ))),
    }
}

/// GGUF tensor data of one format → another, through the canonical form.
pub fn transcode_gguf(
    from: Format,
    to: Format,
    tensor: &str,
    data: &[u8],
    rows: usize,
    cols: usize,
    requantize: bool,
) -> Result<Vec<u8>> {
    let canon = decode_gguf(from, tensor, data, rows, cols, None, false)?;
    encode_gguf(to, tensor, canon.as_ref(), requantize)
}

#[cfg(test)]
mod tests;
