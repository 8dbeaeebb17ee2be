//! # ZeRO and FSDP: data parallelism that shards what it used to replicate
//!
//! Plain data parallelism keeps a full copy of everything on every dp rank: per parameter 4 B of
//! weight, 4 B of gradient and 8 B of AdamW moments (on a GPU in mixed precision, 2 B of bf16
//! weight more, next to the fp32 master). But each rank only *needs* all of it for a moment:
//! AdamW is elementwise, so rank r can update just its 1/dp of every parameter, if it has the
//! averaged gradient of that 1/dp. ZeRO (DeepSpeed) stops replicating, one kind of state at a time:
//!
//! ```text
//!              weights (compute copy)   master + AdamW moments   gradients          per rank
//! ZeRO-0       whole                    whole                    whole              16 B (18 on a GPU)
//! ZeRO-1       whole                    1/dp                     whole              8 + 12/dp
//! ZeRO-2       whole                    1/dp                     1/dp (+ a layer)   4 + 16/dp
//! ZeRO-3       a unit while it computes 1/dp                     1/dp (+ a layer)   16/dp
//! ```
//! (f32 compute, bytes per parameter; a GPU in bf16 keeps a 2 B compute copy instead of 4, and
//! at ZeRO-0 a 4 B master beside it. At ZeRO-3 the unit is gathered from the master partitions.)
//!
//! The averaging all-reduce of plain DP becomes its two halves: a **reduce-scatter** gives each
//! rank the average of its own partition of every gradient, each rank updates its partition, and
//! an **all-gather** brings every rank the updated weights. Same bytes on the wire as one all-reduce.
//!
//! ```text
//! one step, rank r of dp            ZeRO-1 and 2                     ZeRO-3 (FSDP)
//! forward, unit by unit      use the whole weights            all-gather the unit → compute → free
//!                                                             (the next unit's gather already started)
//! backward, unit by unit     grads into buckets; when full:   all-gather → compute → free, and the
//!                            reduce-scatter (ZeRO-2: every    grads' reduce-scatter as in ZeRO-2
//!                            micro-batch, the full grad freed)
//! optimizer                  AdamW on partition r             AdamW on partition r
//!                            (master, m, v)
//!                            → all-gather the new weights     (nothing: the next forward gathers)
//! ```
//! The gradients' half is below: data parallelism's buckets (`data_parallel::buckets_of`),
//! reduce-scattered, once per step at ZeRO-1 as ZeRO-0 all-reduces, on every micro-batch at
//! ZeRO-2 and 3, since the full gradient is not kept — or, with `parallel.zero_reduce = "once"`,
//! once a step at ZeRO-2 and 3 as well: each gradient adds up whole over the step's micro-batches
//! and is reduce-scattered (and freed) in the last one's backward. That is the trade large runs
//! make: 1/micro-batches of the traffic (Llama 3's ZeRO-2 at 16 micro-batches would move 16× the
//! gradients a step), for full gradients held through the step, as ZeRO-1 holds them.
//!
//! The weights' half, the all-gather, is at the end: at ZeRO-1 and 2 the optimizer updates this rank's partitions and every rank then
//! gathers the updated whole weights (`GatherAfterUpdate`, wrapped around the optimizer). A gather
//! packs this rank's partitions of several parameters side by side, so one all-gather returns every
//! rank's partitions, rank after rank; `unpack` puts each parameter together without its padding.
//! How each partition travels is a seam (`Formats`, one `Packing` a parameter): the fp32 master as it
//! is (`Master`) unless the composition root plugs in another — the formats the GEMMs read, bf16
//! or FP8 (`gather_formats.rs`). FSDP (`fsdp.rs`, ZeRO-3) makes the same gather per unit, just
//! before the unit computes.
//!
//! (Step 11 gives these moves their general names, placements: on the dp×cp axis a parameter's
//! master and moments are `Shard(0)` of its flat values; its gradient goes from `Partial(avg)` to
//! `Shard(0)`, a reduce-scatter, and its updated weight from `Shard(0)` to `Replicate`, an
//! all-gather.)
//!
//! **The buckets, rank-major.** So that one reduce-scatter hands each rank whole partitions, a bucket
//! is packed rank-major: rank 0's partition of every member, then rank 1's, … . ZeRO-2 and 3 free
//! each full gradient as soon as it is packed, and add each result into the bucket's partition sums,
//! which `finish` hands to the parameters' partitions.
//!
//! **How a parameter is cut.** Each parameter on its own, by its flat values: rank r keeps
//! `[r·c, (r+1)·c)` with c = ⌈n / dp⌉, the last partition padded with zeros. For a matrix whose rows
//! divide by dp this is FSDP2's `Shard(0)`: a block of whole rows. We chose per-parameter partitions
//! over FSDP1's one flat buffer per unit because everything that works per parameter keeps
//! working unchanged: AdamW with its weight-decay rule (matrices, not norms), clipping, the
//! checkpoint's tensors by name, resuming into any layout. The price is a copy in and out of a
//! flat buffer around each collective (`pack`, `unpack`), as FSDP2 pays.
//!
//! **Over which group.** ZeRO shards over the group it is given (`Sharding`): the whole dp×cp
//! group here. A later lesson, hybrid sharding, gives it a smaller one and plugs into the seam
//! after each bucket's reduce-scatter (`AfterReduce`).
//!
//! **Other replicas.** Each parameter is sharded over the group of its replicas' axis, which the
//! layout names (`Replicas`): every parameter's is dp×cp here; a later lesson's parameters may
//! have another (`Sharding::with` takes one group per axis). Alone in its group, a rank keeps the
//! parameter whole.
//!
//! **Precision.** Gradients are reduce-scattered in fp32 by default (a sum of dp parts loses
//! little there); `parallel.reduce_dtype = "bf16"` moves them in bf16 instead, as many large runs
//! do: each bucket is converted for the wire and its result back, and the step's sums (over
//! micro-batches) and the partitions the optimizer reads stay fp32 — half the gradient traffic,
//! for each average rounded to 8 bits of mantissa (NCCL also adds the parts in bf16; the CPU hub
//! adds the rounded parts in f32 and rounds the sum). Dense data parallelism's all-reduce moves
//! what the same setting says. Weights are all-gathered in the compute dtype (bf16 on a GPU:
//! half the bytes, and what the kernels read anyway), from the fp32 master partitions.
//!
//! ```text
//! gradients reduced a step (G = their f32 bytes, m micro-batches)   "f32"     "bf16"
//! ZeRO-0 (all-reduce), ZeRO-1, ZeRO-2/3 "once"                       G         G/2
//! ZeRO-2/3 every micro-batch                                         m · G     m · G/2
//! ```

use crate::comm::process_grid::Axis;
use crate::comm::tensors::Pending;
use crate::comm::Group;
use crate::comm::ReduceOp;
use crate::config::ZeroReduce;
use crate::model::optimizer::Optimizer;
use crate::model::param::TrainedPart;
use crate::model::{Llama, Param};
use crate::ops;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::DType;
use crate::parallel::data_parallel::{bucket_values, buckets_of, GradReduce, Replicas};
use anyhow::Result;
use std::any::Any;
use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

/// The values of a parameter of `n` values that each of `ranks` ranks keeps under ZeRO:
/// ⌈n / ranks⌉ (the Shard(0) of its flat values).
pub fn partition_size(n: usize, ranks: usize) -> usize {
    n.div_ceil(ranks)
}

/// Of partition `r` (of `c` values) of a parameter of `n` values, how many are real, not padding.
pub fn real(n: usize, c: usize, r: usize) -> usize {
    n.saturating_sub(r * c).min(c)
}

/// Partition `r` of `c` values of `t`'s flat values: `[r·c, (r+1)·c)`, zeros past its end.
pub fn cut(t: &Tensor, r: usize, c: usize) -> Tensor {
    let real = real(t.numel(), c, r);
    let mut part = if real < c { Tensor::zeros_as(&[c], t) } else { Tensor::empty_as(&[c], t) };
    if real > 0 {
        ops::copy(t, r * c, &mut part, 0, real);
    }
    part
}

/// Which ranks shard a parameter, by its replicas' axis: the composition root adds one group
/// per axis it shards — dp×cp (under hybrid sharding, its shard groups), and any later lesson's
/// axis that replicates parameters (the experts' expert-data group). A parameter of an axis not
/// added is kept whole (ZeRO off, or a group of one).
#[derive(Clone)]
pub struct Sharding<'g> {
    /// The ZeRO stage (`parallel.zero_stage`): 0 shards nothing.
    zero_stage: usize,
    /// Each parameter's replicas' axis.
    replicas: Replicas,
    /// Each sharded replicas' axis: (that axis, the axis of the group sharding it, the group).
    shards: Vec<(Axis, Axis, &'g Group)>,
}

impl<'g> Sharding<'g> {
    /// ZeRO at `zero_stage`, over no group yet, for parameters whose replicas `replicas` says.
    pub fn new(zero_stage: usize, replicas: Replicas) -> Sharding<'g> {
        Sharding { zero_stage, replicas, shards: Vec::new() }
    }

    /// Shards the parameters replicated over `replicas` over `group` (on `axis`: the replicas'
    /// own, or under hybrid sharding the shard axis), when ZeRO is on and it has more than one rank.
    pub fn with(mut self, replicas: Axis, (axis, group): (Axis, &'g Group)) -> Sharding<'g> {
        if self.zero_stage > 0 && group.size() > 1 {
            self.shards.push((replicas, axis, group));
        }
        self
    }

    fn find(&self, replicas: Axis) -> Option<&(Axis, Axis, &'g Group)> {
        self.shards.iter().find(|s| s.0 == replicas)
    }

    /// The axis whose group shards `p`.
    pub fn axis_of(&self, p: &Param) -> Axis {
        let replicas = (self.replicas)(p);
        self.find(replicas).map_or(replicas, |s| s.1)
    }

    /// The group sharding the parameters replicated over `axis`, if any.
    pub fn on(&self, axis: Axis) -> Option<&'g Group> {
        self.find(axis).map(|s| s.2)
    }

    /// The group sharding `p`, if any (as the parameters are sharded: `shard`).
    pub fn of(&self, p: &Param) -> Option<&'g Group> {
        self.on((self.replicas)(p))
    }

    /// The group of the shard axis `axis` (a `ZeroPartition`'s), if any: the group holding the other
    /// partitions of a sharded parameter, known from its partition without asking the layout again.
    pub fn over(&self, axis: Axis) -> Option<&'g Group> {
        self.shards.iter().find(|s| s.1 == axis).map(|s| s.2)
    }

    pub fn any(&self) -> bool {
        !self.shards.is_empty()
    }

    /// The sharding groups, each once (two axes may share one), in the order they were added.
    pub fn groups(&self) -> Vec<&'g Group> {
        let mut groups: Vec<&'g Group> = Vec::new();
        for &(_, _, g) in &self.shards {
            if !groups.iter().any(|h| std::ptr::eq(*h, g)) {
                groups.push(g);
            }
        }
        groups
    }
}

/// This rank's partition of a parameter sharded over its replicas — the flat values
/// `[index · len, (index + 1) · len)` of the (zero-padded) tensor — as the parameter's trained
/// part (`Param::trained_part`): what the optimizer updates. `value` is then a compute copy of
/// the whole (ZeRO-1, 2), or empty except while gathered for a forward or backward (ZeRO-3),
/// and `grad` is freed once handed over (2, 3).
pub struct ZeroPartition {
    /// The axis whose ranks hold the other partitions: its replicas' axis, or under hybrid sharding
    /// the shard axis.
    pub axis: Axis,
    /// The fp32 master values of the partition: what AdamW updates.
    pub master: Tensor,
    /// Their gradient, averaged over the data-parallel ranks (reduce-scattered); present from the
    /// end of backward to the next step's `zero_grads`.
    pub grad: Tensor,
    /// The shape of the whole parameter (this tp rank's part of it).
    pub shape: Vec<usize>,
}

impl TrainedPart for ZeroPartition {
    fn trained(&mut self) -> (&mut Tensor, &mut Tensor) {
        (&mut self.master, &mut self.grad)
    }

    fn values(&self) -> &Tensor {
        &self.master
    }

    fn grad(&self) -> &Tensor {
        &self.grad
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// `p`'s partition, if ZeRO shards it: its trained part seen as what it is (`TrainedPart: Any`, so a
/// `dyn TrainedPart` is a `dyn Any` too).
pub fn partition_of(p: &Param) -> Option<&ZeroPartition> {
    let part: &dyn Any = p.trained_part.as_deref()?;
    part.downcast_ref()
}

/// `p`'s partition, to change, if ZeRO shards it.
fn partition_of_mut(p: &mut Param) -> Option<&mut ZeroPartition> {
    let part: &mut dyn Any = p.trained_part.as_deref_mut()?;
    part.downcast_mut()
}

/// Shards the model's parameters and the optimizer's moments as `sharding` says, for ZeRO
/// `zero_stage` 1–3: each rank keeps its partition of every fp32 master, of its gradient and of both
/// moments. ZeRO-2 and 3 free the full gradients (backward makes each again, briefly); ZeRO-3
/// frees the whole weights too (`fsdp.rs` gathers them unit by unit).
pub fn shard<'g>(
    mut model: Llama<'g>,
    optimizer: &mut dyn Optimizer,
    sharding: &Sharding<'g>,
    zero_stage: usize,
) -> Llama<'g> {
    let place = model.place();
    for (p, state) in model.params_mut().into_iter().zip(optimizer.state_mut()) {
        let Some(group) = sharding.of(p) else { continue }; // kept whole
        let n = p.value.numel();
        let master = p.value.master_copy().unwrap_or_else(|| p.value.clone()); // fp32, whole

        // Replicate → Shard(0) of the flat values: this rank's partition, nothing sent
        let mine = |t: &Tensor| cut(t, group.index(), partition_size(n, group.size()));
        for t in state {
            *t = mine(t); // the optimizer's state, each tensor shaped like the parameter
        }
        let grad = Tensor::zeros(&[0]); // the averaged partition, made by each step's reduce-scatters
        let axis = sharding.axis_of(p);
        p.trained_part =
            Some(Box::new(ZeroPartition { axis, master: mine(&master), grad, shape: p.value.shape().to_vec() }));
        p.value = match zero_stage {
            3 => Tensor::zeros(&[0]),                   // gathered before each use
            _ => ops::convert(&p.value, place.dtype()), // the compute copy alone (no master)
        };
        if zero_stage >= 2 {
            p.grad = Tensor::zeros(&[0]); // made by backward, handed to a bucket, freed
        }
    }
    model
}

/// A bucket of ZeRO: its members' partitions, rank-major, and its reduce-scatter.
struct Bucket {
    members: Vec<(usize, usize)>,
    /// Every rank's partitions of the members, rank-major: made when the bucket starts filling,
    /// freed when its reduce-scatter is done.
    flat: Option<Tensor>,
    waiting: usize,
    in_flight: Option<Result<Pending>>,
    /// The values of this rank's partitions of the members, side by side.
    width: usize,
    /// Some member's values do not split evenly over the ranks (its last partition is padded).
    padded: bool,
    /// This rank's partitions of the members' averaged gradients, summed over the step's
    /// micro-batches (made by the first reduce-scatter to land, handed over by `finish`).
    sums: Option<Tensor>,
    closes: bool,
}

/// ZeRO's gradient reduction: data parallelism's buckets, reduce-scattered.
pub struct ZeroBuckets<'g> {
    group: &'g Group,
    /// 1: once per step; 2, 3: freeing the full gradients as they are packed.
    zero_stage: usize,
    /// Reduce-scatter on every micro-batch (ZeRO-2 and 3 by default), or once a step, after the
    /// last micro-batch's backward (ZeRO-1; ZeRO-2 and 3 with `parallel.zero_reduce = "once"`).
    every_micro_batch: bool,
    buckets: Vec<Bucket>,
    place: HashMap<String, (usize, usize)>,
    /// The buckets whose reduce-scatter is in flight, oldest first.
    in_flight: VecDeque<usize>,
    /// A collective that failed while backward ran, reported by `finish`.
    failed: Option<anyhow::Error>,
    /// What a later lesson does to each bucket's averaged partitions once per step, before they are
    /// handed to the parameters (`None`: nothing).
    then: Option<AfterReduce<'g>>,
    /// What the reduce-scatters move: f32, or bf16 (`moving`).
    wire: DType,
}

/// A step over a bucket's averaged partitions (this rank's, side by side), once per step: the seam
/// where hybrid sharding averages them across its replicate group (`hybrid_sharding.rs`).
pub type AfterReduce<'g> = Box<dyn FnMut(&mut Tensor) -> Result<()> + 'g>;

/// ZeRO keeps at most this many reduce-scatters in flight: each holds its bucket's full-size
/// gradients until it lands, and ZeRO-2 must not keep them all.
const IN_FLIGHT: usize = 2;

impl<'g> ZeroBuckets<'g> {
    /// Plans the buckets of `params` (in model order, with their model chunks) sharded over
    /// `group` at `zero_stage` 1–3: a member takes one partition per rank, so a bucket of `bucket_mb`
    /// holds 1/ranks of what a data-parallel one does, per rank; `then` runs over each bucket's
    /// averaged partitions once per step; `reduce` says when ZeRO-2 and 3 reduce-scatter.
    pub fn new(
        (group, then): (&'g Group, Option<AfterReduce<'g>>),
        params: (&[&Param], &[usize]),
        bucket_mb: f64,
        (zero_stage, reduce): (usize, ZeroReduce),
    ) -> ZeroBuckets<'g> {
        let ranks = group.size();
        let room = (bucket_values(bucket_mb) / ranks).max(1);
        let (plans, place) = buckets_of(params, |p| partition_size(p.shape().iter().product(), ranks), room);
        let uneven = |i: usize| params.0[i].shape().iter().product::<usize>() % ranks != 0;
        let buckets = (plans.into_iter())
            .map(|plan| Bucket {
                padded: plan.members.iter().any(|&(i, _)| uneven(i)),
                waiting: plan.members.len(),
                members: plan.members,
                flat: None,
                in_flight: None,
                width: plan.len,
                sums: None,
                closes: plan.closes,
            })
            .collect();
        let every_micro_batch = zero_stage >= 2 && reduce == ZeroReduce::EveryMicroBatch;
        let in_flight = VecDeque::new();
        let wire = DType::F32;
        ZeroBuckets { group, zero_stage, every_micro_batch, buckets, place, in_flight, failed: None, then, wire }
    }

    /// The same, its reduce-scatters moving the gradients as `wire` (`parallel.reduce_dtype`):
    /// each bucket converted for the wire, each rank's partitions of the result converted back
    /// and added up in f32.
    pub fn moving(self, wire: DType) -> ZeroBuckets<'g> {
        ZeroBuckets { wire, ..self }
    }
}

impl GradReduce for ZeroBuckets<'_> {
    /// The gradient's partitions go into its bucket, rank-major (ZeRO-2, 3: the full gradient is
    /// freed); a full bucket's reduce-scatter starts at once: on the last micro-batch (ZeRO-1, and
    /// 2 and 3 reducing once: till then each gradient adds up whole), or on every one (2, 3).
    fn grad_ready(&mut self, p: &mut Param, last: bool) {
        if !self.every_micro_batch && !last {
            return;
        }
        let (b, offset) = self.place[&p.name];
        let (group, ranks) = (self.group, self.group.size());
        let bucket = &mut self.buckets[b];
        let (width, padded) = (bucket.width, bucket.padded);
        // written whole, unless a member's last partition is padded: then zeros under the padding
        let make = |like| match padded {
            true => Tensor::zeros_as(&[width * ranks], like),
            false => Tensor::empty_as(&[width * ranks], like),
        };
        let flat = bucket.flat.get_or_insert_with(|| make(&p.grad));
        let (n, c) = (p.grad.numel(), partition_size(p.grad.numel(), ranks));
        for r in 0..ranks {
            ops::copy(&p.grad, r * c, flat, r * width + offset, real(n, c, r)); // rank r's partition
        }
        if self.zero_stage >= 2 {
            p.grad = Tensor::zeros(&[0]); // handed over: the full gradient is not kept
        }
        bucket.waiting -= 1;
        if bucket.waiting > 0 {
            return;
        }
        let flat = bucket.flat.take().expect("a bucket fills once per micro-batch");
        bucket.in_flight = Some(group.reduce_scatter_tensor_async_as(flat, ReduceOp::Avg, self.wire)); // each rank: its mean
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

    /// Every parameter's partition gets its averaged gradient (`ZeroPartition::grad`).
    fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        self.in_flight.clear(); // every bucket is settled below
        for bucket in &mut self.buckets {
            settle(bucket)?;
            let mut sums = bucket.sums.take().expect("every bucket was reduce-scattered in the step");
            if let Some(then) = &mut self.then {
                then(&mut sums)?;
            }
            for &(member, offset) in &bucket.members {
                let partition = partition_of_mut(params[member]).expect("ZeRO shards every parameter");
                let c = partition.master.numel();
                partition.grad = ops::slice(&sums, offset, &[c]); // freed again by `zero_grads`
            }
        }
        Ok(())
    }
}

/// Waits for a bucket's reduce-scatter in flight, if any, and adds its result (this rank's
/// partitions) into the bucket's sums.
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

/// A sharded parameter's tensor `t` (its master or a moment partition) whole again, from every
/// rank's partition (for a checkpoint): an all-gather, the padding dropped (Shard(0) → Replicate);
/// `None` for a parameter not sharded.
pub fn whole(group: &Group, p: &Param, t: &Tensor) -> Result<Option<Tensor>> {
    let Some(partition) = partition_of(p) else { return Ok(None) };
    let n = partition.shape.iter().product::<usize>();
    let gathered = group.all_gather_tensor(t)?; // every rank's partition, rank after rank
    Ok(Some(ops::slice(&gathered, 0, &[n]).with_shape(&partition.shape))) // the padding is at the end
}

// ── the weights' half: the all-gather from the partitions (ZeRO-1 and 2 after the update; FSDP per unit) ──

/// The sharded parameters of `params` by the group sharding them (in the order the groups were
/// added; one group where two axes share it), as places in `params`.
pub fn by_group<'g>(sharding: &Sharding<'g>, params: &[&Param]) -> Vec<(&'g Group, Vec<usize>)> {
    let mut out = Vec::new();
    for group in sharding.groups() {
        let of =
            |p: &&Param| partition_of(p).and_then(|c| sharding.over(c.axis)).is_some_and(|g| std::ptr::eq(g, group));
        let places: Vec<usize> = (0..params.len()).filter(|&i| of(&params[i])).collect();
        if !places.is_empty() {
            out.push((group, places));
        }
    }
    out
}

/// Of `params`, those at `places`.
pub fn select<'a>(params: &'a mut [&mut Param], places: &[usize]) -> Vec<&'a mut Param> {
    let picked = params.iter_mut().enumerate().filter(|(i, _)| places.contains(i));
    picked.map(|(_, p)| &mut **p).collect()
}

/// How one weight's partition travels in a gather, packed into f32 slots that every backend moves
/// bit for bit.
pub trait Packing {
    /// This rank's partition, packed (`Cow::Borrowed`: sent as it is).
    fn pack<'t>(&self, partition: &'t Tensor) -> Cow<'t, Tensor>;
    /// The slots a partition of `c` numbers takes.
    fn slots(&self, c: usize) -> usize;
    /// The `c` numbers of the partition packed at slot `from` of `gathered`: a tensor holding them,
    /// and where they start in it.
    fn unpack<'t>(&self, gathered: &'t Tensor, from: usize, c: usize) -> (Cow<'t, Tensor>, usize);
}

/// The seam: each parameter's `Packing` for one gather of `params` over `group`, agreeing over the
/// group first whatever the formats need (FP8: each weight's amax over every partition).
pub trait Formats {
    fn packings(&self, group: &Group, params: &[&Param]) -> Result<Vec<Box<dyn Packing>>>;
}

/// The fp32 master as it is: ZeRO's own format.
pub struct Master;

impl Packing for Master {
    fn pack<'t>(&self, partition: &'t Tensor) -> Cow<'t, Tensor> {
        Cow::Borrowed(partition) // no copy
    }

    fn slots(&self, c: usize) -> usize {
        c
    }

    fn unpack<'t>(&self, gathered: &'t Tensor, from: usize, _: usize) -> (Cow<'t, Tensor>, usize) {
        (Cow::Borrowed(gathered), from) // no decoding: copied as they are
    }
}

impl Formats for Master {
    fn packings(&self, _: &Group, params: &[&Param]) -> Result<Vec<Box<dyn Packing>>> {
        Ok(params.iter().map(|_| Box::new(Master) as Box<dyn Packing>).collect())
    }
}

/// A gather in flight: every rank's packed partitions, and each parameter's packing.
pub struct Gather {
    pub pending: Pending,
    pub packings: Vec<Box<dyn Packing>>,
}

/// Starts the all-gather of the whole weights of `params` from every rank's master partitions: each
/// rank packs its partitions side by side, each as its packing says.
pub fn start_gather(group: &Group, params: &[&Param], formats: &dyn Formats) -> Result<Gather> {
    let masters: Vec<&Tensor> = params.iter().map(|p| &partition_of(p).expect("a sharded parameter").master).collect();
    let packings = formats.packings(group, params)?;
    let packed: Vec<Cow<Tensor>> = masters.iter().zip(&packings).map(|(m, w)| w.pack(m)).collect();
    let packed = ops::concat(&packed.iter().map(|p| &**p).collect::<Vec<_>>()); // this rank's, one after another
    let pending = group.all_gather_tensor_async(packed)?; // every rank's partitions, rank after rank
    Ok(Gather { pending, packings })
}

/// Puts the whole weights of `params` together from a gather: rank after rank, each rank's
/// partitions of every parameter side by side, each as its packing packed it.
pub fn unpack(gathered: &Tensor, packings: &[Box<dyn Packing>], params: &mut [&mut Param], ranks: usize) {
    let width = gathered.numel() / ranks; // one rank's packed partitions, in f32 slots
    let mut at = 0;
    for (p, packing) in params.iter_mut().zip(packings) {
        let shape = p.shape().to_vec();
        let (n, c) = (shape.iter().product(), partition_of(p).expect("a sharded parameter").master.numel());
        let mut whole: Option<Tensor> = None;
        for r in 0..ranks {
            let (part, from) = packing.unpack(gathered, r * width + at, c);
            let whole = whole.get_or_insert_with(|| Tensor::empty_as(&shape, &part)); // written whole
            ops::copy(&part, from, whole, r * c, real(n, c, r));
        }
        p.value = whole.expect("at least one rank");
        at += packing.slots(c);
    }
}

/// ZeRO-1 and 2 as the step sees them, through the optimizer seam: the optimizer updates this
/// rank's partitions, then every rank gets the updated whole weights (`gather_weights`).
pub struct GatherAfterUpdate<'g> {
    pub inner: Box<dyn Optimizer + 'g>,
    pub sharding: Sharding<'g>,
    pub formats: Rc<dyn Formats + 'g>,
    /// Values per all-gather (`parallel.bucket_mb`).
    pub bucket: usize,
}

impl Optimizer for GatherAfterUpdate<'_> {
    fn step(&mut self, params: &mut [&mut Param], lr: f32, grad_scale: f32) -> Result<()> {
        self.inner.step(params, lr, grad_scale)?;
        gather_weights(&self.sharding, params, (self.bucket, &*self.formats)) // Shard(0) → Replicate
    }

    fn state(&self) -> Vec<Vec<(&'static str, &Tensor)>> {
        self.inner.state()
    }

    fn state_mut(&mut self) -> Vec<Vec<&mut Tensor>> {
        self.inner.state_mut()
    }

    fn steps_taken(&self) -> u32 {
        self.inner.steps_taken()
    }

    fn resume_at(&mut self, steps: u32) {
        self.inner.resume_at(steps);
    }

    fn to_place(&mut self, place: &Place) {
        self.inner.to_place(place);
    }
}

/// ZeRO-1 and 2, after the optimizer step: every rank gets the updated whole weights of every
/// sharded parameter, from the ranks sharding it (`gather_group`).
pub fn gather_weights(sharding: &Sharding, params: &mut [&mut Param], how: (usize, &dyn Formats)) -> Result<()> {
    let groups = by_group(sharding, &params.iter().map(|p| &**p).collect::<Vec<_>>());
    for (group, places) in groups {
        gather_group(group, &mut select(params, &places), how)?;
    }
    Ok(())
}

/// The updated whole weights of `params`, all sharded over `group`, in groups that gather about
/// `bucket` values (one all-gather each, the next one started before the current one is
/// unpacked). The averaged gradient partitions are used up: freed first.
fn gather_group(group: &Group, params: &mut [&mut Param], (bucket, formats): (usize, &dyn Formats)) -> Result<()> {
    for p in params.iter_mut() {
        partition_of_mut(p).expect("a sharded parameter").grad = Tensor::zeros(&[0]);
    }
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    let mut size = 0;
    for (i, p) in params.iter().enumerate() {
        let c = partition_of(p).expect("a sharded parameter").master.numel() * group.size(); // gathered
        match groups.last_mut() {
            Some(g) if size + c <= bucket => g.end = i + 1,
            _ => {
                groups.push(i..i + 1);
                size = 0;
            }
        }
        size += c;
    }
    let start = |params: &[&mut Param], g: &std::ops::Range<usize>| {
        start_gather(group, &params[g.clone()].iter().map(|p| &**p).collect::<Vec<_>>(), formats)
    };
    let mut next = groups.first().map(|g| start(params, g)).transpose()?;
    for (i, g) in groups.iter().enumerate() {
        let Gather { pending, packings } = next.take().expect("started one group ahead");
        let current = pending.wait()?;
        next = groups.get(i + 1).map(|g| start(params, g)).transpose()?;
        unpack(&current, &packings, &mut params[g.clone()], group.size());
    }
    Ok(())
}
