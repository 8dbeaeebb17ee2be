//! # The routing ops of a mixture of experts on a GPU
//!
//! (Not written yet: a run with experts on a GPU is refused by the config check.)

use crate::cuda::device::Device;
use crate::ops::moe::Routing;
use crate::ops::tensor::Tensor;
use anyhow::{bail, Result};
use std::sync::Arc;

fn missing<T>(op: &str) -> Result<T> {
    bail!("{op}: a mixture of experts has no GPU kernels yet")
}

impl Device {
    pub fn route(self: &Arc<Self>, _logits: &Tensor, _k: usize) -> Result<Routing> {
        missing("route")
    }
    pub fn route_backward(self: &Arc<Self>, _dw: &Tensor, _r: &Routing, _balance: &[f32]) -> Result<Tensor> {
        missing("route backward")
    }
    pub fn gather_rows(self: &Arc<Self>, _x: &Tensor, _order: &[u32]) -> Result<Tensor> {
        missing("gather rows")
    }
    pub fn combine(self: &Arc<Self>, _ys: &Tensor, _slot: &[u32], _w: Option<&Tensor>, _rows: usize) -> Result<Tensor> {
        missing("combine")
    }
    pub fn combine_backward(
        self: &Arc<Self>,
        _dy: &Tensor,
        _ys: &Tensor,
        _slot: &[u32],
        _w: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        missing("combine backward")
    }
}
