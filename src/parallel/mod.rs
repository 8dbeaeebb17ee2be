//! # Parallelism: one lesson per way of splitting the work
//!
//! Read in the tutorial's order: `data_parallel` (same model, different data, averaged
//! gradients) → `zero` (data parallelism that shards optimizer state, gradients and weights:
//! ZeRO-1, 2, 3) → `fsdp` (its other half: the weights gathered from their partitions) →
//! `hybrid_sharding` (ZeRO within shard groups, replicas across them) → `tensor_parallel` (each
//! matrix split across ranks; `shared_kv_heads`, KV heads copied when fewer than the ranks) → `sequence_parallel` (and the rows between the matrices) →
//! `pipeline_parallel` (layers split into stages, AFAB; `pipeline_messages`, what the stages say;
//! `pipeline_tied`, a tied embedding's gradient summed between the first and the last stage;
//! `pipeline_schedule`, a schedule as data, the order of a stage's forwards and backwards;
//! `pipeline_1f1b`, 1F1B; `pipeline_actions`, the schedules walked as lists, interleaved;
//! `pipeline_zero_bubble`, ZB-H1 and ZBV; `schedules`, every schedule by its config name; `layout`, the grid with every lesson's cuts) →
//! `context_parallel` (the sequence split, attention as a ring; `ulysses`, or an all-to-all to a
//! head split) → `expert_parallel` (a mixture of experts' experts divided among ranks, tokens
//! travelling to them by all-to-all). The model (`model/`) knows none of them: it
//! asks its `TensorSplit`, `SequenceSplit`, `WeightSplit` (`model/split.rs`) and `ExpertSplit`
//! (`model/moe.rs`) at the points where a split model must talk, and `tensor_parallel`, `sequence_parallel`,
//! `context_parallel`, `zero` and `expert_parallel` answer with collectives.

pub mod context_parallel;
pub mod data_parallel;
pub mod expert_parallel;
pub mod fsdp;
pub mod gather_formats;
pub mod hybrid_sharding;
pub mod latent_tensor_parallel;
pub mod layout;
pub mod muon_owners;
pub mod pipeline_1f1b;
pub mod pipeline_actions;
pub mod pipeline_messages;
pub mod pipeline_parallel;
pub mod pipeline_schedule;
pub mod pipeline_tied;
pub mod pipeline_zero_bubble;
pub mod schedules;
pub mod sequence_parallel;
pub mod shared_kv_heads;
pub mod tensor_parallel;
pub mod ulysses;
pub mod zero;

use crate::model::optimizer::Optimizer;
use crate::model::Llama;
use anyhow::Result;
use std::time::Instant;

/// What the driver around a training step (`train/driver.rs`) gives the code that runs the step's
/// micro-batches — the loop of `train/step.rs`, or a pipeline schedule: where to record a compute
/// span, and points between micro-batches at which every rank may end the step together (a
/// signal's early stop). The step's code calls it and knows nothing of what is behind it.
pub trait StepHooks {
    /// Records a compute span: its name, and when it began (it ends now).
    fn span(&self, name: String, start: Instant);
    /// Whether `stop_here` is asked before this rank's forward number `k` of the step (counted
    /// from 0): every rank gets the same answer for the same `k`.
    fn asks_before(&self, k: usize) -> bool;
    /// Asked where `asks_before` says: whether every rank ends the step here, its gradients so far
    /// dropped (a collective: every rank asks at the same points).
    fn stop_here(&self) -> Result<bool>;
    /// The step's gradients are reduced and nothing is updated yet (it waited for them since
    /// `start`): the point at which `ferrotron memory` counts what a rank holds.
    fn gradients_ready(&self, _start: Instant, _model: &Llama, _optimizer: &dyn Optimizer) {}
}
