//! Shared by the tutorial steps: the run's size and device, the single-device reference, and the
//! verdict.
#![allow(dead_code)] // each step uses some of these

use anyhow::{bail, Result};
use ferrotron::config::{Config, DeviceKind};
use ferrotron::cuda::device::Device;
use ferrotron::cuda::runtime::Gpu;
use ferrotron::ops::tensor::Place;
use ferrotron::train::{self, Options};

/// `--tiny`: a few steps of a smaller model (what the test suite runs, so the tutorial never rots).
pub fn tiny() -> bool {
    std::env::args().any(|a| a == "--tiny")
}

/// `--gpu`: run on the GPUs (rank r on GPU r mod their count), in f32, so that every claim is
/// checked to the same tolerance as on the CPU.
pub fn gpu() -> bool {
    std::env::args().any(|a| a == "--gpu")
}

/// The settings `--gpu` adds (none without it).
pub fn device_sets() -> Vec<String> {
    match gpu() {
        true => vec!["device.kind=\"cuda\"".into(), "device.dtype=\"f32\"".into()],
        false => Vec::new(),
    }
}

/// Where rank `rank` computes: its GPU with `--gpu`, else the CPU.
pub fn place(cfg: &Config, rank: usize) -> Result<Place> {
    if cfg.device.kind == DeviceKind::Cpu {
        return Ok(Place::Cpu);
    }
    let gpu = Gpu::open(rank % ferrotron::cuda::runtime::device_count()?)?;
    Ok(Place::Cuda(Device::new(&gpu, cfg.device.compute_dtype())?))
}

/// The tiny config (`configs/tiny.toml`) for 40 steps, or a smaller model for 4 with `tiny`;
/// on the GPUs with `--gpu`; then `extra` settings.
pub fn config(tiny: bool, extra: &[&str]) -> Result<Config> {
    let mut sets: Vec<String> = vec!["train.steps=40".into(), "train.warmup_steps=10".into()];
    if tiny {
        let small = [
            "train.steps=4",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "train.seq_len=32",
            "data.copy_lag=8",
        ];
        sets.extend(small.map(String::from));
    }
    sets.extend(device_sets());
    sets.extend(extra.iter().map(|s| s.to_string()));
    Config::load(None, &sets)
}

/// The losses of `cfg` trained on one device with the whole global batch in one micro-batch:
/// what step 01 computes.
pub fn reference(cfg: &Config) -> Result<Vec<f32>> {
    Ok(one_device(cfg, Options::default())?.losses)
}

/// `cfg`'s global batch trained on one device in one micro-batch, with `opts` (quiet): e.g.
/// converge's harmless change, or a routing tape.
pub fn one_device(cfg: &Config, opts: Options) -> Result<train::Summary> {
    let mut one = cfg.clone();
    one.train.micro_batch_size *= cfg.train.grad_accum_steps * cfg.parallel.dp;
    one.train.grad_accum_steps = 1;
    (one.parallel.dp, one.parallel.tp, one.parallel.pp, one.parallel.cp, one.parallel.ep) = (1, 1, 1, 1, 1);
    one.parallel.dp_shard = 0; // one rank shards nothing
                               // what only makes sense split: sequence parallelism (tp > 1), model chunks (pp > 1)
    (one.parallel.sequence_parallel, one.parallel.pp_virtual_stages) = (false, 1);
    one.parallel.pp_schedule = ferrotron::config::PpSchedule::OneFOneB;
    train::train(&one, Options { quiet: true, ..opts })
}

/// PASS or FAIL for `claim`: `got` against step 01's curve for `cfg`, held to `converge`'s
/// criterion (src/commands/converge.rs): within `tol` at every step, or, where it is not, within
/// the band that a harmless change of step 01 opens — every initial weight moved by one unit in
/// the last place, a rounding's worth — at each step max(tol, 10 × that change's largest |Δloss|
/// so far). On the CPU every step passes within `tol`. On a GPU, cuBLAS picks its kernel by the
/// shapes of the product, so a layout that cuts a matrix differently (fewer rows a rank, half the
/// columns) sums in another order than step 01 does (step_by_step/README.md, "On a GPU").
pub fn follows(claim: &str, got: &[f32], cfg: &Config, tol: f32) -> Result<()> {
    let dtype = format!("{:?}", cfg.device.compute_dtype()).to_lowercase();
    let what = format!("every initial weight moved by one {dtype} ulp");
    let nudged = Options { nudge_weights: true, ..Default::default() };
    follows_with(claim, (got, &reference(cfg)?), cfg, tol, (nudged, &what))
}

/// `follows` against a reference curve `want` already made, with another harmless change: (its
/// options for step 01's run, what it is). The harmless run is made only where `tol` fails.
pub fn follows_with(
    claim: &str,
    (got, want): (&[f32], &[f32]),
    cfg: &Config,
    tol: f32,
    harmless: (Options, &str),
) -> Result<()> {
    use ferrotron::commands::converge::Criterion;
    let mut criterion = Criterion::exact(tol, want.len());
    if !criterion.judge(got, want).0 {
        let moved = one_device(cfg, harmless.0)?.losses;
        criterion = Criterion::banded(tol, want, &moved, harmless.1);
    }
    judged(claim, got, want, &criterion)
}

/// Prints PASS or FAIL for `claim`, comparing two loss curves step by step.
pub fn verdict(claim: &str, got: &[f32], want: &[f32], tol: f32) -> Result<()> {
    judged(claim, got, want, &ferrotron::commands::converge::Criterion::exact(tol, want.len()))
}

fn judged(claim: &str, got: &[f32], want: &[f32], c: &ferrotron::commands::converge::Criterion) -> Result<()> {
    let (pass, max, _) = c.judge(got, want);
    let measured = match &c.perturbation {
        None => format!("tolerance {:.0e}", c.tol),
        Some(_) => c.describe().replacen("criterion: ", "", 1),
    };
    println!(
        "verdict: {} — {claim}: max |Δloss| {max:.1e} over {} steps ({measured})",
        if pass { "PASS" } else { "FAIL" },
        got.len()
    );
    if !pass {
        bail!("the claim does not hold");
    }
    Ok(())
}

/// Prints PASS or FAIL for `claim`: `got` bytes must be `share` of `of` bytes, to 1% (ZeRO's
/// chunks are padded to whole values per rank).
pub fn share(claim: &str, got: usize, of: usize, share: f64) -> Result<()> {
    let ratio = got as f64 / of.max(1) as f64;
    let pass = (ratio / share - 1.0).abs() <= 0.01;
    println!(
        "verdict: {} — {claim}: {got} of {of} bytes ({ratio:.3}, expected {share})",
        if pass { "PASS" } else { "FAIL" }
    );
    if !pass {
        bail!("the claim does not hold");
    }
    Ok(())
}

/// Prints PASS or FAIL for `claim` with what was measured (`detail`); a FAIL is an error.
pub fn claim(claim: &str, pass: bool, detail: &str) -> Result<()> {
    println!("verdict: {} — {claim}: {detail}", if pass { "PASS" } else { "FAIL" });
    if !pass {
        bail!("the claim does not hold");
    }
    Ok(())
}

/// Prints PASS or FAIL for `claim`: two replicas' weight hashes must be equal.
pub fn same_weights(claim: &str, a: u64, b: u64) -> Result<()> {
    println!("verdict: {} — {claim}: weight hashes {a:016x} and {b:016x}", if a == b { "PASS" } else { "FAIL" });
    if a != b {
        bail!("the claim does not hold");
    }
    Ok(())
}

/// Gives a step its `main` (run at the lesson's size) and a test that runs it with `--tiny`.
macro_rules! step {
    ($run:ident) => {
        fn main() -> std::process::ExitCode {
            common::main($run)
        }

        #[test]
        fn tiny() {
            // at full size when `the_lesson_quotes_what_this_step_prints` runs this test again
            $run(std::env::var_os(common::FULL_SIZE).is_none()).unwrap();
        }

        #[test]
        fn the_lesson_quotes_what_this_step_prints() {
            common::lesson_quotes(file!()).unwrap();
        }
    };
}

/// Set by `lesson_quotes` for the run it starts: the step's test runs at the lesson's size.
pub const FULL_SIZE: &str = "FERROTRON_STEP_FULL_SIZE";

/// The output a step's lesson (`README.md` beside `main`) quotes under "Run it" is what the step
/// prints at full size on the CPU: this test binary runs its own `tiny` test again at full size
/// and finds every quoted line in that output, in order. In a quote, a line `...` stands for any
/// number of lines and `…` inside a line for any text (timings, which differ between machines).
pub fn lesson_quotes(main: &str) -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let lesson = root.join(main).with_file_name("README.md");
    let text = std::fs::read_to_string(&lesson)?;
    let run_it = text.split("## Run it").nth(1).unwrap_or("");
    let Some(quote) = run_it.split("```text\n").nth(1).and_then(|q| q.split("```").next()) else {
        bail!("{}: no ```text block under \"## Run it\"", lesson.display());
    };
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["--exact", "tiny", "--nocapture", "--test-threads=1"])
        .env(FULL_SIZE, "1")
        .output()?;
    let printed = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("the step failed at full size: {printed}{}", String::from_utf8_lossy(&out.stderr));
    }
    // the harness's own words around the step's output: "test tiny ... " before, "ok" after
    let body = printed.split_once("test tiny ... ").map_or(&*printed, |(_, b)| b);
    let mut lines = body.rsplit_once("\nok\n").map_or(body, |(b, _)| b).lines();
    let mut skipping = false;
    for want in quote.lines() {
        if want.trim() == "..." {
            skipping = true;
            continue;
        }
        let mut seen = Vec::new();
        loop {
            let Some(line) = lines.next() else {
                bail!(
                    "{}: the quoted line\n  {want}\nis not what the step prints next; it printed\n  {}",
                    lesson.display(),
                    seen.join("\n  ")
                );
            };
            if matches(want, line) {
                break;
            }
            seen.push(line.to_string());
        }
        if !skipping && !seen.is_empty() {
            bail!(
                "{}: the step prints lines the quote leaves out (write `...`):\n  {}",
                lesson.display(),
                seen.join("\n  ")
            );
        }
        skipping = false;
    }
    Ok(())
}

/// `line` is `pattern`, where each `…` of the pattern matches any text.
fn matches(pattern: &str, line: &str) -> bool {
    let mut parts = pattern.split('…');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = line.strip_prefix(first) else { return false };
    let parts: Vec<&str> = parts.collect();
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            return rest.ends_with(part);
        }
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.is_empty()
}

/// `main` of every step: run it, print an error in one line and exit 1 on failure.
pub fn main(run: fn(bool) -> Result<()>) -> std::process::ExitCode {
    ferrotron::train::memory::keep_freed_memory(); // as the ferrotron binary does: no page faults per op
    match run(tiny()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
