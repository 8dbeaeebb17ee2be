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
//!
//! Every file a run reads comes in through one door too, `open_read` (and `read_bytes`,
//! `read_text` on it): it opens without waiting and refuses anything but a regular file, so a
//! FIFO named as a model, a checkpoint's state or a trace fails at once, naming the flag or key,
//! instead of blocking for a writer that never comes. `tests/reads.rs` fails on a read anywhere
//! else.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
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
/// (`comm/wires/processes.rs`); errors still print everywhere.
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

/// An output a command line asks for: its flag, the path given, and whether it is a folder (the
/// command writes files inside it) or a file.
pub struct Wanted<'a> {
    pub flag: &'a str,
    pub path: &'a Path,
    pub folder: bool,
}

/// An output of a command, checked: its flag, the path given, and the file or folder it really
/// writes (symlinks and `a/../b` followed).
pub struct Output<'a> {
    pub flag: &'a str,
    pub path: &'a Path,
    pub real: PathBuf,
}

/// Checks that the outputs of one run are writable, are different files (two outputs on one
/// path would write over each other: `--metrics X --trace X`), are none of the run's `inputs`
/// nor inside one (what names it, and the path of a file it reads or of a folder whose files it
/// reads: `--metrics` onto its config, into the checkpoint it resumes), and are no lock a live
/// process holds (a checkpoint folder's `.lock`, another output's claim).
pub fn check_outputs<'a>(outputs: &[Wanted<'a>], inputs: &[(String, PathBuf)]) -> Result<Vec<Output<'a>>> {
    let inputs: Vec<(&String, PathBuf)> =
        inputs.iter().filter_map(|(w, p)| Some((w, p.canonicalize().ok()?))).collect();
    let mut seen: Vec<Output> = Vec::new();
    for &Wanted { flag, path, folder } in outputs {
        // where it would write, found before anything is made: a refused output must not leave
        // even an empty folder inside what the run reads
        let real = match folder {
            true => real_path(path),
            false => real_path(&output_target(path).with_context(|| flag.to_string())?),
        };
        if let Some(other) = seen.iter().find(|o| o.real == real) {
            bail!("{flag} {} is also the {} file: give each output its own path", path.display(), other.flag);
        }
        refuse_inside(flag, path, &real, &inputs)?;
        if !folder && is_held(&real) {
            bail!("{flag} {} is a lock file a live run holds: writing over it would let a second run in; give the output another path", path.display());
        }
        match folder {
            true => check_folder_writable(path).with_context(|| flag.to_string())?,
            false => check_writable(path).with_context(|| flag.to_string())?,
        }
        seen.push(Output { flag, path, real });
    }
    Ok(seen)
}

/// Refuses an output (`flag` `path`, landing at `real`) that is one of `inputs` (canonical) or
/// lies inside one.
fn refuse_inside(flag: &str, path: &Path, real: &Path, inputs: &[(&String, PathBuf)]) -> Result<()> {
    match inputs.iter().find(|(_, input)| real.starts_with(input)) {
        Some((what, input)) => bail!(
            "{flag} {} would write over {what} ({}), which this run reads: give the output another path",
            path.display(),
            input.display()
        ),
        None => Ok(()),
    }
}

/// Checks that the folders config keys name for writing (`outputs`: the key and its folder) are
/// none of the run's `inputs` nor inside one, before anything is made: a run writes a lock, a
/// checkpoint, a token file or an empty folder into none of what it reads. (Nothing else is
/// asked of them here: each is made and tried where it is first written.)
pub fn check_folders(outputs: &[(&str, PathBuf)], inputs: &[(String, PathBuf)]) -> Result<()> {
    let inputs: Vec<(&String, PathBuf)> =
        inputs.iter().filter_map(|(w, p)| Some((w, p.canonicalize().ok()?))).collect();
    outputs.iter().try_for_each(|(key, path)| refuse_inside(key, path, &real_path(path), &inputs))
}

/// `path` absolute, with symlinks and `..` followed as far as it exists, and the rest (not made
/// yet) joined on, `.` and `..` taken as words: the place a write there would land.
fn real_path(path: &Path) -> PathBuf {
    let mut existing = path.to_path_buf();
    let mut rest = Vec::new(); // the last components first, as they are taken off
    loop {
        if let Ok(real) = existing.canonicalize() {
            return rest.iter().rev().fold(real, |mut at: PathBuf, name: &std::ffi::OsString| {
                match name.to_str() {
                    Some(".") => {}
                    Some("..") => drop(at.pop()),
                    _ => at.push(name),
                }
                at
            });
        }
        // the last component, whatever it is: a name, or a `..` below a folder not made yet
        // (`new/..`: the folder is made first, so the `..` lands back where it started)
        let mut parts = existing.components();
        match parts.next_back() {
            Some(last) if existing.as_os_str() != "." => {
                rest.push(last.as_os_str().to_os_string());
                existing = match parts.as_path().as_os_str().is_empty() {
                    true => PathBuf::from("."),
                    false => parts.as_path().to_path_buf(),
                };
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// Whether `path` is a file another open handle holds an advisory lock on (`flock`).
fn is_held(path: &Path) -> bool {
    let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path) else {
        return false;
    };
    file.metadata().is_ok_and(|m| m.is_file()) && file.try_lock_shared().is_err()
}

/// Outputs this process writes, each claimed until it ends: a second live run given one of them
/// is refused (as a second run on a checkpoint folder is), instead of the two writing over each
/// other. The claim is a `flock` on a lock file beside the output, `.NAME.lock` in its folder:
/// keyed on the output's own place, so two runs with different caches or users still meet there.
/// The OS drops it with the process, even after `kill -9`; a run that ends removes its lock files
/// (while still holding them: see `hold`), a killed one leaves a few bytes naming it.
pub struct Claims {
    locks: Vec<(std::fs::File, PathBuf)>,
}

impl Drop for Claims {
    fn drop(&mut self) {
        for (_, path) in &self.locks {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Claims `outputs` for this process (none where `mine` is false: in a multi-process run the first
/// process writes them); refuses an output another live process holds.
pub fn claim(outputs: &[Output], mine: bool) -> Result<Claims> {
    let mut claims = Claims { locks: Vec::new() };
    if !mine {
        return Ok(claims);
    }
    for o in outputs {
        let name = o.real.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let lock_path = folder_of(&o.real).join(format!(".{name}.lock"));
        let note = format!("process {}, writing {}", std::process::id(), o.real.display());
        match hold(&lock_path, &note).with_context(|| o.flag.to_string())? {
            Ok(lock) => claims.locks.push((lock, lock_path)),
            Err(holder) => bail!(
                "{} {} is being written by another live run ({holder}): give this run its own path, or wait for that run to end",
                o.flag,
                o.path.display()
            ),
        }
    }
    Ok(claims)
}

/// Takes the advisory lock (`flock`) of `lock_path`, creating the file, and writes `note` in it
/// for whoever is refused next; `Err(their note)` where another live process holds it. The OS
/// drops the lock with the process, even after `kill -9`. A lock file may be removed by its holder
/// as it ends (`Claims`): a lock taken on a file no longer at `lock_path` is let go and taken
/// again on the file there now, so two processes never both hold "the" lock.
pub fn hold(lock_path: &Path, note: &str) -> Result<std::result::Result<std::fs::File, String>> {
    use std::os::unix::fs::MetadataExt;
    loop {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false) // the holder's note stays readable to the refused
            .read(true)
            .write(true)
            .open(lock_path)
            .with_context(|| format!("cannot open the lock file {}", lock_path.display()))?;
        if lock.try_lock().is_err() {
            let holder = read_text(lock_path, "the lock file").unwrap_or_default();
            return Ok(Err(if holder.trim().is_empty() { "holder unknown".into() } else { holder.trim().to_string() }));
        }
        let here = |m: std::fs::Metadata| (m.dev(), m.ino());
        if lock.metadata().map(here).ok() != std::fs::metadata(lock_path).map(here).ok() {
            continue; // removed (or replaced) since it was opened: take the file there now
        }
        lock.set_len(0).and_then(|_| (&lock).write_all(note.as_bytes())).ok(); // informative only
        return Ok(Ok(lock));
    }
}

/// The cache folder `data.cache_dir` names, or, for `""`, `$FERROTRON_CACHE`, else
/// `$XDG_CACHE_HOME/ferrotron`, else `~/.cache/ferrotron` (the Hugging Face cache's convention).
pub fn cache_folder(setting: &str) -> Result<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    match setting {
        "" => env("FERROTRON_CACHE")
            .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("ferrotron")))
            .or_else(|| env("HOME").map(|d| d.join(".cache/ferrotron")))
            .context("data.cache_dir: no cache folder (HOME is not set); set data.cache_dir or FERROTRON_CACHE"),
        dir => Ok(PathBuf::from(dir)),
    }
}

/// Opens a file the run reads (`what`: the flag, key or role that names it, for the error),
/// refusing what is not a regular file: reading a FIFO would wait forever for a writer, a device
/// might never end. The open itself does not wait (`O_NONBLOCK`, which a regular file's reads
/// ignore), and the check is of what was opened, so nothing can be swapped in between.
pub fn open_read(path: &Path, what: &str) -> Result<std::fs::File> {
    let cannot = || format!("{what}: cannot read {}: check the path", path.display());
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).with_context(cannot)?;
    if !file.metadata().with_context(cannot)?.is_file() {
        bail!("{what}: {} is not a regular file (a folder, a FIFO or a device): give a file", path.display());
    }
    Ok(file)
}

/// The whole of a file the run reads, through `open_read`, a chunk at a time: a signal (under
/// `train`) stops a read of gigabytes between two chunks (`signals.rs`). A file of one chunk is
/// always read whole: the small reads a run makes after a signal (a checkpoint's run id while the
/// signal's checkpoint is pruned) are part of stopping cleanly.
pub fn read_bytes(path: &Path, what: &str) -> Result<Vec<u8>> {
    const CHUNK: usize = 64 << 20;
    let mut file = open_read(path, what)?;
    let size = file.metadata().map_or(0, |m| m.len()) as usize;
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(size).map_err(|_| {
        anyhow::anyhow!("{what}: {} is {size} bytes, more than this machine can hold in memory", path.display())
    })?;
    loop {
        let n = std::io::Read::read_to_end(&mut std::io::Read::take(&mut file, CHUNK as u64), &mut bytes)
            .with_context(|| format!("{what}: cannot read {}", path.display()))?;
        if n < CHUNK {
            return Ok(bytes); // the end of the file
        }
        crate::signals::check(|| format!("reading {what} ({})", path.display()))?;
    }
}

/// A text file the run reads, through `open_read`. A UTF-8 byte-order mark at its start (what
/// some Windows editors write) is no part of the text: dropped, as every reader of JSON, TOML or
/// plain text here would otherwise fail on it at line 1, column 1.
pub fn read_text(path: &Path, what: &str) -> Result<String> {
    let mut bytes = read_bytes(path, what)?;
    if bytes.starts_with(b"\xef\xbb\xbf") {
        bytes.drain(..3);
    }
    String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("{what}: cannot read {} as UTF-8 text", path.display()))
}

/// Flushes a folder's entries (a rename into it) to disk; best effort, as a folder may refuse.
pub fn sync_folder(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
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

/// FNV-1a in two lanes with different offsets and primes, fed the bytes and then the length: a
/// content key with no practical chance of two inputs colliding (a token file's name, a lock's).
pub struct Fingerprint {
    lanes: [u64; 2],
    len: u64,
}

impl Default for Fingerprint {
    fn default() -> Fingerprint {
        Fingerprint { lanes: [0xcbf29ce484222325, 0x6c62272e07bb0142], len: 0 }
    }
}

impl Fingerprint {
    pub fn add(&mut self, bytes: &[u8]) {
        let [mut a, mut b] = self.lanes;
        for &x in bytes {
            a = (a ^ x as u64).wrapping_mul(0x100000001b3);
            b = (b ^ x as u64).wrapping_mul(0x1000193_00000001).rotate_left(17);
        }
        self.lanes = [a, b];
        self.len += bytes.len() as u64;
    }

    /// The two lanes, the length folded into the second.
    pub fn value(&self) -> [u64; 2] {
        let [a, b] = self.lanes;
        [a, b ^ self.len.wrapping_mul(0x9e3779b97f4a7c15)]
    }

    pub fn hex(&self) -> String {
        let [a, b] = self.value();
        format!("{a:016x}{b:016x}")
    }
}
