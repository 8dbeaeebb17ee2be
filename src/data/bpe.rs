//! # A tokenizer of your own: byte-level BPE, learned from your text
//!
//! With `data.tokenizer = "bytes"` every byte is a token: nothing to learn, nothing unknown, but a
//! model then spends its positions and its compute on spelling — a 128-token window holds 128
//! bytes of text. Byte-pair encoding (BPE; Sennrich et al. 2016, GPT-2's byte-level variant) learns
//! a vocabulary from the text instead:
//!
//! ```text
//! start   the 256 bytes are the tokens (so any text encodes: nothing is ever unknown)
//! split   the text into words: a regex keeps letters, digits and punctuation apart and a space
//!         with the word after it (" cat"); no merge crosses a word
//! repeat  count every pair of adjacent tokens inside the words, weighted by each word's count;
//!         the most frequent pair becomes a new token ("t" + "h" → "th", then "th" + "e" → "the");
//!         until the vocabulary has `vocab_size` tokens
//! encode  split, then apply the merges in the order they were learned
//! ```
//! Frequent words become one token, rare ones stay a few: on English prose a few thousand
//! merges already make a token about 3–4 bytes. A window of seq_len tokens then covers several
//! times the text, and although each token is harder to predict (its loss per token rises), the
//! loss per byte — the number that compares tokenizers — falls (step 01's lesson measures it).
//!
//! The training itself is the `tokenizers` crate's `BpeTrainer` (what Hugging Face trains with);
//! this file streams the documents of a text source to it (`documents.rs`: a file, a folder, a
//! glob of `.txt`, `.jsonl` and `.parquet` shards) and lays the tokenizer out as GPT-2's: byte-level
//! pre-tokenizer and decoder, and `<|endoftext|>`, the token that joins documents in a token file
//! (`text.rs`). The result is a `tokenizer.json` that `data.tokenizer` takes and transformers loads
//! (`PreTrainedTokenizerFast(tokenizer_file=…)`), encoding every text to the same ids.

use crate::data::text::Source;
use anyhow::{bail, Context, Result};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The token that ends each document (the first name `text.rs` looks for).
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// The smallest vocabulary: the 256 bytes and the end-of-text token.
pub const MIN_VOCAB: usize = 257;
/// The largest vocabulary learnt: 8 times the largest in use (Gemma 3's 262,144). The trainer
/// of `tokenizers` sizes its tables by the vocabulary before it reads a word, so a size past any
/// use is refused here, before it allocates (10⁹ aborted the process in that allocation).
pub const MAX_VOCAB: usize = 1 << 21;

/// What a training read and made.
pub struct Learned {
    pub tokenizer: Tokenizer,
    pub documents: usize,
    pub bytes: u64,
}

/// Learns a byte-level BPE of `vocab_size` tokens (the 256 bytes, `<|endoftext|>` and the merges)
/// from every document of `source`. Pairs seen fewer than twice are never merged, so a small text
/// may give fewer tokens than asked. A signal stops it at the next document.
pub fn learn(source: &Source, vocab_size: usize) -> Result<Learned> {
    if vocab_size < MIN_VOCAB {
        bail!("--vocab-size {vocab_size}: a byte-level BPE has the 256 bytes and {END_OF_TEXT} at least; give {MIN_VOCAB} or more");
    }
    if vocab_size > MAX_VOCAB {
        bail!("--vocab-size {vocab_size}: more than {MAX_VOCAB} tokens, 8 times the largest vocabulary in use (262,144); give at most {MAX_VOCAB}");
    }
    let mut tokenizer = Tokenizer::new(BPE::default());
    // GPT-2's layout: no space added before the text, offsets trimmed, the split regex on
    let byte_level = ByteLevel::new(false, true, true);
    tokenizer.with_pre_tokenizer(Some(byte_level)).with_decoder(Some(byte_level));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .show_progress(false)
        .build()
        .into();
    // the documents stream from a reader thread: the corpus is never held whole, only its words'
    // counts (what the trainer keeps)
    let (send, receive) = std::sync::mpsc::sync_channel::<String>(256);
    let shards = source.shards.clone();
    let column = source.column.clone();
    let reader = std::thread::spawn(move || -> Result<(usize, u64)> {
        let (mut documents, mut bytes) = (0, 0);
        for shard in &shards {
            crate::data::documents::read(shard, &column, &mut |doc, _| {
                crate::signals::check(|| format!("learning a tokenizer from {}", shard.display()))?;
                (documents, bytes) = (documents + 1, bytes + doc.len() as u64);
                send.send(doc.to_string()).map_err(|_| anyhow::anyhow!("the tokenizer's training stopped"))
            })?;
        }
        Ok((documents, bytes))
    });
    let trained = tokenizer.train(&mut trainer, receive.into_iter());
    let read = reader.join().map_err(|_| anyhow::anyhow!("the document reader panicked"))?;
    let (documents, bytes) = read?; // a reading error (or a signal) is the cause of a failed training
    trained.map_err(|e| anyhow::anyhow!("learning the tokenizer: {e}"))?;
    if bytes == 0 {
        bail!("SOURCE: {} holds no text to learn from (every document of it is empty)", source.name);
    }
    Ok(Learned { tokenizer, documents, bytes })
}

/// `learned` as the JSON of a `tokenizer.json`.
pub fn to_json(learned: &Learned) -> Result<String> {
    learned.tokenizer.to_string(false).map_err(|e| anyhow::anyhow!("{e}")).context("writing the tokenizer")
}
