//! Validation (`[validation]`, `train/validate.rs`): the held-out loss is the same under every
//! parallel layout; held-out data is never trained on (synthetic indices apart, a text's tail cut
//! off); it is in the metrics on the due steps only; the errors. And its sibling, samples while
//! training (`train.sample_every`, `train/sample.rs`): the same text under every layout.

mod common;

use ferrotron::config::Config;
use ferrotron::data::Dataset;
use ferrotron::train::{train, Options};

fn sets(extra: &[&str]) -> Vec<String> {
    let run = ["train.steps=12", "train.warmup_steps=3", "validation.every=5", "validation.batches=2"];
    common::SMALL.iter().chain(&run).chain(extra).map(|s| s.to_string()).collect()
}

fn val_losses(extra: &[&str]) -> Vec<(usize, f32)> {
    let cfg = Config::load(None, &sets(extra)).unwrap();
    train(&cfg, Options { quiet: true, ..Default::default() }).unwrap().val_losses
}

#[test]
fn the_held_out_loss_is_the_same_under_every_layout() {
    let one = val_losses(&[]);
    assert_eq!(one.iter().map(|v| v.0).collect::<Vec<_>>(), [4, 9, 11], "every 5 steps and after the last");
    assert!(one[2].1 < one[0].1, "the model learns: {one:?}");
    for layout in [
        &["parallel.dp=2", "train.micro_batch_size=8"][..],
        &["parallel.tp=2"],
        &["parallel.pp=2", "train.grad_accum_steps=2", "train.micro_batch_size=8"],
        &["parallel.cp=2"],
        &["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=3", "train.micro_batch_size=8"],
    ] {
        let got = val_losses(layout);
        assert_eq!(got.len(), one.len(), "{layout:?}");
        for ((s, a), (_, b)) in one.iter().zip(&got) {
            assert!((a - b).abs() < 1e-5, "{layout:?}, step {s}: held-out loss {b} against one rank's {a}");
        }
    }
}

/// A text whose first 90% is lowercase and last 10% uppercase: with validation on, training
/// batches hold only lowercase bytes and held-out batches only uppercase.
#[test]
fn held_out_data_is_never_trained_on() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("split.txt");
    let text: String = (0..9000)
        .map(|i| (b'a' + (i * 7 % 26) as u8) as char)
        .chain((0..1000).map(|i| (b'A' + (i * 5 % 26) as u8) as char))
        .collect();
    std::fs::write(&source, text).unwrap();
    let cfg = Config::load(
        None,
        &sets(&[
            &format!("data.source=\"text:{}\"", source.display()),
            &format!("data.cache_dir=\"{}\"", dir.path().join("cache").display()),
            "model.vocab_size=256",
        ]),
    )
    .unwrap();
    let mut data = Dataset::open(&cfg.data, &cfg.model).unwrap();
    data.hold_out(cfg.validation.split, cfg.train.seq_len + 1).unwrap();
    for step in 0..200 {
        let (tokens, _) = data.micro_batch(&cfg.train, (0, 1), step, 0).unwrap();
        assert!(tokens.iter().all(|&t| (t as u8).is_ascii_lowercase()), "step {step} trains on held-out text");
    }
    for b in 0..20 {
        let (tokens, targets) = data.held_out_rows(b * 4, 4, cfg.train.seq_len + 1).unwrap();
        assert!(tokens.iter().all(|&t| (t as u8).is_ascii_uppercase()), "held-out batch {b}");
        assert!(targets.iter().all(|&t| (t as u8).is_ascii_uppercase()));
    }
    // the synthetic source: held-out sequences are other sequences, the same each time
    let synthetic = Config::load(None, &sets(&[])).unwrap();
    let data = Dataset::open(&synthetic.data, &synthetic.model).unwrap();
    let held = data.held_out_rows(0, 16, 33).unwrap();
    assert_eq!(held, data.held_out_rows(0, 16, 33).unwrap());
    assert_ne!(held, data.micro_batch(&synthetic.train, (0, 1), 0, 0).unwrap());
    // a text too short for its split is refused, naming the key
    std::fs::write(&source, "x".repeat(300)).unwrap();
    let mut short = Dataset::open(&cfg.data, &cfg.model).unwrap();
    let e = short.hold_out(0.1, 33).unwrap_err().to_string();
    assert!(e.contains("validation.split = 0.1") && e.contains("30 held out"), "{e}");
}

#[test]
fn the_metrics_carry_val_loss_on_the_due_steps_and_bad_settings_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let cfg = Config::load(None, &sets(&[])).unwrap();
    let s = train(&cfg, Options { quiet: true, metrics: Some(&metrics), ..Default::default() }).unwrap();
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let with: Vec<(u64, f64)> =
        lines.iter().filter_map(|l| Some((l["step"].as_u64()?, l["val_loss"].as_f64()?))).collect();
    assert_eq!(
        with.iter().map(|w| w.0 as usize).collect::<Vec<_>>(),
        s.val_losses.iter().map(|v| v.0).collect::<Vec<_>>()
    );
    assert!(with.iter().zip(&s.val_losses).all(|(a, b)| a.1 as f32 == b.1));
    let err = |extra: &[&str]| format!("{:#}", Config::load(None, &sets(extra)).unwrap_err());
    assert!(err(&["validation.batches=0"]).contains("validation.batches = 0"));
    for split in ["0.0", "1.0", "-0.5", "nan"] {
        let e = err(&[&format!("validation.split={split}")]);
        assert!(e.contains("validation.split"), "{split}: {e}");
    }
    // off by default: nothing held out, nothing logged
    let off = Config::load(
        None,
        &common::SMALL.iter().map(|s| s.to_string()).chain(["train.steps=2".into()]).collect::<Vec<_>>(),
    )
    .unwrap();
    assert!(train(&off, Options { quiet: true, ..Default::default() }).unwrap().val_losses.is_empty());
}

/// A validation step's tokens/s counts its training alone: 40 held-out batches after steps 4 and
/// 8 (about twenty training steps' work each) leave those steps' speed near the others', where
/// it fell to a fraction of it when the validation was counted in. (A 3× margin against the
/// timing noise of a shared machine.)
#[test]
fn tokens_per_second_leaves_out_the_validation() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let cfg = Config::load(None, &sets(&["validation.every=4", "validation.batches=40"])).unwrap();
    train(&cfg, Options { quiet: true, metrics: Some(&metrics), ..Default::default() }).unwrap();
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let speed = |l: &serde_json::Value| l["tokens_per_s"].as_f64().unwrap();
    let (validated, plain): (Vec<_>, Vec<_>) = lines.iter().skip(1).partition(|l| !l["val_loss"].is_null());
    assert!(validated.len() >= 2, "{lines:?}");
    let mut plain: Vec<f64> = plain.iter().map(|l| speed(l)).collect();
    plain.sort_by(f64::total_cmp);
    let median = plain[plain.len() / 2];
    for l in validated {
        assert!(speed(l) > median / 3.0, "step {}: {} tok/s against a median of {median}", l["step"], speed(l));
    }
}

/// The samples of a run, from its metrics file: (step, sample).
fn samples(extra: &[&str]) -> Vec<(u64, String)> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.jsonl");
    let mut all = vec!["train.sample_every=5", "train.sample_tokens=12", "validation.every=0"];
    all.extend(extra);
    let cfg = Config::load(None, &sets(&all)).unwrap();
    train(&cfg, Options { quiet: true, metrics: Some(&path), ..Default::default() }).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    lines.filter_map(|j| Some((j["step"].as_u64()?, j["sample"].as_str()?.to_string()))).collect()
}

/// A sample is rank 0's greedy continuation by the gathered model: the same tokens under every
/// layout, every `sample_every` steps and after the last; it continues the held-out data's first
/// 16 tokens by default.
#[test]
fn samples_while_training_are_the_same_under_every_layout() {
    let one = samples(&[]);
    assert_eq!(one.iter().map(|s| s.0).collect::<Vec<_>>(), [4, 9, 11], "every 5 steps and after the last");
    let cfg = Config::load(None, &sets(&[])).unwrap();
    let data = Dataset::open(&cfg.data, &cfg.model).unwrap();
    let first: Vec<String> = data.held_out(0, 16).unwrap().iter().map(|t| t.to_string()).collect();
    let (prompt, new) = one[0].1.split_once(" → ").unwrap();
    assert_eq!(prompt, first.join(" "), "the held-out data's first tokens");
    assert_eq!(new.split(' ').count(), 12, "train.sample_tokens new tokens");
    for layout in [
        &["parallel.dp=2", "train.micro_batch_size=8", "parallel.zero_stage=3"][..],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        &["parallel.pp=2", "train.grad_accum_steps=2", "train.micro_batch_size=8"],
        &["parallel.cp=2"],
    ] {
        assert_eq!(samples(layout), one, "{layout:?}");
    }
}

/// On text, `train.sample_prompt` is encoded by `data.tokenizer` and the sample is shown as text;
/// without validation the default prompt is the text's own first tokens. The errors name the key.
#[test]
fn a_text_sample_continues_its_prompt_and_bad_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "the cat sat on the mat. ".repeat(200)).unwrap();
    let source = format!("data.source=\"text:{}\"", text.display());
    let cache = format!("data.cache_dir=\"{}\"", dir.path().join("cache").display());
    let base = [
        source.as_str(),
        cache.as_str(),
        "model.vocab_size=256",
        "train.sample_tokens=24",
        "train.steps=120",
        "train.sample_every=60",
    ];
    let with = |extra: &[&str]| samples(&base.iter().chain(extra).copied().collect::<Vec<_>>());
    let prompted = with(&["train.sample_prompt=\"the cat\""]);
    assert!(prompted[0].1.starts_with("\"the cat\" → \""), "{prompted:?}");
    let learned = &prompted.last().unwrap().1;
    assert!(learned.contains(" sat on the mat"), "120 steps learn the one sentence: {learned}");
    let default = with(&[]);
    assert!(default[0].1.starts_with("\"the cat sat on t\" → "), "the text's first 16 bytes: {default:?}");
    let err = |extra: &[&str]| Config::load(None, &sets(extra)).err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(err(&["train.sample_every=2", "train.sample_tokens=0"]).contains("train.sample_tokens = 0"));
    assert!(err(&["train.sample_every=2", "train.sample_tokens=5000"]).contains("from 1 to 4096"));
    let synthetic = err(&["train.sample_prompt=\"hello\""]);
    assert!(synthetic.contains("train.sample_prompt") && synthetic.contains("synthetic"), "{synthetic}");
    // a prompt longer than the positions the model trains on (SMALL: 32) is refused before the
    // first step, in a line that does not echo it
    let long = format!("train.sample_prompt=\"{}\"", "the cat sat. ".repeat(3000));
    let cfg = Config::load(None, &sets(&[&base[..], &[long.as_str()]].concat())).unwrap();
    let e = format!("{:#}", train(&cfg, Options { quiet: true, ..Default::default() }).err().unwrap());
    assert!(e.contains("train.sample_prompt is 39000 tokens, more than train.seq_len = 32") && e.len() < 300, "{e}");
}
