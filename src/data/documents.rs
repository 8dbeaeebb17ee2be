//! # Documents: what a text source holds, shard by shard
//!
//! A text source names one file, a folder, or a glob of files (`text:data/train-*.parquet`): the
//! shards, read in the order of their paths, so a run sees the same stream wherever it runs.
//! Each shard is a list of documents:
//!
//! ```text
//! notes.txt          one document: the whole file (UTF-8)
//! web.jsonl          one document a line: its "text" field (data.text_column)
//! train-0.parquet    one document a row: its "text" column, read row group by row group
//! ```
//! Parquet is how the Hub keeps most datasets (FineWeb-Edu, SmolLM-Corpus, TinyStories): a file of
//! row groups, each holding every column's values for some rows, compressed per page (snappy,
//! zstd, gzip, lz4). Reading one row group at a time keeps memory to one group, not the file.
//! Rows whose text is null are skipped. A folder takes its `.parquet`, `.jsonl` and `.txt` files
//! (a Hub snapshot's README.md is not data).

use anyhow::{bail, Context, Result};
use parquet::column::reader::ColumnReader;
use parquet::file::reader::{FileReader, SerializedFileReader};
use std::path::{Path, PathBuf};

/// The extensions a folder's shards have.
const SHARD_KINDS: [&str; 3] = ["parquet", "jsonl", "txt"];

/// The shards `spec` names: a file, a folder's data files, or the files a glob (`*`, `?` within
/// a path component) matches; sorted by path. None is an error naming the spec.
pub fn shards(spec: &str) -> Result<Vec<PathBuf>> {
    let path = Path::new(spec);
    if spec.contains(['*', '?']) {
        let mut found = Vec::new();
        glob(Path::new(if spec.starts_with('/') { "/" } else { "." }), &components(path), &mut found)?;
        found.sort();
        if found.is_empty() {
            bail!("data.source: no file matches {spec}; check the pattern (* and ? match within one folder level)");
        }
        return Ok(found);
    }
    let meta = std::fs::metadata(path).with_context(|| format!("data.source: cannot read {spec}: check the path"))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if !meta.is_dir() {
        bail!("data.source: {spec} is not a regular file or a folder (a FIFO or a device cannot be a text source)");
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("data.source: cannot list the folder {spec}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| SHARD_KINDS.iter().any(|k| e == *k)))
        .collect();
    found.sort();
    if found.is_empty() {
        bail!("data.source: the folder {spec} holds no .parquet, .jsonl or .txt files");
    }
    Ok(found)
}

fn components(path: &Path) -> Vec<String> {
    path.components()
        .filter_map(|c| match c {
            std::path::Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            std::path::Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect()
}

/// The files under `dir` that `parts` (path components, some with wildcards) lead to.
fn glob(dir: &Path, parts: &[String], found: &mut Vec<PathBuf>) -> Result<()> {
    let Some((part, rest)) = parts.split_first() else {
        if dir.is_file() {
            found.push(dir.strip_prefix("./").unwrap_or(dir).to_path_buf());
        }
        return Ok(());
    };
    if !part.contains(['*', '?']) {
        return glob(&dir.join(part), rest, found);
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') && wildcard(part.as_bytes(), name.as_bytes()) {
            glob(&entry.path(), rest, found)?;
        }
    }
    Ok(())
}

/// Does `name` match `pattern`, where `*` is any run of characters and `?` any one?
pub fn wildcard(pattern: &[u8], name: &[u8]) -> bool {
    match (pattern.first(), name.first()) {
        (None, None) => true,
        (Some(b'*'), _) => wildcard(&pattern[1..], name) || (!name.is_empty() && wildcard(pattern, &name[1..])),
        (Some(b'?'), Some(_)) => wildcard(&pattern[1..], &name[1..]),
        (Some(p), Some(n)) if p == n => wildcard(&pattern[1..], &name[1..]),
        _ => false,
    }
}

/// Hands every document of `shard` to `each`, with the bytes of the shard read since the last
/// document (for a progress bar). `column`: the text field of JSON lines and parquet rows.
pub fn read(shard: &Path, column: &str, each: &mut dyn FnMut(&str, u64) -> Result<()>) -> Result<()> {
    let shown = shard.display();
    match shard.extension().and_then(|e| e.to_str()) {
        Some("parquet") => read_parquet(shard, column, each),
        Some("jsonl") => {
            let text = crate::files::read_text(shard, "data.source")?;
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let j: serde_json::Value =
                    serde_json::from_str(line).with_context(|| format!("{shown} line {}: not valid JSON", i + 1))?;
                let Some(t) = j[column].as_str() else {
                    bail!("{shown} line {}: no \"{column}\" string field (data.text_column)", i + 1);
                };
                each(t, line.len() as u64 + 1)?;
            }
            Ok(())
        }
        _ => {
            let text = crate::files::read_text(shard, "data.source")?;
            each(&text, text.len() as u64)
        }
    }
}

/// The documents of a parquet file: column `column` (strings), row group by row group.
fn read_parquet(shard: &Path, column: &str, each: &mut dyn FnMut(&str, u64) -> Result<()>) -> Result<()> {
    let shown = shard.display();
    let file = crate::files::open_read(shard, "data.source")?;
    let reader = SerializedFileReader::new(file).map_err(|e| anyhow::anyhow!("{shown}: not a parquet file ({e})"))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let Some(index) = (0..schema.num_columns()).find(|&i| schema.column(i).path().string() == column) else {
        // a list or a group of that name has leaves below it (`text.list.element`)
        if let Some(i) = (0..schema.num_columns()).find(|&i| schema.column(i).path().parts()[0] == column) {
            let leaf = schema.column(i).path().string();
            bail!(
                "{shown}: column \"{column}\" (data.text_column) is a list or a group ({leaf}), not one string a row"
            );
        }
        let names: Vec<String> = (0..schema.num_columns()).map(|i| schema.column(i).path().string()).collect();
        bail!("{shown}: no column \"{column}\" (data.text_column); it has {}", names.join(", "));
    };
    let desc = schema.column(index);
    if desc.physical_type() != parquet::basic::Type::BYTE_ARRAY || desc.max_rep_level() > 0 {
        bail!("{shown}: column \"{column}\" (data.text_column) does not hold one string a row");
    }
    for g in 0..reader.num_row_groups() {
        let group = reader.get_row_group(g).map_err(|e| anyhow::anyhow!("{shown}, row group {g}: {e}"))?;
        let bytes = group.metadata().compressed_size().max(0) as u64;
        let ColumnReader::ByteArrayColumnReader(mut col) =
            group.get_column_reader(index).map_err(|e| anyhow::anyhow!("{shown}, row group {g}: {e}"))?
        else {
            bail!("{shown}: column \"{column}\" (data.text_column) is not read as strings");
        };
        let (mut values, mut levels) = (Vec::new(), Vec::new());
        let mut first = true;
        loop {
            values.clear();
            levels.clear();
            let (rows, _, _) = col
                .read_records(1024, Some(&mut levels), None, &mut values)
                .map_err(|e| anyhow::anyhow!("{shown}, row group {g}: {e}"))?;
            if rows == 0 {
                break;
            }
            for v in &values {
                let text = v.as_utf8().map_err(|_| {
                    anyhow::anyhow!("{shown}, row group {g}: column \"{column}\" holds bytes that are not UTF-8")
                })?;
                each(text, if std::mem::take(&mut first) { bytes } else { 0 })?;
            }
        }
    }
    Ok(())
}
