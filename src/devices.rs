//! # What a device can do: the peak that MFU divides by
//!
//! Model FLOPs utilisation says how much of the hardware a run uses:
//!
//! ```text
//! FLOPs per token = 6·N + 12·L·(H·d_head)·S      (PaLM, appendix B; also picotron and nanotron)
//!   N: the weights that take part in a token's matrix products (every weight except an untied
//!      input embedding, which is a lookup; of a mixture of experts only the k experts a token
//!      is routed to); 6 = 2 (multiply + add) × 3 (forward, and backward twice)
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

/// A GPU as the vendor's datasheet gives it, per GPU: dense peak TFLOP/s (bf16 and FP8 tensor
/// cores, f32 CUDA cores), memory, HBM bandwidth, and the links a node of them usually has (NVLink
/// between the GPUs of a node, per direction; one InfiniBand or Ethernet adapter a GPU across
/// nodes). `ferrotron plan` reads all of it (`--gpu KEY`), MFU only the peaks (by a part of the
/// name the driver reports).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpu {
    /// `--gpu`'s word for it ("" for a part only MFU looks up).
    pub key: &'static str,
    /// A part of the name the driver reports; the table's first match wins.
    pub name: &'static str,
    pub bf16_tflops: f64,
    /// 0 where the GPU has no FP8 tensor cores.
    pub fp8_tflops: f64,
    pub f32_tflops: f64,
    pub memory_gib: f64,
    pub hbm_tb_s: f64,
    /// NVLink (or PCIe where there is none) between two GPUs of a node, GB/s a direction.
    pub node_gb_s: f64,
    /// The network across nodes, GB/s a direction a GPU (400 Gb/s InfiniBand NDR: 50).
    pub net_gb_s: f64,
    /// Where the figures come from.
    pub source: &'static str,
}

const NVIDIA: &str = "NVIDIA datasheet (dense, without sparsity)";

/// The table, most specific names first ("H100 PCIe" before "H100", "L40" before "L4").
#[rustfmt::skip]
pub const GPUS: [Gpu; 11] = [
    Gpu { key: "h100-pcie", name: "H100 PCIe", bf16_tflops: 756.5, fp8_tflops: 1513.0, f32_tflops: 51.2, memory_gib: 80.0, hbm_tb_s: 2.0, node_gb_s: 25.0, net_gb_s: 50.0, source: NVIDIA },
    Gpu { key: "h100-nvl", name: "H100 NVL", bf16_tflops: 835.5, fp8_tflops: 1671.0, f32_tflops: 60.0, memory_gib: 94.0, hbm_tb_s: 3.9, node_gb_s: 300.0, net_gb_s: 50.0, source: NVIDIA },
    // SXM (its name reads "H100 80GB HBM3"): NVLink 4 at 900 GB/s both ways, NDR InfiniBand
    Gpu { key: "h100", name: "H100", bf16_tflops: 989.4, fp8_tflops: 1978.9, f32_tflops: 66.9, memory_gib: 80.0, hbm_tb_s: 3.35, node_gb_s: 450.0, net_gb_s: 50.0, source: NVIDIA },
    Gpu { key: "", name: "GH200", bf16_tflops: 989.4, fp8_tflops: 1978.9, f32_tflops: 66.9, memory_gib: 96.0, hbm_tb_s: 4.0, node_gb_s: 450.0, net_gb_s: 50.0, source: NVIDIA },
    Gpu { key: "h200", name: "H200", bf16_tflops: 989.4, fp8_tflops: 1978.9, f32_tflops: 66.9, memory_gib: 141.0, hbm_tb_s: 4.8, node_gb_s: 450.0, net_gb_s: 50.0, source: NVIDIA },
    // HGX B200 (per GPU): NVLink 5 at 1.8 TB/s both ways
    Gpu { key: "b200", name: "B200", bf16_tflops: 2250.0, fp8_tflops: 4500.0, f32_tflops: 75.0, memory_gib: 180.0, hbm_tb_s: 7.7, node_gb_s: 900.0, net_gb_s: 50.0, source: NVIDIA },
    // SXM 80 GB: NVLink 3 at 600 GB/s both ways, HDR InfiniBand (200 Gb/s)
    Gpu { key: "a100", name: "A100", bf16_tflops: 312.0, fp8_tflops: 0.0, f32_tflops: 19.5, memory_gib: 80.0, hbm_tb_s: 2.04, node_gb_s: 300.0, net_gb_s: 25.0, source: NVIDIA },
    // no NVLink: PCIe 4.0 ×16 between GPUs (25 GB/s achievable)
    Gpu { key: "l40s", name: "L40S", bf16_tflops: 362.1, fp8_tflops: 733.0, f32_tflops: 91.6, memory_gib: 48.0, hbm_tb_s: 0.864, node_gb_s: 25.0, net_gb_s: 25.0, source: NVIDIA },
    Gpu { key: "l40", name: "L40", bf16_tflops: 181.0, fp8_tflops: 362.0, f32_tflops: 90.5, memory_gib: 48.0, hbm_tb_s: 0.864, node_gb_s: 25.0, net_gb_s: 25.0, source: NVIDIA },
    Gpu { key: "", name: "RTX 4090", bf16_tflops: 165.2, fp8_tflops: 330.3, f32_tflops: 82.6, memory_gib: 24.0, hbm_tb_s: 1.0, node_gb_s: 25.0, net_gb_s: 12.5, source: NVIDIA },
    Gpu { key: "l4", name: "L4", bf16_tflops: 121.0, fp8_tflops: 242.5, f32_tflops: 30.3, memory_gib: 24.0, hbm_tb_s: 0.3, node_gb_s: 25.0, net_gb_s: 12.5, source: NVIDIA },
];

/// The GPU `--gpu` names, by its key.
pub fn gpu(key: &str) -> Option<&'static Gpu> {
    GPUS.iter().find(|g| !g.key.is_empty() && g.key == key)
}

/// The table's row for the GPU the driver names `name` (its first row whose name is part of it).
pub fn gpu_named(name: &str) -> Option<&'static Gpu> {
    GPUS.iter().find(|g| name.contains(g.name))
}

/// The keys `--gpu` takes, for a refusal's line.
pub fn gpu_keys() -> String {
    GPUS.iter().filter(|g| !g.key.is_empty()).map(|g| g.key).collect::<Vec<_>>().join(", ")
}

/// The peak of a GPU named `name` computing in `dtype`, in TFLOP/s, when the table knows it.
pub fn peak_tflops(name: &str, dtype: DType) -> Option<f64> {
    let g = gpu_named(name)?;
    Some(if dtype == DType::Bf16 { g.bf16_tflops } else { g.f32_tflops })
}

/// FLOPs per trained token (forward and backward), by the formula above.
pub fn flops_per_token(m: &ModelConfig, seq_len: usize) -> f64 {
    let lookup_only = if m.tie_word_embeddings { 0.0 } else { m.vocab_size as f64 * m.hidden_size as f64 };
    // a mixture of experts: a token passes through k of the E experts of a block, not all of them
    // (DeepSeekMoE's experts are their own width, and its first layers dense)
    let (e, k) = (m.num_local_experts as f64, m.num_experts_per_tok as f64);
    let (width, dense) = m.deepseek_moe().map_or((m.intermediate_size, 0), |d| (d.width, d.dense_below));
    let moe_layers = m.num_hidden_layers - dense.min(m.num_hidden_layers);
    let idle = (e - k).max(0.0) * 3.0 * (width * m.hidden_size * moe_layers) as f64;
    let n = m.parameter_count() - lookup_only - idle;
    // scores q·k (a query/key head wide) and their sum over the values (a value head wide), each
    // 2 FLOPs a product and 3 passes (forward, two in backward); latent attention's heads differ
    let v = if m.kv_lora_rank > 0 { m.v_head_dim } else { m.head_dim() };
    let attention = 6.0 * (m.num_hidden_layers * m.num_attention_heads * (m.head_dim() + v) * seq_len) as f64;
    6.0 * n + attention
}

/// The calibration file (this machine's CPU, and GPUs measured here): `calibration.json` in the cache folder `cache_dir` names.
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

/// What one CPU thread can do in f32, in TFLOP/s: a recorded peak outside these bounds, times
/// the threads, is no measurement of this machine. The top is above any core's (two AVX-512 FMA
/// units at 5 GHz are 0.32); the bottom, a thousandth of a core's today, is a measurement broken.
pub const CPU_THREAD_TFLOPS: std::ops::RangeInclusive<f64> = 1e-4..=0.5;

/// The f32 peak recorded for `key` in `file`, in TFLOP/s: `Ok(None)` when not measured yet (or
/// the file is unreadable: it is measured again and rewritten), `Err` with the value when it lies
/// outside what the machine's threads can do (`CPU_THREAD_TFLOPS`).
pub fn recorded_cpu_peak(file: &Path, key: &str) -> Result<Option<f64>, f64> {
    let Some(tflops) = recorded_field(file, &["cpu", key, "f32_tflops"]).and_then(|v| v.as_f64()) else {
        return Ok(None);
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let (low, high) = (CPU_THREAD_TFLOPS.start() * threads, CPU_THREAD_TFLOPS.end() * threads);
    match (low..=high).contains(&tflops) {
        true => Ok(Some(tflops)),
        false => Err(tflops),
    }
}

/// Records `tflops` for `key` in `file`, keeping the other machines' entries (the cache folder
/// may be shared) and this one's other measurements.
pub fn record_cpu_peak(file: &Path, key: &str, tflops: f64) -> Result<()> {
    record_field(file, &["cpu", key, "f32_tflops"], serde_json::json!(tflops))?;
    record_field(file, &["cpu", key, "how"], serde_json::json!("ops::cpu_math::gemm, 1024³, all threads"))
}

/// What `file` records at `path` (`["cpu", key, field]`, `["gpu", name, dtype]`): none when not
/// measured yet, or the file is unreadable.
pub fn recorded_field(file: &Path, path: &[&str]) -> Option<serde_json::Value> {
    let text = crate::files::read_text(file, "the calibration file").ok()?;
    let mut json: serde_json::Value = serde_json::from_str(&text).ok()?;
    for key in path {
        json = json.get_mut(*key)?.take();
    }
    Some(json).filter(|v| !v.is_null())
}

/// Records `value` at `path` in `file`, keeping everything else there (the cache folder may be
/// shared by machines, and a machine records several measurements); written whole, so a reader
/// never sees half of it.
pub fn record_field(file: &Path, path: &[&str], value: serde_json::Value) -> Result<()> {
    let old = crate::files::read_text(file, "the calibration file").ok();
    let old = old.and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let mut json = old.filter(serde_json::Value::is_object).unwrap_or_else(|| serde_json::json!({}));
    let mut at = &mut json;
    for key in path {
        if !at[*key].is_object() {
            at[*key] = serde_json::json!({});
        }
        at = &mut at[*key];
    }
    *at = value;
    if let Some(folder) = file.parent() {
        std::fs::create_dir_all(folder)
            .with_context(|| format!("data.cache_dir: cannot create {}", folder.display()))?;
    }
    crate::files::write_atomically(file, serde_json::to_string_pretty(&json)?.as_bytes())
}

/// This machine's CPU peak in TFLOP/s: recorded in the calibration file of `cache_dir`, or
/// `measure`d now (once a machine, said as it starts) and recorded; a record outside what the
/// machine can do is measured again, with a line that says so. A file that cannot be written
/// costs only the record: the measurement is used all the same.
pub fn cpu_peak_tflops(cache_dir: &str, measure: impl FnOnce() -> f64) -> Result<f64> {
    let (file, key) = (calibration_file(cache_dir)?, cpu_key());
    match recorded_cpu_peak(&file, &key) {
        Ok(Some(peak)) => return Ok(peak),
        Ok(None) => crate::say!(
            "measuring this CPU's f32 peak for MFU (a second or two, once for this machine: recorded in {})",
            file.display()
        ),
        Err(bad) => crate::say!(
            "note: {} records {bad:e} TFLOP/s for this CPU, outside what its threads can do ({:e} to {} TFLOP/s each): measuring it again",
            file.display(),
            CPU_THREAD_TFLOPS.start(),
            CPU_THREAD_TFLOPS.end()
        ),
    }
    Ok(record_measured(&file, &key, measure()))
}

/// Records `peak`, measured, for `key` in `file` (a note where it cannot be); returns it.
fn record_measured(file: &Path, key: &str, peak: f64) -> f64 {
    if let Err(e) = record_cpu_peak(file, key, peak) {
        crate::say!("note: the CPU's measured peak ({peak:.3} TFLOP/s) could not be recorded: {e:#}");
    }
    peak
}

/// A step ran faster than the CPU's recorded peak (MFU above 100 %: the machine was busy when it
/// was measured): measures it again and records the larger of that and the step's rate
/// `achieved`, which the CPU plainly can reach. Returns the new peak and a line saying so.
pub fn cpu_peak_beaten(
    cache_dir: &str,
    (recorded, achieved): (f64, f64),
    measure: impl FnOnce() -> f64,
) -> (f64, String) {
    let again = measure();
    let peak = again.max(achieved);
    let kept = if again < achieved { ", below this step's rate, which is kept as the peak" } else { "" };
    let said = format!("note: a step ran at {achieved:.4} TFLOP/s, above this CPU's recorded peak of {recorded:.4} (measured while the machine was busy?): measured again at {again:.4} TFLOP/s{kept}");
    match calibration_file(cache_dir) {
        Ok(file) => (record_measured(&file, &cpu_key(), peak), said),
        Err(_) => (peak, said),
    }
}
