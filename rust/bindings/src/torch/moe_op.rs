//! The CPU kernel of `ternary_rs::ternary_moe`: one call per MoE layer runs the core's routed-experts
//! kernel (`ternary_core::kernels::cpu::moe`) on torch's intra-op pool, so a decode step pays one
//! dispatch and two parallel regions per layer instead of two GEMM calls per active expert.

use half::{bf16, f16};
use ternary_core::kernels::cpu::moe::{self, Experts, Routing};
use ternary_core::kernels::cpu::{layout, Activation, KernelChoice, PreparedRef};

use super::abi::Api;
use super::cpu_op::dtype_name;
use super::policy::{resolve_precision, variant};
use super::pool::TorchPool;
use super::tensor::Tensor;
use super::{api_for_schema, take_tensor};

/// The schema's argument count: x, topk_weights, topk_ids, w13_qweight, w13_scales, w2_qweight,
/// w2_scales, intermediate_size, w13_group_size, w2_group_size, activations,
/// apply_router_weight_on_input.
const NUM_ARGS: u64 = 12;
const OP: &str = "ternary_rs::ternary_moe";

cpu_boxed_op!(
    c"ternary_moe",
    OP,
    ternary_rs_cpu_moe_entry,
    ternary_rs_cpu_moe_boxed
);

unsafe fn boxed(stack: *mut u64, num_args: u64, num_outputs: u64) -> Result<(), String> {
    let api = api_for_schema(OP, (num_args, num_outputs), NUM_ARGS)?;
    // Own every tensor handle first, so all are freed whatever fails below.
    // SAFETY: arguments 0-6 are tensors (owned handles) by the schema.
    let t = |i| unsafe { take_tensor(api, stack, i) };
    let (x, weights, ids) = (t(0), t(1), t(2));
    let (w13q, w13s, w2q, w2s) = (t(3), t(4), t(5), t(6));
    // SAFETY: the stack holds NUM_ARGS entries.
    let arg = |i: usize| unsafe { *stack.add(i) } as i64;
    let int_arg = |i: usize, name: &str| -> Result<usize, String> {
        let v = arg(i);
        usize::try_from(v).map_err(|_| format!("{OP}: {name}={v} must be non-negative"))
    };
    let args = MoeArgs {
        inter: int_arg(7, "intermediate_size")?,
        g13: int_arg(8, "w13_group_size")?,
        g2: int_arg(9, "w2_group_size")?,
        activations: arg(10),
        weight_on_input: arg(11) != 0,
    };
    let out = run(api, x, weights, ids, [w13q, w13s, w2q, w2s], args)?;
    // SAFETY: outputs go to the front of the stack; ownership passes to torch.
    unsafe { *stack = out.into_raw() as u64 };
    Ok(())
}

struct MoeArgs {
    inter: usize,
    g13: usize,
    g2: usize,
    activations: i64,
    weight_on_input: bool,
}

/// `[rows, cols]` of a 2-D tensor, or an error naming it.
fn dims2(t: &Tensor<'_>, what: &str) -> Result<(usize, usize), String> {
    match *t.sizes()? {
        [a, b] => Ok((a as usize, b as usize)),
        ref s => Err(format!("{OP}: {what} must be 2-D, got shape {s:?}")),
    }
}

/// Every expert's prepared weight `[n, k]` in groups of `g`, checked to be the stacked uint8 / float16
/// tensors `ops.prepare_weight` makes (`[E, ...]`, contiguous, on the CPU).
fn stacked<'t>(
    api: &Api,
    q: &'t Tensor<'_>,
    s: &'t Tensor<'_>,
    (n, k, g): (usize, usize, usize),
    what: &str,
) -> Result<Vec<PreparedRef<'t>>, String> {
    ternary_core::canonical::check_shape(n.max(1), k, g)
        .map_err(|e| format!("{OP}: {what}: {e}"))?;
    let experts = q.sizes()?.first().copied().unwrap_or(0);
    let want_q = [
        experts,
        layout::row_blocks(n) as i64,
        layout::block_bytes(k) as i64,
    ];
    let want_s = [
        experts,
        layout::row_blocks(n) as i64,
        (layout::padded_groups(k, g) * layout::ROWS) as i64,
    ];
    for (t, dtype, want, part) in [
        (q, api.dtype_u8, want_q, "qweight"),
        (s, api.dtype_f16, want_s, "scales"),
    ] {
        if !t.is_cpu()? || t.dtype()? != dtype || t.sizes()? != want || !t.is_contiguous()? {
            return Err(format!(
                "{OP}: {what}_{part} must be the experts' prepared weights stacked on the CPU \
                 ({} {want:?}: ops.prepare_weight of a [{n}, {k}] g{g} weight per expert), got shape {:?}",
                if part == "qweight" { "uint8" } else { "float16" },
                t.sizes()?
            ));
        }
    }
    let planes = layout::prepared_bytes(n, k).ok_or("prepared weight size overflows")?;
    let scales = layout::prepared_scales(n, k, g).ok_or("prepared scales size overflows")?;
    let (qp, sp) = (q.data()? as *const u8, s.data()? as *const f16);
    Ok((0..experts as usize)
        .map(|e| {
            // SAFETY: contiguous tensors of exactly `experts` such weights (checked above), alive
            // (held by the caller's handles) for the lifetime 't of the borrows.
            unsafe {
                PreparedRef {
                    rows: n,
                    cols: k,
                    group_size: g,
                    layout: layout::Layout::Rows4,
                    planes: std::slice::from_raw_parts(qp.add(e * planes), planes),
                    scales: std::slice::from_raw_parts(sp.add(e * scales), scales),
                }
            }
        })
        .collect())
}

fn run<'a>(
    api: &'a Api,
    x: Tensor<'a>,
    weights: Tensor<'a>,
    ids: Tensor<'a>,
    [w13q, w13s, w2q, w2s]: [Tensor<'a>; 4],
    a: MoeArgs,
) -> Result<Tensor<'a>, String> {
    for (t, what) in [(&x, "x"), (&weights, "topk_weights"), (&ids, "topk_ids")] {
        if !t.is_cpu()? {
            return Err(format!("{OP} (CPU kernel): {what} is not a CPU tensor"));
        }
    }
    let (m, hidden) = dims2(&x, "x")?;
    let (wm, top_k) = dims2(&weights, "topk_weights")?;
    if dims2(&ids, "topk_ids")? != (m, top_k) || wm != m {
        return Err(format!(
            "{OP}: x {:?}, topk_weights {:?} and topk_ids {:?} must be [M, H], [M, k] and [M, k]",
            x.sizes()?,
            weights.sizes()?,
            ids.sizes()?
        ));
    }
    let dtype = x.dtype()?;
    let name = dtype_name(api, &x, OP)?;
    let w13 = stacked(api, &w13q, &w13s, (2 * a.inter, hidden, a.g13), "w13")?;
    let w2 = stacked(api, &w2q, &w2s, (hidden, a.inter, a.g2), "w2")?;
    if w13.len() != w2.len() {
        return Err(format!(
            "{OP}: {} experts' w13 but {} experts' w2",
            w13.len(),
            w2.len()
        ));
    }
    let x = x.contiguous_as(dtype)?;
    let weights = weights.contiguous_as(api.dtype_f32)?;
    let ids = ids.contiguous_as(api.dtype_i32)?;
    let y = Tensor::empty(api, &[m as i64, hidden as i64], dtype)?;
    if m == 0 || hidden == 0 {
        return Ok(y);
    }
    let precision = resolve_precision(a.activations, name == "float32")?;
    if super::warm_up_pass() {
        y.zero_cpu()?;
        return Ok(y);
    }
    // SAFETY: contiguous CPU tensors of the checked shapes and dtypes, alive for this call.
    let (wv, iv) = unsafe {
        (
            std::slice::from_raw_parts(weights.data()? as *const f32, m * top_k),
            std::slice::from_raw_parts(ids.data()? as *const i32, m * top_k),
        )
    };
    let routing = Routing {
        ids: iv,
        weights: wv,
        top_k,
        weight_on_input: a.weight_on_input,
    };
    let experts = Experts { w13: &w13, w2: &w2 };
    let choice = KernelChoice {
        variant: variant(),
        precision,
    };
    let call = Call {
        experts: &experts,
        routing: &routing,
        choice,
        pool: &TorchPool(api),
        m,
        hidden,
        x: x.data()? as usize,
        y: y.data()? as usize,
    };
    match name {
        "bfloat16" => call.run::<bf16>(),
        "float16" => call.run::<f16>(),
        _ => call.run::<f32>(),
    }?;
    Ok(y)
}

struct Call<'c> {
    experts: &'c Experts<'c>,
    routing: &'c Routing<'c>,
    choice: KernelChoice,
    pool: &'c TorchPool<'c>,
    m: usize,
    hidden: usize,
    x: usize,
    y: usize,
}

impl Call<'_> {
    fn run<T: Activation>(&self) -> Result<(), String> {
        let len = self.m * self.hidden;
        // SAFETY: x and y are the data of contiguous CPU tensors of `len` elements of T (checked
        // dtype and shape; y freshly allocated), alive for the call.
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts(self.x as *const T, len),
                std::slice::from_raw_parts_mut(self.y as *mut T, len),
            )
        };
        moe::moe(
            self.experts,
            x,
            self.m,
            self.routing,
            y,
            self.choice,
            self.pool,
        )
        .map_err(|e| format!("{OP}: {e}"))
    }
}
