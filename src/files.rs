//! # Output: files written whole, and a terminal that may go away
//!
//! Every file a run writes (metrics, traces, reports, the token cache, checkpoints) goes through
//! here, so a reader, a crash or a second run never sees half of one:
//!
//! ```text
//! path ──(symlinks followed)──▶ target          a symlink stays a symlink; its target is written
//! target's folder / .name.<pid>.<n>.tmp         written, flushed to disk
//!           └── rename ──▶ target                the old file or the new one, never a mix
//! ```
//! A target that is a folder, a FIFO or a device is refused, and `check_writable` proves a path
//! can be written before a run spends minutes training (a probe file in the target's folder).
//!
//! Standard output may be closed (`ferrotron train | head`) or full (`> /dev/full`): `say!`
//! prints and ignores the failure, so a lost terminal never stops a run or loses a checkpoint.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Prints a line on standard output; a closed or full output is ignored, never a panic.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if !$crate::files::SILENT.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = writeln!(std::io::stdout().lock(), $($arg)*);
        }
    }};
}

/// Set in every process but the first of a multi-process run: one process speaks for the run
/// (`comm/processes.rs`); errors still print everywhere.
pub static SILENT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The file that writing `path` really writes: symlinks followed to their final target (which
/// may not exist yet). A folder, FIFO, socket or device is refused, naming `path`.
pub fn output_target(path: &Path) -> Result<PathBuf> {
    let mut target = path.to_path_buf();
    for _ in 0..40 {
        let Ok(meta) = std::fs::symlink_metadata(&target) else {
            return Ok(target); // nothing there yet: a new regular file
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            let link = std::fs::read_link(&target).with_context(|| format!("cannot read link {}", target.display()))?;
            target = target.parent().map_or(link.clone(), |dir| dir.join(&link));
            continue;
        }
        if kind.is_file() {
            return Ok(target);
        }
        let what = if kind.is_dir() { "a folder" } else { "not a regular file (a FIFO, socket or device)" };
        bail!("{} is {what}: give the path of a file to write", path.display());
    }
    bail!("{}: too many levels of symbolic links", path.display())
}

/// Checks, before any work, that `path` can be written: its target is a regular file or does
/// not exist, its folder exists (created if need be) and accepts a new file.
pub fn check_writable(path: &Path) -> Result<()> {
    let target = output_target(path)?;
    let dir = folder_of(&target);
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create folder {} for {}", dir.display(), path.display()))?;
    check_folder_writable(&dir).with_context(|| format!("cannot write {}", path.display()))
}

/// Checks that the outputs of one run (flag, path) are writable and are different files: two
/// outputs on one path would write over each other (`--metrics X --trace X`). Symlinks and
/// `a/../b` are followed to the file each would really write.
pub fn check_outputs(outputs: &[(&str, Option<&Path>)]) -> Result<()> {
    let mut seen: Vec<(&str, PathBuf)> = Vec::new();
    for &(flag, path) in outputs {
        let Some(path) = path else { continue };
        check_writable(path).with_context(|| flag.to_string())?;
        let target = output_target(path)?;
        // the folder exists now (check_writable made it): its canonical form names the file
        let name = target.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        let real = folder_of(&target).canonicalize().map(|dir| dir.join(name)).unwrap_or(target);
        if let Some((other, _)) = seen.iter().find(|(_, p)| *p == real) {
            bail!("{flag} {} is also the {other} file: give each output its own path", path.display());
        }
        seen.push((flag, real));
    }
    Ok(())
}

/// Reads a text file the user named (`what`: its flag or key), refusing what is not a regular
/// file: reading a FIFO would wait forever for a writer, a device might never end.
pub fn read_text(path: &Path, what: &str) -> Result<String> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("{what}: cannot read {}: check the path", path.display()))?;
    if !meta.is_file() {
        bail!("{what}: {} is not a regular file (a folder, a FIFO or a device): give a file", path.display());
    }
    std::fs::read_to_string(path).with_context(|| format!("{what}: cannot read {} as UTF-8 text", path.display()))
}

/// Creates `dir` if needed and proves a file can be created in it.
pub fn check_folder_writable(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create folder {}", dir.display()))?;
    if !dir.is_dir() {
        bail!("{} is not a folder", dir.display());
    }
    let probe = temp_name(&dir.join("write-probe"));
    std::fs::File::create(&probe)
        .and_then(|_| std::fs::remove_file(&probe))
        .with_context(|| format!("the folder {} is not writable", dir.display()))
}

/// Writes `bytes` to `path` whole: into a temporary file next to the target, flushed to disk,
/// then renamed onto it. Concurrent writers of the same path each rename a complete file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let target = output_target(path)?;
    let tmp = temp_name(&target);
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|_| f.sync_all()))
        .and_then(|_| std::fs::rename(&tmp, &target));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    Ok(())
}

/// `dir/.name.<pid>.<n>.tmp` beside `target`: unique to this process and call.
fn temp_name(target: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    folder_of(target).join(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

fn folder_of(target: &Path) -> PathBuf {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
