//! # The process grid: where each rank sits in dp × pp × cp × tp
//!
//! Every rank runs the same program; its coordinates decide which data it reads, which layers it
//! holds, which part of the sequence it attends over and which slice of each matrix it owns.
//!
//! ```text
//! rank = ((dp_i · pp + pp_i) · cp + cp_i) · tp + tp_i        tp varies fastest, dp slowest
//!
//! dp=2 pp=2 cp=1 tp=2:   dp 0 ┬ pp 0: ranks 0 1   (a tp group)      pp groups: {0 2} {1 3} …
//!                             └ pp 1: ranks 2 3                     dp groups: {0 4} {1 5} …
//!                        dp 1 ┬ pp 0: ranks 4 5
//!                             └ pp 1: ranks 6 7
//! ```
//! Tensor-parallel neighbours are adjacent ranks (on one machine, the fastest links). A group
//! along an axis is every rank that agrees with you on all the *other* coordinates. The dp×cp
//! group is where gradients of parameters replicated over both data and context are averaged.
//!
//! Expert parallelism adds no ranks: it is carved out of the dp×cp group (as torchtitan and
//! DeepSpeed place it). Number that group's members i = dp_i · cp + cp_i; consecutive blocks of
//! `ep` of them divide the experts among themselves (the ep group, which all-to-alls tokens), and
//! the members with the same i mod ep hold the same experts (the expert-data group, which
//! averages their gradients):
//!
//! ```text
//! dp=4 cp=1 ep=2:   dp×cp {0 1 2 3}   ep groups {0 1} {2 3}   expert-data groups {0 2} {1 3}
//! ```
//!
//! Hybrid sharding (HSDP) cuts the dp×cp group in two the other way: ZeRO shards within groups of
//! `dp_shard` data-parallel replicas (with all their cp ranks: the shard group) and the groups
//! replicate each other (the replicate group: the ranks with the same place in their shard group):
//!
//! ```text
//! dp=4 cp=1 dp_shard=2:   dp×cp {0 1 2 3}   shard groups {0 1} {2 3}   replicate groups {0 2} {1 3}
//! ```

use anyhow::{bail, Result};
use std::fmt::Write;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub dp: usize,
    pub pp: usize,
    pub cp: usize,
    pub tp: usize,
    /// Expert-parallel ranks, of the dp×cp ranks (`with_ep`); 1 without.
    pub ep: usize,
    /// Hybrid sharding: the dp replicas of each shard group (`with_dp_shard`); dp without.
    pub dp_shard: usize,
}

/// A rank's position along each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coords {
    pub dp: usize,
    pub pp: usize,
    pub cp: usize,
    pub tp: usize,
}

/// The most ranks one run may have: each is a thread (and a communication thread) of one process.
pub const MAX_RANKS: usize = 1024;

/// The process groups every rank belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    Tp,
    Cp,
    Pp,
    Dp,
    /// Data and context together: the gradient all-reduce of replicated parameters.
    DpCp,
    /// The ranks of a dp×cp group that divide the experts among them (the tokens' all-to-all).
    Ep,
    /// The ranks of a dp×cp group that hold the same experts: their gradients' average.
    ExpertDp,
    /// Hybrid sharding: the ranks of a dp×cp group among which ZeRO shards (dp_shard × cp).
    DpShard,
    /// Hybrid sharding: the ranks of a dp×cp group holding the same chunks (dp / dp_shard).
    DpReplicate,
    /// Every rank.
    World,
}

impl Axis {
    pub const ALL: [Axis; 10] = [
        Axis::Tp,
        Axis::Cp,
        Axis::Pp,
        Axis::Dp,
        Axis::DpCp,
        Axis::Ep,
        Axis::ExpertDp,
        Axis::DpShard,
        Axis::DpReplicate,
        Axis::World,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Pp => "pp",
            Axis::Dp => "dp",
            Axis::DpCp => "dp×cp",
            Axis::Ep => "ep",
            Axis::ExpertDp => "edp",
            Axis::DpShard => "shard",
            Axis::DpReplicate => "replicate",
            Axis::World => "world",
        }
    }
}

impl Grid {
    pub fn new(dp: usize, pp: usize, cp: usize, tp: usize) -> Result<Grid> {
        for (name, v) in [("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)] {
            if v == 0 {
                bail!("parallel.{name} = 0: every parallel degree must be at least 1");
            }
        }
        let world = [dp, pp, cp].iter().try_fold(tp, |w, &d| w.checked_mul(d));
        match world {
            Some(w) if w <= MAX_RANKS => Ok(Grid { dp, pp, cp, tp, ep: 1, dp_shard: dp }),
            _ => bail!(
                "dp × pp × cp × tp = {dp} × {pp} × {cp} × {tp} ranks: every rank runs as a thread of this process, at most {MAX_RANKS}; choose smaller degrees"
            ),
        }
    }

    /// The same grid with `ep` expert-parallel ranks carved out of each dp×cp group.
    pub fn with_ep(self, ep: usize) -> Result<Grid> {
        if ep == 0 || !(self.dp * self.cp).is_multiple_of(ep) {
            bail!("parallel.ep = {ep} does not divide dp × cp = {}: the expert-parallel ranks are carved out of the dp×cp ranks", self.dp * self.cp);
        }
        Ok(Grid { ep, ..self })
    }

    /// The same grid with ZeRO sharding within groups of `dp_shard` dp replicas (0: all of dp).
    pub fn with_dp_shard(self, dp_shard: usize) -> Result<Grid> {
        let dp_shard = if dp_shard == 0 { self.dp } else { dp_shard };
        if !self.dp.is_multiple_of(dp_shard) {
            bail!("parallel.dp_shard = {dp_shard} does not divide parallel.dp = {}: hybrid sharding cuts the dp replicas into equal shard groups", self.dp);
        }
        Ok(Grid { dp_shard, ..self })
    }

    /// Is ZeRO hybrid: sharded within groups and replicated across them?
    pub fn hybrid(&self) -> bool {
        self.dp_shard < self.dp
    }

    pub fn world_size(&self) -> usize {
        self.dp * self.pp * self.cp * self.tp
    }

    pub fn rank(&self, c: Coords) -> usize {
        ((c.dp * self.pp + c.pp) * self.cp + c.cp) * self.tp + c.tp
    }

    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            tp: rank % self.tp,
            cp: rank / self.tp % self.cp,
            pp: rank / (self.tp * self.cp) % self.pp,
            dp: rank / (self.tp * self.cp * self.pp),
        }
    }

    /// The members of `rank`'s group along `axis`, in rank order.
    pub fn group(&self, rank: usize, axis: Axis) -> Vec<usize> {
        let me = self.coords(rank);
        let expert = |c: Coords| c.dp * self.cp + c.cp; // the place in the dp×cp group
        let same = |c: Coords| match axis {
            Axis::Tp => (c.dp, c.pp, c.cp) == (me.dp, me.pp, me.cp),
            Axis::Cp => (c.dp, c.pp, c.tp) == (me.dp, me.pp, me.tp),
            Axis::Pp => (c.dp, c.cp, c.tp) == (me.dp, me.cp, me.tp),
            Axis::Dp => (c.pp, c.cp, c.tp) == (me.pp, me.cp, me.tp),
            Axis::DpCp => (c.pp, c.tp) == (me.pp, me.tp),
            Axis::Ep => (c.pp, c.tp, expert(c) / self.ep) == (me.pp, me.tp, expert(me) / self.ep),
            Axis::ExpertDp => (c.pp, c.tp, expert(c) % self.ep) == (me.pp, me.tp, expert(me) % self.ep),
            Axis::DpShard => (c.pp, c.tp, c.dp / self.dp_shard) == (me.pp, me.tp, me.dp / self.dp_shard),
            Axis::DpReplicate => {
                (c.pp, c.tp, c.cp, c.dp % self.dp_shard) == (me.pp, me.tp, me.cp, me.dp % self.dp_shard)
            }
            Axis::World => true,
        };
        (0..self.world_size()).filter(|&r| same(self.coords(r))).collect()
    }

    /// The previous and next pipeline stage, if any.
    pub fn pp_neighbours(&self, rank: usize) -> (Option<usize>, Option<usize>) {
        let c = self.coords(rank);
        let prev = (c.pp > 0).then(|| self.rank(Coords { pp: c.pp - 1, ..c }));
        let next = (c.pp + 1 < self.pp).then(|| self.rank(Coords { pp: c.pp + 1, ..c }));
        (prev, next)
    }

    /// The previous and next rank around the context-parallel ring (wrapping).
    pub fn cp_ring(&self, rank: usize) -> (usize, usize) {
        let c = self.coords(rank);
        let prev = self.rank(Coords { cp: (c.cp + self.cp - 1) % self.cp, ..c });
        let next = self.rank(Coords { cp: (c.cp + 1) % self.cp, ..c });
        (prev, next)
    }

    /// One row per rank: coordinates, group members and neighbours.
    pub fn table(&self) -> String {
        let list = |v: &[usize]| v.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",");
        let opt = |v: Option<usize>| v.map_or("-".to_string(), |r| r.to_string());
        let mut out = format!(
            "grid dp={} pp={} cp={} tp={}: {} ranks\n{:>4} {:>3} {:>3} {:>3} {:>3}  {:<12} {:<12} {:<12} {:<12} {:<14} {:<9} {}\n",
            self.dp,
            self.pp,
            self.cp,
            self.tp,
            self.world_size(),
            "rank",
            "dp",
            "pp",
            "cp",
            "tp",
            "tp group",
            "cp group",
            "pp group",
            "dp group",
            "dp×cp group",
            "pp prev/next",
            "cp ring prev/next"
        );
        for r in 0..self.world_size() {
            let c = self.coords(r);
            let (prev, next) = self.pp_neighbours(r);
            let (ring_prev, ring_next) = self.cp_ring(r);
            let _ = writeln!(
                out,
                "{r:>4} {:>3} {:>3} {:>3} {:>3}  {:<12} {:<12} {:<12} {:<12} {:<14} {:<12} {ring_prev}/{ring_next}",
                c.dp,
                c.pp,
                c.cp,
                c.tp,
                list(&self.group(r, Axis::Tp)),
                list(&self.group(r, Axis::Cp)),
                list(&self.group(r, Axis::Pp)),
                list(&self.group(r, Axis::Dp)),
                list(&self.group(r, Axis::DpCp)),
                format!("{}/{}", opt(prev), opt(next)),
            );
        }
        let mut carved = Vec::new();
        if self.ep > 1 {
            carved.push((Axis::Ep, format!("ep={}: ep groups (divide the experts)", self.ep)));
            carved.push((Axis::ExpertDp, format!("ep={}: expert-data groups (same experts)", self.ep)));
        }
        if self.hybrid() {
            carved.push((Axis::DpShard, format!("dp_shard={}: shard groups (ZeRO's chunks)", self.dp_shard)));
            carved.push((Axis::DpReplicate, format!("dp_shard={}: replicate groups (same chunks)", self.dp_shard)));
        }
        {
            for (axis, what) in carved {
                let mut groups: Vec<Vec<usize>> = (0..self.world_size()).map(|r| self.group(r, axis)).collect();
                groups.dedup();
                groups.sort();
                groups.dedup();
                let listed: Vec<String> = groups.iter().map(|g| format!("{{{}}}", list(g))).collect();
                let _ = writeln!(out, "{what}: {}", listed.join(" "));
            }
        }
        out
    }
}
