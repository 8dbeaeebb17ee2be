//! `ferrotron bench`: the FLOP formula, the memory formula against the activations the model
//! really keeps (with each recompute mode), the peak table, and the command's table and JSON.

use ferrotron::commands::bench;
use ferrotron::config::{Config, Recompute};
use ferrotron::devices::{flops_per_token, peak_tflops};
use ferrotron::model::llama::pipeline::StageInput;
use ferrotron::model::stage::Stage;
use ferrotron::model::Llama;
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::DType;
use ferrotron::train::memory::{activation_bytes, activations_held, Keep};
use std::process::Command;

mod common;

fn cfg(sets: &[&str]) -> Config {
    Config::load(None, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
}

#[test]
fn flops_follow_the_palm_formula() {
    let c = cfg(&[]); // tiny: d 128, f 384, 4 layers, 8 heads of 16, 4 KV heads, vocab 64, untied
    let (d, f, l, v, s) = (128.0, 384.0, 4.0, 64.0, 128.0);
    let layer = 2.0 * d * d + 2.0 * (d / 2.0) * d + 3.0 * f * d + 2.0 * d;
    let matmul_weights = l * layer + d + v * d; // the output layer; the input embedding is a lookup
    assert_eq!(flops_per_token(&c.model, 128), 6.0 * matmul_weights + 12.0 * l * d * s);
    let tied = cfg(&["model.tie_word_embeddings=true"]);
    assert_eq!(flops_per_token(&tied.model, 128), 6.0 * matmul_weights + 12.0 * l * d * s, "one table either way");
}

#[test]
fn activation_formula_matches_what_the_model_keeps() {
    for extra in [&[][..], &["model.tie_word_embeddings=true", "model.head_dim=12"], common::SMALL] {
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let c = cfg(extra);
            let (batch, seq) = (3, c.train.seq_len);
            let mut model = Llama::new(&c.model, 1).with_recompute(recompute);
            let tokens: Vec<u32> = (0..batch * seq).map(|i| (i % c.model.vocab_size) as u32).collect();
            let targets: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            model.forward(&tokens, batch, &targets).unwrap();
            let keep = Keep { recompute, ..Keep::WHOLE };
            let want = activation_bytes(&c.model, batch, seq, keep, Stage::WHOLE, DType::F32);
            assert_eq!(model.activation_bytes() as f64, want, "{extra:?} {recompute:?}");
        }
    }
    // pipeline stages: 5 layers on 2 stages, the embedding on the first, the head on the last
    let c = cfg(&[common::SMALL, &["model.num_hidden_layers=5"]].concat());
    let (batch, seq) = (2, c.train.seq_len);
    let tokens: Vec<u32> = (0..batch * seq).map(|i| (i % c.model.vocab_size) as u32).collect();
    let targets: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    for index in 0..2 {
        let stage = Stage::new(index, 2);
        let mut model = Llama::init(&c.model, 1, Box::new(ferrotron::model::Whole), stage);
        let hidden = Tensor::zeros(&[batch * seq, c.model.hidden_size]);
        let input = if index == 0 { StageInput::Tokens(&tokens) } else { StageInput::Hidden(hidden) };
        model.forward_chunk(0, input, batch, &targets).unwrap();
        assert_eq!(
            model.activation_bytes() as f64,
            activation_bytes(&c.model, batch, seq, Keep::WHOLE, stage, DType::F32)
        );
    }
    // held at once with 1F1B on 2 stages and 4 micro-batches: two on the first stage, one on the last
    let c = cfg(&[common::SMALL, &["parallel.pp=2", "train.grad_accum_steps=4"]].concat());
    let per = |index| activation_bytes(&c.model, 16, 32, Keep::WHOLE, Stage::new(index, 2), DType::F32);
    assert_eq!(activations_held(&c, 16, DType::F32), (2.0 * per(0)).max(per(1)));
}

#[test]
fn peaks_by_gpu_name() {
    assert_eq!(peak_tflops("NVIDIA H100 80GB HBM3", DType::Bf16), Some(989.4));
    assert_eq!(peak_tflops("NVIDIA H100 PCIe", DType::Bf16), Some(756.5));
    assert_eq!(peak_tflops("NVIDIA GH200 480GB", DType::F32), Some(66.9));
    assert_eq!(peak_tflops("NVIDIA A100-SXM4-80GB", DType::Bf16), Some(312.0));
    assert_eq!(peak_tflops("NVIDIA L40", DType::Bf16), Some(181.0), "not the L4's");
    assert_eq!(peak_tflops("Some Future GPU", DType::Bf16), None);
}

#[test]
fn bench_reports_a_table_and_json() {
    let small: Vec<String> = common::SMALL.iter().map(|s| s.to_string()).collect();
    let r = bench::bench(&Config::load(None, &small).unwrap(), 1, 2, Some(1.0), false).unwrap();
    assert_eq!((r.measured_steps, r.tokens_per_step), (2, 16 * 32));
    assert!(r.step_ms > 0.0 && r.tokens_per_s > 0.0 && r.mfu.unwrap() > 0.0);
    assert!((r.achieved_tflops - r.flops_per_token * r.tokens_per_s / 1e12).abs() < 1e-12);
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["bench", "--steps", "2", "--warmup", "101"])
        .args(common::SMALL.iter().flat_map(|s| ["--set", s]))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    // on the CPU, MFU is of its measured peak (recorded once, in the cache's calibration file)
    assert!(text.contains("tokens/s") && text.contains("TFLOP/s (this CPU's f32 GEMM, measured once)"), "{text}");
    // a warm-up past a hundred steps runs quietly: it is said before it starts
    assert!(text.contains("warming up: 101 steps before the 2 measured (--warmup)"), "{text}");
    let json = text.lines().find_map(|l| l.strip_prefix("json: ")).expect("a json line");
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["measured_steps"], 2);
    let bad = Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(["bench", "--steps", "0"]).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--steps 0"));
    // --against: the ratio to another run's JSON (the PyTorch reference writes the same keys)
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("torch.json");
    let torch =
        r#"{"framework": "pytorch 2.15 eager", "device": "cpu", "tokens_per_s": 1000.0, "tokens_per_step": 512}"#;
    std::fs::write(&other, torch).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["bench", "--steps", "1", "--warmup", "0", "--against"])
        .arg(&other)
        .args(common::SMALL.iter().flat_map(|s| ["--set", s]))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("against pytorch 2.15 eager on cpu: ") && text.contains("× its tokens/s"), "{text}");
    assert!(!text.contains("compare with care"), "same batch, same device: {text}");
    std::fs::write(&other, "{}").unwrap();
    let bad = Command::new(env!("CARGO_BIN_EXE_ferrotron")).arg("bench").arg("--against").arg(&other).output().unwrap();
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--against") && err.contains("not a bench JSON"), "{err}");
    // a speed of 0 or below is no yardstick (it printed inf× and negative ratios)
    for speed in ["0.0", "-5.0"] {
        std::fs::write(&other, torch.replace("1000.0", speed)).unwrap();
        let bad =
            Command::new(env!("CARGO_BIN_EXE_ferrotron")).arg("bench").arg("--against").arg(&other).output().unwrap();
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success() && err.contains("tokens_per_s is") && err.contains("positive"), "{speed}: {err}");
    }
}

#[test]
fn gpu_configs_have_the_published_sizes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // the parameter counts Hugging Face reports for these models
    for (file, params) in [("smollm-135m", 134_515_008), ("smollm-360m", 361_821_120), ("llama-1b", 1_100_048_384)] {
        let c = Config::load(Some(&root.join(format!("configs/{file}.toml"))), &[]).unwrap();
        assert_eq!(c.model.parameter_count(), params as f64, "{file}");
        assert_eq!((c.train.seq_len, c.device.compute_dtype()), (2048, DType::Bf16), "{file}");
    }
}

#[test]
fn the_profile_table_sorts_longest_first_and_shares_add_up() {
    use ferrotron::cuda::profile::{longest_first, table, Row};
    let rows = longest_first(vec![
        Row { name: "rmsnorm_forward_bf16".into(), calls: 122, ms: 4.0 },
        Row { name: "flash_attention_forward_d64".into(), calls: 60, ms: 30.0 },
        Row { name: "cublas 576x16384x1536".into(), calls: 120, ms: 16.0 },
    ]);
    assert_eq!(rows[0].name, "flash_attention_forward_d64");
    assert_eq!(rows[2].name, "rmsnorm_forward_bf16");
    let t = table(&rows, 2, 40.0); // 2 steps of 40 ms: 25 ms of each busy, 15 idle
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 5, "{t}");
    assert!(lines[1].contains("30.0") && lines[1].contains("15.000") && lines[1].contains("37.5%"), "{t}");
    assert!(lines[4].starts_with("(GPU idle") && lines[4].contains("15.000") && lines[4].contains("37.5%"), "{t}");
}

#[test]
fn bench_profile_is_refused_on_the_cpu() {
    // on the CPU it is refused with a sentence
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(["bench", "--profile"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--profile") && err.contains("device.kind"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU: .ci/gpu_check runs it there (cargo test --release -- --include-ignored)"]
fn bench_profile_times_the_gpu_kernels_on_a_gpu() {
    common::require_gpu();
    let tiny_on_gpu = Config::load(None, &["device.kind=cuda".to_string()]).unwrap(); // head_dim 16: tensor cores
    let r = bench::bench(&tiny_on_gpu, 1, 2, None, true).unwrap();
    let names: Vec<&str> = r.profile.iter().map(|row| row.name.as_str()).collect();
    assert!(names.iter().any(|n| n.starts_with("flash_attention_forward")), "{names:?}");
    assert!(
        names.iter().any(|n| n.starts_with("cublas gemm")) && names.iter().any(|n| n.starts_with("adamw")),
        "{names:?}"
    );
    let busy: f64 = r.profile.iter().map(|row| row.ms).sum();
    assert!(busy > 0.0 && busy <= 2.0 * r.step_ms * 1.05, "kernels {busy} ms, steps {} ms", 2.0 * r.step_ms);
}

#[test]
fn bench_op_attention_is_for_the_gpu_and_alone() {
    let run = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(args).output().unwrap();
    for (args, named) in [
        (&["bench", "--op", "attention"][..], "device.kind"),
        (&["bench", "--op", "attention", "--profile", "--set", "device.kind=cuda"][..], "--profile"),
        (&["bench", "--op", "softmax"][..], "attention"),
        (&["bench", "--peak-tflops", "nan"][..], "--peak-tflops NaN"),
        (&["bench", "--peak-tflops=-1"][..], "--peak-tflops -1"),
        (&["bench", "--peak-tflops", "0"][..], "--peak-tflops 0"),
    ] {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(named), "{args:?}: {err}");
    }
    // the FLOPs FlashAttention's benchmarks count: the causal half of the square, 2 per multiply-add
    let a = ferrotron::ops::Attn { batch: 8, seq: 2048, kv_seq: 2048, heads: 9, kv_heads: 3, head_dim: 64 };
    let flops = ferrotron::commands::bench_attention::forward_flops(a);
    assert_eq!(flops, 4.0 * 8.0 * 9.0 * 2048.0 * 2048.0 * 64.0 / 2.0);
    // GPU_MEASURED.md: PyTorch's FA2 forward at these shapes, 0.175 ms, is 220 TFLOP/s by this count
    assert!((flops / 0.175e-3 / 1e12 - 220.9).abs() < 1.0);
}

/// MFU on the progress line, in `--metrics` and in the summary, from the one device table: on the
/// CPU, of the peak measured once (said as it starts) and recorded in `calibration.json` in the
/// cache folder; a second run reads it. A record outside what the CPU's threads can do is
/// measured again, saying so; one in bounds that a step beats (MFU above 100 %: measured on a
/// busy machine) is measured again at that step, so no step shows more than 100 %.
#[test]
fn train_shows_mfu_against_the_recorded_cpu_peak() {
    let cache = tempfile::tempdir().unwrap();
    let metrics = cache.path().join("m.jsonl");
    let run = || {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .env("FERROTRON_CACHE", cache.path())
            .args(["train", "--metrics", metrics.to_str().unwrap(), "--set", "train.steps=4"])
            .args(common::SMALL.iter().flat_map(|s| ["--set", s]))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let said = run();
    assert!(said.contains("measuring this CPU's f32 peak for MFU"), "{said}");
    let file = cache.path().join("calibration.json");
    let key = ferrotron::devices::cpu_key();
    let recorded = || ferrotron::devices::recorded_cpu_peak(&file, &key).unwrap().expect("measured and recorded");
    let measured = recorded();
    assert!(measured > 1e-4 && measured < 1e3, "{measured} TFLOP/s");
    assert!(said.contains("| MFU ") && said.lines().any(|l| l.starts_with("done:") && l.contains("| MFU ")), "{said}");
    let cfg = Config::load(None, &common::SMALL.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let flops = flops_per_token(&cfg.model, cfg.train.seq_len);
    let mfus = || -> Vec<(f64, f64)> {
        let lines = std::fs::read_to_string(&metrics).unwrap();
        let each = |l: &str| serde_json::from_str::<serde_json::Value>(l).unwrap();
        lines.lines().map(each).map(|v| (v["mfu"].as_f64().unwrap(), v["tokens_per_s"].as_f64().unwrap())).collect()
    };
    // the record read back is the one used (MFU = FLOPs × tokens/s over it), and no read runs a
    // measurement
    let again = run();
    assert!(!again.contains("measuring") && !again.contains("note:"), "{again}");
    for (mfu, tokens_per_s) in mfus() {
        assert!((mfu / (flops * tokens_per_s / (measured * 1e12)) - 1.0).abs() < 1e-9, "{mfu}");
    }
    // a millionth of a TFLOP/s is no CPU's: measured again, said, and the new record used
    ferrotron::devices::record_cpu_peak(&file, &key, 1e-6).unwrap();
    let said = run();
    assert!(said.contains("records 1e-6 TFLOP/s for this CPU, outside what its threads can do"), "{said}");
    assert!(recorded() > 1e-4 && mfus().iter().all(|&(m, _)| m <= 1.0), "{said}");
    // in bounds, but below what a step does (a busy machine's measurement): measured again at the
    // first step, which then shows at most 100 %, as every later one
    let threads = std::thread::available_parallelism().unwrap().get() as f64;
    let low = ferrotron::devices::CPU_THREAD_TFLOPS.start() * threads;
    ferrotron::devices::record_cpu_peak(&file, &key, low).unwrap();
    let said = run();
    assert!(said.contains("above this CPU's recorded peak") && said.contains("measured again at"), "{said}");
    assert!(recorded() > low && mfus().iter().all(|&(m, _)| m <= 1.0), "{said}");
}
