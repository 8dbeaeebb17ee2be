//! Step 20 — a mixture of experts, and expert parallelism: tokens travel to their experts.
//! `cargo run --release --example step20`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::comm::cost::{report, Link};
use ferrotron::comm::launcher::launch;
use ferrotron::comm::placement::{part_of, Placement};
use ferrotron::comm::process_grid::Grid;
use ferrotron::config::Config;
use ferrotron::model::moe::{self, Experts, EP};
use ferrotron::model::routing_tape::TapeMode;
use ferrotron::model::{Llama, Param};
use ferrotron::ops::moe::route;
use ferrotron::ops::tensor::Tensor;
use ferrotron::parallel::expert_parallel::ExpertParallel;
use ferrotron::train::{train, train_all, Options, Summary};
use std::time::Duration;

/// The busiest expert's rows over the mean: 1 is perfectly even.
fn imbalance(s: &Summary) -> f64 {
    let t = &s.expert_tokens;
    *t.iter().max().unwrap_or(&0) as f64 / (t.iter().sum::<usize>() as f64 / t.len().max(1) as f64)
}

/// `ep`'s run (every rank's summary), its curve held to step 01's, and what decides whether a
/// parting is routing or a defect (`model/routing_tape.rs`). Both runs record their router's
/// choices. (1) The ep run replays step 01's choices: it then computes step 01's sums cut
/// differently, so it must follow as a dense layout does — a defect in dispatch, combine or the
/// experts' gradients would not. (2) ep's own curve is held to the band that its own routing
/// choices open in step 01's run (step 01 replaying them): on a GPU the layout's other order of
/// sums flips near-tied choices, and a flipped token trains on, which moves a curve by far more
/// than a rounding; on the CPU no choice differs and both hold to the tolerance.
fn follows_with_its_routing(cfg: &Config, ep: &str) -> Result<Vec<Summary>> {
    let folder = |name: &str| std::env::temp_dir().join(format!("ferrotron-step20-{name}-{}", std::process::id()));
    let (mine, one) = (folder("ep"), folder("one"));
    let tape = |mode| Options { quiet: true, routing_tape: Some(mode), ..Default::default() };
    let checked = (|| {
        let ranks = train_all(cfg, tape(TapeMode::Record(&mine)))?;
        let want = common::one_device(cfg, tape(TapeMode::Record(&one)))?.losses; // step 01's curve
        let replayed = train_all(cfg, tape(TapeMode::Replay(&one)))?;
        let (flips, rows) =
            replayed.iter().filter_map(|s| s.routing_replaced).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        println!("{ep}: {flips} of {rows} routed rows chose other experts than step 01's run did");
        let nudged = Options { nudge_weights: true, ..tape(TapeMode::Replay(&one)) };
        let claim = format!("{ep} with step 01's routing follows its curve");
        let curves = (&replayed[0].losses[..], &want[..]);
        common::follows_with(&claim, curves, cfg, 1e-4, (nudged, "weights moved by one ulp, routing replayed"))?;
        let (claim, what) =
            (format!("{ep} follows the single-device curve"), format!("step 01 with the routing choices of {ep}"));
        common::follows_with(&claim, (&ranks[0].losses, &want), cfg, 1e-4, (tape(TapeMode::Replay(&mine)), &what))?;
        Ok(ranks)
    })();
    [mine, one].iter().for_each(|dir| drop(std::fs::remove_dir_all(dir)));
    checked
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
        println!("{dp} {ep}:");
        let ranks = follows_with_its_routing(&cfg, ep)?;
        let comm: Vec<_> = ranks.iter().map(|s| s.comm.clone()).collect();
        println!("{}", report(&comm, ranks[0].losses.len(), Link::Nvlink));
        let held = (ranks[0].held.weights, alone.held.weights);
        let expert = 3 * one.model.hidden_size * one.model.intermediate_size * 4; // f32 bytes
        let fewer = one.model.num_hidden_layers * expert * (4 - 4 / ranks.len());
        common::claim(
            &format!("each rank of {ep} holds 1/{} of the experts", ranks.len()),
            held.0 + fewer == held.1,
            &format!("{} of {} weight bytes", held.0, held.1),
        )?;
    }
    // in placements' words (step 11): every layer's experts are Shard(0) on the ep axis,
    // replicated over the expert-data axis; each rank's share is the dense model's, value for value
    let dense: Vec<(String, Vec<f32>)> =
        Llama::new(&one.model, 3).params().iter().map(|p| (p.name.clone(), p.value.to_vec())).collect();
    let experts_of_a_layer = Tensor::from_vec(&[4], vec![0.0, 1.0, 2.0, 3.0]);
    let ep = launch(moe::cut_grid(Grid::new(2, 1, 1, 1)?, 2)?, Duration::from_secs(60), |me| {
        let group = me.group(EP);
        let experts = Experts::new(&one.model, Box::new(ExpertParallel::new(group)), 0); // the MLP seam's maker
        let model = Llama::new(&one.model, 3).with_mlps(&experts)?;
        let mine = part_of(&experts_of_a_layer, Placement::Shard(0), (group.index(), group.size())).to_vec();
        let held: Vec<&Param> = model.params().into_iter().filter(|p| moe::is_expert(&p.name)).collect();
        let expert = |p: &Param| p.name.split(".experts.").nth(1)?.split('.').next()?.parse::<f32>().ok();
        let same = |p: &Param| dense.iter().any(|(n, d)| *n == p.name && *d == p.value.to_vec());
        let whole_share = held.len() == one.model.num_hidden_layers * mine.len() * 3; // w1, w2, w3
        Ok(whole_share && held.iter().all(|p| expert(p).is_some_and(|e| mine.contains(&e)) && same(p)))
    })?;
    common::claim(
        "ep = 2, in placements' words: each rank holds its Shard(0) of every layer's experts",
        ep.iter().all(|&ok| ok),
        "value for value",
    )?;
    // the load-balancing loss (Switch): E · Σ f_e · P_e, pushing the routing towards even
    let balanced =
        common::config(tiny, &[&moe[..], &["train.micro_batch_size=8", "model.router_aux_loss_coef=0.1"]].concat())?;
    let with = train(&balanced, quiet)?;
    let detail = format!("max/mean {:.3} with it, {:.3} without", imbalance(&with), imbalance(&alone));
    common::claim("the balance loss evens the experts' load", imbalance(&with) <= imbalance(&alone), &detail)
}

step!(run);
