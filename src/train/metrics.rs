//! # Metrics: what a run tells you while it trains
//!
//! Every step produces one `StepLog`: shown on a progress bar (or as a plain line every tenth of
//! the run when the output is not a terminal, as in CI logs) and, with `--metrics FILE`, written
//! as one JSON object per line, so that curves can be plotted and compared across runs.

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::io::{BufWriter, Write};
use std::path::Path;

#[derive(Serialize, Clone, Debug)]
pub struct StepLog {
    pub step: usize,
    pub loss: f32,
    pub lr: f32,
    pub grad_norm: f32,
    /// The most micro-batch activations rank 0 held at once during the step (pipeline memory).
    pub activations: usize,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
    /// On a GPU: the most memory rank 0's tensors held at once during the step (weights, their
    /// gradients and optimizer state, and the activations kept for backward), in MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_peak_mib: Option<f64>,
}

pub struct Metrics {
    file: Option<BufWriter<std::fs::File>>,
    bar: ProgressBar,
    every: usize,
}

impl Metrics {
    pub fn new(steps: usize, jsonl: Option<&Path>, quiet: bool) -> Result<Metrics> {
        let file = match jsonl {
            Some(p) => Some(BufWriter::new(
                std::fs::File::create(p).with_context(|| format!("--metrics: cannot create {}", p.display()))?,
            )),
            None => None,
        };
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(steps as u64) };
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed_precise}]").expect("valid template"),
        );
        Ok(Metrics { file, bar, every: if quiet { 0 } else { steps.div_ceil(10) } })
    }

    pub fn log(&mut self, s: &StepLog) -> Result<()> {
        if let Some(f) = &mut self.file {
            writeln!(f, "{}", serde_json::to_string(s)?).context("--metrics: write failed")?;
        }
        let mut msg = format!("loss {:.4} | lr {:.2e} | {:.0} tok/s", s.loss, s.lr, s.tokens_per_s);
        if let Some(mib) = s.gpu_peak_mib {
            msg += &format!(" | GPU peak {mib:.0} MiB");
        }
        if self.bar.is_hidden() {
            if self.every > 0 && (s.step + 1).is_multiple_of(self.every) {
                println!("step {:>5} | {msg}", s.step + 1);
            }
        } else {
            self.bar.set_message(msg);
            self.bar.inc(1);
        }
        Ok(())
    }

    pub fn finish(mut self) -> Result<()> {
        self.bar.finish_and_clear();
        if let Some(f) = &mut self.file {
            f.flush().context("--metrics: write failed")?;
        }
        Ok(())
    }
}
