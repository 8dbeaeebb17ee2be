//! # `ferrotron train`: a run, and what it says when it ends
//!
//! The training loop is `train/driver.rs`; this is the command around it: signals handled, the run's
//! outputs written (the trace by the first process, the plot), and its last words: nothing to
//! train, stopped by a signal (where to resume), or done (the final loss against the floor).

use crate::comm::cost::Link;
use crate::comm::trace::Trace;
use crate::commands::plot;
use crate::config::Config;
use crate::model::routing_tape::TapeMode;
use crate::parallel::data_parallel::gradient_all_reduce;
use crate::say;
use anyhow::{Context, Result};
use std::path::Path;

/// Where a run writes, besides its checkpoints (each claimed by the caller: `claim_outputs`).
pub struct Outputs<'a> {
    pub metrics: Option<&'a Path>,
    pub trace: Option<&'a Path>,
    pub plot: Option<&'a Path>,
}

/// Trains `cfg` from scratch or from `resume` (with `allow_changes`), writing `out`; returns the
/// signal that stopped it, if one did.
pub fn run(
    cfg: &Config,
    out: Outputs,
    (resume, allow_changes): (Option<&Path>, bool),
    link: Option<Link>,
    routing_tape: Option<TapeMode>,
) -> Result<Option<i32>> {
    let spans = out.trace.map(|_| Trace::default());
    crate::signals::install(); // Ctrl-C and SIGTERM: stop at a micro-batch, save, exit
    let opts = crate::train::Options {
        metrics: out.metrics,
        trace: spans.as_ref(),
        resume,
        allow_changes,
        stop_on_signal: true,
        comm_report: link,
        routing_tape,
        ..Default::default()
    };
    let s = crate::train::train(cfg, opts)?;
    if s.losses.is_empty() && s.stopped.is_none() {
        say!("nothing to train: the run already finished at step {} of train.steps = {} (raise train.steps to train further)", s.first_step, cfg.train.steps);
        return Ok(None);
    }
    // several processes: the first writes its ranks' spans
    if let (Some(path), Some(spans), true) = (out.trace, &spans, crate::comm::wires::processes::leads()) {
        spans.write(path)?;
        let overlap = match !spans.comm_spans(gradient_all_reduce).is_empty() {
            true => format!(
                "{:.0}% of data-parallel all-reduce time ran during backward",
                100.0 * spans.hidden_fraction(gradient_all_reduce, "backward")
            ),
            false => "no data-parallel all-reduce in this run".into(),
        };
        say!("trace: {} ({overlap})", path.display());
    }
    if let (Some(path), true) = (out.plot, crate::comm::wires::processes::leads()) {
        let steps = s.first_step..s.first_step + s.losses.len();
        let lrs: Vec<f32> = steps.clone().map(|step| crate::model::optimizer::lr_at(&cfg.train, step)).collect();
        let title = format!("{}: steps {} to {} of {}", cfg.data.source, steps.start + 1, steps.end, cfg.train.steps);
        let svg = plot::run_chart(&title, (s.first_step, cfg.train.steps), &s.losses, &s.val_losses, &lrs);
        crate::files::write_atomically(path, svg.as_bytes()).context("--plot")?;
        say!("plot: {} (loss, held-out loss and learning rate against the step)", path.display());
    }
    if let Some(stopped) = &s.stopped {
        let step = s.first_step + s.losses.len();
        let signal = crate::signals::name(stopped.signal);
        if let Some(micro) = stopped.dropped {
            let m = cfg.train.grad_accum_steps;
            say!("step {} dropped after {micro} of its {m} micro-batches: it trains again on resume", step + 1);
        }
        match &stopped.checkpoint {
        _ if s.losses.is_empty() => say!("stopped by {signal} in the run's first step: nothing new to save"),
        Some(at) => say!("stopped by {signal} after step {step}: checkpoint {}; resume with the same command and --resume latest (or --resume {})", at.display(), at.display()),
        None if crate::comm::wires::processes::leads() => say!("stopped by {signal} after step {step}: no checkpoint saved (no folder could take one, as said at the start)"),
        None => say!("stopped by {signal} after step {step}: checkpoints are process 0's to write (see its output)"),
    }
        return Ok(Some(stopped.signal));
    }
    if let Some((replaced, rows)) = s.routing_replaced {
        say!("routing replay: {replaced} of {rows} rows (rank 0's, all steps and MoE layers) took a recorded choice other than their router's own");
    }
    let floor = match s.floor {
        Some(f) => format!("{f:.4} (gap {:.4})", s.final_loss() as f64 - f),
        None => "unknown".into(),
    };
    let val = s.val_losses.last().map(|(_, v)| format!(" | val loss {v:.4} (held-out data)")).unwrap_or_default();
    let mfu = s.mfu.map(|m| format!(" | MFU {:.1}%", 100.0 * m)).unwrap_or_default();
    say!(
        "done: {} steps in {:.1}s | final loss {:.4} (mean of the last tenth){val}{mfu} | entropy floor {floor}",
        s.losses.len(),
        s.wall_s,
        s.final_loss()
    );
    Ok(None)
}
