//! # Parameters: a named weight, its gradient, and where it lives on the grid
//!
//! Every parameter carries its Hugging Face name (so checkpoints load by name and gradients
//! compare tensor by tensor), its gradient (accumulated by backward) and its placements
//! (`comm/placement.rs`): on the tp axis `Shard(0)`, `Shard(1)` or `Replicate`; on the axis of its
//! replicas (dp×cp, or for an expert the expert-data ranks) `Replicate`, or under ZeRO `Shard(0)`
//! of its flat values. A parameter is always made whole first, from its own (seed, name) random
//! stream, and then sliced for its tp rank (`placement::slice_of`), so every layout starts from
//! the same model.
//!
//! ```text
//! tp: Replicate: every rank the whole   Shard(0): rank r rows [r·n/tp, (r+1)·n/tp)   Shard(1): columns
//! ```

use crate::comm::process_grid::Axis;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::{DType, Precision};

pub use crate::comm::placement::Placement;

/// A named weight and its gradient (same shape, accumulated by backward).
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
    /// Its placement on the tp axis (`value` is this rank's slice): Shard(0), Shard(1) or Replicate.
    pub tp: Placement,
    /// The axis whose ranks hold the same slice of it and average its gradient: dp×cp, or for an
    /// expert the expert-data axis (`parallel/expert_parallel.rs`).
    pub replicas: Axis,
    /// With ZeRO (`parallel/zero.rs`) its placement on `replicas` is Shard(0) of its flat values,
    /// and this is this rank's chunk, which the optimizer updates; `value` is then a compute copy
    /// of the whole (ZeRO-1, 2), or empty except while gathered for a forward or backward
    /// (ZeRO-3), and `grad` is freed once handed over (2, 3). `None`: Replicate.
    pub zero: Option<ZeroChunk>,
    /// What its GEMMs read, for a linear layer's weight (`ops/fp8.rs`): f32 by default;
    /// `Llama::with_gemms` sets the run's precision.
    pub precision: Precision,
}

/// This rank's chunk of a parameter sharded over its replicas: the flat values
/// `[index · len, (index + 1) · len)` of the (zero-padded) tensor.
pub struct ZeroChunk {
    /// The axis whose ranks hold the other chunks: its replicas' axis, or under hybrid sharding
    /// the shard axis.
    pub axis: Axis,
    /// The fp32 master values of the chunk: what AdamW updates.
    pub master: Tensor,
    /// Their gradient, averaged over the data-parallel ranks (reduce-scattered); present from the
    /// end of backward to the next step's `zero_grads`.
    pub grad: Tensor,
    /// The shape of the whole parameter (this tp rank's part of it).
    pub shape: Vec<usize>,
}

impl Param {
    /// A parameter holding `value` (placed so on the tp axis), its gradient zero, replicated over
    /// the dp×cp ranks.
    pub fn new(name: String, value: Tensor, tp: Placement) -> Param {
        Param {
            grad: Tensor::zeros(value.shape()),
            name,
            value,
            tp,
            replicas: Axis::DpCp,
            zero: None,
            precision: Precision::F32,
        }
    }

    /// Its placement on `axis`: the tp slice, ZeRO's chunk on its replicas' axis, an expert's
    /// share of its layer's experts on the ep axis; replicated on any other axis.
    pub fn placement(&self, axis: Axis) -> Placement {
        match axis {
            Axis::Tp => self.tp,
            a if self.zero.as_ref().is_some_and(|z| z.axis == a) => Placement::Shard(0),
            Axis::Ep if self.is_expert() => Placement::Shard(0),
            _ => Placement::Replicate,
        }
    }

    /// The shape of the whole parameter (this tp rank's part), sharded or not.
    pub fn shape(&self) -> &[usize] {
        self.zero.as_ref().map_or(self.value.shape(), |s| &s.shape)
    }

    /// Where it lives (the CPU, or the rank's GPU), sharded or not.
    pub fn place(&self) -> Place {
        self.zero.as_ref().map_or(self.value.place(), |s| s.master.place())
    }

    /// One of a mixture of experts' experts: replicated over the expert-data ranks, since
    /// expert parallelism divides the experts among the ep ranks (`model/moe.rs` says so).
    pub fn is_expert(&self) -> bool {
        self.replicas == Axis::ExpertDp
    }

    /// Weight decay applies to matrices, not to norm weights.
    pub fn decays(&self) -> bool {
        self.shape().len() >= 2
    }

    /// What the optimizer updates, and with which gradient: the shard's master and gradient under
    /// ZeRO, else the weight itself (a mixed-precision weight: its fp32 master) and its gradient.
    pub fn trained(&mut self) -> (&mut Tensor, &mut Tensor) {
        match &mut self.zero {
            Some(s) => (&mut s.master, &mut s.grad),
            None => (&mut self.value, &mut self.grad),
        }
    }

    /// The gradient the optimizer reads (see `trained`).
    pub fn trained_grad(&self) -> &Tensor {
        self.zero.as_ref().map_or(&self.grad, |s| &s.grad)
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
