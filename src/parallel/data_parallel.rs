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
//!
//! ZeRO (`zero.rs`) takes the same buckets through a reduce-scatter instead, each rank keeping
//! the average of its own partition. (Step 11 restates both in placements: the all-reduce takes a
//! gradient from `Partial(avg)`, each rank holding its own data's share, to `Replicate`.)

use crate::comm::process_grid::Axis;
use crate::comm::tensors::Pending;
use crate::comm::{Group, ReduceOp};
use crate::config::DpMode;
use crate::model::Param;
use crate::ops;
use crate::ops::tensor::Tensor;
use crate::ops::DType;
use anyhow::Result;
use std::collections::HashMap;

/// Is the traced call `name` (`comm/trace.rs`) a gradient all-reduce of data parallelism (an
/// average over the dp×cp group of more than the one number of the loss)?
pub fn gradient_all_reduce(name: &str) -> bool {
    name.starts_with("all_reduce(avg) of ") && name.contains(" dp×cp[") && !name.contains(" of 1 value ")
}

/// How many f32 values a bucket of `bucket_mb` MiB holds.
pub fn bucket_values(bucket_mb: f64) -> usize {
    ((bucket_mb * (1 << 20) as f64) / 4.0).max(1.0) as usize
}

/// Which ranks hold the same values of a parameter, and so average its gradient: its replicas'
/// axis. The layout answers it for every parameter (`parallel/layout.rs`); data parallelism's own
/// answer, the dp×cp ranks for all of them, is `every_on_dp_cp`.
pub type Replicas = fn(&Param) -> Axis;

/// Every parameter replicated over the dp×cp ranks: plain data parallelism.
pub fn every_on_dp_cp(_: &Param) -> Axis {
    Axis::DpCp
}

/// Where a gradient goes once backward has made it: the data-parallel hook, and ZeRO's.
pub trait GradReduce {
    /// Backward calls this when `p`'s gradient for the micro-batch is complete (`last`: of the
    /// step's last micro-batch).
    fn grad_ready(&mut self, p: &mut Param, last: bool);
    /// After the last backward of the step: every gradient reduced. `params` are those given to
    /// the planner, in its order.
    fn finish(&mut self, params: &mut [&mut Param]) -> Result<()>;
}

/// The plan of one bucket: a run of consecutive gradients, in backward order.
pub struct BucketPlan {
    /// Each member's place in the parameter list, and its offset in the bucket.
    pub members: Vec<(usize, usize)>,
    /// The values side by side.
    pub len: usize,
    /// The last bucket of a backward pass (of the model, or of one model chunk when the pipeline
    /// is interleaved, whose chunks run their backwards apart: a bucket holds one chunk's).
    pub closes: bool,
}

/// The bucket planner (for data parallelism and ZeRO): parameters of
/// `widths[i]` values in model order, backward runs them last to first, and a bucket holds at
/// most `room` values (or one parameter, if larger) of a single model chunk (`chunk_of`).
pub fn plan_buckets((widths, chunk_of): (&[usize], &[usize]), room: usize) -> Vec<BucketPlan> {
    let mut plans: Vec<BucketPlan> = Vec::new();
    for (i, &n) in widths.iter().enumerate().rev() {
        let other_chunk = |plan: &BucketPlan| chunk_of[plan.members[0].0] != chunk_of[i];
        if plans.last().is_none_or(|plan| plan.len + n > room || other_chunk(plan)) {
            plans.push(BucketPlan { members: Vec::new(), len: 0, closes: true });
        }
        let plan = plans.last_mut().expect("pushed above");
        plan.members.push((i, plan.len));
        plan.len += n;
    }
    for b in 1..plans.len() {
        plans[b - 1].closes = chunk_of[plans[b].members[0].0] != chunk_of[plans[b - 1].members[0].0];
    }
    plans
}

/// `params` planned into buckets (`plan_buckets`), each taking `width(p)` values; also, by
/// parameter name, (bucket, offset).
pub fn buckets_of(
    (params, chunk_of): (&[&Param], &[usize]),
    width: impl Fn(&Param) -> usize,
    room: usize,
) -> (Vec<BucketPlan>, HashMap<String, (usize, usize)>) {
    let widths: Vec<usize> = params.iter().map(|p| width(p)).collect();
    let plans = plan_buckets((&widths, chunk_of), room);
    let place = plans
        .iter()
        .enumerate()
        .flat_map(|(b, plan)| plan.members.iter().map(move |&(i, at)| (params[i].name.clone(), (b, at))))
        .collect();
    (plans, place)
}

/// A bucket of data parallelism: its gradients side by side, and its all-reduce.
struct Bucket {
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
    /// What the all-reduces move: f32, or bf16 (`moving`).
    wire: DType,
}

impl<'g> DataParallel<'g> {
    /// Plans the buckets for `params` (in model order, `chunk_of` each one's model chunk) over
    /// `group`; each bucket's buffer lives where the gradients do (on a GPU, the all-reduce never
    /// leaves it with NCCL).
    pub fn new(group: &'g Group, params: (&[&Param], &[usize]), mode: DpMode, bucket_mb: f64) -> DataParallel<'g> {
        let (plans, place) = buckets_of(params, |p| p.shape().iter().product(), bucket_values(bucket_mb));
        let buckets = match (mode, group.size()) {
            (DpMode::Bucketed, 2..) => (plans.into_iter())
                .map(|plan| {
                    let like = params.0[plan.members[0].0];
                    let flat = Some(Tensor::zeros_on(&[plan.len], &like.place(), DType::F32)); // kept for every step
                    Bucket { waiting: plan.members.len(), members: plan.members, flat, in_flight: None }
                })
                .collect(),
            _ => Vec::new(), // nothing to pack: naive mode, or alone
        };
        DataParallel { group, mode, buckets, place, wire: DType::F32 }
    }

    /// The same, its all-reduces moving the gradients as `wire` (bf16: half the bytes, each
    /// bucket converted for the wire and back; the average comes back to the f32 gradients).
    pub fn moving(self, wire: DType) -> DataParallel<'g> {
        DataParallel { wire, ..self }
    }
}

impl GradReduce for DataParallel<'_> {
    /// On the step's last micro-batch, the gradient goes into its bucket; a full bucket's
    /// all-reduce starts at once, while backward goes on with the earlier layers.
    fn grad_ready(&mut self, p: &mut Param, last: bool) {
        if self.buckets.is_empty() || !last {
            return; // earlier micro-batches only add into the gradients
        }
        let (b, offset) = self.place[&p.name];
        let bucket = &mut self.buckets[b];
        let flat = bucket.flat.as_mut().expect("a bucket fills once per step");
        ops::copy(&p.grad, 0, flat, offset, p.grad.numel());
        bucket.waiting -= 1;
        if bucket.waiting == 0 {
            let flat = bucket.flat.take().expect("filled above");
            // the all-reduce: every rank gets the mean over the group
            bucket.in_flight = Some(self.group.all_reduce_tensor_async_as(flat, ReduceOp::Avg, self.wire));
        }
    }

    /// Every gradient becomes the average over the group: naive mode all-reduces them now, one by
    /// one; bucketed waits for what is still in flight and copies the averages back.
    fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        if self.group.size() == 1 {
            return Ok(());
        }
        if self.mode == DpMode::Naive {
            for p in params.iter_mut() {
                // the mean over the group (moved as `wire`, back in the gradient's format)
                let grad = std::mem::replace(&mut p.grad, Tensor::zeros(&[0]));
                p.grad = self.group.all_reduce_tensor_async_as(grad, ReduceOp::Avg, self.wire)?.wait()?;
            }
            return Ok(());
        }
        for bucket in &mut self.buckets {
            let pending = bucket.in_flight.take().expect("backward reported every gradient of the bucket");
            let reduced = pending?.wait()?; // this is where the step waits for the network
            for &(member, offset) in &bucket.members {
                let grad = &mut params[member].grad;
                let n = grad.numel();
                ops::copy(&reduced, offset, grad, 0, n);
            }
            bucket.flat = Some(reduced); // the next step's bucket
            bucket.waiting = bucket.members.len();
        }
        Ok(())
    }
}
