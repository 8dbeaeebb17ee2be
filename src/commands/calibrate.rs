//! # `ferrotron bench --calibrate`: the rates `plan` predicts with, measured on this machine
//!
//! A datasheet's peak is not what a run reaches: a small GEMM reaches a fraction of it, attention
//! less, and the small ops are bound by memory and by the cost of starting each one. `plan`
//! divides work by *measured* rates (`step_time::Rates`). On this CPU they are measured here, on
//! every thread and on one (ranks as threads share the cores: with as many ranks as cores each
//! computes on about one), and kept in `calibration.json` of the cache folder beside the CPU's
//! peak; the wire between ranks (the local backend: shared memory between threads) too:
//!
//! ```text
//! GEMM        a linear layer forward and backward (ops::linear, linear_backward) at the row counts
//!             and widths of small models: 3 · 2·m·k·n / time / (the same at 1024³)
//! attention   ops::attention forward + backward, causal FLOPs × 3.5 / time / peak
//! small ops   one block's norms, residual adds, RoPE and SwiGLU, forward and backward → the
//!             bandwidth over the bytes step_time counts; ops::add_assign on 64 values → µs an op
//! the wire    an all-reduce of 4 bytes between two ranks → α; of 8 MiB → β
//! ```

use crate::comm::launcher::{launch, Rank};
use crate::comm::process_grid::{Axis, Grid};
use crate::comm::ReduceOp;
use crate::commands::step_time;
use crate::commands::step_time::{Rates, Wire};
use crate::config::Config;
use crate::ops;
use crate::ops::precision::Precision;
use crate::ops::tensor::Tensor;
use crate::ops::types::Attn;
use anyhow::{Context, Result};
use std::time::{Duration, Instant};

/// What `bench --calibrate` records for this CPU.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CpuCalibration {
    /// Every thread of the pool on each op (one rank alone).
    pub all_threads: Rates,
    /// One thread (a rank among as many ranks as cores).
    pub one_thread: Rates,
    pub threads: usize,
    /// The local backend between two ranks.
    pub wire: Wire,
}

/// The best of `n` timings of `f` after one to warm up, in seconds.
fn best(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..n)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

/// A tensor of `rows × cols` small values (never zeros: a product of zeros can be faster).
fn fill(rows: usize, cols: usize) -> Tensor {
    Tensor::from_vec(&[rows, cols], (0..rows * cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect())
}

/// The rates of the op layer on the pool it runs in now.
fn rates(source: &str) -> Rates {
    // a linear layer forward and backward (x·wᵀ; dx = dy·w, dw += dyᵀ·x): 3 × 2·m·k·n FLOPs
    let linear = |m: usize, k: usize, n: usize| {
        let (x, w, dy) = (fill(m, k), fill(n, k), fill(m, n));
        let mut dw = Tensor::zeros(&[n, k]);
        let s = best(3, || {
            let _ = ops::linear(&x, &w, Precision::F32);
            let _ = ops::linear_backward(&dy, &x, &w, &mut dw, Precision::F32);
        });
        (2.0 * (m * k * n) as f64, 3.0 * 2.0 * (m * k * n) as f64 / s)
    };
    let (_, peak) = linear(1024, 1024, 1024);
    // the shapes of small models' layers: rows of a micro-batch, widths of a block
    let shapes = [
        (512, 32, 32),
        (512, 64, 64),
        (1024, 128, 128),
        (2048, 128, 384),
        (2048, 384, 128),
        (4096, 256, 256),
        (2048, 512, 512),
        (1024, 1024, 1024),
    ];
    let mut gemm: Vec<(f64, f64)> = shapes
        .iter()
        .map(|&(m, k, n)| {
            let (flops, rate) = linear(m, k, n);
            (flops, rate / peak)
        })
        .collect();
    gemm.sort_by(|a, b| a.0.total_cmp(&b.0));
    gemm.dedup_by(|a, b| a.0 == b.0);
    // attention: 4 sequences of 128, 8 heads (4 KV) of 16
    let a = Attn { batch: 4, seq: 128, kv_seq: 128, heads: 8, kv_heads: 4, head_dim: 16 };
    let (q, k, v) = (fill(512, 128), fill(512, 64), fill(512, 64));
    let pos: Vec<u32> = (0..128u32).collect();
    let attention_s = best(3, || {
        let (out, lse) = ops::attention(a, &q, &k, &v, (&pos, &pos));
        let _ = ops::attention_backward(a, (&q, &k, &v), (&pos, &pos), (&out, &lse), &out);
    });
    let causal = 4.0 * (a.batch * a.heads * a.seq * a.seq * a.head_dim) as f64 / 2.0;
    // the small ops of one block, forward and backward, on 2048 rows of a d = 128 block: the
    // bandwidth that makes `step_time::small_bytes` take as long; the fixed cost of an op on 64
    // values
    let small_s = best(3, || small_ops(2048, (128, 128, 64, 384)));
    let block = Config::load(
        None,
        &[
            "model.hidden_size=128".into(),
            "model.intermediate_size=384".into(),
            "model.num_attention_heads=8".into(),
            "model.num_key_value_heads=4".into(),
        ],
    );
    let bytes = block.map_or(0.0, |c| 3.0 * 2048.0 * step_time::small_bytes(&c, 4.0));
    let (mut u, w) = (Tensor::from_vec(&[64], vec![1.0; 64]), Tensor::from_vec(&[64], vec![0.5; 64]));
    let tiny = best(50, || ops::add_assign(&mut u, &w));
    Rates {
        source: source.to_string(),
        peak_tflops: peak / 1e12,
        gemm,
        attention: causal * 3.5 / attention_s / peak,
        small_gb_s: bytes / small_s / 1e9,
        op_us: tiny * 1e6,
    }
}

/// One block's small ops on `rows` rows, forward and backward: two RMSNorms with their residual
/// adds, RoPE on q and k, SwiGLU.
fn small_ops(rows: usize, (d, q, kv, f): (usize, usize, usize, usize)) {
    let (x, add, w) = (fill(rows, d), fill(rows, d), Tensor::from_vec(&[d], vec![1.0; d]));
    let mut dw = Tensor::zeros(&[d]);
    let pos: Vec<u32> = (0..rows as u32).collect();
    for _ in 0..2 {
        let mut h = x.clone();
        let (y, rstd) = ops::add_rmsnorm(&mut h, &add, &w, 1e-5);
        let _ = ops::rmsnorm_backward(&y, &h, &w, &rstd, &mut dw, Some(&add));
    }
    let (mut qt, mut kt) = (fill(rows, q), fill(rows, kv));
    ops::rope(&mut qt, &pos, 16, 1e4);
    ops::rope(&mut kt, &pos, 16, 1e4);
    ops::rope_backward(&mut qt, &pos, 16, 1e4);
    ops::rope_backward(&mut kt, &pos, 16, 1e4);
    let (gate, up) = (fill(rows, f), fill(rows, f));
    let h = ops::swiglu(&gate, &up);
    let _ = ops::swiglu_backward(&h, &gate, &up);
}

/// α and β of the local backend between two ranks (threads): an all-reduce of 4 bytes is
/// latency alone (2 hops), one of 8 MiB moves the bytes once each way (`step_time`'s model).
fn wire() -> Result<Wire> {
    let times = launch(Grid::new(2, 1, 1, 1)?, Duration::from_secs(60), |me: &Rank| {
        let group = me.group(Axis::World);
        let time = |values: usize| -> Result<f64> {
            let mut t = Tensor::from_vec(&[values], vec![1.0; values]);
            let mut best = f64::MAX;
            for _ in 0..20 {
                let start = Instant::now();
                group.all_reduce_tensor(&mut t, ReduceOp::Sum)?;
                best = best.min(start.elapsed().as_secs_f64());
            }
            Ok(best)
        };
        Ok((time(1)?, time(2 << 20)?))
    })?;
    let (small, large) = times[0];
    let alpha = small / 2.0;
    Ok(Wire { alpha_s: alpha, beta_b_s: (8 << 20) as f64 / (large - 2.0 * alpha).max(1e-9) })
}

/// Today's date (UTC), as YYYY-MM-DD.
fn today() -> String {
    let days =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86_400) as i64;
    // days since 1970-01-01 to a civil date (Howard Hinnant's algorithm)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let (d, m) = (doy - (153 * mp + 2) / 5 + 1, if mp < 10 { mp + 3 } else { mp - 9 });
    format!("{:04}-{m:02}-{d:02}", yoe + era * 400 + i64::from(m <= 2))
}

/// Measures this CPU (a few seconds) and records it in `calibration.json` of `cache_dir`.
pub fn calibrate(cache_dir: &str) -> Result<CpuCalibration> {
    let threads = rayon::current_num_threads();
    let date = today();
    let all_threads = rates(&format!("this CPU, {threads} threads, measured {date} (bench --calibrate)"));
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().context("a one-thread pool")?;
    let one_thread = one.install(|| rates(&format!("this CPU, one thread, measured {date} (bench --calibrate)")));
    let calibration = CpuCalibration { all_threads, one_thread, threads, wire: wire()? };
    let file = crate::devices::calibration_file(cache_dir)?;
    crate::devices::record_cpu_field(&file, &crate::devices::cpu_key(), "plan", serde_json::to_value(&calibration)?)?;
    Ok(calibration)
}

/// What `bench --calibrate` recorded for this CPU in `cache_dir`.
pub fn recorded(cache_dir: &str) -> Result<CpuCalibration> {
    let file = crate::devices::calibration_file(cache_dir)?;
    let value = crate::devices::recorded_cpu_field(&file, &crate::devices::cpu_key(), "plan").with_context(|| {
        format!("no calibration of this CPU in {}: run `ferrotron bench --calibrate` first", file.display())
    })?;
    let again =
        || format!("{}: the plan's calibration is unreadable; run `ferrotron bench --calibrate` again", file.display());
    let c: CpuCalibration = serde_json::from_value(value).with_context(again)?;
    // a file edited by hand: every rate positive and finite, the GEMM points rising
    let positive = |x: f64| x.is_finite() && x > 0.0;
    let rates_ok = |r: &Rates| {
        !r.gemm.is_empty()
            && r.gemm.iter().all(|&(f, e)| positive(f) && positive(e))
            && r.gemm.windows(2).all(|w| w[0].0 < w[1].0)
            && [r.peak_tflops, r.attention, r.small_gb_s].into_iter().all(positive)
            && r.op_us.is_finite()
            && r.op_us >= 0.0
    };
    let wire_ok = c.wire.alpha_s.is_finite() && c.wire.alpha_s >= 0.0 && positive(c.wire.beta_b_s);
    if !(rates_ok(&c.all_threads) && rates_ok(&c.one_thread) && wire_ok && c.threads > 0) {
        anyhow::bail!("{}", again());
    }
    Ok(c)
}

/// A table of what was measured.
pub fn table(c: &CpuCalibration) -> String {
    let mut s = String::new();
    for (what, r) in [(format!("{} threads", c.threads), &c.all_threads), ("1 thread".to_string(), &c.one_thread)] {
        s += &format!("{what}: f32 GEMM peak {:.3} TFLOP/s; efficiency by GFLOP a call:", r.peak_tflops);
        for (f, e) in &r.gemm {
            s += &format!(" {:.3}→{:.2}", f / 1e9, e);
        }
        s += &format!("; attention {:.2}; small ops {:.1} GB/s, {:.1} µs an op\n", r.attention, r.small_gb_s, r.op_us);
    }
    s += &format!(
        "the local backend between two ranks: α = {:.1} µs, β = {:.1} GB/s\n",
        c.wire.alpha_s * 1e6,
        c.wire.beta_b_s / 1e9
    );
    s
}
