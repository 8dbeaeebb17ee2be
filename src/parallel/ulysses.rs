//! # Ulysses: context parallelism by trading the sequence split for a head split
//!
//! Ring attention (`context_parallel.rs`) keeps each rank's slice of the sequence and passes the
//! keys and values around. DeepSpeed-Ulysses (Megatron's `cp_comm_type = "a2a"`) does the
//! opposite around attention: one all-to-all turns "my positions, every head" into "every
//! position, my heads", attention runs locally on whole sequences, and another all-to-all turns
//! the output back. In placements (`comm/placement.rs`), with q as `[batch, seq, heads·hd]`:
//!
//! ```text
//! q, k, v   Shard(1) (my positions)  ──all-to-all──▶  Shard(2) (my heads, every position)
//! attention of my heads, whole sequences: nothing else to talk about
//! out       Shard(2)                 ──all-to-all──▶  Shard(1)
//! ```
//! Heads are independent in attention, so this is exact, and every rank does the same work
//! whatever the split. Each all-to-all sends (cp − 1)/cp of a rank's tensor: the bytes per rank
//! fall as the sequence is cut finer, where the ring sends every other rank's keys and values
//! (cp − 1 blocks) to each. The price: cp must divide the heads (each tp rank's), and the
//! all-to-alls sit on the critical path, where the ring hides its transfers behind attention.
//!
//! **Grouped-query attention.** Query heads `[j·H/cp, (j+1)·H/cp)` read KV heads
//! `[j·KV/cp, (j+1)·KV/cp)`, so when cp divides the KV heads they split the same way. When it
//! does not (2 KV heads on 4 ranks), each KV head is first repeated r = cp / gcd(KV, cp) times,
//! in place, so that KV·r heads divide by cp and query head h still reads a copy of its own
//! KV head; backward sums the copies' gradients back into it.
//!
//! The block keeps its tensors in the sequence split, so backward moves q, k, v and out to the
//! head split again (with the output gradient and the log-sum-exp) before its all-to-alls home.
//! Which ranks hold which positions is `context_parallel::positions`: attention reads them, so
//! either split works; both cost the same here.

use crate::comm::placement::{redistribute, Placement};
use crate::comm::Group;
use crate::config::CpSplit;
use crate::model::SequenceSplit;
use crate::ops::tensor::Tensor;
use crate::ops::{self, gather_blocks, Attn};
use crate::parallel::context_parallel::positions;
use anyhow::Result;
use std::borrow::Cow;

/// The cp group, all-to-all'ing between the sequence split and the head split.
#[derive(Clone, Copy)]
pub struct Ulysses<'g> {
    pub group: &'g Group,
    pub split: CpSplit,
}

const SEQ: Placement = Placement::Shard(1);
const HEADS: Placement = Placement::Shard(2);

/// How often each KV head is repeated so that `n` ranks split them: r = n / gcd(kv, n).
pub fn repeats(kv_heads: usize, n: usize) -> usize {
    let gcd = (1..=kv_heads.min(n)).rev().find(|&d| kv_heads.is_multiple_of(d) && n.is_multiple_of(d)).unwrap_or(1);
    n / gcd
}

impl Ulysses<'_> {
    /// `t` `[batch·seq, heads·hd]` of this rank's positions → `[batch·S, heads/cp·hd]` of every
    /// position (in rank order: rank 0's positions, then rank 1's, …) and this rank's heads.
    fn head_split(&self, t: &Tensor, batch: usize) -> Result<Tensor> {
        let (n, cols) = (self.group.size(), t.cols());
        let seq = t.rows() / batch;
        let whole = [batch, seq * n, cols];
        Ok(redistribute(Cow::Borrowed(t), &whole, SEQ, HEADS, self.group)?.with_shape(&[batch * seq * n, cols / n]))
    }

    /// The inverse: `[batch·S, heads/cp·hd]` → `[batch·seq, heads·hd]` of this rank's positions.
    fn sequence_split(&self, t: Tensor, batch: usize) -> Result<Tensor> {
        let (n, cols) = (self.group.size(), t.cols());
        let whole_seq = t.rows() / batch;
        let whole = [batch, whole_seq, cols * n];
        Ok(redistribute(Cow::Owned(t), &whole, HEADS, SEQ, self.group)?.with_shape(&[batch * whole_seq / n, cols * n]))
    }

    /// Every position of the sequence, in the order `head_split` lays the rows out.
    fn all_positions(&self, seq: usize) -> Vec<u32> {
        let n = self.group.size();
        (0..n).flat_map(|i| positions(self.split, n, i, seq * n)).collect()
    }

    /// The attention call on this rank's heads and every position.
    fn head_attn(&self, a: Attn) -> Attn {
        let n = self.group.size();
        let kv_heads = a.kv_heads * repeats(a.kv_heads, n) / n;
        Attn { seq: a.seq * n, kv_seq: a.kv_seq * n, heads: a.heads / n, kv_heads, ..a }
    }

    /// k or v with each of its KV heads repeated `r` times in place, then to the head split.
    fn kv_head_split(&self, t: &Tensor, a: Attn) -> Result<Tensor> {
        let r = repeats(a.kv_heads, self.group.size());
        self.head_split(&repeat_heads(t, a.kv_heads, r), a.batch)
    }

    /// The log-sum-exp `[batch, heads, seq]` of my positions ↔ `[batch, heads/cp, S]` of my heads.
    fn lse_head_split(&self, lse: &Tensor, a: Attn) -> Result<Tensor> {
        let whole = [a.batch, a.heads, a.seq * self.group.size()];
        redistribute(Cow::Borrowed(lse), &whole, Placement::Shard(2), Placement::Shard(1), self.group)
    }
}

/// `t` `[rows, kv·hd]` with each KV head repeated `r` times in place: `[rows, kv·r·hd]`.
fn repeat_heads(t: &Tensor, kv: usize, r: usize) -> Cow<'_, Tensor> {
    if r == 1 {
        return Cow::Borrowed(t);
    }
    let (rows, hd) = (t.rows(), t.cols() / kv);
    let order: Vec<u32> = (0..rows * kv).flat_map(|h| std::iter::repeat_n(h as u32, r)).collect();
    Cow::Owned(gather_blocks(t, hd, &order).with_shape(&[rows, kv * r * hd]))
}

/// The backward of `repeat_heads`: each KV head's gradient, summed over its `r` copies.
fn sum_repeats(d: Tensor, kv: usize, r: usize) -> Tensor {
    if r == 1 {
        return d;
    }
    let (rows, hd) = (d.rows(), d.cols() / (kv * r));
    let copy = |c: usize| gather_blocks(&d, hd, &(0..rows * kv).map(|h| (h * r + c) as u32).collect::<Vec<_>>());
    let mut sum = copy(0);
    for c in 1..r {
        ops::add_assign(&mut sum, &copy(c));
    }
    sum.with_shape(&[rows, kv * hd])
}

impl SequenceSplit for Ulysses<'_> {
    fn positions(&self, seq: usize) -> Vec<u32> {
        positions(self.split, self.group.size(), self.group.index(), seq * self.group.size())
    }

    /// q, k, v to the head split, attention of my heads over whole sequences, out back.
    fn attention(&self, a: Attn, q: &Tensor, k: &Tensor, v: &Tensor, _: &[u32]) -> Result<(Tensor, Tensor, u64)> {
        let h = self.head_attn(a);
        let (q, k, v) = (self.head_split(q, a.batch)?, self.kv_head_split(k, a)?, self.kv_head_split(v, a)?);
        let all = self.all_positions(a.seq);
        let (out, lse) = ops::attention(h, &q, &k, &v, (&all, &all));
        let whole = [a.batch, a.heads, h.seq];
        let lse = redistribute(Cow::Owned(lse), &whole, Placement::Shard(1), Placement::Shard(2), self.group)?;
        Ok((self.sequence_split(out, a.batch)?, lse, (h.batch * h.heads * h.seq * h.kv_seq) as u64))
    }

    /// Everything attention's backward reads to the head split, and dq, dk, dv back.
    fn attention_backward(
        &self,
        a: Attn,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        _: &[u32],
        (out, lse): (&Tensor, &Tensor),
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let h = self.head_attn(a);
        let (q, k, v) = (self.head_split(q, a.batch)?, self.kv_head_split(k, a)?, self.kv_head_split(v, a)?);
        let (out, dout, lse) =
            (self.head_split(out, a.batch)?, self.head_split(dout, a.batch)?, self.lse_head_split(lse, a)?);
        let all = self.all_positions(a.seq);
        let (dq, dk, dv) = ops::attention_backward(h, (&q, &k, &v), (&all, &all), (&out, &lse), &dout);
        let r = repeats(a.kv_heads, self.group.size());
        let home = |d: Tensor| -> Result<Tensor> { Ok(sum_repeats(self.sequence_split(d, a.batch)?, a.kv_heads, r)) };
        Ok((self.sequence_split(dq, a.batch)?, home(dk)?, home(dv)?))
    }
}
