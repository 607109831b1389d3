//! AMX-INT8 tiles for the int8 modes (Sapphire Rapids and later: AMX-TILE + AMX-INT8).
//!
//! The VNNI kernel unpacks each 64-byte weight load once per tile of at most [`super::INT8_TILE`]
//! tokens and issues one `vpdpbusd` (64 multiply-adds) per token: from M ≈ 8 it is compute-bound and
//! no faster than torch's bf16 GEMM (vLLM batch 16 ran at 0.64× bf16). One `tdpbssd` does 16 × 16 ×
//! 64 multiply-adds, so here the weight is decoded once per 32 rows × 512 columns into signed trits
//! `t = c − 1` (one GFNI instruction per 64 weights, below; the A operand, two tiles of 16 rows × 64
//! columns per sub-vector) and multiplied against the activations of 16 tokens at once (the B operand,
//! repacked once per call into AMX's 4-byte column groups). Measured on the 27B shapes, one thread:
//! M = 16 at 128–270 G weight-tokens/s from DRAM (VNNI 44–54), M = 128 at 185–360 (torch bf16 130–155).
//!
//! What bounds it (perf, and runs with parts switched off): per weight, one A tile load (1 KiB ≈ 4 ns
//! from L1), the decode, and the f32 epilogue of every (row, group), all fixed per weight rather than
//! per token. At M = 8 on 2048 → 12288 (one thread, in cache) the epilogue was 28 % of the time and the
//! decode 16 %. Calls of at most 8 tokens therefore use 8-token tiles, whose C rows sit two to a vector
//! in the epilogue: 1.34–1.44 → 1.05 ms there. At M = 512 on 5120 → 17408 (min of interleaved runs)
//! a 100 ms call spent ~20 ms in the epilogue and ~21 ms writing y (64-byte pieces of 512 token rows,
//! each line first read for ownership): the epilogue now runs once per pair of groups and large
//! outputs are streamed (`super::STREAM_Y_MIN_BYTES`), 80 ms (torch bf16: 106–108 ms).
//!
//! Where an M = 8 call's time goes now (one thread, 5120 → 17408, one process timing each part switched
//! off in turn, min of 400 interleaved rounds): 35.8 ps per weight in all, of which the decode 10.3,
//! the tile loads and products 10.0, the epilogue 7.2 and the rest (quantizing x, the scales, y) 6.7;
//! M = 1 streams the same weights at 15.1 (2.4×). The parts add up because the tile loads wait for
//! the decode's stores ahead of them: alone in a loop from L1, tile loads and products run at 7.4 ns
//! per 1024 weights (the rate of the tile products) and the decode at 6.5, but interleaved at 16–23,
//! and one after the other at 16 (products and stores without tile loads do overlap: 8). On this VM
//! the tile unit also has phases of half speed (shared with another tenant), which the vector
//! kernels do not see.
//!
//! The decode: the A tiles hold the signed trits `t = c − 1`, each byte
//! made by one GFNI `gf2p8affineqb` per 64 weights (bit pair i of every packed byte mapped straight to
//! the int8 −1, 0 or +1: the map is affine over GF(2), so shift, mask and subtract are one single-uop
//! instruction; a shift + AND for the codes alone measured 49 ns per 4096 weights, this 31), multiplied
//! by `tdpbssd` (signed A × signed B). The epilogue then has no code offset to take back out (it
//! subtracted `Σq` per group and token when A held the codes `t + 1`). The weight streams are
//! prefetched [`STREAM_AHEAD`] bytes ahead, and the next column chunk is decoded between the tile
//! products of the current one (two A buffers), so the memory stream and the tile products run
//! while the vector unit decodes; the tile loads still wait for its stores (above).
//!
//! Numerics: per weight group and (row, token) the tile sums `Σ t·q` exactly in int32; the epilogue
//! adds `f32(sum) · (f32(s) · xs)` (one FMA) group after group. That is the scalar reference's
//! combination with the trits summed in integers, where the reference takes the code offset back out
//! in f32, so it is at least as accurate (tested against float64 and the scalar kernel like every
//! variant).
//!
//! Tile state is per thread and shared with every other AMX user of the process (oneDNN, torch's
//! brgemm, which cache their configuration): each task saves the caller's configuration and restores it
//! (or releases the tiles when there was none) before returning.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::layout::{padded_cols, padded_groups, row_blocks, CHUNK_BYTES, ROWS, SUB_K, SUPER_K};
use super::PreparedRef;
use half::slice::HalfFloatSliceExt;

/// Weight rows per A tile (four row blocks of the layout).
pub const TILE_N: usize = 16;
/// Weight rows per worker group: two A tiles share every B tile (a tile load costs more than a
/// `tdpbssd` here, so each B load feeds two products).
pub const GROUP_ROWS: usize = 2 * TILE_N;
/// Tokens per B tile.
pub const TILE_T: usize = 16;
/// Tokens per B tile when a call has at most this many (decode batches of 5–8): C rows of 8 int32
/// sit two to a vector, so the f32 epilogue of every (row, group), a quarter of the time at M = 8,
/// takes half the vector operations.
pub const NARROW_T: usize = 8;
/// Columns per decode chunk: one superblock (32 rows × 256 codes = 8 KiB of A), or two when one group
/// spans a whole superblock, so that a chunk always holds at least two groups (the epilogue runs on
/// pairs). Two chunk buffers alternate (16–32 KiB, in L1): the next chunk is decoded while the tiles
/// multiply the current one.
fn chunk_cols(group_size: usize) -> usize {
    if group_size >= SUPER_K {
        2 * SUPER_K
    } else {
        SUPER_K
    }
}
/// The widest chunk ([`chunk_cols`]).
const MAX_CHUNK_K: usize = 2 * SUPER_K;
/// Bytes of one chunk buffer of A: `[MAX_CHUNK_K/64][32 rows][64]` codes.
const A_BUFFER_BYTES: usize = MAX_CHUNK_K / SUB_K * GROUP_ROWS * TILE_ROW_BYTES;
/// Software prefetch distance in each of the 8 block streams of a row group. Without it the decode
/// waited on DRAM while the tile unit idled, and the tiles waited on the decode.
const STREAM_AHEAD: usize = 2048;
/// Activation bytes one token block may span (`tokens · Kp`): a 32-row group streams its block's B
/// tiles from L2, so the block must fit there (2 MiB per core on Sapphire Rapids, a quarter left for
/// the rest). Larger M runs block after block, re-decoding the weight and redoing its epilogue
/// set-up, which matters at large K: 17408 → 5120 at M = 512, one thread, min of interleaved runs
/// against torch bf16, went from 0.86–0.92× with 1 MiB blocks (3 token tiles) to 1.00–1.21× with
/// 1.5 MiB (5 tiles); 2 MiB was no better, and 5120 → 17408 did not move.
/// Unit tests use 32 KiB so their small shapes run several blocks.
const TOKEN_BLOCK_BYTES: usize = if cfg!(test) { 1 << 15 } else { 3 << 19 };
/// Bytes of one tile row (AMX's maximum).
const TILE_ROW_BYTES: usize = 64;
/// Bytes of one full tile.
const TILE_BYTES: usize = 16 * TILE_ROW_BYTES;

/// Whether this CPU has AMX-TILE and AMX-INT8 and the OS lets this process use the tile data
/// (Linux: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, granted once per process).
pub(crate) fn is_supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // cpuid leaf 7 (edx bit 24 AMX-TILE, 25 AMX-INT8) exists on every CPU with AVX-512.
        // Every CPU with AMX (Sapphire Rapids and later) has GFNI too; the decode relies on it.
        let cpu = super::avx512::is_supported()
            && super::avx512::has_bf16_dot()
            && super::avx512::has_gfni()
            && {
                let l7 = __cpuid_count(7, 0);
                (l7.edx >> 24) & 1 == 1 && (l7.edx >> 25) & 1 == 1
            };
        cpu && request_tile_permission()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain syscall with integer arguments; it only changes this process's XSAVE permissions.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// One cache line. Tile rows, their vector stores and the epilogue's loads are whole lines: unaligned,
/// each would split across two (measured: the decode ran 3× slower from a plain `Vec<i8>`).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

const ZERO_LINE: Line = Line([0; 64]);

/// A growable buffer of whole cache lines, viewed as `T`s.
#[derive(Default)]
struct Lines(Vec<Line>);

impl Lines {
    /// Make it `bytes` long (rounded up to lines), all zero.
    fn zeroed(&mut self, bytes: usize) {
        self.0.clear();
        self.0.resize(bytes.div_ceil(64), ZERO_LINE);
    }

    fn slice<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(bytemuck::cast_slice::<Line, u8>(&self.0))
    }

    fn slice_mut<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(bytemuck::cast_slice_mut::<Line, u8>(&mut self.0))
    }
}

// SAFETY: plain bytes, no padding (64 bytes, align 64).
unsafe impl bytemuck::Zeroable for Line {}
unsafe impl bytemuck::Pod for Line {}

/// The 64-byte `ldtilecfg` operand.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// tmm0–3: C (16 rows × `width` int32; two groups in flight × two row halves), tmm4–5: A (16
    /// rows × `ks` trits, one per row half), tmm6–7: B (`ks / 4` rows × `width` tokens × 4 codes;
    /// alternate steps).
    fn for_step(ks: usize, width: usize) -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..4 {
            c.colsb[t] = (4 * width) as u16;
            c.rows[t] = TILE_N as u8;
        }
        for t in 4..6 {
            c.colsb[t] = ks as u16;
            c.rows[t] = TILE_N as u8;
        }
        for t in 6..8 {
            c.colsb[t] = (4 * width) as u16;
            c.rows[t] = (ks / 4) as u8;
        }
        c
    }
}

/// Saves the thread's tile configuration on creation and puts it back on drop (also on unwind).
struct TileGuard {
    saved: TileConfig,
}

impl TileGuard {
    /// SAFETY: AMX must be supported ([`is_supported`]).
    unsafe fn configure(cfg: &TileConfig) -> TileGuard {
        let mut saved = TileConfig::for_step(64, TILE_T);
        unsafe {
            asm!("sttilecfg [{0}]", in(reg) &mut saved as *mut TileConfig, options(nostack));
            asm!("ldtilecfg [{0}]", in(reg) cfg as *const TileConfig, options(nostack));
        }
        TileGuard { saved }
    }
}

impl Drop for TileGuard {
    fn drop(&mut self) {
        // SAFETY: only created by `configure`, so AMX is available.
        unsafe {
            if self.saved.palette == 0 {
                asm!("tilerelease", options(nostack, nomem));
            } else {
                asm!("ldtilecfg [{0}]", in(reg) &self.saved as *const TileConfig, options(nostack));
            }
        }
    }
}

/// Activations of one call in the B-operand form: per token tile, `Kp/4` rows of `width` tokens × 4
/// consecutive int8 codes (missing tokens zero), and the activation scales `[Gp][width]` per tile.
/// Kept per thread between calls (like the other scratch buffers: no page faults per call).
#[derive(Default)]
pub(crate) struct TokenTiles {
    pub tiles: usize,
    /// Tokens per tile: [`TILE_T`], or [`NARROW_T`] for calls of at most that many.
    pub width: usize,
    kp: usize,
    gp: usize,
    b: Lines,
    xs: Vec<f32>,
}

impl TokenTiles {
    /// Token tiles per block for this `Kp` (at least one; see [`TOKEN_BLOCK_BYTES`]).
    pub fn tiles_per_block(&self) -> usize {
        (TOKEN_BLOCK_BYTES / (self.kp.max(1) * self.width.max(1))).max(1)
    }

    /// Refill from the quantized rows `q` (`m · Kp`) and their scales `xs4` (`m · Gp · 4`, as the
    /// quantizer writes them).
    pub fn fill(&mut self, q: &[i8], xs4: &[f32], m: usize, kp: usize, gp: usize) {
        assert!(q.len() >= m * kp && xs4.len() >= m * gp * ROWS);
        let w = if m <= NARROW_T { NARROW_T } else { TILE_T };
        let tiles = m.div_ceil(w);
        (self.tiles, self.width, self.kp, self.gp) = (tiles, w, kp, gp);
        self.b.zeroed(tiles * kp * w);
        self.xs.clear();
        self.xs.resize(tiles * gp * w, 0.0);
        // B rows are `w` tokens × 4 codes: a transpose of the tokens' rows as 32-bit words (one word
        // store each; byte copies of 4 were a tenth of an M = 8 call on small shapes).
        let b = self.b.slice_mut::<u32>();
        for mi in 0..m {
            let (j, t) = (mi / w, mi % w);
            let bt = &mut b[j * kp / 4 * w..(j + 1) * kp / 4 * w];
            for (dst, quad) in bt[t..]
                .iter_mut()
                .step_by(w)
                .zip(q[mi * kp..(mi + 1) * kp].chunks_exact(4))
            {
                *dst = u32::from_le_bytes([
                    quad[0] as u8,
                    quad[1] as u8,
                    quad[2] as u8,
                    quad[3] as u8,
                ]);
            }
            for gi in 0..gp {
                self.xs[(j * gp + gi) * w + t] = xs4[(mi * gp + gi) * ROWS];
            }
        }
    }
}

/// One task's tile state and scratch: the caller's tile configuration is restored when it drops, so
/// create and drop it on the thread that runs the task.
pub(crate) struct Worker {
    /// A tiles of two column chunks (alternating): `[2][MAX_CHUNK_K/64][32 rows][64]` codes.
    a: Lines,
    /// Int32 sums of the two groups in flight, `[parity][32 rows][width tokens]`.
    c: Lines,
    /// f32 results of the current group, `[tile][32 rows][width tokens]`.
    acc: Lines,
    /// f32 scales of the current 32 rows, `[8 blocks][Gp][4]`.
    scales: Vec<f32>,
    group_size: usize,
    /// Tokens per tile ([`TokenTiles::width`]).
    width: usize,
    /// `(row group, buffer)` whose first chunk the previous [`Worker::group`] call already decoded
    /// (during its own last chunk), so consecutive row groups stream without a gap.
    predecoded: Option<(usize, usize)>,
    _tiles: TileGuard,
}

/// One k-step of a group: B of the token tile (rows `$sb` bytes apart) into `$b`, then both row
/// halves' A tiles (codes, unsigned) against it into `$c0`, `$c1` (tile register names must be literal, hence one
/// instance per register choice).
macro_rules! step {
    ($c0:literal, $c1:literal, $b:literal, $a0:expr, $a1:expr, $bp:expr, $sb:expr) => {
        asm!(
            concat!("tileloadd ", $b, ", [{b} + {sb}*1]"),
            "tileloadd tmm4, [{a0} + {s}*1]",
            concat!("tdpbssd ", $c0, ", tmm4, ", $b),
            "tileloadd tmm5, [{a1} + {s}*1]",
            concat!("tdpbssd ", $c1, ", tmm5, ", $b),
            a0 = in(reg) $a0,
            a1 = in(reg) $a1,
            b = in(reg) $bp,
            s = in(reg) TILE_ROW_BYTES,
            sb = in(reg) $sb,
            options(nostack, readonly),
        )
    };
}

/// The two C tiles (row halves) of one group in flight: zero them, or store them to `$cp` (32 rows ×
/// `$width` int32, half 0 then half 1). Register names must be literal, as in [`step!`].
macro_rules! c_pair {
    (zero, $c0:literal, $c1:literal) => {
        asm!(concat!("tilezero ", $c0), concat!("tilezero ", $c1), options(nostack, nomem))
    };
    (store, $c0:literal, $c1:literal, $cp:expr, $width:expr) => {
        asm!(
            concat!("tilestored [{c} + {s}*1], ", $c0),
            concat!("tilestored [{c1} + {s}*1], ", $c1),
            c = in(reg) $cp,
            c1 = in(reg) $cp.add(TILE_N * $width),
            s = in(reg) 4 * $width,
            options(nostack),
        )
    };
}

impl Worker {
    /// For token tiles of `width` ([`TILE_T`] or [`NARROW_T`]). SAFETY: AMX must be supported
    /// ([`is_supported`]).
    pub unsafe fn new(group_size: usize, width: usize) -> Worker {
        assert!(width == TILE_T || width == NARROW_T);
        // SAFETY: as the caller promises.
        let tiles =
            unsafe { TileGuard::configure(&TileConfig::for_step(group_size.min(SUB_K), width)) };
        let (mut a, mut c) = (Lines::default(), Lines::default());
        a.zeroed(2 * A_BUFFER_BYTES);
        c.zeroed(2 * GROUP_ROWS * TILE_T * 4);
        Worker {
            a,
            c,
            acc: Lines::default(),
            scales: Vec::new(),
            group_size,
            width,
            predecoded: None,
            _tiles: tiles,
        }
    }

    /// Returns `out[j − tiles.start][n][t]` for the 32-row group `grp` of `w` (rows `32·grp ..`) and
    /// the token tiles `j ∈ tiles`: `Σ_g f32(s[n][g]) · xs[t][g] · Σ_{k∈g} t(n, k) · q[t][k]`
    /// (`tiles.len() · 32 · width` floats). `w` must be checked ([`PreparedRef::check`]) and have this
    /// worker's group size; `tt` must have been built for its `Kp` and `Gp`. `next`: the row group
    /// this worker does next, if any (its first chunk is decoded during this group's last one).
    pub fn group(
        &mut self,
        w: &PreparedRef<'_>,
        grp: usize,
        tt: &TokenTiles,
        tiles: std::ops::Range<usize>,
        next: Option<usize>,
    ) -> &[f32] {
        let (kp, gp) = (padded_cols(w.cols), padded_groups(w.cols, w.group_size));
        assert!(w.group_size == self.group_size && tt.kp == kp && tt.gp == gp);
        assert!(tt.width == self.width);
        assert!(tiles.start <= tiles.end && tiles.end <= tt.tiles);
        assert!(grp * GROUP_ROWS < w.rows.max(1));
        assert!(next.is_none_or(|n| n * GROUP_ROWS < w.rows && n != grp));
        let len = tiles.len() * GROUP_ROWS * self.width;
        let mut acc = std::mem::take(&mut self.acc);
        acc.zeroed(len * 4);
        // SAFETY: the worker exists only where AMX and AVX-512 are available; sizes asserted above.
        unsafe { self.group_inner(w, grp, next, tt, tiles, &mut acc.slice_mut::<f32>()[..len]) };
        self.acc = acc;
        &self.acc.slice::<f32>()[..len]
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
    unsafe fn group_inner(
        &mut self,
        w: &PreparedRef<'_>,
        grp: usize,
        next: Option<usize>,
        tt: &TokenTiles,
        tiles: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let (kp, g, gp, w_t) = (tt.kp, self.group_size, tt.gp, self.width);
        let blocks = row_blocks(w.rows);
        const BLOCKS: usize = GROUP_ROWS / ROWS;
        let b0 = grp * BLOCKS;
        // f32 scales, [block][Gp][4] as the layout keeps them (rows of missing blocks: 0).
        // Every element is written below: no zero-fill per row group (it was a tenth of the work
        // around the tiles at M = 8).
        let scales = &mut self.scales;
        scales.resize(BLOCKS * gp * ROWS, 0.0);
        let present = BLOCKS.min(blocks - b0);
        scales[present * gp * ROWS..].fill(0.0);
        for bi in 0..present {
            let (_, s) = w.block(b0 + bi);
            let d = &mut scales[bi * gp * ROWS..(bi + 1) * gp * ROWS];
            // 16 at a time here (half's slice conversion makes a call per 8, a few % of M = 8).
            let whole = d.len() / 16 * 16;
            for i in (0..whole).step_by(16) {
                // SAFETY: i + 16 ≤ len of both (s holds the block's gp·4 scales, as d).
                unsafe {
                    let h = _mm256_loadu_si256(s.as_ptr().add(i).cast());
                    _mm512_storeu_ps(d.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
                }
            }
            s[whole..d.len()].convert_to_f32_slice(&mut d[whole..]);
        }
        let ks = g.min(SUB_K);
        let ck = chunk_cols(g);
        // Group sizes, k-steps and chunk widths are powers of two: shifts instead of the divisions
        // that were a quarter of the work around the tiles at M = 8 (two per k-step).
        debug_assert!(g.is_power_of_two() && ks.is_power_of_two() && ck.is_power_of_two());
        let (g_shift, ks_shift) = (g.trailing_zeros(), ks.trailing_zeros());
        let a_base = self.a.slice_mut::<u8>().as_mut_ptr();
        // SAFETY: `a` holds two buffers of A_BUFFER_BYTES.
        let buf = |i: usize| unsafe { a_base.add((i % 2) * A_BUFFER_BYTES) };
        let c = self.c.slice_mut::<i32>();
        // Each chunk is decoded between the tile products of the one before it (spread over that
        // chunk's k-steps of the first token tile); the first one during the previous row group's last
        // chunk, or up front.
        let first = match self.predecoded.take() {
            Some((g, b)) if g == grp => b,
            _ => {
                // SAFETY: ck.min(Kp) columns fit a buffer (ck ≤ MAX_CHUNK_K).
                unsafe { decode_blocks(w, b0, 0..BLOCKS, 0, ck.min(kp), buf(0)) };
                0
            }
        };
        for (ci, kc0) in (0..kp).step_by(ck).enumerate() {
            let kc = ck.min(kp - kc0);
            // What to decode meanwhile: this group's next chunk, or the next group's first.
            let (next_b0, next0, next_kc) = match (kp - kc0 - kc, next) {
                (0, Some(n)) => (n * BLOCKS, 0, ck.min(kp)),
                (0, None) => (b0, 0, 0),
                (left, _) => (b0, kc0 + kc, ck.min(left)),
            };
            let a = buf(first + ci).cast_const();
            // kc is 256 or 512 (a whole chunk, or the last one), so steps is a power of two.
            debug_assert!(kc.is_power_of_two());
            let steps_shift = (kc >> ks_shift).trailing_zeros();
            for (o, j) in tiles.clone().enumerate() {
                let bt = tt.b.slice::<i8>()[j * kp * w_t..].as_ptr();
                let xs = &tt.xs[j * gp * w_t..(j + 1) * gp * w_t];
                let acc = &mut out[o * GROUP_ROWS * w_t..(o + 1) * GROUP_ROWS * w_t];
                // kc is a multiple of 256, and g divides 256 (or kc, for g = 256).
                let groups = kc >> g_shift;
                for q in 0..groups {
                    let gk = kc0 + q * g;
                    let parity = q % 2;
                    // SAFETY: A rows are 64 bytes apart in the chunk buffer (k − kc0 < kc), B rows
                    // `4·w_t` bytes apart from row k/4 of the token tile (k + ks ≤ Kp); C goes to
                    // `c[parity]` (32 rows × w_t int32 ≤ 2 KiB); the next chunk's decode writes the
                    // other buffer (next0 + next_kc ≤ Kp).
                    unsafe {
                        match parity {
                            0 => c_pair!(zero, "tmm0", "tmm1"),
                            _ => c_pair!(zero, "tmm2", "tmm3"),
                        }
                        for (si, k) in (gk..gk + g).step_by(ks).enumerate() {
                            let kl = k - kc0;
                            let a0 = a.add(kl / SUB_K * 2 * TILE_BYTES + kl % SUB_K);
                            let a1 = a0.add(TILE_BYTES);
                            let (bp, sb) = (bt.add(k / 4 * 4 * w_t), 4 * w_t);
                            match (parity, si % 2) {
                                (0, 0) => step!("tmm0", "tmm1", "tmm6", a0, a1, bp, sb),
                                (0, _) => step!("tmm0", "tmm1", "tmm7", a0, a1, bp, sb),
                                (_, 0) => step!("tmm2", "tmm3", "tmm6", a0, a1, bp, sb),
                                _ => step!("tmm2", "tmm3", "tmm7", a0, a1, bp, sb),
                            }
                            if o == 0 && next_kc > 0 {
                                // This step's share of the next chunk's 8 row blocks.
                                let s = kl >> ks_shift;
                                let blocks =
                                    (s * BLOCKS) >> steps_shift..((s + 1) * BLOCKS) >> steps_shift;
                                decode_blocks(
                                    w,
                                    next_b0,
                                    blocks,
                                    next0,
                                    next_kc,
                                    buf(first + ci + 1),
                                );
                            }
                        }
                        let cp = c.as_mut_ptr().add(parity * GROUP_ROWS * w_t);
                        match parity {
                            0 => c_pair!(store, "tmm0", "tmm1", cp, w_t),
                            _ => c_pair!(store, "tmm2", "tmm3", cp, w_t),
                        }
                        // The f32 epilogue runs once per pair of groups (one load and store of the
                        // running sums for both; one thread, min of interleaved runs: 5120 → 17408
                        // at M = 512 91–96 → 80 ms, 2048 → 6144 at M = 8 0.55 → 0.51 ms) and
                        // overlaps the next group's tile products (other C tiles).
                        let gi = gk >> g_shift;
                        let ep = Epilogue {
                            c: c.as_ptr(),
                            scales: scales.as_ptr(),
                            xs,
                            gp,
                            width: w_t,
                        };
                        if parity == 1 {
                            ep.run::<2>(gi - 1, acc);
                        } else if q + 1 == groups {
                            ep.run::<1>(gi, acc);
                        }
                    }
                }
            }
        }
        if let (Some(n), false) = (next, tiles.is_empty()) {
            self.predecoded = Some((n, first + kp.div_ceil(ck)));
        }
    }
}

/// The f32 epilogue of `G` consecutive groups whose int32 sums sit in the C buffer's parities
/// `0 .. G`: `acc[n][t] += f32(sum_g[n][t]) · (s[n][g] · xs[t][g])`, group after group
/// (one FMA each, in registers between the groups: bit for bit the group-by-group order).
struct Epilogue<'a> {
    /// C buffer: `[parity][32 rows][width]` int32.
    c: *const i32,
    /// f32 scales of the 32 rows, `[8 blocks][Gp][4]`.
    scales: *const f32,
    /// Activation scales of the token tile, `[Gp][width]`.
    xs: &'a [f32],
    gp: usize,
    width: usize,
}

impl Epilogue<'_> {
    /// SAFETY: the C buffer holds `G` parities of this width; `g0 + G ≤ Gp`; `acc` is 32 × width.
    #[inline(always)]
    unsafe fn run<const G: usize>(&self, g0: usize, acc: &mut [f32]) {
        let (w_t, gp) = (self.width, self.gp);
        debug_assert!(acc.len() >= GROUP_ROWS * w_t && g0 + G <= gp);
        debug_assert!(self.xs.len() >= gp * w_t);
        let scale = |gi: usize, n: usize| unsafe {
            self.scales.add((n / ROWS * gp + gi) * ROWS + n % ROWS)
        };
        let sums = |p: usize, n: usize| unsafe { self.c.add(p * GROUP_ROWS * w_t + n * w_t) };
        unsafe {
            if w_t == TILE_T {
                let xv: [__m512; G] = std::array::from_fn(|p| {
                    _mm512_loadu_ps(self.xs.as_ptr().add((g0 + p) * TILE_T))
                });
                for n in 0..GROUP_ROWS {
                    let ap = acc.as_mut_ptr().add(n * TILE_T);
                    let mut v = _mm512_loadu_ps(ap);
                    for (p, &xp) in xv.iter().enumerate() {
                        let raw = _mm512_loadu_si512(sums(p, n).cast());
                        let sum = _mm512_cvtepi32_ps(raw);
                        let cs = _mm512_mul_ps(_mm512_set1_ps(*scale(g0 + p, n)), xp);
                        v = _mm512_fmadd_ps(sum, cs, v);
                    }
                    _mm512_storeu_ps(ap, v);
                }
            } else {
                // Rows n, n + 1 per vector (C and acc rows are 8 wide and contiguous; their scales
                // are adjacent too: n is even and a row block holds 4).
                let xv: [__m512; G] = std::array::from_fn(|p| {
                    _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(
                        self.xs.as_ptr().add((g0 + p) * NARROW_T),
                    ))))
                });
                let pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
                for n in (0..GROUP_ROWS).step_by(2) {
                    let ap = acc.as_mut_ptr().add(n * NARROW_T);
                    let mut v = _mm512_loadu_ps(ap);
                    for (p, &xp) in xv.iter().enumerate() {
                        let raw = _mm512_loadu_si512(sums(p, n).cast());
                        let sum = _mm512_cvtepi32_ps(raw);
                        let s2 = scale(g0 + p, n);
                        let s = _mm512_permutexvar_ps(
                            pair,
                            _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(s2.cast()))),
                        );
                        v = _mm512_fmadd_ps(sum, _mm512_mul_ps(s, xp), v);
                    }
                    _mm512_storeu_ps(ap, v);
                }
            }
        }
    }
}

/// The `gf2p8affineqb` matrix that maps bit pair `i` of a byte (the code `c` of field `i`) to the
/// int8 trit `c − 1`: `0 → 0xFF`, `1 → 0x00`, `2 → 0x01` (with the constant `0xFF`).
/// Over GF(2) that is affine: result bit 0 = `x₂ᵢ ⊕ 1`, bits 1–7 = `x₂ᵢ ⊕ x₂ᵢ₊₁ ⊕ 1`. (Code 3, which
/// validated weights never hold, would come out as −2.) Matrix byte `7 − j` selects the input bits
/// of result bit `j`.
#[inline]
#[target_feature(enable = "avx512f")]
fn trit_field(i: u32) -> __m512i {
    let low = 1u64 << (2 * i);
    let both = 3u64 << (2 * i);
    _mm512_set1_epi64(((low << 56) | (both * 0x0001_0101_0101_0101)) as i64)
}

/// Trits `t` of row blocks `b0 + bi` (`bi ∈ blocks`; A-buffer rows `4·bi ..` of the 32),
/// columns `kc0 .. kc0 + kc`, into the chunk buffer at `dst` (`[kc/64][32 rows][64]`: the sub-vector's
/// two A tiles, row halves 0 and 1). A missing block (past the last row) is all zero. Each block's
/// stream is prefetched [`STREAM_AHEAD`] bytes ahead (past its end: the next row group's block at the
/// same place, 8 blocks on).
///
/// Field `i` of every byte comes out as trits in one `gf2p8affineqb` ([`trit_field`]) instead of a
/// shift, an AND and a subtract: the decode is one instruction and one store per 64 weights, which
/// leaves the vector ports to the epilogue (shift + AND alone: 49 ns per 4096 weights in L1, this:
/// 31, stores alone: 27).
///
/// SAFETY: AVX-512BW and GFNI are available; `kc0 + kc ≤ Kp`, both multiples of 256; `dst` holds
/// `kc/64` subs.
#[target_feature(enable = "avx512f,avx512bw,gfni")]
unsafe fn decode_blocks(
    w: &PreparedRef<'_>,
    b0: usize,
    blocks: std::ops::Range<usize>,
    kc0: usize,
    kc: usize,
    dst: *mut u8,
) {
    const GROUP_BLOCKS: usize = GROUP_ROWS / ROWS;
    let subs = kc / SUB_K;
    let kp = padded_cols(w.cols);
    let present = row_blocks(w.rows);
    // Rows 4·bi + r of sub-vector u: `dst + (u·32 + 4·bi + r)·64`.
    let sub_stride = GROUP_ROWS * TILE_ROW_BYTES;
    let (f0, f1, f2, f3) = (trit_field(0), trit_field(1), trit_field(2), trit_field(3));
    for bi in blocks {
        let b = b0 + bi;
        let rows_at = dst.wrapping_add(bi * ROWS * TILE_ROW_BYTES);
        if b >= present {
            for u in 0..subs {
                for r in 0..ROWS {
                    // SAFETY: row 4·bi + r of sub u is inside the buffer.
                    unsafe {
                        _mm512_storeu_si512(
                            rows_at.add(u * sub_stride + r * TILE_ROW_BYTES).cast(),
                            _mm512_setzero_si512(),
                        )
                    };
                }
            }
            continue;
        }
        let bp = w.block(b).0.as_ptr();
        for sb in kc0 / SUPER_K..(kc0 + kc) / SUPER_K {
            let o = sb * ROWS * CHUNK_BYTES;
            let far = if o + STREAM_AHEAD < kp {
                STREAM_AHEAD
            } else {
                STREAM_AHEAD + (GROUP_BLOCKS - 1) * kp
            };
            // The four sub-vectors of this superblock: subs u0 .. u0 + 4 of the chunk.
            let out = rows_at.wrapping_add((sb * SUPER_K - kc0) / SUB_K * sub_stride);
            for r in 0..ROWS {
                // SAFETY: sb < Kp/256, so the chunk is inside the block; prefetches never fault; the
                // stores stay inside the buffer (u0 + 3 < subs).
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(o + far + r * CHUNK_BYTES).cast());
                    let v = _mm512_loadu_si512(bp.add(o + r * CHUNK_BYTES).cast());
                    let o = out.add(r * TILE_ROW_BYTES);
                    _mm512_storeu_si512(o.cast(), _mm512_gf2p8affine_epi64_epi8::<0xFF>(v, f0));
                    _mm512_storeu_si512(
                        o.add(sub_stride).cast(),
                        _mm512_gf2p8affine_epi64_epi8::<0xFF>(v, f1),
                    );
                    _mm512_storeu_si512(
                        o.add(2 * sub_stride).cast(),
                        _mm512_gf2p8affine_epi64_epi8::<0xFF>(v, f2),
                    );
                    _mm512_storeu_si512(
                        o.add(3 * sub_stride).cast(),
                        _mm512_gf2p8affine_epi64_epi8::<0xFF>(v, f3),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current_config() -> [u8; 64] {
        let mut c = TileConfig::for_step(64, TILE_T);
        // SAFETY: only called where AMX is supported.
        unsafe { asm!("sttilecfg [{0}]", in(reg) &mut c as *mut TileConfig, options(nostack)) };
        // SAFETY: TileConfig is 64 plain bytes.
        unsafe { std::mem::transmute::<TileConfig, [u8; 64]>(c) }
    }

    /// Another AMX user's configuration (oneDNN, torch's brgemm cache theirs) survives a task, and a
    /// thread that had none is left with its tiles released.
    #[test]
    fn tasks_restore_the_callers_tile_configuration() {
        if !is_supported() {
            eprintln!("no AMX here: nothing to test");
            return;
        }
        std::thread::spawn(|| {
            assert_eq!(
                current_config(),
                [0; 64],
                "a fresh thread has no tile configuration"
            );
            drop(unsafe { Worker::new(128, TILE_T) });
            assert_eq!(current_config(), [0; 64], "released after the task");
            let mut theirs = TileConfig::for_step(16, TILE_T);
            theirs.rows[5] = 3;
            theirs.colsb[5] = 12;
            // SAFETY: AMX is supported (checked above).
            unsafe {
                asm!("ldtilecfg [{0}]", in(reg) &theirs as *const TileConfig, options(nostack))
            };
            let before = current_config();
            drop(unsafe { Worker::new(32, NARROW_T) });
            assert_eq!(current_config(), before, "restored after the task");
            unsafe { asm!("tilerelease", options(nostack, nomem)) };
        })
        .join()
        .unwrap();
    }
}
