//! # ZeRO and FSDP: data parallelism that shards what it used to replicate
//!
//! Plain data parallelism keeps a full copy of everything on every dp rank: per parameter 4 B of
//! weight, 4 B of gradient and 8 B of AdamW moments (on a GPU in mixed precision, 2 B of bf16
//! weight more, next to the fp32 master). But each rank only *needs* all of it for a moment:
//! AdamW is elementwise, so rank r can update just its 1/dp of every parameter, if it has the
//! averaged gradient of that 1/dp. ZeRO (DeepSpeed) stops replicating, stage by stage:
//!
//! ```text
//!              weights (compute copy)   master + AdamW moments   gradients          per rank
//! stage 0      whole                    whole                    whole              16 B (18 on a GPU)
//! stage 1      whole                    1/dp                     whole              8 + 12/dp
//! stage 2      whole                    1/dp                     1/dp (+ a layer)   4 + 16/dp
//! stage 3      a unit while it computes 1/dp                     1/dp (+ a layer)   16/dp
//! ```
//! (f32 compute, bytes per parameter; a GPU in bf16 keeps a 2 B compute copy instead of 4, and
//! at stage 0 a 4 B master beside it. At stage 3 the unit is gathered from the master chunks.)
//!
//! The averaging all-reduce of plain DP becomes its two halves: a **reduce-scatter** gives each
//! rank the average of its own chunk of every gradient, each rank updates its chunk, and an
//! **all-gather** brings every rank the updated weights. Same bytes on the wire as one all-reduce.
//!
//! ```text
//! one step, rank r of dp            stage 1–2                           stage 3 (FSDP)
//! forward, unit by unit      use the whole weights            all-gather the unit → compute → free
//!                                                             (the next unit's gather already started)
//! backward, unit by unit     grads into buckets; when full:   all-gather → compute → free, and the
//!                            reduce-scatter (stage 2: every   grads' reduce-scatter as in stage 2
//!                            micro-batch, the full grad freed)
//! optimizer                  AdamW on chunk r (master, m, v)  AdamW on chunk r
//!                            → all-gather the new weights     (nothing: the next forward gathers)
//! ```
//! (`data_parallel.rs` keeps the buckets; stage 1 reduce-scatters once per step as stage 0
//! all-reduces, stage 2 and 3 on every micro-batch, since the full gradient is not kept.)
//!
//! **How a parameter is cut.** Each parameter on its own, by its flat values: rank r keeps
//! `[r·c, (r+1)·c)` with c = ⌈n / dp⌉, the last chunk padded with zeros. For a matrix whose rows
//! divide by dp this is FSDP2's `Shard(0)`: a block of whole rows. We chose per-parameter chunks
//! over FSDP1's one flat buffer per unit because everything that works per parameter keeps
//! working unchanged: AdamW with its weight-decay rule (matrices, not norms), clipping, the
//! checkpoint's tensors by name, resuming into any layout. The price is a copy in and out of a
//! flat buffer around each collective (`pack`, `unpack`), as FSDP2 pays.
//!
//! **Experts.** With expert parallelism (`expert_parallel.rs`) the experts are not replicated
//! over the dp×cp ranks but over the expert-data group (dp×cp / ep ranks): that is the group
//! that shards them (`Sharding`); alone in it, a rank keeps its experts whole.
//!
//! **Precision.** Gradients are reduce-scattered in fp32 (a sum of dp parts loses little there,
//! much in bf16); weights are all-gathered in the compute dtype (bf16 on a GPU: half the bytes,
//! and what the kernels read anyway), from the fp32 master chunks.

use crate::comm::tensors::Pending;
use crate::comm::Group;
use crate::model::optimizer::Optimizer;
use crate::model::param::Shard;
use crate::model::{Llama, Param, WeightSplit};
use crate::ops::tensor::Tensor;
use crate::ops::{self, DType};
use crate::parallel::data_parallel::{chunk, real};
use anyhow::Result;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

/// Which ranks shard a parameter: the dp×cp group, or for an expert the expert-data group;
/// `None`: kept whole (ZeRO off, or a group of one).
#[derive(Clone, Copy)]
pub struct Sharding<'g> {
    pub dense: Option<&'g Group>,
    pub experts: Option<&'g Group>,
}

impl<'g> Sharding<'g> {
    /// ZeRO over `dense` (the dp×cp ranks) and `experts` (the expert-data ranks), each when it
    /// has more than one rank and `stage` > 0.
    pub fn new(stage: usize, dense: &'g Group, experts: &'g Group) -> Sharding<'g> {
        let on = |g: &'g Group| (stage > 0 && g.size() > 1).then_some(g);
        Sharding { dense: on(dense), experts: on(experts) }
    }

    /// The group sharding `p`, if any.
    pub fn of(&self, p: &Param) -> Option<&'g Group> {
        if p.is_expert() {
            self.experts
        } else {
            self.dense
        }
    }

    pub fn any(&self) -> bool {
        self.dense.is_some() || self.experts.is_some()
    }
}

/// Shards the model's parameters and the optimizer's moments as `sharding` says, for ZeRO
/// `stage` 1–3: each rank keeps its chunk of every fp32 master, of its gradient and of both
/// moments. Stage 2 and 3 free the full gradients (backward makes each again, briefly); stage 3
/// frees the whole weights too and gives the model the FSDP gatherer.
pub fn shard<'g>(mut model: Llama<'g>, optimizer: &mut Optimizer, sharding: Sharding<'g>, stage: usize) -> Llama<'g> {
    let place = model.place();
    let mut moments = Vec::new();
    for (p, (m, v)) in model.params_mut().into_iter().zip(optimizer.moments()) {
        let Some(group) = sharding.of(p) else {
            moments.push((m.clone(), v.clone())); // kept whole
            continue;
        };
        let (r, ranks) = (group.index(), group.size());
        let n = p.value.numel();
        let c = chunk(n, ranks);
        let master = p.value.master_copy().unwrap_or_else(|| p.value.clone()); // fp32, whole
        let mine = |t: &Tensor| {
            let mut part = Tensor::zeros_on(&[c], &place, t.dtype()); // the padding stays zero
            ops::copy(t, r * c, &mut part, 0, real(n, c, r));
            part
        };
        moments.push((mine(m), mine(v)));
        let grad = Tensor::zeros(&[0]); // the averaged chunk, made by each step's reduce-scatters
        p.shard = Some(Shard { master: mine(&master), grad, shape: p.value.shape().to_vec() });
        p.value = match stage {
            3 => Tensor::zeros(&[0]),                   // gathered before each use
            _ => ops::convert(&p.value, place.dtype()), // the compute copy alone (no master)
        };
        if stage >= 2 {
            p.grad = Tensor::zeros(&[0]); // made by backward, handed to a bucket, freed
        }
    }
    optimizer.replace_moments(moments);
    match stage {
        3 => model.with_weight_split(Rc::new(Fsdp {
            sharding,
            prefetched: RefCell::new(None),
            computing: Cell::new(None),
        })),
        _ => model,
    }
}

/// The sharded parameters of `params` by the group sharding them (dense first, then experts;
/// one group when they are the same, as without expert parallelism), as places in `params`.
fn by_group<'g>(sharding: &Sharding<'g>, params: &[&Param]) -> Vec<(&'g Group, Vec<usize>)> {
    let mut out = Vec::new();
    let experts = sharding.experts.filter(|e| !sharding.dense.is_some_and(|d| std::ptr::eq(d, *e)));
    for group in [sharding.dense, experts].into_iter().flatten() {
        let of = |p: &&Param| p.shard.is_some() && sharding.of(p).is_some_and(|g| std::ptr::eq(g, group));
        let places: Vec<usize> = (0..params.len()).filter(|&i| of(&params[i])).collect();
        if !places.is_empty() {
            out.push((group, places));
        }
    }
    out
}

/// Of `params`, those at `places`.
fn select<'a>(params: &'a mut [&mut Param], places: &[usize]) -> Vec<&'a mut Param> {
    let picked = params.iter_mut().enumerate().filter(|(i, _)| places.contains(i));
    picked.map(|(_, p)| &mut **p).collect()
}

/// A unit's gathers in flight: one per sharding group, with the places of its parameters.
type Started<'g> = Vec<(&'g Group, Vec<usize>, Pending)>;

/// Starts the gathers of a unit's sharded weights: one per sharding group.
fn start_unit<'g>(sharding: &Sharding<'g>, unit: &[&Param]) -> Result<Started<'g>> {
    let mut started = Vec::new();
    for (group, places) in by_group(sharding, unit) {
        let params: Vec<&Param> = places.iter().map(|&i| unit[i]).collect();
        let pending = start_gather(group, &params)?;
        started.push((group, places, pending));
    }
    Ok(started)
}

/// Waits for a unit's gathers and puts its whole weights together.
fn finish_unit(started: Started, unit: &mut [&mut Param]) -> Result<()> {
    for (group, places, pending) in started {
        unpack(&pending.wait()?, &mut select(unit, &places), group.size());
    }
    Ok(())
}

/// Starts the all-gather of the whole weights of `params` from every rank's master chunks: each
/// rank packs its chunks side by side, in the compute dtype.
fn start_gather(group: &Group, params: &[&Param]) -> Result<Pending> {
    let masters: Vec<&Tensor> = params.iter().map(|p| &p.shard.as_ref().expect("a sharded parameter").master).collect();
    let packed = ops::concat(&masters); // fp32, this rank's chunks one after another
    let compute = masters[0].place().dtype();
    group.all_gather_tensor_async(if compute == DType::F32 { packed } else { ops::convert(&packed, compute) })
}

/// Puts the whole weights of `params` together from a gather: rank after rank, each rank's chunks
/// of every parameter side by side.
fn unpack(gathered: &Tensor, params: &mut [&mut Param], ranks: usize) {
    let width = gathered.numel() / ranks; // one rank's chunks
    let mut at = 0;
    for p in params.iter_mut() {
        let shape = p.shape().to_vec();
        let (n, c) = (shape.iter().product(), p.shard.as_ref().expect("a sharded parameter").master.numel());
        let mut whole = Tensor::empty_as(&shape, gathered); // written whole, rank by rank
        for r in 0..ranks {
            ops::copy(gathered, r * width + at, &mut whole, r * c, real(n, c, r));
        }
        p.value = whole;
        at += c;
    }
}

/// Stage 1 and 2, after the optimizer step: every rank gets the updated whole weights of every
/// sharded parameter, from the ranks sharding it (`gather_group`).
pub fn gather_weights(sharding: &Sharding, params: &mut [&mut Param], bucket: usize) -> Result<()> {
    let groups = by_group(sharding, &params.iter().map(|p| &**p).collect::<Vec<_>>());
    for (group, places) in groups {
        gather_group(group, &mut select(params, &places), bucket)?;
    }
    Ok(())
}

/// The updated whole weights of `params`, all sharded over `group`, in groups that gather about
/// `bucket` values (one all-gather each, the next one started before the current one is
/// unpacked). The averaged gradient chunks are used up: freed first.
fn gather_group(group: &Group, params: &mut [&mut Param], bucket: usize) -> Result<()> {
    for p in params.iter_mut() {
        p.shard.as_mut().expect("a sharded parameter").grad = Tensor::zeros(&[0]);
    }
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    let mut size = 0;
    for (i, p) in params.iter().enumerate() {
        let c = p.shard.as_ref().expect("a sharded parameter").master.numel() * group.size(); // gathered
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
        start_gather(group, &params[g.clone()].iter().map(|p| &**p).collect::<Vec<_>>())
    };
    let mut next = groups.first().map(|g| start(params, g)).transpose()?;
    for (i, g) in groups.iter().enumerate() {
        let current = next.take().expect("started one group ahead").wait()?;
        next = groups.get(i + 1).map(|g| start(params, g)).transpose()?;
        unpack(&current, &mut params[g.clone()], group.size());
    }
    Ok(())
}

/// Stage 3: gathers a unit's whole weights before it computes (the next unit's gather already
/// in flight while it does) and frees them after.
struct Fsdp<'g> {
    sharding: Sharding<'g>,
    /// The gathers started for the unit whose first parameter is named so.
    prefetched: RefCell<Option<(String, Started<'g>)>>,
    /// When the unit now gathered got its weights (a traced run draws its compute from there).
    computing: Cell<Option<Instant>>,
}

impl WeightSplit for Fsdp<'_> {
    fn gather(&self, unit: &mut [&mut Param]) -> Result<()> {
        let Some(first) = unit.first() else { return Ok(()) };
        let started = match self.prefetched.borrow_mut().take() {
            Some((name, started)) if name == first.name => started,
            other => {
                // nothing prefetched for this unit (the schedule turned from forward to backward):
                // finish what was started, in the same order on every rank, and gather now
                for (_, _, pending) in other.into_iter().flat_map(|(_, started)| started) {
                    pending.wait()?;
                }
                start_unit(&self.sharding, &unit.iter().map(|p| &**p).collect::<Vec<_>>())?
            }
        };
        finish_unit(started, unit)?;
        self.computing.set(Some(Instant::now())); // the prefetch of the next unit is issued from here on
        Ok(())
    }

    fn prefetch(&self, next: &[&Param]) -> Result<()> {
        let Some(first) = next.first() else { return Ok(()) };
        let mut prefetched = self.prefetched.borrow_mut();
        for (_, _, earlier) in prefetched.take().into_iter().flat_map(|(_, started)| started) {
            earlier.wait()?; // not used: a gather is only ever one unit ahead
        }
        *prefetched = Some((first.name.clone(), start_unit(&self.sharding, next)?));
        Ok(())
    }

    fn release(&self, unit: &mut [&mut Param]) {
        if let (Some(start), Some(first)) = (self.computing.take(), unit.first()) {
            if let Some(group) = self.sharding.dense.or(self.sharding.experts) {
                group.trace_compute(|| unit_name(&first.name), start); // on this rank's trace
            }
        }
        for p in unit.iter_mut().filter(|p| p.shard.is_some()) {
            p.value = Tensor::zeros(&[0]); // only the chunk in `shard` stays
        }
    }
}

/// How the trace names a unit's compute, from its first parameter: "layer 3 (FSDP unit)", …
fn unit_name(first: &str) -> String {
    let unit = match first.strip_prefix("model.layers.").and_then(|r| r.split('.').next()) {
        Some(i) => format!("layer {i}"),
        None if first.starts_with("model.embed_tokens") => "embedding".into(),
        None => "head".into(),
    };
    format!("{unit} (FSDP unit)")
}

/// A sharded parameter's tensor `t` (its master or a moment chunk) whole again, from every
/// rank's chunk (for a checkpoint); `None` for a parameter that is not sharded.
pub fn whole(group: &Group, p: &Param, t: &Tensor) -> Result<Option<Tensor>> {
    let Some(shard) = &p.shard else { return Ok(None) };
    let gathered = group.all_gather_tensor(t)?; // [ranks · c]: the chunks in rank order
    Ok(Some(ops::slice(&gathered, 0, &shard.shape))) // without the padding
}
