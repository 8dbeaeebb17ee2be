//! Zero-bubble pipelines: a backward split into B and W is bitwise the whole one (dense, MoE,
//! every recompute mode); ZB-H1 and ZBV run every F, B and W once, each W after its B, without
//! deadlock, with the bubble and the peak memory they promise, and stop cleanly at their
//! stop points; both follow the single-rank curve alone and with dp, ZeRO, tp, sequence
//! parallelism, cp (ring and Ulysses), hybrid sharding, experts and recomputation; a traced run
//! draws its F, B and W; the stages hold what
//! `ferrotron memory` says; checkpoints move between the V and a plain pipeline; the errors.

mod common;

use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::commands::schedule::{from_trace, simulate};
use ferrotron::config::{Config, ModelConfig, PpSchedule, Recompute};
use ferrotron::model::deferred_grads::Later;
use ferrotron::model::llama::pipeline::{StageGrad, StageInput};
use ferrotron::model::split::Now;
use ferrotron::model::stage::Stage;
use ferrotron::model::Llama;
use ferrotron::parallel::pipeline_schedule::{sent_by, Action, Work};
use ferrotron::parallel::schedules::schedule_of;
use ferrotron::train::{train_all, Options};
use std::collections::HashSet;

/// 10 steps of the small model, 8 layers, 4 micro-batches of 2 sequences.
fn sets(extra: &[&str]) -> Vec<String> {
    let run = [
        "model.num_hidden_layers=8",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=4",
        "train.steps=10",
        "train.warmup_steps=5",
    ];
    common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect()
}

fn model_config(extra: &[&str]) -> ModelConfig {
    Config::load(None, &sets(extra)).unwrap().model
}

/// Every gradient of `model`, by name.
fn grads(model: &Llama) -> Vec<(String, Vec<f32>)> {
    model.params().iter().map(|p| (p.name.clone(), p.grad.to_vec())).collect()
}

#[test]
fn a_backward_split_into_b_and_w_is_bitwise_the_whole_one() {
    let moe = ["model.num_local_experts=4", "model.num_experts_per_tok=2", "model.router_aux_loss_coef=0.02"];
    for (extra, recompute) in [
        (&[][..], Recompute::None),
        (&[][..], Recompute::Selective),
        (&[][..], Recompute::Full),
        (&moe[..], Recompute::None),
    ] {
        let cfg = model_config(extra);
        let (batch, seq) = (2, 32);
        let tokens: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % cfg.vocab_size) as u32).collect();
        let targets: Vec<i32> = tokens.iter().map(|&t| (t as i32 + 1) % cfg.vocab_size as i32).collect();
        let run = |split: bool| {
            let mut model = Llama::new(&cfg, 3).with_recompute(recompute);
            // two micro-batches in flight, their B's before their W's, as ZB-H1 runs them
            for _ in 0..2 {
                model.forward_chunk(0, StageInput::Tokens(&tokens), batch, &targets).unwrap();
            }
            for _ in 0..2 {
                match split {
                    true => assert!(model
                        .backward_chunk(0, StageGrad::Loss(0.5), &mut Later::default(), &mut |_| {})
                        .unwrap()
                        .is_none()),
                    false => {
                        assert!(model.backward_chunk(0, StageGrad::Loss(0.5), &mut Now, &mut |_| {}).unwrap().is_none())
                    }
                }
            }
            if split {
                assert_eq!(model.activations_held(), 2, "after B, the W's inputs are still held");
                let before = grads(&model);
                assert!(before.iter().any(|(_, g)| g.iter().all(|&x| x == 0.0)), "B leaves the weight gradients");
                let mut seen = HashSet::new();
                for _ in 0..2 {
                    model.backward_weights(0, &mut |p| _ = seen.insert(p.name.clone())).unwrap();
                }
                assert_eq!(seen.len(), model.params().len(), "W announces every parameter of the chunk");
                assert_eq!(model.activations_held(), 0);
                assert!(model.backward_weights(0, &mut |_| {}).is_err(), "no W is owed");
            }
            grads(&model)
        };
        let (whole, split) = (run(false), run(true));
        for ((name, a), (_, b)) in whole.iter().zip(&split) {
            assert!(a.iter().any(|&x| x != 0.0), "{name}: a gradient at all");
            assert_eq!(a, b, "{extra:?} {recompute:?}: {name} differs between the whole and the split backward");
        }
    }
}

/// The actions of every stage of `kind`.
fn plans(kind: PpSchedule, p: usize, m: usize, v: usize) -> Vec<Vec<Action>> {
    (0..p).map(|s| schedule_of(kind).actions(p, s, m, v).collect()).collect()
}

#[test]
fn zero_bubble_schedules_run_every_f_b_and_w_once_and_keep_their_promises() {
    for (kind, v) in [(PpSchedule::ZbH1, 1), (PpSchedule::Zbv, 2)] {
        for (p, m) in [(1, 1), (2, 1), (2, 3), (2, 4), (3, 5), (3, 7), (4, 7), (4, 8), (4, 16), (6, 12), (8, 15)] {
            if kind == PpSchedule::Zbv && (p < 2 || m < 2 * p - 1) {
                continue;
            }
            for (s, plan) in plans(kind, p, m, v).iter().enumerate() {
                let mut got: Vec<(char, usize, usize)> = Vec::new();
                for (at, a) in plan.iter().enumerate() {
                    let (letter, w) = (a.to_string().chars().next().unwrap(), a.work());
                    if let Action::Weights(w) = a {
                        let b = plan.iter().position(|x| *x == Action::InputGrad(*w)).unwrap();
                        assert!(b < at, "{kind:?} p={p} m={m} stage {s}: W{} before its B", w.micro);
                    }
                    got.push((letter, w.micro, w.chunk));
                }
                got.sort_unstable();
                let mut want: Vec<_> = ['B', 'F', 'W']
                    .iter()
                    .flat_map(|&l| (0..m).flat_map(move |i| (0..v).map(move |c| (l, i, c))))
                    .collect();
                want.sort_unstable();
                assert_eq!(got, want, "{kind:?} p={p} m={m} stage {s}: every F, B and W once");
            }
            // on the clock: no deadlock; the peak each stage holds is `held`'s (the memory estimate)
            let t = simulate(kind, p, m, v).unwrap();
            let counted: Vec<f64> = (0..p).map(|s| schedule_of(kind).held(p, s, m, v) as f64 / v as f64).collect();
            assert_eq!(t.peak_activations, counted, "{kind:?} p={p} m={m}: held");
            if kind == PpSchedule::ZbH1 && m >= p {
                let (got, want) = (t.bubble(), t.bubble_formula().unwrap());
                assert!((got - want).abs() < 1e-9, "ZB-H1 p={p} m={m}: bubble {got} vs (p−1)/(3m+p−1) = {want}");
            }
        }
    }
    // p = 4, m = 8: the bubble falls from 1F1B's 27% to a third of its idle time, then nearly
    // to nothing, and no stage holds more than 1F1B's first
    let (one, h1, v) = (
        simulate(PpSchedule::OneFOneB, 4, 8, 1).unwrap(),
        simulate(PpSchedule::ZbH1, 4, 8, 1).unwrap(),
        simulate(PpSchedule::Zbv, 4, 8, 2).unwrap(),
    );
    assert!((one.bubble() - 3.0 / 11.0).abs() < 1e-9 && (h1.bubble() - 3.0 / 27.0).abs() < 1e-9);
    assert!(v.bubble() < 0.06, "ZBV: {}", v.bubble());
    assert!(one.makespan - h1.makespan == 6.0, "ZB-H1 saves (p − 1)·W of 1F1B's (p − 1)(F + B + W)");
    assert_eq!(h1.peak_activations, vec![4.0; 4]);
    assert_eq!(v.peak_activations, vec![4.0; 4]);
    assert_eq!(schedule_of(PpSchedule::ZbH1).held(4, 3, 2, 1), 2, "never more than the step's micro-batches");
    // rank 0 of the V holds the embedding (chunk 0) and the output layer (chunk 1): a tied
    // weight's gradient is whole after chunk 0's last W, which comes after chunk 1's
    for (p, m) in [(2, 3), (4, 7), (4, 9), (8, 16)] {
        let plan: Vec<Action> = schedule_of(PpSchedule::Zbv).actions(p, 0, m, 2).collect();
        let last_w = |chunk| plan.iter().rposition(|a| *a == Action::Weights(Work { micro: m - 1, chunk })).unwrap();
        assert!(last_w(0) > last_w(1), "p={p} m={m}");
    }
}

#[test]
fn the_v_shape_goes_down_the_ranks_and_back_up() {
    let s = |i| Stage::v(i, 2);
    assert_eq!((0..2).map(|i| s(i).chunk_layers(8)).collect::<Vec<_>>(), vec![vec![0..2, 6..8], vec![2..4, 4..6]]);
    assert!(s(0).is_first() && s(0).is_last() && !s(1).is_last());
    assert_eq!((s(0).virtual_stage(1), s(1).virtual_stage(1)), (3, 2));
    assert_eq!((0..4).map(|u| s(0).place_of(u)).collect::<Vec<_>>(), vec![(0, 0), (1, 0), (1, 1), (0, 1)]);
    assert_eq!(s(1).loss_rank(), 0);
    // rank 1's chunk 0 feeds its own chunk 1; rank 0's chunk 1 makes the loss, sends nothing on
    let w = |chunk| Work { micro: 0, chunk };
    assert_eq!(sent_by(s(1), 1, Action::Forward(w(0))).map(|(to, _)| to), Some(1));
    assert_eq!(sent_by(s(0), 0, Action::Forward(w(1))), None);
    assert_eq!(sent_by(s(0), 0, Action::InputGrad(w(1))).map(|(to, _)| to), Some(1));
    assert_eq!(sent_by(s(0), 0, Action::Weights(w(1))), None);
}

/// Plays every rank's schedule with blocking receives and, before each rank's k-th forward (k a
/// positive multiple of p·V), a collective "stop?" every rank must reach: false if some rank
/// waits for ever.
fn stop_points_are_safe(kind: PpSchedule, p: usize, m: usize, v: usize) -> bool {
    let stage = schedule_of(kind).stage(0, p, v);
    let (plans, last) = (plans(kind, p, m, stage.chunks), p * stage.chunks - 1);
    let every = p * stage.chunks;
    let (mut next, mut forwards, mut asked) = (vec![0; p], vec![0; p], vec![0; p]);
    let mut done: HashSet<(usize, usize, bool)> = HashSet::new(); // (virtual stage, micro-batch, forward)
    loop {
        let mut moved = false;
        for r in 0..p {
            let Some(&a) = plans[r].get(next[r]) else { continue };
            let (u, i) = (Stage { index: r, ..stage }.virtual_stage(a.work().chunk), a.work().micro);
            let k = forwards[r];
            if matches!(a, Action::Forward(_)) && k > 0 && k % every == 0 {
                if asked[r] < k / every {
                    asked[r] += 1; // reaches the question
                    moved = true;
                    continue;
                }
                if asked.iter().any(|&q| q < k / every) {
                    continue; // answered once every rank has asked it
                }
            }
            // its input: the previous virtual stage's forward, the next one's backward (or its own forward, at the loss)
            let needs = match a {
                Action::Forward(_) => (u > 0).then(|| (u - 1, i, true)),
                Action::Backward(_) | Action::InputGrad(_) if u == last => Some((u, i, true)),
                Action::Backward(_) | Action::InputGrad(_) => Some((u + 1, i, false)),
                Action::Weights(_) => Some((u, i, false)),
            };
            if needs.is_some_and(|n| !done.contains(&n)) {
                continue;
            }
            if !matches!(a, Action::Weights(_)) {
                done.insert((u, i, matches!(a, Action::Forward(_))));
            }
            forwards[r] += usize::from(matches!(a, Action::Forward(_)));
            next[r] += 1;
            moved = true;
        }
        if (0..p).all(|r| next[r] == plans[r].len()) {
            return true;
        }
        if !moved {
            return false;
        }
    }
}

#[test]
fn every_schedule_stops_at_its_questions_without_deadlock() {
    for (kind, v) in
        [(PpSchedule::OneFOneB, 1), (PpSchedule::Interleaved, 2), (PpSchedule::ZbH1, 1), (PpSchedule::Zbv, 2)]
    {
        for p in 2..=5usize {
            for m in [2 * p - 1, 2 * p, 3 * p, 4 * p + 1] {
                if kind == PpSchedule::Interleaved && !m.is_multiple_of(p) {
                    continue;
                }
                assert!(stop_points_are_safe(kind, p, m, v), "{kind:?} p={p} m={m}: a rank waits for ever");
            }
        }
    }
}

#[test]
fn zero_bubble_pipelines_follow_the_single_rank_curve() {
    let spec = "pp=2,pp_schedule=zb-h1;\
                pp=4,pp_schedule=zb-h1;\
                pp=2,pp_schedule=zbv;\
                pp=4,pp_schedule=zbv,grad_accum_steps=8;\
                pp=3,pp_schedule=zbv,grad_accum_steps=8,recompute=full;\
                dp=2,pp=2,pp_schedule=zb-h1,grad_accum_steps=2,zero_stage=3;\
                dp=2,pp=2,pp_schedule=zbv,zero_stage=2;\
                dp=2,pp=2,pp_schedule=zbv,dp_mode=naive;\
                tp=2,pp=2,pp_schedule=zbv,sequence_parallel=true;\
                tp=2,pp=2,pp_schedule=zb-h1;\
                cp=2,pp=2,pp_schedule=zbv,recompute=selective;\
                cp=2,pp=2,pp_schedule=zb-h1,cp_mode=ulysses;\
                dp=4,dp_shard=2,zero_stage=3,pp=2,pp_schedule=zb-h1,grad_accum_steps=2";
    let converge::Report { baseline, outcomes, .. } =
        converge::converge(None, &sets(&[]), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(baseline[9] < baseline[0] - 0.2, "the baseline learns");
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    // tied embeddings: the V holds the embedding and the output layer both on rank 0
    let tied = ["model.tie_word_embeddings=true"];
    let spec = "pp=2,pp_schedule=zbv;dp=2,pp=2,pp_schedule=zbv,zero_stage=3;pp=4,pp_schedule=zbv,grad_accum_steps=8";
    let converge::Report { outcomes, .. } =
        converge::converge(None, &sets(&tied), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    for o in &outcomes {
        assert!(o.pass, "tied, {}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    // a mixture of experts, its experts on other ranks
    let moe = ["model.num_hidden_layers=4", "model.num_local_experts=4", "model.num_experts_per_tok=2"];
    let spec = "pp=2,pp_schedule=zbv;ep=2,dp=2,pp=2,pp_schedule=zb-h1;ep=2,dp=2,pp=2,pp_schedule=zbv";
    let converge::Report { outcomes, .. } =
        converge::converge(None, &sets(&moe), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn the_stages_hold_what_the_schedule_and_the_memory_estimate_say() {
    for (kind, pp, m, v) in [("zb-h1", 4, 6, 1), ("zb-h1", 4, 2, 1), ("zbv", 2, 4, 2), ("zbv", 3, 5, 2)] {
        let schedule = format!("parallel.pp_schedule=\"{kind}\"");
        let (pp_set, m_set) = (format!("parallel.pp={pp}"), format!("train.grad_accum_steps={m}"));
        let cfg = Config::load(None, &sets(&[&pp_set, &schedule, &m_set, "train.steps=2"])).unwrap();
        let ranks = train_all(&cfg, Options { quiet: true, ..Default::default() }).unwrap();
        let measured: Vec<usize> = ranks.iter().map(|r| r.peak_activations).collect();
        let kind = cfg.parallel.pp_schedule;
        let want: Vec<usize> = (0..pp).map(|s| schedule_of(kind).held(pp, s, m, v)).collect();
        assert_eq!(measured, want, "{kind:?} pp={pp} m={m}: micro-batch chunks held per stage");
        common::memory_estimate_within(&cfg, 0.1, &format!("{kind:?}"));
    }
}

#[test]
fn a_zbv_runs_trace_draws_its_f_b_and_w() {
    let cfg = Config::load(None, &sets(&["parallel.pp=2", "parallel.pp_schedule=\"zbv\"", "train.steps=2"])).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    common::write_trace(&cfg, &path);
    let t = from_trace(&path).unwrap();
    // 2 ranks, 4 micro-batches through 2 chunks each, an F, a B and a W of each
    assert_eq!((t.stages, t.micro_batches, t.chunks, t.slots.len()), (2, 4, 2, 2 * 4 * 2 * 3));
    let of = |r: usize| t.slots.iter().filter(|s| s.stage == r).map(|s| s.action).collect::<Vec<_>>();
    assert_eq!(of(0), schedule_of(PpSchedule::Zbv).actions(2, 0, 4, 2).collect::<Vec<_>>(), "rank 0 ran its schedule");
    assert_eq!(t.peak_activations, vec![2.0, 2.0], "p micro-batches (2p half-size chunks) on each rank");
    let svg = ferrotron::commands::schedule::svg(&[t]);
    assert!(svg.contains(">W3.1</text>"), "the W boxes are drawn");
}

#[test]
fn checkpoints_move_between_the_v_and_the_plain_pipeline() {
    let (v, plain) = (["parallel.pp=2", "parallel.pp_schedule=\"zbv\""], ["parallel.pp=3"]);
    common::checkpoints_move_between(&sets(&["train.grad_accum_steps=4"]), &v, &plain);
}

#[test]
fn impossible_zero_bubble_pipelines_are_clear_errors() {
    let err = |extra: &[&str]| Config::load(None, &sets(extra)).unwrap_err().to_string();
    let zbv = ["parallel.pp_schedule=\"zbv\""];
    assert!(err(&zbv).contains("needs at least 2 pipeline stages"), "{}", err(&zbv));
    let e = err(&[&zbv[..], &["parallel.pp=4"]].concat());
    assert!(e.contains("train.grad_accum_steps = 4") && e.contains("2·pp − 1 = 7"), "{e}");
    let e = err(&[&zbv[..], &["parallel.pp=2", "model.num_hidden_layers=3"]].concat());
    assert!(e.contains("every chunk needs at least one layer"), "{e}");
    let e = err(&[&zbv[..], &["parallel.pp=2", "parallel.pp_virtual_stages=3"]].concat());
    assert!(e.contains("always gives each rank 2 chunks"), "{e}");
    let e = err(&["parallel.pp=2", "parallel.pp_schedule=\"zb-h1\"", "parallel.pp_virtual_stages=2"]);
    assert!(e.contains("needs parallel.pp_schedule = \"interleaved\""), "{e}");
    let e = err(&["parallel.pp=2", "parallel.pp_schedule=\"zb-h1\"", "parallel.backend=\"nccl\""]);
    assert!(e.contains("not yet paired for NCCL"), "{e}");
    let e = err(&["parallel.pp_schedule=\"zb-h2\""]);
    assert!(e.contains("zb-h2"), "{e}");
}
