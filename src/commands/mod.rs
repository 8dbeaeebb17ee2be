//! # The commands around training
//!
//! `converge` (does a layout reproduce the one-rank loss curve?), `bench` (tokens/s, MFU,
//! memory; `--op attention`: the attention kernels alone), `memory` (what every rank holds,
//! estimated and measured), `doctor` (is this machine ready?), `eval` (a Hugging Face model's
//! loss), `generate` (sampling from a model, with the KV cache), `schedule` (the pipeline picture), `plot` (the SVG charts they draw) and `train` (the
//! command around the training loop). `main.rs`
//! parses the CLI and calls these; the training loop itself is `train.rs` (its step `train/step.rs`).

pub mod bench;
pub mod bench_attention;
pub mod converge;
pub mod doctor;
pub mod eval;
pub mod generate;
pub mod memory;
pub mod plot;
pub mod schedule;
pub mod self_check;
pub mod train;

/// Checks a command's outputs (`files::check_outputs`) and claims them for this run
/// (`files::claim`): in a multi-process run the first process writes them.
pub fn claim_outputs(outputs: &[(&str, Option<&std::path::Path>)]) -> anyhow::Result<crate::files::Claims> {
    let checked = crate::files::check_outputs(outputs)?;
    crate::files::claim(&checked, crate::comm::wires::processes::leads())
}
