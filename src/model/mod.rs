//! # The model: a Llama, forward and backward by hand
//!
//! Read in this order: `param` (a weight, its gradient, how ranks share it) → `init` (every
//! weight from its own random stream) → `block` (one transformer block, its MLP a seam; `moe`, a
//! mixture of experts in that seam, and `family`, which of the two a config asks for;
//! `recompute`, keeping less of a block for backward) → `llama` (the whole model, or one pipeline
//! `stage` of it; its loss seam, which `fused_loss` plugs into for the loss without the logits) →
//! `split` (the model's seams: where a model cut across ranks must talk, which layers a rank
//! builds, where a backward's weight gradients go: now, or kept by `deferred_grads` for a
//! zero-bubble W) → `optimizer` (AdamW, clipping, the schedule) → `kv_cache` (generating text:
//! each layer's keys and values kept, one new row a step).

pub mod block;
pub mod deferred_grads;
pub mod family;
pub mod fused_loss;
pub mod init;
pub mod kv_cache;
pub mod latent_attention;
pub mod llama;
pub mod moe;
pub mod muon;
pub mod optimizer;
pub mod param;
pub mod recompute;
pub mod routing_tape;
pub mod sampling;
pub mod split;
pub mod stage;

pub use llama::Llama;
pub use param::{Param, ParamKind};
pub use split::{SequenceSplit, TensorSplit, WeightSplit, Whole};
