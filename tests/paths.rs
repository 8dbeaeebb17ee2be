//! The first rule of reliability: one door for paths. Every flag that names a file or folder
//! says, in the CLI's own table (`src/commands/cli.rs`), whether the command reads or writes it
//! and whether it is a file or a folder; the run's registry of inputs and outputs is made from
//! that table. Here the table itself is walked:
//!
//! - every path flag of every command declares its role (a planted undeclared flag is caught);
//! - every output flag of every command is tried against every input the command has (its read
//!   flags and the config keys that name files), given the input's own path or a path inside it:
//!   each try is refused, naming the output's flag, and the input is left as it was; so is every
//!   config key that names a folder to write (`commands::CONFIG_OUTPUTS`), and every config key
//!   that takes a free string says whether it is read, written or no place;
//! - an output claimed by a live run is refused to a second run, whatever its cache folder, and
//!   a lock file a live run holds is never an output.
//!
//! A new flag is covered the day it lands: an output flag joins the tries at once, and an input
//! flag without a fixture below fails the test until one is given.

mod common;

use clap::CommandFactory;
use ferrotron::commands::cli::{Cli, READS, WRITES};
use ferrotron::commands::CONFIG_OUTPUTS;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_ferrotron");

/// What is wrong with the path flags of `command` and its subcommands: a flag whose value is a
/// path (typed `PathBuf`, or hinted as one) without `READS` or `WRITES`, or with one but no file
/// or folder hint.
fn undeclared(command: &clap::Command) -> Vec<String> {
    let mut problems = Vec::new();
    for sub in command.get_subcommands() {
        for arg in sub.get_arguments() {
            let hint = arg.get_value_hint();
            let is_path = arg.get_value_parser().type_id() == std::any::TypeId::of::<PathBuf>()
                || matches!(hint, clap::ValueHint::FilePath | clap::ValueHint::DirPath | clap::ValueHint::AnyPath);
            let role = matches!(arg.get_help_heading(), Some(READS) | Some(WRITES));
            let name = format!("{} --{}", sub.get_name(), arg.get_id());
            if is_path && !role {
                problems.push(format!("{name} takes a path but says neither READS nor WRITES"));
            }
            if role && !matches!(hint, clap::ValueHint::FilePath | clap::ValueHint::DirPath) {
                problems.push(format!("{name} is read or written but not hinted as a file or a folder"));
            }
        }
    }
    problems
}

#[test]
fn every_path_flag_says_whether_it_is_read_or_written() {
    let cli = Cli::command();
    assert_eq!(undeclared(&cli), Vec::<String>::new());
    let writes: Vec<String> = cli
        .get_subcommands()
        .flat_map(|s| {
            s.get_arguments().filter(|a| a.get_help_heading() == Some(WRITES)).map(move |a| a.get_id().to_string())
        })
        .collect();
    assert!(writes.len() >= 8, "the outputs found: {writes:?}");
    // planted: an output flag added without its role, and a role without a file or folder hint
    let planted = clap::Command::new("ferrotron").subcommand(
        clap::Command::new("report")
            .arg(clap::Arg::new("out").long("out").value_parser(clap::value_parser!(PathBuf)))
            .arg(clap::Arg::new("notes").long("notes").help_heading(WRITES)),
    );
    let found = undeclared(&planted);
    assert!(found.iter().any(|p| p.starts_with("report --out takes a path")), "{found:?}");
    assert!(found.iter().any(|p| p.starts_with("report --notes is read or written")), "{found:?}");
}

/// The config keys that name what a run reads, each tried below as an input of every command
/// that reads a config (`commands::inputs`), and the string keys that name no place.
const CONFIG_INPUTS: [&str; 4] = ["data.source", "data.tokenizer", "model.init_from", "checkpoint.dir"];
const NOT_PLACES: [&str; 2] = ["train.sample_prompt", "data.text_column"];

/// Of the config keys `free` that take any string (a path could be one), those that say neither
/// that they are read (`CONFIG_INPUTS`), written (`commands::CONFIG_OUTPUTS`) nor no place at
/// all: a new key that may name a place must take a side.
fn unsorted_keys(free: &[String]) -> Vec<String> {
    let outputs: Vec<&str> = CONFIG_OUTPUTS.iter().map(|(k, _)| *k).collect();
    let sorted = |k: &str| CONFIG_INPUTS.contains(&k) || outputs.contains(&k) || NOT_PLACES.contains(&k);
    free.iter().filter(|k| !sorted(k)).cloned().collect()
}

#[test]
fn every_config_key_that_names_a_place_says_whether_it_is_read_or_written() {
    use ferrotron::config::Config;
    // every key whose value is a string that a path could be (a choice among names refuses it)
    let settings = Config::load(None, &[]).unwrap().settings();
    let takes_a_path = |k: &&String| Config::read(None, &[format!("{k}=\"some/where\"")]).is_ok();
    let mut free: Vec<String> = settings.keys().filter(takes_a_path).cloned().collect();
    assert!(free.len() >= 7, "{free:?}");
    assert_eq!(unsorted_keys(&free), Vec::<String>::new());
    // planted: a key naming a folder to write, added to the config alone
    free.push("train.log_dir".into());
    assert_eq!(unsorted_keys(&free), vec!["train.log_dir".to_string()]);
}

fn run(args: &[String], cwd: &Path) -> Output {
    Command::new(BIN).args(args).current_dir(cwd).stdin(Stdio::null()).output().unwrap()
}

fn small(extra: &[&str]) -> Vec<String> {
    common::SMALL.iter().chain(extra).flat_map(|s| ["--set".to_string(), s.to_string()]).collect()
}

/// Every file under `p` (or `p` itself) with its bytes, and every folder (an empty one left by
/// a refused output is a change too).
fn snapshot(p: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut all = BTreeMap::new();
    if p.is_dir() {
        all.insert(p.to_path_buf(), b"a folder".to_vec());
        for e in std::fs::read_dir(p).unwrap().flatten() {
            all.extend(snapshot(&e.path()));
        }
    } else if p.exists() {
        all.insert(p.to_path_buf(), std::fs::read(p).unwrap());
    }
    all
}

/// An input of a command: the arguments that make the command read it, and the path read.
struct Input {
    name: String,
    args: Vec<String>,
    path: PathBuf,
}

#[test]
fn no_output_of_any_command_may_be_one_of_its_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let at = |name: &str| tmp.path().join(name);
    let s = |p: PathBuf| p.display().to_string();
    // the fixtures: a config, a checkpoint (also a Hugging Face folder), a trace, routing tapes,
    // a bench JSON, a text, a tokenizer
    std::fs::write(at("c.toml"), "[train]\nsteps = 1\n").unwrap();
    let ck = at("ck");
    let made = run(
        &[
            &["train".into(), "--trace".into(), s(at("t.json"))][..],
            &small(&["checkpoint.every=1", &format!("checkpoint.dir=\"{}\"", ck.display()), "train.steps=1"]),
        ]
        .concat(),
        tmp.path(),
    );
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let step = std::fs::read_dir(&ck).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).unwrap();
    let moe = small(&["model.num_local_experts=4", "model.num_experts_per_tok=2", "train.steps=1"]);
    let made = run(&[&["train".into(), "--record-routing".into(), s(at("tapes"))][..], &moe].concat(), tmp.path());
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    std::fs::write(at("other.json"), r#"{"tokens_per_s": 100.0, "tokens_per_step": 512, "device": "cpu"}"#).unwrap();
    std::fs::write(at("d.txt"), "a text to train on. ".repeat(100)).unwrap();
    std::fs::create_dir(at("shards")).unwrap();
    std::fs::write(at("shards/e.txt"), "a shard to train on. ".repeat(100)).unwrap();
    let tokenizer = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/tokenizer.json");
    std::fs::copy(tokenizer, at("tokenizer.json")).unwrap();
    let flag_fixture: BTreeMap<&str, PathBuf> = [
        ("--config", at("c.toml")),
        ("--resume", step.clone()),
        ("--replay-routing", at("tapes")),
        ("--trace", at("t.json")),
        ("--against", at("other.json")),
    ]
    .into();
    // the config keys that name what a run reads (`commands::inputs`)
    let set = |k: &str, v: String| vec!["--set".to_string(), format!("{k}=\"{v}\"")];
    let keys = [
        Input {
            name: "data.source".into(),
            args: [
                set("data.source", format!("text:{}", s(at("d.txt")))),
                vec!["--set".into(), "model.vocab_size=320".into()],
            ]
            .concat(),
            path: at("d.txt"),
        },
        Input {
            name: "data.tokenizer".into(),
            args: [
                set("data.source", format!("text:{}", s(at("d.txt")))),
                set("data.tokenizer", s(at("tokenizer.json"))),
                vec!["--set".into(), "model.vocab_size=320".into()],
            ]
            .concat(),
            path: at("tokenizer.json"),
        },
        Input {
            name: "data.source".into(),
            args: [
                set("data.source", format!("text:{}", s(at("shards")))),
                vec!["--set".into(), "model.vocab_size=320".into()],
            ]
            .concat(),
            path: at("shards"),
        },
        Input { name: "model.init_from".into(), args: set("model.init_from", s(step.clone())), path: step.clone() },
        Input { name: "checkpoint.dir".into(), args: set("checkpoint.dir", s(ck.clone())), path: ck.join(".lock") },
    ];
    let named: std::collections::BTreeSet<&str> = keys.iter().map(|k| k.name.as_str()).collect();
    assert_eq!(named, CONFIG_INPUTS.into(), "each config input has a fixture here");
    let cli = Cli::command();
    let mut tries = 0;
    for sub in cli.get_subcommands() {
        let name = sub.get_name();
        let has_config = sub.get_arguments().any(|a| a.get_long() == Some("config"));
        // the output flags, and where the command reads a config, the keys that name a folder
        // to write into (`commands::CONFIG_OUTPUTS`)
        let mut outputs: Vec<String> = sub
            .get_arguments()
            .filter(|a| a.get_help_heading() == Some(WRITES))
            .map(|a| format!("--{}", a.get_long().unwrap()))
            .collect();
        if has_config {
            outputs.extend(CONFIG_OUTPUTS.iter().map(|(key, _)| key.to_string()));
        }
        if outputs.is_empty() {
            continue;
        }
        let base: Vec<String> = match name {
            "converge" => vec!["converge".into(), "--variants".into(), "dp=2".into()],
            "tokenizer" => {
                ["tokenizer", "--vocab-size", "260", &format!("text:{}", s(at("d.txt")))].map(String::from).into()
            }
            other => vec![other.into()],
        };
        let mut inputs: Vec<Input> = Vec::new();
        if name == "tokenizer" {
            // its SOURCE, a text as data.source names one
            inputs.push(Input { name: "SOURCE".into(), args: Vec::new(), path: at("d.txt") });
        }
        for arg in sub.get_arguments().filter(|a| a.get_help_heading() == Some(READS)) {
            let flag = format!("--{}", arg.get_long().unwrap());
            let path =
                flag_fixture.get(flag.as_str()).unwrap_or_else(|| panic!("{name} {flag}: give it a fixture here"));
            inputs.push(Input { name: flag.clone(), args: vec![flag, s(path.clone())], path: path.clone() });
        }
        if has_config {
            inputs.extend(keys.iter().map(|k| Input {
                name: k.name.clone(),
                args: k.args.clone(),
                path: k.path.clone(),
            }));
        }
        for flag in &outputs {
            // a key is given as `--set KEY="PATH"`; the input named by that same key is not tried
            let as_args = |target: &Path| match flag.starts_with("--") {
                true => vec![flag.clone(), s(target.to_path_buf())],
                false => set(flag, s(target.to_path_buf())),
            };
            for input in inputs.iter().filter(|i| &i.name != flag) {
                // the input's own path, and (a folder) a file inside it and a path below a
                // folder not made yet inside it
                let mut targets = vec![input.path.clone()];
                // and the input by way of a folder not made yet (`new/..`), which the write would make
                let file = input.path.file_name().unwrap();
                targets.push(input.path.parent().unwrap().join("not-made-yet/..").join(file));
                if input.path.is_dir() {
                    targets.push(std::fs::read_dir(&input.path).unwrap().flatten().next().unwrap().path());
                    targets.push(input.path.join("new/../new/out"));
                }
                for target in targets {
                    let before = snapshot(&input.path);
                    let mut args = base.clone();
                    if sub.get_arguments().any(|a| a.get_long() == Some("set")) {
                        args.extend(small(&[]));
                    }
                    args.extend(input.args.iter().cloned());
                    args.extend(as_args(&target));
                    let out = run(&args, tmp.path());
                    let err = String::from_utf8_lossy(&out.stderr);
                    assert!(
                        !out.status.success(),
                        "{name} {flag} onto {} ({}) was accepted",
                        target.display(),
                        input.name
                    );
                    assert!(
                        err.contains(flag.as_str()) || err.contains("cannot be used with"),
                        "{name} {flag} onto {}: {err}",
                        input.name
                    );
                    assert!(!err.contains("panicked"), "{err}");
                    let after = snapshot(&input.path);
                    let changed: Vec<_> =
                        after.keys().chain(before.keys()).filter(|k| after.get(*k) != before.get(*k)).collect();
                    assert!(changed.is_empty(), "{name} {flag} onto {}: the input changed: {changed:?}", input.name);
                    tries += 1;
                }
            }
        }
    }
    assert!(tries >= 250, "{tries} tries");
}

/// An output claimed by a live run is refused to a second run even when the two use different
/// cache folders (the claim lies beside the output), and a lock file a live run holds (a
/// checkpoint folder's `.lock`) is no output of another run.
#[test]
fn a_live_runs_output_and_its_locks_are_refused_to_another_run() {
    let tmp = tempfile::tempdir().unwrap();
    let metrics = tmp.path().join("m.jsonl");
    let ck = tmp.path().join("ck");
    let long = small(&["train.steps=100000", "checkpoint.every=1000", &format!("checkpoint.dir=\"{}\"", ck.display())]);
    let mut first = Command::new(BIN)
        .args([&["train".into(), "--metrics".into(), metrics.display().to_string()][..], &long].concat())
        .env("FERROTRON_CACHE", tmp.path().join("cache-a"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 2 {
        assert!(start.elapsed().as_secs() < 120, "the first run never trained");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let second = |extra: &[String]| {
        Command::new(BIN)
            .args([&["train".to_string()][..], &small(&["train.steps=1"]), extra].concat())
            .env("FERROTRON_CACHE", tmp.path().join("cache-b"))
            .output()
            .unwrap()
    };
    let out = second(&["--metrics".into(), metrics.display().to_string()]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let lock = ck.join(".lock");
    let before = std::fs::read(&lock).unwrap();
    let out2 = second(&["--metrics".into(), lock.display().to_string()]);
    let err2 = String::from_utf8_lossy(&out2.stderr).to_string();
    first.kill().unwrap();
    first.wait().unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--metrics") && err.contains("being written by another live run"), "{err}");
    assert_eq!(out2.status.code(), Some(1), "{err2}");
    assert!(err2.contains("--metrics") && err2.contains("a lock file a live run holds"), "{err2}");
    assert_eq!(std::fs::read(&lock).unwrap(), before, "the lock's note is left alone");
}
