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
//! and reports, per variant, the largest per-step loss difference against its criterion, with a
//! CSV of all curves and an SVG plot.
//!
//! Why a tolerance alone is not the criterion: training is a dynamical system that amplifies
//! small differences. Two runs that differ only in the order of a sum (a dp all-reduce adds the
//! replicas' gradients in another grouping, a tp row-parallel GEMM splits its inner dimension)
//! agree to ~1e-6 for a while, and then their difference grows by orders of magnitude every few
//! dozen steps until the curves are two samples of the same noisy descent (on the tiny config, in
//! f32: 1e-6 up to step 110, 1e-4 at 150, 1e-2 at 200). In bf16 every step rounds far more, and the
//! curves part at once. So the harness measures what a change that is harmless by construction
//! does to the baseline — the same run on one rank with every initial weight moved by one unit in
//! the last place of the compute dtype (`model::init::nudge`: a difference the size of one
//! rounding, in f32 or in bf16) — and holds each variant to:
//!
//! ```text
//! |Δloss| at step s ≤ max(tol, BAND_FACTOR × the harmless change's largest |Δloss| up to s)
//! ```
//! that is, the tolerance while the harmless change stays well inside it, then the band the
//! dynamics have opened. A broken layout is wrong from the first steps, where the criterion is
//! exact. The harmless run is made only when some variant leaves the tolerance (a passing check
//! costs nothing more).
//!
//! Keys are `section.key`, or the short names `dp`, `tp`,
//! `pp`, `cp`, `pp_schedule`, `cp_split`, `cp_mode`, `dp_mode`, `bucket_mb`, `backend` (in `[parallel]`) and
//! `grad_accum_steps`, `micro_batch_size` (in `[train]`).

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
                "dp" | "tp" | "pp" | "cp" | "ep" | "sequence_parallel" | "pp_schedule" | "pp_virtual_stages" | "cp_split" | "cp_mode" | "dp_mode" | "bucket_mb" | "zero_stage" | "zero_reduce" | "reduce_dtype" | "dp_shard" | "backend" => {
                    format!("parallel.{key}")
                }
                "grad_accum_steps" | "micro_batch_size" | "recompute" => format!("train.{key}"),
                _ => bail!("--variants: unknown key `{key}` in `{label}`: use section.key, or dp, tp, pp, cp, ep, sequence_parallel, pp_schedule, pp_virtual_stages, cp_split, cp_mode, dp_mode, bucket_mb, zero_stage, zero_reduce, reduce_dtype, dp_shard, backend, grad_accum_steps, micro_batch_size, recompute"),
            };
            if let Some(twice) = sets.iter().find(|s: &&String| s.split_once('=').is_some_and(|(k, _)| k == full)) {
                bail!(
                    "--variants: `{label}` sets {full} twice (`{twice}` and `{set}`): give each key once per variant"
                );
            }
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
    /// The step where |Δloss| is furthest above what passes there (or closest below it).
    pub worst_step: usize,
    pub pass: bool,
}

/// How far past the harmless change's running difference a variant may go: one such change is one
/// sample of a growing noise (another layout rounds a few times more or less), and a factor of 10
/// is a few dozen steps of its growth.
pub const BAND_FACTOR: f32 = 10.0;

/// What a variant's curve is held to, step by step.
pub struct Criterion {
    pub tol: f32,
    /// The harmless change that was measured, when a variant needed it, and its largest |Δloss|.
    pub perturbation: Option<(String, f32)>,
    /// The largest |Δloss| that passes, per step.
    pub allowed: Vec<f32>,
}

impl Criterion {
    /// `tol` at every step.
    pub fn exact(tol: f32, steps: usize) -> Criterion {
        Criterion { tol, perturbation: None, allowed: vec![tol; steps] }
    }

    /// At each step, the larger of `tol` and BAND_FACTOR × the running max of |perturbed − baseline|.
    pub fn banded(tol: f32, baseline: &[f32], perturbed: &[f32], what: &str) -> Criterion {
        let mut running = 0.0f32;
        let allowed = baseline
            .iter()
            .zip(perturbed)
            .map(|(b, p)| {
                running = running.max((b - p).abs()); // NaN (a run that blew up) opens no band
                tol.max(BAND_FACTOR * running)
            })
            .collect();
        Criterion { tol, perturbation: Some((what.to_string(), running)), allowed }
    }

    /// (pass, the largest |Δloss|, the step most over — or least under — what passes there).
    pub fn judge(&self, losses: &[f32], baseline: &[f32]) -> (bool, f32, usize) {
        let diffs: Vec<f32> = losses.iter().zip(baseline).map(|(a, b)| (a - b).abs()).collect();
        let max_diff = diffs.iter().fold(0.0f32, |m, &d| if d.is_nan() || m.is_nan() { f32::NAN } else { m.max(d) });
        let margin = |s: usize| if diffs[s].is_nan() { f32::INFINITY } else { diffs[s] / self.allowed[s] };
        let worst = (0..diffs.len()).max_by(|&a, &b| margin(a).total_cmp(&margin(b))).unwrap_or(0);
        let pass = losses.len() == baseline.len() && diffs.iter().zip(&self.allowed).all(|(d, a)| d <= a);
        (pass, max_diff, worst)
    }

    /// The criterion in a sentence, with the band measured.
    pub fn describe(&self) -> String {
        let tol = self.tol;
        let Some((what, largest)) = &self.perturbation else {
            return format!("criterion: |Δloss| ≤ {tol:.0e} at every step");
        };
        let exact = self.allowed.iter().take_while(|&&a| a == tol).count();
        let band = match self.allowed.last() {
            Some(&last) if exact == 0 => format!("so the band applies from the first step and reaches {last:.1e}"),
            Some(&last) if exact < self.allowed.len() => {
                format!("so the tolerance held up to step {exact} and the band reaches {last:.1e}")
            }
            _ => "so the tolerance held throughout".to_string(),
        };
        format!("criterion: at each step |Δloss| ≤ max({tol:.0e}, {BAND_FACTOR} × the largest |Δloss| so far of a harmless change of the baseline: {what}, a rounding's worth); the change reached {largest:.1e}, {band}")
    }
}

/// A converge run: the baseline's curve, the criterion and each variant's outcome.
pub struct Report {
    pub baseline: Vec<f32>,
    pub criterion: Criterion,
    pub outcomes: Vec<Outcome>,
}

/// `--tol`: 0 (bit for bit) or a positive finite loss difference.
pub fn check_tol(tol: f32) -> Result<()> {
    if !(tol.is_finite() && tol >= 0.0) {
        bail!("--tol {tol}: give a finite loss difference of 0 (bit for bit) or more (for example 1e-4)");
    }
    Ok(())
}

/// Every variant checked before anything runs: its settings load, with its micro-batch size set
/// (unless it gives one) so that it keeps the baseline's global batch. Each variant's settings.
pub fn plan<'v>(
    path: Option<&Path>,
    sets: &[String],
    variants: &'v [Variant],
) -> Result<Vec<(&'v Variant, Vec<String>)>> {
    let base = super::load_config(path, sets)?;
    let global = base.train.micro_batch_size * base.train.grad_accum_steps * base.parallel.dp;
    let mut planned = Vec::new();
    for v in variants {
        let load = |extra: &[String]| {
            super::load_config(path, &sets.iter().chain(extra).cloned().collect::<Vec<_>>())
                .with_context(|| format!("variant `{}`", v.label))
        };
        let with_sets = load(&v.sets)?;
        let mut extra = v.sets.clone();
        if !v.sets.iter().any(|s| s.starts_with("train.micro_batch_size=")) {
            let split = with_sets.train.grad_accum_steps * with_sets.parallel.dp;
            if global % split != 0 {
                bail!("variant `{}`: the global batch of {global} sequences does not split into grad_accum_steps × dp = {split} equal micro-batches", v.label);
            }
            extra.push(format!("train.micro_batch_size={}", global / split));
            load(&extra)?;
        }
        planned.push((v, extra));
    }
    Ok(planned)
}

/// The baseline's losses, the criterion, and each variant's outcome against them.
pub fn converge(path: Option<&Path>, sets: &[String], variants: &[Variant], tol: f32) -> Result<Report> {
    check_tol(tol)?;
    let base = super::load_config(path, sets)?;
    let (t, p) = (&base.train, &base.parallel);
    let global = t.micro_batch_size * t.grad_accum_steps * p.dp;
    let mut one_rank: Vec<String> = ["dp", "tp", "pp", "cp", "ep"].map(|a| format!("parallel.{a}=1")).into();
    one_rank.push(format!("train.grad_accum_steps={}", t.grad_accum_steps * p.dp));
    // started as several processes, each computes the baseline alone, and the variants together
    let run_as = |label: &str, extra: &[String], one_process: bool, nudge_weights: bool| -> Result<Vec<f32>> {
        let all: Vec<String> = sets.iter().chain(extra).cloned().collect();
        let cfg = super::load_config(path, &all).with_context(|| format!("variant `{label}`"))?;
        let g = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.parallel.dp;
        if g != global {
            bail!("variant `{label}`: global batch {g} sequences, but the baseline has {global}; set micro_batch_size so that micro_batch_size × grad_accum_steps × dp = {global}");
        }
        crate::say!(
            "running {label} ({} rank{})",
            cfg.parallel.world_size(),
            if cfg.parallel.world_size() == 1 { "" } else { "s" }
        );
        Ok(train::train(&cfg, Options { quiet: true, one_process, nudge_weights, ..Default::default() })?.losses)
    };
    let run = |label: &str, extra: &[String], one_process: bool| run_as(label, extra, one_process, false);
    let planned = plan(path, sets, variants)?; // every variant checked before anything runs
    let baseline = run("baseline", &one_rank, true)?;
    let mut curves = Vec::new();
    for (v, extra) in planned {
        curves.push((v.label.clone(), run(&v.label, &extra, false)?));
    }
    let mut criterion = Criterion::exact(tol, baseline.len());
    let within = |c: &Criterion| curves.iter().all(|(_, losses)| c.judge(losses, &baseline).0);
    if !within(&criterion) {
        let dtype = base.device.compute_dtype();
        let what = format!("every initial weight moved by one {} ulp", format!("{dtype:?}").to_lowercase());
        let nudged = run_as(&format!("the harmless change ({what})"), &one_rank, true, true)?;
        criterion = Criterion::banded(tol, &baseline, &nudged, &what);
    }
    let outcomes = curves
        .into_iter()
        .map(|(label, losses)| {
            let (pass, max_diff, worst_step) = criterion.judge(&losses, &baseline);
            Outcome { label, losses, max_diff, worst_step, pass }
        })
        .collect();
    Ok(Report { baseline, criterion, outcomes })
}

/// The criterion, then a line per variant: its largest |Δloss|, and at its worst step the
/// difference against what passes there.
pub fn table(r: &Report) -> String {
    let width = r.outcomes.iter().map(|o| o.label.len()).max().unwrap_or(0).max(7);
    let mut s = format!("{}\n", r.criterion.describe());
    s += &format!("{:<width$}  {:>12}  {:>28}  result\n", "variant", "max |Δloss|", "worst step: |Δloss| / allowed");
    for o in &r.outcomes {
        let at = o.worst_step;
        let there = (o.losses.get(at).zip(r.baseline.get(at))).map_or(f32::NAN, |(a, b)| (a - b).abs());
        // steps shown from 1, as the progress line and the plots count them
        let allowed = r.criterion.allowed.get(at).copied().unwrap_or(r.criterion.tol);
        let worst = format!("{}: {there:.1e} / {allowed:.1e}", at + 1);
        s += &format!(
            "{:<width$}  {:>12.3e}  {worst:>28}  {}\n",
            o.label,
            o.max_diff,
            if o.pass { "pass" } else { "FAIL" }
        );
    }
    s
}

/// `losses.csv` (step, baseline, one column per variant) and `losses.svg` in `dir`.
pub fn write_outputs(dir: &Path, r: &Report) -> Result<()> {
    let (baseline, outcomes) = (&r.baseline, &r.outcomes);
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
    let title = "loss per step: parallel variants against one rank";
    let svg = crate::commands::plot::loss_chart(title, &curves, (&r.criterion.allowed, r.criterion.tol));
    for (name, bytes) in [("losses.csv", csv.as_bytes()), ("losses.svg", svg.as_bytes())] {
        let path = dir.join(name);
        crate::files::write_atomically(&path, bytes)?;
    }
    Ok(())
}
