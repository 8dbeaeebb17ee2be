//! # The routing ops of a mixture of experts on a GPU
//!
//! One method per op of `ops/moe.rs`, launching `kernels/moe.cu` (`cuda/launch_table/moe.rs`);
//! the experts' GEMMs are the plain linear layers of `ops/gpu.rs`, one cuBLAS call per expert
//! and product on its contiguous rows. The index lists (each routed row's token, each token's
//! routed rows) are made on the host from the ids `route` reads back, and uploaded like the
//! embedding's tokens; the ids, the load-balancing term and the renormalised weights stay f32.

use crate::cuda::device::Device;
use crate::cuda::launch_table::moe;
use crate::ops::gpu::addr;
use crate::ops::moe::{Router, Routing};
use crate::ops::tensor::{Place, Tensor};
use crate::ops::types::DType;
use anyhow::Result;
use std::sync::Arc;

impl Device {
    pub fn route(self: &Arc<Self>, logits: &Tensor, k: usize) -> Result<Routing> {
        let (t, e) = (logits.rows(), logits.cols());
        let (probs, weights) = (self.tensor(&[t, e], DType::F32), self.tensor(&[t, k], DType::F32));
        let ids = self.tensor(&[t, k], DType::F32);
        self.run(&moe::route(logits.dtype(), addr(logits), (t, e, k), (addr(&probs), addr(&weights), addr(&ids))))?;
        // a CPU–GPU sync point: the experts' row counts size their GEMMs and the all-to-all
        let experts = ids.to_vec().into_iter().map(|id| id as u32).collect();
        Ok(Routing { probs, weights, experts, router: Router::Softmax })
    }

    pub fn route_backward(self: &Arc<Self>, dweights: &Tensor, r: &Routing, balance: &[f32]) -> Result<Tensor> {
        let (t, e, k) = (r.probs.rows(), r.probs.cols(), r.weights.cols());
        let place = Place::Cuda(self.clone());
        let ids = Tensor::from_host_in(&[t, k], r.experts.iter().map(|&i| i as f32).collect(), &place, DType::F32);
        let balance = (!balance.is_empty()).then(|| Tensor::from_host_in(&[e], balance.to_vec(), &place, DType::F32));
        let dlogits = self.tensor(&[t, e], self.dtype);
        let inputs = (addr(dweights), addr(&r.probs), addr(&r.weights), addr(&ids));
        let at = balance.as_ref().map_or(0, addr);
        self.run(&moe::route_backward(self.dtype, inputs, at, (t, e, k), addr(&dlogits)))?;
        Ok(dlogits)
    }

    /// `x` seen as rows of `d` values: those rows in `order`.
    pub fn permute_rows(self: &Arc<Self>, x: &Tensor, d: usize, order: &[u32]) -> Result<Tensor> {
        let out = self.tensor(&[order.len(), d], x.dtype());
        if !order.is_empty() {
            let (at, _keep) = self.index_addr(order)?;
            self.run(&moe::permute_rows(x.dtype(), addr(x), (at, order.len()), d, addr(&out)))?;
        }
        Ok(out)
    }

    pub fn weighted_sum(
        self: &Arc<Self>,
        ys: &Tensor,
        slot: &[u32],
        weights: Option<&Tensor>,
        rows: usize,
    ) -> Result<Tensor> {
        let (d, k) = (ys.cols(), slot.len() / rows.max(1));
        let y = self.tensor(&[rows, d], ys.dtype());
        if rows > 0 {
            let (at, _keep) = self.index_addr(slot)?;
            let w = weights.map_or(0, addr);
            self.run(&moe::weighted_sum(ys.dtype(), (addr(ys), at, w), (rows, k, d), addr(&y)))?;
        }
        Ok(y)
    }

    pub fn weighted_sum_backward(
        self: &Arc<Self>,
        dy: &Tensor,
        ys: &Tensor,
        slot: &[u32],
        w: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (rows, d, k) = (dy.rows(), dy.cols(), w.cols());
        let (dys, dw) = (self.tensor(ys.shape(), ys.dtype()), self.tensor(&[rows, k], DType::F32));
        if rows > 0 {
            let (at, _keep) = self.index_addr(slot)?;
            let inputs = (addr(dy), addr(ys), at, addr(w));
            self.run(&moe::weighted_sum_backward(dy.dtype(), inputs, (rows, k, d), (addr(&dys), addr(&dw))))?;
        }
        Ok((dys, dw))
    }
}
