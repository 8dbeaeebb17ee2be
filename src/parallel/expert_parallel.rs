//! # Expert parallelism: each rank holds some of the experts, and tokens travel to them
//!
//! A mixture of experts multiplies the MLP's weights by E while each token still uses k of them
//! (`model/moe.rs`). Expert parallelism (GShard, DeepSpeed-MoE, torchtitan) stops replicating the
//! experts: `ep` ranks of the dp×cp group (`process_grid.rs`) each keep E/ep of them, and every
//! MoE layer sends each routed row to the rank holding its expert and back. The attention and
//! the router stay data parallel: each rank routes its own tokens.
//!
//! ```text
//! ep = 2, E = 4          rank 0 holds experts 0 1            rank 1 holds experts 2 3
//! routed rows            [e0 e0 e1 | e2 e3 e3]               [e0 | e1 e1 e2 e2 e3]
//!   all-to-all (dispatch): rank 0 keeps its e0 e1 rows and gets rank 1's e0 e1 rows; …
//! rank 0 computes        e0: [mine, rank 1's]  e1: [mine, rank 1's]
//!   all-to-all (combine): every row goes back where it came from, in the order it left
//! ```
//! The sizes are known only after routing, so each layer first all-gathers the counts (E
//! numbers per rank: who sends how many rows to which expert); then one all-to-all of variable
//! sizes goes out and one comes back. Backward takes the same two roads for the gradients (the
//! output gradient to the experts, the input gradient home), with the counts it already has. The
//! order is fixed (experts in order, each expert's rows sender by sender, each sender's in token
//! order), so a run is the same every time and follows the single-rank curve.
//!
//! Gradients: an expert's gradient on its rank sums the rows of all ep ranks' tokens, and the
//! ranks holding the same experts average it as data parallelism does: their replicas' axis is
//! the expert-data axis (`parallel/layout.rs`'s `replicas`, by `model/moe.rs`'s `is_expert`), and each gradient
//! goes to the reducer of its axis (`train/gradients.rs`); divided by ep after that, it is the mean over every
//! dp×cp rank's tokens, as for the weights every rank holds (`average_over_tokens`). ZeRO shards
//! the expert weights over the expert-data group.

use crate::comm::Group;
use crate::model::moe::{ExpertSplit, Routed};
use crate::model::Param;
use crate::ops;
use crate::ops::moe::permute_rows;
use crate::ops::tensor::Tensor;
use crate::parallel::data_parallel::GradReduce;
use anyhow::Result;
use std::ops::Range;

/// The experts divided among the members of `group` (an ep group of the grid).
pub struct ExpertParallel<'g> {
    group: &'g Group,
}

impl<'g> ExpertParallel<'g> {
    pub fn new(group: &'g Group) -> ExpertParallel<'g> {
        ExpertParallel { group }
    }
}

/// The experts member `m` of `n` holds, of `total`.
fn held_by(m: usize, n: usize, total: usize) -> Range<usize> {
    let per = total / n;
    m * per..(m + 1) * per
}

impl Routed {
    /// Rows each member sends to the experts `member` holds (this rank sends `counts[me]`).
    fn to_member(&self, from: usize, member: usize) -> usize {
        let n = self.counts.len();
        self.counts[from][held_by(member, n, self.counts[from].len())].iter().sum()
    }

    /// (rows this rank sends to each member, rows it receives from each).
    fn sizes(&self) -> (Vec<usize>, Vec<usize>) {
        let n = self.counts.len();
        ((0..n).map(|j| self.to_member(self.me, j)).collect(), (0..n).map(|i| self.to_member(i, self.me)).collect())
    }

    /// Where the received rows (sender after sender, each sender's sorted by expert) go when
    /// laid out expert after expert (each expert's by sender): `order[i]` is the received row
    /// that becomes row i.
    fn by_expert(&self) -> Vec<u32> {
        let mut starts = Vec::new(); // starts[i][e]: where sender i's rows for held expert e begin
        let mut at = 0;
        for c in &self.counts {
            let mut mine = Vec::new();
            for e in self.held.clone() {
                mine.push(at);
                at += c[e];
            }
            starts.push(mine);
        }
        let mut order = Vec::new();
        for (local, e) in self.held.clone().enumerate() {
            for (i, c) in self.counts.iter().enumerate() {
                order.extend((starts[i][local]..starts[i][local] + c[e]).map(|r| r as u32));
            }
        }
        order
    }
}

impl ExpertSplit for ExpertParallel<'_> {
    fn held(&self, total: usize) -> Range<usize> {
        held_by(self.group.index(), self.group.size(), total)
    }

    fn dispatch(&self, rows: Tensor, counts: &[usize]) -> Result<(Tensor, Routed)> {
        let (n, total) = (self.group.size(), counts.len());
        // who sends how many rows to which expert: E small integers per member, exact in f32
        let mine: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
        let all = self.group.all_gather(&mine)?;
        let counts = all.chunks(total).map(|c| c.iter().map(|&x| x as usize).collect()).collect();
        let routed = Routed { counts, me: self.group.index(), held: held_by(self.group.index(), n, total) };
        let rows = self.dispatch_again(rows, &routed)?;
        Ok((rows, routed))
    }

    fn dispatch_again(&self, rows: Tensor, routed: &Routed) -> Result<Tensor> {
        let (send, recv) = routed.sizes();
        let received = self.group.all_to_all_tensor(&rows, &send, &recv)?;
        drop(rows);
        Ok(permute_rows(&received, &routed.by_expert())) // sender-major → expert-major
    }

    fn combine(&self, rows: Tensor, routed: &Routed) -> Result<Tensor> {
        let order = routed.by_expert();
        let mut back = vec![0u32; order.len()]; // expert-major → sender-major: the inverse order
        order.iter().enumerate().for_each(|(i, &r)| back[r as usize] = i as u32);
        let by_sender = permute_rows(&rows, &back);
        drop(rows);
        let (send, recv) = routed.sizes();
        self.group.all_to_all_tensor(&by_sender, &recv, &send) // every row home
    }
}

/// After the expert-data group averaged them: the expert gradients, which sum the rows of `ep`
/// ranks' tokens, divided by `ep` into the mean over every dp×cp rank's tokens. `experts` are
/// the parameters replicated over the expert-data axis.
pub fn average_over_tokens(experts: &mut [&mut Param], ep: usize) {
    if ep == 1 {
        return;
    }
    for p in experts.iter_mut() {
        ops::scale(p.trained().1, 1.0 / ep as f32);
    }
}

/// The experts' part of each gradient's way (`train/gradients.rs`): the reducer of the
/// expert-data axis (data parallelism's or ZeRO's), then `average_over_tokens`.
pub struct ExpertGrads<'g> {
    pub inner: Box<dyn GradReduce + 'g>,
    pub ep: usize,
}

impl GradReduce for ExpertGrads<'_> {
    fn grad_ready(&mut self, p: &mut Param, last: bool) {
        self.inner.grad_ready(p, last);
    }

    fn finish(&mut self, experts: &mut [&mut Param]) -> Result<()> {
        self.inner.finish(experts)?;
        average_over_tokens(experts, self.ep);
        Ok(())
    }
}
