//! # The output end: final norm, output layer, cross-entropy — and the loss without the logits
//!
//! ```text
//! x ─ rmsnorm ─ xn ─ lm_head: logits = xn · Wᵀ [rows, vocab] ─ log-softmax ─ loss = mean(lse − z)
//! backward:  dlogits = (softmax − one-hot) · scale / count;  dxn = dlogits · W;  dW += dlogitsᵀ · xn
//! ```
//! The logits are the largest activation of a small model: rows × vocab numbers (135M params,
//! 8 × 2048 rows, a 49,152-word vocabulary: 3.2 GB in f32), kept from forward for backward.
//! With `train.loss_chunk_rows` = R > 0 they never exist at once (llm.c's fused classifier,
//! TransformerEngine's fused cross-entropy): forward takes R rows at a time, computes their
//! logits, their loss, and at once their gradient (the loss's backward scale is known in
//! training: 1 / the micro-batches), so it can add the chunk's dW and write its rows of dxn
//! before the next chunk's logits are made. What is kept for backward is dxn, rows × hidden:
//! vocab / hidden times less. Backward then only sums dxn over the tp ranks (each had its slice
//! of the vocabulary) and goes on through the norm. The price: the scale must be fixed before
//! forward (`Llama::with_fused_loss`; a backward asking another one is an error), and the loss's
//! sum and dW's sum over rows are taken chunk by chunk (the same numbers within rounding).
//!
//! Vocab-parallel as before: each tp rank computes its slice of every chunk's logits, and the
//! row statistics (max, Σexp, the target's logit) are summed over the ranks per chunk.

use super::{FusedLoss, HeadCache, HeadOut, Llama, Unit};
use crate::model::param::Param;
use crate::model::weight_grads::WeightGrads;
use crate::ops::tensor::Tensor;
use crate::ops::{self, DType};
use anyhow::{bail, Result};

impl HeadCache {
    pub(super) fn bytes(&self) -> usize {
        let out = match &self.out {
            HeadOut::Logits { xn, logits, lse } => xn.bytes() + logits.bytes() + lse.bytes(),
            HeadOut::Fused { dxn, .. } => dxn.bytes(),
        };
        self.x_final.bytes() + self.rstd.bytes() + out
    }
}

impl Llama<'_> {
    /// The final norm, the output layer and the loss of `x` against `targets`: the mean loss
    /// (a one-number f32 tensor) and what backward needs.
    pub(super) fn head_forward(&mut self, x: Tensor, targets: &[i32]) -> Result<(Tensor, HeadCache)> {
        let first = self.vocab_first;
        self.fetch(Unit::Head, true)?;
        let h = self.head.as_mut().expect("the last stage has the head");
        let (xn, rstd) = ops::rmsnorm(&x, &h.norm.value, self.cfg.rms_norm_eps);
        let out_layer = h.lm_head.as_mut().or(self.embed_tokens.as_mut()).expect("a tied head has the embedding");
        let count = targets.iter().filter(|&&t| t >= 0).count();
        let (loss, out) = match self.fused_loss {
            None => {
                // column parallel: this rank's vocabulary slice of every row's logits
                let logits = ops::linear(&*self.tp.gather_rows(&xn)?, &out_layer.value, out_layer.precision);
                let (loss, _, lse) = self.tp.cross_entropy(&logits, targets, first)?;
                (loss, HeadOut::Logits { xn, logits, lse })
            }
            Some(FusedLoss { rows, scale }) => {
                out_layer.ensure_grad(); // its gradient is added here, in forward
                let xin = self.tp.gather_rows(&xn)?;
                let (n, d) = (xin.rows(), xin.cols());
                let mut loss = Tensor::zeros_on(&[1], &xin.place(), DType::F32);
                let mut dxn = Tensor::empty_as(&[n, d], &xin);
                for start in (0..n).step_by(rows) {
                    let r = rows.min(n - start);
                    let (xc, tc) = (ops::slice(&xin, start * d, &[r, d]), &targets[start..start + r]);
                    let logits = ops::linear(&xc, &out_layer.value, out_layer.precision); // [r, vocab slice]: the only logits
                    let (chunk_loss, chunk_count, lse) = self.tp.cross_entropy(&logits, tc, first)?;
                    ops::add_scaled(&mut loss, chunk_loss, chunk_count as f32 / count.max(1) as f32);
                    let dlogits = ops::cross_entropy_backward(&logits, tc, first, &lse, scale / count.max(1) as f32);
                    drop(logits);
                    ops::copy(
                        &ops::linear_input_grad(&dlogits, &out_layer.value, out_layer.precision),
                        0,
                        &mut dxn,
                        start * d,
                        r * d,
                    );
                    ops::linear_weight_grad(&dlogits, &xc, &mut out_layer.grad, out_layer.precision);
                }
                (loss, HeadOut::Fused { dxn, scale })
            }
        };
        self.free(Unit::Head);
        Ok((loss, HeadCache { targets: targets.to_vec(), x_final: x, rstd, count, out }))
    }

    /// The head's backward from the loss scaled by `scale`: returns dx; the output layer's
    /// weight GEMM goes to `w` (with the fused loss it was done in forward).
    pub(super) fn head_backward(
        &mut self,
        hc: HeadCache,
        scale: f32,
        w: &mut dyn WeightGrads,
        ready: &mut dyn FnMut(&mut Param),
    ) -> Result<Tensor> {
        let first = self.vocab_first;
        self.fetch(Unit::Head, false)?;
        let h = self.head.as_mut().expect("the last stage has the head");
        let dxn = match hc.out {
            HeadOut::Logits { xn, logits, lse } => {
                // softmax − one-hot on this rank's vocabulary slice: local, the lse is global
                let dlogits =
                    ops::cross_entropy_backward(&logits, &hc.targets, first, &lse, scale / hc.count.max(1) as f32);
                drop(logits);
                let out_layer =
                    h.lm_head.as_mut().or(self.embed_tokens.as_mut()).expect("a tied head has the embedding");
                self.tp.column_backward(xn, vec![(dlogits, out_layer)], w)?
            }
            HeadOut::Fused { dxn, scale: done } if done == scale => self.tp.sum_input_grad(dxn)?,
            HeadOut::Fused { scale: done, .. } => {
                bail!("backward: the fused loss made its gradient for a loss scale of {done} in forward, and backward asks for {scale}; set the scale with Llama::with_fused_loss")
            }
        };
        h.lm_head.iter_mut().for_each(&mut *ready); // a tied head's gradient is done with the embedding's
        let dx = ops::rmsnorm_backward(&dxn, &hc.x_final, &h.norm.value, &hc.rstd, &mut h.norm.grad, None);
        ready(&mut h.norm);
        self.free(Unit::Head);
        Ok(dx)
    }
}
