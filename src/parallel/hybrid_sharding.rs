//! # Hybrid sharding (HSDP): ZeRO within shard groups, replicated across them
//!
//! FSDP shards over every dp × cp rank, so each gather and reduce-scatter spans the whole group,
//! across the slow links between nodes. Hybrid sharding (PyTorch's HSDP) cuts the data-parallel
//! ranks into shard groups of `parallel.dp_shard` (inside a node; two cuts of the grid's dp×cp
//! group, `SHARD` and `REPLICATE`, `comm/process_grid.rs`), runs ZeRO within each (`zero.rs`,
//! `fsdp.rs`, over the shard axis), and keeps the groups as replicas of one another:
//!
//! ```text
//! dp = 4, dp_shard = 2:   shard groups {0 1} {2 3}     replicate groups {0 2} {1 3}
//!
//! backward   gradient ──reduce-scatter in the shard group──▶ my partition of the group's mean
//! step end   my partition ──all-reduce across the replicate group──▶ the mean over all four
//! forward    partitions ──all-gather in the shard group──▶ the whole weight (never leaves the node)
//! ```
//! The one thing it adds to ZeRO is the middle line, plugged into ZeRO's seam for what happens
//! to each bucket's averaged partitions (`ZeroBuckets`'s `AfterReduce`): one all-reduce per bucket,
//! once a step, of a 1/dp_shard share of the gradients — the only traffic that crosses nodes.

use crate::comm::process_grid::{Along, Cut, Grid};
use crate::comm::{Group, ReduceOp};
use crate::parallel::zero::AfterReduce;
use anyhow::{bail, Result};

/// The shard groups: consecutive blocks of dp_shard replicas, with their cp ranks.
pub const SHARD: Cut = Cut { name: "shard", what: "shard groups (ZeRO's partitions)", along: Along::Blocks };
/// The replicate groups: the ranks with the same place in their shard groups.
pub const REPLICATE: Cut = Cut { name: "replicate", what: "replicate groups (same partitions)", along: Along::Strided };

/// `grid` with the shard and replicate groups of `parallel.dp_shard` replicas (0, or all of dp:
/// no hybrid sharding, no cut; ZeRO then shards over the whole dp×cp group).
pub fn cut_grid(grid: Grid, dp_shard: usize) -> Result<Grid> {
    let dp_shard = if dp_shard == 0 { grid.dp } else { dp_shard };
    if !grid.dp.is_multiple_of(dp_shard) {
        bail!("parallel.dp_shard = {dp_shard} does not divide parallel.dp = {}: hybrid sharding cuts the dp replicas into equal shard groups", grid.dp);
    }
    if dp_shard == grid.dp {
        return Ok(grid);
    }
    let (n, setting) = (dp_shard * grid.cp, Some(("dp_shard", dp_shard)));
    grid.with_cut(SHARD, n, setting)?.with_cut(REPLICATE, n, setting)
}

/// Is ZeRO hybrid in `grid`: sharded within groups and replicated across them?
pub fn is_hybrid(grid: &Grid) -> bool {
    grid.cuts().any(|made| made.cut == SHARD)
}

/// Each shard group averaged its own data's gradients; across the `replicas` group (the ranks
/// holding the same partitions) the partitions become the mean over all of them.
pub fn average_across<'g>(replicas: &'g Group) -> AfterReduce<'g> {
    Box::new(move |partitions| replicas.all_reduce_tensor(partitions, ReduceOp::Avg))
}
