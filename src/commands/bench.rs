//! # Benchmarking: tokens per second, MFU and memory against a formula
//!
//! `ferrotron bench` trains a config for a few warm-up steps and then some measured steps, and
//! reports the step time, the tokens per second, and the model FLOPs utilisation: FLOPs per token
//! × tokens per second over the peak FLOP/s of the devices (`devices.rs` has the formula and the
//! table of peaks by GPU name; a CPU's is measured once). `--peak-tflops` gives the peak of one
//! rank's device for other hardware.
//!
//! Memory: the peak the GPU's tensors reached in a step, next to what the formula expects (bytes
//! per weight for weights, gradients and AdamW, plus the activations one micro-batch keeps for its
//! backward, `train/memory.rs`), and the largest micro-batch that the GPU's memory would hold.

use crate::config::Config;
use crate::devices::{flops_per_token, peak_tflops};
use crate::train::memory::{activations_held, bytes_per_weight, weights_per_rank};
use crate::train::{self, Options};
use anyhow::{bail, Result};
use serde::Serialize;

#[derive(Serialize, Debug)]
pub struct Report {
    pub device: String,
    pub dtype: String,
    pub ranks: usize,
    pub parameters: usize,
    pub seq_len: usize,
    pub tokens_per_step: usize,
    pub warmup_steps: usize,
    pub measured_steps: usize,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    pub flops_per_token: f64,
    pub achieved_tflops: f64,
    pub peak_tflops: Option<f64>,
    pub mfu: Option<f64>,
    pub gpu_peak_mib: Option<f64>,
    pub formula_static_mib: f64,
    /// The activations the busiest rank holds at once (`activations_held`).
    pub formula_activations_mib: f64,
    /// The largest micro-batch (sequences) the GPU's memory holds by the formula, at 90% use.
    pub max_micro_batch: Option<usize>,
    /// With `--profile`: GPU time by kernel over the measured steps, longest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<crate::cuda::profile::Row>,
}

/// A warm-up of more steps than this is said before it starts (a GPU needs a few).
const LONG_WARMUP: usize = 100;

/// Trains `warmup + steps` steps of `cfg` and measures the last `steps`; with `profile`, times
/// every GPU kernel of the measured steps (`cuda/profile.rs`).
pub fn bench(cfg: &Config, warmup: usize, steps: usize, peak_override: Option<f64>, profile: bool) -> Result<Report> {
    if steps == 0 {
        bail!("--steps 0: measure at least one step");
    }
    if let Some(peak) = peak_override.filter(|p| !(p.is_finite() && *p > 0.0)) {
        bail!("--peak-tflops {peak}: give the device's peak as a positive number of TFLOP/s (for example 989.4 for an H100 SXM in bf16)");
    }
    if profile && cfg.device.kind != crate::config::DeviceKind::Cuda {
        bail!("--profile times GPU kernels: set device.kind = \"cuda\" (on the CPU, `train --trace` shows where the time goes)");
    }
    let mut cfg = cfg.clone();
    let Some(total) = warmup.checked_add(steps) else {
        bail!("--warmup {warmup} + --steps {steps} is too many steps");
    };
    cfg.train.steps = total;
    cfg.checkpoint.every = 0;
    let (t, p, m) = (&cfg.train, &cfg.parallel, &cfg.model);
    let dtype = cfg.device.compute_dtype();
    let (name, gpu_mem) = match cfg.device.kind {
        crate::config::DeviceKind::Cuda => gpu_name_and_memory()?,
        crate::config::DeviceKind::Cpu => ("cpu".to_string(), None),
    };
    let profile_from_step = profile.then_some(warmup);
    if warmup > LONG_WARMUP {
        // the run is quiet: a long warm-up would pass without a word
        crate::say!("warming up: {warmup} steps before the {steps} measured (--warmup), no progress shown meanwhile");
    }
    let s = train::train(&cfg, Options { quiet: true, profile_from_step, ..Default::default() })?;
    let profile = if profile { crate::cuda::profile::finish()? } else { Vec::new() };
    let measured = &s.step_s[warmup..];
    let step_s = measured.iter().sum::<f64>() / measured.len() as f64;
    let tokens_per_step = t.micro_batch_size * t.grad_accum_steps * p.dp * t.seq_len;
    let tokens_per_s = tokens_per_step as f64 / step_s;
    let flops = flops_per_token(m, t.seq_len);
    let achieved_tflops = flops * tokens_per_s / 1e12;
    let ranks = p.world_size();
    // a GPU's peak by its name, one per rank; the CPU's measured once, shared by its ranks
    let on_cpu = cfg.device.kind == crate::config::DeviceKind::Cpu;
    let peak = peak_override.or_else(|| match on_cpu {
        true => crate::devices::cpu_peak_tflops(&cfg.data.cache_dir, crate::ops::cpu_math::peak_tflops).ok(),
        false => peak_tflops(&name, dtype),
    });
    let devices = if on_cpu { 1 } else { ranks };
    let static_bytes = bytes_per_weight(dtype) * weights_per_rank(m, p.tp, p.pp);
    let held = activations_held(&cfg, t.micro_batch_size, dtype);
    let per_sequence = activations_held(&cfg, 1, dtype);
    let mib = |b: f64| b / (1 << 20) as f64;
    Ok(Report {
        device: name,
        dtype: format!("{dtype:?}").to_lowercase(),
        ranks,
        parameters: m.parameter_count() as usize,
        seq_len: t.seq_len,
        tokens_per_step,
        warmup_steps: warmup,
        measured_steps: steps,
        step_ms: step_s * 1e3,
        tokens_per_s,
        flops_per_token: flops,
        achieved_tflops,
        peak_tflops: peak,
        mfu: peak.map(|pk| achieved_tflops / (pk * devices as f64)),
        gpu_peak_mib: s.gpu_peak_mib,
        formula_static_mib: mib(static_bytes),
        formula_activations_mib: mib(held),
        profile,
        max_micro_batch: gpu_mem.map(|total| ((total as f64 * 0.9 - static_bytes) / per_sequence).max(0.0) as usize),
    })
}

pub(crate) fn gpu_name_and_memory() -> Result<(String, Option<usize>)> {
    crate::cuda::runtime::device_count()?;
    let ctx = cudarc::driver::CudaContext::new(0).map_err(crate::cuda::runtime::cuda_err)?;
    Ok((
        ctx.name().map_err(crate::cuda::runtime::cuda_err)?,
        Some(ctx.total_mem().map_err(crate::cuda::runtime::cuda_err)?),
    ))
}

/// Another run's report, for a ratio: what `benches/torch_reference.py --json` writes.
#[derive(serde::Deserialize, Debug)]
pub struct Other {
    #[serde(default)]
    pub framework: Option<String>,
    pub device: String,
    pub tokens_per_s: f64,
    pub tokens_per_step: usize,
}

impl Other {
    pub fn read(path: &std::path::Path) -> Result<Other> {
        let text = crate::files::read_text(path, "--against")?;
        let other: Other = serde_json::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "--against {}: not a bench JSON (tokens_per_s, tokens_per_step, device): {e}",
                path.display()
            )
        })?;
        // a ratio against 0 or a negative speed would print inf× or a negative multiple
        if !(other.tokens_per_s.is_finite() && other.tokens_per_s > 0.0) {
            anyhow::bail!(
                "--against {}: tokens_per_s is {}; a run's speed is a positive number of tokens a second",
                path.display(),
                other.tokens_per_s
            );
        }
        Ok(other)
    }

    /// One line: our tokens/s as a multiple of the other run's.
    pub fn compare(&self, r: &Report) -> String {
        let who = self.framework.clone().unwrap_or_else(|| "ferrotron".into());
        let mut line = format!(
            "against {who} on {}: {:.2}× its tokens/s ({:.0} vs {:.0})",
            self.device,
            r.tokens_per_s / self.tokens_per_s,
            r.tokens_per_s,
            self.tokens_per_s
        );
        if self.tokens_per_step != r.tokens_per_step || self.device != r.device {
            line += " — not the same batch or device: compare with care";
        }
        line
    }
}

/// The report as the table `ferrotron bench` prints.
pub fn table(r: &Report) -> String {
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("n/a".to_string(), f);
    let rows = [
        ("device", format!("{} ({}, {} rank{})", r.device, r.dtype, r.ranks, if r.ranks == 1 { "" } else { "s" })),
        ("parameters", format!("{:.1}M", r.parameters as f64 / 1e6)),
        ("tokens per step", format!("{} (sequence {})", r.tokens_per_step, r.seq_len)),
        (
            "step time",
            format!("{:.1} ms (mean of {} steps after {} warm-up)", r.step_ms, r.measured_steps, r.warmup_steps),
        ),
        ("tokens/s", format!("{:.0}", r.tokens_per_s)),
        ("model TFLOP/s", format!("{:.2} ({:.3} GFLOP per token)", r.achieved_tflops, r.flops_per_token / 1e9)),
        ("MFU", opt(r.mfu, &|m| format!("{:.1}% of {}", 100.0 * m, peak_in_words(r)))),
        ("peak memory", opt(r.gpu_peak_mib, &|m| format!("{m:.0} MiB (GPU tensors, rank 0)"))),
        (
            "formula",
            format!(
                "{:.0} MiB weights+grads+AdamW, {:.0} MiB activations held at once",
                r.formula_static_mib, r.formula_activations_mib
            ),
        ),
        ("largest micro-batch", r.max_micro_batch.map_or("n/a".to_string(), |b| format!("{b} sequences"))),
    ];
    rows.iter().map(|(k, v)| format!("{k:<20} {v}\n")).collect()
}

/// The peak MFU divides by: one GPU's, or the whole CPU's (its ranks share it).
fn peak_in_words(r: &Report) -> String {
    let peak = r.peak_tflops.unwrap_or(0.0);
    match r.device.as_str() {
        "cpu" => format!("{peak:.3} TFLOP/s (this CPU's f32 GEMM, measured once)"),
        _ => format!("{peak:.1} TFLOP/s per rank"),
    }
}
