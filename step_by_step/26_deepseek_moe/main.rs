//! Step 26 — DeepSeekMoE: many narrow experts, shared experts, a sigmoid router choosing within
//! groups, and the load balanced by a bias instead of a loss. `cargo run --release --example step26`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::ops::moe::{route_sigmoid, Choice, Router};
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::DType;
use ferrotron::train::{train, train_all, Options, Summary};

/// The busiest expert's rows over the mean over the run (1 is even).
fn imbalance(s: &Summary) -> f64 {
    let t = &s.expert_tokens;
    *t.iter().max().unwrap_or(&0) as f64 / (t.iter().sum::<usize>() as f64 / t.len().max(1) as f64)
}

fn step_ms(s: &Summary) -> f64 {
    1e3 * s.step_s.iter().skip(1).sum::<f64>() / (s.step_s.len().max(2) - 1) as f64
}

fn run(tiny: bool) -> Result<()> {
    // routing, by hand: one token, 8 experts in 4 groups of 2; each group scored by its two best
    // biased scores, the best 2 groups kept, the top 2 experts inside them; the weights from the
    // unbiased scores, renormalised and scaled by 2.5. Expert 0's bias (+0.3) wins it a place.
    let logits = Tensor::from_vec(&[1, 8], vec![0.2, -1.0, 1.5, 1.4, -0.5, -0.4, 0.9, -2.0]);
    let bias = [0.3, 0.0, 0.0, 0.0, 0.0, 0.0, -0.2, 0.0];
    let router = Router::Sigmoid { norm: true, scale: 2.5, dtype: DType::F32 };
    for (name, bias) in [("no bias", [0.0; 8]), ("with the bias", bias)] {
        let r = route_sigmoid(&logits, 2, Choice { bias: &bias, groups: 4, kept: 2 }, router);
        let w = r.weights.to_vec();
        println!("{name}: experts {:?} with weights {:.3} and {:.3}", r.experts, w[0], w[1]);
    }
    // a small DeepSeek-V3: latent attention, a dense first layer, then 16 routed experts of 96 in
    // 4 groups (a token's 2 from its best 2 groups) and one shared expert of 96: 288 features a
    // token, against the dense MLP's 384
    let v3 = [
        "model.num_key_value_heads=8",
        "model.kv_lora_rank=32",
        "model.qk_nope_head_dim=16",
        "model.qk_rope_head_dim=8",
        "model.v_head_dim=16",
        "train.micro_batch_size=8",
        "model.initializer_range=0.1",
    ];
    let moe = [
        "model.num_local_experts=16",
        "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=96",
        "model.n_shared_experts=1",
        "model.first_k_dense_replace=1",
        "model.n_group=4",
        "model.topk_group=2",
        "model.routed_scaling_factor=2.5",
    ];
    let quiet = Options { quiet: true, ..Default::default() };
    let dense = train(&common::config(tiny, &v3)?, quiet)?;
    let fixed = train(&common::config(tiny, &[&v3[..], &moe].concat())?, quiet)?;
    let with_bias: Vec<&str> = [&v3[..], &moe, &["model.bias_update_speed=0.01"]].concat();
    let balanced = train(&common::config(tiny, &with_bias)?, quiet)?;
    println!(
        "dense MLP (384):          step {:>6.1} ms, final loss {:.4}",
        step_ms(&dense),
        dense.losses[dense.losses.len() - 1]
    );
    for (name, s) in [("DeepSeekMoE, bias fixed", &fixed), ("DeepSeekMoE, γ = 0.01", &balanced)] {
        let last = s.losses.last().copied().unwrap_or(f32::NAN);
        println!("{name:<25} step {:>6.1} ms, final loss {last:.4}, load max/mean {:.3}", step_ms(s), imbalance(s));
    }
    let detail = format!("max/mean {:.3} with it, {:.3} without", imbalance(&balanced), imbalance(&fixed));
    common::claim("the bias evens the experts' load", imbalance(&balanced) < imbalance(&fixed), &detail)?;
    // the bias moves by the loads of the whole step: every layout makes the same update
    let ep = common::config(
        tiny,
        &[&with_bias[..], &["parallel.dp=2", "parallel.ep=2", "train.micro_batch_size=4"]].concat(),
    )?;
    let ranks = train_all(&ep, quiet)?;
    common::follows("dp=2 ep=2 with the bias moving follows the single-device curve", &ranks[0].losses, &ep, 1e-4)
}

step!(run);
