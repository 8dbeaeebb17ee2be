//! # The GPU: everything CUDA, behind the op layer and the collectives
//!
//! Read in this order: `runtime` (a device, its two streams, the libraries we load) → `nvrtc`
//! (compiling `kernels/*.cu` for this GPU) → `kernels` (the table of kernels) → `launch_table`
//! (every kernel launch as data) → `device` (a rank's GPU and the buffers tensors keep on it) →
//! `ops` (each op of the op layer on the GPU) → `nccl` (tensor collectives through NCCL) →
//! `self_check` (every GPU op against the CPU reference) and `profile` (kernel timings). Nothing outside `ops/`, `comm/` and the
//! commands names these types: the model and the parallelism lessons run unchanged on a GPU.

pub mod device;
pub mod kernels;
pub mod launch_table;
pub mod moe;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod profile;
pub mod runtime;
pub mod self_check;
