//! # FSDP: ZeRO's other half, the weights gathered from their chunks
//!
//! ZeRO (`zero.rs`) leaves each rank 1/dp of every weight's fp32 master: `Shard(0)` of its flat
//! values on the dp×cp axis (`comm/placement.rs`). A forward or backward needs the whole weight:
//! `Shard(0)` → `Replicate`, an all-gather. Stages 1 and 2 gather every weight once per step,
//! right after the optimizer updated the chunks (`gather_weights`). Stage 3 (FSDP) keeps nothing
//! whole: the model asks for a unit (a block, the embedding, the head) just before it computes
//! with it and frees it right after (`Fsdp`, the model's `WeightSplit`), and the next unit's
//! gather is already in flight while this one computes:
//!
//! ```text
//! comm:     [gather layer 0][gather layer 1][gather layer 2] …
//! compute:                  [layer 0]       [layer 1]       [layer 2] …   (free after each)
//! ```
//! A gather packs this rank's chunks of the unit's parameters side by side, so one all-gather
//! returns every rank's chunks, rank after rank; `unpack` puts each parameter together without
//! its padding. How each chunk travels is a seam (`Formats`, one `Wire` a parameter): the fp32
//! master as it is (`Master`) unless the composition root plugs in another — the formats the
//! GEMMs read, bf16 or FP8 (`gather_formats.rs`). The experts' chunks are gathered over their own
//! group, the expert-data ranks.

use crate::comm::tensors::Pending;
use crate::comm::Group;
use crate::model::optimizer::Optimizer;
use crate::model::{Param, WeightSplit};
use crate::ops;
use crate::ops::tensor::{Place, Tensor};
use crate::parallel::zero::{real, Sharding};
use anyhow::Result;
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

/// The sharded parameters of `params` by the group sharding them (dense first, then experts;
/// one group when they are the same, as without expert parallelism), as places in `params`.
fn by_group<'g>(sharding: &Sharding<'g>, params: &[&Param]) -> Vec<(&'g Group, Vec<usize>)> {
    let mut out = Vec::new();
    let experts = sharding.expert_group.filter(|e| !sharding.dense_group.is_some_and(|d| std::ptr::eq(d, *e)));
    for group in [sharding.dense_group, experts].into_iter().flatten() {
        let of = |p: &&Param| p.zero.is_some() && sharding.of(p).is_some_and(|g| std::ptr::eq(g, group));
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
type Started<'g> = Vec<(&'g Group, Vec<usize>, Gather)>;

/// Starts the gathers of a unit's sharded weights: one per sharding group.
fn start_unit<'g>(sharding: &Sharding<'g>, unit: &[&Param], formats: &dyn Formats) -> Result<Started<'g>> {
    let mut started = Vec::new();
    for (group, places) in by_group(sharding, unit) {
        let params: Vec<&Param> = places.iter().map(|&i| unit[i]).collect();
        let pending = start_gather(group, &params, formats)?;
        started.push((group, places, pending));
    }
    Ok(started)
}

/// Waits for a unit's gathers and puts its whole weights together.
fn finish_unit(started: Started, unit: &mut [&mut Param]) -> Result<()> {
    for (group, places, pending) in started {
        unpack(&pending.pending.wait()?, &pending.wires, &mut select(unit, &places), group.size());
    }
    Ok(())
}

/// How one weight's chunk travels in a gather, packed into f32 slots that every backend moves
/// bit for bit.
pub trait Wire {
    /// This rank's chunk, packed (`Cow::Borrowed`: sent as it is).
    fn pack<'t>(&self, chunk: &'t Tensor) -> Cow<'t, Tensor>;
    /// The slots a chunk of `c` numbers takes.
    fn slots(&self, c: usize) -> usize;
    /// The `c` numbers of the chunk packed at slot `from` of `gathered`: a tensor holding them,
    /// and where they start in it.
    fn unpack<'t>(&self, gathered: &'t Tensor, from: usize, c: usize) -> (Cow<'t, Tensor>, usize);
}

/// The seam: each parameter's `Wire` for one gather of `params` over `group`, agreeing over the
/// group first whatever the formats need (FP8: each weight's amax over every chunk).
pub trait Formats {
    fn wires(&self, group: &Group, params: &[&Param]) -> Result<Vec<Box<dyn Wire>>>;
}

/// The fp32 master as it is: FSDP's own format.
pub struct Master;

impl Wire for Master {
    fn pack<'t>(&self, chunk: &'t Tensor) -> Cow<'t, Tensor> {
        Cow::Borrowed(chunk) // no copy
    }

    fn slots(&self, c: usize) -> usize {
        c
    }

    fn unpack<'t>(&self, gathered: &'t Tensor, from: usize, _: usize) -> (Cow<'t, Tensor>, usize) {
        (Cow::Borrowed(gathered), from) // no decoding: copied as they are
    }
}

impl Formats for Master {
    fn wires(&self, _: &Group, params: &[&Param]) -> Result<Vec<Box<dyn Wire>>> {
        Ok(params.iter().map(|_| Box::new(Master) as Box<dyn Wire>).collect())
    }
}

/// A gather in flight: every rank's packed chunks, and each parameter's wire.
struct Gather {
    pending: Pending,
    wires: Vec<Box<dyn Wire>>,
}

/// Starts the all-gather of the whole weights of `params` from every rank's master chunks: each
/// rank packs its chunks side by side, each as its wire says.
fn start_gather(group: &Group, params: &[&Param], formats: &dyn Formats) -> Result<Gather> {
    let masters: Vec<&Tensor> = params.iter().map(|p| &p.zero.as_ref().expect("a sharded parameter").master).collect();
    let wires = formats.wires(group, params)?;
    let packed: Vec<Cow<Tensor>> = masters.iter().zip(&wires).map(|(m, w)| w.pack(m)).collect();
    let packed = ops::concat(&packed.iter().map(|p| &**p).collect::<Vec<_>>()); // this rank's chunks one after another
    let pending = group.all_gather_tensor_async(packed)?; // every rank's chunks, rank after rank
    Ok(Gather { pending, wires })
}

/// Puts the whole weights of `params` together from a gather: rank after rank, each rank's
/// chunks of every parameter side by side, each as its wire packed it.
fn unpack(gathered: &Tensor, wires: &[Box<dyn Wire>], params: &mut [&mut Param], ranks: usize) {
    let width = gathered.numel() / ranks; // one rank's packed chunks, in f32 slots
    let mut at = 0;
    for (p, wire) in params.iter_mut().zip(wires) {
        let shape = p.shape().to_vec();
        let (n, c) = (shape.iter().product(), p.zero.as_ref().expect("a sharded parameter").master.numel());
        let mut whole: Option<Tensor> = None;
        for r in 0..ranks {
            let (part, from) = wire.unpack(gathered, r * width + at, c);
            let whole = whole.get_or_insert_with(|| Tensor::empty_as(&shape, &part)); // written whole
            ops::copy(&part, from, whole, r * c, real(n, c, r));
        }
        p.value = whole.expect("at least one rank");
        at += wire.slots(c);
    }
}

/// ZeRO-1 and 2 as the step sees them, through the optimizer seam: the optimizer updates this
/// rank's chunks, then every rank gets the updated whole weights (`gather_weights`).
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

/// Stage 1 and 2, after the optimizer step: every rank gets the updated whole weights of every
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
/// unpacked). The averaged gradient chunks are used up: freed first.
fn gather_group(group: &Group, params: &mut [&mut Param], (bucket, formats): (usize, &dyn Formats)) -> Result<()> {
    for p in params.iter_mut() {
        p.zero.as_mut().expect("a sharded parameter").grad = Tensor::zeros(&[0]);
    }
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    let mut size = 0;
    for (i, p) in params.iter().enumerate() {
        let c = p.zero.as_ref().expect("a sharded parameter").master.numel() * group.size(); // gathered
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
        let Gather { pending, wires } = next.take().expect("started one group ahead");
        let current = pending.wait()?;
        next = groups.get(i + 1).map(|g| start(params, g)).transpose()?;
        unpack(&current, &wires, &mut params[g.clone()], group.size());
    }
    Ok(())
}

/// Stage 3: gathers a unit's whole weights before it computes (the next unit's gather already
/// in flight while it does) and frees them after.
pub struct Fsdp<'g> {
    sharding: Sharding<'g>,
    formats: Rc<dyn Formats + 'g>,
    /// The gathers started for the unit whose first parameter is named so.
    prefetched: RefCell<Option<(String, Started<'g>)>>,
    /// When the unit now gathered got its weights (a traced run draws its compute from there).
    computing: Cell<Option<Instant>>,
}

impl<'g> Fsdp<'g> {
    /// FSDP over `sharding`'s groups, each weight travelling as `formats` says.
    pub fn new(sharding: Sharding<'g>, formats: Rc<dyn Formats + 'g>) -> Fsdp<'g> {
        Fsdp { sharding, formats, prefetched: RefCell::new(None), computing: Cell::new(None) }
    }
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
                    pending.pending.wait()?;
                }
                start_unit(&self.sharding, &unit.iter().map(|p| &**p).collect::<Vec<_>>(), &*self.formats)?
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
            earlier.pending.wait()?; // not used: a gather is only ever one unit ahead
        }
        *prefetched = Some((first.name.clone(), start_unit(&self.sharding, next, &*self.formats)?));
        Ok(())
    }

    fn release(&self, unit: &mut [&mut Param]) {
        if let (Some(start), Some(first)) = (self.computing.take(), unit.first()) {
            if let Some(group) = self.sharding.dense_group.or(self.sharding.expert_group) {
                group.trace_compute(|| unit_name(&first.name), start); // on this rank's trace
            }
        }
        for p in unit.iter_mut().filter(|p| p.zero.is_some()) {
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
