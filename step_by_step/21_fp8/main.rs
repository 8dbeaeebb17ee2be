//! Step 21 — FP8: the linear layers' GEMMs in eight bits, with current scaling.
//! `cargo run --release --example step21`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::Call;
use ferrotron::model::init::normal;
use ferrotron::ops::fp8::{scale_for, Fp8};
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::{self, Precision};
use ferrotron::train::{train_all, Options};

/// ‖got − want‖ / ‖want‖.
fn relative(got: &Tensor, want: &Tensor) -> f32 {
    let (g, w) = (got.to_vec(), want.to_vec());
    let d: f32 = g.iter().zip(&w).map(|(a, b)| (a - b) * (a - b)).sum();
    (d / w.iter().map(|b| b * b).sum::<f32>()).sqrt()
}

/// The mean of the last tenth of a curve (what `ferrotron train` calls the final loss).
fn final_loss(losses: &[f32]) -> f32 {
    let tail = &losses[losses.len() - (losses.len() / 10).max(1)..];
    tail.iter().sum::<f32>() / tail.len() as f32
}

fn run(tiny: bool) -> Result<()> {
    // 1. the formats, and why a scale: gradients of 1e-4 are below E4M3's subnormals and near
    //    E5M2's; scaled so that their amax lands on the largest value, they keep 3 or 2 bits
    let grads = [3.1e-6f32, 2.7e-5, -8.3e-5, 1.9e-4];
    let amax = grads.iter().fold(0.0f32, |m, g| m.max(g.abs()));
    let list = |v: &mut dyn Iterator<Item = f32>| v.map(|x| format!("{x:.2e}")).collect::<Vec<_>>().join(", ");
    println!("four gradients: [{}]", list(&mut grads.iter().cloned()));
    for f in [Fp8::E4M3, Fp8::E5M2] {
        let s = scale_for(amax, f);
        println!("{f:?} (largest {}, u = {}):", f.largest(), f.unit_roundoff());
        println!("  cast as they are: [{}]", list(&mut grads.iter().map(|&g| f.round(g))));
        println!("  scale {s:.3e}:   [{}]", list(&mut grads.iter().map(|&g| f.round(g * s) / s)));
    }

    // 2. one linear layer's three GEMMs: the error against f32, and what the formats predict
    //    (tests/fp8.rs: 0.212·2⁻ᵐ per cast, √(r_a² + r_b²) per product)
    let r = |f: Fp8| 2.0 * f.unit_roundoff() * (0.541f32 / 12.0).sqrt();
    let (fwd, bwd) = ((2.0 * r(Fp8::E4M3).powi(2)).sqrt(), (r(Fp8::E4M3).powi(2) + r(Fp8::E5M2).powi(2)).sqrt());
    let (x, w, dy) =
        (normal(1, "x", &[256, 512], 1.0), normal(2, "w", &[384, 512], 0.02), normal(3, "dy", &[256, 384], 1e-4));
    let y = relative(&ops::linear(&x, &w, Precision::Fp8), &ops::linear(&x, &w, Precision::F32));
    let dx =
        relative(&ops::linear_input_grad(&dy, &w, Precision::Fp8), &ops::linear_input_grad(&dy, &w, Precision::F32));
    let (mut dw8, mut dw) = (Tensor::zeros(&[384, 512]), Tensor::zeros(&[384, 512]));
    ops::linear_weight_grad(&dy, &x, &mut dw8, Precision::Fp8);
    ops::linear_weight_grad(&dy, &x, &mut dw, Precision::F32);
    let dw = relative(&dw8, &dw);
    println!("\none linear layer, 256 rows, 512 → 384, FP8 against f32 (relative error of the whole output):");
    println!("  y  = x·Wᵀ  (E4M3 × E4M3): {:.2}%, predicted {:.2}%", 100.0 * y, 100.0 * fwd);
    println!("  dx = dy·W  (E5M2 × E4M3): {:.2}%, predicted {:.2}%", 100.0 * dx, 100.0 * bwd);
    println!("  dW = dyᵀ·x (E5M2 × E4M3): {:.2}%, predicted {:.2}%", 100.0 * dw, 100.0 * bwd);
    let near = |got: f32, want: f32| (got / want - 1.0).abs() < 0.2;
    common::claim(
        "each GEMM errs as the formats predict",
        near(y, fwd) && near(dx, bwd) && near(dw, bwd),
        "within 20%",
    )?;

    // 3. the same model trained three ways, FSDP over 2 ranks (ZeRO-3: every weight gathered
    //    before its layer computes); the curves, and the bytes the gathers move
    println!("\nFSDP over 2 ranks, per step: the weights' all-gather bytes (rank 0), final loss, distance to f32");
    let mut curves: Vec<Vec<f32>> = Vec::new();
    for dtype in ["f32", "bf16", "fp8"] {
        let sets = [
            "parallel.dp=2",
            "parallel.zero_stage=3",
            "train.micro_batch_size=8",
            &format!("device.dtype=\"{dtype}\""),
        ];
        let cfg = common::config(tiny, &sets)?;
        let ranks = train_all(&cfg, Options { quiet: true, ..Default::default() })?;
        let steps = cfg.train.steps as f64;
        let gathered: u64 = ranks[0].comm.iter().filter(|t| t.call == Call::AllGather).map(|t| t.tally.bytes).sum();
        let losses = ranks[0].losses.clone();
        let distance = curves
            .first()
            .map_or(0.0, |f32s| losses.iter().zip(f32s).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max));
        let time = match common::gpu() {
            true => format!(", {:.1} ms a step", 1e3 * ranks[0].step_s.iter().skip(1).sum::<f64>() / (steps - 1.0)),
            false => String::new(),
        };
        println!(
            "  {dtype:<5} {:>9.0} B gathered, final loss {:.4}, max |Δloss| to f32 {distance:.1e}{time}",
            gathered as f64 / steps,
            final_loss(&losses)
        );
        curves.push(losses);
    }
    let (bf16, fp8) = (final_loss(&curves[1]), final_loss(&curves[2]));
    let off = 100.0 * (fp8 / bf16 - 1.0);
    common::claim(
        "FP8 trains as bf16 does",
        off.abs() <= 2.0,
        &format!("final loss {fp8:.4} against {bf16:.4}: {off:+.2}% (target ±2%)"),
    )
}

step!(run);
