//! # What a checkpoint of the model holds, from the config alone
//!
//! A checkpoint is checked, written and read tensor by tensor by name (`checkpoint/`). Which
//! tensors a model (or one pipeline stage of it) has, their full shapes and how tensor
//! parallelism cuts each, follow from the config: the model's own parts listing (`parts.rs`)
//! run with nothing allocated.

use super::Llama;
use crate::config::ModelConfig;
use crate::model::block::Block;
use crate::model::family;
use crate::model::param::{Param, ParamKind};
use crate::model::split::LayerSplit;
use crate::ops::tensor::Tensor;
use crate::ops::TpCut;
use std::collections::HashMap;

impl Llama<'_> {
    /// The name and full shape of every tensor of the layers `layer_split` says (a pipeline stage's), in
    /// Hugging Face order, from the config alone (nothing allocated): what a checkpoint of this
    /// model must hold (of a tied model's last stage, not the copy of the embedding it holds as
    /// its output layer: the first stage writes that tensor).
    pub fn tensor_shapes(cfg: &ModelConfig, layer_split: impl LayerSplit) -> Vec<(String, Vec<usize>)> {
        let copy = cfg.tie_word_embeddings && !layer_split.has_embedding();
        let cuts = Llama::tensor_cuts(cfg, layer_split).into_iter();
        let written = cuts.filter(|(name, ..)| !(copy && name == "model.embed_tokens.weight"));
        written.map(|(name, shape, ..)| (name, shape)).collect()
    }

    /// The name and shape of every buffer of the layers `layer_split` says (what a part keeps that
    /// no optimizer trains: DeepSeekMoE's balancing bias), in the order they are made: a checkpoint
    /// holds them beside the parameters.
    pub fn buffer_shapes(cfg: &ModelConfig, layer_split: impl LayerSplit) -> Vec<(String, Vec<usize>)> {
        let mut buffers = Vec::new();
        let (attentions, mlps) = (family::attentions(cfg), family::mlps(cfg));
        Llama::parts(cfg, &layer_split, (&*attentions, &*mlps), &mut |name, shape, kind, tp| {
            if kind == ParamKind::Buffer {
                buffers.push((name.clone(), shape.to_vec()));
            }
            Ok(Param::new(name, Tensor::zeros(&[0]), tp)) // nothing allocated
        })
        .expect("listing cannot fail");
        buffers
    }

    /// `tensor_shapes`, with how tensor parallelism cuts each tensor, in the order of `params()`.
    pub fn tensor_cuts(cfg: &ModelConfig, layer_split: impl LayerSplit) -> Vec<(String, Vec<usize>, TpCut)> {
        let mut shapes = HashMap::new();
        let (attentions, mlps) = (family::attentions(cfg), family::mlps(cfg));
        let made = Llama::parts(cfg, &layer_split, (&*attentions, &*mlps), &mut |name, shape, _, tp| {
            shapes.insert(name.clone(), shape.to_vec());
            Ok(Param::new(name, Tensor::zeros(&[0]), tp)) // nothing allocated
        });
        let (embed, layers, head) = made.expect("listing cannot fail");
        let head = head.iter().flat_map(|h| [Some(&h.norm), h.lm_head.as_ref()]).flatten();
        let params = embed.iter().chain(layers.iter().flat_map(Block::params)).chain(head);
        params.map(|p| (p.name.clone(), shapes[&p.name].clone(), p.tp)).collect()
    }
}
