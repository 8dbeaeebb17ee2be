//! Shared by the test files that train.

#[allow(dead_code)] // the test files that start processes
pub mod processes;

/// A model small enough to train in seconds (`--set` strings).
#[allow(dead_code)] // not every test file trains
pub const SMALL: &[&str] = &[
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "train.seq_len=32",
    "data.copy_lag=8",
];

/// Why the GPU tests cannot run here, if they cannot: no driver, no GPU, no NVRTC or headers,
/// no cuBLAS.
#[allow(dead_code)] // used by the GPU test files only
pub fn no_gpu() -> Option<String> {
    let ready = ferrotron::cuda::runtime::device_count()
        .and_then(|n| if n > 0 { Ok(()) } else { anyhow::bail!("the driver sees no GPU") })
        .and_then(|_| ferrotron::cuda::nvrtc::nvrtc_ready().map(drop))
        .and_then(|_| ferrotron::cuda::runtime::require("cuBLAS"));
    ready.err().map(|e| format!("{e:#}"))
}
