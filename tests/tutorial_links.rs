//! The lessons in `step_by_step/` point at code as "`src/file.rs:LINE` `name`" (or "`:LINE`
//! `name`" for another line of the same file). Every such reference in every lesson is checked:
//! the file and line exist, the line is code (not a comment, a blank or a lone brace), and the
//! name written right after it is on that line's code, as a word — so an edit that moves the
//! code shows up here, not in a reader's confusion. A reference must name what it points at.
//! (The steps themselves run as example tests.)
//!
//! Two more checks keep the prose honest: every file name quoted in the docs and in `src/`'s doc
//! comments names a file that exists, and no text of the repository points into the folder
//! beside the checkout that the sessions which built it shared, which a clone does not have.

use std::path::{Path, PathBuf};

/// One reference's verdict: `Ok` or what is wrong with it.
fn check(root: &Path, file: &str, line: usize, name: Option<&str>) -> Result<(), String> {
    let source = std::fs::read_to_string(root.join(file)).map_err(|_| format!("no file {file}"))?;
    let at = source.lines().nth(line.wrapping_sub(1)).ok_or(format!("{file} has no line {line}"))?;
    // the code of the line: a trailing `// comment` is not code
    let code = at.split_once("//").map_or(at, |(code, _)| code).trim();
    if code.chars().all(|c| "{}()[];,".contains(c)) {
        return Err(format!("{file}:{line} is not code (a comment, a blank or a brace): {at}"));
    }
    let Some(name) = name else {
        return Err(format!(
            "{file}:{line} names nothing: write the fn, struct or variable it points at right after it"
        ));
    };
    let word = name.rsplit("::").next().unwrap_or(name);
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let found = code.match_indices(word).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + word.len()..].chars().next();
        !before.is_some_and(is_word) && !after.is_some_and(is_word)
    });
    if !found {
        return Err(format!("{file}:{line} should hold `{name}` in its code, but it is: {at}"));
    }
    Ok(())
}

#[test]
fn lesson_line_references_point_at_their_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut lessons = vec![root.join("step_by_step/README.md")];
    for entry in std::fs::read_dir(root.join("step_by_step")).unwrap() {
        lessons.push(entry.unwrap().path().join("README.md"));
    }
    let (mut checked, mut wrong) = (0, Vec::new());
    for lesson in lessons {
        let Ok(text) = std::fs::read_to_string(&lesson) else { continue };
        // the code spans of the lesson, in order: `src/x.rs:12`, `name`, `:40`, `name`, …
        let spans: Vec<&str> = text.split('`').skip(1).step_by(2).collect();
        let mut file: Option<&str> = None;
        for (i, span) in spans.iter().enumerate() {
            let Some((f, line)) = span.split_once(':') else { continue };
            let Ok(line) = line.parse::<usize>() else { continue };
            if f.ends_with(".rs") || f.ends_with(".cu") {
                file = Some(f);
            } else if !f.is_empty() {
                continue;
            }
            let Some(f) = file else {
                wrong.push(format!("{}: `{span}` before any file", lesson.display()));
                continue;
            };
            // a name counts only when written right after the reference ("`:40` `name`")
            let rest = text.split(&format!("`{span}`")).nth(1).unwrap_or("");
            let is_reference = |n: &str| n.split_once(':').is_some_and(|(_, l)| l.parse::<usize>().is_ok());
            let name =
                spans.get(i + 1).filter(|n| rest.trim_start().starts_with(&format!("`{n}`")) && !is_reference(n));
            if let Err(e) = check(root, f, line, name.copied()) {
                wrong.push(format!("{}: {e}", lesson.display()));
            }
            checked += 1;
        }
    }
    assert!(wrong.is_empty(), "{} of {checked} references do not land:\n{}", wrong.len(), wrong.join("\n"));
    assert!(checked >= 100, "only {checked} references found");
}

/// The composition root opens with a table of every seam, "`Seam (src/file.rs:LINE)`", beside
/// the config key that picks each part: each reference must land on its seam's line, as a
/// lesson's does (`.ci/lesson_refs` moves these too).
#[test]
fn the_composition_roots_table_points_at_its_seams() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let compose = "src/train/compose.rs";
    let text = std::fs::read_to_string(root.join(compose)).unwrap();
    let (mut checked, mut wrong) = (0, Vec::new());
    for row in text.lines().take_while(|l| l.starts_with("//!")) {
        // "//! Seam (src/x.rs:12)   key → part   lesson"
        let Some((seam, rest)) = row.trim_start_matches("//!").trim().split_once(" (src/") else { continue };
        let Some((reference, _)) = rest.split_once(')') else { continue };
        let Some((file, line)) = reference.split_once(':') else { continue };
        let Ok(line) = line.parse::<usize>() else { continue };
        if let Err(e) = check(root, &format!("src/{file}"), line, Some(seam)) {
            wrong.push(format!("{compose}: {e}"));
        }
        checked += 1;
    }
    assert!(wrong.is_empty(), "{} of {checked} seams of the table do not land:\n{}", wrong.len(), wrong.join("\n"));
    assert!(checked >= 12, "only {checked} seams found in {compose}'s table");
}

/// The checker itself: it refuses a comment, a closing brace, a name only in a trailing comment,
/// a name that is only part of a word, and a reference that names nothing.
#[test]
fn the_checker_refuses_what_does_not_land() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("x.rs");
    std::fs::write(&file, "/// fn step\nfn step() {\n}\nlet steps = 1; // step\nlet x = step();\n").unwrap();
    let f = file.to_str().unwrap();
    assert!(check(root, f, 1, Some("step")).unwrap_err().contains("not code"));
    assert!(check(root, f, 3, Some("step")).unwrap_err().contains("not code"));
    assert!(check(root, f, 4, Some("step")).unwrap_err().contains("should hold `step`"));
    assert!(check(root, f, 2, None).unwrap_err().contains("names nothing"));
    assert!(check(root, f, 9, Some("step")).unwrap_err().contains("no line 9"));
    check(root, f, 2, Some("step")).unwrap();
    check(root, f, 5, Some("Llama::step")).unwrap();
}

/// Every file under `path` (or `path` itself, when it is a file), in order, but for build outputs
/// (`target/`) and git's own folder.
fn files_under(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_file() {
        out.push(path.to_path_buf());
        return;
    }
    let Ok(entries) = std::fs::read_dir(path) else { return };
    let mut entries: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for entry in entries {
        if entry.file_name().is_some_and(|n| n == "target" || n == ".git") {
            continue;
        }
        files_under(&entry, out);
    }
}

/// A path as the reports write it: from the repository's root.
fn shown(root: &Path, file: &Path) -> String {
    file.strip_prefix(root).unwrap_or(file).display().to_string()
}

/// Nothing in the repository may point into the folder beside the checkout (`..` then `/shared`)
/// that the sessions which built ferrotron shared: a user who clones the repository does not have
/// it. A figure from there is stated where it is used, or in BENCHMARKS.md, with its date and
/// source. (The needle is built from two pieces, so that this file does not trip its own check.)
#[test]
fn nothing_points_out_of_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let needle = concat!("..", "/shared");
    let places = [
        "README.md",
        "BENCHMARKS.md",
        "Cargo.toml",
        "build.rs",
        "docs",
        "step_by_step",
        "kernels",
        "src",
        "tests",
        "configs",
        "benches",
        ".ci",
    ];
    let mut files = Vec::new();
    for place in places {
        files_under(&root.join(place), &mut files);
    }
    let mut found = Vec::new();
    let mut read = 0;
    for file in &files {
        // text files only: one that is not UTF-8 is not prose
        let Ok(text) = std::fs::read_to_string(file) else { continue };
        read += 1;
        for (i, line) in text.lines().enumerate() {
            if line.contains(needle) {
                found.push(format!("{}:{}: {}", shown(root, file), i + 1, line.trim()));
            }
        }
    }
    assert!(read >= 100, "only {read} text files found under {places:?}");
    assert!(
        found.is_empty(),
        "{} lines point into {needle}, which a clone of the repository does not have; state the figure \
         in place or in BENCHMARKS.md, with its date and source:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// The extensions of the repository's files that prose quotes by name.
const QUOTED_EXTENSIONS: [&str; 7] = ["rs", "cu", "cuh", "toml", "md", "py", "json"];

/// The file a code span names, when the span looks like a path of the repository:
/// `folder/file.ext` (ext one of `QUOTED_EXTENSIONS`), perhaps followed by `:LINE` or
/// `:LINE-LINE`. Not a path of the repository, so `None`: a bare file name without a folder
/// (`llama.rs`: too ambiguous, it could be any folder's), a path under `target/` (a build output)
/// or starting with `/` or `~` (outside the repository), a span with any character but letters,
/// digits and `_-./` (a glob `*`, a placeholder `<name>` or `{a,b}`, an ellipsis `…`, a URL, a
/// command line), and a path through a placeholder folder written in capitals (`DIR/NAME.cu`,
/// `CACHE/calibration.json`).
fn quoted_path(span: &str) -> Option<&str> {
    let is_number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let path = match span.split_once(':') {
        Some((path, lines)) if lines.split('-').count() <= 2 && lines.split('-').all(is_number) => path,
        Some(_) => return None,
        None => span,
    };
    let (folders, file) = path.rsplit_once('/')?;
    let is_placeholder =
        |f: &str| f.bytes().any(|b| b.is_ascii_uppercase()) && f.bytes().all(|b| b.is_ascii_uppercase() || b == b'_');
    let extension = file.rsplit_once('.').map(|(_, e)| e);
    let usable = path.chars().all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c))
        && !path.starts_with('/')
        && !path.starts_with("target/")
        && !folders.split('/').any(is_placeholder)
        && extension.is_some_and(|e| QUOTED_EXTENSIONS.contains(&e));
    usable.then_some(path)
}

/// The code spans of some lines of prose, each with the number of the line it starts on: the text
/// between two backquotes of one paragraph. A blank line ends a paragraph (and a span left open:
/// a stray backquote), and the lines of a fenced block (between two lines of three backquotes)
/// are not prose.
fn code_spans<'a>(lines: impl IntoIterator<Item = (usize, &'a str)>) -> Vec<(usize, String)> {
    let mut spans = Vec::new();
    let (mut open, mut fenced): (Option<(usize, String)>, bool) = (None, false);
    for (number, line) in lines {
        let trimmed = line.trim();
        if trimmed.starts_with("```") {
            (fenced, open) = (!fenced, None);
            continue;
        }
        if fenced || trimmed.is_empty() {
            open = None;
            continue;
        }
        for (i, piece) in line.split('`').enumerate() {
            match (i, open.take()) {
                // the line goes on with the span the line before opened
                (0, Some((at, mut text))) => {
                    text.push('\n');
                    text.push_str(piece);
                    open = Some((at, text));
                }
                (0, None) => {}
                (_, Some(span)) => spans.push(span), // a backquote closes it; `piece` is prose
                (_, None) => open = Some((number, piece.to_string())),
            }
        }
    }
    spans
}

/// The file names quoted in `text` (the text of `file`: Markdown, or Rust, whose `//!` and `///`
/// doc comments are its prose) that name no file: each as `FILE:LINE names PATH, which does not
/// exist`. A path may be written from the repository's root, from `src/` (`model/block.rs`), from
/// `tests/`, from `step_by_step/` or from the folder of the file that quotes it. `checked` counts
/// the paths looked up.
fn missing_files(root: &Path, file: &Path, text: &str, checked: &mut usize) -> Vec<String> {
    let rust = file.extension().is_some_and(|e| e == "rs");
    let lines = text.lines().enumerate().map(|(i, line)| {
        let prose = if rust {
            let doc = line.trim_start();
            match doc.strip_prefix("///").or_else(|| doc.strip_prefix("//!")) {
                Some(rest) if !rest.starts_with('/') => rest,
                _ => "", // code, or a plain comment: not prose
            }
        } else {
            line
        };
        (i + 1, prose)
    });
    let here = file.parent().unwrap_or(root);
    let bases =
        [root.to_path_buf(), root.join("src"), root.join("tests"), root.join("step_by_step"), here.to_path_buf()];
    let mut missing = Vec::new();
    for (line, span) in code_spans(lines) {
        let Some(path) = quoted_path(&span) else { continue };
        *checked += 1;
        if !bases.iter().any(|base| base.join(path).exists()) {
            missing.push(format!("{}:{line} names {path}, which does not exist", shown(root, file)));
        }
    }
    missing
}

/// File names quoted in prose (the README, BENCHMARKS.md, `docs/`, the kernels' and the lessons'
/// READMEs, and the doc comments of `src/`) name files that exist: a file moved or renamed must
/// take its mentions along. A file of another repository is written without backquotes, as
/// BENCHMARKS.md's sources are. (`.ci/lesson_refs` is the tool that moves the lessons'
/// `file:line` references; this check only asks that the file be there.)
#[test]
fn file_names_quoted_in_prose_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut prose: Vec<PathBuf> = ["README.md", "BENCHMARKS.md", "kernels/README.md", "step_by_step/README.md"]
        .iter()
        .map(|f| root.join(f))
        .collect();
    let mut docs = Vec::new();
    files_under(&root.join("docs"), &mut docs);
    prose.extend(docs.into_iter().filter(|f| f.extension().is_some_and(|e| e == "md")));
    let mut lessons: Vec<PathBuf> = std::fs::read_dir(root.join("step_by_step"))
        .unwrap()
        .map(|e| e.unwrap().path().join("README.md"))
        .filter(|f| f.is_file())
        .collect();
    lessons.sort();
    prose.extend(lessons);
    let mut sources = Vec::new();
    files_under(&root.join("src"), &mut sources);
    prose.extend(sources.into_iter().filter(|f| f.extension().is_some_and(|e| e == "rs")));
    let (mut checked, mut missing) = (0, Vec::new());
    for file in &prose {
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        missing.extend(missing_files(root, file, &text, &mut checked));
    }
    assert!(
        missing.is_empty(),
        "{} of {checked} file names quoted in prose name no file:\n{}",
        missing.len(),
        missing.join("\n")
    );
    assert!(checked >= 500, "only {checked} quoted file names found");
}

/// The scanner itself: one planted stale name is caught, and what is not a path of the
/// repository (a bare name, a build output, a glob, a placeholder, a command, a fenced block, a
/// plain comment in Rust) is left alone.
#[test]
fn a_quoted_file_that_does_not_exist_is_caught() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lesson = root.join("step_by_step/planted/README.md");
    let text = "The crate is `src/lib.rs:1`, its commands `commands/mod.rs:3-9` and this test\n\
                `tests/tutorial_links.rs`; the block was in `src/model/nonexistent.rs`.\n\
                Skipped: `llama.rs`, `target/debug/x.rs`, `configs/*.toml`, `DIR/NAME.cu`,\n\
                `ferrotron train --config configs/none.toml`, `/etc/none.toml`, `src/<name>.rs`.\n\
                \n\
                ```text\n\
                src/gone.rs `src/gone.rs`\n\
                ```\n";
    let mut checked = 0;
    let missing = missing_files(root, &lesson, text, &mut checked);
    assert_eq!(
        missing,
        ["step_by_step/planted/README.md:2 names src/model/nonexistent.rs, which does not exist"],
        "the planted name should be the one miss"
    );
    assert_eq!(checked, 4, "four spans are paths of the repository");
    // in Rust, only doc comments are prose
    let source = root.join("src/planted.rs");
    let text = "/// See `model/nonexistent.rs`.\n// `model/gone.rs`\nlet s = \"`model/gone.rs`\";\n//! `src/lib.rs`\n";
    let mut checked = 0;
    let missing = missing_files(root, &source, text, &mut checked);
    assert_eq!(missing, ["src/planted.rs:1 names model/nonexistent.rs, which does not exist"]);
    assert_eq!(checked, 2);
}
