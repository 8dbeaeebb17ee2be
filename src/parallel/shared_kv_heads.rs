//! # KV heads fewer than the tp ranks: copies, and their gradients added up
//!
//! Tensor parallelism gives each rank whole attention heads (`tensor_parallel.rs`). With
//! grouped-query attention the KV heads are fewer than the query heads — llama-1b has 32 query
//! heads and 4 KV heads, smollm-135m 9 and 3 — so a tp of 8 cannot give each rank its own KV
//! head. Megatron-LM and torchtitan copy them instead: the n ranks sit in kv_heads equal runs
//! of neighbours, each run holding one KV head (its rows of k_proj and v_proj,
//! `TpCut::HeadRows`), and each rank's query heads are among the ones that head serves.
//!
//! ```text
//! tp = 4, 8 query heads, 2 KV heads:   rank       0     1  │  2     3
//!                                      q heads   0 1   2 3 │ 4 5   6 7
//!                                      KV head    0     0  │  1     1     rank r: ⌊r · kv / tp⌋
//! ```
//! Forward needs nothing new: each rank computes k and v of its head from every row, as one
//! rank would, and attends its query heads to it. Backward reaches the copy from this rank's
//! query heads only, so each copy's weight gradient is a part of the whole one: the head's
//! gradient is the sum over the ranks holding it. (The input gradient needs nothing new either:
//! f's all-reduce already adds every rank's dk · W_k, and the copies' W_k are equal.) So once a
//! step, after the replicas' reducers and before the gradient norm, one all-reduce over the tp
//! group adds them up: each rank writes its copies' gradients into its head's slot of a buffer
//! as long as all the heads, zeros elsewhere, and reads its slot back. Every copy then has the same
//! gradient, so the same update, and the copies stay equal without a message. The norm counts
//! each head once (its first rank's copy), and a checkpoint holds each once.
//!
//! What it costs: the buffer holds every KV head's k_proj and v_proj gradients (2 · kv · head_dim ·
//! hidden values a layer), an all-reduce's 2 · (tp − 1) / tp of that a step — small beside the
//! step's activations' all-reduces. An all-reduce within each run of copies would move tp / kv
//! times less (the lesson's exercise 4).

use crate::comm::{Group, ReduceOp};
use crate::model::Param;
use crate::ops;
use crate::ops::tensor::Tensor;
use crate::parallel::data_parallel::GradReduce;
use anyhow::{ensure, Result};

/// The copies' gradients added up over the tp group, once a step.
pub struct SharedKvGrads<'g>(pub &'g Group);

impl GradReduce for SharedKvGrads<'_> {
    fn grad_ready(&mut self, _: &mut Param, _: bool) {} // nothing to start during backward

    fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        sum_copies(params, self.0)
    }
}

/// Each copied slice's gradient (this rank's trained part of it: under ZeRO its partition, the
/// same partition on every copy) summed over the tp ranks holding that slice: one all-reduce of
/// all of them, each rank's in its slice's slot.
pub fn sum_copies(params: &mut [&mut Param], tp: &Group) -> Result<()> {
    let n = tp.size();
    let mut copied: Vec<&mut Param> = params.iter_mut().filter(|p| p.tp.copies(n) > 1).map(|p| &mut **p).collect();
    let Some(first) = copied.first() else { return Ok(()) };
    let (slot, slots) = first.tp.part_of((tp.index(), n));
    ensure!(
        copied.iter().all(|p| p.tp.part_of((tp.index(), n)) == (slot, slots)),
        "the copied weights are cut differently: one buffer cannot add them up"
    );
    let grads: Vec<&Tensor> = copied.iter().map(|p| p.trained_grad()).collect();
    let mine = ops::concat(&grads);
    let len = mine.numel();
    let mut all = Tensor::zeros_as(&[slots * len], &mine);
    ops::copy(&mine, 0, &mut all, slot * len, len);
    drop(mine);
    tp.all_reduce_tensor(&mut all, ReduceOp::Sum)?;
    let mut at = slot * len;
    for p in &mut copied {
        let grad = p.trained().1;
        let k = grad.numel();
        ops::copy(&all, at, grad, 0, k);
        at += k;
    }
    Ok(())
}

/// The parameters this rank holds as a copy that an earlier tp rank holds too: the gradient norm
/// counts those once, at the first rank of each run.
pub fn later_copies(params: &[&Param], tp: &Group) -> Vec<String> {
    let (r, n) = (tp.index(), tp.size());
    params.iter().filter(|p| r % p.tp.copies(n) != 0).map(|p| p.name.clone()).collect()
}
