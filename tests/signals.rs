//! Every long phase outside the training step stops on a signal (`src/signals.rs`): with the
//! handler installed and a SIGTERM received, a file read of more than one chunk, the data's
//! preparation (hashing the source, tokenising it, checking a token file), a checkpoint's and a
//! Hugging Face folder's weights each end with `Interrupted` at their next chunk, and nothing is
//! written; a file of one chunk is still read whole; validation and a sample while training end
//! without their result. (The training
//! step, validation and the wait for peers are signalled on the real binary: `tests/faults.rs`,
//! `tests/multiprocess.rs`.) Its own test binary: the signal, once noted, stays for the process.
//!
//! How signals are counted is tried on the real binary: copies of one signal (a few milliseconds
//! apart, or passed on twice by `timeout`) stop the run cleanly with a checkpoint, and only a
//! signal later than `signals::COPIES_WITHIN` stops it at once.

use ferrotron::config::Config;
use ferrotron::data::Dataset;
use ferrotron::signals::interrupted;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::processes::{args, wait_for_steps, BIN};

fn text_config(source: &std::path::Path, cache: &std::path::Path) -> Config {
    let sets = [
        format!("data.source=\"text:{}\"", source.display()),
        "data.tokenizer=\"bytes\"".into(),
        format!("data.cache_dir=\"{}\"", cache.display()),
        "model.vocab_size=256".into(),
    ];
    Config::load(None, &sets).unwrap()
}

#[test]
fn after_a_signal_every_read_and_the_data_preparation_stop_with_interrupted() {
    let tmp = tempfile::tempdir().unwrap();
    let (text, other, cache) = (tmp.path().join("a.txt"), tmp.path().join("b.txt"), tmp.path().join("cache"));
    std::fs::write(&text, "some text to read. ".repeat(100)).unwrap();
    std::fs::write(&other, "a text never tokenised. ".repeat(100)).unwrap();
    // before any signal: all is read (the token file of a.txt is made)
    let cfg = text_config(&text, &cache);
    Dataset::open(&cfg.data, &cfg.model).unwrap();
    assert_eq!(ferrotron::files::read_bytes(&text, "a file").unwrap().len(), 1900);

    ferrotron::signals::install();
    unsafe { libc::raise(libc::SIGTERM) }; // noted by the handler, as a scheduler's would be
    assert_eq!(ferrotron::signals::received(), Some(libc::SIGTERM));
    let stopped = |e: anyhow::Error, during: &str| {
        let said = format!("{e:#}");
        assert_eq!(interrupted(&e), Some(libc::SIGTERM), "{said}");
        assert!(said.contains("stopped by SIGTERM while") && said.contains(during), "{said}");
    };
    // a file of more than one 64 MiB chunk stops after its first (sparse: no disk is used); one
    // of a single chunk is read whole, as the small reads of a signal's own save must be
    let big = tmp.path().join("big.bin");
    std::fs::File::create(&big).unwrap().set_len((64 << 20) + 1).unwrap();
    stopped(ferrotron::files::read_bytes(&big, "a file").unwrap_err(), "reading a file");
    stopped(ferrotron::files::read_text(&big, "a text").unwrap_err(), "reading a text");
    assert_eq!(ferrotron::files::read_bytes(&text, "a small file").unwrap().len(), 1900);
    // the data: a source already tokenised, and one that is not (no token file is left behind)
    let tokens_before = std::fs::read_dir(cache.join("tokens")).unwrap().count();
    stopped(Dataset::open(&cfg.data, &cfg.model).err().unwrap(), "data.source");
    let fresh = text_config(&other, &cache);
    stopped(Dataset::open(&fresh.data, &fresh.model).err().unwrap(), "data.source");
    assert_eq!(std::fs::read_dir(cache.join("tokens")).unwrap().count(), tokens_before, "nothing written");
    // a checkpoint folder and a Hugging Face folder: their large safetensors file stops
    let folder = tmp.path().join("model");
    std::fs::create_dir_all(&folder).unwrap();
    let gqa = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gqa/config.json");
    std::fs::copy(gqa, folder.join("config.json")).unwrap();
    let state = r#"{"step": 1, "adam_steps": 1, "run_id": "0-0", "config": "[model]\n[train]\n[data]\n"}"#;
    std::fs::write(folder.join("trainer_state.json"), state).unwrap();
    std::fs::hard_link(&big, folder.join("model.safetensors")).unwrap();
    stopped(ferrotron::checkpoint::save::load(&folder).err().unwrap(), "model.safetensors");
    stopped(ferrotron::checkpoint::hf::load_hf(&folder).err().unwrap(), "model.safetensors");
    // a sample while training ends at its next token, as validation at its next micro-batch:
    // the step is kept, without a sample or a held-out loss
    let metrics = tmp.path().join("m.jsonl");
    let sets: Vec<String> =
        ["train.steps=1", "train.sample_every=1", "validation.every=1", "model.num_hidden_layers=1"]
            .map(String::from)
            .into();
    let cfg = Config::load(None, &sets).unwrap();
    let opts = ferrotron::train::Options { quiet: true, metrics: Some(&metrics), ..Default::default() };
    assert_eq!(ferrotron::train::train(&cfg, opts).unwrap().losses.len(), 1);
    let line = std::fs::read_to_string(&metrics).unwrap();
    assert!(line.contains("\"loss\"") && !line.contains("sample") && !line.contains("val_loss"), "{line}");
}

/// 4M parameters: the save of a clean stop takes long enough for a signal to arrive inside it.
const BIG: [&str; 3] = ["model.hidden_size=256", "model.intermediate_size=1024", "model.num_hidden_layers=4"];

/// `train` of the small model for ever, checkpoints in `dir`, metrics to `metrics`.
fn endless(dir: &Path, metrics: &Path, extra: &[&str]) -> Vec<String> {
    let mut sets: Vec<String> = common::SMALL.iter().chain(extra).map(|s| s.to_string()).collect();
    sets.extend(["train.steps=100000".into(), "checkpoint.every=5".into()]);
    sets.push(format!("checkpoint.dir=\"{}\"", dir.display()));
    [args(&["train"], &sets), vec!["--metrics".into(), metrics.display().to_string()]].concat()
}

fn spawn(cmd: &mut Command) -> Child {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

fn send(pid: u32, sig: i32) {
    // SAFETY: signalling a process this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0);
}

/// A clean stop: exit 128 + `sig`, the last step saved, where to resume said, nothing else.
fn stopped_cleanly(child: Child, sig: i32, dir: &Path, metrics: &Path, what: &str) -> String {
    let out = child.wait_with_output().unwrap();
    let said = common::processes::said(&out);
    assert_eq!(out.status.code(), Some(128 + sig), "{what}: {said}");
    let done = std::fs::read_to_string(metrics).unwrap().lines().count();
    assert!(said.contains(&format!("checkpoint {}", dir.join(format!("step_{done:06}")).display())), "{what}: {said}");
    assert!(said.contains("--resume latest") && !said.contains("stopping now"), "{what}: {said}");
    ferrotron::checkpoint::save::load(&dir.join(format!("step_{done:06}"))).unwrap();
    said
}

#[test]
fn copies_of_one_signal_a_few_milliseconds_apart_or_through_timeout_stop_the_run_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    // two signals 5 ms apart, as a job runner that signals a process and then its group sends
    for (i, sig) in [libc::SIGTERM, libc::SIGINT].into_iter().enumerate() {
        let (dir, metrics) = (tmp.path().join(format!("ck{i}")), tmp.path().join(format!("m{i}.jsonl")));
        let child = spawn(Command::new(BIN).args(endless(&dir, &metrics, &BIG)));
        wait_for_steps(&metrics, 3, Duration::from_secs(120));
        send(child.id(), sig);
        std::thread::sleep(Duration::from_millis(5));
        send(child.id(), sig);
        let said = stopped_cleanly(child, sig, &dir, &metrics, "two copies 5 ms apart");
        assert!(said.contains("another signal within a second of the first: taken as a copy of it"), "{said}");
    }
    // SIGTERM to `timeout`, which passes it to the run and then to its whole process group
    let (dir, metrics) = (tmp.path().join("ck_timeout"), tmp.path().join("m_timeout.jsonl"));
    let child = spawn(Command::new("timeout").args(["600", BIN]).args(endless(&dir, &metrics, &BIG)));
    wait_for_steps(&metrics, 3, Duration::from_secs(120));
    send(child.id(), libc::SIGTERM);
    stopped_cleanly(child, libc::SIGTERM, &dir, &metrics, "SIGTERM through timeout");
}

#[test]
fn a_signal_later_than_the_copies_window_stops_at_once_and_the_last_checkpoint_stays() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, metrics) = (tmp.path().join("ck"), tmp.path().join("m.jsonl"));
    let mut child = spawn(Command::new(BIN).args(endless(&dir, &metrics, &BIG)));
    wait_for_steps(&metrics, 7, Duration::from_secs(120));
    send(child.id(), libc::SIGINT);
    // once the handler has said it took the first, freeze the run in its clean stop, let the
    // window pass, and send the second: it is delivered when the run goes on
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("signal received") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() > 0, "the first signal was not noted");
    }
    send(child.id(), libc::SIGSTOP);
    let stopped = Instant::now();
    std::thread::sleep(ferrotron::signals::COPIES_WITHIN + Duration::from_millis(200));
    send(child.id(), libc::SIGINT);
    send(child.id(), libc::SIGCONT);
    let out = child.wait_with_output().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    assert_eq!(out.status.code(), Some(130), "{rest}");
    assert!(rest.contains("second signal: stopping now"), "{rest}");
    assert!(stopped.elapsed() < Duration::from_secs(30));
    let listed = ferrotron::checkpoint::folder::list(&dir).unwrap();
    assert!(!listed.is_empty());
    listed.iter().for_each(|l| drop(ferrotron::checkpoint::save::load(&l.path).unwrap()));
}
