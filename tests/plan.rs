//! `ferrotron plan`'s deterministic half against the code that runs: each axis's calls and bytes
//! against the ledger of real runs, memory against `ferrotron memory`, bubbles against the schedule.

mod common;

use ferrotron::comm::cost::Call;
use ferrotron::commands::traffic;
use ferrotron::config::Config;
use ferrotron::parallel::layout::grid_of;
use ferrotron::parallel::schedules::stage_of;
use ferrotron::train::{train_all, Options};

const STEPS: usize = 2;

/// Every rank's ledger against the model of its stage: (axis, call) → (calls, bytes) per step.
fn ledger_matches(extra: &[&str]) {
    let run = [
        "train.micro_batch_size=4",
        "train.grad_accum_steps=4",
        "train.steps=2",
        "train.warmup_steps=1",
        "checkpoint.every=0",
    ];
    let sets: Vec<String> = common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect();
    let cfg = Config::load(None, &sets).unwrap();
    let summaries = train_all(&cfg, Options { quiet: true, stop_on_signal: true, ..Default::default() }).unwrap();
    let grid = grid_of(&cfg.parallel).unwrap();
    let mut bad = Vec::new();
    // what an ep rank sends depends on its tokens' routing: that axis is compared as the mean
    // over the ranks of a stage
    let of = |rank: usize, axis: &str, call: Call| {
        let one = |r: usize| {
            summaries[r]
                .comm
                .iter()
                .find(|t| t.axis == axis && t.call == call)
                .map_or((0.0, 0.0), |t| (t.tally.calls as f64 / STEPS as f64, t.tally.bytes as f64 / STEPS as f64))
        };
        match axis {
            "ep" => {
                let same: Vec<usize> =
                    (0..summaries.len()).filter(|&r| grid.coords(r).pp == grid.coords(rank).pp).collect();
                let sum = same.iter().map(|&r| one(r)).fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
                (sum.0 / same.len() as f64, sum.1 / same.len() as f64)
            }
            _ => one(rank),
        }
    };
    for (rank, s) in summaries.iter().enumerate() {
        let stage = stage_of(grid.coords(rank).pp, &cfg.parallel);
        let model = traffic::per_step(&cfg, stage);
        let mut keys: Vec<(&str, Call)> =
            s.comm.iter().filter(|t| t.tally.calls > 0).map(|t| (t.axis, t.call)).collect();
        keys.extend(model.iter().map(|f| (f.axis, f.call)));
        keys.sort();
        keys.dedup();
        for (axis, call) in keys {
            let got = of(rank, axis, call);
            let want = model
                .iter()
                .filter(|f| f.axis == axis && f.call == call)
                .fold((0.0, 0.0), |a, f| (a.0 + f.calls, a.1 + f.bytes));
            if got != want {
                bad.push(format!("rank {rank} {axis} {}: ledger {got:?}, plan {want:?}", call.name()));
            }
        }
    }
    assert!(bad.is_empty(), "{extra:?}:\n{}", bad.join("\n"));
}

#[test]
fn debug_all() {
    for l in [
        &["parallel.dp=2"][..],
        &["parallel.dp=2", "parallel.bucket_mb=0.01"],
        &["parallel.dp=2", "parallel.dp_mode=naive"],
        &["parallel.dp=2", "parallel.zero_stage=1", "parallel.bucket_mb=0.01"],
        &["parallel.dp=2", "parallel.zero_stage=2"],
        &["parallel.dp=2", "parallel.zero_stage=3"],
        &["parallel.tp=2"],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        &["parallel.pp=2"],
        &["parallel.pp=2", "parallel.pp_schedule=afab"],
        &[
            "parallel.pp=2",
            "parallel.pp_schedule=interleaved",
            "parallel.pp_virtual_stages=2",
            "model.num_hidden_layers=4",
        ],
        &["parallel.pp=2", "parallel.pp_schedule=zb-h1"],
        &["parallel.pp=2", "parallel.pp_schedule=zbv", "model.num_hidden_layers=4"],
        &["parallel.cp=2"],
        &["parallel.cp=2", "parallel.cp_mode=ulysses"],
        &["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2"],
        &["parallel.dp=2", "parallel.ep=2", "model.num_local_experts=4", "model.num_experts_per_tok=2"],
        &[
            "parallel.dp=4",
            "parallel.ep=2",
            "parallel.zero_stage=2",
            "model.num_local_experts=4",
            "model.num_experts_per_tok=2",
        ],
        &[
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.zero_stage=1",
            "parallel.sequence_parallel=true",
        ],
        &["parallel.dp=2", "parallel.cp=2", "parallel.zero_stage=3", "parallel.bucket_mb=0.01"],
        &["parallel.pp=4", "model.num_hidden_layers=4", "parallel.pp_schedule=1f1b", "train.grad_accum_steps=8"],
        &["parallel.cp=4", "parallel.cp_mode=ulysses", "model.num_key_value_heads=2"],
        &["parallel.cp=3", "train.seq_len=48"],
    ] {
        let r = std::panic::catch_unwind(|| ledger_matches(l));
        if r.is_err() {
            eprintln!("FAILED {l:?}");
        }
    }
}
