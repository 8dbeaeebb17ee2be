//! Checkpoints: a killed and resumed run repeats the uninterrupted losses; checkpoints move
//! between topologies; they are Hugging Face folders; old and incomplete ones are handled; a
//! corrupt file is named.

mod common;

use common::processes::losses;
use ferrotron::checkpoint::hf as checkpoint;
use ferrotron::config::Config;
use ferrotron::train::{train, Options};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn sets(dir: &Path, extra: &[&str]) -> Vec<String> {
    let run = ["train.warmup_steps=5".to_string(), format!("checkpoint.dir=\"{}\"", dir.display())];
    common::SMALL.iter().map(|s| s.to_string()).chain(run).chain(extra.iter().map(|s| s.to_string())).collect()
}

fn run(dir: &Path, extra: &[&str], resume: Option<&Path>) -> Vec<f32> {
    let cfg = Config::load(None, &sets(dir, extra)).unwrap();
    train(&cfg, Options { quiet: true, resume, ..Default::default() }).unwrap().losses
}

#[test]
fn a_killed_run_resumes_on_the_uninterrupted_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let bin = env!("CARGO_BIN_EXE_ferrotron");
    let mut args: Vec<String> = vec!["train".into()];
    for s in sets(&dir, &["train.steps=300", "checkpoint.every=3"]) {
        args.extend(["--set".into(), s]);
    }
    let with =
        |extra: &[&str]| args.iter().cloned().chain(extra.iter().map(|s| s.to_string())).collect::<Vec<String>>();
    let full = tmp.path().join("full.jsonl");
    let out = Command::new(bin)
        .args(with(&["--set", "checkpoint.every=0", "--metrics", full.to_str().unwrap()]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // start the same run with checkpoints, and kill it (SIGKILL) once a few exist
    let mut child = Command::new(bin).args(with(&[])).stdout(std::process::Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    while !dir.join("step_000006").exists() {
        assert!(start.elapsed() < Duration::from_secs(60), "no checkpoint appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let resumed = tmp.path().join("resumed.jsonl");
    let out =
        Command::new(bin).args(with(&["--resume", "latest", "--metrics", resumed.to_str().unwrap()])).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (full, resumed) = (losses(&full), losses(&resumed));
    assert!(!resumed.is_empty() && resumed[0].0 >= 6 && resumed.last().unwrap().0 == 299);
    for (step, loss) in &resumed {
        assert_eq!(*loss, full[*step as usize].1, "step {step}: the resumed run left the uninterrupted curve");
    }
}

#[test]
fn checkpoints_move_between_topologies() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let sharded = ["parallel.tp=2", "parallel.pp=2", "train.grad_accum_steps=2", "train.micro_batch_size=8"];
    let mut first = sharded.to_vec();
    first.extend(["train.steps=8", "checkpoint.every=4"]);
    let uninterrupted = run(&dir, &first, None);
    let step4 = dir.join("step_000004");
    // the tp=2 × pp=2 checkpoint resumed on one rank and on the same layout
    let one = run(
        &tmp.path().join("x"),
        &["train.steps=8", "train.grad_accum_steps=2", "train.micro_batch_size=8"],
        Some(&step4),
    );
    let same =
        run(&tmp.path().join("y"), &sharded.iter().copied().chain(["train.steps=8"]).collect::<Vec<_>>(), Some(&step4));
    assert_eq!(same, uninterrupted[4..], "resuming on the same layout repeats its losses exactly");
    for (a, b) in one.iter().zip(&uninterrupted[4..]) {
        assert!((a - b).abs() < 1e-5, "one rank from a tp×pp checkpoint: {a} vs {b}");
    }
    // the folder is a Hugging Face Llama
    let model = checkpoint::load_hf(&step4).unwrap();
    let cfg = Config::load(None, &sets(&dir, &[])).unwrap();
    assert_eq!(model.cfg, checkpoint::read_hf_config(&step4.join("config.json")).unwrap());
    assert_eq!(model.cfg.hidden_size, cfg.model.hidden_size);
    // its floats are the shortest decimals that read back as the same f32, as transformers writes
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step4.join("config.json")).unwrap()).unwrap();
    assert_eq!((json["rms_norm_eps"].as_f64(), json["initializer_range"].as_f64()), (Some(1e-5), Some(0.02)));
    assert!(model.params().iter().any(|p| p.name == "model.layers.1.mlp.down_proj.weight"));
}

#[test]
fn only_the_newest_complete_checkpoints_are_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    run(&dir, &["train.steps=5", "checkpoint.every=1", "checkpoint.keep=2"], None);
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, [".lock", "step_000004", "step_000005"]);
    // a folder left by a run killed while writing is never taken for the latest
    std::fs::create_dir(dir.join("step_000009.tmp")).unwrap();
    let cfg = Config::load(None, &sets(&dir, &[])).unwrap();
    assert_eq!(ferrotron::checkpoint::folder::resolve(Path::new("latest"), &cfg).unwrap(), dir.join("step_000005"));
}

#[test]
fn a_corrupt_checkpoint_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    run(&dir, &["train.steps=2", "checkpoint.every=2"], None);
    let file = dir.join("step_000002/model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let cfg = Config::load(None, &sets(&dir, &["train.steps=4"])).unwrap();
    let err = train(&cfg, Options { quiet: true, resume: Some(&dir.join("step_000002")), ..Default::default() })
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("model.safetensors"), "{err:#}");
    let err = train(&cfg, Options { quiet: true, resume: Some(&tmp.path().join("nowhere")), ..Default::default() })
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("trainer_state.json"), "{err:#}");
}

#[test]
fn pretrained_weights_are_really_used() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gqa");
    let mut cfg =
        Config::load(None, &["train.steps=1".into(), "train.seq_len=16".into(), "data.copy_lag=4".into()]).unwrap();
    cfg.model = checkpoint::read_hf_config(&fixture.join("config.json")).unwrap();
    cfg.model.init_from = fixture.display().to_string();
    cfg.validate().unwrap();
    let quiet = Options { quiet: true, ..Default::default() };
    let first = train(&cfg, quiet).unwrap().losses[0];
    // the same batch through the checkpoint loaded as `eval` loads it
    let data = ferrotron::data::Dataset::open(&cfg.data, &cfg.model).unwrap();
    let (tokens, targets) = data.micro_batch(&cfg.train, (0, 1), 0, 0).unwrap();
    let want = checkpoint::load_hf(&fixture).unwrap().forward(&tokens, cfg.train.micro_batch_size, &targets).unwrap();
    assert!((first - want).abs() < 1e-6, "first training loss {first} vs the checkpoint's {want}");
    let mut tp2 = cfg.clone();
    tp2.parallel.tp = 2;
    assert!((train(&tp2, quiet).unwrap().losses[0] - want).abs() < 1e-5, "sliced for tp = 2");
    let mut random = cfg.clone();
    random.model.init_from.clear();
    assert!((train(&random, quiet).unwrap().losses[0] - want).abs() > 1e-3, "a random init gives another loss");
    let mut wrong = cfg.clone();
    wrong.model.intermediate_size = 48;
    let err = format!("{:#}", train(&wrong, quiet).err().unwrap());
    assert!(err.contains("intermediate_size = 40") && err.contains("model.intermediate_size = 48"), "{err}");
}

#[test]
fn a_diverging_run_stops_and_keeps_its_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let cfg = Config::load(
        None,
        &sets(&dir, &["train.steps=50", "train.lr=1e6", "train.min_lr=1e6", "train.grad_clip=0", "checkpoint.every=1"]),
    )
    .unwrap();
    let err = format!("{:#}", train(&cfg, Options { quiet: true, ..Default::default() }).err().unwrap());
    // the loss guard, or (first, when the step that diverged saves) the checkpoint's own guard
    let named = err.contains("the loss became") || err.contains("holds NaN, so no checkpoint is written");
    assert!(named && err.contains("lower train.lr"), "{err}");
    let latest = ferrotron::checkpoint::folder::resolve(Path::new("latest"), &cfg).unwrap();
    let state = ferrotron::checkpoint::save::load(&latest).unwrap();
    assert!(state.step < 50, "stopped early, at step {}", state.step);
}
