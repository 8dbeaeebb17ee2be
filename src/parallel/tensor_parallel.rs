//! # Tensor parallelism: one layer's matrices split across the ranks of a tp group
//!
//! A linear layer `y = x · Wᵀ` with `W: [out, in]` can be cut two ways (Megatron-LM):
//!
//! ```text
//! column parallel (W split by output rows)      row parallel (W split by input columns)
//!   x ──f──▶ x·W₀ᵀ = y₀   (rank 0)                 x₀ ──▶ x₀·W₀ᵀ ─┐
//!     └─f──▶ x·W₁ᵀ = y₁   (rank 1)                 x₁ ──▶ x₁·W₁ᵀ ─┴─g──▶ y = Σ partial
//!   y stays split by features                      x arrives split by features
//! ```
//! `f` is the identity forward and an all-reduce of the input gradient backward (every rank
//! holds a part of dL/dx); `g` is an all-reduce forward and the identity backward. A block is
//! column layers, then per-rank work on its own heads or features, then a row layer, twice
//! (q,k,v → attention → o; gate,up → SwiGLU → down), so per block it takes:
//!
//! ```text
//! forward:  g after o, g after down                                    2 all-reduces
//! backward: f for q|k|v (their three input gradients summed first),
//!           f for gate|up (likewise)                                   2 all-reduces
//! ```
//! The layers that read the same input share one `f`: dx = dy_q·W_q + dy_k·W_k + dy_v·W_v is
//! summed on the rank, then all-reduced once, and that all-reduce runs while the rank computes
//! the weight gradients (dW += dyᵀ·x), which need no one. The forward of a column layer and the
//! backward of a row layer are local (`ops::linear`; `ops::linear_input_grad` and
//! `WeightGrads::linear` in `model/block.rs`).
//!
//! The vocabulary is split the same way: the embedding table by rows (each rank looks up the
//! ids it holds, zeros for the others, then `g`), and the output layer is column parallel, so
//! every rank holds the logits of its slice of the vocabulary. The cross-entropy never gathers
//! them: it all-reduces three numbers per row (the max, the sum of exponentials, the target's
//! logit), and its backward is local. With tp = 1 every collective here is skipped, and the
//! same code is the dense model.
//!
//! This is the model's `TensorSplit` (`model/split.rs`): the block calls these methods at the
//! points where its ranks must talk.

use crate::comm::{Group, ReduceOp};
use crate::model::split::{input_grad, owned, row_losses, WeightGrads};
use crate::model::{Param, TensorSplit};
use crate::ops;
use crate::ops::tensor::Tensor;
use anyhow::Result;
use std::borrow::Cow;

/// This rank's part of tensor parallelism: the tp group its layers talk over.
pub struct TensorParallel<'g> {
    group: &'g Group,
}

impl<'g> TensorParallel<'g> {
    pub fn new(group: &'g Group) -> TensorParallel<'g> {
        TensorParallel { group }
    }

    /// In-place all-reduce over the tp group (the same call on the CPU and on GPUs, where NCCL
    /// does it on the device: `comm/tensors.rs`).
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.group.all_reduce_tensor(t, op)
    }
}

impl TensorSplit for TensorParallel<'_> {
    fn part(&self) -> (usize, usize) {
        (self.group.index(), self.group.size())
    }

    /// Row parallel forward: each rank's partial product, summed by `g`.
    fn row_forward(&self, x: &Tensor, w: &Param) -> Result<Tensor> {
        let mut y = w.linear(x);
        self.all_reduce(&mut y, ReduceOp::Sum)?; // g
        Ok(y)
    }

    /// Column parallel backward of the layers reading `x`: this rank's dx = Σ dy·W, then `f`
    /// all-reduces it, asynchronously, while the weight-gradient GEMMs run.
    fn column_backward(
        &self,
        x: Tensor,
        layers: Vec<(Tensor, &mut Param)>,
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let pending = self.group.all_reduce_tensor_async(input_grad(&layers), ReduceOp::Sum)?; // f, started
        dw.linear(Cow::Owned(x), owned(layers)); // overlaps the all-reduce (or kept for later)
        pending.wait()
    }

    /// f: the partial input gradients summed.
    fn sum_input_grad(&self, mut dx: Tensor) -> Result<Tensor> {
        self.all_reduce(&mut dx, ReduceOp::Sum)?;
        Ok(dx)
    }

    /// Vocab-parallel embedding: the table holds ids `first..`; the others contribute zeros.
    fn embedding_forward(&self, table: &Param, tokens: &[u32], first: usize) -> Result<Tensor> {
        let mut x = ops::embedding(&table.value, tokens, first);
        self.all_reduce(&mut x, ReduceOp::Sum)?; // g
        Ok(x)
    }

    /// Cross-entropy over logits split by vocabulary: three statistics per row, all-reduced.
    fn cross_entropy(&self, logits: &Tensor, targets: &[i32], first: usize) -> Result<(Tensor, usize, Tensor)> {
        let mut max = ops::row_max(logits);
        self.all_reduce(&mut max, ReduceOp::Max)?;
        let mut sum_exp = ops::row_sum_exp(logits, &max);
        self.all_reduce(&mut sum_exp, ReduceOp::Sum)?;
        let lse = ops::log_sum_exp(&max, &sum_exp);
        let mut target = ops::target_logits(logits, targets, first); // 0 outside this rank's slice
        self.all_reduce(&mut target, ReduceOp::Sum)?;
        Ok(row_losses(targets, lse, &target))
    }
}
