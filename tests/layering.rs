//! The architecture stays what `src/lib.rs` says: imports run one way, from the bottom layer up
//! (values → GPU runtime → tensors → ops → comm → model → data → parallel → checkpoint → train →
//! commands), no module imports a module that imports it back, the CPU lessons (`model/`,
//! `parallel/`, `train.rs`) never name CUDA, and the collective API knows no NCCL. The folders
//! are the layers too: a file may use files of its own folder and of the folders below it
//! (`FOLDERS`), never above, but for the plain values (the first layer), which every folder may
//! read. The check reads every `crate::…` path (in `use` lines and inline), every `super::…` path
//! and every use of a child module, in every file of `src/`. It is also run on a planted cycle, a
//! planted upward import and a planted upward arrow between folders, and must catch all three.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers, lowest first. A module may use modules of its own layer (without a cycle) and of
/// the layers below, never above. Every file of `src/` (but `lib.rs` and `main.rs`) is listed.
const LAYERS: &[(&str, &[&str])] = &[
    ("values", &["files", "config::table", "config", "config::checks", "ops::types", "comm::process_grid"]),
    (
        "GPU runtime",
        &[
            "cuda",
            "cuda::runtime",
            "cuda::kernels",
            "cuda::nvrtc",
            "cuda::profile",
            "cuda::launch_table",
            "cuda::launch_table::attention",
            "cuda::launch_table::moe",
            "cuda::device",
        ],
    ),
    ("tensors", &["ops::tensor"]),
    (
        "ops",
        &[
            "ops::cpu_math",
            "ops::fp8",
            "ops::cpu_attention",
            "ops::cpu",
            "ops::gpu",
            "ops::gpu_fp8",
            "ops::moe",
            "ops::gpu_moe",
            "ops",
            "ops::wire",
        ],
    ),
    (
        "comm",
        &[
            "comm::device_link",
            "comm::cost",
            "comm::trace",
            "comm::wires::processes",
            "comm::wires::tcp",
            "comm::wires::mpi",
            "comm::local",
            "comm::wires::note",
            "comm::wires::remote",
            "comm::wires",
            "comm",
            "comm::tensors",
            "comm::placement",
            "comm::nccl",
            "comm::launcher",
        ],
    ),
    (
        "model",
        &[
            "model::param",
            "model::init",
            "model::stage",
            "model::weight_grads",
            "model::split",
            "model::moe",
            "model::routing_tape",
            "model::kv_cache",
            "model::block",
            "model::llama",
            "model::llama::parts",
            "model::llama::units",
            "model::llama::head",
            "model::llama::decode",
            "model::optimizer",
            "model",
        ],
    ),
    ("data", &["data::documents", "data::hf_hub", "data::text", "data"]),
    (
        "parallel",
        &[
            "parallel::data_parallel",
            "parallel::tensor_parallel",
            "parallel::sequence_parallel",
            "parallel::pipeline_schedule",
            "parallel::pipeline_messages",
            "parallel::pipeline_stop",
            "parallel::pipeline_parallel",
            "parallel::context_parallel",
            "parallel::ulysses",
            "parallel::zero",
            "parallel::fsdp",
            "parallel::expert_parallel",
            "parallel",
        ],
    ),
    ("checkpoint", &["checkpoint::folder", "checkpoint::hf", "checkpoint::save", "checkpoint"]),
    (
        "train",
        &[
            "train::agree",
            "train::feed",
            "train::gradients",
            "train::memory",
            "train::metrics",
            "train::stop",
            "train::run",
            "train::step",
            "train::compose",
            "train::validate",
            "train::watch",
            "train::driver",
            "train",
        ],
    ),
    (
        "commands",
        &[
            "commands::plot",
            "commands::schedule",
            "commands::eval",
            "commands::generate",
            "commands::converge",
            "commands::train",
            "commands::memory",
            "commands::self_check",
            "commands::doctor",
            "commands::bench",
            "commands::bench_attention",
            "commands",
        ],
    ),
];

/// The folders (and top-level files) of `src/`, lowest first: what `src/lib.rs`'s map says.
const FOLDERS: &[&str] =
    &["files", "config", "cuda", "ops", "comm", "model", "data", "parallel", "checkpoint", "train", "commands"];

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

/// Every module of `src/` (path like `model::block`) with its source.
fn sources() -> BTreeMap<String, String> {
    fn walk(dir: &Path, prefix: &str, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_stem().unwrap().to_str().unwrap().to_string();
            if path.is_dir() {
                walk(&path, &join(prefix, &name), out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let module = match name.as_str() {
                    "mod" => prefix.to_string(),
                    _ => join(prefix, &name),
                };
                out.insert(module, std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), "", &mut out);
    out.remove("lib"); // the crate root only declares the folders
    out.remove("main"); // the binary sits on top of everything
    out
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}::{name}")
    }
}

/// The source without comments (line comments and doc comments; the tree has no block comments).
fn code(text: &str) -> String {
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The paths a module's code names, as module paths relative to the crate (`ops::tensor::Tensor`).
fn referenced(module: &str, text: &str) -> Vec<String> {
    let code = code(text);
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
    let children: Vec<&str> = code
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod ").or_else(|| l.trim().strip_prefix("mod ")))
        .map(|l| l.trim_end_matches(';').trim())
        .collect();
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let word = |i: usize| -> String {
        code[i..].chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect()
    };
    for (i, _) in code.match_indices("crate::") {
        if i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_') {
            out.push(word(i + "crate::".len()));
        }
    }
    for (i, _) in code.match_indices("super::") {
        out.push(join(parent, &word(i + "super::".len())));
    }
    for line in code.lines() {
        let line = line.trim().trim_start_matches("pub ");
        if let Some(rest) = line.strip_prefix("use ") {
            let first = rest.split("::").next().unwrap_or("");
            if children.contains(&first) {
                out.push(join(module, rest.trim_end_matches(';')));
            }
        }
    }
    out
}

/// The module a path points into: the longest known module that prefixes it.
fn target<'a>(path: &str, modules: &'a BTreeSet<String>) -> Option<&'a String> {
    let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty() && !p.starts_with('{')).collect();
    (1..=parts.len()).rev().find_map(|n| modules.get(&parts[..n].join("::")))
}

/// Every violation of the layering in `sources`, as sentences; empty when all is well.
fn check(sources: &BTreeMap<String, String>) -> Vec<String> {
    let layer_of: BTreeMap<&str, usize> =
        LAYERS.iter().enumerate().flat_map(|(i, (_, ms))| ms.iter().map(move |m| (*m, i))).collect();
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    let mut problems = Vec::new();
    for m in &modules {
        if !layer_of.contains_key(m.as_str()) {
            problems.push(format!("{m} is in no layer: add it to LAYERS in tests/layering.rs"));
        }
    }
    for m in layer_of.keys().filter(|m| !modules.contains(**m)) {
        problems.push(format!("LAYERS lists {m}, which is not a file of src/"));
    }
    let mut edges: BTreeMap<&String, BTreeSet<&String>> = BTreeMap::new();
    for (m, text) in sources {
        for path in referenced(m, text) {
            let Some(t) = target(&path, &modules) else { continue };
            if t == m {
                continue;
            }
            edges.entry(m).or_default().insert(t);
            if let (Some(&a), Some(&b)) = (layer_of.get(m.as_str()), layer_of.get(t.as_str())) {
                if b > a {
                    problems.push(format!(
                        "{m} ({} layer) uses {t} ({} layer): imports must run from lower layers up",
                        LAYERS[a].0, LAYERS[b].0
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
