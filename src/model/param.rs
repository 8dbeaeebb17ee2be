//! # Parameters: a named weight, its gradient, and how tensor parallelism cuts it
//!
//! Every parameter carries its Hugging Face name (so checkpoints load by name and gradients
//! compare tensor by tensor), its gradient (accumulated by backward) and how tensor parallelism
//! cuts it (`TpCut`: its rows, its columns, or whole on every rank). What the optimizer updates is the weight itself, unless a
//! later lesson keeps a trained part apart (ZeRO keeps only this rank's partition of the master:
//! `TrainedPart`). A parameter is always made whole first, from its own (seed, name) random
//! stream, and then cut for its tp rank (`ops::tp_part`), so every layout starts from the same
//! model.
//!
//! ```text
//! tp: Whole: every rank all of W   Rows: rank r rows [r·n/tp, (r+1)·n/tp) of W [n, ·]   Columns: its columns
//! ```

use crate::ops::tensor::{Place, Tensor};
use crate::ops::{self, DType, Precision, TpCut};
use std::any::Any;

/// A named weight and its gradient (same shape, accumulated by backward).
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
    /// How tensor parallelism cuts it (`value` is this rank's part): rows, columns, or whole.
    pub tp: TpCut,
    /// Its trained part, where a later lesson keeps it apart from `value`: then the optimizer
    /// updates that part with its own gradient, and `value` is only what forward and backward
    /// compute with. `None`: the optimizer updates `value` itself with `grad` (`Param::trained`).
    pub trained_part: Option<Box<dyn TrainedPart>>,
    /// What its GEMMs read, for a linear layer's weight (mixed precision, `ops/precision.rs`): f32
    /// by default;
    /// `Llama::with_gemms` sets the run's precision.
    pub precision: Precision,
}

/// A parameter's trained part kept apart from its `value` (say, only this rank's partition of its
/// fp32 master): the values the optimizer updates, their gradient, and the whole parameter's
/// shape. The lesson that keeps it so implements this for its own type (and, `Any` being its
/// supertrait, reads the type back with a downcast).
pub trait TrainedPart: Any {
    /// The values the optimizer updates, and their gradient.
    fn trained(&mut self) -> (&mut Tensor, &mut Tensor);
    fn values(&self) -> &Tensor;
    fn grad(&self) -> &Tensor;
    /// The shape of the whole parameter (this tp rank's part of it).
    fn shape(&self) -> &[usize];
}

impl Param {
    /// A parameter holding `value` (its part, cut so by tensor parallelism), its gradient zero.
    pub fn new(name: String, value: Tensor, tp: TpCut) -> Param {
        Param { grad: Tensor::zeros(value.shape()), name, value, tp, trained_part: None, precision: Precision::F32 }
    }

    /// The shape of the whole parameter (this tp rank's part), sharded or not.
    pub fn shape(&self) -> &[usize] {
        self.trained_part.as_ref().map_or(self.value.shape(), |t| t.shape())
    }

    /// Where it lives (the CPU, or the rank's GPU), sharded or not.
    pub fn place(&self) -> Place {
        self.trained_part.as_ref().map_or(self.value.place(), |t| t.values().place())
    }

    // A linear layer's GEMMs with this weight, each read as `precision` says (f32 unless a
    // later lesson sets it: `with_gemms`).

    /// y = x · Wᵀ: `x` [rows, in], W [out, in] → [rows, out].
    pub fn linear(&self, x: &Tensor) -> Tensor {
        ops::linear(x, &self.value, self.precision)
    }

    /// Its backward to the input: dx = dy · W.
    pub fn linear_input_grad(&self, dy: &Tensor) -> Tensor {
        ops::linear_input_grad(dy, &self.value, self.precision)
    }

    /// `linear_input_grad` added into `dx`.
    pub fn linear_input_grad_add(&self, dy: &Tensor, dx: &mut Tensor) {
        ops::linear_input_grad_add(dy, &self.value, self.precision, dx)
    }

    /// Its backward to the weight: grad += dyᵀ · x.
    pub fn linear_weight_grad(&mut self, dy: &Tensor, x: &Tensor) {
        ops::linear_weight_grad(dy, x, &mut self.grad, self.precision)
    }

    /// Weight decay applies to matrices, not to norm weights.
    pub fn decays(&self) -> bool {
        self.shape().len() >= 2
    }

    /// Makes the gradient again, zero, where it was freed after being handed over (ZeRO-2/3): before a
    /// backward that adds into it.
    pub fn ensure_grad(&mut self) {
        if self.grad.numel() == 0 {
            self.grad = Tensor::zeros_on(self.shape(), &self.place(), DType::F32);
        }
    }
}

/// What a parameter is, which decides its init: matrices are N(0, std²), norm weights ones; a
/// buffer (a tensor a part keeps but no optimizer trains, PyTorch's word) zeros.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum ParamKind {
    Matrix,
    Norm,
    Buffer,
}
