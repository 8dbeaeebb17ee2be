//! Sequence parallelism and activation recomputation: the whole model's gradients under sp equal
//! the dense model's (tp 2 and 4, every recompute mode), the activations kept equal the formula
//! byte for byte and fall by tp in the norm and residual regions, sp and recompute follow the
//! single-rank curve with every parallelism, and the measured peak falls with each.

mod common;

use ferrotron::comm::launcher::launch;
use ferrotron::comm::placement::part_of;
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::commands::memory;
use ferrotron::config::{Config, Recompute};
use ferrotron::model::stage::Stage;
use ferrotron::model::Llama;
use ferrotron::ops::DType;
use ferrotron::parallel::sequence_parallel::{sum_replicated_grads, SequenceParallel};
use ferrotron::train::memory::{activation_bytes, Keep};
use std::time::Duration;

/// SMALL with 4 KV heads, so that tp = 4 gives each rank whole heads.
fn sets(extra: &[&str]) -> Vec<String> {
    let run = ["model.num_key_value_heads=4", "train.micro_batch_size=4", "train.steps=10", "train.warmup_steps=3"];
    common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect()
}

#[test]
fn gradients_under_sequence_parallelism_equal_the_dense_model_s() {
    let cfg = Config::load(None, &sets(&[])).unwrap();
    let (batch, seq, v) = (2, cfg.train.seq_len, cfg.model.vocab_size);
    let tokens: Vec<u32> = (0..batch * seq).map(|i| ((i * 7 + i / 5) % v) as u32).collect();
    let targets: Vec<i32> = tokens.iter().skip(1).map(|&t| t as i32).chain([-1]).collect();
    let mut dense = Llama::new(&cfg.model, 5);
    let loss = dense.forward(&tokens, batch, &targets).unwrap();
    dense.backward(1.0).unwrap();
    let dense: Vec<_> = dense.params().iter().map(|p| p.grad.clone()).collect();
    for tp in [2, 4] {
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            launch(Grid::new(1, 1, 1, tp).unwrap(), Duration::from_secs(60), |me| {
                let group = me.group(Axis::Tp);
                let split = Box::new(SequenceParallel::new(group));
                let mut model = Llama::init(&cfg.model, 5, split, Stage::WHOLE).with_recompute(recompute);
                let got = model.forward(&tokens, batch, &targets)?;
                assert!((got - loss).abs() <= 1e-5 * loss, "tp {tp}: loss {got} vs {loss}");
                // what each rank keeps: the formula, byte for byte
                let keep = Keep { tp, sequence_parallel: true, recompute, ..Keep::WHOLE };
                let want = activation_bytes(&cfg.model, batch, seq, keep, Stage::WHOLE, DType::F32);
                assert_eq!(model.activation_bytes() as f64, want, "tp {tp} {recompute:?}");
                model.backward(1.0)?;
                sum_replicated_grads(&mut model.params_mut(), group)?; // the norms saw 1/tp of the rows
                for (p, d) in model.params().iter().zip(&dense) {
                    let want = part_of(d, p.tp.into(), (group.index(), tp)).to_vec();
                    for (i, (a, b)) in p.grad.to_vec().iter().zip(&want).enumerate() {
                        let ok = (a - b).abs() <= 1e-5 * (1.0 + b.abs());
                        assert!(ok, "tp {tp} {recompute:?}: {}[{i}] {a} vs {b}", p.name);
                    }
                }
                Ok(())
            })
            .unwrap_or_else(|e| panic!("tp = {tp}: {e:#}"));
        }
    }
}

#[test]
fn sequence_parallelism_cuts_the_norm_and_residual_activations_by_tp() {
    let cfg = Config::load(None, &sets(&[])).unwrap();
    let (batch, seq, m) = (4, cfg.train.seq_len, &cfg.model);
    for tp in [2, 4] {
        let bytes = |sequence_parallel| {
            let keep = Keep { tp, sequence_parallel, ..Keep::WHOLE };
            activation_bytes(m, batch, seq, keep, Stage::WHOLE, DType::F32)
        };
        let (plain, sp) = (bytes(false), bytes(true));
        // per block: the input, two norms' outputs, the residual and two 1/rms rows; the head:
        // the final norm's input, output and 1/rms. Each falls to 1/tp, nothing else moves.
        let (rows, d, l) = ((batch * seq) as f64, m.hidden_size as f64, m.num_hidden_layers as f64);
        let regions = 4.0 * rows * (l * (4.0 * d + 2.0) + 2.0 * d + 1.0);
        assert_eq!(plain - sp, regions * (1.0 - 1.0 / tp as f64), "tp {tp}");
    }
}

/// Each variant of `spec` against one rank, to `tol` on every step.
fn follow_the_single_rank_curve(spec: &str, tol: f32) {
    let variants = parse_variants(spec).unwrap();
    let converge::Report { baseline, outcomes, .. } = converge::converge(None, &sets(&[]), &variants, tol).unwrap();
    assert!(baseline[9] < baseline[0] - 0.2, "the baseline learns: {} → {}", baseline[0], baseline[9]);
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn sequence_parallelism_follows_the_single_rank_curve_with_dp_pp_cp_and_zero() {
    follow_the_single_rank_curve(
        "tp=2,sequence_parallel=true;tp=4,sequence_parallel=true;dp=2,tp=2,sequence_parallel=true;\
         tp=2,pp=2,sequence_parallel=true,grad_accum_steps=2;tp=2,cp=2,sequence_parallel=true;\
         dp=2,tp=2,sequence_parallel=true,zero_stage=3",
        1e-4,
    );
}

/// Every rank's losses of a run of `extra`.
fn losses(extra: &[&str]) -> Vec<f32> {
    let cfg = Config::load(None, &sets(extra)).unwrap();
    ferrotron::train::train(&cfg, ferrotron::train::Options { quiet: true, ..Default::default() }).unwrap().losses
}

#[test]
fn recomputation_gives_the_same_losses_as_keeping_everything_in_each_layout() {
    for layout in [&["parallel.tp=2"][..], &["parallel.cp=2"], &["parallel.pp=2", "train.grad_accum_steps=2"]] {
        let none = losses(layout);
        for mode in ["train.recompute=\"selective\"", "train.recompute=\"full\""] {
            let again = losses(&[layout, &[mode]].concat());
            let diff = none.iter().zip(&again).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(diff <= 1e-6, "{layout:?} {mode}: {diff:e}");
        }
    }
}

#[test]
fn recomputation_leaves_the_curve_as_it_is_with_every_parallelism() {
    // one rank: the same ops on the same numbers, so the same bits
    follow_the_single_rank_curve("recompute=selective;recompute=full", 0.0);
    follow_the_single_rank_curve(
        "dp=2,recompute=full;tp=2,recompute=selective;tp=2,sequence_parallel=true,recompute=full;\
         pp=2,grad_accum_steps=2,recompute=full;pp=2,grad_accum_steps=2,pp_schedule=afab,recompute=selective;\
         cp=2,recompute=full;dp=2,zero_stage=3,recompute=full",
        1e-4,
    );
}

#[test]
fn the_measured_peak_falls_with_sequence_parallelism_and_recomputation() {
    // 4 layers of 64 wide, so that activations dominate what a rank holds
    let peak = |extra: &[&str]| {
        let more =
            [&["model.num_hidden_layers=4", "model.hidden_size=64", "model.intermediate_size=128"], extra].concat();
        let cfg = Config::load(None, &sets(&more)).unwrap();
        let ranks = memory::memory(&cfg, true).unwrap();
        let r = &ranks[0];
        let measured = r.measured_peak_bytes.unwrap();
        assert!(
            (r.total_bytes / measured - 1.0).abs() <= 0.1,
            "{extra:?}: estimated {}, measured {measured}",
            r.total_bytes
        );
        measured
    };
    let (none, selective, full) =
        (peak(&[]), peak(&["train.recompute=\"selective\""]), peak(&["train.recompute=\"full\""]));
    assert!(selective < none && full < selective, "recompute: none {none}, selective {selective}, full {full}");
    let (tp, sp) = (peak(&["parallel.tp=2"]), peak(&["parallel.tp=2", "parallel.sequence_parallel=true"]));
    assert!(sp < tp, "tp 2: {tp} B, with sequence parallelism {sp} B");
}
