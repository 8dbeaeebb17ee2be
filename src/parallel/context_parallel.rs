//! # Context parallelism: the sequence split across ranks, attention as a ring
//!
//! Everything in a Llama block but attention works token by token, so each of the `cp` ranks can
//! hold a slice of every sequence. Attention needs every earlier key, so the key/value blocks
//! travel around the ring of cp ranks while each rank attends its queries to the block it holds:
//!
//! ```text
//! step 0: rank r attends to its own K,V      ──send K,V to r+1, receive from r−1──▶
//! step 1: rank r attends to rank r−1's K,V   ──pass it on──▶   …   (cp steps in all)
//! ```
//! Each block gives a partial softmax; partial results merge exactly through their
//! log-sum-exp (`ops/ring_merge.rs`), in fp32. The transfer of the next block overlaps the
//! attention of the current one, and a block the causal mask hides entirely is skipped. The
//! backward recomputes each block from the saved, merged log-sum-exp: dQ stays with the queries,
//! dK and dV travel on around the ring with their block and arrive home after cp hops.
//!
//! What travels is a block's *source* of keys and values (`attention_from`): for most attentions
//! k and v themselves; an attention whose keys and values are images of something smaller hands
//! that instead, and its maker (`MakeKeys`) turns each block into keys and values where it lands —
//! less traffic for more compute, the ring's trade to choose.
//!
//! **Split.** Cut contiguously, rank r holds positions `[r·T/cp, (r+1)·T/cp)` and its queries see
//! r + 1 of the cp blocks: the last rank does cp times the work of the first. Zigzag cuts the
//! sequence into 2·cp chunks and gives rank r chunks r and 2·cp − 1 − r, one early and one late,
//! so every rank attends to every block with the same amount of work. RoPE and the causal mask
//! use the global positions either way.
//!
//! This is the model's `SequenceSplit` (`model/split.rs`): the block's attention calls it. The
//! other answer to the same question is `ulysses.rs`: an all-to-all to a head split, and
//! attention on whole sequences (`parallel.cp_mode`).

use crate::comm::Group;
use crate::config::CpSplit;
use crate::model::split::{MakeKeys, MakeKeysBackward, SequenceSplit};
use crate::ops::ring_merge::attention_merge;
use crate::ops::tensor::Tensor;
use crate::ops::{self, Attn, DType};
use anyhow::Result;

/// A rank's place in the cp ring and how the sequence is cut.
#[derive(Clone, Copy)]
pub struct Ring<'g> {
    pub group: &'g Group,
    pub split: CpSplit,
}

/// Positions of a sequence of `seq` tokens that rank `index` of `count` holds, in order.
pub fn positions(split: CpSplit, count: usize, index: usize, seq: usize) -> Vec<u32> {
    match split {
        CpSplit::Contiguous => {
            let n = seq / count;
            (index * n..(index + 1) * n).map(|p| p as u32).collect()
        }
        CpSplit::Zigzag => {
            let c = seq / (2 * count);
            let chunk = |i: usize| (i * c..(i + 1) * c).map(|p| p as u32);
            chunk(index).chain(chunk(2 * count - 1 - index)).collect()
        }
    }
}

impl Ring<'_> {
    fn size(&self) -> usize {
        self.group.size()
    }
    /// The positions held by the owner of the block a rank holds at ring step `step`.
    fn block_positions(&self, step: usize, seq: usize) -> Vec<u32> {
        let (n, r) = (self.size(), self.group.index());
        positions(self.split, n, (r + n - step) % n, seq * n)
    }
    fn next_prev(&self) -> (usize, usize) {
        let (n, r) = (self.size(), self.group.index());
        ((r + 1) % n, (r + n - 1) % n)
    }
}

/// Can any query at `q_pos` see any key at `k_pos`?
fn visible(q_pos: &[u32], k_pos: &[u32]) -> bool {
    k_pos.iter().min() <= q_pos.iter().max()
}

impl SequenceSplit for Ring<'_> {
    fn positions(&self, seq: usize) -> Vec<u32> {
        positions(self.split, self.size(), self.group.index(), seq * self.size())
    }

    /// Attention to every block of keys as it passes by: k and v travel as they are.
    fn attention(&self, a: Attn, q: &Tensor, k: &Tensor, v: &Tensor, pos: &[u32]) -> Result<(Tensor, Tensor, u64)> {
        self.attention_from(a, q, (&ops::concat(&[k, v]), &AsGiven(k.shape().to_vec())), pos)
    }

    fn attention_backward(
        &self,
        a: Attn,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        pos: &[u32],
        out_lse: (&Tensor, &Tensor),
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (source, mut keys) = (ops::concat(&[k, v]), AsGiven(k.shape().to_vec()));
        let (dq, dsource) = self.attention_from_backward(a, q, (&source, &mut keys), pos, out_lse, dout)?;
        let [dk, dv] = unpack(&dsource, k.shape());
        Ok((dq, dk, dv))
    }

    /// Attention to every block of keys as it passes by, merged through the log-sum-exp. What
    /// travels is the block's source; its keys and values are made where it lands.
    fn attention_from(
        &self,
        a: Attn,
        q: &Tensor,
        (source, keys): (&Tensor, &dyn MakeKeys),
        pos: &[u32],
    ) -> Result<(Tensor, Tensor, u64)> {
        let work = (a.batch * a.heads * a.seq * a.kv_seq) as u64;
        let mut out = Tensor::zeros_like(q);
        let no_key = vec![f32::NEG_INFINITY; a.batch * a.heads * a.seq];
        let mut lse = Tensor::from_vec(&[a.batch, a.heads, a.seq], no_key).to_dtype(&q.place(), DType::F32);
        let mut done = 0;
        walk(self, a, source, |block, k_pos| {
            if visible(pos, k_pos) {
                let (k, v) = keys.keys(block);
                let (o, l) = ops::attention(a, q, &k, &v, (pos, k_pos));
                attention_merge(a, (&mut out, &mut lse), &o, &l);
                done += work;
            }
            Ok(())
        })?;
        Ok((out, lse, done))
    }

    /// The backward from the merged `out` and `lse`: dq stays, the source's gradient travels with
    /// its block.
    fn attention_from_backward(
        &self,
        a: Attn,
        q: &Tensor,
        (source, keys): (&Tensor, &mut dyn MakeKeysBackward),
        pos: &[u32],
        (out, lse): (&Tensor, &Tensor),
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (next, prev) = self.next_prev();
        let mut dq = Tensor::zeros_like(q);
        let mut dblock = Tensor::zeros_like(source);
        walk(self, a, source, |block, k_pos| {
            if visible(pos, k_pos) {
                let (k, v) = keys.keys(block);
                let (dq_i, dk_i, dv_i) = ops::attention_backward(a, (q, &k, &v), (pos, k_pos), (out, lse), dout);
                ops::add_assign(&mut dq, &dq_i);
                ops::add_assign(&mut dblock, &keys.keys_backward(block, &dk_i, &dv_i));
            }
            // the block's gradient follows the block; after the last hop it is back with its owner
            dblock = self.group.send_recv_tensor(&dblock, next, source.shape(), prev)?;
            Ok(())
        })?;
        Ok((dq, dblock))
    }
}

/// Keys and values that travel as they are: the source is k then v, each of this shape.
struct AsGiven(Vec<usize>);

impl MakeKeys for AsGiven {
    fn keys(&self, source: &Tensor) -> (Tensor, Tensor) {
        let [k, v] = unpack(source, &self.0);
        (k, v)
    }
}

impl MakeKeysBackward for AsGiven {
    fn keys_backward(&mut self, _: &Tensor, dk: &Tensor, dv: &Tensor) -> Tensor {
        ops::concat(&[dk, dv])
    }
}

/// Walks the ring: at step s this rank holds the block (a source of keys and values) of the rank
/// s places before it (its own at step 0), and `visit(block, key positions)` runs on it while the
/// block already travels on to the next rank (an async `send_recv`).
fn walk(ring: &Ring, a: Attn, source: &Tensor, mut visit: impl FnMut(&Tensor, &[u32]) -> Result<()>) -> Result<()> {
    let (next, prev) = ring.next_prev();
    let mut received: Option<Tensor> = None; // the block in hand, after our own
    for step in 0..ring.size() {
        let block = received.as_ref().unwrap_or(source);
        let pending = (step + 1 < ring.size())
            .then(|| ring.group.send_recv_tensor_async(ops::concat(&[block]), next, source.shape(), prev))
            .transpose()?;
        visit(block, &ring.block_positions(step, a.seq))?;
        if let Some(pending) = pending {
            received = Some(pending.wait()?);
        }
    }
    Ok(())
}

/// The two tensors of a block that holds two of `shape` one after the other (K and V, or their
/// gradients).
fn unpack(block: &Tensor, shape: &[usize]) -> [Tensor; 2] {
    let half = block.numel() / 2;
    [ops::slice(block, 0, shape), ops::slice(block, half, shape)]
}
