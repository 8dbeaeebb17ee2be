//! # Checkpoints: saving a run, and resuming it exactly
//!
//! A checkpoint is a folder `dir/step_NNNNNN/`:
//!
//! ```text
//! config.json          the architecture, in Hugging Face's words
//! model.safetensors    every weight, full size, Hugging Face names (transformers loads it as is)
//! optimizer.safetensors  AdamW's moments: exp_avg.<name>, exp_avg_sq.<name>
//! trainer_state.json   the step, AdamW's step count, the run's config
//! ```
//! Tensors are saved whole, whatever the topology: tensor-parallel shards are all-gathered, the
//! pipeline stages send theirs to rank 0, which writes. Loading slices them again for the new
//! topology (`Llama::build`), so a checkpoint moves between layouts. Data order and the learning
//! rate depend only on the step, and there is no other randomness in a step, so a resumed run
//! repeats the uninterrupted run's losses exactly.
//!
//! Writing is atomic: files go into `step_NNNNNN.tmp/`, are flushed to disk, and the folder is
//! renamed when complete; only then are checkpoints beyond the newest `keep` deleted. A run
//! killed while saving leaves the previous checkpoint as the latest complete one.

use crate::checkpoint::hf::{build_from, full_tensor, read_safetensors};
use crate::comm::launcher::Rank;
use crate::config::{Config, ModelConfig};
use crate::model::optimizer::Optimizer;
use crate::model::{shard, unshard, Llama, Param, Split, Stage, TensorSplit, Whole};
use crate::ops::tensor::Tensor;
use crate::parallel::process_grid::Axis;
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Full tensors by name: the weights and the optimizer moments.
pub struct State {
    pub weights: Vec<(String, Tensor)>,
    pub moments: Vec<(String, Tensor)>,
}

/// Gathers the whole model and optimizer onto rank 0 (`Some` there, `None` elsewhere). Every rank
/// calls it; only the ranks of the first dp and cp replica take part.
pub fn gather(me: &Rank, cfg: &Config, model: &Llama, optimizer: &Optimizer) -> Result<Option<State>> {
    if me.coords.dp != 0 || me.coords.cp != 0 {
        return Ok(None);
    }
    let (tp_group, pp) = (me.group(Axis::Tp), me.group(Axis::Pp));
    let whole = |t: &Tensor, split: Split| -> Result<Tensor> {
        if split == Split::Replicated || tp_group.size() == 1 {
            return Ok(Tensor::from_vec(t.shape(), t.to_vec())); // a host copy, also of a GPU tensor
        }
        let all = tp_group.all_gather(&t.host_view())?;
        let parts: Vec<Tensor> = all.chunks(t.numel()).map(|c| Tensor::from_vec(t.shape(), c.to_vec())).collect();
        Ok(unshard(&parts, split))
    };
    let mut mine = Vec::new(); // (name, weight, exp_avg, exp_avg_sq) of this stage, full size
    for (p, (m, v)) in model.params().iter().zip(optimizer.moments()) {
        mine.push((p.name.clone(), whole(&p.value, p.split)?, whole(m, p.split)?, whole(v, p.split)?));
    }
    if me.coords.tp != 0 {
        return Ok(None);
    }
    if me.coords.pp != 0 {
        let flat: Vec<f32> = mine.iter().flat_map(|(_, w, m, v)| [w, m, v]).flat_map(|t| t.to_vec()).collect();
        pp.send(&flat, 0)?;
        return Ok(None);
    }
    for stage in 1..pp.size() {
        let skeleton =
            Llama::build(&cfg.model, Box::new(Whole), Stage { index: stage, count: pp.size() }, |_, shape, _| {
                Ok(Tensor::zeros(shape))
            })?;
        let shapes: Vec<(String, Vec<usize>)> =
            skeleton.params().iter().map(|p| (p.name.clone(), p.value.shape().to_vec())).collect();
        let total: usize = shapes.iter().map(|(_, s)| 3 * s.iter().product::<usize>()).sum();
        let flat = pp.recv(total, stage)?;
        let mut at = 0;
        let mut take = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            at += n;
            Tensor::from_vec(shape, flat[at - n..at].to_vec())
        };
        for (name, shape) in shapes {
            let (w, m, v) = (take(&shape), take(&shape), take(&shape));
            mine.push((name, w, m, v));
        }
    }
    let mut state = State { weights: Vec::new(), moments: Vec::new() };
    for (name, w, m, v) in mine {
        state.moments.push((format!("exp_avg.{name}"), m));
        state.moments.push((format!("exp_avg_sq.{name}"), v));
        state.weights.push((name, w));
    }
    Ok(Some(state))
}

/// Writes checkpoint `step` (steps done) into `dir`, atomically; keeps the newest `keep`.
pub fn save(dir: &Path, step: usize, state: &State, cfg: &Config, adam_steps: u32) -> Result<PathBuf> {
    let final_dir = dir.join(format!("step_{step:06}"));
    let tmp = dir.join(format!("step_{step:06}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp); // a previous run killed while writing
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create checkpoint folder {}", tmp.display()))?;
    write_file(&tmp.join("config.json"), hf_config(&cfg.model).as_bytes())?;
    write_file(&tmp.join("model.safetensors"), &safetensors_bytes(&state.weights)?)?;
    write_file(&tmp.join("optimizer.safetensors"), &safetensors_bytes(&state.moments)?)?;
    let meta = serde_json::json!({
        "step": step,
        "adam_steps": adam_steps,
        "config": toml::to_string(cfg).context("the config does not serialise")?,
    });
    write_file(&tmp.join("trainer_state.json"), serde_json::to_string_pretty(&meta)?.as_bytes())?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).with_context(|| format!("cannot replace {}", final_dir.display()))?;
    }
    std::fs::rename(&tmp, &final_dir).with_context(|| format!("cannot rename {} into place", tmp.display()))?;
    let mut all = complete_checkpoints(dir)?;
    while all.len() > cfg.checkpoint.keep.max(1) {
        let (_, old) = all.remove(0);
        std::fs::remove_dir_all(&old).with_context(|| format!("cannot delete old checkpoint {}", old.display()))?;
    }
    Ok(final_dir)
}

/// Complete checkpoints in `dir`, oldest first.
fn complete_checkpoints(dir: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("cannot list checkpoint folder {}", dir.display()))?;
    let mut found: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            Some((name.strip_prefix("step_")?.parse().ok()?, e.path())) // `.tmp` folders do not parse
        })
        .collect();
    found.sort();
    Ok(found)
}

/// `latest` → the newest complete checkpoint in `checkpoint.dir`; anything else is a folder.
pub fn resolve(arg: &Path, cfg: &Config) -> Result<PathBuf> {
    if arg.as_os_str() != "latest" {
        return Ok(arg.to_path_buf());
    }
    let dir = Path::new(&cfg.checkpoint.dir);
    match complete_checkpoints(dir)?.pop() {
        Some((_, path)) => Ok(path),
        None => bail!("--resume latest: no complete checkpoint in {} (checkpoint.dir)", dir.display()),
    }
}

/// A checkpoint read back, ready to be sliced for this rank.
pub struct Resumed {
    pub step: usize,
    pub adam_steps: u32,
    weights: HashMap<String, Tensor>,
    moments: HashMap<String, Tensor>,
}

pub fn load(dir: &Path) -> Result<Resumed> {
    let meta_path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&meta_path)
        .with_context(|| format!("cannot read {}: not a ferrotron checkpoint folder", meta_path.display()))?;
    let meta: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", meta_path.display()))?;
    let (Some(step), Some(adam_steps)) = (meta["step"].as_u64(), meta["adam_steps"].as_u64()) else {
        bail!("{}: step or adam_steps is missing", meta_path.display());
    };
    let weights = read_safetensors(&dir.join("model.safetensors"))?;
    let moments = read_safetensors(&dir.join("optimizer.safetensors"))?;
    Ok(Resumed { step: step as usize, adam_steps: adam_steps as u32, weights, moments })
}

impl Resumed {
    /// This rank's model: the checkpoint's tensors, sliced for `tp` and `stage`.
    pub fn model<'g>(&self, cfg: &ModelConfig, tp: Box<dyn TensorSplit + 'g>, stage: Stage) -> Result<Llama<'g>> {
        build_from(&self.weights, cfg, tp, stage, "model.safetensors")
    }

    /// The optimizer for `params` (this rank's slices), at the checkpoint's AdamW step.
    pub fn optimizer(&self, params: &[&Param], (index, count): (usize, usize)) -> Result<Optimizer> {
        let mut moments = Vec::new();
        for p in params {
            let full_shape = match p.split {
                Split::Replicated => p.value.shape().to_vec(),
                Split::Rows => vec![p.value.rows() * count, p.value.cols()],
                Split::Cols => vec![p.value.rows(), p.value.cols() * count],
            };
            let get = |kind: &str| -> Result<Tensor> {
                let t =
                    full_tensor(&self.moments, &format!("{kind}.{}", p.name), &full_shape, "optimizer.safetensors")?;
                Ok(shard(&t, p.split, index, count))
            };
            moments.push((get("exp_avg")?, get("exp_avg_sq")?));
        }
        Ok(Optimizer::restore(moments, self.adam_steps))
    }
}

/// The architecture as a Hugging Face `config.json`.
pub fn hf_config(m: &ModelConfig) -> String {
    let j = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim(),
        "rope_theta": m.rope_theta,
        "rms_norm_eps": m.rms_norm_eps,
        "tie_word_embeddings": m.tie_word_embeddings,
        "initializer_range": m.initializer_range,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    });
    serde_json::to_string_pretty(&j).expect("JSON")
}

fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shape().to_vec(), t.to_vec().iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, shape, b)| {
            Ok((n.as_str(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| anyhow::anyhow!("cannot build safetensors views: {e:?}"))?;
    safetensors::tensor::serialize(views, &None).map_err(|e| anyhow::anyhow!("cannot serialise safetensors: {e:?}"))
}

/// Writes and flushes to disk.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).with_context(|| format!("cannot write {}", path.display()))
}
