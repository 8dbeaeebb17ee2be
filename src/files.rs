//! # Output files, written whole
//!
//! Every file a run writes (metrics, traces, reports, the token cache) goes through here, so a
//! reader (or a crash) never sees half of one.

use std::path::Path;

/// Writes `bytes` to `path` through a temporary file and a rename: readers never see half a file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
