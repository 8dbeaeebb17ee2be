//! # A run owns its checkpoint folder
//!
//! Checkpoints are only worth something if the newest one in `checkpoint.dir` really is this
//! run's latest state. Three rules make sure of it:
//!
//! ```text
//! dir/.lock              an advisory lock held for the whole run: a second run writing the same
//!                        folder at the same time is refused, with the holder's pid and start
//! trainer_state.json     every checkpoint carries its run's id (`run_id`); a resumed run keeps
//!   "run_id": "…"        the id of the checkpoint it continues
//! taking the folder      a new run refuses a folder that holds checkpoints; a resumed run
//!                        refuses another run's, and its own newer than the step it resumes
//! ```
//! Pruning (`checkpoint.keep`) then only ever deletes this run's older checkpoints. The lock is
//! the operating system's (`flock`): it goes away with the process, even after `kill -9`. What
//! a killed run left half-written (`step_NNNNNN.<run id>.tmp`) a later run removes only when it
//! holds nothing but checkpoint files (`FILES`): a look-alike folder holding anything else is
//! left where it is, with a note. A run id read from a file is one `new_run_id` makes or refused:
//! it names folders.

use crate::config::Config;
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};

/// A checkpoint folder taken by one run: locked, and holding no other run's checkpoints.
pub struct Folder {
    pub dir: PathBuf,
    pub run_id: String,
    _lock: File,
}

/// A complete checkpoint found in a folder.
pub struct Listed {
    pub step: usize,
    pub path: PathBuf,
    /// `None` when its `trainer_state.json` is missing or unreadable: nobody's checkpoint.
    pub run_id: Option<String>,
}

/// A fresh run id: the start time and process, unique enough to tell runs apart.
pub fn new_run_id() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{:x}-{:x}", now.as_nanos(), std::process::id())
}

/// Whether `id` has the form `new_run_id` makes: two hex numbers joined by `-` (at most 32 and 8
/// digits: nanoseconds and a pid). Nothing else may become part of a folder's name.
pub fn is_run_id(id: &str) -> bool {
    let hex = |s: &str, most: usize| !s.is_empty() && s.len() <= most && s.chars().all(|c| c.is_ascii_hexdigit());
    id.split_once('-').is_some_and(|(a, b)| hex(a, 32) && hex(b, 8))
}

/// The files a checkpoint folder holds (`checkpoint/save.rs` writes them, in this order).
pub const FILES: [&str; 4] = ["config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"];

impl Folder {
    /// Takes `dir` for run `run_id`, which starts fresh (`resumed_step = None`) or continues from
    /// a checkpoint at `resumed_step`: creates and locks the folder, clears what killed runs left
    /// half-written, and refuses it if it holds checkpoints this run must not replace or prune.
    pub fn take(dir: &Path, run_id: &str, resumed_step: Option<usize>) -> Result<Folder> {
        crate::files::check_folder_writable(dir).context("checkpoint.dir")?;
        let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let note = format!("pid {}, run {run_id}, started at unix time {}", std::process::id(), started.as_secs());
        let lock = match crate::files::hold(&dir.join(".lock"), &note).context("checkpoint.dir")? {
            Ok(lock) => lock,
            Err(holder) => bail!(
                "checkpoint.dir = {} is in use by another run ({holder}): wait for it to end, or choose another checkpoint.dir",
                dir.display()
            ),
        };
        remove_half_written(dir)?;
        refuse_others(dir, run_id, resumed_step)?;
        Ok(Folder { dir: dir.to_path_buf(), run_id: run_id.to_string(), _lock: lock })
    }

    /// What `take` would refuse, found without creating, locking or removing anything: for a run
    /// that saves only if a signal comes, so that a save bound to fail is known before step 0.
    pub fn check(dir: &Path, run_id: &str, resumed_step: Option<usize>) -> Result<()> {
        let existing = dir.ancestors().find(|a| a.as_os_str().is_empty() || a.exists()).unwrap_or(Path::new("/"));
        let existing = if existing.as_os_str().is_empty() { Path::new(".") } else { existing };
        if !existing.is_dir() {
            bail!("checkpoint.dir = {}: {} is not a folder", dir.display(), existing.display());
        }
        let probe = existing.join(format!(".write-probe.{run_id}"));
        std::fs::File::create(&probe)
            .and_then(|_| std::fs::remove_file(&probe))
            .with_context(|| format!("checkpoint.dir = {}: {} is not writable", dir.display(), existing.display()))?;
        if existing != dir {
            return Ok(()); // the folder is created when saving
        }
        if let Ok(lock) = crate::files::open_read(&dir.join(".lock"), "the checkpoint folder's lock") {
            if lock.try_lock_shared().is_err() {
                bail!("checkpoint.dir = {} is in use by another run", dir.display());
            }
        }
        refuse_others(dir, run_id, resumed_step)
    }

    /// Deletes this run's checkpoints beyond the newest `keep` (at least one is kept).
    pub fn prune(&self, keep: usize) -> Result<()> {
        let mine: Vec<Listed> =
            list(&self.dir)?.into_iter().filter(|l| l.run_id.as_deref() == Some(&self.run_id)).collect();
        for old in &mine[..mine.len().saturating_sub(keep.max(1))] {
            // renamed first: a run killed while deleting leaves a `.tmp` folder, not a checkpoint
            // with files missing that would pass for complete
            let mut doomed = old.path.clone().into_os_string();
            doomed.push(format!(".{}.tmp", self.run_id));
            std::fs::rename(&old.path, &doomed)
                .and_then(|_| std::fs::remove_dir_all(&doomed))
                .with_context(|| format!("cannot delete old checkpoint {}", old.path.display()))?;
        }
        Ok(())
    }
}

/// Refuses `dir` if it holds another run's checkpoints, or one of this run's newer than the step
/// it resumes from.
fn refuse_others(dir: &Path, run_id: &str, resumed_step: Option<usize>) -> Result<()> {
    let all = list(dir)?;
    let name = |l: &Listed| l.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if let Some(other) = all.iter().find(|l| l.run_id.as_deref() != Some(run_id)) {
        let whose = match &other.run_id {
            Some(id) => format!("run {id}"),
            None => "no run (its trainer_state.json is missing or unreadable)".into(),
        };
        let fix = match resumed_step {
            None => {
                "to continue that run, add --resume latest; otherwise choose another checkpoint.dir or move them away"
            }
            Some(_) => "choose another checkpoint.dir for this run, or move them away",
        };
        bail!(
            "checkpoint.dir = {} holds checkpoints of another run ({} is from {whose}): {fix}",
            dir.display(),
            name(other)
        );
    }
    if let (Some(step), Some(newer)) = (resumed_step, all.iter().rev().find(|l| Some(l.step) > resumed_step)) {
        bail!(
            "checkpoint.dir = {} holds a newer checkpoint of this run ({}) than the step resumed ({step}): continuing would replace it; resume with --resume latest, or move it away",
            dir.display(),
            name(newer)
        );
    }
    Ok(())
}

/// Complete checkpoints (`step_NNNNNN/`) in `dir`, oldest first; none when `dir` does not exist.
pub fn list(dir: &Path) -> Result<Vec<Listed>> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(dir).with_context(|| format!("cannot list checkpoint folder {}", dir.display()))?;
    let mut found: Vec<Listed> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step_")?.parse().ok()?; // `.tmp` folders do not parse
            Some(Listed { step, run_id: run_id_of(&e.path()), path: e.path() })
        })
        .collect();
    found.sort_by_key(|l| l.step);
    Ok(found)
}

/// The run id recorded in a checkpoint folder, if it has a readable one.
pub fn run_id_of(checkpoint: &Path) -> Option<String> {
    let text = crate::files::read_text(&checkpoint.join("trainer_state.json"), "trainer_state.json").ok()?;
    let meta: serde_json::Value = serde_json::from_str(&text).ok()?;
    meta["run_id"].as_str().map(str::to_string)
}

/// Is `name` a folder a ferrotron run writes a checkpoint into, or deletes one through
/// (`step_NNNNNN.<run id>.tmp`, the run id being `new_run_id`'s two hex numbers)? Only such names
/// are ever removed: a user's `notes.tmp` in the same folder is not the run's to delete.
pub fn is_half_written(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("step_").and_then(|r| r.strip_suffix(".tmp")) else { return false };
    let Some((step, id)) = rest.split_once('.') else { return false };
    step.len() >= 6 && step.chars().all(|c| c.is_ascii_digit()) && is_run_id(id)
}

/// Folders that killed runs left half-written (`is_half_written`) and that hold nothing but
/// checkpoint files (`FILES`, plain files); only called with the lock held, so nobody is writing
/// them. A folder named so that holds anything else is someone's: left, with a note.
fn remove_half_written(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?.flatten() {
        let p = e.path();
        if !(is_half_written(&e.file_name().to_string_lossy()) && p.is_dir() && !p.is_symlink()) {
            continue;
        }
        let listed = std::fs::read_dir(&p).with_context(|| format!("cannot list {}", p.display()))?;
        let foreign = listed.flatten().find(|f| {
            let plain = f.file_type().is_ok_and(|t| t.is_file());
            !(plain && FILES.iter().any(|name| f.file_name() == *name))
        });
        match foreign {
            None => std::fs::remove_dir_all(&p).with_context(|| format!("cannot remove the half-written {}", p.display()))?,
            Some(f) => crate::say!(
                "note: {} is named like a half-written checkpoint but holds {}, which no checkpoint does: left as it is (remove it yourself if nobody needs it)",
                p.display(),
                f.file_name().to_string_lossy()
            ),
        }
    }
    Ok(())
}

/// `latest` → the newest complete checkpoint in `checkpoint.dir`; anything else is a folder.
pub fn resolve(arg: &Path, cfg: &Config) -> Result<PathBuf> {
    if arg.as_os_str() != "latest" {
        return Ok(arg.to_path_buf());
    }
    let dir = Path::new(&cfg.checkpoint.dir);
    match list(dir)?.pop() {
        Some(l) => Ok(l.path),
        None => bail!("--resume latest: no complete checkpoint in {} (checkpoint.dir)", dir.display()),
    }
}

/// `--resume latest` found the newest checkpoint `newest` damaged (`e`): the error, naming the
/// newest older one of its folder that `loads`, so that the damaged one can be moved away.
pub fn name_newest_good(newest: &Path, e: anyhow::Error, loads: impl Fn(&Path) -> bool) -> anyhow::Error {
    let older = newest.parent().map(list).and_then(Result::ok).unwrap_or_default();
    let shown = newest.display();
    match older.iter().rev().find(|l| l.path != newest && loads(&l.path)) {
        Some(l) => e.context(format!(
            "--resume latest: the newest checkpoint {shown} is damaged; the newest that loads is {}: move the damaged one away and run again with --resume latest",
            l.path.display()
        )),
        None => e.context(format!("--resume latest: the newest checkpoint {shown} is damaged, and no older one loads")),
    }
}
