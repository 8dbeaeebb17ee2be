//! The CUDA kernels on a GPU against the CPU reference: every op forward and backward, f32 and
//! bf16, random inputs, odd sizes (`src/commands/self_check.rs`). `#[ignore]`d (cargo counts it): `.ci/gpu_check` runs it
//! on a GPU machine with `--include-ignored`, where it fails without a GPU, NVRTC or cuBLAS.

mod common;

#[test]
#[ignore = "needs a CUDA GPU: .ci/gpu_check runs it there (cargo test --release -- --include-ignored)"]
fn kernels_match_the_cpu_reference_on_a_gpu() {
    common::require_gpu();
    let gpu = ferrotron::cuda::runtime::Gpu::open(0).unwrap();
    let report = ferrotron::commands::self_check::self_test(&gpu).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(report.len() > 50, "every op is checked in both dtypes");
    for line in report {
        eprintln!("{line}");
    }
}
