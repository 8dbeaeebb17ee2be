//! # Parameters: a named weight, its gradient, and how it is cut across ranks
//!
//! Every parameter carries its Hugging Face name (so checkpoints load by name and gradients
//! compare tensor by tensor), its gradient (accumulated by backward) and its `Split`: how the
//! tensor-parallel ranks share it. A parameter is always made whole first, from its own
//! (seed, name) random stream, and then cut (`shard`), so every layout starts from the same model;
//! `unshard` puts the parts back together for a checkpoint.
//!
//! ```text
//! Replicated: every rank the whole   Rows: rank r rows [r·n/tp, (r+1)·n/tp)   Cols: rank r columns
//! ```

use crate::ops::tensor::Tensor;

/// A named weight and its gradient (same shape, accumulated by backward).
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
    /// How it is cut across the tp ranks (`value` is this rank's part).
    pub split: Split,
}

/// What a parameter is, which decides its init: matrices are N(0, std²), norm weights ones.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum ParamKind {
    Matrix,
    Norm,
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
