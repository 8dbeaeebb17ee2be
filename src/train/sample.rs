//! # Samples while training: what the model writes, every so often
//!
//! A loss says how well the model predicts; a sample shows it. Every `train.sample_every` steps
//! (and after the last), the model greedily continues a prompt by `train.sample_tokens` tokens:
//! `train.sample_prompt` through `data.tokenizer`, or by default the first 16 tokens of the
//! held-out data (of the text itself where a text source holds nothing out). On the synthetic
//! data a sample shows the copying the loss cannot: after a MARKER, a model that has learned
//! attention writes the tokens `copy_lag` back again.
//!
//! It is validation's sibling (`validate.rs`): rank 0 decodes with the whole model, gathered
//! once for both, by the decode loop `ferrotron generate` runs (`model/sampling.rs`), so a
//! sample is the same under every layout. Greedy, so it repeats exactly. A signal ends it at the
//! next token.

use crate::config::Config;
use crate::data::Dataset;
use crate::model::sampling::{generate, Sampling};
use crate::model::Llama;
use anyhow::{Context, Result};

/// How many tokens of the held-out data a sample continues by default.
const PROMPT_TOKENS: usize = 16;

/// Is there a sample after step `step`?
pub(super) fn due(cfg: &Config, step: usize) -> bool {
    let every = cfg.train.sample_every;
    every > 0 && ((step + 1).is_multiple_of(every) || step + 1 == cfg.train.steps)
}

/// The prompt's tokens: `train.sample_prompt` encoded, or the data's first tokens.
pub(super) fn prompt(cfg: &Config, data: &Dataset) -> Result<Vec<u32>> {
    let text = &cfg.train.sample_prompt;
    let ids = match data.tokenizer() {
        Some(t) if !text.is_empty() => t.encode(text).context("train.sample_prompt")?,
        _ => data.first_tokens(PROMPT_TOKENS.min(cfg.train.seq_len))?,
    };
    if ids.is_empty() {
        anyhow::bail!("train.sample_prompt = {text:?} is no tokens: give some text to continue (or \"\" for the data's first tokens)");
    }
    // the model trains on seq_len positions: a prompt longer is a prefill past anything it saw
    // (and, at 36,000 tokens, one that no signal could stop for many seconds)
    if ids.len() > cfg.train.seq_len {
        anyhow::bail!(
            "train.sample_prompt is {} tokens, more than train.seq_len = {}: give a prompt of at most that many tokens",
            ids.len(),
            cfg.train.seq_len
        );
    }
    Ok(ids)
}

/// `prompt` continued by `whole` (rank 0's gathered model) as a line of text, or of token ids
/// where the data has no text; `None` when a signal cut it short.
pub(super) fn sample(cfg: &Config, data: &Dataset, whole: &mut Llama, prompt: &[u32]) -> Result<Option<String>> {
    let greedy = Sampling { max_new_tokens: cfg.train.sample_tokens, temperature: 0.0, top_k: 0, seed: 0 };
    let eos: Vec<u32> = data.tokenizer().and_then(|t| t.eos()).into_iter().collect();
    let new = match generate(whole, prompt, &greedy, &eos, &mut |_| crate::signals::check(|| "sampling".into())) {
        Err(e) => match crate::signals::interrupted(&e) {
            // the run then stops after this step, as it would without a sample
            Some(sig) => {
                crate::say!("sample cut short by {}", crate::signals::name(sig));
                return Ok(None);
            }
            None => return Err(e),
        },
        Ok(new) => new,
    };
    let shown = |ids: &[u32]| -> Result<String> {
        Ok(match data.tokenizer() {
            Some(t) => format!("{:?}", t.decode(ids)?), // quoted: line breaks and spaces stay visible
            None => ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" "),
        })
    };
    Ok(Some(format!("{} → {}", shown(prompt)?, shown(&new)?)))
}
