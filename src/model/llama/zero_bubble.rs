//! # W later: the weight gradients a zero-bubble B left in the model (lesson 15)
//!
//! A zero-bubble schedule's B runs a chunk's backward with a `WeightGrads` that keeps each weight
//! GEMM's inputs instead of computing it (`model/deferred_grads.rs`); what it kept waits in the
//! model, one entry per micro-batch and chunk (`model/llama/pipeline.rs` puts it there). The
//! schedule's W for that chunk runs them here, oldest first, and only then are the chunk's
//! gradients complete for data parallelism.

use super::Llama;
use crate::model::param::Param;
use anyhow::{anyhow, Result};

impl Llama<'_> {
    /// The W half: the weight GEMMs of the oldest micro-batch whose backward through `chunk`
    /// deferred them (`split.rs`). Then `ready` sees every parameter of the chunk, in
    /// backward's order. It gathers no weight (a weight gradient reads none).
    pub fn backward_weights(&mut self, chunk: usize, ready: &mut dyn FnMut(&mut Param)) -> Result<()> {
        let oldest = self.deferred.iter().position(|(c, _)| *c == chunk);
        let (_, kept) = oldest.and_then(|at| self.deferred.remove(at)).ok_or_else(|| {
            anyhow!("backward: no backward through chunk {chunk} is waiting for its weight gradients")
        })?;
        // a tied output layer is the embedding: its gradient is complete in chunk 0's W only
        let embedding = self.embed_tokens.as_ref().map(|e| e.name.clone()).filter(|_| chunk != 0);
        let mut params = self.chunk_params_mut(chunk);
        kept.apply(&mut params);
        params.into_iter().filter(|p| Some(&p.name) != embedding.as_ref()).for_each(ready);
        Ok(())
    }

    /// The parameters of model chunk `chunk`, in backward's order: the head's (after the last
    /// chunk), the blocks' from the last, the embedding (before chunk 0, or as the head's tied
    /// output layer; once).
    fn chunk_params_mut(&mut self, chunk: usize) -> Vec<&mut Param> {
        let mut v: Vec<&mut Param> = Vec::new();
        let mut tied = false;
        if let Some(h) = self.head.as_mut().filter(|_| chunk + 1 == self.chunks.len()) {
            v.push(&mut h.norm);
            tied = h.lm_head.is_none();
            v.extend(h.lm_head.as_mut());
        }
        for layer in self.layers[self.chunks[chunk].clone()].iter_mut().rev() {
            v.extend(layer.params_mut());
        }
        v.extend(self.embed_tokens.as_mut().filter(|_| chunk == 0 || tied));
        v
    }
}
