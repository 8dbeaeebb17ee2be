//! ZeRO-1, 2 and 3 (FSDP): every stage reproduces the single-rank curve at dp 2, 3 (partitions
//! padded) and 4, with accumulation, and composed with tp, pp and cp; so does hybrid sharding
//! (HSDP, `parallel.dp_shard`); a checkpoint saved at one stage (or hybrid) resumes at another
//! stage and layout on the uninterrupted curve, and one saved at dp 3 (every partition padded) holds
//! the one-rank checkpoint's tensors; each stage holds the share it promises, measured
//! from the tensors, and `ferrotron memory`'s estimate follows the measured peak.

mod common;

use ferrotron::comm::trace::{Lane, Span, Trace};
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::commands::memory;
use ferrotron::config::Config;
use ferrotron::train::memory::{Held, RankMemory};
use ferrotron::train::{train, train_all, Options, Summary};
use std::path::Path;

/// A global batch of 12 splits into 1, 2, 3 and 4 dp ranks.
const RUN: &[&str] = &["train.micro_batch_size=12", "train.steps=12", "train.warmup_steps=3"];

fn sets(extra: &[&str]) -> Vec<String> {
    common::SMALL.iter().chain(RUN).chain(extra).map(|s| s.to_string()).collect()
}

/// Each variant of `spec` against one rank, to 1e-4 on every step.
fn follow_the_single_rank_curve(spec: &str) {
    let variants = parse_variants(spec).unwrap();
    let converge::Report { baseline, outcomes, .. } = converge::converge(None, &sets(&[]), &variants, 1e-4).unwrap();
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

/// ZeRO-2 and 3 reducing once a step (`parallel.zero_reduce = "once"`): the gradients add up
/// whole over the micro-batches and are reduce-scattered after the last, on the same curve.
#[test]
fn reducing_once_a_step_follows_the_single_rank_curve() {
    follow_the_single_rank_curve(
        "dp=2,zero_stage=2,grad_accum_steps=3,zero_reduce=once;\
         dp=2,zero_stage=3,grad_accum_steps=2,bucket_mb=0.01,zero_reduce=once;\
         dp=2,pp=2,zero_stage=2,grad_accum_steps=2,zero_reduce=once;dp=4,dp_shard=2,zero_stage=3,grad_accum_steps=3,zero_reduce=once",
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

#[test]
fn hybrid_sharding_follows_the_single_rank_curve() {
    follow_the_single_rank_curve(
        "dp=4,dp_shard=2,zero_stage=1;dp=4,dp_shard=2,zero_stage=2;dp=4,dp_shard=2,zero_stage=3;\
         dp=4,dp_shard=1,zero_stage=3;dp=2,dp_shard=1,cp=2,zero_stage=3,grad_accum_steps=2;\
         dp=2,cp=2,dp_shard=1,zero_stage=3;dp=2,tp=2,pp=2,dp_shard=1,zero_stage=2,grad_accum_steps=2",
    );
}

#[test]
fn hybrid_sharding_holds_a_shard_group_s_share_and_its_checkpoint_resumes_anywhere() {
    let (plain, hybrid) = (measured(3, &[]).0.held, measured(3, &["parallel.dp_shard=2"]).0.held);
    // 1/2 instead of 1/4 of the optimizer state and of the masters
    assert!(close(hybrid.optimizer, plain.optimizer as f64 * 2.0, 0.01), "{hybrid:?} vs {plain:?}");
    assert!(close(hybrid.weights, plain.weights as f64 * 2.0, 0.01), "{hybrid:?} vs {plain:?}");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hsdp");
    let hsdp = ["parallel.dp=4", "parallel.dp_shard=2", "parallel.zero_stage=3", "train.micro_batch_size=3"];
    let uninterrupted = run(&dir, &[&hsdp[..], &["checkpoint.every=4"]].concat(), None);
    for (label, layout) in [
        ("one rank", &["train.micro_batch_size=12"][..]),
        ("FSDP at dp 2", &["parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=6"]),
        ("hybrid again", &hsdp[..]),
    ] {
        let resumed = run(&tmp.path().join(label.replace(' ', "_")), layout, Some(&dir.join("step_000004")));
        for (step, (a, b)) in resumed.iter().zip(&uninterrupted[4..]).enumerate() {
            assert!((a - b).abs() < 1e-4, "{label}, step {}: {a} vs {b}", step + 4);
        }
    }
}

#[test]
fn hybrid_sharding_settings_that_cannot_be_are_named() {
    let err = |extra: &[&str]| format!("{:#}", Config::load(None, &sets(extra)).unwrap_err());
    let e = err(&["parallel.dp=4", "parallel.dp_shard=3", "parallel.zero_stage=3"]);
    assert!(e.contains("parallel.dp_shard = 3 does not divide parallel.dp = 4"), "{e}");
    let e = err(&["parallel.dp=4", "parallel.dp_shard=2"]);
    assert!(e.contains("parallel.dp_shard = 2 with parallel.zero_stage = 0"), "{e}");
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

#[test]
fn a_checkpoint_of_padded_chunks_is_the_one_rank_checkpoint() {
    // at dp 3 no tensor of the small model divides into partitions (32 norm values, 32·64 matrix
    // values…): every rank's last partition is padded, and the checkpoint must gather the partitions and
    // drop the padding. One step, saved; the learning rate is far below a weight's last bit, so
    // both save the weights they started from, and the moments agree to rounding.
    let tmp = tempfile::tempdir().unwrap();
    let saved = |name: &str, extra: &[&str]| {
        let dir = tmp.path().join(name);
        let frozen = ["train.steps=1", "train.lr=1e-30", "train.min_lr=1e-30", "checkpoint.every=1"];
        let mut all = sets(&frozen);
        all.extend(extra.iter().map(|s| s.to_string()));
        all.push(format!("checkpoint.dir=\"{}\"", dir.display()));
        train(&Config::load(None, &all).unwrap(), Options { quiet: true, ..Default::default() }).unwrap();
        common::checkpoint_tensors(&dir.join("step_000001"))
    };
    let (weights, moments) = saved("one", &[]);
    for stage in ["1", "3"] {
        let zero = [format!("parallel.zero_stage={stage}")];
        let layout = ["parallel.dp=3", "train.micro_batch_size=4", &zero[0]];
        let (w, m) = saved(&format!("zero{stage}"), &layout);
        common::assert_tensors_close(&format!("ZeRO-{stage} at dp 3"), &w, &weights, 0.0);
        common::assert_tensors_close(&format!("ZeRO-{stage} at dp 3"), &m, &moments, 1e-3);
    }
}

/// Rank 0 of two steps at dp 4 with ZeRO `stage`, on the built-in model with one sequence of 32
/// tokens per rank (weights, gradients and AdamW state outweigh the activations), with what
/// `ferrotron memory` estimated for it.
fn measured(stage: usize, extra: &[&str]) -> (Summary, RankMemory) {
    let mut sets: Vec<String> = ["train.micro_batch_size=1", "train.seq_len=32", "data.copy_lag=8", "parallel.dp=4"]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    sets.push(format!("parallel.zero_stage={stage}"));
    let cfg = Config::load(None, &sets).unwrap();
    let estimate = memory::memory(&cfg, false).unwrap().swap_remove(0);
    let mut two = cfg.clone();
    (two.train.steps, two.train.warmup_steps, two.checkpoint.every) = (2, 1, 0);
    (train_all(&two, Options { quiet: true, ..Default::default() }).unwrap().swap_remove(0), estimate)
}

/// `a` is `b` to within `rel`.
fn close(a: usize, b: f64, rel: f64) -> bool {
    (a as f64 - b).abs() <= rel * b
}

#[test]
fn each_stage_holds_its_share_measured_and_the_estimate_follows() {
    let runs: Vec<(Summary, RankMemory)> = (0..=3).map(|stage| measured(stage, &[])).collect();
    let h: Vec<Held> = runs.iter().map(|(s, _)| s.held).collect();
    // when the gradients are complete: AdamW state 1/dp from ZeRO-1 on (partitions are padded to
    // ⌈n/4⌉: a few values more), gradients 1/dp from ZeRO-2 on, weights 1/dp at ZeRO-3 (the
    // masters' partitions; no whole weight is kept between uses)
    for k in 1..=3 {
        assert!(close(h[k].optimizer, h[0].optimizer as f64 / 4.0, 0.01), "stage {k}: {:?} vs {:?}", h[k], h[0]);
    }
    assert!(
        close(h[1].grads, h[0].grads as f64 * 1.25, 0.01),
        "ZeRO-1 keeps full gradients and its partition: {:?}",
        h[1]
    );
    for k in 2..=3 {
        assert!(close(h[k].grads, h[0].grads as f64 / 4.0, 0.01), "stage {k}: {:?} vs {:?}", h[k], h[0]);
    }
    assert!(close(h[3].weights, h[0].weights as f64 / 4.0, 0.01), "ZeRO-3: {:?} vs {:?}", h[3], h[0]);
    // the measured peak falls with every stage (ZeRO-3 also holds a gathered layer and the next
    // one's gather at its busiest), and the estimate is within 10% of it
    for k in 1..=3 {
        assert!(
            runs[k].0.peak_bytes < runs[k - 1].0.peak_bytes,
            "stage {k} peak {} ≥ stage {}'s {}",
            runs[k].0.peak_bytes,
            k - 1,
            runs[k - 1].0.peak_bytes
        );
    }
    for (k, (s, e)) in runs.iter().enumerate() {
        assert!(
            close(s.peak_bytes, e.total_bytes, 0.1),
            "stage {k}: estimated {} B, measured {} B",
            e.total_bytes,
            s.peak_bytes
        );
    }
}

#[test]
fn the_memory_estimate_is_within_ten_percent_of_the_measured_peak_for_every_layout() {
    let base = ["train.micro_batch_size=4", "train.seq_len=64", "data.copy_lag=8"];
    for layout in [
        "parallel.dp=1",
        "parallel.dp=2",
        "parallel.tp=2",
        "parallel.pp=2,train.grad_accum_steps=4",
        "parallel.pp=2,train.grad_accum_steps=4,parallel.pp_schedule=\"afab\"",
        "parallel.cp=2",
        "parallel.dp=2,parallel.zero_stage=1",
        "parallel.dp=2,parallel.zero_stage=2,train.grad_accum_steps=2",
        "parallel.dp=2,parallel.zero_stage=2,train.grad_accum_steps=2,parallel.zero_reduce=\"once\"",
        "parallel.dp=2,parallel.zero_stage=2,train.grad_accum_steps=2,parallel.reduce_dtype=\"bf16\"",
        "parallel.dp=2,parallel.reduce_dtype=\"bf16\"",
        "parallel.dp=2,parallel.zero_stage=3,parallel.bucket_mb=0.05",
        "parallel.dp=2,parallel.tp=2,parallel.pp=2,parallel.zero_stage=3",
        "parallel.dp=2,parallel.cp=2,parallel.zero_stage=2",
        "parallel.dp=4,parallel.dp_shard=2,parallel.zero_stage=3",
    ] {
        let sets: Vec<String> = base.iter().map(|s| s.to_string()).chain(layout.split(',').map(String::from)).collect();
        let cfg = Config::load(None, &sets).unwrap();
        common::memory_estimate_within(&cfg, 0.1, layout);
    }
}

#[test]
fn bf16_adamw_moments_change_the_curve_a_little_and_shard_like_fp32_ones() {
    let bf16 = "train.optimizer_dtype=\"bf16\"";
    let run = |extra: &[&str]| {
        let cfg = Config::load(None, &sets(&[&["train.steps=30"], extra].concat())).unwrap();
        train(&cfg, Options { quiet: true, ..Default::default() }).unwrap().losses
    };
    let (fp32, rounded) = (run(&[]), run(&[bf16]));
    let diff = fp32.iter().zip(&rounded).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    // rounded moments move the curve (the option does something), and only a little
    assert!(diff > 1e-6 && diff < 0.05, "max |Δloss| {diff:e} between bf16 and fp32 moments");
    assert!(rounded[29] < rounded[0] - 0.5, "bf16 moments learn: {} → {}", rounded[0], rounded[29]);
    // partitioned over dp 2 with FSDP, the bf16 moments give the one-rank bf16-moment curve
    let fsdp = run(&[bf16, "parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=6"]);
    let diff = fsdp.iter().zip(&rounded).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(diff <= 1e-4, "FSDP with bf16 moments: max |Δloss| {diff:e}");
}

#[test]
fn fsdp_gathers_the_next_unit_while_this_one_computes_in_the_trace() {
    let cfg =
        Config::load(None, &sets(&["parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=6"])).unwrap();
    let trace = Trace::default();
    train(&cfg, Options { quiet: true, trace: Some(&trace), ..Default::default() }).unwrap();
    let spans: Vec<Span> = trace.spans().into_iter().filter(|s| s.rank == 0).collect();
    let units: Vec<&Span> = spans.iter().filter(|s| s.name.ends_with("(FSDP unit)")).collect();
    let gathers: Vec<&Span> =
        spans.iter().filter(|s| s.lane == Lane::Comm && s.name.starts_with("all_gather")).collect();
    // per step: the embedding, 2 blocks and the head forward, the head and 2 blocks backward
    assert_eq!(units.len(), 7 * 12, "{:?}", units.iter().take(8).map(|u| &u.name).collect::<Vec<_>>());
    assert_eq!(gathers.len(), 7 * 12);
    // every gather but the first of each pass (forward: the embedding's; backward: the head's) is
    // issued while the unit before it computes, and runs at least partly during that compute
    let during = |g: &Span| units.iter().any(|u| u.start_us <= g.issued_us && g.issued_us <= u.end_us);
    let prefetched: Vec<&&Span> = gathers.iter().filter(|g| during(g)).collect();
    assert_eq!(prefetched.len(), 5 * 12, "prefetched gathers per step: {}", prefetched.len() as f64 / 12.0);
    let overlap: f64 = prefetched
        .iter()
        .map(|g| units.iter().map(|u| (g.end_us.min(u.end_us) - g.start_us.max(u.start_us)).max(0.0)).sum::<f64>())
        .sum();
    assert!(overlap > 0.0, "no gather ran while a unit computed");
}

#[test]
fn ferrotron_memory_writes_every_rank_as_json() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("memory.json");
    let mut args = vec!["memory", "--measure", "--json", json.to_str().unwrap()];
    let sets = sets(&[
        "parallel.dp=2",
        "parallel.pp=2",
        "parallel.zero_stage=3",
        "train.micro_batch_size=6",
        "train.grad_accum_steps=2",
    ]);
    for s in &sets {
        args.extend(["--set", s]);
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(&args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("What shrinks each column") && text.contains("zero_stage 3 keeps 1/(dp·cp)"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    for (i, r) in ranks.iter().enumerate() {
        assert_eq!(r["rank"].as_u64(), Some(i as u64));
        let parts = ["weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "comm_bytes"];
        let sum: f64 = parts.iter().map(|k| r[k].as_f64().unwrap()).sum();
        assert!((sum - r["total_bytes"].as_f64().unwrap()).abs() < 1.0, "{r}");
        let measured = r["measured_peak_bytes"].as_f64().unwrap();
        assert!((sum / measured - 1.0).abs() <= 0.1, "rank {i}: estimated {sum}, measured {measured}");
    }
}

/// Gradients moved in bf16 (`parallel.reduce_dtype = "bf16"`): the same calls, half the bytes of
/// every reduce-scatter and of the dense all-reduce; the curve leaves one rank's (each average is
/// rounded to bf16) but stays within `converge`'s band for a lossy change.
#[test]
fn bf16_reductions_move_half_the_bytes_within_the_band_of_one_rank() {
    let spec = "dp=2,reduce_dtype=bf16;dp=2,dp_mode=naive,reduce_dtype=bf16;\
                dp=2,zero_stage=2,grad_accum_steps=3,reduce_dtype=bf16;\
                dp=2,zero_stage=3,grad_accum_steps=2,zero_reduce=once,reduce_dtype=bf16";
    let converge::Report { outcomes, .. } =
        converge::converge(None, &sets(&["train.steps=60"]), &parse_variants(spec).unwrap(), 1e-2).unwrap();
    for o in &outcomes {
        // within a lossy change's band (converge --tol 1e-2; measured: 2e-4 to 5e-4), and off the
        // curve: a run that never rounded would sit on it (under 1e-6, as the f32 layouts above)
        assert!(o.pass && o.max_diff > 1e-6, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    // the comm report: per (call) on the dp×cp axis, calls and bytes of rank 0 over the run
    let report = |extra: &[&str]| -> Vec<(String, u64, u64)> {
        let cfg = Config::load(None, &sets(&[&["train.steps=2", "parallel.dp=2"], extra].concat())).unwrap();
        let summary = train_all(&cfg, Options { quiet: true, ..Default::default() }).unwrap().remove(0);
        let gradient = |name: &str| name == "all_reduce" || name == "reduce_scatter"; // not the weights' gathers
        let grads = summary.comm.iter().filter(|t| t.axis == "dp×cp" && gradient(t.call.name()) && t.tally.bytes > 64);
        grads.map(|t| (t.call.name().to_string(), t.tally.calls, t.tally.bytes)).collect()
    };
    for layout in [&[][..], &["parallel.zero_stage=2", "train.grad_accum_steps=3"]] {
        let (f32s, bf16s) = (report(layout), report(&[layout, &["parallel.reduce_dtype=bf16"]].concat()));
        assert!(!f32s.is_empty(), "{layout:?}: no gradient reduction seen");
        // (the dp×cp axis also carries a few one-value sums, in f32 either way: at most 64 bytes)
        let halved = |(a, b): (&(String, u64, u64), &(String, u64, u64))| {
            a.0 == b.0 && a.1 == b.1 && b.2 >= a.2 / 2 && b.2 <= a.2 / 2 + 64
        };
        let same = f32s.len() == bf16s.len() && f32s.iter().zip(&bf16s).all(halved);
        assert!(same, "{layout:?}: bf16 moves half the bytes in the same calls: {bf16s:?} vs f32 {f32s:?}");
    }
}
