//! # Sequence parallelism: tensor parallelism that also splits the tokens between its layers
//!
//! Under tensor parallelism (`tensor_parallel.rs`) the attention and MLP matrices are split, but
//! what lies between them — the RMSNorms, the residual adds, the block's input and output — is
//! computed by every tp rank on every token, and every rank keeps the same copy of those
//! activations for backward. Sequence parallelism (Megatron-LM, Korthikanti et al. 2022) splits
//! those regions by tokens instead: each tp rank holds rows/tp of them (a contiguous run of the
//! micro-batch's `batch × seq` rows; norms and residuals treat every token alone, so any cut by
//! tokens would do).
//!
//! ```text
//!            rows/tp                      all rows, split heads/features             rows/tp
//! x ─ rmsnorm ─ xn ──ḡ──▶ q,k,v ─ attention ─ o ──r̄──▶ (+) ─ rmsnorm ──ḡ──▶ gate,up ─ … ─ down ──r̄──▶ (+)
//!
//! ḡ  forward: all-gather the rows          backward: reduce-scatter the input gradient
//! r̄  forward: reduce-scatter the partial   backward: all-gather the output gradient (the
//!    products (sum, keep my rows)          row layer's local backward reads every row)
//! ```
//! Tensor parallelism's `g` (an all-reduce after o and down, identity backward) becomes a
//! reduce-scatter forward and an all-gather backward, and its `f` (identity forward, an
//! all-reduce of the input gradient of q|k|v and gate|up backward) becomes an all-gather forward
//! and a reduce-scatter backward. An all-reduce *is* a reduce-scatter then an all-gather, so the
//! bytes on the wire hardly change (`comm/cost.rs`), while the norm and residual activations
//! each rank keeps fall by tp. To keep that saving, a column layer's input is kept as this
//! rank's rows and all-gathered again in backward (as Megatron does), started before the
//! input-gradient GEMMs so that it runs while they compute.
//!
//! Two more consequences. The vocabulary-parallel embedding ends in a reduce-scatter (each rank
//! keeps its rows of the summed lookups), and its backward gathers the rows' gradients back. And
//! the norm weights, replicated over tp, now see only this rank's rows in backward: their
//! gradients are partial sums, added over the tp ranks once per step (`sum_replicated_grads`).

use crate::comm::{Group, ReduceOp};
use crate::model::split::{input_grad, owned, WeightGrads};
use crate::model::{Param, TensorSplit};
use crate::ops::tensor::Tensor;
use crate::ops::{self, TpCut};
use crate::parallel::data_parallel::GradReduce;
use crate::parallel::tensor_parallel::TensorParallel;
use anyhow::Result;
use std::borrow::Cow;

/// Tensor parallelism over `group` with the rows between the layers split over the same ranks.
pub struct SequenceParallel<'g> {
    group: &'g Group,
    /// The vocabulary-parallel cross-entropy is tensor parallelism's: the logits' rows are whole.
    tp: TensorParallel<'g>,
}

impl<'g> SequenceParallel<'g> {
    pub fn new(group: &'g Group) -> SequenceParallel<'g> {
        SequenceParallel { group, tp: TensorParallel::new(group) }
    }
}

impl TensorSplit for SequenceParallel<'_> {
    fn part(&self) -> (usize, usize) {
        (self.group.index(), self.group.size())
    }

    fn row_share(&self) -> usize {
        self.group.size()
    }

    /// ḡ forward, and r̄ backward: every rank's rows, in rank order.
    fn gather_rows<'t>(&self, x: &'t Tensor) -> Result<Cow<'t, Tensor>> {
        Ok(Cow::Owned(self.group.all_gather_tensor(x)?))
    }

    /// r̄ forward: each rank's partial product, summed, and this rank's rows of the sum kept.
    fn row_forward(&self, x: &Tensor, w: &Param) -> Result<Tensor> {
        self.group.reduce_scatter_tensor(&w.linear(x), ReduceOp::Sum)
    }

    /// ḡ backward for column layers whose input `x` is this rank's rows: the whole input is
    /// gathered again (started first, so it travels during the input-gradient GEMMs), the input
    /// gradient is summed over the ranks and scattered back to rows (started before the
    /// weight-gradient GEMMs, so it travels while they compute).
    fn column_backward(
        &self,
        x: Tensor,
        layers: Vec<(Tensor, &mut Param)>,
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let gathering = self.group.all_gather_tensor_async(x)?; // (an asynchronous call owns what it sends)
        let scattering = self.group.reduce_scatter_tensor_async(input_grad(&layers), ReduceOp::Sum)?;
        // overlaps the reduce-scatter (or kept for later, the whole input with it)
        dw.linear(Cow::Owned(gathering.wait()?), owned(layers));
        scattering.wait()
    }

    /// ḡ backward: the partial input gradients summed, each rank keeping its rows.
    fn sum_input_grad(&self, dx: Tensor) -> Result<Tensor> {
        self.group.reduce_scatter_tensor(&dx, ReduceOp::Sum)
    }

    /// The vocabulary-parallel lookup, summed over the ranks; each keeps its rows.
    fn embedding_forward(&self, table: &Param, tokens: &[u32], first: usize) -> Result<Tensor> {
        self.group.reduce_scatter_tensor(&ops::embedding(&table.value, tokens, first), ReduceOp::Sum)
    }

    fn cross_entropy(&self, logits: &Tensor, targets: &[i32], first: usize) -> Result<(Tensor, usize, Tensor)> {
        self.tp.cross_entropy(logits, targets, first)
    }
}

/// Adds the gradients of the weights replicated over tp (the RMSNorms) over the tp ranks: with
/// sequence parallelism each rank's backward saw only its rows, so each rank holds its rows'
/// share of their gradients, and an all-reduce (sum) makes them whole. One per step, of all of
/// them packed together, after data parallelism has averaged them (both are sums, so the order
/// does not matter) and before the gradient norm reads them.
pub fn sum_replicated_grads(params: &mut [&mut Param], tp: &Group) -> Result<()> {
    sum_grads_over_tp(params, tp, |p| p.tp == TpCut::Whole)
}

/// The gradients of the parameters `which` picks, summed over the tp ranks: one all-reduce of
/// them packed together.
pub fn sum_grads_over_tp(params: &mut [&mut Param], tp: &Group, which: impl Fn(&Param) -> bool) -> Result<()> {
    let mut norms: Vec<&mut Param> = params.iter_mut().filter(|p| which(p)).map(|p| &mut **p).collect();
    if norms.is_empty() || tp.size() == 1 {
        return Ok(());
    }
    let grads: Vec<&Tensor> = norms.iter().map(|p| p.trained_grad()).collect();
    let mut packed = ops::concat(&grads);
    tp.all_reduce_tensor(&mut packed, ReduceOp::Sum)?;
    let mut at = 0;
    for p in &mut norms {
        let grad = p.trained().1;
        let n = grad.numel();
        ops::copy(&packed, at, grad, 0, n);
        at += n;
    }
    Ok(())
}

/// Sequence parallelism's part of each gradient's way (`train/gradients.rs`): after the replicas'
/// reducers, the norms' gradients summed over tp (`sum_replicated_grads`).
pub struct NormGradsOverTp<'g>(pub &'g Group);

impl GradReduce for NormGradsOverTp<'_> {
    fn grad_ready(&mut self, _: &mut Param, _: bool) {} // nothing to start during backward

    fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        sum_replicated_grads(params, self.0)
    }
}
