//! # Metrics: what a run tells you while it trains
//!
//! Every step produces one `StepLog`: shown on a progress bar (or as a plain line every tenth of
//! the run when the output is not a terminal, as in CI logs) and, with `--metrics FILE`, written
//! as one JSON object per line, so that curves can be plotted and compared across runs. Each line
//! is written as its step ends, so a killed run's file holds every step it finished; a resumed
//! run keeps the lines before its first step and appends after them. Each line names its run
//! (`"run"`, the id its checkpoints carry): a resumed run refuses a file that holds another
//! run's steps, which would make one curve of two runs.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

#[derive(Serialize, Clone, Debug)]
pub struct StepLog {
    pub step: usize,
    pub loss: f32,
    /// The loss on held-out data after this step, where there was a validation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
    /// A greedy continuation after this step, where one was due (`train.sample_every`):
    /// `"prompt" → "continuation"` (token ids for the synthetic data).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample: Option<String>,
    pub lr: f32,
    pub grad_norm: f32,
    /// The most micro-batch activations rank 0 held at once during the step (pipeline memory).
    pub activations: usize,
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation of the step (`devices.rs`), where the devices' peak is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    pub elapsed_s: f64,
    /// On a GPU: the most memory rank 0's tensors held at once during the step (weights, their
    /// gradients and optimizer state, and the activations kept for backward), in MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_peak_mib: Option<f64>,
    /// A mixture of experts: the rows rank 0 routed to each expert in the step, summed over its
    /// MoE layers (empty for a dense model).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub expert_tokens: Vec<usize>,
    /// A mixture of experts: the load imbalance, the busiest expert's rows over the mean, in the
    /// most unbalanced layer (1 is perfectly even; E/k would be every token on the same experts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_imbalance: Option<f64>,
    /// A mixture of experts, layer by layer (keys: the layer's number): the rows rank 0 routed to
    /// each expert, and the busiest expert's rows over the mean.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub expert_layer_tokens: BTreeMap<String, Vec<usize>>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub expert_layer_imbalance: BTreeMap<String, f64>,
}

/// One step's routing on rank 0, from its rows per expert of each MoE layer (by layer).
pub struct ExpertLoad {
    /// Rows per expert, summed over the layers.
    pub tokens: Vec<usize>,
    /// Each layer's busiest expert's rows over the mean (1: even; E/k: every row on the same k).
    pub imbalance: BTreeMap<usize, f64>,
}

impl ExpertLoad {
    pub fn of(layers: &BTreeMap<usize, Vec<usize>>) -> ExpertLoad {
        let width = layers.values().map(Vec::len).max().unwrap_or(0);
        let tokens = (0..width).map(|e| layers.values().map(|l| l.get(e).copied().unwrap_or(0)).sum()).collect();
        let ratio = |l: &Vec<usize>| {
            let mean = l.iter().sum::<usize>() as f64 / l.len().max(1) as f64;
            l.iter().copied().max().unwrap_or(0) as f64 / mean.max(f64::MIN_POSITIVE)
        };
        let imbalance = layers.iter().filter(|(_, l)| !l.is_empty()).map(|(&i, l)| (i, ratio(l))).collect();
        ExpertLoad { tokens, imbalance }
    }

    /// The most unbalanced layer and its max/mean.
    pub fn worst(&self) -> Option<(usize, f64)> {
        self.imbalance.iter().map(|(&l, &r)| (l, r)).reduce(|a, b| if b.1 > a.1 { b } else { a })
    }
}

pub struct Metrics {
    file: Option<std::fs::File>,
    bar: ProgressBar,
    every: usize,
    /// The run's id, written on every line.
    run: String,
}

/// A line of the metrics file: the run, then the step's numbers.
#[derive(Serialize)]
struct Line<'a> {
    run: &'a str,
    #[serde(flatten)]
    step: &'a StepLog,
}

impl Metrics {
    /// Metrics for steps `first..steps` of the run `run`; `jsonl` keeps its lines of steps before
    /// `first`, which must be that run's.
    pub fn new((first, steps): (usize, usize), jsonl: Option<&Path>, quiet: bool, run: &str) -> Result<Metrics> {
        let file = jsonl.map(|p| open_history(p, first, run));
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(steps as u64) };
        bar.set_position(first as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed_precise}]").expect("valid template"),
        );
        let every = if quiet { 0 } else { steps.div_ceil(10) };
        Ok(Metrics { file: file.transpose()?, bar, every, run: run.to_string() })
    }

    pub fn log(&mut self, s: &StepLog) -> Result<()> {
        if let Some(f) = &mut self.file {
            let line = serde_json::to_string(&Line { run: &self.run, step: s })? + "\n";
            f.write_all(line.as_bytes()).context("--metrics: write failed")?; // one write per step
        }
        let mut msg = format!("loss {:.4} | lr {:.2e} | {:.0} tok/s", s.loss, s.lr, s.tokens_per_s);
        if let Some(mfu) = s.mfu {
            msg += &format!(" | MFU {:.1}%", 100.0 * mfu);
        }
        if let Some(mib) = s.gpu_peak_mib {
            msg += &format!(" | GPU peak {mib:.0} MiB");
        }
        if let Some(ratio) = s.expert_imbalance {
            msg += &format!(" | experts max/mean {ratio:.2}");
            let worst = s.expert_layer_imbalance.iter().find(|(_, &r)| r == ratio);
            if let Some(layer) = worst.map(|(l, _)| l).filter(|_| s.expert_layer_imbalance.len() > 1) {
                msg += &format!(" (layer {layer})");
            }
        }
        if let Some(v) = s.val_loss {
            msg += &format!(" | val loss {v:.4}");
        }
        if self.bar.is_hidden() {
            let due = self.every > 0 && (s.step + 1).is_multiple_of(self.every);
            if due || s.val_loss.is_some() && self.every > 0 {
                crate::say!("step {:>5} | {msg}", s.step + 1);
            }
        } else {
            if let Some(v) = s.val_loss {
                self.bar.println(format!(
                    "step {:>5} | val loss {v:.4} (held-out data) | loss {:.4}",
                    s.step + 1,
                    s.loss
                ));
            }
            self.bar.set_message(msg);
            self.bar.inc(1);
        }
        if let Some(sample) = &s.sample {
            self.note(&format!("step {:>5} | sample: {sample}", s.step + 1));
        }
        Ok(())
    }

    /// A line between the steps' (where a checkpoint went): above the progress bar, or on its own
    /// line where the bar is hidden; nothing when quiet.
    pub fn note(&self, line: &str) {
        match (self.bar.is_hidden(), self.every > 0) {
            (false, _) => self.bar.println(line),
            (true, true) => crate::say!("{line}"),
            (true, false) => {}
        }
    }

    pub fn finish(mut self) -> Result<()> {
        self.bar.finish_and_clear();
        if let Some(f) = &mut self.file {
            f.sync_data().context("--metrics: write failed")?;
        }
        Ok(())
    }
}

/// The metrics file, rewritten whole with its lines of steps before `first` (none for a new run),
/// and opened to append. A resumed run (`first` > 0) refuses a file holding a line of a run other
/// than `run`; lines that name no run (written before lines named theirs) are kept, with a note.
fn open_history(path: &Path, first: usize, run: &str) -> Result<std::fs::File> {
    let mut kept = String::new();
    if first > 0 {
        let text = crate::files::read_text(path, "--metrics").unwrap_or_default();
        let mut unnamed = 0;
        for l in text.lines() {
            let Ok(j) = serde_json::from_str::<serde_json::Value>(l) else { continue };
            match j["run"].as_str() {
                Some(other) if other != run => bail!(
                    "--metrics {}: holds steps of run {:?}, not of the run resumed ({run}): one file would hold two runs' curves; give another file, or move that one away",
                    path.display(),
                    other.chars().take(40).collect::<String>()
                ),
                Some(_) => {}
                None => unnamed += 1,
            }
            if j["step"].as_u64().is_some_and(|s| (s as usize) < first) {
                kept += &format!("{l}\n");
            }
        }
        if unnamed > 0 {
            crate::say!("note: --metrics {}: {unnamed} lines name no run (written by an older ferrotron): kept, though whether they are this run's could not be checked", path.display());
        }
    }
    let written = (|| -> Result<std::fs::File> {
        crate::files::write_atomically(path, kept.as_bytes())?;
        let target = crate::files::output_target(path)?;
        Ok(std::fs::OpenOptions::new().append(true).open(target)?)
    })();
    written.with_context(|| format!("--metrics: cannot write {}", path.display()))
}
