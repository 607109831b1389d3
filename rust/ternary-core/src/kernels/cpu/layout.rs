//! The CPU kernel's weight layout: sign bit-planes.
//!
//! The canonical form stores `W[n, k]` as a 2-bit code `t + 1`, four per byte along K. The kernels
//! do not want codes, they want *selections*: "add x here" (t = +1) and "subtract x here" (t = −1).
//! AVX-512 applies a 16-bit mask register to 16 lanes in one instruction, so the prepared layout
//! stores exactly those masks:
//!
//! * K is cut into chunks of [`CHUNK_K`] = 64 columns (zero-padded at the end: a padded column has
//!   both bits clear, i.e. t = 0, so it contributes nothing).
//! * Each chunk of a row is [`CHUNK_BYTES`] = 16 bytes: a little-endian `u64` **plus** mask (bit i set
//!   ⇔ `W[n, 64c + i] = +1`) followed by a little-endian `u64` **minus** mask (bit i ⇔ t = −1).
//! * Rows are stored one after the other: row `n` occupies bytes
//!   `[n · row_bytes(K), (n + 1) · row_bytes(K))`.
//!
//! The layout has the same size as the canonical codes (2 bits per weight) unless K is an odd multiple
//! of 32, where the last chunk is half padding. Any 16-, 32- or 64-bit slice of a plane is a ready
//! mask register (`kmovw k, m16` straight from memory), and an 8-bit slice drives the AVX2 decode.
//! Scales stay as they are (f16 `[N, K/g]`): converting them to f32 would add 6 % to the bytes the
//! memory-bound GEMV streams at g = 128.

use rayon::prelude::*;

use crate::canonical::CanonicalRef;
use crate::{Error, Result};

/// Columns per bit-plane chunk (one `u64` per plane).
pub const CHUNK_K: usize = 64;
/// Bytes per chunk of one row: plus plane then minus plane.
pub const CHUNK_BYTES: usize = 16;
/// Byte offset of the minus plane inside a chunk.
pub const MINUS_OFFSET: usize = 8;

/// K rounded up to a whole number of chunks.
pub fn padded_cols(cols: usize) -> usize {
    cols.div_ceil(CHUNK_K) * CHUNK_K
}

/// Bytes of one prepared row.
pub fn row_bytes(cols: usize) -> usize {
    cols.div_ceil(CHUNK_K) * CHUNK_BYTES
}

/// Bytes of a prepared `[rows, cols]` weight (checked: `None` on overflow).
pub fn prepared_bytes(rows: usize, cols: usize) -> Option<usize> {
    rows.checked_mul(row_bytes(cols))
}

/// `PLANE_NIBBLES[b] = (plus, minus)`: the 4-bit plus/minus masks of the four codes in canonical byte `b`
/// (code 2 → plus, code 0 → minus, code 1 → neither; code 3 is rejected before this table is used).
const PLANE_NIBBLES: [(u8, u8); 256] = {
    let mut table = [(0u8, 0u8); 256];
    let mut b = 0;
    while b < 256 {
        let (mut plus, mut minus) = (0u8, 0u8);
        let mut lane = 0;
        while lane < 4 {
            match (b >> (2 * lane)) & 3 {
                0 => minus |= 1 << lane,
                2 => plus |= 1 << lane,
                _ => {}
            }
            lane += 1;
        }
        table[b] = (plus, minus);
        b += 1;
    }
    table
};

/// Convert one canonical row (`cols / 4` code bytes) into its bit-planes (`row_bytes(cols)` bytes).
fn prepare_row(codes: &[u8], out: &mut [u8]) {
    for (chunk_codes, chunk_out) in codes
        .chunks(CHUNK_K / 4)
        .zip(out.chunks_exact_mut(CHUNK_BYTES))
    {
        let (mut plus, mut minus) = (0u64, 0u64);
        for (i, &b) in chunk_codes.iter().enumerate() {
            let (p, m) = PLANE_NIBBLES[b as usize];
            plus |= (p as u64) << (4 * i);
            minus |= (m as u64) << (4 * i);
        }
        chunk_out[..MINUS_OFFSET].copy_from_slice(&plus.to_le_bytes());
        chunk_out[MINUS_OFFSET..].copy_from_slice(&minus.to_le_bytes());
    }
}

/// Permute a canonical weight into bit-planes, writing `out` (`prepared_bytes(rows, cols)` bytes).
/// Validates first: code 3 and non-finite scales are errors (naming `tensor`, first index, count).
pub fn prepare_into(w: CanonicalRef<'_>, tensor: &str, out: &mut [u8]) -> Result<()> {
    w.validate(tensor)?;
    let rb = row_bytes(w.cols);
    if Some(out.len()) != prepared_bytes(w.rows, w.cols) {
        return Err(Error::invalid(format!(
            "prepared buffer for [{}, {}] needs {} bytes, got {}",
            w.rows,
            w.cols,
            w.rows.saturating_mul(rb),
            out.len()
        )));
    }
    let codes_per_row = w.cols / 4;
    if w.rows == 0 {
        return Ok(());
    }
    crate::threads::install(|| {
        out.par_chunks_exact_mut(rb)
            .zip(w.qweight.par_chunks_exact(codes_per_row))
            .with_min_len(64)
            .for_each(|(row_out, row_codes)| prepare_row(row_codes, row_out));
    });
    Ok(())
}

/// Permute a canonical weight into a new bit-plane buffer (see [`prepare_into`]).
pub fn prepare(w: CanonicalRef<'_>, tensor: &str) -> Result<Vec<u8>> {
    let n = prepared_bytes(w.rows, w.cols)
        .ok_or_else(|| Error::invalid(format!("shape [{}, {}] overflows", w.rows, w.cols)))?;
    let mut out = vec![0u8; n];
    prepare_into(w, tensor, &mut out)?;
    Ok(out)
}

/// Trit of column `k` of one prepared row (reads the planes bit by bit; for tests and the scalar kernel).
#[inline]
pub fn trit(row: &[u8], k: usize) -> i8 {
    let base = (k / CHUNK_K) * CHUNK_BYTES;
    let bit = k % CHUNK_K;
    let byte = bit / 8;
    let plus = (row[base + byte] >> (bit % 8)) & 1;
    let minus = (row[base + MINUS_OFFSET + byte] >> (bit % 8)) & 1;
    plus as i8 - minus as i8
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use proptest::prelude::*;

    /// Plain reference of the permutation, written from the layout description: set bit by bit.
    fn reference_planes(rows: usize, cols: usize, qweight: &[u8]) -> Vec<u8> {
        let rb = row_bytes(cols);
        let mut out = vec![0u8; rows * rb];
        for n in 0..rows {
            for k in 0..cols {
                let code = (qweight[n * cols / 4 + k / 4] >> (2 * (k % 4))) & 3;
                let plane = match code {
                    2 => 0,
                    0 => MINUS_OFFSET,
                    _ => continue,
                };
                let byte = n * rb + (k / 64) * 16 + plane + (k % 64) / 8;
                out[byte] |= 1 << (k % 8);
            }
        }
        out
    }

    fn canonical(rows: usize, cols: usize, codes: &[u8]) -> (Vec<u8>, Vec<f16>) {
        let qweight = codes
            .chunks(4)
            .map(|c| {
                c.iter()
                    .enumerate()
                    .fold(0u8, |b, (i, &v)| b | (v << (2 * i)))
            })
            .collect();
        (qweight, vec![f16::ONE; rows * cols / 32])
    }

    #[test]
    fn running_example() {
        // FORMATS.md running example: trits [+1, 0, -1, -1, 0, +1, +1, 0] → bytes 0x06 0x69.
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
        let p = prepare(w, "w").unwrap();
        assert_eq!(p.len(), 16);
        assert_eq!(p[0], 0b0110_0001); // plus at k = 0, 5, 6
        assert_eq!(p[MINUS_OFFSET], 0b0000_1100); // minus at k = 2, 3
        assert!(p[1..8].iter().chain(&p[9..]).all(|&b| b == 0));
        let trits: Vec<i8> = (0..8).map(|k| trit(&p, k)).collect();
        assert_eq!(trits, [1, 0, -1, -1, 0, 1, 1, 0]);
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

    proptest! {
        #[test]
        fn matches_reference(rows in 1usize..6, chunks32 in 1usize..7, seed in any::<u64>()) {
            let cols = chunks32 * 32;
            let mut state = seed | 1;
            let codes: Vec<u8> = (0..rows * cols)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % 3) as u8
                })
                .collect();
            let (q, s) = canonical(rows, cols, &codes);
            let w = CanonicalRef { rows, cols, group_size: 32, qweight: &q, scales: &s };
            let p = prepare(w, "w").unwrap();
            prop_assert_eq!(&p, &reference_planes(rows, cols, &q));
            let rb = row_bytes(cols);
            for n in 0..rows {
                for k in 0..padded_cols(cols) {
                    let want = if k < cols { codes[n * cols + k] as i8 - 1 } else { 0 };
                    prop_assert_eq!(trit(&p[n * rb..(n + 1) * rb], k), want);
                }
            }
        }
    }
}
