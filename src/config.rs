//! # Configuration: one TOML file, seven sections, overrides from the command line
//!
//! A run is described by `[model]`, `[train]`, `[parallel]`, `[data]`, `[device]`,
//! `[checkpoint]` and `[validation]`. Every key has the value written in `configs/tiny.toml` (compiled into the
//! binary) unless your file or a `--set section.key=value` says otherwise, in that order.
//! Unknown keys and wrong types are errors that name the key; `validate` (`config/checks.rs`)
//! then checks that the values make sense together.

mod checks;
mod table;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::Path;
use table::{apply_set, merge, one_line, plain_words, renamed};

/// The longest a rank may be configured to wait for the others (`parallel.timeout_s`): a week.
pub const MAX_TIMEOUT_S: f64 = 604800.0;

/// The most tokens a sample while training may add (`train.sample_tokens`): its KV cache grows
/// with them on rank 0.
pub const MAX_SAMPLE_TOKENS: usize = 4096;
/// The most Newton–Schulz iterations a Muon update may take (5 is usual; PyTorch refuses 100).
pub const MAX_NS_STEPS: usize = 99;

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
    pub validation: ValidationConfig,
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
    /// Experts in each block's MLP (a Mixtral mixture of experts, `model/moe.rs`); 0: the dense
    /// Llama MLP.
    pub num_local_experts: usize,
    /// Experts each token goes to (top-k of the router), with `num_local_experts` > 0.
    pub num_experts_per_tok: usize,
    /// Weight of the Switch load-balancing loss added to the cross-entropy; 0: off (as in
    /// transformers' default training path).
    pub router_aux_loss_coef: f32,
    /// Multi-head latent attention (DeepSeek-V3's, `model/latent_attention.rs`) when > 0: the
    /// width of the latent each token's keys and values are made from; 0: grouped-query attention.
    pub kv_lora_rank: usize,
    /// With MLA, the query's own latent width; 0: one `q_proj` (Hugging Face's null).
    pub q_lora_rank: usize,
    /// With MLA, per head: the query/key part without position, the rotated part (one key for
    /// every head), the value.
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// With MLA, RoPE's pairs: interleaved (x₂ᵢ, x₂ᵢ₊₁), DeepSeek's layout; false: split halves.
    pub rope_interleave: bool,
    /// DeepSeekMoE (`model/moe.rs`) when > 0: each of the `num_local_experts` routed experts is
    /// this wide, its router scores by sigmoid and balances with a bias; 0: Mixtral's experts
    /// (`intermediate_size` wide, softmax router).
    pub moe_intermediate_size: usize,
    /// With DeepSeekMoE: experts every token goes through (one SwiGLU this many experts wide).
    pub n_shared_experts: usize,
    /// With DeepSeekMoE: the first this many layers keep a dense MLP (`intermediate_size`).
    pub first_k_dense_replace: usize,
    /// With DeepSeekMoE: the experts in `n_group` groups; a token's experts come from its
    /// `topk_group` best groups.
    pub n_group: usize,
    pub topk_group: usize,
    /// With DeepSeekMoE: the chosen experts' scores divided by their sum (then scaled).
    pub norm_topk_prob: bool,
    /// With DeepSeekMoE: the factor on the chosen experts' weights.
    pub routed_scaling_factor: f32,
    /// With DeepSeekMoE: γ of the auxiliary-loss-free balancing, each expert's bias moved by
    /// ±γ after every step towards the mean load (DeepSeek-V3 trained with 0.001); 0: the bias
    /// stays as loaded.
    pub bias_update_speed: f32,
    /// With DeepSeekMoE: α of its complementary sequence-wise balance loss, per MoE layer and
    /// training sequence α · Σ_e f_e · P_e (DeepSeek-V3 trained with 0.0001); 0: off.
    pub seq_aux_loss_coef: f32,
    /// RoPE's frequencies for a context longer than the one trained on (`ops/rope_scaling.rs`):
    /// `[model.rope_scaling]`, Hugging Face's `rope_scaling` (or `rope_parameters`) dict.
    pub rope_scaling: RopeScaling,
    /// Start from these weights instead of a random init: a Hugging Face Llama folder whose
    /// config.json matches the keys above. Empty: random init.
    pub init_from: String,
}

/// How RoPE's frequencies are rescaled (`ops/rope_scaling.rs`), with Hugging Face's names; a key
/// another kind does not read keeps its default.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// `default` (plain RoPE), `linear`, `yarn` (DeepSeek-V3's) or `llama3`.
    pub rope_type: RopeType,
    /// How many times longer the context is than the one trained on (linear, yarn, llama3).
    pub factor: f64,
    /// The context length trained on (yarn, llama3).
    pub original_max_position_embeddings: usize,
    /// yarn: the factor on cos and sin; 0: derived from `factor` (and `mscale`, `mscale_all_dim`).
    pub attention_factor: f64,
    /// yarn: the rotations per original context above which a pair keeps its frequency
    /// (`beta_fast`), below which it is divided by `factor` (`beta_slow`); a ramp between.
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// yarn: the terms of the derived `attention_factor`, and DeepSeek's softmax scale
    /// (× (0.1·`mscale_all_dim`·ln `factor` + 1)²); 0: absent.
    pub mscale: f64,
    pub mscale_all_dim: f64,
    /// yarn: the ramp's ends rounded outwards to whole pairs.
    pub truncate: bool,
    /// llama3: wavelengths above original / `low_freq_factor` are divided by `factor`, below
    /// original / `high_freq_factor` kept, and smoothly between.
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
}

impl RopeScaling {
    /// Plain RoPE: the values `configs/tiny.toml` gives.
    pub const PLAIN: RopeScaling = RopeScaling {
        rope_type: RopeType::Default,
        factor: 1.0,
        original_max_position_embeddings: 0,
        attention_factor: 0.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 0.0,
        mscale_all_dim: 0.0,
        truncate: true,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
    };
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RopeType {
    Default,
    Linear,
    Yarn,
    Llama3,
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
    /// What AdamW keeps its moments in (and Muon its momentum): `f32`, or `bf16` (half the
    /// optimizer's memory).
    pub optimizer_dtype: F32OrBf16,
    /// What updates the blocks' matrices: `adamw`, or `muon` (`model/muon.rs`: momentum made
    /// orthogonal by Newton–Schulz; everything else stays with AdamW).
    pub optimizer: OptimizerKind,
    /// Muon's peak learning rate; its rate at a step is `muon_lr × lr_at(step) / lr` (the same
    /// warmup and cosine).
    pub muon_lr: f32,
    /// Muon's momentum μ, and whether its update looks ahead (Nesterov).
    pub muon_momentum: f32,
    pub muon_nesterov: bool,
    /// Newton–Schulz iterations per update.
    pub muon_ns_steps: usize,
    /// How Muon's rate follows a matrix's shape: `original` (× √max(1, rows/cols)),
    /// `match_rms_adamw` (× 0.2·√max(rows, cols)) or `spectral_unclamped` (× √(rows/cols)).
    pub muon_adjust_lr: MuonAdjustLr,
    /// What each block keeps for backward (`model/block.rs`): `none` (everything), `selective`
    /// (not the attention core's output: recomputed from q, k, v), `full` (its input only:
    /// backward runs the block's forward again).
    pub recompute: Recompute,
    /// The loss without the logits (`model/fused_loss.rs`): > 0 computes the output layer, the
    /// loss and its gradient this many rows at a time in forward, never holding the whole
    /// `rows × vocab` logits (a *stripe* of rows at a time); 0 keeps them whole for backward.
    pub loss_stripe_rows: usize,
    /// Every this many steps (and after the last), a greedy continuation of `sample_prompt`
    /// printed and kept in the metrics (`train/sample.rs`); 0: never.
    pub sample_every: usize,
    /// The text a sample continues (through `data.tokenizer`); empty: the first tokens of the
    /// held-out data.
    pub sample_prompt: String,
    /// How many tokens each sample adds.
    pub sample_tokens: usize,
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
pub enum OptimizerKind {
    Adamw,
    Muon,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum MuonAdjustLr {
    Original,
    MatchRmsAdamw,
    SpectralUnclamped,
}

/// A number format a setting picks: f32, or bf16 (half the bytes, 8 bits of mantissa).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum F32OrBf16 {
    F32,
    Bf16,
}

impl F32OrBf16 {
    pub fn dtype(self) -> crate::ops::types::DType {
        match self {
            F32OrBf16::F32 => crate::ops::types::DType::F32,
            F32OrBf16::Bf16 => crate::ops::types::DType::Bf16,
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
    /// Expert-parallel ranks: the experts are divided among `ep` ranks of the dp×cp group, and
    /// tokens travel to their experts' rank with an all-to-all (`parallel/expert_parallel.rs`).
    pub ep: usize,
    /// With tp > 1: the norms and residuals between the tp layers hold 1/tp of the rows, an
    /// all-gather and a reduce-scatter replacing each all-reduce (`parallel/sequence_parallel.rs`).
    pub sequence_parallel: bool,
    pub pp_schedule: PpSchedule,
    /// With `pp_schedule = "interleaved"`: the model chunks (V ≥ 2) each pipeline rank holds
    /// (`model/stage.rs`); 1 otherwise.
    pub pp_virtual_stages: usize,
    /// How context parallelism cuts each sequence: `zigzag` (balanced) or `contiguous`.
    pub cp_split: CpSplit,
    /// How context parallelism attends across the split: `ring` (keys and values passed around,
    /// `parallel/context_parallel.rs`) or `ulysses` (an all-to-all to a head split and back,
    /// `parallel/ulysses.rs`).
    pub cp_mode: CpMode,
    /// How data-parallel ranks average gradients: `bucketed` (overlapped with backward) or `naive`.
    pub dp_mode: DpMode,
    /// Size of a gradient bucket, in MiB of f32 gradients.
    pub bucket_mb: f64,
    /// What the dp×cp ranks shard instead of replicating (`parallel/zero.rs`): 0 nothing, 1 the
    /// optimizer state, 2 also the gradients, 3 also the weights (FSDP).
    pub zero_stage: usize,
    /// When ZeRO-2 and 3 reduce-scatter the gradients: `every_micro_batch` (each micro-batch's,
    /// the full gradients freed as they are packed) or `once` (kept whole and accumulated across
    /// the step's micro-batches, reduce-scattered after the last one's backward: less traffic,
    /// more memory). ZeRO-0 and 1 reduce once a step either way.
    pub zero_reduce: ZeroReduce,
    /// What the data-parallel gradient reduction moves (the dense all-reduce's buckets, ZeRO's
    /// reduce-scatters): `f32`, or `bf16` (half the bytes: each bucket converted for the wire and
    /// back, the step's sums kept in f32).
    pub reduce_dtype: F32OrBf16,
    /// Hybrid sharding (HSDP): ZeRO shards within groups of `dp_shard` dp replicas and the groups
    /// replicate each other (gradients reduce-scattered inside a group, all-reduced across);
    /// 0: all of dp (plain ZeRO).
    pub dp_shard: usize,
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
pub enum CpMode {
    Ring,
    Ulysses,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum DpMode {
    Naive,
    Bucketed,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum ZeroReduce {
    EveryMicroBatch,
    Once,
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

    /// The backend this run asks for: `auto` stays local under the interleaved and zero-bubble
    /// pipelines, whose messages are not paired for NCCL yet.
    pub fn backend_asked(&self) -> CommBackend {
        match self.pp_schedule {
            s if s.unpaired() && self.backend == CommBackend::Auto => CommBackend::Local,
            _ => self.backend,
        }
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
    /// Zero bubble H1 (Qi et al.): 1F1B with each backward split into B (input gradient) and a
    /// later W (weight gradients); a third of 1F1B's bubble for the same peak memory.
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// The V-shaped zero-bubble schedule: two chunks per rank (`model/stage.rs`), B and W split.
    Zbv,
}

impl PpSchedule {
    /// Whether its backwards are split into B and a later W (`model/deferred_grads.rs`).
    pub fn splits_backward(self) -> bool {
        matches!(self, PpSchedule::ZbH1 | PpSchedule::Zbv)
    }

    /// Whether it walks an action list whose messages are not paired for NCCL (interleaved, the
    /// zero-bubble ones).
    pub fn unpaired(self) -> bool {
        matches!(self, PpSchedule::Interleaved | PpSchedule::ZbH1 | PpSchedule::Zbv)
    }

    /// Its name in the config.
    pub fn name(self) -> &'static str {
        match self {
            PpSchedule::Afab => "afab",
            PpSchedule::OneFOneB => "1f1b",
            PpSchedule::Interleaved => "interleaved",
            PpSchedule::ZbH1 => "zb-h1",
            PpSchedule::Zbv => "zbv",
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `"synthetic"` (built in), `"text:PATH"` (a text, JSON-lines or parquet file, a folder of
    /// them, or a glob) or `"hub:ORG/NAME/FILE"` (a dataset file or glob on the Hugging Face Hub).
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
    /// Where text sources' token files go; `""`: `$FERROTRON_CACHE`, else
    /// `$XDG_CACHE_HOME/ferrotron`, else `~/.cache/ferrotron`.
    pub cache_dir: String,
    /// Text sources: the field of a JSON line, or the column of a parquet row, that holds the text.
    #[serde(default = "text_column")]
    pub text_column: String,
}

fn text_column() -> String {
    "text".into()
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

/// The loss on held-out data while training (see `train/validate.rs`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ValidationConfig {
    /// Every this many steps (and after the last); 0: never.
    pub every: usize,
    /// Held-out batches per validation, each the size of the global batch (`micro_batch_size ×
    /// grad_accum_steps × dp` sequences, whatever the layout).
    pub batches: usize,
    /// Of a text source, the share at its end held out (not trained on) while `every > 0`.
    pub split: f64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    pub kind: DeviceKind,
    /// What the device computes in: `bf16` (mixed precision: bf16 activations and compute
    /// copies of the weights, fp32 master weights, gradients and AdamW moments), `fp8` (the same,
    /// with the blocks' linear layers' GEMMs in FP8: E4M3 weights and activations, E5M2
    /// gradients, per-tensor current scaling; `ops/fp8.rs`), `f32` (f32 throughout, no TF32:
    /// step-by-step comparable with the CPU), or `auto` (bf16 on a GPU, f32 on the CPU). The CPU
    /// computes in f32 and emulates `bf16` and `fp8` where they change the numbers most: it rounds
    /// every linear layer's GEMM operands and output as the GPU would.
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
    Fp8,
}

impl DeviceConfig {
    /// The dtype the kernels compute in.
    pub fn compute_dtype(&self) -> crate::ops::types::DType {
        match (self.kind, self.dtype) {
            (DeviceKind::Cuda, DeviceDtype::Auto | DeviceDtype::Bf16 | DeviceDtype::Fp8) => {
                crate::ops::types::DType::Bf16
            }
            _ => crate::ops::types::DType::F32,
        }
    }

    /// What the linear layers' GEMMs read: the compute dtype, or FP8 (on the CPU, emulated).
    pub fn gemms(&self) -> crate::ops::precision::Precision {
        use crate::ops::precision::Precision;
        match (self.kind, self.dtype) {
            (_, DeviceDtype::Fp8) => Precision::Fp8,
            (_, DeviceDtype::Bf16) | (DeviceKind::Cuda, DeviceDtype::Auto) => Precision::Bf16,
            _ => Precision::F32,
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
        if self.kv_lora_rank > 0 {
            return self.qk_nope_head_dim + self.qk_rope_head_dim; // MLA: a query's (and key's) head
        }
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The KV heads one of `tp` tensor-parallel ranks attends with: its share of them, or one (a
    /// copy of the head its query heads read) when the KV heads are fewer than the ranks.
    pub fn kv_heads_on(&self, tp: usize) -> usize {
        (self.num_key_value_heads / tp.max(1)).max(1)
    }

    /// The head width the attention core computes in: `head_dim`, or latent attention's query/key
    /// and value heads padded to the wider of the two (`model/latent_attention.rs`).
    pub fn core_head_dim(&self) -> usize {
        match self.kv_lora_rank {
            0 => self.head_dim(),
            _ => self.head_dim().max(self.v_head_dim),
        }
    }

    /// Latent attention's shapes, when its latent is (`kv_lora_rank` > 0); `None`: GQA.
    pub fn latent(&self) -> Option<Latent> {
        (self.kv_lora_rank > 0).then_some(Latent {
            kv_rank: self.kv_lora_rank,
            q_rank: self.q_lora_rank,
            nope: self.qk_nope_head_dim,
            rope: self.qk_rope_head_dim,
            v: self.v_head_dim,
        })
    }

    /// DeepSeekMoE's settings, when its experts are (`moe_intermediate_size` > 0); `None`: Mixtral's.
    pub fn deepseek_moe(&self) -> Option<DeepSeekMoe> {
        (self.moe_intermediate_size > 0).then_some(DeepSeekMoe {
            width: self.moe_intermediate_size,
            shared: self.n_shared_experts,
            dense_below: self.first_k_dense_replace,
            groups: self.n_group,
            kept: self.topk_group,
            norm: self.norm_topk_prob,
            scale: self.routed_scaling_factor,
            speed: self.bias_update_speed,
            seq_coef: self.seq_aux_loss_coef,
        })
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
        let mlp = match (self.num_local_experts as f64, self.moe_intermediate_size as f64) {
            (0.0, _) => 3.0 * f * d,
            (e, 0.0) => e * 3.0 * f * d + e * d, // the experts and the router
            (e, fe) => {
                // DeepSeekMoE: the routed experts, the router, the shared experts; the first
                // layers dense
                let moe = e * 3.0 * fe * d + e * d + 3.0 * fe * self.n_shared_experts as f64 * d;
                let dense = (self.first_k_dense_replace.min(self.num_hidden_layers) as f64) / l;
                dense * 3.0 * f * d + (1.0 - dense) * moe
            }
        };
        let attention = match self.kv_lora_rank as f64 {
            0.0 => 2.0 * q * d + 2.0 * kv * d, // q, o, k, v
            c => {
                let [ql, r, n, vd] =
                    [self.q_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim].map(|x| x as f64);
                let query = if ql == 0.0 { q * d } else { ql * d + ql + ql * q };
                query + (c + r) * d + c + c * h * (n + vd) + h * vd * d // MLA: q, kv_a, its norm, kv_b, o
            }
        };
        let layer = attention + mlp + 2.0 * d; // the MLP, two norms
        let embeddings = if self.tie_word_embeddings { 1.0 } else { 2.0 } * v * d;
        embeddings + l * layer + d
    }
}

/// Latent attention's shapes (`model/latent_attention.rs`), read from the `[model]` keys by the
/// config that has them (`ModelConfig::latent`), for what prices it without building it (`plan`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Latent {
    /// The keys' latent, the query's (0: a plain q_proj), and a head's parts: the query/key's
    /// unrotated and rotated widths, the value's.
    pub kv_rank: usize,
    pub q_rank: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
}

/// Is the parameter named `name` one of latent attention's latent path (`model/latent_attention.rs`),
/// replicated over tp with a gradient each rank makes from its own heads (a partial sum)?
pub fn partial_over_tp(name: &str) -> bool {
    let latent = ["q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"];
    name.contains(".self_attn.") && latent.iter().any(|s| name.ends_with(s))
}

/// DeepSeekMoE's settings (`model/moe.rs`), read from the `[model]` keys by the config that has
/// them (`ModelConfig::deepseek_moe`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeepSeekMoe {
    /// Each routed expert's width, the shared experts' count, the dense layers below the first MoE one.
    pub width: usize,
    pub shared: usize,
    pub dense_below: usize,
    /// The groups of experts, and how many of them a token's experts may come from.
    pub groups: usize,
    pub kept: usize,
    /// The chosen scores renormalised; their factor; γ, the bias's step; α, the sequence-wise
    /// balance loss's weight.
    pub norm: bool,
    pub scale: f32,
    pub speed: f32,
    pub seq_coef: f32,
}

/// How a `model.init_from` folder's `[model]` keys are read (`Config::load_with`): the checkpoint
/// code reads folders, the config does not.
pub type FolderKeys<'a> = &'a dyn Fn(&str) -> Result<toml::Table>;

/// A config's settings, `section.key` → value (`Config::settings`).
pub type Settings = std::collections::BTreeMap<String, String>;

/// The keys whose values differ between `this` and `that`, in key order, with this and that
/// value (`absent` where one has no such key).
pub fn differing<'a>(this: &'a Settings, that: &'a Settings) -> Vec<(&'a str, &'a str, &'a str)> {
    let keys: std::collections::BTreeSet<&String> = this.keys().chain(that.keys()).collect();
    let value = |s: &'a Settings, k: &String| s.get(k).map_or("absent", String::as_str);
    keys.into_iter()
        .filter(|k| this.get(*k) != that.get(*k))
        .map(|k| (k.as_str(), value(this, k), value(that, k)))
        .collect()
}

impl Config {
    /// Every setting as `section.key` → its value as TOML writes it (an f32 key as the f32 it
    /// holds), to compare two configs: a resumed run's with its checkpoint's (`checkpoint/save.rs`),
    /// a process's with process 0's (`train/agree.rs`).
    pub fn settings(&self) -> Settings {
        let table = toml::Value::try_from(self).expect("a config serialises");
        let mut all = Settings::new();
        for (section, keys) in table.as_table().into_iter().flatten() {
            for (key, value) in keys.as_table().into_iter().flatten() {
                let shown = match value {
                    toml::Value::Float(x) if (*x as f32) as f64 == *x => (*x as f32).to_string(), // an f32 key
                    v => v.to_string(),
                };
                all.insert(format!("{section}.{key}"), shown);
            }
        }
        all
    }

    /// The built-in default (`configs/tiny.toml`) with `--set` overrides.
    pub fn load(path: Option<&Path>, sets: &[String]) -> Result<Config> {
        Config::load_with(path, sets, None)
    }

    /// `load`, where a `model.init_from` folder gives every `[model]` key that neither the file
    /// nor a `--set` gives, as `folder_keys` reads them from it (the built-in defaults do not
    /// count as given: a Hugging Face folder's shape need not be written again).
    pub fn load_with(path: Option<&Path>, sets: &[String], folder_keys: Option<FolderKeys>) -> Result<Config> {
        let config = Config::read_with(path, sets, folder_keys)?;
        config.validate()?;
        Ok(config)
    }

    /// `load` without the checks of the sections against each other: every key read and typed,
    /// for a caller that changes the layout or the batch before it checks (`ferrotron plan`).
    pub fn read(path: Option<&Path>, sets: &[String]) -> Result<Config> {
        Config::read_with(path, sets, None)
    }

    fn read_with(path: Option<&Path>, sets: &[String], folder_keys: Option<FolderKeys>) -> Result<Config> {
        let mut table: toml::Table = TINY.parse().expect("configs/tiny.toml is valid TOML");
        // the [model] keys the file and the --sets give (a model.init_from folder gives the rest)
        let mut given: Vec<String> = sets
            .iter()
            .filter_map(|s| s.split_once('=')?.0.trim().strip_prefix("model.")?.split('.').next().map(str::to_string))
            .collect();
        if let Some(path) = path {
            let text = crate::files::read_text(path, "--config")?;
            let user: toml::Table = text.parse().map_err(|e: toml::de::Error| {
                anyhow::anyhow!("{}: not valid TOML: {}", path.display(), one_line(&e.to_string()))
            })?;
            // a section given as a value (`model = 5`) or as a list of tables (`[[train]]`)
            for (key, value) in &user {
                if table.get(key).is_some_and(toml::Value::is_table) && !value.is_table() {
                    let written = match value {
                        toml::Value::Array(a) if a.iter().all(toml::Value::is_table) => {
                            format!("`[[{key}]]` (a list of tables)")
                        }
                        other => format!("`{key} = {other}`"),
                    };
                    anyhow::bail!(
                        "{}: {written}, but `{key}` is one section: write `[{key}]` once, with its keys below it",
                        path.display()
                    );
                }
            }
            let user = renamed(user, &path.display().to_string())?;
            given.extend(user.get("model").and_then(toml::Value::as_table).into_iter().flat_map(|m| m.keys().cloned()));
            merge(&mut table, user);
        }
        for set in sets {
            apply_set(&mut table, set)?;
        }
        let init_from = table.get("model").and_then(|m| m.get("init_from")).and_then(toml::Value::as_str);
        if let (Some(keys), Some(folder)) = (folder_keys, init_from.filter(|f| !f.is_empty())) {
            let inherited = keys(folder)?;
            if let Some(toml::Value::Table(model)) = table.get_mut("model") {
                model.extend(inherited.into_iter().filter(|(k, _)| !given.contains(k)));
            }
        }
        let read = |table: toml::Table| -> std::result::Result<Config, (String, String)> {
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let mut msg = one_line(&e.inner().to_string());
                if let Some(i) = msg.rfind(" in `") {
                    msg.truncate(i); // toml repeats the key we already name
                }
                (e.path().to_string(), msg)
            })
        };
        let config = read(table.clone()).map_err(|(key, msg)| {
            let where_ = path.map(|p| format!(" (in {} or --set)", p.display())).unwrap_or_default();
            let again = |t| read(t).err().map(|(_, m)| m).unwrap_or_default();
            anyhow::anyhow!("config key `{key}`: {}{where_}", plain_words(&msg, &key, &table, &again))
        })?;
        Ok(config)
    }

    /// A config recorded as TOML (a checkpoint's), over the built-in defaults: a key added since
    /// it was written takes its default. One without the sections every run has recorded since
    /// the first (`[model]`, `[train]`, `[data]`) is no recording: `None`, as for a bad one.
    pub fn from_recorded(text: &str) -> Option<Config> {
        let mut table: toml::Table = TINY.parse().expect("configs/tiny.toml is valid TOML");
        let recorded: toml::Table = text.parse().ok()?;
        if !["model", "train", "data"].iter().all(|s| recorded.get(*s).is_some_and(toml::Value::is_table)) {
            return None;
        }
        merge(&mut table, renamed(recorded, "the recorded config").ok()?);
        toml::Value::Table(table).try_into().ok()
    }
}
