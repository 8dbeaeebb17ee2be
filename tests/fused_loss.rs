//! The loss without the logits (`train.loss_stripe_rows`): the striped head's loss and gradients
//! are the whole logits' within rounding, for stripes that divide the rows and stripes that do
//! not, dense and Mixtral; a backward asking another scale than forward's is refused; runs with
//! it follow the single-rank curve with tp (and sequence parallelism), pp (1F1B and ZBV), dp
//! with ZeRO-3 and cp; the measured peak falls by at least the logits' bytes and the memory
//! estimate follows.

mod common;

use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::config::Config;
use ferrotron::model::fused_loss::FusedLoss;
use ferrotron::model::llama::pipeline::{StageGrad, StageInput, StageOutput};
use ferrotron::model::split::Now;
use ferrotron::model::Llama;

fn sets(extra: &[&str]) -> Vec<String> {
    let run = [
        "model.num_hidden_layers=4",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=4",
        "train.steps=10",
        "train.warmup_steps=5",
    ];
    common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect()
}

/// (loss, every gradient) of two micro-batches, forward and backward at scale 1/2, with the
/// fused loss of `rows` rows a stripe (0: the whole logits).
fn run(extra: &[&str], rows: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let cfg = Config::load(None, &sets(extra)).unwrap().model;
    let (batch, seq) = (2, 32);
    let mut model = Llama::new(&cfg, 5);
    if rows > 0 {
        model = model.with_loss(Box::new(FusedLoss { rows, scale: 0.5 }));
    }
    let mut losses = Vec::new();
    for micro in 0..2u32 {
        let tokens: Vec<u32> = (0..batch * seq as u32).map(|i| (i * 13 + micro * 7) % cfg.vocab_size as u32).collect();
        // a few rows without a target (-1), as padding would be
        let targets: Vec<i32> =
            tokens.iter().enumerate().map(|(i, &t)| if i % 9 == 4 { -1 } else { t as i32 / 2 }).collect();
        let StageOutput::Loss(loss) =
            model.forward_chunk(0, StageInput::Tokens(&tokens), batch as usize, &targets).unwrap()
        else {
            panic!("the whole model ends in a loss")
        };
        losses.push(loss.to_vec()[0]);
        model.backward_chunk(0, StageGrad::Loss(0.5), &mut Now, &mut |_| {}).unwrap();
    }
    (losses, model.params().iter().map(|p| p.grad.to_vec()).collect())
}

#[test]
fn the_striped_loss_is_the_whole_logits_loss_within_rounding() {
    let moe = ["model.num_local_experts=4", "model.num_experts_per_tok=2", "model.router_aux_loss_coef=0.02"];
    for extra in [&[][..], &moe[..]] {
        let (want_loss, want_grads) = run(extra, 0);
        for rows in [1, 7, 16, 64, 1000] {
            let (loss, grads) = run(extra, rows);
            for (a, b) in loss.iter().zip(&want_loss) {
                assert!((a - b).abs() <= 1e-6 * b.abs(), "{extra:?} rows {rows}: loss {a} vs {b}");
            }
            for (g, w) in grads.iter().zip(&want_grads) {
                let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let diff = g.iter().zip(w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    scale > 0.0 && diff <= 1e-5 * scale,
                    "{extra:?} rows {rows}: gradient off by {diff} of {scale}"
                );
            }
        }
    }
}

#[test]
fn a_backward_with_another_scale_than_forwards_is_refused() {
    let cfg = Config::load(None, &sets(&[])).unwrap().model;
    let mut model = Llama::new(&cfg, 5).with_loss(Box::new(FusedLoss { rows: 16, scale: 0.25 }));
    let tokens: Vec<u32> = (0..64).map(|i| i % cfg.vocab_size as u32).collect();
    let targets: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    model.forward_chunk(0, StageInput::Tokens(&tokens), 2, &targets).unwrap();
    let e = model.backward_chunk(0, StageGrad::Loss(0.5), &mut Now, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("a loss scale of 0.25 in forward, and backward asks for 0.5"), "{e}");
}

#[test]
fn training_with_the_striped_loss_follows_the_single_rank_curve() {
    let spec = "train.loss_stripe_rows=24;\
                tp=2,train.loss_stripe_rows=24;\
                tp=2,sequence_parallel=true,train.loss_stripe_rows=16;\
                pp=2,train.loss_stripe_rows=24;\
                pp=2,pp_schedule=zbv,train.loss_stripe_rows=24;\
                dp=2,zero_stage=3,grad_accum_steps=2,train.loss_stripe_rows=24;\
                cp=2,train.loss_stripe_rows=24";
    let converge::Report { baseline, outcomes, .. } =
        converge::converge(None, &sets(&[]), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(baseline[9] < baseline[0] - 0.2, "the baseline learns");
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn the_striped_loss_lowers_the_peak_by_the_logits() {
    // a vocabulary large beside the hidden size, as in a real model: the logits dominate
    let big = ["model.vocab_size=4096", "train.steps=2", "train.grad_accum_steps=1"];
    let peak = |rows: &str| {
        let cfg = Config::load(None, &sets(&[&big[..], &[rows]].concat())).unwrap();
        let r = ferrotron::commands::memory::memory(&cfg, true).unwrap().swap_remove(0);
        let measured = r.measured_peak_bytes.unwrap();
        assert!(
            (r.total_bytes / measured - 1.0).abs() <= 0.1,
            "{rows}: estimated {}, measured {measured}",
            r.total_bytes
        );
        measured
    };
    let (whole, striped) = (peak("train.loss_stripe_rows=0"), peak("train.loss_stripe_rows=16"));
    let logits = (2 * 32 * 4096 * 4) as f64; // rows × vocab in f32
    assert!(whole - striped >= logits, "the peak fell by {} bytes, the logits are {logits}", whole - striped);
}
