//! # The whole model, one step of generation at a time (the KV cache: `model/kv_cache.rs`)
//!
//! The same picture as `forward` — embedding, blocks, norm, output layer — run on the rows of
//! one sequence that are new since the last step, each block reading and extending its part of
//! the cache. No loss and nothing kept for a backward: the logits of the last row are the answer.

use super::Llama;
use crate::model::kv_cache::KvCache;
use crate::ops::tensor::Tensor;
use crate::ops::{self, Attn};
use anyhow::{bail, Result};

impl Llama<'_> {
    /// Runs `tokens` (a prompt, then one token a step) at positions `cache.len()..`, appending
    /// their keys and values to `cache`; returns the logits after the last of them (`vocab`
    /// values, on the host: the caller picks the next token from them).
    pub fn decode(&mut self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let (Some(embed), Some(head)) = (self.embed_tokens.as_ref(), self.head.as_ref()) else {
            bail!("generating needs the whole model: this one is a pipeline stage");
        };
        if self.tp.part().1 > 1 || tokens.is_empty() {
            bail!("generating needs the whole model on one rank and at least one token");
        }
        let n = tokens.len();
        let mut x = self.tp.embedding_forward(embed, tokens, self.vocab_first)?;
        let cfg = &self.cfg;
        let attn = Attn {
            batch: 1,
            seq: n,
            kv_seq: cache.len() + n,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim(),
        };
        let positions: Vec<u32> = (cache.len()..cache.len() + n).map(|p| p as u32).collect();
        for (i, layer) in self.layers.iter().enumerate() {
            // the block's forward, its attention the cache's: this step's keys join the cached ones
            x = layer.generate(&*self.tp, x, cfg, (attn, &positions), cache.layer(i))?;
            // nothing kept for a backward
        }
        cache.advance(n);
        // only the last row's logits are needed: the head runs on it alone
        let mut row = Tensor::empty_as(&[1, x.cols()], &x);
        ops::copy(&x, (n - 1) * x.cols(), &mut row, 0, x.cols());
        let (xn, _) = ops::rmsnorm(&row, &head.norm.value, cfg.rms_norm_eps);
        let out_layer = head.lm_head.as_ref().unwrap_or(embed);
        Ok(out_layer.linear(&xn).to_vec()) // on a GPU, a wait for the step
    }
}
