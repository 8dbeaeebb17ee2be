//! # Each gradient's way from backward to the optimizer
//!
//! A gradient leaves backward as each rank's share of it: averaged over the ranks holding the
//! same parameter — its replicas, on the axis the layout names for it (`Replicas`: dp×cp for
//! the dense weights) — it becomes the gradient of the whole batch. Each axis has one reducer,
//! and backward hands every finished gradient to the reducer of its axis; `finish` waits for what
//! is still in flight. Data parallelism's bucketed all-reduce is the first reducer
//! (`parallel/data_parallel.rs`):
//!
//! ```text
//! backward ──grad_ready(p)──▶ the reducer of p's replicas' axis   (a bucket's all-reduce starts)
//! finish ─────────────────▶ every reducer, in the order they were added, waits and writes back
//! ```
//! Which reducers a run has is decided once, by the composition root (`train/compose.rs`): later
//! lessons plug theirs in here without this file naming them — ZeRO a reduce-scatter in place of
//! the all-reduce, a mixture of experts its own axis, sequence parallelism a sum over tp after
//! the others (`Which::Every`). Then the global norm (`global_sum_squares`): each rank's Σ g²
//! over what it holds, added up over the groups that cut the model, so that clipping sees the
//! whole model's gradient. What the step does next (AdamW, the weights' way back) reads in order
//! in `train/step.rs`.

use crate::comm::process_grid::Axis;
use crate::comm::{Group, ReduceOp};
use crate::model::Param;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::{self, DType, TpCut};
use crate::parallel::data_parallel::{GradReduce, Replicas};
use anyhow::Result;
use std::collections::HashMap;
use std::rc::Rc;

/// Which gradients a reducer takes.
#[derive(Clone, Copy, PartialEq)]
pub enum Which {
    /// Those of the parameters replicated over this axis.
    Replicas(Axis),
    /// Every parameter's, after the replicas' reducers.
    Every,
}

impl Which {
    fn takes(self, p: &Param, axes: &AxisOf) -> bool {
        match self {
            Which::Replicas(axis) => axes.of(p) == axis,
            Which::Every => true,
        }
    }
}

/// Each parameter's replicas' axis, decided once from the model's parameters as the reducers are
/// made (the layout's `Replicas`: dp×cp, or a later lesson's axis for its own parameters); the
/// step then hands each gradient on by it, asking nothing of the parameter but its name.
#[derive(Clone)]
pub struct AxisOf(Rc<HashMap<String, Axis>>);

impl AxisOf {
    pub fn new(params: &[&Param], replicas: Replicas) -> AxisOf {
        AxisOf(Rc::new(params.iter().map(|p| (p.name.clone(), replicas(p))).collect()))
    }

    /// `p`'s replicas' axis (dp×cp for a parameter it was not made with).
    pub fn of(&self, p: &Param) -> Axis {
        self.0.get(&p.name).copied().unwrap_or(Axis::DpCp)
    }
}

/// The reducers of the step.
pub struct Gradients<'g> {
    /// Each parameter's replicas' axis.
    axes: AxisOf,
    reducers: Vec<(Which, Box<dyn GradReduce + 'g>)>,
}

impl<'g> Gradients<'g> {
    /// No reducer yet, for parameters whose replicas' axis `axes` says.
    pub fn new(axes: AxisOf) -> Gradients<'g> {
        Gradients { axes, reducers: Vec::new() }
    }

    /// Adds the reducer of the gradients `which` names.
    pub fn add(&mut self, which: Which, reducer: Box<dyn GradReduce + 'g>) {
        self.reducers.push((which, reducer));
    }

    /// Of `params` (in model order, `chunks` each one's model chunk), those replicated over
    /// `axis`, with their chunks: what a reducer of that axis plans its buckets for.
    pub fn replicated_over<'p>(
        &self,
        (params, chunks): (&[&'p Param], &[usize]),
        axis: Axis,
    ) -> (Vec<&'p Param>, Vec<usize>) {
        let mine = (0..params.len()).filter(|&i| self.axes.of(params[i]) == axis);
        mine.map(|i| (params[i], chunks[i])).unzip()
    }

    /// Backward's hook: `p`'s gradient of this micro-batch is complete (`last`: of the step's last).
    pub fn grad_ready(&mut self, p: &mut Param, last: bool) {
        for (which, reducer) in &mut self.reducers {
            if which.takes(p, &self.axes) {
                reducer.grad_ready(p, last);
            }
        }
    }

    /// `grad_ready` as a closure, for the pipeline schedule.
    pub fn hook<'s>(&'s mut self) -> impl FnMut(&mut Param, bool) + use<'s, 'g> {
        |p, last| self.grad_ready(p, last)
    }

    /// After the step's last backward: every reducer in turn finishes the gradients it takes
    /// (the replicas' average; under ZeRO this rank's partition of it).
    pub fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        for (which, reducer) in &mut self.reducers {
            let takes = |p: &Param| which.takes(p, &self.axes);
            let mut mine: Vec<&mut Param> = params.iter_mut().filter(|p| takes(p)).map(|p| &mut **p).collect();
            reducer.finish(&mut mine)?;
        }
        Ok(())
    }
}

/// Σ g² of the whole model's gradient when it is cut across the tp group and the pp stages: the
/// sum of squares of a whole is the sum of its slices' sums, so each rank's Σ g² over its tp
/// slices is summed over the tp group, plus the parameters every tp rank holds whole counted
/// once, then summed over the stages. Each replicas' axis (`NormAxis`) adds its parameters' part
/// this way in turn: where each rank holds only a part of every trained gradient (ZeRO's
/// partitions), its sums are first added up over the group holding the other parts; where the
/// axis's other ranks hold other parameters (a later lesson's experts), over that group too. A
/// one-number tensor on the rank's device: on GPUs the sums stay there (NCCL), and the step reads
/// it together with the loss.
pub fn global_sum_squares(params: &[&mut Param], groups: &NormGroups) -> Result<Tensor> {
    let place = params.first().map_or(Place::Cpu, |p| p.place());
    let sum = |keep: &dyn Fn(&Param) -> bool, parts: Option<&Group>| -> Result<Tensor> {
        let counted = |p: &&&mut Param| keep(p) && !groups.copies.contains(&p.name);
        let grads: Vec<&Tensor> = params.iter().filter(counted).map(|p| p.trained_grad()).collect();
        let mut sum = ops::sum_squares_total(&grads, &place);
        if let Some(group) = parts {
            group.all_reduce_tensor(&mut sum, ReduceOp::Sum)?; // the other ranks' parts
        }
        Ok(sum)
    };
    let mut total: Option<Tensor> = None;
    for a in &groups.axes {
        let on = |p: &Param| groups.axes_of.of(p) == a.axis;
        if !params.iter().any(|p| on(p)) {
            continue;
        }
        // the tp slices, summed over the tp group; then what every tp rank holds whole
        let mut part = None;
        if params.iter().any(|p| on(p) && p.tp != TpCut::Whole) {
            let mut slices = sum(&|p| on(p) && p.tp != TpCut::Whole, a.parts)?;
            groups.tp.all_reduce_tensor(&mut slices, ReduceOp::Sum)?;
            part = Some(slices);
        }
        let whole = sum(&|p| on(p) && p.tp == TpCut::Whole, a.parts)?;
        let mut part = match part {
            Some(mut slices) => {
                ops::add_assign(&mut slices, &whole);
                slices
            }
            None => whole,
        };
        if let Some(group) = a.others {
            group.all_reduce_tensor(&mut part, ReduceOp::Sum)?; // the parameters the others hold
        }
        match &mut total {
            Some(total) => ops::add_assign(total, &part),
            None => total = Some(part),
        }
    }
    let mut total = total.unwrap_or_else(|| Tensor::zeros_on(&[1], &place, DType::F32));
    groups.pp.all_reduce_tensor(&mut total, ReduceOp::Sum)?;
    Ok(total)
}

/// The groups the gradient norm adds its parts over.
pub struct NormGroups<'g> {
    /// Each parameter's replicas' axis.
    pub axes_of: AxisOf,
    pub tp: &'g Group,
    pub pp: &'g Group,
    /// Each replicas' axis, in the order their parts are added (dp×cp first).
    pub axes: Vec<NormAxis<'g>>,
    /// The parameters this rank holds as copies of another rank's, which counts them (once).
    pub copies: Vec<String>,
}

/// The parameters replicated over `axis`, and the groups their sums are added over.
pub struct NormAxis<'g> {
    pub axis: Axis,
    /// The ranks holding the other parts of each trained part (ZeRO), if they are cut.
    pub parts: Option<&'g Group>,
    /// The ranks holding other parameters of this axis, if any (experts: the ep group).
    pub others: Option<&'g Group>,
}
