//! What the documents say a CPU run prints, checked against the run (`README.md`, `docs/*.md`,
//! the lessons):
//!
//! - a quoted output marked `<!-- checked: ARGS -->` (on the line before its ```text fence) is
//!   run as `ferrotron ARGS` in a scratch folder, and every line of the quote must be a line the
//!   run printed, word for word — but for the words `; varies: -2` names (counted from the end
//!   of each line: the 2nd from the end is a timing there). A `$ …` line and a `…` line are
//!   left out;
//! - every command an exercise gives (`ferrotron …` or `cargo run --release -- …` in a lesson's
//!   Exercises) runs and exits 0, the commands of a lesson in order, in one scratch folder;
//! - the counts the documents write (config sections; the pipeline schedules each command lists)
//!   are the code's;
//! - the README's first runs, "What you will see" and "After the first run": the header, the
//!   step-320 loss and rate, the final and held-out losses, and every `generate` quoted on the
//!   checkpoint that run saves, are what the default run and its commands print.
//!
//! A planted drift fails each (`tests/documents.rs`'s own test of the checker).

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ferrotron");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The documents: the README, docs/*.md and the lessons.
fn documents() -> Vec<String> {
    let mut docs = vec!["README.md".to_string()];
    for dir in ["docs", "step_by_step"] {
        let mut found: Vec<PathBuf> =
            std::fs::read_dir(root().join(dir)).unwrap().flatten().map(|e| e.path()).collect();
        found.sort();
        for p in found {
            let file = if p.is_dir() { p.join("README.md") } else { p };
            if file.extension().is_some_and(|e| e == "md") && file.is_file() {
                docs.push(file.strip_prefix(root()).unwrap().display().to_string());
            }
        }
    }
    docs
}

/// A command line split as a shell splits it: quotes group, a backslash escapes.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut word, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut word));
                }
                any = false;
            }
            (None, '\'' | '"') => (quote, any) = (Some(c), true),
            (Some(q), c) if c == q => quote = None,
            (None, '\\') | (Some('"'), '\\') => {
                word.extend(chars.next());
                any = true;
            }
            (_, c) => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(word);
    }
    out
}

/// A scratch folder to run in, with the repository's fixtures reachable as `tests/fixtures`.
fn scratch() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tests")).unwrap();
    std::os::unix::fs::symlink(root().join("tests/fixtures"), dir.path().join("tests/fixtures")).unwrap();
    dir
}

fn run(args: &[String], cwd: &Path) -> (bool, String) {
    let out = Command::new(BIN).args(args).current_dir(cwd).env("FERROTRON_CACHE", cwd.join("cache")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A quoted output and how to make it.
struct Quote {
    at: String,
    args: Vec<String>,
    /// Words left out of the comparison, counted from each line's end (1: the last).
    varies: Vec<usize>,
    lines: Vec<String>,
}

/// The `<!-- checked: … -->` quotes of `text` (a document named `name`).
fn quotes(name: &str, text: &str) -> Vec<Quote> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(spec) = line.trim().strip_prefix("<!-- checked: ").and_then(|s| s.strip_suffix(" -->")) else {
            continue;
        };
        let (args, varies) = match spec.split_once("; varies: ") {
            Some((a, v)) => (a, v.split(',').map(|n| n.trim().trim_start_matches('-').parse().unwrap()).collect()),
            None => (spec, Vec::new()),
        };
        assert!(
            lines.get(i + 1).is_some_and(|l| l.trim() == "```text"),
            "{name}:{}: a checked quote opens with ```text",
            i + 2
        );
        let body = lines[i + 2..].iter().take_while(|l| l.trim() != "```");
        let quoted = body.map(|l| l.trim().to_string()).filter(|l| !l.is_empty() && l != "…" && !l.starts_with("$ "));
        found.push(Quote { at: format!("{name}:{}", i + 1), args: words(args), varies, lines: quoted.collect() });
    }
    found
}

/// Each quoted line that the output has no line for, word for word but the varying words.
fn unmatched(q: &Quote, output: &str) -> Vec<String> {
    let mask = |l: &str| {
        let mut w: Vec<&str> = l.split_whitespace().collect();
        let n = w.len();
        for &k in &q.varies {
            if k >= 1 && k <= n {
                w[n - k] = "*";
            }
        }
        w.join(" ")
    };
    let printed: Vec<String> = output.lines().map(mask).collect();
    q.lines.iter().filter(|l| !printed.contains(&mask(l))).cloned().collect()
}

#[test]
fn every_checked_quote_is_what_its_command_prints() {
    let mut checked = 0;
    let mut problems = Vec::new();
    for doc in documents() {
        for q in quotes(&doc, &read(&doc)) {
            let dir = scratch();
            let (ok, output) = run(&q.args, dir.path());
            let missing = unmatched(&q, &output);
            if !ok || !missing.is_empty() {
                problems.push(format!(
                    "{}: `ferrotron {}` printed\n{output}\nbut the document quotes\n{}",
                    q.at,
                    q.args.join(" "),
                    missing.join("\n")
                ));
            }
            checked += 1;
        }
    }
    assert!(checked >= 5, "{checked} quotes");
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// The commands a lesson's exercises give, in order: inline code that starts with `ferrotron ` or
/// `cargo run --release -- `, across line breaks.
fn exercise_commands(text: &str) -> Vec<Vec<String>> {
    let text = format!("\n{text}");
    let Some(start) = text.find("\n## Exercises") else { return Vec::new() };
    let rest = &text[start + 1..];
    let section = &rest[..rest[3..].find("\n## ").map_or(rest.len(), |e| e + 3)];
    let joined: String = section.split('\n').map(str::trim).collect::<Vec<_>>().join(" ");
    let mut found = Vec::new();
    for (i, span) in joined.split('`').enumerate() {
        if i % 2 == 0 {
            continue; // outside code
        }
        let args = span.strip_prefix("ferrotron ").or_else(|| span.strip_prefix("cargo run --release -- "));
        found.extend(args.map(words));
    }
    found
}

#[test]
fn every_exercise_command_runs() {
    let mut ran = 0;
    let mut problems = Vec::new();
    for doc in documents().iter().filter(|d| d.starts_with("step_by_step/")) {
        let dir = scratch();
        for args in exercise_commands(&read(doc)) {
            let start = std::time::Instant::now();
            let (ok, output) = run(&args, dir.path());
            let took = start.elapsed().as_secs_f64();
            if !ok {
                problems.push(format!("{doc}: `ferrotron {}` failed:\n{output}", args.join(" ")));
            } else if took > 60.0 {
                problems.push(format!(
                    "{doc}: `ferrotron {}` took {took:.0} s: an exercise should run in a minute",
                    args.join(" ")
                ));
            }
            ran += 1;
        }
    }
    assert!(ran >= 15, "{ran} exercise commands");
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// The checker fails on planted drift: a quoted number off by one digit, a command that fails,
/// an exercise command that does not exist.
#[test]
fn the_checks_catch_a_planted_drift() {
    let doc = "<!-- checked: schedule --pp 2 --microbatches 2 --schedule 1f1b -->\n```text\n1F1B: 2 rows, m=2: bubble 33.3% of the step (formula 33.3%), peak micro-batch activations per row 2.00 1.00\n```\n";
    let dir = scratch();
    let q = &quotes("planted", doc)[0];
    let (ok, out) = run(&q.args, dir.path());
    assert!(ok && unmatched(q, &out).is_empty(), "the true quote passes: {out}");
    let drifted = doc.replace("33.3% of", "33.4% of");
    assert_eq!(unmatched(&quotes("planted", &drifted)[0], &out).len(), 1, "one digit off is caught");
    let varying = "<!-- checked: x; varies: -2 -->\n```text\na b 1.5 c\n```\n";
    assert_eq!(unmatched(&quotes("v", varying)[0], "a b 9.9 c\n").len(), 0, "the varying word is left out");
    assert_eq!(unmatched(&quotes("v", varying)[0], "a x 1.5 c\n").len(), 1, "but only it");
    let exercise =
        "## Exercises\n\n1. Run `ferrotron schedule\n   --pp 3` and `cargo run --release -- no-such-command`.\n";
    let commands = exercise_commands(exercise);
    assert_eq!(commands, [words("schedule --pp 3"), words("no-such-command")]);
    assert!(!run(&commands[1], dir.path()).0, "a command that does not exist fails");
    assert_eq!(words(r#"--set a=\"x\" 'b c' "d e""#), ["--set", "a=\"x\"", "b c", "d e"]);
}

/// The counts the documents write are the code's: the config's sections, and every pipeline
/// schedule in `schedule`'s help and in docs/cli.md's usage line.
#[test]
fn the_documents_counts_are_the_codes() {
    let cfg = ferrotron::config::Config::load(None, &[]).unwrap();
    let sections = toml::Table::try_from(&cfg).unwrap().len();
    let word = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"][sections];
    assert!(
        read("docs/config.md").contains(&format!("A config has {word} sections")),
        "docs/config.md: {sections} sections"
    );
    assert!(read("README.md").contains(&format!("the {word} config sections")), "README.md: {sections} sections");
    assert!(
        read("src/config.rs").contains(&format!("one TOML file, {word} sections")),
        "src/config.rs: {sections} sections"
    );
    // the schedules: every word parallel.pp_schedule takes
    let e = ferrotron::config::Config::load(None, &["parallel.pp_schedule=\"?\"".into()]).err().unwrap();
    let e = format!("{e:#}");
    let names: Vec<&str> = e[e.find("expected").unwrap()..].split('`').skip(1).step_by(2).collect();
    assert!(names.len() >= 5, "{e}");
    let help = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout).to_lowercase();
    let usage = read("docs/cli.md");
    for name in names {
        assert!(help.contains(name), "ferrotron --help's schedule line does not name {name}");
        assert!(
            usage.contains(&format!("|{name}")) || usage.contains(&format!("{name}|")),
            "docs/cli.md's usage line does not name {name}"
        );
    }
}

/// The `generate` quotes on the tiny model (`$ ferrotron generate --model tiny/step_000400 …` in
/// a text block, or a `cargo run --release -- generate --model tiny/…` block followed by a
/// console block), with the lines each quotes (a speed line left out).
fn generate_quotes(name: &str, text: &str) -> Vec<(String, Vec<String>, Vec<String>)> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let (args, out_from) = if let Some(a) = line.strip_prefix("$ ferrotron generate --model tiny/") {
            (format!("generate --model tiny/{a}"), i + 1)
        } else if let Some(a) = line.strip_prefix("cargo run --release -- generate --model tiny/") {
            match (lines.get(i + 1), lines.get(i + 2)) {
                (Some(&"```"), Some(&"```console")) => (format!("generate --model tiny/{a}"), i + 3),
                _ => continue, // a command without its output
            }
        } else {
            continue;
        };
        let quoted = lines[out_from..].iter().take_while(|l| **l != "```").filter(|l| !l.contains("tokens/s"));
        found.push((format!("{name}:{}", i + 1), words(&args), quoted.map(|l| l.to_string()).collect()));
    }
    found
}

/// README.md's first run and the run after it: "What you will see" (the default run's header,
/// its line at step 320, its final loss, floor and gap) and "After the first run" (its first
/// command, run as written: the held-out loss at step 400 it quotes), then every quoted
/// `generate` on the checkpoint that command saves (docs/cli.md, step 01). Rates, times and the
/// machine's available memory are one machine's, and left out.
#[test]
fn the_readmes_first_runs_are_what_the_default_run_prints() {
    let readme = read("README.md");
    let section = |title: &str| {
        let s = &readme[readme.find(title).unwrap()..];
        s[..s[3..].find("\n## ").unwrap() + 3].to_string()
    };
    let seen = section("## What you will see");
    let block = &seen[seen.find("```text\n").unwrap() + 8..];
    let quoted: Vec<&str> = block[..block.find("```").unwrap()].lines().collect();
    // the command of "After the first run", as written (its lines joined)
    let after = section("## After the first run");
    let sh = &after[after.find("```sh\n").unwrap() + 6..];
    let joined = sh[..sh.find("```").unwrap()].replace("\\\n", " ");
    let first = joined.lines().find(|l| l.starts_with("cargo run --release -- train")).unwrap();
    let dir = scratch();
    let (ok, out) = run(&words(first.strip_prefix("cargo run --release -- ").unwrap()), dir.path());
    assert!(ok, "{first}: {out}");
    let printed = |prefix: &str| {
        out.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no `{prefix}` line:\n{out}"))
    };
    assert_eq!(quoted[0], printed("model:"), "the header");
    assert_eq!(quoted[2], printed("data:"), "the data line");
    let upto = |l: &str, word: &str| l[..l.find(word).unwrap()].to_string();
    assert_eq!(upto(quoted[1], " of the "), upto(printed("memory:"), " of the "), "the memory estimate");
    // the bar's 320/400 against the plain line of step 320: its loss and learning rate
    let at = |s: &str, key: &str| {
        s.split(" | ").find_map(|p| p.rsplit_once(key).map(|(_, v)| v.split(' ').next().unwrap().to_string()))
    };
    let step = printed("step   320 |");
    for key in ["loss ", "lr "] {
        assert_eq!(at(quoted[3], key), at(step, key), "{key}at step 320");
    }
    let done = printed("done:");
    for part in ["final loss", "entropy floor"] {
        let q = quoted[4].split(" | ").find(|p| p.starts_with(part)).unwrap();
        assert!(done.split(" | ").any(|p| p == q), "{q} against {done}");
    }
    // "step 400 | loss 1.1953 | … | val loss 1.1912": the held-out loss after the last step
    let flat = after.split_whitespace().collect::<Vec<_>>().join(" ");
    let line = &flat[flat.find("`step 400 | ").unwrap() + 1..];
    let line = &line[..line.find('`').unwrap()];
    let (loss, val) = (at(line, "loss ").unwrap(), at(line, "val loss ").unwrap());
    let last = printed("step   400 |");
    assert_eq!((at(last, "loss "), at(last, "val loss ")), (Some(loss), Some(val)), "{last}");
    // every quoted generate on its checkpoint
    let mut quotes = 0;
    for doc in documents() {
        for (at, args, lines) in generate_quotes(&doc, &read(&doc)) {
            let (ok, out) = run(&args, dir.path());
            let said: Vec<&str> = out.lines().map(str::trim).collect();
            let missing: Vec<&String> = lines.iter().filter(|l| !said.contains(&l.as_str())).collect();
            assert!(ok && missing.is_empty(), "{at}: `ferrotron {}` printed\n{out}\nnot {missing:?}", args.join(" "));
            quotes += 1;
        }
    }
    assert!(quotes >= 2, "{quotes} generate quotes");
}
