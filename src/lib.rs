//! ferrotron: an educational, from-scratch LLM pre-training repository.
//!
//! The folders are the course. Read them in this order:
//!
//! | folder | what it teaches |
//! | --- | --- |
//! | `ops/` | tensors and the op layer the model is written in; `cpu.rs` is the reference math, `gpu.rs` its GPU twin |
//! | `model/` | the Llama, forward and backward by hand; its parameters, init and AdamW |
//! | `train/step.rs` | the training step, on one screen: micro-batches, each gradient's way, the optimizer (the loop around it is `train/driver.rs`; `train.rs` maps the folder) |
//! | `comm/` | the process grid; process groups and collectives; placements and the collective between two (`placement.rs`); ranks as threads (`local.rs`), the launcher, NCCL for GPU tensors; a run over several processes (`wires/`: TCP or MPI) |
//! | `parallel/` | one lesson per parallelism: data, tensor, sequence, pipeline, context, ZeRO and FSDP, experts |
//! | `data/` | the synthetic language, real text and tokenizers, Hugging Face hub files |
//! | `checkpoint/` | Hugging Face weights in and out, save and resume |
//! | `cuda/` | the GPU runtime beneath everything: devices, buffers, streams, NVRTC, the kernel table and its launches |
//! | `commands/` | the tools around training: converge, bench, doctor (with the GPU self-check), eval, generate, tokenizer, memory, the schedule picture |
//!
//! Imports run one way between the folders, from the lowest: the plain values (`signals`, `files`,
//! `config`, `devices`, `ops/types.rs`, which every folder reads) → `cuda` (the GPU runtime) → `ops` →
//! `comm` → `model` → `data` → `parallel` → `checkpoint` → `train` → `commands`.
//! `tests/layering.rs` keeps it so, folder by folder and module by module. Every file also
//! belongs to one lesson of the tutorial, or to one track no lesson teaches
//! (`step_by_step/syllabus.toml`); `tests/syllabus.rs` keeps the lessons' order: no lesson's code
//! uses a later one's, but for the moves the table still lists.

pub mod checkpoint;
pub mod comm;
pub mod commands;
pub mod config;
pub mod cuda;
pub mod data;
pub mod devices;
pub mod files;
pub mod model;
pub mod ops;
pub mod parallel;
pub mod signals;
pub mod train;
