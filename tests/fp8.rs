//! FP8 with current scaling (`device.dtype = "fp8"`, `src/ops/fp8.rs`), on the CPU reference.
//!
//! The error the formats predict, stated once: a cast rounds a normal number x to within
//! u·|x| (u = 2⁻⁴ in E4M3, 2⁻³ in E5M2), a subnormal to within half the subnormal step (divided
//! by the tensor's scale). For numbers spread over their binade as Benford's law says (as a
//! Gaussian's are, near enough), the rounding error's root mean square is 2⁻ᵐ·√(0.541/12) =
//! 0.212·2⁻ᵐ of the number (m mantissa bits): r = 2.65% in E4M3, 5.31% in E5M2. A GEMM output
//! is a sum of products whose errors are independent, so its relative error (over the whole
//! output) is √(r_a² + r_b²): 3.75% forward (E4M3 × E4M3), 5.94% for both backward GEMMs
//! (E5M2 × E4M3). Each element is bounded by the worst case, Σ_k (e_a|b| + |a|e_b + e_a·e_b)
//! with e = u·|x| + the subnormal half-step, plus the bf16 rounding of the output.
//!
//! Checked here: the casts against every number of both formats; one GEMM against the worst case
//! element by element and against the root mean square from both sides (a GEMM that skipped the
//! cast would fail the lower side); the gradients of one training step, where the errors of the
//! GEMMs between the loss and a parameter add in quadrature; and the curve: FP8 trains within 2%
//! of bf16's final loss, alone and with tp, dp (ZeRO-3) and pp.

mod common;

use ferrotron::config::Config;
use ferrotron::model::init::normal;
use ferrotron::model::llama::pipeline::{StageGrad, StageInput, StageOutput};
use ferrotron::model::split::Now;
use ferrotron::model::Llama;
use ferrotron::ops::fp8::Fp8;
use ferrotron::ops::precision::gemms;
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::{self, Precision};

/// The non-negative finite values of `f`, by code (0x00, 0x01, …): from the bits, sign 0,
/// exponent (bias 7 or 15), mantissa; codes grow with the values, so an even code is an even
/// mantissa.
fn values_by_code(f: Fp8) -> Vec<f32> {
    let (m_bits, bias, finite_codes) = match f {
        Fp8::E4M3 => (3, 7, 127),  // 0x7f is NaN
        Fp8::E5M2 => (2, 15, 124), // 0x7c is ∞, above it NaN
    };
    (0u32..finite_codes)
        .map(|code| {
            let (e, m) = (code >> m_bits, code & ((1 << m_bits) - 1));
            let frac = m as f32 / (1 << m_bits) as f32;
            if e == 0 {
                frac * 2f32.powi(1 - bias) // subnormal
            } else {
                (1.0 + frac) * 2f32.powi(e as i32 - bias)
            }
        })
        .collect()
}

#[test]
fn the_casts_round_to_nearest_even_and_saturate() {
    for f in [Fp8::E4M3, Fp8::E5M2] {
        let values = values_by_code(f);
        assert_eq!(*values.last().unwrap(), f.largest());
        for (code, &v) in values.iter().enumerate() {
            assert_eq!((f.round(v), f.round(-v)), (v, -v), "{f:?}: {v} (code {code}) is a value of the format");
        }
        // between neighbours: below the midpoint down, above it up, on it to the even code
        for code in 0..values.len() - 1 {
            let (a, b) = (values[code], values[code + 1]);
            let mid = (a + b) / 2.0;
            for (x, want) in [(mid.next_down(), a), (mid.next_up(), b), (mid, if code % 2 == 0 { a } else { b })] {
                assert_eq!(f.round(x), want, "{f:?}: {x} between {a} and {b}");
                assert_eq!(f.round(-x), -want, "{f:?}: {} between {} and {}", -x, -a, -b);
            }
        }
        // beyond the largest: the largest (saturating), as the GPU's __NV_SATFINITE casts do
        for x in [f.largest() * 1.04, f.largest() * 1.2, 1e30] {
            assert_eq!(f.round(x), f.largest());
            assert_eq!(f.round(-x), -f.largest());
        }
        assert!(f.round(f32::INFINITY).is_nan() && f.round(f32::NAN).is_nan(), "an overflow upstream stays seen");
    }
}

/// The root mean square of a cast's relative rounding error for Benford-spread numbers (above).
fn rms_rounding(f: Fp8) -> f32 {
    2.0 * f.unit_roundoff() * (0.541f32 / 12.0).sqrt()
}

fn gaussian(seed: u64, shape: &[usize], std: f32) -> Tensor {
    normal(seed, "fp8 test", shape, std)
}

/// ‖got − want‖ / ‖want‖ over the whole tensor.
fn relative(got: &[f32], want: &[f32]) -> f32 {
    let d: f32 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    (d / want.iter().map(|w| w * w).sum::<f32>()).sqrt()
}

/// Every element of `got` (a · b in FP8, a's rows by b's rows, k long) within the worst case of
/// `want` (the f32 product), and the whole within 0.75–1.25 of the predicted root mean square.
fn within_prediction(
    what: &str,
    (got, want): (&[f32], &[f32]),
    (a, fa): (&[f32], Fp8),
    (b, fb): (&[f32], Fp8),
    k: usize,
) {
    let amax = |v: &[f32]| v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    // the subnormal half-step, back in the tensor's units (scale = largest / amax)
    let (ha, hb) =
        (fa.subnormal_step() / 2.0 * amax(a) / fa.largest(), fb.subnormal_step() / 2.0 * amax(b) / fb.largest());
    let (n_b, bf16_u) = (b.len() / k, 2f32.powi(-8));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (row_a, row_b) = (&a[(i / n_b) * k..][..k], &b[(i % n_b) * k..][..k]);
        let worst: f32 = (row_a.iter().zip(row_b))
            .map(|(x, y)| {
                let (ea, eb) = (fa.unit_roundoff() * x.abs() + ha, fb.unit_roundoff() * y.abs() + hb);
                ea * y.abs() + x.abs() * eb + ea * eb + 1e-6 * (x * y).abs() // + the f32 sums
            })
            .sum();
        let bound = worst + bf16_u * (w.abs() + worst);
        assert!(
            (g - w).abs() <= bound,
            "{what}: element {i} is {g}, the f32 product {w}: beyond the worst case {bound}"
        );
    }
    let (rel, predicted) = (relative(got, want), (rms_rounding(fa).powi(2) + rms_rounding(fb).powi(2)).sqrt());
    println!("{what}: relative error {rel:.4}, predicted {predicted:.4}");
    assert!(
        (0.75..=1.25).contains(&(rel / predicted)),
        "{what}: relative error {rel:.4}, the formats predict {predicted:.4}"
    );
}

#[test]
fn one_gemm_errs_within_what_the_formats_predict() {
    let transpose = |t: &Tensor| {
        let (r, c, v) = (t.rows(), t.cols(), t.to_vec());
        (0..c).flat_map(|j| (0..r).map(|i| v[i * c + j]).collect::<Vec<_>>()).collect::<Vec<f32>>()
    };
    // activations of size ~1 with a few outliers, weights of size 0.02, gradients of size 1e-4
    let (m, k, n) = (96, 256, 80);
    let mut x = gaussian(1, &[m, k], 1.0).to_vec();
    x[17] = 40.0; // one outlier sets the scale, as activations' do
    let x = Tensor::from_vec(&[m, k], x);
    let (w, dy) = (gaussian(2, &[n, k], 0.02), gaussian(3, &[m, n], 1e-4));
    let (e4, e5) = (Fp8::E4M3, Fp8::E5M2);

    let (y8, y) = (ops::linear(&x, &w, Precision::Fp8), ops::linear(&x, &w, Precision::F32));
    within_prediction("forward", (&y8.to_vec(), &y.to_vec()), (&x.to_vec(), e4), (&w.to_vec(), e4), k);

    let (dx8, dx) = (ops::linear_input_grad(&dy, &w, Precision::Fp8), ops::linear_input_grad(&dy, &w, Precision::F32));
    within_prediction("input gradient", (&dx8.to_vec(), &dx.to_vec()), (&dy.to_vec(), e5), (&transpose(&w), e4), n);

    let (mut dw8, mut dw) = (Tensor::zeros(&[n, k]), Tensor::zeros(&[n, k]));
    ops::linear_weight_grad(&dy, &x, &mut dw8, Precision::Fp8);
    ops::linear_weight_grad(&dy, &x, &mut dw, Precision::F32);
    within_prediction("weight gradient", (&dw8.to_vec(), &dw.to_vec()), (&transpose(&dy), e5), (&transpose(&x), e4), m);

    // bf16 (the CPU's emulation of a GPU's mixed precision) errs far less: u = 2⁻⁸
    let yb = ops::linear(&x, &w, Precision::Bf16);
    assert!(relative(&yb.to_vec(), &y.to_vec()) < 0.01);
}

fn sets(extra: &[&str]) -> Vec<String> {
    let run = ["train.micro_batch_size=4", "train.steps=80", "train.warmup_steps=10"];
    common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect()
}

/// Every parameter's (name, gradient) of one forward and backward of the same batch, its linear
/// layers' GEMMs in `p`.
fn gradients(p: Precision, extra: &[&str]) -> Vec<(String, Vec<f32>)> {
    let cfg = Config::load(None, &sets(extra)).unwrap().model;
    let mut model = Llama::new(&cfg, 5).with_gemms(gemms(p));
    let (batch, seq) = (4, 32u32);
    let tokens: Vec<u32> = (0..batch * seq).map(|i| (i * 13 + i / 7) % cfg.vocab_size as u32).collect();
    let targets: Vec<i32> = tokens.iter().map(|&t| (t as i32 * 5 + 3) % cfg.vocab_size as i32).collect();
    let StageOutput::Loss(_) = model.forward_chunk(0, StageInput::Tokens(&tokens), batch as usize, &targets).unwrap()
    else {
        panic!("the whole model ends in a loss")
    };
    model.backward_chunk(0, StageGrad::Loss(1.0), &mut Now, &mut |_| {}).unwrap();
    model.params().iter().map(|p| (p.name.clone(), p.grad.to_vec())).collect()
}

#[test]
fn one_steps_gradients_err_within_what_the_formats_predict() {
    // A weight gradient of block l (of L) is its own E5M2 × E4M3 GEMM (5.94%) of an x that came
    // through forward's FP8 GEMMs and a dy that came down from the loss through two input-gradient
    // GEMMs in each block above (down then gate|up, o then q|k|v) and one in its own: at most
    // n = 2(L − 1 − l) + 3 GEMMs in series, whose independent errors add in quadrature: √n · 5.94%
    // (the residual stream carries part of dy past them exactly, so this bounds from above). The
    // norms' gradients see the same dy; the embedding's and the output layer's (bf16) lie at
    // the ends, bounded as block 0's.
    let r_bwd = (rms_rounding(Fp8::E5M2).powi(2) + rms_rounding(Fp8::E4M3).powi(2)).sqrt();
    for (layers, extra) in [(2, &[][..]), (4, &["model.num_hidden_layers=4", "model.tie_word_embeddings=true"])] {
        let want = gradients(Precision::F32, extra);
        for ((name, w), (_, g)) in want.iter().zip(gradients(Precision::Fp8, extra)) {
            let l = name.strip_prefix("model.layers.").map_or(0, |r| r.split('.').next().unwrap().parse().unwrap());
            let (rel, bound) = (relative(&g, w), ((2 * (layers - 1 - l) + 3) as f32).sqrt() * r_bwd);
            println!("{extra:?} {name}: {rel:.4} (bound {bound:.4})");
            assert!(rel > 0.0 && rel <= bound, "{extra:?} {name}: gradient off by {rel:.4}, beyond {bound:.4}");
        }
    }
}

#[test]
fn the_output_layer_and_the_router_stay_in_bf16() {
    let cfg = Config::load(None, &sets(&["model.num_local_experts=4", "model.num_experts_per_tok=2"])).unwrap().model;
    let model = Llama::new(&cfg, 5).with_gemms(gemms(Precision::Fp8));
    for p in model.params() {
        let want = match ["lm_head", "block_sparse_moe.gate", "embed", "norm"].iter().position(|n| p.name.contains(n)) {
            Some(0 | 1) => Precision::Bf16, // stays bf16
            Some(_) => Precision::F32,      // no GEMM reads it
            None => Precision::Fp8,
        };
        assert_eq!(p.precision, want, "{}", p.name);
    }
}

/// The losses of `sets(extra)` trained with its GEMMs in `dtype`.
fn curve(dtype: &str, extra: &[&str]) -> Vec<f32> {
    let mut all = sets(extra);
    all.push(format!("device.dtype=\"{dtype}\""));
    let quiet = ferrotron::train::Options { quiet: true, ..Default::default() };
    ferrotron::train::train(&Config::load(None, &all).unwrap(), quiet).unwrap().losses
}

/// The mean of the last five losses.
fn last(losses: &[f32]) -> f32 {
    losses[losses.len() - 5..].iter().sum::<f32>() / 5.0
}

#[test]
fn fp8_trains_within_two_percent_of_bf16_on_every_layout() {
    let (f32_, bf16, fp8) = (curve("f32", &[]), curve("bf16", &[]), curve("fp8", &[]));
    println!("final losses: f32 {:.4}, bf16 {:.4}, fp8 {:.4}", last(&f32_), last(&bf16), last(&fp8));
    assert!(last(&fp8) < 0.8 * fp8[0], "it trains: {} → {}", fp8[0], last(&fp8));
    assert!((last(&fp8) / last(&bf16) - 1.0).abs() <= 0.02, "fp8 {} against bf16 {}", last(&fp8), last(&bf16));
    assert!(fp8 != bf16 && bf16 != f32_, "the roundings change the numbers");
    // a layout changes which rows or columns share a scale (a rank's slice has its own amax), so
    // FP8 follows one rank's FP8 within its own noise, not to the bit
    for layout in [
        &["parallel.tp=2"][..],
        &["parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=2"],
        &["parallel.pp=2", "train.grad_accum_steps=2", "train.micro_batch_size=2"],
    ] {
        let got = curve("fp8", layout);
        println!("{layout:?}: final loss {:.4}", last(&got));
        assert!(
            (last(&got) / last(&fp8) - 1.0).abs() <= 0.02,
            "{layout:?}: {} against one rank's {}",
            last(&got),
            last(&fp8)
        );
    }
}

#[test]
fn the_wire_formats_carry_what_the_gemms_read() {
    use ferrotron::ops::packing;
    let t = gaussian(9, &[1001], 0.02); // odd: the last slot is half or a quarter full
    let maxima = packing::abs_max(&t);
    let amax = t.to_vec().iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert_eq!(maxima.to_vec().iter().cloned().fold(0.0, f32::max), amax);
    let s = ferrotron::ops::fp8::scale_for(amax, Fp8::E4M3);
    for (w, slots, want) in [
        (Precision::F32, 1001, t.to_vec()),
        (Precision::Bf16, 501, t.to_vec().iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()),
        (Precision::Fp8, 251, t.to_vec().iter().map(|&x| Fp8::E4M3.round(x * s) * (1.0 / s)).collect()),
    ] {
        let packed = packing::pack(&t, w, Some(&maxima));
        assert_eq!(packed.numel(), slots, "{w:?}: {} bytes a number", 4 * slots / 1001);
        // placed after 3 slots of something else, as a unit's second weight is
        let mut after = vec![7.0f32; 3];
        after.extend(packed.to_vec());
        assert_eq!(
            packing::unpack(&Tensor::from_vec(&[after.len()], after), 3, 1001, w, Some(&maxima)).to_vec(),
            want,
            "{w:?}"
        );
    }
    // what the GEMM reads of a weight gathered in FP8 is what it reads of the weight itself
    let x = gaussian(10, &[32, 1001], 1.0);
    let gathered =
        packing::unpack(&packing::pack(&t, Precision::Fp8, Some(&maxima)), 0, 1001, Precision::Fp8, Some(&maxima));
    let y = |w: &Tensor| ops::linear(&x, &Tensor::from_vec(&[1, 1001], w.to_vec()), Precision::Fp8).to_vec();
    assert_eq!(y(&gathered), y(&t));
}

/// (the curve, the weights' all-gather bytes a step on rank 0) of a 2-rank FSDP run in `dtype`
/// (with `extra` settings).
fn fsdp_with(dtype: &str, stage: usize, extra: &[&str]) -> (Vec<f32>, f64) {
    let mut all = sets(&[&["parallel.dp=2", "train.micro_batch_size=2", "train.steps=20"][..], extra].concat());
    all.extend([format!("parallel.zero_stage={stage}"), format!("device.dtype=\"{dtype}\"")]);
    let cfg = Config::load(None, &all).unwrap();
    let quiet = ferrotron::train::Options { quiet: true, ..Default::default() };
    let ranks = ferrotron::train::train_all(&cfg, quiet).unwrap();
    let call = ferrotron::comm::cost::Call::AllGather;
    let bytes: u64 = ranks[0].comm.iter().filter(|t| t.call == call).map(|t| t.tally.bytes).sum();
    (ranks[0].losses.clone(), bytes as f64 / cfg.train.steps as f64)
}

fn fsdp(dtype: &str, stage: usize) -> (Vec<f32>, f64) {
    fsdp_with(dtype, stage, &[])
}

#[test]
fn fsdp_gathers_weights_as_their_gemms_read_them() {
    // the matrices travel in 2 bytes a number in bf16, in 1 in FP8 (the output layer stays in
    // 2), the norms and the embedding (no GEMM reads them) in 4 on the CPU; a GPU computing in
    // bf16 sends every weight in bf16 or FP8
    let (f32_, f32_bytes) = fsdp("f32", 3);
    let (bf16, bf16_bytes) = fsdp("bf16", 3);
    let (fp8, fp8_bytes) = fsdp("fp8", 3);
    println!("gathered a step: f32 {f32_bytes}, bf16 {bf16_bytes}, fp8 {fp8_bytes} B");
    assert!((0.5..0.7).contains(&(bf16_bytes / f32_bytes)), "bf16 {bf16_bytes} against f32 {f32_bytes}");
    assert!((0.5..0.75).contains(&(fp8_bytes / bf16_bytes)), "fp8 {fp8_bytes} against bf16 {bf16_bytes}");
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff(&bf16, &fsdp("bf16", 0).0) <= 1e-5, "FSDP in bf16 against replicas in bf16");
    // and changes no number a GEMM reads: the curve of replicas that never gather
    let (whole, _) = fsdp("fp8", 0);
    assert!(diff(&fp8, &whole) <= 1e-5, "FSDP in FP8 against replicas in FP8: {}", diff(&fp8, &whole));
    assert!(fp8 != f32_);
    // ZeRO-1 gathers the updated weights after each step the same way
    let (zero1, zero1_bytes) = fsdp("fp8", 1);
    assert!(diff(&zero1, &whole) <= 1e-5 && zero1_bytes < fp8_bytes, "ZeRO-1 in FP8: {zero1_bytes} B");
    // each tp rank's slices gathered over its dp ranks: the same
    let tp = ["parallel.tp=2"];
    let (sharded, _) = fsdp_with("fp8", 3, &tp);
    assert!(diff(&sharded, &fsdp_with("fp8", 0, &tp).0) <= 1e-5, "tp 2 × FSDP in FP8 against tp 2 replicas");
}
