//! The lessons in `step_by_step/` point at code as "`src/file.rs:LINE` `name`" (or "`:LINE`
//! `name`" for another line of the same file). Every such reference in every lesson is checked:
//! the file and line exist, the line is code (not a comment, a blank or a lone brace), and the
//! name written right after it is on that line's code, as a word — so an edit that moves the
//! code shows up here, not in a reader's confusion. A reference must name what it points at.
//! (The steps themselves run as example tests.)

use std::path::Path;

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
