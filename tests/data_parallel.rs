//! Data parallelism: DP runs reproduce the single-rank loss curve, naive and bucketed agree bit
//! for bit whatever the bucket size, accumulation keeps the global batch and communicates once per
//! step, replicas stay identical, and the trace shows all-reduce starting during backward.

use ferrotron::comm::trace::{Lane, Trace};
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::config::Config;
use ferrotron::parallel::data_parallel::gradient_all_reduce;
use ferrotron::train::{self, train_all, Options, Summary};

mod common;

/// 20 steps of the small model; a global batch of 12 splits into 1, 2, 3 and 4 ranks.
const RUN: &[&str] = &["train.micro_batch_size=12", "train.steps=20", "train.warmup_steps=5"];

fn sets(extra: &[&str]) -> Vec<String> {
    common::SMALL.iter().chain(RUN).chain(extra).map(|s| s.to_string()).collect()
}

/// The trace test measures when all-reduces are issued against backward: it should not share the
/// two cores with the other training tests of this file, so each takes this lock while it trains.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(extra: &[&str]) -> Vec<Summary> {
    let _alone = alone();
    let cfg = Config::load(None, &sets(extra)).unwrap();
    train_all(&cfg, Options { quiet: true, ..Default::default() }).unwrap()
}

#[test]
fn dp_2_3_4_follow_the_single_rank_curve() {
    let variants = parse_variants("dp=2;dp=3;dp=4;dp=2,grad_accum_steps=3").unwrap();
    let converge::Report { baseline, outcomes, .. } = {
        let _alone = alone();
        converge::converge(None, &sets(&[]), &variants, 1e-4).unwrap()
    };
    assert_eq!(baseline.len(), 20);
    assert!(baseline[19] < baseline[0] - 0.5, "the baseline learns: {} → {}", baseline[0], baseline[19]);
    for o in &outcomes {
        assert_eq!(o.losses.len(), 20, "{}", o.label);
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn naive_and_bucketed_agree_bit_for_bit_at_every_bucket_size() {
    let reference = run(&["parallel.dp=2", "parallel.dp_mode=\"naive\""]);
    for bucket_mb in ["1e-6", "0.01", "0.05", "25", "1e4"] {
        let set = format!("parallel.bucket_mb={bucket_mb}");
        let bucketed = run(&["parallel.dp=2", &set]);
        assert_eq!(bucketed[0].losses, reference[0].losses, "bucket_mb = {bucket_mb}");
        assert_eq!(bucketed[0].checksum, reference[0].checksum, "bucket_mb = {bucket_mb}");
    }
}

#[test]
fn replicas_stay_bit_identical() {
    let ranks = run(&["parallel.dp=3", "parallel.bucket_mb=0.01"]);
    assert_eq!(ranks.len(), 3);
    assert!(ranks.iter().all(|r| r.checksum == ranks[0].checksum && r.losses == ranks[0].losses));
}

#[test]
fn accumulation_4x1_equals_1x4() {
    let four_micro = run(&["train.micro_batch_size=1", "train.grad_accum_steps=4", "train.steps=6"]);
    let one_micro = run(&["train.micro_batch_size=4", "train.grad_accum_steps=1", "train.steps=6"]);
    for (step, (a, b)) in four_micro[0].losses.iter().zip(&one_micro[0].losses).enumerate() {
        assert!((a - b).abs() < 1e-5, "step {step}: {a} vs {b}");
    }
}

#[test]
fn trace_shows_one_sync_per_step_overlapping_backward() {
    let cfg = Config::load(
        None,
        &sets(&[
            "parallel.dp=2",
            "parallel.bucket_mb=0.01",
            "train.steps=3",
            "train.grad_accum_steps=3",
            "train.micro_batch_size=2",
        ]),
    )
    .unwrap();
    let trace = Trace::default();
    let _alone = alone();
    train::train(&cfg, Options { trace: Some(&trace), quiet: true, ..Default::default() }).unwrap();
    let spans = trace.spans();
    for rank in 0..2 {
        let of = |lane: Lane, keep: &dyn Fn(&str) -> bool| -> Vec<_> {
            spans.iter().filter(|s| s.rank == rank && s.lane == lane && keep(&s.name)).cloned().collect()
        };
        let backward = of(Lane::Compute, &|n| n.starts_with("backward"));
        let buckets = of(Lane::Comm, &gradient_all_reduce);
        assert_eq!(backward.len(), 9, "3 steps × 3 micro-batches");
        assert_eq!(of(Lane::Compute, &|n| n == "optimizer").len(), 3);
        let per_step = buckets.len() / 3;
        assert!(
            per_step >= 3 && buckets.len() == 3 * per_step,
            "one reduction per bucket per step, not per micro-batch"
        );
        // When an all-reduce *runs* depends on the scheduler and on the peer (on two busy cores the
        // comm thread may only get a core after backward); when it is *issued* does not: a bucket
        // is handed to the comm thread as soon as its last gradient is written, inside backward.
        for step in 0..3 {
            let last_backward = &backward[step * 3 + 2];
            let these = &buckets[step * per_step..(step + 1) * per_step];
            assert!(
                these.iter().all(|b| b.issued_us > last_backward.start_us && b.issued_us < last_backward.end_us),
                "rank {rank} step {step}: every bucket is issued during the last backward"
            );
            assert!(these.iter().all(|b| b.start_us >= b.issued_us), "a call runs after it is issued");
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    trace.write(&path).unwrap();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    assert!(events.iter().any(|e| e["ph"] == "X" && e["pid"] == 1 && e["tid"] == 1));
}

/// The first trace a learner opens (`train --trace` at dp = 2 on the defaults) shows the bucketing
/// lesson, not its opposite: the default buckets split the tiny model, so all but the last are
/// issued while backward still runs.
#[test]
fn the_defaults_trace_has_several_buckets_issued_inside_backward() {
    let cfg = Config::load(None, &["parallel.dp=2", "train.steps=1"].map(String::from)).unwrap();
    let trace = Trace::default();
    let _alone = alone();
    train::train(&cfg, Options { trace: Some(&trace), quiet: true, ..Default::default() }).unwrap();
    let spans = trace.spans();
    let backward = spans.iter().find(|s| s.rank == 0 && s.name.starts_with("backward")).unwrap();
    let buckets: Vec<_> = spans.iter().filter(|s| s.rank == 0 && gradient_all_reduce(&s.name)).collect();
    let inside = buckets.iter().filter(|b| b.issued_us < backward.end_us).count();
    assert!(
        buckets.len() >= 3 && inside >= buckets.len() - 1,
        "{} buckets, {inside} issued inside backward",
        buckets.len()
    );
}

#[test]
fn variant_errors_are_clear() {
    let err = |spec: &str| parse_variants(spec).err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(err("dp").contains("not key=value"));
    assert!(err("zp=2").contains("unknown key `zp`"));
    assert!(err(" ; ").contains("empty"));
    let variants = parse_variants("dp=5").unwrap();
    let msg = format!("{:#}", converge::converge(None, &sets(&[]), &variants, 1e-4).err().unwrap());
    assert!(msg.contains("does not split"), "{msg}");
}
