//! # The commands around training
//!
//! `converge` (does a layout reproduce the one-rank loss curve?), `bench` (tokens/s, MFU,
//! memory; `--op attention`: the attention kernels alone), `memory` (what every rank holds,
//! estimated and measured), `doctor` (is this machine ready?), `eval` (a Hugging Face model's
//! loss), `generate` (sampling from a model, with the KV cache), `schedule` (the pipeline picture), `plot` (the SVG charts they draw) and `train` (the
//! command around the training loop). `main.rs`
//! parses the CLI and calls these; the training loop itself is `train/driver.rs` (its step `train/step.rs`).

pub mod bench;
pub mod bench_attention;
pub mod calibrate;
pub mod cli;
pub mod converge;
pub mod doctor;
pub mod eval;
pub mod generate;
pub mod memory;
pub mod plan;
pub mod plot;
pub mod schedule;
pub mod self_check;
pub mod step_time;
pub mod tokenizer;
pub mod traffic;
pub mod train;

use crate::config::Config;
use cli::PathArg;
use std::path::PathBuf;

/// The run's config from `--config` and `--set`, a `model.init_from` folder giving the `[model]`
/// keys they leave out (`Config::load_with`, `checkpoint/hf.rs`'s `model_keys_of`): what every
/// command that trains or measures a run reads.
pub fn load_config(path: Option<&std::path::Path>, sets: &[String]) -> anyhow::Result<Config> {
    Config::load_with(path, sets, Some(&crate::checkpoint::hf::model_keys_of))
}

/// Checks a command's outputs, the paths its command line `paths` writes, against each other and
/// against everything it reads (`inputs`: its read flags and what `cfg` names), and claims them
/// for this run (`files::claim`): in a multi-process run the first process writes them.
pub fn claim_outputs(paths: &[PathArg], cfg: Option<&Config>) -> anyhow::Result<crate::files::Claims> {
    let outputs: Vec<crate::files::Wanted> = paths
        .iter()
        .filter(|p| p.writes)
        .map(|p| crate::files::Wanted { flag: &p.flag, path: &p.path, folder: p.folder })
        .collect();
    let inputs = inputs(paths, cfg);
    if let Some(cfg) = cfg {
        let folders: Vec<(&str, PathBuf)> = CONFIG_OUTPUTS.iter().filter_map(|(k, f)| Some((*k, f(cfg)?))).collect();
        crate::files::check_folders(&folders, &inputs)?;
    }
    let checked = crate::files::check_outputs(&outputs, &inputs)?;
    crate::files::claim(&checked, crate::comm::wires::processes::leads())
}

/// The folder a config key names, if it is set.
pub type FolderOf = fn(&Config) -> Option<PathBuf>;

/// The config keys that name a folder a run writes into, each with the folder it names (none:
/// the key is unset). Checked against everything the run reads as the output flags are.
pub const CONFIG_OUTPUTS: [(&str, FolderOf); 2] = [
    ("checkpoint.dir", |c| Some(PathBuf::from(&c.checkpoint.dir)).filter(|p| !p.as_os_str().is_empty())),
    ("data.cache_dir", |c| crate::files::cache_folder(&c.data.cache_dir).ok()), // no HOME: named later
];

/// What a command reads, by the flag or key that names it: the paths its command line reads (a
/// folder whole: a checkpoint, a model, a routing tape), and of the config `cfg`: a text
/// source's shards (and its folder, where it names one), a tokenizer file, the model folder it starts from, and the checkpoints of
/// `checkpoint.dir` with the folder's lock. No output may be one of them or inside one.
pub fn inputs(paths: &[PathArg], cfg: Option<&Config>) -> Vec<(String, PathBuf)> {
    let mut v: Vec<(String, PathBuf)> =
        paths.iter().filter(|p| !p.writes).map(|p| (p.flag.clone(), p.path.clone())).collect();
    let Some(cfg) = cfg else { return v };
    if let Some(spec) = cfg.data.source.strip_prefix("text:") {
        let shards = crate::data::documents::shards(spec).unwrap_or_default(); // a bad source fails later, named
        v.extend(shards.into_iter().map(|s| ("data.source".to_string(), s)));
        if std::path::Path::new(spec).is_dir() {
            // a folder of shards: a file written into it would be a shard of the next run
            v.push(("data.source's folder".into(), PathBuf::from(spec)));
        }
    }
    let local = |s: &str| !s.is_empty() && s != "bytes" && !s.starts_with("hub:");
    if local(&cfg.data.tokenizer) {
        v.push(("data.tokenizer".into(), PathBuf::from(&cfg.data.tokenizer)));
    }
    if local(&cfg.model.init_from) {
        v.push(("model.init_from".into(), PathBuf::from(&cfg.model.init_from)));
    }
    let dir = std::path::Path::new(&cfg.checkpoint.dir);
    if !cfg.checkpoint.dir.is_empty() {
        v.push(("checkpoint.dir's lock".into(), dir.join(".lock")));
        let steps = std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path());
        let steps = steps.filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step_")));
        v.extend(steps.map(|p| ("a checkpoint of checkpoint.dir".to_string(), p)));
    }
    v
}
