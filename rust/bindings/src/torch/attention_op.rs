//! The CPU kernel of `ternary_rs::decode_attention`: one decode step's attention over vLLM's paged CPU KV
//! cache (`ternary_core::attention`) on torch's intra-op pool, written into the caller's output tensor.

use half::{bf16, f16};
use ternary_core::attention::{
    self, AttentionParams, CacheShape, DecodeBatch, DecodeStep, HeadStrides, PagedKvCache,
};
use ternary_core::element::Element;

use super::abi::Api;
use super::policy::float_kernel;
use super::pool::TorchPool;
use super::tensor::Tensor;
use super::{api_for, take_tensor};

/// The schema's argument count: out, query, kv_cache, seq_lens, block_table, scale, sliding_window, softcap.
const NUM_ARGS: u64 = 8;
const OP: &str = "ternary_rs::decode_attention";

cpu_boxed_op!(
    c"decode_attention",
    OP,
    ternary_rs_cpu_attention_entry,
    ternary_rs_cpu_attention_boxed
);

unsafe fn boxed(stack: *mut u64, num_args: u64, num_outputs: u64) -> Result<(), String> {
    let api = api_for(OP, (num_args, num_outputs), NUM_ARGS, 0)?;
    // Own every tensor handle first, so all are freed whatever fails below.
    // SAFETY: by the schema, 0-4 are tensors, 5 and 7 floats (an f64's bits), 6 an int.
    let (out, query, kv_cache, seq_lens, block_table, scale, window, softcap) = unsafe {
        (
            take_tensor(api, stack, 0),
            take_tensor(api, stack, 1),
            take_tensor(api, stack, 2),
            take_tensor(api, stack, 3),
            take_tensor(api, stack, 4),
            f64::from_bits(*stack.add(5)),
            *stack.add(6) as i64,
            f64::from_bits(*stack.add(7)),
        )
    };
    let params = AttentionParams {
        scale: scale as f32,
        sliding_window: usize::try_from(window).ok().filter(|&w| w > 0),
        softcap: (softcap > 0.0).then_some(softcap as f32),
    };
    let args = Args {
        api,
        out,
        query,
        kv_cache,
        seq_lens,
        block_table,
        params,
    };
    let dtype = args.query.dtype()?;
    if dtype == api.dtype_bf16 {
        args.run::<bf16>(dtype)
    } else if dtype == api.dtype_f16 {
        args.run::<f16>(dtype)
    } else if dtype == api.dtype_f32 {
        args.run::<f32>(dtype)
    } else {
        Err(format!(
            "{OP}: query dtype is not supported; use bfloat16, float16 or float32"
        ))
    }
}

struct Args<'a> {
    api: &'a Api,
    out: Tensor<'a>,
    query: Tensor<'a>,
    kv_cache: Tensor<'a>,
    seq_lens: Tensor<'a>,
    block_table: Tensor<'a>,
    params: AttentionParams,
}

/// A tensor's elements as a byte range, to refuse an output that overlaps an input.
fn bytes(ptr: *const u8, len: usize, elem: usize) -> std::ops::Range<usize> {
    ptr as usize..ptr as usize + len * elem
}

impl Args<'_> {
    /// The call with `T` the element type of `dtype`, the query's.
    fn run<T: Element>(&self, dtype: i32) -> Result<(), String> {
        let api = self.api;
        let tensors = [
            (&self.out, "out"),
            (&self.query, "query"),
            (&self.kv_cache, "kv_cache"),
            (&self.seq_lens, "seq_lens"),
            (&self.block_table, "block_table"),
        ];
        for (t, what) in tensors {
            if !t.is_cpu()? {
                return Err(format!("{OP}: {what} is not a CPU tensor"));
            }
        }
        for (t, what) in [(&self.out, "out"), (&self.kv_cache, "kv_cache")] {
            if t.dtype()? != dtype {
                return Err(format!("{OP}: {what} must have the query's dtype"));
            }
        }
        for (t, what) in [
            (&self.seq_lens, "seq_lens"),
            (&self.block_table, "block_table"),
        ] {
            if t.dtype()? != api.dtype_i32 {
                return Err(format!("{OP}: {what} must be int32"));
            }
        }
        let (n, heads, d, q_rows) = match (self.query.sizes()?, self.query.strides()?) {
            (&[n, h, d], &[s0, s1, 1]) if s0 >= 0 && s1 >= 0 => (
                n as usize,
                h as usize,
                d as usize,
                HeadStrides {
                    tokens: n as usize,
                    heads: h as usize,
                    token_stride: s0 as usize,
                    head_stride: s1 as usize,
                },
            ),
            (s, st) => {
                return Err(format!(
                    "{OP}: query must be [tokens, heads, head_size] with unit stride in the last dimension, \
                     got shape {s:?}, strides {st:?}"
                ))
            }
        };
        let out_rows = match (self.out.sizes()?, self.out.strides()?) {
            (&[on, oh, od], &[s0, s1, 1])
                if [on, oh, od] == [n as i64, heads as i64, d as i64] && s0 >= 0 && s1 >= 0 =>
            {
                HeadStrides {
                    tokens: n,
                    heads,
                    token_stride: s0 as usize,
                    head_stride: s1 as usize,
                }
            }
            (&[on, ohd], &[s0, 1]) if [on, ohd] == [n as i64, (heads * d) as i64] && s0 >= 0 => {
                HeadStrides {
                    tokens: n,
                    heads,
                    token_stride: s0 as usize,
                    head_stride: d,
                }
            }
            (s, st) => {
                return Err(format!(
                "{OP}: out must be [{n}, {heads}, {d}] or [{n}, {}] with unit stride in the last \
                     dimension, got shape {s:?}, strides {st:?}",
                heads * d
            ))
            }
        };
        // inner dimensions contiguous; blocks and heads at any stride (vLLM pads hybrid models' pages)
        let shape = match (self.kv_cache.sizes()?, self.kv_cache.strides()?) {
            (&[b, h, bs, dd], &[sb, sh, s2, 1])
                if dd == 2 * d as i64 && s2 == dd && sb >= 0 && sh >= 0 =>
            {
                CacheShape {
                    blocks: b as usize,
                    block_stride: sb as usize,
                    kv_heads: h as usize,
                    head_stride: sh as usize,
                    block_size: bs as usize,
                    head_dim: d,
                }
            }
            (s, st) => {
                return Err(format!(
                    "{OP}: kv_cache must be [blocks, kv_heads, block_size, {}] with contiguous last two \
                     dimensions, got shape {s:?}, strides {st:?}",
                    2 * d
                ))
            }
        };
        if self.seq_lens.sizes()? != [n as i64] || !self.seq_lens.is_contiguous()? {
            return Err(format!(
                "{OP}: seq_lens must be a contiguous [{n}] (one per query token), got shape {:?}",
                self.seq_lens.sizes()?
            ));
        }
        let (width, table_stride) =
            match (self.block_table.sizes()?, self.block_table.strides()?) {
                (&[r, w], &[s0, 1]) if r >= n as i64 && s0 >= 0 => (w as usize, s0 as usize),
                (&[r, 0], _) if r >= n as i64 => (0, 0),
                (s, st) => {
                    return Err(format!(
                        "{OP}: block_table must be [>= {n}, blocks] with unit stride in the last dimension, \
                         got shape {s:?}, strides {st:?}"
                    ))
                }
            };
        if n == 0 {
            return Ok(());
        }
        let elem = std::mem::size_of::<T>();
        let overflow = |what: &str| format!("{OP}: {what}'s strides overflow");
        let q_len = q_rows.values(d).ok_or_else(|| overflow("query"))?;
        let out_len = out_rows.values(d).ok_or_else(|| overflow("out"))?;
        let kv_len = shape.values().ok_or_else(|| overflow("kv_cache"))?;
        // the rows of the n sequences (a longer table's other rows are not read)
        let table_len = if width == 0 {
            0
        } else {
            (n - 1)
                .checked_mul(table_stride)
                .and_then(|v| v.checked_add(width))
                .ok_or_else(|| overflow("block_table"))?
        };
        let (qp, op, kp) = (
            self.query.data()? as *const u8,
            self.out.data()? as *mut u8,
            self.kv_cache.data()? as *const u8,
        );
        let (sp, tp) = (
            self.seq_lens.data()? as *const u8,
            self.block_table.data()? as *const u8,
        );
        let written = bytes(op, out_len, elem);
        for (r, what) in [
            (bytes(qp, q_len, elem), "query"),
            (bytes(kp, kv_len, elem), "kv_cache"),
            (bytes(sp, n, 4), "seq_lens"),
            (bytes(tp, table_len, 4), "block_table"),
        ] {
            if r.start < written.end && written.start < r.end {
                return Err(format!("{OP}: out overlaps {what}"));
            }
        }
        // SAFETY: CPU tensors of T (query, out, kv_cache: dtypes checked) and i32 (seq_lens, block_table)
        // whose strides address the lengths computed above, alive for the call; `out` overlaps none of
        // them (checked), and the kernel checks every index it derives from the data.
        let (query, out, kv, seq_lens, table) = unsafe {
            (
                std::slice::from_raw_parts(qp as *const T, q_len),
                std::slice::from_raw_parts_mut(op as *mut T, out_len),
                std::slice::from_raw_parts(kp as *const T, kv_len),
                std::slice::from_raw_parts(sp as *const i32, n),
                std::slice::from_raw_parts(tp as *const i32, table_len),
            )
        };
        let cache = PagedKvCache::strided(kv, shape).map_err(|e| format!("{OP}: {e}"))?;
        let batch = DecodeBatch {
            seq_lens,
            block_table: table,
            blocks_per_seq: width,
            block_table_stride: table_stride,
        };
        // the build the CPU kernel variant names (forced by `TERNARY_RS_CPU_KERNEL` for comparisons)
        let kernel = float_kernel();
        let step = DecodeStep {
            query,
            query_rows: q_rows,
            cache,
            batch,
            params: self.params,
        };
        attention::decode_attention_with(kernel, &step, out, out_rows, &TorchPool(api))
            .map_err(|e| format!("{OP}: {e}"))
    }
}
