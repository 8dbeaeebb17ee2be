//! # The loss without the logits: the fused loss, a stripe of rows at a time
//!
//! ```text
//! for each stripe of R rows of xn:  logits = xn_c · Wᵀ [R, vocab]   loss += their cross-entropy
//!                                  dlogits = (softmax − one-hot) · scale / count
//!                                  dxn_c = dlogits · W        dW += dlogitsᵀ · xn_c
//!                                  (the stripe's logits are dropped here)
//! ```
//! The logits are the largest activation of a small model: rows × vocab numbers (135M params,
//! 8 × 2048 rows, a 49,152-word vocabulary: 3.2 GB in f32), which the plain loss
//! (`llama.rs`'s `WholeLogits`) keeps from forward for backward. With `train.loss_stripe_rows`
//! = R > 0 they never exist at once (llm.c's fused classifier, TransformerEngine's fused
//! cross-entropy): forward takes R rows at a time, computes their logits, their loss, and at once
//! their gradient (the loss's backward scale is known in training: 1 / the micro-batches), so it
//! can add the stripe's dW and write its rows of dxn before the next stripe's logits are made. What
//! is kept for backward is dxn, rows × hidden: vocab / hidden times less. Backward then only sums
//! dxn over the tp ranks (each had its slice of the vocabulary) and goes on through the norm.
//! The price: the scale must be fixed before forward (a backward asking another one is an
//! error), and the loss's sum and dW's sum over rows are taken stripe by stripe (the same numbers
//! within rounding).
//!
//! It plugs into the model's loss seam (`LossHead`), chosen by the composition root
//! (`train/compose.rs`); vocab-parallel as the plain loss: each tp rank computes its slice of every
//! stripe's logits, and the row statistics are summed over the ranks per stripe.

use crate::model::llama::{LossHead, LossKept, OutputLayer};
use crate::model::split::WeightGrads;
use crate::ops::tensor::Tensor;
use crate::ops::{self, DType};
use anyhow::{bail, Result};

/// The fused loss: `rows` rows a stripe, its gradient made in forward for a backward of loss
/// scale `scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FusedLoss {
    pub rows: usize,
    pub scale: f32,
}

/// What it keeps: dxn, made in forward for `scale` (this rank's vocabulary slice's share:
/// Partial(sum) over tp).
struct Dxn {
    dxn: Tensor,
    scale: f32,
}

impl LossHead for FusedLoss {
    fn forward(&self, xn: Tensor, out: OutputLayer, targets: &[i32]) -> Result<(Tensor, Box<dyn LossKept>)> {
        let OutputLayer { weight, tp, first } = out;
        let count = targets.iter().filter(|&&t| t >= 0).count().max(1); // the loss is their mean
        weight.ensure_grad(); // its gradient is added here, in forward
        let xin = tp.gather_rows(&xn)?;
        let (n, d) = (xin.rows(), xin.cols());
        let mut loss = Tensor::zeros_on(&[1], &xin.place(), DType::F32);
        let mut dxn = Tensor::empty_as(&[n, d], &xin);
        for start in (0..n).step_by(self.rows) {
            let r = self.rows.min(n - start);
            let (xc, tc) = (ops::slice(&xin, start * d, &[r, d]), &targets[start..start + r]);
            let logits = weight.linear(&xc); // [r, vocab slice]: the only logits
            let (stripe_loss, stripe_count, lse) = tp.cross_entropy(&logits, tc, first)?;
            ops::add_scaled(&mut loss, stripe_loss, stripe_count as f32 / count as f32);
            let dlogits = ops::cross_entropy_backward(&logits, tc, first, &lse, self.scale / count as f32);
            drop(logits);
            ops::copy(&weight.linear_input_grad(&dlogits), 0, &mut dxn, start * d, r * d);
            weight.linear_weight_grad(&dlogits, &xc);
        }
        Ok((loss, Box::new(Dxn { dxn, scale: self.scale })))
    }
}

impl LossKept for Dxn {
    fn backward(self: Box<Self>, scale: f32, out: OutputLayer, _: &mut dyn WeightGrads) -> Result<Tensor> {
        if scale != self.scale {
            bail!("backward: the fused loss made its gradient for a loss scale of {} in forward, and backward asks for {scale}; set the scale with FusedLoss {{ scale, .. }}", self.scale)
        }
        out.tp.sum_input_grad(self.dxn) // the weight gradient was made in forward
    }

    fn bytes(&self) -> usize {
        self.dxn.bytes()
    }

    fn logits(&self) -> Option<&Tensor> {
        None // never held whole
    }
}
