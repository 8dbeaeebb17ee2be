//! # Data parallelism: same model, different data, averaged gradients
//!
//! Every DP rank holds the whole model and reads its own slice of the global batch. After
//! backward, the ranks average their gradients, so every replica takes the same optimizer step
//! and the replicas stay identical. Two ways to average:
//!
//! **naive**: when backward is over, all-reduce each gradient, one after another. Simple, but
//! the network is idle during backward and the GPU is idle during the all-reduces.
//!
//! **bucketed** (the default): backward produces gradients from the last layer to the first, so
//! the gradients are packed, in that order, into buckets of about `bucket_mb` megabytes. When the
//! last gradient of a bucket is written, its all-reduce starts on the communication thread (on
//! GPUs with NCCL, the communication stream) and runs *while backward goes on* with the earlier
//! layers; the optimizer only waits for what is
//! still in flight:
//!
//! ```text
//! backward:   [lm_head, norm, layer 3][layer 2][layer 1][layer 0, embed]─┐
//! comm:                 └─[all-reduce bucket 0]─[bucket 1]─[bucket 2]──[bucket 3]─▶ optimizer
//! ```
//! With gradient accumulation only the last micro-batch of a step communicates: the earlier
//! ones just add into the gradients. The reduction is over the dp×cp group (every rank holding the
//! same weights; a rank of a context-parallel group saw other tokens of the same sequences).

use crate::comm::tensors::Pending;
use crate::comm::{Group, ReduceOp};
use crate::config::DpMode;
use crate::model::Param;
use crate::ops;
use crate::ops::tensor::Tensor;
use anyhow::Result;
use std::collections::HashMap;

/// Is the traced call `name` (`comm/trace.rs`) a gradient all-reduce of data parallelism (an
/// average over the dp×cp group of more than the one number of the loss)?
pub fn gradient_all_reduce(name: &str) -> bool {
    name.starts_with("all_reduce(avg) of ") && name.contains(" dp×cp[") && !name.contains(" of 1 value ")
}

/// A run of consecutive gradients (in backward order) reduced by one all-reduce.
struct Bucket {
    /// Each member's place in the model's parameter list, and its offset in `flat`.
    members: Vec<(usize, usize)>,
    /// The members' gradients side by side, on their device (None while its all-reduce runs).
    flat: Option<Tensor>,
    waiting: usize,
    in_flight: Option<Result<Pending>>,
}

pub struct DataParallel<'g> {
    group: &'g Group,
    mode: DpMode,
    buckets: Vec<Bucket>,
    /// Parameter name → (bucket, offset in the bucket).
    place: HashMap<String, (usize, usize)>,
}

impl<'g> DataParallel<'g> {
    /// Plans the buckets for `params` (in model order) over `group`; each bucket's buffer lives
    /// where the gradients do (on a GPU, the all-reduce never leaves it with NCCL).
    pub fn new(group: &'g Group, params: &[&Param], mode: DpMode, bucket_mb: f64) -> DataParallel<'g> {
        let capacity = ((bucket_mb * (1 << 20) as f64) / 4.0).max(1.0) as usize; // f32 gradients
        let mut plans: Vec<(Vec<(usize, usize)>, usize)> = Vec::new(); // members, length
        let mut place = HashMap::new();
        for (i, p) in params.iter().enumerate().rev() {
            let n = p.grad.numel();
            if plans.last().is_none_or(|(_, len)| len + n > capacity) {
                plans.push((Vec::new(), 0));
            }
            let index = plans.len() - 1;
            let (members, len) = &mut plans[index];
            place.insert(p.name.clone(), (index, *len));
            members.push((i, *len));
            *len += n;
        }
        let buckets = match (mode, group.size()) {
            (DpMode::Bucketed, 2..) => plans
                .into_iter()
                .map(|(members, len)| {
                    let flat = Some(Tensor::zeros_as(&[len], &params[members[0].0].grad));
                    Bucket { waiting: members.len(), members, flat, in_flight: None }
                })
                .collect(),
            _ => Vec::new(), // nothing to pack: naive mode, or alone
        };
        DataParallel { group, mode, buckets, place }
    }

    /// Backward calls this when `p`'s gradient for the step is complete (last micro-batch only).
    /// Bucketed mode copies it into its bucket and starts the bucket's all-reduce once full.
    pub fn grad_ready(&mut self, p: &Param) {
        if self.buckets.is_empty() {
            return;
        }
        let (b, offset) = self.place[&p.name];
        let bucket = &mut self.buckets[b];
        let flat = bucket.flat.as_mut().expect("a bucket fills once per step");
        ops::copy(&p.grad, 0, flat, offset, p.grad.numel());
        bucket.waiting -= 1;
        if bucket.waiting == 0 {
            let flat = bucket.flat.take().expect("a bucket fills once per step");
            bucket.in_flight = Some(self.group.all_reduce_tensor_async(flat, ReduceOp::Avg));
        }
    }

    /// After the last backward of the step: every gradient becomes the average over the group.
    /// `params` are the model's, in the order given to `new`.
    pub fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        if self.group.size() == 1 {
            return Ok(());
        }
        if self.mode == DpMode::Naive {
            for p in params.iter_mut() {
                self.group.all_reduce_tensor(&mut p.grad, ReduceOp::Avg)?;
            }
            return Ok(());
        }
        for bucket in &mut self.buckets {
            let pending = bucket.in_flight.take().expect("backward reported every gradient of the bucket");
            let reduced = pending?.wait()?;
            for &(member, offset) in &bucket.members {
                let grad = &mut params[member].grad;
                let n = grad.numel();
                ops::copy(&reduced, offset, grad, 0, n);
            }
            bucket.flat = Some(reduced);
            bucket.waiting = bucket.members.len();
        }
        Ok(())
    }
}
