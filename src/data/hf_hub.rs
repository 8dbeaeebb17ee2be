//! # Files from the Hugging Face Hub, through its local cache
//!
//! `hub:ORG/NAME` names a repository on huggingface.co: a model for `model.init_from` and
//! `data.tokenizer`, a dataset for `data.source = "hub:ORG/NAME/FILE"`. Files are looked up in the
//! usual Hugging Face cache first (`$HF_HOME/hub`, by default `~/.cache/huggingface/hub`, shared
//! with transformers), so a repository that is already there needs no network; otherwise
//! `hf-hub` downloads it into that cache.

use anyhow::{anyhow, bail, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo};
use std::path::PathBuf;

/// A file of a model or dataset repository: from the cache, else downloaded into it.
fn fetch(repo: Repo, id: &str, file: &str) -> Result<PathBuf> {
    let cache = Cache::from_env();
    if let Some(path) = cache.repo(repo.clone()).get(file) {
        return Ok(path);
    }
    let api = ApiBuilder::from_cache(cache.clone())
        .with_progress(true)
        .build()
        .map_err(|e| anyhow!("cannot set up Hugging Face downloads: {e}"))?;
    api.repo(repo).get(file).map_err(|e| {
        anyhow!(
            "{id}: cannot download {file} ({e}), and it is not in the Hugging Face cache {}",
            cache.path().display()
        )
    })
}

/// `ORG/NAME` → the local folder of that model with `config.json` and its weights.
pub fn model_dir(id: &str) -> Result<PathBuf> {
    let repo = Repo::model(id.to_string());
    let config = fetch(repo.clone(), id, "config.json")?;
    let single = fetch(repo.clone(), id, "model.safetensors");
    if single.is_err() {
        let index = fetch(repo.clone(), id, "model.safetensors.index.json")
            .map_err(|e| anyhow!("{id}: neither model.safetensors nor a sharded index: {e:#}"))?;
        let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index)?)?;
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
