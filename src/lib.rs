//! ferrotron: an educational, from-scratch LLM pre-training repository.
//!
//! Read in this order: `tensor` → `ops` (and `cpu`, its kernels) → `block` → `model` →
//! `optimizer` → `data` → `train`. `init` makes the weights, `config` the run, `checkpoint` and
//! `eval` read Hugging Face models, `save` writes and resumes checkpoints, `text` and `download`
//! bring real text and Hub files. Ranks: `process_grid` → `comm` (and `hub`, its local backend)
//! → `launch` → `data_parallel` → `tensor_parallel` → `pipeline_parallel` (and `schedule`) →
//! `context_parallel` → `converge` (and `trace`, `plot`). GPUs: `gpu` → `kernels` → `cuda` →
//! `launches` → `cuda_ops` (and `cuda_check`) → `comm_gpu` (NCCL) → `doctor`.

pub mod bench;
pub mod block;
pub mod checkpoint;
pub mod comm;
pub mod comm_gpu;
pub mod config;
pub mod context_parallel;
pub mod converge;
pub mod cpu;
pub mod cuda;
pub mod cuda_check;
pub mod cuda_ops;
pub mod data;
pub mod data_parallel;
pub mod doctor;
pub mod download;
pub mod eval;
pub mod gpu;
pub mod hub;
pub mod init;
pub mod kernels;
pub mod launch;
pub mod launches;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod optimizer;
pub mod pipeline_parallel;
pub mod plot;
pub mod process_grid;
pub mod profile;
pub mod save;
pub mod schedule;
pub mod tensor;
pub mod tensor_parallel;
pub mod text;
pub mod trace;
pub mod train;
