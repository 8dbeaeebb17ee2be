//! The syllabus holds (`step_by_step/syllabus.toml`): every file of `src/` and `kernels/` is in
//! one lesson or one track; the lessons are the tutorial's steps, in its order, and the tutorial's
//! index, the README's reading guide and `src/lib.rs` say the same; and no file of a lesson uses a
//! later lesson — imports it or names a path into it, names one of its enum variants, its fields
//! of a shared type or its config keys (`names`) — but where its `owes` lists that lesson, a
//! move still to be made, or its `calls` does (the step, which calls each lesson's seam by
//! design). A listed debt that is paid must leave the list, so it only shrinks. The check also
//! runs on one planted violation of each kind, and must catch each.

#[path = "support/syllabus.rs"]
mod syllabus;

use std::collections::{BTreeMap, BTreeSet};
use syllabus::{code, inline_children, module_of, reexported, referenced, root, sources, table, target, Table};

/// Whether `code` names `name` as a whole: `Precision::Fp8` not followed by a letter, `.precision` not
/// followed by one (a field or config key, not `.gemm_out`), `ZeroPartition` as a word.
fn names(code: &str, name: &str) -> bool {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices(name).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + name.len()..].chars().next();
        (name.starts_with('.') || !before.is_some_and(is_word)) && !after.is_some_and(is_word)
    })
}

/// Every use of a later lesson by a lesson's file, as (file, later lesson's step) → what it uses.
fn later_uses(table: &Table, sources: &BTreeMap<String, String>) -> BTreeMap<(String, String), String> {
    let lesson_of: BTreeMap<String, usize> =
        table.entries().into_iter().filter_map(|(e, l)| Some((module_of(&e.path)?, l?))).collect();
    let path_of: BTreeMap<String, &str> =
        table.entries().into_iter().filter_map(|(e, _)| Some((module_of(&e.path)?, e.path.as_str()))).collect();
    // an item named through a module that re-exports it is the re-exported item:
    // `model::Placement` was `comm::placement::Placement`
    let reexports: BTreeMap<String, String> = sources
        .iter()
        .flat_map(|(m, text)| reexported(m, text).into_iter().map(move |p| (format!("{m}::{}", last(&p)), p)))
        .collect();
    let module = |p: &str| target(p, |p| sources.get_key_value(p).map(|(k, _)| k));
    let resolve = |mut path: String| {
        for _ in 0..8 {
            let Some(t) = module(&path) else { break };
            let rest = path.strip_prefix(t.as_str()).unwrap_or("").trim_start_matches("::");
            let (name, after) = rest.split_once("::").unwrap_or((rest, ""));
            let Some(to) = reexports.get(&format!("{t}::{name}")) else { break };
            path = if after.is_empty() { to.clone() } else { format!("{to}::{after}") };
        }
        module(&path)
    };
    let mut found = BTreeMap::new();
    for (m, text) in sources {
        let Some(&a) = lesson_of.get(m) else { continue }; // a track, or a file the table lacks
        let file = path_of[m].to_string();
        let mut note = |b: usize, what: String| {
            found.entry((file.clone(), table.lesson[b].step.clone())).or_insert(what);
        };
        for path in referenced(m, text).into_iter().chain(inline_children(m, text)) {
            let Some(t) = resolve(path) else { continue };
            if let Some(&b) = lesson_of.get(t).filter(|&&b| b > a) {
                note(b, format!("uses {}", path_of[t]));
            }
        }
        let code = code(text);
        for (b, lesson) in table.lesson.iter().enumerate().skip(a + 1) {
            for name in lesson.names.iter().filter(|n| names(&code, n)) {
                note(b, format!("names {name}"));
            }
        }
    }
    found
}

/// The last segment of a path: the item it names.
fn last(path: &str) -> &str {
    path.rsplit("::").next().unwrap_or(path)
}

/// What the table's `owes` and `calls` and the code disagree on, as sentences.
fn debts_disagree(table: &Table, sources: &BTreeMap<String, String>) -> Vec<String> {
    let found = later_uses(table, sources);
    let pairs = |list: &BTreeMap<String, Vec<String>>| -> BTreeSet<(String, String)> {
        list.iter().flat_map(|(file, steps)| steps.iter().map(|s| (file.clone(), s.clone()))).collect()
    };
    let (owed, called) = (pairs(&table.owes), pairs(&table.calls));
    let mut problems = Vec::new();
    for ((file, step), what) in &found {
        let pair = (file.clone(), step.clone());
        if !owed.contains(&pair) && !called.contains(&pair) {
            problems.push(format!(
                "{file} {what}, of the later lesson {step}: move it into that lesson's files (or a seam it plugs into)"
            ));
        }
    }
    for (list, pairs) in [("owes", &owed), ("calls", &called)] {
        for (file, step) in pairs.iter().filter(|d| !found.contains_key(*d)) {
            problems.push(format!("{file} no longer uses lesson {step}: take \"{step}\" off its `{list}`"));
        }
    }
    problems
}

#[test]
fn no_lesson_uses_a_later_one_but_its_listed_debts() {
    let problems = debts_disagree(&table(), &sources());
    assert!(problems.is_empty(), "the syllabus order is broken:\n{}", problems.join("\n"));
}

#[test]
fn the_check_catches_a_planted_use_of_each_kind() {
    let table = table();
    let plant = |module: &str, line: &str, expect: &str| {
        let mut planted = sources();
        planted.get_mut(module).unwrap().push_str(line);
        let problems = debts_disagree(&table, &planted);
        assert!(problems.iter().any(|p| p.contains(expect)), "planted in {module}: {line}\n{problems:#?}");
    };
    // an import of a later lesson's file: the CPU math of lesson 01 reaching for ZeRO (06)
    plant(
        "ops::cpu_math",
        "\nuse crate::parallel::zero::Sharding;\n",
        "uses src/parallel/zero.rs, of the later lesson 06_zero",
    );
    // a path into one, inline
    plant("comm::local", "\nfn f(_: crate::comm::placement::Placement) {}\n", "of the later lesson 11_placements");
    // a later lesson's enum variant: FP8's precision in the ranks lesson
    plant(
        "comm::tensors",
        "\nconst A: Precision = Precision::Fp8;\n",
        "names Precision::Fp8, of the later lesson 21_fp8",
    );
    // a later lesson's cut of the grid: the experts' axis in the ranks lesson
    plant(
        "comm::tensors",
        "\nfn f(me: &Rank) -> usize { me.group(EP).size() }\n",
        "names EP, of the later lesson 20_experts",
    );
    // a path into a child module of its own, inline: placements (11) in the ranks lesson's comm/mod.rs
    plant(
        "comm",
        "\nfn f() -> placement::Placement { placement::Placement::Replicate }\n",
        "uses src/comm/placement.rs, of the later lesson 11_placements",
    );
    // a later lesson's field of a shared type: the experts' (20) in the model's init (01)
    plant(
        "model::init",
        "\nfn f(c: &ModelConfig) -> bool { c.num_local_experts > 0 }\n",
        "names .num_local_experts, of the later lesson 20_experts",
    );
    // a later lesson's method planted back into lesson 01's model: zero bubble's W (15), the
    // pipeline's stage entry point (12), the experts' MLP swap (20), the ring's merge (16)
    plant(
        "model::llama",
        "\nfn f(m: &mut Llama) { m.backward_weights(0, &mut |_| {}).ok(); }\n",
        "names backward_weights, of the later lesson 15_zero_bubble",
    );
    plant(
        "model::block",
        "\nfn f(m: &mut Llama, t: &[u32]) { m.forward_chunk(0, t, 1, &[]).ok(); }\n",
        "names forward_chunk, of the later lesson 12_pipeline_afab",
    );
    plant(
        "model::llama::parts",
        "\nimpl Block<'_> { fn with_mlp(self) -> Self { self } }\n",
        "names with_mlp, of the later lesson 20_experts",
    );
    plant(
        "ops",
        "\npub fn merge(a: Attn, o: &mut Tensor) { attention_merge(a, o) }\n",
        "names attention_merge, of the later lesson 16_context_parallel",
    );
    // a later lesson's config key: hybrid sharding's (08) in ZeRO (06)
    plant(
        "parallel::zero",
        "\nfn f(p: &ParallelConfig) -> usize { p.dp_shard }\n",
        "names .dp_shard, of the later lesson 08_hsdp",
    );
}

#[test]
fn the_check_follows_a_re_export() {
    // ZeRO's (06) `Sharding` re-exported by `parallel/mod.rs` (01) and imported from there by the
    // CPU math (01): the import is of zero.rs all the same
    let mut planted = sources();
    planted.get_mut("parallel").unwrap().push_str("\npub use zero::Sharding;\n");
    planted.get_mut("ops::cpu_math").unwrap().push_str("\nuse crate::parallel::Sharding;\n");
    let problems = debts_disagree(&table(), &planted);
    let caught = "src/ops/cpu_math.rs uses src/parallel/zero.rs, of the later lesson 06_zero";
    assert!(problems.iter().any(|p| p.contains(caught)), "{problems:#?}");
}

#[test]
fn every_file_is_in_one_lesson_or_track_and_the_lessons_are_the_tutorial() {
    let table = table();
    let mut listed = BTreeMap::new();
    let mut problems = Vec::new();
    for (e, _) in table.entries() {
        if listed.insert(e.path.clone(), ()).is_some() {
            problems.push(format!("{} is listed twice", e.path));
        }
        if !root().join(&e.path).is_file() {
            problems.push(format!("{} is listed but is not a file", e.path));
        }
        if !table.layers.contains(&e.layer) {
            problems.push(format!("{}: layer {:?} is not in `layers`", e.path, e.layer));
        }
    }
    for dir in ["src", "kernels"] {
        let mut stack = vec![root().join(dir)];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                let rel = path.strip_prefix(root()).unwrap().to_str().unwrap().to_string();
                match path.is_dir() {
                    true => stack.push(path),
                    false if rel == "src/lib.rs" || rel == "src/main.rs" => {}
                    false if !listed.contains_key(&rel) => problems.push(format!("{rel} is in no lesson or track")),
                    false => {}
                }
            }
        }
    }
    // the lessons are the step folders, in order
    let mut steps: Vec<String> = (std::fs::read_dir(root().join("step_by_step")).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    steps.sort();
    let lessons: Vec<String> = table.lesson.iter().map(|l| l.step.clone()).collect();
    if lessons != steps {
        problems.push(format!("the lessons {lessons:?} are not the tutorial's steps {steps:?}"));
    }
    for (name, list) in [("owes", &table.owes), ("calls", &table.calls)] {
        for (file, steps) in list {
            if !listed.contains_key(file) {
                problems.push(format!("`{name}` names {file}, which the table does not list"));
            }
            problems.extend(
                steps.iter().filter(|s| !lessons.contains(s)).map(|s| format!("`{name}` names {s}, no lesson")),
            );
        }
    }
    if let Some(both) = table.owes.keys().find(|f| table.calls.contains_key(*f)) {
        problems.push(format!("{both} is in both `owes` and `calls`: a file's later uses are one or the other"));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_index_the_reading_guide_and_lib_rs_agree_with_the_table() {
    let table = table();
    let read = |p: &str| std::fs::read_to_string(root().join(p)).unwrap();
    let mut problems = Vec::new();
    // the tutorial's index lists the lessons in the table's order: `| [01](01_one_device/) | …`
    let index = read("step_by_step/README.md");
    let rows: Vec<&str> = (index.lines())
        .filter_map(|l| l.strip_prefix("| [")?.split_once("](")?.1.split_once("/)").map(|(d, _)| d))
        .collect();
    let lessons: Vec<&str> = table.lesson.iter().map(|l| l.step.as_str()).collect();
    if rows != lessons {
        problems.push(format!("step_by_step/README.md's index lists {rows:?}, the table {lessons:?}"));
    }
    // each lesson names the files it adds, and the README's reading guide names every lesson's file
    // but a folder's index (`mod.rs`)
    let readme = read("README.md");
    for lesson in &table.lesson {
        let text = read(&format!("step_by_step/{}/README.md", lesson.step));
        for e in &lesson.files {
            if !text.contains(&e.path) {
                problems.push(format!("step_by_step/{}/README.md does not name its file {}", lesson.step, e.path));
            }
            if !e.path.ends_with("/mod.rs") && !readme.contains(&e.path) {
                problems.push(format!("README.md's reading guide does not name {} (lesson {})", e.path, lesson.step));
            }
        }
    }
    // lib.rs gives the folders' order: the order in which the table's layers reach them
    let mut folders: Vec<&str> = Vec::new();
    for layer in table.layers.iter().skip(1) {
        for (e, _) in table.entries().into_iter().filter(|(e, _)| &e.layer == layer) {
            let folder = e.path.strip_prefix("src/").and_then(|p| p.split_once('/')).map(|(f, _)| f);
            if let Some(f) = folder.filter(|f| !folders.contains(f)) {
                folders.push(f);
            }
        }
    }
    let chain = folders.iter().map(|f| format!("`{f}`")).collect::<Vec<_>>();
    let lib = read("src/lib.rs").lines().map(|l| l.trim_start_matches("//!")).collect::<Vec<_>>().join(" ");
    let lib = lib.split_whitespace().collect::<Vec<_>>().join(" ");
    let said: Vec<&str> = lib.split(" → ").map(|s| s.split_whitespace().next().unwrap_or("")).collect();
    if !said.windows(chain.len()).any(|w| w.iter().zip(&chain).all(|(a, b)| a.trim_end_matches('.') == b)) {
        problems.push(format!("src/lib.rs should give the folders' order as {}", chain.join(" → ")));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
