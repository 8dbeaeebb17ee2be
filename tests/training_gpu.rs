//! Training on a GPU: in f32 (no TF32) it follows the CPU loss curve step by step; in bf16 mixed
//! precision the tiny config still reaches its entropy floor; ranks sharing one GPU (the local
//! backend) follow the single-rank curve. `#[ignore]`d (cargo counts them):
//! `.ci/gpu_check` runs them on a GPU machine with `--include-ignored`.

use ferrotron::config::Config;
use ferrotron::train::{train, train_all, Options, Summary};

mod common;

fn run(sets: &[&str]) -> Vec<Summary> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let cfg = Config::load(None, &sets).unwrap();
    train_all(&cfg, Options { quiet: true, ..Default::default() }).unwrap_or_else(|e| panic!("{e:#}"))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
#[ignore = "needs a CUDA GPU: .ci/gpu_check runs it there (cargo test --release -- --include-ignored)"]
fn f32_on_the_gpu_follows_the_cpu_curve() {
    common::require_gpu();
    let base = ["train.steps=20", "train.warmup_steps=5"];
    let cpu = run(&base);
    let gpu = run(&[&base[..], &["device.kind=cuda", "device.dtype=f32"]].concat());
    let diff = max_diff(&cpu[0].losses, &gpu[0].losses);
    eprintln!("tiny config, 20 steps: CPU {:?}\n GPU f32 {:?}\n max |Δloss| {diff:.1e}", cpu[0].losses, gpu[0].losses);
    assert!(diff <= 1e-4, "GPU f32 loss differs from the CPU by {diff:.1e}");
}

#[test]
#[ignore = "needs a CUDA GPU: .ci/gpu_check runs it there (cargo test --release -- --include-ignored)"]
fn ranks_sharing_a_gpu_follow_the_single_rank_curve() {
    common::require_gpu();
    let base: Vec<&str> =
        [common::SMALL, &["train.micro_batch_size=4", "train.steps=10", "device.kind=cuda", "device.dtype=f32"]]
            .concat();
    for layout in [
        &["parallel.dp=2", "parallel.tp=2", "parallel.backend=local"][..],
        &["parallel.pp=2", "parallel.cp=2", "parallel.backend=local"],
    ] {
        // the same global batch as one rank (tests/converge.rs runs this comparison on the CPU)
        let diff = common::layout_against_one_rank(&base, layout);
        eprintln!("{layout:?} on one GPU: max |Δloss| {diff:.1e}");
        assert!(diff <= 1e-4, "{layout:?} on a GPU differs from one rank by {diff:.1e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: .ci/gpu_check runs it there (cargo test --release -- --include-ignored)"]
fn bf16_mixed_precision_reaches_the_floor() {
    common::require_gpu();
    let cfg = Config::load(None, &["device.kind=cuda".to_string()]).unwrap();
    let s = train(&cfg, Options { quiet: true, ..Default::default() }).unwrap_or_else(|e| panic!("{e:#}"));
    let (last, floor) = (s.final_loss() as f64, s.floor.expect("the synthetic corpus has a floor"));
    eprintln!("tiny config, bf16, {} steps: final {last:.4}, floor {floor:.4}", s.losses.len());
    assert!(last - floor < 0.08, "bf16 training ended at {last:.4}, {:.3} above the floor", last - floor);
}

#[test]
#[ignore = "needs a CUDA GPU: .ci/gpu_check runs it there (cargo test --release -- --include-ignored)"]
fn bf16_activations_match_the_memory_formula() {
    common::require_gpu();
    use ferrotron::{cuda::device::Device, cuda::runtime::Gpu, model::Llama, ops::tensor::Place};
    let cfg = Config::load(None, &[]).unwrap();
    let device = Device::new(&Gpu::open(0).unwrap(), ferrotron::ops::DType::Bf16).unwrap();
    let mut model = Llama::new(&cfg.model, 1);
    model.to_place(&Place::Cuda(device.clone()));
    let (batch, seq) = (2, cfg.train.seq_len);
    let tokens: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % cfg.model.vocab_size) as u32).collect();
    let targets: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    model.forward(&tokens, batch, &targets).unwrap();
    let whole = ferrotron::model::stage::Stage::WHOLE;
    let want = ferrotron::train::memory::activation_bytes(
        &cfg.model,
        batch,
        seq,
        ferrotron::train::memory::Keep::WHOLE,
        whole,
        ferrotron::ops::DType::Bf16,
    );
    assert_eq!(model.activation_bytes() as f64, want);
    model.backward(1.0).unwrap();
    assert_eq!(model.activation_bytes(), 0, "backward frees what forward kept");
    assert!(device.take_peak_bytes() as f64 >= want, "the peak counts the activations");
}
