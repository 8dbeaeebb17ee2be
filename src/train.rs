//! # The training loop
//!
//! Every rank runs this same loop (SPMD); with `dp` data-parallel ranks each reads its own slice
//! of the step's global batch:
//!
//! ```text
//! for each step:
//!     zero the gradients
//!     for each micro-batch, in the pipeline schedule's order (on one stage: one after another):
//!         forward → loss,  backward(1 / grad_accum_steps)       (gradients add up)
//!         on the last one, each finished gradient goes to data parallelism
//!     data parallel: wait until every gradient is the average over the dp ranks
//!     global gradient norm → clip → learning rate for this step → AdamW
//!     log step, loss (averaged over the dp ranks), lr, grad_norm, tokens/s
//! ```
//! The global batch of a step is `micro_batch_size × grad_accum_steps × dp` sequences; its loss is
//! the mean over all of their tokens, whatever way it is cut into ranks and micro-batches.

use crate::checkpoint;
use crate::comm::ReduceOp;
use crate::config::Config;
use crate::context_parallel::{self, Ring};
use crate::cuda::Device;
use crate::data::Dataset;
use crate::data_parallel::DataParallel;
use crate::launch::{launch_on, Rank, Setup};
use crate::metrics::{Metrics, StepLog};
use crate::model::{Llama, Param};
use crate::optimizer::{self, Optimizer};
use crate::pipeline_parallel::{self, Stage, StepPlan};
use crate::process_grid::{Axis, Grid};
use crate::save::{self, Resumed};
use crate::tensor::{Place, Tensor};
use crate::trace::{Lane, Trace};
use anyhow::{bail, Result};
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// What a run prints and records besides training.
#[derive(Clone, Copy, Default)]
pub struct Options<'a> {
    /// One JSON object per step (written by rank 0).
    pub metrics: Option<&'a Path>,
    /// Collects every rank's forward, backward, all-reduce and optimizer spans.
    pub trace: Option<&'a Trace>,
    /// No header, no progress.
    pub quiet: bool,
    /// Continue from this checkpoint folder (or `latest` in `checkpoint.dir`).
    pub resume: Option<&'a Path>,
    /// Time every GPU kernel from this step on (`profile.rs`; `bench --profile`).
    pub profile_from_step: Option<usize>,
}

/// One rank's view of a finished run.
pub struct Summary {
    /// The loss of every step, averaged over the global batch.
    pub losses: Vec<f32>,
    pub floor: Option<f64>,
    pub wall_s: f64,
    /// A hash of the bits of every weight: replicas that agree have equal checksums.
    pub checksum: u64,
    /// The most micro-batch activations this rank held at once.
    pub peak_activations: usize,
    /// Attention score entries this rank computed per step (the context-parallel balance).
    pub attention_work: u64,
    /// The wall time of every step, in seconds.
    pub step_s: Vec<f64>,
    /// On a GPU: the most memory this rank's tensors held in any step, in MiB.
    pub gpu_peak_mib: Option<f64>,
}

impl Summary {
    /// Mean loss of the last tenth of the run (at least one step): less noisy than the last step.
    pub fn final_loss(&self) -> f32 {
        let n = self.losses.len().div_ceil(10).max(1);
        self.losses[self.losses.len() - n..].iter().sum::<f32>() / n as f32
    }
}

/// Trains on every rank of the configured grid; returns rank 0's summary.
pub fn train(cfg: &Config, opts: Options) -> Result<Summary> {
    Ok(train_all(cfg, opts)?.swap_remove(0))
}

/// Trains and returns every rank's summary, in rank order.
pub fn train_all(cfg: &Config, opts: Options) -> Result<Vec<Summary>> {
    let (t, p) = (&cfg.train, &cfg.parallel);
    let grid = Grid::new(p.dp, p.pp, p.cp, p.tp)?;
    let setup = Setup::from_config(cfg)?;
    let data = Dataset::open(&cfg.data, &cfg.model)?;
    let floor = data.entropy_floor(t.seq_len);
    if !opts.quiet {
        println!(
            "model: {:.2}M parameters | global batch {} × {} × {} dp × {} tokens | {} steps on {} in {} ({} rank{})",
            cfg.model.parameter_count() as f64 / 1e6,
            t.micro_batch_size,
            t.grad_accum_steps,
            p.dp,
            t.seq_len,
            t.steps,
            format!("{:?}", cfg.device.kind).to_lowercase(),
            format!("{:?}", cfg.device.compute_dtype()).to_lowercase(),
            grid.world_size(),
            if grid.world_size() == 1 { "" } else { "s" },
        );
        match floor {
            Some(f) => println!("data: {} | entropy floor {f:.4} nats/token", cfg.data.source),
            None => println!("data: {} | entropy floor unknown", cfg.data.source),
        }
    }
    let resumed = match opts.resume {
        Some(arg) => {
            let dir = save::resolve(arg, cfg)?;
            let r = save::load(&dir)?;
            if !opts.quiet {
                println!("resuming from {} (step {} of {})", dir.display(), r.step, t.steps);
            }
            Some(r)
        }
        None => None,
    };
    let pretrained = match cfg.model.init_from.is_empty() || resumed.is_some() {
        true => None,
        false => Some(checkpoint::pretrained(&cfg.model)?),
    };
    let start = Start { resumed: resumed.as_ref(), pretrained: pretrained.as_ref() };
    let mut summaries = launch_on(grid, setup, |me| train_rank(me, cfg, &data, opts, start))?;
    summaries.iter_mut().for_each(|s| s.floor = floor);
    if p.cp > 1 && !opts.quiet {
        let work: Vec<String> = summaries.iter().map(|s| format!("{:.2}M", s.attention_work as f64 / 1e6)).collect();
        println!("attention work per rank and step ({:?} split, score entries): {}", p.cp_split, work.join(" "));
    }
    Ok(summaries)
}

/// The loop of one rank.
/// Where the weights come from: a checkpoint to resume, pretrained weights, or (neither) the init.
#[derive(Clone, Copy)]
struct Start<'a> {
    resumed: Option<&'a Resumed>,
    pretrained: Option<&'a HashMap<String, Tensor>>,
}

fn train_rank(me: &Rank, cfg: &Config, data: &Dataset, opts: Options, start: Start) -> Result<Summary> {
    let resumed = start.resumed;
    let t = &cfg.train;
    let (dp_group, pp_group) = (me.group(Axis::DpCp), me.group(Axis::Pp));
    let stage = Stage { index: me.coords.pp, count: cfg.parallel.pp };
    let tp_group = me.group(Axis::Tp);
    let (mut model, first_step) = match (resumed, start.pretrained) {
        (Some(r), _) => (r.model(&cfg.model, Some(tp_group), stage)?, r.step),
        (None, Some(w)) => (checkpoint::build_from(w, &cfg.model, Some(tp_group), stage, &cfg.model.init_from)?, 0),
        (None, None) => (Llama::init(&cfg.model, t.seed, Some(tp_group), stage), 0),
    };
    let (cp, local_seq) = (me.group(Axis::Cp), t.seq_len / cfg.parallel.cp);
    let local = context_parallel::positions(cfg.parallel.cp_split, cp.size(), cp.index(), t.seq_len);
    if cp.size() > 1 {
        model = model.with_ring(Ring { group: cp, split: cfg.parallel.cp_split });
    }
    // on a GPU, the weights move there once; the training step below is the same code
    let device = match &me.gpu {
        Some(gpu) => Some(Device::new(gpu, cfg.device.compute_dtype())?),
        None => None,
    };
    let place = device.clone().map_or(Place::Cpu, Place::Cuda);
    model.to_place(&place);
    let mut dp = DataParallel::new(dp_group, &model.params(), cfg.parallel.dp_mode, cfg.parallel.bucket_mb);
    let mut optimizer = match resumed {
        Some(r) => {
            let mut o = r.optimizer(&model.params(), (tp_group.index(), tp_group.size()))?;
            o.to_place(&place); // the moments were read into host memory
            o
        }
        None => Optimizer::new(&model.params_mut()), // moments made next to the gradients
    };
    let quiet = opts.quiet || me.rank != 0;
    let mut metrics = Metrics::new(t.steps, opts.metrics.filter(|_| me.rank == 0), quiet)?;
    let record = |name: &str, start: Instant| {
        if let Some(trace) = opts.trace {
            trace.record(me.rank, Lane::Compute, name, start, Instant::now());
        }
    };
    let tokens_per_step = (t.micro_batch_size * t.grad_accum_steps * cfg.parallel.dp * t.seq_len) as f64;
    let start = Instant::now();
    let (mut losses, mut peak_activations, mut attention_work) = (Vec::with_capacity(t.steps), 0, 0);
    let (mut step_s, mut gpu_peak_mib) = (Vec::with_capacity(t.steps), None::<f64>);
    for step in first_step..t.steps {
        if opts.profile_from_step == Some(step) {
            crate::profile::start();
        }
        let step_start = Instant::now();
        model.zero_grads();
        // this rank's slice of the micro-batch: its dp share, and its cp positions of each sequence
        let data = |micro| {
            let (tokens, targets) = data.micro_batch(t, (me.coords.dp, cfg.parallel.dp), step, micro)?;
            Ok((
                context_parallel::local_rows(&tokens, t.seq_len, &local),
                context_parallel::local_rows(&targets, t.seq_len, &local),
            ))
        };
        let plan = StepPlan {
            kind: cfg.parallel.pp_schedule,
            micro_batches: t.grad_accum_steps,
            batch: t.micro_batch_size,
            hidden: [t.micro_batch_size * local_seq, cfg.model.hidden_size],
            data: &data,
            record: &|name, start| record(&name, start),
        };
        let stats = pipeline_parallel::run_step(&mut model, pp_group, &plan, &mut |p| dp.grad_ready(p))?;
        let t2 = Instant::now();
        dp.finish(&mut model.params_mut(), opts.trace.map(|tr| (tr, me.rank)))?;
        record("wait for gradients", t2);
        // the last stage knows the loss; every rank logs the mean over the global batch
        let mut loss = [stats.loss];
        pp_group.broadcast(&mut loss, pp_group.size() - 1)?;
        dp_group.all_reduce(&mut loss, ReduceOp::Avg)?;
        let loss = loss[0];
        if !loss.is_finite() {
            bail!("the loss became {loss} at step {step}: lower train.lr or set train.grad_clip");
        }
        let t3 = Instant::now();
        let mut params = model.params_mut();
        // dp replicas now hold the same averaged gradients; tp shards and pp stages add up their parts
        let grad_norm = optimizer::global_grad_norm(&params, me.group(Axis::Tp), pp_group)?;
        optimizer::clip(&mut params, grad_norm, t.grad_clip);
        let lr = optimizer::lr_at(t, step);
        optimizer.step(&mut params, t, lr);
        record("optimizer", t3);
        losses.push(loss);
        peak_activations = peak_activations.max(stats.peak_activations);
        attention_work += model.take_attention_work();
        let step_peak = device.as_ref().map(|d| d.take_peak_bytes() as f64 / (1 << 20) as f64);
        gpu_peak_mib = step_peak.map(|p| p.max(gpu_peak_mib.unwrap_or(0.0)));
        step_s.push(step_start.elapsed().as_secs_f64());
        metrics.log(&StepLog {
            step,
            activations: stats.peak_activations,
            loss,
            lr,
            grad_norm: grad_norm as f32,
            gpu_peak_mib: step_peak,
            tokens_per_s: tokens_per_step / step_start.elapsed().as_secs_f64(),
            elapsed_s: start.elapsed().as_secs_f64(),
        })?;
        let every = cfg.checkpoint.every;
        if every > 0 && ((step + 1) % every == 0 || step + 1 == t.steps) {
            if let Some(state) = save::gather(me, cfg, &model, &optimizer)? {
                save::save(Path::new(&cfg.checkpoint.dir), step + 1, &state, cfg, optimizer.steps_taken())?;
            }
        }
    }
    metrics.finish()?;
    let checksum = checksum(&model.params());
    let attention_work = attention_work / (t.steps - first_step).max(1) as u64;
    let wall_s = start.elapsed().as_secs_f64();
    Ok(Summary { losses, floor: None, wall_s, checksum, peak_activations, attention_work, step_s, gpu_peak_mib })
}

/// FNV-1a over the bits of every weight, in model order.
fn checksum(params: &[&Param]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for x in params.iter().flat_map(|p| p.value.to_vec()) {
        for b in x.to_bits().to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    h
}
