//! The communication ledger against the formulas: each axis's calls and bytes per step for tp,
//! tp with sequence parallelism, dp and pp, counted by the groups while the model trains; the
//! α–β model's arithmetic; `train --comm-report`'s table.

mod common;

use ferrotron::comm::cost::{report, AxisTally, Call, Link, Tally};
use ferrotron::config::Config;
use ferrotron::train::{train_all, Options};
use std::process::Command;

const STEPS: usize = 3;

/// Rank 0's (calls, bytes) per step of `call` on `axis`, and the config, for a run of `extra`.
fn per_step(extra: &[&str]) -> (Config, impl Fn(&str, Call) -> (u64, u64)) {
    let run = ["train.micro_batch_size=4", "train.grad_accum_steps=2", "train.steps=3", "train.warmup_steps=1"];
    let sets: Vec<String> = common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect();
    let cfg = Config::load(None, &sets).unwrap();
    let summaries = train_all(&cfg, Options { quiet: true, ..Default::default() }).unwrap();
    let comm = summaries[0].comm.clone();
    let lookup = move |axis: &str, call: Call| {
        let t = comm.iter().find(|t| t.axis == axis && t.call == call).map_or(Tally::default(), |t| t.tally);
        assert_eq!(t.calls % STEPS as u64, 0, "{axis} {call:?}: every step makes the same calls");
        (t.calls / STEPS as u64, t.bytes / STEPS as u64)
    };
    (cfg, lookup)
}

#[test]
fn tensor_parallel_traffic_follows_the_formula() {
    let (cfg, count) = per_step(&["parallel.tp=2"]);
    let (m, l, d) = (2, cfg.model.num_hidden_layers as u64, cfg.model.hidden_size as u64);
    let rows = 4 * cfg.train.seq_len as u64;
    // per micro-batch: the embedding's g, two g forward and two f backward per block, the
    // head's f, and three row statistics of the cross-entropy; per step the gradient norm's sum
    let calls = m * (1 + 4 * l + 1 + 3) + 1;
    let bytes = m * 4 * (rows * d * (1 + 4 * l + 1) + 3 * rows) + 4;
    assert_eq!(count("tp", Call::AllReduce), (calls, bytes));
    assert_eq!(count("tp", Call::AllGather), (0, 0));
}

#[test]
fn sequence_parallelism_trades_each_all_reduce_for_a_gather_and_a_scatter() {
    let (cfg, count) = per_step(&["parallel.tp=2", "parallel.sequence_parallel=true"]);
    let (m, l, d) = (2, cfg.model.num_hidden_layers as u64, cfg.model.hidden_size as u64);
    let (rows, x) = (4 * cfg.train.seq_len as u64, 4 * cfg.train.seq_len as u64 * cfg.model.hidden_size as u64 * 4);
    // all-gathers: before q|k|v, gate|up and the output layer forward; in backward the output
    // gradients of o and down, the column layers' inputs again, and the embedding's gradient
    assert_eq!(count("tp", Call::AllGather), (m * (6 * l + 3), m * (6 * l + 3) * x));
    // reduce-scatters: the embedding's and each row layer's sum forward, each column layer's
    // input gradient backward
    assert_eq!(count("tp", Call::ReduceScatter), (m * (4 * l + 2), m * (4 * l + 2) * x));
    // all-reduces left: the cross-entropy's statistics, the gradient norm, the norms' gradients
    let norms = (2 * l + 1) * d * 4;
    assert_eq!(count("tp", Call::AllReduce), (m * 3 + 2, m * 3 * rows * 4 + 4 + norms));
}

#[test]
fn data_and_pipeline_parallel_traffic_follows_the_formula() {
    let (cfg, count) = per_step(&["parallel.dp=2"]);
    // one bucket (25 MiB holds every gradient) all-reduced once per step, and the loss averaged
    let weights = cfg.model.parameter_count() as u64;
    assert_eq!(count("dp×cp", Call::AllReduce), (2, 4 * weights + 4));
    let (cfg, count) = per_step(&["parallel.pp=2"]);
    // 1F1B, 2 stages, 2 micro-batches: stage 0 sends F0, exchanges F1 for dB0, receives dB1;
    // every message is one micro-batch's activations or their gradient
    let x = 4 * cfg.train.seq_len as u64 * cfg.model.hidden_size as u64 * 4;
    assert_eq!(count("pp", Call::P2p), (3, 3 * x));
    assert_eq!(count("pp", Call::Broadcast), (1, 4), "the loss, from the last stage");
    assert_eq!(count("pp", Call::AllReduce), (1, 4), "the gradient norm's sum");
}

#[test]
fn the_alpha_beta_model_adds_hops_and_bytes() {
    let t = Tally { calls: 10, bytes: 4_000_000, seconds: 0.0 };
    let (a, b) = Link::Pcie.alpha_beta();
    // a ring all-reduce over 4 ranks: 2·3 hops, 2·3/4 of the bytes through each link
    let want = 10.0 * 6.0 * a + 1.5 * 4e6 / b;
    assert!((t.predicted_seconds(Call::AllReduce, 4, Link::Pcie) - want).abs() < 1e-12);
    let want = 10.0 * 3.0 * a + 0.75 * 4e6 / b; // half of that: a reduce-scatter
    assert!((t.predicted_seconds(Call::ReduceScatter, 4, Link::Pcie) - want).abs() < 1e-12);
    assert!((t.predicted_seconds(Call::P2p, 2, Link::Pcie) - (10.0 * a + 4e6 / b)).abs() < 1e-12);
    // one large all-reduce (bandwidth-bound) is ~18× faster over NVLink than PCIe, 2× over
    // InfiniBand; ten small ones (latency-bound) only ~3× over NVLink
    let large = Tally { calls: 1, bytes: 400_000_000, seconds: 0.0 };
    let on = |t: &Tally, link| t.predicted_seconds(Call::AllReduce, 8, link);
    assert!(
        on(&large, Link::Pcie) > 15.0 * on(&large, Link::Nvlink) && on(&large, Link::Pcie) > 1.9 * on(&large, Link::Ib)
    );
    assert!(on(&t, Link::Pcie) < 5.0 * on(&t, Link::Nvlink), "400 kB a call: the hops' latency dominates");
    // the report: per step and per rank, means over ranks
    let rank = vec![AxisTally { axis: "tp", ranks: 4, call: Call::AllReduce, tally: t }];
    let table = report(&[rank.clone(), rank], 2, Link::Pcie);
    assert!(table.contains("tp") && table.contains("all_reduce") && table.contains("5.0"), "{table}");
    assert!(table.contains(&format!("{:.3}", 4e6 / 2.0 / 1e6)), "2 MB per step: {table}");
}

#[test]
fn train_comm_report_prints_every_axis() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["train", "--comm-report", "--link", "ib"])
        .args(common::SMALL.iter().flat_map(|s| ["--set", s]))
        .args(["--set", "train.steps=2", "--set", "parallel.dp=2", "--set", "parallel.tp=2"])
        .args(["--set", "checkpoint.every=0"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("α–β model on ib: α = 5 µs, β = 50 GB/s"), "{text}");
    for row in ["tp ", "dp×cp ", "world "] {
        assert!(text.lines().any(|l| l.starts_with(row) && l.contains("all_reduce")), "{row}: {text}");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["train", "--comm-report", "--link", "wifi"])
        .output()
        .unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("nvlink"));
}
