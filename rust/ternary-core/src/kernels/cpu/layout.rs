//! The CPU kernel's weight layout: four rows interleaved, 256 codes per 64-byte row chunk.
//!
//! Every mode of the kernel (int8 dot products with `vpdpbusd`, exact f32/bf16 sums, the f32 tile
//! decode of the large-M path) wants, for 64 consecutive weights of one row, a vector of 64 byte codes
//! `c = t + 1 ∈ {0, 1, 2}`. The canonical form packs codes 4 per byte *along K*; here they are packed 4
//! per byte *across 64-weight sub-vectors*, so one shift and one AND give 64 ready byte codes:
//!
//! * K is padded to [`SUPER_K`] = 256 (`Kp`); padded weights have code 1 (t = 0) and the kernel feeds
//!   them zero activations.
//! * Rows are taken in blocks of [`ROWS`] = 4 (N padded to `Np`, padded rows have code 1); a row block
//!   is `Kp` bytes: for each 256-weight superblock `sb`, the 64-byte chunks of rows 0, 1, 2, 3.
//! * In the chunk of row `r`, superblock `sb`, byte `j` holds the codes of weights `256·sb + 64·i + j`
//!   for `i = 0..4` at bits `2i..2i+1`: sub-vector `i` is `(chunk >> 2i) & 3` byte-wise.
//!
//! So the whole weight is one sequential stream (`Np/4` blocks of `Kp` bytes): the kernel reads it once,
//! front to back, which is what the hardware prefetchers stream best, and each 64-byte load feeds four
//! rows' worth of nothing but useful codes (2 bits per weight, as in the canonical form).
//!
//! Scales stay fp16 (converting to f32 would add 6 % to the bytes the memory-bound GEMV streams at
//! g = 128), rearranged to `[Np/4][Gp][4]` (`Gp = Kp / g` groups, padded groups 0) so a row block's
//! scales are contiguous and the four rows of one group sit together.
//!
//! ## The rows-in-lanes layout ([`Layout::Lanes16`])
//!
//! The int8 modes on AVX-512 VNNI want the opposite: 4 consecutive weights of each of 16 rows in one
//! vector (lane n = row n), so that one `vpdpbusd` with a broadcast of 4 activation codes adds 16 rows'
//! partial sums and a group's epilogue is one conversion and FMA per 16 rows (`lanes`). Prepared that
//! way once, the kernel unpacks each 64-byte line with a shift and an AND, with no transpose per call:
//!
//! * rows in groups of [`LANE_ROWS`] = 16 (N padded to 16, padded rows code 1), K padded to `Kp` as
//!   above; a row group is `Kp / 16` lines of 64 bytes, `4·Kp` bytes, groups one after another;
//! * in line `j` of a group, byte `4n + b` holds at bits `2i..2i+1` the code of row `n`, weight
//!   `16·j + 4·i + b` (`i, b = 0..4`): `(line >> 2i) & 3` byte-wise gives, in lane n, the codes of
//!   weights `16·j + 4·i .. + 4` of row n — the order `vpdpbusd` multiplies them with 4 activation codes;
//! * scales `[Np/16][Gp][16]` fp16 (one 32-byte load per row group and weight group).
//!
//! Consecutive lines are consecutive weights, so a weight group (g = 32 … 256) is 2 … 16 whole lines.
//! The same bytes per weight as the 4-row layout; the weight is again one front-to-back stream.

use half::f16;
use rayon::prelude::*;

use crate::canonical::CanonicalRef;
use crate::{Error, Result};

/// Rows per interleaved block.
pub const ROWS: usize = 4;
/// Weights per superblock (one 64-byte chunk per row).
pub const SUPER_K: usize = 256;
/// Bytes of one row's chunk of a superblock.
pub const CHUNK_BYTES: usize = 64;
/// Weights per sub-vector (one byte lane per weight after the unpack).
pub const SUB_K: usize = 64;
/// Code of t = 0, used for padding.
const ZERO_CODE: u8 = 1;
/// Rows per group of the rows-in-lanes layout (one 32-bit lane each).
pub const LANE_ROWS: usize = 16;
/// Bytes of one line of the rows-in-lanes layout (16 rows × 16 weights).
pub const LINE_BYTES: usize = 64;
/// Weights of one row per line of the rows-in-lanes layout.
pub const LINE_K: usize = 16;

/// How a prepared weight's codes and scales are arranged (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Four rows interleaved, 64-weight sub-vectors of one row per vector: every kernel variant.
    Rows4,
    /// Rows in the 32-bit lanes of 16-row groups: the int8 modes on AVX-512 VNNI (`lanes`, which has
    /// an exact-mode kernel too); other variants run its plain reference, the MoE kernel refuses it.
    Lanes16,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::Rows4 => "rows4",
            Layout::Lanes16 => "lanes16",
        }
    }

    pub fn parse(name: &str) -> Result<Layout> {
        match name {
            "rows4" => Ok(Layout::Rows4),
            "lanes16" => Ok(Layout::Lanes16),
            other => Err(Error::invalid(format!(
                "unknown CPU weight layout '{other}'; expected rows4 or lanes16"
            ))),
        }
    }

    /// Rows of one unit of the layout (a row block or a row group).
    pub fn unit_rows(self) -> usize {
        match self {
            Layout::Rows4 => ROWS,
            Layout::Lanes16 => LANE_ROWS,
        }
    }

    /// Units (row blocks / row groups) of a weight of `rows` rows.
    pub fn units(self, rows: usize) -> usize {
        rows.div_ceil(self.unit_rows())
    }

    /// Code bytes of one unit: `unit_rows · Kp / 4`.
    pub fn unit_bytes(self, cols: usize) -> usize {
        self.unit_rows() * padded_cols(cols) / 4
    }

    /// The prepared codes as a 2-D shape `[units, unit_bytes]` (the shape a torch tensor of them has;
    /// for one (rows, cols) the two layouts' shapes differ in the second dimension: `Kp` vs `4·Kp`).
    pub fn codes_shape(self, rows: usize, cols: usize) -> (usize, usize) {
        (self.units(rows), self.unit_bytes(cols))
    }

    /// The prepared scales as `[units, Gp · unit_rows]`.
    pub fn scales_shape(self, rows: usize, cols: usize, group_size: usize) -> (usize, usize) {
        (
            self.units(rows),
            padded_groups(cols, group_size) * self.unit_rows(),
        )
    }

    /// Code bytes of a prepared `[rows, cols]` weight (checked: `None` on overflow).
    pub fn prepared_bytes(self, rows: usize, cols: usize) -> Option<usize> {
        self.units(rows).checked_mul(self.unit_bytes(cols))
    }

    /// fp16 values of the prepared scales of a `[rows, cols]` weight at `group_size` (checked).
    pub fn prepared_scales(self, rows: usize, cols: usize, group_size: usize) -> Option<usize> {
        self.units(rows)
            .checked_mul(padded_groups(cols, group_size))?
            .checked_mul(self.unit_rows())
    }
}

/// Position of weight `(n, k)` of a rows-in-lanes row group (`n < 16`): (byte offset in the group, bit
/// shift).
#[inline]
pub fn lanes_code_position(n: usize, k: usize) -> (usize, u32) {
    let (j, within) = (k / LINE_K, k % LINE_K);
    (j * LINE_BYTES + 4 * n + within % 4, 2 * (within / 4) as u32)
}

/// Code `t + 1` of weight `(n, k)` of a rows-in-lanes row group (for tests and the reference kernels).
#[inline]
pub fn lanes_code(group: &[u8], n: usize, k: usize) -> u8 {
    let (byte, shift) = lanes_code_position(n, k);
    (group[byte] >> shift) & 3
}

/// K rounded up to whole superblocks.
pub fn padded_cols(cols: usize) -> usize {
    cols.div_ceil(SUPER_K) * SUPER_K
}

/// N rounded up to whole row blocks.
pub fn padded_rows(rows: usize) -> usize {
    rows.div_ceil(ROWS) * ROWS
}

/// Number of row blocks.
pub fn row_blocks(rows: usize) -> usize {
    rows.div_ceil(ROWS)
}

/// Bytes of one row block (4 rows × Kp/4).
pub fn block_bytes(cols: usize) -> usize {
    padded_cols(cols)
}

/// Scale groups per padded row.
pub fn padded_groups(cols: usize, group_size: usize) -> usize {
    padded_cols(cols) / group_size
}

/// Bytes of a prepared `[rows, cols]` weight (checked: `None` on overflow).
pub fn prepared_bytes(rows: usize, cols: usize) -> Option<usize> {
    Layout::Rows4.prepared_bytes(rows, cols)
}

/// fp16 values of the prepared scales of a `[rows, cols]` weight at `group_size` (checked).
pub fn prepared_scales(rows: usize, cols: usize, group_size: usize) -> Option<usize> {
    Layout::Rows4.prepared_scales(rows, cols, group_size)
}

/// Position of weight `(r, k)` of a row block: (byte offset in the block, bit shift).
#[inline]
pub fn code_position(r: usize, k: usize) -> (usize, u32) {
    let (sb, within) = (k / SUPER_K, k % SUPER_K);
    let (sub, j) = (within / SUB_K, within % SUB_K);
    (
        sb * ROWS * CHUNK_BYTES + r * CHUNK_BYTES + j,
        2 * sub as u32,
    )
}

/// Code `t + 1` of weight `(r, k)` of a prepared row block (for tests and the scalar kernels).
#[inline]
pub fn code(block: &[u8], r: usize, k: usize) -> u8 {
    let (byte, shift) = code_position(r, k);
    (block[byte] >> shift) & 3
}

/// Permute one block of up to [`ROWS`] canonical rows (`rows_codes[r]` = K/4 bytes, missing rows padded).
fn prepare_block(rows_codes: &[&[u8]], cols: usize, out: &mut [u8]) {
    // Byte j of a chunk gathers codes of weights j, 64 + j, 128 + j, 192 + j: start from all-zero codes.
    out.fill(ZERO_CODE * 0x55);
    for (r, codes) in rows_codes.iter().enumerate() {
        for sb in 0..cols.div_ceil(SUPER_K) {
            let chunk = &mut out[sb * ROWS * CHUNK_BYTES + r * CHUNK_BYTES..][..CHUNK_BYTES];
            for sub in 0..SUPER_K / SUB_K {
                let k0 = sb * SUPER_K + sub * SUB_K;
                if k0 >= cols {
                    break;
                }
                let shift = 2 * sub;
                // 64 weights = 16 canonical bytes (K is a multiple of 32, so a sub-vector is whole or
                // half present).
                let bytes = &codes[k0 / 4..((k0 + SUB_K).min(cols)) / 4];
                for (jb, &b) in bytes.iter().enumerate() {
                    for lane in 0..4 {
                        let c = (b >> (2 * lane)) & 3;
                        let j = 4 * jb + lane;
                        chunk[j] = (chunk[j] & !(3 << shift)) | (c << shift);
                    }
                }
            }
        }
    }
}

/// Permute one row group of up to [`LANE_ROWS`] canonical rows into the rows-in-lanes layout.
fn prepare_lanes_group(rows_codes: &[&[u8]], out: &mut [u8]) {
    out.fill(ZERO_CODE * 0x55);
    for (n, codes) in rows_codes.iter().enumerate() {
        // Canonical byte kb holds weights 4·kb .. + 4 (code of weight 4·kb + l at bits 2l): one
        // sub-step i of one line, b = l.
        for (kb, &byte) in codes.iter().enumerate() {
            let (j, i) = (kb / 4, kb % 4);
            let line = &mut out[j * LINE_BYTES + 4 * n..][..4];
            let shift = 2 * i;
            for (b, dst) in line.iter_mut().enumerate() {
                let c = (byte >> (2 * b)) & 3;
                *dst = (*dst & !(3 << shift)) | (c << shift);
            }
        }
    }
}

/// Check the output sizes of [`prepare_into`].
fn check_prepared_sizes(
    w: &CanonicalRef<'_>,
    layout: Layout,
    planes: usize,
    scales: usize,
) -> Result<()> {
    let want_planes = layout.prepared_bytes(w.rows, w.cols);
    let want_scales = layout.prepared_scales(w.rows, w.cols, w.group_size);
    if Some(planes) != want_planes || Some(scales) != want_scales {
        return Err(Error::invalid(format!(
            "prepared buffers ({}) for [{}, {}] g{} need {want_planes:?} code bytes and {want_scales:?} scales, got {planes} and {scales}",
            layout.name(), w.rows, w.cols, w.group_size
        )));
    }
    Ok(())
}

/// Permute a canonical weight into the kernel layout (`out`: [`prepared_bytes`], `out_scales`:
/// [`prepared_scales`]). Validates first: code 3 and non-finite scales are errors (naming `tensor`,
/// first index, count).
pub fn prepare_into(
    w: CanonicalRef<'_>,
    tensor: &str,
    out: &mut [u8],
    out_scales: &mut [f16],
) -> Result<()> {
    prepare_layout_into(w, tensor, Layout::Rows4, out, out_scales)
}

/// [`prepare_into`] for either layout (sizes from [`Layout::prepared_bytes`] and
/// [`Layout::prepared_scales`]).
pub fn prepare_layout_into(
    w: CanonicalRef<'_>,
    tensor: &str,
    layout: Layout,
    out: &mut [u8],
    out_scales: &mut [f16],
) -> Result<()> {
    w.validate(tensor)?;
    check_prepared_sizes(&w, layout, out.len(), out_scales.len())?;
    if w.rows == 0 {
        return Ok(());
    }
    if layout == Layout::Lanes16 {
        prepare_lanes(w, out, out_scales);
        return Ok(());
    }
    let (cols, g) = (w.cols, w.group_size);
    let codes_per_row = cols / 4;
    let groups = cols / g;
    let gp = padded_groups(cols, g);
    let bb = block_bytes(cols);
    crate::threads::install(|| {
        out.par_chunks_exact_mut(bb)
            .zip(out_scales.par_chunks_exact_mut(gp * ROWS))
            .enumerate()
            .with_min_len(16)
            .for_each(|(b, (block_out, scales_out))| {
                let rows: Vec<&[u8]> = (b * ROWS..((b + 1) * ROWS).min(w.rows))
                    .map(|n| &w.qweight[n * codes_per_row..(n + 1) * codes_per_row])
                    .collect();
                prepare_block(&rows, cols, block_out);
                scales_out.fill(f16::ZERO);
                for (r, n) in (b * ROWS..((b + 1) * ROWS).min(w.rows)).enumerate() {
                    for gi in 0..groups {
                        scales_out[gi * ROWS + r] = w.scales[n * groups + gi];
                    }
                }
            });
    });
    Ok(())
}

/// The rows-in-lanes half of [`prepare_layout_into`] (sizes checked), row group by row group on all
/// cores.
fn prepare_lanes(w: CanonicalRef<'_>, out: &mut [u8], out_scales: &mut [f16]) {
    let (cols, g) = (w.cols, w.group_size);
    let codes_per_row = cols / 4;
    let groups = cols / g;
    let gp = padded_groups(cols, g);
    let unit = Layout::Lanes16.unit_bytes(cols);
    crate::threads::install(|| {
        out.par_chunks_exact_mut(unit)
            .zip(out_scales.par_chunks_exact_mut(gp * LANE_ROWS))
            .enumerate()
            .with_min_len(4)
            .for_each(|(grp, (group_out, scales_out))| {
                let span = grp * LANE_ROWS..((grp + 1) * LANE_ROWS).min(w.rows);
                let rows: Vec<&[u8]> = span
                    .clone()
                    .map(|n| &w.qweight[n * codes_per_row..(n + 1) * codes_per_row])
                    .collect();
                prepare_lanes_group(&rows, group_out);
                scales_out.fill(f16::ZERO);
                for (r, n) in span.enumerate() {
                    for gi in 0..groups {
                        scales_out[gi * LANE_ROWS + r] = w.scales[n * groups + gi];
                    }
                }
            });
    });
}

/// Permute a canonical weight into new buffers (see [`prepare_into`]).
pub fn prepare(w: CanonicalRef<'_>, tensor: &str) -> Result<(Vec<u8>, Vec<f16>)> {
    prepare_layout(w, tensor, Layout::Rows4)
}

/// [`prepare_layout_into`] into new buffers.
pub fn prepare_layout(
    w: CanonicalRef<'_>,
    tensor: &str,
    layout: Layout,
) -> Result<(Vec<u8>, Vec<f16>)> {
    let overflow = || Error::invalid(format!("shape [{}, {}] overflows", w.rows, w.cols));
    let n = layout.prepared_bytes(w.rows, w.cols).ok_or_else(overflow)?;
    let s = layout
        .prepared_scales(w.rows, w.cols, w.group_size)
        .ok_or_else(overflow)?;
    let (mut out, mut scales) = (vec![0u8; n], vec![f16::ZERO; s]);
    prepare_layout_into(w, tensor, layout, &mut out, &mut scales)?;
    Ok((out, scales))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canonical(cols: usize, codes: &[u8]) -> Vec<u8> {
        assert_eq!(codes.len() % cols, 0);
        codes
            .chunks(4)
            .map(|c| {
                c.iter()
                    .enumerate()
                    .fold(0u8, |b, (i, &v)| b | (v << (2 * i)))
            })
            .collect()
    }

    /// Plain reference written from the layout description, weight by weight.
    fn reference(rows: usize, cols: usize, codes: &[u8]) -> Vec<u8> {
        let kp = padded_cols(cols);
        let mut out = vec![0u8; row_blocks(rows) * kp];
        for n in 0..padded_rows(rows) {
            for k in 0..kp {
                let c = if n < rows && k < cols {
                    codes[n * cols + k]
                } else {
                    1
                };
                let (b, r) = (n / 4, n % 4);
                let byte = b * kp + (k / 256) * 256 + r * 64 + k % 64;
                out[byte] |= c << (2 * ((k % 256) / 64));
            }
        }
        out
    }

    #[test]
    fn running_example() {
        // Running example of docs/formats.md#worked-examples: trits [+1, 0, -1, -1, 0, +1, +1, 0] → canonical bytes 0x06 0x69.
        let mut q = vec![0x55u8; 8];
        q[0] = 0x06;
        q[1] = 0x69;
        let s = vec![f16::ONE];
        let w = CanonicalRef {
            rows: 1,
            cols: 32,
            group_size: 32,
            qweight: &q,
            scales: &s,
        };
        let (p, ps) = prepare(w, "w").unwrap();
        assert_eq!(p.len(), 256);
        let trits: Vec<i8> = (0..8).map(|k| code(&p, 0, k) as i8 - 1).collect();
        assert_eq!(trits, [1, 0, -1, -1, 0, 1, 1, 0]);
        // Weights 32.. of row 0 and every weight of the padded rows are t = 0.
        assert!((32..256).all(|k| code(&p, 0, k) == 1));
        assert!((1..4).all(|r| (0..256).all(|k| code(&p, r, k) == 1)));
        assert_eq!(ps.len(), 8 * 4);
        assert_eq!(ps[0], f16::ONE);
        assert!(ps[1..].iter().all(|&v| v == f16::ZERO));
    }

    #[test]
    fn rejects_code_three_with_index() {
        let mut q = vec![0x55u8; 16];
        q[5] = 0x57; // element 20 has code 3
        let s = vec![f16::ONE; 2];
        let w = CanonicalRef {
            rows: 1,
            cols: 64,
            group_size: 32,
            qweight: &q,
            scales: &s,
        };
        let e = prepare(w, "layer.qweight").unwrap_err().to_string();
        assert!(e.contains("layer.qweight") && e.contains("index 20"), "{e}");
    }

    /// `len` codes in {0, 1, 2} from a xorshift stream.
    fn random_codes(len: usize, seed: u64) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 3) as u8
            })
            .collect()
    }

    /// Plain rows-in-lanes reference written from the layout description, weight by weight.
    fn lanes_reference(rows: usize, cols: usize, codes: &[u8]) -> Vec<u8> {
        let kp = padded_cols(cols);
        let mut out = vec![0u8; rows.div_ceil(16) * 4 * kp];
        for n in 0..rows.div_ceil(16) * 16 {
            for k in 0..kp {
                let c = if n < rows && k < cols {
                    codes[n * cols + k]
                } else {
                    1
                };
                let byte = (n / 16) * 4 * kp + (k / 16) * 64 + 4 * (n % 16) + k % 4;
                out[byte] |= c << (2 * ((k % 16) / 4));
            }
        }
        out
    }

    proptest! {
        #[test]
        fn lanes_match_reference(rows in 1usize..40, chunks32 in 1usize..20, gi in 0usize..4, seed in any::<u64>()) {
            let g = crate::canonical::GROUP_SIZES[gi];
            let cols = chunks32 * 32;
            prop_assume!(cols % g == 0);
            let codes = random_codes(rows * cols, seed);
            let q = canonical(cols, &codes);
            let s: Vec<f16> = (0..rows * cols / g).map(|i| f16::from_f32(i as f32 + 1.0)).collect();
            let w = CanonicalRef { rows, cols, group_size: g, qweight: &q, scales: &s };
            let (p, ps) = prepare_layout(w, "w", Layout::Lanes16).unwrap();
            prop_assert_eq!(&p, &lanes_reference(rows, cols, &codes));
            let unit = Layout::Lanes16.unit_bytes(cols);
            for n in 0..rows {
                for k in 0..cols {
                    prop_assert_eq!(lanes_code(&p[(n / 16) * unit..], n % 16, k), codes[n * cols + k]);
                }
            }
            let gp = padded_groups(cols, g);
            for n in 0..rows.div_ceil(16) * 16 {
                for gi in 0..gp {
                    let want = if n < rows && gi < cols / g { s[n * (cols / g) + gi] } else { f16::ZERO };
                    prop_assert_eq!(ps[(n / 16) * gp * 16 + gi * 16 + n % 16], want);
                }
            }
        }

        #[test]
        fn matches_reference(rows in 1usize..10, chunks32 in 1usize..20, gi in 0usize..4, seed in any::<u64>()) {
            let g = crate::canonical::GROUP_SIZES[gi];
            let cols = chunks32 * 32;
            prop_assume!(cols % g == 0);
            let codes = random_codes(rows * cols, seed);
            let q = canonical(cols, &codes);
            let s: Vec<f16> = (0..rows * cols / g).map(|i| f16::from_f32(i as f32 + 1.0)).collect();
            let w = CanonicalRef { rows, cols, group_size: g, qweight: &q, scales: &s };
            let (p, ps) = prepare(w, "w").unwrap();
            prop_assert_eq!(&p, &reference(rows, cols, &codes));
            let gp = padded_groups(cols, g);
            for n in 0..padded_rows(rows) {
                for gi in 0..gp {
                    let want = if n < rows && gi < cols / g { s[n * (cols / g) + gi] } else { f16::ZERO };
                    prop_assert_eq!(ps[(n / 4) * gp * 4 + gi * 4 + n % 4], want);
                }
            }
        }
    }
}
