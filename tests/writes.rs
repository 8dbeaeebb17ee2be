//! Every place a run writes is declared (issue "Nothing lost, nothing hung, nothing read wrong —
//! by rule"): a file is written only where a flag of the CLI's table says the command writes
//! (`src/commands/cli.rs`, its `WRITES` heading: checked against every input before anything is
//! written, `tests/paths.rs`), or inside a folder the run owns and locks (`checkpoint.dir`,
//! `data.cache_dir`). The rule test reads every module of `src/` and `src/main.rs`, finds each
//! that writes a file (`write_atomically`, `File::create`, `fs::write`, an `OpenOptions` that
//! writes, `fs::rename`, `fs::copy`), and fails on one that `WRITERS` does not list with what
//! declares its place; each listed flag must be a `WRITES` flag of the table. A planted writer
//! must fail it.

#[path = "support/syllabus.rs"]
mod syllabus;

use clap::CommandFactory;
use ferrotron::commands::cli::{Cli, WRITES};

/// The ways to write a file by its path.
const WRITES_BY: [&str; 6] =
    ["write_atomically(", "File::create(", "fs::write(", ".write(true)", "fs::rename(", "fs::copy("];

/// Every module that writes, with what declares where: the `WRITES` flags it serves, or the
/// folder a run owns (`checkpoint.dir`, `data.cache_dir`). `files` is the door itself.
const WRITERS: &[(&str, &[&str])] = &[
    ("files", &[]),
    ("main", &["--out", "--json"]),
    ("commands::train", &["--plot"]),
    ("commands::converge", &["--out"]),
    ("comm::trace", &["--trace"]),
    ("train::metrics", &["--metrics"]),
    ("model::routing_tape", &["--record-routing"]),
    ("checkpoint::save", &["checkpoint.dir"]),
    ("checkpoint::folder", &["checkpoint.dir"]),
    ("data::text", &["data.cache_dir"]),
    ("devices", &["data.cache_dir"]),
    ("commands::tokenizer", &["--out"]),
];

/// The folders a run owns: locked while it writes them (`checkpoint/folder.rs`) or named by the
/// content they hold (`data/text.rs`'s token files), never given as an output flag.
const OWNED: [&str; 2] = ["checkpoint.dir", "data.cache_dir"];

/// Every module of `sources` that writes a file and is not in `WRITERS`, as `module: line N`.
fn undeclared(sources: &[(String, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (module, text) in sources.iter().filter(|(m, _)| !WRITERS.iter().any(|(w, _)| w == m)) {
        for (i, line) in syllabus::code(text).lines().enumerate() {
            if WRITES_BY.iter().any(|w| line.contains(w)) {
                found.push(format!("{module}: line {}: {}", i + 1, line.trim()));
            }
        }
    }
    found
}

fn all_sources() -> Vec<(String, String)> {
    let mut sources: Vec<(String, String)> = syllabus::sources().into_iter().collect();
    let main = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/main.rs");
    sources.push(("main".into(), std::fs::read_to_string(main).unwrap()));
    sources
}

#[test]
fn every_write_is_to_a_declared_place() {
    let sources = all_sources();
    assert!(sources.len() > 100, "the walk found the modules of src/");
    let found = undeclared(&sources);
    assert!(
        found.is_empty(),
        "files written where no flag of the CLI's table (WRITES) nor an owned folder declares it; declare the output, then list the module in WRITERS:\n{}",
        found.join("\n")
    );
    // each listed module still writes (a stale entry would let a new writer hide), and each
    // place it names is a WRITES flag of some command, or an owned folder
    let flags: Vec<String> = Cli::command()
        .get_subcommands()
        .flat_map(|s| {
            s.get_arguments()
                .filter(|a| a.get_help_heading() == Some(WRITES))
                .map(|a| format!("--{}", a.get_long().unwrap()))
                .collect::<Vec<_>>()
        })
        .collect();
    for (module, places) in WRITERS {
        let text = &sources.iter().find(|(m, _)| m == module).unwrap_or_else(|| panic!("{module} is no module")).1;
        assert!(
            WRITES_BY.iter().any(|w| syllabus::code(text).contains(w)),
            "{module} no longer writes: drop it from WRITERS"
        );
        for place in *places {
            assert!(
                flags.iter().any(|f| f == place) || OWNED.contains(place),
                "{module}: {place} is no WRITES flag nor owned folder"
            );
        }
    }
}

#[test]
fn a_planted_writer_is_found() {
    let planted = |code: &str| vec![("commands::report".to_string(), format!("fn f(p: &Path) {{\n    {code}\n}}"))];
    for code in [
        "crate::files::write_atomically(p, b\"x\")?;",
        "let f = std::fs::File::create(p)?;",
        "std::fs::write(p, b\"x\")?;",
        "let f = std::fs::OpenOptions::new().write(true).open(p)?;",
        "std::fs::rename(p, q)?;",
        "std::fs::copy(p, q)?;",
    ] {
        assert_eq!(undeclared(&planted(code)).len(), 1, "{code} writes");
    }
    assert!(undeclared(&planted("let t = crate::files::read_text(p, \"--x\")?; // not fs::write(p)")).is_empty());
}
