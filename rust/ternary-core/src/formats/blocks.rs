//! The generic block drivers: a format's block codec ([`BlockCodec`]) run over a whole `[rows, cols]`
//! tensor on the ternary-rs pool ([`crate::threads::install`]), one row per work item (rows never
//! share blocks or groups), validating while decoding: a non-finite scale is reported by block index
//! (`row·blocks_per_row + block`), code 3 by element index (`row·cols + col`, PyTorch `[N, K]`
//! order), each with the count. Also the scalar references of both directions.

use half::f16;
use rayon::prelude::*;

use super::{BlockCodec, Format};
use crate::canonical::{check_shape, count_code3, merge_first, CanonicalRef, CanonicalTernary};
use crate::{threads, Error, Result};

/// Aim for at least this many output bytes per rayon work item (small rows are batched).
const MIN_TASK_BYTES: usize = 16 * 1024;

fn rows_per_task(row_bytes: usize) -> usize {
    MIN_TASK_BYTES.div_ceil(row_bytes.max(1)).max(1)
}

pub(crate) fn block_layout<C: BlockCodec>(
    tensor: &str,
    rows: usize,
    cols: usize,
) -> Result<(usize, usize)> {
    if cols == 0 || !cols.is_multiple_of(C::BLOCK_VALUES) {
        return Err(Error::validation(
            tensor,
            format!(
                "{} needs K (in_features = {cols}) to be a positive multiple of its block size {}",
                C::FORMAT.name(),
                C::BLOCK_VALUES
            ),
            (cols - cols % C::BLOCK_VALUES) as u64,
            (cols % C::BLOCK_VALUES) as u64,
        ));
    }
    let blocks_per_row = cols / C::BLOCK_VALUES;
    let bytes = rows
        .checked_mul(blocks_per_row)
        .and_then(|b| b.checked_mul(C::BLOCK_BYTES))
        .ok_or_else(|| Error::invalid(format!("tensor '{tensor}': [{rows}, {cols}] overflows")))?;
    Ok((blocks_per_row, bytes))
}

/// Zero `chunk` (on the task that then overwrites it, while its lines are in cache) and hand it back
/// initialized.
fn zero_fill(chunk: &mut [std::mem::MaybeUninit<u8>]) -> &mut [u8] {
    // SAFETY: every byte is written before the slice is reinterpreted as initialized `u8`s.
    unsafe {
        std::ptr::write_bytes(chunk.as_mut_ptr(), 0, chunk.len());
        &mut *(chunk as *mut [std::mem::MaybeUninit<u8>] as *mut [u8])
    }
}

/// Decode a whole tensor of block format `C` (fast path, validated).
pub fn decode_blocks<C: BlockCodec>(
    tensor: &str,
    data: &[u8],
    rows: usize,
    cols: usize,
) -> Result<CanonicalTernary> {
    let (blocks_per_row, bytes) = block_layout::<C>(tensor, rows, cols)?;
    check_shape(rows, cols, C::BLOCK_VALUES)?;
    if data.len() != bytes {
        return Err(Error::format(
            format!("tensor '{tensor}'"),
            data.len() as u64,
            format!(
                "{} [{rows}, {cols}] needs {bytes} bytes ({} blocks of {}), got {}",
                C::FORMAT.name(),
                rows * blocks_per_row,
                C::BLOCK_BYTES,
                data.len()
            ),
        ));
    }
    let row_bytes = cols / 4;
    let row_in = blocks_per_row * C::BLOCK_BYTES;
    // Outputs are written in place by the tasks that fill them: a `vec![0; n]` would zero the whole
    // tensor first, on this thread alone (glibc reuses freed heap for tensors under its 32 MiB mmap
    // threshold, so calloc must clear it), and then every task would read those lines back in.
    let mut qweight = Vec::<u8>::with_capacity(rows * row_bytes);
    let mut scales = Vec::<f16>::with_capacity(rows * blocks_per_row);
    let per_task = rows_per_task(row_bytes);
    let (bad_scales, code3) = threads::install(|| {
        qweight.spare_capacity_mut()[..rows * row_bytes]
            .par_chunks_mut(row_bytes * per_task)
            .zip(
                scales.spare_capacity_mut()[..rows * blocks_per_row]
                    .par_chunks_mut(blocks_per_row * per_task),
            )
            .zip(data.par_chunks(row_in * per_task))
            .enumerate()
            .map(|(task, ((q, s), src))| {
                let first_block = task * per_task * blocks_per_row;
                decode_task::<C>(src, zero_fill(q), s, first_block, task * per_task * cols)
            })
            .reduce(
                || ((0, None), (0, None)),
                |a, b| (merge_first(a.0, b.0), merge_first(a.1, b.1)),
            )
    });
    // SAFETY: the zipped chunks cover both spare capacities whole (the data length was checked
    // above: `rows` rows of `row_in` bytes, so every task got its rows), and each task wrote every
    // element of its chunks: `zero_fill` the codes, the scale loop every scale.
    unsafe {
        qweight.set_len(rows * row_bytes);
        scales.set_len(rows * blocks_per_row);
    }
    if let Some(first) = bad_scales.1 {
        return Err(Error::validation(
            tensor,
            format!("non-finite (NaN/Inf) scale d in {} block", C::FORMAT.name()),
            first,
            bad_scales.0,
        ));
    }
    if let Some(first) = code3.1 {
        return Err(Error::validation(
            tensor,
            format!(
                "code 3 (+2·d) in {} data is not ternary; the kernels are ternary-only",
                C::FORMAT.name()
            ),
            first,
            code3.0,
        ));
    }
    Ok(CanonicalTernary {
        rows,
        cols,
        group_size: C::BLOCK_VALUES,
        qweight,
        scales,
    })
}

/// One task of [`decode_blocks`]: the blocks of `src` unpacked into `q` (already zeroed) and their
/// scales into `s`. Returns the tallies of non-finite scales (block indices from `first_block`) and
/// of code 3 (element indices from `first_element`).
#[inline]
fn decode_task<C: BlockCodec>(
    src: &[u8],
    q: &mut [u8],
    s: &mut [std::mem::MaybeUninit<f16>],
    first_block: usize,
    first_element: usize,
) -> ScaleAndCode3Tallies {
    // Branch-free over the blocks; located only when one is bad.
    let mut all_finite = true;
    for (sb, blk) in s.iter_mut().zip(src.chunks_exact(C::BLOCK_BYTES)) {
        let d = C::scale(blk);
        all_finite &= d.is_finite();
        sb.write(d);
    }
    let mut bad = (0u64, None);
    if !all_finite {
        for (b, blk) in src.chunks_exact(C::BLOCK_BYTES).enumerate() {
            if !C::scale(blk).is_finite() {
                bad.0 += 1;
                bad.1.get_or_insert((first_block + b) as u64);
            }
        }
    }
    C::unpack_blocks(src, q);
    let threes = if C::CAN_HOLD_CODE3 {
        let (n, f) = count_code3(q);
        (n, f.map(|f| f + first_element as u64))
    } else {
        (0, None)
    };
    (bad, threes)
}

/// `(count, first index)` of bad scales and of code-3 values.
type ScaleAndCode3Tallies = ((u64, Option<u64>), (u64, Option<u64>));

/// Encode a validated canonical tensor whose group size is `C::BLOCK_VALUES` (fast path).
pub fn encode_blocks<C: BlockCodec>(tensor: &str, canon: CanonicalRef<'_>) -> Result<Vec<u8>> {
    canon.validate(tensor)?;
    if canon.group_size != C::BLOCK_VALUES {
        return Err(Error::invalid(format!(
            "tensor '{tensor}': {} encodes group size {}, got {} (regroup first)",
            C::FORMAT.name(),
            C::BLOCK_VALUES,
            canon.group_size
        )));
    }
    let (blocks_per_row, bytes) = block_layout::<C>(tensor, canon.rows, canon.cols)?;
    if C::FORMAT == Format::Q1_0 {
        // Binary: every value must be ±d. Zero trits (code 1: low bit set, high bit clear) cannot be stored.
        let zeros = canon.qweight.iter().enumerate().find_map(|(i, &b)| {
            let z = b & !(b >> 1) & 0x55;
            (z != 0).then(|| i as u64 * 4 + z.trailing_zeros() as u64 / 2)
        });
        if let Some(first) = zeros {
            let count: u64 = canon
                .qweight
                .iter()
                .map(|&b| (b & !(b >> 1) & 0x55).count_ones() as u64)
                .sum();
            return Err(Error::validation(
                tensor,
                "Q1_0 is binary (±d): a zero weight cannot be stored",
                first,
                count,
            ));
        }
    }
    let row_bytes = canon.cols / 4;
    let row_out = blocks_per_row * C::BLOCK_BYTES;
    let canon_block = C::BLOCK_VALUES / 4;
    let per_task = rows_per_task(row_out);
    let mut out = vec![0u8; bytes];
    threads::install(|| {
        out.par_chunks_mut(row_out * per_task)
            .zip(canon.qweight.par_chunks(row_bytes * per_task))
            .zip(canon.scales.par_chunks(blocks_per_row * per_task))
            .for_each(|((o, q), s)| {
                for ((blk, qb), &d) in o
                    .chunks_exact_mut(C::BLOCK_BYTES)
                    .zip(q.chunks_exact(canon_block))
                    .zip(s)
                {
                    C::pack_block(qb, d, blk);
                }
            })
    });
    Ok(out)
}

/// Scalar reference decode of a whole tensor (no validation): codes `[rows·cols]` and block scales.
pub fn decode_blocks_ref<C: BlockCodec>(
    data: &[u8],
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<f16>) {
    let n_blocks = rows * cols / C::BLOCK_VALUES;
    let mut codes = vec![0u8; rows * cols];
    let mut scales = Vec::with_capacity(n_blocks);
    for (blk, c) in data
        .chunks_exact(C::BLOCK_BYTES)
        .zip(codes.chunks_exact_mut(C::BLOCK_VALUES))
    {
        scales.push(C::decode_block_ref(blk, c));
    }
    (codes, scales)
}

/// Scalar reference encode of a whole tensor from codes and block scales.
pub fn encode_blocks_ref<C: BlockCodec>(codes: &[u8], scales: &[f16]) -> Vec<u8> {
    let mut out = vec![0u8; codes.len() / C::BLOCK_VALUES * C::BLOCK_BYTES];
    for ((blk, c), &d) in out
        .chunks_exact_mut(C::BLOCK_BYTES)
        .zip(codes.chunks_exact(C::BLOCK_VALUES))
        .zip(scales)
    {
        C::encode_block_ref(c, d, blk);
    }
    out
}
