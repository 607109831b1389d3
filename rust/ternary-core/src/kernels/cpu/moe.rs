//! Routed ternary experts (a Mixture-of-Experts layer) in one call:
//! `y[t] = Σ_j w[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))` with `e = ids[t, j]`.
//!
//! The `(token, slot)` pairs are sorted by expert (a stable counting sort), so each expert's inputs,
//! hidden activations and outputs are contiguous row blocks and both projections are grouped GEMMs.
//! In the int8 modes the activations of a projection are quantized once for every pair, and the
//! experts with few tokens (decode: the per-row int8 kernel) share **one** parallel region per
//! projection, their row blocks its tasks. One GEMM call per expert paid a fork/join, a
//! quantization and (from Python) a dispatch each: at decode that was most of the layer's time.
//! Experts with many tokens (prefill) keep their own tiling (AMX tiles, the wide kernel), one call each;
//! the exact mode runs one [`gemm`] per expert.
//!
//! Numerics are those of the per-expert composition the Python fallback runs
//! (`ternary_rs.serving._ops_moe`): each projection's output is rounded to the activation type,
//! SiLU-and-mul is computed in f32 and rounded once, and the k weighted expert outputs of a token are
//! summed in f32 (slot order) and rounded once.

use super::{
    gemm, layout, quantize_rows, Activation, Job, KernelChoice, PreparedRef, QuantizedRows,
    Scratch, PARALLEL_MIN_WEIGHTS, ROWS, SCRATCH, STREAM_Y_MIN_BYTES, TASK_MIN_WEIGHTS,
};
use crate::threads::{DisjointWrites, ParallelFor};
use crate::{Error, Result};

/// Every expert's two weights in the kernel layout, expert `e` at index `e`.
pub struct Experts<'a> {
    /// Fused gate and up projections, `[2I, H]` (the I gate rows first).
    pub w13: &'a [PreparedRef<'a>],
    /// Down projections, `[H, I]`.
    pub w2: &'a [PreparedRef<'a>],
}

/// The router's choice for `m` tokens: `ids[t·top_k + j]` and `weights[t·top_k + j]`.
pub struct Routing<'a> {
    pub ids: &'a [i32],
    pub weights: &'a [f32],
    pub top_k: usize,
    /// Scale each input row by its weight instead of the output (Llama-4 style top-1 routing).
    pub weight_on_input: bool,
}

impl Experts<'_> {
    /// `(hidden, intermediate)` after checking every expert has the same `[2I, H]` and `[H, I]`
    /// weights (one group size per projection) and that the buffers match.
    pub fn check(&self) -> Result<(usize, usize)> {
        let (Some(a), Some(d)) = (self.w13.first(), self.w2.first()) else {
            return Err(Error::invalid("MoE layer without experts"));
        };
        if self.w13.len() != self.w2.len() {
            return Err(Error::invalid(format!(
                "MoE layer has {} gate/up weights but {} down weights",
                self.w13.len(),
                self.w2.len()
            )));
        }
        for w in self.w13.iter().chain(self.w2) {
            // The grouped int8 GEMM reads row blocks.
            w.require_rows4("the MoE kernel")?;
        }
        let (hidden, inter) = (a.cols, a.rows / 2);
        if a.rows % 2 != 0 || d.rows != hidden || d.cols != inter {
            return Err(Error::invalid(format!(
                "MoE expert weights [{}, {}] and [{}, {}] are not [2I, H] and [H, I]",
                a.rows, a.cols, d.rows, d.cols
            )));
        }
        for (e, (u, v)) in self.w13.iter().zip(self.w2).enumerate() {
            if (u.rows, u.cols, u.group_size) != (a.rows, a.cols, a.group_size)
                || (v.rows, v.cols, v.group_size) != (d.rows, d.cols, d.group_size)
            {
                return Err(Error::invalid(format!(
                    "MoE expert {e} has weights [{}, {}] g{} and [{}, {}] g{}, expert 0 [{}, {}] g{} and [{}, {}] g{}",
                    u.rows, u.cols, u.group_size, v.rows, v.cols, v.group_size,
                    a.rows, a.cols, a.group_size, d.rows, d.cols, d.group_size
                )));
            }
            u.check()
                .and_then(|()| v.check())
                .map_err(|err| Error::invalid(format!("MoE expert {e}: {err}")))?;
        }
        Ok((hidden, inter))
    }
}

/// The pairs of a routing sorted by expert: `order[i]` is the pair (`t·top_k + j`) at sorted row `i`,
/// `rows[e]` expert `e`'s sorted rows.
struct Sorted {
    order: Vec<usize>,
    /// `position[pair]`: the sorted row of a pair.
    position: Vec<usize>,
    rows: Vec<std::ops::Range<usize>>,
}

fn sort_pairs(ids: &[i32], top_k: usize, experts: usize) -> Result<Sorted> {
    let mut counts = vec![0usize; experts];
    for (pair, &id) in ids.iter().enumerate() {
        match usize::try_from(id).ok().filter(|&e| e < experts) {
            Some(e) => counts[e] += 1,
            None => {
                return Err(Error::invalid(format!(
                    "expert id {id} (token {}, slot {}) is outside [0, {experts})",
                    pair / top_k.max(1),
                    pair % top_k.max(1)
                )))
            }
        }
    }
    let mut rows = Vec::with_capacity(experts);
    let mut next = Vec::with_capacity(experts);
    let mut start = 0;
    for &c in &counts {
        rows.push(start..start + c);
        next.push(start);
        start += c;
    }
    let (mut order, mut position) = (vec![0; ids.len()], vec![0; ids.len()]);
    for (pair, &id) in ids.iter().enumerate() {
        let slot = &mut next[id as usize];
        order[*slot] = pair;
        position[pair] = *slot;
        *slot += 1;
    }
    Ok(Sorted {
        order,
        position,
        rows,
    })
}

/// The MoE layer: `x [m, H]` → `y [m, H]` (see the module docs), on `par`'s threads.
pub fn moe<T: Activation>(
    experts: &Experts<'_>,
    x: &[T],
    m: usize,
    routing: &Routing<'_>,
    y: &mut [T],
    choice: KernelChoice,
    par: &dyn ParallelFor,
) -> Result<()> {
    let (hidden, inter) = experts.check()?;
    let pairs = m.checked_mul(routing.top_k);
    if Some(x.len()) != m.checked_mul(hidden) || y.len() != x.len() {
        return Err(Error::invalid(format!(
            "MoE layer of hidden size {hidden}: x has {} and y {} elements for {m} tokens",
            x.len(),
            y.len()
        )));
    }
    if Some(routing.ids.len()) != pairs || Some(routing.weights.len()) != pairs {
        return Err(Error::invalid(format!(
            "MoE routing of {m} tokens × top-{} has {} ids and {} weights",
            routing.top_k,
            routing.ids.len(),
            routing.weights.len()
        )));
    }
    let sorted = sort_pairs(routing.ids, routing.top_k, experts.w13.len())?;
    let p = routing.ids.len();
    if p == 0 {
        y.fill(T::default());
        return Ok(());
    }
    // The inputs in sorted order (scaled by their weight with `weight_on_input`, rounded to T as
    // the per-expert composition does).
    let mut xs = vec![T::default(); p * hidden];
    let mut f = vec![0f32; hidden.max(2 * inter)];
    for (row, &pair) in xs.chunks_exact_mut(hidden).zip(&sorted.order) {
        let src = &x[(pair / routing.top_k) * hidden..][..hidden];
        if routing.weight_on_input {
            T::to_f32_slice(src, &mut f[..hidden]);
            let w = routing.weights[pair];
            f[..hidden].iter_mut().for_each(|v| *v *= w);
            T::from_f32_slice(&f[..hidden], row);
        } else {
            row.copy_from_slice(src);
        }
    }
    let mut h = vec![T::default(); p * 2 * inter];
    grouped_gemm(experts.w13, &sorted.rows, &xs, &mut h, choice, par)?;
    // SiLU(gate) · up in f32, rounded once.
    let mut a = vec![T::default(); p * inter];
    for (hr, ar) in h.chunks_exact(2 * inter).zip(a.chunks_exact_mut(inter)) {
        T::to_f32_slice(hr, &mut f[..2 * inter]);
        let (gate, up) = f[..2 * inter].split_at_mut(inter);
        for (g, u) in gate.iter_mut().zip(up.iter()) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
        T::from_f32_slice(gate, ar);
    }
    drop(h);
    let mut out = xs; // reused: same size
    grouped_gemm(experts.w2, &sorted.rows, &a, &mut out, choice, par)?;
    // Each token's k outputs, weighted, summed in f32 in slot order, rounded once.
    let mut acc = vec![0f32; hidden];
    for (t, yt) in y.chunks_exact_mut(hidden).enumerate() {
        acc.fill(0.0);
        for j in 0..routing.top_k {
            let pair = t * routing.top_k + j;
            T::to_f32_slice(
                &out[sorted.position[pair] * hidden..][..hidden],
                &mut f[..hidden],
            );
            let w = if routing.weight_on_input {
                1.0
            } else {
                routing.weights[pair]
            };
            for (a, v) in acc.iter_mut().zip(&f[..hidden]) {
                *a += v * w;
            }
        }
        T::from_f32_slice(&acc, yt);
    }
    Ok(())
}

/// `y[rows[e]] = x[rows[e]] · W_eᵀ` for every expert `e` with rows (`x [P, K]`, `y [P, N]`).
fn grouped_gemm<T: Activation>(
    weights: &[PreparedRef<'_>],
    rows: &[std::ops::Range<usize>],
    x: &[T],
    y: &mut [T],
    choice: KernelChoice,
    par: &dyn ParallelFor,
) -> Result<()> {
    let (n, k) = (weights[0].rows, weights[0].cols);
    if !choice.precision.is_int8() {
        for (w, r) in weights.iter().zip(rows).filter(|(_, r)| !r.is_empty()) {
            let (xe, ye) = (&x[r.start * k..r.end * k], &mut y[r.start * n..r.end * n]);
            gemm(*w, xe, r.len(), None, ye, choice, par)?;
        }
        return Ok(());
    }
    let kernels = choice.variant.kernels()?;
    let p = x.len() / k;
    let y_ptr = y.as_mut_ptr();
    let job = |e: usize| {
        let r = &rows[e];
        Job {
            w: weights[e],
            m: r.len(),
            kernels,
            bias: None,
            // SAFETY (of the later writes): expert e's tasks write only its rows r of y.
            y: DisjointWrites::from_ptr(y_ptr.wrapping_add(r.start * n)),
            stream_y: r.len() * n * std::mem::size_of::<T>() >= STREAM_Y_MIN_BYTES,
        }
    };
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let s: &mut Scratch = &mut s;
        let shape = quantize_rows(
            kernels,
            weights[0],
            x,
            p,
            choice.precision == super::Precision::Int8Token,
            s,
        );
        let all = shape.of(&s.q, &s.xs4, &s.qsum4);
        let g = weights[0].group_size;
        // Experts with many tokens: their own tiling, one call each.
        let mut small = Vec::new();
        for e in (0..weights.len()).filter(|&e| !rows[e].is_empty()) {
            let (j, xq) = (job(e), all.rows(rows[e].clone(), k, g));
            if j.int8_is_per_row() {
                small.push((j, xq));
            } else {
                #[cfg(target_arch = "x86_64")]
                let tiles = &mut s.tiles;
                #[cfg(not(target_arch = "x86_64"))]
                let tiles = &mut ();
                j.run_quantized(xq, tiles, &mut s.tokens, par);
            }
        }
        run_per_row_together(&small, k, par);
    });
    Ok(())
}

/// The per-row int8 kernel of several experts' jobs (each with its quantized rows) in one parallel
/// region: tasks of row blocks, sized as [`Job::split`] sizes them for one weight.
fn run_per_row_together<T: Activation>(
    jobs: &[(Job<'_, T>, QuantizedRows<'_>)],
    k: usize,
    par: &dyn ParallelFor,
) {
    let Some((first, _)) = jobs.first() else {
        return;
    };
    let unit = ROWS * layout::padded_cols(k);
    let blocks = layout::row_blocks(first.w.rows);
    let total: usize = jobs.iter().map(|(j, _)| blocks * unit * j.m.min(16)).sum();
    let threads = par.threads().max(1);
    if total < PARALLEL_MIN_WEIGHTS || threads == 1 {
        for (j, xq) in jobs {
            j.int8_blocks(*xq, 0..blocks);
        }
        return;
    }
    let per_task = (TASK_MIN_WEIGHTS / unit)
        .max((blocks * jobs.len()).div_ceil(4 * threads))
        .clamp(1, blocks);
    let per_job = blocks.div_ceil(per_task);
    par.run(jobs.len() * per_job, &|range| {
        for t in range {
            let ((j, xq), b0) = (&jobs[t / per_job], (t % per_job) * per_task);
            j.int8_blocks(*xq, b0..(b0 + per_task).min(blocks));
        }
    });
}
