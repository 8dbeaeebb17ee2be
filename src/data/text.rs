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
//! rename it into place. Opening reads every id once: each must be below the vocabulary, and
//! together they must give the checksum the header holds, so a cache damaged since it was
//! written (zeroed blocks, a bit flipped) is found before it trains anything, and is tokenised
//! again from the source, with a note; so is a file of the first version, which had no checksum.
//!
//! ```text
//! CACHE/tokens/NAME.<fp>.tokens:  "FTOK" | version u32 = 2 | count u64 | checksum 2 × u64
//!                                 | count × u32 token ids            (all little-endian)
//! checksum: files::Fingerprint of the ids' bytes
//! ```

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

pub enum Tokenizer {
    Bytes,
    /// A Hugging Face tokenizer, the `tokenizer.json` it came from, and that file's fingerprint.
    Bpe(Box<tokenizers::Tokenizer>, PathBuf, String),
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
        let bytes = crate::files::read_bytes(&path, "data.tokenizer")?;
        let mut print = crate::files::Fingerprint::default();
        print.add(&bytes);
        let t = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| anyhow::anyhow!("data.tokenizer: cannot load {} as a tokenizer.json: {e}", path.display()))?;
        Ok(Tokenizer::Bpe(Box::new(t), path, print.hex()))
    }

    /// What the tokenizer is, by content: `bytes`, or the fingerprint of its `tokenizer.json`
    /// (recorded in each checkpoint of a text run; `generate` compares it).
    pub fn fingerprint(&self) -> &str {
        match self {
            Tokenizer::Bytes => "bytes",
            Tokenizer::Bpe(_, _, print) => print,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Bpe(t, ..) => t.get_vocab_size(true),
        }
    }

    /// The token that separates documents, if the tokenizer has one.
    pub fn eos(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Bpe(t, ..) => EOS_NAMES.iter().find_map(|n| t.token_to_id(n)),
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
            Tokenizer::Bpe(t, ..) => t.decode(ids, false).map_err(|e| anyhow::anyhow!("tokenizer: {e}")),
        }
    }

    /// The ids of `text`, without special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Bpe(t, ..) => {
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

/// The token file's header: "FTOK", the version, the count, the checksum.
const HEADER: usize = 32;
/// The version this build writes; a file of another (version 1 had no checksum) is rebuilt.
const VERSION: u32 = 2;

impl Tokens {
    /// Opens the token file of `source` for `tokenizer`, writing it first if needed; checks that
    /// every id is below `vocab` (a stale or foreign file would index past the embedding) and that
    /// the ids give the header's checksum. A file of another version, or whose ids do not give its
    /// checksum, is tokenised again from the source (whose bytes its name's fingerprint was just
    /// taken of), with a note.
    pub fn open(source: &Source, tokenizer: &Tokenizer, vocab: usize, cache_folder: &Path) -> Result<Tokens> {
        let (cache, fingerprint) = cache_path(source, tokenizer, cache_folder)?;
        if !cache.exists() {
            write_tokens(source, tokenizer, &cache)?;
        }
        match Tokens::check(&cache, &fingerprint, vocab)? {
            Checked::Good(tokens) => Ok(tokens),
            Checked::Stale(why) => {
                crate::say!("note: the token file {} {why}: tokenising {} again", cache.display(), source.name);
                write_tokens(source, tokenizer, &cache)?;
                match Tokens::check(&cache, &fingerprint, vocab)? {
                    Checked::Good(tokens) => Ok(tokens),
                    Checked::Stale(why) => {
                        bail!("{}: {why} even when written again; is the disk sound?", cache.display())
                    }
                }
            }
        }
    }

    /// Reads the token file `path` once whole: its header, every id against `vocab`, the checksum.
    fn check(path: &Path, fingerprint: &str, vocab: usize) -> Result<Checked> {
        let file = crate::files::open_read(path, "the token file")?;
        let size = file.metadata().with_context(|| format!("cannot read {}", path.display()))?.len();
        let mut header = [0u8; HEADER];
        let word = |h: &[u8; HEADER], at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
        let read = std::os::unix::fs::FileExt::read_exact_at(&file, &mut header[..8], 0);
        if read.is_err() || &header[..4] != b"FTOK" {
            return Ok(Checked::Stale("does not begin as a token file does".into()));
        }
        let version = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        if version != VERSION {
            let why = format!("is of version {version}, this build reads version {VERSION} (with a checksum)");
            return Ok(Checked::Stale(why));
        }
        let read = std::os::unix::fs::FileExt::read_exact_at(&file, &mut header, 0);
        let count = word(&header, 8);
        if read.is_err() || count.checked_mul(4).and_then(|b| b.checked_add(HEADER as u64)) != Some(size) {
            return Ok(Checked::Stale(format!("is not complete ({size} bytes, its header counting {count} tokens)")));
        }
        let want = [word(&header, 16), word(&header, 24)];
        let tokens = Tokens { file, path: path.into(), count: count as usize, fingerprint: fingerprint.into() };
        // every id below the vocabulary and into the checksum, a chunk at a time (the file may be
        // larger than memory)
        const CHUNK: usize = 1 << 20;
        let mut sum = crate::files::Fingerprint::default();
        let mut largest = 0;
        for start in (0..tokens.count).step_by(CHUNK) {
            let bytes = tokens.bytes(start, CHUNK.min(tokens.count - start))?;
            sum.add(&bytes);
            largest = ids_of(&bytes).fold(largest, u32::max);
            crate::signals::check_leaving(|| {
                let (path, done) = (tokens.path.display(), start * 100 / tokens.count.max(1));
                (
                    format!("checking the token file {path} ({done} % read)"),
                    "the token file stays as it is, to be checked again by the next run".to_string(),
                )
            })?;
        }
        if sum.value() != want {
            return Ok(Checked::Stale(
                "holds ids that do not give the checksum in its header (damaged since it was written)".into(),
            ));
        }
        if largest as usize >= vocab {
            bail!("{}: holds token id {largest}, but model.vocab_size = {vocab}; raise model.vocab_size to the tokenizer's vocabulary", tokens.path.display());
        }
        Ok(Checked::Good(tokens))
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
        Ok(ids_of(&self.bytes(start, len)?).collect())
    }

    /// The bytes of tokens `start..start + len`.
    fn bytes(&self, start: usize, len: usize) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; 4 * len];
        std::os::unix::fs::FileExt::read_exact_at(&self.file, &mut bytes, (HEADER + 4 * start) as u64).with_context(
            || {
                format!(
                    "{}: the token file changed under this run (cut short?); delete it and start again to rebuild it",
                    self.path.display()
                )
            },
        )?;
        Ok(bytes)
    }
}

/// The ids little-endian `bytes` hold.
fn ids_of(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
}

/// What reading a token file whole found.
enum Checked {
    Good(Tokens),
    /// It is to be written again, for this reason.
    Stale(String),
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
        Tokenizer::Bpe(_, path, _) => hash.add(&crate::files::read_bytes(path, "data.tokenizer")?),
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
    // a signal during the last document: its ids are not written either
    crate::signals::check(|| format!("tokenising {}", source.name))?;
    let mut bytes = Vec::with_capacity(HEADER + 4 * ids.len());
    bytes.extend(b"FTOK");
    bytes.extend(VERSION.to_le_bytes());
    bytes.extend((ids.len() as u64).to_le_bytes());
    bytes.extend([0; 16]); // the checksum, once the ids are in
    bytes.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
    let mut sum = crate::files::Fingerprint::default();
    sum.add(&bytes[HEADER..]);
    let checksum: Vec<u8> = sum.value().iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes[16..HEADER].copy_from_slice(&checksum);
    crate::files::write_atomically(cache, &bytes).context("the token file")
}
