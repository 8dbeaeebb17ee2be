//! # `ferrotron bench --op attention`: one layer's attention, alone
//!
//! Attention is the one op whose cost grows with the square of the sequence, and the one a
//! from-scratch repository most easily gets slow (it was 85% of the step before
//! `kernels/flash_attention.cu`). This measures it without the rest of the step: the forward, and
//! the forward with the backward (δ, dq, dk, dv), on a config's shapes (micro-batch, sequence,
//! heads, KV heads, head size), in its compute dtype, as GPU time of the kernels (CUDA events,
//! `cuda/profile.rs`), averaged over `steps` calls after `warmup`. The FLOPs are the causal half
//! of the square, as FlashAttention's benchmarks count them:
//!
//! ```text
//! forward           4·b·h·s²·d / 2     (Q·Kᵀ and P·V, 2 FLOPs a multiply-add, half the square)
//! forward+backward  3.5 × the forward  (the backward recomputes S and makes dP, dQ, dK, dV: 2.5×)
//! ```
//! `benches/torch_reference.py --op attention` measures PyTorch's SDPA (FlashAttention-2 and
//! cuDNN) on the same shapes, and `.ci/gpu_check` prints both.

use crate::config::{Config, DeviceKind};
use crate::cuda::profile;
use crate::cuda::runtime::Gpu;
use crate::ops::tensor::Place;
use crate::ops::{self, Attn};
use anyhow::{bail, Result};
use serde::Serialize;

/// What `bench --op attention` measured.
#[derive(Clone, Debug, Serialize)]
pub struct AttentionReport {
    pub device: String,
    pub dtype: String,
    /// (batch, sequence, heads, KV heads, head size)
    pub shape: (usize, usize, usize, usize, usize),
    pub kernels: String,
    /// each attention kernel's time a layer (ms), the longest first
    pub per_kernel_ms: Vec<(String, f64)>,
    pub forward_ms: f64,
    pub forward_tflops: f64,
    pub forward_backward_ms: f64,
    pub forward_backward_tflops: f64,
}

/// The causal attention FLOPs of one forward over `a` (half of the s × s square).
pub fn forward_flops(a: Attn) -> f64 {
    4.0 * (a.batch * a.heads) as f64 * (a.seq as f64).powi(2) * a.head_dim as f64 / 2.0
}

/// Times the attention of `cfg`'s shapes on GPU 0.
pub fn bench_attention(cfg: &Config, warmup: usize, steps: usize) -> Result<AttentionReport> {
    if cfg.device.kind != DeviceKind::Cuda {
        bail!("--op attention times GPU kernels: set device.kind = \"cuda\"");
    }
    if steps == 0 {
        bail!("--steps 0: measure at least one call");
    }
    let (m, t) = (&cfg.model, &cfg.train);
    let head_dim = m.head_dim();
    let a = Attn {
        batch: t.micro_batch_size,
        seq: t.seq_len,
        kv_seq: t.seq_len,
        heads: m.num_attention_heads,
        kv_heads: m.num_key_value_heads,
        head_dim,
    };
    let dtype = cfg.device.compute_dtype();
    let (device, _) = super::bench::gpu_name_and_memory()?;
    let gpu = Gpu::open(0)?;
    let place = Place::Cuda(crate::cuda::device::Device::new(&gpu, dtype)?);
    let rand = |seed: u64, shape: &[usize]| {
        crate::model::init::normal(seed, "bench attention", shape, 1.0).to_dtype(&place, dtype)
    };
    let (rows, kv_rows) = (a.batch * a.seq, a.batch * a.kv_seq);
    let q = rand(1, &[rows, a.heads * head_dim]);
    let (k, v) = (rand(2, &[kv_rows, a.kv_heads * head_dim]), rand(3, &[kv_rows, a.kv_heads * head_dim]));
    let dout = rand(4, &[rows, a.heads * head_dim]);
    let pos: Vec<u32> = (0..a.seq as u32).collect();
    let layer = || {
        let (out, lse) = ops::attention(a, &q, &k, &v, (&pos, &pos));
        ops::attention_backward(a, (&q, &k, &v), (&pos, &pos), (&out, &lse), &dout);
    };
    for _ in 0..warmup {
        layer(); // kernels loaded, memory pools grown
    }
    profile::start();
    for _ in 0..steps {
        layer();
    }
    let rows = profile::finish()?;
    // forward kernels are named *attention_forward* (attention_wide_forward_* past 128); the rest
    // (δ, dq, dk, dv, the sums of parts) is the backward
    let every: Vec<&profile::Row> = rows.iter().filter(|r| r.name.contains("attention")).collect();
    let forward: Vec<&profile::Row> = every.iter().copied().filter(|r| r.name.contains("_forward")).collect();
    let attention_ms = |rs: &[&profile::Row]| rs.iter().map(|r| r.ms).sum::<f64>() / steps as f64;
    let (forward_ms, forward_backward_ms) = (attention_ms(&forward), attention_ms(&every));
    let flops = forward_flops(a);
    let per_kernel_ms = every.iter().map(|r| (r.name.clone(), r.ms / steps as f64)).collect();
    let mut kernels: Vec<&str> = every.iter().map(|r| r.name.as_str()).collect();
    kernels.sort();
    Ok(AttentionReport {
        device,
        dtype: format!("{dtype:?}").to_lowercase(),
        shape: (a.batch, a.seq, a.heads, a.kv_heads, head_dim),
        kernels: kernels.join(" "),
        per_kernel_ms,
        forward_ms,
        forward_tflops: flops / forward_ms / 1e9,
        forward_backward_ms,
        forward_backward_tflops: 3.5 * flops / forward_backward_ms / 1e9,
    })
}

/// The report as printed.
pub fn attention_table(r: &AttentionReport) -> String {
    let (b, s, h, kv, d) = r.shape;
    let each: Vec<String> = r.per_kernel_ms.iter().map(|(name, ms)| format!("{name} {ms:.3}")).collect();
    format!(
        "device               {} ({})\nshape                batch {b}, sequence {s}, heads {h}, KV heads {kv}, head size {d} (causal)\n\
         kernels              {}\nper kernel (ms)      {}\nforward              {:.3} ms ({:.1} TFLOP/s)\nforward+backward     {:.3} ms ({:.1} TFLOP/s)\n",
        r.device, r.dtype, r.kernels, each.join(", "), r.forward_ms, r.forward_tflops, r.forward_backward_ms, r.forward_backward_tflops
    )
}
