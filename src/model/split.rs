//! # The model's seams: where a model cut across ranks must talk, and where its gradients go
//!
//! The model is written once, for one rank. When its matrices are cut across tensor-parallel
//! ranks or its sequences across context-parallel ranks, a few of its steps need the other ranks;
//! those steps are the methods below. The model calls them and knows nothing else of parallelism:
//! `Whole` (this rank holds every matrix and every token) answers them locally, and the lessons
//! `parallel/tensor_parallel.rs` and `parallel/context_parallel.rs` answer them with collectives.
//! (picotron swaps its model's layers for parallel ones; we hand the model the object that talks.)
//!
//! (A third, `WeightSplit`, says where the weights are between uses: ZeRO-3 gathers them. A
//! fourth, `LayerSplit`, says which layers this rank builds at all: a pipeline stage's.)
//!
//! ```text
//! TensorSplit (Megatron's f and g)                SequenceSplit (the cp ring)
//!   row_forward       o, down: Σ partial products    positions  which tokens of each sequence
//!   column_backward   q|k|v, gate|up: Σ dx           attention  every earlier key, wherever it is
//!   embedding_forward Σ vocabulary slices            attention_backward
//!                                                    attention_from  keys made from a smaller
//!                                                      source (`MakeKeys`), which travels instead
//!   cross_entropy     3 row statistics, all-reduced
//!   gather_rows       sequence parallelism: the rows between the layers are split too
//! ```
//! The other halves need no one: a column-parallel forward is `ops::linear` on this rank's
//! rows of W, a row-parallel backward `ops::linear_input_grad` and the
//! weight gradient (`WeightGrads::linear`) on its columns.
//!
//! ## Where a backward's weight gradients go: `WeightGrads`
//!
//! A linear layer y = x · Wᵀ has a backward of two GEMMs that need nothing of each other:
//!
//! ```text
//! B   dx  = dy · W        the input gradient: the layer before waits for it
//! W   dW += dyᵀ · x       the weight gradient: nobody reads it before the optimizer step
//! ```
//! The model's backward computes B itself and hands every W — each linear layer's, and the
//! embedding's scatter-add, whose backward is all weight gradient — to a `WeightGrads`. `Now`
//! computes it on the spot: the plain backward of every lesson. A later lesson, the zero-bubble
//! pipelines (`deferred_grads.rs`), plugs in another that keeps the W's inputs instead and runs
//! them later; what it deferred (`Deferred`) waits in the model for `Llama::backward_weights`.

use crate::model::param::Param;
use crate::ops::tensor::Tensor;
use crate::ops::{self, Attn};
use anyhow::Result;
use std::borrow::Cow;
use std::ops::Range;

/// How this rank's linear layers and vocabulary relate to the other tensor-parallel ranks'.
pub trait TensorSplit {
    /// This rank's place among the ranks that share each matrix: (index, count).
    fn part(&self) -> (usize, usize);

    /// How many ranks share the rows of the regions between the linear layers (norms,
    /// residuals, the block's input and output): 1, or tp with sequence parallelism.
    fn row_share(&self) -> usize {
        1
    }

    /// Every row of `x`, where this rank holds 1/`row_share` of them: before a column-parallel
    /// layer, and for the output gradient of a row-parallel one (sequence parallelism
    /// all-gathers; otherwise `x` is already whole).
    fn gather_rows<'t>(&self, x: &'t Tensor) -> Result<Cow<'t, Tensor>> {
        Ok(Cow::Borrowed(x))
    }

    /// A row-parallel layer: y = x · Wᵀ from this rank's input features, summed over the ranks
    /// (this rank's rows of the sum, with sequence parallelism).
    fn row_forward(&self, x: &Tensor, w: &Param) -> Result<Tensor>;

    /// The backward of column-parallel layers that read the same input `x` (q, k, v; gate, up),
    /// each `(dy, W)`: returns dx = Σ dy · W over the layers and the ranks, and hands every
    /// dW += dyᵀ · x to `dw` (now, or kept for a zero-bubble schedule's W: `deferred_grads.rs`). `x`
    /// and dx have this rank's rows (all of them without sequence parallelism).
    fn column_backward(&self, x: Tensor, layers: Vec<(Tensor, &mut Param)>, dw: &mut dyn WeightGrads)
        -> Result<Tensor>;

    /// An input gradient each rank made from its own slice of a column-parallel layer (the fused
    /// loss's dxn): summed over the ranks, this rank's rows kept.
    fn sum_input_grad(&self, dx: Tensor) -> Result<Tensor>;

    /// The rows of `tokens` from a table holding vocabulary ids `first..`, summed over the ranks.
    fn embedding_forward(&self, table: &Param, tokens: &[u32], first: usize) -> Result<Tensor>;

    /// Cross-entropy of logits holding vocabulary ids `first..`: (mean row loss, a one-number
    /// tensor on the logits' device; counted rows; per-row log-sum-exp over the whole vocabulary).
    /// Rows with a negative target are ignored.
    fn cross_entropy(&self, logits: &Tensor, targets: &[i32], first: usize) -> Result<(Tensor, usize, Tensor)>;
}

/// How this rank's tokens relate to the rest of each sequence.
pub trait SequenceSplit {
    /// The positions, in the whole sequence, of the `seq` tokens of each sequence this rank holds.
    fn positions(&self, seq: usize) -> Vec<u32>;

    /// Causal attention of this rank's queries (at `pos`) to every earlier key of the sequence.
    /// Returns (out, lse, work): work counts the query × key score entries computed.
    fn attention(&self, a: Attn, q: &Tensor, k: &Tensor, v: &Tensor, pos: &[u32]) -> Result<(Tensor, Tensor, u64)>;

    /// The backward of `attention`, from its `out` and `lse`: (dq, dk, dv) of this rank's tokens.
    fn attention_backward(
        &self,
        a: Attn,
        qkv: (&Tensor, &Tensor, &Tensor),
        pos: &[u32],
        out_lse: (&Tensor, &Tensor),
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)>;

    /// `attention` with keys and values an attention makes from something smaller (`keys` makes
    /// them from `source`, whose rows are this rank's tokens). By default they are made here and
    /// attended; a split that passes key blocks between ranks (the ring) passes the source
    /// instead and makes each block's keys where it lands.
    fn attention_from(
        &self,
        a: Attn,
        q: &Tensor,
        (source, keys): (&Tensor, &dyn MakeKeys),
        pos: &[u32],
    ) -> Result<(Tensor, Tensor, u64)> {
        let (k, v) = keys.keys(source);
        self.attention(a, q, &k, &v, pos)
    }

    /// The backward of `attention_from`: (dq, dsource) of this rank's tokens.
    fn attention_from_backward(
        &self,
        a: Attn,
        q: &Tensor,
        (source, keys): (&Tensor, &mut dyn MakeKeysBackward),
        pos: &[u32],
        out_lse: (&Tensor, &Tensor),
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (k, v) = keys.keys(source);
        let (dq, dk, dv) = self.attention_backward(a, (q, &k, &v), pos, out_lse, dout)?;
        Ok((dq, keys.keys_backward(source, &dk, &dv)))
    }
}

/// How an attention makes the keys and values of a block of tokens from its rows of a `source`
/// (`SequenceSplit::attention_from`).
pub trait MakeKeys {
    /// (k, v) of the block whose rows of the source are `source`.
    fn keys(&self, source: &Tensor) -> (Tensor, Tensor);
}

/// `MakeKeys` and its backward.
pub trait MakeKeysBackward: MakeKeys {
    /// The gradient of `source` from the gradients of the keys and values made from it; the
    /// gradients of the weights that made them go where the maker sends them.
    fn keys_backward(&mut self, source: &Tensor, dk: &Tensor, dv: &Tensor) -> Tensor;
}

/// Where this rank's weights are between uses. `Whole`: here, always (replicas, ZeRO-1 and 2).
/// FSDP (ZeRO-3, `parallel/zero.rs`): each rank keeps 1/dp of every weight, and the model asks
/// for a unit's (a block's, the embedding's, the head's) whole weights just before it computes
/// with them and frees them right after.
pub trait WeightSplit {
    /// Before a unit's forward or backward: its weights whole.
    fn gather(&self, unit: &mut [&mut Param]) -> Result<()>;
    /// The unit the model will compute with next: its gather may start now, while this one computes.
    fn prefetch(&self, next: &[&Param]) -> Result<()>;
    /// After the unit's forward or backward: its whole weights are freed again.
    fn release(&self, unit: &mut [&mut Param]);
}

/// Which of the model's layers this rank holds, in which chunks (a chunk: layers computed one
/// after another, between two hand-overs), and whether it holds the embedding before the first
/// and the head after the last. `Whole`: every layer in one chunk, with both ends. A pipeline
/// stage (`model/stage.rs`) holds one piece of the layers, or several.
pub trait LayerSplit {
    /// The layers (of `n`) of each chunk, in order.
    fn chunk_layers(&self, n: usize) -> Vec<Range<usize>>;
    /// Holds the embedding (before its chunk 0).
    fn has_embedding(&self) -> bool;
    /// Holds the final norm, the output layer and the loss (after its last chunk).
    fn has_head(&self) -> bool;
}

/// Where a backward's weight gradients go.
pub trait WeightGrads {
    /// dW += dyᵀ · x for each `(dy, W)` of `layers`, all reading `x`.
    fn linear(&mut self, x: Cow<Tensor>, layers: Vec<(Cow<Tensor>, &mut Param)>);
    /// The embedding's backward: `table`'s rows += `dx`'s rows by token id (from `first`).
    fn embedding(&mut self, table: &mut Param, dx: Cow<Tensor>, tokens: &[u32], first: usize);
    /// What it deferred, when the backward is done (`None`: nothing, all is computed).
    fn deferred(&mut self) -> Option<Box<dyn Deferred>> {
        None
    }
}

/// Weight gradients a backward deferred: the W of a zero-bubble pipeline.
pub trait Deferred {
    /// Runs them into the gradients of `params` (found by name).
    fn apply(self: Box<Self>, params: &mut [&mut Param]);
    /// The bytes they hold until then (activation memory).
    fn bytes(&self) -> usize;
}

/// One rank holds every matrix whole and every sequence whole: nothing to talk about.
pub struct Whole;

impl LayerSplit for Whole {
    fn chunk_layers(&self, n: usize) -> Vec<Range<usize>> {
        std::iter::once(0..n).collect() // one chunk: every layer
    }
    fn has_embedding(&self) -> bool {
        true
    }
    fn has_head(&self) -> bool {
        true
    }
}

impl WeightSplit for Whole {
    fn gather(&self, _: &mut [&mut Param]) -> Result<()> {
        Ok(())
    }
    fn prefetch(&self, _: &[&Param]) -> Result<()> {
        Ok(())
    }
    fn release(&self, _: &mut [&mut Param]) {}
}

/// Every weight gradient computed as backward meets it.
pub struct Now;

impl WeightGrads for Now {
    fn linear(&mut self, x: Cow<Tensor>, layers: Vec<(Cow<Tensor>, &mut Param)>) {
        layers.into_iter().for_each(|(dy, p)| p.linear_weight_grad(&dy, &x))
    }

    fn embedding(&mut self, table: &mut Param, dx: Cow<Tensor>, tokens: &[u32], first: usize) {
        ops::embedding_backward(&dx, tokens, first, &mut table.grad)
    }
}

impl TensorSplit for Whole {
    fn part(&self) -> (usize, usize) {
        (0, 1)
    }
    fn row_forward(&self, x: &Tensor, w: &Param) -> Result<Tensor> {
        Ok(w.linear(x))
    }
    fn column_backward(
        &self,
        x: Tensor,
        layers: Vec<(Tensor, &mut Param)>,
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let dx = input_grad(&layers);
        dw.linear(Cow::Owned(x), owned(layers));
        Ok(dx)
    }
    fn sum_input_grad(&self, dx: Tensor) -> Result<Tensor> {
        Ok(dx)
    }
    fn embedding_forward(&self, table: &Param, tokens: &[u32], first: usize) -> Result<Tensor> {
        Ok(ops::embedding(&table.value, tokens, first))
    }
    fn cross_entropy(&self, logits: &Tensor, targets: &[i32], first: usize) -> Result<(Tensor, usize, Tensor)> {
        let max = ops::row_max(logits);
        let lse = ops::log_sum_exp(&max, &ops::row_sum_exp(logits, &max));
        Ok(row_losses(targets, lse, &ops::target_logits(logits, targets, first)))
    }
}

impl SequenceSplit for Whole {
    fn positions(&self, seq: usize) -> Vec<u32> {
        (0..seq as u32).collect()
    }
    fn attention(&self, a: Attn, q: &Tensor, k: &Tensor, v: &Tensor, pos: &[u32]) -> Result<(Tensor, Tensor, u64)> {
        let (out, lse) = ops::attention(a, q, k, v, (pos, pos));
        Ok((out, lse, (a.batch * a.heads * a.seq * a.kv_seq) as u64))
    }
    fn attention_backward(
        &self,
        a: Attn,
        qkv: (&Tensor, &Tensor, &Tensor),
        pos: &[u32],
        out_lse: (&Tensor, &Tensor),
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Ok(ops::attention_backward(a, qkv, (pos, pos), out_lse, dout))
    }
}

/// dx = Σ dy · W over layers that read the same input: this rank's part of the input gradient.
pub fn input_grad(layers: &[(Tensor, &mut Param)]) -> Tensor {
    let (first, rest) = layers.split_first().expect("at least one layer");
    let mut dx = first.1.linear_input_grad(&first.0);
    for (dy, w) in rest {
        w.linear_input_grad_add(dy, &mut dx);
    }
    dx
}

/// The layers' output gradients as `WeightGrads::linear` takes them.
pub fn owned(layers: Vec<(Tensor, &mut Param)>) -> Vec<(Cow<'static, Tensor>, &mut Param)> {
    layers.into_iter().map(|(dy, p)| (Cow::Owned(dy), p)).collect()
}

/// (the mean of lse − target logit over the rows with a target, as a one-number tensor where
/// the logits are: on a GPU nobody waits for it here; their count; lse).
pub fn row_losses(targets: &[i32], lse: Tensor, target: &Tensor) -> (Tensor, usize, Tensor) {
    let count = targets.iter().filter(|&&t| t >= 0).count();
    let mut loss = Tensor::zeros_as(&[1], &lse); // f32, like the row statistics
    ops::add_loss(&mut loss, (&lse, target), targets, 1.0 / count.max(1) as f32);
    (loss, count, lse)
}
