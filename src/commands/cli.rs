//! # The command line, and the files each command reads and writes
//!
//! The flags of every command (`clap`'s derive). A flag that names a file or folder says what the
//! command does with it, in the type clap keeps: its help heading is `READS` or `WRITES`, and
//! its value hint says a file or a folder. `paths` reads them back from any parsed command line,
//! so the run's registry of inputs and outputs (`commands::claim_outputs`) is made from the
//! flags themselves: a new output flag is checked against every input the day it is added, and
//! `tests/paths.rs` fails on a path flag that declares neither.

use clap::{Args, Parser, Subcommand, ValueHint};
use std::path::PathBuf;

/// The command line as `main` parses it: the table below, with a value that starts with `-` and
/// is a number (`--steps -1`) taken as the flag's value, so it is refused naming the flag
/// (clap otherwise reads `-1` as a flag of its own: "unexpected argument '-1'", no flag named).
pub fn command() -> clap::Command {
    let numbers = |a: clap::Arg| match a.get_action().takes_values() {
        true => a.allow_negative_numbers(true),
        false => a,
    };
    <Cli as clap::CommandFactory>::command().mut_subcommands(move |s| s.mut_args(numbers))
}

/// The help heading of a flag naming a file or folder the command reads.
pub const READS: &str = "Files it reads";
/// The help heading of a flag naming a file or folder the command writes.
pub const WRITES: &str = "Files it writes";

#[derive(Parser)]
#[command(name = "ferrotron", version, about = "Educational from-scratch LLM pre-training")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Train a Llama from scratch (the built-in configs/tiny.toml unless --config is given).
    Train(TrainArgs),
    /// Run the single-rank baseline and parallel variants with the same seed and global batch;
    /// compare their loss curves.
    Converge(ConvergeArgs),
    /// Print every rank's coordinates and process groups for a dp × pp × cp × tp layout (and ep).
    Grid(GridArgs),
    /// Draw the pipeline schedules (AFAB, 1F1B, interleaved, ZB-H1, ZBV) as an SVG timeline and print their bubbles.
    Schedule(ScheduleArgs),
    /// Every rank's bytes of weights, gradients, optimizer state, activations and communication
    /// buffers for a layout (estimated from the shapes; --measure also trains two steps).
    Memory(MemoryArgs),
    /// Which layout for a model on a cluster: every dp × tp × pp × cp × ep, ZeRO stage, schedule,
    /// recomputation and micro-batch that fits, ranked by predicted tokens/s (nothing runs).
    Plan(PlanArgs),
    /// Mean next-token loss of a Hugging Face Llama checkpoint on a token file.
    Eval(EvalArgs),
    /// Sample from a model (a ferrotron checkpoint or a Hugging Face Llama folder) with a KV
    /// cache: greedy with --temperature 0, else drawn from the softmax over the top-k tokens.
    Generate(GenerateArgs),
    /// Learn a byte-level BPE tokenizer from a text source and write its tokenizer.json (for
    /// data.tokenizer, and loadable by transformers).
    Tokenizer(TokenizerArgs),
    /// Check the CUDA setup: libraries, driver, GPUs, then self-tests on GPU 0.
    Doctor,
    /// Measure a config: step time, tokens/s, MFU and peak memory (warm-up steps excluded);
    /// prints a table and the same as JSON.
    Bench(BenchArgs),
}

#[derive(Args)]
pub struct TrainArgs {
    /// A TOML config; keys it leaves out keep their configs/tiny.toml values.
    #[arg(long, help_heading = READS, value_hint = ValueHint::FilePath)]
    pub config: Option<PathBuf>,
    /// Override one key, e.g. --set train.steps=100 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Write one JSON object per step to this file.
    #[arg(long, value_name = "OUT.jsonl", help_heading = WRITES, value_hint = ValueHint::FilePath)]
    pub metrics: Option<PathBuf>,
    /// Write a Chrome trace (open in ui.perfetto.dev): every rank's forward, backward,
    /// all-reduce and optimizer spans.
    #[arg(long, value_name = "OUT.json", help_heading = WRITES, value_hint = ValueHint::FilePath)]
    pub trace: Option<PathBuf>,
    /// After training, draw the training loss, the held-out loss (with [validation]) and the
    /// learning rate against the step as an SVG.
    #[arg(long, value_name = "OUT.svg", help_heading = WRITES, value_hint = ValueHint::FilePath)]
    pub plot: Option<PathBuf>,
    /// Continue a run from a checkpoint folder, or `latest` (the newest in checkpoint.dir).
    #[arg(long, value_name = "DIR|latest", help_heading = READS, value_hint = ValueHint::DirPath)]
    pub resume: Option<PathBuf>,
    /// With --resume: continue although lr, schedule, batch or data differ from the
    /// checkpoint's run (they are named either way).
    #[arg(long, requires = "resume")]
    pub allow_changes: bool,
    /// After training, print each axis's calls, bytes and time per step, next to what the
    /// α–β model predicts on --link.
    #[arg(long)]
    pub comm_report: bool,
    /// The link the comm report's model assumes: nvlink (450 GB/s, 3 µs), pcie (25 GB/s,
    /// 10 µs) or ib (50 GB/s, 5 µs).
    #[arg(long, default_value = "nvlink", value_parser = ["nvlink", "pcie", "ib"], requires = "comm_report")]
    pub link: String,
    /// A mixture of experts: write every layer's routing (each row's experts, every step) into
    /// this folder, one file a rank, for --replay-routing.
    #[arg(long, value_name = "DIR", conflicts_with = "replay_routing", help_heading = WRITES, value_hint = ValueHint::DirPath)]
    pub record_routing: Option<PathBuf>,
    /// A mixture of experts: every row takes the experts a --record-routing run chose for it (a
    /// run of the same global batch, any layout); says how many choices that replaced.
    #[arg(long, value_name = "DIR", help_heading = READS, value_hint = ValueHint::DirPath)]
    pub replay_routing: Option<PathBuf>,
}

#[derive(Args)]
pub struct ConvergeArgs {
    #[arg(long, help_heading = READS, value_hint = ValueHint::FilePath)]
    pub config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Variants separated by `;`, settings by `,`: "dp=2;dp=4;dp=2,grad_accum_steps=2".
    #[arg(long)]
    pub variants: String,
    /// Steps per run (default: the config's train.steps).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Largest per-step loss difference that passes while rounding has not been amplified
    /// (afterwards a band measured from a harmless change of the baseline: see the output).
    #[arg(long, default_value_t = 1e-4, allow_negative_numbers = true)]
    pub tol: f32,
    /// Folder for losses.csv and losses.svg.
    #[arg(long, default_value = "converge_out", help_heading = WRITES, value_hint = ValueHint::DirPath)]
    pub out: PathBuf,
}

#[derive(Args)]
pub struct GridArgs {
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    #[arg(long, default_value_t = 1)]
    pub cp: usize,
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Expert-parallel ranks, carved out of the dp×cp ranks.
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Hybrid sharding: the dp replicas of each ZeRO shard group (0: all of dp).
    #[arg(long, default_value_t = 0)]
    pub dp_shard: usize,
}

#[derive(Args)]
pub struct ScheduleArgs {
    #[arg(long, default_value_t = 4)]
    pub pp: usize,
    #[arg(long, default_value_t = 8)]
    pub microbatches: usize,
    /// afab, 1f1b, interleaved, zb-h1, zbv, both (afab and 1f1b), zero-bubble (1f1b, zb-h1, zbv) or all.
    #[arg(long, default_value = "both")]
    pub schedule: String,
    /// Model chunks per stage for the interleaved schedule.
    #[arg(long = "virtual", default_value_t = 2)]
    pub r#virtual: usize,
    /// Draw the last step of a real run instead, from its `train --trace` file.
    #[arg(long, value_name = "TRACE.json", help_heading = READS, value_hint = ValueHint::FilePath)]
    pub trace: Option<PathBuf>,
    #[arg(long, default_value = "schedule.svg", help_heading = WRITES, value_hint = ValueHint::FilePath)]
    pub out: PathBuf,
}

#[derive(Args)]
pub struct MemoryArgs {
    #[arg(long, help_heading = READS, value_hint = ValueHint::FilePath)]
    pub config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Train two steps and add each rank's measured peak of live tensor bytes.
    #[arg(long)]
    pub measure: bool,
    /// Also write {"ranks": [...]} to this file.
    #[arg(long, value_name = "OUT.json", help_heading = WRITES, value_hint = ValueHint::FilePath)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct PlanArgs {
    /// The model: a ferrotron TOML or a Hugging Face config.json (default: the built-in config).
    #[arg(long, help_heading = READS, value_hint = ValueHint::FilePath)]
    pub config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// How many GPUs (or, with --gpu cpu, ranks as threads on this machine).
    #[arg(long, default_value_t = 8)]
    pub gpus: usize,
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// h100, h200, b200, a100, l40s, … (the device table), or cpu: this machine as
    /// `bench --calibrate` measured it.
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// Tokens a step over every rank (default: the config's micro_batch_size × grad_accum_steps
    /// × dp × seq_len).
    #[arg(long)]
    pub global_batch_tokens: Option<usize>,
    /// Default: the config's train.seq_len.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// bf16 or fp8.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Only what ferrotron's GPU backend runs today: leave out the pipeline schedules not yet
    /// paired for NCCL (interleaved, zb-h1, zbv), otherwise priced and marked `*`.
    #[arg(long)]
    pub runnable: bool,
    /// Also list the candidates the search set aside, counted by reason (the config check that
    /// refused them, the search's bounds, a batch that does not divide).
    #[arg(long)]
    pub explain_drops: bool,
    /// The GPU's memory, GiB (default: the table's).
    #[arg(long)]
    pub memory_gib: Option<f64>,
    /// NVLink inside a node, GB/s a direction (default: the table's).
    #[arg(long)]
    pub node_gb_s: Option<f64>,
    /// The network across nodes, GB/s a direction a GPU (default: the table's).
    #[arg(long)]
    pub net_gb_s: Option<f64>,
    /// Rows of the table (the fastest layouts).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print layout number N of the table in full.
    #[arg(long, value_name = "N", conflicts_with = "fixed")]
    pub explain: Option<usize>,
    /// Price only the layout the config and --set give (dp: what is left of the GPUs), in full.
    #[arg(long)]
    pub fixed: bool,
    /// Also write every layout tried, with its config keys and prediction, to this file.
    #[arg(long, value_name = "OUT.json", help_heading = WRITES, value_hint = ValueHint::FilePath)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct EvalArgs {
    /// Folder with config.json and model.safetensors (or a sharded index).
    #[arg(long, help_heading = READS, value_hint = ValueHint::DirPath)]
    pub model: PathBuf,
    /// Whitespace-separated token ids, one sequence per line.
    #[arg(long, help_heading = READS, value_hint = ValueHint::FilePath)]
    pub tokens: PathBuf,
}

#[derive(Args)]
pub struct GenerateArgs {
    /// Folder with config.json and the safetensors (a `train` checkpoint is one).
    #[arg(long, help_heading = READS, value_hint = ValueHint::DirPath)]
    pub model: PathBuf,
    /// The text to continue (needs a tokenizer: the folder's tokenizer.json, or --tokenizer).
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    pub prompt: Option<String>,
    /// The prompt as token ids, e.g. "5 17 42".
    #[arg(long)]
    pub tokens: Option<String>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// 0: greedy (the most likely token each time); higher: more varied.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Draw among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 50)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A tokenizer.json, `bytes`, or `hub:ORG/NAME` (default: the folder's tokenizer.json).
    #[arg(long, help_heading = READS, value_hint = ValueHint::FilePath)]
    pub tokenizer: Option<String>,
    /// Where the model runs: cpu or cuda (GPU 0).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// On a GPU: bf16 or f32 (the CPU computes in f32).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    pub dtype: String,
}

#[derive(Args)]
pub struct TokenizerArgs {
    /// What to learn from, as data.source takes it: text:PATH (a .txt, .jsonl or .parquet file, a
    /// folder or a glob of them) or hub:ORG/NAME/FILE.
    #[arg(value_name = "SOURCE")]
    pub source: String,
    /// Tokens in the vocabulary: the 256 bytes, <|endoftext|> and the merges learned (257 or more).
    #[arg(long)]
    pub vocab_size: usize,
    /// The JSON field or parquet column holding each document.
    #[arg(long, default_value = "text")]
    pub text_column: String,
    /// Where the tokenizer goes.
    #[arg(long, default_value = "tokenizer.json", help_heading = WRITES, value_hint = ValueHint::FilePath)]
    pub out: PathBuf,
}

#[derive(Args)]
pub struct BenchArgs {
    #[arg(long, help_heading = READS, value_hint = ValueHint::FilePath)]
    pub config: Option<PathBuf>,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Steps measured, after the warm-up.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Steps run first and not measured (kernel loading, allocator warm-up).
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Peak TFLOP/s of one device, for the MFU (default: by GPU name; none on a CPU).
    #[arg(long, allow_negative_numbers = true)]
    pub peak_tflops: Option<f64>,
    /// Also write the JSON to this file.
    #[arg(long, value_name = "OUT.json", help_heading = WRITES, value_hint = ValueHint::FilePath)]
    pub json: Option<PathBuf>,
    /// The JSON of another run of the same config (`benches/torch_reference.py --json`, or
    /// an earlier `bench --json`): print the tokens/s ratio against it.
    #[arg(long, value_name = "OTHER.json", help_heading = READS, value_hint = ValueHint::FilePath)]
    pub against: Option<PathBuf>,
    /// Time every GPU kernel and GEMM of the measured steps and print where the step's time
    /// goes (GPU only; events on the stream, a little slower than a plain run).
    #[arg(long)]
    pub profile: bool,
    /// Measure one op alone instead of a training step: `attention` times the attention
    /// kernels (forward, forward+backward) on the config's shapes (GPU only).
    #[arg(long, value_name = "OP", value_parser = ["attention"])]
    pub op: Option<String>,
    /// Measure the rates `plan` predicts with and record them in the cache folder's
    /// calibration.json: on the CPU (`device.kind = "cpu"`) what `plan --gpu cpu` uses (GEMMs,
    /// attention, the small ops on every thread and on one, the wire between ranks); on a GPU
    /// (`device.kind = "cuda"`) that GPU's kernels at the config's shapes in its dtype and NCCL's
    /// wire between two GPUs, which `plan --gpu KEY --dtype D` of that kind then uses.
    #[arg(long, conflicts_with_all = ["op", "profile", "against"])]
    pub calibrate: bool,
}

/// A file or folder a command line names: its flag, its path, whether the command writes it
/// (else reads it), and whether it is a folder.
pub struct PathArg {
    pub flag: String,
    pub path: PathBuf,
    pub writes: bool,
    pub folder: bool,
}

/// Every path given on the command line `matches` of (sub)command `command`, with what the
/// command does with it, from the flags' headings and hints.
pub fn paths(command: &clap::Command, matches: &clap::ArgMatches) -> Vec<PathArg> {
    let mut found = Vec::new();
    for arg in command.get_arguments() {
        let writes = match arg.get_help_heading() {
            Some(READS) => false,
            Some(WRITES) => true,
            _ => continue,
        };
        let given = matches.get_raw(arg.get_id().as_str()).into_iter().flatten();
        let flag = format!("--{}", arg.get_long().unwrap_or(arg.get_id().as_str()));
        let folder = arg.get_value_hint() == ValueHint::DirPath;
        found.extend(given.map(|p| PathArg { flag: flag.clone(), path: PathBuf::from(p), writes, folder }));
    }
    found
}
