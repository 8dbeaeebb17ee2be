//! # The GPU runtime: the lowest floor
//!
//! Read in this order: `runtime` (a device, its two streams, the libraries we load) → `nvrtc`
//! (compiling `kernels/*.cu` for this GPU) → `kernels` (the table of kernels) → `launch_table`
//! (every kernel launch as data) → `device` (a rank's GPU and the buffers tensors keep on it) →
//! `profile` (kernel timings). This folder imports nothing of the crate but plain types
//! (`ops/types.rs`). Above it: each op on the GPU beside its CPU twin (`ops/gpu.rs`,
//! `ops/gpu_moe.rs`), tensor collectives through NCCL with the other collectives
//! (`comm/nccl.rs`), every GPU op against the CPU reference with the commands
//! (`commands/self_check.rs`). The model and the parallelism lessons never name CUDA: they run
//! unchanged on a GPU.

pub mod device;
pub mod kernels;
pub mod launch_table;
pub mod nvrtc;
pub mod profile;
pub mod runtime;
