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

use crate::ops::tensor::{Place, Tensor};
use crate::ops::DType;

/// A named weight and its gradient (same shape, accumulated by backward).
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
    /// How it is cut across the tp ranks (`value` is this rank's part).
    pub split: Split,
    /// With ZeRO (`parallel/zero.rs`): this rank's 1/dp of the parameter, which the optimizer
    /// updates; `value` is then a compute copy of the whole (ZeRO-1, 2), or empty except while
    /// gathered for a forward or backward (ZeRO-3), and `grad` is freed once handed over (2, 3).
    pub shard: Option<Shard>,
}

/// This rank's chunk of a parameter sharded over the data-parallel ranks: the flat values
/// `[index · len, (index + 1) · len)` of the (zero-padded) tensor.
pub struct Shard {
    /// The fp32 master values of the chunk: what AdamW updates.
    pub master: Tensor,
    /// Their gradient, averaged over the data-parallel ranks (reduce-scattered); present from the
    /// end of backward to the next step's `zero_grads`.
    pub grad: Tensor,
    /// The shape of the whole parameter (this tp rank's part of it).
    pub shape: Vec<usize>,
}

impl Param {
    /// A parameter holding `value`, its gradient zero.
    pub fn new(name: String, value: Tensor, split: Split) -> Param {
        Param { grad: Tensor::zeros(value.shape()), name, value, split, shard: None }
    }

    /// The shape of the whole parameter (this tp rank's part), sharded or not.
    pub fn shape(&self) -> &[usize] {
        self.shard.as_ref().map_or(self.value.shape(), |s| &s.shape)
    }

    /// Where it lives (the CPU, or the rank's GPU), sharded or not.
    pub fn place(&self) -> Place {
        self.shard.as_ref().map_or(self.value.place(), |s| s.master.place())
    }

    /// One of a mixture of experts' experts (Hugging Face's Mixtral names): expert parallelism
    /// divides them among ranks, and their gradients are averaged over other ranks.
    pub fn is_expert(&self) -> bool {
        self.name.contains(".block_sparse_moe.experts.")
    }

    /// Weight decay applies to matrices, not to norm weights.
    pub fn decays(&self) -> bool {
        self.shape().len() >= 2
    }

    /// What the optimizer updates, and with which gradient: the shard's master and gradient under
    /// ZeRO, else the weight itself (a mixed-precision weight: its fp32 master) and its gradient.
    pub fn trained(&mut self) -> (&mut Tensor, &mut Tensor) {
        match &mut self.shard {
            Some(s) => (&mut s.master, &mut s.grad),
            None => (&mut self.value, &mut self.grad),
        }
    }

    /// The gradient the optimizer reads (see `trained`).
    pub fn trained_grad(&self) -> &Tensor {
        self.shard.as_ref().map_or(&self.grad, |s| &s.grad)
    }

    /// Makes the gradient again, zero, where ZeRO-2/3 freed it after handing it over: before a
    /// backward that adds into it.
    pub fn ensure_grad(&mut self) {
        if self.grad.numel() == 0 {
            self.grad = Tensor::zeros_on(self.shape(), &self.place(), DType::F32);
        }
    }
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
