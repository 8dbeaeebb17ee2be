//! # The config as a TOML table: layering files and `--set`, before the typed checks
//!
//! `configs/tiny.toml`, then the user's file, then each `--set section.key=value` are laid on one
//! TOML table, which is then read into `Config` (`config.rs`). Checks that are easier on the
//! untyped table (every float finite, whatever its key) live here too.

use anyhow::{bail, Result};

/// The first float of `v` (a config as TOML) that is NaN or infinite, with its key.
pub(super) fn first_non_finite(v: &toml::Value, key: &str) -> Option<(String, f64)> {
    match v {
        toml::Value::Float(x) if !x.is_finite() => Some((key.to_string(), *x)),
        toml::Value::Table(t) => t
            .iter()
            .find_map(|(k, v)| first_non_finite(v, &if key.is_empty() { k.clone() } else { format!("{key}.{k}") })),
        _ => None,
    }
}

/// Recursively lays `over` on top of `base`: tables merge, other values replace.
pub(super) fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// Keys renamed since a config, a `--set` or a checkpoint's record could first say them:
/// (section, the old name, the new one). The old name still means the new key.
const RENAMED: [(&str, &str, &str); 1] = [
    ("train", "loss_chunk_rows", "loss_stripe_rows"), // 2026-12-01: `chunk` is the pipeline's word
];

/// The name `key` of `section` goes by now.
fn current<'k>(section: &str, key: &'k str) -> &'k str {
    RENAMED.iter().find(|r| r.0 == section && r.1 == key).map_or(key, |r| r.2)
}

/// One layer of the config (a file, a checkpoint's record) with each old key under its new name;
/// `source` names the layer where it gives both.
pub(super) fn renamed(mut table: toml::Table, source: &str) -> Result<toml::Table> {
    for (section, old, new) in RENAMED {
        let Some(keys) = table.get_mut(section).and_then(toml::Value::as_table_mut) else { continue };
        if let Some(value) = keys.remove(old) {
            if keys.contains_key(new) {
                bail!("{source}: `{section}.{old}` is the old name of `{section}.{new}`; give it once, as `{new}`");
            }
            keys.insert(new.to_string(), value);
        }
    }
    Ok(table)
}

/// `section.key=value`, or `section.table.key=value` for a key of a table inside a section
/// (`model.rope_scaling.factor`); the value is read as TOML (`3`, `1e-3`, `true`, `"x"`), else as
/// a string.
pub(super) fn apply_set(table: &mut toml::Table, set: &str) -> Result<()> {
    let Some((path, raw)) = set.split_once('=') else {
        bail!("--set {set}: expected section.key=value, for example --set train.steps=100");
    };
    let path: Vec<&str> = path.trim().split('.').collect();
    if !(2..=3).contains(&path.len()) || path.iter().any(|p| p.is_empty()) {
        bail!("--set {set}: the key must be section.key (or section.table.key), for example train.lr");
    }
    let parsed = format!("v = {}", raw.trim()).parse::<toml::Table>().ok();
    if parsed.as_ref().is_some_and(|t| t.len() > 1) {
        // `2\ntrain.lr=5` reads as two keys: the second would be dropped without a word
        bail!("--set {}: one section.key=value a --set; this value holds more (a line break?)", set.escape_debug());
    }
    let value = parsed.and_then(|mut t| t.remove("v")).unwrap_or_else(|| toml::Value::String(raw.trim().to_string()));
    let section = table.entry(path[0]).or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let Some(section) = section.as_table_mut() else {
        bail!("--set {set}: `{}` is not a section", path[0]);
    };
    let key = current(path[0], path[1]).to_string();
    match path.get(2) {
        None => {
            section.insert(key, value);
        }
        Some(inner) => {
            let inside = section.entry(&key).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let Some(inside) = inside.as_table_mut() else {
                bail!("--set {set}: `{}.{key}` is not a table of keys", path[0]);
            };
            inside.insert(inner.to_string(), value);
        }
    }
    Ok(())
}

/// The reader's complaint about `key` (dotted) of `table`, in the config's own words: serde speaks
/// of "unit variants" and "struct ModelConfig"; a user wrote a word or a section. `read` reads a
/// table again, to learn the words a key takes.
pub(super) fn plain_words(msg: &str, key: &str, table: &toml::Table, read: &dyn Fn(toml::Table) -> String) -> String {
    let path: Vec<&str> = key.split('.').collect();
    let value = path[1..].iter().fold(table.get(path[0]), |at, k| at.and_then(|v| v.get(*k)));
    let shown = match value {
        Some(toml::Value::Datetime(d)) => format!("the date-time {d}"), // not toml's inner table
        Some(v) => v.to_string(),
        None => "this".to_string(),
    };
    if msg.contains("expected struct") {
        return format!(
            "is {shown}, but `{key}` is a section: give its keys (`[{key}]` in a file, or --set {key}.KEY=VALUE)"
        );
    }
    if msg.contains("unit variant") {
        // the same table with a word no key takes there: the reader then lists the words it takes
        let mut probe = table.clone();
        let (last, parents) = path.split_last().expect("a key has a name");
        let section = parents.iter().try_fold(&mut probe, |t, k| t.get_mut(*k).and_then(toml::Value::as_table_mut));
        if let Some(section) = section {
            section.insert(last.to_string(), toml::Value::String("?".into()));
            let listed = read(probe);
            if let Some(i) = listed.find("unknown variant `?`, ").map(|i| i + "unknown variant `?`, ".len()) {
                return format!("is {shown}; {} (a word: in quotes in a file)", &listed[i..]);
            }
        }
        return format!("is {shown}, not one of the words this key takes");
    }
    let what = msg.strip_prefix("invalid type: ").or_else(|| msg.strip_prefix("invalid value: "));
    match what.and_then(|m| m.split_once(", expected ")) {
        Some((_, wanted)) => {
            let wanted = match wanted {
                "usize" | "u64" | "u32" | "u16" | "u8" => "a whole number, 0 or more",
                "f64" | "f32" => "a number",
                other => other,
            };
            format!("is {shown}; expected {wanted}")
        }
        None => msg.to_string(),
    }
}

pub(super) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
