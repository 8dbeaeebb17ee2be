//! `ferrotron plan`'s deterministic half against the code that runs: each axis's calls and bytes
//! against the ledger of real runs, memory against `ferrotron memory`, bubbles against the schedule.

mod common;

use ferrotron::comm::cost::Call;
use ferrotron::commands::schedule::simulate;
use ferrotron::commands::{plan, traffic};
use ferrotron::config::{Config, DeviceDtype};
use ferrotron::parallel::layout::grid_of;
use ferrotron::parallel::schedules::stage_of;
use ferrotron::train::memory;
use ferrotron::train::{train_all, Options};
use std::path::Path;
use std::process::Command;

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
fn data_parallel_and_zero_bytes_equal_the_ledger() {
    ledger_matches(&["parallel.dp=2"]);
    ledger_matches(&["parallel.dp=2", "parallel.bucket_mb=0.01"]); // many buckets
    ledger_matches(&["parallel.dp=2", "parallel.dp_mode=naive"]);
    ledger_matches(&["parallel.dp=2", "parallel.zero_stage=1", "parallel.bucket_mb=0.01"]);
    ledger_matches(&["parallel.dp=2", "parallel.zero_stage=2"]);
    ledger_matches(&["parallel.dp=2", "parallel.zero_stage=3"]);
    ledger_matches(&["parallel.dp=2", "parallel.zero_stage=2", "parallel.zero_reduce=once"]); // once a step
    ledger_matches(&["parallel.dp=2", "parallel.zero_stage=3", "parallel.zero_reduce=once", "parallel.bucket_mb=0.01"]);
    ledger_matches(&["parallel.dp=3", "parallel.zero_stage=3", "parallel.bucket_mb=0.01"]); // padded chunks
    ledger_matches(&["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2"]);
    // gradients moved in bf16: half the bytes of the all-reduce and of the reduce-scatters
    ledger_matches(&["parallel.dp=2", "parallel.reduce_dtype=bf16"]);
    ledger_matches(&["parallel.dp=2", "parallel.dp_mode=naive", "parallel.reduce_dtype=bf16"]);
    ledger_matches(&["parallel.dp=2", "parallel.zero_stage=2", "parallel.reduce_dtype=bf16"]);
    ledger_matches(&["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2", "parallel.reduce_dtype=bf16"]);
    // hybrid
}

#[test]
fn tensor_and_context_parallel_bytes_equal_the_ledger() {
    ledger_matches(&["parallel.tp=2"]);
    ledger_matches(&["parallel.tp=2", "parallel.sequence_parallel=true"]);
    // 2 KV heads over 4 ranks: the copies' gradients summed once a step (with ZeRO, partitions)
    ledger_matches(&["parallel.tp=4"]);
    ledger_matches(&[
        "parallel.tp=4",
        "parallel.sequence_parallel=true",
        "parallel.cp=2",
        "parallel.cp_mode=ulysses",
        "model.num_attention_heads=8",
    ]);
    ledger_matches(&["parallel.tp=4", "parallel.dp=2", "parallel.zero_stage=2"]);
    ledger_matches(&["parallel.cp=2"]);
    ledger_matches(&["parallel.cp=3", "train.seq_len=48"]);
    ledger_matches(&["parallel.cp=2", "parallel.cp_mode=ulysses"]);
    ledger_matches(&["parallel.cp=4", "parallel.cp_mode=ulysses"]); // KV heads repeated
    ledger_matches(&["parallel.dp=2", "parallel.cp=2", "parallel.zero_stage=3", "parallel.bucket_mb=0.01"]);
}

/// Latent attention on the small model: every head its own KV head, both latents, a value head
/// narrower than the query/key's.
const MLA: [&str; 6] = [
    "model.num_key_value_heads=4",
    "model.kv_lora_rank=8",
    "model.q_lora_rank=6",
    "model.qk_nope_head_dim=4",
    "model.qk_rope_head_dim=4",
    "model.v_head_dim=6",
];

/// Latent attention: the ring passes each block's source (kv_lora_rank + qk_rope_head_dim a
/// token), Ulysses moves the padded heads, tp sums the replicated latent path's gradients once a
/// step; DeepSeekMoE's experts over ep.
#[test]
fn latent_attention_bytes_equal_the_ledger() {
    for layout in [
        &["parallel.cp=2"][..],
        &["parallel.cp=3", "train.seq_len=48"],
        &["parallel.cp=2", "parallel.cp_mode=ulysses"],
        &["parallel.cp=2", "parallel.cp_mode=ulysses", "model.v_head_dim=12"], // heads padded to v
        &["parallel.tp=2"],
        &["parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=2"],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ] {
        ledger_matches(&[&MLA[..], layout].concat());
    }
    let deepseek_moe = [
        "model.num_local_experts=4",
        "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=8",
        "model.n_shared_experts=1",
    ];
    ledger_matches(&[&MLA[..], &deepseek_moe, &["parallel.dp=2", "parallel.ep=2"]].concat());
}

/// The step-time model prices every GEMM a layer runs: with each GEMM at 1 TFLOP/s and nothing
/// else costing time, a micro-batch's forward is its GEMM FLOPs, counted here from the shapes by
/// hand: latent attention's five projections (kv_b_proj once per ring block its heads are made
/// for, and once more in the backward, which makes them again), DeepSeekMoE's router, k experts
/// of their own width and the shared expert, its first layer dense, the head.
#[test]
fn the_step_time_model_prices_latent_attention_and_deepseek_moe_gemm_by_gemm() {
    use ferrotron::commands::step_time::{micro_batch, Rates};
    let rates = Rates {
        source: "a GEMM at 1 TFLOP/s, nothing else".into(),
        peak_tflops: 1.0,
        gemm: vec![(1.0, 1.0)],
        attention: 1e30,
        small_gb_s: 1e30,
        op_us: 0.0,
        overlap_slowdown: 0.0,
    };
    let deepseek = [
        "model.num_hidden_layers=3",
        "model.num_local_experts=4",
        "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=8",
        "model.n_shared_experts=1",
        "model.first_k_dense_replace=1",
    ];
    for (layout, blocks) in
        [(&[][..], 1.0), (&["parallel.cp=2"], 2.0), (&["parallel.cp=2", "parallel.cp_mode=ulysses"], 1.0)]
    {
        let sets: Vec<String> =
            common::SMALL.iter().chain(&MLA).chain(&deepseek).chain(layout).map(|s| s.to_string()).collect();
        let cfg = Config::load(None, &sets).unwrap();
        let (m, t) = (&cfg.model, &cfg.train);
        let rows = (t.micro_batch_size * t.seq_len / cfg.parallel.cp) as f64;
        let (d, h) = (32.0, 4.0);
        let latent = d * 6.0 + 6.0 * h * 8.0 + d * 12.0 + h * 6.0 * d; // q_a, q_b, kv_a, o
        let kv_b = 8.0 * h * (4.0 + 6.0);
        let (dense, moe) = (3.0 * d * 64.0, d * 4.0 + 2.0 * 3.0 * d * 8.0 + 3.0 * d * 8.0);
        let per_token = 3.0 * (latent + blocks * kv_b) + dense + 2.0 * moe + d * m.vocab_size as f64;
        let mb = micro_batch(&cfg, stage_of(0, &cfg.parallel), &rates, 1.0);
        let want = 2.0 * rows * per_token;
        let close = |got: f64, want: f64| ((got - want) / want).abs() < 1e-6;
        assert!(close(mb.forward * 1e12, want), "{layout:?}: forward {} FLOPs, counted {want}", mb.forward * 1e12);
        let again = 2.0 * rows * 3.0 * blocks * kv_b;
        assert!(close(mb.backward * 1e12, 2.0 * want + again), "{layout:?}: backward {}", mb.backward * 1e12);
    }
}

#[test]
fn pipeline_bytes_equal_the_ledger_for_every_schedule() {
    let four = "model.num_hidden_layers=4";
    ledger_matches(&["parallel.pp=2"]);
    ledger_matches(&["parallel.pp=2", "parallel.pp_schedule=afab"]);
    ledger_matches(&["parallel.pp=4", four, "train.grad_accum_steps=8"]);
    ledger_matches(&["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2", four]);
    ledger_matches(&["parallel.pp=2", "parallel.pp_schedule=zb-h1"]);
    ledger_matches(&["parallel.pp=2", "parallel.pp_schedule=zbv", four]);
    ledger_matches(&[
        "parallel.dp=2",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.zero_stage=1",
        "parallel.sequence_parallel=true",
    ]);
}

#[test]
fn a_tied_embeddings_swap_between_the_pipelines_ends_equals_the_ledger() {
    let (tied, four) = ("model.tie_word_embeddings=true", "model.num_hidden_layers=4");
    ledger_matches(&[tied, "parallel.pp=2"]);
    ledger_matches(&[tied, four, "parallel.pp=4", "parallel.pp_schedule=afab", "train.grad_accum_steps=8"]);
    ledger_matches(&[tied, four, "parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2"]);
    ledger_matches(&[tied, "parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=2"]);
    ledger_matches(&[tied, "parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=3", "parallel.bucket_mb=0.01"]);
    ledger_matches(&[tied, "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]);
}

#[test]
fn expert_bytes_equal_the_ledger_as_a_mean_over_the_ep_ranks() {
    let moe = ["model.num_local_experts=4", "model.num_experts_per_tok=2"];
    ledger_matches(&[&["parallel.dp=2", "parallel.ep=2"][..], &moe].concat());
    ledger_matches(&[&["parallel.dp=4", "parallel.ep=2", "parallel.zero_stage=2"][..], &moe].concat());
}

/// A layout of the small model on GPUs (nothing runs: the plan and the estimate only read shapes).
fn on_gpus(extra: &[&str]) -> Config {
    let sets: Vec<String> = common::SMALL
        .iter()
        .chain(&["device.kind=\"cuda\"", "train.micro_batch_size=4", "train.grad_accum_steps=8"])
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    Config::load(None, &sets).unwrap()
}

fn h100s(n: usize) -> plan::Cluster {
    plan::cluster("h100", (n, 8), DeviceDtype::Bf16, None).unwrap()
}

const LAYOUTS: &[&[&str]] = &[
    &["parallel.dp=2"],
    &["parallel.dp=4", "parallel.zero_stage=1"],
    &["parallel.dp=2", "parallel.zero_stage=3", "train.recompute=\"selective\""],
    &["parallel.dp=4", "parallel.zero_stage=3", "parallel.dp_shard=2"],
    &["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"],
    &["parallel.pp=2", "parallel.pp_schedule=afab", "train.loss_stripe_rows=16"],
    &["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2", "model.num_hidden_layers=4"],
    &["parallel.pp=2", "parallel.pp_schedule=zbv", "model.num_hidden_layers=4"],
    &["parallel.cp=2", "parallel.dp=2", "parallel.zero_stage=2", "train.recompute=\"full\""],
    &["parallel.dp=2", "parallel.ep=2", "model.num_local_experts=4", "model.num_experts_per_tok=2"],
];

#[test]
fn plans_memory_is_ferrotron_memorys_for_the_same_layout() {
    for extra in LAYOUTS {
        let cfg = on_gpus(extra);
        let layout = plan::predict(&cfg, &h100s(cfg.parallel.world_size())).unwrap();
        let ranks = memory::per_rank(&cfg).unwrap();
        let busiest = ranks.iter().map(|r| r.total_bytes).fold(0.0, f64::max);
        assert_eq!(layout.memory_gib * (1u64 << 30) as f64, busiest, "{extra:?}");
        let kinds = layout.breakdown.unwrap().memory_gib.iter().sum::<f64>();
        assert!((kinds - layout.memory_gib).abs() < 1e-9, "{extra:?}: the kinds add up to the total");
    }
}

#[test]
fn plans_bubble_is_the_schedules() {
    for extra in LAYOUTS.iter().filter(|l| l.iter().any(|s| s.starts_with("parallel.pp="))) {
        let cfg = on_gpus(extra);
        let p = &cfg.parallel;
        let layout = plan::predict(&cfg, &h100s(cfg.parallel.world_size())).unwrap();
        let chunks = ferrotron::parallel::schedules::stage_of(0, p).chunks;
        let want = simulate(p.pp_schedule, p.pp, cfg.train.grad_accum_steps, chunks).unwrap().bubble();
        assert_eq!(layout.breakdown.unwrap().bubble, want, "{extra:?}");
        assert!(want > 0.0, "{extra:?}: a pipeline of 8 micro-batches has a bubble");
    }
}

#[test]
fn plan_searches_a_405b_model_on_16384_gpus_and_ranks_what_fits() {
    let model = plan::model_of(Some(Path::new("tests/fixtures/plan/llama-3.1-405b.json")), &[]).unwrap();
    let cluster = h100s(16384);
    let ask = plan::Ask { global_batch_tokens: 2048 * 8192, seq_len: 8192, dtype: DeviceDtype::Bf16, runnable: false };
    let layouts = plan::plan(&model, &cluster, &ask).unwrap().layouts;
    let fit: Vec<_> = layouts.iter().filter(|l| l.fits).collect();
    assert!(!fit.is_empty(), "some layout of 405B fits on 16,384 H100s");
    assert!(layouts.iter().any(|l| !l.fits), "and some does not (one rank cannot hold its weights)");
    assert!(fit.windows(2).all(|w| w[0].tokens_per_s >= w[1].tokens_per_s), "fastest first");
    assert!(fit[0].tp <= 8, "the fastest keeps tensor parallelism inside a node: {:?}", fit[0]);
    for l in &fit {
        assert!(l.memory_gib <= 80.0, "{l:?}");
        // tp beyond a node is tried, and priced on the network
        let crosses = l.breakdown.as_ref().unwrap().comm.iter().any(|a| a.flow.axis == "tp" && a.across_nodes);
        assert_eq!(crosses, l.tp > 8, "{l:?}");
        assert_eq!(l.dp * l.tp * l.pp * l.cp, 16384);
        assert_eq!(l.micro_batch_size * l.grad_accum_steps * l.dp, 2048, "the global batch is kept");
        let b = l.breakdown.as_ref().unwrap();
        assert!(b.compute_s > 0.0 && l.step_s.unwrap() >= b.compute_s && l.mfu.unwrap() < 1.0, "{l:?}");
    }
}

#[test]
fn tensor_parallelism_across_nodes_is_priced_on_the_network() {
    // tp = 8 on nodes of 8 GPUs talks over NVLink; the same on nodes of 4 would cross the network
    let wide = [
        "model.hidden_size=1024",
        "model.intermediate_size=2048",
        "model.num_attention_heads=8",
        "model.num_key_value_heads=4",
        "train.seq_len=1024",
        "parallel.tp=4",
    ];
    let cfg = on_gpus(&wide);
    let inside = plan::predict(&cfg, &plan::cluster("h100", (4, 8), DeviceDtype::Bf16, None).unwrap()).unwrap();
    let across = plan::predict(&cfg, &plan::cluster("h100", (4, 2), DeviceDtype::Bf16, None).unwrap()).unwrap();
    let tp = |l: &plan::Layout| {
        l.breakdown
            .as_ref()
            .unwrap()
            .comm
            .iter()
            .filter(|a| a.flow.axis == "tp")
            .map(|a| (a.wire_s, a.across_nodes))
            .fold((0.0, false), |s, a| (s.0 + a.0, s.1 | a.1))
    };
    let ((fast, a), (slow, b)) = (tp(&inside), tp(&across));
    assert!(!a && b, "inside a node, then across");
    assert!(slow > 5.0 * fast, "450 GB/s NVLink against 50 GB/s: {fast} s vs {slow} s");
}

fn ferrotron(args: &[&str]) -> (bool, String, String) {
    said(Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(args))
}

/// `ferrotron ARGS` with its cache folder (the calibration file's) in `cache`.
fn ferrotron_cached(cache: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    said(Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(args).env("FERROTRON_CACHE", cache))
}

/// Whether `command` succeeded, and its stdout and stderr.
fn said(command: &mut Command) -> (bool, String, String) {
    let out = command.output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn plan_refuses_impossible_inputs_in_one_line() {
    let hf = "tests/fixtures/plan/llama-3-8b.json";
    for (args, says) in [
        (&["plan", "--gpus", "12", "--gpus-per-node", "8"][..], "--gpus 12 is not a whole number of nodes"),
        (&["plan", "--gpu", "x100"], "--gpu x100: not in the device table"),
        (&["plan", "--gpus", "0"], "--gpus 0"),
        (&["plan", "--seq-len", "128", "--global-batch-tokens", "1000"], "not a whole number of sequences"),
        (&["plan", "--config", hf], "a Hugging Face config.json holds no batch"),
        (&["plan", "--gpu", "a100", "--dtype", "fp8"], "no FP8 tensor cores"),
        (&["plan", "--net-gb-s", "0"], "--net-gb-s 0: give a positive number"),
        (&["plan", "--fixed", "--gpus", "8", "--set", "parallel.tp=3"], "does not divide --gpus 8"),
        (&["plan", "--explain", "9999"], "--explain 9999: the table has layouts 1 to"),
        (&["bench", "--calibrate", "--set", "device.kind=\"cuda\""], "CUDA driver (libcuda) was not found"),
    ] {
        let (ok, _, err) = ferrotron(args);
        assert!(!ok, "{args:?} must fail");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line, not {err}");
        assert!(err.contains(says) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn plan_json_holds_every_layout_under_its_config_names_and_matches_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let batch =
        ["--config", "configs/llama-1b.toml", "--gpus", "16", "--seq-len", "2048", "--global-batch-tokens", "262144"];
    let (ok, text, err) = ferrotron(
        &[&["plan"][..], &batch, &["--top", "3", "--explain", "1", "--json", out.to_str().unwrap()]].concat(),
    );
    assert!(ok, "{err}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let layouts = json["layouts"].as_array().unwrap();
    let keys = [
        "dp",
        "tp",
        "pp",
        "cp",
        "ep",
        "zero_stage",
        "dp_shard",
        "pp_schedule",
        "pp_virtual_stages",
        "cp_mode",
        "sequence_parallel",
        "recompute",
        "micro_batch_size",
        "grad_accum_steps",
        "loss_stripe_rows",
        "dtype",
        "fits",
        "memory_gib",
        "step_s",
        "tokens_per_s",
        "mfu",
        "breakdown",
    ];
    for l in layouts {
        for k in keys {
            assert!(l.get(k).is_some(), "{k} missing in {l}");
        }
    }
    // each layout's keys, set on the config, price the same with --fixed
    let best = &layouts[0];
    let set = |k: &str| format!("parallel.{k}={}", best[k]);
    let (ok, fixed, err) = ferrotron(
        &[
            &["plan", "--fixed"][..],
            &batch,
            &[
                "--set",
                &set("tp"),
                "--set",
                &set("pp"),
                "--set",
                &set("cp"),
                "--set",
                &set("zero_stage"),
                "--set",
                &set("dp_shard"),
                "--set",
                &format!("parallel.pp_schedule={}", best["pp_schedule"]),
                "--set",
                &format!("parallel.cp_mode={}", best["cp_mode"]),
                "--set",
                &set("sequence_parallel"),
                "--set",
                &format!("train.micro_batch_size={}", best["micro_batch_size"]),
                "--set",
                &format!("train.recompute={}", best["recompute"]),
                "--set",
                &format!("train.loss_stripe_rows={}", best["loss_stripe_rows"]),
            ],
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    let tokens = format!("{:.0} tokens/s", best["tokens_per_s"].as_f64().unwrap());
    assert!(fixed.contains(&tokens) && text.contains(&tokens), "{tokens} in\n{fixed}\n{text}");
}

#[test]
fn plan_on_this_cpu_needs_its_calibration_and_refuses_a_broken_one() {
    let cache = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| ferrotron_cached(cache.path(), args);
    let (ok, _, err) = run(&["plan", "--gpu", "cpu", "--gpus", "2"]);
    assert!(!ok && err.trim().lines().count() == 1 && err.contains("run `ferrotron bench --calibrate` first"), "{err}");
    let (ok, text, err) = run(&["bench", "--calibrate"]);
    assert!(ok, "{err}");
    assert!(text.contains("the local backend between two ranks: α ="), "{text}");
    let (ok, text, err) = run(&["plan", "--gpu", "cpu", "--gpus", "2", "--top", "2"]);
    assert!(ok, "{err}");
    // the header, the count, the column names, two layouts, the rates (and a key to the zero column)
    let lines = text.lines().filter(|l| !l.starts_with("zero 3o:")).count();
    assert!(text.starts_with("plan for a ") && text.contains("layouts tried") && lines == 6, "{text}");
    assert!(text.contains("rates: this CPU,"), "{text}");
    // a hand-edited calibration without GEMM points is refused, not a panic
    let file = cache.path().join("calibration.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    for (_, machine) in json["cpu"].as_object_mut().unwrap() {
        machine["plan"]["all_threads"]["gemm"] = serde_json::json!([]);
    }
    std::fs::write(&file, json.to_string()).unwrap();
    let (ok, _, err) = run(&["plan", "--gpu", "cpu", "--gpus", "2"]);
    assert!(!ok && err.trim().lines().count() == 1 && err.contains("calibration is unreadable"), "{err}");
}

/// A GPU calibration as `bench --calibrate` records it (`calibrate::GpuCalibration`), by hand.
fn gpu_calibration(name: &str, dtype: &str, measured: &str, source: &str, wire: bool) -> serde_json::Value {
    serde_json::json!({
        "name": name, "dtype": dtype, "measured": measured,
        "rates": {
            "source": source, "peak_tflops": 989.4,
            "gemm": [[1e9, 0.2], [1e11, 0.4]], "attention": 0.1, "small_gb_s": 1000.0, "op_us": 4.0
        },
        "wire": if wire { serde_json::json!({"alpha_s": 2e-5, "beta_b_s": 1e11}) } else { serde_json::Value::Null },
    })
}

#[test]
fn plan_predicts_a_gpu_with_its_recorded_calibration_of_that_gpu_and_dtype() {
    let cache = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| ferrotron_cached(cache.path(), args);
    let ask = ["plan", "--config", "configs/llama-1b.toml", "--gpus", "8", "--top", "1", "--explain", "1"];
    let (ok, shipped, err) = run(&ask);
    assert!(ok, "{err}");
    assert!(shipped.contains("rates: H100 SXM, ferrotron's kernels") && shipped.contains("the device table's links"));
    // two calibrations of an H100 SXM (the later wins), one of an H100 PCIe (another --gpu), and
    // an FP8 one of the SXM: `--gpu h100` in bf16 takes the later SXM one, and its wire
    let file = cache.path().join("calibration.json");
    let h100 = "NVIDIA H100 80GB HBM3";
    let json = serde_json::json!({"gpu": {
        h100: {
            "bf16": gpu_calibration(h100, "bf16", "2026-11-28", "later SXM", true),
            "fp8": gpu_calibration(h100, "fp8", "2026-11-28", "SXM in FP8", false),
        },
        "NVIDIA H100 SXM5 80GB": {"bf16": gpu_calibration("NVIDIA H100 SXM5 80GB", "bf16", "2026-01-01", "earlier SXM", false)},
        "NVIDIA H100 PCIe": {"bf16": gpu_calibration("NVIDIA H100 PCIe", "bf16", "2026-12-01", "a PCIe card", false)},
    }});
    std::fs::write(&file, json.to_string()).unwrap();
    let (ok, measured, err) = run(&ask);
    assert!(ok, "{err}");
    assert!(measured.contains("rates: later SXM"), "{measured}");
    assert!(
        measured.contains("inside a node α 20.0 µs, β 100 GB/s") && measured.contains("NCCL as measured 2026-11-28")
    );
    let step = |text: &str| text.lines().find(|l| l.starts_with("step ")).unwrap().to_string();
    assert_ne!(step(&shipped), step(&measured), "the calibration changes the prediction");
    let (ok, fp8, err) = run(&[&ask[..], &["--dtype", "fp8"]].concat());
    assert!(ok && fp8.contains("rates: SXM in FP8") && fp8.contains("the device table's links"), "{err}{fp8}");
    let (ok, pcie, err) = run(&[&ask[..], &["--gpu", "h100-pcie"]].concat());
    assert!(ok && pcie.contains("rates: a PCIe card"), "{err}{pcie}");
    let (ok, h200, _) = run(&[&ask[..], &["--gpu", "h200"]].concat());
    assert!(ok && h200.contains("H200: the H100's measured efficiencies"), "{h200}");
    // a hand-broken one is refused in a line that names it
    let mut broken = json.clone();
    broken["gpu"][h100]["bf16"]["rates"]["attention"] = serde_json::json!(-1.0);
    std::fs::write(&file, broken.to_string()).unwrap();
    let (ok, _, err) = run(&ask);
    assert!(
        !ok && err.trim().lines().count() == 1
            && err.contains("the calibration of NVIDIA H100 80GB HBM3 (bf16) is unreadable"),
        "{err}"
    );
}

#[test]
fn when_nothing_fits_plan_says_the_least_memory_the_closest_saver_and_how_many_gpus_would_do() {
    // the tiny model on 2 and on 4 H100s: a GPU between the least either needs fits on 4 only
    let model = plan::model_of(None, &[]).unwrap();
    let ask = plan::Ask { global_batch_tokens: 64 * 128, seq_len: 128, dtype: DeviceDtype::Bf16, runnable: false };
    let least = |gpus: usize| {
        // on GPUs of no memory nothing fits, so every layout comes with its least (every saver on)
        let none = plan::Cluster { per_node: 2, memory_bytes: 0.0, ..h100s(gpus) };
        let layouts = plan::plan(&model, &none, &ask).unwrap().layouts;
        layouts.iter().map(|l| l.memory_gib).fold(f64::INFINITY, f64::min)
    };
    let (two, four) = (least(2), least(4));
    assert!(four < two, "more GPUs need less a GPU: {four} vs {two} GiB");
    let between = (two + four) / 2.0;
    let cluster = plan::Cluster { per_node: 2, memory_bytes: between * (1u64 << 30) as f64, ..h100s(2) };
    let layouts = plan::plan(&model, &cluster, &ask).unwrap().layouts;
    let short = plan::shortfall(&model, &cluster, &ask, &layouts).expect("nothing fits");
    assert!((short.least.memory_gib - two).abs() < 1e-9 && !short.least.fits, "{:?}", short.least);
    assert_eq!(short.gpus_that_fit, Some(4), "the fewest GPUs on which a layout fits");
    assert!(short.savers.windows(2).all(|w| w[0].1 <= w[1].1) && !short.savers.is_empty(), "{:?}", short.savers);
    let text = plan::shortfall_text(&short, &cluster);
    assert!(text.contains("the least any layout needs is") && text.contains("on 4 GPUs (2 nodes of 2)"), "{text}");
    // where a layout fits there is no shortfall
    assert!(plan::shortfall(&model, &h100s(2), &ask, &plan::plan(&model, &h100s(2), &ask).unwrap().layouts).is_none());
    // the command: the header names what it planned, --explain says why nothing is explained,
    // --json holds the shortfall
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("plan.json");
    let memory = format!("{:.6}", between);
    let args = ["plan", "--gpus", "2", "--gpus-per-node", "2", "--memory-gib", &memory, "--seq-len", "128"];
    let (ok, text, err) = ferrotron(
        &[&args[..], &["--global-batch-tokens", "8192", "--explain", "1", "--json", out.to_str().unwrap()]].concat(),
    );
    assert!(ok, "{err}");
    let header = text.lines().next().unwrap();
    assert!(
        header.starts_with("plan for a ")
            && header.contains("M parameters (4 layers, hidden 128) on 2 × h100 (2 a node"),
        "{text}"
    );
    assert!(text.contains("8192 tokens a step = 64 sequences of 128") && text.contains("nothing fits in"), "{text}");
    assert!(text.contains("--explain 1: no layout fits"), "{text}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(json["nothing_fits"]["gpus_that_fit"], 4, "{}", json["nothing_fits"]);
    assert!(json["model"]["parameters"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_steps_exposed_rows_add_up_to_its_time() {
    // every row of --explain is what that call adds: compute + optimizer + the rows = the step
    for extra in LAYOUTS.iter().chain(&[&["parallel.tp=2", "parallel.dp=2"][..], &["parallel.cp=2", "parallel.tp=2"]]) {
        let cfg = on_gpus(extra);
        let l = plan::predict(&cfg, &h100s(cfg.parallel.world_size())).unwrap();
        let b = l.breakdown.as_ref().unwrap();
        let rows: f64 = b.comm.iter().map(|a| a.exposed_s).sum();
        let step = l.step_s.unwrap();
        assert!(
            (b.compute_s + b.optimizer_s + rows - step).abs() <= 1e-12 * step,
            "{extra:?}: {step} s against the rows"
        );
        for a in &b.comm {
            // a call hidden still costs the device its share while it runs
            assert!(
                a.exposed_s <= a.wire_s * (1.0 + 1e-12) && a.exposed_s >= a.wire_s * 20.0 / 132.0 * (1.0 - 1e-12),
                "{extra:?}: {a:?}"
            );
        }
    }
}

#[test]
fn a_call_hides_only_behind_the_work_beside_it() {
    use ferrotron::commands::step_time::{exposed, MicroBatch, Rates, Wire, Wires};
    let cfg = on_gpus(&["parallel.cp=2", "parallel.dp=2", "parallel.zero_stage=3"]);
    let wire = Wire { alpha_s: 0.0, beta_b_s: 1e9 };
    let wires = Wires { node: wire, net: wire, per_node: 8 };
    let rates = Rates { overlap_slowdown: 0.1, ..Rates::h100() };
    let m = MicroBatch { forward: 8e-3, backward: 16e-3, ring_block: (1e-3, 2.5e-3), ..Default::default() };
    let flow = |axis, call, calls: f64, secs: f64| traffic::Flow {
        axis,
        ranks: 2,
        call,
        calls,
        bytes: calls * secs * 1e9 * 2.0, // a 2-rank gather moves half its bytes
        exposed: false,
    };
    let beside = |t: f64, cover: f64| t - t.min(cover) + 0.1 * t.min(cover);
    // the ring: 8 hops of 2 ms each, half in the forward behind a 1 ms block, half in the
    // backward behind a 2.5 ms one (not behind the step's whole attention)
    let ring = traffic::Flow { bytes: 8.0 * 2e-3 * 1e9, ..flow("cp", Call::P2p, 8.0, 2e-3) };
    let got = exposed(&cfg, &[ring], (&wires, &rates), &m, 8)[0].2;
    let want = 4.0 * (beside(2e-3, 1e-3) + beside(2e-3, 2.5e-3));
    assert!((got - want).abs() < 1e-12, "ring: {got} s, want {want} s");
    // FSDP's gathers: 8 micro-batches × 2 units × forward and backward; each behind the unit
    // before it (8/2 ms forward, 16/2 backward), the first of the step waits
    let gathers = flow("dp×cp", Call::AllGather, 32.0, 5e-3);
    let got = exposed(&cfg, &[gathers], (&wires, &rates), &m, 8)[0].2;
    let want = 5e-3 + 15.0 * beside(5e-3, 4e-3) + 16.0 * beside(5e-3, 8e-3);
    assert!((got - want).abs() < 1e-12, "FSDP: {got} s, want {want} s");
}

#[test]
fn the_search_cuts_by_divisors_rounds_the_batch_and_counts_what_it_sets_aside() {
    // 6 heads on 6 GPUs: tp 3 and 6, cp 3, not only powers of two
    let sets =
        ["model.num_attention_heads=6", "model.num_key_value_heads=6", "model.hidden_size=192", "model.vocab_size=192"];
    let model = plan::model_of(None, &sets.map(String::from)).unwrap();
    let cluster = plan::Cluster { per_node: 6, ..h100s(6) };
    // 65 sequences: no dp of 2, 3 or 6 divides it; each layout takes the nearest within 5 %
    let ask = plan::Ask { global_batch_tokens: 65 * 96, seq_len: 96, dtype: DeviceDtype::Bf16, runnable: false };
    let searched = plan::plan(&model, &cluster, &ask).unwrap();
    let l = &searched.layouts;
    assert!(l.iter().any(|l| l.tp == 3) && l.iter().any(|l| l.tp == 6) && l.iter().any(|l| l.cp == 3), "divisors");
    assert!(searched.rounded > 0 && l.iter().all(|l| l.sequences.abs_diff(65) as f64 <= 0.05 * 65.0));
    assert!(l.iter().all(|l| l.sequences == l.micro_batch_size * l.grad_accum_steps * l.dp));
    assert!(plan::rounding(&searched, &ask).unwrap().contains("within 5 % of 65 sequences"));
    // every schedule in the default search, those the GPU backend cannot run marked; ZeRO-3 once
    assert!(l.iter().any(|l| l.pp_schedule == "interleaved" && !l.nccl_ready));
    assert!(l.iter().any(|l| l.pp_schedule == "zbv") && l.iter().any(|l| l.zero_reduce == "once"));
    let runnable = plan::plan(&model, &cluster, &plan::Ask { runnable: true, ..ask.clone() }).unwrap();
    assert!(runnable.layouts.iter().all(|l| l.nccl_ready) && !runnable.layouts.is_empty());
    // the drops, by reason, each with its first example
    let reasons: Vec<&str> = runnable.dropped.iter().map(|d| d.reason.as_str()).collect();
    assert!(reasons.contains(&"a schedule the GPU backend cannot run yet (--runnable)"), "{reasons:?}");
    assert!(runnable.dropped.iter().all(|d| d.count > 0 && !d.example.is_empty()));
    // 7 GPUs for the tiny model's 16 sequences, 4 heads and 4 layers: nothing to try, and the
    // command says why
    let (ok, text, err) = ferrotron(&["plan", "--gpus", "7", "--gpus-per-node", "7"]);
    assert!(ok, "{err}");
    for said in ["0 layouts tried", "candidates set aside", "the config check on parallel.tp", "within 5 %"] {
        assert!(text.contains(said), "{said}: {text}");
    }
}

#[test]
fn an_all_to_all_across_nodes_runs_on_nvlink_and_the_network_at_once() {
    use ferrotron::commands::step_time::{flow_seconds, Wire, Wires};
    let cfg =
        on_gpus(&["parallel.dp=16", "parallel.ep=16", "model.num_local_experts=16", "model.num_experts_per_tok=2"]);
    let (node, net) = (Wire { alpha_s: 3e-6, beta_b_s: 450e9 }, Wire { alpha_s: 5e-6, beta_b_s: 50e9 });
    let flow =
        |ranks| traffic::Flow { axis: "ep", ranks, call: Call::AllToAll, calls: 4.0, bytes: 1.6e9, exposed: true };
    // 16 ranks on nodes of 8: 7 destinations over NVLink, 8 over the network, side by side
    let two = flow_seconds(&cfg, &flow(16), &Wires { node, net, per_node: 8 });
    let want = 4.0 * 15.0 * 5e-6 + (1.6e9 * 7.0 / 16.0 / 450e9_f64).max(1.6e9 * 8.0 / 16.0 / 50e9);
    assert!((two - want).abs() < 1e-12, "{two} s, want {want} s");
    // inside one node: NVLink alone, by the ring's count
    let one = flow_seconds(&cfg, &flow(16), &Wires { node, net, per_node: 16 });
    assert!((one - (4.0 * 15.0 * 3e-6 + 1.6e9 * 15.0 / 16.0 / 450e9)).abs() < 1e-12, "{one}");
    // nodes of one GPU: every destination over the network
    let apart = flow_seconds(&cfg, &flow(16), &Wires { node, net, per_node: 1 });
    assert!((apart - (4.0 * 15.0 * 5e-6 + 1.6e9 * 15.0 / 16.0 / 50e9)).abs() < 1e-12, "{apart}");
}

#[test]
fn a_gemm_is_priced_at_the_roofline_of_its_shape_and_attention_at_the_busiest_cp_rank() {
    use ferrotron::commands::step_time::{micro_batch, Rates};
    let h = Rates::h100();
    // an expert's GEMM over 8 rows reads a 4096 × 4096 weight for 0.27 GFLOP: bandwidth-bound
    let skinny = h.gemm_seconds((8.0, 4096.0, 4096.0), 2.0);
    let read = (8.0 * 4096.0 * 2.0 + 4096.0 * 4096.0) * 2.0 / (h.small_gb_s * 1e9);
    assert!((skinny - read).abs() < 1e-15, "{skinny} s, the bytes take {read} s");
    // a square one of the same weight over 8192 rows: its FLOPs at the calibrated efficiency
    let square = h.gemm_seconds((8192.0, 4096.0, 4096.0), 2.0);
    let flops = 2.0 * 8192.0 * 4096.0 * 4096.0;
    assert!((square - flops / (h.peak_tflops * 1e12 * h.gemm_efficiency(flops))).abs() < 1e-15, "{square}");
    // a ring in contiguous chunks: its last rank attends (2cp − 1)/cp of the mean; zigzag and
    // Ulysses the mean
    let attention = |extra: &[&str]| {
        let cfg = on_gpus(&[&["parallel.cp=4", "train.seq_len=64"][..], extra].concat());
        micro_batch(&cfg, stage_of(0, &cfg.parallel), &h, 1.0).attention
    };
    let (zigzag, contiguous) =
        (attention(&["parallel.cp_split=\"zigzag\""]), attention(&["parallel.cp_split=\"contiguous\""]));
    assert!((contiguous / zigzag - 7.0 / 4.0).abs() < 1e-12, "{contiguous} against {zigzag}");
    assert!((attention(&["parallel.cp_mode=\"ulysses\""]) / zigzag - 1.0).abs() < 1e-12);
}
