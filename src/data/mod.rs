//! # Data: a built-in synthetic language with a known floor, and plain text
//!
//! The default source needs no download and tells you how low the loss can go. Each sequence is
//! written left to right by a small machine with two modes:
//!
//! ```text
//! markov: next token ~ uniform over `branching` successors of the last `markov_order` tokens
//!         (a sparse table fixed by the seed), or, with probability copy_prob, the MARKER token
//! copy:   after a MARKER, the next copy_len tokens repeat the tokens copy_lag positions back
//!         …  a b c d e f g  …  MARKER a b c d  …      ← only attention can look copy_lag back
//! ```
//! The mode is always readable from the tokens already seen, so the best possible prediction of
//! each token has an exact entropy: ln(branching) for a plain Markov step, the entropy of the
//! marker coin plus ln(branching) when a marker may come, and 0 inside a copy span. Averaging that
//! over positions (a small dynamic programme over the mode) gives the floor, in nats per token,
//! that a perfect model reaches. A model that learns the Markov table but not to copy stays well
//! above it.
//!
//! The other source is real text, tokenised by `data/text.rs`; sequence `i` is a window of its tokens
//! at a place drawn from (data seed, i). Either way, sequence `i` of the run depends only on
//! (data seed, i), so the tokens of a step never depend on the topology.

pub mod bpe;
pub mod documents;
pub mod held_out;
pub mod hf_hub;
pub mod text;

use crate::config::{DataConfig, ModelConfig, TrainConfig};
use anyhow::{bail, Result};
use rand::Rng;

pub enum Dataset {
    Synthetic(Synthetic),
    /// Training reads windows of `tokens[..train_end]`; the rest is held out for validation.
    Text {
        tokens: crate::data::text::Tokens,
        seed: u64,
        train_end: usize,
        /// What made the tokens, to read them back as text (samples while training).
        tokenizer: crate::data::text::Tokenizer,
    },
}

pub struct Synthetic {
    seed: u64,
    vocab: usize,
    order: usize,
    branching: usize,
    copy_prob: f64,
    copy_len: usize,
    copy_lag: usize,
    /// `branching` successors for every context of `order` previous tokens.
    table: Vec<u32>,
}

/// The synthetic machine's mode before a token is written.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Markov,
    Copy(usize),
}

/// The rows of a micro-batch laid out `[batch × seq]` at positions `pos` of every sequence: what
/// a rank reads when it holds only some positions of each (the composition root says which).
pub fn rows_at<T: Copy>(data: &[T], seq: usize, pos: &[u32]) -> Vec<T> {
    data.chunks(seq).flat_map(|s| pos.iter().map(|&p| s[p as usize])).collect()
}

impl Dataset {
    /// Opens the source named by `data.source` (reading the file of a text source).
    pub fn open(d: &DataConfig, m: &ModelConfig) -> Result<Dataset> {
        let Some(source) = text_source(&d.source, &d.text_column)? else {
            return Ok(Dataset::Synthetic(Synthetic::new(d, m.vocab_size)));
        };
        {
            let tokenizer = crate::data::text::Tokenizer::load(&d.tokenizer)?;
            if tokenizer.vocab_size() > m.vocab_size {
                bail!(
                    "data.tokenizer {} has {} tokens, more than model.vocab_size = {}: raise model.vocab_size",
                    d.tokenizer,
                    tokenizer.vocab_size(),
                    m.vocab_size
                );
            }
            let cache = crate::files::cache_folder(&d.cache_dir)?;
            let tokens = crate::data::text::Tokens::open(&source, &tokenizer, m.vocab_size, &cache)?;
            let train_end = tokens.len();
            Ok(Dataset::Text { tokens, seed: d.seed, train_end, tokenizer })
        }
    }

    /// Sequence number `index` of the stream, `len` tokens long.
    pub fn sequence(&self, index: u64, len: usize) -> Result<Vec<u32>> {
        match self {
            Dataset::Synthetic(s) => Ok(s.sequence(index, len)),
            Dataset::Text { tokens, seed, train_end, .. } => {
                if *train_end < len {
                    bail!("data.source: the text has {train_end} tokens to train on, fewer than train.seq_len + 1 = {len}");
                }
                let start = crate::model::init::stream(*seed, &format!("text/{index}")).gen_range(0..=train_end - len);
                tokens.window(start, len)
            }
        }
    }

    /// The tokenizer of a text source (none for the synthetic one: it has no text).
    pub fn tokenizer(&self) -> Option<&crate::data::text::Tokenizer> {
        match self {
            Dataset::Synthetic(_) => None,
            Dataset::Text { tokenizer, .. } => Some(tokenizer),
        }
    }

    /// What a text source's tokens were made from, by content (`data/text.rs`): a resumed run and
    /// the processes of a run compare it. The synthetic source has none: its settings make it.
    pub fn fingerprint(&self) -> Option<&str> {
        match self {
            Dataset::Synthetic(_) => None,
            Dataset::Text { tokens, .. } => Some(&tokens.fingerprint),
        }
    }

    /// The tokens a text source trains on (its held-out tail excluded); none for the synthetic
    /// source, which never repeats.
    pub fn train_tokens(&self) -> Option<usize> {
        match self {
            Dataset::Synthetic(_) => None,
            Dataset::Text { train_end, .. } => Some(*train_end),
        }
    }

    /// The entropy floor of next-token prediction at this sequence length, where known.
    pub fn entropy_floor(&self, seq_len: usize) -> Option<f64> {
        match self {
            Dataset::Synthetic(s) => Some(s.entropy_floor(seq_len + 1)),
            Dataset::Text { .. } => None,
        }
    }

    /// Micro-batch `micro` of step `step` for data-parallel rank `dp_rank` of `dp`: (inputs,
    /// next-token targets), `micro_batch_size` rows. A step's global batch is the sequences
    /// `step·G .. (step+1)·G` with `G = micro_batch_size × grad_accum_steps × dp`; rank d reads the
    /// d-th contiguous slice of it. So the tokens of a step never depend on how it is cut.
    pub fn micro_batch(
        &self,
        t: &TrainConfig,
        (dp_rank, dp): (usize, usize),
        step: usize,
        micro: usize,
    ) -> Result<(Vec<u32>, Vec<i32>)> {
        let global = t.micro_batch_size * t.grad_accum_steps * dp;
        let first = (step * global + (dp_rank * t.grad_accum_steps + micro) * t.micro_batch_size) as u64;
        rows((first..first + t.micro_batch_size as u64).map(|i| self.sequence(i, t.seq_len + 1)))
    }
}

/// The documents `spec` names (`data.source`): `text:PATH` (a file, a folder or a glob) or
/// `hub:ORG/NAME/FILE` (listed from the Hub or its cache), each document the `column` of its row;
/// `None` for `synthetic`.
pub fn text_source(spec: &str, column: &str) -> Result<Option<crate::data::text::Source>> {
    let (shards, path) = match (spec.strip_prefix("text:"), spec.strip_prefix("hub:")) {
        (Some(path), _) => (crate::data::documents::shards(path)?, path),
        (_, Some(hub)) => (crate::data::hf_hub::dataset_files(hub)?, hub),
        _ => return Ok(None),
    };
    let name = path.trim_end_matches('/').rsplit('/').next().unwrap_or("source").to_string();
    Ok(Some(crate::data::text::Source { shards, column: column.to_string(), name }))
}

/// Sequences of seq_len + 1 tokens as model rows: (inputs: all but the last token of each,
/// targets: all but the first).
fn rows(sequences: impl Iterator<Item = Result<Vec<u32>>>) -> Result<(Vec<u32>, Vec<i32>)> {
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for s in sequences {
        let s = s?;
        inputs.extend_from_slice(&s[..s.len() - 1]);
        targets.extend(s[1..].iter().map(|&x| x as i32));
    }
    Ok((inputs, targets))
}

impl Synthetic {
    pub fn new(d: &DataConfig, vocab: usize) -> Synthetic {
        let content = vocab - 1; // the last id is the MARKER
        let contexts = (vocab + 1).pow(d.markov_order as u32);
        let mut rng = crate::model::init::stream(d.seed, "markov-table");
        let mut table = Vec::with_capacity(contexts * d.branching);
        let mut ids: Vec<u32> = (0..content as u32).collect();
        for _ in 0..contexts {
            for i in 0..d.branching {
                let j = rng.gen_range(i..content); // partial Fisher–Yates: distinct successors
                ids.swap(i, j);
            }
            table.extend_from_slice(&ids[..d.branching]);
        }
        Synthetic {
            seed: d.seed,
            vocab,
            order: d.markov_order,
            branching: d.branching,
            copy_prob: d.copy_prob,
            copy_len: d.copy_len,
            copy_lag: d.copy_lag,
            table,
        }
    }

    fn marker(&self) -> u32 {
        self.vocab as u32 - 1
    }

    /// The successors allowed after the tokens before position `t` (missing ones count as `vocab`).
    fn successors(&self, x: &[u32], t: usize) -> &[u32] {
        let ctx = (1..=self.order).fold(0, |acc, back| {
            let tok = if t >= back { x[t - back] as usize } else { self.vocab };
            acc * (self.vocab + 1) + tok
        });
        &self.table[ctx * self.branching..(ctx + 1) * self.branching]
    }

    /// May a marker be written at position `t`? Only once a copy has something to repeat.
    fn marker_allowed(&self, t: usize) -> bool {
        self.copy_prob > 0.0 && t >= self.copy_lag
    }

    fn next_mode(&self, mode: Mode, token: u32) -> Mode {
        match mode {
            Mode::Markov if token == self.marker() && self.copy_prob > 0.0 => Mode::Copy(0),
            Mode::Copy(j) if j + 1 < self.copy_len => Mode::Copy(j + 1),
            _ => Mode::Markov,
        }
    }

    pub fn sequence(&self, index: u64, len: usize) -> Vec<u32> {
        let mut rng = crate::model::init::stream(self.seed, &format!("sequence/{index}"));
        let mut x = vec![rng.gen_range(0..self.marker())];
        let mut mode = Mode::Markov;
        for t in 1..len {
            let tok = match mode {
                Mode::Copy(_) => x[t - self.copy_lag],
                Mode::Markov if self.marker_allowed(t) && rng.gen_bool(self.copy_prob) => self.marker(),
                Mode::Markov => self.successors(&x, t)[rng.gen_range(0..self.branching)],
            };
            x.push(tok);
            mode = self.next_mode(mode, tok);
        }
        x
    }

    /// Entropy (nats) of the next token at position `t` in `mode`.
    fn step_entropy(&self, mode: Mode, t: usize) -> f64 {
        let b = (self.branching as f64).ln();
        match mode {
            Mode::Copy(_) => 0.0,
            Mode::Markov if self.marker_allowed(t) => {
                let p = self.copy_prob;
                -p * p.ln() - (1.0 - p) * (1.0 - p).ln() + (1.0 - p) * b
            }
            Mode::Markov => b,
        }
    }

    /// Mean entropy of tokens 1..len given their past: the exact floor of the training loss.
    /// `p_markov` and `p_copy[j]` are the probabilities of each mode before writing token t.
    pub fn entropy_floor(&self, len: usize) -> f64 {
        let (mut p_markov, mut p_copy) = (1.0, vec![0.0; self.copy_len]);
        let mut total = 0.0;
        for t in 1..len {
            total += p_markov * self.step_entropy(Mode::Markov, t);
            let start = if self.marker_allowed(t) { p_markov * self.copy_prob } else { 0.0 };
            let end = p_copy.last().copied().unwrap_or(0.0);
            p_markov += end - start;
            p_copy.rotate_right(1);
            if let Some(first) = p_copy.first_mut() {
                *first = start;
            }
        }
        total / (len - 1) as f64
    }

    /// The source's own mean negative log-likelihood of tokens 1.. of `x`: what a perfect model
    /// scores on it. Averaged over many sequences it approaches `entropy_floor`.
    pub fn nll(&self, x: &[u32]) -> f64 {
        let mut mode = Mode::Markov;
        let mut total = 0.0;
        for t in 1..x.len() {
            let p = match mode {
                Mode::Copy(_) => (x[t] == x[t - self.copy_lag]) as u8 as f64,
                Mode::Markov => {
                    let (p_marker, p_rest) = match self.marker_allowed(t) {
                        true => (self.copy_prob, 1.0 - self.copy_prob),
                        false => (0.0, 1.0),
                    };
                    if x[t] == self.marker() {
                        p_marker
                    } else if self.successors(x, t).contains(&x[t]) {
                        p_rest / self.branching as f64
                    } else {
                        0.0
                    }
                }
            };
            total -= p.ln();
            mode = self.next_mode(mode, x[t]);
        }
        total / (x.len() - 1) as f64
    }
}
