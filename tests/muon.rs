//! Muon (`model/muon.rs`, `parallel/muon_owners.rs`): Newton–Schulz against an independent f64
//! reference (wide, tall, square); Muon + AdamW against PyTorch's `torch.optim.Muon` +
//! `torch.optim.AdamW` step for step (`fixtures/make_muon_fixture.py`); the owners' assignment;
//! every layout on the one-rank curve; the all_to_all bytes the owners' exchange costs per step;
//! the momentum saved and resumed bit for bit across layouts; and the checkpoint's names.

mod common;

use ferrotron::checkpoint::hf as checkpoint;
use ferrotron::comm::cost::Call;
use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::commands::eval;
use ferrotron::config::{Config, MuonAdjustLr};
use ferrotron::model::muon::{self, Muon};
use ferrotron::model::optimizer::{self, Optimizer};
use ferrotron::model::Whole;
use ferrotron::ops::tensor::Tensor;
use ferrotron::parallel::muon_owners::assign;
use ferrotron::train::{train, train_all, Options};
use std::path::Path;

fn sets(extra: &[&str]) -> Vec<String> {
    let muon = ["train.optimizer=\"muon\"", "train.micro_batch_size=8", "train.steps=10", "train.warmup_steps=2"];
    common::SMALL.iter().chain(&muon).chain(extra).map(|s| s.to_string()).collect()
}

/// Newton–Schulz in f64 as PyTorch writes it: a tall matrix transposed, X·Xᵀ, transposed back.
fn reference(u: &[f32], rows: usize, cols: usize, steps: usize) -> Vec<f64> {
    let (a, b, c) = (3.4445, -4.7750, 2.0315);
    let tall = rows > cols;
    let (r, k) = if tall { (cols, rows) } else { (rows, cols) };
    let at = |i: usize, j: usize| if tall { u[j * cols + i] } else { u[i * cols + j] } as f64;
    let mut x: Vec<f64> = (0..r * k).map(|n| at(n / k, n % k)).collect();
    let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-7);
    x.iter_mut().for_each(|v| *v /= norm);
    let mul = |p: &[f64], q: &[f64], n: usize, m: usize, l: usize| -> Vec<f64> {
        (0..n * l).map(|o| (0..m).map(|j| p[o / l * m + j] * q[j * l + o % l]).sum()).collect()
    };
    for _ in 0..steps {
        let xt: Vec<f64> = (0..k * r).map(|n| x[(n % r) * k + n / r]).collect();
        let gram = mul(&x, &xt, r, k, r);
        let gg = mul(&gram, &gram, r, r, r);
        let poly: Vec<f64> = gram.iter().zip(&gg).map(|(g, h)| b * g + c * h).collect();
        let px = mul(&poly, &x, r, r, k);
        x = x.iter().zip(&px).map(|(x, p)| a * x + p).collect();
    }
    if tall {
        (0..rows * cols).map(|n| x[(n % cols) * k + n / cols]).collect()
    } else {
        x
    }
}

#[test]
fn newton_schulz_matches_an_f64_reference_wide_tall_and_square() {
    for (rows, cols) in [(8, 24), (24, 8), (16, 16), (1, 5), (7, 3)] {
        let u: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.3).collect();
        let got = muon::newton_schulz(&Tensor::from_vec(&[rows, cols], u.clone()), 5).to_vec();
        let want = reference(&u, rows, cols, 5);
        let diff = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max);
        assert!(diff < 1e-5, "{rows}×{cols}: off by {diff}");
        // orthogonal-ish: every singular value in the quintic's band, so ‖O‖_F² ≈ min(rows, cols)
        let energy: f64 = want.iter().map(|v| v * v).sum::<f64>() / rows.min(cols) as f64;
        assert!((0.4..1.5).contains(&energy), "{rows}×{cols}: mean squared singular value {energy}");
    }
    // a zero update stays zero (divided by max(‖U‖, 1e-7), not by 0)
    let zero = muon::newton_schulz(&Tensor::zeros(&[4, 6]), 5).to_vec();
    assert!(zero.iter().all(|v| *v == 0.0));
}

#[test]
fn the_rate_follows_the_shape_as_pytorch_adjusts_it() {
    assert_eq!(muon::adjusted(MuonAdjustLr::Original, &[64, 16]), 2.0);
    assert_eq!(muon::adjusted(MuonAdjustLr::Original, &[16, 64]), 1.0);
    assert_eq!(muon::adjusted(MuonAdjustLr::MatchRmsAdamw, &[16, 100]), 2.0);
    assert_eq!(muon::adjusted(MuonAdjustLr::SpectralUnclamped, &[16, 64]), 0.5);
    // what Muon updates: the blocks' projections and experts, not embeddings, norms or routers
    assert!(muon::updates("model.layers.0.self_attn.q_proj.weight", &[8, 8]));
    assert!(muon::updates("model.layers.1.block_sparse_moe.experts.2.w1.weight", &[8, 4]));
    assert!(!muon::updates("model.layers.1.block_sparse_moe.gate.weight", &[4, 8]));
    assert!(!muon::updates("model.embed_tokens.weight", &[50, 8]));
    assert!(!muon::updates("lm_head.weight", &[50, 8]));
    assert!(!muon::updates("model.layers.0.input_layernorm.weight", &[8]));
    // DeepSeek-V3's: latent attention's projections (kv_a_proj_with_mqa too), its experts, not its router
    assert!(muon::updates("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", &[12, 8]));
    assert!(muon::updates("model.layers.0.self_attn.kv_b_proj.weight", &[20, 8]));
    assert!(muon::updates("model.layers.1.mlp.experts.3.gate_proj.weight", &[4, 8]));
    assert!(muon::updates("model.layers.1.mlp.shared_experts.up_proj.weight", &[4, 8]));
    assert!(!muon::updates("model.layers.1.mlp.gate.weight", &[8, 8]));
    assert!(!muon::updates("model.layers.0.self_attn.kv_a_layernorm.weight", &[12]));
}

/// Muon + AdamW from the `gqa` fixture's init on its batch, 30 steps, against PyTorch's losses.
#[test]
fn muon_and_adamw_follow_pytorch_step_for_step() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let text = std::fs::read_to_string(fixtures.join("muon/losses.json")).unwrap();
    let recorded: serde_json::Value = serde_json::from_str(&text).unwrap();
    let train_keys = recorded["train"].as_object().unwrap();
    for (name, variant) in recorded["variants"].as_object().unwrap() {
        let mut sets: Vec<String> = train_keys.iter().map(|(k, v)| format!("train.{k}={v}")).collect();
        sets.extend(variant["settings"].as_object().unwrap().iter().map(|(k, v)| format!("train.{k}={v}")));
        let t = Config::load(None, &sets).unwrap().train;
        let mut model = checkpoint::load_hf(&fixtures.join("gqa")).unwrap();
        let seqs = eval::read_tokens(&fixtures.join("gqa/tokens.txt"), model.cfg.vocab_size).unwrap();
        let tokens: Vec<u32> = seqs.concat();
        let targets: Vec<i32> = seqs.iter().flat_map(|s| eval::shifted_targets(s)).collect();
        let mut opt = Muon::new(&mut model.params_mut(), &t, Box::new(Whole));
        let want: Vec<f64> = variant["losses"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(want.len(), t.steps, "{name}: a loss per step");
        for (step, want) in want.iter().enumerate() {
            model.zero_grads();
            let loss = model.forward(&tokens, seqs.len(), &targets).unwrap() as f64;
            assert!((loss - want).abs() <= 5e-4, "{name}, step {}: loss {loss} vs PyTorch {want}", step + 1);
            model.backward(1.0).unwrap();
            let mut params = model.params_mut();
            let norm = optimizer::grad_sum_squares(&params).sqrt();
            let lr = optimizer::lr_at(&t, step);
            opt.step(&mut params, lr, optimizer::clip_factor(norm, t.grad_clip)).unwrap();
        }
        assert!(want[29] < want[0] / 10.0, "{name}: the fixture learns");
    }
}

#[test]
fn owners_are_assigned_largest_first_to_the_least_loaded() {
    let sizes = [("b", 10), ("a", 10), ("c", 6), ("d", 5), ("e", 4)];
    // a (10, the name first) → 0, b (10) → 1, c (6) → 0 (10 vs 10: the lower index), d → 1, e → 1
    assert_eq!(assign(&sizes, 2), vec![1, 0, 0, 1, 1]);
    assert_eq!(assign(&sizes, 1), vec![0; 5]);
    let spread = assign(&sizes, 8); // more ranks than matrices: one each, the rest idle
    assert_eq!(spread, vec![1, 0, 2, 3, 4]);
}

#[test]
fn muon_under_data_parallel_and_zero_follows_one_rank() {
    let variants = parse_variants(
        "dp=2;dp=2,zero_stage=1;dp=2,zero_stage=2;dp=2,zero_stage=3;dp=3,zero_stage=2;\
         dp=4,dp_shard=2,zero_stage=2;dp=2,cp=2,zero_stage=3",
    )
    .unwrap();
    let twelve = sets(&["train.micro_batch_size=12"]); // splits into 2, 3 and 4 ranks
    let report = converge::converge(None, &twelve, &variants, 1e-4).unwrap();
    assert!(report.baseline[9] < report.baseline[0] - 0.2, "Muon learns: {:?}", report.baseline);
    for o in &report.outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn muon_under_tensor_pipeline_and_expert_parallel_follows_one_rank() {
    let variants = parse_variants(
        "tp=2;tp=2,sequence_parallel=true;dp=2,tp=2,zero_stage=3;pp=2,grad_accum_steps=2;\
         pp=2,pp_schedule=zbv,grad_accum_steps=4,tp=2",
    )
    .unwrap();
    let four_layers = sets(&["model.num_hidden_layers=4"]); // ZBV's V: two chunks a stage
    let report = converge::converge(None, &four_layers, &variants, 1e-4).unwrap();
    for o in &report.outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    let experts = ["model.num_local_experts=4", "model.num_experts_per_tok=2"];
    let variants = parse_variants("dp=2,ep=2;dp=2,ep=2,zero_stage=2").unwrap();
    let report = converge::converge(None, &sets(&experts), &variants, 1e-4).unwrap();
    for o in &report.outcomes {
        assert!(o.pass, "experts, {}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

/// The owners' exchange per step on the dp axis, summed over the ranks: with replicas (ZeRO-0)
/// each owner sends its matrices' results to every rank; under ZeRO every rank's partition goes to
/// the owner and comes back, partition by partition.
#[test]
fn the_owners_exchange_costs_what_the_lesson_says() {
    let values = |cfg: &Config| -> u64 {
        let model = ferrotron::model::Llama::new(&cfg.model, 1);
        model.params().iter().filter(|p| muon::updates(&p.name, p.shape())).map(|p| p.value.numel() as u64).sum()
    };
    for (zero, ranks) in [(0, 2), (2, 2), (3, 4)] {
        let (z, d) = (format!("parallel.zero_stage={zero}"), format!("parallel.dp={ranks}"));
        let cfg = Config::load(None, &sets(&[&z, &d, "train.steps=2"])).unwrap();
        let summaries = train_all(&cfg, Options { quiet: true, ..Default::default() }).unwrap();
        let (mut calls, mut bytes) = (0, 0);
        for s in &summaries {
            let t = s.comm.iter().find(|t| t.call == Call::AllToAll).expect("Muon's all_to_all is counted");
            assert!(t.axis.starts_with("dp"), "on the data-parallel axis, not {}", t.axis);
            (calls, bytes) = (calls + t.tally.calls, bytes + t.tally.bytes);
        }
        let (n, r) = (values(&cfg), ranks as u64);
        let (want_calls, want_bytes) = match zero {
            0 => (1, r * n * 4), // each result to every rank
            _ => (2, 2 * n * 4), // each partition there and back (no padding: the sizes divide)
        };
        assert_eq!((calls, bytes), (r * 2 * want_calls, 2 * want_bytes), "zero {zero}, dp {ranks}: 2 steps");
    }
}

/// A Muon run saved at step 3 under one layout resumes under another on the uninterrupted curve;
/// the checkpoint names the momentum as PyTorch does and keeps AdamW's moments for the rest.
#[test]
fn the_momentum_is_saved_and_resumed_across_layouts() {
    let base = sets(&[]);
    let (half, dp) = ("train.micro_batch_size=4", "parallel.dp=2"); // the same global batch
    common::checkpoints_move_between(&base, &[dp, half, "parallel.zero_stage=2"], &["parallel.tp=2"]);
    common::checkpoints_move_between(&base, &[], &[dp, half, "parallel.zero_stage=3", "parallel.pp=2"]);
    // bit for bit on one layout
    let tmp = tempfile::tempdir().unwrap();
    let run = |resume: Option<&Path>, dir: &str| {
        let dir = format!("checkpoint.dir=\"{}\"", tmp.path().join(dir).display());
        let cfg = Config::load(None, &sets(&["train.steps=6", "checkpoint.every=3", &dir, "parallel.dp=2"])).unwrap();
        train(&cfg, Options { quiet: true, resume, ..Default::default() }).unwrap().losses
    };
    let whole = run(None, "a");
    let resumed = run(Some(&tmp.path().join("a/step_000003")), "b");
    assert_eq!(&whole[3..], &resumed[..], "resumed bit for bit");
    let (_, state) = common::checkpoint_tensors(&tmp.path().join("a/step_000003"));
    let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"momentum_buffer.model.layers.0.self_attn.q_proj.weight"), "{names:?}");
    assert!(names.contains(&"exp_avg.model.embed_tokens.weight"), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with("exp_avg.model.layers.0.mlp")), "{names:?}");
    // an AdamW checkpoint does not resume as Muon, even with --allow-changes: refused in the
    // run's words (the optimizer named), not by a missing tensor
    let dir = format!("checkpoint.dir=\"{}\"", tmp.path().join("c").display());
    let adamw =
        Config::load(None, &sets(&["train.steps=3", "checkpoint.every=3", &dir, "train.optimizer=\"adamw\""])).unwrap();
    train(&adamw, Options { quiet: true, ..Default::default() }).unwrap();
    let resume = Config::load(None, &sets(&["train.steps=6"])).unwrap();
    let step = tmp.path().join("c/step_000003");
    let opts = Options { quiet: true, resume: Some(&step), allow_changes: true, ..Default::default() };
    let err = format!("{:#}", train(&resume, opts).err().expect("refused"));
    assert!(
        err.contains("train.optimizer = adamw, and this run sets muon") && !err.contains("momentum_buffer"),
        "{err}"
    );
    // a second moment below zero is damage, refused at the resume (not a NaN steps later)
    let ck = tmp.path().join("c/step_000003/optimizer.safetensors");
    let bytes = std::fs::read(&ck).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = header["exp_avg_sq.model.norm.weight"]["data_offsets"][0].as_u64().unwrap() as usize;
    let mut damaged = bytes.clone();
    damaged[8 + n + at..8 + n + at + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
    std::fs::write(&ck, damaged).unwrap();
    let back = Config::load(None, &sets(&["train.steps=6", "train.optimizer=\"adamw\""])).unwrap();
    let err = format!(
        "{:#}",
        train(&back, Options { quiet: true, resume: Some(&step), ..Default::default() }).err().unwrap()
    );
    assert!(err.contains("exp_avg_sq.model.norm.weight holds -1") && err.contains("never below zero"), "{err}");
}

/// `ferrotron memory` counts Muon's state as the run holds it: one momentum per matrix value, in
/// ZeRO's partitions too.
#[test]
fn memory_counts_the_momentum_as_held() {
    for extra in [&[][..], &["parallel.dp=2", "train.micro_batch_size=4", "parallel.zero_stage=2"]] {
        let cfg = Config::load(None, &sets(&[&["train.steps=1"][..], extra].concat())).unwrap();
        let estimated = ferrotron::train::memory::per_rank(&cfg).unwrap()[0].optimizer_bytes;
        let held = train_all(&cfg, Options { quiet: true, ..Default::default() }).unwrap()[0].held.optimizer;
        assert_eq!(estimated, held as f64, "{extra:?}");
    }
}

/// `train --comm-report` says whose all_to_all it counts on the dp axis.
#[test]
fn the_comm_report_names_the_owners_exchange() {
    let tmp = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .current_dir(tmp.path())
        .args(["train", "--comm-report"])
        .args(sets(&["parallel.dp=2", "train.micro_batch_size=4", "train.steps=2"]).iter().flat_map(|s| ["--set", s]))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let row =
        text.lines().find(|l| l.starts_with("dp×cp") && l.contains("all_to_all")).unwrap_or_else(|| panic!("{text}"));
    assert!(row.split_whitespace().nth(3) == Some("1.0"), "one call a step and rank: {row}");
    assert!(text.contains("Muon's owners"), "{text}");
}

/// `train.optimizer_dtype = "bf16"` keeps Muon's momentum rounded to bf16 after each update, as
/// it keeps AdamW's moments.
#[test]
fn the_momentum_is_kept_in_the_optimizer_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = format!("checkpoint.dir=\"{}\"", tmp.path().display());
    let bf16 = ["train.steps=3", "checkpoint.every=3", "train.optimizer_dtype=\"bf16\"", &dir];
    let f32 = ["train.steps=3", "train.optimizer_dtype=\"f32\""];
    let a = train(&Config::load(None, &sets(&bf16)).unwrap(), Options { quiet: true, ..Default::default() }).unwrap();
    let b = train(&Config::load(None, &sets(&f32)).unwrap(), Options { quiet: true, ..Default::default() }).unwrap();
    // (the first update reads the momentum before it is rounded: the curves part at step 3)
    assert!(a.losses[2] != b.losses[2], "the rounding moves the curve: {:?} vs {:?}", a.losses, b.losses);
    let (_, state) = common::checkpoint_tensors(&tmp.path().join("step_000003"));
    let momentum: Vec<f32> =
        state.iter().filter(|(n, _)| n.starts_with("momentum_buffer.")).flat_map(|(_, v)| v.clone()).collect();
    assert!(!momentum.is_empty() && momentum.iter().any(|v| *v != 0.0));
    assert!(momentum.iter().all(|v| half::bf16::from_f32(*v).to_f32() == *v), "every value a bf16");
}
