//! The CUDA kernels on a GPU against the CPU reference: every op forward and backward, f32 and
//! bf16, random inputs, odd sizes (`src/cuda/self_check.rs`). Skipped with a printed reason where there
//! is no GPU, no NVRTC or no cuBLAS.

mod common;

#[test]
fn kernels_match_the_cpu_reference_on_a_gpu() {
    if let Some(why) = common::no_gpu() {
        eprintln!("skipped: {why}");
        return;
    }
    let gpu = ferrotron::cuda::runtime::Gpu::open(0).unwrap();
    let report = ferrotron::cuda::self_check::self_test(&gpu).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(report.len() > 50, "every op is checked in both dtypes");
    for line in report {
        eprintln!("{line}");
    }
}
