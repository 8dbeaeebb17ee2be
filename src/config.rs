//! # Configuration: one TOML file, six sections, overrides from the command line
//!
//! A run is described by `[model]`, `[train]`, `[parallel]`, `[data]`, `[device]` and
//! `[checkpoint]`. Every key has the value written in `configs/tiny.toml` (compiled into the
//! binary) unless your file or a `--set section.key=value` says otherwise, in that order.
//! Unknown keys and wrong types are errors that name the key; `validate` then checks that the
//! values make sense together.

mod table;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use table::{apply_set, first_non_finite, merge, one_line};

/// The longest a rank may be configured to wait for the others (`parallel.timeout_s`): a week.
pub const MAX_TIMEOUT_S: f64 = 604800.0;

/// The built-in default run, `configs/tiny.toml`.
pub const TINY: &str = include_str!("../configs/tiny.toml");

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub parallel: ParallelConfig,
    pub data: DataConfig,
    pub device: DeviceConfig,
    pub checkpoint: CheckpointConfig,
}

/// The Llama architecture; key names follow Hugging Face's `config.json`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Per-head width; when absent, `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    pub rope_theta: f64,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal init of every matrix.
    pub initializer_range: f32,
    /// Start from these weights instead of a random init: a Hugging Face Llama folder whose
    /// config.json matches the keys above. Empty: random init.
    pub init_from: String,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub steps: usize,
    pub seed: u64,
    pub micro_batch_size: usize,
    pub grad_accum_steps: usize,
    pub seq_len: usize,
    /// Peak learning rate, reached after `warmup_steps`.
    pub lr: f32,
    /// The floor the cosine decay ends at, on the last step.
    pub min_lr: f32,
    pub warmup_steps: usize,
    /// Decoupled AdamW decay, applied to matrices only (not to norm weights).
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub adam_eps: f32,
    /// Global gradient-norm clipping threshold; 0 turns clipping off.
    pub grad_clip: f32,
    /// What AdamW keeps its moments in: `f32`, or `bf16` (half the optimizer's memory).
    pub optimizer_dtype: MomentsDtype,
    /// What each block keeps for backward (`model/block.rs`): `none` (everything), `selective`
    /// (not the attention core's output: recomputed from q, k, v), `full` (its input only:
    /// backward runs the block's forward again).
    pub recompute: Recompute,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    None,
    Selective,
    Full,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum MomentsDtype {
    F32,
    Bf16,
}

impl MomentsDtype {
    pub fn dtype(self) -> crate::ops::types::DType {
        match self {
            MomentsDtype::F32 => crate::ops::types::DType::F32,
            MomentsDtype::Bf16 => crate::ops::types::DType::Bf16,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub cp: usize,
    /// With tp > 1: the norms and residuals between the tp layers hold 1/tp of the rows, an
    /// all-gather and a reduce-scatter replacing each all-reduce (`parallel/sequence_parallel.rs`).
    pub sequence_parallel: bool,
    pub pp_schedule: PpSchedule,
    /// With `pp_schedule = "interleaved"`: the model chunks (V ≥ 2) each pipeline rank holds
    /// (`model/stage.rs`); 1 otherwise.
    pub pp_virtual_stages: usize,
    /// How context parallelism cuts each sequence: `zigzag` (balanced) or `contiguous`.
    pub cp_split: CpSplit,
    /// How data-parallel ranks average gradients: `bucketed` (overlapped with backward) or `naive`.
    pub dp_mode: DpMode,
    /// Size of a gradient bucket, in MiB of f32 gradients.
    pub bucket_mb: f64,
    /// What the dp×cp ranks shard instead of replicating (`parallel/zero.rs`): 0 nothing, 1 the
    /// optimizer state, 2 also the gradients, 3 also the weights (FSDP).
    pub zero_stage: usize,
    /// How GPU tensors travel between ranks: `auto` (NCCL when each rank has its own GPU), `local`
    /// (through host memory) or `nccl` (on the device, `comm/tensors.rs`).
    pub backend: CommBackend,
    /// Seconds a rank waits for the others before the run stops with the names of the missing.
    pub timeout_s: f64,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum CpSplit {
    Contiguous,
    Zigzag,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum DpMode {
    Naive,
    Bucketed,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum CommBackend {
    Auto,
    Local,
    Nccl,
}

impl ParallelConfig {
    /// dp × tp × pp × cp (saturating: `Grid::new` refuses a world that large).
    pub fn world_size(&self) -> usize {
        [self.tp, self.pp, self.cp].iter().fold(self.dp, |w, &d| w.saturating_mul(d))
    }
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum PpSchedule {
    Afab,
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B (Megatron): each rank holds `pp_virtual_stages` chunks of layers.
    Interleaved,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `"synthetic"` (built in) or `"text:PATH"` (a UTF-8 file, or JSON lines with a `text` field).
    pub source: String,
    /// Seed of the data stream, separate from the init seed.
    pub seed: u64,
    /// Synthetic source: each token depends on this many previous tokens...
    pub markov_order: usize,
    /// ...through a table allowing this many successors per context.
    pub branching: usize,
    /// Probability that a marker token starts a copy span.
    pub copy_prob: f64,
    /// Length of a copy span.
    pub copy_len: usize,
    /// A copy span repeats the tokens this far back.
    pub copy_lag: usize,
    /// Text sources: `"bytes"`, a path to a Hugging Face `tokenizer.json`, or `"hub:ORG/NAME"`.
    pub tokenizer: String,
}

/// Saving the run as it trains (see `checkpoint/save.rs`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Save every this many steps (and at the end); 0 saves nothing.
    pub every: usize,
    /// Checkpoints go to `dir/step_NNNNNN/`.
    pub dir: String,
    /// How many checkpoints to keep; older ones are deleted once a newer one is complete.
    pub keep: usize,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    pub kind: DeviceKind,
    /// What the GPU computes in: `bf16` (mixed precision: bf16 activations and compute copies of
    /// the weights, fp32 master weights, gradients and AdamW moments), `f32` (f32 throughout, no
    /// TF32: step-by-step comparable with the CPU), or `auto` (bf16 on a GPU, f32 on the CPU).
    pub dtype: DeviceDtype,
    /// Wait for every kernel and GEMM and check it (for debugging: an asynchronous GPU error is
    /// then reported by the op that caused it; slow).
    pub sync_launches: bool,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceDtype {
    Auto,
    F32,
    Bf16,
}

impl DeviceConfig {
    /// The dtype the kernels compute in.
    pub fn compute_dtype(&self) -> crate::ops::types::DType {
        match (self.kind, self.dtype) {
            (DeviceKind::Cuda, DeviceDtype::Auto | DeviceDtype::Bf16) => crate::ops::types::DType::Bf16,
            _ => crate::ops::types::DType::F32,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl ModelConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The number of weights, from the shapes alone (`model/block.rs` and `model/llama.rs` make
    /// them); in f64, so that no config can overflow it.
    pub fn parameter_count(&self) -> f64 {
        let [d, f, hd, v, l, h, kvh] = [
            self.hidden_size,
            self.intermediate_size,
            self.head_dim(),
            self.vocab_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads,
        ]
        .map(|x| x as f64);
        let (q, kv) = (h * hd, kvh * hd);
        let layer = 2.0 * q * d + 2.0 * kv * d + 3.0 * f * d + 2.0 * d; // q, o, k, v, MLP, two norms
        let embeddings = if self.tie_word_embeddings { 1.0 } else { 2.0 } * v * d;
        embeddings + l * layer + d
    }

    /// The checks every model needs, whether it comes from a TOML file or a `config.json`.
    pub fn validate(&self, prefix: &str) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ];
        for (key, v) in positive {
            if v == 0 {
                bail!("{prefix}{key} = 0: it must be at least 1");
            }
        }
        let (h, kv) = (self.num_attention_heads, self.num_key_value_heads);
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(h) {
            bail!("{prefix}hidden_size = {} is not divisible by {prefix}num_attention_heads = {h}: change one, or set {prefix}head_dim", self.hidden_size);
        }
        if !h.is_multiple_of(kv) {
            bail!("{prefix}num_attention_heads = {h} is not a multiple of {prefix}num_key_value_heads = {kv}: grouped-query attention shares each KV head among a whole number of query heads");
        }
        if self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            bail!("{prefix}head_dim = {} must be even and positive: RoPE rotates pairs of features", self.head_dim());
        }
        for (key, v) in [
            ("rope_theta", self.rope_theta),
            ("rms_norm_eps", self.rms_norm_eps as f64),
            ("initializer_range", self.initializer_range as f64),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                bail!("{prefix}{key} = {v}: it must be a positive finite number");
            }
        }
        Ok(())
    }
}

impl Config {
    /// The built-in default (`configs/tiny.toml`) with `--set` overrides.
    pub fn load(path: Option<&Path>, sets: &[String]) -> Result<Config> {
        let mut table: toml::Table = TINY.parse().expect("configs/tiny.toml is valid TOML");
        if let Some(path) = path {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read config file {}: check the path", path.display()))?;
            let user: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                anyhow::anyhow!("{}: not valid TOML: {}", path.display(), one_line(&e.to_string()))
            })?;
            merge(&mut table, user);
        }
        for set in sets {
            apply_set(&mut table, set)?;
        }
        let config: Config = serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
            let where_ = path.map(|p| format!(" (in {} or --set)", p.display())).unwrap_or_default();
            let mut msg = one_line(&e.inner().to_string());
            if let Some(i) = msg.rfind(" in `") {
                msg.truncate(i); // toml repeats the key we already name
            }
            anyhow::anyhow!("config key `{}`: {msg}{where_}", e.path())
        })?;
        config.validate()?;
        Ok(config)
    }

    /// A config recorded as TOML (a checkpoint's), over the built-in defaults: a key added since
    /// it was written takes its default.
    pub fn from_recorded(text: &str) -> Option<Config> {
        let mut table: toml::Table = TINY.parse().expect("configs/tiny.toml is valid TOML");
        merge(&mut table, text.parse().ok()?);
        toml::Value::Table(table).try_into().ok()
    }

    pub fn validate(&self) -> Result<()> {
        let table = toml::Value::try_from(self).context("the config does not serialise")?;
        if let Some((key, v)) = first_non_finite(&table, "") {
            bail!("{key} = {v}: it must be a finite number");
        }
        self.model.validate("model.")?;
        let (t, p) = (&self.train, &self.parallel);
        for (key, v) in [
            ("train.steps", t.steps),
            ("train.micro_batch_size", t.micro_batch_size),
            ("train.grad_accum_steps", t.grad_accum_steps),
            ("train.seq_len", t.seq_len),
            ("parallel.dp", p.dp),
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
            ("parallel.cp", p.cp),
        ] {
            if v == 0 {
                bail!("{key} = 0: it must be at least 1");
            }
        }
        if !(t.lr > 0.0 && t.min_lr >= 0.0 && t.min_lr <= t.lr) {
            bail!("train.lr = {} and train.min_lr = {}: need 0 <= min_lr <= lr and lr > 0", t.lr, t.min_lr);
        }
        if !(0.0..1.0).contains(&t.beta1) || !(0.0..1.0).contains(&t.beta2) {
            bail!("train.beta1 and train.beta2 must lie in [0, 1)");
        }
        if t.adam_eps <= 0.0 {
            bail!("train.adam_eps = {}: it must be positive (it keeps AdamW from dividing by zero)", t.adam_eps);
        }
        for (key, v) in [("train.weight_decay", t.weight_decay), ("train.grad_clip", t.grad_clip)] {
            if v < 0.0 {
                bail!("{key} = {v}: it must be 0 (off) or positive");
            }
        }
        let chunks = if p.cp_split == CpSplit::Zigzag { 2 * p.cp } else { p.cp };
        if p.cp > 1 && !t.seq_len.is_multiple_of(chunks) {
            bail!("train.seq_len = {} does not split into {chunks} equal chunks for parallel.cp = {} (the {:?} split cuts {chunks} chunks): choose a seq_len divisible by {chunks}", t.seq_len, p.cp, p.cp_split);
        }
        if p.pp > self.model.num_hidden_layers {
            bail!(
                "parallel.pp = {} exceeds model.num_hidden_layers = {}: every pipeline stage needs at least one layer",
                p.pp,
                self.model.num_hidden_layers
            );
        }
        let v = p.pp_virtual_stages;
        match (p.pp_schedule, v) {
            (_, 0) => bail!("parallel.pp_virtual_stages = 0: it must be at least 1"),
            (PpSchedule::Interleaved, 1) => bail!("parallel.pp_schedule = \"interleaved\" with parallel.pp_virtual_stages = 1: give each rank at least 2 model chunks (or use \"1f1b\")"),
            (PpSchedule::Afab | PpSchedule::OneFOneB, v) if v > 1 => bail!("parallel.pp_virtual_stages = {v} needs parallel.pp_schedule = \"interleaved\""),
            _ => {}
        }
        if p.pp_schedule == PpSchedule::Interleaved {
            let (layers, m) = (self.model.num_hidden_layers, t.grad_accum_steps);
            if p.pp < 2 {
                bail!("parallel.pp_schedule = \"interleaved\" with parallel.pp = {}: the interleaved schedule needs at least 2 pipeline stages", p.pp);
            }
            if p.pp.saturating_mul(v) > layers {
                bail!("parallel.pp × parallel.pp_virtual_stages = {} × {v} exceeds model.num_hidden_layers = {layers}: every model chunk needs at least one layer", p.pp);
            }
            if !m.is_multiple_of(p.pp) {
                bail!("parallel.pp_schedule = \"interleaved\": train.grad_accum_steps = {m} micro-batches must be a multiple of parallel.pp = {} (they go through the pipeline in groups of pp)", p.pp);
            }
            if p.backend == CommBackend::Nccl {
                bail!("parallel.pp_schedule = \"interleaved\" with parallel.backend = \"nccl\": its messages are not yet paired for NCCL (a large NCCL send waits for its receive); use backend \"local\" or \"auto\", or pp_schedule \"1f1b\"");
            }
        }
        if p.pp > 1 && self.model.tie_word_embeddings {
            bail!("model.tie_word_embeddings = true with parallel.pp = {}: the embedding (first stage) and the output layer (last stage) would need a shared gradient; untie them or set parallel.pp = 1", p.pp);
        }
        let m = &self.model;
        for (key, v) in [
            ("num_attention_heads", m.num_attention_heads),
            ("num_key_value_heads", m.num_key_value_heads),
            ("intermediate_size", m.intermediate_size),
            ("vocab_size", m.vocab_size),
        ] {
            if !v.is_multiple_of(p.tp) {
                bail!("parallel.tp = {} does not divide model.{key} = {v}: tensor parallelism gives each rank whole attention heads, whole KV heads, and equal slices of the MLP and the vocabulary; choose a tp that divides all four", p.tp);
            }
        }
        if p.sequence_parallel {
            if p.tp == 1 {
                bail!("parallel.sequence_parallel = true with parallel.tp = 1: sequence parallelism splits the rows between the tensor-parallel layers over the tp ranks; set parallel.tp > 1 or sequence_parallel = false");
            }
            let rows = t.micro_batch_size * t.seq_len / p.cp;
            if !rows.is_multiple_of(p.tp) {
                bail!("parallel.sequence_parallel = true: a micro-batch's {rows} rows per rank (train.micro_batch_size × train.seq_len / parallel.cp) do not split into parallel.tp = {} equal parts; choose sizes whose product divides by tp", p.tp);
            }
        }
        if !(p.bucket_mb > 0.0 && p.bucket_mb <= 1e6) {
            bail!("parallel.bucket_mb = {}: it must be a positive number of MiB, at most 1e6", p.bucket_mb);
        }
        if p.zero_stage > 3 {
            bail!("parallel.zero_stage = {}: it must be 0 (replicas), 1 (optimizer state sharded), 2 (and gradients) or 3 (and weights: FSDP)", p.zero_stage);
        }
        if p.zero_stage > 0 && p.dp_mode == DpMode::Naive {
            bail!("parallel.dp_mode = \"naive\" with parallel.zero_stage = {}: ZeRO reduce-scatters gradients in buckets; set dp_mode = \"bucketed\" or zero_stage = 0", p.zero_stage);
        }
        if !(p.timeout_s > 0.0 && p.timeout_s <= MAX_TIMEOUT_S) {
            bail!(
                "parallel.timeout_s = {}: it must be a positive number of seconds, at most {MAX_TIMEOUT_S} (a week)",
                p.timeout_s
            );
        }
        if self.checkpoint.dir.trim().is_empty() {
            bail!("checkpoint.dir is empty: name the folder checkpoints go to (a run also saves there when stopped by a signal)");
        }
        if self.device.kind == DeviceKind::Cpu && self.device.dtype == DeviceDtype::Bf16 {
            bail!("device.dtype = \"bf16\" with device.kind = \"cpu\": the CPU backend computes in f32; set device.dtype = \"auto\" or \"f32\", or device.kind = \"cuda\"");
        }
        if self.device.kind == DeviceKind::Cuda && self.model.head_dim() > 128 {
            bail!("model.head_dim = {}: the CUDA attention kernel supports head_dim up to 128; use device.kind = \"cpu\" or a smaller head_dim", self.model.head_dim());
        }
        validate_data(&self.data, &self.model, t.seq_len)
    }
}

/// Checks `[data]` against the model, before anything is read.
fn validate_data(d: &DataConfig, m: &ModelConfig, seq_len: usize) -> Result<()> {
    if d.source.starts_with("text:") || d.source.starts_with("hub:") {
        if d.tokenizer == "bytes" && m.vocab_size < 256 {
            bail!(
                "data.source = \"{}\" uses byte tokens: model.vocab_size must be at least 256 (it is {})",
                d.source,
                m.vocab_size
            );
        }
        return Ok(());
    }
    if d.source != "synthetic" {
        bail!("data.source = \"{}\": use \"synthetic\", \"text:PATH\" or \"hub:ORG/NAME/FILE\"", d.source);
    }
    if d.branching == 0 || d.branching + 2 > m.vocab_size {
        bail!(
            "data.branching = {}: it must be at least 1 and at most model.vocab_size - 2 = {}",
            d.branching,
            m.vocab_size.saturating_sub(2)
        );
    }
    if (m.vocab_size as f64 + 1.0).powi(d.markov_order as i32) > (1 << 22) as f64 {
        bail!("data.markov_order = {} with model.vocab_size = {}: the successor table would be too large; lower the order", d.markov_order, m.vocab_size);
    }
    if !(0.0..1.0).contains(&d.copy_prob) {
        bail!("data.copy_prob = {}: it must lie in [0, 1)", d.copy_prob);
    }
    if d.copy_prob > 0.0 && (d.copy_len == 0 || d.copy_lag == 0 || d.copy_lag >= seq_len) {
        bail!("data.copy_len and data.copy_lag must be at least 1, and data.copy_lag below train.seq_len = {seq_len}");
    }
    Ok(())
}
