//! Shared by the test files that train.

#[allow(dead_code)] // the test files that start processes
pub mod processes;
#[allow(dead_code)] // the test files that draw
pub mod svg;

/// A model small enough to train in seconds (`--set` strings).
#[allow(dead_code)] // not every test file trains
pub const SMALL: &[&str] = &[
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "train.seq_len=32",
    "data.copy_lag=8",
];

/// For the `#[ignore]`d GPU tests: run where asked (`--include-ignored`), they fail naming what is
/// missing (no driver, no GPU, no NVRTC or headers, no cuBLAS) instead of passing without having run.
#[allow(dead_code)] // used by the GPU test files only
pub fn require_gpu() {
    let ready = ferrotron::cuda::runtime::device_count()
        .and_then(|n| if n > 0 { Ok(()) } else { anyhow::bail!("the driver sees no GPU") })
        .and_then(|_| ferrotron::cuda::nvrtc::nvrtc_ready().map(drop))
        .and_then(|_| ferrotron::cuda::runtime::require("cuBLAS"));
    if let Err(why) = ready {
        panic!("this test needs a CUDA GPU: {why:#}");
    }
}

/// The largest per-step loss difference between one rank and `layout` (settings like
/// "parallel.dp=2"), both on `sets`, through `converge` — which keeps the global batch: with dp
/// ranks each takes micro_batch_size / dp sequences. (Setting parallel.dp alone on top of a
/// micro-batch size would train on dp times as many sequences a step, and part from one rank for
/// that reason only: a GPU test once did, and reported 3.9e-2.)
#[allow(dead_code)] // not every test file compares layouts
pub fn layout_against_one_rank(sets: &[&str], layout: &[&str]) -> f32 {
    use ferrotron::commands::converge;
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let variant = converge::Variant { label: layout.join(","), sets: layout.iter().map(|s| s.to_string()).collect() };
    let report = converge::converge(None, &sets, &[variant], 1e-4).unwrap_or_else(|e| panic!("{e:#}"));
    report.outcomes[0].max_diff
}

/// Trains `cfg` with a trace and writes it to `path` (what `train --trace PATH` does).
#[allow(dead_code)] // the pipeline test files
pub fn write_trace(cfg: &ferrotron::config::Config, path: &std::path::Path) {
    let trace = ferrotron::comm::trace::Trace::default();
    let opts = ferrotron::train::Options { trace: Some(&trace), quiet: true, ..Default::default() };
    ferrotron::train::train(cfg, opts).unwrap();
    trace.write(path).unwrap();
}

/// Trains 6 steps of `base + a`, saving every 3, resumes step 3's checkpoint in `base + b` (and
/// the other way round), and asserts steps 4-6 are the uninterrupted run's (1e-6).
#[allow(dead_code)] // the pipeline test files
pub fn checkpoints_move_between(base: &[String], a: &[&str], b: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let run = |layout: &[&str], dir: &str, resume: Option<&std::path::Path>| {
        let dir = format!("checkpoint.dir=\"{}\"", tmp.path().join(dir).display());
        let more = ["train.steps=6", "checkpoint.every=3", &dir];
        let sets: Vec<String> = base.iter().cloned().chain(layout.iter().chain(&more).map(|s| s.to_string())).collect();
        let cfg = ferrotron::config::Config::load(None, &sets).unwrap();
        let opts = ferrotron::train::Options { quiet: true, resume, ..Default::default() };
        ferrotron::train::train(&cfg, opts).unwrap().losses
    };
    for (from, to, name) in [(a, b, "a"), (b, a, "b")] {
        let whole = run(from, name, None);
        let step3 = tmp.path().join(name).join("step_000003");
        let resumed = run(to, &format!("{name}_resumed"), Some(&step3));
        let diff = whole[3..].iter().zip(&resumed).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(resumed.len() == 3 && diff <= 1e-6, "{from:?} → {to:?}: {resumed:?} vs {:?}", &whole[3..]);
    }
}

/// A safetensors file's tensors as f32, by name.
pub type Tensors = Vec<(String, Vec<f32>)>;

/// The tensors of a checkpoint step's folder: (model.safetensors, optimizer.safetensors).
#[allow(dead_code)] // the test files that compare checkpoints
pub fn checkpoint_tensors(step: &std::path::Path) -> (Tensors, Tensors) {
    let read = |file: std::path::PathBuf| {
        let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut all: Tensors = st
            .tensors()
            .into_iter()
            .map(|(name, t)| (name, t.data().chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    };
    (read(step.join("model.safetensors")), read(step.join("optimizer.safetensors")))
}

/// The same tensors, each within `tolerance` of its largest value (0: equal).
#[allow(dead_code)] // the test files that compare checkpoints
pub fn assert_tensors_close(what: &str, got: &Tensors, want: &Tensors, tolerance: f32) {
    let names = |t: &Tensors| t.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}: the tensors saved");
    for ((name, a), (_, b)) in got.iter().zip(want) {
        let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
        let size = b.iter().map(|y| y.abs()).fold(f32::MIN_POSITIVE, f32::max);
        assert!(a.len() == b.len() && diff <= tolerance * size, "{what}: {name} differs by {diff} (of {size})");
    }
}

/// Trains `cfg` two steps and asserts that each rank's estimated memory is within `tolerance`
/// (a fraction) of its measured peak; `what` names the layout in a failure.
#[allow(dead_code)] // used by the test files that measure memory
pub fn memory_estimate_within(cfg: &ferrotron::config::Config, tolerance: f64, what: &str) {
    for r in ferrotron::commands::memory::memory(cfg, true).unwrap() {
        let m = r.measured_peak_bytes.unwrap();
        let (rank, estimated) = (r.rank, r.total_bytes);
        assert!(
            (estimated / m - 1.0).abs() <= tolerance,
            "{what}, rank {rank}: estimated {estimated} B, measured {m} B"
        );
    }
}
