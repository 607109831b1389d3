//! Dense float tensors ↔ ternary.
//!
//! * [`recover`]: "unpacked" ternary checkpoints (PrismML `*-unpacked`, ternary-qat output; docs/formats.md#dense-ternary)
//!   store `t·a` densely in fp16/bf16/fp32. Every group must hold only {−a, 0, +a} with
//!   `a = max|w|`; codes and scales are recovered exactly (refused, naming the first offending element,
//!   if a value is anything else or `a` is not exactly representable in fp16).
//! * [`ternarize`]: post-training ternarization of arbitrary weights, by group **absmax** (Bonsai /
//!   ternary-qat: `a = max(amax|g|, 1e-8)`, `t = round(clamp(w/a, −1, 1))`) or **absmean** (BitNet:
//!   `s = max(mean|g|, 1e-5)` per group or per tensor, `t = clamp(round(w/s), −1, 1)`).
//!
//! Rounding conventions (documented because they decide bit-exactness):
//! * `round` is round-half-to-even (`torch.round`, which both reference libraries use), in f32.
//! * `t` is decided against the **f32** scale, as the reference libraries do, so the trits equal
//!   theirs; the stored scale is then `fp16(scale)` (nearest even), and the dequantized canonical
//!   tensor is exactly `t · fp16(scale)`. Deciding against the fp16-rounded scale instead would move
//!   the rounding thresholds by ≤ 2⁻¹¹ relative and break agreement with those libraries.
//! * `mean|g|` is accumulated in f64 (then rounded to f32), so the result does not depend on the
//!   thread count or summation order.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::canonical::{check_shape, CanonicalTernary};
use crate::{threads, Error, Result};

/// Element type of a dense tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseDtype {
    F16,
    BF16,
    F32,
}

impl DenseDtype {
    pub fn from_name(name: &str) -> Result<Self> {
        match name.to_ascii_uppercase().as_str() {
            "F16" | "FLOAT16" => Ok(Self::F16),
            "BF16" | "BFLOAT16" => Ok(Self::BF16),
            "F32" | "FLOAT32" => Ok(Self::F32),
            _ => Err(Error::invalid(format!(
                "dense ternary tensors must be F16, BF16 or F32, not {name}"
            ))),
        }
    }
    pub fn size(self) -> usize {
        match self {
            Self::F16 | Self::BF16 => 2,
            Self::F32 => 4,
        }
    }
    #[inline(always)]
    fn load(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            Self::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            Self::BF16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            Self::F32 => f32::from_le_bytes([
                bytes[4 * i],
                bytes[4 * i + 1],
                bytes[4 * i + 2],
                bytes[4 * i + 3],
            ]),
        }
    }
}

/// How dense weights are ternarized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Group absmax (Bonsai / ternary-qat).
    Absmax,
    /// Group absmean (BitNet b1.58 per group).
    Absmean,
    /// Tensor absmean (BitNet b1.58 as trained: one scale per tensor, broadcast to every group).
    AbsmeanTensor,
}

impl Method {
    pub fn from_name(name: &str, per_tensor: bool) -> Result<Self> {
        match (name.to_ascii_lowercase().as_str(), per_tensor) {
            ("absmax", false) => Ok(Self::Absmax),
            ("absmean", false) => Ok(Self::Absmean),
            ("absmean", true) => Ok(Self::AbsmeanTensor),
            ("absmax", true) => Err(Error::invalid(
                "per-tensor absmax is not a convention any ternary checkpoint uses; use absmean",
            )),
            (m, _) => Err(Error::invalid(format!(
                "unknown ternarization method '{m}'; expected 'absmax' or 'absmean'"
            ))),
        }
    }
}

/// Smallest absmax ternary-qat accepts (`clamp(1e-8)`), and BitNet's smallest absmean (`clamp(1e-5)`).
pub const ABSMAX_FLOOR: f32 = 1e-8;
pub const ABSMEAN_FLOOR: f32 = 1e-5;

/// First offending index and count, merged across rows.
#[derive(Clone, Copy, Default)]
struct Issue {
    count: u64,
    first: Option<u64>,
}

impl Issue {
    fn add(&mut self, index: u64) {
        self.count += 1;
        self.first.get_or_insert(index);
    }
    fn merge(self, other: Issue) -> Issue {
        Issue {
            count: self.count + other.count,
            first: match (self.first, other.first) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }
    fn check(self, tensor: &str, what: &str) -> Result<()> {
        match self.first {
            Some(first) => Err(Error::validation(tensor, what, first, self.count)),
            None => Ok(()),
        }
    }
}

#[derive(Clone, Copy, Default)]
struct Issues {
    non_finite: Issue,
    not_ternary: Issue,
    scale: Issue,
}

impl Issues {
    fn merge(self, o: Issues) -> Issues {
        Issues {
            non_finite: self.non_finite.merge(o.non_finite),
            not_ternary: self.not_ternary.merge(o.not_ternary),
            scale: self.scale.merge(o.scale),
        }
    }
}

fn check_len(tensor: &str, len: usize, rows: usize, cols: usize, elem: usize) -> Result<()> {
    let want = rows
        .checked_mul(cols)
        .and_then(|n| n.checked_mul(elem))
        .ok_or_else(|| Error::invalid(format!("shape [{rows}, {cols}] overflows")))?;
    if len != want {
        return Err(Error::format(
            format!("tensor '{tensor}'"),
            len as u64,
            format!(
                "dense [{rows}, {cols}] with {elem}-byte elements needs {want} bytes, got {len}"
            ),
        ));
    }
    Ok(())
}

#[inline(always)]
fn code_of(t: f32) -> u8 {
    (t as i32 + 1) as u8
}

/// Recover codes and scales exactly from a dense ternary tensor (little-endian bytes).
pub fn recover(
    tensor: &str,
    bytes: &[u8],
    dtype: DenseDtype,
    rows: usize,
    cols: usize,
    group_size: usize,
) -> Result<CanonicalTernary> {
    check_shape(rows, cols, group_size)?;
    check_len(tensor, bytes.len(), rows, cols, dtype.size())?;
    let groups = cols / group_size;
    let (canon, issues) = build_rows(
        rows,
        cols,
        group_size,
        bytes,
        cols * dtype.size(),
        Issues::merge,
        |n, q, s, src| {
            let mut iss = Issues::default();
            let mut vals = vec![0f32; group_size];
            for (g, sg) in s.iter_mut().enumerate() {
                let base = (n * cols + g * group_size) as u64;
                let mut a = 0f32;
                for (j, v) in vals.iter_mut().enumerate() {
                    *v = dtype.load(src, g * group_size + j);
                    if !v.is_finite() {
                        iss.non_finite.add(base + j as u64);
                    }
                    a = a.max(v.abs());
                }
                let scale = f16::from_f32(a);
                if scale.to_f32() != a {
                    iss.scale.add((n * groups + g) as u64);
                }
                *sg = scale;
                for (j, &v) in vals.iter().enumerate() {
                    let code = if v == a && a != 0.0 {
                        2
                    } else if v == -a && a != 0.0 {
                        0
                    } else if v == 0.0 {
                        1
                    } else {
                        iss.not_ternary.add(base + j as u64);
                        1
                    };
                    let k = g * group_size + j;
                    q[k / 4] |= code << (2 * (k % 4));
                }
            }
            iss
        },
    );
    issues
        .non_finite
        .check(tensor, "non-finite (NaN/Inf) value in dense tensor")?;
    issues.not_ternary.check(
        tensor,
        &format!(
            "not ternary at group size {group_size}: element is neither 0 nor ±max|group| \
             (try a smaller group size, or ternarize() to requantize)"
        ),
    )?;
    issues.scale.check(
        tensor,
        "group scale max|group| is not exactly representable in fp16 (first index is the group)",
    )?;
    Ok(canon)
}

/// Ternarize dense f32 weights `[rows, cols]` with `method` at `group_size`.
pub fn ternarize(
    tensor: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
    group_size: usize,
    method: Method,
) -> Result<CanonicalTernary> {
    check_shape(rows, cols, group_size)?;
    check_len(tensor, w.len() * 4, rows, cols, 4)?;
    if let Some(i) = threads::install(|| w.par_iter().position_first(|v| !v.is_finite())) {
        let count = threads::install(|| w.par_iter().filter(|v| !v.is_finite()).count());
        return Err(Error::validation(
            tensor,
            "non-finite (NaN/Inf) weight",
            i as u64,
            count as u64,
        ));
    }
    let tensor_scale = if method == Method::AbsmeanTensor {
        // Row sums in parallel, added in row order: independent of the thread count.
        let row_sums: Vec<f64> = threads::install(|| {
            w.par_chunks(cols)
                .map(|r| r.iter().map(|v| v.abs() as f64).sum::<f64>())
                .collect()
        });
        let mean = (row_sums.iter().sum::<f64>() / (rows * cols) as f64) as f32;
        Some(mean.max(ABSMEAN_FLOOR))
    } else {
        None
    };
    let groups = cols / group_size;
    let (canon, overflow) = build_rows(
        rows,
        cols,
        group_size,
        w,
        cols,
        Issue::merge,
        |n, q, s, row| {
            let mut overflow = Issue::default();
            for (g, grp) in row.chunks_exact(group_size).enumerate() {
                let scale = match (method, tensor_scale) {
                    (_, Some(ts)) => ts,
                    (Method::Absmax, _) => grp
                        .iter()
                        .fold(0f32, |m, v| m.max(v.abs()))
                        .max(ABSMAX_FLOOR),
                    _ => {
                        let sum: f64 = grp.iter().map(|v| v.abs() as f64).sum();
                        ((sum / group_size as f64) as f32).max(ABSMEAN_FLOOR)
                    }
                };
                let stored = f16::from_f32(scale);
                if !stored.is_finite() {
                    overflow.add((n * groups + g) as u64);
                }
                s[g] = stored;
                for (j, &v) in grp.iter().enumerate() {
                    let t = match method {
                        Method::Absmax => (v / scale).clamp(-1.0, 1.0).round_ties_even(),
                        _ => (v / scale).round_ties_even().clamp(-1.0, 1.0),
                    };
                    let k = g * group_size + j;
                    q[k / 4] |= code_of(t) << (2 * (k % 4));
                }
            }
            overflow
        },
    );
    overflow.check(
        tensor,
        "group scale exceeds the fp16 range (65504); the first index is the group",
    )?;
    Ok(canon)
}

/// A fresh canonical `[rows, cols]` tensor at `group_size`, filled row by row on the pool (at least
/// four rows per work item): `row(n, its code bytes, its scales, its src_row source elements)` fills
/// row `n` and returns what it found; the finds of all rows are combined with `merge`.
fn build_rows<T: Sync, R: Send + Default>(
    rows: usize,
    cols: usize,
    group_size: usize,
    src: &[T],
    src_row: usize,
    merge: impl Fn(R, R) -> R + Sync + Send,
    row: impl Fn(usize, &mut [u8], &mut [f16], &[T]) -> R + Sync + Send,
) -> (CanonicalTernary, R) {
    let (row_bytes, groups) = (cols / 4, cols / group_size);
    let mut qweight = vec![0u8; rows * row_bytes];
    let mut scales = vec![f16::ZERO; rows * groups];
    let found = threads::install(|| {
        qweight
            .par_chunks_mut(row_bytes)
            .zip(scales.par_chunks_mut(groups))
            .zip(src.par_chunks(src_row))
            .enumerate()
            .with_min_len(4)
            .map(|(n, ((q, s), src))| row(n, q, s, src))
            .reduce(R::default, merge)
    });
    let canon = CanonicalTernary {
        rows,
        cols,
        group_size,
        qweight,
        scales,
    };
    (canon, found)
}
