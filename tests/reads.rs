//! One door for every read (issue "Nothing lost, nothing hung, nothing read wrong — by rule"):
//! every file a run reads comes in through `files::open_read` (`src/files.rs`), which never waits
//! on a FIFO and refuses anything but a regular file, naming the flag or key. The rule test reads
//! every module of `src/` and fails on any other way in (`std::fs::read`, `fs::read_to_string`,
//! `File::open`, an `OpenOptions` that reads, a library's own `from_file`), so a read that a new
//! feature adds goes through the door the day it lands; a planted bypass must fail it. Then a
//! FIFO stands in for each file a model folder, a checkpoint or a command's flag names, and every
//! read must fail at once, naming it, where it used to wait for a writer forever.

#[path = "support/syllabus.rs"]
mod syllabus;

use ferrotron::checkpoint::{hf, save};
use ferrotron::commands::{bench, generate, schedule};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

/// The ways to open a file by its path that bypass the door.
const BYPASSES: [&str; 5] = ["fs::read(", "fs::read_to_string(", "File::open(", ".read(true)", "from_file("];

/// Every line of `sources` (module → text) that opens a file for reading by another way than the
/// door, as `module: line N: code`. The door itself (`files`) is where the opening happens.
fn bypasses(sources: &[(String, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (module, text) in sources.iter().filter(|(m, _)| m != "files") {
        for (i, line) in syllabus::code(text).lines().enumerate() {
            if BYPASSES.iter().any(|b| line.contains(b)) {
                found.push(format!("{module}: line {}: {}", i + 1, line.trim()));
            }
        }
    }
    found
}

#[test]
fn every_read_goes_through_the_door() {
    let sources: Vec<(String, String)> = syllabus::sources().into_iter().collect();
    assert!(sources.len() > 100, "the walk found the modules of src/");
    let found = bypasses(&sources);
    assert!(
        found.is_empty(),
        "reads that bypass files::open_read (use open_read, read_bytes or read_text):\n{}",
        found.join("\n")
    );
}

#[test]
fn a_planted_bypass_is_found() {
    let planted = |code: &str| vec![("data::text".to_string(), format!("fn f(p: &Path) {{\n    {code}\n}}"))];
    for code in [
        "let t = std::fs::read_to_string(p)?;",
        "let b = std::fs::read(p)?;",
        "let f = File::open(p)?;",
        "let f = std::fs::OpenOptions::new().read(true).open(p)?;",
        "let t = tokenizers::Tokenizer::from_file(p)?;",
    ] {
        assert_eq!(bypasses(&planted(code)).len(), 1, "{code} is a bypass");
    }
    // the door's own calls, a comment and the door's module are not
    let fine = planted("let t = crate::files::read_text(p, \"--x\")?; // not std::fs::read(p)");
    assert!(bypasses(&fine).is_empty());
    assert!(bypasses(&[("files".into(), "std::fs::File::open(p)".into())]).is_empty());
}

/// `read()`'s error, or a failure if it took more than 10 s (a read waiting on the FIFO).
fn fails_at_once<T>(what: &str, read: impl FnOnce() -> anyhow::Result<T> + Send + 'static) -> String {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(read().err().map(|e| format!("{e:#}")));
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Some(err)) => err,
        Ok(None) => panic!("{what}: a FIFO was read as if it were a file"),
        Err(_) => panic!("{what}: still waiting on the FIFO after 10 s"),
    }
}

fn fifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

#[test]
fn a_fifo_in_place_of_any_file_fails_at_once_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let gqa = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gqa");
    // a model folder whose config is real and whose weights are a FIFO; a checkpoint folder whose
    // state is; a generation config that is
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::copy(gqa.join("config.json"), model.join("config.json")).unwrap();
    fifo(&model.join("model.safetensors"));
    fifo(&model.join("generation_config.json"));
    let checkpoint = tmp.path().join("step_000002");
    std::fs::create_dir(&checkpoint).unwrap();
    fifo(&checkpoint.join("trainer_state.json"));
    let lone = tmp.path().join("lone.fifo");
    fifo(&lone);
    let (m, w, c, l, l2) = (model.clone(), model.join("model.safetensors"), checkpoint, lone.clone(), lone);
    check("model.safetensors (eval, generate, init_from)", move || hf::load_hf(&m).map(drop));
    check("a safetensors file", move || hf::read_safetensors(&w).map(drop));
    check("generation_config.json", move || generate::eos_ids(&model));
    check("trainer_state.json (--resume)", move || save::load(&c).map(drop));
    check("bench --against", move || bench::Other::read(&l).map(drop));
    check("schedule --trace", move || schedule::from_trace(&l2).map(drop));
}

fn check<T>(what: &str, read: impl FnOnce() -> anyhow::Result<T> + Send + 'static) {
    let err = fails_at_once(what, read);
    assert!(err.contains("not a regular file"), "{what}: {err}");
}
