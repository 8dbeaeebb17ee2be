//! The hostile sweep (issue 40): a table of bad inputs across every config key, every path
//! argument and the subcommands' flags, each run on the real binary. The contract for every case:
//!
//! - no panic, no abort, no hang: the exit code is 0 or 1 (2 for clap's own usage errors), within
//!   the case's time limit;
//! - refused: exactly one line on stderr, `error: …`, that names what was wrong (the key, the flag
//!   or the file) — never a Rust debug dump;
//! - nothing outside the case's own scratch folder is created, and nothing in it the run did not
//!   make is changed.
//!
//! Cases that must be refused say so and what the line must name; cases where the value is a
//! legitimate if odd choice (`copy_prob = 0`) may also train, briefly (`train.steps = 1`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferrotron");

#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    /// Exit 1, one line naming this.
    Refused(&'static str),
    /// Exit 0, or exit 1 with one line naming this.
    RefusedOrRuns(&'static str),
}

struct Case {
    args: Vec<String>,
    want: Want,
}

/// The kinds of value a config key takes, read from the config itself (`config_keys`).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Float,
    Integer,
    Bool,
    /// One of a few words: any other word is refused.
    Word,
    /// A path or a name: any word may be right.
    Text,
}

/// Keys whose large values are valid runs of months (`train.steps = 2³²`): their huge values are
/// not tried here (`tests/faults.rs` stops such a run by a signal).
const LONG_RUNS: &[&str] = &["train.steps", "train.grad_accum_steps"];

/// Every key of the config with its kind, found from the config, not listed by hand: the
/// built-in config written as TOML gives each key and its type, and whether a made-up word is
/// refused tells a key of a few words from a free one. A key added tomorrow is swept tomorrow;
/// so is a key of a table inside a section (`model.rope_scaling.factor`).
fn config_keys() -> Vec<(String, Kind)> {
    let cfg = ferrotron::config::Config::load(None, &[]).unwrap();
    let table = toml::Table::try_from(&cfg).unwrap();
    let mut keys = Vec::new();
    let mut leaves = Vec::new();
    for (section, values) in &table {
        for (key, value) in values.as_table().unwrap() {
            match value.as_table() {
                Some(inner) => leaves.extend(inner.iter().map(|(k, v)| (format!("{section}.{key}.{k}"), v.clone()))),
                None => leaves.push((format!("{section}.{key}"), value.clone())),
            }
        }
    }
    for (name, value) in leaves {
        // a key that takes words refuses another word as an unknown variant (a text key may
        // refuse it for another reason: `train.sample_prompt` on the synthetic data)
        let word = |w: &str| {
            let e = ferrotron::config::Config::load(None, &[format!("{name}=\"{w}\"")]).err();
            e.is_some_and(|e| format!("{e:#}").contains("variant"))
        };
        let kind = match value {
            toml::Value::Float(_) => Kind::Float,
            toml::Value::Integer(_) => Kind::Integer,
            toml::Value::Boolean(_) => Kind::Bool,
            toml::Value::String(_) if word("no-such-word") && word("nonsense") => Kind::Word,
            toml::Value::String(_) => Kind::Text,
            other => panic!("{name} = {other}: a kind of value the sweep does not know; teach it"),
        };
        keys.push((name, kind));
    }
    keys
}

fn leaf(key: &str) -> &'static str {
    Box::leak(key.rsplit('.').next().unwrap().to_string().into_boxed_str())
}

fn train(sets: &[String]) -> Vec<String> {
    let mut a = vec!["train".to_string()];
    let base = common::SMALL.iter().map(|s| s.to_string()).chain(["train.steps=1".to_string()]);
    for s in base.chain(sets.iter().cloned()) {
        a.extend(["--set".into(), s]);
    }
    a
}

fn config_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add = |key: &str, value: &str, want: Want| {
        cases.push(Case { args: train(&[format!("{key}={value}")]), want });
    };
    let keys = config_keys();
    let count = |k: Kind| keys.iter().filter(|(_, kind)| *kind == k).count();
    assert!(count(Kind::Float) >= 13 && count(Kind::Integer) >= 29 && count(Kind::Word) >= 8, "{keys:?}");
    for (key, kind) in &keys {
        let name = leaf(key);
        match kind {
            Kind::Float => {
                for v in ["nan", "inf", "-inf", "\"0.1\"", "[1.0]"] {
                    add(key, v, Want::Refused(name));
                }
                for v in ["-1.0", "0.0", "1e300"] {
                    add(key, v, Want::RefusedOrRuns(name));
                }
            }
            Kind::Integer => {
                for v in ["-1", "1.5", "\"4\"", "18446744073709551616", "true"] {
                    add(key, v, Want::Refused(name));
                }
                // a model this large is refused by the memory estimate, before anything is allocated
                let named: &'static str =
                    if key.starts_with("model.") { Box::leak(format!("GiB|{name}").into()) } else { name };
                add(key, "0", Want::RefusedOrRuns(name));
                if !LONG_RUNS.contains(&key.as_str()) {
                    for v in ["4294967296", "9223372036854775807"] {
                        add(key, v, Want::RefusedOrRuns(named));
                    }
                }
            }
            Kind::Word => {
                for v in ["\"\"", "\"nonsense\"", "3"] {
                    add(key, v, Want::Refused(name));
                }
            }
            Kind::Bool => {
                for v in ["3", "\"yes\""] {
                    add(key, v, Want::Refused(name));
                }
            }
            Kind::Text => {
                for v in ["3", "[1]", "{ a = 1 }"] {
                    add(key, v, Want::Refused(name));
                }
            }
        }
    }
    for (key, v) in [("data.source", "\"nonsense\""), ("data.source", "3")] {
        add(key, v, Want::Refused(leaf(key)));
    }
    // the synthetic source reads no tokenizer: a missing one is not an error there
    add("data.tokenizer", "\"/no/tokenizer.json\"", Want::RefusedOrRuns("tokenizer"));
    for set in ["model.no_such_key=1", "nosection.key=1", "train.lr", "=1", "train.lr=", "train..lr=1"] {
        cases.push(Case { args: train(&[set.to_string()]), want: Want::Refused("") });
    }
    cases
}

/// Every flag that names a file or folder, from the CLI's table (`src/commands/cli.rs`):
/// (command, flag, whether the command writes it, whether it is a folder).
fn path_flags() -> Vec<(String, String, bool, bool)> {
    use clap::CommandFactory;
    use ferrotron::commands::cli::{Cli, READS, WRITES};
    let mut flags = Vec::new();
    for sub in Cli::command().get_subcommands() {
        for arg in sub.get_arguments() {
            let writes = match arg.get_help_heading() {
                Some(READS) => false,
                Some(WRITES) => true,
                _ => continue,
            };
            let folder = arg.get_value_hint() == clap::ValueHint::DirPath;
            flags.push((sub.get_name().to_string(), format!("--{}", arg.get_long().unwrap()), writes, folder));
        }
    }
    assert!(flags.len() >= 20, "{flags:?}");
    flags
}

/// What `command` needs besides the flag under test, short and valid: a small model, one step.
fn base_args(command: &str, scratch: &Path) -> Vec<String> {
    let gqa = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gqa").display().to_string();
    let tokens = scratch.join("tokens.txt");
    std::fs::write(&tokens, "1 2 3 4 5\n").unwrap();
    let sets = |mut a: Vec<String>| {
        common::SMALL.iter().for_each(|s| a.extend(["--set".into(), s.to_string()]));
        a
    };
    let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    match command {
        "train" => train(&[]),
        "converge" => sets(v(&["converge", "--variants", "dp=2", "--steps", "1"])),
        "bench" => sets(v(&["bench", "--steps", "1", "--warmup", "0"])),
        "memory" => sets(v(&["memory"])),
        "plan" => sets(v(&["plan", "--gpus", "2", "--top", "1"])),
        "schedule" => v(&["schedule"]),
        "eval" => v(&["eval", "--model", &gqa, "--tokens", &tokens.display().to_string()]),
        "generate" => v(&["generate", "--model", &gqa, "--tokens", "1", "--max-new-tokens", "1"]),
        "tokenizer" => v(&["tokenizer", "--vocab-size", "260", &format!("text:{}", tokens.display())]),
        other => panic!("{other} takes a path: give the sweep its base arguments here"),
    }
}

/// Bad paths: a FIFO, a folder, a missing file, garbage, for every argument that reads one.
fn path_cases(scratch: &Path) -> Vec<Case> {
    let fifo = scratch.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let garbage = scratch.join("garbage.bin");
    std::fs::write(&garbage, [0xffu8, 0xfe, 0, 1, 2, 3, 0x80].repeat(100)).unwrap();
    let folder = scratch.join("folder");
    std::fs::create_dir_all(&folder).unwrap();
    let missing = scratch.join("missing");
    // symlinks to a FIFO and to a folder, one to nothing, and two that point at each other
    let link = |name: &str, to: &Path| {
        let at = scratch.join(name);
        std::os::unix::fs::symlink(to, &at).unwrap();
        at
    };
    let (to_fifo, to_folder, dangling) =
        (link("to-fifo", &fifo), link("to-folder", &folder), link("dangling", &missing));
    let looped = link("loop-a", &scratch.join("loop-b"));
    link("loop-b", &looped);
    let s = |p: &Path| p.display().to_string();
    let mut cases = Vec::new();
    // every flag of every command that names a file or folder (the CLI's own table), given each
    // kind of wrong one: the line names the path or the flag
    let wrong_inputs = [&fifo, &garbage, &folder, &missing, &to_fifo, &to_folder, &dangling, &looped];
    for (command, flag, writes, folder_flag) in path_flags() {
        let wrong: Vec<String> = match (writes, folder_flag) {
            (false, _) => wrong_inputs.iter().map(|p| s(p)).collect(),
            // an output file: a folder, a FIFO, a path under a file, such symlinks
            (true, false) => {
                vec![s(&folder), s(&fifo), format!("{}/x.json", s(&garbage)), s(&to_fifo), s(&to_folder), s(&looped)]
            }
            // an output folder: a FIFO, a file, a path under a file, such symlinks
            (true, true) => vec![s(&fifo), s(&garbage), format!("{}/x", s(&garbage)), s(&to_fifo), s(&looped)],
        };
        for bad in wrong {
            if !writes && folder_flag && bad == s(&folder) {
                continue; // an empty folder is a folder: refused for its missing files, named below
            }
            let named: &'static str = Box::leak(format!("{bad}|{flag}").into_boxed_str());
            let mut args = base_args(&command, scratch);
            match args.iter().position(|a| *a == flag) {
                Some(i) => args[i + 1] = bad,
                None => args.extend([flag.to_string(), bad]),
            }
            cases.push(Case { args, want: Want::Refused(named) });
        }
    }
    for bad in wrong_inputs {
        let named: &'static str = Box::leak(s(bad).into_boxed_str());
        let source = format!("data.source=\"text:{}\"", s(bad));
        let cache = format!("data.cache_dir=\"{}\"", s(&scratch.join("cache")));
        cases.push(Case { args: train(&[source, cache, "model.vocab_size=256".into()]), want: Want::Refused(named) });
        let tok = format!("data.tokenizer=\"{}\"", s(bad));
        let text = format!("data.source=\"text:{}\"", s(&scratch.join("corpus.txt")));
        cases.push(Case { args: train(&[text, tok, "model.vocab_size=512".into()]), want: Want::Refused("tokenizer") });
    }
    // config files with a value of the wrong kind where a section, a word or a number goes
    for (i, (toml, named)) in [
        ("model = 5", "`model`"),
        ("[train]\nlr = { x = 1 }", "train.lr"),
        ("[parallel]\ndp_mode = 2", "`naive` or `bucketed`"),
        ("[train]\nrecompute = [1]", "`selective`"),
        ("[data]\nsource = { a = 1 }", "data.source"),
        ("[model]\nhidden_size = 32\n[model]", "duplicate key"),
        ("[train]\nlr = 1e-3\nlr = 2e-3", "duplicate key"),
        ("[[train]]\nsteps = 1", "write `[train]` once"),
        ("[train]\nsteps = 1979-05-27T07:32:00Z", "the date-time 1979-05-27T07:32:00Z"),
    ]
    .into_iter()
    .enumerate()
    {
        let file = scratch.join(format!("wrong-{i}.toml"));
        std::fs::write(&file, toml).unwrap();
        cases.push(Case { args: vec!["train".into(), "--config".into(), s(&file)], want: Want::Refused(named) });
    }
    let gqa = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gqa");
    for bad in [&fifo, &folder, &missing] {
        let named: &'static str = Box::leak(s(bad).into_boxed_str());
        cases.push(Case {
            args: vec!["eval".into(), "--model".into(), s(&gqa), "--tokens".into(), s(bad)],
            want: Want::Refused(named),
        });
    }
    // a file given for two outputs
    let same = s(&scratch.join("same.out"));
    cases.push(Case {
        args: [train(&[]), vec!["--metrics".into(), same.clone(), "--plot".into(), same]].concat(),
        want: Want::Refused("--plot"),
    });
    cases.push(Case {
        args: train(&[format!("checkpoint.dir=\"{}\"", s(&garbage))]),
        want: Want::RefusedOrRuns("checkpoint.dir"),
    });
    cases.push(Case {
        args: train(&[format!("checkpoint.dir=\"{}\"", s(&garbage)), "checkpoint.every=1".into()]),
        want: Want::Refused("checkpoint.dir"),
    });
    cases
}

/// Damaged versions of one file: (what was done to it, its bytes).
type Variants = Vec<(&'static str, Vec<u8>)>;

/// Damaged files inside a model folder and a checkpoint: each file of each, empty, cut off,
/// garbage, with bytes added, or with a value of the wrong kind, read by every command that reads
/// it. The line names the file.
fn damaged_cases(scratch: &Path) -> Vec<Case> {
    let s = |p: &Path| p.display().to_string();
    let ckpt = scratch.join("ckpt");
    let made = Command::new(BIN)
        .args(train(&["checkpoint.every=1".into(), format!("checkpoint.dir=\"{}\"", s(&ckpt))]))
        .env("FERROTRON_CACHE", scratch.join("cache"))
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let good_ckpt = ckpt.join("step_000001");
    let good_model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gqa");
    let safetensors = |good: &[u8]| -> Variants {
        let header = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        let head = String::from_utf8(good[8..8 + header].to_vec()).unwrap();
        let mut long_header = good.to_vec();
        long_header[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut not_json = good.to_vec();
        not_json[8..12].copy_from_slice(b"}}}}");
        vec![
            ("empty", vec![]),
            ("cut off", good[..good.len() / 2].to_vec()),
            ("cut in its header", good[..20].to_vec()),
            ("bytes added", [good, b"garbage"].concat()),
            ("an absurd header length", long_header),
            ("a header that is not JSON", not_json),
            (
                "an integer tensor",
                [&good[..8], head.replacen("F32", "I32", 1).as_bytes(), &good[8 + header..]].concat(),
            ),
            ("a wider dtype", [&good[..8], head.replacen("F32", "F64", 1).as_bytes(), &good[8 + header..]].concat()),
        ]
    };
    let json = |good: &str, edits: &[(&'static str, &str, &str)]| -> Variants {
        let mut v: Variants = vec![
            ("empty", vec![]),
            ("garbage", b"\xff\xfe{{".to_vec()),
            ("a list", b"[]".to_vec()),
            ("null", b"null".to_vec()),
        ];
        for &(what, from, to) in edits {
            assert!(good.contains(from), "{from} in {good}");
            v.push((what, good.replacen(from, to, 1).into_bytes()));
        }
        v
    };
    let read = |p: PathBuf| std::fs::read(p).unwrap();
    let text = |p: PathBuf| std::fs::read_to_string(p).unwrap();
    let state = text(good_ckpt.join("trainer_state.json"));
    let mut damaged: Vec<(&Path, &'static str, Variants)> = vec![
        (&good_model, "model.safetensors", safetensors(&read(good_model.join("model.safetensors")))),
        (&good_ckpt, "model.safetensors", safetensors(&read(good_ckpt.join("model.safetensors")))),
        (&good_ckpt, "optimizer.safetensors", safetensors(&read(good_ckpt.join("optimizer.safetensors")))),
        (
            &good_model,
            "config.json",
            json(
                &text(good_model.join("config.json")),
                &[
                    ("no layers", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 0"),
                    ("a huge width", "\"hidden_size\": 32", "\"hidden_size\": 4294967296"),
                    ("a huge vocabulary", "\"vocab_size\": 48", "\"vocab_size\": 1e20"),
                ],
            ),
        ),
    ];
    damaged.push((
        &good_ckpt,
        "trainer_state.json",
        json(
            &state,
            &[
                ("the step as text", "\"step\": 1", "\"step\": \"1\""),
                ("a negative step", "\"step\": 1", "\"step\": -1"),
                ("a huge AdamW count", "\"adam_steps\": 1", "\"adam_steps\": 99999999999999"),
                ("no run id", "\"run_id\"", "\"ru_id\""),
                ("a config that is not TOML", "\"config\": \"", "\"config\": \"[[[ "),
            ],
        ),
    ));
    let mut cases = Vec::new();
    for (good, file, variants) in damaged {
        for (what, bytes) in variants {
            // named for the reader of a failure: `damaged/step_000001-model.safetensors-cut off/`
            let dir =
                scratch.join("damaged").join(format!("{}-{file}-{what}", good.file_name().unwrap().to_string_lossy()));
            std::fs::create_dir_all(&dir).unwrap();
            for f in std::fs::read_dir(good).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
            }
            std::fs::write(dir.join(file), bytes).unwrap();
            // a config.json that disagrees with the weights' shapes: the folder is named, with the tensor
            let named = match file {
                "config.json" => format!("{}|{}: tensor", s(&dir.join(file)), s(&dir)),
                _ => s(&dir.join(file)),
            };
            let named: &'static str = Box::leak(named.into_boxed_str());
            let d = s(&dir);
            if good == good_model {
                for args in [
                    vec![
                        "eval".into(),
                        "--model".into(),
                        d.clone(),
                        "--tokens".into(),
                        s(&good_model.join("tokens.txt")),
                    ],
                    vec!["generate".into(), "--model".into(), d.clone(), "--tokens".into(), "1".into()],
                ] {
                    cases.push(Case { args, want: Want::Refused(named) });
                }
            } else {
                cases.push(Case {
                    args: [train(&["train.steps=2".into()]), vec!["--resume".into(), d.clone()]].concat(),
                    want: Want::Refused(named),
                });
                // eval reads a checkpoint's config.json and model.safetensors only
                let want = if file == "model.safetensors" { Want::Refused(named) } else { Want::RefusedOrRuns(named) };
                cases.push(Case {
                    args: vec![
                        "eval".into(),
                        "--model".into(),
                        d,
                        "--tokens".into(),
                        s(&good_model.join("tokens.txt")),
                    ],
                    want,
                });
            }
        }
    }
    cases
}

/// The other subcommands' flags.
fn command_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add =
        |args: &[&str], want: Want| cases.push(Case { args: args.iter().map(|s| s.to_string()).collect(), want });
    for tol in ["nan", "-1", "inf"] {
        add(&["converge", "--variants", "dp=2", "--tol", tol], Want::Refused("--tol"));
    }
    for v in ["dp=2,dp=4", "dp", "dp=x", "nokey=2", ""] {
        add(&["converge", "--variants", v, "--steps", "2"], Want::Refused("variant"));
    }
    for p in ["nan", "-1", "0", "inf"] {
        add(&["bench", "--peak-tflops", p], Want::Refused("--peak-tflops"));
    }
    for (flag, v) in [("--dp", "0"), ("--tp", "0"), ("--pp", "0"), ("--cp", "0"), ("--ep", "0")] {
        add(&["grid", flag, v], Want::Refused(""));
    }
    for (flag, v) in [("--pp", "0"), ("--microbatches", "0"), ("--virtual", "0")] {
        add(&["schedule", flag, v], Want::Refused(""));
    }
    for v in ["nan", "-1", "inf"] {
        add(
            &["generate", "--model", "tests/fixtures/gqa", "--tokens", "1", "--temperature", v],
            Want::Refused("--temperature"),
        );
    }
    add(&["generate", "--model", "tests/fixtures/gqa", "--tokens", "99999999999"], Want::Refused("token"));
    add(
        &["generate", "--model", "tests/fixtures/gqa", "--tokens", "1", "--max-new-tokens", "0"],
        Want::Refused("--max-new-tokens"),
    );
    cases
}

/// A library's type or variant name in a message (`MetadataIncompleteBuffer`, `ParseIntError`):
/// a word of two capitalised parts or more, outside a path, that is not one of the field's words.
fn rust_name(err: &str) -> Option<&str> {
    const OURS: &[&str] = &[
        "NaN",
        "AdamW",
        "GiB",
        "MiB",
        "KiB",
        "TFLOP",
        "RoPE",
        "ZeRO",
        "SwiGLU",
        "RMSNorm",
        "DeepSeekMoE",
        "DeepSeek-V3",
        "MoE",
    ];
    err.split(|c: char| c.is_whitespace() || "()[]{},:;'\"`".contains(c))
        .filter(|w| !w.contains('/') && !w.contains('.'))
        .find(|w| {
            let humps =
                w.char_indices().filter(|&(i, c)| c.is_uppercase() && w[..i].ends_with(char::is_lowercase)).count();
            w.starts_with(char::is_uppercase) && humps >= 1 && !w.ends_with("ForCausalLM") && !OURS.contains(w)
        })
}

/// Runs `case`, returning what is wrong with the outcome, if anything.
fn judge(case: &Case, cwd: &Path) -> Option<String> {
    let start = Instant::now();
    let mut child = Command::new(BIN)
        .args(&case.args)
        .current_dir(cwd)
        .env("FERROTRON_CACHE", cwd.join("cache"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let limit = Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            return Some(format!("hung past {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    let code = status.code();
    let one_line = err.trim_end().lines().count() == 1 && err.starts_with("error: ");
    // a Rust debug dump, or serde's words for what a user wrote as a word or a section
    const DEBUG: &[&str] =
        &["panicked", "RUST_BACKTRACE", "Error {", "Custom {", "kind: ", "unit variant", "expected struct"];
    // and words of the layers below: the OS's own phrase, toml's inner names, serde's enums
    const RUST_WORDS: &[&str] = &[
        "invalid type",
        "expected usize",
        "expected u64",
        "expected u32",
        "expected f64",
        "(os error",
        "$__toml_private",
        "untagged enum",
        "[0]`",
    ];
    let debug = DEBUG.iter().chain(RUST_WORDS).find(|d| err.contains(*d));
    if let Some(d) = debug.copied().or_else(|| rust_name(&err)) {
        return Some(format!("printed `{d}`: {err}"));
    }
    let (named, may_run) = match case.want {
        Want::Refused(n) => (n, false),
        Want::RefusedOrRuns(n) => (n, true),
    };
    match code {
        Some(0) if may_run => None,
        Some(0) => Some("succeeded, but must be refused".into()),
        Some(1) | Some(2) if !one_line => Some(format!("not one `error:` line: {err}")),
        Some(1) | Some(2) if !named.split('|').any(|n| err.contains(n)) => {
            Some(format!("does not name `{named}`: {err}"))
        }
        Some(1) | Some(2) => None,
        other => Some(format!("exit {other:?} (a panic or an abort): {err}")),
    }
}

#[test]
fn the_hostile_sweep() {
    let scratch = tempfile::tempdir().unwrap();
    let cwd = scratch.path().join("cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    std::fs::write(scratch.path().join("corpus.txt"), "some text to train on. ".repeat(200)).unwrap();
    let mut cases = config_cases();
    cases.extend(path_cases(scratch.path()));
    cases.extend(command_cases());
    cases.extend(damaged_cases(scratch.path()));
    assert!(cases.len() >= 150, "only {} cases", cases.len());
    eprintln!("the hostile sweep: {} cases", cases.len());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // two at a time: the machine's two cores
    let wrong: Vec<String> = std::thread::scope(|s| {
        let halves: Vec<_> = cases
            .chunks(cases.len().div_ceil(2))
            .map(|part| {
                let cwd = &cwd;
                let root = &root;
                s.spawn(move || {
                    part.iter()
                        .filter_map(|c| {
                            let own = cwd.join(format!("{:p}", c as *const Case));
                            std::fs::create_dir_all(&own).unwrap();
                            let dir = if c.args.iter().any(|a| a.starts_with("tests/")) { root } else { &own };
                            judge(c, dir).map(|why| {
                                format!("{:?}: {why}", c.args.iter().rev().take(4).rev().collect::<Vec<_>>())
                            })
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        halves.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert!(wrong.is_empty(), "{} of {} cases went wrong:\n{}", wrong.len(), cases.len(), wrong.join("\n"));
    // the working folder holds only what the cases asked for: the token cache, and the default
    // checkpoints/ of the runs whose (odd but valid) checkpoint.every saved; a refused command
    // leaves nothing
    let left: Vec<String> = std::fs::read_dir(&cwd)
        .unwrap()
        .flat_map(|case| std::fs::read_dir(case.unwrap().path()).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "cache" && n != "checkpoints")
        .collect();
    assert!(left.is_empty(), "the runs left {left:?} in their working folder");
}
