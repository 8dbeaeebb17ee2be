//! Pipeline parallelism: both schedules, alone and combined with dp and tp, reproduce the
//! single-rank loss curve; the activation counters show 1F1B's memory bound against AFAB's;
//! uneven layer splits; the schedule simulator's bubble; the errors.

mod common;

use ferrotron::comm::trace::Trace;
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::commands::schedule::{from_trace, simulate};
use ferrotron::config::{Config, PpSchedule};
use ferrotron::model::Stage;
use ferrotron::parallel::pipeline_parallel::{schedule, Action};
use ferrotron::train::{train, train_all, Options};

/// 20 steps of the small model with 4 micro-batches of 2 sequences.
fn sets(extra: &[&str]) -> Vec<String> {
    let run = [
        "model.num_hidden_layers=4",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=4",
        "train.steps=20",
        "train.warmup_steps=5",
    ];
    common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect()
}

#[test]
fn pp_with_both_schedules_and_with_dp_and_tp_follow_the_single_rank_curve() {
    let spec = "pp=2;pp=4;pp=2,pp_schedule=afab;pp=4,pp_schedule=afab;dp=2,pp=2;tp=2,pp=2";
    let (baseline, outcomes) = converge::converge(None, &sets(&[]), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(baseline[19] < baseline[0] - 0.5, "the baseline learns");
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn uneven_layer_splits_follow_the_curve_too() {
    let spec = "pp=2;pp=3,pp_schedule=afab";
    let (_, outcomes) =
        converge::converge(None, &sets(&["model.num_hidden_layers=5"]), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(outcomes.iter().all(|o| o.pass));
    // 5 layers on 3 stages: the remainder goes to the first stages
    let split: Vec<_> = (0..3).map(|i| Stage::new(i, 3).layers(5)).collect();
    assert_eq!(split, vec![vec![0, 1], vec![2, 3], vec![4]]);
    assert_eq!(Stage::new(1, 4).layers(4), vec![1]);
    // interleaved: 2 ranks of 2 chunks over 8 layers, and 3 × 2 over 7 (the remainder first)
    assert_eq!(Stage { index: 0, count: 2, chunks: 2 }.layers(8), vec![0, 1, 4, 5]);
    assert_eq!(Stage { index: 1, count: 2, chunks: 2 }.chunk_layers(8), vec![2..4, 6..8]);
    assert_eq!(Stage { index: 0, count: 3, chunks: 2 }.chunk_layers(7), vec![0..2, 3..4]);
}

#[test]
fn one_f_one_b_holds_at_most_pp_minus_stage_micro_batches() {
    for (kind, micro) in [(PpSchedule::OneFOneB, 6), (PpSchedule::Afab, 6), (PpSchedule::OneFOneB, 2)] {
        let kind_name = if kind == PpSchedule::Afab { "afab" } else { "1f1b" };
        let cfg = Config::load(
            None,
            &sets(&[
                "parallel.pp=4",
                &format!("parallel.pp_schedule=\"{kind_name}\""),
                &format!("train.grad_accum_steps={micro}"),
                "train.steps=2",
            ]),
        )
        .unwrap();
        let ranks = train_all(&cfg, Options { quiet: true, ..Default::default() }).unwrap();
        let held: Vec<usize> = ranks.iter().map(|r| r.peak_activations).collect();
        let want: Vec<usize> = match kind {
            PpSchedule::Afab => vec![micro; 4],
            PpSchedule::OneFOneB => (0..4).map(|s| (4 - s).min(micro)).collect(),
        };
        assert_eq!(held, want, "{kind_name}, {micro} micro-batches: activations held per stage");
    }
}

#[test]
fn schedules_run_every_micro_batch_once_and_show_the_bubble() {
    for kind in [PpSchedule::Afab, PpSchedule::OneFOneB] {
        for (p, m) in [(1, 3), (2, 1), (4, 8), (3, 5)] {
            for s in 0..p {
                let plan = schedule(kind, p, s, m);
                let fwd: Vec<usize> =
                    plan.iter().filter_map(|a| if let Action::Forward(i) = a { Some(*i) } else { None }).collect();
                let bwd: Vec<usize> =
                    plan.iter().filter_map(|a| if let Action::Backward(i) = a { Some(*i) } else { None }).collect();
                assert_eq!((fwd, bwd), ((0..m).collect(), (0..m).collect()), "{kind:?} p={p} m={m} stage {s}");
            }
            let t = simulate(kind, p, m).unwrap();
            assert!(
                (t.bubble() - t.bubble_formula()).abs() < 1e-9,
                "{kind:?} p={p} m={m}: {} vs {}",
                t.bubble(),
                t.bubble_formula()
            );
        }
    }
    assert_eq!(simulate(PpSchedule::OneFOneB, 4, 8).unwrap().peak_activations, vec![4, 3, 2, 1]);
    assert_eq!(simulate(PpSchedule::Afab, 4, 8).unwrap().peak_activations, vec![8; 4]);
}

#[test]
fn impossible_pipelines_are_clear_errors() {
    let err = |extra: &[&str]| format!("{:#}", Config::load(None, &sets(extra)).unwrap_err());
    assert!(err(&["parallel.pp=5"]).contains("parallel.pp = 5 exceeds model.num_hidden_layers = 4"));
    assert!(err(&["parallel.pp=2", "model.tie_word_embeddings=true"]).contains("tie_word_embeddings"));
}

#[test]
fn a_real_runs_trace_draws_its_schedule() {
    let cfg = Config::load(None, &sets(&["parallel.pp=2", "parallel.dp=2", "train.steps=2"])).unwrap();
    let trace = Trace::default();
    train(&cfg, Options { trace: Some(&trace), quiet: true, ..Default::default() }).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    trace.write(&path).unwrap();
    let t = from_trace(&path).unwrap();
    assert_eq!((t.stages, t.micro_batches, t.slots.len()), (4, 4, 4 * 8), "4 ranks, 4 micro-batches, F and B each");
    // ranks 0 and 2 are stage 0 (two dp replicas), ranks 1 and 3 stage 1
    assert_eq!(t.peak_activations, vec![2, 1, 2, 1]);
}

#[test]
fn the_trace_shows_every_axis_talking() {
    let sets = ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2", "train.steps=1", "train.grad_accum_steps=2"];
    let cfg = Config::load(None, &sets.map(String::from)).unwrap();
    let trace = Trace::default();
    train(&cfg, Options { trace: Some(&trace), quiet: true, ..Default::default() }).unwrap();
    for (axis, call) in [("tp[", "all_reduce(sum)"), ("cp[", "send_recv"), ("pp[", "send"), ("pp[", "recv")] {
        let spans = trace.comm_spans(|n| n.contains(axis) && n.starts_with(call));
        assert!(!spans.is_empty(), "no {call} on a {axis}…] group in the trace");
        assert!(spans.iter().all(|s| s.end_us >= s.start_us));
    }
    // the loss is broadcast from the last stage and averaged over dp×cp
    assert!(!trace.comm_spans(|n| n.starts_with("broadcast") && n.contains("pp[")).is_empty());
}
