//! # FSDP (ZeRO-3): the weights gathered from their partitions just before they compute
//!
//! ZeRO (`zero.rs`) leaves each rank 1/dp of every weight's fp32 master, its partition. A forward or
//! backward needs the whole weight: an all-gather. ZeRO-1 and 2 gather every weight once per
//! step, right after the optimizer updated the partitions (`zero.rs`'s `gather_weights`), and keep
//! it. ZeRO-3 (FSDP) keeps nothing whole: the model asks for a unit (a block, the embedding, the
//! head) just before it computes with it and frees it right after (`Fsdp`, the model's
//! `WeightSplit`), and the next unit's gather is already in flight while this one computes:
//!
//! ```text
//! comm:     [gather layer 0][gather layer 1][gather layer 2] …
//! compute:                  [layer 0]       [layer 1]       [layer 2] …   (free after each)
//! ```
//! A unit's gather is ZeRO's (`zero.rs`: `start_gather` packs this rank's partitions side by side,
//! `unpack` puts each weight together, each partition travelling as the `Formats` seam says), one per
//! group that shards the unit's parameters: the experts' partitions are gathered over their own group,
//! the expert-data ranks.

use crate::comm::Group;
use crate::model::{Param, WeightSplit};
use crate::ops::tensor::Tensor;
use crate::parallel::zero::{by_group, partition_of, select, start_gather, unpack, Formats, Gather, Sharding};
use anyhow::Result;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

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
        unpack(&pending.pending.wait()?, &pending.packings, &mut select(unit, &places), group.size());
    }
    Ok(())
}

/// ZeRO-3: gathers a unit's whole weights before it computes (the next unit's gather already
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
            if let Some(group) = self.sharding.groups().first() {
                group.trace_compute(|| unit_name(&first.name), start); // on this rank's trace
            }
        }
        for p in unit.iter_mut().filter(|p| partition_of(p).is_some()) {
            p.value = Tensor::zeros(&[0]); // only the partition in `shard` stays
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
