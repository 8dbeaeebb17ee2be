//! # Muon under every layout: one owner per matrix
//!
//! Muon's Newton–Schulz (`model/muon.rs`) needs each matrix whole, and no earlier layout keeps
//! it so: ZeRO cuts every parameter into flat partitions, one per data-parallel rank, and tensor
//! parallelism gives each tp rank a slice. Gathering every matrix on every rank would work and
//! would cost every rank the whole model's worth of traffic and of Newton–Schulz GEMMs. Instead
//! (as nanochat and Megatron-LM distribute it) each matrix gets **one owner**: its pieces travel
//! to the owner, the owner runs Newton–Schulz, and each rank gets its piece of the result back.
//! The GEMMs are divided among the ranks instead of repeated on each.
//!
//! ```text
//! the owners, in each data-parallel group (dp×cp; an expert's: its expert-data group; under
//! hybrid sharding: its shard group): the matrices by size, largest first (ties by name), each
//! to the rank that owns the fewest values so far — the same answer on every rank, no message
//!
//! one step, per group of n ranks; U = the update of a matrix of N values (4 B each, f32)
//!   ZeRO-1/2/3 (partitions)   all_to_all: each rank's partition of U → the owner      (n−1)/n · N · 4 B
//!                         owner: Newton–Schulz;  all_to_all: partition r of O → rank r   the same
//!   ZeRO-0 (replicas)     every rank has U already: nothing goes out
//!                         owner: Newton–Schulz;  all_to_all: O → every rank   (n−1) · N · 4 B
//!   tensor parallel       the owner's tp group: each tp slice → the tp owner, O's slices back
//!   pipeline              each stage owns its own matrices: nothing new
//! ```
//! So under ZeRO Muon moves two more reduce-scatters' worth of bytes per step (the gradient's
//! reduce-scatter and the weights' all-gather are unchanged; the momentum stays in partitions:
//! it is elementwise); without ZeRO every rank receives the whole model's orthogonalised updates,
//! an all-gather's worth. Under ZeRO-3 no weight is gathered for it: what travels is the update.
//! Memory: the owner holds its matrices whole for Newton–Schulz (the update, X, the Gram matrix
//! and its square), one matrix at a time.
//!
//! Every exchange is an `all_to_all` with counts, the experts' collective: the comm report
//! counts it on the group's axis (`--comm-report`). Each phase runs over every group before the
//! next phase starts, in the same order on every rank, so no two ranks wait on each other in
//! different groups.

use crate::comm::launcher::Rank;
use crate::comm::process_grid::Axis;
use crate::comm::Group;
use crate::model::muon::{self, WholeMatrices};
use crate::model::Param;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::{self, TpCut};
use crate::parallel::data_parallel::Replicas;
use crate::parallel::zero::{self, Sharding};
use anyhow::Result;

/// Where one matrix's pieces go.
#[derive(Clone, Debug)]
struct MatrixOwner {
    /// Its data-parallel group (an index into `Owners::groups`), the owner's index in it, and
    /// whether ZeRO cuts it into partitions there (else every member holds it whole); `None`: no
    /// other rank holds it.
    dp: Option<(usize, usize, bool)>,
    /// Under tensor parallelism, the tp owner and how the slices cut it (`None`: whole).
    tp: Option<(usize, TpCut)>,
    /// The values of this rank's tp slice of the matrix, and of its ZeRO partition.
    values: usize,
    partition: usize,
    /// The tp slice's shape.
    shape: Vec<usize>,
}

/// Muon's matrices brought together at their owners (the `WholeMatrices` seam for a layout).
pub struct Owners<'g> {
    matrices: Vec<MatrixOwner>,
    groups: Vec<&'g Group>,
    tp: &'g Group,
}

/// Assigns `sizes` (named) to `ranks` owners: by size, largest first, ties by name, each to the
/// least-loaded owner (the lowest index among equals). Returns each one's owner, in input order.
pub fn assign(sizes: &[(&str, usize)], ranks: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].1.cmp(&sizes[a].1).then(sizes[a].0.cmp(sizes[b].0)));
    let (mut load, mut owner) = (vec![0usize; ranks], vec![0; sizes.len()]);
    for i in order {
        let least = (0..ranks).min_by_key(|&r| (load[r], r)).expect("one rank at least");
        owner[i] = least;
        load[least] += sizes[i].1;
    }
    owner
}

impl<'g> Owners<'g> {
    /// The owners of the Muon matrices of `params` (the model's, before ZeRO cuts them) for rank
    /// `me`: in the group that shards each (`sharding`), or that replicates it (`replicas`), and
    /// across the tp group.
    pub fn new(me: &'g Rank, sharding: &Sharding<'g>, replicas: Replicas, params: &[&Param]) -> Owners<'g> {
        let tp = me.group(Axis::Tp);
        let mats: Vec<&&Param> = params.iter().filter(|p| muon::updates(&p.name, p.shape())).collect();
        let mut groups: Vec<&'g Group> = Vec::new();
        let mut matrices: Vec<MatrixOwner> = Vec::new();
        for p in &mats {
            let (partitioned, group) = match sharding.of(p) {
                Some(g) => (true, g),
                None => (false, me.group(replicas(p))),
            };
            let at = groups.iter().position(|g| std::ptr::eq(*g, group)).unwrap_or_else(|| {
                groups.push(group);
                groups.len() - 1
            });
            let values = p.shape().iter().product::<usize>();
            let dp = (group.size() > 1).then_some((at, 0, partitioned));
            let partition =
                if partitioned && group.size() > 1 { zero::partition_size(values, group.size()) } else { values };
            let tp = (tp.size() > 1 && p.tp.dim().is_some()).then_some((0, p.tp));
            matrices.push(MatrixOwner { dp, tp, values, partition, shape: p.shape().to_vec() });
        }
        // the data-parallel owners, group by group
        for (at, group) in groups.iter().enumerate() {
            let members: Vec<usize> =
                (0..matrices.len()).filter(|&i| matrices[i].dp.is_some_and(|d| d.0 == at)).collect();
            let sizes: Vec<(&str, usize)> =
                members.iter().map(|&i| (mats[i].name.as_str(), matrices[i].values)).collect();
            for (&i, owner) in members.iter().zip(assign(&sizes, group.size())) {
                matrices[i].dp.as_mut().expect("a member").1 = owner;
            }
        }
        // the tp owners, among the matrices this rank's data-parallel index owns (its tp peers
        // share the index, so they pick the same)
        let mine = |m: &MatrixOwner| m.dp.is_none_or(|(at, owner, _)| owner == groups[at].index());
        let members: Vec<usize> =
            (0..matrices.len()).filter(|&i| matrices[i].tp.is_some() && mine(&matrices[i])).collect();
        let sizes: Vec<(&str, usize)> = members.iter().map(|&i| (mats[i].name.as_str(), matrices[i].values)).collect();
        for (&i, owner) in members.iter().zip(assign(&sizes, tp.size())) {
            matrices[i].tp.as_mut().expect("a member").0 = owner;
        }
        Owners { matrices, groups, tp }
    }

    /// Whether this rank owns matrix `i` in its data-parallel group.
    fn owns_dp(&self, i: usize) -> bool {
        self.matrices[i].dp.is_none_or(|(at, owner, _)| owner == self.groups[at].index())
    }

    /// Whether this rank runs Newton–Schulz on matrix `i`.
    fn owns(&self, i: usize) -> bool {
        self.owns_dp(i) && self.matrices[i].tp.is_none_or(|(owner, _)| owner == self.tp.index())
    }

    /// The values of the matrices this rank runs Newton–Schulz on (what the lesson's exercise
    /// compares across ranks).
    pub fn load(&self) -> usize {
        (0..self.matrices.len()).filter(|&i| self.owns(i)).map(|i| self.matrices[i].values * self.tp_size(i)).sum()
    }

    /// The different tp slices of matrix `i` (ranks holding copies of a slice count once).
    fn tp_size(&self, i: usize) -> usize {
        self.matrices[i].tp.map_or(1, |(_, cut)| cut.parts(self.tp.size()))
    }
}

/// One all_to_all over `group`: `out[q]` goes to member q (each a list of flat tensors sent
/// one after another), `counts[q]` values come from member q. Returns what each member sent.
fn exchange(group: &Group, out: Vec<Vec<Tensor>>, counts: &[usize], place: &Place) -> Result<Vec<Tensor>> {
    let send: Vec<usize> = out.iter().map(|ts| ts.iter().map(|t| t.numel()).sum()).collect();
    let parts: Vec<&Tensor> = out.iter().flatten().collect();
    let flat = match parts.is_empty() {
        true => Tensor::zeros_on(&[0, 1], place, ops::DType::F32),
        false => ops::concat(&parts).with_shape(&[send.iter().sum(), 1]),
    };
    let got = group.all_to_all_tensor(&flat, &send, counts)?;
    let mut at = 0;
    let mut from = Vec::with_capacity(counts.len());
    for &c in counts {
        from.push(ops::slice(&got, at, &[c]));
        at += c;
    }
    Ok(from)
}

/// The whole of a matrix from its tp slices (in tp order), cut along `d` of a whole [rows, cols].
fn join_slices(slices: &[Tensor], slice: &[usize], d: usize) -> Tensor {
    let n = slices.len();
    let joined = ops::concat(&slices.iter().collect::<Vec<_>>());
    match d {
        0 => joined.with_shape(&[slice[0] * n, slice[1]]),
        _ => {
            let rows = slice[0];
            let order: Vec<u32> = (0..rows).flat_map(|i| (0..n).map(move |j| (j * rows + i) as u32)).collect();
            ops::gather_blocks(&joined, slice[1], &order).with_shape(&[rows, slice[1] * n])
        }
    }
}

impl WholeMatrices for Owners<'_> {
    fn each_whole(&mut self, _: &[&Param], pieces: Vec<Tensor>, f: &dyn Fn(Tensor) -> Tensor) -> Result<Vec<Tensor>> {
        let Some(place) = pieces.first().map(|t| t.place()) else { return Ok(Vec::new()) };
        let n = self.matrices.len();
        let flat = |t: Tensor| {
            let k = t.numel();
            t.with_shape(&[k])
        };
        let mut pieces: Vec<Option<Tensor>> = pieces.into_iter().map(|t| Some(flat(t))).collect();
        // 1. each matrix's tp slice whole at its data-parallel owner
        let mut slice: Vec<Option<Tensor>> = vec![None; n];
        for (at, group) in self.groups.iter().enumerate() {
            let ranks = group.size();
            let members: Vec<usize> = (0..n).filter(|&i| self.matrices[i].dp.is_some_and(|d| d.0 == at)).collect();
            let partitioned: Vec<usize> =
                members.iter().copied().filter(|&i| self.matrices[i].dp.expect("a member").2).collect();
            for &i in members.iter().filter(|&&i| !self.matrices[i].dp.expect("a member").2 && self.owns_dp(i)) {
                slice[i] = pieces[i].take(); // a replica: the owner has it already
            }
            if partitioned.is_empty() {
                continue;
            }
            let mut out = vec![Vec::new(); ranks];
            for &i in &partitioned {
                out[self.matrices[i].dp.expect("a member").1].push(pieces[i].take().expect("a piece"));
            }
            let mine: Vec<usize> = partitioned.iter().copied().filter(|&i| self.owns_dp(i)).collect();
            let each: usize = mine.iter().map(|&i| self.matrices[i].partition).sum();
            let got = exchange(group, out, &vec![each; ranks], &place)?;
            let mut at = 0;
            for &i in &mine {
                let (c, values) = (self.matrices[i].partition, self.matrices[i].values);
                let partitions: Vec<Tensor> = got.iter().map(|g| ops::slice(g, at, &[c])).collect();
                let whole = ops::concat(&partitions.iter().collect::<Vec<_>>()); // padded at the end
                slice[i] = Some(ops::slice(&whole, 0, &[values]));
                at += c;
            }
        }
        for i in (0..n).filter(|&i| self.matrices[i].dp.is_none()) {
            slice[i] = pieces[i].take();
        }
        // 2. the tp slices whole at the tp owner
        let mut whole: Vec<Option<Tensor>> = vec![None; n];
        let on_tp: Vec<usize> = (0..n).filter(|&i| self.matrices[i].tp.is_some() && self.owns_dp(i)).collect();
        if !on_tp.is_empty() {
            let mut out = vec![Vec::new(); self.tp.size()];
            for &i in &on_tp {
                out[self.matrices[i].tp.expect("on tp").0].push(slice[i].take().expect("a slice"));
            }
            let mine: Vec<usize> = on_tp.iter().copied().filter(|&i| self.owns(i)).collect();
            let each: usize = mine.iter().map(|&i| self.matrices[i].values).sum();
            let got = exchange(self.tp, out, &vec![each; self.tp.size()], &place)?;
            let mut at = 0;
            for &i in &mine {
                let m = &self.matrices[i];
                let cut = m.tp.expect("on tp").1;
                // one slice of each run of copies (KV heads fewer than the ranks: equal updates)
                let firsts = got.iter().step_by(cut.copies(self.tp.size()));
                let slices: Vec<Tensor> = firsts.map(|g| ops::slice(g, at, &[m.values])).collect();
                whole[i] = Some(join_slices(&slices, &m.shape, cut.dim().expect("a cut")));
                at += m.values;
            }
        }
        for i in (0..n).filter(|&i| self.matrices[i].tp.is_none() && self.owns_dp(i)) {
            whole[i] = slice[i].take().map(|t| t.with_shape(&self.matrices[i].shape));
        }
        // 3. Newton–Schulz at the owners
        let mut result: Vec<Option<Tensor>> = whole.into_iter().map(|w| w.map(f)).collect();
        // 4. the tp slices back from the tp owner
        if !on_tp.is_empty() {
            let mut out = vec![Vec::new(); self.tp.size()];
            for &i in on_tp.iter().filter(|&&i| self.owns(i)) {
                let (o, cut) = (result[i].take().expect("orthogonalised"), self.matrices[i].tp.expect("on tp").1);
                for (r, to) in out.iter_mut().enumerate() {
                    to.push(flat(ops::tp_part(&o, cut, (r, self.tp.size()))));
                }
            }
            let counts: Vec<usize> = (0..self.tp.size())
                .map(|r| {
                    on_tp
                        .iter()
                        .filter(|&&i| self.matrices[i].tp.expect("on tp").0 == r)
                        .map(|&i| self.matrices[i].values)
                        .sum()
                })
                .collect();
            let got = exchange(self.tp, out, &counts, &place)?;
            let mut at = vec![0; self.tp.size()];
            for &i in &on_tp {
                let r = self.matrices[i].tp.expect("on tp").0;
                result[i] = Some(ops::slice(&got[r], at[r], &[self.matrices[i].values]));
                at[r] += self.matrices[i].values;
            }
        }
        // 5. each rank's piece back from the data-parallel owner: its partition, or the whole slice
        let mut back: Vec<Option<Tensor>> = vec![None; n];
        for (at, group) in self.groups.iter().enumerate() {
            let ranks = group.size();
            let members: Vec<usize> = (0..n).filter(|&i| self.matrices[i].dp.is_some_and(|d| d.0 == at)).collect();
            if members.is_empty() {
                continue;
            }
            let mut out = vec![Vec::new(); ranks];
            for &i in members.iter().filter(|&&i| self.owns_dp(i)) {
                let (m, o) = (&self.matrices[i], flat(result[i].take().expect("orthogonalised")));
                for (r, to) in out.iter_mut().enumerate() {
                    to.push(match m.dp.expect("a member").2 {
                        true => zero::cut(&o, r, m.partition),
                        false => o.clone(),
                    });
                }
            }
            let size = |i: usize| {
                if self.matrices[i].dp.expect("a member").2 {
                    self.matrices[i].partition
                } else {
                    self.matrices[i].values
                }
            };
            let counts: Vec<usize> = (0..ranks)
                .map(|r| {
                    members.iter().filter(|&&i| self.matrices[i].dp.expect("a member").1 == r).map(|&i| size(i)).sum()
                })
                .collect();
            let got = exchange(group, out, &counts, &place)?;
            let mut from = vec![0; ranks];
            for &i in &members {
                let r = self.matrices[i].dp.expect("a member").1;
                back[i] = Some(ops::slice(&got[r], from[r], &[size(i)]));
                from[r] += size(i);
            }
        }
        for i in (0..n).filter(|&i| self.matrices[i].dp.is_none()) {
            back[i] = result[i].take();
        }
        Ok(back.into_iter().map(|b| b.expect("every matrix comes back")).collect())
    }
}
