//! # Another kind of MLP over the same weights (lesson 20)
//!
//! A model is built with the MLPs its config describes (`family.rs`: every expert of a mixture
//! on this rank). A run that puts the experts elsewhere — divided over the ep ranks, or routed as
//! a tape replays (`model/moe.rs`, `model/routing_tape.rs`) — makes every block's MLP again of
//! the same parameters, through the block's MLP seam (`Mlps`), and gives the model the loss term
//! those MLPs add. Evaluation takes the term off: the balance loss is a training aid.

use super::Llama;
use crate::config::ModelConfig;
use crate::model::block::{Block, LossTerm, Mlps};
use crate::model::param::Param;
use anyhow::{anyhow, Result};
use std::collections::HashMap;

impl<'g> Llama<'g> {
    /// Gives every block the MLP `mlps` makes of its MLP's parameters (a mixture of experts
    /// divided among ranks, `moe.rs`), and the model the loss term they add; a parameter the new
    /// kind does not ask for is dropped.
    pub fn with_mlps(mut self, mlps: &dyn Mlps<'g>) -> Result<Llama<'g>> {
        let cfg = &self.cfg;
        self.layers = self.layers.into_iter().map(|b| b.with_mlp(mlps, cfg)).collect::<Result<_>>()?;
        self.term = mlps.loss_term();
        Ok(self)
    }

    /// Every buffer of this rank's layers (tensors no optimizer trains: DeepSeekMoE's balancing
    /// biases), by name, whole, on the host, in the order `Llama::buffer_shapes` lists them.
    pub fn buffers(&self) -> Vec<(String, crate::ops::tensor::Tensor)> {
        self.layers.iter().flat_map(|b| b.mlp.buffers()).collect()
    }

    /// Adds `term` to the loss from now on (`None`: no term); returns the term it added before.
    pub fn replace_loss_term(&mut self, term: Option<Box<dyn LossTerm + 'g>>) -> Option<Box<dyn LossTerm + 'g>> {
        std::mem::replace(&mut self.term, term)
    }
}

impl<'g> Block<'g> {
    /// This block with the MLP `mlps` makes of its MLP's parameters (another kind over the same
    /// weights). One it does not ask for is dropped.
    fn with_mlp(self, mlps: &dyn Mlps<'g>, cfg: &ModelConfig) -> Result<Block<'g>> {
        let mut had: HashMap<String, Param> = self.mlp.into_params().into_iter().map(|p| (p.name.clone(), p)).collect();
        let layer = self.layer;
        let mlp = mlps.make(layer, cfg, &mut |name, _, _, _| {
            had.remove(&name).ok_or_else(|| anyhow!("layer {layer}'s MLP has no parameter {name}"))
        })?;
        Ok(Block { mlp, ..self })
    }
}
