//! The `ferrotron` command line: `train`, `grid`, `eval` and `doctor`.

use anyhow::Result;
use clap::{Parser, Subcommand};
use ferrotron::process_grid::Grid;
use ferrotron::{checkpoint, config::Config, doctor, eval, launch, train};
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
    Train {
        /// A TOML config; keys it leaves out keep their configs/tiny.toml values.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override one key, e.g. --set train.steps=100 (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        sets: Vec<String>,
        /// Write one JSON object per step to this file.
        #[arg(long, value_name = "OUT.jsonl")]
        metrics: Option<PathBuf>,
    },
    /// Print every rank's coordinates and process groups for a dp × pp × cp × tp layout.
    Grid {
        #[arg(long, default_value_t = 1)]
        dp: usize,
        #[arg(long, default_value_t = 1)]
        pp: usize,
        #[arg(long, default_value_t = 1)]
        cp: usize,
        #[arg(long, default_value_t = 1)]
        tp: usize,
    },
    /// Mean next-token loss of a Hugging Face Llama checkpoint on a token file.
    Eval {
        /// Folder with config.json and model.safetensors (or a sharded index).
        #[arg(long)]
        model: PathBuf,
        /// Whitespace-separated token ids, one sequence per line.
        #[arg(long)]
        tokens: PathBuf,
    },
    /// Check the CUDA setup: libraries, driver, GPUs, then self-tests on GPU 0.
    Doctor,
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train { config, sets, metrics } => {
            let cfg = Config::load(config.as_deref(), &sets)?;
            let s = train::train(&cfg, metrics.as_deref(), false)?;
            let floor = match s.floor {
                Some(f) => format!("{f:.4} (gap {:.4})", s.final_loss() as f64 - f),
                None => "unknown".into(),
            };
            println!(
                "done: {} steps in {:.1}s | final loss {:.4} (mean of the last tenth) | entropy floor {floor}",
                s.losses.len(),
                s.wall_s,
                s.final_loss()
            );
        }
        Command::Grid { dp, pp, cp, tp } => {
            let grid = Grid::new(dp, pp, cp, tp)?;
            print!("{}", grid.table());
            launch::check_groups(grid)?;
            println!(
                "checked: {} rank threads each all-gathered their rank number over each of their groups and got the members above",
                grid.world_size()
            );
        }
        Command::Eval { model, tokens } => {
            let mut m = checkpoint::load_hf(&model)?;
            let seqs = eval::read_tokens(&tokens, m.cfg.vocab_size)?;
            println!("loss: {:.6}", eval::mean_loss(&mut m, &seqs));
        }
        Command::Doctor => doctor::doctor()?,
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
