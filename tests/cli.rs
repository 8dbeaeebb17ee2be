//! The command line as a user meets it: `train` with metrics, and `eval` on a checkpoint.

mod common;

use std::process::Command;

fn ferrotron(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?} failed: {stderr}");
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn train_prints_floor_and_summary_and_writes_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let out = ferrotron(&[
        "train",
        "--set",
        "train.steps=3",
        "--set",
        "train.seq_len=32",
        "--set",
        "data.copy_lag=8",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(out.contains("entropy floor"), "{out}");
    assert!(out.contains("done: 3 steps"), "{out}");
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&metrics).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i);
        for key in ["loss", "lr", "grad_norm", "tokens_per_s"] {
            assert!(l[key].as_f64().is_some_and(|v| v.is_finite() && v > 0.0), "{key} in {l}");
        }
    }
    // the first loss of an untrained model is close to ln(vocab)
    let first = lines[0]["loss"].as_f64().unwrap();
    assert!((first - 64f64.ln()).abs() < 0.1, "first loss {first}");
}

/// A run says what it did: where each checkpoint went, how often a text is read, and that bf16 on
/// a CPU is emulated there.
#[test]
fn train_says_where_checkpoints_go_what_the_data_is_and_what_is_emulated() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let text = dir.path().join("d.txt");
    std::fs::write(&text, "a short text, read many times. ".repeat(40)).unwrap();
    let out = ferrotron(&[
        "train",
        "--set",
        "train.steps=4",
        "--set",
        "checkpoint.every=2",
        "--set",
        &format!("checkpoint.dir=\"{}\"", ck.display()),
        "--set",
        &format!("data.source=\"text:{}\"", text.display()),
        "--set",
        "data.tokenizer=\"bytes\"",
        "--set",
        "model.vocab_size=256",
        "--set",
        &format!("data.cache_dir=\"{}\"", dir.path().join("cache").display()),
        "--set",
        "device.dtype=\"bf16\"",
    ]);
    for step in ["step_000002", "step_000004"] {
        assert!(out.contains(&format!("checkpoint: {}", ck.join(step).display())), "{out}");
    }
    // 1240 tokens; 4 steps × 16 sequences × 128 tokens = 8192 read: about 6.6 times
    assert!(out.contains("1240 tokens to train on; 4 steps read about 6.6 times that"), "{out}");
    assert!(out.contains("on cpu in bf16, emulated on the CPU"), "{out}");
}

#[test]
fn eval_prints_the_transformers_loss() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tied_odd");
    let out = ferrotron(&["eval", "--model", dir, "--tokens", &format!("{dir}/tokens.txt")]);
    let loss: f64 = out.trim().strip_prefix("loss: ").unwrap().parse().unwrap();
    assert!((loss - 4.846938).abs() < 1e-5, "{out}");
}

#[test]
fn converge_prints_a_table_and_writes_csv_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("conv");
    let small = ["model.num_hidden_layers=1", "train.seq_len=32", "data.copy_lag=8", "train.micro_batch_size=4"];
    let mut args = vec!["converge", "--variants", "dp=2;dp=2,grad_accum_steps=2", "--steps", "3"];
    for s in &small {
        args.extend(["--set", s]);
    }
    args.extend(["--out", out_dir.to_str().unwrap()]);
    let out = ferrotron(&args);
    assert!(out.contains("dp=2,grad_accum_steps=2") && out.matches("pass").count() == 2, "{out}");
    let csv = std::fs::read_to_string(out_dir.join("losses.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4, "a header and 3 steps: {csv}");
    assert!(csv.starts_with("step,baseline,\"dp=2\""));
    let svg = std::fs::read_to_string(out_dir.join("losses.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>") && svg.matches("<polyline").count() == 5);
    // the band the verdict holds the curves to is drawn, and the tolerance
    assert!(svg.contains("<polygon") && svg.contains("allowed |Δloss|") && svg.contains("stroke-dasharray=\"2 3\""));
    assert_eq!(common::svg::problems(&svg), Vec::<String>::new(), "the plot reads");
}

#[test]
fn train_with_dp_writes_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    let sets = ["parallel.dp=2", "train.steps=2", "model.num_hidden_layers=1", "train.seq_len=32", "data.copy_lag=8"];
    let mut args = vec!["train", "--trace", trace.to_str().unwrap()];
    for s in &sets {
        args.extend(["--set", s]);
    }
    let out = ferrotron(&args);
    assert!(out.contains("2 ranks") && out.contains("of data-parallel all-reduce time ran during backward"), "{out}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let names: Vec<&str> = json["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
    for want in ["forward 0", "backward 0", "all_reduce(avg) of", "optimizer", "process_name"] {
        assert!(names.iter().any(|n| n.starts_with(want)), "{want} missing from {names:?}");
    }
    let loss = names.iter().find(|n| n.starts_with("all_reduce(avg) of 1 value ")).expect("the loss average");
    assert!(loss.ends_with("dp×cp[0,1]"), "{loss}");
}

/// `train --plot`: the loss, the held-out loss (with validation) and the learning rate, drawn;
/// and the outputs of a run never share a file.
#[test]
fn train_plots_its_run_and_refuses_outputs_on_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("run.svg");
    let small = ["train.steps=6", "train.seq_len=32", "data.copy_lag=8", "validation.every=3", "validation.batches=1"];
    let mut args = vec!["train", "--plot", svg.to_str().unwrap()];
    small.iter().for_each(|s| args.extend(["--set", s]));
    let out = ferrotron(&args);
    assert!(out.contains("plot: ") && out.contains("val loss"), "{out}");
    let picture = std::fs::read_to_string(&svg).unwrap();
    for part in ["training loss", "loss on held-out data", "learning rate", "<polyline", "<circle"] {
        assert!(picture.contains(part), "{part} missing from the plot");
    }
    assert_eq!(picture.matches("<circle").count(), 2, "a point per validation (steps 3 and 6)");
    // steps counted from 1, as the progress line counts them: the title and the axis agree
    assert!(
        picture.contains("steps 1 to 6 of 6</text>") && picture.contains(">1</text>") && picture.contains(">6</text>")
    );
    assert!(!picture.contains(">0</text>"), "no step 0 on the axis");
    assert_eq!(common::svg::problems(&picture), Vec::<String>::new(), "the plot reads");
    // one file for two outputs: refused before training, naming both flags; nothing written
    let same = dir.path().join("same.json");
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink(&same, &link).unwrap();
    for (a, b) in [("--metrics", "--trace"), ("--metrics", "--plot"), ("--trace", "--plot")] {
        for second in [&same, &link] {
            let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
                .args(["train", a, same.to_str().unwrap(), b, second.to_str().unwrap()])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{a} {b}: {err}");
            assert!(err.contains(&format!("is also the {a} file")), "{err}");
            assert!(!same.exists(), "nothing is written");
        }
    }
}

/// A converge plot of many variants with long names, and a run plot with a long title, still
/// read: the canvas grows with its legend and title (`tests/common/svg.rs`).
#[test]
fn plots_of_many_curves_and_long_names_read() {
    let curves: Vec<(String, Vec<f32>)> = (0..40)
        .map(|i| {
            (format!("dp=2,tp=2,pp=2,cp=2,zero_stage=3,recompute=\"selective\" #{i}"), vec![4.0 - i as f32 * 0.01; 30])
        })
        .collect();
    let svg = ferrotron::commands::plot::loss_chart("loss per step", &curves, (&[1e-4; 30], 1e-4));
    assert_eq!(common::svg::problems(&svg), Vec::<String>::new());
    let title = format!("text:{}: steps 1 to 3 of 3", "/a/very/long/path/to/a/corpus".repeat(8));
    let svg = ferrotron::commands::plot::run_chart(&title, (0, 3), &[4.0, 3.0, 2.0], &[(2, 2.5)], &[1e-3; 3]);
    assert_eq!(common::svg::problems(&svg), Vec::<String>::new());
}
