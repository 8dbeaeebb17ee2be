//! The `ferrotron` command line: `train`, `converge`, `grid`, `schedule`, `memory`, `eval`,
//! `generate`, `doctor` and `bench`.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use ferrotron::checkpoint::hf;
use ferrotron::comm::cost::Link;
use ferrotron::comm::launcher;
use ferrotron::comm::process_grid::Grid;
use ferrotron::commands::{self, bench, converge, doctor, eval, generate, memory, schedule};
use ferrotron::config::Config;
use ferrotron::config::PpSchedule;
use ferrotron::model::routing_tape::{self, TapeMode};
use ferrotron::say;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "ferrotron", version, about = "Educational from-scratch LLM pre-training")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a Llama from scratch (the built-in configs/tiny.toml unless --config is given).
    Train(TrainArgs),
    /// Run the single-rank baseline and parallel variants with the same seed and global batch;
    /// compare their loss curves.
    Converge(ConvergeArgs),
    /// Print every rank's coordinates and process groups for a dp × pp × cp × tp layout (and ep).
    Grid(GridArgs),
    /// Draw the pipeline schedules (AFAB, 1F1B, interleaved) as an SVG timeline and print their bubbles.
    Schedule(ScheduleArgs),
    /// Every rank's bytes of weights, gradients, optimizer state, activations and communication
    /// buffers for a layout (estimated from the shapes; --measure also trains two steps).
    Memory(MemoryArgs),
    /// Mean next-token loss of a Hugging Face Llama checkpoint on a token file.
    Eval(EvalArgs),
    /// Sample from a model (a ferrotron checkpoint or a Hugging Face Llama folder) with a KV
    /// cache: greedy with --temperature 0, else drawn from the softmax over the top-k tokens.
    Generate(GenerateArgs),
    /// Check the CUDA setup: libraries, driver, GPUs, then self-tests on GPU 0.
    Doctor,
    /// Measure a config: step time, tokens/s, MFU and peak memory (warm-up steps excluded);
    /// prints a table and the same as JSON.
    Bench(BenchArgs),
}

#[derive(Args)]
struct TrainArgs {
    /// A TOML config; keys it leaves out keep their configs/tiny.toml values.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override one key, e.g. --set train.steps=100 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Write one JSON object per step to this file.
    #[arg(long, value_name = "OUT.jsonl")]
    metrics: Option<PathBuf>,
    /// Write a Chrome trace (open in ui.perfetto.dev): every rank's forward, backward,
    /// all-reduce and optimizer spans.
    #[arg(long, value_name = "OUT.json")]
    trace: Option<PathBuf>,
    /// After training, draw the training loss, the held-out loss (with [validation]) and the
    /// learning rate against the step as an SVG.
    #[arg(long, value_name = "OUT.svg")]
    plot: Option<PathBuf>,
    /// Continue a run from a checkpoint folder, or `latest` (the newest in checkpoint.dir).
    #[arg(long, value_name = "DIR|latest")]
    resume: Option<PathBuf>,
    /// With --resume: continue although lr, schedule, batch or data differ from the
    /// checkpoint's run (they are named either way).
    #[arg(long, requires = "resume")]
    allow_changes: bool,
    /// After training, print each axis's calls, bytes and time per step, next to what the
    /// α–β model predicts on --link.
    #[arg(long)]
    comm_report: bool,
    /// The link the comm report's model assumes: nvlink (450 GB/s, 3 µs), pcie (25 GB/s,
    /// 10 µs) or ib (50 GB/s, 5 µs).
    #[arg(long, default_value = "nvlink", value_parser = ["nvlink", "pcie", "ib"], requires = "comm_report")]
    link: String,
    /// A mixture of experts: write every layer's routing (each row's experts, every step) into
    /// this folder, one file a rank, for --replay-routing.
    #[arg(long, value_name = "DIR", conflicts_with = "replay_routing")]
    record_routing: Option<PathBuf>,
    /// A mixture of experts: every row takes the experts a --record-routing run chose for it (a
    /// run of the same global batch, any layout); says how many choices that replaced.
    #[arg(long, value_name = "DIR")]
    replay_routing: Option<PathBuf>,
}

#[derive(Args)]
struct ConvergeArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Variants separated by `;`, settings by `,`: "dp=2;dp=4;dp=2,grad_accum_steps=2".
    #[arg(long)]
    variants: String,
    /// Steps per run (default: the config's train.steps).
    #[arg(long)]
    steps: Option<usize>,
    /// Largest per-step loss difference that passes while rounding has not been amplified
    /// (afterwards a band measured from a harmless change of the baseline: see the output).
    #[arg(long, default_value_t = 1e-4, allow_negative_numbers = true)]
    tol: f32,
    /// Folder for losses.csv and losses.svg.
    #[arg(long, default_value = "converge_out")]
    out: PathBuf,
}

#[derive(Args)]
struct GridArgs {
    #[arg(long, default_value_t = 1)]
    dp: usize,
    #[arg(long, default_value_t = 1)]
    pp: usize,
    #[arg(long, default_value_t = 1)]
    cp: usize,
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Expert-parallel ranks, carved out of the dp×cp ranks.
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Hybrid sharding: the dp replicas of each ZeRO shard group (0: all of dp).
    #[arg(long, default_value_t = 0)]
    dp_shard: usize,
}

#[derive(Args)]
struct ScheduleArgs {
    #[arg(long, default_value_t = 4)]
    pp: usize,
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// afab, 1f1b, interleaved, zb-h1, zbv, both (afab and 1f1b), zero-bubble (1f1b, zb-h1, zbv) or all.
    #[arg(long, default_value = "both")]
    schedule: String,
    /// Model chunks per stage for the interleaved schedule.
    #[arg(long = "virtual", default_value_t = 2)]
    r#virtual: usize,
    /// Draw the last step of a real run instead, from its `train --trace` file.
    #[arg(long, value_name = "TRACE.json")]
    trace: Option<PathBuf>,
    #[arg(long, default_value = "schedule.svg")]
    out: PathBuf,
}

#[derive(Args)]
struct MemoryArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Train two steps and add each rank's measured peak of live tensor bytes.
    #[arg(long)]
    measure: bool,
    /// Also write {"ranks": [...]} to this file.
    #[arg(long, value_name = "OUT.json")]
    json: Option<PathBuf>,
}

#[derive(Args)]
struct EvalArgs {
    /// Folder with config.json and model.safetensors (or a sharded index).
    #[arg(long)]
    model: PathBuf,
    /// Whitespace-separated token ids, one sequence per line.
    #[arg(long)]
    tokens: PathBuf,
}

#[derive(Args)]
struct GenerateArgs {
    /// Folder with config.json and the safetensors (a `train` checkpoint is one).
    #[arg(long)]
    model: PathBuf,
    /// The text to continue (needs a tokenizer: the folder's tokenizer.json, or --tokenizer).
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    prompt: Option<String>,
    /// The prompt as token ids, e.g. "5 17 42".
    #[arg(long)]
    tokens: Option<String>,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0: greedy (the most likely token each time); higher: more varied.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Draw among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 50)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A tokenizer.json, `bytes`, or `hub:ORG/NAME` (default: the folder's tokenizer.json).
    #[arg(long)]
    tokenizer: Option<String>,
    /// Where the model runs: cpu or cuda (GPU 0).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// On a GPU: bf16 or f32 (the CPU computes in f32).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    dtype: String,
}

#[derive(Args)]
struct BenchArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    sets: Vec<String>,
    /// Steps measured, after the warm-up.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Steps run first and not measured (kernel loading, allocator warm-up).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Peak TFLOP/s of one device, for the MFU (default: by GPU name; none on a CPU).
    #[arg(long, allow_negative_numbers = true)]
    peak_tflops: Option<f64>,
    /// Also write the JSON to this file.
    #[arg(long, value_name = "OUT.json")]
    json: Option<PathBuf>,
    /// The JSON of another run of the same config (`benches/torch_reference.py --json`, or
    /// an earlier `bench --json`): print the tokens/s ratio against it.
    #[arg(long, value_name = "OTHER.json")]
    against: Option<PathBuf>,
    /// Time every GPU kernel and GEMM of the measured steps and print where the step's time
    /// goes (GPU only; events on the stream, a little slower than a plain run).
    #[arg(long)]
    profile: bool,
    /// Measure one op alone instead of a training step: `attention` times the attention
    /// kernels (forward, forward+backward) on the config's shapes (GPU only).
    #[arg(long, value_name = "OP", value_parser = ["attention"])]
    op: Option<String>,
}

/// Each command is a function below.
fn run(cli: Cli) -> Result<Exit> {
    match cli.command {
        Command::Train(a) => train_command(a),
        Command::Converge(a) => converge_command(a),
        Command::Schedule(a) => schedule_command(a),
        Command::Grid(a) => grid_command(a),
        Command::Eval(a) => eval_command(a),
        Command::Memory(a) => memory_command(a),
        Command::Generate(a) => generate_command(a),
        Command::Doctor => doctor::doctor().map(|_| Exit::Done),
        Command::Bench(a) if a.op.is_some() => bench_op(a),
        Command::Bench(a) => bench_step(a),
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
) -> Result<Exit> {
    let cfg = Config::load(config.as_deref(), &sets)?;
    // before, not after, training: each output writable, and no two on one file
    let outputs = [("--metrics", metrics.as_deref()), ("--trace", trace.as_deref()), ("--plot", plot.as_deref())];
    // and none onto what the run reads (its config, data, checkpoints, the model it starts from)
    // (a routing tape's folder may hold other files: its tapes are what is read)
    let tapes = replay_routing.as_deref().and_then(|dir| routing_tape::tapes(dir).ok()).unwrap_or_default();
    let mut reads = vec![("--resume", resume.as_deref())];
    reads.extend(tapes.iter().map(|t| ("--replay-routing", Some(t.as_path()))));
    let _claims = commands::claim_outputs(&outputs, &commands::inputs(&reads, Some((&cfg, config.as_deref()))))?; // held until the run ends
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

fn converge_command(ConvergeArgs { config, mut sets, variants, steps, tol, out }: ConvergeArgs) -> Result<Exit> {
    let variants = converge::parse_variants(&variants)?;
    converge::check_tol(tol)?;
    converge::plan(config.as_deref(), &sets, &variants)?; // every refusal before --out is made
    ferrotron::files::check_folder_writable(&out).context("--out")?;
    let real = out.canonicalize().with_context(|| format!("--out {}", out.display()))?;
    let out_folder = ferrotron::files::Output { flag: "--out", path: &out, real };
    let _claim = ferrotron::files::claim(&[out_folder], ferrotron::comm::wires::processes::leads())?;
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
    let reads = commands::inputs(&[("--trace", trace.as_deref())], None);
    let _claims = commands::claim_outputs(&[("--out", Some(&out))], &reads)?;
    let timelines = match &trace {
        Some(path) => vec![schedule::from_trace(path)?],
        None => {
            let play = |k| schedule::simulate(k, pp, microbatches, r#virtual);
            kinds.into_iter().map(play).collect::<Result<Vec<_>>>()?
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

fn memory_command(MemoryArgs { config, sets, measure, json }: MemoryArgs) -> Result<Exit> {
    let cfg = Config::load(config.as_deref(), &sets)?;
    let reads = commands::inputs(&[], Some((&cfg, config.as_deref())));
    let _claims = commands::claim_outputs(&[("--json", json.as_deref())], &reads)?;
    let ranks = memory::memory(&cfg, measure)?;
    say!("{}", memory::table(&cfg, &ranks).trim_end());
    if let Some(path) = &json {
        ferrotron::files::write_atomically(path, memory::json(&ranks)?.as_bytes()).context("--json")?;
    }

    Ok(Exit::Done)
}

fn generate_command(
    GenerateArgs { model, prompt, tokens, max_new_tokens, temperature, top_k, seed, tokenizer, device, dtype }: GenerateArgs,
) -> Result<Exit> {
    let sampling = generate::Sampling { max_new_tokens, temperature, top_k, seed };
    let dtype = if dtype == "f32" { ferrotron::ops::DType::F32 } else { ferrotron::ops::DType::Bf16 };
    let gpu = (device == "cuda").then_some(dtype);
    generate::run(&model, (prompt.as_deref(), tokens.as_deref()), &sampling, tokenizer.as_deref(), gpu)?;

    Ok(Exit::Done)
}

/// `bench --op attention`: one op alone.
fn bench_op(
    BenchArgs { config, sets, steps, warmup, json, against, profile, peak_tflops, .. }: BenchArgs,
) -> Result<Exit> {
    if profile || against.is_some() || peak_tflops.is_some() {
        anyhow::bail!("--op attention times the attention kernels alone: leave out --profile, --against and --peak-tflops (they are for a training step)");
    }
    let cfg = Config::load(config.as_deref(), &sets)?;
    let reads = commands::inputs(&[], Some((&cfg, config.as_deref())));
    let _claims = commands::claim_outputs(&[("--json", json.as_deref())], &reads)?;
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
) -> Result<Exit> {
    let cfg = Config::load(config.as_deref(), &sets)?;
    let other = against.as_deref().map(bench::Other::read).transpose()?; // a bad file fails before the run
    let reads = commands::inputs(&[("--against", against.as_deref())], Some((&cfg, config.as_deref())));
    let _claims = commands::claim_outputs(&[("--json", json.as_deref())], &reads)?;
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
    let (code, ok) = match run(Cli::parse()) {
        Ok(Exit::Done) => (ExitCode::SUCCESS, true),
        Ok(Exit::Signal(sig)) => (ExitCode::from((128 + sig) as u8), true), // stopped cleanly
        // a signal stopped work outside the training step (a read, the data, a wait): 128 + signal,
        // and the other processes, if any, stop too (as after an error)
        Err(e) if ferrotron::signals::interrupted(&e).is_some() => {
            let _ = writeln!(std::io::stderr(), "{e:#}");
            (ExitCode::from((128 + ferrotron::signals::interrupted(&e).unwrap_or(0)) as u8), false)
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            (ExitCode::FAILURE, false)
        }
    };
    // the link to the other processes, if any: ended cleanly, or (MPI) the job aborted
    ferrotron::comm::wires::remote::end(ok);
    code
}
