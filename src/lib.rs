//! ferrotron: an educational, from-scratch LLM pre-training repository.
//!
//! The folders are the course. Read them in this order:
//!
//! | folder | what it teaches |
//! | --- | --- |
//! | `ops/` | tensors and the op layer the model is written in; `cpu.rs` is the reference math |
//! | `model/` | the Llama, forward and backward by hand; its parameters, init and AdamW |
//! | `train.rs` | the training loop: one step, micro-batches, the optimizer |
//! | `comm/` | process groups and collectives; placements and the collective between two (`placement.rs`); ranks as threads (`local.rs`), the launcher; a run over several processes (`processes.rs`, bridged by `remote.rs` over TCP or MPI) |
//! | `parallel/` | the process grid, then one lesson per parallelism: data, tensor, pipeline, context |
//! | `data/` | the synthetic language, real text and tokenizers, Hugging Face hub files |
//! | `checkpoint/` | Hugging Face weights in and out, save and resume |
//! | `cuda/` | the GPU behind the op layer: runtime, NVRTC, kernel launches, GPU ops, NCCL |
//! | `commands/` | the tools around training: converge, bench, doctor, eval, generate, memory, the schedule picture |
//!
//! Imports run one way, from the bottom of this list up: `ops` → `model` → `parallel` →
//! `train` → `commands` (with `comm` beside `ops`, and `cuda` behind the op layer and the
//! collectives). `tests/layering.rs` keeps it so.

pub mod checkpoint;
pub mod comm;
pub mod commands;
pub mod config;
pub mod cuda;
pub mod data;
pub mod files;
pub mod model;
pub mod ops;
pub mod parallel;
pub mod train;
