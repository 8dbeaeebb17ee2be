//! The lessons in `step_by_step/` point at code as "`src/file.rs:LINE` `name`" (or "`:LINE`
//! `name`" for another line of the same file): each such line must still hold that name, so an
//! edit that moves the code shows up here, not in a reader's confusion. (The steps themselves
//! run as example tests.)

use std::path::Path;

#[test]
fn lesson_line_references_point_at_their_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for entry in std::fs::read_dir(root.join("step_by_step")).unwrap() {
        let lesson = entry.unwrap().path().join("README.md");
        let Ok(text) = std::fs::read_to_string(&lesson) else { continue };
        // the code spans of the lesson, in order: `src/x.rs:12`, `:40`, `name`, …
        let spans: Vec<&str> = text.split('`').skip(1).step_by(2).collect();
        let mut file: Option<&str> = None;
        for (i, span) in spans.iter().enumerate() {
            let (f, line) = match span.split_once(':') {
                Some((f, l)) if f.starts_with("src/") => (Some(f), l),
                Some(("", l)) => (file, l),
                _ => continue,
            };
            file = f.or(file);
            let (Some(f), Ok(line)) = (f, line.parse::<usize>()) else { continue };
            let Some(name) = spans.get(i + 1).filter(|n| !n.contains(':') && !n.contains(' ')) else { continue };
            // only a name written right after the reference counts ("`:40` `name`")
            let between = text.split(&format!("`{span}`")).nth(1).unwrap_or("");
            if !between.trim_start().starts_with(&format!("`{name}`")) {
                continue;
            }
            let name = name.rsplit("::").next().unwrap();
            let source =
                std::fs::read_to_string(root.join(f)).unwrap_or_else(|_| panic!("{}: no file {f}", lesson.display()));
            let at = source.lines().nth(line - 1).unwrap_or("");
            assert!(at.contains(name), "{}: {f}:{line} should hold `{name}`, but it is: {at}", lesson.display());
            checked += 1;
        }
    }
    assert!(checked >= 20, "only {checked} references found");
}
