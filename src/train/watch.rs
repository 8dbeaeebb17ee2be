//! # Watching a rank's run: what each step printed, took, held and sent
//!
//! The loop (`train/driver.rs`) tells its `Watch` when a step starts, each compute span, and what
//! the step ended with; the watch writes the metrics line, records trace spans, times the step,
//! reads the memory peak and adds up the step's communication, and hands the rank's `Summary`
//! back at the end.

use super::memory::Held;
use super::metrics::{ExpertLoad, Metrics, StepLog};
use super::run::{Options, Stopped, Summary};
use crate::comm::cost;
use crate::comm::launcher::Rank;
use crate::comm::trace::{Lane, Trace};
use crate::config::Config;
use crate::model::moe::Experts;
use crate::model::Llama;
use crate::ops::tensor::Place;
use anyhow::Result;
use std::collections::BTreeMap;
use std::time::Instant;

/// What the loop reports at the end of a step.
pub(super) struct StepEnd {
    pub step: usize,
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f64,
    /// The most micro-batch activations held at once in the step.
    pub activations_held: usize,
    /// What the model and optimizer held when the gradients were complete.
    pub held: Held,
    /// The loss on held-out data after this step, where there was a validation (rank 0).
    pub val_loss: Option<f32>,
    /// A greedy continuation of the sample prompt after this step, where one was due (rank 0).
    pub sample: Option<String>,
    /// The seconds that validation and sampling took: not the step's (its tokens/s counts training alone).
    pub validation_s: f64,
}

/// A rank's watch over its run: metrics, trace spans, step times, peaks.
pub(super) struct Watch<'a> {
    rank: usize,
    /// Its groups, whose communication is counted step by step.
    me: &'a Rank,
    trace: Option<&'a Trace>,
    profile_from_step: Option<usize>,
    metrics: Metrics,
    place: Place,
    tokens_per_step: f64,
    /// The model FLOPs of a step, over the peak FLOP/s of the devices the run uses: MFU is this
    /// over the step's seconds (`devices.rs`). None where the peak is unknown or nothing is shown.
    flops_per_peak: Option<f64>,
    /// The model FLOPs of a step.
    flops: f64,
    /// On the CPU, where MFU is shown: the cache folder whose recorded peak a step above 100 %
    /// measures again (once a run).
    recalibrate: Option<String>,
    run_start: Instant,
    step_start: Instant,
    summary: Summary,
}

impl<'a> Watch<'a> {
    /// Watches a run that starts at `first_step`; the metrics file keeps the lines of the steps
    /// before it (a resumed run continues its history).
    pub(super) fn new(
        me: &'a Rank,
        cfg: &Config,
        opts: Options<'a>,
        (first_step, place, cpu_peak, run): (usize, Place, Option<f64>, &str),
    ) -> Result<Watch<'a>> {
        let (t, rank) = (&cfg.train, me.rank);
        place.take_peak_bytes(); // the steps' peaks count from here, after the model was built
        if let Some(trace) = opts.trace {
            me.trace_to(trace)?; // every collective and message of this rank's groups
        }
        if opts.comm_report.is_some() {
            me.time_calls()?; // GPU calls timed with events, as in a traced run
        }
        me.comm_tallies(); // the count starts with the first step, not with setting up
        let jsonl = opts.metrics.filter(|_| rank == 0);
        let metrics = Metrics::new((first_step, t.steps), jsonl, opts.quiet || rank != 0, run)?;
        let summary = Summary::new(first_step);
        let tokens_per_step = (t.micro_batch_size * t.grad_accum_steps * cfg.parallel.dp * t.seq_len) as f64;
        // only rank 0 shows MFU; a quiet run (converge's) has no line to show it on
        let flops = crate::devices::flops_per_token(&cfg.model, t.seq_len) * tokens_per_step;
        let peak = if rank == 0 && !opts.quiet { peak_tflops(cfg, &place, cpu_peak) } else { None };
        let flops_per_peak = peak.map(|tflops| flops / (tflops * 1e12));
        let on_cpu = matches!(place, Place::Cpu) && peak.is_some();
        let recalibrate = on_cpu.then(|| cfg.data.cache_dir.clone());
        let (trace, profile_from_step, now) = (opts.trace, opts.profile_from_step, Instant::now());
        let (run_start, step_start) = (now, now);
        Ok(Watch {
            rank,
            me,
            trace,
            profile_from_step,
            metrics,
            place,
            tokens_per_step,
            flops_per_peak,
            flops,
            recalibrate,
            run_start,
            step_start,
            summary,
        })
    }

    pub(super) fn step_starts(&mut self, step: usize) {
        if self.profile_from_step == Some(step) {
            crate::cuda::profile::start();
        }
        self.step_start = Instant::now();
    }

    /// Records a compute span from `start` to now (with `--trace`).
    pub(super) fn span(&self, name: String, start: Instant) {
        if let Some(trace) = self.trace {
            trace.record(self.rank, Lane::Compute, name, start, start, Instant::now());
        }
    }

    pub(super) fn step_ends(&mut self, end: &StepEnd, model: &mut Llama, experts: Option<&Experts>) -> Result<()> {
        let s = &mut self.summary;
        s.losses.push(end.loss);
        s.grad_norms.push(end.grad_norm);
        s.val_losses.extend(end.val_loss.map(|v| (end.step, v)));
        let layers = experts.map_or(BTreeMap::new(), Experts::take_load);
        let load = ExpertLoad::of(&layers);
        s.expert_tokens.resize(load.tokens.len(), 0);
        s.expert_tokens.iter_mut().zip(&load.tokens).for_each(|(a, b)| *a += b);
        s.peak_activations = s.peak_activations.max(end.activations_held);
        s.held = end.held;
        s.attention_work += model.take_attention_work();
        let place = &self.place;
        let peak = place.take_peak_bytes();
        s.peak_bytes = s.peak_bytes.max(peak);
        let step_peak = matches!(place, Place::Cuda(_)).then(|| peak as f64 / (1 << 20) as f64);
        s.gpu_peak_mib = step_peak.map(|p| p.max(s.gpu_peak_mib.unwrap_or(0.0)));
        let seconds = (self.step_start.elapsed().as_secs_f64() - end.validation_s).max(1e-9);
        s.step_s.push(seconds);
        // this step's calls, added up (on a GPU their timing events are read and let go here,
        // not kept for the whole run)
        cost::merge(&mut s.comm, self.me.comm_tallies());
        let mut mfu = self.flops_per_peak.map(|f| f / seconds);
        if let (Some(m), Some(cache)) = (mfu.filter(|&m| m > 1.0), self.recalibrate.take()) {
            // above 100 %: the recorded peak is wrong, not the step (once a run: this is a pause)
            let rates = (self.flops / (m * seconds) / 1e12, self.flops / seconds / 1e12);
            let (peak, said) = crate::devices::cpu_peak_beaten(&cache, rates, crate::ops::cpu_math::peak_tflops);
            self.metrics.note(&said);
            self.flops_per_peak = Some(self.flops / (peak * 1e12));
            mfu = self.flops_per_peak.map(|f| f / seconds);
        }
        self.metrics.log(&StepLog {
            step: end.step,
            activations: end.activations_held,
            loss: end.loss,
            val_loss: end.val_loss,
            sample: end.sample.clone(),
            lr: end.lr,
            grad_norm: end.grad_norm as f32,
            gpu_peak_mib: step_peak,
            expert_imbalance: load.worst().map(|(_, r)| r),
            expert_layer_imbalance: load.imbalance.iter().map(|(l, r)| (l.to_string(), *r)).collect(),
            expert_layer_tokens: layers.into_iter().map(|(l, t)| (l.to_string(), t)).collect(),
            expert_tokens: load.tokens,
            tokens_per_s: self.tokens_per_step / seconds,
            mfu,
            elapsed_s: self.run_start.elapsed().as_secs_f64(),
        })
    }

    /// Says where a checkpoint went (rank 0, which writes them).
    pub(super) fn saved(&self, at: &std::path::Path) {
        self.metrics.note(&format!("checkpoint: {}", at.display()));
    }

    /// Notes that a signal stopped the run, and the checkpoint it saved (`None` where another
    /// process wrote it).
    pub(super) fn stopped(&mut self, stopped: Stopped) {
        self.summary.stopped = Some(stopped);
    }

    pub(super) fn finish(mut self, model: &Llama) -> Result<Summary> {
        self.metrics.finish()?;
        let s = &mut self.summary;
        cost::merge(&mut s.comm, self.me.comm_tallies()); // the last step's signal check and checkpoint
        s.checksum = model.checksum();
        s.attention_work /= s.losses.len().max(1) as u64;
        s.wall_s = self.run_start.elapsed().as_secs_f64();
        // over the steps' own time (validation and checkpoints left out), as tokens/s is
        let stepping: f64 = s.step_s.iter().sum();
        s.mfu = self.flops_per_peak.map(|f| f * s.step_s.len() as f64 / stepping.max(1e-9));
        Ok(self.summary)
    }
}

/// The peak TFLOP/s of every device the run uses, where known: a GPU's from its name (`devices.rs`)
/// times the GPUs (ranks on GPUs of their own, else the GPUs they share); the CPU's, measured
/// before the ranks started (`cpu_peak`), the whole machine's (its ranks share it).
fn peak_tflops(cfg: &Config, place: &Place, cpu_peak: Option<f64>) -> Option<f64> {
    match place {
        Place::Cuda(device) => {
            let name = device.gpu.ctx.name().ok()?;
            let per_gpu = crate::devices::peak_tflops(&name, cfg.device.compute_dtype())?;
            let processes = crate::comm::wires::processes::current().ok().flatten().map_or(1, |p| p.count);
            let gpus = crate::cuda::runtime::device_count().ok()? * processes;
            Some(per_gpu * cfg.parallel.world_size().min(gpus) as f64)
        }
        Place::Cpu => cpu_peak,
    }
}
