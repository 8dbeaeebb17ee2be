//! # Processes of one run agree on its settings
//!
//! Several processes (`comm/processes.rs`) train as one run only if they were started with the
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
//! `model.init_from`) are not compared.

use crate::comm::Group;
use crate::config::Config;
use anyhow::{bail, Result};
use std::collections::BTreeMap;

/// Every rank of `world` gets rank 0's settings, and fails if its own differ.
pub(super) fn settings(world: &Group, cfg: &Config) -> Result<()> {
    let mine = cfg.shaping_settings();
    let text = mine.join("\n");
    let mut len = [text.len() as f32]; // exact: a config is far under 2²⁴ bytes
    world.broadcast(&mut len, 0)?;
    let mut bytes: Vec<f32> = match world.index() {
        0 => text.bytes().map(f32::from).collect(),
        _ => vec![0.0; len[0] as usize],
    };
    world.broadcast(&mut bytes, 0)?;
    let theirs = String::from_utf8_lossy(&bytes.iter().map(|&b| b as u8).collect::<Vec<u8>>()).into_owned();
    let me = crate::comm::processes::current()?.map_or(0, |p| p.index);
    let differences = compare(&mine, &theirs, me);
    // the rank that differs fails; the others learn it from the run's abort, naming this error
    if !differences.is_empty() {
        bail!(
            "the processes of this run were started with different settings: {}; start every process with the same config and --set",
            differences.join(", ")
        );
    }
    Ok(())
}

/// `key = here in process me, there in process 0` for each key whose values differ.
fn compare(mine: &[String], theirs: &str, me: usize) -> Vec<String> {
    let split = |l: &str| l.split_once(" = ").map(|(k, v)| (k.to_string(), v.to_string()));
    let here: BTreeMap<String, String> = mine.iter().filter_map(|l| split(l)).collect();
    let there: BTreeMap<String, String> = theirs.lines().filter_map(split).collect();
    let keys: std::collections::BTreeSet<&String> = here.keys().chain(there.keys()).collect();
    let absent = "absent".to_string();
    keys.into_iter()
        .filter(|k| here.get(*k) != there.get(*k))
        .map(|k| {
            let (a, b) = (here.get(k).unwrap_or(&absent), there.get(k).unwrap_or(&absent));
            format!("{k} = {a} in process {me}, {b} in process 0")
        })
        .collect()
}
