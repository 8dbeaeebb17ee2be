//! The architecture stays what `src/lib.rs` says: imports run one way, from the bottom layer up
//! (values → GPU runtime → tensors → ops → comm → model → data → parallel → checkpoint → train →
//! commands), no module imports a module that imports it back, the CPU lessons (`model/`,
//! `parallel/`, `train.rs` and the step's files in `train/`) never name CUDA, and the collective
//! API knows no NCCL. The folders are the layers too: a file may use files of its own folder and
//! of the folders below it (`FOLDERS`), never above, but for the plain values (the first layer),
//! which every folder may read. The check reads every `crate::…` path (in `use` lines and
//! inline), every `super::…` path (each `use` group spelled out) and every use of a child module,
//! in every file of `src/`; the layers come from `step_by_step/syllabus.toml`. It is also run on
//! a planted cycle, a planted upward import and a planted upward arrow between folders, and must
//! catch all three.

#[path = "support/syllabus.rs"]
mod syllabus;

use std::collections::{BTreeMap, BTreeSet};
use syllabus::{code, module_of, referenced, sources, table, target};

/// The layers, lowest first, each with its modules, from `step_by_step/syllabus.toml` (which
/// also gives each file its lesson): a module may use modules of its own layer (without a cycle)
/// and of the layers below, never above.
fn layers() -> Vec<(String, Vec<String>)> {
    let table = table();
    let mut layers: Vec<(String, Vec<String>)> = table.layers.iter().map(|l| (l.clone(), Vec::new())).collect();
    for (entry, _) in table.entries() {
        let at = layers.iter().position(|(l, _)| *l == entry.layer);
        let at = at.unwrap_or_else(|| panic!("{}: layer {:?} is not in `layers`", entry.path, entry.layer));
        layers[at].1.extend(module_of(&entry.path));
    }
    layers
}

/// The folders (and top-level files) of `src/`, lowest first: what `src/lib.rs`'s map says.
const FOLDERS: &[&str] = &[
    "signals",
    "files",
    "config",
    "devices",
    "cuda",
    "ops",
    "comm",
    "model",
    "data",
    "parallel",
    "checkpoint",
    "train",
    "commands",
];

/// Modules that must not name CUDA (`crate::cuda`, `cudarc`): the CPU lessons and the
/// collective API. `x::` means the folder x and everything in it.
const NO_CUDA: &[&str] = &[
    "model::",
    "parallel::",
    "train",
    "train::step",
    "train::compose",
    "train::feed",
    "train::gradients",
    "train::driver",
    "comm",
    "comm::local",
    "comm::trace",
    "comm::device_link",
    "comm::tensors",
    "comm::cost",
    "comm::placement",
    "comm::process_grid",
];

/// Every violation of the layering in `sources`, as sentences; empty when all is well.
fn check(sources: &BTreeMap<String, String>) -> Vec<String> {
    let layers = layers();
    let layer_of: BTreeMap<&str, usize> =
        layers.iter().enumerate().flat_map(|(i, (_, ms))| ms.iter().map(move |m| (m.as_str(), i))).collect();
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    let mut problems = Vec::new();
    for m in &modules {
        if !layer_of.contains_key(m.as_str()) {
            problems.push(format!("{m} is in no layer: add its file to step_by_step/syllabus.toml"));
        }
    }
    for m in layer_of.keys().filter(|m| !modules.contains(**m)) {
        problems.push(format!("step_by_step/syllabus.toml lists {m}, which is not a file of src/"));
    }
    let mut edges: BTreeMap<&String, BTreeSet<&String>> = BTreeMap::new();
    for (m, text) in sources {
        for path in referenced(m, text) {
            let Some(t) = target(&path, |p| modules.get(p)) else { continue };
            if t == m {
                continue;
            }
            edges.entry(m).or_default().insert(t);
            if let (Some(&a), Some(&b)) = (layer_of.get(m.as_str()), layer_of.get(t.as_str())) {
                if b > a {
                    problems.push(format!(
                        "{m} ({} layer) uses {t} ({} layer): imports must run from lower layers up",
                        layers[a].0, layers[b].0
                    ));
                }
            }
        }
        // the folders: no arrow runs back up, but to the plain values every folder reads
        let folder = |m: &str| FOLDERS.iter().position(|f| m.split("::").next() == Some(*f));
        let plain = |t: &str| layer_of.get(t) == Some(&0);
        match folder(m) {
            None => problems.push(format!("{m} is in no folder of FOLDERS in tests/layering.rs")),
            Some(a) => {
                for t in edges.get(m).into_iter().flatten().filter(|t| !plain(t)) {
                    if let Some(b) = folder(t).filter(|&b| b > a) {
                        problems.push(format!(
                            "{m} (folder {}) uses {t} (folder {}): arrows between folders must run up",
                            FOLDERS[a], FOLDERS[b]
                        ));
                    }
                }
            }
        }
        let lesson = NO_CUDA.iter().any(|p| match p.strip_suffix("::") {
            Some(folder) => m == folder || m.starts_with(p),
            None => m == p,
        });
        if lesson && (code(text).contains("crate::cuda") || code(text).contains("cudarc")) {
            problems.push(format!("{m} names CUDA: the CPU lessons and the collective API must not"));
        }
    }
    // cycles: a depth-first search that reports the first path back to a module on the stack
    fn visit<'a>(
        m: &'a String,
        edges: &BTreeMap<&'a String, BTreeSet<&'a String>>,
        stack: &mut Vec<&'a String>,
        done: &mut BTreeSet<&'a String>,
        problems: &mut Vec<String>,
    ) {
        if let Some(at) = stack.iter().position(|s| *s == m) {
            let cycle: Vec<&str> = stack[at..].iter().map(|s| s.as_str()).chain([m.as_str()]).collect();
            problems.push(format!("import cycle: {}", cycle.join(" → ")));
            return;
        }
        if !done.insert(m) {
            return;
        }
        stack.push(m);
        for t in edges.get(m).into_iter().flatten() {
            visit(t, edges, stack, done, problems);
        }
        stack.pop();
    }
    let mut done = BTreeSet::new();
    for m in &modules {
        visit(m, &edges, &mut Vec::new(), &mut done, &mut problems);
    }
    problems
}

#[test]
fn imports_run_one_way_without_cycles() {
    let problems = check(&sources());
    assert!(problems.is_empty(), "the layering is broken:\n{}", problems.join("\n"));
}

#[test]
fn the_check_catches_a_planted_cycle() {
    // model::param is below model::llama in the same layer; llama already uses param
    let mut planted = sources();
    planted.get_mut("model::param").unwrap().push_str("\nuse crate::model::llama::Llama;\n");
    let problems = check(&planted);
    assert!(problems.iter().any(|p| p.contains("import cycle") && p.contains("model::llama")), "{problems:?}");
}

#[test]
fn the_check_catches_an_arrow_back_down_between_folders() {
    // the GPU ops must not reach the collectives: ops/ is below comm/
    let mut planted = sources();
    planted.get_mut("ops::gpu").unwrap().push_str("\nfn f(_: &crate::comm::tensors::Pending) {}\n");
    let problems = check(&planted);
    assert!(
        problems.iter().any(|p| p.contains("ops::gpu (folder ops) uses comm::tensors (folder comm)")),
        "{problems:?}"
    );
}

#[test]
fn the_check_catches_an_upward_import_and_cuda_in_a_lesson() {
    let mut planted = sources();
    planted.get_mut("ops::tensor").unwrap().push_str("\nfn f(_: crate::model::Param) {}\n");
    planted.get_mut("parallel::data_parallel").unwrap().push_str("\nuse crate::cuda::runtime::Gpu;\n");
    let problems = check(&planted);
    assert!(problems.iter().any(|p| p.contains("ops::tensor (tensors layer) uses model")), "{problems:?}");
    assert!(problems.iter().any(|p| p.contains("parallel::data_parallel names CUDA")), "{problems:?}");
}
