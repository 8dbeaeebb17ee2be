//! # `ferrotron tokenizer`: learn a vocabulary from your text
//!
//! `ferrotron tokenizer --vocab-size 1024 text:corpus.txt` learns a byte-level BPE from every
//! document of the source (`data/bpe.rs` says how), writes `tokenizer.json`, and says how much
//! text a token holds — then `--set data.tokenizer=tokenizer.json --set model.vocab_size=1024`
//! trains on it.

use crate::config::DataConfig;
use crate::data::bpe;
use crate::data::text::Tokenizer;
use anyhow::{Context, Result};
use std::path::Path;

/// How much of the source the bytes-a-token figure is measured on.
const MEASURED: usize = 1 << 20;

/// Learns a tokenizer of `vocab_size` tokens from `data.source` and writes it to `out`.
pub fn run(d: &DataConfig, vocab_size: usize, out: &Path) -> Result<()> {
    let source = crate::data::text_source(&d.source, &d.text_column)?
        .context("SOURCE: give a text source, text:PATH or hub:ORG/NAME/FILE (the synthetic data has no text)")?;
    let shards = source.shards.len();
    let plural = if shards == 1 { "" } else { "s" };
    crate::say!("learning a byte-level BPE of {vocab_size} tokens from {} ({shards} shard{plural})", source.name);
    let start = std::time::Instant::now();
    let learned = bpe::learn(&source, vocab_size)?;
    let size = learned.tokenizer.get_vocab_size(true);
    crate::files::write_atomically(out, bpe::to_json(&learned)?.as_bytes()).context("--out")?;
    // how much text a token holds, on the first MiB of the documents
    let tokenizer = Tokenizer::load(&out.to_string_lossy())?;
    let (mut bytes, mut tokens) = (0usize, 0usize);
    for shard in &source.shards {
        if bytes >= MEASURED {
            break;
        }
        crate::data::documents::read(shard, &source.column, &mut |doc, _| {
            crate::signals::check(|| "measuring the tokenizer".into())?;
            // at most the rest of the MiB, cut at a character's start
            let mut end = doc.len().min(MEASURED.saturating_sub(bytes));
            while !doc.is_char_boundary(end) {
                end -= 1;
            }
            bytes += end;
            tokens += tokenizer.encode(&doc[..end])?.len();
            Ok(())
        })?;
    }
    crate::say!(
        "learned {size} tokens (256 bytes, {}, {} merges) from {} document{}, {}, in {:.1} s",
        bpe::END_OF_TEXT,
        size.saturating_sub(bpe::MIN_VOCAB),
        learned.documents,
        if learned.documents == 1 { "" } else { "s" },
        amount(learned.bytes as usize),
        start.elapsed().as_secs_f64()
    );
    crate::say!(
        "{:.2} bytes a token (on the first {}; bytes as tokens: 1.00)",
        bytes as f64 / tokens.max(1) as f64,
        amount(bytes)
    );
    crate::say!(
        "tokenizer: {} — train on it with --set data.tokenizer=\"{}\" --set model.vocab_size={size}",
        out.display(),
        out.display()
    );
    Ok(())
}

/// An amount of text: kB under a megabyte, else MB.
fn amount(bytes: usize) -> String {
    match bytes < 1_000_000 {
        true => format!("{:.1} kB", bytes as f64 / 1e3),
        false => format!("{:.1} MB", bytes as f64 / 1e6),
    }
}
