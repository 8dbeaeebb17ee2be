//! # FSDP's units: the pieces of the model whose weights are gathered together
//!
//! Under ZeRO-3 (`parallel/zero.rs`) a rank keeps 1/dp of every weight and the model asks its
//! `WeightSplit` for a unit's whole weights just before it computes with them, and frees them
//! after. A unit is the embedding, one block, or the head (the final norm and the output layer,
//! which is the embedding when they are tied). The forward and backward of `llama.rs` call
//! `fetch` and `free` around each unit; with `Whole` (no FSDP) both do nothing but, before a
//! backward, make sure each gradient exists.
//!
//! ```text
//! forward:   Embedding → Layer(0) → … → Layer(L-1) → Head       (each fetch prefetches the next)
//! backward:  Head → Layer(L-1) → … → Layer(0)                   (the embedding's needs no weight)
//! ```

use super::{Llama, Unit};
use crate::model::param::Param;
use anyhow::Result;

impl Llama<'_> {
    /// A unit's parameters: the embedding; a block's; the head's (the final norm and the output
    /// layer, which is the embedding when they are tied).
    fn unit(&self, u: Unit) -> Vec<&Param> {
        match u {
            Unit::Embedding => self.embed_tokens.iter().collect(),
            Unit::Layer(i) => self.layers[i].params(),
            Unit::Head => self
                .head
                .iter()
                .flat_map(|h| [Some(&h.norm), h.lm_head.as_ref().or(self.embed_tokens.as_ref())])
                .flatten()
                .collect(),
        }
    }

    fn unit_mut(&mut self, u: Unit) -> Vec<&mut Param> {
        match u {
            Unit::Embedding => self.embed_tokens.iter_mut().collect(),
            Unit::Layer(i) => self.layers[i].params_mut(),
            Unit::Head => {
                let Some(h) = &mut self.head else { return Vec::new() };
                vec![Some(&mut h.norm), h.lm_head.as_mut().or(self.embed_tokens.as_mut())]
                    .into_iter()
                    .flatten()
                    .collect()
            }
        }
    }

    /// The unit computed after `u` in a forward (`forward` true) or a backward of this stage.
    /// A backward never gathers the embedding: its gradient needs only the tokens.
    /// (With the interleaved pipeline, within the model chunk of `u`: the next chunk's turn
    /// comes later.)
    fn after(&self, u: Unit, forward: bool) -> Option<Unit> {
        let (layers, head) = (self.layers.len(), self.head.is_some());
        let chunk = |i: usize| self.chunks.iter().find(|c| c.contains(&i)).cloned().unwrap_or(0..layers);
        match (u, forward) {
            (Unit::Embedding, true) => Some(Unit::Layer(0)),
            (Unit::Layer(i), true) if i + 1 < chunk(i).end => Some(Unit::Layer(i + 1)),
            (Unit::Layer(i), true) => (head && chunk(i).end == layers).then_some(Unit::Head),
            (Unit::Head, false) => Some(Unit::Layer(layers - 1)),
            (Unit::Layer(i), false) => (i > chunk(i).start).then(|| Unit::Layer(i - 1)),
            _ => None,
        }
    }

    /// `u`'s whole weights, here before it computes (and, for a backward, its gradients to add
    /// into); the gather of the unit after it starts now.
    pub(super) fn fetch(&mut self, u: Unit, forward: bool) -> Result<()> {
        let weights = self.weights.clone();
        weights.gather(&mut self.unit_mut(u))?;
        if !forward {
            self.unit_mut(u).into_iter().for_each(Param::ensure_grad);
        }
        match self.after(u, forward) {
            Some(next) => weights.prefetch(&self.unit(next)),
            None => Ok(()),
        }
    }

    /// After `u` computed: its whole weights may go.
    pub(super) fn free(&mut self, u: Unit) {
        let weights = self.weights.clone();
        weights.release(&mut self.unit_mut(u));
    }
}
