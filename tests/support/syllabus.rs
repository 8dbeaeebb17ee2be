//! The syllabus table (`step_by_step/syllabus.toml`) and the code it maps, read the same way by
//! `tests/layering.rs` (the layers) and `tests/syllabus.rs` (the lessons' order); each reads
//! only part of it.
#![allow(dead_code)]

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Table {
    /// The layers, lowest first.
    pub layers: Vec<String>,
    /// The lessons, in the tutorial's order.
    pub lesson: Vec<Lesson>,
    pub track: Vec<Track>,
    /// A lesson's files that still use later lessons: moves still to be made.
    #[serde(default)]
    pub owes: BTreeMap<String, Vec<String>>,
    /// A lesson's files that call later lessons' seams by design (the step: each seam named by its
    /// lesson, in the order a step runs them). Not debts; listed all the same, and checked as real.
    #[serde(default)]
    pub calls: BTreeMap<String, Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lesson {
    /// The tutorial's folder: `step_by_step/<step>/`.
    pub step: String,
    pub files: Vec<Entry>,
    /// What this lesson adds to shared types and the config: `Precision::Fp8`, `.precision`.
    #[serde(default)]
    pub names: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Track {
    /// What the track is (no lesson teaches it).
    pub name: String,
    pub files: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub path: String,
    pub layer: String,
}

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub fn table() -> Table {
    let path = root().join("step_by_step/syllabus.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

impl Table {
    /// Every file's entry with its lesson's place in the order (`None`: a track).
    pub fn entries(&self) -> Vec<(&Entry, Option<usize>)> {
        let lessons = self.lesson.iter().enumerate().flat_map(|(i, l)| l.files.iter().map(move |e| (e, Some(i))));
        lessons.chain(self.track.iter().flat_map(|t| t.files.iter().map(|e| (e, None)))).collect()
    }
}

/// The module of a file of `src/` (`src/model/llama/parts.rs` → `model::llama::parts`,
/// `src/ops/mod.rs` → `ops`); `None` for other files.
pub fn module_of(path: &str) -> Option<String> {
    let rest = path.strip_prefix("src/")?.strip_suffix(".rs")?;
    Some(rest.trim_end_matches("/mod").replace('/', "::"))
}

/// Every module of `src/` (path like `model::block`) with its source, but the crate root and the
/// binary.
pub fn sources() -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root()).unwrap().to_str().unwrap().to_string();
                out.insert(module_of(&rel).unwrap(), std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(&root().join("src"), &mut out);
    out.remove("lib"); // the crate root only declares the folders
    out.remove("main"); // the binary sits on top of everything
    out
}

pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}::{name}")
    }
}

/// The source without comments (line comments and doc comments; the tree has no block comments).
pub fn code(text: &str) -> String {
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The paths a module's code names, as module paths relative to the crate (`ops::tensor::Tensor`):
/// every `crate::…` and `super::…` path, each `use` line's groups spelled out, and every `use` of a
/// child module. Declaring a child (`mod x;`) is not a use.
pub fn referenced(module: &str, text: &str) -> Vec<String> {
    let code = code(text);
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
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
    out.extend(used(module, &code, false));
    out
}

/// The paths into its own child modules a module's code names inline (`fp8::cast(…)` in `ops`):
/// a use for the syllabus, not an import for the layering (a child may still use its parent).
pub fn inline_children(module: &str, text: &str) -> Vec<String> {
    let code = code(text);
    let mut out = Vec::new();
    for child in children(&code) {
        for (i, _) in code.match_indices(&format!("{child}::")) {
            let before = code[..i].chars().next_back();
            if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                let path: String =
                    code[i..].chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
                out.push(join(module, &path));
            }
        }
    }
    out
}

/// The child modules a module declares (`mod x;`, `pub mod x;`).
fn children(code: &str) -> Vec<&str> {
    code.lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod ").or_else(|| l.trim().strip_prefix("mod ")))
        .map(|l| l.trim_end_matches(';').trim())
        .collect()
}

/// The paths a module re-exports (`pub use …`), as module paths relative to the crate: an item
/// named through the module is the item of the path.
pub fn reexported(module: &str, text: &str) -> Vec<String> {
    used(module, &code(text), true)
}

/// The paths of a module's `use` statements (only its `pub` ones: `exported`), each group
/// spelled out: `use crate::a::{b, c::D}` names a::b and a::c::D.
fn used(module: &str, code: &str, exported: bool) -> Vec<String> {
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
    let children = children(code);
    let mut out = Vec::new();
    let mut statements = Vec::new();
    for (at, line) in code.lines().scan(0, |at, l| Some((std::mem::replace(at, *at + l.len() + 1), l))) {
        let trimmed = line.trim_start();
        let words =
            trimmed.trim_start_matches("pub(crate) ").trim_start_matches("pub(super) ").trim_start_matches("pub ");
        if words.starts_with("use ") && (!exported || words.len() < trimmed.len()) {
            let from = at + (line.len() - words.len());
            let to = code[from..].find(';').map_or(code.len(), |n| from + n);
            statements.push(&code[from + "use ".len()..to]);
        }
    }
    for tree in statements {
        // `x as y` imports x: the renaming is dropped, then the spaces
        let (mut words, mut tree_text) = (tree.split_whitespace(), String::new());
        while let Some(w) = words.next() {
            match w {
                "as" => tree_text.push_str(words.next().map_or("", |n| &n[n.find([',', '}']).unwrap_or(n.len())..])),
                w => tree_text.push_str(w),
            }
        }
        for path in spell_out(&tree_text) {
            let first = path.split("::").next().unwrap_or("");
            if let Some(rest) = path.strip_prefix("crate::") {
                out.push(rest.to_string());
            } else if let Some(rest) = path.strip_prefix("super::") {
                out.push(join(parent, rest));
            } else if children.contains(&first) {
                out.push(join(module, &path));
            }
        }
    }
    out
}

/// A `use` tree without spaces, as the paths it imports: `a::{b,c::{d,self}}` → a::b, a::c::d,
/// a::c.
fn spell_out(tree: &str) -> Vec<String> {
    let Some(open) = tree.find('{') else {
        return vec![tree.trim_end_matches("::self").to_string()];
    };
    let (head, inner) = (&tree[..open], &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())]);
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts.iter().filter(|p| !p.is_empty()).flat_map(|p| spell_out(&format!("{head}{p}"))).collect()
}

/// The module a path points into: the longest known module that prefixes it.
pub fn target<'a>(path: &str, modules: impl Fn(&str) -> Option<&'a String>) -> Option<&'a String> {
    let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty() && !p.starts_with('{')).collect();
    (1..=parts.len()).rev().find_map(|n| modules(&parts[..n].join("::")))
}
