//! # What a device can do: the peak that MFU divides by
//!
//! Model FLOPs utilisation says how much of the hardware a run uses:
//!
//! ```text
//! FLOPs per token = 6·N + 12·L·(H·d_head)·S      (PaLM, appendix B; also picotron and nanotron)
//!   N: the weights that take part in a matrix product (every weight except an untied input
//!      embedding, which is a lookup); 6 = 2 (multiply + add) × 3 (forward, and backward twice)
//!   12·L·(H·d_head)·S: the attention scores and their use, Q·Kᵀ and P·V, forward and backward,
//!      over the whole S × S square (the causal half that is skipped still counts, by convention)
//! MFU = FLOPs per token × tokens per second / the peak FLOP/s of the devices the run uses
//! ```
//! A GPU's peak is its dense bf16 tensor-core rate in mixed precision, or its f32 CUDA-core rate
//! in f32 mode (cuBLAS runs without TF32 there), from the table below by its name. A CPU has no
//! datasheet number that its GEMM library reaches, so its peak is measured once — the f32 GEMM
//! the model runs, on all of its threads — and kept per machine in `calibration.json` in the
//! cache folder (`data.cache_dir`), which later runs read. `train` shows MFU on its progress line
//! and in its summary; `bench` in its table.

use crate::config::ModelConfig;
use crate::ops::types::DType;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Dense peak TFLOP/s (bf16 tensor cores, f32 CUDA cores) by a part of the GPU's name; the first
/// match wins.
const PEAKS: [(&str, f64, f64); 9] = [
    ("H100 PCIe", 756.5, 51.2),
    ("H100 NVL", 835.5, 60.0),
    ("H100", 989.4, 66.9), // SXM (its name reads "H100 80GB HBM3")
    ("H200", 989.4, 66.9), // and GH200
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L40", 181.0, 90.5), // before "L4", which its name contains
    ("RTX 4090", 165.2, 82.6),
    ("L4", 121.0, 30.3),
];

/// The peak of a GPU named `name` computing in `dtype`, in TFLOP/s, when the table knows it.
pub fn peak_tflops(name: &str, dtype: DType) -> Option<f64> {
    let (_, bf16, f32) = PEAKS.iter().find(|(part, _, _)| name.contains(part))?;
    Some(if dtype == DType::Bf16 { *bf16 } else { *f32 })
}

/// FLOPs per trained token (forward and backward), by the formula above.
pub fn flops_per_token(m: &ModelConfig, seq_len: usize) -> f64 {
    let lookup_only = if m.tie_word_embeddings { 0.0 } else { m.vocab_size as f64 * m.hidden_size as f64 };
    let n = m.parameter_count() - lookup_only;
    let attention = 12.0 * (m.num_hidden_layers * m.num_attention_heads * m.head_dim() * seq_len) as f64;
    6.0 * n + attention
}

/// The CPU's calibration file: `calibration.json` in the cache folder `cache_dir` names.
pub fn calibration_file(cache_dir: &str) -> Result<PathBuf> {
    Ok(crate::files::cache_folder(cache_dir)?.join("calibration.json"))
}

/// This machine's CPU as the calibration file keys it: its model name and thread count (a
/// container with fewer threads measures again).
pub fn cpu_key() -> String {
    let info = crate::files::read_text(Path::new("/proc/cpuinfo"), "the CPU's name").unwrap_or_default();
    let model = info.lines().find_map(|l| l.strip_prefix("model name")).map(|l| l.trim_start_matches([' ', '\t', ':']));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{} × {threads} threads", model.unwrap_or(std::env::consts::ARCH))
}

/// The f32 peak recorded for `key` in `file`, in TFLOP/s; none when not measured yet (or the file
/// is unreadable: it is measured again and rewritten).
pub fn recorded_cpu_peak(file: &Path, key: &str) -> Option<f64> {
    let text = crate::files::read_text(file, "the calibration file").ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["cpu"][key]["f32_tflops"].as_f64().filter(|t| t.is_finite() && *t > 0.0)
}

/// Records `tflops` for `key` in `file`, keeping the other machines' entries (the cache folder
/// may be shared); written whole, so a reader never sees half of it.
pub fn record_cpu_peak(file: &Path, key: &str, tflops: f64) -> Result<()> {
    let old = crate::files::read_text(file, "the calibration file").ok();
    let old = old.and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let mut json = old.filter(serde_json::Value::is_object).unwrap_or_else(|| serde_json::json!({}));
    if !json["cpu"].is_object() {
        json["cpu"] = serde_json::json!({});
    }
    json["cpu"][key] = serde_json::json!({ "f32_tflops": tflops, "how": "ops::cpu_math::gemm, 1024³, all threads" });
    if let Some(folder) = file.parent() {
        std::fs::create_dir_all(folder)
            .with_context(|| format!("data.cache_dir: cannot create {}", folder.display()))?;
    }
    crate::files::write_atomically(file, serde_json::to_string_pretty(&json)?.as_bytes())
}

/// This machine's CPU peak in TFLOP/s: recorded in the calibration file of `cache_dir`, or
/// `measure`d now (once a machine) and recorded. A file that cannot be written costs only the
/// record: the measurement is used all the same.
pub fn cpu_peak_tflops(cache_dir: &str, measure: impl FnOnce() -> f64) -> Result<f64> {
    let (file, key) = (calibration_file(cache_dir)?, cpu_key());
    if let Some(peak) = recorded_cpu_peak(&file, &key) {
        return Ok(peak);
    }
    let peak = measure();
    if let Err(e) = record_cpu_peak(&file, &key, peak) {
        crate::say!("note: the CPU's measured peak ({peak:.3} TFLOP/s) could not be recorded: {e:#}");
    }
    Ok(peak)
}
