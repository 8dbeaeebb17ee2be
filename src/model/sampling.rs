//! # Sampling from a model: the decode loop, and how the next token is picked
//!
//! A language model gives, after each position, a score (logit) for every token of the
//! vocabulary. Generating is a loop around that:
//!
//! ```text
//! prompt ─ decode (all its rows at once, filling the KV cache) ─ logits ─ pick ─ token
//!            ▲                                                               │
//!            └──────────── decode (one row: the new token) ◀─────────────────┘
//! ```
//! until `max_new_tokens` or an end-of-text token. `decode` and its cache are `kv_cache.rs`; this
//! file picks:
//!
//! - temperature 0: the most likely token (greedy; ties to the lowest id, as `argmax` does) —
//!   what transformers' `generate(do_sample=False)` returns;
//! - temperature T > 0: a draw from softmax(logits / T) over the `top_k` most likely tokens (0:
//!   all of them), from a ChaCha stream seeded by `seed`, so a run repeats exactly. Small T
//!   sharpens the distribution towards greedy, large T flattens it; top-k cuts the long tail of
//!   unlikely tokens that would otherwise be drawn now and then.
//!
//! `ferrotron generate` (`commands/generate.rs`) and the samples a run prints while it trains
//! (`train/sample.rs`) both run it.

use crate::model::kv_cache::KvCache;
use crate::model::Llama;
use anyhow::{bail, Result};
use rand::Rng;

/// How the next token is picked, and how many.
#[derive(Clone, Debug)]
pub struct Sampling {
    pub max_new_tokens: usize,
    /// 0: greedy.
    pub temperature: f32,
    /// Draw among this many most likely tokens; 0: all.
    pub top_k: usize,
    pub seed: u64,
}

impl Sampling {
    /// Every setting checked, naming the flag.
    pub fn check(&self) -> Result<()> {
        if self.max_new_tokens == 0 {
            bail!("--max-new-tokens 0 generates nothing: give 1 or more");
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!("--temperature {}: give a finite number ≥ 0 (0 is greedy)", self.temperature);
        }
        Ok(())
    }
}

/// Generates after `prompt`: the new tokens, ending with the end-of-text token if one of `eos`
/// came. `on_token` sees each as it is picked (to print it at once); an error it returns ends the
/// generation with that error (a signal while sampling during training).
pub fn generate(
    model: &mut Llama,
    prompt: &[u32],
    s: &Sampling,
    eos: &[u32],
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    s.check()?;
    let vocab = model.cfg.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        bail!("the prompt holds token id {bad}, but the model's vocabulary has {vocab} tokens");
    }
    let mut cache = KvCache::new(model.cfg.num_hidden_layers);
    let mut rng = crate::model::init::stream(s.seed, "generate");
    let mut logits = model.decode(prompt, &mut cache)?;
    let mut new = Vec::new(); // grown as tokens come: a stop at end-of-text reserves no more
    loop {
        let token = pick(&logits, s.temperature, s.top_k, &mut rng);
        new.push(token);
        on_token(token)?;
        if eos.contains(&token) || new.len() == s.max_new_tokens {
            return Ok(new);
        }
        logits = model.decode(&[token], &mut cache)?;
    }
}

/// The next token from `logits`: the largest (temperature 0), or a draw from the softmax at
/// `temperature` over the `top_k` largest (0: all).
pub fn pick(logits: &[f32], temperature: f32, top_k: usize, rng: &mut impl Rng) -> u32 {
    let argmax = |l: &[f32]| l.iter().enumerate().fold(0, |best, (i, &x)| if x > l[best] { i } else { best });
    if temperature == 0.0 {
        return argmax(logits) as u32;
    }
    // the candidates, most likely first (ties: lower id first)
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if top_k > 0 {
        order.truncate(top_k);
    }
    // softmax over them, from the largest (so no exp overflows)
    let top = logits[order[0]] as f64;
    let weights: Vec<f64> = order.iter().map(|&i| ((logits[i] as f64 - top) / temperature as f64).exp()).collect();
    let mut draw = rng.gen::<f64>() * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        if draw < *w {
            return i as u32;
        }
        draw -= w;
    }
    order[0] as u32 // only reached through rounding at the very end of the range
}
