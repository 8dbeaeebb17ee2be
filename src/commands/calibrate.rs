//! # `ferrotron bench --calibrate`: the rates `plan` predicts with, measured on this machine
//!
//! A datasheet's peak is not what a run reaches: a small GEMM reaches a fraction of it, attention
//! less, and the small ops are bound by memory and by the cost of starting each one. `plan`
//! divides work by *measured* rates (`step_time::Rates`), measured here through the op layer the
//! runs use, and kept in `calibration.json` of the cache folder:
//!
//! ```text
//! GEMM        a linear layer forward and backward (ops::linear, linear_backward):
//!             3 · 2·m·k·n / time / the peak (a CPU's: its fastest GEMM's, at 1024³; a GPU's: its
//!             datasheet's)
//! attention   ops::attention forward + backward, causal FLOPs × 3.5 / time / peak
//! small ops   one block's norms, residual adds, RoPE and SwiGLU, forward and backward → the
//!             bandwidth over the bytes step_time counts; ops::add_assign on 64 values → µs an op
//! the wire    an all-reduce of 4 bytes between two ranks → α; of 8 MiB → β
//! ```
//! On this CPU (`device.kind = "cpu"`) the shapes are small models' and the rates are measured
//! on every thread and on one (ranks as threads share the cores: with as many ranks as cores
//! each computes on about one); the wire is the local backend between two rank threads. On a GPU
//! (`device.kind = "cuda"`, GPU 0, in `device.dtype`) the shapes are the config's own — its
//! block's four GEMMs at a quarter, one and four times a micro-batch's rows, its attention, its
//! block's small ops — timed by the GPU (CUDA events: the kernels' time); a launch's own cost is
//! what a stream of tiny ops takes on the host's clock beyond their kernels. The wire is NCCL
//! between GPUs 0 and 1 where the machine has two; with one, `plan` keeps the table's link
//! figures and says so. A GPU's calibration is recorded under the name its driver reports and
//! the dtype, and `plan --gpu KEY --dtype D` uses the latest one whose name the device table
//! gives that KEY.

use crate::comm::launcher::{launch_on, Backend, Capacity, Rank, Setup};
use crate::comm::process_grid::{Axis, Grid};
use crate::comm::ReduceOp;
use crate::commands::step_time;
use crate::commands::step_time::{Rates, Wire};
use crate::config::{Config, DeviceDtype, DeviceKind};
use crate::cuda::profile;
use crate::ops;
use crate::ops::precision::Precision;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::types::{Attn, DType};
use anyhow::{bail, Context, Result};
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

/// What `bench --calibrate` records for a GPU, computing in one dtype.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GpuCalibration {
    /// The name its driver reports ("NVIDIA H100 80GB HBM3").
    pub name: String,
    /// "bf16", "fp8" (bf16 with FP8 GEMMs) or "f32".
    pub dtype: String,
    /// When (YYYY-MM-DD): of several calibrations for one `--gpu`, `plan` takes the latest.
    pub measured: String,
    pub rates: Rates,
    /// NCCL between GPUs 0 and 1 (none on a machine of one GPU).
    pub wire: Option<Wire>,
}

/// Where a calibration measures: this CPU's thread pool, or a GPU computing in `dtype` with
/// `precision` GEMMs.
struct On {
    place: Place,
    dtype: DType,
    precision: Precision,
}

impl On {
    fn cpu() -> On {
        On { place: Place::Cpu, dtype: DType::F32, precision: Precision::F32 }
    }

    /// A tensor of `rows × cols` small values (never zeros: a product of zeros can be faster).
    fn tensor(&self, rows: usize, cols: usize) -> Tensor {
        let data = (0..rows * cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
        Tensor::from_host_in(&[rows, cols], data, &self.place, self.dtype)
    }

    /// Waits for everything queued (on a GPU a CPU–GPU sync point; on the CPU nothing is queued).
    fn sync(&self) -> Result<()> {
        match &self.place {
            Place::Cpu => Ok(()),
            Place::Cuda(dev) => dev.gpu.compute.synchronize().map_err(crate::cuda::runtime::cuda_err),
        }
    }

    /// Seconds one call of `f` takes, after one call to warm up: on the CPU the best of `n`
    /// calls on the wall clock; on a GPU the time its kernels ran (CUDA events), the mean of `n`
    /// calls — what the launches cost beyond that is `op_us`, measured apart.
    fn time(&self, n: usize, mut f: impl FnMut()) -> Result<f64> {
        f();
        if let Place::Cpu = self.place {
            return Ok((0..n)
                .map(|_| {
                    let start = Instant::now();
                    f();
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min));
        }
        profile::start();
        (0..n).for_each(|_| f());
        let kernels = profile::finish()?;
        Ok(kernels.iter().map(|k| k.ms).sum::<f64>() / 1e3 / n as f64)
    }
}

/// The shapes a calibration measures at: GEMMs (m, k, n), one attention, and one block's small
/// ops on `rows` rows of widths (d, q, kv, f).
struct Shapes {
    gemms: Vec<(usize, usize, usize)>,
    attention: Attn,
    rows: usize,
    widths: (usize, usize, usize, usize),
}

impl Shapes {
    /// This CPU's: the row counts and widths of small models' layers.
    fn cpu() -> Shapes {
        Shapes {
            gemms: vec![
                (512, 32, 32),
                (512, 64, 64),
                (1024, 128, 128),
                (2048, 128, 384),
                (2048, 384, 128),
                (4096, 256, 256),
                (2048, 512, 512),
                (1024, 1024, 1024),
            ],
            // 4 sequences of 128, 8 heads (4 KV) of 16
            attention: Attn { batch: 4, seq: 128, kv_seq: 128, heads: 8, kv_heads: 4, head_dim: 16 },
            rows: 2048,
            widths: (128, 128, 64, 384),
        }
    }

    /// A config's own: its block's GEMMs (q, k and v in one; the output; gate and up in one; the
    /// down projection, as `step_time::micro_batch` counts them) at a quarter, one and four
    /// micro-batches of rows, its attention on a micro-batch, its block's small ops.
    fn of(cfg: &Config) -> Shapes {
        let (m, t) = (&cfg.model, &cfg.train);
        let rows = t.micro_batch_size * t.seq_len;
        let (d, f, hd) = (m.hidden_size, m.intermediate_size, m.head_dim());
        let (q, kv) = (m.num_attention_heads * hd, m.num_key_value_heads * hd);
        let block = [(d, q + 2 * kv), (q, d), (d, 2 * f), (f, d)];
        let gemms =
            [(rows / 4).max(1), rows, 4 * rows].into_iter().flat_map(|r| block.map(|(k, n)| (r, k, n))).collect();
        let attention = Attn {
            batch: t.micro_batch_size,
            seq: t.seq_len,
            kv_seq: t.seq_len,
            heads: m.num_attention_heads,
            kv_heads: m.num_key_value_heads,
            head_dim: hd,
        };
        Shapes { gemms, attention, rows, widths: (d, q, kv, f) }
    }
}

/// The rates of the op layer on `on` at `shapes`, each GEMM's efficiency a fraction of `peak`
/// (TFLOP/s; none: the fastest GEMM's rate).
fn rates(on: &On, source: String, shapes: &Shapes, peak: Option<f64>) -> Result<Rates> {
    // a linear layer forward and backward (x·wᵀ; dx = dy·w, dw += dyᵀ·x): 3 × 2·m·k·n FLOPs
    let mut measured = Vec::new();
    // the largest first: the small ones are then timed on a machine already awake (the pool's
    // threads spinning, the clocks up), as in a step
    for &(m, k, n) in shapes.gemms.iter().rev() {
        let (x, w, dy) = (on.tensor(m, k), on.tensor(n, k), on.tensor(m, n));
        let mut dw = Tensor::zeros_on(&[n, k], &on.place, DType::F32);
        let s = on.time(3, || {
            let _ = ops::linear(&x, &w, on.precision);
            let _ = ops::linear_backward(&dy, &x, &w, &mut dw, on.precision);
        })?;
        let flops = 2.0 * (m * k * n) as f64;
        measured.push((flops, 3.0 * flops / s));
    }
    let peak = peak.map_or_else(|| measured.iter().map(|g| g.1).fold(f64::NAN, f64::max), |t| t * 1e12);
    // one point a FLOP count, rising (shapes of equal FLOPs: the mean of their efficiencies)
    measured.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut gemm: Vec<(f64, f64)> = Vec::new();
    for group in measured.chunk_by(|a, b| a.0 == b.0) {
        let mean = group.iter().map(|g| g.1).sum::<f64>() / group.len() as f64;
        gemm.push((group[0].0, mean / peak));
    }
    let a = shapes.attention;
    let (rows, kv_rows) = (a.batch * a.seq, a.batch * a.kv_seq);
    let q = on.tensor(rows, a.heads * a.head_dim);
    let (k, v) = (on.tensor(kv_rows, a.kv_heads * a.head_dim), on.tensor(kv_rows, a.kv_heads * a.head_dim));
    let pos: Vec<u32> = (0..a.seq as u32).collect();
    let attention_s = on.time(3, || {
        let (out, lse) = ops::attention(a, &q, &k, &v, (&pos, &pos));
        let _ = ops::attention_backward(a, (&q, &k, &v), (&pos, &pos), (&out, &lse), &out);
    })?;
    let causal = super::bench_attention::forward_flops(a);
    // the small ops of one block, forward and backward: the bandwidth that makes
    // `step_time::small_bytes` take as long
    let small_s = on.time(3, || small_ops(on, shapes.rows, shapes.widths, a.head_dim))?;
    let (d, q_width, kv_width, f) = shapes.widths;
    let block = Config::load(
        None,
        &[
            format!("model.hidden_size={d}"),
            format!("model.intermediate_size={f}"),
            format!("model.num_attention_heads={}", q_width / a.head_dim),
            format!("model.num_key_value_heads={}", kv_width / a.head_dim),
            format!("model.head_dim={}", a.head_dim),
        ],
    );
    let element = if on.dtype == DType::Bf16 { 2.0 } else { 4.0 };
    let bytes = block.map_or(0.0, |c| 3.0 * shapes.rows as f64 * step_time::small_bytes(&c, element));
    // the fixed cost of an op, on 64 values: on the CPU the whole op; on a GPU what a stream of
    // them takes on the host's clock beyond their kernels (the launch)
    let (mut u, w) = (on.tensor(1, 64), on.tensor(1, 64));
    let kernel = on.time(50, || ops::add_assign(&mut u, &w))?;
    let op_s = match on.place {
        Place::Cpu => kernel,
        Place::Cuda(_) => {
            let start = Instant::now();
            (0..200).for_each(|_| ops::add_assign(&mut u, &w));
            on.sync()?;
            (start.elapsed().as_secs_f64() / 200.0 - kernel).max(0.0)
        }
    };
    Ok(Rates {
        source,
        peak_tflops: peak / 1e12,
        gemm,
        attention: causal * 3.5 / attention_s / peak,
        small_gb_s: bytes / small_s / 1e9,
        op_us: op_s * 1e6,
        // not timed here (it needs a collective running beside a GEMM): on a GPU the share
        // `Rates::h100` takes from DeepSeek-V3's report; on a CPU none, the local backend's
        // copies being in the calibrated steps already
        overlap_slowdown: match on.place {
            Place::Cpu => 0.0,
            Place::Cuda(_) => Rates::h100().overlap_slowdown,
        },
    })
}

/// One block's small ops on `rows` rows of widths (d, q, kv, f), forward and backward: two
/// RMSNorms with their residual adds, RoPE on q and k (heads of `hd`), SwiGLU.
fn small_ops(on: &On, rows: usize, (d, q, kv, f): (usize, usize, usize, usize), hd: usize) {
    let (x, add) = (on.tensor(rows, d), on.tensor(rows, d));
    let w = Tensor::from_host_in(&[d], vec![1.0; d], &on.place, on.dtype);
    let mut dw = Tensor::zeros_on(&[d], &on.place, DType::F32);
    let pos: Vec<u32> = (0..rows as u32).collect();
    for _ in 0..2 {
        let mut h = x.clone();
        let (y, rstd) = ops::add_rmsnorm(&mut h, &add, &w, 1e-5);
        let _ = ops::rmsnorm_backward(&y, &h, &w, &rstd, &mut dw, Some(&add));
    }
    let (mut qt, mut kt) = (on.tensor(rows, q), on.tensor(rows, kv));
    let rope = ops::Rope::plain(1e4, hd);
    ops::rope(&mut qt, &pos, &rope);
    ops::rope(&mut kt, &pos, &rope);
    ops::rope_backward(&mut qt, &pos, &rope);
    ops::rope_backward(&mut kt, &pos, &rope);
    let (gate, up) = (on.tensor(rows, f), on.tensor(rows, f));
    let h = ops::swiglu(&gate, &up);
    let _ = ops::swiglu_backward(&h, &gate, &up);
}

/// α and β between two ranks of `setup` (threads on the local backend; GPUs 0 and 1 on NCCL):
/// an all-reduce of 4 bytes is latency alone (2 hops), one of 8 MiB moves the bytes once each
/// way (`step_time`'s model). Each is the best of 20 calls on the CPU; on GPUs, where only a
/// sync tells when a call is done, the best of 5 means of 10 calls in a row.
fn wire(setup: Setup) -> Result<Wire> {
    let times = launch_on(Grid::new(2, 1, 1, 1)?, setup, |me: &Rank| {
        let on = match &me.gpu {
            Some(gpu) => On { place: Place::for_rank(Some(gpu), DType::F32)?, ..On::cpu() },
            None => On::cpu(),
        };
        let group = me.group(Axis::World);
        let (tries, calls) = if me.gpu.is_some() { (5, 10) } else { (20, 1) };
        let time = |values: usize| -> Result<f64> {
            let mut t = Tensor::zeros_on(&[values], &on.place, DType::F32);
            group.all_reduce_tensor(&mut t, ReduceOp::Sum)?; // NCCL sets its channels up on the first
            let mut best = f64::MAX;
            for _ in 0..tries {
                let start = Instant::now();
                for _ in 0..calls {
                    group.all_reduce_tensor(&mut t, ReduceOp::Sum)?;
                }
                on.sync()?;
                best = best.min(start.elapsed().as_secs_f64() / calls as f64);
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
    let (on, shapes) = (On::cpu(), Shapes::cpu());
    let source = |what: &str| format!("this CPU, {what}, measured {date} (bench --calibrate)");
    let all_threads = rates(&on, source(&format!("{threads} threads")), &shapes, None)?;
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().context("a one-thread pool")?;
    let one_thread = one.install(|| rates(&on, source("one thread"), &shapes, None))?;
    let calibration =
        CpuCalibration { all_threads, one_thread, threads, wire: wire(Setup::cpu(Duration::from_secs(60)))? };
    let file = crate::devices::calibration_file(cache_dir)?;
    let key = crate::devices::cpu_key();
    crate::devices::record_field(&file, &["cpu", &key, "plan"], serde_json::to_value(&calibration)?)?;
    Ok(calibration)
}

/// What `bench --calibrate` recorded for this CPU in `cache_dir`.
pub fn recorded(cache_dir: &str) -> Result<CpuCalibration> {
    let file = crate::devices::calibration_file(cache_dir)?;
    let value =
        crate::devices::recorded_field(&file, &["cpu", &crate::devices::cpu_key(), "plan"]).with_context(|| {
            format!("no calibration of this CPU in {}: run `ferrotron bench --calibrate` first", file.display())
        })?;
    let again =
        || format!("{}: the plan's calibration is unreadable; run `ferrotron bench --calibrate` again", file.display());
    let c: CpuCalibration = serde_json::from_value(value).with_context(again)?;
    if !(rates_ok(&c.all_threads) && rates_ok(&c.one_thread) && wire_ok(&c.wire) && c.threads > 0) {
        bail!("{}", again());
    }
    Ok(c)
}

/// A file edited by hand: every rate positive and finite, the GEMM points rising.
fn rates_ok(r: &Rates) -> bool {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    !r.gemm.is_empty()
        && r.gemm.iter().all(|&(f, e)| positive(f) && positive(e))
        && r.gemm.windows(2).all(|w| w[0].0 < w[1].0)
        && [r.peak_tflops, r.attention, r.small_gb_s].into_iter().all(positive)
        && r.op_us.is_finite()
        && r.op_us >= 0.0
        && (0.0..1.0).contains(&r.overlap_slowdown)
}

fn wire_ok(w: &Wire) -> bool {
    w.alpha_s.is_finite() && w.alpha_s >= 0.0 && w.beta_b_s.is_finite() && w.beta_b_s > 0.0
}

/// How a calibration names the dtype of `cfg`'s GEMMs.
fn dtype_word(precision: Precision) -> &'static str {
    match precision {
        Precision::F32 => "f32",
        Precision::Bf16 => "bf16",
        Precision::Fp8 => "fp8",
    }
}

/// Measures GPU 0 at `cfg`'s shapes in its dtype (and NCCL between GPUs 0 and 1 where there are
/// two), and records it in `calibration.json` of the config's cache folder.
pub fn calibrate_gpu(cfg: &Config) -> Result<GpuCalibration> {
    if cfg.device.kind != DeviceKind::Cuda {
        bail!("calibrating a GPU needs device.kind = \"cuda\"");
    }
    let (name, _) = super::bench::gpu_name_and_memory()?;
    let (precision, date) = (cfg.device.gemms(), today());
    let dtype = dtype_word(precision);
    let row = crate::devices::gpu_named(&name);
    let peak = row.map(|g| match precision {
        Precision::Fp8 => g.fp8_tflops,
        Precision::Bf16 => g.bf16_tflops,
        Precision::F32 => g.f32_tflops,
    });
    if precision == Precision::Fp8 && peak == Some(0.0) {
        bail!("device.dtype = \"fp8\" on {name}: it has no FP8 tensor cores; use \"bf16\"");
    }
    let gpu = crate::cuda::runtime::Gpu::open(0)?;
    let compute = cfg.device.compute_dtype();
    let on = On { place: Place::Cuda(crate::cuda::device::Device::new(&gpu, compute)?), dtype: compute, precision };
    let peak_said = match peak {
        Some(_) => "of its datasheet peak",
        None => "of its fastest GEMM's rate (it is not in the device table)",
    };
    let source = format!("{name}, {dtype}, measured {date} (bench --calibrate, efficiencies {peak_said})");
    let rates = rates(&on, source, &Shapes::of(cfg), peak)?;
    let wire = match crate::cuda::runtime::device_count()? {
        0 | 1 => None,
        _ => {
            let timeout = Duration::from_secs(120);
            let capacity = Capacity::gpu(1)?;
            let (sync_launches, spread, first_gpu) = (false, false, 0);
            Some(wire(Setup {
                timeout,
                cuda: true,
                sync_launches,
                backend: Backend::Nccl,
                capacity,
                spread,
                first_gpu,
            })?)
        }
    };
    let calibration = GpuCalibration { name: name.clone(), dtype: dtype.into(), measured: date, rates, wire };
    let file = crate::devices::calibration_file(&cfg.data.cache_dir)?;
    crate::devices::record_field(&file, &["gpu", &name, dtype], serde_json::to_value(&calibration)?)?;
    Ok(calibration)
}

/// The latest calibration recorded in `cache_dir` of a GPU the device table names `key`, for
/// `dtype` (bf16, or FP8 GEMMs); none when no such GPU was measured.
pub fn recorded_gpu(cache_dir: &str, key: &str, dtype: DeviceDtype) -> Result<Option<GpuCalibration>> {
    let file = crate::devices::calibration_file(cache_dir)?;
    let word = dtype_word(if dtype == DeviceDtype::Fp8 { Precision::Fp8 } else { Precision::Bf16 });
    let Some(serde_json::Value::Object(gpus)) = crate::devices::recorded_field(&file, &["gpu"]) else {
        return Ok(None);
    };
    let mut latest: Option<GpuCalibration> = None;
    for (name, entry) in gpus {
        if crate::devices::gpu_named(&name).map(|g| g.key) != Some(key) || entry.get(word).is_none() {
            continue;
        }
        let again = || {
            format!("{}: the calibration of {name} ({word}) is unreadable; run `ferrotron bench --calibrate --set device.kind=cuda` on it again, or remove it", file.display())
        };
        let c: GpuCalibration = serde_json::from_value(entry[word].clone()).with_context(again)?;
        if !(rates_ok(&c.rates) && c.wire.as_ref().is_none_or(wire_ok)) {
            bail!("{}", again());
        }
        if latest.as_ref().is_none_or(|l| c.measured >= l.measured) {
            latest = Some(c);
        }
    }
    Ok(latest)
}

/// A table of what was measured on this CPU.
pub fn table(c: &CpuCalibration) -> String {
    let mut s = String::new();
    for (what, r) in [(format!("{} threads", c.threads), &c.all_threads), ("1 thread".to_string(), &c.one_thread)] {
        s += &format!("{what}: f32 GEMM peak {:.3} TFLOP/s; {}\n", r.peak_tflops, rates_line(r));
    }
    s + &format!("the local backend between two ranks: {}\n", wire_line(&c.wire))
}

/// A table of what was measured on a GPU.
pub fn gpu_table(c: &GpuCalibration) -> String {
    let r = &c.rates;
    let mut s = format!("{} ({}): peak {:.1} TFLOP/s; {}\n", c.name, c.dtype, r.peak_tflops, rates_line(r));
    s += &match &c.wire {
        Some(w) => format!("NCCL between GPUs 0 and 1: {}\n", wire_line(w)),
        None => "one GPU: no wire to measure (plan keeps the device table's link figures)\n".into(),
    };
    s + &match crate::devices::gpu_named(&c.name) {
        Some(g) if !g.key.is_empty() => format!("plan --gpu {} --dtype {} predicts with it\n", g.key, c.dtype),
        _ => "not in the device table (src/devices.rs): plan --gpu cannot name it\n".into(),
    }
}

fn rates_line(r: &Rates) -> String {
    let points: Vec<String> = r.gemm.iter().map(|(f, e)| format!("{:.3}→{:.2}", f / 1e9, e)).collect();
    format!(
        "GEMM efficiency by GFLOP a call: {}; attention {:.2}; small ops {:.1} GB/s, {:.1} µs an op",
        points.join(" "),
        r.attention,
        r.small_gb_s,
        r.op_us
    )
}

fn wire_line(w: &Wire) -> String {
    format!("α = {:.1} µs, β = {:.1} GB/s", w.alpha_s * 1e6, w.beta_b_s / 1e9)
}
