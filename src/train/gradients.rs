//! # Each gradient's way from backward to the optimizer
//!
//! A gradient leaves backward as each rank's share of it: averaged over the ranks holding the
//! same parameter — its replicas, on the axis `Param::replicas` names (dp×cp for the dense
//! weights) — it becomes the gradient of the whole batch. Each axis has one reducer, and backward
//! hands every finished gradient to the reducer of its axis; `finish` waits for what is still in
//! flight. Data parallelism's bucketed all-reduce is the first reducer
//! (`parallel/data_parallel.rs`):
//!
//! ```text
//! backward ──grad_ready(p)──▶ the reducer of p's replicas' axis   (a bucket's all-reduce starts)
//! finish ─────────────────▶ every reducer, in the order they were added, waits and writes back
//! ```
//! Which reducers a run has is decided once, by the composition root (`train/compose.rs`): later
//! lessons plug theirs in here without this file naming them — ZeRO a reduce-scatter in place of
//! the all-reduce, a mixture of experts its own axis, sequence parallelism a sum over tp after
//! the others (`Which::Every`). What the step does next (the global norm, AdamW, the weights'
//! way back) reads in order in `train/step.rs`.

use crate::comm::process_grid::Axis;
use crate::model::Param;
use crate::parallel::data_parallel::GradReduce;
use anyhow::Result;

/// Which gradients a reducer takes.
#[derive(Clone, Copy, PartialEq)]
pub enum Which {
    /// Those of the parameters replicated over this axis.
    Replicas(Axis),
    /// Every parameter's, after the replicas' reducers.
    Every,
}

impl Which {
    fn takes(self, p: &Param) -> bool {
        match self {
            Which::Replicas(axis) => p.replicas == axis,
            Which::Every => true,
        }
    }
}

/// The reducers of the step.
#[derive(Default)]
pub struct Gradients<'g> {
    reducers: Vec<(Which, Box<dyn GradReduce + 'g>)>,
}

impl<'g> Gradients<'g> {
    /// Adds the reducer of the gradients `which` names.
    pub fn add(&mut self, which: Which, reducer: Box<dyn GradReduce + 'g>) {
        self.reducers.push((which, reducer));
    }

    /// Of `params` (in model order, `chunks` each one's model chunk), those replicated over
    /// `axis`, with their chunks: what a reducer of that axis plans its buckets for.
    pub fn replicated_over<'p>((params, chunks): (&[&'p Param], &[usize]), axis: Axis) -> (Vec<&'p Param>, Vec<usize>) {
        let mine = (0..params.len()).filter(|&i| params[i].replicas == axis);
        mine.map(|i| (params[i], chunks[i])).unzip()
    }

    /// Backward's hook: `p`'s gradient of this micro-batch is complete (`last`: of the step's last).
    pub fn grad_ready(&mut self, p: &mut Param, last: bool) {
        for (which, reducer) in &mut self.reducers {
            if which.takes(p) {
                reducer.grad_ready(p, last);
            }
        }
    }

    /// `grad_ready` as a closure, for the pipeline schedule.
    pub fn hook<'s>(&'s mut self) -> impl FnMut(&mut Param, bool) + use<'s, 'g> {
        |p, last| self.grad_ready(p, last)
    }

    /// After the step's last backward: every reducer in turn finishes the gradients it takes
    /// (the replicas' average; under ZeRO this rank's chunk of it).
    pub fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        for (which, reducer) in &mut self.reducers {
            let mut mine: Vec<&mut Param> = params.iter_mut().filter(|p| which.takes(p)).map(|p| &mut **p).collect();
            reducer.finish(&mut mine)?;
        }
        Ok(())
    }
}
