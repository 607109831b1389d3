//! The Gated DeltaNet decode step (the linear-attention layers of Qwen3.5 / Qwen3-Next, 48 of Bonsai 2
//! 27B's 64 layers), one new token per sequence: the causal depthwise convolution's update, the gates and
//! the delta-rule update of the recurrent state, fused into one pass per (sequence, key head)
//! (docs/design.md#gated-deltanet-decode).
//!
//! vLLM CPU runs this step as ~15 torch operations issued from Python around two C++ kernels; at Bonsai 2's
//! widths that overhead was about half of each layer's call (~130 of ~280 µs on two Zen 5 cores), while the
//! work itself is reading and writing the slot's f32 state once. Here the call reads its inputs and the
//! state once and writes the state, the convolution window and the output once.
//!
//! Per sequence `t` in cache slot `s` (`slots[t]`), the step computes what vLLM's
//! `causal_conv1d_update` (SiLU) followed by `fused_sigmoid_gating_delta_rule_update` (with
//! `use_qk_l2norm_in_kernel`) compute:
//! * channel `c` of the `2·Hk·K + Hv·V` convolution channels: `y = silu(bias + Σⱼ w[c][j] · win[j])` over the
//!   window `win = (conv[s][c][0 .. W−1], x[t][c])`, rounded to bf16 as vLLM stores it; the window moves
//!   on by one (`conv[s][c] ← win[1 ..]`);
//! * `y` is `q` (`Hk` heads of `K`), `k` (same) and `v` (`Hv` heads of `V`); value head `h` reads key head
//!   `h / (Hv / Hk)`; `q ← q / √(Σq² + 10⁻⁶) · K^−½` and `k ← k / √(Σk² + 10⁻⁶)`;
//! * gates `g = −exp(A_log[h]) · softplus(a[t][h] + dt_bias[h])` (`softplus(z) = z` above 20) and
//!   `β = sigmoid(b[t][h])`;
//! * the slot's state of head `h`, `S` (`K × V` f32, row `i` at `i · V`: the layout vLLM's CPU kernels
//!   use): `S ← e^g · S`, `δ = β · (v − Sᵀk)`, `S ← S + k δᵀ`, `out[t][h] = Sᵀq` (rounded to bf16).
//!
//! Numerics: f32 throughout (bf16 inputs widened exactly), the same operations in the same order as vLLM's
//! Triton reference up to the order of the f32 sums; [`decode_reference`] is the float64 version every
//! build is tested against. Validation is in one place ([`plan`]): shapes, strides, every slot index and
//! every length, before anything is written — a bad slot is an error naming the sequence.

// Per-lane arrays are indexed in lockstep with the channel they hold.
#![allow(clippy::needless_range_loop)]

use std::ops::Range;

use half::bf16;

use crate::fast_math::exp_nonpositive;
pub use crate::fast_math::Kernel;
use crate::threads::{DisjointWrites, ParallelFor};
use crate::{Error, Result};

/// Largest key / value head size accepted (Qwen3.5 and Qwen3-Next use 128).
pub const MAX_HEAD_DIM: usize = 256;
/// Value head sizes must be a multiple of this (the vector loops' width).
pub const VALUE_DIM_MULTIPLE: usize = 16;
/// Largest convolution width accepted (the models use 4).
pub const MAX_CONV_WIDTH: usize = 8;
/// Most sequences one call takes.
pub const MAX_SEQUENCES: usize = 1 << 16;
/// Added to `Σq²` and `Σk²` before the square root (FLA's `l2norm`, as vLLM's kernels).
const L2NORM_EPS: f32 = 1e-6;
/// Above this, `softplus(z) = z` (torch's and vLLM's threshold, with β = 1).
const SOFTPLUS_THRESHOLD: f32 = 20.0;
/// Channels of the convolution computed together.
const LANES: usize = 16;
/// How far ahead of the first pass's row the state is prefetched (f32 values: 8 KiB; 4 and 16 KiB were
/// 2-5 % slower, none 10 %, at batch 1 on two Zen 5 cores).
const PREFETCH_AHEAD: usize = 2048;

/// A layer's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_width: usize,
}

impl GdnShape {
    /// `q`, `k` and `v` channels together: the convolution's width and the input row's length.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// One slot's state values: `value_heads · key_dim · value_dim`.
    pub fn state_len(&self) -> usize {
        self.value_heads * self.key_dim * self.value_dim
    }

    fn heads_per_key(&self) -> usize {
        self.value_heads / self.key_heads
    }

    fn check(&self) -> Result<()> {
        let s = self;
        if s.key_heads == 0 || s.value_heads == 0 || !s.value_heads.is_multiple_of(s.key_heads) {
            return Err(Error::invalid(format!(
                "GDN: {} value heads are not a positive multiple of {} key heads",
                s.value_heads, s.key_heads
            )));
        }
        if s.key_dim == 0 || s.key_dim > MAX_HEAD_DIM {
            return Err(Error::invalid(format!(
                "GDN: key head size {} outside 1..={MAX_HEAD_DIM}",
                s.key_dim
            )));
        }
        if s.value_dim == 0
            || s.value_dim > MAX_HEAD_DIM
            || !s.value_dim.is_multiple_of(VALUE_DIM_MULTIPLE)
        {
            return Err(Error::invalid(format!(
                "GDN: value head size {} is not a multiple of {VALUE_DIM_MULTIPLE} in 16..={MAX_HEAD_DIM}",
                s.value_dim
            )));
        }
        if !(2..=MAX_CONV_WIDTH).contains(&s.conv_width) {
            return Err(Error::invalid(format!(
                "GDN: convolution width {} outside 2..={MAX_CONV_WIDTH}",
                s.conv_width
            )));
        }
        // Head counts are bounded only by the caller's memory: the products below must not wrap.
        s.value_heads
            .checked_mul(s.key_dim * s.value_dim)
            .and_then(|_| s.value_heads.checked_mul(s.value_dim))
            .and_then(|v| v.checked_add(2 * s.key_heads.checked_mul(s.key_dim)?))
            .map(|_| ())
            .ok_or_else(|| Error::invalid("GDN: head counts overflow"))
    }
}

/// A layer's constant parameters, as f32.
#[derive(Clone, Copy, Debug)]
pub struct GdnParams<'a> {
    /// `[conv_channels][conv_width]`, the newest tap last.
    pub conv_weight: &'a [f32],
    /// `[conv_channels]`, if the convolution has one.
    pub conv_bias: Option<&'a [f32]>,
    /// `[value_heads]`.
    pub a_log: &'a [f32],
    /// `[value_heads]`.
    pub dt_bias: &'a [f32],
}

/// Every cache slot's convolution window (`conv_width − 1` past inputs per channel): slot `s`, channel
/// `c`, step `j` (oldest first) at `s · slot_stride + c · channel_stride + j · step_stride`.
pub struct ConvCache<'a> {
    pub data: &'a mut [bf16],
    pub slots: usize,
    pub slot_stride: usize,
    pub channel_stride: usize,
    pub step_stride: usize,
}

/// Every cache slot's recurrent state: slot `s` at `s · slot_stride`, `[value_heads][key_dim][value_dim]`
/// contiguous f32.
pub struct StateCache<'a> {
    pub data: &'a mut [f32],
    pub slots: usize,
    pub slot_stride: usize,
}

/// One decode step's per-sequence inputs.
#[derive(Clone, Copy, Debug)]
pub struct DecodeInputs<'a> {
    /// Row `t` (at `t · x_stride`): the `conv_channels` projected `q, k, v` inputs of sequence `t`.
    pub x: &'a [bf16],
    pub x_stride: usize,
    /// Row `t` (at `t · gate_stride`): the `value_heads` gate inputs `a` and `b` of sequence `t`.
    pub a: &'a [bf16],
    pub b: &'a [bf16],
    pub gate_stride: usize,
    /// The cache slot of each sequence (all different).
    pub slots: &'a [i32],
}

/// One decode step's layer and inputs.
#[derive(Clone, Copy, Debug)]
pub struct DecodeStep<'a> {
    pub shape: GdnShape,
    pub params: GdnParams<'a>,
    pub inputs: DecodeInputs<'a>,
}

/// Run one decode step: update every sequence's convolution window and state in place and write its
/// output, `out[t][h][i]` (`sequences × value_heads × value_dim` bf16), the work split over `par` by
/// (sequence, key head).
///
/// Refused before anything is written: sizes or strides that do not match the shape, a slot index outside
/// the caches or used by two sequences (the error names the sequence). Non-finite values are not checked:
/// they propagate as in vLLM.
pub fn decode(
    step: &DecodeStep<'_>,
    conv: ConvCache<'_>,
    state: StateCache<'_>,
    out: &mut [bf16],
    kernel: Kernel,
    par: &dyn ParallelFor,
) -> Result<()> {
    let (shape, params, inputs) = (&step.shape, &step.params, &step.inputs);
    let n = plan(shape, params, inputs, &conv, &state, out.len())?;
    if !kernel.is_supported() {
        return Err(Error::invalid(format!(
            "GDN: the {kernel:?} kernel does not run on this CPU"
        )));
    }
    let job = Job {
        shape: *shape,
        params: *params,
        inputs: *inputs,
        conv: DisjointWrites::new(conv.data),
        conv_strides: (conv.slot_stride, conv.channel_stride, conv.step_stride),
        state: DisjointWrites::new(state.data),
        state_stride: state.slot_stride,
        out: DisjointWrites::new(out),
    };
    let items = n * shape.key_heads;
    let run = |range: Range<usize>| {
        for item in range {
            // SAFETY: `plan` checked every length, stride and slot (distinct, in bounds), so item
            // (sequence t, key head kh) touches only its own slot's channels and heads and its own output.
            unsafe { job.item(item / shape.key_heads, item % shape.key_heads, kernel) };
        }
    };
    // One item is ~2-5 µs (a key head's value heads' states): a fork pays from two items per thread up.
    if items >= 2 * par.threads() && par.threads() > 1 {
        par.run(items, &run);
    } else {
        run(0..items);
    }
    Ok(())
}

/// Checks everything [`decode`] and [`decode_reference`] rely on; returns the number of sequences.
fn plan(
    shape: &GdnShape,
    params: &GdnParams<'_>,
    inputs: &DecodeInputs<'_>,
    conv: &ConvCache<'_>,
    state: &StateCache<'_>,
    out_len: usize,
) -> Result<usize> {
    shape.check()?;
    let (channels, width, hv) = (shape.conv_channels(), shape.conv_width, shape.value_heads);
    let n = inputs.slots.len();
    if n > MAX_SEQUENCES {
        return Err(Error::invalid(format!(
            "GDN: {n} sequences in one call (at most {MAX_SEQUENCES})"
        )));
    }
    let need = |what: &str, have: usize, want: usize| {
        if have == want {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "GDN: {what} has {have} values, the shape needs {want}"
            )))
        }
    };
    need(
        "the convolution weight",
        params.conv_weight.len(),
        channels * width,
    )?;
    if let Some(bias) = params.conv_bias {
        need("the convolution bias", bias.len(), channels)?;
    }
    need("A_log", params.a_log.len(), hv)?;
    need("dt_bias", params.dt_bias.len(), hv)?;
    need("the output", out_len, n * hv * shape.value_dim)?;
    let rows = |what: &str, len: usize, stride: usize, row: usize| -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let last = (n - 1)
            .checked_mul(stride)
            .and_then(|v| v.checked_add(row))
            .filter(|_| stride >= row)
            .ok_or_else(|| Error::invalid(format!("GDN: {what} rows overlap or overflow")))?;
        if len < last {
            return Err(Error::invalid(format!(
                "GDN: {what} has {len} values, {n} rows of stride {stride} need {last}"
            )));
        }
        Ok(())
    };
    rows("x", inputs.x.len(), inputs.x_stride, channels)?;
    rows("a", inputs.a.len(), inputs.gate_stride, hv)?;
    rows("b", inputs.b.len(), inputs.gate_stride, hv)?;
    // The last element a slot's window reaches, and its state.
    let conv_end = conv
        .slot_stride
        .checked_mul(conv.slots.saturating_sub(1))
        .and_then(|v| v.checked_add((channels - 1).checked_mul(conv.channel_stride)?))
        .and_then(|v| v.checked_add((width - 2).checked_mul(conv.step_stride)?))
        .ok_or_else(|| Error::invalid("GDN: convolution cache strides overflow"))?;
    if conv.slots > 0 && conv.data.len() <= conv_end {
        return Err(Error::invalid(format!(
            "GDN: the convolution cache has {} values, {} slots at these strides need {}",
            conv.data.len(),
            conv.slots,
            conv_end + 1
        )));
    }
    // Within a slot, no two (channel, step) pairs may share an element (the update moves them), and
    // slots must not overlap.
    let (cs, ss) = (conv.channel_stride, conv.step_stride);
    let steps_outer = width == 2 || ss >= cs.saturating_mul(channels);
    let channels_outer = cs >= ss.saturating_mul(width - 1);
    let slot_extent = (channels - 1) * cs + (width - 2) * ss + 1;
    if cs == 0
        || (width > 2 && ss == 0)
        || !(steps_outer || channels_outer)
        || (conv.slots > 1 && conv.slot_stride < slot_extent)
    {
        return Err(Error::invalid(format!(
            "GDN: convolution cache strides (slot {}, channel {cs}, step {ss}) overlap",
            conv.slot_stride
        )));
    }
    let state_len = shape.state_len();
    if state.slot_stride < state_len
        || (state.slots > 0
            && state
                .slot_stride
                .checked_mul(state.slots - 1)
                .and_then(|v| v.checked_add(state_len))
                .is_none_or(|end| state.data.len() < end))
    {
        return Err(Error::invalid(format!(
            "GDN: the state cache has {} values, {} slots of stride {} need {} each",
            state.data.len(),
            state.slots,
            state.slot_stride,
            state_len
        )));
    }
    for (t, &slot) in inputs.slots.iter().enumerate() {
        if slot < 0 || slot as usize >= conv.slots.min(state.slots) {
            return Err(Error::invalid(format!(
                "GDN: sequence {t}'s cache slot {slot} is outside 0..{}",
                conv.slots.min(state.slots)
            )));
        }
    }
    let mut seen: Vec<i32> = inputs.slots.to_vec();
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        let t = inputs.slots.iter().rposition(|&s| s == w[0]).unwrap_or(0);
        return Err(Error::invalid(format!(
            "GDN: sequence {t} uses cache slot {} that an earlier sequence of the call uses too",
            w[0]
        )));
    }
    Ok(n)
}

struct Job<'a> {
    shape: GdnShape,
    params: GdnParams<'a>,
    inputs: DecodeInputs<'a>,
    /// Each item writes only its own slot's channels, state heads and output rows (`plan`).
    conv: DisjointWrites<bf16>,
    conv_strides: (usize, usize, usize),
    state: DisjointWrites<f32>,
    state_stride: usize,
    out: DisjointWrites<bf16>,
}

impl Job<'_> {
    /// Sequence `t`, key head `kh`: its `q` and `k` channels and its value heads' `v` channels, then each
    /// of those value heads' state.
    ///
    /// # Safety
    /// `plan` passed and `kernel` runs here; no other item has the same `(t, kh)`.
    unsafe fn item(&self, t: usize, kh: usize, kernel: Kernel) {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller checked the CPU and the item.
            Kernel::Avx512 => unsafe { self.item_avx512(t, kh) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::Avx2 => unsafe { self.item_avx2(t, kh) },
            // SAFETY: as above.
            _ => unsafe { self.item_with::<false, false>(t, kh) },
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma,f16c")]
    unsafe fn item_avx512(&self, t: usize, kh: usize) {
        // SAFETY: the caller's.
        unsafe { self.item_with::<true, true>(t, kh) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn item_avx2(&self, t: usize, kh: usize) {
        // SAFETY: the caller's.
        unsafe { self.item_with::<true, false>(t, kh) }
    }

    /// `WIDE`: inside the AVX-512 build (its 128-wide heads' state update in registers).
    #[inline(always)]
    unsafe fn item_with<const FMA: bool, const WIDE: bool>(&self, t: usize, kh: usize) {
        let s = &self.shape;
        let (kd, vd, group) = (s.key_dim, s.value_dim, s.heads_per_key());
        let key_width = s.key_heads * kd;
        let slot = self.inputs.slots[t] as usize;
        let x = &self.inputs.x[t * self.inputs.x_stride..][..s.conv_channels()];
        let mut q = [0f32; MAX_HEAD_DIM];
        let mut k = [0f32; MAX_HEAD_DIM];
        let mut v = [0f32; MAX_HEAD_DIM];
        // SAFETY (the three convolutions and the heads): the channels of key head kh and of its value
        // heads, the state of those heads in slot `slot` and output rows (t, h) are this item's alone.
        unsafe {
            self.conv_run::<FMA>(slot, kh * kd, x, &mut q[..kd]);
            self.conv_run::<FMA>(slot, key_width + kh * kd, x, &mut k[..kd]);
        }
        normalize::<FMA>(&mut q[..kd], (kd as f32).sqrt().recip());
        normalize::<FMA>(&mut k[..kd], 1.0);
        for h in kh * group..(kh + 1) * group {
            unsafe {
                self.conv_run::<FMA>(slot, 2 * key_width + h * vd, x, &mut v[..vd]);
                self.head::<FMA, WIDE>(t, slot, h, &q[..kd], &k[..kd], &v[..vd]);
            }
        }
    }

    /// Convolution channels `first .. first + ys.len()` of the input row `x` in slot `slot`, [`LANES`] at
    /// a time.
    #[inline(always)]
    unsafe fn conv_run<const FMA: bool>(
        &self,
        slot: usize,
        first: usize,
        x: &[bf16],
        ys: &mut [f32],
    ) {
        for (i, chunk) in ys.chunks_mut(LANES).enumerate() {
            let mut lanes = [0f32; LANES];
            // SAFETY: the caller's channels.
            unsafe { self.conv_lanes::<FMA>(slot, first + i * LANES, chunk.len(), x, &mut lanes) };
            chunk.copy_from_slice(&lanes[..chunk.len()]);
        }
    }

    /// Convolution channels `c0 .. c0 + lanes` of sequence `t` (input row `x`) in slot `slot`: their
    /// outputs (bf16-rounded, as f32) to `ys`, and their windows moved on by one.
    #[inline(always)]
    unsafe fn conv_lanes<const FMA: bool>(
        &self,
        slot: usize,
        c0: usize,
        lanes: usize,
        x: &[bf16],
        ys: &mut [f32; LANES],
    ) {
        let w = self.shape.conv_width;
        let (ss, cs, st) = self.conv_strides;
        let weight = self.params.conv_weight;
        let mut win = [[0f32; LANES]; MAX_CONV_WIDTH];
        let mut taps = [[0f32; LANES]; MAX_CONV_WIDTH];
        // Channels c0 .. c0 + lanes of this slot lie inside the cache (plan) and are this item's: the
        // reads and writes through `at` below rely on it.
        let at = self.conv.at(slot * ss + c0 * cs);
        for j in 0..w - 1 {
            if cs == 1 && lanes == LANES {
                // vLLM's default layout: a step's channels are contiguous
                // SAFETY: this item's channels of step j, inside the cache (above).
                let src = unsafe { std::slice::from_raw_parts(at.add(j * st), LANES) };
                for l in 0..LANES {
                    win[j][l] = src[l].to_f32();
                }
            } else {
                for l in 0..lanes {
                    // SAFETY: as above.
                    win[j][l] = unsafe { *at.add(l * cs + j * st) }.to_f32();
                }
            }
        }
        for l in 0..lanes {
            win[w - 1][l] = x[c0 + l].to_f32();
            for j in 0..w {
                taps[j][l] = weight[(c0 + l) * w + j];
            }
        }
        let mut acc = [0f32; LANES];
        if let Some(bias) = self.params.conv_bias {
            acc[..lanes].copy_from_slice(&bias[c0..c0 + lanes]);
        }
        for j in 0..w {
            for l in 0..LANES {
                acc[l] = madd::<FMA>(taps[j][l], win[j][l], acc[l]);
            }
        }
        for l in 0..LANES {
            ys[l] = bf16::from_f32(silu(acc[l])).to_f32();
        }
        // The window moves on: step j takes step j + 1 (every value came from bf16: exact).
        for j in 0..w - 1 {
            for l in 0..lanes {
                // SAFETY: as above.
                unsafe { *at.add(l * cs + j * st) = bf16::from_f32(win[j + 1][l]) };
            }
        }
    }

    /// Value head `h` of sequence `t` (slot `slot`), given its normalized `q` and `k` and its `v`.
    #[inline(always)]
    unsafe fn head<const FMA: bool, const WIDE: bool>(
        &self,
        t: usize,
        slot: usize,
        h: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
    ) {
        let s = &self.shape;
        let (kd, vd) = (s.key_dim, s.value_dim);
        let row = t * self.inputs.gate_stride + h;
        let (a, b) = (self.inputs.a[row].to_f32(), self.inputs.b[row].to_f32());
        let (decay, beta) = gates(a, b, self.params.a_log[h], self.params.dt_bias[h]);
        // SAFETY: head h of this slot: kd · vd values inside the cache (plan), only this item's.
        let st = unsafe {
            self.state
                .slice(slot * self.state_stride + h * kd * vd, kd * vd)
        };
        // SAFETY: output row (t, h): vd values, only this item's.
        let out = unsafe { self.out.slice((t * s.value_heads + h) * vd, vd) };
        let mut o = [0f32; MAX_HEAD_DIM];
        #[cfg(target_arch = "x86_64")]
        if WIDE && vd == WIDE_HEAD {
            // SAFETY: `WIDE` only in the AVX-512 build (the CPU checked); a head of kd rows of 128.
            unsafe { delta_rule_avx512(st, k, q, v, decay, beta, &mut o) };
        } else {
            delta_rule::<FMA>(st, vd, k, q, v, decay, beta, &mut o[..vd]);
        }
        #[cfg(not(target_arch = "x86_64"))]
        delta_rule::<FMA>(st, vd, k, q, v, decay, beta, &mut o[..vd]);
        for (dst, &x) in out.iter_mut().zip(o.iter()) {
            *dst = bf16::from_f32(x);
        }
    }
}

/// One head's state update (`st`: `k.len()` rows of `vd`) and its output `o = Sᵀq`, in two passes down the
/// rows: `Sᵀk` of the decayed state, then `S ← e^g · S + k δᵀ` (the decay computed again, the same
/// rounding, rather than stored by the first pass: one store per value, not two) with `Sᵀq` summed.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn delta_rule<const FMA: bool>(
    st: &mut [f32],
    vd: usize,
    k: &[f32],
    q: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    o: &mut [f32],
) {
    let mut kv = [0f32; MAX_HEAD_DIM];
    let kv = &mut kv[..vd];
    let ahead = st.as_ptr().wrapping_add(PREFETCH_AHEAD);
    for (i, (row, &ki)) in st.chunks_exact(vd).zip(k).enumerate() {
        prefetch(ahead.wrapping_add(i * vd), vd);
        for (&sj, kvj) in row.iter().zip(kv.iter_mut()) {
            *kvj = madd::<FMA>(sj * decay, ki, *kvj);
        }
    }
    for (kvj, &vj) in kv.iter_mut().zip(v) {
        *kvj = (vj - *kvj) * beta;
    }
    for ((row, &ki), &qi) in st.chunks_exact_mut(vd).zip(k).zip(q) {
        for ((sj, &dj), oj) in row.iter_mut().zip(kv.iter()).zip(o.iter_mut()) {
            let x = madd::<FMA>(ki, dj, *sj * decay);
            *sj = x;
            *oj = madd::<FMA>(x, qi, *oj);
        }
    }
}

/// The value head size of Qwen3.5 / Qwen3-Next, whose state update has an AVX-512 build with its sums in
/// registers.
const WIDE_HEAD: usize = 128;

/// [`delta_rule`] for 128-wide heads on AVX-512: `Sᵀk`, `δ` and `Sᵀq` in 8 registers each (the generic
/// loop keeps them in memory: a store and a reload per row). The same operations in the same order as
/// `delta_rule::<true>`, so the same numbers bit for bit.
///
/// # Safety
/// AVX-512F and FMA are available; `st` holds `k.len()` rows of 128, `v` and `o` at least 128 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn delta_rule_avx512(
    st: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    o: &mut [f32],
) {
    use std::arch::x86_64::*;
    const U: usize = WIDE_HEAD / 16;
    assert!(
        st.len() == k.len() * WIDE_HEAD
            && q.len() == k.len()
            && v.len() >= WIDE_HEAD
            && o.len() >= WIDE_HEAD
    );
    let base = st.as_mut_ptr();
    let ahead = st.as_ptr().wrapping_add(PREFETCH_AHEAD);
    // SAFETY (whole body): row i's 128 values lie at base + 128·i inside `st` (asserted); prefetches do
    // not access memory.
    unsafe {
        let dec = _mm512_set1_ps(decay);
        let mut kv = [_mm512_setzero_ps(); U];
        for (i, &ki) in k.iter().enumerate() {
            prefetch(ahead.wrapping_add(i * WIDE_HEAD), WIDE_HEAD);
            let row = base.add(i * WIDE_HEAD);
            let kb = _mm512_set1_ps(ki);
            for u in 0..U {
                let x = _mm512_mul_ps(_mm512_loadu_ps(row.add(16 * u)), dec);
                kv[u] = _mm512_fmadd_ps(x, kb, kv[u]);
            }
        }
        let b = _mm512_set1_ps(beta);
        let delta: [__m512; U] = std::array::from_fn(|u| {
            _mm512_mul_ps(
                _mm512_sub_ps(_mm512_loadu_ps(v.as_ptr().add(16 * u)), kv[u]),
                b,
            )
        });
        let mut acc = [_mm512_setzero_ps(); U];
        for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
            let row = base.add(i * WIDE_HEAD);
            let (kb, qb) = (_mm512_set1_ps(ki), _mm512_set1_ps(qi));
            for u in 0..U {
                let decayed = _mm512_mul_ps(_mm512_loadu_ps(row.add(16 * u)), dec);
                let x = _mm512_fmadd_ps(kb, delta[u], decayed);
                _mm512_storeu_ps(row.add(16 * u), x);
                acc[u] = _mm512_fmadd_ps(x, qb, acc[u]);
            }
        }
        for u in 0..U {
            _mm512_storeu_ps(o.as_mut_ptr().add(16 * u), acc[u]);
        }
    }
}

/// Ask for the `len` f32 at `p` in L1 (a hint: it never faults, whatever `p` is).
#[inline(always)]
fn prefetch(p: *const f32, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..len).step_by(16) {
        // SAFETY: a prefetch does not access memory architecturally.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(line).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `x · sigmoid(x)` with `exp` of `−|x|` only (so the vectorizing `exp` serves both signs).
#[inline(always)]
fn silu(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    let s = if x >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    };
    x * s
}

/// `x ← x / √(Σx² + ε) · scale`.
#[inline(always)]
fn normalize<const FMA: bool>(x: &mut [f32], scale: f32) {
    let mut acc = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] = madd::<FMA>(c[l], c[l], acc[l]);
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        acc[l] = madd::<FMA>(v, v, acc[l]);
    }
    let sum: f32 = acc.iter().sum();
    let f = (sum + L2NORM_EPS).sqrt().recip() * scale;
    for v in x.iter_mut() {
        *v *= f;
    }
}

/// The decay `e^g` and `β` of one head and token.
fn gates(a: f32, b: f32, a_log: f32, dt_bias: f32) -> (f32, f32) {
    let z = a + dt_bias;
    let softplus = if z > SOFTPLUS_THRESHOLD {
        z
    } else {
        z.exp().ln_1p()
    };
    let g = -a_log.exp() * softplus;
    (g.exp(), 1.0 / (1.0 + (-b).exp()))
}

/// The float64 reference: the same step with every operation in f64 (the convolution's output rounded to
/// bf16 as in [`decode`], each head's state widened to f64 and rounded back to f32 once); updates `conv`
/// and `state_f32` in place and returns `[sequences][value_heads][value_dim]` outputs, unrounded.
pub fn decode_reference(
    step: &DecodeStep<'_>,
    conv: ConvCache<'_>,
    state_f32: StateCache<'_>,
) -> Result<Vec<f64>> {
    let (shape, params, inputs) = (&step.shape, &step.params, &step.inputs);
    let n = plan(
        shape,
        params,
        inputs,
        &conv,
        &state_f32,
        inputs.slots.len() * shape.value_heads * shape.value_dim,
    )?;
    let s = shape;
    let (kd, vd, w, channels) = (s.key_dim, s.value_dim, s.conv_width, s.conv_channels());
    let key_width = s.key_heads * kd;
    let mut out = vec![0f64; n * s.value_heads * vd];
    for t in 0..n {
        let slot = inputs.slots[t] as usize;
        let mut y = vec![0f64; channels];
        for (c, yc) in y.iter_mut().enumerate() {
            let at = slot * conv.slot_stride + c * conv.channel_stride;
            let mut win: Vec<f64> = (0..w - 1)
                .map(|j| conv.data[at + j * conv.step_stride].to_f64())
                .collect();
            win.push(inputs.x[t * inputs.x_stride + c].to_f64());
            let mut acc = params.conv_bias.map_or(0.0, |b| b[c] as f64);
            for j in 0..w {
                acc += params.conv_weight[c * w + j] as f64 * win[j];
            }
            let silu = acc / (1.0 + (-acc).exp());
            *yc = bf16::from_f64(silu).to_f64();
            for j in 0..w - 1 {
                conv.data[at + j * conv.step_stride] = bf16::from_f64(win[j + 1]);
            }
        }
        let norm = |v: &[f64], scale: f64| -> Vec<f64> {
            let f = scale / (v.iter().map(|x| x * x).sum::<f64>() + L2NORM_EPS as f64).sqrt();
            v.iter().map(|x| x * f).collect()
        };
        for h in 0..s.value_heads {
            let kh = h / s.heads_per_key();
            let q = norm(&y[kh * kd..][..kd], 1.0 / (kd as f64).sqrt());
            let k = norm(&y[key_width + kh * kd..][..kd], 1.0);
            let v = &y[2 * key_width + h * vd..][..vd];
            let row = t * inputs.gate_stride + h;
            let z = inputs.a[row].to_f64() + params.dt_bias[h] as f64;
            let softplus = if z > SOFTPLUS_THRESHOLD as f64 {
                z
            } else {
                z.exp().ln_1p()
            };
            let decay = (-(params.a_log[h] as f64).exp() * softplus).exp();
            let beta = 1.0 / (1.0 + (-inputs.b[row].to_f64()).exp());
            let st = &mut state_f32.data[slot * state_f32.slot_stride + h * kd * vd..][..kd * vd];
            let mut sm: Vec<f64> = st.iter().map(|&x| x as f64 * decay).collect();
            let mut delta = vec![0f64; vd];
            for j in 0..vd {
                let kv: f64 = (0..kd).map(|i| sm[i * vd + j] * k[i]).sum();
                delta[j] = (v[j] - kv) * beta;
            }
            for i in 0..kd {
                for j in 0..vd {
                    sm[i * vd + j] += k[i] * delta[j];
                }
            }
            for j in 0..vd {
                out[(t * s.value_heads + h) * vd + j] =
                    (0..kd).map(|i| sm[i * vd + j] * q[i]).sum();
            }
            for (dst, &x) in st.iter_mut().zip(&sm) {
                *dst = x as f32;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
