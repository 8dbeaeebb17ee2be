//! # A tied embedding across the pipeline: one weight on two stages
//!
//! A tied model reads one matrix twice: the embedding looks its rows up on the way in, the output
//! layer multiplies by it on the way out. Cut into stages, the embedding lives on the first stage
//! and the output layer on the last, so the last stage holds a copy (`Llama::build` makes it as it
//! makes the embedding: same name, same values). Each copy's backward gives only its own half of
//! the gradient; the weight's gradient is their sum. So once a step — after data parallelism has
//! averaged each over its replicas, before the norm and the update — the two stages swap their
//! halves and both add them up (Megatron's "embedding group"):
//!
//! ```text
//! stage 0      g_embed ──────────────┐ ┌──── g_embed + g_head      (the same sum on both, so the
//! stage p−1    g_head  ──────────────┘ └──── g_head + g_embed       same update keeps them equal)
//! ```
//! Each rank swaps with the rank holding the same part of the other copy: the same tp slice of
//! the vocabulary, the same ZeRO partition (a partition is cut from each parameter alone, so the
//! two stages' line up). The gradient norm counts the weight once (the first stage's: the last
//! names its copy in `NormGroups::copies`), and a checkpoint holds it once. Where one stage holds
//! both ends (ZBV's V, or no pipeline) there is no copy and nothing to swap.

use crate::comm::Group;
use crate::model::Param;
use crate::ops;
use crate::parallel::data_parallel::GradReduce;
use anyhow::Result;

/// The name both copies of a tied embedding have.
const EMBEDDING: &str = "model.embed_tokens.weight";

/// The swap of a tied embedding's gradient with the stage holding its other copy.
pub struct TiedEmbedding<'g> {
    pub pp: &'g Group,
    /// The other copy's stage (its place in the pp group).
    pub peer: usize,
}

impl GradReduce for TiedEmbedding<'_> {
    fn grad_ready(&mut self, _: &mut Param, _: bool) {} // the swap waits for the replicas' average

    fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        for p in params.iter_mut().filter(|p| p.name == EMBEDDING) {
            let (_, grad) = p.trained(); // under ZeRO this rank's partition of it
            let other = self.pp.send_recv_tensor(grad, self.peer, grad.shape(), self.peer)?;
            ops::add_assign(grad, &other);
        }
        Ok(())
    }
}
