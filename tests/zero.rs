//! ZeRO-1, 2 and 3 (FSDP): every stage reproduces the single-rank curve at dp 2, 3 (chunks
//! padded) and 4, with accumulation, and composed with tp, pp and cp; a checkpoint saved at one
//! stage resumes at another stage and layout on the uninterrupted curve.

mod common;

use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::config::Config;
use ferrotron::train::{train, Options};
use std::path::Path;

/// A global batch of 12 splits into 1, 2, 3 and 4 dp ranks.
const RUN: &[&str] = &["train.micro_batch_size=12", "train.steps=12", "train.warmup_steps=3"];

fn sets(extra: &[&str]) -> Vec<String> {
    common::SMALL.iter().chain(RUN).chain(extra).map(|s| s.to_string()).collect()
}

/// Each variant of `spec` against one rank, to 1e-4 on every step.
fn follow_the_single_rank_curve(spec: &str) {
    let variants = parse_variants(spec).unwrap();
    let (baseline, outcomes) = converge::converge(None, &sets(&[]), &variants, 1e-4).unwrap();
    assert!(baseline[11] < baseline[0] - 0.2, "the baseline learns: {} → {}", baseline[0], baseline[11]);
    for o in &outcomes {
        assert_eq!(o.losses.len(), baseline.len(), "{}", o.label);
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn stages_1_2_3_at_dp_2_3_4_follow_the_single_rank_curve() {
    follow_the_single_rank_curve(
        "dp=2,zero_stage=1;dp=2,zero_stage=2;dp=2,zero_stage=3;\
         dp=3,zero_stage=3;dp=4,zero_stage=1;dp=4,zero_stage=2;dp=4,zero_stage=3;\
         dp=2,zero_stage=2,grad_accum_steps=3;dp=2,zero_stage=3,grad_accum_steps=2,bucket_mb=0.01",
    );
}

#[test]
fn zero_composes_with_tp_pp_and_cp() {
    follow_the_single_rank_curve(
        "dp=2,tp=2,zero_stage=3;dp=2,pp=2,zero_stage=3,grad_accum_steps=2;\
         dp=2,pp=2,zero_stage=3,grad_accum_steps=3,pp_schedule=afab;dp=2,cp=2,zero_stage=2;\
         dp=2,tp=2,pp=2,zero_stage=1,grad_accum_steps=2",
    );
}

fn run(dir: &Path, extra: &[&str], resume: Option<&Path>) -> Vec<f32> {
    let mut all = sets(extra);
    all.extend(["train.steps=8".to_string(), format!("checkpoint.dir=\"{}\"", dir.display())]);
    let cfg = Config::load(None, &all).unwrap();
    train(&cfg, Options { quiet: true, resume, ..Default::default() }).unwrap().losses
}

#[test]
fn a_checkpoint_resumes_across_stages_and_layouts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fsdp");
    let fsdp = ["parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=6", "checkpoint.every=4"];
    let uninterrupted = run(&dir, &fsdp, None);
    let step4 = dir.join("step_000004");
    for (label, layout) in [
        ("one rank", &["train.micro_batch_size=12"][..]),
        ("ZeRO-1 at dp 4", &["parallel.dp=4", "parallel.zero_stage=1", "train.micro_batch_size=3"]),
        (
            "ZeRO-2 at dp 2 × tp 2",
            &["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=2", "train.micro_batch_size=6"],
        ),
        ("plain dp 3", &["parallel.dp=3", "train.micro_batch_size=4"]),
    ] {
        let resumed = run(&tmp.path().join(label.replace(' ', "_")), layout, Some(&step4));
        assert_eq!(resumed.len(), 4, "{label}");
        for (step, (a, b)) in resumed.iter().zip(&uninterrupted[4..]).enumerate() {
            assert!((a - b).abs() < 1e-4, "{label}, step {}: {a} vs {b}", step + 4);
        }
    }
    // and a plain checkpoint resumed into FSDP
    let plain = tmp.path().join("plain");
    let uninterrupted = run(&plain, &["checkpoint.every=4"], None);
    let resumed = run(&tmp.path().join("into_fsdp"), &fsdp[..3], Some(&plain.join("step_000004")));
    for (step, (a, b)) in resumed.iter().zip(&uninterrupted[4..]).enumerate() {
        assert!((a - b).abs() < 1e-4, "plain into FSDP, step {}: {a} vs {b}", step + 4);
    }
}
