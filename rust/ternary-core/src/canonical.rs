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

/// Code bytes from which [`CanonicalRef::validate`] splits its check over the pool.
const PARALLEL_VALIDATE_BYTES: usize = 1 << 20;

/// Whether any 2-bit code in `bytes` is 3 (both bits set): a branch-free OR over whole words, which
/// the compiler vectorizes.
fn has_code3(bytes: &[u8]) -> bool {
    let words = bytes.chunks_exact(8);
    let tail = words
        .remainder()
        .iter()
        .fold(0u8, |a, &b| a | (b & (b >> 1)));
    let any = words.fold(0u64, |a, w| {
        let x = u64::from_le_bytes(w.try_into().expect("chunk of 8"));
        a | (x & (x >> 1))
    });
    any & 0x5555_5555_5555_5555 != 0 || tail & 0x55 != 0
}

/// Number of code-3 fields in a canonical byte slice, and the element index (within the slice) of
/// the first one.
pub(crate) fn count_code3(bytes: &[u8]) -> (u64, Option<u64>) {
    // Valid data has no code 3: a branch-free pass settles that case; only data that holds one
    // takes the exact count below.
    if !has_code3(bytes) {
        return (0, None);
    }
    let mut count = 0u64;
    let mut first = None;
    // Whole words first: a code is 3 exactly when both of its bits are set.
    let mut words = bytes.chunks_exact(8);
    let mut base = 0usize;
    for w in &mut words {
        let x = u64::from_le_bytes(w.try_into().expect("chunk of 8"));
        let threes = x & (x >> 1) & 0x5555_5555_5555_5555;
        if threes != 0 {
            if first.is_none() {
                first = Some((base * 4 + threes.trailing_zeros() as usize / 2) as u64);
            }
            count += threes.count_ones() as u64;
        }
        base += 8;
    }
    for (i, &b) in words.remainder().iter().enumerate() {
        let threes = b & (b >> 1) & 0x55;
        if threes != 0 {
            if first.is_none() {
                first = Some(((base + i) * 4 + threes.trailing_zeros() as usize / 2) as u64);
            }
            count += threes.count_ones() as u64;
        }
    }
    (count, first)
}

/// Merge two `(count, first index)` tallies of bad values (parallel reductions): counts add, the
/// smaller first index wins.
pub(crate) fn merge_first(a: (u64, Option<u64>), b: (u64, Option<u64>)) -> (u64, Option<u64>) {
    let first = match (a.1, b.1) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    };
    (a.0 + b.0, first)
}

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
    if cols == 0 || !cols.is_multiple_of(group_size) {
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
        // Valid data, the usual case, is settled by branch-free passes (on the pool for large
        // tensors); only a tensor that holds a bad value takes the exact scans below, which locate
        // and count.
        let clean_codes = |q: &[u8]| !has_code3(q);
        let clean_scales =
            |s: &[f16]| s.iter().fold(0u16, |a, v| a | u16::from(!v.is_finite())) == 0;
        let clean = if self.qweight.len() < PARALLEL_VALIDATE_BYTES {
            clean_codes(self.qweight) && clean_scales(self.scales)
        } else {
            use rayon::prelude::*;
            crate::threads::install(|| {
                self.qweight.par_chunks(1 << 16).all(clean_codes)
                    && self.scales.par_chunks(1 << 15).all(clean_scales)
            })
        };
        if clean {
            return Ok(());
        }
        let (bad_codes, first_code) = count_code3(self.qweight);
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

/// Output element type of [`CanonicalRef::dequantize_bits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfKind {
    F16,
    BF16,
}

/// `MASKS[b][c]`: four 16-bit lanes, lane `j` all ones where code `j` of byte `b` equals `c`.
/// Dequantizing a byte is then `(M0 & −s) | (M1 & 0·s) | (M2 & s)` on four lanes at once.
const LANE_MASKS: [[u64; 3]; 256] = {
    let mut t = [[0u64; 3]; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 4 {
            let c = (b >> (2 * j)) & 3;
            if c < 3 {
                t[b][c] |= 0xFFFF << (16 * j);
            }
            j += 1;
        }
        b += 1;
    }
    t
};

/// byte → its four trits as consecutive i8 (little-endian word).
const BYTE_TRITS: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 4 {
            let trit = ((b >> (2 * j)) & 3) as i32 - 1;
            t[b] |= ((trit as i8) as u8 as u32) << (8 * j);
            j += 1;
        }
        b += 1;
    }
    t
};

impl<'a> CanonicalRef<'a> {
    /// `W[n, k] = (c − 1) · scale` in f32, row-major `[rows, cols]` (validate first: code 3 reads +2).
    pub fn dequantize_f32(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.rows * self.cols];
        self.dequantize_f32_into(&mut out)?;
        Ok(out)
    }

    /// [`Self::dequantize_f32`] into a caller's buffer of `rows · cols` values (e.g. a NumPy or
    /// torch tensor allocated with huge pages: first-touch page faults dominate large outputs).
    pub fn dequantize_f32_into(&self, out: &mut [f32]) -> Result<()> {
        self.dequantize_f32_impl(out, dequant_simd::available())
    }

    /// `simd = false` forces the scalar reference loop (tests compare the two).
    pub(crate) fn dequantize_f32_impl(&self, out: &mut [f32], simd: bool) -> Result<()> {
        self.for_each_group(out, |grp, qg, sc| {
            let sc = sc.to_f32();
            let lut = [-sc, 0.0 * sc, sc, 2.0 * sc];
            if simd {
                dequant_simd::group_f32(qg, grp, lut);
                return;
            }
            for (o, &b) in grp.chunks_exact_mut(4).zip(qg) {
                for (j, v) in o.iter_mut().enumerate() {
                    *v = lut[((b >> (2 * j)) & 3) as usize];
                }
            }
        })
    }

    /// Check shape and `out` (`rows · cols` values), then run `f(out group, its code bytes, its
    /// scale)` on every group, rows in parallel: the loop both dequantizers share.
    fn for_each_group<T: Send>(
        &self,
        out: &mut [T],
        f: impl Fn(&mut [T], &[u8], f16) + Sync,
    ) -> Result<()> {
        self.check()?;
        self.check_out(out.len())?;
        let (cols, g) = (self.cols, self.group_size);
        crate::threads::install(|| {
            use rayon::prelude::*;
            out.par_chunks_mut(cols)
                .enumerate()
                .with_min_len(4)
                .for_each(|(n, row)| {
                    let q = &self.qweight[n * cols / 4..(n + 1) * cols / 4];
                    let s = &self.scales[n * (cols / g)..(n + 1) * (cols / g)];
                    for ((grp, qg), &sc) in
                        row.chunks_exact_mut(g).zip(q.chunks_exact(g / 4)).zip(s)
                    {
                        f(grp, qg, sc);
                    }
                    // The SIMD paths write with streaming stores: order them before the row is handed on.
                    dequant_simd::fence();
                })
        });
        Ok(())
    }

    fn check_out(&self, len: usize) -> Result<()> {
        if len != self.rows * self.cols {
            return Err(Error::invalid(format!(
                "output buffer holds {len} values, [{}, {}] needs {}",
                self.rows,
                self.cols,
                self.rows * self.cols
            )));
        }
        Ok(())
    }

    /// `W[n, k] = (c − 1) · scale` rounded (nearest even) to fp16 or bf16, returned as raw bits.
    /// The product is computed in f32 (exact: `t ∈ {−1, 0, 1}`), then rounded once.
    pub fn dequantize_bits(&self, kind: HalfKind) -> Result<Vec<u16>> {
        let mut out = vec![0u16; self.rows * self.cols];
        self.dequantize_bits_into(kind, &mut out)?;
        Ok(out)
    }

    /// [`Self::dequantize_bits`] into a caller's buffer of `rows · cols` values.
    pub fn dequantize_bits_into(&self, kind: HalfKind, out: &mut [u16]) -> Result<()> {
        self.dequantize_bits_impl(kind, out, dequant_simd::available())
    }

    /// `simd = false` forces the scalar reference loop (tests compare the two).
    pub(crate) fn dequantize_bits_impl(
        &self,
        kind: HalfKind,
        out: &mut [u16],
        simd: bool,
    ) -> Result<()> {
        let to_bits = move |x: f32| match kind {
            HalfKind::F16 => half::f16::from_f32(x).to_bits(),
            HalfKind::BF16 => half::bf16::from_f32(x).to_bits(),
        };
        self.for_each_group(out, |grp, qg, sc| {
            let sc = sc.to_f32();
            let (neg, zero, pos, two) = (
                to_bits(-sc),
                to_bits(0.0 * sc),
                to_bits(sc),
                to_bits(2.0 * sc),
            );
            if simd {
                dequant_simd::group_u16(qg, grp, [neg, zero, pos, two]);
                return;
            }
            let lane = |x: u16| x as u64 * 0x0001_0001_0001_0001;
            let (neg, zero, pos) = (lane(neg), lane(zero), lane(pos));
            for (o, &b) in grp.chunks_exact_mut(4).zip(qg) {
                let m = &LANE_MASKS[b as usize];
                let w = (m[0] & neg) | (m[1] & zero) | (m[2] & pos);
                o[0] = w as u16;
                o[1] = (w >> 16) as u16;
                o[2] = (w >> 32) as u16;
                o[3] = (w >> 48) as u16;
            }
        })
    }

    /// Trits `t = c − 1` as int8, row-major `[rows, cols]`.
    pub fn trits(&self) -> Result<Vec<i8>> {
        self.check()?;
        Ok(unpack_trits(self.qweight))
    }

    /// Change the group size without changing a value. To a divisor of the current group: always
    /// (scales repeat). To a multiple: only when, in each merged group, every sub-group that holds a
    /// nonzero trit has the same scale (all-zero sub-groups dequantize to 0 whatever their scale);
    /// otherwise [`Regrouped::ScalesDiffer`]. `repack::regroup` adds the refusal or the
    /// requantization on top.
    pub fn try_regroup(&self, group_size: usize) -> Result<Regrouped> {
        self.check()?;
        check_shape(self.rows, self.cols, group_size)?;
        let g = self.group_size;
        if group_size <= g {
            let rep = g / group_size;
            let scales = self
                .scales
                .iter()
                .flat_map(|s| std::iter::repeat_n(*s, rep))
                .collect();
            return Ok(Regrouped::Exact(CanonicalTernary {
                rows: self.rows,
                cols: self.cols,
                group_size,
                qweight: self.qweight.to_vec(),
                scales,
            }));
        }
        let merge = group_size / g;
        let sub_bytes = g / 4;
        let mut scales = Vec::with_capacity(self.scales.len() / merge);
        let mut bad = 0u64;
        let mut first_bad = None;
        for (m, (subs, codes)) in self
            .scales
            .chunks_exact(merge)
            .zip(self.qweight.chunks_exact(group_size / 4))
            .enumerate()
        {
            let mut common: Option<f16> = None;
            let mut ok = true;
            for (s, q) in subs.iter().zip(codes.chunks_exact(sub_bytes)) {
                // 0x55 bytes are four zero trits: such a sub-group's scale is irrelevant.
                if q.iter().all(|&b| b == 0x55) {
                    continue;
                }
                match common {
                    None => common = Some(*s),
                    Some(c) if c == *s => {}
                    Some(_) => ok = false,
                }
            }
            if !ok {
                bad += 1;
                first_bad.get_or_insert(m as u64);
            }
            scales.push(common.unwrap_or(subs[0]));
        }
        if let Some(first_group) = first_bad {
            return Ok(Regrouped::ScalesDiffer {
                first_group,
                count: bad,
            });
        }
        Ok(Regrouped::Exact(CanonicalTernary {
            rows: self.rows,
            cols: self.cols,
            group_size,
            qweight: self.qweight.to_vec(),
            scales,
        }))
    }
}

/// A group-size change that [`CanonicalRef::try_regroup`] made, or could not make without changing
/// values.
#[derive(Debug)]
pub enum Regrouped {
    Exact(CanonicalTernary),
    /// Merged sub-groups holding nonzero trits have different scales: `first_group` is the first
    /// merged group (at the new size), `count` how many are so.
    ScalesDiffer {
        first_group: u64,
        count: u64,
    },
}

impl Regrouped {
    /// The regrouped tensor, or the refusal that names the first merged group whose sub-groups
    /// differ (from group size `from` to `to`).
    pub fn exact_or_refuse(self, tensor: &str, from: usize, to: usize) -> Result<CanonicalTernary> {
        match self {
            Regrouped::Exact(t) => Ok(t),
            Regrouped::ScalesDiffer { first_group, count } => Err(Error::validation(
                tensor,
                format!(
                    "cannot merge groups of {from} into groups of {to} losslessly: the merged \
                     sub-groups have different scales (first index is the merged group); pass \
                     requantize=True to re-ternarize at group {to}"
                ),
                first_group,
                count,
            )),
        }
    }
}

/// Canonical code bytes → trits `c − 1` as int8 (four per byte; code 3 reads as +2).
pub fn unpack_trits(qweight: &[u8]) -> Vec<i8> {
    let mut out = vec![0i8; qweight.len() * 4];
    crate::threads::install(|| {
        use rayon::prelude::*;
        out.par_chunks_mut(1 << 16)
            .zip(qweight.par_chunks(1 << 14))
            .for_each(|(o, q)| {
                for (o4, &b) in o.chunks_exact_mut(4).zip(q) {
                    let w = BYTE_TRITS[b as usize].to_le_bytes();
                    for j in 0..4 {
                        o4[j] = w[j] as i8;
                    }
                }
            })
    });
    out
}

/// Pack trits `[rows, cols]` (int8 in {−1, 0, 1}) into canonical code bytes `[rows, cols/4]`.
pub fn pack_trits(tensor: &str, trits: &[i8], cols: usize) -> Result<Vec<u8>> {
    if cols == 0 || !cols.is_multiple_of(4) || !trits.len().is_multiple_of(cols) {
        return Err(Error::invalid(format!(
            "trits of {} values cannot be [N, K] with K = {cols} a positive multiple of 4",
            trits.len()
        )));
    }
    let mut out = vec![0u8; trits.len() / 4];
    let (count, first) = crate::threads::install(|| {
        use rayon::prelude::*;
        out.par_chunks_mut(1 << 14)
            .zip(trits.par_chunks(1 << 16))
            .enumerate()
            .map(|(c, (o, t))| {
                let mut bad = (0u64, None);
                for (i, (ob, t4)) in o.iter_mut().zip(t.chunks_exact(4)).enumerate() {
                    let mut b = 0u8;
                    for (j, &v) in t4.iter().enumerate() {
                        if !(-1..=1).contains(&v) {
                            bad.0 += 1;
                            bad.1.get_or_insert((c * (1 << 16) + 4 * i + j) as u64);
                        }
                        b |= (((v as i32 + 1) & 3) as u8) << (2 * j);
                    }
                    *ob = b;
                }
                bad
            })
            .reduce(|| (0, None), merge_first)
    });
    if let Some(first) = first {
        return Err(Error::validation(
            tensor,
            "trit outside {-1, 0, 1}",
            first,
            count,
        ));
    }
    Ok(out)
}

/// AVX-512BW dequantization of one group: 8 code bytes → 32 values per step. The bytes are spread
/// so each 16-bit lane holds the byte of its code (`vpshufb`), shifted to its code (`vpsrlvw`), and the
/// code indexes a 4-entry table of the group's values (`vpermw`). The scalar loops in
/// [`CanonicalRef::dequantize_bits_into`] are the reference; the tests compare both.
mod dequant_simd {
    /// Whether the AVX-512 path can run here (checked once per call, cached by std).
    #[inline]
    pub fn available() -> bool {
        crate::cpu_features::avx512bw_available()
    }

    /// Order this thread's streaming stores before anything that follows (no-op without SIMD).
    #[inline]
    pub fn fence() {
        #[cfg(target_arch = "x86_64")]
        if available() {
            // SAFETY: sfence is SSE, present on every x86-64 CPU.
            unsafe { std::arch::x86_64::_mm_sfence() }
        }
    }

    /// `out[i] = lut[code i]` for a group (`q.len()` a multiple of 8, `out.len() == 4·q.len()`).
    #[inline]
    pub fn group_u16(q: &[u8], out: &mut [u16], lut: [u16; 4]) {
        assert!(q.len().is_multiple_of(8) && out.len() == 4 * q.len());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers use this path only when `available()` saw avx512f and avx512bw.
        unsafe {
            x86::group_u16(q, out, lut)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no SIMD dequantization on this architecture")
    }

    #[inline]
    pub fn group_f32(q: &[u8], out: &mut [f32], lut: [f32; 4]) {
        assert!(q.len().is_multiple_of(8) && out.len() == 4 * q.len());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        unsafe {
            x86::group_f32(q, out, lut)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no SIMD dequantization on this architecture")
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        /// `vpshufb` control: 16-bit lane `i` (of 32) gets code byte `i / 4` in its low byte. The
        /// 8 code bytes are broadcast to every 64-bit lane, so 128-bit lane `L` reads bytes
        /// `2L + k/4` for its 8 lanes `k`.
        const SPREAD: [i8; 64] = {
            let mut c = [0i8; 64];
            let mut p = 0;
            while p < 64 {
                let (lane128, within) = (p / 16, p % 16);
                c[p] = if within % 2 == 0 {
                    (2 * lane128 + (within / 2) / 4) as i8
                } else {
                    -128 // zero the high byte
                };
                p += 1;
            }
            c
        };
        /// `vpsrlvw` counts: lane `i` shifts by `2·(i % 4)`.
        const SHIFTS: [u16; 32] = {
            let mut s = [0u16; 32];
            let mut i = 0;
            while i < 32 {
                s[i] = 2 * (i as u16 % 4);
                i += 1;
            }
            s
        };

        #[inline(always)]
        unsafe fn codes32(x: u64) -> __m512i {
            let spread = _mm512_loadu_si512(SPREAD.as_ptr().cast());
            let shifts = _mm512_loadu_si512(SHIFTS.as_ptr().cast());
            let b = _mm512_shuffle_epi8(_mm512_set1_epi64(x as i64), spread);
            _mm512_and_si512(_mm512_srlv_epi16(b, shifts), _mm512_set1_epi16(3))
        }

        #[target_feature(enable = "avx512f,avx512bw")]
        pub unsafe fn group_u16(q: &[u8], out: &mut [u16], lut: [u16; 4]) {
            let table = lut[0] as u64
                | (lut[1] as u64) << 16
                | (lut[2] as u64) << 32
                | (lut[3] as u64) << 48;
            let table = _mm512_set1_epi64(table as i64);
            for (o, qq) in out.chunks_exact_mut(32).zip(q.chunks_exact(8)) {
                let x = u64::from_le_bytes(qq.try_into().expect("8 bytes"));
                let v = _mm512_permutexvar_epi16(codes32(x), table);
                store(o.as_mut_ptr().cast(), v);
            }
        }

        /// One 64-byte store; streaming (no read-for-ownership of a line about to be overwritten whole,
        /// half the memory traffic of a fresh output) when the address allows it. `fence` orders them.
        #[inline(always)]
        unsafe fn store(p: *mut __m512i, v: __m512i) {
            if (p as usize).is_multiple_of(64) {
                _mm512_stream_si512(p, v);
            } else {
                _mm512_storeu_si512(p.cast(), v);
            }
        }

        #[target_feature(enable = "avx512f,avx512bw")]
        pub unsafe fn group_f32(q: &[u8], out: &mut [f32], lut: [f32; 4]) {
            let table = _mm512_setr_ps(
                lut[0], lut[1], lut[2], lut[3], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0,
            );
            for (o, qq) in out.chunks_exact_mut(32).zip(q.chunks_exact(8)) {
                let x = u64::from_le_bytes(qq.try_into().expect("8 bytes"));
                let c = codes32(x);
                let lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(c));
                let hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(c));
                store(
                    o.as_mut_ptr().cast(),
                    _mm512_castps_si512(_mm512_permutexvar_ps(lo, table)),
                );
                store(
                    o.as_mut_ptr().add(16).cast(),
                    _mm512_castps_si512(_mm512_permutexvar_ps(hi, table)),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code3_counter_finds_first_and_all() {
        let mut b = vec![0x55u8; 21];
        b[9] = 0b0011_0101; // field 2 of byte 9 → element 38
        b[20] = 0xFF; // 4 more
        assert_eq!(count_code3(&b), (5, Some(38)));
        assert_eq!(count_code3(&[0x55u8; 13]), (0, None));
    }

    #[test]
    fn code_layout_is_lsb_first_along_k() {
        // Running example of docs/formats.md#worked-examples: trits [+1, 0, -1, -1, 0, +1, +1, 0] → bytes 0x06 0x69.
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
    fn validate_on_the_pool_finds_every_bad_value() {
        // Above PARALLEL_VALIDATE_BYTES the clean check runs in chunks on the pool: a single bad code
        // or scale in any chunk (first, middle, the ragged last one) must still be found and located.
        let (rows, cols, g) = (4100, 1024, 128); // 1 049 600 code bytes
        let qw = vec![0x55u8; rows * cols / 4];
        let sc = vec![f16::ONE; rows * cols / g];
        let t = |q: &[u8], s: &[f16]| {
            CanonicalRef {
                rows,
                cols,
                group_size: g,
                qweight: q,
                scales: s,
            }
            .validate("w")
        };
        assert!(qw.len() >= PARALLEL_VALIDATE_BYTES);
        t(&qw, &sc).unwrap();
        for at in [0, 70_000, qw.len() - 1] {
            let mut q = qw.clone();
            q[at] = 0x57; // lane 0 = code 3
            match t(&q, &sc).unwrap_err() {
                Error::Validation {
                    first_index, count, ..
                } => assert_eq!((first_index, count), (at as u64 * 4, 1)),
                e => panic!("{e}"),
            }
        }
        for at in [0, 20_000, sc.len() - 1] {
            let mut s = sc.clone();
            s[at] = f16::NEG_INFINITY;
            match t(&qw, &s).unwrap_err() {
                Error::Validation {
                    first_index, count, ..
                } => assert_eq!((first_index, count), (at as u64, 1)),
                e => panic!("{e}"),
            }
        }
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
