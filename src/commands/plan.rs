//! # `ferrotron plan`: which layout, for this model on this cluster, and why
//!
//! Every lesson before this one taught a way to cut the work; this one asks which cut to make.
//! The Ultra-Scale Playbook's reasoning, done by the code the runs use:
//!
//! ```text
//! 1. memory first   a layout that does not fit is no layout: weights, gradients and AdamW
//!                   state shrink with tp, pp and ZeRO; activations with tp+sp, cp, pp's
//!                   micro-batches in flight, recomputation and the fused loss
//!                   (train/memory.rs, the same estimate `ferrotron memory` prints)
//! 2. then time      compute at the rates the device reaches (step_time.rs), the bubble of the
//!                   pipeline's schedule (the clock of `ferrotron schedule`), and each axis's
//!                   bytes (traffic.rs, what the comm report's ledger counts) over the wire it
//!                   crosses — NVLink inside a node, the network across — less what hides
//!                   behind compute
//! 3. rank           by tokens/s; a memory saver (recomputation, the fused loss) is taken only
//!                   where a layout needs it to fit: it costs time and buys nothing else
//! ```
//! What falls out is the Playbook's advice, not coded in but found: tp inside a node (its
//! all-reduces every block would crawl over the network), pp or ZeRO-3 across nodes when the
//! weights do not fit, cp when the sequence is long, and micro-batches enough to keep the
//! bubble small. `plan` tries every layout the run could take (dp, tp with and without sp, pp
//! with each schedule, cp ring and Ulysses, ep for a mixture of experts, ZeRO 0–3 and hybrid
//! sharding, recomputation, micro-batch size) and prints those that fit, fastest first.

use crate::checkpoint::hf::read_hf_config;
use crate::commands::calibrate;
use crate::commands::schedule::simulate;
use crate::commands::step_time::{self, MicroBatch, Rates, Wire, Wires};
use crate::commands::traffic::{self, Flow};
use crate::config::{Config, CpMode, DeviceDtype, DeviceKind, ModelConfig, PpSchedule, Recompute, ZeroReduce};
use crate::devices::{self, Gpu};
use crate::parallel::schedules::stage_of;
use crate::train::memory::{per_stage, RankMemory};
use anyhow::{bail, Result};
use std::path::Path;

/// The cluster: how many devices, how many a node, which, its wires, and the rates it reaches.
#[derive(Clone, Debug)]
pub struct Cluster {
    pub gpus: usize,
    pub per_node: usize,
    /// What `--gpu` named ("cpu": this machine, ranks as threads).
    pub name: String,
    pub memory_bytes: f64,
    pub wires: Wires,
    /// Where the wires' figures come from.
    pub wires_source: String,
    pub rates: Rates,
    /// The share of the rates one rank gets (ranks as threads sharing a CPU's cores; 1 on a GPU).
    pub share: f64,
    pub on_cpu: bool,
}

/// What `plan` is asked.
#[derive(Clone, Debug)]
pub struct Ask {
    pub global_batch_tokens: usize,
    pub seq_len: usize,
    pub dtype: DeviceDtype,
    /// Only the layouts ferrotron's GPU backend runs today: not the schedules whose messages are
    /// not yet paired for NCCL (interleaved, zero bubble), which are otherwise priced and marked.
    pub runnable: bool,
}

/// What a search tried: every candidate priced (the fitting ones first, fastest first), and
/// every one it set aside, counted by reason.
#[derive(Clone, Debug)]
pub struct Searched {
    pub layouts: Vec<Layout>,
    pub dropped: Vec<Dropped>,
    /// Of the layouts, how many take a global batch other than the one asked (the nearest that
    /// their dp × micro-batch divides).
    pub rounded: usize,
}

/// Candidates set aside for one reason: how many, and the first one's words.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Dropped {
    pub reason: String,
    pub count: usize,
    pub example: String,
}

/// The drops of a search, as they come.
#[derive(Default)]
struct Tally(Vec<Dropped>);

impl Tally {
    fn drop(&mut self, reason: &str, example: impl FnOnce() -> String) {
        match self.0.iter_mut().find(|d| d.reason == reason) {
            Some(d) => d.count += 1,
            None => self.0.push(Dropped { reason: reason.into(), count: 1, example: example() }),
        }
    }

    /// A config check's refusal, under the key it names first (`parallel.tp = 3 does not …`).
    fn refused(&mut self, e: &anyhow::Error) {
        let text = e.to_string();
        let key = text.split([' ', ':']).next().unwrap_or("").to_string();
        self.drop(&format!("the config check on {key}"), || text.clone());
    }
}

/// One layout's prediction.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Layout {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub cp: usize,
    pub ep: usize,
    pub zero_stage: usize,
    pub dp_shard: usize,
    /// ZeRO-2/3's gradient reduce-scatter: "every_micro_batch", or "once" a step (the
    /// gradients accumulated whole first).
    pub zero_reduce: &'static str,
    pub pp_schedule: &'static str,
    pub pp_virtual_stages: usize,
    pub cp_mode: &'static str,
    pub sequence_parallel: bool,
    pub recompute: &'static str,
    pub micro_batch_size: usize,
    pub grad_accum_steps: usize,
    pub loss_stripe_rows: usize,
    pub dtype: &'static str,
    /// The step's sequences (the asked batch, or the nearest this dp × micro-batch divides).
    pub sequences: usize,
    /// Whether ferrotron's GPU backend runs it today (its pipeline's messages paired for NCCL).
    pub nccl_ready: bool,
    pub fits: bool,
    pub memory_gib: f64,
    pub step_s: Option<f64>,
    pub tokens_per_s: Option<f64>,
    pub mfu: Option<f64>,
    pub breakdown: Option<Breakdown>,
}

/// Where a layout's step goes.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Breakdown {
    /// The busiest rank's memory by kind, GiB: weights, gradients, optimizer, activations, buffers.
    pub memory_gib: [f64; 5],
    /// Compute of the step, bubble included, and the bubble's share of it.
    pub compute_s: f64,
    pub bubble: f64,
    pub optimizer_s: f64,
    /// Per axis and call: seconds on the wire, and of them exposed (not hidden behind compute).
    pub comm: Vec<AxisTime>,
    pub tokens_per_s_per_gpu: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct AxisTime {
    #[serde(flatten)]
    pub flow: Flow,
    pub wire_s: f64,
    pub exposed_s: f64,
    /// Whether its groups span more than a node (on the network's wire, not NVLink).
    pub across_nodes: bool,
}

/// The model `--config` gives: a ferrotron TOML (with `--set`s) or a Hugging Face config.json;
/// read, not yet checked (each layout is checked with its own batch).
pub fn model_of(path: Option<&Path>, sets: &[String]) -> Result<Config> {
    match path {
        Some(p) if is_hf(p) => {
            // the architecture as `--set model.…` before the user's own sets, checked as one config
            let model = toml::Value::try_from(read_hf_config(p)?)?;
            let keys = model.as_table().into_iter().flatten().map(|(k, v)| format!("model.{k}={v}"));
            Config::read(None, &keys.chain(sets.iter().cloned()).collect::<Vec<_>>())
        }
        _ => Config::read(path, sets),
    }
}

/// Whether `--config` names a Hugging Face config.json (else a ferrotron TOML).
pub fn is_hf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

/// The cluster `--gpu` names, with `--gpus`, `--gpus-per-node` and the overrides (GB/s a
/// direction, GiB). `measured`, what `bench --calibrate` recorded on such a GPU, replaces the
/// shipped rates, and where it measured NCCL between two of them, the link inside a node.
pub fn cluster(
    gpu: &str,
    (gpus, per_node): (usize, usize),
    dtype: DeviceDtype,
    measured: Option<calibrate::GpuCalibration>,
) -> Result<Cluster> {
    if gpus == 0 || gpus > 1 << 20 {
        bail!("--gpus {gpus}: give from 1 to {} GPUs", 1 << 20);
    }
    if per_node == 0 {
        bail!("--gpus-per-node 0: a node holds at least one GPU");
    }
    if gpus > per_node && !gpus.is_multiple_of(per_node) {
        bail!(
            "--gpus {gpus} is not a whole number of nodes of --gpus-per-node {per_node}: give a multiple of {per_node}"
        );
    }
    let Some(g) = devices::gpu(gpu) else {
        bail!("--gpu {gpu}: not in the device table; give one of {} (or cpu, this machine)", devices::gpu_keys());
    };
    let peak = match dtype {
        DeviceDtype::Fp8 if g.fp8_tflops == 0.0 => {
            bail!("--dtype fp8 on {}: it has no FP8 tensor cores; use --dtype bf16", g.name)
        }
        DeviceDtype::Fp8 => g.fp8_tflops,
        _ => g.bf16_tflops,
    };
    let mut wires = gpu_wires(g, per_node.min(gpus));
    let mut wires_source = format!("the device table's links for {}", g.name);
    let rates = match measured {
        Some(c) => {
            if let Some(w) = c.wire {
                wires.node = w;
                wires_source = format!(
                    "inside a node NCCL as measured {} (bench --calibrate); across, the device table's",
                    c.measured
                );
            }
            c.rates
        }
        None if g.key == "h100" && dtype != DeviceDtype::Fp8 => Rates::h100(),
        None => Rates::scaled(g, peak),
    };
    Ok(Cluster {
        gpus,
        per_node: per_node.min(gpus),
        name: g.key.to_string(),
        memory_bytes: g.memory_gib * (1u64 << 30) as f64,
        wires,
        wires_source,
        rates,
        share: 1.0,
        on_cpu: false,
    })
}

/// This machine's CPU with `ranks` ranks as threads, as `bench --calibrate` measured it: the
/// ranks' ops all run on the one pool of the machine's threads, so each rank gets 1/ranks of
/// what the whole pool reaches (the small ops, bound by memory, hardly scale with threads: one
/// thread's rate would overstate what each of several ranks gets).
pub fn cpu_cluster(cache_dir: &str, ranks: usize) -> Result<Cluster> {
    if ranks == 0 {
        bail!("--gpus 0: give at least one rank");
    }
    let c = calibrate::recorded(cache_dir)?;
    let (rates, share) = (c.all_threads, 1.0 / ranks as f64);
    let capacity = crate::comm::launcher::Capacity::host(ranks);
    Ok(Cluster {
        gpus: ranks,
        per_node: ranks,
        name: "cpu".into(),
        memory_bytes: capacity.bytes / ranks as f64,
        wires: Wires { node: c.wire, net: c.wire, per_node: ranks },
        wires_source: "the local backend between rank threads, as measured (bench --calibrate)".into(),
        rates,
        share,
        on_cpu: true,
    })
}

/// `--memory-gib`, `--node-gb-s`, `--net-gb-s` over the table's figures.
pub fn override_cluster(
    c: &mut Cluster,
    (memory_gib, node, net): (Option<f64>, Option<f64>, Option<f64>),
) -> Result<()> {
    for (flag, v) in [("--memory-gib", memory_gib), ("--node-gb-s", node), ("--net-gb-s", net)] {
        if v.is_some_and(|v| !(v > 0.0 && v.is_finite())) {
            bail!("{flag} {}: give a positive number", v.unwrap_or(0.0));
        }
    }
    if let Some(g) = memory_gib {
        c.memory_bytes = g * (1u64 << 30) as f64;
    }
    if let Some(b) = node {
        c.wires.node.beta_b_s = b * 1e9;
    }
    if let Some(b) = net {
        c.wires.net.beta_b_s = b * 1e9;
    }
    Ok(())
}

/// A GPU's wires: NVLink (or PCIe) inside a node, the network across (α as `comm/cost.rs`'s
/// links: 3 µs NVLink, 10 µs PCIe, 5 µs InfiniBand).
fn gpu_wires(g: &Gpu, per_node: usize) -> Wires {
    let node_alpha = if g.node_gb_s >= 100.0 { 3e-6 } else { 10e-6 };
    Wires {
        node: Wire { alpha_s: node_alpha, beta_b_s: g.node_gb_s * 1e9 },
        net: Wire { alpha_s: 5e-6, beta_b_s: g.net_gb_s * 1e9 },
        per_node,
    }
}

/// The layouts to try: every cut of `gpus` into dp × tp × pp × cp (× ep) by divisibility, each
/// ZeRO stage and reduction, schedule, cp mode, sp and micro-batch size the config checks accept;
/// what they refuse, and what the search's bounds leave out, counted in `tally`.
fn candidates(base: &Config, cluster: &Cluster, ask: &Ask, tally: &mut Tally) -> Vec<Config> {
    let m = &base.model;
    let n = cluster.gpus;
    let sequences = ask.global_batch_tokens / ask.seq_len;
    let divisors = |x: usize| (1..=x).filter(move |d| x.is_multiple_of(*d));
    let mut out = Vec::new();
    for tp in divisors(n) {
        for cp in divisors(n / tp) {
            if cp > MAX_CP {
                tally.drop(&format!("cp beyond the search's {MAX_CP}"), || format!("cp {cp} (tp {tp})"));
                continue;
            }
            for pp in divisors(n / (tp * cp)) {
                if pp > m.num_hidden_layers || pp > MAX_PP {
                    let why = format!("pp beyond the layers or the search's {MAX_PP}");
                    tally.drop(&why, || format!("pp {pp} (tp {tp}, cp {cp})"));
                    continue;
                }
                let dp = n / (tp * cp * pp);
                let eps: Vec<usize> = match m.num_local_experts {
                    0 => vec![1],
                    e => divisors(dp * cp).filter(|&x| e.is_multiple_of(x)).collect(),
                };
                for &ep in &eps {
                    for mbs in [1, 2, 4, 8] {
                        // the nearest whole number of micro-batches, within the slack
                        let accum = ((sequences as f64 / (mbs * dp) as f64).round() as usize).max(1);
                        let moved = (accum * mbs * dp).abs_diff(sequences) as f64 / sequences as f64;
                        if moved > SLACK_PERCENT as f64 / 100.0 {
                            let why =
                                format!("dp × micro-batch does not divide the global batch within {SLACK_PERCENT} %");
                            tally.drop(&why, || format!("dp {dp} × micro-batch {mbs} against {sequences} sequences"));
                            continue;
                        }
                        out.extend(shapes(base, (dp, tp, pp, cp, ep), (mbs, accum), cluster, ask, tally));
                    }
                }
            }
        }
    }
    out
}

/// The variants of one cut: ZeRO stages, reductions and hybrid sharding, schedules, cp modes, sp.
fn shapes(
    base: &Config,
    (dp, tp, pp, cp, ep): (usize, usize, usize, usize, usize),
    (mbs, m): (usize, usize),
    cluster: &Cluster,
    ask: &Ask,
    tally: &mut Tally,
) -> Vec<Config> {
    let z = dp * cp;
    // (stage, shard group, reduction): ZeRO-3 also reducing once a step where a step has
    // micro-batches to accumulate, its gradients accumulated whole (ZeRO-2 once moves what
    // ZeRO-1 moves: no new layout)
    let (each, once) = (ZeroReduce::EveryMicroBatch, ZeroReduce::Once);
    let zeros: Vec<(usize, usize, ZeroReduce)> = {
        let mut v = vec![(0, 0, each)];
        let shard = (cluster.per_node / (tp * cp)).max(1);
        for s in [0, shard] {
            // hybrid sharding: shard inside a node's worth of dp ranks, replicate across
            let hybrid = s > 1 && s < dp && dp.is_multiple_of(s);
            if z > 1 && (s == 0 || hybrid) {
                v.extend([(2, s, each), (3, s, each)]);
                v.extend((m > 1).then_some((3, s, once)));
            }
        }
        if z > 1 {
            v.push((1, 0, each));
        }
        v
    };
    let schedules: Vec<(PpSchedule, usize)> = match pp {
        1 => vec![(PpSchedule::OneFOneB, 1)],
        _ if m > MAX_MICRO_BATCHES => {
            let why = format!("more micro-batches than the pipeline's clock plays ({MAX_MICRO_BATCHES})");
            tally.drop(&why, || format!("{m} of pp {pp}"));
            vec![]
        }
        _ => vec![
            (PpSchedule::Afab, 1),
            (PpSchedule::OneFOneB, 1),
            (PpSchedule::Interleaved, 2),
            (PpSchedule::Interleaved, 4),
            (PpSchedule::ZbH1, 1),
            (PpSchedule::Zbv, 2),
        ],
    };
    let modes: &[CpMode] = if cp > 1 { &[CpMode::Ring, CpMode::Ulysses] } else { &[CpMode::Ring] };
    let sps: &[bool] = if tp > 1 { &[false, true] } else { &[false] };
    let mut out = Vec::new();
    for &(zero, shard, reduce) in &zeros {
        for &(schedule, v) in &schedules {
            if ask.runnable && !cluster.on_cpu && schedule.unpaired() {
                tally.drop("a schedule the GPU backend cannot run yet (--runnable)", || schedule.name().into());
                continue;
            }
            for &mode in modes {
                for &sp in sps {
                    let mut c = base.clone();
                    let p = &mut c.parallel;
                    (p.dp, p.tp, p.pp, p.cp, p.ep) = (dp, tp, pp, cp, ep);
                    (p.zero_stage, p.dp_shard, p.zero_reduce) = (zero, shard, reduce);
                    (p.pp_schedule, p.pp_virtual_stages) = (schedule, v);
                    (p.cp_mode, p.sequence_parallel) = (mode, sp);
                    let t = &mut c.train;
                    (t.micro_batch_size, t.grad_accum_steps, t.seq_len) = (mbs, m, ask.seq_len);
                    (t.recompute, t.loss_stripe_rows, t.steps, t.warmup_steps) = (Recompute::None, 0, 1, 0);
                    match c.validate() {
                        Ok(()) => out.push(c),
                        Err(e) => tally.refused(&e),
                    }
                }
            }
        }
    }
    out
}

/// The search's bounds: a ring of more than 64 ranks, a pipeline of more than 128 stages.
const MAX_CP: usize = 64;
const MAX_PP: usize = 128;

/// How far a layout's global batch may move from the one asked, to the nearest its dp ×
/// micro-batch divides, in per cent.
const SLACK_PERCENT: usize = 5;

/// The most micro-batches of a pipeline the schedule's clock plays (`commands/schedule.rs`).
const MAX_MICRO_BATCHES: usize = 4096;

/// The memory savers, least costly first: a layout takes the first that makes it fit.
const SAVERS: [(Recompute, usize); 4] =
    [(Recompute::None, 0), (Recompute::None, 4096), (Recompute::Selective, 4096), (Recompute::Full, 4096)];

/// The busiest rank's memory of `cfg`.
fn busiest(cfg: &Config) -> RankMemory {
    busiest_of(&per_stage(cfg)).clone()
}

fn busiest_of(stages: &[RankMemory]) -> &RankMemory {
    stages.iter().max_by(|a, b| a.total_bytes.total_cmp(&b.total_bytes)).expect("a stage at least")
}

/// Everything `plan` says of `cfg` on `cluster`.
pub fn predict(cfg: &Config, cluster: &Cluster) -> Result<Layout> {
    predict_with(cfg, cluster, &mut Clocks::default(), per_stage(cfg))
}

/// The pipeline clocks played so far, by (schedule, stages, micro-batches, chunks): (makespan,
/// bubble). A search meets the same pipeline under many layouts; playing it is its costliest part.
#[derive(Default)]
pub struct Clocks(std::collections::HashMap<(&'static str, usize, usize, usize), (f64, f64)>);

impl Clocks {
    fn play(&mut self, kind: PpSchedule, stages: usize, m: usize, chunks: usize) -> Result<(f64, f64)> {
        let key = (kind.name(), stages, m, chunks);
        if let Some(&known) = self.0.get(&key) {
            return Ok(known);
        }
        let tl = simulate(kind, stages, m, chunks)?;
        self.0.insert(key, (tl.makespan, tl.bubble()));
        Ok((tl.makespan, tl.bubble()))
    }
}

/// `predict` with the clocks played so far and `cfg`'s memory by stage.
fn predict_with(cfg: &Config, cluster: &Cluster, clocks: &mut Clocks, stage_memory: Vec<RankMemory>) -> Result<Layout> {
    let (p, t) = (&cfg.parallel, &cfg.train);
    let memory = busiest_of(&stage_memory).clone();
    let fits = memory.total_bytes <= cluster.memory_bytes;
    let mut layout = describe(cfg, fits, memory.total_bytes);
    if !fits {
        return Ok(layout);
    }
    // ranks sharing a CPU's cores each get their share of its rate
    let share = cluster.share;
    // the stages: the first (embedding) and the last (head) differ, the middle ones are the first's
    let stages: Vec<usize> = if p.pp == 1 { vec![0] } else { vec![0, p.pp - 1] };
    let mut worst: Option<(f64, Breakdown)> = None;
    let timeline = match p.pp {
        1 => None,
        _ => Some(clocks.play(p.pp_schedule, p.pp, t.grad_accum_steps, stage_of(0, p).chunks)?),
    };
    let slowest: MicroBatch = stages
        .iter()
        .map(|&s| step_time::micro_batch(cfg, stage_of(s, p), &cluster.rates, share))
        .max_by(|a, b| (a.forward + a.backward).total_cmp(&(b.forward + b.backward)))
        .expect("a stage");
    // the pipeline's clock counts a micro-batch's forward as 1 and its backward as 2; where the
    // stages share a device's cores (ranks as threads), a stage idle in the bubble leaves them to
    // the others: the step is their work alone
    let work = t.grad_accum_steps as f64 * (slowest.forward + slowest.backward);
    let (compute, bubble) = match timeline {
        None => (work, 0.0),
        Some((_, bubble)) if cluster.share < 1.0 => (work, bubble),
        Some((makespan, bubble)) => (makespan * (slowest.forward + slowest.backward) / 3.0, bubble),
    };
    for &s in &stages {
        let stage = stage_of(s, p);
        let mb = step_time::micro_batch(cfg, stage, &cluster.rates, share);
        let flows = traffic::per_step(cfg, stage);
        let timed = step_time::exposed(cfg, &flows, (&cluster.wires, &cluster.rates), &mb, t.grad_accum_steps);
        let comm: f64 = timed.iter().map(|(.., shown)| shown).sum();
        let trained = (stage_memory[s].optimizer_bytes / 8.0).max(1.0); // two 4-byte moments a value
        let optimizer = step_time::optimizer_seconds(trained, &cluster.rates, share);
        let step = compute + comm + optimizer;
        let breakdown = Breakdown {
            memory_gib: [
                memory.weights_bytes,
                memory.grads_bytes,
                memory.optimizer_bytes,
                memory.activations_bytes,
                memory.comm_bytes,
            ]
            .map(gib),
            compute_s: compute,
            bubble,
            optimizer_s: optimizer,
            comm: timed
                .into_iter()
                .map(|(flow, wire_s, exposed_s)| {
                    let across_nodes = step_time::span(cfg, flow.axis) > cluster.wires.per_node;
                    AxisTime { flow, wire_s, exposed_s, across_nodes }
                })
                .collect(),
            tokens_per_s_per_gpu: 0.0,
        };
        if worst.as_ref().is_none_or(|(w, _)| step > *w) {
            worst = Some((step, breakdown));
        }
    }
    let (step, mut breakdown) = worst.expect("a stage");
    let tokens = (t.micro_batch_size * t.grad_accum_steps * p.dp * t.seq_len) as f64 / step;
    breakdown.tokens_per_s_per_gpu = tokens / cluster.gpus as f64;
    let flops = devices::flops_per_token(&cfg.model, t.seq_len) * tokens;
    layout.step_s = Some(step);
    layout.tokens_per_s = Some(tokens);
    layout.mfu = Some(flops / (cluster.gpus as f64 * cluster.rates.peak_tflops * 1e12));
    layout.breakdown = Some(breakdown);
    Ok(layout)
}

fn gib(b: f64) -> f64 {
    b / (1u64 << 30) as f64
}

/// The layout's keys, under their config names.
fn describe(cfg: &Config, fits: bool, memory: f64) -> Layout {
    let (p, t) = (&cfg.parallel, &cfg.train);
    Layout {
        dp: p.dp,
        tp: p.tp,
        pp: p.pp,
        cp: p.cp,
        ep: p.ep,
        zero_stage: p.zero_stage,
        dp_shard: p.dp_shard,
        zero_reduce: match p.zero_reduce {
            ZeroReduce::EveryMicroBatch => "every_micro_batch",
            ZeroReduce::Once => "once",
        },
        pp_schedule: p.pp_schedule.name(),
        pp_virtual_stages: p.pp_virtual_stages,
        cp_mode: if p.cp_mode == CpMode::Ring { "ring" } else { "ulysses" },
        sequence_parallel: p.sequence_parallel,
        recompute: match t.recompute {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        },
        micro_batch_size: t.micro_batch_size,
        grad_accum_steps: t.grad_accum_steps,
        loss_stripe_rows: t.loss_stripe_rows,
        dtype: match cfg.device.dtype {
            DeviceDtype::Fp8 => "fp8",
            DeviceDtype::F32 => "f32",
            _ => "bf16",
        },
        sequences: t.micro_batch_size * t.grad_accum_steps * p.dp,
        nccl_ready: p.pp == 1 || !p.pp_schedule.unpaired(),
        fits,
        memory_gib: gib(memory),
        step_s: None,
        tokens_per_s: None,
        mfu: None,
        breakdown: None,
    }
}

/// Every layout of `model` on `cluster` for `ask`, the fitting ones first, fastest first, and
/// what the search set aside. A layout that does not fit with any memory saver is kept (with its
/// least memory) for `--json`.
pub fn plan(base: &Config, cluster: &Cluster, ask: &Ask) -> Result<Searched> {
    check_ask(&base.model, ask)?;
    let base = prepared(base, cluster, ask);
    let mut tally = Tally::default();
    let candidates = candidates(&base, cluster, ask, &mut tally);
    // the candidates priced on every core, each thread a contiguous share (the order kept)
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = candidates.len().div_ceil(threads).max(1);
    let priced: Vec<Result<Vec<Layout>>> = std::thread::scope(|scope| {
        let work: Vec<_> = candidates.chunks(share).map(|part| scope.spawn(|| price(part, cluster))).collect();
        work.into_iter().map(|w| w.join().expect("a pricing thread panicked")).collect()
    });
    let mut out = Vec::new();
    for part in priced {
        out.extend(part?);
    }
    out.sort_by(|a, b| {
        b.tokens_per_s
            .unwrap_or(-1.0)
            .total_cmp(&a.tokens_per_s.unwrap_or(-1.0))
            .then(a.memory_gib.total_cmp(&b.memory_gib))
    });
    let sequences = ask.global_batch_tokens / ask.seq_len;
    let rounded = out.iter().filter(|l| l.sequences != sequences).count();
    Ok(Searched { layouts: out, dropped: tally.0, rounded })
}

/// Each candidate of `part` priced with the first memory saver that makes it fit, or, where none
/// does, described with its least memory.
fn price(part: &[Config], cluster: &Cluster) -> Result<Vec<Layout>> {
    let (mut out, mut clocks) = (Vec::new(), Clocks::default());
    for c in part {
        let mut tried = None;
        for (recompute, rows) in SAVERS {
            let mut s = c.clone();
            (s.train.recompute, s.train.loss_stripe_rows) = (recompute, rows);
            let stages = per_stage(&s);
            let memory = busiest_of(&stages).total_bytes;
            if memory <= cluster.memory_bytes {
                tried = Some(predict_with(&s, cluster, &mut clocks, stages)?);
                break;
            }
            if tried.as_ref().is_none_or(|l: &Layout| memory < l.memory_gib * (1u64 << 30) as f64) {
                tried = Some(describe(&s, false, memory));
            }
        }
        out.extend(tried);
    }
    Ok(out)
}

/// `base` set for planning on `cluster`: its device and dtype, no checkpoints or validation.
fn prepared(base: &Config, cluster: &Cluster, ask: &Ask) -> Config {
    let mut base = base.clone();
    base.device.kind = if cluster.on_cpu { DeviceKind::Cpu } else { DeviceKind::Cuda };
    base.device.dtype = ask.dtype;
    base.checkpoint.every = 0;
    base.validation.every = 0;
    base
}

/// What `plan` says when no layout fits: the least memory any layout needs, the least with each
/// memory saver (closest first), and the fewest GPUs on which one fits.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Shortfall {
    /// The layout that needs the least memory a GPU (its `memory_gib`).
    pub least: Layout,
    /// Each saver and the least memory a GPU of the layouts using it, GiB, least first.
    pub savers: Vec<(&'static str, f64)>,
    /// The fewest GPUs (the cluster's count times 2, 4, … 64, nodes as they are) on which some
    /// layout fits; `None`: not even on 64 times as many.
    pub gpus_that_fit: Option<usize>,
}

/// The shortfall of `layouts` (what `plan` returned for `base` on `cluster`), if none fits.
pub fn shortfall(base: &Config, cluster: &Cluster, ask: &Ask, layouts: &[Layout]) -> Option<Shortfall> {
    if layouts.iter().any(|l| l.fits) {
        return None;
    }
    let by_memory = |a: &&Layout, b: &&Layout| a.memory_gib.total_cmp(&b.memory_gib);
    let least = layouts.iter().min_by(by_memory)?.clone();
    type Uses = fn(&Layout) -> bool; // whether a layout uses the saver
    let savers: [(&'static str, Uses); 5] = [
        ("full recomputation", |l| l.recompute == "full"),
        ("ZeRO-3", |l| l.zero_stage == 3),
        ("context parallelism (cp > 1)", |l| l.cp > 1),
        ("pipeline parallelism (pp > 1)", |l| l.pp > 1),
        ("tensor parallelism (tp > 1)", |l| l.tp > 1),
    ];
    let mut least_with: Vec<(&'static str, f64)> = (savers.iter())
        .filter_map(|(name, uses)| layouts.iter().filter(|l| uses(l)).min_by(by_memory).map(|l| (*name, l.memory_gib)))
        .collect();
    least_with.sort_by(|a, b| a.1.total_cmp(&b.1));
    let base = prepared(base, cluster, ask);
    let gpus_that_fit = (1..=6).map(|k| cluster.gpus << k).find(|&gpus| {
        let more = Cluster { gpus, ..cluster.clone() };
        candidates(&base, &more, ask, &mut Tally::default()).iter().any(|c| {
            SAVERS.iter().any(|&(recompute, rows)| {
                let mut s = c.clone();
                (s.train.recompute, s.train.loss_stripe_rows) = (recompute, rows);
                busiest(&s).total_bytes <= cluster.memory_bytes
            })
        })
    });
    Some(Shortfall { least, savers: least_with, gpus_that_fit })
}

/// The shortfall in words, in the table's place.
pub fn shortfall_text(s: &Shortfall, cluster: &Cluster) -> String {
    let l = &s.least;
    let mut out = format!(
        "nothing fits in {:.0} GiB a GPU: the least any layout needs is {:.1} GiB (dp {} × tp {} × pp {} × cp {}, ZeRO {}, recompute {}, micro-batch {})
",
        gib(cluster.memory_bytes),
        l.memory_gib,
        l.dp,
        l.tp,
        l.pp,
        l.cp,
        l.zero_stage,
        l.recompute,
        l.micro_batch_size
    );
    let savers: Vec<String> = s.savers.iter().map(|(name, g)| format!("{name} {g:.1} GiB")).collect();
    if !savers.is_empty() {
        out += &format!(
            "the least with each memory saver, closest first: {}
",
            savers.join(", ")
        );
    }
    out += &match s.gpus_that_fit {
        Some(n) => format!(
            "on {n} GPUs ({} nodes of {}) a layout fits
",
            n / cluster.per_node.max(1),
            cluster.per_node
        ),
        None => format!(
            "no layout fits on up to {} GPUs either: a smaller model, a shorter sequence or a larger GPU
",
            cluster.gpus << 6
        ),
    };
    out
}

/// What `plan` planned for, in one line above its table.
pub fn header(base: &Config, cluster: &Cluster, ask: &Ask) -> String {
    let (m, n) = (&base.model, base.model.parameter_count());
    let size = if n >= 1e9 { format!("{:.1}B", n / 1e9) } else { format!("{:.1}M", n / 1e6) };
    format!(
        "plan for a model of {size} parameters ({} layers, hidden {}) on {} × {} ({} a node, {:.0} GiB each): {} tokens a step = {} sequences of {}\n",
        m.num_hidden_layers,
        m.hidden_size,
        cluster.gpus,
        cluster.name,
        cluster.per_node,
        gib(cluster.memory_bytes),
        ask.global_batch_tokens,
        ask.global_batch_tokens / ask.seq_len,
        ask.seq_len
    )
}

/// The line under the header where some layouts took another batch than the one asked.
pub fn rounding(searched: &Searched, ask: &Ask) -> Option<String> {
    (searched.rounded > 0).then(|| {
        format!(
            "{} of the layouts take the nearest batch their dp × micro-batch divides, within {SLACK_PERCENT} % of {} sequences (tokens/s at their own)",
            searched.rounded,
            ask.global_batch_tokens / ask.seq_len
        )
    })
}

/// What the search set aside, by reason, most first (`--explain-drops`; printed too when
/// nothing was tried).
pub fn drops_text(dropped: &[Dropped]) -> String {
    let mut d: Vec<&Dropped> = dropped.iter().collect();
    d.sort_by_key(|x| std::cmp::Reverse(x.count));
    let total: usize = d.iter().map(|x| x.count).sum();
    let mut s = format!("{total} candidates set aside:\n");
    for x in d {
        s += &format!("{:>8}  {} (the first: {})\n", x.count, x.reason, x.example);
    }
    s
}

/// The one layout `base` gives (its parallel and train keys; dp is what is left of the GPUs, the
/// micro-batches what is left of the global batch), priced whether or not it fits (`fits` says).
pub fn fixed(base: &Config, cluster: &Cluster, ask: &Ask) -> Result<Layout> {
    check_ask(&base.model, ask)?;
    let mut c = base.clone();
    (c.device.kind, c.device.dtype) = (if cluster.on_cpu { DeviceKind::Cpu } else { DeviceKind::Cuda }, ask.dtype);
    let p = &mut c.parallel;
    let cut = p.tp * p.pp * p.cp;
    if !cluster.gpus.is_multiple_of(cut) {
        bail!("--fixed: tp × pp × cp = {} × {} × {} = {cut} does not divide --gpus {}; choose degrees whose product divides it", p.tp, p.pp, p.cp, cluster.gpus);
    }
    p.dp = cluster.gpus / cut;
    let t = &mut c.train;
    let sequences = ask.global_batch_tokens / ask.seq_len;
    if !sequences.is_multiple_of(t.micro_batch_size * p.dp) {
        bail!("--fixed: {sequences} sequences a step do not split into dp {} × micro_batch_size {}: change --global-batch-tokens or train.micro_batch_size", p.dp, t.micro_batch_size);
    }
    (t.seq_len, t.grad_accum_steps, t.steps, t.warmup_steps) =
        (ask.seq_len, sequences / (t.micro_batch_size * p.dp), 1, 0);
    (c.checkpoint.every, c.validation.every) = (0, 0);
    c.validate()?;
    let fits = busiest(&c).total_bytes <= cluster.memory_bytes;
    let mut priced = predict(&c, &Cluster { memory_bytes: f64::INFINITY, ..cluster.clone() })?;
    priced.fits = fits;
    Ok(priced)
}

/// Refuses what no layout can answer, in one line.
fn check_ask(m: &ModelConfig, ask: &Ask) -> Result<()> {
    m.validate("model.")?;
    if ask.seq_len < 2 {
        bail!("--seq-len {}: a sequence needs at least 2 tokens", ask.seq_len);
    }
    if ask.global_batch_tokens < ask.seq_len || !ask.global_batch_tokens.is_multiple_of(ask.seq_len) {
        bail!(
            "--global-batch-tokens {} is not a whole number of sequences of --seq-len {}: give a multiple of {}",
            ask.global_batch_tokens,
            ask.seq_len,
            ask.seq_len
        );
    }
    let sequences = ask.global_batch_tokens / ask.seq_len;
    if sequences > 1 << 40 {
        bail!(
            "--global-batch-tokens {}: more than 2⁴⁰ sequences a step; give a smaller batch",
            ask.global_batch_tokens
        );
    }
    Ok(())
}

/// The table a person reads: the `top` fastest layouts that fit.
pub fn table(layouts: &[Layout], cluster: &Cluster, top: usize) -> String {
    let fit: Vec<&Layout> = layouts.iter().filter(|l| l.fits).collect();
    let mut s = format!(
        "{} layouts tried, {} fit in {:.0} GiB a GPU; the fastest {}:\n",
        layouts.len(),
        fit.len(),
        gib(cluster.memory_bytes),
        top.min(fit.len())
    );
    s += &format!(
        "{:>3}  {:>5} {:>3} {:>3} {:>3} {:>3}  {:<5} {:<11} {:<3} {:<9} {:>3} {:>5}  {:>8} {:>8} {:>10} {:>6}  {}\n",
        "#",
        "dp",
        "tp",
        "pp",
        "cp",
        "ep",
        "zero",
        "schedule",
        "sp",
        "recompute",
        "mbs",
        "accum",
        "GiB",
        "step s",
        "tokens/s",
        "MFU",
        "exposed comm"
    );
    for (i, l) in fit.iter().take(top).enumerate() {
        let b = l.breakdown.as_ref().expect("a fitting layout is timed");
        let zero = if l.dp_shard > 0 { format!("{}h{}", l.zero_stage, l.dp_shard) } else { l.zero_stage.to_string() };
        let zero = if l.zero_reduce == "once" { format!("{zero}o") } else { zero };
        let unready = if l.nccl_ready || cluster.on_cpu { "" } else { "*" };
        let schedule = match (l.pp, l.pp_virtual_stages) {
            (1, _) => "-".to_string(),
            (_, 1) => format!("{}{unready}", l.pp_schedule),
            (_, v) => format!("{} v{v}{unready}", l.pp_schedule),
        };
        let cp = if l.cp > 1 && l.cp_mode == "ulysses" { format!("{}u", l.cp) } else { l.cp.to_string() };
        let mut comm: Vec<(&str, f64)> = Vec::new();
        for a in &b.comm {
            match comm.iter_mut().find(|(axis, _)| *axis == a.flow.axis) {
                Some(c) => c.1 += a.exposed_s,
                None => comm.push((a.flow.axis, a.exposed_s)),
            }
        }
        let comm: Vec<String> =
            comm.iter().filter(|(_, t)| *t >= 1e-4).map(|(a, t)| format!("{a} {:.0} ms", t * 1e3)).collect();
        s += &format!(
            "{:>3}  {:>5} {:>3} {:>3} {:>3} {:>3}  {:<5} {:<11} {:<3} {:<9} {:>3} {:>5}  {:>8.1} {:>8.3} {:>10.0} {:>5.1}%  {}\n",
            i + 1,
            l.dp,
            l.tp,
            l.pp,
            cp,
            l.ep,
            zero,
            schedule,
            if l.sequence_parallel { "sp" } else { "-" },
            if l.loss_stripe_rows > 0 && l.recompute == "none" { "loss".to_string() } else { l.recompute.to_string() },
            l.micro_batch_size,
            l.grad_accum_steps,
            l.memory_gib,
            l.step_s.unwrap_or(0.0),
            l.tokens_per_s.unwrap_or(0.0),
            100.0 * l.mfu.unwrap_or(0.0),
            comm.join(", ")
        );
    }
    if !cluster.on_cpu && fit.iter().take(top).any(|l| !l.nccl_ready) {
        s += "* priced, but ferrotron's GPU backend cannot run it yet (its messages are not paired for NCCL); --runnable leaves these out\n";
    }
    if fit.iter().take(top).any(|l| l.zero_reduce == "once") {
        s += "zero 3o: ZeRO-3 reducing its gradients once a step (parallel.zero_reduce = \"once\")\n";
    }
    s + &format!("rates: {}\n", cluster.rates.source)
}

/// One layout in full (`--explain`).
pub fn explain(l: &Layout, cluster: &Cluster) -> String {
    let Some(b) = &l.breakdown else {
        return format!(
            "this layout needs {:.1} GiB a GPU, more than the {:.0} GiB there\n",
            l.memory_gib,
            gib(cluster.memory_bytes)
        );
    };
    let fits = match l.fits {
        true => String::new(),
        false => format!(" — MORE than the {:.0} GiB there: it does not fit", gib(cluster.memory_bytes)),
    };
    let schedule = match (l.pp, l.pp_virtual_stages) {
        (1, _) => String::new(),
        (_, 1) => format!(" ({})", l.pp_schedule),
        (_, v) => format!(" ({}, {v} chunks a rank)", l.pp_schedule),
    };
    let cp_mode = if l.cp > 1 { format!(" ({})", l.cp_mode) } else { String::new() };
    let unready = match l.nccl_ready || cluster.on_cpu {
        true => "",
        false => {
            "\n(priced; ferrotron's GPU backend cannot run this schedule yet: its messages are not paired for NCCL)"
        }
    };
    let mut s = format!(
        "dp {} × tp {}{} × pp {}{schedule} × cp {}{cp_mode} × ep {}, ZeRO {}{}, micro-batch {} × {} accumulated, recompute {}{}{unready}\n",
        l.dp,
        l.tp,
        if l.sequence_parallel { " (sp)" } else { "" },
        l.pp,
        l.cp,
        l.ep,
        l.zero_stage,
        match (l.dp_shard, l.zero_reduce) {
            (0, "once") => " (its gradients reduced once a step)".to_string(),
            (0, _) => String::new(),
            (k, "once") => format!(" in shard groups of {k} (its gradients reduced once a step)"),
            (k, _) => format!(" in shard groups of {k}"),
        },
        l.micro_batch_size,
        l.grad_accum_steps,
        l.recompute,
        if l.loss_stripe_rows > 0 { format!(", fused loss ({} rows a stripe)", l.loss_stripe_rows) } else { String::new() }
    );
    let [w, g, o, a, c] = b.memory_gib;
    s += &format!("memory a GPU: {:.2} GiB = weights {w:.2} + gradients {g:.2} + optimizer {o:.2} + activations {a:.2} + buffers {c:.2} (of {:.0}){fits}\n", l.memory_gib, gib(cluster.memory_bytes));
    s += &format!("rates: {}\n", cluster.rates.source);
    let (node, net) = (cluster.wires.node, cluster.wires.net);
    s += &format!(
        "wires: inside a node α {:.1} µs, β {:.0} GB/s; across nodes α {:.1} µs, β {:.0} GB/s ({})\n",
        node.alpha_s * 1e6,
        node.beta_b_s / 1e9,
        net.alpha_s * 1e6,
        net.beta_b_s / 1e9,
        cluster.wires_source
    );
    s += &format!(
        "step {:.3} s = compute {:.3} s (bubble {:.1}% of it) + optimizer {:.3} s + exposed communication {:.3} s\n",
        l.step_s.unwrap_or(0.0),
        b.compute_s,
        100.0 * b.bubble,
        b.optimizer_s,
        l.step_s.unwrap_or(0.0) - b.compute_s - b.optimizer_s
    );
    s += &format!(
        "{:<10} {:>6}  {:<14} {:>9} {:>12} {:>10} {:>10}  {}\n",
        "axis", "ranks", "call", "calls", "MB", "wire ms", "exposed ms", "crosses"
    );
    for a in &b.comm {
        let f = &a.flow;
        let wire = if a.across_nodes { "nodes" } else { "a node" };
        s += &format!(
            "{:<10} {:>6}  {:<14} {:>9.0} {:>12.3} {:>10.3} {:>10.3}  {wire}\n",
            f.axis,
            f.ranks,
            f.call.name(),
            f.calls,
            f.bytes / 1e6,
            a.wire_s * 1e3,
            a.exposed_s * 1e3
        );
    }
    s += &format!(
        "{:.0} tokens/s ({:.0} a GPU), MFU {:.1}%\n",
        l.tokens_per_s.unwrap_or(0.0),
        b.tokens_per_s_per_gpu,
        100.0 * l.mfu.unwrap_or(0.0)
    );
    s
}

/// The JSON of `--json`: `{"model": …, "cluster": …, "layouts": [...], "dropped": [...],
/// "nothing_fits": …}` (`dropped`: the search's set-aside candidates by reason; `nothing_fits`:
/// the shortfall, `null` when a layout fits).
pub fn json(
    base: &Config,
    layouts: &[Layout],
    cluster: &Cluster,
    ask: &Ask,
    short: Option<&Shortfall>,
    dropped: &[Dropped],
) -> Result<String> {
    let m = &base.model;
    Ok(serde_json::to_string_pretty(&serde_json::json!({
        "model": {
            "parameters": m.parameter_count(),
            "num_hidden_layers": m.num_hidden_layers,
            "hidden_size": m.hidden_size,
        },
        "cluster": {
            "gpus": cluster.gpus,
            "gpus_per_node": cluster.per_node,
            "gpu": cluster.name,
            "memory_gib": gib(cluster.memory_bytes),
            "rates": cluster.rates,
            "node": cluster.wires.node,
            "net": cluster.wires.net,
        },
        "global_batch_tokens": ask.global_batch_tokens,
        "seq_len": ask.seq_len,
        "layouts": layouts,
        "dropped": dropped,
        "nothing_fits": short,
    }))?)
}
