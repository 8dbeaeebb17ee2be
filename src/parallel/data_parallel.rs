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
//! Under ZeRO (`zero.rs`) the same buckets are **reduce-scattered** instead: each rank gets the
//! average of its own chunk of every gradient in the bucket. So that one reduce-scatter hands
//! each rank whole chunks, a bucket is packed rank-major: rank 0's chunk of every member, then
//! rank 1's, … . Stage 1 does this once per step; stage 2 and 3 on every micro-batch, freeing
//! each full gradient as soon as it is packed, and add each result into the bucket's chunk sums,
//! which `finish` hands to the parameters' shards.

use crate::comm::tensors::Pending;
use crate::comm::{Group, ReduceOp};
use crate::config::DpMode;
use crate::model::Param;
use crate::ops;
use crate::ops::tensor::Tensor;
use crate::ops::DType;
use anyhow::Result;
use std::collections::{HashMap, VecDeque};

/// Is the traced call `name` (`comm/trace.rs`) a gradient all-reduce of data parallelism (an
/// average over the dp×cp group of more than the one number of the loss)?
pub fn gradient_all_reduce(name: &str) -> bool {
    name.starts_with("all_reduce(avg) of ") && name.contains(" dp×cp[") && !name.contains(" of 1 value ")
}

/// The values of a parameter of `n` values that each of `ranks` ranks keeps under ZeRO:
/// ⌈n / ranks⌉ (`zero.rs`).
pub fn chunk(n: usize, ranks: usize) -> usize {
    n.div_ceil(ranks)
}

/// Of chunk `r` (of `c` values) of a parameter of `n` values, how many are real, not padding.
pub fn real(n: usize, c: usize, r: usize) -> usize {
    n.saturating_sub(r * c).min(c)
}

/// How many f32 values a bucket of `bucket_mb` MiB holds.
pub fn bucket_values(bucket_mb: f64) -> usize {
    ((bucket_mb * (1 << 20) as f64) / 4.0).max(1.0) as usize
}

/// A run of consecutive gradients (in backward order) reduced by one collective.
struct Bucket {
    /// Each member's place in the model's parameter list, and its offset in `flat` (ZeRO: in
    /// each rank's part of `flat`, and in `sums`).
    members: Vec<(usize, usize)>,
    /// The members' gradients side by side, on their device (None while its collective runs;
    /// under ZeRO, made when the bucket starts filling and freed when its reduce-scatter is done).
    flat: Option<Tensor>,
    waiting: usize,
    in_flight: Option<Result<Pending>>,
    /// ZeRO: the values of this rank's chunks of the members, side by side.
    width: usize,
    /// ZeRO: some member's values do not split evenly over the ranks (its last chunk is padded).
    padded: bool,
    /// ZeRO: this rank's chunks of the members' averaged gradients, summed over the step's
    /// micro-batches (made by the first reduce-scatter to land, handed over by `finish`).
    sums: Option<Tensor>,
    /// The last bucket of a backward pass (of the model, or of one model chunk when the pipeline
    /// is interleaved).
    closes: bool,
}

pub struct DataParallel<'g> {
    group: &'g Group,
    mode: DpMode,
    /// ZeRO stage: 0 all-reduces, 1–3 reduce-scatter (2 and 3 on every micro-batch).
    stage: usize,
    buckets: Vec<Bucket>,
    /// Parameter name → (bucket, offset in the bucket).
    place: HashMap<String, (usize, usize)>,
    /// ZeRO: the buckets whose reduce-scatter is in flight, oldest first.
    in_flight: VecDeque<usize>,
    /// A collective that failed while backward ran, reported by `finish`.
    failed: Option<anyhow::Error>,
}

/// ZeRO keeps at most this many reduce-scatters in flight: each holds its bucket's full-size
/// gradients until it lands, and stage 2 must not keep them all.
const IN_FLIGHT: usize = 2;

impl<'g> DataParallel<'g> {
    /// Plans the buckets for `params` (in model order) over `group`; each bucket's buffer lives
    /// where the gradients do (on a GPU, the collective never leaves it with NCCL). `chunk` gives
    /// each parameter's model chunk (all 0 but with the interleaved pipeline, whose chunks run
    /// their backwards apart): a bucket holds one chunk's gradients.
    pub fn new(
        group: &'g Group,
        (params, chunk_of): (&[&Param], &[usize]),
        mode: DpMode,
        bucket_mb: f64,
        stage: usize,
    ) -> DataParallel<'g> {
        let capacity = bucket_values(bucket_mb);
        let ranks = group.size();
        // a member takes its whole gradient in a plain bucket, one chunk per rank under ZeRO
        let width = |p: &Param| match stage {
            0 => p.shape().iter().product(),
            _ => chunk(p.shape().iter().product(), ranks),
        };
        let room = if stage == 0 { capacity } else { (capacity / ranks).max(1) }; // ZeRO: × ranks in `flat`
        let mut plans: Vec<(Vec<(usize, usize)>, usize)> = Vec::new(); // members, width
        let mut place = HashMap::new();
        for (i, p) in params.iter().enumerate().rev() {
            let n = width(p);
            let other_chunk = |members: &Vec<(usize, usize)>| chunk_of[members[0].0] != chunk_of[i];
            if plans.last().is_none_or(|(members, len)| len + n > room || other_chunk(members)) {
                plans.push((Vec::new(), 0));
            }
            let index = plans.len() - 1;
            let (members, len) = &mut plans[index];
            place.insert(p.name.clone(), (index, *len));
            members.push((i, *len));
            *len += n;
        }
        let chunk_of_plan = |b: usize| plans.get(b).map(|(members, _)| chunk_of[members[0].0]);
        let closes: Vec<bool> = (0..plans.len()).map(|b| chunk_of_plan(b + 1) != chunk_of_plan(b)).collect();
        let buckets = match (mode, ranks) {
            (DpMode::Bucketed, 2..) => plans
                .into_iter()
                .zip(closes)
                .map(|((members, len), closes)| {
                    let like = &params[members[0].0];
                    // stage 0 keeps its bucket for every step; ZeRO makes one as it starts filling
                    let flat = (stage == 0).then(|| Tensor::zeros_on(&[len], &like.place(), DType::F32));
                    let padded = members.iter().any(|&(i, _)| params[i].shape().iter().product::<usize>() % ranks != 0);
                    let (waiting, width) = (members.len(), len);
                    Bucket { waiting, members, flat, in_flight: None, width, padded, sums: None, closes }
                })
                .collect(),
            _ => Vec::new(), // nothing to pack: naive mode, or alone
        };
        DataParallel { group, mode, stage, buckets, place, in_flight: VecDeque::new(), failed: None }
    }

    /// Backward calls this when `p`'s gradient for the micro-batch is complete (`last`: of the
    /// step's last micro-batch). The gradient goes into its bucket, whose collective starts once
    /// it is full: at the last micro-batch, or at every one under ZeRO-2/3 (which then frees it).
    pub fn grad_ready(&mut self, p: &mut Param, last: bool) {
        if self.buckets.is_empty() || (self.stage < 2 && !last) {
            return;
        }
        let (b, offset) = self.place[&p.name];
        let (group, stage) = (self.group, self.stage);
        let bucket = &mut self.buckets[b];
        if stage == 0 {
            let flat = bucket.flat.as_mut().expect("a bucket fills once per step");
            ops::copy(&p.grad, 0, flat, offset, p.grad.numel());
        } else {
            let width = bucket.width;
            let (ranks, padded) = (group.size(), bucket.padded);
            // written whole, unless a member's last chunk is padded: then zeros under the padding
            let make = |like| {
                if padded {
                    Tensor::zeros_as(&[width * ranks], like)
                } else {
                    Tensor::empty_as(&[width * ranks], like)
                }
            };
            let flat = bucket.flat.get_or_insert_with(|| make(&p.grad));
            let (n, c) = (p.grad.numel(), chunk(p.grad.numel(), group.size()));
            // rank-major: rank r's chunk of every member side by side, then rank r + 1's
            for r in 0..group.size() {
                ops::copy(&p.grad, r * c, flat, r * width + offset, real(n, c, r));
            }
            if stage >= 2 {
                p.grad = Tensor::zeros(&[0]); // handed over: the full gradient is not kept
            }
        }
        bucket.waiting -= 1;
        if bucket.waiting > 0 {
            return;
        }
        let flat = bucket.flat.take().expect("a bucket fills once per micro-batch");
        if stage == 0 {
            bucket.in_flight = Some(group.all_reduce_tensor_async(flat, ReduceOp::Avg));
            return;
        }
        bucket.in_flight = Some(group.reduce_scatter_tensor_async(flat, ReduceOp::Avg));
        bucket.waiting = bucket.members.len();
        self.in_flight.push_back(b);
        // the last bucket of the backward: every reduce-scatter of this micro-batch lands now, so
        // that no full-size bucket outlives its backward (with a pipeline, forwards come next)
        let keep = if bucket.closes { 0 } else { IN_FLIGHT };
        while self.in_flight.len() > keep {
            let oldest = self.in_flight.pop_front().expect("more than kept");
            if let Err(e) = settle(&mut self.buckets[oldest]) {
                self.failed.get_or_insert(e);
            }
        }
    }

    /// After the last backward of the step: every gradient becomes the average over the group
    /// (ZeRO: every shard's gradient, this rank's chunk of the average). `params` are the
    /// model's, in the order given to `new`.
    pub fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        if self.group.size() == 1 {
            return Ok(());
        }
        if self.mode == DpMode::Naive {
            for p in params.iter_mut() {
                self.group.all_reduce_tensor(&mut p.grad, ReduceOp::Avg)?;
            }
            return Ok(());
        }
        self.in_flight.clear(); // every bucket is settled below
        for bucket in &mut self.buckets {
            if self.stage > 0 {
                settle(bucket)?;
                let sums = bucket.sums.take().expect("every bucket was reduce-scattered in the step");
                for &(member, offset) in &bucket.members {
                    let shard = params[member].shard.as_mut().expect("ZeRO shards every parameter");
                    let c = shard.master.numel();
                    shard.grad = ops::slice(&sums, offset, &[c]); // freed again by `zero_grads`
                }
                continue;
            }
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

/// Waits for a ZeRO bucket's reduce-scatter in flight, if any, and adds its result (this rank's
/// chunks) into the bucket's sums.
fn settle(bucket: &mut Bucket) -> Result<()> {
    if let Some(pending) = bucket.in_flight.take() {
        let mine = pending?.wait()?;
        match &mut bucket.sums {
            Some(sums) => ops::add_assign(sums, &mine),
            None => bucket.sums = Some(mine),
        }
    }
    Ok(())
}
