//! Decode attention over vLLM's paged CPU KV cache: one query token per sequence (docs/design.md#decode-attention).
//!
//! In a decode step every sequence's new token attends to all its cached keys, so the step reads the whole
//! KV cache once; at serving context lengths that is more bytes than the model's ternary weights (64
//! sequences × 2 048 tokens of a Qwen3-1.7B-shaped layer: 537 MB per layer against ~14 MB of weights). This
//! kernel is built to read the cache at the memory's speed: each (sequence, KV head) pair streams its keys
//! and values once for all the query heads that share them (GQA), and the work is spread over threads by
//! (sequence, KV head, key span), long sequences split into spans whose partial softmaxes are merged at the
//! end (flash-decoding), so one long sequence still uses every core.
//!
//! * Cache layout (what vLLM's `CPU_ATTN` writes for its `vec` and `vec16` kernels): `[blocks, kv_heads,
//!   2 · block_size · head_dim]` — in block `b`, KV head `h`, the keys column-major (`[head_dim,
//!   block_size]`: dimension `i` of the block's token `t` at `i · block_size + t`), then the values
//!   row-major (`[block_size, head_dim]`). Sequence `i`'s token `t` is in block
//!   `block_table[i][t / block_size]`, slot `t % block_size`. (Its `amx` kernels pack the block for AMX
//!   tiles instead; the vLLM backend keeps vLLM's kernel there.)
//! * Keys seen: the last `min(seq_len, sliding_window)` tokens of the sequence (all of them without a
//!   window), the query's own token included (its key is written before the call).
//! * Numerics: every element is widened exactly to f32; `s = (scale·q)·k` with f32 products and sums,
//!   optionally soft-capped (`cap·tanh(s/cap)`); an online softmax in f32 (`exp` by a degree-6 polynomial,
//!   relative error < 2.5·10⁻⁷, arguments below −86 count as e⁻⁸⁶); `out = Σ p·v / Σ p` in f32, rounded once to
//!   the output's type. So against float64 the error is a few f32 roundings per sum, far below one bf16 ulp
//!   of the output ([`decode_attention_reference`] is the float64 reference every path is tested against).
//! * Kernels: the same code compiled three ways and picked at run time ([`Kernel::best`]): AVX-512 (16-lane
//!   FMA), AVX2 + FMA + F16C (8-lane), and a portable build without FMA.
//!
//! Validation is in one place (`plan`): shapes, strides and lengths of every slice, and every block id a
//! sequence needs is checked against the cache before any thread starts, so a bad block table is an
//! error naming the sequence, never an out-of-bounds read.

// The tile kernels index fixed-size register arrays by head, chunk and lane.
#![allow(clippy::needless_range_loop)]

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::element::Element;
use crate::fast_math::exp_nonpositive as exp;
use crate::threads::{DisjointWrites, ParallelFor};
use crate::{Error, Result};

/// Largest head size accepted (vLLM's CPU attention supports up to 512).
pub const MAX_HEAD_DIM: usize = 512;
/// Head sizes must be a multiple of this (the kernels' vector width; every head size vLLM's CPU
/// attention supports is one).
pub const HEAD_DIM_MULTIPLE: usize = 16;
/// Largest number of query heads per KV head accepted (keeps the per-thread scratch bounded).
pub const MAX_QUERIES_PER_KV: usize = 256;
/// Keys scored together before their values are accumulated. A block of 128 (vLLM's CPU default) is one
/// tile, so its keys are read front to back — which the hardware prefetchers follow: tiles of 64 keys read
/// every key row's first half, then its second, and one thread streamed the cache at a third of the rate.
const TILE: usize = 128;
/// Query heads whose scores are accumulated in registers together (3 heads × 128 keys: 24 AVX-512
/// registers).
const HEADS_PER_PASS: usize = 3;
/// Head dimensions whose output sums are accumulated in registers together, per query head, where the
/// head size is a multiple of it (3 heads × 64 dimensions: 12 AVX-512 registers); else
/// [`HEAD_DIM_MULTIPLE`].
const WIDE_DIMS: usize = 64;
/// A sequence is split into key spans only when there are fewer (sequence, KV head) pairs than this many
/// per thread, and never into spans shorter than [`SPLIT_MIN_KEYS`].
const ITEMS_PER_THREAD: usize = 4;
/// Shortest key span of a split sequence (shorter spans cost more in merging than they gain in balance).
const SPLIT_MIN_KEYS: usize = 256;
/// Below this many cache bytes read, the call runs on the calling thread (a fork costs more).
const PARALLEL_MIN_BYTES: usize = 1 << 17;

/// Where a paged KV cache's slabs lie: block `b`, KV head `h` starts at `b · block_stride + h ·
/// head_stride` and holds `2 · block_size · head_dim` values (keys, then values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    pub blocks: usize,
    pub block_stride: usize,
    pub kv_heads: usize,
    pub head_stride: usize,
    pub block_size: usize,
    pub head_dim: usize,
}

impl CacheShape {
    /// A contiguous `[blocks, kv_heads, 2 · block_size · head_dim]` cache (None where that overflows).
    pub fn contiguous(
        blocks: usize,
        kv_heads: usize,
        block_size: usize,
        head_dim: usize,
    ) -> Option<Self> {
        let slab = 2usize.checked_mul(block_size)?.checked_mul(head_dim)?;
        Some(Self {
            blocks,
            block_stride: slab.checked_mul(kv_heads)?,
            kv_heads,
            head_stride: slab,
            block_size,
            head_dim,
        })
    }

    /// Values one slab holds (None where that overflows).
    fn slab_len(&self) -> Option<usize> {
        2usize
            .checked_mul(self.block_size)?
            .checked_mul(self.head_dim)
    }

    /// Values a buffer needs to hold every slab: the end of the last one (None where that overflows).
    pub fn values(&self) -> Option<usize> {
        if self.blocks == 0 || self.kv_heads == 0 {
            return Some(0);
        }
        (self.blocks - 1)
            .checked_mul(self.block_stride)?
            .checked_add((self.kv_heads - 1).checked_mul(self.head_stride)?)?
            .checked_add(self.slab_len()?)
    }
}

/// vLLM's paged KV cache of one attention layer: per block and KV head, `[head_dim, block_size]` keys then
/// `[block_size, head_dim]` values (see the module doc), at any block and head strides (vLLM pads the pages
/// of hybrid models' attention layers to their recurrent state's size).
#[derive(Clone, Copy, Debug)]
pub struct PagedKvCache<'a, T> {
    data: &'a [T],
    shape: CacheShape,
}

impl<'a, T> PagedKvCache<'a, T> {
    /// A contiguous cache: `data` holds exactly `blocks · kv_heads · 2 · block_size · head_dim` values.
    pub fn new(
        data: &'a [T],
        blocks: usize,
        kv_heads: usize,
        block_size: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let shape = CacheShape::contiguous(blocks, kv_heads, block_size, head_dim);
        let need = shape.and_then(|s| s.block_stride.checked_mul(blocks));
        match shape {
            Some(shape) if need == Some(data.len()) => Self::strided(data, shape),
            _ => Err(Error::invalid(format!(
                "KV cache has {} values; [blocks={blocks}, kv_heads={kv_heads}, block_size={block_size}, \
                 2 · head_dim={head_dim}] needs {}",
                data.len(),
                need.map_or("more than usize".into(), |w| w.to_string())
            ))),
        }
    }

    /// A cache of any [`CacheShape`] in `data`; its slabs must lie inside `data` without overlapping.
    pub fn strided(data: &'a [T], shape: CacheShape) -> Result<Self> {
        let CacheShape {
            blocks,
            block_stride,
            kv_heads,
            head_stride,
            block_size,
            head_dim,
        } = shape;
        if kv_heads == 0 || block_size == 0 {
            return Err(Error::invalid(format!(
                "KV cache with kv_heads={kv_heads}, block_size={block_size}: both must be positive"
            )));
        }
        let overlap = shape.slab_len().is_none_or(|slab| {
            (kv_heads > 1 && head_stride < slab)
                || (blocks > 1 && block_stride < (kv_heads - 1) * head_stride + slab)
        });
        if shape.values().is_none_or(|e| e > data.len()) || overlap {
            return Err(Error::invalid(format!(
                "KV cache of {} values cannot hold {blocks} blocks × {kv_heads} KV heads of 2 × {block_size} × \
                 {head_dim} at strides {block_stride} (block) and {head_stride} (head)",
                data.len()
            )));
        }
        Ok(Self { data, shape })
    }

    /// Offset of (`block`, `kv_head`)'s keys; its values start `block_size · head_dim` further on.
    #[inline(always)]
    fn slab(&self, block: usize, kv_head: usize) -> usize {
        block * self.shape.block_stride + kv_head * self.shape.head_stride
    }
}

/// Per-token, per-head rows of `head_dim` values at arbitrary token / head strides (a query or an output
/// tensor as torch lays it out; the values of one head are contiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadStrides {
    pub tokens: usize,
    pub heads: usize,
    pub token_stride: usize,
    pub head_stride: usize,
}

impl HeadStrides {
    /// Contiguous `[tokens, heads, head_dim]`.
    pub fn contiguous(tokens: usize, heads: usize, head_dim: usize) -> Self {
        Self {
            tokens,
            heads,
            token_stride: heads * head_dim,
            head_stride: head_dim,
        }
    }

    #[inline(always)]
    fn at(&self, token: usize, head: usize) -> usize {
        token * self.token_stride + head * self.head_stride
    }

    /// Values a buffer needs to hold every row of `head_dim` values: the end of the last one (None where
    /// that overflows).
    pub fn values(&self, head_dim: usize) -> Option<usize> {
        if self.tokens == 0 || self.heads == 0 {
            return Some(0);
        }
        (self.tokens - 1)
            .checked_mul(self.token_stride)?
            .checked_add((self.heads - 1).checked_mul(self.head_stride)?)?
            .checked_add(head_dim)
    }

    /// Whether two rows of different (token, head) pairs can share an element (written rows must not).
    fn rows_overlap(&self, head_dim: usize) -> bool {
        let mut strides = [
            (self.token_stride, self.tokens),
            (self.head_stride, self.heads),
        ];
        strides.sort_unstable();
        // sorted by stride, each dimension must step past everything the smaller ones cover
        let mut covered = head_dim;
        for (stride, count) in strides {
            if count > 1 {
                if stride < covered {
                    return true;
                }
                covered += stride * (count - 1);
            }
        }
        false
    }
}

/// The sequences of one decode step: sequence `i` has `seq_lens[i]` tokens (its new one included) whose
/// blocks are `block_table[i · block_table_stride ..][.. ceil(seq_lens[i] / block_size)]`, at most
/// `blocks_per_seq` of them (the table's width).
#[derive(Clone, Copy, Debug)]
pub struct DecodeBatch<'a> {
    pub seq_lens: &'a [i32],
    pub block_table: &'a [i32],
    pub blocks_per_seq: usize,
    pub block_table_stride: usize,
}

/// The layer's attention settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// Multiplies `q·k` (usually `head_dim^-½`).
    pub scale: f32,
    /// Attend to the last this-many tokens only (None: all).
    pub sliding_window: Option<usize>,
    /// `s → cap·tanh(s/cap)` after scaling (Gemma 2-style soft-capping); None: off.
    pub softcap: Option<f32>,
}

pub use crate::fast_math::Kernel;

/// One decode step's inputs: the query rows (one token per sequence), the layer's cache, the batch and
/// the layer's settings.
#[derive(Clone, Copy, Debug)]
pub struct DecodeStep<'a, T> {
    pub query: &'a [T],
    pub query_rows: HeadStrides,
    pub cache: PagedKvCache<'a, T>,
    pub batch: DecodeBatch<'a>,
    pub params: AttentionParams,
}

/// `out[i, h] = softmax(scale · q[i, h] · Kᵢᵀ) · Vᵢ` for every sequence `i` of the batch and query head
/// `h` (KV head `h / (heads / kv_heads)`), on `par`'s threads, with the fastest kernel this CPU runs.
pub fn decode_attention<T: Element>(
    step: &DecodeStep<'_, T>,
    out: &mut [T],
    out_rows: HeadStrides,
    par: &dyn ParallelFor,
) -> Result<()> {
    decode_attention_with(Kernel::best(), step, out, out_rows, par)
}

/// [`decode_attention`] with a chosen kernel build (tests run every build this CPU has).
pub fn decode_attention_with<T: Element>(
    kernel: Kernel,
    step: &DecodeStep<'_, T>,
    out: &mut [T],
    out_rows: HeadStrides,
    par: &dyn ParallelFor,
) -> Result<()> {
    if !kernel.is_supported() {
        return Err(Error::invalid(format!(
            "decode attention: the {kernel:?} kernel does not run on this CPU"
        )));
    }
    let plan = plan(step, out.len(), out_rows, par.threads())?;
    let mut partials = vec![0f32; plan.split_items * plan.partial_len()];
    let job = Job {
        plan: &plan,
        step,
        out: DisjointWrites::new(out),
        out_rows,
        partials: DisjointWrites::new(&mut partials),
    };
    let next = AtomicUsize::new(0);
    let tasks = |_: Range<usize>| job.run_tasks(kernel, &next);
    if plan.cache_bytes::<T>() < PARALLEL_MIN_BYTES || par.threads() <= 1 || plan.items.len() <= 1 {
        tasks(0..1);
    } else {
        par.run(par.threads().min(plan.items.len()), &tasks);
    }
    job.merge_splits(&partials);
    Ok(())
}

/// One unit of work: the query heads of one KV head of one sequence over one key span.
#[derive(Clone, Copy, Debug)]
struct Item {
    seq: u32,
    kv_head: u32,
    keys: (u32, u32),
    /// Index of its partial result, for a span of a split sequence (`u32::MAX`: written to `out` directly).
    partial: u32,
}

/// A validated call: the work items (longest first) and the shapes.
#[derive(Debug)]
struct Plan {
    items: Vec<Item>,
    /// (sequence, KV head, first partial, spans) of every split pair.
    splits: Vec<(u32, u32, u32, u32)>,
    split_items: usize,
    group: usize,
    head_dim: usize,
}

impl Plan {
    /// f32 values per partial result: `m` and `l` per query head, then the unnormalized output rows.
    fn partial_len(&self) -> usize {
        self.group * (self.head_dim + 2)
    }

    fn cache_bytes<T>(&self) -> usize {
        let keys: usize = self
            .items
            .iter()
            .map(|i| (i.keys.1 - i.keys.0) as usize)
            .sum();
        keys * 2 * self.head_dim * std::mem::size_of::<T>()
    }
}

/// Check every argument and cut the work into items (the one place a call is validated).
fn plan<T>(
    step: &DecodeStep<'_, T>,
    out_len: usize,
    out_rows: HeadStrides,
    threads: usize,
) -> Result<Plan> {
    let (query_rows, cache, batch, params) =
        (step.query_rows, &step.cache, &step.batch, &step.params);
    let query_len = step.query.len();
    let bad = |msg: String| Error::invalid(format!("decode attention: {msg}"));
    let d = cache.shape.head_dim;
    if d == 0 || !d.is_multiple_of(HEAD_DIM_MULTIPLE) || d > MAX_HEAD_DIM {
        return Err(bad(format!(
            "head_dim={d} must be a positive multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
        )));
    }
    let n = batch.seq_lens.len();
    let heads = query_rows.heads;
    if query_rows.tokens != n || out_rows.tokens != n || out_rows.heads != heads {
        return Err(bad(format!(
            "query has {} tokens × {heads} heads and out {} × {}; the batch has {n} sequences",
            query_rows.tokens, out_rows.tokens, out_rows.heads
        )));
    }
    if heads == 0
        || !heads.is_multiple_of(cache.shape.kv_heads)
        || heads / cache.shape.kv_heads > MAX_QUERIES_PER_KV
    {
        return Err(bad(format!(
            "{heads} query heads over {} KV heads: must be a positive multiple, at most {MAX_QUERIES_PER_KV} per KV head",
            cache.shape.kv_heads
        )));
    }
    for (rows, len, what) in [(query_rows, query_len, "query"), (out_rows, out_len, "out")] {
        let need = rows
            .values(d)
            .ok_or_else(|| bad(format!("{what}: strides overflow")))?;
        if need > len {
            return Err(bad(format!(
                "{what} holds {len} values; its strides address {need}"
            )));
        }
    }
    if out_rows.rows_overlap(d) {
        return Err(bad(format!(
            "out's strides {out_rows:?} make rows of head_dim={d} overlap"
        )));
    }
    if !params.scale.is_finite() {
        return Err(bad(format!("scale={} must be finite", params.scale)));
    }
    if let Some(cap) = params.softcap {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(bad(format!(
                "softcap={cap} must be positive and finite (None: off)"
            )));
        }
    }
    if params.sliding_window == Some(0) {
        return Err(bad("sliding_window=0 attends to nothing (None: off)".into()));
    }
    let bs = cache.shape.block_size;
    let mut spans = Vec::with_capacity(n);
    for (i, &len) in batch.seq_lens.iter().enumerate() {
        let len =
            usize::try_from(len).map_err(|_| bad(format!("sequence {i} has seq_len={len}")))?;
        let blocks = len.div_ceil(bs);
        if blocks > batch.blocks_per_seq {
            return Err(bad(format!(
                "sequence {i}: seq_len={len} needs {blocks} blocks of {bs}; the block table has {} per sequence",
                batch.blocks_per_seq
            )));
        }
        let row = i * batch.block_table_stride;
        if blocks > 0 && row.saturating_add(blocks) > batch.block_table.len() {
            return Err(bad(format!(
                "sequence {i}: its {blocks} blocks lie past the block table's {} entries (row stride {})",
                batch.block_table.len(),
                batch.block_table_stride
            )));
        }
        let start = params.sliding_window.map_or(0, |w| len.saturating_sub(w));
        for (j, &b) in batch.block_table[row.min(batch.block_table.len())..][..blocks]
            .iter()
            .enumerate()
            .skip(start / bs)
        {
            if b < 0 || b as usize >= cache.shape.blocks {
                return Err(bad(format!(
                    "sequence {i}: block table entry {j} is block {b}; the cache has {} blocks",
                    cache.shape.blocks
                )));
            }
        }
        if len > u32::MAX as usize {
            return Err(bad(format!("sequence {i}: seq_len={len} is too long")));
        }
        spans.push((start as u32, len as u32));
    }
    // Split long sequences into spans only where there are too few (sequence, KV head) pairs to keep every
    // thread busy.
    let pairs = n * cache.shape.kv_heads;
    let want = threads.max(1) * ITEMS_PER_THREAD;
    let split = if threads > 1 && pairs > 0 && pairs < want {
        want.div_ceil(pairs)
    } else {
        1
    };
    let mut items = Vec::with_capacity(pairs * split);
    let mut splits = Vec::new();
    let mut split_items = 0usize;
    for (i, &(start, end)) in spans.iter().enumerate() {
        let len = (end - start) as usize;
        let parts = split.min(len / SPLIT_MIN_KEYS).max(1);
        let step = len.div_ceil(parts).max(1);
        for kv in 0..cache.shape.kv_heads {
            let first = split_items;
            for p in 0..parts {
                let a = start as usize + p * step;
                let b = (a + step).min(end as usize);
                let partial = if parts > 1 {
                    split_items += 1;
                    (split_items - 1) as u32
                } else {
                    u32::MAX
                };
                items.push(Item {
                    seq: i as u32,
                    kv_head: kv as u32,
                    keys: (a as u32, b as u32),
                    partial,
                });
            }
            if parts > 1 {
                splits.push((i as u32, kv as u32, first as u32, parts as u32));
            }
        }
    }
    // Longest first, handed out one by one: the threads finish together however uneven the lengths.
    items.sort_by_key(|it| std::cmp::Reverse(it.keys.1 - it.keys.0));
    Ok(Plan {
        items,
        splits,
        split_items,
        group: heads / cache.shape.kv_heads,
        head_dim: d,
    })
}

struct Job<'p, 'a, T> {
    plan: &'p Plan,
    step: &'p DecodeStep<'a, T>,
    /// The output rows: disjoint (token, head) rows ([`plan`] checks), one item each.
    out: DisjointWrites<T>,
    out_rows: HeadStrides,
    /// The partial results of split spans: one slot per item.
    partials: DisjointWrites<f32>,
}

/// Per-thread scratch: the scaled query rows, the running softmax state and one chunk's scores.
struct Scratch {
    q: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    scores: Vec<f32>,
}

impl Scratch {
    fn new(group: usize, head_dim: usize) -> Self {
        Self {
            q: vec![0.0; group * head_dim],
            acc: vec![0.0; group * head_dim],
            m: vec![0.0; group],
            l: vec![0.0; group],
            scores: vec![0.0; group * TILE],
        }
    }
}

impl<T: Element> Job<'_, '_, T> {
    /// Take items until none is left.
    fn run_tasks(&self, kernel: Kernel, next: &AtomicUsize) {
        match kernel {
            // SAFETY: `decode_attention_with` checked that the CPU runs this build.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { self.run_avx512(next) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { self.run_avx2(next) },
            _ => self.run_portable(next),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma,f16c")]
    unsafe fn run_avx512(&self, next: &AtomicUsize) {
        self.run_items::<Fused>(next)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, next: &AtomicUsize) {
        self.run_items::<Fused>(next)
    }

    fn run_portable(&self, next: &AtomicUsize) {
        self.run_items::<Unfused>(next)
    }

    #[inline(always)]
    fn run_items<M: MulAdd>(&self, next: &AtomicUsize) {
        let plan = self.plan;
        let mut s = Scratch::new(plan.group, plan.head_dim);
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = plan.items.get(i) else {
                return;
            };
            // the item a thread takes next (a guess: another thread may take it first), for prefetching
            let after = plan.items.get(next.load(Ordering::Relaxed));
            self.attend::<M>(item, after, &mut s);
            self.finish(item, &s);
        }
    }

    /// The (block, KV head) slab holding key `pos` of `item`'s sequence (its block id checked by `plan`).
    #[inline(always)]
    fn slab_of(&self, item: &Item, pos: usize) -> usize {
        let (b, cache) = (&self.step.batch, &self.step.cache);
        let block =
            b.block_table[item.seq as usize * b.block_table_stride + pos / cache.shape.block_size];
        cache.slab(block as usize, item.kv_head as usize)
    }

    /// The online softmax of one item's key span into `s.m`, `s.l`, `s.acc`. While a tile of a block is
    /// computed, the same part of the next block (or of `after`'s first block) is prefetched: blocks lie
    /// anywhere in the cache, and the keys are read in strided rows the hardware prefetchers do not
    /// run ahead of (without it, one thread read the cache at a third of the streaming bandwidth).
    #[inline(always)]
    fn attend<M: MulAdd>(&self, item: &Item, after: Option<&Item>, s: &mut Scratch) {
        let (g, d) = (self.plan.group, self.plan.head_dim);
        let (seq, kv) = (item.seq as usize, item.kv_head as usize);
        for h in 0..g {
            let at = self.step.query_rows.at(seq, kv * g + h);
            let q = &mut s.q[h * d..(h + 1) * d];
            T::widen(&self.step.query[at..at + d], q);
            for v in q.iter_mut() {
                *v *= self.step.params.scale;
            }
        }
        s.m.fill(f32::NEG_INFINITY);
        s.l.fill(0.0);
        s.acc.fill(0.0);
        let (cache, batch) = (&self.step.cache, &self.step.batch);
        let bs = cache.shape.block_size;
        let table =
            &batch.block_table[(seq * batch.block_table_stride).min(batch.block_table.len())..];
        let (mut pos, end) = (item.keys.0 as usize, item.keys.1 as usize);
        while pos < end {
            let off = pos % bs;
            let n = (end - pos).min(bs - off).min(TILE);
            // every block id was checked against the cache by `plan`
            let slab = cache.slab(table[pos / bs] as usize, kv);
            // the next block of this item (or the first of the item a thread takes next), prefetched
            // row by row as this one is computed: a new block is a jump the hardware cannot follow
            let ahead = match (pos / bs + 1) * bs {
                b if b < end => Some(self.slab_of(item, b)),
                _ => after
                    .filter(|a| a.keys.1 > a.keys.0)
                    .map(|a| self.slab_of(a, a.keys.0 as usize)),
            };
            let ahead = ahead.map(|a| &cache.data[a..a + 2 * bs * d]);
            let keys = &cache.data[slab..slab + bs * d];
            let values = &cache.data[slab + (bs + off) * d..slab + (bs + off + n) * d];
            // (plain loops, not closures: a closure would not inherit the caller's target features)
            let mut h0 = 0;
            while h0 < g {
                let (q, sc) = (&s.q[h0 * d..], &mut s.scores[h0 * TILE..]);
                let pre = ahead.filter(|_| h0 == 0).map(|a| &a[..bs * d]);
                let a = (q, keys, pre, bs, off, n, d);
                h0 += match g - h0 {
                    1 => score_tile::<T, M, 1>(a, sc),
                    2 => score_tile::<T, M, 2>(a, sc),
                    _ => score_tile::<T, M, HEADS_PER_PASS>(a, sc),
                };
            }
            for h in 0..g {
                let scores = &mut s.scores[h * TILE..h * TILE + n];
                if let Some(cap) = self.step.params.softcap {
                    for v in scores.iter_mut() {
                        *v = cap * (*v / cap).tanh();
                    }
                }
                let m_new = s.m[h].max(max(scores));
                if m_new > s.m[h] {
                    let c = exp(s.m[h] - m_new);
                    s.l[h] *= c;
                    for a in s.acc[h * d..(h + 1) * d].iter_mut() {
                        *a *= c;
                    }
                    s.m[h] = m_new;
                }
                s.l[h] += exp_sum(scores, m_new);
            }
            let mut h0 = 0;
            while h0 < g {
                let (p, acc) = (&s.scores[h0 * TILE..], &mut s.acc[h0 * d..]);
                let pre = ahead
                    .filter(|_| h0 == 0)
                    .map(|a| &a[(bs + off) * d..(bs + off + n) * d]);
                h0 += match g - h0 {
                    1 => value_tile::<T, M, 1>(p, values, pre, n, d, acc),
                    2 => value_tile::<T, M, 2>(p, values, pre, n, d, acc),
                    _ => value_tile::<T, M, HEADS_PER_PASS>(p, values, pre, n, d, acc),
                };
            }
            pos += n;
        }
    }

    /// Write a finished item: the normalized rows to `out`, or its partial state for [`Self::merge_splits`].
    #[inline(always)]
    fn finish(&self, item: &Item, s: &Scratch) {
        let (g, d) = (self.plan.group, self.plan.head_dim);
        if item.partial != u32::MAX {
            let len = self.plan.partial_len();
            // SAFETY: slot `item.partial` of `split_items` slots of `len` values, written by this item only.
            let slot = unsafe { self.partials.slice(item.partial as usize * len, len) };
            slot[..g].copy_from_slice(&s.m);
            slot[g..2 * g].copy_from_slice(&s.l);
            slot[2 * g..].copy_from_slice(&s.acc);
            return;
        }
        for h in 0..g {
            self.write_row(
                item.seq as usize,
                item.kv_head as usize * g + h,
                &s.acc[h * d..(h + 1) * d],
                s.l[h],
            );
        }
    }

    /// `out[seq, head] = acc / l` (zeros where no key was seen).
    #[inline(always)]
    fn write_row(&self, seq: usize, head: usize, acc: &[f32], l: f32) {
        let at = self.out_rows.at(seq, head);
        // SAFETY: `plan` checked that `out` holds every row and that rows do not overlap; each (seq, head)
        // row is written by one item only.
        let dst = unsafe { self.out.slice(at, acc.len()) };
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        for (o, &a) in dst.iter_mut().zip(acc) {
            *o = T::from_f32(a * inv);
        }
    }

    /// Merge the spans of every split sequence (log-sum-exp of their partial softmaxes).
    fn merge_splits(&self, partials: &[f32]) {
        let (g, d, len) = (self.plan.group, self.plan.head_dim, self.plan.partial_len());
        let mut acc = vec![0f32; d];
        for &(seq, kv, first, parts) in &self.plan.splits {
            let slots: Vec<&[f32]> = (first..first + parts)
                .map(|p| &partials[p as usize * len..(p as usize + 1) * len])
                .collect();
            for h in 0..g {
                let m = slots.iter().map(|p| p[h]).fold(f32::NEG_INFINITY, f32::max);
                acc.fill(0.0);
                let mut l = 0f32;
                for p in &slots {
                    let w = if p[h] == f32::NEG_INFINITY {
                        0.0
                    } else {
                        exp(p[h] - m)
                    };
                    l += w * p[g + h];
                    let rows = &p[2 * g + h * d..2 * g + (h + 1) * d];
                    for (a, &v) in acc.iter_mut().zip(rows) {
                        *a += w * v;
                    }
                }
                self.write_row(seq as usize, kv as usize * g + h, &acc, l);
            }
        }
    }
}

/// What the build has: multiply-add with one rounding (FMA) or two, and whether F16C converts f16.
trait MulAdd {
    /// The x86-64 builds with FMA also have F16C (both are checked by [`Kernel::is_supported`]).
    const F16C: bool;
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

/// `a·b + c` in one FMA instruction (only in builds with FMA enabled: elsewhere `f32::mul_add` is a libm
/// call).
struct Fused;
impl MulAdd for Fused {
    const F16C: bool = true;
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

struct Unfused;
impl MulAdd for Unfused {
    const F16C: bool = false;
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// Lanes of the reductions' partial sums (one AVX-512 register; two AVX2 ones).
const LANES: usize = 16;

/// `scores[h·TILE + t] = q_h · key(off + t)` for `G` heads (returns `G`) and `n ≤ TILE` keys of one
/// block, whose keys are stored column-major (`keys[i·bs + t]`: dimension `i` of key `t`). Each
/// dimension's row of keys is widened once and multiplied by every head's broadcast query value: no
/// horizontal sums.
#[inline(always)]
fn score_tile<T: Element, M: MulAdd, const G: usize>(
    a: ScoreArgs<'_, T>,
    scores: &mut [f32],
) -> usize {
    // the 16-key chunks that cover n as a constant, so the sums live in registers; a whole tile (every
    // block of 128, 64, 32 or 16 keys but a sequence's last) without any bounds test per load
    match a.5 {
        TILE => score_chunks::<T, M, G, { TILE / LANES }, true>(a, scores),
        64 => score_chunks::<T, M, G, 4, true>(a, scores),
        32 => score_chunks::<T, M, G, 2, true>(a, scores),
        LANES => score_chunks::<T, M, G, 1, true>(a, scores),
        n => match n.div_ceil(LANES) {
            0..=1 => score_chunks::<T, M, G, 1, false>(a, scores),
            2 => score_chunks::<T, M, G, 2, false>(a, scores),
            3..=4 => score_chunks::<T, M, G, 4, false>(a, scores),
            _ => score_chunks::<T, M, G, { TILE / LANES }, false>(a, scores),
        },
    }
    G
}

/// [`score_tile`]'s arguments but the scores: query rows, keys, the keys to prefetch, block size, first
/// key, keys, head size.
type ScoreArgs<'a, T> = (
    &'a [f32],
    &'a [T],
    Option<&'a [T]>,
    usize,
    usize,
    usize,
    usize,
);

/// [`score_tile`] over `C` chunks of [`LANES`] keys (`FULL`: exactly `C · LANES` keys).
#[inline(always)]
fn score_chunks<T: Element, M: MulAdd, const G: usize, const C: usize, const FULL: bool>(
    (q, keys, prefetch_keys, bs, off, n, d): ScoreArgs<'_, T>,
    scores: &mut [f32],
) {
    let mut acc = [[[0f32; LANES]; C]; G];
    for i in 0..d {
        let row = &keys[i * bs + off..i * bs + off + n];
        if let Some(next) = prefetch_keys {
            prefetch(&next[i * bs + off..i * bs + off + n]);
        }
        for c in 0..C {
            let k = if FULL {
                widen_lanes::<T, M>(&row[c * LANES..(c + 1) * LANES])
            } else {
                // a chunk past n (or its part past n) reads zeros: its sums are never read
                widen_part(row.get(c * LANES..).unwrap_or(&[]))
            };
            for h in 0..G {
                let qv = q[h * d + i];
                for l in 0..LANES {
                    acc[h][c][l] = M::mul_add(qv, k[l], acc[h][c][l]);
                }
            }
        }
    }
    for h in 0..G {
        for (t, sc) in scores[h * TILE..h * TILE + n].iter_mut().enumerate() {
            *sc = acc[h][t / LANES][t % LANES];
        }
    }
}

/// [`LANES`] values in f32, by value so they stay in a register.
#[inline(always)]
fn widen_lanes<T: Element, M: MulAdd>(src: &[T]) -> [f32; LANES] {
    let src: &[T; LANES] = src.try_into().expect("LANES values");
    if M::F16C {
        // SAFETY: builds with `M::F16C` run only where `Kernel::is_supported` found F16C.
        return unsafe { T::widen16_f16c(src) };
    }
    let mut out = [0f32; LANES];
    T::widen(src, &mut out);
    out
}

/// The first [`LANES`] values of `src` in f32, zeros past its end (a sequence's last keys).
#[inline(always)]
fn widen_part<T: Element>(src: &[T]) -> [f32; LANES] {
    let mut out = [0f32; LANES];
    let n = src.len().min(LANES);
    T::widen(&src[..n], &mut out[..n]);
    out
}

/// `acc_h += Σ_t p[h·TILE + t] · value(t)` for `G` heads (returns `G`) and `n` value rows (row-major, `d`
/// each), in slices of `W` dimensions whose sums stay in registers over all the rows.
#[inline(always)]
fn value_tile<T: Element, M: MulAdd, const G: usize>(
    p: &[f32],
    values: &[T],
    prefetch_values: Option<&[T]>,
    n: usize,
    d: usize,
    acc: &mut [f32],
) -> usize {
    if d.is_multiple_of(WIDE_DIMS) {
        value_slices::<T, M, G, { WIDE_DIMS / LANES }>(p, values, prefetch_values, n, d, acc);
    } else {
        value_slices::<T, M, G, 1>(p, values, prefetch_values, n, d, acc);
    }
    G
}

/// [`value_tile`] over slices of `C` × [`LANES`] dimensions.
#[inline(always)]
fn value_slices<T: Element, M: MulAdd, const G: usize, const C: usize>(
    p: &[f32],
    values: &[T],
    prefetch_values: Option<&[T]>,
    n: usize,
    d: usize,
    acc: &mut [f32],
) {
    let w = C * LANES;
    for j in (0..d).step_by(w) {
        let mut sums = [[[0f32; LANES]; C]; G];
        for h in 0..G {
            for c in 0..C {
                let at = h * d + j + c * LANES;
                sums[h][c].copy_from_slice(&acc[at..at + LANES]);
            }
        }
        for (t, row) in values.chunks_exact(d).take(n).enumerate() {
            // spread over the first slice's rows (a burst of prefetches stalls on the miss buffers)
            if let Some(next) = prefetch_values.filter(|_| j == 0) {
                prefetch(&next[t * d..(t + 1) * d]);
            }
            for c in 0..C {
                let v = widen_lanes::<T, M>(&row[j + c * LANES..j + (c + 1) * LANES]);
                for h in 0..G {
                    let w = p[h * TILE + t];
                    for l in 0..LANES {
                        sums[h][c][l] = M::mul_add(w, v[l], sums[h][c][l]);
                    }
                }
            }
        }
        for h in 0..G {
            for c in 0..C {
                let at = h * d + j + c * LANES;
                acc[at..at + LANES].copy_from_slice(&sums[h][c]);
            }
        }
    }
}

/// Ask for `data`'s cache lines into L2 (a hint: no fault, no effect on results). Not L1: the next
/// block would evict the tile being computed.
#[inline(always)]
fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let bytes = std::mem::size_of_val(data);
        let p = data.as_ptr().cast::<i8>();
        for at in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults; `at` stays inside `data`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.add(at)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

#[inline(always)]
fn tree_sum(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            acc[i] += acc[i + w];
        }
        w /= 2;
    }
    acc[0]
}

/// The largest of `v` (−∞ for none).
#[inline(always)]
fn max(v: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = v.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            m[i] = m[i].max(c[i]);
        }
    }
    for (i, &x) in chunks.remainder().iter().enumerate() {
        m[i] = m[i].max(x);
    }
    m.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// `v[i] = exp(v[i] − m)` in place; returns their sum.
#[inline(always)]
fn exp_sum(v: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = v.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            c[i] = exp(c[i] - m);
            acc[i] += c[i];
        }
    }
    for (i, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x = exp(*x - m);
        acc[i] += *x;
    }
    tree_sum(acc)
}

/// The float64 reference every build is tested against: for each sequence and query head, the scores of
/// its keys, a two-pass softmax and the weighted sum of its values, all in f64. Returns `[tokens, heads,
/// head_dim]` values (validated as [`decode_attention`] validates them).
pub fn decode_attention_reference<T: Element>(step: &DecodeStep<'_, T>) -> Result<Vec<f64>> {
    let (query, query_rows, cache, batch) = (step.query, step.query_rows, &step.cache, &step.batch);
    let params = &step.params;
    let d = cache.shape.head_dim;
    let heads = query_rows.heads;
    let out_rows = HeadStrides::contiguous(batch.seq_lens.len(), heads, d);
    let plan = plan(step, heads * batch.seq_lens.len() * d, out_rows, 1)?;
    let mut out = vec![0f64; batch.seq_lens.len() * heads * d];
    let bs = cache.shape.block_size;
    for item in &plan.items {
        let (seq, kv) = (item.seq as usize, item.kv_head as usize);
        let keys: Vec<usize> = (item.keys.0 as usize..item.keys.1 as usize).collect();
        // key `pos`, dimension `i` (column-major in its block), and value `pos` (a row)
        let slab = |pos: usize| {
            let block = batch.block_table[seq * batch.block_table_stride + pos / bs] as usize;
            cache.slab(block, kv)
        };
        let key = |pos: usize, i: usize| cache.data[slab(pos) + i * bs + pos % bs].to_f32();
        let value = |pos: usize| {
            let at = slab(pos) + (bs + pos % bs) * d;
            &cache.data[at..at + d]
        };
        for h in 0..plan.group {
            let head = kv * plan.group + h;
            let at = query_rows.at(seq, head);
            let q = &query[at..at + d];
            let scores: Vec<f64> = keys
                .iter()
                .map(|&p| {
                    let s: f64 = q
                        .iter()
                        .enumerate()
                        .map(|(i, a)| f64::from(a.to_f32()) * f64::from(key(p, i)))
                        .sum::<f64>()
                        * f64::from(params.scale);
                    params.softcap.map_or(s, |c| {
                        let c = f64::from(c);
                        c * (s / c).tanh()
                    })
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let l: f64 = p.iter().sum();
            let o = &mut out[(seq * heads + head) * d..(seq * heads + head + 1) * d];
            for (&pos, &w) in keys.iter().zip(&p) {
                for (a, v) in o.iter_mut().zip(value(pos)) {
                    *a += w / l * f64::from(v.to_f32());
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
