//! # Hybrid sharding (HSDP): ZeRO within shard groups, replicated across them
//!
//! FSDP shards over every dp × cp rank, so each gather and reduce-scatter spans the whole group,
//! across the slow links between nodes. Hybrid sharding (PyTorch's HSDP) cuts the data-parallel
//! ranks into shard groups of `parallel.dp_shard` (inside a node; the grid carves them,
//! `comm/process_grid.rs`), runs ZeRO within each (`zero.rs`, `fsdp.rs`, over the shard axis), and
//! keeps the groups as replicas of one another:
//!
//! ```text
//! dp = 4, dp_shard = 2:   shard groups {0 1} {2 3}     replicate groups {0 2} {1 3}
//!
//! backward   gradient ──reduce-scatter in the shard group──▶ my chunk of the group's mean
//! step end   my chunk ──all-reduce across the replicate group──▶ the mean over all four
//! forward    chunks ──all-gather in the shard group──▶ the whole weight (never leaves the node)
//! ```
//! The one thing it adds to ZeRO is the middle line, plugged into ZeRO's seam for what happens
//! to each bucket's averaged chunks (`ZeroBuckets`'s `AfterReduce`): one all-reduce per bucket,
//! once a step, of a 1/dp_shard share of the gradients — the only traffic that crosses nodes.

use crate::comm::{Group, ReduceOp};
use crate::parallel::zero::AfterReduce;

/// Each shard group averaged its own data's gradients; across the `replicas` group (the ranks
/// holding the same chunks) the chunks become the mean over all of them.
pub fn average_across<'g>(replicas: &'g Group) -> AfterReduce<'g> {
    Box::new(move |chunks| replicas.all_reduce_tensor(chunks, ReduceOp::Avg))
}
