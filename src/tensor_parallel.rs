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
//! holds a part of dL/dx); `g` is an all-reduce forward and the identity backward. A column layer
//! followed by a row layer (q,k,v → attention → o; gate,up → SwiGLU → down) needs one `f` and
//! one `g` per block, and everything between them runs on each rank's own heads or features.
//!
//! The vocabulary is split the same way: the embedding table by rows (each rank looks up the
//! ids it holds, zeros for the others, then `g`), and the output layer is column parallel, so
//! every rank holds the logits of its slice of the vocabulary. The cross-entropy never gathers
//! them: it all-reduces three numbers per row (the max, the sum of exponentials, the target's
//! logit), and its backward is local. With tp = 1 every collective here is skipped, and the
//! same code is the dense model.

use crate::comm::{Group, ReduceOp};
use crate::model::Param;
use crate::ops;
use crate::tensor::Tensor;
use anyhow::Result;

/// The tp group a layer talks over; `None` on a single rank.
pub type Tp<'g> = Option<&'g Group>;

/// In-place all-reduce over the tp group (nothing to do alone).
fn all_reduce(tp: Tp, t: &mut Tensor, op: ReduceOp) -> Result<()> {
    match tp {
        Some(g) if g.size() > 1 => t.update_host(|v| g.all_reduce(v, op)),
        _ => Ok(()),
    }
}

/// Column parallel forward: `f` is the identity, so it is the local product.
pub fn column_forward(x: &Tensor, w: &Param) -> Tensor {
    ops::linear(x, &w.value)
}

/// Column parallel backward: dx is a sum over the ranks' output slices, so `f` all-reduces it,
/// asynchronously, while the weight-gradient GEMM runs.
pub fn column_backward(tp: Tp, dy: &Tensor, x: &Tensor, w: &mut Param) -> Result<Tensor> {
    let mut dx = ops::linear_input_grad(dy, &w.value);
    let pending = tp.filter(|g| g.size() > 1).map(|g| g.all_reduce_async(&dx.host_view(), ReduceOp::Sum));
    ops::linear_weight_grad(dy, x, &mut w.grad); // overlaps the all-reduce
    if let Some(handle) = pending {
        dx.write(&handle.wait()?);
    }
    Ok(dx)
}

/// Row parallel forward: each rank's partial product, summed by `g`.
pub fn row_forward(tp: Tp, x: &Tensor, w: &Param) -> Result<Tensor> {
    let mut y = ops::linear(x, &w.value);
    all_reduce(tp, &mut y, ReduceOp::Sum)?;
    Ok(y)
}

/// Row parallel backward: `g` is the identity backward; dx is this rank's slice of features.
pub fn row_backward(dy: &Tensor, x: &Tensor, w: &mut Param) -> Tensor {
    ops::linear_backward(dy, x, &w.value, &mut w.grad)
}

/// Vocab-parallel embedding: the table holds ids `first..`; the others contribute zeros.
pub fn embedding_forward(tp: Tp, table: &Param, tokens: &[u32], first: usize) -> Result<Tensor> {
    let mut x = ops::embedding(&table.value, tokens, first);
    all_reduce(tp, &mut x, ReduceOp::Sum)?;
    Ok(x)
}

/// Its backward is local: each rank accumulates the rows of the ids it holds.
pub fn embedding_backward(dx: &Tensor, tokens: &[u32], first: usize, table: &mut Param) {
    ops::embedding_backward(dx, tokens, first, &mut table.grad);
}

/// Cross-entropy over logits split by vocabulary (`logits` holds ids `first..`): returns (sum of
/// row losses, counted rows, per-row log-sum-exp over the *whole* vocabulary). Rows with a
/// negative target are ignored.
pub fn cross_entropy(tp: Tp, logits: &Tensor, targets: &[i32], first: usize) -> Result<(f64, usize, Tensor)> {
    let mut max = ops::row_max(logits);
    all_reduce(tp, &mut max, ReduceOp::Max)?;
    let mut sum_exp = ops::row_sum_exp(logits, &max);
    all_reduce(tp, &mut sum_exp, ReduceOp::Sum)?;
    let lse = ops::log_sum_exp(&max, &sum_exp);
    let mut target = ops::target_logits(logits, targets, first);
    all_reduce(tp, &mut target, ReduceOp::Sum)?;
    let (mut sum, mut count) = (0.0f64, 0);
    for ((&t, l), z) in targets.iter().zip(lse.to_vec()).zip(target.to_vec()) {
        if t >= 0 {
            sum += (l - z) as f64;
            count += 1;
        }
    }
    Ok((sum, count, lse))
}

/// Its backward, local to each slice: softmax − one-hot, scaled.
pub fn cross_entropy_backward(logits: &Tensor, targets: &[i32], first: usize, lse: &Tensor, scale: f32) -> Tensor {
    ops::cross_entropy_backward(logits, targets, first, lse, scale)
}

/// How a parameter is cut across the tp ranks.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Split {
    /// Every rank holds all of it (norm weights).
    Replicated,
    /// By rows: column-parallel weights (output features), the embedding and output layer (vocabulary).
    Rows,
    /// By columns: row-parallel weights (input features).
    Cols,
}

/// Rank `index` of `count`'s part of the full tensor `full`.
pub fn shard(full: &Tensor, split: Split, index: usize, count: usize) -> Tensor {
    let (rows, cols) = (full.rows(), full.cols());
    let data = full.to_vec();
    match split {
        Split::Replicated => full.clone(),
        Split::Rows => {
            let n = rows / count;
            let part = data[index * n * cols..(index + 1) * n * cols].to_vec();
            Tensor::from_vec(&[n, cols], part)
        }
        Split::Cols => {
            let n = cols / count;
            let part = data.chunks(cols).flat_map(|r| r[index * n..(index + 1) * n].iter().copied()).collect();
            Tensor::from_vec(&[rows, n], part)
        }
    }
}

/// The inverse of `shard`: the full tensor from every rank's part, in rank order.
pub fn unshard(parts: &[Tensor], split: Split) -> Tensor {
    let (rows, cols) = (parts[0].rows(), parts[0].cols());
    match split {
        Split::Replicated => parts[0].clone(),
        Split::Rows => Tensor::from_vec(&[rows * parts.len(), cols], parts.iter().flat_map(|p| p.to_vec()).collect()),
        Split::Cols => {
            let data: Vec<Vec<f32>> = parts.iter().map(|p| p.to_vec()).collect();
            let full =
                (0..rows).flat_map(|r| data.iter().flat_map(move |d| d[r * cols..(r + 1) * cols].iter().copied()));
            Tensor::from_vec(&[rows, cols * parts.len()], full.collect())
        }
    }
}
