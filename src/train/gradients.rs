//! # Each gradient's way from backward to the optimizer
//!
//! A gradient leaves backward `Partial(avg)` (`comm/placement.rs`) on the axis of its
//! parameter's replicas, `Param::replicas`: dp×cp for the dense weights, the expert-data axis for
//! a mixture of experts' experts (`model/moe.rs` says so when it makes them). Each of the two
//! axes has one reducer, and backward hands every finished gradient to the reducer of its axis:
//!
//! ```text
//! axis       ZeRO off (or one rank)                 ZeRO on that axis
//! dp×cp      DataParallel: bucketed all-reduce      ZeroBuckets: bucketed reduce-scatter
//!            (parallel/data_parallel.rs)            (parallel/zero.rs)
//! edp        the same, over the ranks holding the same experts; then ÷ ep (expert_parallel.rs)
//! ```
//! Under hybrid sharding (`parallel.dp_shard`) the dense ZeroBuckets reduce-scatter inside a
//! shard group and then average each chunk across the replicate group.
//! `finish` waits for what is still in flight. What the step does next (the sums over tp, the
//! global norm, AdamW, ZeRO's gather) reads in order in `train.rs`.

use crate::comm::launcher::Rank;
use crate::comm::process_grid::Axis;
use crate::config::ParallelConfig;
use crate::model::Param;
use crate::parallel::data_parallel::{DataParallel, GradReduce};
use crate::parallel::expert_parallel::average_over_tokens;
use crate::parallel::zero::{Sharding, ZeroBuckets};
use anyhow::Result;

/// The reducers of the step, one per axis that replicates parameters.
pub struct Gradients<'g> {
    reducers: Vec<(Axis, Box<dyn GradReduce + 'g>)>,
    ep: usize,
}

impl<'g> Gradients<'g> {
    /// The reducers for `params` (in model order, with each one's model chunk) of rank `me`,
    /// with ZeRO where `sharding` says.
    pub fn new(
        me: &'g Rank,
        p: &ParallelConfig,
        sharding: &Sharding<'g>,
        (params, chunks): (&[&Param], &[usize]),
    ) -> Self {
        let mut reducers: Vec<(Axis, Box<dyn GradReduce + 'g>)> = Vec::new();
        for axis in [Axis::DpCp, Axis::ExpertDp] {
            let mine: Vec<usize> = (0..params.len()).filter(|&i| params[i].replicas == axis).collect();
            let list = (
                mine.iter().map(|&i| params[i]).collect::<Vec<_>>(),
                mine.iter().map(|&i| chunks[i]).collect::<Vec<_>>(),
            );
            let list = (&list.0[..], &list.1[..]);
            let reducer: Box<dyn GradReduce> = match sharding.on(axis) {
                Some(group) => {
                    // hybrid sharding: the dense chunks are averaged across the replicate group too
                    let hybrid = axis == Axis::DpCp && me.grid.hybrid();
                    let replicas = hybrid.then(|| me.group(Axis::DpReplicate));
                    Box::new(ZeroBuckets::new((group, replicas), list, p.bucket_mb, p.zero_stage))
                }
                None => Box::new(DataParallel::new(me.group(axis), list, p.dp_mode, p.bucket_mb)),
            };
            reducers.push((axis, reducer));
        }
        Gradients { reducers, ep: me.group(Axis::Ep).size() }
    }

    /// Backward's hook: `p`'s gradient of this micro-batch is complete (`last`: of the step's last).
    pub fn grad_ready(&mut self, p: &mut Param, last: bool) {
        let (_, reducer) = self.reducers.iter_mut().find(|(axis, _)| *axis == p.replicas).expect("a reducer per axis");
        reducer.grad_ready(p, last);
    }

    /// `grad_ready` as a closure, for the pipeline schedule.
    pub fn hook<'s>(&'s mut self) -> impl FnMut(&mut Param, bool) + use<'s, 'g> {
        |p, last| self.grad_ready(p, last)
    }

    /// After the step's last backward: every gradient averaged over its replicas (under ZeRO:
    /// this rank's chunk of the average), the experts' then divided by ep.
    pub fn finish(&mut self, params: &mut [&mut Param]) -> Result<()> {
        for (axis, reducer) in &mut self.reducers {
            let mut mine: Vec<&mut Param> =
                params.iter_mut().filter(|p| p.replicas == *axis).map(|p| &mut **p).collect();
            reducer.finish(&mut mine)?;
            if *axis == Axis::ExpertDp {
                average_over_tokens(&mut mine, self.ep);
            }
        }
        Ok(())
    }
}
