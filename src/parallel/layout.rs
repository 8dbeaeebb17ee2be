//! # The layout a config asks for: the process grid with every lesson's groups
//!
//! The grid (`comm/process_grid.rs`) knows dp × pp × cp × tp. Two later lessons cut more groups
//! out of its dp×cp group without adding ranks, each making its own cuts: expert parallelism
//! (`model/moe.rs`: the ep and expert-data groups) and hybrid sharding
//! (`parallel/hybrid_sharding.rs`: the shard and replicate groups). This is where they are put
//! together, for the run, the memory estimate and `ferrotron grid`; and where each parameter's
//! replicas are (`replicas`): the dp×cp ranks, or an expert's on the expert-data axis.

use crate::comm::process_grid::{Axis, Grid};
use crate::config::ParallelConfig;
use crate::model::moe::{self, EXPERT_DP};
use crate::model::Param;
use crate::parallel::hybrid_sharding;
use anyhow::Result;

/// The process grid of `p`, with every lesson's cuts of its dp×cp group.
pub fn grid_of(p: &ParallelConfig) -> Result<Grid> {
    with_cuts(Grid::new(p.dp, p.pp, p.cp, p.tp)?, p.ep, p.dp_shard)
}

/// `grid` with the groups expert parallelism (`parallel.ep`) and hybrid sharding
/// (`parallel.dp_shard`) cut out of its dp×cp group.
pub fn with_cuts(grid: Grid, ep: usize, dp_shard: usize) -> Result<Grid> {
    hybrid_sharding::cut_grid(moe::cut_grid(grid, ep)?, dp_shard)
}

/// The axis of `p`'s replicas, the ranks holding the same values of it (the `Replicas` the
/// gradients, ZeRO and checkpoints are given): an expert's are the ranks holding the same
/// experts, every other parameter's the dp×cp ranks.
pub fn replicas(p: &Param) -> Axis {
    if moe::is_expert(&p.name) {
        EXPERT_DP.into()
    } else {
        Axis::DpCp
    }
}
