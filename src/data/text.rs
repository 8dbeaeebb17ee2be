//! # Real text: a tokenizer, documents, and a token file read in place
//!
//! `data.source = "text:PATH"` trains on the documents of a file, a folder or a glob of shards
//! (a UTF-8 file, JSON lines, parquet: `data/documents.rs`). `data.tokenizer` turns text into ids:
//! `"bytes"` (each byte is a token, vocab 256) or a Hugging Face `tokenizer.json`, run by the
//! `tokenizers` crate exactly as transformers' fast tokenizers run it. Documents are joined with
//! the tokenizer's end-of-text token between them.
//!
//! Tokenising is done once: the ids go to a token file in the cache folder (`data.cache_dir`;
//! by default `~/.cache/ferrotron`, never beside the user's source), named by a fingerprint of
//! the source's bytes and the tokenizer's, so an edited source is tokenised again even when its
//! size and time stayed the same. Later runs read windows of that file in place
//! without loading it. Runs tokenising the same source at once each write a whole file and
//! rename it into place; opening checks the ids against the vocabulary.
//!
//! ```text
//! CACHE/tokens/NAME.<fp>.tokens:  "FTOK" | version u32 | count u64 | count × u32 token ids (LE)
//! ```

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

pub enum Tokenizer {
    Bytes,
    /// A Hugging Face tokenizer and the `tokenizer.json` it came from.
    Bpe(Box<tokenizers::Tokenizer>, PathBuf),
}

/// End-of-text tokens used by common tokenizers, looked up in this order.
const EOS_NAMES: [&str; 5] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>"];

impl Tokenizer {
    /// `"bytes"`, a path to a `tokenizer.json`, or `"hub:ORG/NAME"` (that model's tokenizer.json).
    pub fn load(spec: &str) -> Result<Tokenizer> {
        if spec == "bytes" {
            return Ok(Tokenizer::Bytes);
        }
        let path = match spec.strip_prefix("hub:") {
            Some(id) => crate::data::hf_hub::tokenizer_file(id)?,
            None => PathBuf::from(spec),
        };
        // through the door: a FIFO or a folder is refused there, naming data.tokenizer
        let t = tokenizers::Tokenizer::from_bytes(crate::files::read_bytes(&path, "data.tokenizer")?)
            .map_err(|e| anyhow::anyhow!("data.tokenizer: cannot load {} as a tokenizer.json: {e}", path.display()))?;
        Ok(Tokenizer::Bpe(Box::new(t), path))
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Bpe(t, _) => t.get_vocab_size(true),
        }
    }

    /// The token that separates documents, if the tokenizer has one.
    pub fn eos(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Bpe(t, _) => EOS_NAMES.iter().find_map(|n| t.token_to_id(n)),
        }
    }

    /// The text of `ids`, special tokens included (with `Bytes`, an id past 255 is shown as ⟨id⟩).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Bytes => {
                let mut text = String::new();
                for run in ids.chunk_by(|a, b| (*a < 256) == (*b < 256)) {
                    match run[0] < 256 {
                        true => {
                            text.push_str(&String::from_utf8_lossy(&run.iter().map(|&t| t as u8).collect::<Vec<_>>()))
                        }
                        false => run.iter().for_each(|t| text.push_str(&format!("⟨{t}⟩"))),
                    }
                }
                Ok(text)
            }
            Tokenizer::Bpe(t, _) => t.decode(ids, false).map_err(|e| anyhow::anyhow!("tokenizer: {e}")),
        }
    }

    /// The ids of `text`, without special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Bpe(t, _) => {
                Ok(t.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?.get_ids().to_vec())
            }
        }
    }
}

/// A tokenised source, read from its token file in place: each window is one positioned read
/// (`pread`) of its bytes, not a memory map. A map would turn the file shrinking under the run
/// (someone truncating or rewriting the cache) into SIGBUS, which kills the process with no word;
/// a read that comes back short is an error naming the file. The cost is one system call per
/// sequence, a few microseconds against a step of milliseconds (BENCHMARKS.md, "token reads").
pub struct Tokens {
    file: std::fs::File,
    path: PathBuf,
    count: usize,
    /// The fingerprint of what the tokens were made from (every shard's bytes, the text column,
    /// the tokenizer): a resumed run and every process of a run compare it.
    pub fingerprint: String,
}

const HEADER: usize = 16;

impl Tokens {
    /// Opens the token file of `source` for `tokenizer`, writing it first if needed, and checks
    /// that every id is below `vocab` (a stale or foreign file would index past the embedding).
    pub fn open(source: &Source, tokenizer: &Tokenizer, vocab: usize, cache_folder: &Path) -> Result<Tokens> {
        let (cache, fingerprint) = cache_path(source, tokenizer, cache_folder)?;
        if !cache.exists() {
            write_tokens(source, tokenizer, &cache)?;
        }
        let file = crate::files::open_read(&cache, "the token file")?;
        let size = file.metadata().with_context(|| format!("cannot read {}", cache.display()))?.len();
        let mut header = [0u8; HEADER];
        let read = std::os::unix::fs::FileExt::read_exact_at(&file, &mut header, 0);
        let count = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        if read.is_err()
            || &header[..4] != b"FTOK"
            || count.checked_mul(4).and_then(|b| b.checked_add(16)) != Some(size)
        {
            bail!("{}: not a complete token file; delete it and it will be rebuilt", cache.display());
        }
        let tokens = Tokens { file, path: cache, count: count as usize, fingerprint };
        // every id below the vocabulary, a chunk at a time (the file may be larger than memory)
        const CHUNK: usize = 1 << 20;
        for start in (0..tokens.count).step_by(CHUNK) {
            let ids = tokens.window(start, CHUNK.min(tokens.count - start))?;
            if let Some(&max) = ids.iter().max().filter(|&&m| m as usize >= vocab) {
                bail!("{}: holds token id {max}, but model.vocab_size = {vocab}; delete the file to rebuild it, or raise model.vocab_size", tokens.path.display());
            }
            crate::signals::check(|| format!("checking the token file {}", tokens.path.display()))?;
        }
        Ok(tokens)
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens `start..start + len`, read from the file; a file cut short since it was opened is
    /// an error naming it.
    pub fn window(&self, start: usize, len: usize) -> Result<Vec<u32>> {
        let mut bytes = vec![0u8; 4 * len];
        std::os::unix::fs::FileExt::read_exact_at(&self.file, &mut bytes, (HEADER + 4 * start) as u64).with_context(
            || {
                format!(
                    "{}: the token file changed under this run (cut short?); delete it and start again to rebuild it",
                    self.path.display()
                )
            },
        )?;
        Ok(bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))).collect())
    }
}

/// A text source: its shards in order (`data/documents.rs`), the text field of their rows, and a
/// name for its token file.
pub struct Source {
    pub shards: Vec<PathBuf>,
    pub column: String,
    pub name: String,
}

/// `CACHE/tokens/NAME.<fingerprint>.tokens`: the fingerprint covers every byte of every shard, in
/// order, the text column and the tokenizer's file (a 128-bit hash: two independent lanes).
/// Returns the path and the fingerprint.
fn cache_path(source: &Source, tokenizer: &Tokenizer, cache_folder: &Path) -> Result<(PathBuf, String)> {
    let mut hash = crate::files::Fingerprint::default();
    let mut buf = vec![0u8; 1 << 20];
    for shard in &source.shards {
        let mut file = crate::files::open_read(shard, "data.source")?;
        loop {
            crate::signals::check(|| format!("reading data.source ({})", shard.display()))?;
            let n = std::io::Read::read(&mut file, &mut buf)
                .with_context(|| format!("data.source: cannot read {}", shard.display()))?;
            if n == 0 {
                break;
            }
            hash.add(&buf[..n]);
        }
        hash.add(b"|shard|");
    }
    hash.add(format!("|column {}|tokenizer|", source.column).as_bytes());
    match tokenizer {
        Tokenizer::Bytes => hash.add(b"bytes"),
        Tokenizer::Bpe(_, path) => hash.add(&crate::files::read_bytes(path, "data.tokenizer")?),
    }
    let name: String =
        source.name.chars().map(|c| if c.is_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    let folder = cache_folder.join("tokens");
    std::fs::create_dir_all(&folder).with_context(|| {
        format!("data.cache_dir: cannot create {}; set data.cache_dir to a writable folder", folder.display())
    })?;
    Ok((folder.join(format!("{name}.{}.tokens", hash.hex())), hash.hex()))
}

/// Tokenises every document of every shard, joined by the end-of-text token, into `cache`.
fn write_tokens(source: &Source, tokenizer: &Tokenizer, cache: &Path) -> Result<()> {
    let total = source.shards.iter().map(|s| std::fs::metadata(s).map_or(0, |m| m.len())).sum();
    let bar = indicatif::ProgressBar::new(total).with_message(format!("tokenising {}", source.name));
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} ({eta})")
            .expect("a valid template"),
    );
    let (mut ids, mut docs): (Vec<u32>, usize) = (Vec::new(), 0);
    for shard in &source.shards {
        crate::data::documents::read(shard, &source.column, &mut |doc, bytes| {
            crate::signals::check(|| format!("tokenising {}", shard.display()))?; // no token file yet
            if docs > 0 {
                ids.extend(tokenizer.eos());
            }
            docs += 1;
            ids.extend(tokenizer.encode(doc)?);
            bar.inc(bytes);
            Ok(())
        })?;
    }
    bar.finish_and_clear();
    let mut bytes = Vec::with_capacity(HEADER + 4 * ids.len());
    bytes.extend(b"FTOK");
    bytes.extend(1u32.to_le_bytes());
    bytes.extend((ids.len() as u64).to_le_bytes());
    bytes.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
    crate::files::write_atomically(cache, &bytes).context("the token file")
}
