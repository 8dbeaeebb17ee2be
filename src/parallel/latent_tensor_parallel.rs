//! # Latent attention under tensor parallelism: the replicated latent path's gradients
//!
//! Megatron's cut of multi-head latent attention (`model/latent_attention.rs`): the heads split
//! over the tp ranks (q_proj or q_b_proj and kv_b_proj column parallel, o_proj row parallel), the
//! latent path replicated (q_a_proj, kv_a_proj_with_mqa, q_a_layernorm, kv_a_layernorm: every rank
//! computes the same latents from the same rows). Its backward reaches the latents from this
//! rank's heads only, so each rank holds a partial sum of their gradients; one all-reduce a step,
//! after the replicas' reducers and before the gradient norm, makes them whole.
//!
//! With sequence parallelism every replicated weight's gradient is already summed over tp
//! (`sequence_parallel.rs`, each rank saw its own rows): the latent path's among them, so this
//! reducer is not added then.

use crate::comm::Group;
use crate::config::partial_over_tp;
use crate::model::Param;
use crate::parallel::data_parallel::GradReduce;
use crate::parallel::sequence_parallel::sum_grads_over_tp;
use anyhow::Result;

/// The latent path's gradients summed over the tp group, once a step.
pub struct LatentGradsOverTp<'g>(pub &'g Group);

impl GradReduce for LatentGradsOverTp<'_> {
    fn grad_ready(&mut self, _: &mut Param, _: bool) {} // nothing to start during backward

    fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        sum_grads_over_tp(params, self.0, |p| partial_over_tp(&p.name))
    }
}
