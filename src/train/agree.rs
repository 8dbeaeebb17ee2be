//! # Processes of one run agree on its settings
//!
//! Several processes (`comm/wires/processes.rs`) train as one run only if they were started with the
//! same settings: two replicas with different learning rates would drift apart while every
//! collective still succeeds, and a process with fewer steps would leave the others waiting. So
//! before the first step, rank 0 sends its settings to every rank, and each compares:
//!
//! ```text
//! rank 0 ── broadcast(length), broadcast(bytes) ──▶ every rank: "section.key = value" lines
//! a rank whose own lines differ fails, naming each key with both values; the run's abort
//! carries that error to every other process, so all of them stop with it before step 0
//! ```
//! Paths that may differ from one machine to the next (`checkpoint.dir`, `data.cache_dir`,
//! `model.init_from`) are not compared; what they hold is: the text's fingerprint (its files'
//! content, so one path holding two texts on two machines is caught) and the checkpoint each
//! process resumed (its run and step).

use crate::comm::Group;
use crate::config::{differing, Config, Settings};
use anyhow::{bail, Result};

/// Not compared: paths that may differ from one machine to the next.
const PER_MACHINE: [&str; 3] = ["checkpoint.dir", "data.cache_dir", "model.init_from"];

/// Every rank of `world` gets rank 0's settings and `facts` (what the run read: its data, its
/// checkpoint), and fails if its own differ.
pub(super) fn settings(world: &Group, cfg: &Config, facts: Settings) -> Result<()> {
    let mut mine = cfg.settings();
    mine.retain(|k, _| !PER_MACHINE.contains(&k.as_str()));
    mine.extend(facts);
    let text: String = mine.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
    let mut len = [text.len() as f32]; // exact: a config is far under 2²⁴ bytes
    world.broadcast(&mut len, 0)?;
    let mut bytes: Vec<f32> = match world.index() {
        0 => text.bytes().map(f32::from).collect(),
        _ => vec![0.0; len[0] as usize],
    };
    world.broadcast(&mut bytes, 0)?;
    let text = String::from_utf8_lossy(&bytes.iter().map(|&b| b as u8).collect::<Vec<u8>>()).into_owned();
    let theirs: Settings =
        text.lines().filter_map(|l| l.split_once(" = ")).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let me = crate::comm::wires::processes::current()?.map_or(0, |p| p.index);
    let differences: Vec<String> = differing(&mine, &theirs)
        .into_iter()
        .map(|(k, here, there)| format!("{k} = {here} in process {me}, {there} in process 0"))
        .collect();
    // the rank that differs fails; the others learn it from the run's abort, naming this error
    if !differences.is_empty() {
        bail!(
            "the processes of this run were started with different settings: {}; start every process with the same config, --set, data and --resume",
            differences.join(", ")
        );
    }
    Ok(())
}
