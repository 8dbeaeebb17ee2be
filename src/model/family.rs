//! # Which model a config describes
//!
//! A config with `model.num_local_experts` = 0 describes Llama: every block's MLP is dense
//! (`block.rs`'s `Dense`), the loss the language model's. With E > 0 it describes Mixtral: every
//! block's MLP is a mixture of E experts (`moe.rs`), and with `router_aux_loss_coef` > 0 the loss
//! carries their load-balancing term; with `moe_intermediate_size` > 0 the mixture is
//! DeepSeekMoE's (the same file: fine-grained and shared experts, a sigmoid router balanced by a
//! bias). They plug into the block's MLP seam (`Mlps`), so the model's own files never name the
//! experts: this file is where the families meet, as `transformers` picks a class by the config's
//! `model_type`. Llama and Mixtral attend alike
//! (`block.rs`'s `Gqa`, through the block's attention seam, `Attentions`); with
//! `kv_lora_rank` > 0 the attention is DeepSeek-V3's multi-head latent attention
//! (`latent_attention.rs`), through the same seam.
//!
//! What it makes holds every expert on this rank. The composition root (`train/compose.rs`)
//! makes the experts again of the same weights, where the run puts them (`Llama::with_mlps`).

use crate::config::ModelConfig;
use crate::model::block::{Attentions, DenseMlps, GqaAttentions, Mlps};
use crate::model::latent_attention::MlaAttentions;
use crate::model::moe::Experts;
use crate::model::split::Whole;
use crate::ops::rope_scaling;
use std::rc::Rc;

/// The blocks' attentions of the model `cfg` describes: Llama's and Mixtral's are grouped-query,
/// DeepSeek-V3's (`kv_lora_rank` > 0) latent.
pub fn attentions<'g>(cfg: &ModelConfig) -> Box<dyn Attentions<'g> + 'g> {
    match cfg.kv_lora_rank {
        0 => {
            let (theta, scaling) = (cfg.rope_theta, cfg.rope_scaling);
            Box::new(GqaAttentions { rope: Rc::new(move |head_dim| rope_scaling::rope_of(theta, &scaling, head_dim)) })
        }
        _ => Box::new(MlaAttentions),
    }
}

/// The blocks' MLPs of the model `cfg` describes (and what they add to its loss), every expert
/// on this rank.
pub fn mlps<'g>(cfg: &ModelConfig) -> Box<dyn Mlps<'g> + 'g> {
    match cfg.num_local_experts {
        0 => Box::new(DenseMlps),
        _ => Box::new(Experts::new(cfg, Box::new(Whole), 0)), // nothing trains here: no sequence-wise loss
    }
}
