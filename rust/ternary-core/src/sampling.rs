//! Top-k / top-p (nucleus) masking of a batch of logits, in place: what vLLM's `apply_top_k_top_p`
//! does on CPU, without its sort of the whole vocabulary per row (a 248 320-entry sort per sequence and
//! step: ~18 ms for one row, ~640 ms for 64, more than the model's own step at 1.7B).
//!
//! Per row, with vLLM's rules (`vllm/v1/sample/ops/topk_topp_sampler.py`):
//! * **top-k** keeps every logit `>=` the k-th largest (ties with it included); `k <= 0` or `k >= vocab`
//!   keeps all. A selection (`select_nth_unstable`), not a sort.
//! * **top-p** then keeps, among those, every token whose higher-ranked tokens hold less than `p` of the
//!   probability (softmax over what top-k kept): the largest always stays. The boundary is found by a
//!   three-way partition search over the logits carrying their probability mass (expected linear time),
//!   not a sort. vLLM ranks tokens of equal logit in its (unstable) sort order and can cut a run of ties
//!   in two; here a token's rank is "strictly larger logit", so a run of ties is kept or dropped whole
//!   (the kept set is vLLM's, or it plus the rest of the boundary's ties). `p >= 1` keeps all (vLLM drops
//!   only tokens whose f32 probability is exactly 0 there, which sampling can never pick). The mass is
//!   summed in f64; vLLM's f32 cumulative sum can move a boundary token whose mass sits within its
//!   rounding of `p`.
//!
//! [`reference_row`] is the same by a full sort (tests).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::threads::{DisjointWrites, ParallelFor};
use crate::{Error, Result};

/// Largest vocabulary a row may have (logit index in 32 bits, and a bound on scratch space).
pub const MAX_VOCAB: usize = 1 << 26;

/// Mask to `-inf`, in place, every logit of the `logits.len() / vocab` rows outside the row's top-k
/// (`k[row]`, if given) and then its top-p (`p[row]`, if given) set, rows split over `par`.
///
/// Refused (nothing written): lengths that do not match, a `p` that is not in `(0, 1]`, a NaN logit (the
/// error names the row and column; vLLM's own sort decides what NaN means there).
pub fn mask_top_k_top_p(
    logits: &mut [f32],
    vocab: usize,
    k: Option<&[i64]>,
    p: Option<&[f32]>,
    par: &dyn ParallelFor,
) -> Result<()> {
    if vocab == 0 || vocab > MAX_VOCAB || !logits.len().is_multiple_of(vocab) {
        return Err(Error::invalid(format!(
            "top-k / top-p: {} logits are not rows of a vocabulary of {vocab} (at most {MAX_VOCAB})",
            logits.len()
        )));
    }
    let rows = logits.len() / vocab;
    for (what, len) in [("k", k.map(<[i64]>::len)), ("p", p.map(<[f32]>::len))] {
        if len.is_some_and(|l| l != rows) {
            return Err(Error::invalid(format!(
                "top-k / top-p: {what} has {len:?} entries for {rows} rows"
            )));
        }
    }
    if let Some((row, bad)) = p
        .into_iter()
        .flatten()
        .enumerate()
        .find(|(_, &x)| !(x > 0.0 && x <= 1.0))
    {
        return Err(Error::invalid(format!(
            "top-p of row {row} is {bad}, not in (0, 1]"
        )));
    }
    if let Some(i) = first_nan(logits, vocab, par) {
        return Err(Error::invalid(format!(
            "top-k / top-p: logit of row {}, token {} is NaN",
            i / vocab,
            i % vocab
        )));
    }
    let out = DisjointWrites::new(logits);
    par.run(rows, &|range| {
        let mut scratch = Scratch::default();
        for row in range {
            // SAFETY: rows are disjoint `vocab`-long slices of `logits`, each handed to one task.
            let x = unsafe { out.slice(row * vocab, vocab) };
            let limit_k = k.map_or(0, |k| usize::try_from(k[row]).unwrap_or(0));
            mask_row(x, limit_k, p.map(|p| p[row]), &mut scratch);
        }
    });
    Ok(())
}

/// Where the first NaN logit is, if any: rows checked on `par`, each in 64-logit chunks whose check the
/// compiler vectorises (a scan that stops at the first NaN is one compare per logit: as long as the
/// masking itself for a top-k row).
fn first_nan(logits: &[f32], vocab: usize, par: &dyn ParallelFor) -> Option<usize> {
    let first = AtomicUsize::new(usize::MAX);
    par.run(logits.len() / vocab, &|range| {
        for row in range {
            let x = &logits[row * vocab..(row + 1) * vocab];
            if x.chunks(64)
                .any(|c| c.iter().fold(false, |nan, v| nan | v.is_nan()))
            {
                let at = x.iter().position(|v| v.is_nan()).unwrap_or(0);
                first.fetch_min(row * vocab + at, Ordering::Relaxed);
            }
        }
    });
    Some(first.into_inner()).filter(|&i| i != usize::MAX)
}

/// Per task: a copy of a row (the top-k selection) and the top-p candidates with their mass.
#[derive(Default)]
struct Scratch {
    values: Vec<f32>,
    candidates: Vec<(f32, f64)>,
}

/// One row (no NaN): the smallest logit kept, and everything below it set to `-inf`.
fn mask_row(row: &mut [f32], k: usize, p: Option<f32>, s: &mut Scratch) {
    let floor = top_k_floor(row, k, &mut s.values);
    let floor = match p.filter(|&p| p < 1.0) {
        Some(p) => top_p_floor(row, floor, p, &mut s.candidates),
        None => floor,
    };
    if floor > f32::NEG_INFINITY {
        for x in row.iter_mut().filter(|x| **x < floor) {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// The k-th largest logit (`-inf`: top-k keeps all).
fn top_k_floor(row: &[f32], k: usize, values: &mut Vec<f32>) -> f32 {
    if k == 0 || k >= row.len() {
        return f32::NEG_INFINITY;
    }
    values.clear();
    values.extend_from_slice(row);
    let at = row.len() - k;
    *values.select_nth_unstable_by(at, f32::total_cmp).1
}

/// The smallest logit top-p keeps among those `>= floor`: the smallest `x` whose strictly larger
/// candidates hold less than `p` of the candidates' softmax mass.
fn top_p_floor(row: &[f32], floor: f32, p: f32, candidates: &mut Vec<(f32, f64)>) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return floor; // every token already masked
    }
    candidates.clear();
    let mut total = 0f64;
    for &x in row.iter().filter(|&&x| x >= floor) {
        let e = f64::from((x - max).exp()); // f32 exp, as vLLM's f32 softmax
        total += e;
        candidates.push((x, e));
    }
    let target = f64::from(p) * total;
    // Invariant: `above` is the mass of every candidate larger than all of `w`, and `above < target`
    // (so all of those are kept); the answer lies in `w`.
    let mut above = 0f64;
    let mut w: &mut [(f32, f64)] = candidates;
    loop {
        let pivot = median_of_three(w);
        let (greater, equal) = partition3(w, pivot);
        let mass = |s: &[(f32, f64)]| s.iter().map(|c| c.1).sum::<f64>();
        let m_greater = mass(&w[..greater]);
        if above + m_greater >= target {
            // The pivot's ties and all below are dropped; the boundary is among the larger ones (not
            // empty: above < target).
            w = &mut w[..greater];
            continue;
        }
        // The pivot's ties are kept (what is above them holds less than p).
        above += m_greater + mass(&w[greater..greater + equal]);
        let rest = &mut w[greater + equal..];
        if above >= target || rest.is_empty() {
            return pivot;
        }
        w = rest;
    }
}

/// A pivot value from the window (median of its first, middle and last logits).
fn median_of_three(w: &[(f32, f64)]) -> f32 {
    let (a, b, c) = (w[0].0, w[w.len() / 2].0, w[w.len() - 1].0);
    a.max(b).min(a.min(b).max(c))
}

/// Reorder `w` as `[> pivot][== pivot][< pivot]`; the first two lengths.
fn partition3(w: &mut [(f32, f64)], pivot: f32) -> (usize, usize) {
    let (mut lt, mut i, mut gt) = (0, 0, w.len());
    // Dutch national flag, largest first: [0, lt) > pivot, [lt, i) == pivot, [gt, len) < pivot.
    while i < gt {
        let x = w[i].0;
        if x > pivot {
            w.swap(lt, i);
            lt += 1;
            i += 1;
        } else if x < pivot {
            gt -= 1;
            w.swap(i, gt);
        } else {
            i += 1;
        }
    }
    (lt, gt - lt)
}

/// [`mask_top_k_top_p`] of one row by a full sort (descending, ties together), for the tests: what the
/// partition search must reproduce exactly.
pub fn reference_row(row: &mut [f32], k: usize, p: Option<f32>) {
    let mut sorted: Vec<f32> = row.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut floor = if k == 0 || k >= row.len() {
        f32::NEG_INFINITY
    } else {
        sorted[k - 1]
    };
    if let Some(p) = p.filter(|&p| p < 1.0) {
        let max = sorted[0];
        if max > f32::NEG_INFINITY {
            let kept: Vec<f32> = sorted.iter().copied().filter(|&x| x >= floor).collect();
            let e: Vec<f64> = kept.iter().map(|&x| f64::from((x - max).exp())).collect();
            let target = f64::from(p) * e.iter().sum::<f64>();
            // Walk runs of equal logits from the top: a run is kept while what is above it is < target.
            let (mut above, mut i) = (0f64, 0);
            while i < kept.len() && above < target {
                floor = kept[i];
                let mut j = i;
                while j < kept.len() && kept[j] == kept[i] {
                    above += e[j];
                    j += 1;
                }
                i = j;
            }
        }
    }
    for x in row.iter_mut().filter(|x| **x < floor) {
        *x = f32::NEG_INFINITY;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads::Serial;
    use proptest::prelude::*;

    fn masked(row: &[f32], k: i64, p: Option<f32>) -> Vec<f32> {
        let mut x = row.to_vec();
        let ps = p.map(|p| vec![p]);
        mask_top_k_top_p(&mut x, row.len(), Some(&[k]), ps.as_deref(), &Serial).unwrap();
        x
    }

    fn reference(row: &[f32], k: i64, p: Option<f32>) -> Vec<f32> {
        let mut x = row.to_vec();
        reference_row(&mut x, usize::try_from(k).unwrap_or(0), p);
        x
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        /// Logits from a few distinct values (many ties, as bf16 logits have) or spread out, any k and
        /// p: the partition search keeps exactly what the full sort keeps.
        #[test]
        fn matches_the_sort(
            raw in prop::collection::vec(-40i32..40, 1..300),
            spread in prop::bool::ANY,
            k in -2i64..320,
            p in prop::option::of(0.001f32..1.0),
        ) {
            let row: Vec<f32> = raw.iter().enumerate()
                .map(|(i, &v)| if spread { v as f32 * 0.37 + i as f32 * 1e-3 } else { v as f32 * 0.25 })
                .collect();
            prop_assert_eq!(masked(&row, k, p), reference(&row, k, p));
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities 0.5, 0.25, 0.125, 0.125: p = 0.4 keeps the top one, 0.7 the top two; from just
        // above 0.75 the two tied last ones too (together).
        let ln2 = std::f32::consts::LN_2;
        let row = [0.0, -ln2, -2.0 * ln2, -2.0 * ln2];
        let kept = |p: f32| {
            masked(&row, 0, Some(p))
                .iter()
                .filter(|x| x.is_finite())
                .count()
        };
        assert_eq!(kept(0.4), 1);
        assert_eq!(kept(0.7), 2);
        assert_eq!(kept(0.76), 4); // the last two are tied: kept together
        assert_eq!(kept(1.0), 4);
    }

    #[test]
    fn top_k_keeps_ties_and_never_everything_masked() {
        let row = [1.0, 3.0, 3.0, 2.0, f32::NEG_INFINITY];
        assert_eq!(
            masked(&row, 1, None),
            [
                f32::NEG_INFINITY,
                3.0,
                3.0,
                f32::NEG_INFINITY,
                f32::NEG_INFINITY
            ]
        );
        assert_eq!(masked(&row, 5, None), row);
        assert_eq!(masked(&row, 0, None), row);
        let all_masked = [f32::NEG_INFINITY; 3];
        assert_eq!(masked(&all_masked, 1, Some(0.5)), all_masked);
    }

    #[test]
    fn refuses_bad_input_without_writing() {
        let mut x = vec![0.0f32, 1.0, f32::NAN, 2.0];
        let e = mask_top_k_top_p(&mut x, 2, None, Some(&[0.5, 0.5]), &Serial).unwrap_err();
        assert!(e.to_string().contains("row 1, token 0"), "{e}");
        assert_eq!(x[1], 1.0);
        let mut x = vec![0.0f32; 4];
        assert!(mask_top_k_top_p(&mut x, 2, None, Some(&[0.5, 0.0]), &Serial).is_err());
        assert!(mask_top_k_top_p(&mut x, 3, None, None, &Serial).is_err());
        assert!(mask_top_k_top_p(&mut x, 2, Some(&[1]), None, &Serial).is_err());
    }
}
