//! The canonical ternary tensor: the one in-memory form every source format decodes to.
//!
//! A linear weight `W[N, K]` (PyTorch `[out_features, in_features]`) is
//! * `qweight: u8 [N, K/4]` — `W[n, k]` is code `c = t + 1 ∈ {0, 1, 2}` in byte `k / 4` at bits `2·(k % 4)`
//!   (least significant first). Code 3 is invalid. This is the byte order of GGUF Q2_0/PQ2_0 and MLX
//!   2-bit packs, so those need no bit shuffling.
//! * `scales: f16 [N, K/g]` — `W[n, k] = (c − 1) · scales[n, k / g]`, g ∈ [`GROUP_SIZES`].
//!
//! Packing along K means a tensor-parallel N-shard is a row slice and a K-shard at a multiple of
//! lcm(4, g) is a column slice; groups never cross rows.

use half::f16;

use crate::{Error, Result};

/// Group sizes a canonical tensor may use (one per checkpoint).
pub const GROUP_SIZES: [usize; 4] = [32, 64, 128, 256];

/// The invalid 2-bit code (would decode to +2·scale).
pub const INVALID_CODE: u8 = 3;

/// Borrowed canonical tensor (what kernels and encoders take).
#[derive(Clone, Copy, Debug)]
pub struct CanonicalRef<'a> {
    pub rows: usize,
    pub cols: usize,
    pub group_size: usize,
    pub qweight: &'a [u8],
    pub scales: &'a [f16],
}

/// Owned canonical tensor (what decoders return).
#[derive(Clone, Debug, PartialEq)]
pub struct CanonicalTernary {
    pub rows: usize,
    pub cols: usize,
    pub group_size: usize,
    pub qweight: Vec<u8>,
    pub scales: Vec<f16>,
}

/// Check that `(rows, cols, group_size)` is a valid canonical shape.
pub fn check_shape(rows: usize, cols: usize, group_size: usize) -> Result<()> {
    if !GROUP_SIZES.contains(&group_size) {
        return Err(Error::invalid(format!(
            "group size {group_size} is not one of {GROUP_SIZES:?}"
        )));
    }
    if cols == 0 || cols % group_size != 0 {
        return Err(Error::invalid(format!(
            "K = {cols} (in_features) is not a positive multiple of the group size {group_size}"
        )));
    }
    rows.checked_mul(cols)
        .ok_or_else(|| Error::invalid(format!("shape [{rows}, {cols}] overflows")))?;
    Ok(())
}

impl CanonicalTernary {
    /// All-zero weights with unit scales.
    pub fn zeros(rows: usize, cols: usize, group_size: usize) -> Result<Self> {
        check_shape(rows, cols, group_size)?;
        Ok(Self {
            rows,
            cols,
            group_size,
            qweight: vec![0x55; rows * cols / 4],
            scales: vec![f16::ONE; rows * cols / group_size],
        })
    }

    pub fn as_ref(&self) -> CanonicalRef<'_> {
        CanonicalRef {
            rows: self.rows,
            cols: self.cols,
            group_size: self.group_size,
            qweight: &self.qweight,
            scales: &self.scales,
        }
    }
}

impl<'a> CanonicalRef<'a> {
    /// Check lengths against the shape (call once at API boundaries).
    pub fn check(&self) -> Result<()> {
        check_shape(self.rows, self.cols, self.group_size)?;
        let (nq, ns) = (
            self.rows * self.cols / 4,
            self.rows * self.cols / self.group_size,
        );
        if self.qweight.len() != nq || self.scales.len() != ns {
            return Err(Error::invalid(format!(
                "canonical [{}, {}] g{} needs {} code bytes and {} scales, got {} and {}",
                self.rows,
                self.cols,
                self.group_size,
                nq,
                ns,
                self.qweight.len(),
                self.scales.len()
            )));
        }
        Ok(())
    }

    /// Code `t + 1` of `W[n, k]`.
    #[inline]
    pub fn code(&self, n: usize, k: usize) -> u8 {
        (self.qweight[n * self.cols / 4 + k / 4] >> (2 * (k % 4))) & 3
    }

    /// Trit `t ∈ {-1, 0, 1}` of `W[n, k]` (code 3 reads as +2; validate first).
    #[inline]
    pub fn trit(&self, n: usize, k: usize) -> i8 {
        self.code(n, k) as i8 - 1
    }

    /// Scale of the group holding `W[n, k]`.
    #[inline]
    pub fn scale(&self, n: usize, k: usize) -> f16 {
        self.scales[n * (self.cols / self.group_size) + k / self.group_size]
    }

    /// Reject code 3 and non-finite scales, naming the tensor, the first offending index and the count.
    pub fn validate(&self, tensor: &str) -> Result<()> {
        self.check()?;
        let mut bad_codes = 0u64;
        let mut first_code = None;
        for (i, &b) in self.qweight.iter().enumerate() {
            // A code is 3 exactly when both of its bits are set.
            let threes = (b & (b >> 1) & 0x55).count_ones() as u64;
            if threes > 0 {
                if first_code.is_none() {
                    let lane = (0..4).find(|j| (b >> (2 * j)) & 3 == 3).unwrap_or(0);
                    first_code = Some(i as u64 * 4 + lane as u64);
                }
                bad_codes += threes;
            }
        }
        if let Some(first) = first_code {
            return Err(Error::validation(
                tensor,
                "code 3 (+2·scale) is not ternary; the kernels are ternary-only",
                first,
                bad_codes,
            ));
        }
        let mut bad_scales = 0u64;
        let mut first_scale = None;
        for (i, s) in self.scales.iter().enumerate() {
            if !s.is_finite() {
                first_scale.get_or_insert(i as u64);
                bad_scales += 1;
            }
        }
        if let Some(first) = first_scale {
            return Err(Error::validation(
                tensor,
                "non-finite (NaN/Inf) scale in group",
                first,
                bad_scales,
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_layout_is_lsb_first_along_k() {
        // Running example of FORMATS.md: trits [+1, 0, -1, -1, 0, +1, +1, 0] → bytes 0x06 0x69.
        let q = [0x06u8, 0x69];
        let s = [f16::from_f32(0.5); 1];
        let mut qw = vec![0x55u8; 32];
        qw[..2].copy_from_slice(&q);
        let t = CanonicalRef {
            rows: 1,
            cols: 128,
            group_size: 128,
            qweight: &qw,
            scales: &s,
        };
        let trits: Vec<i8> = (0..8).map(|k| t.trit(0, k)).collect();
        assert_eq!(trits, [1, 0, -1, -1, 0, 1, 1, 0]);
        t.validate("w").unwrap();
    }

    #[test]
    fn validate_reports_code_three_and_nan() {
        let mut qw = vec![0x55u8; 32];
        qw[3] = 0b1100_0101; // lane 3 of byte 3 = code 3 → element 15
        let s = [f16::ONE];
        let t = CanonicalRef {
            rows: 1,
            cols: 128,
            group_size: 128,
            qweight: &qw,
            scales: &s,
        };
        match t.validate("w").unwrap_err() {
            Error::Validation {
                first_index, count, ..
            } => assert_eq!((first_index, count), (15, 1)),
            e => panic!("{e}"),
        }
        let qw = vec![0x55u8; 32];
        let s = [f16::NAN];
        let t = CanonicalRef {
            rows: 1,
            cols: 128,
            group_size: 128,
            qweight: &qw,
            scales: &s,
        };
        assert!(matches!(t.validate("w"), Err(Error::Validation { .. })));
    }
}
