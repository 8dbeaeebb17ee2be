//! Faults, signals and absurd input, tried on the real binary as a hostile user would: each case
//! asserts the exit code, the one-line message, and that no existing checkpoint was lost or
//! changed. Small sizes: the whole file runs in well under a minute on two cores.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferrotron");

/// `train` on the small model with checkpoints in `dir`, plus `extra` arguments.
fn train_args(dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["train".to_string()];
    let run = ["train.warmup_steps=5".to_string(), format!("checkpoint.dir=\"{}\"", dir.display())];
    for s in common::SMALL.iter().map(|s| s.to_string()).chain(run) {
        args.extend(["--set".into(), s]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run(args: &[String]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn spawn(args: &[String]) -> Child {
    Command::new(BIN).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

/// The error line of a failed run: exit code 1, exactly one line on stderr, containing `want`.
fn fails_with(out: &Output, want: &[&str]) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "expected a failure; stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for w in want {
        assert!(err.contains(w), "expected `{w}` in: {err}");
    }
    err
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Every file under `dir` with its bytes: to show that nothing was lost or changed.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut all = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            all.extend(snapshot(&p));
        } else if !p.ends_with(".lock") {
            all.insert(p.clone(), std::fs::read(&p).unwrap());
        }
    }
    all
}

/// (step, loss) of every line of a metrics file.
fn curve(jsonl: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(jsonl).unwrap();
    let line = |l: &str| {
        let j: serde_json::Value = serde_json::from_str(l).unwrap();
        (j["step"].as_u64().unwrap(), j["loss"].as_f64().unwrap())
    };
    text.lines().map(line).collect()
}

fn wait_for_lines(jsonl: &Path, n: usize) {
    let start = Instant::now();
    while std::fs::read_to_string(jsonl).map_or(0, |t| t.lines().count()) < n {
        assert!(start.elapsed() < Duration::from_secs(60), "the run did not get going");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The metrics of the run without any fault, trained with `steps` in a folder of its own.
fn uninterrupted(tmp: &Path, steps: &str) -> PathBuf {
    let reference = tmp.join("reference.jsonl");
    ok(&run(&train_args(&tmp.join("reference"), &["--set", steps, "--metrics", reference.to_str().unwrap()])));
    reference
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

/// `args`, with `--resume latest` when `dir` holds a checkpoint.
fn resuming(args: &[String], dir: &Path) -> Vec<String> {
    let mut a = args.to_vec();
    if ferrotron::checkpoint::folder::list(dir).unwrap().last().is_some() {
        a.extend(["--resume".into(), "latest".into()]);
    }
    a
}

#[test]
fn kill_9_anywhere_even_inside_a_checkpoint_write_then_resume_repeats_the_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, steps) = (tmp.path().join("ck"), "train.steps=120");
    let reference = uninterrupted(tmp.path(), steps);
    // every step saves, so a good share of the kills land inside a checkpoint write
    let metrics = tmp.path().join("m.jsonl");
    let args =
        train_args(&dir, &["--set", steps, "--set", "checkpoint.every=1", "--metrics", metrics.to_str().unwrap()]);
    let (mut seed, mut latest) = (0x9e3779b97f4a7c15u64, Vec::new());
    for _ in 0..6 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let from = ferrotron::checkpoint::folder::list(&dir).unwrap().last().map_or(0, |l| l.step) as usize;
        let mut child = spawn(&resuming(&args, &dir));
        // kill by progress, not by the clock (a faster machine must not finish the run first):
        // 3–14 steps past the checkpoint we resumed from, then 0–4 ms into the next step
        wait_for_lines(&metrics, from + 3 + (seed >> 33) as usize % 12);
        std::thread::sleep(Duration::from_micros((seed >> 20) % 4000));
        child.kill().unwrap(); // SIGKILL: no chance to clean up
        child.wait().unwrap();
        for l in ferrotron::checkpoint::folder::list(&dir).unwrap() {
            ferrotron::checkpoint::save::load(&l.path).expect("every complete checkpoint loads");
        }
        latest.push(ferrotron::checkpoint::folder::list(&dir).unwrap().last().map_or(0, |l| l.step));
    }
    // the kills landed in the middle of the run, at several places
    assert!(latest.iter().all(|&s| s < 120) && latest.windows(2).filter(|w| w[0] != w[1]).count() >= 2, "{latest:?}");
    ok(&run(&resuming(&args, &dir)));
    // one line per step, each the uninterrupted run's loss exactly: nothing lost, nothing mixed
    assert_eq!(curve(&metrics), curve(&reference));
}

#[test]
fn sigterm_and_sigint_save_then_resume_repeats_the_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, steps) = (tmp.path().join("ck"), "train.steps=400");
    let reference = uninterrupted(tmp.path(), steps);
    let metrics = tmp.path().join("m.jsonl");
    let args =
        train_args(&dir, &["--set", steps, "--set", "checkpoint.every=1000", "--metrics", metrics.to_str().unwrap()]);
    for (sig, code, resume) in [(libc::SIGTERM, 143, false), (libc::SIGINT, 130, true)] {
        let mut a = args.clone();
        if resume {
            a.extend(["--resume".into(), "latest".into()]);
        }
        let lines = std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count());
        let child = spawn(&a);
        wait_for_lines(&metrics, lines + 20);
        signal(&child, sig);
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(code), "{stdout}");
        let done = curve(&metrics).len();
        let saved = dir.join(format!("step_{done:06}"));
        assert!(stdout.contains(&format!("checkpoint {}", saved.display())), "{stdout}");
        assert!(stdout.contains("--resume latest"), "{stdout}");
        assert!(done < 400, "stopped early");
    }
    ok(&run(&[args, vec!["--resume".into(), "latest".into()]].concat()));
    assert_eq!(curve(&metrics), curve(&reference), "the stopped and resumed run is the uninterrupted run");
}

/// One rank, a 1F1B pipeline, an interleaved one and a V-shaped zero-bubble one (`--set` pairs).
const LAYOUTS: [&[&str]; 4] = [
    &[],
    &["--set", "parallel.pp=2"],
    &[
        "--set",
        "parallel.pp=2",
        "--set",
        "parallel.pp_schedule=interleaved",
        "--set",
        "parallel.pp_virtual_stages=2",
        "--set",
        "model.num_hidden_layers=4",
    ],
    &["--set", "parallel.pp=2", "--set", "parallel.pp_schedule=zbv", "--set", "model.num_hidden_layers=4"],
];

#[test]
fn a_signal_within_a_long_step_stops_at_the_next_micro_batch() {
    let tmp = tempfile::tempdir().unwrap();
    for (i, layout) in LAYOUTS.iter().enumerate() {
        // a step of 2³² micro-batches would take months: the signal is honoured inside it, and
        // with no step finished there is nothing to save
        let dir = tmp.path().join(format!("ck{i}"));
        let mut child =
            spawn(&train_args(&dir, &[layout, &["--set", "train.grad_accum_steps=4294967296"][..]].concat()));
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.starts_with("data:") {
            line.clear();
            assert!(std::io::BufRead::read_line(&mut stdout, &mut line).unwrap() > 0, "the run did not start");
        }
        std::thread::sleep(Duration::from_millis(300)); // well inside the first step
        signal(&child, libc::SIGTERM);
        let signalled = Instant::now();
        let out = child.wait_with_output().unwrap();
        assert!(signalled.elapsed() < Duration::from_secs(20), "{layout:?}: stopped within moments");
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
        assert_eq!(out.status.code(), Some(143), "{layout:?}: {rest}{}", String::from_utf8_lossy(&out.stderr));
        assert!(rest.contains("step 1 dropped after ") && rest.contains("of its 4294967296 micro-batches"), "{rest}");
        assert!(rest.contains("stopped by SIGTERM in the run's first step: nothing new to save"), "{rest}");
        assert!(!dir.exists(), "nothing saved");
    }
    // steps of a few hundred micro-batches: the stopped step is dropped, the finished ones saved,
    // and resuming repeats the uninterrupted run
    for (i, layout) in LAYOUTS.iter().enumerate() {
        let long = [layout, &["--set", "train.grad_accum_steps=300", "--set", "train.steps=4"][..]].concat();
        let reference = tmp.path().join(format!("reference{i}.jsonl"));
        let ref_args = [&long[..], &["--metrics", reference.to_str().unwrap()]].concat();
        ok(&run(&train_args(&tmp.path().join(format!("ref{i}")), &ref_args)));
        let (dir, metrics) = (tmp.path().join(format!("long{i}")), tmp.path().join(format!("m{i}.jsonl")));
        let args = train_args(&dir, &[&long[..], &["--metrics", metrics.to_str().unwrap()]].concat());
        let child = spawn(&args);
        wait_for_lines(&metrics, 1);
        std::thread::sleep(Duration::from_millis(30)); // past the next step's first micro-batches
        signal(&child, libc::SIGTERM);
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(143), "{layout:?}: {stdout}");
        let done = curve(&metrics).len();
        assert!(done < 4, "stopped early: {stdout}");
        assert!(stdout.contains(&format!("step {} dropped after ", done + 1)), "{stdout}");
        assert!(stdout.contains(&format!("checkpoint {}", dir.join(format!("step_{done:06}")).display())), "{stdout}");
        ok(&run(&[args, vec!["--resume".into(), "latest".into()]].concat()));
        assert_eq!(curve(&metrics), curve(&reference), "{layout:?}: the dropped step was trained again, whole");
    }
}

#[test]
fn a_signal_during_a_save_lets_it_finish_then_stops_with_the_next() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    // 4M parameters: a save takes long enough to be caught in the middle
    let big = [
        "--set",
        "model.hidden_size=256",
        "--set",
        "model.intermediate_size=1024",
        "--set",
        "model.num_hidden_layers=4",
    ];
    let args = train_args(&dir, &[&big[..], &["--set", "train.steps=100000", "--set", "checkpoint.every=3"]].concat());
    let child = spawn(&args);
    let start = Instant::now();
    let writing = loop {
        let tmp_folder = std::fs::read_dir(&dir).into_iter().flatten().flatten().find(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.ends_with(".tmp") && name.starts_with("step_")
        });
        if let Some(e) = tmp_folder {
            break e.file_name().to_string_lossy()[5..11].parse::<usize>().unwrap();
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no save was seen");
        std::thread::sleep(Duration::from_micros(200));
    };
    signal(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(143), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let listed = ferrotron::checkpoint::folder::list(&dir).unwrap();
    let steps: Vec<usize> = listed.iter().map(|l| l.step).collect();
    assert!(steps.contains(&writing), "the save under way finished: {steps:?}");
    assert_eq!(steps.last(), Some(&(writing + 1)), "then the next step saved and the run stopped: {steps:?}");
    listed.iter().for_each(|l| drop(ferrotron::checkpoint::save::load(&l.path).unwrap()));
    assert!(!std::fs::read_dir(&dir).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".tmp")));
}

#[test]
fn a_reused_folder_is_refused_and_nothing_in_it_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let first = train_args(&dir, &["--set", "train.steps=6", "--set", "checkpoint.every=2"]);
    ok(&run(&first));
    let before = snapshot(&dir);
    // a new run in the same folder: refused, not pruning the old run's checkpoints
    fails_with(&run(&first), &["holds checkpoints of another run", "--resume latest"]);
    fails_with(&run(&train_args(&dir, &["--set", "train.steps=9", "--set", "checkpoint.every=1"])), &["another run"]);
    // resuming an older checkpoint of the run would replace the newer one
    let older = dir.join("step_000004");
    fails_with(
        &run(&[
            first.clone(),
            vec!["--set".into(), "train.steps=8".into(), "--resume".into(), older.to_str().unwrap().into()],
        ]
        .concat()),
        &["newer checkpoint of this run (step_000006)"],
    );
    // another run's checkpoint resumed into this folder
    let other = tmp.path().join("other");
    ok(&run(&train_args(&other, &["--set", "train.steps=2", "--set", "checkpoint.every=2"])));
    let foreign = other.join("step_000002");
    fails_with(
        &run(&[first.clone(), vec!["--resume".into(), foreign.to_str().unwrap().into()]].concat()),
        &["holds checkpoints of another run"],
    );
    assert_eq!(snapshot(&dir), before, "the folder's checkpoints are untouched");
    // a finished run says so; a checkpoint past train.steps is an error
    let out = ok(&run(&[first.clone(), vec!["--resume".into(), "latest".into()]].concat()));
    assert!(out.contains("nothing to train: the run already finished at step 6"), "{out}");
    let shorter = [first.clone(), vec!["--set".into(), "train.steps=4".into(), "--resume".into(), "latest".into()]];
    fails_with(&run(&shorter.concat()), &["step_000006 is at step 6, past train.steps = 4"]);
    // settings that change the curve are named; --allow-changes continues anyway
    let lr =
        [first.clone(), vec!["--set".into(), "train.lr=0.001".into(), "--set".into(), "data.seed=7".into()]].concat();
    let resume = vec!["--set".into(), "train.steps=8".into(), "--resume".into(), "latest".into()];
    fails_with(
        &run(&[lr.clone(), resume.clone()].concat()),
        &["train.lr = 0.001 (checkpoint: 0.006)", "data.seed = 7 (checkpoint: 42)", "--allow-changes"],
    );
    assert_eq!(snapshot(&dir), before);
    let out = ok(&run(&[lr, resume, vec!["--allow-changes".into()]].concat()));
    assert!(out.contains("continuing with changed settings: data.seed = 7"), "{out}");
}

#[test]
fn two_runs_cannot_write_one_folder_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let metrics = tmp.path().join("m.jsonl");
    let long = train_args(&dir, &["--set", "train.steps=100000", "--set", "checkpoint.every=5"]);
    let mut first = spawn(&[long.clone(), vec!["--metrics".into(), metrics.to_str().unwrap().into()]].concat());
    wait_for_lines(&metrics, 12);
    let err = fails_with(
        &run(&train_args(&dir, &["--set", "train.steps=3", "--set", "checkpoint.every=1"])),
        &["is in use by another run"],
    );
    assert!(err.contains(&format!("pid {}", first.id())), "names the holder: {err}");
    // the resumed form is refused as well, while the first run holds the folder
    fails_with(&run(&[long, vec!["--resume".into(), "latest".into()]].concat()), &["in use by another run"]);
    first.kill().unwrap();
    first.wait().unwrap();
    for l in ferrotron::checkpoint::folder::list(&dir).unwrap() {
        assert!(l.run_id.is_some(), "only the first run's checkpoints");
        ferrotron::checkpoint::save::load(&l.path).unwrap();
    }
}

#[test]
fn an_output_another_live_run_writes_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let (metrics, trace, plot) = (t("m.jsonl"), t("trace.json"), t("plot.svg"));
    let outputs = ["--metrics", &metrics, "--trace", &trace, "--plot", &plot];
    let mut first =
        spawn(&train_args(&tmp.path().join("ck1"), &[&["--set", "train.steps=100000"], &outputs[..]].concat()));
    wait_for_lines(Path::new(&metrics), 3);
    std::os::unix::fs::symlink(&trace, tmp.path().join("link.json")).unwrap();
    std::fs::create_dir(tmp.path().join("sub")).unwrap();
    // the same files by other names: `a/../b`, a symlink, the plain path
    for (flag, path) in [("--metrics", t("sub/../m.jsonl")), ("--trace", t("link.json")), ("--plot", plot.clone())] {
        let out = run(&train_args(&tmp.path().join("ck2"), &["--set", "train.steps=2", flag, &path]));
        fails_with(&out, &[flag, "another live run", &format!("process {}", first.id())]);
    }
    assert!(!tmp.path().join("ck2").exists(), "refused before anything was made");
    first.kill().unwrap(); // kill -9: the claims go with the process
    first.wait().unwrap();
    ok(&run(&train_args(&tmp.path().join("ck3"), &[&["--set", "train.steps=2"], &outputs[..]].concat())));
    assert_eq!(curve(Path::new(&metrics)).len(), 2, "the third run wrote the metrics");
}

#[test]
fn damaged_and_foreign_checkpoints_are_named_and_left_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let args = train_args(&dir, &["--set", "train.steps=2", "--set", "checkpoint.every=2"]);
    ok(&run(&args));
    let step = dir.join("step_000002");
    let resume = |extra: &[&str], ck: &Path| {
        let more = ["--set", "train.steps=4", "--resume", ck.to_str().unwrap()];
        run(&train_args(
            &tmp.path().join("new"),
            &[&args[1..].iter().map(|s| s.as_str()).collect::<Vec<_>>()[..], extra, &more].concat(),
        ))
    };
    // each damage in a copy of the checkpoint: the original stays as it was
    let damaged = |name: &str, damage: &dyn Fn(&Path)| {
        let copy = tmp.path().join(name);
        std::fs::create_dir_all(&copy).unwrap();
        for f in std::fs::read_dir(&step).unwrap().flatten() {
            std::fs::copy(f.path(), copy.join(f.file_name())).unwrap();
        }
        damage(&copy);
        copy
    };
    let before = snapshot(&dir);
    let truncated = damaged("truncated", &|c| {
        let f = c.join("model.safetensors");
        let b = std::fs::read(&f).unwrap();
        std::fs::write(&f, &b[..b.len() / 3]).unwrap();
    });
    fails_with(&resume(&[], &truncated), &["model.safetensors", "not a valid safetensors file"]);
    let nan = damaged("nan", &|c| {
        let f = c.join("model.safetensors");
        let mut b = std::fs::read(&f).unwrap();
        let n = b.len();
        b[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes()); // the last weight of the last tensor
        std::fs::write(&f, b).unwrap();
    });
    fails_with(&resume(&[], &nan), &["holds NaN or infinite values"]);
    let foreign = damaged("foreign", &|c| {
        let f = c.join("trainer_state.json");
        let text = std::fs::read_to_string(&f).unwrap().replace("\"run_id\"", "\"someone\"");
        std::fs::write(&f, text).unwrap();
    });
    fails_with(&resume(&[], &foreign), &["no run_id"]);
    fails_with(&resume(&[], &tmp.path().join("nowhere")), &["trainer_state.json", "not a ferrotron checkpoint"]);
    // a model smaller than the checkpoint: its extra layer would be dropped
    fails_with(
        &resume(&["--set", "model.num_hidden_layers=1"], &step),
        &["model.layers.1", "more layers than model.num_hidden_layers = 1"],
    );
    // a tied model from an untied checkpoint: its output layer would be dropped
    fails_with(
        &resume(&["--set", "model.tie_word_embeddings=true"], &step),
        &["lm_head.weight", "tie_word_embeddings = true"],
    );
    assert_eq!(snapshot(&dir), before);
}

/// Hostile values of each field of `trainer_state.json`, by the field's name: every field a run
/// writes must be listed here (a new one fails the test until its cases are), each value refused
/// where it is read, in one line naming the file and the field. `None`: the field taken out, with
/// what the resume must then say (a field older checkpoints lack resumes with a note).
fn hostile_fields() -> Vec<(&'static str, Vec<serde_json::Value>, Option<&'static str>)> {
    use serde_json::json;
    let escape = json!("/../../../ESCAPED");
    vec![
        ("step", vec![json!(-1), json!("2"), json!(1e30), json!(null), json!(3)], None),
        ("adam_steps", vec![json!(3), json!(1), json!(-1), json!("2"), json!(4294967296u64)], None),
        ("run_id", vec![escape.clone(), json!(""), json!("0-0/x"), json!(5), json!("a".repeat(100_000))], None),
        (
            "data_fingerprint",
            vec![json!(null), escape.clone(), json!(5), json!("0123456789ABCDEF0123456789ABCDEF"), json!("00")],
            Some("predates data fingerprints"),
        ),
        ("tokenizer_fingerprint", vec![escape.clone(), json!(7), json!("Bytes"), json!([])], Some("")),
        ("config", vec![json!(""), json!(5), json!("[train]\nsteps = \"x\"\n"), escape], None),
    ]
}

#[test]
fn every_field_of_trainer_state_json_is_checked_where_it_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, text) = (tmp.path().join("ck"), tmp.path().join("d.txt"));
    std::fs::write(&text, "a text whose checkpoint will be edited. ".repeat(100)).unwrap();
    let sets = [
        format!("data.source=\"text:{}\"", text.display()),
        "data.tokenizer=\"bytes\"".into(),
        format!("data.cache_dir=\"{}\"", tmp.path().join("cache").display()),
        "model.vocab_size=256".into(),
    ];
    let with = |ck: &Path, extra: &[&str]| {
        let mut a = train_args(ck, extra);
        sets.iter().for_each(|s| a.extend(["--set".into(), s.clone()]));
        a
    };
    ok(&run(&with(&dir, &["--set", "train.steps=2", "--set", "checkpoint.every=2"])));
    let state = dir.join("step_000002/trainer_state.json");
    let meta: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    let cases = hostile_fields();
    let listed: Vec<&str> = cases.iter().map(|(k, ..)| *k).collect();
    let mut written: Vec<&str> = meta.keys().map(String::as_str).collect();
    written.sort();
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(written, sorted, "every field a checkpoint holds has its hostile values here");
    let before = snapshot(&dir);
    let mut tries = 0;
    for (key, values, when_missing) in &cases {
        let edits = values.iter().map(Some).chain([None]);
        for (i, value) in edits.enumerate() {
            let copy = tmp.path().join(format!("edited-{key}-{i}"));
            std::fs::create_dir_all(&copy).unwrap();
            for f in std::fs::read_dir(dir.join("step_000002")).unwrap().flatten() {
                std::fs::copy(f.path(), copy.join(f.file_name())).unwrap();
            }
            let mut edited = meta.clone();
            match value {
                Some(v) => drop(edited.insert(key.to_string(), v.clone())),
                None => drop(edited.remove(*key)),
            }
            std::fs::write(copy.join("trainer_state.json"), serde_json::to_string(&edited).unwrap()).unwrap();
            let new = tmp.path().join(format!("new-{key}-{i}"));
            let resume = ["--set", "train.steps=4", "--resume", copy.to_str().unwrap()];
            let out = run(&with(&new, &resume));
            match (value, when_missing) {
                (None, Some(note)) => assert!(ok(&out).contains(note), "{key} taken out: {}", ok(&out)),
                _ => {
                    let err = fails_with(&out, &["trainer_state.json"]);
                    let named = err.contains(&format!("\"{key}\"")) || err.contains(key) || err.contains("no run_id");
                    assert!(named, "{key} = {value:?}: the field is named: {err}");
                    assert!(err.len() < 600, "{key}: a short line: {err}");
                    assert!(!new.exists(), "{key} = {value:?}: nothing made for the run");
                }
            }
            tries += 1;
        }
    }
    assert!(tries >= 30, "{tries}");
    assert!(!Path::new("/ESCAPED").exists() && !tmp.path().join("ESCAPED").exists());
    assert_eq!(snapshot(&dir), before, "the checkpoint itself is left alone");
}

/// Each metrics line names its run: resuming with the metrics file of another run (which would
/// splice two curves into one) is refused and the file left as it was; the run's own resumes.
#[test]
fn resuming_onto_another_runs_metrics_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    let trained = |dir: &str, metrics: &Path| {
        let extra = ["--set", "train.steps=2", "--set", "checkpoint.every=2", "--metrics", metrics.to_str().unwrap()];
        ok(&run(&train_args(&tmp.path().join(dir), &extra)))
    };
    trained("ck_a", &a);
    trained("ck_b", &b);
    let line: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&a).unwrap().lines().next().unwrap()).unwrap();
    assert!(line["run"].as_str().is_some_and(ferrotron::checkpoint::folder::is_run_id), "{line}");
    let resume = |metrics: &Path| {
        let more = ["--set", "train.steps=3", "--resume", "latest", "--metrics", metrics.to_str().unwrap()];
        run(&train_args(&tmp.path().join("ck_a"), &more))
    };
    let before = std::fs::read(&b).unwrap();
    fails_with(&resume(&b), &["--metrics", "holds steps of run", "not of the run resumed"]);
    assert_eq!(std::fs::read(&b).unwrap(), before, "the other run's file is left as it was");
    ok(&resume(&a));
    assert_eq!(curve(&a).len(), 3, "its own file goes on");
}

#[test]
fn outputs_are_written_whole_through_symlinks_and_checked_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let target = tmp.path().join("real.jsonl");
    std::fs::write(&target, "old\n").unwrap();
    let link = tmp.path().join("link.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    ok(&run(&train_args(&dir, &["--set", "train.steps=3", "--metrics", link.to_str().unwrap()])));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays a link");
    assert_eq!(curve(&target).len(), 3, "its target holds the metrics");
    // a folder, a FIFO, a device, a path under a file, an empty checkpoint.dir: refused at once
    let fifo = tmp.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let under_file = file.join("m.jsonl");
    let long = ["--set", "train.steps=100000", "--set", "checkpoint.every=1"];
    for (flag, path, want) in [
        ("--metrics", tmp.path().to_path_buf(), "is a folder"),
        ("--metrics", fifo.clone(), "not a regular file"),
        ("--metrics", PathBuf::from("/dev/null"), "not a regular file"),
        ("--trace", fifo.clone(), "not a regular file"),
        ("--metrics", under_file.clone(), "cannot create folder"),
    ] {
        let start = Instant::now();
        let a = train_args(&tmp.path().join("never"), &[&long[..], &[flag, path.to_str().unwrap()]].concat());
        fails_with(&run(&a), &[flag, want]);
        assert!(start.elapsed() < Duration::from_secs(20), "refused before training");
        assert!(!tmp.path().join("never").join("step_000001").exists(), "nothing was trained");
    }
    fails_with(&run(&train_args(&dir, &["--set", "checkpoint.dir=\"\""])), &["checkpoint.dir is empty"]);
    let svg = ["schedule", "--out", fifo.to_str().unwrap()].map(String::from);
    fails_with(&run(&svg), &["--out", "not a regular file"]);
    let json = ["bench", "--steps", "1", "--warmup", "0", "--json", tmp.path().to_str().unwrap()].map(String::from);
    fails_with(&run(&json), &["--json", "is a folder"]);
    let conv = ["converge", "--variants", "dp=2", "--out", file.to_str().unwrap()].map(String::from);
    fails_with(&run(&conv), &["--out"]);
}

#[test]
fn an_output_onto_what_the_run_reads_is_refused_and_the_input_is_left_alone() {
    // outputs were compared only with each other: each of these wrote over its input, exit 0
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    ok(&run(&train_args(&dir, &["--set", "train.steps=2", "--set", "checkpoint.every=1"])));
    let config = tmp.path().join("c.toml");
    std::fs::write(&config, "[train]\nsteps = 2\n").unwrap();
    let text = tmp.path().join("d.txt");
    std::fs::write(&text, "some text to train on, ".repeat(50)).unwrap();
    let state = dir.join("step_000002").join("trainer_state.json");
    let source = format!("data.source=\"text:{}\"", s(&text));
    let lock = dir.join(".lock");
    let cases: Vec<(Vec<String>, &str, &Path)> = vec![
        (vec!["--config".into(), s(&config), "--metrics".into(), s(&config)], "--config", &config),
        (
            vec!["--set".into(), source, "--set".into(), "model.vocab_size=256".into(), "--plot".into(), s(&text)],
            "data.source",
            &text,
        ),
        (
            vec!["--resume".into(), "latest".into(), "--metrics".into(), s(&state)],
            "a checkpoint of checkpoint.dir",
            &state,
        ),
        (vec!["--metrics".into(), s(&lock)], "checkpoint.dir's lock", &lock),
    ];
    for (extra, named, input) in cases {
        let before = std::fs::read(input).ok();
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        fails_with(&run(&train_args(&dir, &extra)), &["would write over", named]);
        assert_eq!(std::fs::read(input).ok(), before, "{named}: left as it was");
    }
    let trace = tmp.path().join("t.json");
    std::fs::write(&trace, "{}").unwrap();
    fails_with(
        &run(&["schedule".into(), "--trace".into(), s(&trace), "--out".into(), s(&trace)]),
        &["--out", "--trace"],
    );
    let other = tmp.path().join("o.json");
    std::fs::write(&other, r#"{"device": "cpu", "tokens_per_s": 1000.0, "tokens_per_step": 512}"#).unwrap();
    let bench =
        ["bench", "--steps", "1", "--warmup", "0", "--against", &s(&other), "--json", &s(&other)].map(String::from);
    fails_with(&run(&bench), &["--json", "would write over --against"]);
    assert!(std::fs::read_to_string(&other).unwrap().contains("1000.0"), "--against left as it was");
}

/// A resumed run reads the text its checkpoint trained on, by content: a data file rewritten
/// under the same path is refused (or, with --allow-changes, named), and a checkpoint written
/// before fingerprints existed resumes with a note that the data could not be compared.
#[test]
fn resuming_on_a_text_rewritten_under_the_same_path_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, text) = (tmp.path().join("ck"), tmp.path().join("d.txt"));
    std::fs::write(&text, "one text, read the first time. ".repeat(300)).unwrap();
    let sets = [
        format!("data.source=\"text:{}\"", text.display()),
        "data.tokenizer=\"bytes\"".into(),
        format!("data.cache_dir=\"{}\"", tmp.path().join("cache").display()),
        "checkpoint.every=2".into(),
        "model.vocab_size=256".into(),
    ];
    let with = |steps: &str, extra: &[&str]| {
        let mut a = train_args(&dir, &["--set", steps]);
        sets.iter().for_each(|s| a.extend(["--set".into(), s.clone()]));
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    ok(&run(&with("train.steps=2", &[])));
    let before = snapshot(&dir);
    // the same text: resumes, without a note about the data
    // (and a model.init_from beside --resume is said not to be read)
    let init = format!("model.init_from=\"{}\"", dir.join("step_000002").display());
    let same = ok(&run(&with("train.steps=3", &["--resume", "latest", "--set", &init])));
    assert!(!same.contains("changed data") && !same.contains("predates"), "{same}");
    assert!(same.contains("is not read: the weights come from the checkpoint resumed"), "{same}");
    std::fs::remove_dir_all(dir.join("step_000003")).ok();
    std::fs::write(&text, "another text, written under the same name. ".repeat(300)).unwrap();
    fails_with(
        &run(&with("train.steps=4", &["--resume", "latest"])),
        &["data.source", "changed since the checkpoint", "--allow-changes"],
    );
    assert_eq!(snapshot(&dir).keys().collect::<Vec<_>>(), before.keys().collect::<Vec<_>>(), "nothing written");
    let allowed = ok(&run(&with("train.steps=3", &["--resume", "latest", "--allow-changes"])));
    assert!(allowed.contains("continuing on changed data"), "{allowed}");
    // a checkpoint from before the fingerprint: resumes, saying what it could not check
    let state = dir.join("step_000002/trainer_state.json");
    let mut meta: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    meta.as_object_mut().unwrap().remove("data_fingerprint").unwrap();
    std::fs::write(&state, meta.to_string()).unwrap();
    std::fs::remove_dir_all(dir.join("step_000003")).ok();
    let old = ok(&run(&with("train.steps=3", &["--resume", &dir.join("step_000002").display().to_string()])));
    assert!(old.contains("predates data fingerprints"), "{old}");
}

#[test]
fn a_closed_or_full_stdout_never_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let args = train_args(&tmp.path().join("ck"), &["--set", "train.steps=20", "--set", "checkpoint.every=10"]);
    let full = std::fs::File::options().write(true).open("/dev/full").unwrap();
    let out = Command::new(BIN).args(&args).stdout(full).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // a reader that goes away at once: training goes on and saves
    let args = train_args(&tmp.path().join("ck2"), &["--set", "train.steps=20", "--set", "checkpoint.every=10"]);
    let mut child = Command::new(BIN).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(tmp.path().join("ck2/step_000020").exists());
    let out = Command::new(BIN)
        .args(["grid", "--dp", "2"])
        .stdout(std::fs::File::options().write(true).open("/dev/full").unwrap())
        .output()
        .unwrap();
    assert!(out.status.success() && out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_signal_during_validation_stops_it_at_the_next_micro_batch() {
    // a validation of 10⁹ batches would take years: a signal ends it within moments, and the run
    // saves and exits as after any step; 2⁶² held-out sequences or more are refused at once
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let long = ["--set", "validation.every=1", "--set", "validation.batches=1000000000", "--set", "train.steps=3"];
    let mut child = spawn(&train_args(&dir, &long));
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut stdout, &mut line).unwrap() > 0, "the run did not start");
    }
    std::thread::sleep(Duration::from_millis(3000)); // step 1 is done (in ~0.1 s), its validation under way
    signal(&child, libc::SIGTERM);
    let signalled = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if signalled.elapsed() > Duration::from_secs(20) {
            child.kill().unwrap(); // fail, not hang
            panic!("the validation went on 20 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert_eq!(out.status.code(), Some(143), "{rest}{}", String::from_utf8_lossy(&out.stderr));
    assert!(rest.contains("validation cut short by SIGTERM after "), "{rest}");
    assert!(rest.contains("note: validation.batches = 1000000000: each validation"), "said before it began: {rest}");
    let saved =
        std::fs::read_dir(&dir).unwrap().flatten().any(|e| e.file_name().to_string_lossy().starts_with("step_"));
    assert!(saved, "the finished step is saved: {rest}");
    let huge = ["--set", "validation.every=1", "--set", "validation.batches=4611686018427387904"];
    fails_with(&run(&train_args(&tmp.path().join("ck2"), &huge)), &["validation.batches", "2⁶²"]);
}

#[test]
fn absurd_sizes_and_non_finite_floats_are_refused_in_a_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    for (set, want) in [
        ("model.vocab_size=1000000000000", "model.vocab_size = 1000000000000"),
        ("model.intermediate_size=1000000000000", "this run needs about"),
        ("model.num_hidden_layers=1000000000", "this run needs about"),
        ("model.hidden_size=4611686018427387904", "this run needs about"),
        ("train.seq_len=100000000", "this run needs about"),
        ("train.micro_batch_size=1000000000000", "this run needs about"),
        ("parallel.dp=100000", "at most 1024"),
        ("parallel.dp=4294967296", "at most 1024"),
        ("parallel.timeout_s=1e300", "parallel.timeout_s"),
        ("train.lr=nan", "train.lr = NaN"),
        ("train.lr=inf", "train.lr = inf"),
        ("model.rope_theta=-inf", "model.rope_theta"),
        ("model.rms_norm_eps=0", "model.rms_norm_eps = 0"),
        ("model.initializer_range=0", "model.initializer_range = 0"),
        ("train.adam_eps=0", "train.adam_eps = 0"),
        ("train.weight_decay=-0.1", "train.weight_decay = -0.1"),
        ("train.grad_clip=-1", "train.grad_clip = -1"),
        ("parallel.bucket_mb=1e300", "parallel.bucket_mb"),
        ("data.copy_prob=nan", "data.copy_prob"),
    ] {
        let start = Instant::now();
        fails_with(&run(&train_args(&dir, &["--set", set])), &[want]);
        assert!(start.elapsed() < Duration::from_secs(20), "{set}: refused at once");
        assert!(!dir.exists(), "{set}: nothing written");
    }
    let grid = ["grid", "--dp", "100000"].map(String::from);
    fails_with(&run(&grid), &["at most 1024"]);
    let grid = ["grid", "--dp", "4294967296", "--tp", "4294967296"].map(String::from);
    fails_with(&run(&grid), &["at most 1024"]);
    fails_with(&run(&["schedule", "--pp", "100000"].map(String::from)), &["at most 256 stages"]);
    fails_with(&run(&["bench", "--steps", "0"].map(String::from)), &["--steps 0"]);
    let warm = ["bench", "--warmup", "18446744073709551615", "--steps", "1"].map(String::from);
    fails_with(&run(&warm), &["too many steps"]);
    let conv =
        ["converge", "--variants", "dp=100000", "--out", tmp.path().join("c").to_str().unwrap()].map(String::from);
    fails_with(&run(&conv), &["variant `dp=100000`"]);
}

/// Issue 40, lost data: a run removes only the temporary folders ferrotron runs make
/// (`step_NNNNNN.<run id>.tmp`), never a user's `*.tmp` in the same folder.
#[test]
fn only_the_runs_own_temporary_folders_are_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    std::fs::create_dir_all(dir.join("junk.tmp")).unwrap();
    std::fs::write(dir.join("notes.tmp"), "the user's notes").unwrap();
    std::fs::write(dir.join("junk.tmp/keep"), "x").unwrap();
    std::fs::create_dir_all(dir.join("step_000009.tmp")).unwrap(); // not a run id: not ours
    let left = dir.join("step_000003.18c2f0a1b2c3d4e5-3039.tmp"); // a killed run's half-written save
    std::fs::create_dir_all(&left).unwrap();
    std::fs::write(left.join("model.safetensors"), "half").unwrap();
    // named like one, but holding what no checkpoint holds: someone's, left with a note
    let look_alike = dir.join("step_000001.abc-123.tmp");
    std::fs::create_dir_all(look_alike.join("drafts")).unwrap();
    std::fs::write(look_alike.join("thesis.tex"), "mine").unwrap();
    let nested = dir.join("step_000002.abc-124.tmp");
    std::fs::create_dir_all(nested.join("model.safetensors")).unwrap(); // a folder, not the file
    let said = run(&train_args(&dir, &["--set", "train.steps=2", "--set", "checkpoint.every=1"]));
    ok(&said);
    assert!(look_alike.join("thesis.tex").exists() && look_alike.join("drafts").is_dir() && nested.is_dir());
    let out = String::from_utf8_lossy(&said.stdout).into_owned() + &String::from_utf8_lossy(&said.stderr);
    assert!(out.contains("step_000001.abc-123.tmp is named like a half-written checkpoint but holds"), "{out}");
    // what a checkpoint holds is exactly what a leftover may hold
    let mut files: Vec<String> = std::fs::read_dir(dir.join("step_000002"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, ferrotron::checkpoint::folder::FILES, "a checkpoint's files");
    assert_eq!(std::fs::read_to_string(dir.join("notes.tmp")).unwrap(), "the user's notes");
    assert!(dir.join("junk.tmp/keep").exists() && dir.join("step_000009.tmp").is_dir());
    assert!(!left.exists(), "the killed run's half-written folder is removed");
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    let mut leftovers: Vec<&String> =
        names.iter().filter(|n| ferrotron::checkpoint::folder::is_half_written(n)).collect();
    leftovers.sort();
    assert_eq!(
        leftovers,
        ["step_000001.abc-123.tmp", "step_000002.abc-124.tmp"].map(String::from).iter().collect::<Vec<_>>()
    );
    assert!(ferrotron::checkpoint::folder::is_half_written("step_000012.18c2f0a1b2c3d4e5-3039.tmp"));
    for not_ours in [
        "notes.tmp",
        "step_000012.tmp",
        "step_12.ab-cd.tmp",
        "step_000012.xyz-1.tmp",
        "step_000012.ab.tmp",
        "step_000012.ab-123456789.tmp",
    ] {
        assert!(!ferrotron::checkpoint::folder::is_half_written(not_ours), "{not_ours}");
    }
}

/// Issue 40, lost data: with `checkpoint.every = 0` a signal still saves; if `checkpoint.dir`
/// would refuse that save (it holds another run's checkpoints), the run says so before its first
/// step and the signal saves beside it, saying where, instead of losing every trained step.
#[test]
fn a_signal_save_that_would_fail_is_found_at_start_and_goes_beside() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    ok(&run(&train_args(&dir, &["--set", "train.steps=2", "--set", "checkpoint.every=2"])));
    let before = snapshot(&dir);
    let metrics = tmp.path().join("m.jsonl");
    let args = train_args(&dir, &["--set", "train.steps=100000", "--metrics", metrics.to_str().unwrap()]);
    let child = spawn(&args);
    wait_for_lines(&metrics, 5);
    signal(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(143), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let note = stdout.lines().position(|l| l.contains("holds checkpoints of another run") && l.contains("instead"));
    let first_step = stdout.lines().position(|l| l.starts_with("step "));
    assert!(note.is_some() && (first_step.is_none() || note < first_step), "said at the start: {stdout}");
    let beside: Vec<PathBuf> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("ck-"))
        .collect();
    assert_eq!(beside.len(), 1, "{stdout}");
    let saved = ferrotron::checkpoint::folder::list(&beside[0]).unwrap();
    assert_eq!(saved.len(), 1);
    assert!(stdout.contains(&saved[0].path.display().to_string()), "says where: {stdout}");
    assert_eq!(snapshot(&dir), before, "the other run's checkpoints are untouched");
    // where no folder can take it (checkpoint.dir under a file), the run says so at the start and
    // a signal stops it cleanly, without a save
    std::fs::write(tmp.path().join("file"), "x").unwrap();
    let under_file = tmp.path().join("file/ck");
    let metrics = tmp.path().join("m2.jsonl");
    let child =
        spawn(&train_args(&under_file, &["--set", "train.steps=100000", "--metrics", metrics.to_str().unwrap()]));
    wait_for_lines(&metrics, 5);
    signal(&child, libc::SIGTERM);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(143), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("a signal will stop the run without saving"), "{stdout}");
    assert!(stdout.contains("no checkpoint saved (no folder could take one"), "{stdout}");
}

/// Issue 40, lost data: a step that makes a weight or an AdamW moment non-finite writes no
/// checkpoint, and the run stops there, naming the step and the tensor.
#[test]
fn no_checkpoint_ever_holds_a_non_finite_number() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let args = train_args(
        &dir,
        &["--set", "train.steps=2", "--set", "checkpoint.every=1", "--set", "train.weight_decay=1e30"],
    );
    let err = fails_with(&run(&args), &["step ", "holds", "no checkpoint is written"]);
    for l in ferrotron::checkpoint::folder::list(&dir).unwrap() {
        let state = ferrotron::checkpoint::save::load(&l.path).unwrap_or_else(|e| panic!("{err}: {e:#}"));
        drop(state); // loading checks every tensor is finite
    }
}

/// Issue 40: `--resume latest` on a damaged newest checkpoint names the newest one that loads;
/// moved away, the resume goes on from it. Changing `train.recompute` (which the losses do not
/// depend on) is not a change of the run.
#[test]
fn a_damaged_newest_checkpoint_names_the_newest_good_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    ok(&run(&train_args(
        &dir,
        &["--set", "train.steps=4", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=2"],
    )));
    let model = dir.join("step_000004/model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 3]).unwrap();
    let more = train_args(&dir, &["--set", "train.steps=6", "--set", "checkpoint.every=2", "--resume", "latest"]);
    fails_with(
        &run(&more),
        &["step_000004 is damaged", "the newest that loads is", "step_000002", "move the damaged one away"],
    );
    std::fs::rename(dir.join("step_000004"), tmp.path().join("damaged")).unwrap();
    ok(&run(&[more, vec!["--set".into(), "train.recompute=\"full\"".into()]].concat()));
    assert!(dir.join("step_000006").is_dir());
}

/// Issue 78, a path from a file: the run id a checkpoint records names the folders a resumed run
/// saves into, so one that is not of the form a run makes is refused in one line, and nothing is
/// made outside `checkpoint.dir`.
#[test]
fn a_run_id_read_from_a_checkpoint_is_one_a_run_makes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    ok(&run(&train_args(&dir, &["--set", "train.steps=1", "--set", "checkpoint.every=1"])));
    let state = dir.join("step_000001/trainer_state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&text).unwrap();
    let id = meta["run_id"].as_str().unwrap().to_string();
    assert!(ferrotron::checkpoint::folder::is_run_id(&id), "{id}");
    for bad in ["/../../../ESCAPED", "../x-1", "ab-cd/ef", "", "ab_cd", "ab-cd.tmp"] {
        std::fs::write(&state, text.replace(&id, bad)).unwrap();
        let checkpoint = dir.join("step_000001");
        let resume = ["--resume", checkpoint.to_str().unwrap(), "--set", "train.steps=2"];
        let said = run(&train_args(&dir, &resume));
        fails_with(&said, &["\"run_id\" is", "not a run id ferrotron makes"]);
        assert!(!tmp.path().join("ESCAPED").exists() && !dir.join("step_000002").exists(), "{bad}");
    }
}
