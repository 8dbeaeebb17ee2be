//! Tensor collectives on GPU tensors (NCCL and the local hub through host memory) and the choice of
//! backend. The GPU tests are `#[ignore]`d (cargo counts them) and run on a GPU machine with
//! `--include-ignored` (`.ci/gpu_check`); the backend choice is checked everywhere.

use ferrotron::comm::launcher::{choose_backend, Backend};
use ferrotron::comm::process_grid::Grid;
use ferrotron::commands::doctor::comm_self_test;
use ferrotron::config::CommBackend;

/// The number of GPUs; the GPU tests are `#[ignore]`d and, asked for, fail without one.
fn gpus() -> usize {
    match ferrotron::cuda::runtime::device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) => panic!("this test needs a CUDA GPU: the CUDA driver sees none"),
        Err(e) => panic!("this test needs a CUDA GPU: {e:#}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU: .ci/gpu_check runs it there (cargo test --release -- --include-ignored)"]
fn nccl_collectives_one_rank_per_gpu() {
    let gpus = gpus();
    ferrotron::cuda::runtime::require("NCCL").unwrap_or_else(|e| panic!("this test needs NCCL: {e:#}"));
    comm_self_test(Grid::new(gpus.min(8), 1, 1, 1).unwrap(), Backend::Nccl).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: .ci/gpu_check runs it there (cargo test --release -- --include-ignored)"]
fn local_collectives_on_gpu_buffers_shared_gpu() {
    gpus();
    for n in [1, 2, 3, 4] {
        comm_self_test(Grid::new(n, 1, 1, 1).unwrap(), Backend::Local).unwrap_or_else(|e| panic!("{n} ranks: {e:#}"));
    }
}

#[test]
fn backend_choice() {
    use CommBackend::*;
    // NCCL when every rank has a GPU of its own, the hub otherwise
    assert_eq!(choose_backend(Auto, true, 4, 8).unwrap(), Backend::Nccl);
    assert_eq!(choose_backend(Auto, true, 4, 1).unwrap(), Backend::Local);
    assert_eq!(choose_backend(Auto, true, 1, 1).unwrap(), Backend::Local, "one rank needs no NCCL");
    assert_eq!(choose_backend(Auto, false, 4, 0).unwrap(), Backend::Local);
    assert_eq!(choose_backend(Local, true, 2, 2).unwrap(), Backend::Local);
    assert_eq!(choose_backend(Nccl, true, 2, 2).unwrap(), Backend::Nccl);
    let err = |c, cuda, w, g| format!("{:#}", choose_backend(c, cuda, w, g).unwrap_err());
    assert!(err(Nccl, false, 1, 0).contains("needs device.kind = \"cuda\""));
    assert!(err(Nccl, true, 4, 1).contains("4 ranks, 1 GPU(s)"));
    assert!(err(Auto, true, 1, 0).contains("sees no GPU"));
}
