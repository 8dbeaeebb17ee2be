//! # B now, W later: the weight gradients kept for the zero-bubble pipelines
//!
//! A linear layer y = x · Wᵀ has a backward of two GEMMs that need nothing of each other:
//!
//! ```text
//! B   dx  = dy · W        the input gradient: the layer before waits for it (and, on a
//!                         pipeline, the stage before)
//! W   dW += dyᵀ · x       the weight gradient: nobody reads it before the optimizer step
//! ```
//! Every backward runs both where it meets them (`Now`, the seam's first implementation in
//! `split.rs`). The zero-bubble pipelines (Qi et al. 2023, `parallel/pipeline_zero_bubble.rs`)
//! run B at once, so the gradient leaves for the previous stage sooner, and W later, in time the
//! stage would otherwise spend idle: the backward is given `Later`, which keeps, instead of
//! computing, each weight GEMM's two inputs (x and dy); the model holds what it kept until the
//! schedule says W (`Llama::backward_weights`), which runs them.
//!
//! What waits: every linear layer's weight GEMM (q, k, v, o, gate, up, down, the router, each
//! expert's w1, w2, w3, the output layer) and the embedding's scatter-add (its backward is all
//! weight gradient). What does not: the RMSNorms' weight gradients, a row sum that falls out of
//! the kernel computing their input gradient. What it costs: between B and W a micro-batch
//! still holds each GEMM's input x (an activation it held anyway, now kept past B) and its
//! output gradient dy (new: about what the activations of the layer outputs were). The schedules
//! bound how many micro-batches wait for their W; `train/memory.rs` counts them.
//!
//! Nothing changes in the numbers: the same GEMMs run on the same inputs into the same
//! gradients, in the same order per parameter, so a split backward is bitwise the plain one.

use crate::model::param::Param;
use crate::model::split::{Deferred, WeightGrads};
use crate::ops;
use crate::ops::tensor::Tensor;
use std::borrow::Cow;

/// Every weight gradient kept, in backward's order, for later.
#[derive(Default)]
pub struct Later(Vec<Job>);

/// One weight gradient a backward left for later (a W job).
enum Job {
    /// dW += dyᵀ · x for each named parameter that reads the same input x.
    Linear { x: Tensor, dys: Vec<(String, Tensor)> },
    /// The embedding table's rows += the gradient of the rows that looked them up (ids from
    /// `first`: a vocab-parallel slice).
    Embedding { name: String, dx: Tensor, tokens: Vec<u32>, first: usize },
}

impl WeightGrads for Later {
    fn linear(&mut self, x: Cow<Tensor>, layers: Vec<(Cow<Tensor>, &mut Param)>) {
        let dys = layers.into_iter().map(|(dy, p)| (p.name.clone(), dy.into_owned())).collect();
        self.0.push(Job::Linear { x: x.into_owned(), dys });
    }

    fn embedding(&mut self, table: &mut Param, dx: Cow<Tensor>, tokens: &[u32], first: usize) {
        let (name, tokens) = (table.name.clone(), tokens.to_vec());
        self.0.push(Job::Embedding { name, dx: dx.into_owned(), tokens, first });
    }

    fn deferred(&mut self) -> Option<Box<dyn Deferred>> {
        Some(Box::new(std::mem::take(&mut self.0)))
    }
}

impl Deferred for Vec<Job> {
    fn apply(self: Box<Self>, params: &mut [&mut Param]) {
        self.into_iter().for_each(|d| d.apply(params));
    }

    fn bytes(&self) -> usize {
        self.iter().map(Job::bytes).sum()
    }
}

impl Job {
    /// Runs it into the gradients of `params` (found by name).
    fn apply(self, params: &mut [&mut Param]) {
        match self {
            Job::Linear { x, dys } => {
                for (name, dy) in dys {
                    let p = grad_of(params, &name);
                    p.linear_weight_grad(&dy, &x)
                }
            }
            Job::Embedding { name, dx, tokens, first } => {
                ops::embedding_backward(&dx, &tokens, first, &mut grad_of(params, &name).grad)
            }
        }
    }

    /// The bytes it keeps.
    fn bytes(&self) -> usize {
        match self {
            Job::Linear { x, dys } => x.bytes() + dys.iter().map(|(_, dy)| dy.bytes()).sum::<usize>(),
            Job::Embedding { dx, tokens, .. } => dx.bytes() + tokens.len() * 4,
        }
    }
}

/// The parameter named `name` among `params`, its gradient made if it was freed (ZeRO-2 and 3
/// free a gradient once handed over; a W may be the first to add into it this step).
fn grad_of<'a>(params: &'a mut [&mut Param], name: &str) -> &'a mut Param {
    let p = params.iter_mut().find(|p| p.name == name).expect("a deferred gradient's parameter is among those given");
    p.ensure_grad();
    p
}
