//! # Files from the Hugging Face Hub, through its local cache
//!
//! `hub:ORG/NAME` names a repository on huggingface.co: a model for `model.init_from` and
//! `data.tokenizer`, a dataset for `data.source = "hub:ORG/NAME/FILE"` (FILE may be a glob,
//! `data/train-*.parquet`: every matching file of the repository, in name order). Files are
//! looked up in the usual Hugging Face cache first (`$HF_HOME/hub`, by default `~/.cache/huggingface/hub`, shared
//! with transformers), so a repository that is already there needs no network; otherwise
//! `hf-hub` downloads it into that cache (from `HF_ENDPOINT`, a mirror, where that is set).
//! Without a network and without a cached copy, the error says exactly that.

use anyhow::{anyhow, bail, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo};
use std::path::PathBuf;

/// The Hub's cache, once `id` is a repository name as the Hub makes them and `file` a path inside
/// a repository: both become paths in the cache, so `hub:../../etc` must not. (The Hub's own
/// rule: `[ORG/]NAME`, letters, digits, `-`, `_` and `.`, each part beginning and ending with a
/// letter, digit or `_`, no `--` or `..`, at most 96 characters.) A cache root that is not a
/// folder is named with the variable that put it there.
fn checked(id: &str, file: &str) -> Result<Cache> {
    let part_ok = |p: &str| {
        let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        edge(p.chars().next())
            && edge(p.chars().last())
            && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let parts: Vec<&str> = id.split('/').collect();
    if id.len() > 96 || id.contains("--") || id.contains("..") || parts.len() > 2 || !parts.iter().all(|p| part_ok(p)) {
        let shown: String = id.chars().take(100).collect();
        bail!("hub:{shown}: not a Hugging Face repository name (ORG/NAME: letters, digits, -, _ and ., no -- or .., at most 96 characters), e.g. hub:HuggingFaceTB/SmolLM2-135M");
    }
    let bad = |c: &str| c.is_empty() || c == "." || c == "..";
    if file.starts_with('/') || file.split('/').any(bad) {
        bail!("hub:{id}: {file:?} is not a file's path inside a repository (no leading /, no empty, . or .. parts)");
    }
    let cache = Cache::from_env();
    // the cache folder, or the nearest part of its path that exists, must be a folder
    let root = cache.path();
    if let Some(file) = root.ancestors().find(|a| a.exists()).filter(|a| !a.is_dir()) {
        let by = ["HF_HUB_CACHE", "HF_HOME"].into_iter().find(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
        let by = by.map_or("the default".to_string(), |v| format!("{v}={}", std::env::var(v).unwrap_or_default()));
        bail!("the Hugging Face cache {} cannot be a folder: {} is a file (set by {by}); point it at a folder (HF_HOME holds hub/ inside it), or unset it", root.display(), file.display());
    }
    Ok(cache)
}

/// A file of a model or dataset repository: from the cache, else downloaded into it.
fn fetch(repo: Repo, id: &str, file: &str) -> Result<PathBuf> {
    let cache = checked(id, file)?;
    if let Some(path) = cache.repo(repo.clone()).get(file) {
        return Ok(path);
    }
    let api = hub(cache.clone())
        .with_progress(true)
        .build()
        .map_err(|e| anyhow!("cannot set up Hugging Face downloads: {e}"))?;
    api.repo(repo).get(file).map_err(|e| match offline(&e.to_string()) {
        true => anyhow!(
            "{id}: no network (the Hub cannot be reached) and no cached copy of {file} in the Hugging Face cache {}: {FETCH_ONCE}",
            cache.path().display()
        ),
        false => anyhow!(
            "{id}: cannot download {file} ({e}), and it is not in the Hugging Face cache {}",
            cache.path().display()
        ),
    })
}

/// The Hub's API over `cache`, at `HF_ENDPOINT` where that is set (a mirror), as transformers
/// reads it.
fn hub(cache: Cache) -> ApiBuilder {
    let builder = ApiBuilder::from_cache(cache);
    match std::env::var("HF_ENDPOINT") {
        Ok(endpoint) if !endpoint.is_empty() => builder.with_endpoint(endpoint),
        _ => builder,
    }
}

/// What to do without a network.
const FETCH_ONCE: &str = "run once where the Hub can be reached (or fill that cache elsewhere, e.g. `hf download`, and copy it; HF_HOME says where it is), then offline";

/// Whether a request failed for want of a network (no name resolution, no route, refused, timed
/// out), not because the Hub said no.
fn offline(error: &str) -> bool {
    let e = error.to_lowercase();
    ["dns", "resolve", "connection refused", "connection failed", "network is unreachable", "timed out", "timeout"]
        .iter()
        .any(|w| e.contains(w))
}

/// `ORG/NAME` → the local folder of that model with `config.json` and its weights.
pub fn model_dir(id: &str) -> Result<PathBuf> {
    let repo = Repo::model(id.to_string());
    let config = fetch(repo.clone(), id, "config.json")?;
    let single = fetch(repo.clone(), id, "model.safetensors");
    if single.is_err() {
        let index = fetch(repo.clone(), id, "model.safetensors.index.json")
            .map_err(|e| anyhow!("{id}: neither model.safetensors nor a sharded index: {e:#}"))?;
        let j: serde_json::Value = serde_json::from_str(&crate::files::read_text(&index, id)?)?;
        let shards: std::collections::BTreeSet<&str> =
            j["weight_map"].as_object().into_iter().flatten().filter_map(|(_, f)| f.as_str()).collect();
        for shard in shards {
            fetch(repo.clone(), id, shard)?;
        }
    }
    Ok(config.parent().expect("a file in a snapshot folder").to_path_buf())
}

/// `ORG/NAME` → the local path of the model's `tokenizer.json`.
pub fn tokenizer_file(id: &str) -> Result<PathBuf> {
    fetch(Repo::model(id.to_string()), id, "tokenizer.json")
}

/// `ORG/NAME/FILE` (a dataset repository and a file in it) → its local path.
pub fn dataset_file(spec: &str) -> Result<PathBuf> {
    let parts: Vec<&str> = spec.splitn(3, '/').collect();
    if parts.len() < 3 || parts.iter().any(|p| p.is_empty()) {
        bail!("hub:{spec}: a dataset file is named hub:ORG/NAME/FILE, for example hub:roneneldan/TinyStories/TinyStoriesV2-GPT4-valid.txt");
    }
    let id = format!("{}/{}", parts[0], parts[1]);
    fetch(Repo::dataset(id.clone()), &id, parts[2])
}

/// `ORG/NAME/PATTERN` → the local paths of the dataset's files that match it (`*`, `?` within a
/// path component), in name order; a pattern without wildcards is one file. The names come from
/// the Hub, else, offline, from the repository's snapshot in the cache.
pub fn dataset_files(spec: &str) -> Result<Vec<PathBuf>> {
    let (id, pattern) = match spec.splitn(3, '/').collect::<Vec<_>>()[..] {
        [_, _, pattern] if !pattern.contains(['*', '?']) => return Ok(vec![dataset_file(spec)?]),
        [org, name, pattern] if !org.is_empty() && !name.is_empty() => (format!("{org}/{name}"), pattern),
        _ => return Ok(vec![dataset_file(spec)?]), // its error names the form
    };
    let matches = |file: &str| {
        let (p, f): (Vec<&str>, Vec<&str>) = (pattern.split('/').collect(), file.split('/').collect());
        p.len() == f.len()
            && p.iter().zip(&f).all(|(p, f)| crate::data::documents::wildcard(p.as_bytes(), f.as_bytes()))
    };
    let repo = Repo::dataset(id.clone());
    let api = hub(checked(&id, pattern)?).build().map_err(|e| e.to_string());
    let listed = api.and_then(|api| api.repo(repo.clone()).info().map_err(|e| e.to_string()));
    let names = match listed {
        Ok(info) => info.siblings.into_iter().map(|s| s.rfilename).collect(),
        Err(why) => match cached_files(&repo) {
            Ok(names) => names, // offline: the cached snapshot's files
            Err(_) => {
                let cache = Cache::from_env().path().display().to_string();
                match offline(&why) {
                    true => bail!("hub:{spec}: no network (the Hub cannot be reached) and no cached copy of {id} in the Hugging Face cache {cache}: {FETCH_ONCE}"),
                    false => bail!("hub:{spec}: cannot list {id} on the Hub ({why}), and it is not in the Hugging Face cache {cache}"),
                }
            }
        },
    };
    let mut files: Vec<String> = names.into_iter().filter(|n| matches(n)).collect();
    files.sort();
    if files.is_empty() {
        bail!("hub:{spec}: no file of {id} matches {pattern}");
    }
    files.iter().map(|f| fetch(repo.clone(), &id, f)).collect()
}

/// The files of a repository's cached snapshot (`refs/main` → `snapshots/<commit>/`), as paths
/// relative to it.
fn cached_files(repo: &Repo) -> Result<Vec<String>> {
    let folder = Cache::from_env().path().join(repo.folder_name());
    let commit = crate::files::read_text(&folder.join("refs").join(repo.revision()), "the Hub cache")?;
    let snapshot = folder.join("snapshots").join(commit.trim());
    let mut names = Vec::new();
    let mut todo = vec![snapshot.clone()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir)?.filter_map(|e| e.ok()) {
            let path = entry.path();
            match path.is_dir() {
                true => todo.push(path),
                false => names.push(path.strip_prefix(&snapshot)?.to_string_lossy().into_owned()),
            }
        }
    }
    Ok(names)
}
