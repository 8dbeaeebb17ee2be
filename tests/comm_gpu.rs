//! Tensor collectives on GPU tensors (NCCL and the local hub through host memory) and the choice of
//! backend. The GPU tests run where a CUDA driver and a GPU are found, and are skipped with a
//! printed reason elsewhere; the backend choice is checked everywhere.

use ferrotron::comm::launcher::{choose_backend, Backend};
use ferrotron::commands::doctor::comm_self_test;
use ferrotron::config::CommBackend;
use ferrotron::parallel::process_grid::Grid;

/// The number of GPUs, or `None` (with the reason printed) when the GPU tests must be skipped.
fn gpus() -> Option<usize> {
    match ferrotron::cuda::runtime::device_count() {
        Ok(n) if n > 0 => Some(n),
        Ok(_) => {
            eprintln!("skipped: the CUDA driver sees no GPU");
            None
        }
        Err(e) => {
            eprintln!("skipped: {e:#}");
            None
        }
    }
}

#[test]
fn nccl_collectives_one_rank_per_gpu() {
    let Some(gpus) = gpus() else { return };
    if let Err(e) = ferrotron::cuda::runtime::require("NCCL") {
        eprintln!("skipped: {e:#}");
        return;
    }
    comm_self_test(Grid::new(gpus.min(8), 1, 1, 1).unwrap(), Backend::Nccl).unwrap();
}

#[test]
fn local_collectives_on_gpu_buffers_shared_gpu() {
    if gpus().is_none() {
        return;
    }
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
