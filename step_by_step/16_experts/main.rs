//! Step 16 — a mixture of experts, and expert parallelism: tokens travel to their experts.
//! `cargo run --release --example step16`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::{report, Link};
use ferrotron::ops::moe::route;
use ferrotron::ops::tensor::Tensor;
use ferrotron::train::{train, train_all, Options, Summary};

/// The busiest expert's rows over the mean: 1 is perfectly even.
fn imbalance(s: &Summary) -> f64 {
    let t = &s.expert_tokens;
    *t.iter().max().unwrap_or(&0) as f64 / (t.iter().sum::<usize>() as f64 / t.len().max(1) as f64)
}

fn run(tiny: bool) -> Result<()> {
    // routing, by hand: 3 tokens, 4 experts, top-2 of the softmax, renormalised
    let logits = Tensor::from_vec(&[3, 4], vec![2.0, 1.0, 0.5, -1.0, 0.0, 0.1, 3.0, 2.9, 1.0, 1.0, 1.0, 1.0]);
    let r = route(&logits, 2);
    for t in 0..3 {
        let (e, w) = (&r.experts[2 * t..2 * t + 2], &r.weights.to_vec()[2 * t..2 * t + 2]);
        println!("token {t}: experts {} and {} with weights {:.3} and {:.3}", e[0], e[1], w[0], w[1]);
    }
    // a Mixtral: every MLP 4 SwiGLU experts, each token through 2 of them
    let moe = ["model.num_local_experts=4", "model.num_experts_per_tok=2", "model.initializer_range=0.1"];
    let quiet = Options { quiet: true, ..Default::default() };
    let one = common::config(tiny, &[&moe[..], &["train.micro_batch_size=8"]].concat())?;
    let alone = train(&one, quiet)?;
    println!(
        "tokens per expert over the run (rank 0, all layers): {:?}, max/mean {:.2}",
        alone.expert_tokens,
        imbalance(&alone)
    );
    // expert parallelism: the experts divided among 2, then 4 ranks of the dp group; every
    // MoE layer all-to-alls the routed rows to their experts and back
    for (dp, ep, mb) in [
        ("parallel.dp=2", "parallel.ep=2", "train.micro_batch_size=4"),
        ("parallel.dp=4", "parallel.ep=4", "train.micro_batch_size=2"),
    ] {
        let cfg = common::config(tiny, &[&moe[..], &[dp, ep, mb]].concat())?;
        let ranks = train_all(&cfg, quiet)?;
        let comm: Vec<_> = ranks.iter().map(|s| s.comm.clone()).collect();
        println!("{dp} {ep}:\n{}", report(&comm, ranks[0].losses.len(), Link::Nvlink));
        common::follows(&format!("{ep} follows the single-device curve"), &ranks[0].losses, &cfg, 1e-4)?;
        let held = (ranks[0].held.weights, alone.held.weights);
        let expert = 3 * one.model.hidden_size * one.model.intermediate_size * 4; // f32 bytes
        let fewer = one.model.num_hidden_layers * expert * (4 - 4 / ranks.len());
        common::claim(
            &format!("each rank of {ep} holds 1/{} of the experts", ranks.len()),
            held.0 + fewer == held.1,
            &format!("{} of {} weight bytes", held.0, held.1),
        )?;
    }
    // the load-balancing loss (Switch): E · Σ f_e · P_e, pushing the routing towards even
    let balanced =
        common::config(tiny, &[&moe[..], &["train.micro_batch_size=8", "model.router_aux_loss_coef=0.1"]].concat())?;
    let with = train(&balanced, quiet)?;
    let detail = format!("max/mean {:.3} with it, {:.3} without", imbalance(&with), imbalance(&alone));
    common::claim("the balance loss evens the experts' load", imbalance(&with) <= imbalance(&alone), &detail)
}

step!(run);
