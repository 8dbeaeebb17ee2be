//! # Placements: where a tensor lives on one axis of the grid, and the collective between two
//!
//! Take one axis of the grid (its group of n ranks) and a tensor whose whole value has shape S.
//! Every parallelism in this repository keeps that tensor in one of three *placements* on that
//! axis. These are PyTorch DTensor's words, which torchtitan and FSDP2 are built on:
//!
//! ```text
//! Shard(d)      rank r holds the r-th of n equal slices along dimension d
//! Replicate     every rank holds all of it
//! Partial(op)   every rank holds a tensor of shape S, and the value is their sum (or mean):
//!               a gradient just after backward, a row-parallel layer's output before its g
//! ```
//! Going from one placement to another *is* a collective (or, where nothing needs to travel, a
//! local step):
//!
//! ```text
//! from \ to     Replicate        Shard(d)                    Partial(op)
//! Partial(op)   all-reduce       reduce-scatter              —
//! Shard(d)      all-gather       all-to-all (from Shard(e))  local: zeros around the slice
//! Replicate     —                local: keep rank r's slice  local: rank 0 keeps it (sum)
//! ```
//! An all-reduce is a reduce-scatter followed by an all-gather (Partial → Shard → Replicate):
//! ZeRO splits data parallelism's all-reduce into exactly those two halves.
//!
//! Where ferrotron's tensors live, in these words (tutorial step 11 prints and checks the table):
//!
//! ```text
//! tensor                          axis     placement
//! q k v gate up, embedding, head  tp       Shard(0): rows of W [out, in] (Megatron's "column-parallel")
//! o, down                         tp       Shard(1): columns of W (Megatron's "row-parallel")
//! norm weights, router            tp       Replicate
//! any weight                      dp×cp    Replicate; under ZeRO Shard(0) of its flat values
//! an expert's weights             ep       Shard(0) of the layer's experts; edp like dp×cp above
//! a gradient after backward       dp×cp    Partial(avg) → all-reduce (DP) or reduce-scatter (ZeRO)
//! a norm's gradient, with SP      tp       Partial(sum) → all-reduce
//! a master under hybrid sharding  shard    Shard(0) of its flat values, and Replicate on replicate
//! q, k, v around Ulysses          cp       Shard(1) of [batch, seq, heads·hd] → all-to-all → Shard(2)
//! a checkpoint's tensor           every    Replicate, gathered from wherever it is
//! ```
//! A dimension that does not divide by n is padded: every slice has ⌈S[d]/n⌉ entries along d,
//! and the last slices end in zeros (FSDP2 pads the same way before its collectives). That is how
//! ZeRO cuts a parameter of any size (`parallel/zero.rs`).
//!
//! Every helper here sees a tensor as `[a, S[d], b]` around its dimension d (`ops::around`), so
//! one slice is a block of `S[d]/n · b` values in each of the a rows (`ops::slice_along`, the
//! same cut tensor parallelism makes): the local steps are `ops::copy` where the slices are
//! contiguous (a = 1) and one gather of blocks elsewhere (of single entries where the last slice
//! is padded).

use crate::comm::tensors::Pending;
use crate::comm::Group;
use crate::ops::tensor::Tensor;
use crate::ops::types::{ReduceOp, TpCut};
use crate::ops::{self, gather_blocks};
use anyhow::{bail, ensure, Result};
use std::borrow::Cow;

/// Where a tensor lives on one axis of the grid (see the lesson above).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Placement {
    Shard(usize),
    Replicate,
    Partial(ReduceOp),
}

/// Tensor parallelism's cuts (step 09) are placements on the tp axis: rows `Shard(0)`, columns
/// `Shard(1)`, whole `Replicate`.
impl From<TpCut> for Placement {
    fn from(cut: TpCut) -> Placement {
        cut.dim().map_or(Placement::Replicate, Placement::Shard)
    }
}

/// What takes a tensor from one placement to another: a collective, or a local step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Move {
    Nothing,
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp, usize),
    AllGather(usize),
    AllToAll {
        from: usize,
        to: usize,
    },
    /// Local: keep this rank's slice along the dimension.
    Slice(usize),
    /// Local: this rank's slice along the dimension (× n for a mean), zeros everywhere else.
    Pad(usize),
    /// Local: a sum's rank 0 keeps the value and the others hold zeros (a mean's ranks all keep it).
    Split(ReduceOp),
}

impl Move {
    /// The table of the lesson: the move from `from` to `to`.
    pub fn between(from: Placement, to: Placement) -> Result<Move> {
        use Placement::*;
        Ok(match (from, to) {
            (a, b) if a == b => Move::Nothing,
            (Partial(op), Replicate) => Move::AllReduce(op),
            (Partial(op), Shard(d)) => Move::ReduceScatter(op, d),
            (Shard(d), Replicate) => Move::AllGather(d),
            (Shard(d), Shard(e)) => Move::AllToAll { from: d, to: e },
            (Replicate, Shard(d)) => Move::Slice(d),
            (Shard(_), Partial(ReduceOp::Max)) => bail!("a partial max of a shard would need -∞ around it"),
            (Shard(d), Partial(_)) => Move::Pad(d),
            (Replicate, Partial(op)) => Move::Split(op),
            (Partial(a), Partial(b)) => bail!("no move turns a partial {a:?} into a partial {b:?}"),
            (Replicate, Replicate) => unreachable!("equal placements move nothing"),
        })
    }

    /// Does the move send anything between ranks?
    pub fn communicates(self) -> bool {
        matches!(self, Move::AllReduce(_) | Move::ReduceScatter(..) | Move::AllGather(_) | Move::AllToAll { .. })
    }

    /// The move in words: `all_reduce(sum)`, `all_gather along dim 1`, `local: slice along dim 0`.
    pub fn name(self) -> String {
        let op = |op: ReduceOp| format!("{op:?}").to_lowercase();
        match self {
            Move::Nothing => "nothing".into(),
            Move::AllReduce(o) => format!("all_reduce({})", op(o)),
            Move::ReduceScatter(o, d) => format!("reduce_scatter({}) along dim {d}", op(o)),
            Move::AllGather(d) => format!("all_gather along dim {d}"),
            Move::AllToAll { from, to } => format!("all_to_all: dim {from} → dim {to}"),
            Move::Slice(d) => format!("local: keep my slice along dim {d}"),
            Move::Pad(d) => format!("local: my slice along dim {d}, zeros elsewhere"),
            Move::Split(o) => format!("local: a partial {} of the value", op(o)),
        }
    }
}

/// The shape one rank holds of a tensor whose whole shape is `shape`, placed so over `n` ranks.
fn local_shape(shape: &[usize], placement: Placement, n: usize) -> Vec<usize> {
    let mut local = shape.to_vec();
    if let Placement::Shard(d) = placement {
        local[d] = shape[d].div_ceil(n);
    }
    local
}

/// Rank `r`'s part (of `n`) of `whole` placed as `to`: the local step from Replicate, nothing
/// sent (a slice for Shard; for a sum's Partial, the value on rank 0 and zeros elsewhere).
pub fn part_of(whole: &Tensor, to: Placement, (r, n): (usize, usize)) -> Tensor {
    match to {
        Placement::Shard(d) => ops::slice_along(whole, whole.shape(), d, (r, n)),
        Placement::Partial(ReduceOp::Sum) if r > 0 => Tensor::zeros_as(whole.shape(), whole),
        _ => whole.clone(), // every rank holds it all: Replicate, or a mean's (or max's) Partial
    }
}

/// Every rank's slice along `d`, one after another (rank-major): what a reduce-scatter along the
/// first dimension hands out as Shard(d).
fn rank_major(whole: &Tensor, shape: &[usize], d: usize, n: usize) -> Tensor {
    let (a, s, b) = ops::around(shape, d);
    let ld = s.div_ceil(n);
    if a > 1 && s == n * ld {
        // one gather: block r of every row, rank after rank
        let order: Vec<u32> = (0..n).flat_map(|r| (0..a).map(move |i| (i * n + r) as u32)).collect();
        return gather_blocks(whole, ld * b, &order);
    }
    let parts: Vec<Tensor> = (0..n).map(|r| ops::slice_along(whole, shape, d, (r, n))).collect();
    ops::concat(&parts.iter().collect::<Vec<_>>())
}

/// The whole tensor of `shape` from every rank's slice along `d`, one after another (what an
/// all-gather returns): the inverse of `rank_major`, without the padding.
fn assemble(stacked: &Tensor, shape: &[usize], d: usize, n: usize) -> Tensor {
    let (a, s, b) = ops::around(shape, d);
    let ld = s.div_ceil(n);
    if a == 1 {
        return ops::slice(stacked, 0, shape); // the slices are runs, the padding at the end
    }
    if s == n * ld {
        // no padding: row i's block j is block i of rank j's slice
        let order: Vec<u32> = (0..a).flat_map(|i| (0..n).map(move |j| (j * a + i) as u32)).collect();
        return gather_blocks(stacked, ld * b, &order).with_shape(shape);
    }
    // entry (i, k) of the whole is entry (i, k mod ld) of rank k / ld's slice
    let order: Vec<u32> =
        (0..a).flat_map(|i| (0..s).map(move |k| ((k / ld) * a * ld + i * ld + k % ld) as u32)).collect();
    gather_blocks(stacked, b, &order).with_shape(shape)
}

/// Moves this rank's `t` (of a tensor whose whole shape is `shape`) from placement `from` to `to`
/// over `group`, with the move of the table. Returns this rank's tensor in the new placement. `t`
/// is borrowed where the move only reads it, owned where an all-reduce can work in place.
pub fn redistribute(t: Cow<Tensor>, shape: &[usize], from: Placement, to: Placement, group: &Group) -> Result<Tensor> {
    let (r, n) = (group.index(), group.size());
    for p in [from, to] {
        if let Placement::Shard(d) = p {
            ensure!(d < shape.len(), "{p:?} of a tensor of {} dimensions ({shape:?})", shape.len());
        }
    }
    let step = Move::between(from, to)?;
    if n == 1 {
        return Ok(t.into_owned()); // alone, every placement is the whole value
    }
    Ok(match step {
        Move::Nothing => t.into_owned(),
        Move::AllReduce(op) => {
            let mut t = t.into_owned();
            group.all_reduce_tensor(&mut t, op)?; // in place
            t
        }
        Move::ReduceScatter(op, d) => {
            let local = local_shape(shape, to, n);
            let stacked = rank_major(&t, shape, d, n).with_shape(&[n * local.iter().product::<usize>()]);
            group.reduce_scatter_tensor(&stacked, op)?.with_shape(&local)
        }
        Move::AllGather(d) => assemble(&group.all_gather_tensor(&t)?, shape, d, n),
        Move::AllToAll { from: d, to: e } => {
            // each rank sends member j its slice along e of what it holds along d …
            let mine = local_shape(shape, from, n);
            let piece = local_shape(&mine, to, n).iter().product::<usize>();
            let sent = rank_major(&t, &mine, e, n).with_shape(&[n, piece]);
            let got = group.all_to_all_tensor(&sent, &vec![1; n], &vec![1; n])?;
            // … and puts the slices along d that it receives side by side
            let theirs = local_shape(shape, to, n); // the whole along d, my slice along e
            assemble(&got, &theirs, d, n)
        }
        Move::Slice(d) => ops::slice_along(&t, shape, d, (r, n)),
        Move::Split(_) => part_of(&t, to, (r, n)),
        Move::Pad(d) => {
            let zeros = Tensor::zeros_as(t.shape(), &t);
            let parts: Vec<&Tensor> = (0..n).map(|j| if j == r { &*t } else { &zeros }).collect();
            let mut padded = assemble(&ops::concat(&parts), shape, d, n);
            if to == Placement::Partial(ReduceOp::Avg) {
                ops::scale(&mut padded, n as f32); // the mean of the n parts is the whole
            }
            padded
        }
    })
}

/// Starts a move that is one collective along the first dimension of a tensor laid out for it
/// (`t` is already rank-major: a ZeRO bucket, a unit's packed weight partitions), and returns it in
/// flight: Partial → Replicate (all-reduce), Partial → Shard(0) (reduce-scatter), Shard(0) →
/// Replicate (all-gather, the slices one after another).
pub fn start(t: Tensor, from: Placement, to: Placement, group: &Group) -> Result<Pending> {
    match Move::between(from, to)? {
        Move::AllReduce(op) => group.all_reduce_tensor_async(t, op),
        Move::ReduceScatter(op, 0) => group.reduce_scatter_tensor_async(t, op),
        Move::AllGather(0) => group.all_gather_tensor_async(t),
        other => bail!("{} is not one collective along the first dimension", other.name()),
    }
}
