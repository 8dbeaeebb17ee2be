//! # Checkpoints: reading a Hugging Face Llama (or Mixtral)
//!
//! A Mixtral folder (`model_type = "mixtral"`) is a Llama whose MLPs are mixtures of experts:
//! `block_sparse_moe.gate` and `block_sparse_moe.experts.N.w1/w2/w3`, as transformers saves them.
//! A Hugging Face checkpoint is a folder with `config.json` (the architecture) and the weights in
//! `model.safetensors`, or split over several files listed in `model.safetensors.index.json`.
//! Because our parameter names are Hugging Face's, loading is a lookup by name with a shape check.
//! Weights stored in bf16 or f16 are widened to f32. A missing `lm_head.weight` means the output
//! layer is tied to the embedding.

use crate::config::{ModelConfig, RopeScaling, RopeType};
use crate::model::stage::Stage;
use crate::model::{Llama, TensorSplit, Whole};
use crate::ops::tensor::Tensor;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;

/// Loads a Hugging Face Llama folder into a model ready for `forward`.
pub fn load_hf(dir: &Path) -> Result<Llama<'static>> {
    let mut cfg = read_hf_config(&dir.join("config.json"))?;
    let mut tensors = read_hf_weights(dir)?;
    if !tensors.contains_key("lm_head.weight") {
        cfg.tie_word_embeddings = true;
    }
    drop_non_weights(&mut tensors, &cfg, dir)?;
    check_tensors(&tensors, &expected_tensors(&cfg), dir, &cfg)?;
    build_from(&tensors, &cfg, Box::new(Whole), Stage::WHOLE, &dir.display().to_string())
}

/// A DeepSeek-V3 folder's multi-token-prediction layers (`num_nextn_predict_layers`; 0 for
/// every other model).
fn mtp_layers(dir: &Path) -> Result<usize> {
    let text = crate::files::read_text(&dir.join("config.json"), "config.json")?;
    let j: Value = serde_json::from_str(&text).unwrap_or(Value::Null); // read_hf_config named any error
    Ok(match j["model_type"].as_str() {
        Some("deepseek_v3") => j["num_nextn_predict_layers"].as_u64().unwrap_or(0) as usize,
        _ => 0,
    })
}

/// Every tensor a folder of the model `cfg` describes holds: its parameters, then its buffers.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let mut all = Llama::tensor_shapes(cfg, Stage::WHOLE);
    all.extend(Llama::buffer_shapes(cfg, Stage::WHOLE));
    all
}

/// Hugging Face folders may store what is not a weight (old RoPE buffers), and a tied model may
/// also store its output layer, a copy of the embedding that transformers ignores: both go. So do
/// a DeepSeek-V3's multi-token-prediction layers (`num_nextn_predict_layers` of them, stored as
/// the layers after the last), which transformers does not run either: said in a note.
fn drop_non_weights(tensors: &mut HashMap<String, Tensor>, cfg: &ModelConfig, dir: &Path) -> Result<()> {
    tensors.retain(|name, _| !name.ends_with("rotary_emb.inv_freq"));
    let (layers, mtp) = (cfg.num_hidden_layers, mtp_layers(dir)?);
    let is_mtp = |name: &str| {
        let layer = name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()?.parse::<usize>().ok());
        layer.is_some_and(|i| i >= layers && i < layers + mtp)
    };
    let before = tensors.len();
    tensors.retain(|name, _| !is_mtp(name));
    if tensors.len() < before {
        let last = layers + mtp - 1;
        crate::say!("note: {}: its multi-token-prediction layers (model.layers.{layers} to {last}, num_nextn_predict_layers = {mtp}) are not part of the model transformers runs, and are dropped", dir.display());
    }
    if cfg.tie_word_embeddings {
        if let Some(head) = tensors.remove("lm_head.weight") {
            let embed = tensors.get("model.embed_tokens.weight");
            if embed.is_some_and(|e| e.host_view() != head.host_view()) {
                bail!("{}: lm_head.weight differs from model.embed_tokens.weight, but tie_word_embeddings = true: the output layer would be dropped; set model.tie_word_embeddings = false", dir.display());
            }
        }
    }
    Ok(())
}

/// Checks that `tensors` are exactly the model's (`expected`: name, full shape): none missing,
/// none left over, the same shapes, every value finite. `source` names them in errors.
pub fn check_tensors(
    tensors: &HashMap<String, Tensor>,
    expected: &[(String, Vec<usize>)],
    source: &Path,
    cfg: &ModelConfig,
) -> Result<()> {
    let file = source.display();
    for (name, shape) in expected {
        let t = tensors.get(name).with_context(|| format!("{file}: tensor {name} is missing"))?;
        if t.shape() != shape {
            bail!("{file}: tensor {name} has shape {:?}, but the config needs {shape:?}", t.shape());
        }
        if t.host_view().iter().any(|x| !x.is_finite()) {
            bail!("{file}: tensor {name} holds NaN or infinite values: the checkpoint is damaged or diverged; use an earlier one");
        }
    }
    let known: HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    let mut left: Vec<&String> = tensors.keys().filter(|n| !known.contains(n.as_str())).collect();
    left.sort();
    if let Some(name) = left.first() {
        let layer = name.split('.').nth(2).and_then(|i| i.parse::<usize>().ok());
        let why = match layer {
            Some(i) if i >= cfg.num_hidden_layers => {
                format!("the checkpoint has more layers than model.num_hidden_layers = {}", cfg.num_hidden_layers)
            }
            _ if name.ends_with("lm_head.weight") && cfg.tie_word_embeddings => {
                "the checkpoint has an output layer of its own, but model.tie_word_embeddings = true".into()
            }
            _ => "it is not part of the configured Llama".into(),
        };
        bail!("{file}: tensor {name} would be left unused: {why}; set the [model] keys to the checkpoint's");
    }
    Ok(())
}

/// The keys of a Llama's, a Mixtral's or a DeepSeek-V3's `config.json`, as transformers' own
/// config classes have them (`tests/fixtures/config_keys.json`), by what ferrotron does with
/// each: none is passed over without a reason (`tests/hf_keys.rs`). Keys transformers does not
/// know, it ignores, and so does ferrotron. DeepSeek-V3's multi-token-prediction layers
/// (`num_nextn_predict_layers`) are not part of the model transformers runs: their tensors, in
/// a folder that has them, are dropped (`drop_non_weights`).
pub mod keys {
    /// Read into the model's config (`ModelConfig`), or deciding which model it is.
    pub const READ: &[&str] = &[
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "rms_norm_eps",
        "tie_word_embeddings",
        "initializer_range",
        "num_local_experts",
        "num_experts_per_tok",
        "router_aux_loss_coef",
        "output_router_logits",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "qk_head_dim",
        "rope_interleave",
        "first_k_dense_replace",
        "n_routed_experts",
        "moe_intermediate_size",
        "n_shared_experts",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
        // RoPE's rescaling for a longer context, and the context it is measured against
        "rope_parameters",
        "rope_scaling",
        "max_position_embeddings",
    ];
    /// Change the math where they leave their default: refused then, naming the key.
    pub const REFUSED_UNLESS_DEFAULT: &[&str] = &[
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "attention_dropout",
        "router_jitter_noise",
        "sliding_window",
        "quantization_config",
    ];
    /// Not the model's math: names, special token ids (`eos_token_id`: `generate`), the dtype
    /// the weights were saved in (they are widened to f32), how transformers returns outputs,
    /// and `pretraining_tp` (transformers 5 ignores it; in 4 it only cut the same GEMMs in parts).
    pub const NOT_MATH: &[&str] = &[
        "_name_or_path",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "id2label",
        "label2id",
        "problem_type",
        "is_encoder_decoder",
        "chunk_size_feed_forward",
        "pretraining_tp",
        "num_nextn_predict_layers",
    ];
}

/// Reads the architecture from a Hugging Face `config.json`.
pub fn read_hf_config(path: &Path) -> Result<ModelConfig> {
    if !path.exists() {
        bail!("cannot read {}: a Hugging Face model folder needs config.json", path.display());
    }
    let text = crate::files::read_text(path, "config.json")?; // a FIFO or a folder: refused there
    let j: Value =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: not valid JSON: {e}", path.display()))?;
    let file = path.display();
    // A key may be absent (or null): transformers' default then. Present with another type (a
    // string "500000.0", as some exported configs have) is an error, never read as absent.
    let at = |key: &str| key.split_once('.').map_or(&j[key], |(outer, inner)| &j[outer][inner]);
    let typed = |key: &str, want: &str, read: &dyn Fn(&Value) -> bool| -> Result<Option<&Value>> {
        match at(key) {
            Value::Null => Ok(None),
            v if read(v) => Ok(Some(v)),
            v => bail!("{file}: {key} = {v} is not {want}; write it as {want} (or leave it out for the default)"),
        }
    };
    let opt_size = |key: &str| -> Result<Option<usize>> {
        Ok(typed(key, "a whole number", &|v| v.is_u64())?.and_then(Value::as_u64).map(|n| n as usize))
    };
    let size = |key: &str| -> Result<usize> {
        opt_size(key)?
            .with_context(|| format!("{file}: {key} is missing; a Llama config.json gives it as a whole number"))
    };
    let number =
        |key: &str| -> Result<Option<f64>> { Ok(typed(key, "a number", &|v| v.is_number())?.and_then(Value::as_f64)) };
    let flag = |key: &str| -> Result<Option<bool>> {
        Ok(typed(key, "true or false", &|v| v.is_boolean())?.and_then(Value::as_bool))
    };
    let text =
        |key: &str| -> Result<Option<&str>> { Ok(typed(key, "a string", &|v| v.is_string())?.and_then(Value::as_str)) };

    let model_type = text("model_type")?.unwrap_or("llama");
    let (mixtral, deepseek) = match model_type {
        "llama" => (false, false),
        "mixtral" => (true, false),
        "deepseek_v3" => (false, true),
        _ => bail!("{file}: model_type is \"{model_type}\"; only Llama, Mixtral and DeepSeek-V3 models are supported"),
    };
    // DeepSeekMoE: the layers from first_k_dense_replace on hold routed and shared experts
    // (transformers' defaults where a key is absent); none, and every layer is dense
    let dense_below = opt_size("first_k_dense_replace")?.unwrap_or(3);
    let routed = if deepseek { opt_size("n_routed_experts")?.unwrap_or(256) } else { 0 };
    let moe = routed > 0 && dense_below < size("num_hidden_layers")?;
    if let Some(noise) = number("router_jitter_noise")?.filter(|x| mixtral && *x != 0.0) {
        bail!("{file}: router_jitter_noise = {noise} is not supported (ferrotron's router has no noise); set it to 0");
    }
    for key in ["attention_bias", "mlp_bias"] {
        if flag(key)? == Some(true) {
            bail!("{file}: {key} = true is not supported (ferrotron's Llama has no biases)");
        }
    }
    if let Some(act) = text("hidden_act")?.filter(|a| *a != "silu") {
        bail!("{file}: hidden_act = \"{act}\" is not supported; Llama uses \"silu\"");
    }
    // RoPE's frequencies, as transformers 5 reads them: the `rope_scaling` dict when there is
    // one (transformers 4's name, which real DeepSeek-V3 folders use), else `rope_parameters`;
    // its type under "rope_type" or "type"; the keys a kind leaves out, transformers' defaults
    let dict =
        if j["rope_scaling"].as_object().is_some_and(|d| !d.is_empty()) { "rope_scaling" } else { "rope_parameters" };
    let inner = |k: &str| format!("{dict}.{k}");
    let kind = text(&inner("rope_type"))?.or(text(&inner("type"))?).unwrap_or("default");
    let rope_type = match kind {
        "default" => RopeType::Default,
        "linear" => RopeType::Linear,
        "yarn" => RopeType::Yarn,
        "llama3" => RopeType::Llama3,
        other => bail!("{file}: {dict}.rope_type = \"{other}\" is not supported (ferrotron rescales RoPE as \"linear\", \"yarn\" or \"llama3\"); use a model without it"),
    };
    for key in [inner("partial_rotary_factor"), "partial_rotary_factor".into()] {
        if let Some(part) = number(&key)?.filter(|p| *p != 1.0) {
            bail!("{file}: {key} = {part} is not supported (ferrotron's RoPE turns the whole head); use a model without it");
        }
    }
    let rope_scaling = if rope_type == RopeType::Default {
        RopeScaling::PLAIN
    } else {
        // the context trained on: a top-level key first (as transformers gives it priority), then
        // the dict's, then max_position_embeddings (its class default where absent)
        let max_positions = opt_size("max_position_embeddings")?.unwrap_or(match (mixtral, deepseek) {
            (true, _) => 131072,
            (_, true) => 4096,
            _ => 2048,
        });
        let original = match opt_size("original_max_position_embeddings")? {
            Some(n) => n,
            None => opt_size(&inner("original_max_position_embeddings"))?.unwrap_or(max_positions),
        };
        let needs = |key: &str| -> Result<f64> {
            number(&inner(key))?
                .with_context(|| format!("{file}: {dict}.{key} is missing; rope_type \"{kind}\" needs it"))
        };
        let d = RopeScaling::PLAIN;
        let yarn = rope_type == RopeType::Yarn;
        let llama3 = rope_type == RopeType::Llama3;
        let or_default = |key: &str, default: f64| -> Result<f64> {
            Ok(number(&inner(key))?.filter(|x| *x != 0.0).unwrap_or(default)) // Python's `or`: 0 is absent
        };
        RopeScaling {
            rope_type,
            factor: match number(&inner("factor"))? {
                Some(f) => f,
                None if yarn => max_positions as f64 / original.max(1) as f64,
                None => needs("factor")?,
            },
            original_max_position_embeddings: if yarn || llama3 { original } else { 0 },
            attention_factor: if yarn { number(&inner("attention_factor"))?.unwrap_or(0.0) } else { 0.0 },
            beta_fast: if yarn { or_default("beta_fast", d.beta_fast)? } else { d.beta_fast },
            beta_slow: if yarn { or_default("beta_slow", d.beta_slow)? } else { d.beta_slow },
            mscale: if yarn { number(&inner("mscale"))?.unwrap_or(0.0) } else { 0.0 },
            mscale_all_dim: number(&inner("mscale_all_dim"))?.unwrap_or(0.0),
            truncate: if yarn { flag(&inner("truncate"))?.unwrap_or(true) } else { true },
            low_freq_factor: if llama3 { needs("low_freq_factor")? } else { d.low_freq_factor },
            high_freq_factor: if llama3 { needs("high_freq_factor")? } else { d.high_freq_factor },
        }
    };
    if let Some(v) = number("attention_dropout")?.filter(|x| *x != 0.0) {
        bail!("{file}: attention_dropout = {v} is not supported (ferrotron's attention has no dropout); set it to 0");
    }
    if let Some(w) = opt_size("sliding_window")?.filter(|_| mixtral) {
        bail!("{file}: sliding_window = {w} is not supported (ferrotron's attention sees every earlier token); set it to null");
    }
    if !j["quantization_config"].is_null() {
        bail!("{file}: quantization_config is set: quantised weights are not supported; use the model's unquantised weights");
    }
    let heads = size("num_attention_heads")?;
    // DeepSeek-V3's latent attention (transformers' defaults where a key is absent); its
    // head_dim is derived (transformers writes qk_rope_head_dim there), and so is qk_head_dim
    let latent = |key: &str, default: usize| -> Result<usize> {
        Ok(if deepseek { opt_size(key)?.unwrap_or(default) } else { 0 })
    };
    let (nope, rope) = (latent("qk_nope_head_dim", 128)?, latent("qk_rope_head_dim", 64)?);
    if let Some(qk) = opt_size("qk_head_dim")?.filter(|&qk| deepseek && qk != nope + rope) {
        bail!(
            "{file}: qk_head_dim = {qk}, but qk_nope_head_dim + qk_rope_head_dim = {}: the folder contradicts itself",
            nope + rope
        );
    }
    let cfg = ModelConfig {
        vocab_size: size("vocab_size")?,
        hidden_size: size("hidden_size")?,
        intermediate_size: size("intermediate_size")?,
        num_hidden_layers: size("num_hidden_layers")?,
        num_attention_heads: heads,
        num_key_value_heads: opt_size("num_key_value_heads")?.unwrap_or(heads),
        head_dim: if deepseek { None } else { opt_size("head_dim")? },
        rope_theta: number(&inner("rope_theta"))?.or(number("rope_theta")?).unwrap_or(10000.0),
        rms_norm_eps: number("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        tie_word_embeddings: flag("tie_word_embeddings")?.unwrap_or(false),
        initializer_range: number("initializer_range")?.unwrap_or(0.02) as f32,
        num_local_experts: if mixtral {
            size("num_local_experts")?
        } else if moe {
            routed
        } else {
            0
        },
        num_experts_per_tok: match (mixtral, moe) {
            (true, _) => size("num_experts_per_tok")?,
            (_, true) => opt_size("num_experts_per_tok")?.unwrap_or(8),
            _ => 0,
        },
        // transformers adds the balance loss only when the router logits are asked for (and
        // never to DeepSeek-V3's, which balances by its bias)
        router_aux_loss_coef: match flag("output_router_logits")? {
            Some(true) if mixtral => number("router_aux_loss_coef")?.unwrap_or(0.001) as f32,
            _ => 0.0,
        },
        moe_intermediate_size: if moe { opt_size("moe_intermediate_size")?.unwrap_or(2048) } else { 0 },
        n_shared_experts: if moe { opt_size("n_shared_experts")?.unwrap_or(1) } else { 0 },
        first_k_dense_replace: if moe { dense_below } else { 0 },
        n_group: if moe { opt_size("n_group")?.unwrap_or(8) } else { 1 },
        topk_group: if moe { opt_size("topk_group")?.unwrap_or(4) } else { 1 },
        norm_topk_prob: if moe { flag("norm_topk_prob")?.unwrap_or(true) } else { true },
        routed_scaling_factor: if moe { number("routed_scaling_factor")?.unwrap_or(2.5) as f32 } else { 1.0 },
        bias_update_speed: 0.0, // evaluating a folder moves no bias; training sets it
        seq_aux_loss_coef: 0.0, // transformers' DeepSeek-V3 adds no balance loss
        kv_lora_rank: latent("kv_lora_rank", 512)?,
        q_lora_rank: if deepseek && !j["q_lora_rank"].is_null() { latent("q_lora_rank", 1536)? } else { 0 },
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope,
        v_head_dim: latent("v_head_dim", 128)?,
        rope_interleave: flag("rope_interleave")?.unwrap_or(true),
        rope_scaling,
        init_from: String::new(),
    };
    cfg.validate(&format!("{file}: "))?;
    Ok(cfg)
}

/// All tensors of a checkpoint folder, from one safetensors file or a sharded set.
pub fn read_hf_weights(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return read_safetensors(&dir.join("model.safetensors"));
    }
    let text = crate::files::read_text(&index, "the safetensors index")?;
    let j: Value =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: not valid JSON: {e}", index.display()))?;
    let Some(map) = j["weight_map"].as_object() else {
        bail!("{}: no weight_map object", index.display());
    };
    let files: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
    let mut all = HashMap::new();
    for f in files {
        all.extend(read_safetensors(&dir.join(f))?);
    }
    Ok(all)
}

/// Every tensor of a safetensors file, widened to f32.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    use safetensors::Dtype;
    let bytes = crate::files::read_bytes(path, "safetensors")?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not a valid safetensors file ({}); re-download or re-export it",
            path.display(),
            damage(&e)
        )
    })?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => raw.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F16 => raw.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => bail!("{}: tensor {name} has dtype {other:?}; expected F32, BF16 or F16", path.display()),
        };
        out.insert(name, Tensor::from_vec(view.shape(), data));
    }
    Ok(out)
}

/// What is wrong with a safetensors file, in words (the library's errors print as Rust names).
fn damage(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => "it is too short to hold a header: empty or cut off".into(),
        E::InvalidHeaderLength => "the header length in its first 8 bytes does not fit the file: cut off".into(),
        E::HeaderTooLarge => "its first 8 bytes give an impossible header size".into(),
        E::InvalidHeader | E::InvalidHeaderStart | E::InvalidHeaderDeserialization | E::JsonError(_) => {
            "its header is not the JSON table of tensors".into()
        }
        E::MetadataIncompleteBuffer => "its tensors do not cover its bytes: cut off, or with bytes added".into(),
        E::InvalidOffset(name) => format!(
            "tensor {name}'s bytes do not start where the tensor before it ends (safetensors gives each tensor its own bytes, in order: shared, overlapping or out-of-order offsets are not a valid file)"
        ),
        E::TensorNotFound(name) => format!("it has no tensor {name}"),
        E::TensorInvalidInfo | E::InvalidTensorView(..) | E::ValidationOverflow => {
            "a tensor's shape and dtype do not match its bytes".into()
        }
        E::IoError(io) => io.to_string(),
    }
}

/// This rank's part (tp slice, pipeline stage) of a model whose full tensors are `weights`;
/// `source` names them in errors.
pub fn build_from<'g>(
    weights: &HashMap<String, Tensor>,
    cfg: &ModelConfig,
    tp: Box<dyn TensorSplit + 'g>,
    stage: Stage,
    source: &str,
) -> Result<Llama<'g>> {
    Llama::build(cfg, tp, stage, |name, shape, _| full_tensor(weights, name, shape, source))
}

/// The tensor `name`, checked against the shape the config needs.
pub fn full_tensor(tensors: &HashMap<String, Tensor>, name: &str, shape: &[usize], source: &str) -> Result<Tensor> {
    let t = tensors.get(name).with_context(|| format!("{source}: tensor {name} is missing"))?;
    if t.shape() != shape {
        bail!("{source}: tensor {name} has shape {:?}, but the config needs {shape:?}", t.shape());
    }
    Ok(t.clone())
}

/// The `[model]` keys a run does not take from its `model.init_from` folder: how to initialise
/// (the folder's weights replace it), and the training aids (the balance loss, the bias's step).
const NOT_INHERITED: [&str; 5] =
    ["initializer_range", "init_from", "router_aux_loss_coef", "bias_update_speed", "seq_aux_loss_coef"];

/// The folder `model.init_from` names: a path, or a Hub model (`hub:ID`) in the local cache.
fn folder_of(init_from: &str) -> Result<std::path::PathBuf> {
    match init_from.strip_prefix("hub:") {
        Some(id) => crate::data::hf_hub::model_dir(id),
        None => Ok(std::path::PathBuf::from(init_from)),
    }
}

/// The `[model]` keys of the folder `init_from` names, as a config inherits them
/// (`Config::load_with`): its config.json read as ferrotron reads it, less the keys a run never
/// takes from it, and less a head_dim that is the one the other keys imply.
pub fn model_keys_of(init_from: &str) -> Result<toml::Table> {
    let theirs = read_hf_config(&folder_of(init_from)?.join("config.json"))?;
    let mut keys = toml::Table::try_from(&theirs)?;
    keys.retain(|k, _| !NOT_INHERITED.contains(&k));
    if theirs.head_dim == Some(theirs.hidden_size / theirs.num_attention_heads.max(1)) {
        keys.remove("head_dim"); // implied: a run that leaves it out is the same model
    }
    Ok(keys)
}

/// The weights of `model.init_from`, after checking that its config.json is the configured
/// architecture.
pub fn pretrained(cfg: &ModelConfig) -> Result<HashMap<String, Tensor>> {
    let dir = folder_of(&cfg.init_from)?;
    let dir = dir.as_path();
    let theirs = read_hf_config(&dir.join("config.json"))?;
    let (a, b) = (toml::Table::try_from(cfg)?, toml::Table::try_from(&theirs)?);
    for (key, mine) in a.iter().filter(|(k, _)| !NOT_INHERITED.contains(&k.as_str())) {
        let other = b.get(key);
        let same = match (mine, other) {
            (toml::Value::Float(x), Some(toml::Value::Float(y))) => (x - y).abs() <= 1e-6 * x.abs().max(1e-30),
            _ => Some(mine) == other,
        };
        if !same {
            let other = other.map_or("absent".to_string(), |v| v.to_string());
            bail!("model.init_from = {}: its config.json has {key} = {other}, but model.{key} = {mine}; set the [model] keys to the checkpoint's", dir.display());
        }
    }
    let mut tensors = read_hf_weights(dir)?;
    drop_non_weights(&mut tensors, cfg, dir)?;
    check_tensors(&tensors, &expected_tensors(cfg), dir, cfg)?;
    Ok(tensors)
}
