//! The lessons in `step_by_step/` point at code as "`src/file.rs:LINE` `name`": each such line
//! must still hold that name, so an edit that moves the code shows up here, not in a reader's
//! confusion. (The steps themselves run as example tests.)

use std::path::Path;

#[test]
fn lesson_line_references_point_at_their_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for entry in std::fs::read_dir(root.join("step_by_step")).unwrap() {
        let lesson = entry.unwrap().path().join("README.md");
        let Ok(text) = std::fs::read_to_string(&lesson) else { continue };
        // "`src/x.rs:123` `name`" (the name may be `Type::name`)
        for (i, _) in text.match_indices("`src/") {
            let rest = &text[i + 1..];
            let Some((reference, after)) = rest.split_once('`') else { continue };
            let Some((file, line)) = reference.split_once(':') else { continue };
            let Ok(line) = line.parse::<usize>() else { continue };
            let after = after.trim_start();
            let Some(name) = after.strip_prefix('`').and_then(|n| n.split_once('`')).map(|(n, _)| n) else { continue };
            let name = name.rsplit("::").next().unwrap();
            let source = std::fs::read_to_string(root.join(file))
                .unwrap_or_else(|_| panic!("{}: no file {file}", lesson.display()));
            let at = source.lines().nth(line - 1).unwrap_or("");
            assert!(at.contains(name), "{}: {file}:{line} should hold `{name}`, but it is: {at}", lesson.display());
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} references found");
}
