//! The weight layout of the CUDA kernels (`cuda/ternary_gemm.cu`), produced once per layer at load time.
//!
//! The kernels feed 2-bit codes straight into `mma.sync.m16n8k16` fragments, so the codes are reordered so
//! that one 16-byte load per lane of a warp yields every fragment register the lane needs for a 64 (K) ×
//! 32 (N) block of `W` — a *chunk* of [`CHUNK_BYTES`] bytes:
//!
//! * chunks are stored strip-major: chunk `(nb, kb)` (N rows `32·nb ..`, K columns `64·kb ..`) starts at
//!   byte `(nb · k_chunks + kb) · 512`, so a strip of 32 output features streams contiguously along K;
//! * inside a chunk, lane `l` (0..32) owns bytes `16·l .. 16·l + 16`, read as four little-endian `u32`
//!   words `w = 0..4`, one per 16-wide k-step;
//! * code `q` (0..16) of word `w` sits at bits `2q, 2q+1`. With `r = q % 8`, `h = q / 8`, `nt = r / 2`,
//!   `j = r % 2` it holds `W[n, k]` for `n = 32·nb + 8·nt + l / 4` and
//!   `k = 64·kb + 16·w + 8·j + 2·(l % 4) + h`.
//!
//! So bits `2r` and `16 + 2r` of a word hold the two consecutive-k elements of one `bf16x2`/`half2`
//! fragment register (`(w >> 2r) & 0x0003_0003`, OR'ed into an fp16/bf16 exponent, is the pair as
//! `128 + c` / `1024 + c`): register `r = 2·nt + j` is `b0b1` (`j = 0`) or `b2b3` (`j = 1`) of the B
//! fragment of n-tile `nt` — and, read as the *A* operand, registers `(4p, 4p+2, 4p+1, 4p+3)` are the
//! A fragment of rows `16p .. 16p+16`, which the decode (M ≤ 8) kernel uses with `x` as the B operand.
//!
//! N is padded to a multiple of [`CHUNK_N`] and K to a multiple of [`CHUNK_K`] with code 1 (weight 0).
//! Scales are transposed to `f16 [groups_pad, n_pad]` (group-major: a k-step's scales for 32 consecutive
//! outputs are one contiguous 64-byte run) with zeros in the padding; `groups_pad = ceil(k_pad / g)`.

use half::f16;
use rayon::prelude::*;

use crate::canonical::CanonicalRef;
use crate::{threads, Result};

/// Output features (N) per chunk: 4 n-tiles of the mma's n8.
pub const CHUNK_N: usize = 32;
/// Input features (K) per chunk: 4 k-steps of the mma's k16.
pub const CHUNK_K: usize = 64;
/// Bytes per chunk: 32 lanes × one 16-byte load.
pub const CHUNK_BYTES: usize = CHUNK_N * CHUNK_K / 4;
/// Bytes each lane loads per chunk.
pub const LANE_BYTES: usize = 16;
/// The code of a zero weight (used for padding).
const ZERO_CODE: u8 = 1;

const _: () = assert!(CHUNK_BYTES == 32 * LANE_BYTES);

/// A weight in the CUDA kernels' layout.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuLayout {
    /// Real output features.
    pub rows: usize,
    /// Real input features.
    pub cols: usize,
    pub group_size: usize,
    /// `rows` rounded up to [`CHUNK_N`].
    pub n_pad: usize,
    /// `cols` rounded up to [`CHUNK_K`].
    pub k_pad: usize,
    /// `ceil(k_pad / group_size)`: rows of `scales`.
    pub groups_pad: usize,
    /// `n_pad / 32` strips × `k_pad / 64` chunks × 512 bytes.
    pub qweight: Vec<u8>,
    /// `f16 [groups_pad, n_pad]`.
    pub scales: Vec<f16>,
}

/// Padded sizes `(n_pad, k_pad, groups_pad)` for a `[rows, cols]` weight with group size `g`.
pub fn padded_dims(rows: usize, cols: usize, group_size: usize) -> Result<(usize, usize, usize)> {
    crate::canonical::check_shape(rows, cols, group_size)?;
    let round_up = |v: usize, m: usize| {
        v.checked_next_multiple_of(m).ok_or_else(|| {
            crate::Error::invalid(format!("dimension {v} overflows when padded to {m}"))
        })
    };
    let n_pad = round_up(rows, CHUNK_N)?;
    let k_pad = round_up(cols, CHUNK_K)?;
    let groups_pad = k_pad.div_ceil(group_size);
    // Both outputs must be addressable.
    n_pad
        .checked_mul(k_pad)
        .and_then(|v| groups_pad.checked_mul(n_pad).map(|_| v))
        .ok_or_else(|| {
            crate::Error::invalid(format!("padded shape [{n_pad}, {k_pad}] overflows"))
        })?;
    Ok((n_pad, k_pad, groups_pad))
}

/// Position of code `q` of word `word` of lane `lane` inside a chunk, as `(n, k)` offsets from the
/// chunk's origin. The one definition of the in-chunk order (the kernels' fragment maths mirror it).
#[inline]
pub fn chunk_coords(lane: usize, word: usize, q: usize) -> (usize, usize) {
    let (r, h) = (q % 8, q / 8);
    let (nt, j) = (r / 2, r % 2);
    (8 * nt + lane / 4, 16 * word + 8 * j + 2 * (lane % 4) + h)
}

/// Permute a canonical weight into the CUDA layout. Rejects code 3 and non-finite scales (the kernels are
/// ternary-only); runs on the ternary-rs pool.
pub fn to_gpu_layout(w: CanonicalRef<'_>, tensor: &str) -> Result<GpuLayout> {
    w.validate(tensor)?;
    let (n_pad, k_pad, groups_pad) = padded_dims(w.rows, w.cols, w.group_size)?;
    let k_chunks = k_pad / CHUNK_K;
    let strip_bytes = k_chunks * CHUNK_BYTES;
    let mut qweight = vec![0u8; n_pad / CHUNK_N * strip_bytes];
    let row_bytes = w.cols / 4;

    threads::install(|| {
        qweight
            .par_chunks_mut(strip_bytes)
            .enumerate()
            .for_each(|(nb, strip)| {
                for (kb, chunk) in strip.chunks_exact_mut(CHUNK_BYTES).enumerate() {
                    for (lane, lane_bytes) in chunk.chunks_exact_mut(LANE_BYTES).enumerate() {
                        for (word, out) in lane_bytes.chunks_exact_mut(4).enumerate() {
                            let mut bits = 0u32;
                            for q in 0..16 {
                                let (dn, dk) = chunk_coords(lane, word, q);
                                let (n, k) = (nb * CHUNK_N + dn, kb * CHUNK_K + dk);
                                let code = if n < w.rows && k < w.cols {
                                    (w.qweight[n * row_bytes + k / 4] >> (2 * (k % 4))) & 3
                                } else {
                                    ZERO_CODE
                                };
                                bits |= u32::from(code) << (2 * q);
                            }
                            out.copy_from_slice(&bits.to_le_bytes());
                        }
                    }
                }
            });
    });

    let groups = w.cols / w.group_size;
    let mut scales = vec![f16::ZERO; groups_pad * n_pad];
    for (grp, out_row) in scales.chunks_exact_mut(n_pad).take(groups).enumerate() {
        for (n, s) in out_row.iter_mut().take(w.rows).enumerate() {
            *s = w.scales[n * groups + grp];
        }
    }

    Ok(GpuLayout {
        rows: w.rows,
        cols: w.cols,
        group_size: w.group_size,
        n_pad,
        k_pad,
        groups_pad,
        qweight,
        scales,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::CanonicalTernary;

    /// Tiny deterministic generator (no dependency on the code under test).
    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    fn random(rows: usize, cols: usize, g: usize, seed: u64) -> CanonicalTernary {
        let mut s = seed;
        let mut t = CanonicalTernary::zeros(rows, cols, g).unwrap();
        for b in t.qweight.iter_mut() {
            let mut v = 0u8;
            for i in 0..4 {
                v |= ((lcg(&mut s) % 3) as u8) << (2 * i);
            }
            *b = v;
        }
        for x in t.scales.iter_mut() {
            *x = f16::from_f32((lcg(&mut s) % 1000) as f32 / 997.0 + 0.01);
        }
        t
    }

    /// Reference: walk every weight of the *source* and compute where the spec in the module docs puts it
    /// (the inverse direction of the implementation), then compare whole buffers.
    fn reference(t: &CanonicalTernary) -> (Vec<u8>, Vec<f16>) {
        let n_pad = t.rows.div_ceil(32) * 32;
        let k_pad = t.cols.div_ceil(64) * 64;
        let groups_pad = k_pad.div_ceil(t.group_size);
        let kc = k_pad / 64;
        let mut q = vec![0x55u8; n_pad * k_pad / 4]; // all code 1
        for n in 0..t.rows {
            for k in 0..t.cols {
                let code = t.as_ref().code(n, k);
                let (nb, kb, nn, kk) = (n / 32, k / 64, n % 32, k % 64);
                let lane = (nn % 8) * 4 + (kk % 8) / 2;
                let (nt, word, j, h) = (nn / 8, kk / 16, (kk % 16) / 8, kk % 2);
                let qi = h * 8 + nt * 2 + j;
                let byte = (nb * kc + kb) * 512 + lane * 16 + word * 4 + qi / 4;
                let shift = 2 * (qi % 4);
                q[byte] = (q[byte] & !(3 << shift)) | (code << shift);
            }
        }
        let mut s = vec![f16::ZERO; groups_pad * n_pad];
        for n in 0..t.rows {
            for grp in 0..t.cols / t.group_size {
                s[grp * n_pad + n] = t.scales[n * (t.cols / t.group_size) + grp];
            }
        }
        (q, s)
    }

    #[test]
    fn matches_reference_over_shapes() {
        for &(rows, cols, g) in &[
            (32, 64, 64),
            (1, 32, 32),
            (33, 96, 32),
            (7, 256, 256),
            (100, 384, 128),
            (65, 224, 32),
        ] {
            let t = random(rows, cols, g, (rows * 1000 + cols) as u64);
            let l = to_gpu_layout(t.as_ref(), "w").unwrap();
            let (q, s) = reference(&t);
            assert_eq!(l.qweight, q, "codes for [{rows}, {cols}] g{g}");
            assert_eq!(l.scales, s, "scales for [{rows}, {cols}] g{g}");
            assert_eq!(l.n_pad, rows.div_ceil(32) * 32);
            assert_eq!(l.k_pad, cols.div_ceil(64) * 64);
        }
    }

    #[test]
    fn chunk_coords_is_a_bijection() {
        let mut seen = vec![false; CHUNK_N * CHUNK_K];
        for lane in 0..32 {
            for word in 0..4 {
                for q in 0..16 {
                    let (n, k) = chunk_coords(lane, word, q);
                    assert!(n < CHUNK_N && k < CHUNK_K);
                    assert!(!std::mem::replace(&mut seen[n * CHUNK_K + k], true));
                }
            }
        }
        assert!(seen.iter().all(|&b| b));
    }

    #[test]
    fn word_pairs_are_consecutive_k_of_one_fragment_register() {
        // bits 2r and 16+2r: same n, k and k+1, k even — what one bf16x2 register holds.
        for lane in 0..32 {
            for word in 0..4 {
                for r in 0..8 {
                    let (n0, k0) = chunk_coords(lane, word, r);
                    let (n1, k1) = chunk_coords(lane, word, r + 8);
                    assert_eq!((n0, k0 % 2, k1), (n1, 0, k0 + 1));
                }
            }
        }
    }

    #[test]
    fn rejects_code_three_and_bad_shapes() {
        let mut t = random(4, 64, 64, 1);
        t.qweight[5] |= 0b11;
        assert!(matches!(
            to_gpu_layout(t.as_ref(), "w"),
            Err(crate::Error::Validation { .. })
        ));
        assert!(padded_dims(4, 48, 32).is_err());
        assert!(padded_dims(4, 64, 48).is_err());
        assert!(padded_dims(usize::MAX / 2, 64, 64).is_err());
    }
}
