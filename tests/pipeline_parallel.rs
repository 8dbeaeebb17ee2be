//! Pipeline parallelism: AFAB, 1F1B and interleaved 1F1B, alone and combined with dp, tp (and
//! sequence parallelism), cp and ZeRO, reproduce the single-rank loss curve; the activation
//! counters show 1F1B's memory bound against AFAB's; uneven layer splits; the schedules run every
//! (micro-batch, chunk) once and the simulator's bubble is the formula's; the errors.

mod common;

use ferrotron::comm::trace::Trace;
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::commands::schedule::{from_trace, simulate};
use ferrotron::config::{Config, PpSchedule};
use ferrotron::model::stage::Stage;
use ferrotron::parallel::pipeline_schedule::Action;
use ferrotron::parallel::schedules::schedule_of;
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
    let converge::Report { baseline, outcomes, .. } =
        converge::converge(None, &sets(&[]), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(baseline[19] < baseline[0] - 0.5, "the baseline learns");
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn a_tied_embedding_on_two_stages_follows_the_single_rank_curve_under_every_schedule() {
    // the first stage's embedding and the last's copy of it as the output layer: their gradients
    // summed between the two before each update (with dp, ZeRO, tp and sequence parallelism too)
    let spec = "pp=2;pp=4,pp_schedule=afab;pp=2,pp_schedule=interleaved,pp_virtual_stages=2;\
                pp=2,pp_schedule=zb-h1;dp=2,pp=2,zero_stage=1;dp=2,pp=2,zero_stage=2,zero_reduce=once;\
                dp=2,pp=2,zero_stage=3;tp=2,pp=2,sequence_parallel=true;pp=3,pp_schedule=afab";
    let tied = sets(&["model.tie_word_embeddings=true"]);
    let converge::Report { baseline, outcomes, .. } =
        converge::converge(None, &tied, &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(baseline[19] < baseline[0] - 0.5, "the baseline learns");
    for o in &outcomes {
        assert!(o.pass, "tied, {}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    // the two copies stay equal, and a checkpoint holds the weight once: it resumes into one rank
    let interleaved = ["parallel.pp=2", "parallel.pp_schedule=\"interleaved\"", "parallel.pp_virtual_stages=2"];
    let short = sets(&["model.tie_word_embeddings=true", "train.grad_accum_steps=2"]);
    common::checkpoints_move_between(&short, &interleaved, &[]);
    common::checkpoints_move_between(
        &short,
        &["parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=3"],
        &["parallel.dp=2"],
    );
    // the last stage's copy is in the memory estimate (params, gradients, AdamW's moments)
    for layout in [&["parallel.pp=2"][..], &["parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=3"]] {
        let cfg = Config::load(None, &[&short[..], &layout.iter().map(|s| s.to_string()).collect::<Vec<_>>()].concat())
            .unwrap();
        common::memory_estimate_within(&cfg, 0.1, &format!("tied, {layout:?}"));
    }
    // the copy is as big as an untied output layer: the last stage's weights, gradients and
    // moments are the same bytes tied or not (an estimate leaving the copy out would be smaller)
    let state = |tied: &str| {
        let cfg = Config::load(None, &sets(&[tied, "parallel.pp=2"])).unwrap();
        let last = ferrotron::commands::memory::memory(&cfg, false).unwrap().pop().unwrap();
        (last.weights_bytes, last.grads_bytes, last.optimizer_bytes)
    };
    assert_eq!(state("model.tie_word_embeddings=true"), state("model.tie_word_embeddings=false"));
}

#[test]
fn uneven_layer_splits_follow_the_curve_too() {
    let spec = "pp=2;pp=3,pp_schedule=afab";
    let converge::Report { baseline: _, outcomes, .. } =
        converge::converge(None, &sets(&["model.num_hidden_layers=5"]), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(outcomes.iter().all(|o| o.pass));
    // 5 layers on 3 stages: the remainder goes to the first stages
    let split: Vec<_> = (0..3).map(|i| Stage::new(i, 3).layers(5)).collect();
    assert_eq!(split, vec![vec![0, 1], vec![2, 3], vec![4]]);
    assert_eq!(Stage::new(1, 4).layers(4), vec![1]);
    // interleaved: 2 ranks of 2 chunks over 8 layers, and 3 × 2 over 7 (the remainder first)
    assert_eq!(Stage::looped(0, 2, 2).layers(8), vec![0, 1, 4, 5]);
    assert_eq!(Stage::looped(1, 2, 2).chunk_layers(8), vec![2..4, 6..8]);
    assert_eq!(Stage::looped(0, 3, 2).chunk_layers(7), vec![0..2, 4..5]);
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
            _ => unreachable!("not among the kinds above"),
        };
        assert_eq!(held, want, "{kind_name}, {micro} micro-batches: activations held per stage");
    }
}

/// (micro-batch, chunk) pairs.
type Works = Vec<(usize, usize)>;

/// The forwards and the backwards of `plan`, each sorted.
fn works(plan: &[Action]) -> (Works, Works) {
    let (mut f, mut b) = (Vec::new(), Vec::new());
    for a in plan {
        match a {
            Action::Forward(w) => f.push((w.micro, w.chunk)),
            Action::Backward(w) => b.push((w.micro, w.chunk)),
            Action::InputGrad(_) | Action::Weights(_) => unreachable!("these schedules do not split their backwards"),
        }
    }
    f.sort_unstable();
    b.sort_unstable();
    (f, b)
}

#[test]
fn schedules_run_every_micro_batch_once_and_show_the_bubble() {
    for (kind, v) in
        [(PpSchedule::Afab, 1), (PpSchedule::OneFOneB, 1), (PpSchedule::Interleaved, 2), (PpSchedule::Interleaved, 3)]
    {
        let sizes: &[(usize, usize)] = match kind {
            PpSchedule::Interleaved => &[(2, 2), (2, 4), (4, 4), (4, 8), (3, 6)], // m a multiple of p
            _ => &[(1, 3), (2, 1), (4, 8), (3, 5)],
        };
        for &(p, m) in sizes {
            for s in 0..p {
                let plan: Vec<Action> = schedule_of(kind).actions(p, s, m, v).collect();
                let every: Vec<(usize, usize)> = (0..m).flat_map(|i| (0..v).map(move |c| (i, c))).collect();
                assert_eq!(works(&plan), (every.clone(), every), "{kind:?} p={p} m={m} V={v} stage {s}");
            }
            // played on the clock: no deadlock, and the idle share is the formula's
            let t = simulate(kind, p, m, v).unwrap();
            let (got, want) = (t.bubble(), t.bubble_formula().unwrap());
            assert!((got - want).abs() < 1e-9, "{kind:?} p={p} m={m} V={v}: {got} vs {want}");
        }
    }
    assert_eq!(simulate(PpSchedule::OneFOneB, 4, 8, 1).unwrap().peak_activations, vec![4.0, 3.0, 2.0, 1.0]);
    assert_eq!(simulate(PpSchedule::Afab, 4, 8, 1).unwrap().peak_activations, vec![8.0; 4]);
    // interleaving shrinks the bubble V times over, for a little more activation memory
    let (plain, twice) =
        (simulate(PpSchedule::OneFOneB, 4, 8, 1).unwrap(), simulate(PpSchedule::Interleaved, 4, 8, 2).unwrap());
    assert!((plain.bubble() - 3.0 / 11.0).abs() < 1e-9 && (twice.bubble() - 3.0 / 19.0).abs() < 1e-9);
    assert_eq!(twice.peak_activations, vec![5.5, 4.5, 3.5, 2.5]);
}

#[test]
fn interleaved_1f1b_follows_the_single_rank_curve() {
    // 8 layers: pp 2 or 4 with 2 chunks each, pp 2 with 4 chunks; with dp, ZeRO-3, tp with
    // sequence parallelism, cp and full recomputation
    let spec = "pp=2,pp_schedule=interleaved,pp_virtual_stages=2;\
                pp=4,pp_schedule=interleaved,pp_virtual_stages=2;\
                pp=2,pp_schedule=interleaved,pp_virtual_stages=4,grad_accum_steps=2;\
                dp=2,pp=2,pp_schedule=interleaved,pp_virtual_stages=2,grad_accum_steps=2,zero_stage=3;\
                tp=2,pp=2,pp_schedule=interleaved,pp_virtual_stages=2,sequence_parallel=true;\
                cp=2,pp=2,pp_schedule=interleaved,pp_virtual_stages=2,recompute=full";
    let extra = ["model.num_hidden_layers=8", "train.steps=10"];
    let converge::Report { baseline, outcomes, .. } =
        converge::converge(None, &sets(&extra), &parse_variants(spec).unwrap(), 1e-4).unwrap();
    assert!(baseline[9] < baseline[0] - 0.2, "the baseline learns");
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    // what a rank holds, measured, against `ferrotron memory`'s estimate
    let cfg = Config::load(
        None,
        &sets(
            &[&extra[..], &["parallel.pp=2", "parallel.pp_schedule=\"interleaved\"", "parallel.pp_virtual_stages=2"]]
                .concat(),
        ),
    )
    .unwrap();
    common::memory_estimate_within(&cfg, 0.1, "interleaved");
}

#[test]
fn checkpoints_move_between_the_interleaved_and_the_plain_pipeline() {
    let interleaved = ["parallel.pp=2", "parallel.pp_schedule=\"interleaved\"", "parallel.pp_virtual_stages=2"];
    common::checkpoints_move_between(&sets(&["train.grad_accum_steps=2"]), &interleaved, &["parallel.pp=2"]);
}

#[test]
fn impossible_pipelines_are_clear_errors() {
    let err = |extra: &[&str]| format!("{:#}", Config::load(None, &sets(extra)).unwrap_err());
    assert!(err(&["parallel.pp=5"]).contains("parallel.pp = 5 exceeds model.num_hidden_layers = 4"));
    let interleaved = ["parallel.pp=2", "parallel.pp_schedule=\"interleaved\""];
    assert!(err(&interleaved).contains("parallel.pp_virtual_stages = 1"));
    assert!(err(&["parallel.pp_virtual_stages=2"]).contains("needs parallel.pp_schedule = \"interleaved\""));
    let v = |n: &'static str| [&interleaved[..], &[n]].concat();
    assert!(err(&v("parallel.pp_virtual_stages=3")).contains("exceeds model.num_hidden_layers = 4"));
    let e = err(&[&v("parallel.pp_virtual_stages=2")[..], &["train.grad_accum_steps=3"]].concat());
    assert!(e.contains("train.grad_accum_steps = 3 micro-batches must be a multiple of parallel.pp = 2"), "{e}");
    let e = err(&[&v("parallel.pp_virtual_stages=2")[..], &["parallel.backend=\"nccl\""]].concat());
    assert!(e.contains("not yet paired for NCCL"), "{e}");
}

#[test]
fn a_real_runs_trace_draws_its_schedule() {
    let cfg = Config::load(None, &sets(&["parallel.pp=2", "parallel.dp=2", "train.steps=2"])).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    common::write_trace(&cfg, &path);
    let t = from_trace(&path).unwrap();
    assert_eq!((t.stages, t.micro_batches, t.slots.len()), (4, 4, 4 * 8), "4 ranks, 4 micro-batches, F and B each");
    // ranks 0 and 2 are stage 0 (two dp replicas), ranks 1 and 3 stage 1
    assert_eq!(t.peak_activations, vec![2.0, 1.0, 2.0, 1.0]);
    let svg = ferrotron::commands::schedule::svg(&[t]);
    assert!(svg.contains("peak micro-batch activations per stage: 2.00, 1.00, 2.00, 1.00</text>"), "{svg}");
    // a run without a pipeline has no schedule: refused (before schedule.svg is written)
    let cfg = Config::load(None, &sets(&["parallel.dp=2", "train.steps=1"])).unwrap();
    common::write_trace(&cfg, &path);
    let e = from_trace(&path).err().expect("a dp-only trace is refused").to_string();
    assert!(e.contains("t.json: this run had no pipeline") && e.contains("parallel.pp of 2 or more"), "{e}");
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

/// Every schedule's picture reads at every size up to p = 8, m = 32: no two labels print over each
/// other, every label fits its box, every title fits the canvas (`common::svg`); and all five
/// schedules drawn in one picture, on one clock.
#[test]
fn every_schedule_picture_reads() {
    let mut drawn = 0;
    let mut all = Vec::new();
    for p in 2..=8 {
        for m in [1, 2, 3, 4, 5, 7, 8, 12, 15, 16, 24, 31, 32] {
            for (kind, chunks) in [
                (PpSchedule::Afab, 1),
                (PpSchedule::OneFOneB, 1),
                (PpSchedule::Interleaved, 2),
                (PpSchedule::Interleaved, 4),
                (PpSchedule::ZbH1, 1),
                (PpSchedule::Zbv, 2),
            ] {
                let Ok(t) = simulate(kind, p, m, chunks) else { continue }; // a size the schedule refuses
                let slots = t.slots.len();
                let svg = ferrotron::commands::schedule::svg(std::slice::from_ref(&t));
                let problems = common::svg::problems(&svg);
                assert!(problems.is_empty(), "{kind:?} p={p} m={m} V={chunks}:\n{}", problems.join("\n"));
                let labels = svg.matches("text-anchor=\"middle\"").count();
                assert_eq!(labels, slots, "{kind:?} p={p} m={m}: every box has its label");
                drawn += 1;
                if p == 8 && m == 32 {
                    all.push(t);
                }
            }
        }
    }
    assert!(drawn > 300, "{drawn} pictures");
    let svg = ferrotron::commands::schedule::svg(&all);
    assert_eq!(common::svg::problems(&svg), Vec::<String>::new(), "all six at p = 8, m = 32 in one picture");
}
