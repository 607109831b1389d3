use proptest::prelude::*;
use proptest::test_runner::{RngAlgorithm, TestRng};

use super::*;
use crate::threads::{Rayon, Serial};

/// A layer, its caches and one step's inputs, from a seed.
struct Case {
    shape: GdnShape,
    conv_weight: Vec<f32>,
    conv_bias: Option<Vec<f32>>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    /// `[slots][channels][steps]` (`channel_first`) or `[slots][steps][channels]`.
    conv: Vec<bf16>,
    channel_first: bool,
    slots: usize,
    state: Vec<f32>,
    x: Vec<bf16>,
    a: Vec<bf16>,
    b: Vec<bf16>,
    seq_slots: Vec<i32>,
}

/// Values in [−1, 1) and indices below `n`, from proptest's deterministic generator.
struct Values(TestRng);

impl Values {
    fn new(seed: u64) -> Values {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        Values(TestRng::from_seed(RngAlgorithm::XorShift, &bytes))
    }
    fn next(&mut self) -> f32 {
        (self.0.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        self.0.next_u32() as usize % n
    }
}

impl Case {
    fn new(shape: GdnShape, sequences: usize, channel_first: bool, bias: bool, seed: u64) -> Case {
        let mut r = Values::new(seed);
        let channels = shape.conv_channels();
        let slots = sequences + 2;
        let mut free: Vec<i32> = (0..slots as i32).collect();
        let seq_slots = (0..sequences)
            .map(|_| free.remove(r.below(free.len())))
            .collect();
        let bf = |r: &mut Values, n: usize, scale: f32| -> Vec<bf16> {
            (0..n).map(|_| bf16::from_f32(r.next() * scale)).collect()
        };
        let f = |r: &mut Values, n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|_| r.next() * scale).collect()
        };
        Case {
            shape,
            conv_weight: f(&mut r, channels * shape.conv_width, 0.6),
            conv_bias: bias.then(|| f(&mut r, channels, 0.3)),
            a_log: f(&mut r, shape.value_heads, 1.0),
            dt_bias: f(&mut r, shape.value_heads, 1.0),
            conv: bf(&mut r, slots * channels * (shape.conv_width - 1), 1.5),
            channel_first,
            slots,
            state: f(&mut r, slots * shape.state_len(), 0.5),
            x: bf(&mut r, sequences * channels, 2.0),
            a: bf(&mut r, sequences * shape.value_heads, 3.0),
            b: bf(&mut r, sequences * shape.value_heads, 3.0),
            seq_slots,
        }
    }

    fn params(&self) -> GdnParams<'_> {
        GdnParams {
            conv_weight: &self.conv_weight,
            conv_bias: self.conv_bias.as_deref(),
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
        }
    }

    fn step(&self) -> DecodeStep<'_> {
        DecodeStep {
            shape: self.shape,
            params: self.params(),
            inputs: self.inputs(),
        }
    }

    fn inputs(&self) -> DecodeInputs<'_> {
        DecodeInputs {
            x: &self.x,
            x_stride: self.shape.conv_channels(),
            a: &self.a,
            b: &self.b,
            gate_stride: self.shape.value_heads,
            slots: &self.seq_slots,
        }
    }

    fn conv_cache<'a>(&self, data: &'a mut [bf16]) -> ConvCache<'a> {
        let (channels, steps) = (self.shape.conv_channels(), self.shape.conv_width - 1);
        let (channel_stride, step_stride) = if self.channel_first {
            (steps, 1)
        } else {
            (1, channels)
        };
        ConvCache {
            data,
            slots: self.slots,
            slot_stride: channels * steps,
            channel_stride,
            step_stride,
        }
    }

    fn state_cache<'a>(&self, data: &'a mut [f32]) -> StateCache<'a> {
        StateCache {
            data,
            slots: self.slots,
            slot_stride: self.shape.state_len(),
        }
    }

    /// One step by `kernel`: (outputs, conv cache, state cache) after it.
    fn run(
        &self,
        kernel: Kernel,
        par: &dyn ParallelFor,
    ) -> Result<(Vec<bf16>, Vec<bf16>, Vec<f32>)> {
        let (mut conv, mut state) = (self.conv.clone(), self.state.clone());
        let mut out =
            vec![bf16::ZERO; self.seq_slots.len() * self.shape.value_heads * self.shape.value_dim];
        decode(
            &self.step(),
            self.conv_cache(&mut conv),
            self.state_cache(&mut state),
            &mut out,
            kernel,
            par,
        )?;
        Ok((out, conv, state))
    }

    fn reference(&self) -> (Vec<f64>, Vec<bf16>, Vec<f32>) {
        let (mut conv, mut state) = (self.conv.clone(), self.state.clone());
        let out = decode_reference(
            &self.step(),
            self.conv_cache(&mut conv),
            self.state_cache(&mut state),
        )
        .unwrap();
        (out, conv, state)
    }
}

fn kernels() -> Vec<Kernel> {
    [Kernel::Avx512, Kernel::Avx2, Kernel::Portable]
        .into_iter()
        .filter(|k| k.is_supported())
        .collect()
}

/// Every build against the float64 reference: the window update exactly; the state within f32 rounding
/// of its terms (and of a one-ulp bf16 difference in a convolution output where f32 and f64 round it
/// apart); the outputs within bf16 rounding.
fn check_case(case: &Case) {
    let (want, want_conv, want_state) = case.reference();
    let out_scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-3);
    let state_scale = want_state
        .iter()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(1e-3);
    for kernel in kernels() {
        for par in [&Serial as &dyn ParallelFor, &Rayon] {
            let (out, conv, state) = case.run(kernel, par).unwrap();
            assert_eq!(conv, want_conv, "{kernel:?}: convolution windows");
            for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
                let err = (o.to_f64() - w).abs();
                assert!(
                    err <= 8e-3 * w.abs() + 1e-2 * out_scale,
                    "{kernel:?}: output {i}: {o} vs {w}"
                );
            }
            for (i, (&s, &w)) in state.iter().zip(&want_state).enumerate() {
                let err = (s - w).abs();
                assert!(
                    err <= 1e-4 * w.abs() + 1e-2 * state_scale,
                    "{kernel:?}: state {i}: {s} vs {w}"
                );
            }
            // slots no sequence uses are untouched
            let per = case.shape.state_len();
            for slot in 0..case.slots {
                if !case.seq_slots.contains(&(slot as i32)) {
                    assert_eq!(state[slot * per..][..per], case.state[slot * per..][..per]);
                }
            }
        }
    }
}

#[test]
fn bonsai_2_widths() {
    // Qwen3.5-27B / Bonsai 2: 16 key heads, 48 value heads, 128 / 128, width 4.
    let shape = GdnShape {
        key_heads: 16,
        value_heads: 48,
        key_dim: 128,
        value_dim: 128,
        conv_width: 4,
    };
    for (sequences, channel_first) in [(1, false), (3, true)] {
        check_case(&Case::new(
            shape,
            sequences,
            channel_first,
            false,
            sequences as u64,
        ));
    }
}

#[test]
fn the_avx512_head_update_is_the_generic_fma_one_bit_for_bit() {
    let shape = GdnShape {
        key_heads: 2,
        value_heads: 6,
        key_dim: 128,
        value_dim: 128,
        conv_width: 4,
    };
    if !(Kernel::Avx512.is_supported() && Kernel::Avx2.is_supported()) {
        return;
    }
    let case = Case::new(shape, 3, false, true, 5);
    assert_eq!(
        case.run(Kernel::Avx512, &Serial).unwrap(),
        case.run(Kernel::Avx2, &Serial).unwrap()
    );
}

#[test]
fn the_state_stays_close_over_many_steps() {
    // 40 steps fed back: errors must not grow into a different state.
    let shape = GdnShape {
        key_heads: 2,
        value_heads: 4,
        key_dim: 32,
        value_dim: 32,
        conv_width: 4,
    };
    let mut case = Case::new(shape, 2, false, true, 7);
    let (mut conv_ref, mut state_ref) = (case.conv.clone(), case.state.clone());
    let mut rng = Values::new(99);
    for _ in 0..40 {
        case.x = case
            .x
            .iter()
            .map(|_| bf16::from_f32(rng.next() * 2.0))
            .collect();
        let (_, conv, state) = case.run(Kernel::best(), &Serial).unwrap();
        let reference = Case {
            conv: conv_ref.clone(),
            state: state_ref.clone(),
            ..case.clone_inputs()
        };
        let (_, c, s) = reference.reference();
        (conv_ref, state_ref) = (c, s);
        case.conv = conv;
        case.state = state;
    }
    for (s, w) in case.state.iter().zip(&state_ref) {
        assert!((s - w).abs() <= 1e-3 + 1e-3 * w.abs(), "{s} vs {w}");
    }
}

impl Case {
    fn clone_inputs(&self) -> Case {
        Case {
            shape: self.shape,
            conv_weight: self.conv_weight.clone(),
            conv_bias: self.conv_bias.clone(),
            a_log: self.a_log.clone(),
            dt_bias: self.dt_bias.clone(),
            conv: self.conv.clone(),
            channel_first: self.channel_first,
            slots: self.slots,
            state: self.state.clone(),
            x: self.x.clone(),
            a: self.a.clone(),
            b: self.b.clone(),
            seq_slots: self.seq_slots.clone(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn every_build_matches_the_reference(
        key_heads in 1usize..4, group in 1usize..4, key_dim in 1usize..40, value_dim in prop::sample::select(vec![16usize, 32, 48]),
        width in 2usize..6, sequences in 1usize..6, channel_first: bool, bias: bool, seed: u64,
    ) {
        let shape = GdnShape { key_heads, value_heads: key_heads * group, key_dim, value_dim, conv_width: width };
        check_case(&Case::new(shape, sequences, channel_first, bias, seed));
    }
}

#[test]
fn refusals_name_the_problem_and_write_nothing() {
    let shape = GdnShape {
        key_heads: 2,
        value_heads: 4,
        key_dim: 16,
        value_dim: 16,
        conv_width: 4,
    };
    let base = Case::new(shape, 3, false, false, 3);
    let refused = |case: &Case, needle: &str| {
        let (mut conv, mut state) = (case.conv.clone(), case.state.clone());
        let mut out = vec![bf16::ZERO; case.seq_slots.len() * 4 * 16];
        let err = decode(
            &case.step(),
            case.conv_cache(&mut conv),
            case.state_cache(&mut state),
            &mut out,
            Kernel::Portable,
            &Serial,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(needle), "{err}");
        assert_eq!(conv, case.conv);
        assert_eq!(state, case.state);
        assert!(out.iter().all(|v| *v == bf16::ZERO));
    };
    let mut dup = base.clone_inputs();
    dup.seq_slots[2] = dup.seq_slots[0];
    refused(&dup, "sequence 2 uses cache slot");
    let mut outside = base.clone_inputs();
    outside.seq_slots[1] = outside.slots as i32;
    refused(&outside, "sequence 1's cache slot");
    let mut negative = base.clone_inputs();
    negative.seq_slots[0] = -1;
    refused(&negative, "sequence 0's cache slot -1");
    let mut short = base.clone_inputs();
    short.x.pop();
    refused(&short, "x has");
    let mut bad = base.clone_inputs();
    bad.shape.value_heads = 3;
    refused(&bad, "not a positive multiple");
    let mut odd = base.clone_inputs();
    odd.shape.value_dim = 20;
    refused(&odd, "not a multiple of 16");
}
