//! # The loss-convergence harness: does configuration X give the single-rank loss curve?
//!
//! A parallel run computes the same mathematics as one rank, cut differently, so with the same
//! seed and the same global batch its per-step losses must match the single-rank run up to
//! floating-point reordering (about 1e-5 on the CPU). The harness runs:
//!
//! ```text
//! baseline: the config on one rank (dp = tp = pp = cp = 1, grad_accum_steps × dp micro-batches)
//! variant:  the config with e.g. "dp=2,grad_accum_steps=2"; micro_batch_size is chosen so
//!           micro_batch_size × grad_accum_steps × dp stays the global batch
//! ```
//! and reports, per variant, the largest per-step loss difference against a tolerance, with a
//! CSV of all curves and an SVG plot. Keys are `section.key`, or the short names `dp`, `tp`,
//! `pp`, `cp`, `pp_schedule`, `cp_split`, `dp_mode`, `bucket_mb`, `backend` (in `[parallel]`) and
//! `grad_accum_steps`, `micro_batch_size` (in `[train]`).

use crate::config::Config;
use crate::train::{self, Options};
use anyhow::{bail, Context, Result};
use std::path::Path;

pub struct Variant {
    pub label: String,
    /// `section.key=value` settings.
    pub sets: Vec<String>,
}

/// `"dp=2;dp=4;dp=2,grad_accum_steps=2"`: variants split by `;`, settings by `,`.
pub fn parse_variants(spec: &str) -> Result<Vec<Variant>> {
    let mut variants = Vec::new();
    for label in spec.split(';').map(str::trim).filter(|v| !v.is_empty()) {
        let mut sets = Vec::new();
        for set in label.split(',').map(str::trim) {
            let Some((key, value)) = set.split_once('=') else {
                bail!("--variants: `{set}` in `{label}` is not key=value (for example dp=2)");
            };
            let key = key.trim();
            let full = match key {
                _ if key.contains('.') => key.to_string(),
                "dp" | "tp" | "pp" | "cp" | "ep" | "sequence_parallel" | "pp_schedule" | "pp_virtual_stages" | "cp_split" | "dp_mode" | "bucket_mb" | "zero_stage" | "backend" => {
                    format!("parallel.{key}")
                }
                "grad_accum_steps" | "micro_batch_size" | "recompute" => format!("train.{key}"),
                _ => bail!("--variants: unknown key `{key}` in `{label}`: use section.key, or dp, tp, pp, cp, ep, sequence_parallel, pp_schedule, pp_virtual_stages, cp_split, dp_mode, bucket_mb, zero_stage, backend, grad_accum_steps, micro_batch_size, recompute"),
            };
            sets.push(format!("{full}={}", value.trim()));
        }
        variants.push(Variant { label: label.to_string(), sets });
    }
    if variants.is_empty() {
        bail!("--variants is empty: give at least one, for example --variants \"dp=2\"");
    }
    Ok(variants)
}

pub struct Outcome {
    pub label: String,
    pub losses: Vec<f32>,
    pub max_diff: f32,
    pub pass: bool,
}

/// The baseline's losses and each variant's outcome against it.
pub fn converge(
    path: Option<&Path>,
    sets: &[String],
    variants: &[Variant],
    tol: f32,
) -> Result<(Vec<f32>, Vec<Outcome>)> {
    let base = Config::load(path, sets)?;
    let (t, p) = (&base.train, &base.parallel);
    let global = t.micro_batch_size * t.grad_accum_steps * p.dp;
    let one_rank = [
        "parallel.dp=1".to_string(),
        "parallel.tp=1".into(),
        "parallel.pp=1".into(),
        "parallel.cp=1".into(),
        "parallel.ep=1".into(),
        format!("train.grad_accum_steps={}", t.grad_accum_steps * p.dp),
    ];
    // started as several processes, each computes the baseline alone, and the variants together
    let run = |label: &str, extra: &[String], one_process: bool| -> Result<Vec<f32>> {
        let all: Vec<String> = sets.iter().chain(extra).cloned().collect();
        let cfg = Config::load(path, &all).with_context(|| format!("variant `{label}`"))?;
        let g = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.parallel.dp;
        if g != global {
            bail!("variant `{label}`: global batch {g} sequences, but the baseline has {global}; set micro_batch_size so that micro_batch_size × grad_accum_steps × dp = {global}");
        }
        crate::say!(
            "running {label} ({} rank{})",
            cfg.parallel.world_size(),
            if cfg.parallel.world_size() == 1 { "" } else { "s" }
        );
        Ok(train::train(&cfg, Options { quiet: true, one_process, ..Default::default() })?.losses)
    };
    // every variant's settings are checked before anything runs
    let mut planned = Vec::new();
    for v in variants {
        let with_sets = Config::load(path, &sets.iter().chain(&v.sets).cloned().collect::<Vec<_>>())
            .with_context(|| format!("variant `{}`", v.label))?;
        let mut extra = v.sets.clone();
        if !v.sets.iter().any(|s| s.starts_with("train.micro_batch_size=")) {
            let split = with_sets.train.grad_accum_steps * with_sets.parallel.dp;
            if global % split != 0 {
                bail!("variant `{}`: the global batch of {global} sequences does not split into grad_accum_steps × dp = {split} equal micro-batches", v.label);
            }
            extra.push(format!("train.micro_batch_size={}", global / split));
        }
        planned.push((v, extra));
    }
    let baseline = run("baseline", &one_rank, true)?;
    let mut outcomes = Vec::new();
    for (v, extra) in planned {
        let losses = run(&v.label, &extra, false)?;
        let max_diff = losses.iter().zip(&baseline).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        let pass = max_diff <= tol && losses.len() == baseline.len();
        outcomes.push(Outcome { label: v.label.clone(), losses, max_diff, pass });
    }
    Ok((baseline, outcomes))
}

/// The per-variant table.
pub fn table(outcomes: &[Outcome], tol: f32) -> String {
    let width = outcomes.iter().map(|o| o.label.len()).max().unwrap_or(0).max(7);
    let mut s = format!("{:<width$}  {:>14}  result (tolerance {tol:.0e})\n", "variant", "max |Δloss|");
    for o in outcomes {
        s += &format!("{:<width$}  {:>14.3e}  {}\n", o.label, o.max_diff, if o.pass { "pass" } else { "FAIL" });
    }
    s
}

/// `losses.csv` (step, baseline, one column per variant) and `losses.svg` in `dir`.
pub fn write_outputs(dir: &Path, baseline: &[f32], outcomes: &[Outcome]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut csv = String::from("step,baseline");
    outcomes.iter().for_each(|o| csv += &format!(",\"{}\"", o.label.replace('"', "'")));
    for (step, b) in baseline.iter().enumerate() {
        csv += &format!("\n{step},{b}");
        outcomes
            .iter()
            .for_each(|o| csv += &format!(",{}", o.losses.get(step).map_or(String::new(), |x| x.to_string())));
    }
    csv.push('\n');
    let mut curves = vec![("baseline (1 rank)".to_string(), baseline.to_vec())];
    curves.extend(outcomes.iter().map(|o| (o.label.clone(), o.losses.clone())));
    let svg = crate::commands::plot::loss_chart("loss per step: parallel variants against one rank", &curves);
    for (name, bytes) in [("losses.csv", csv.as_bytes()), ("losses.svg", svg.as_bytes())] {
        let path = dir.join(name);
        crate::files::write_atomically(&path, bytes)?;
    }
    Ok(())
}
