//! The `ferrotron` command line: `train`, `converge`, `grid`, `schedule`, `memory`, `eval`,
//! `generate`, `doctor` and `bench` (their flags: `commands/cli.rs`).

use anyhow::{Context, Result};
use clap::FromArgMatches;
use ferrotron::checkpoint::hf;
use ferrotron::comm::cost::Link;
use ferrotron::comm::launcher;
use ferrotron::comm::process_grid::Grid;
use ferrotron::commands::cli::{
    BenchArgs, Cli, Command, ConvergeArgs, EvalArgs, GenerateArgs, GridArgs, MemoryArgs, PathArg, PlanArgs,
    ScheduleArgs, TokenizerArgs, TrainArgs,
};
use ferrotron::commands::{self, bench, converge, doctor, eval, generate, memory, plan, schedule};
use ferrotron::config::Config;
use ferrotron::config::PpSchedule;
use ferrotron::model::routing_tape::TapeMode;
use ferrotron::say;
use std::io::Write;
use std::process::ExitCode;

/// Each command is a function below; `paths` are the files and folders its command line
/// names, with what it does with each (`commands/cli.rs`).
fn run(cli: Cli, paths: &[PathArg]) -> Result<Exit> {
    match cli.command {
        Command::Train(a) => train_command(a, paths),
        Command::Converge(a) => converge_command(a, paths),
        Command::Schedule(a) => schedule_command(a, paths),
        Command::Grid(a) => grid_command(a),
        Command::Eval(a) => eval_command(a),
        Command::Memory(a) => memory_command(a, paths),
        Command::Plan(a) => plan_command(a, paths),
        Command::Generate(a) => generate_command(a),
        Command::Tokenizer(a) => tokenizer_command(a, paths),
        Command::Doctor => doctor::doctor().map(|_| Exit::Done),
        Command::Bench(a) if a.op.is_some() => bench_op(a, paths),
        Command::Bench(a) if a.calibrate => {
            let cfg = commands::load_config(a.config.as_deref(), &a.sets)?;
            if cfg.device.kind == ferrotron::config::DeviceKind::Cuda {
                let calibration = ferrotron::commands::calibrate::calibrate_gpu(&cfg)?;
                say!("{}", ferrotron::commands::calibrate::gpu_table(&calibration).trim_end());
                return Ok(Exit::Done);
            }
            let calibration = ferrotron::commands::calibrate::calibrate(&cfg.data.cache_dir)?;
            say!("{}", ferrotron::commands::calibrate::table(&calibration).trim_end());
            Ok(Exit::Done)
        }
        Command::Bench(a) => bench_step(a, paths),
    }
}

fn train_command(
    TrainArgs {
        config,
        sets,
        metrics,
        trace,
        plot,
        resume,
        allow_changes,
        comm_report,
        link,
        record_routing,
        replay_routing,
    }: TrainArgs,
    paths: &[PathArg],
) -> Result<Exit> {
    let cfg = commands::load_config(config.as_deref(), &sets)?;
    // before, not after, training: each output writable, no two on one file, and none onto what
    // the run reads (its config, data, checkpoints, the model it starts from)
    let _claims = commands::claim_outputs(paths, Some(&cfg))?; // held until the run ends
    let outputs =
        commands::train::Outputs { metrics: metrics.as_deref(), trace: trace.as_deref(), plot: plot.as_deref() };
    let link = comm_report.then(|| Link::parse(&link)).flatten();
    let tape = match (&record_routing, &replay_routing) {
        (Some(dir), _) => Some(TapeMode::Record(dir)),
        (_, Some(dir)) => Some(TapeMode::Replay(dir)),
        _ => None,
    };
    Ok(match commands::train::run(&cfg, outputs, (resume.as_deref(), allow_changes), link, tape)? {
        Some(signal) => Exit::Signal(signal), // every process of the run exits 128 + signal
        None => Exit::Done,
    })
}

fn converge_command(
    ConvergeArgs { config, mut sets, variants, steps, tol, out }: ConvergeArgs,
    paths: &[PathArg],
) -> Result<Exit> {
    let variants = converge::parse_variants(&variants)?;
    converge::check_tol(tol)?;
    converge::plan(config.as_deref(), &sets, &variants)?; // every refusal before --out is made
    let _claim = commands::claim_outputs(paths, Some(&commands::load_config(config.as_deref(), &sets)?))?;
    sets.extend(steps.map(|n| format!("train.steps={n}")));
    let report = converge::converge(config.as_deref(), &sets, &variants, tol)?;
    if ferrotron::comm::wires::processes::leads() {
        converge::write_outputs(&out, &report)?; // once, by the first process
    }
    say!("{}", converge::table(&report).trim_end());
    say!("curves: {0}/losses.csv, plot: {0}/losses.svg", out.display());
    let failed = report.outcomes.iter().filter(|o| !o.pass).count();
    if failed > 0 {
        anyhow::bail!("{failed} variant(s) left the single-rank loss curve: {}", report.criterion.describe());
    }

    Ok(Exit::Done)
}

fn schedule_command(
    ScheduleArgs { pp, microbatches, schedule: which, r#virtual, trace, out }: ScheduleArgs,
    paths: &[PathArg],
) -> Result<Exit> {
    use PpSchedule::{Afab, Interleaved, OneFOneB, ZbH1, Zbv};
    let all = [Afab, OneFOneB, Interleaved, ZbH1, Zbv];
    let kinds = match which.as_str() {
        "both" => vec![Afab, OneFOneB],
        "zero-bubble" => vec![OneFOneB, ZbH1, Zbv],
        "all" => all.to_vec(),
        one if all.iter().any(|k| k.name() == one) => all.into_iter().filter(|k| k.name() == one).collect(),
        other => {
            anyhow::bail!("--schedule {other}: expected afab, 1f1b, interleaved, zb-h1, zbv, both (afab and 1f1b), zero-bubble (1f1b, zb-h1 and zbv) or all")
        }
    };
    let _claims = commands::claim_outputs(paths, None)?;
    let timelines = match &trace {
        Some(path) => vec![schedule::from_trace(path)?],
        // one schedule asked for: its refusal is the answer; of a set, those that cannot run at
        // this size are left out, each with its reason (ZBV needs 2·pp − 1 micro-batches)
        None if kinds.len() == 1 => vec![schedule::simulate(kinds[0], pp, microbatches, r#virtual)?],
        None => {
            let played: Vec<_> =
                kinds.iter().map(|&k| (k, schedule::simulate(k, pp, microbatches, r#virtual))).collect();
            if played.iter().all(|(_, p)| p.is_err()) {
                // nothing to draw: the first one's reason is the answer (a size no schedule takes)
                return Err(played.into_iter().find_map(|(_, p)| p.err()).expect("a set of schedules"));
            }
            let mut drawn = Vec::new();
            for (kind, p) in played {
                match p {
                    Ok(t) => drawn.push(t),
                    Err(e) => say!("{} left out: {}", kind.name(), e.to_string().trim_start_matches("schedule: ")),
                }
            }
            drawn
        }
    };
    for t in &timelines {
        let formula = t.bubble_formula().map_or(String::new(), |f| format!(" (formula {:.1}%)", 100.0 * f));
        say!(
            "{}: {} rows, m={}: bubble {:.1}% of the step{formula}, peak micro-batch activations per row {}",
            t.name,
            t.stages,
            t.micro_batches,
            100.0 * t.bubble(),
            t.peak_activations.iter().map(|a| format!("{a:.2}")).collect::<Vec<_>>().join(" ")
        );
    }
    ferrotron::files::write_atomically(&out, schedule::svg(&timelines).as_bytes()).context("--out")?;
    say!("picture: {}", out.display());

    Ok(Exit::Done)
}

fn grid_command(GridArgs { dp, pp, cp, tp, ep, dp_shard }: GridArgs) -> Result<Exit> {
    let grid = ferrotron::parallel::layout::with_cuts(Grid::new(dp, pp, cp, tp)?, ep, dp_shard)?;
    say!("{}", grid.table().trim_end());
    launcher::check_groups(grid)?;
    let n = grid.world_size();
    say!("checked: {n} rank threads each all-gathered their rank number over each of their groups and got the members above");
    Ok(Exit::Done)
}

fn eval_command(EvalArgs { model, tokens }: EvalArgs) -> Result<Exit> {
    let mut m = hf::load_hf(&model)?;
    let seqs = eval::read_tokens(&tokens, m.cfg.vocab_size)?;
    say!("loss: {:.6}", eval::mean_loss(&mut m, &seqs)?);

    Ok(Exit::Done)
}

fn memory_command(MemoryArgs { config, sets, measure, json }: MemoryArgs, paths: &[PathArg]) -> Result<Exit> {
    let cfg = commands::load_config(config.as_deref(), &sets)?;
    let _claims = commands::claim_outputs(paths, Some(&cfg))?;
    let ranks = memory::memory(&cfg, measure)?;
    say!("{}", memory::table(&cfg, &ranks).trim_end());
    if let Some(path) = &json {
        ferrotron::files::write_atomically(path, memory::json(&ranks)?.as_bytes()).context("--json")?;
    }

    Ok(Exit::Done)
}

fn plan_command(a: PlanArgs, paths: &[PathArg]) -> Result<Exit> {
    let base = plan::model_of(a.config.as_deref(), &a.sets)?;
    let _claims = commands::claim_outputs(paths, Some(&base))?;
    let dtype = match a.dtype.as_str() {
        "bf16" => ferrotron::config::DeviceDtype::Bf16,
        "fp8" => ferrotron::config::DeviceDtype::Fp8,
        other => anyhow::bail!("--dtype {other}: expected bf16 or fp8"),
    };
    let mut cluster = match a.gpu.as_str() {
        "cpu" => plan::cpu_cluster(&base.data.cache_dir, a.gpus)?,
        gpu => {
            // a calibration `bench --calibrate` recorded on such a GPU replaces the shipped rates
            let measured = ferrotron::commands::calibrate::recorded_gpu(&base.data.cache_dir, gpu, dtype)?;
            plan::cluster(gpu, (a.gpus, a.gpus_per_node), dtype, measured)?
        }
    };
    plan::override_cluster(&mut cluster, (a.memory_gib, a.node_gb_s, a.net_gb_s))?;
    let hf = a.config.as_deref().is_some_and(plan::is_hf);
    if hf && (a.seq_len.is_none() || a.global_batch_tokens.is_none()) {
        anyhow::bail!("--config {}: a Hugging Face config.json holds no batch; give --seq-len and --global-batch-tokens (for example --seq-len 4096 --global-batch-tokens 4194304)", a.config.as_deref().map(|p| p.display().to_string()).unwrap_or_default());
    }
    let t = &base.train;
    let seq_len = a.seq_len.unwrap_or(t.seq_len);
    let default_tokens = t.micro_batch_size * t.grad_accum_steps * base.parallel.dp * seq_len;
    let ask = plan::Ask {
        global_batch_tokens: a.global_batch_tokens.unwrap_or(default_tokens),
        seq_len,
        dtype: if cluster.on_cpu { ferrotron::config::DeviceDtype::F32 } else { dtype },
        runnable: a.runnable,
    };
    say!("{}", plan::header(&base, &cluster, &ask).trim_end());
    if a.fixed {
        let layout = plan::fixed(&base, &cluster, &ask)?;
        say!("{}", plan::explain(&layout, &cluster).trim_end());
        if let Some(path) = &a.json {
            let text = plan::json(&base, std::slice::from_ref(&layout), &cluster, &ask, None, &[])?;
            ferrotron::files::write_atomically(path, text.as_bytes()).context("--json")?;
        }
        return Ok(Exit::Done);
    }
    let searched = plan::plan(&base, &cluster, &ask)?;
    if let Some(line) = plan::rounding(&searched, &ask) {
        say!("{line}");
    }
    let layouts = &searched.layouts;
    let short = plan::shortfall(&base, &cluster, &ask, layouts);
    match &short {
        None => say!("{}", plan::table(layouts, &cluster, a.top).trim_end()),
        Some(s) => say!("{} layouts tried\n{}", layouts.len(), plan::shortfall_text(s, &cluster).trim_end()),
    }
    // nothing tried: the reasons are the answer
    if a.explain_drops || layouts.is_empty() {
        say!("{}", plan::drops_text(&searched.dropped).trim_end());
    }
    if let Some(n) = a.explain {
        let fit: Vec<&plan::Layout> = layouts.iter().filter(|l| l.fits).collect();
        match (fit.get(n.wrapping_sub(1)), &short) {
            (Some(l), _) => say!("\nlayout {n}:\n{}", plan::explain(l, &cluster).trim_end()),
            (None, Some(_)) => {
                say!("\n--explain {n}: no layout fits, so none is timed; the least memory any needs is above")
            }
            (None, None) => anyhow::bail!("--explain {n}: the table has layouts 1 to {}", fit.len()),
        }
    }
    if let Some(path) = &a.json {
        let text = plan::json(&base, layouts, &cluster, &ask, short.as_ref(), &searched.dropped)?;
        ferrotron::files::write_atomically(path, text.as_bytes()).context("--json")?;
    }
    Ok(Exit::Done)
}

fn generate_command(
    GenerateArgs { model, prompt, tokens, max_new_tokens, temperature, top_k, seed, tokenizer, device, dtype }: GenerateArgs,
) -> Result<Exit> {
    let sampling = ferrotron::model::sampling::Sampling { max_new_tokens, temperature, top_k, seed };
    let dtype = if dtype == "f32" { ferrotron::ops::DType::F32 } else { ferrotron::ops::DType::Bf16 };
    let gpu = (device == "cuda").then_some(dtype);
    generate::run(&model, (prompt.as_deref(), tokens.as_deref()), &sampling, tokenizer.as_deref(), gpu)?;

    Ok(Exit::Done)
}

fn tokenizer_command(
    TokenizerArgs { source, vocab_size, text_column, out }: TokenizerArgs,
    paths: &[PathArg],
) -> Result<Exit> {
    let plain_path = !source.contains(':') && source != "synthetic";
    let source = if plain_path { format!("text:{source}") } else { source };
    // the source as a run's config would name it: its shards are then inputs no output may overwrite
    let mut cfg = Config::load(None, &[])?;
    (cfg.data.source, cfg.data.text_column) = (source, text_column);
    let _claims = commands::claim_outputs(paths, Some(&cfg))?;
    ferrotron::commands::tokenizer::run(&cfg.data, vocab_size, &out)?;

    Ok(Exit::Done)
}

/// `bench --op attention`: one op alone.
fn bench_op(
    BenchArgs { config, sets, steps, warmup, json, against, profile, peak_tflops, .. }: BenchArgs,
    paths: &[PathArg],
) -> Result<Exit> {
    if profile || against.is_some() || peak_tflops.is_some() {
        anyhow::bail!("--op attention times the attention kernels alone: leave out --profile, --against and --peak-tflops (they are for a training step)");
    }
    let cfg = commands::load_config(config.as_deref(), &sets)?;
    let _claims = commands::claim_outputs(paths, Some(&cfg))?;
    let report = ferrotron::commands::bench_attention::bench_attention(&cfg, warmup, steps)?;
    say!("{}", ferrotron::commands::bench_attention::attention_table(&report).trim_end());
    let text = serde_json::to_string(&report)?;
    say!("json: {text}");
    if let Some(path) = json {
        ferrotron::files::write_atomically(&path, text.as_bytes()).context("--json")?;
    }

    Ok(Exit::Done)
}

/// `bench`: a training step.
fn bench_step(
    BenchArgs { config, sets, steps, warmup, peak_tflops, json, against, profile, .. }: BenchArgs,
    paths: &[PathArg],
) -> Result<Exit> {
    let cfg = commands::load_config(config.as_deref(), &sets)?;
    let other = against.as_deref().map(bench::Other::read).transpose()?; // a bad file fails before the run
    let _claims = commands::claim_outputs(paths, Some(&cfg))?;
    let report = bench::bench(&cfg, warmup, steps, peak_tflops, profile)?;
    say!("{}", bench::table(&report).trim_end());
    if profile {
        // every rank's kernels are timed: per step of one rank, on average
        say!("\n{}", ferrotron::cuda::profile::table(&report.profile, steps * report.ranks, report.step_ms).trim_end());
    }
    if let Some(other) = other {
        say!("{}", other.compare(&report));
    }
    let text = serde_json::to_string(&report)?;
    say!("json: {text}");
    if let Some(path) = json {
        ferrotron::files::write_atomically(&path, text.as_bytes()).context("--json")?;
    }

    Ok(Exit::Done)
}

/// How a command ended, besides an error.
enum Exit {
    Done,
    /// A signal stopped training after a checkpoint: exit 128 + its number, as shells expect.
    Signal(i32),
}

/// An error as one line, in the user's words: each cause of the chain joined by ": ", and an
/// operating system's own phrase ("Not a directory (os error 20)") said plainly, for whatever
/// file or flag the causes above it name.
fn in_words(e: &anyhow::Error) -> String {
    use std::io::ErrorKind::*;
    let plain = |c: &(dyn std::error::Error + 'static)| match c.downcast_ref::<std::io::Error>() {
        None => c.to_string(),
        Some(io) => match io.kind() {
            NotFound => "no such file or folder".into(),
            PermissionDenied => "permission denied (check its owner and mode)".into(),
            AlreadyExists => "a file is already there".into(),
            NotADirectory => "a part of the path is a file, not a folder".into(),
            IsADirectory => "it is a folder, not a file".into(),
            DirectoryNotEmpty => "the folder is not empty".into(),
            ReadOnlyFilesystem => "the file system is read-only".into(),
            StorageFull => "the disk is full".into(),
            _ if io.raw_os_error() == Some(libc::ENODEV) => {
                "not a file that can be read (a folder or a device?)".into()
            }
            _ => io.to_string().split(" (os error").next().unwrap_or_default().to_string(),
        },
    };
    e.chain().map(plain).collect::<Vec<_>>().join(": ")
}

fn main() -> ExitCode {
    ferrotron::train::memory::keep_freed_memory();
    // A GPU error inside an op unwinds its rank to the launcher, which ends the run with it as the
    // one error line; the default hook would print it first, with a backtrace note. Any other
    // panic is a bug, and keeps the default report (where it happened).
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info.payload().downcast_ref::<String>().map(String::as_str).unwrap_or("");
        if !message.starts_with(ferrotron::cuda::device::GPU_ERROR) {
            default_hook(info);
        }
    }));
    // One of several processes (mpirun, srun, torchrun): the first one speaks for the run.
    if !ferrotron::comm::wires::processes::leads() {
        ferrotron::files::SILENT.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    // Output goes through `say!`, which ignores a closed or full stdout: a reader that goes away
    // (`ferrotron train | head`) costs the output, never the run or its checkpoints.
    let command = commands::cli::command();
    let matches = command.clone().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let paths = match matches.subcommand() {
        Some((name, sub)) => command.find_subcommand(name).map_or(Vec::new(), |c| commands::cli::paths(c, sub)),
        None => Vec::new(),
    };
    let (code, ok) = match run(cli, &paths) {
        Ok(Exit::Done) => (ExitCode::SUCCESS, true),
        Ok(Exit::Signal(sig)) => (ExitCode::from((128 + sig) as u8), true), // stopped cleanly
        // a signal stopped work outside the training step (a read, the data, a wait): 128 + signal,
        // and the other processes, if any, stop too (as after an error)
        Err(e) if ferrotron::signals::interrupted(&e).is_some() => {
            let _ = writeln!(std::io::stderr(), "{e:#}");
            (ExitCode::from((128 + ferrotron::signals::interrupted(&e).unwrap_or(0)) as u8), false)
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {}", in_words(&e));
            (ExitCode::FAILURE, false)
        }
    };
    // the link to the other processes, if any: ended cleanly, or (MPI) the job aborted
    ferrotron::comm::wires::remote::end(ok);
    code
}
