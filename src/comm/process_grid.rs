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
//! Later lessons cut more groups out of each dp×cp group without adding ranks (`Cut`): number
//! its members i = dp_i · cp + cp_i; a cut groups them in consecutive blocks of n, or takes the
//! members n apart. Expert parallelism and hybrid sharding make their groups so:
//!
//! ```text
//! dp=4 cp=1, n=2:   dp×cp {0 1 2 3}   blocks of 2 {0 1} {2 3}   2 apart {0 2} {1 3}
//! ```

use anyhow::{bail, Result};
use std::fmt::Write;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub dp: usize,
    pub pp: usize,
    pub cp: usize,
    pub tp: usize,
    /// The groups later lessons cut out of the dp×cp group (`with_cut`).
    cuts: [Option<GridCut>; MAX_CUTS],
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

/// The process groups every rank belongs to: the grid's own axes, and the cuts later lessons
/// make (`Grid::with_cut`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    Tp,
    Cp,
    Pp,
    Dp,
    /// Data and context together: the gradient all-reduce of replicated parameters.
    DpCp,
    /// Every rank.
    World,
    /// A group a later lesson cuts out of the dp×cp group.
    Cut(Cut),
}

/// A cut of the dp×cp group (members i = dp_i · cp + cp_i), made by the lesson that needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// Its name in group names and the comm report: "ep", "shard".
    pub name: &'static str,
    /// What its groups are, for the grid's table.
    pub what: &'static str,
    pub along: Along,
}

/// How a cut of size n groups the dp×cp members.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Along {
    /// Consecutive blocks of n: members i and j together when i / n = j / n.
    Blocks,
    /// Every n-th: members i and j together when i mod n = j mod n.
    Strided,
}

/// A cut one grid has: its size n, and the setting that asked for it (shown in the table; `None`:
/// the cut is there at its size that changes nothing, for code that asks for its group anyway).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GridCut {
    pub cut: Cut,
    pub n: usize,
    pub setting: Option<(&'static str, usize)>,
}

/// The most cuts one grid holds.
const MAX_CUTS: usize = 4;

impl From<Cut> for Axis {
    fn from(cut: Cut) -> Axis {
        Axis::Cut(cut)
    }
}

impl Axis {
    /// The grid's own axes: every grid has their groups.
    pub const MESH: [Axis; 6] = [Axis::Tp, Axis::Cp, Axis::Pp, Axis::Dp, Axis::DpCp, Axis::World];

    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Pp => "pp",
            Axis::Dp => "dp",
            Axis::DpCp => "dp×cp",
            Axis::World => "world",
            Axis::Cut(cut) => cut.name,
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
            Some(w) if w <= MAX_RANKS => Ok(Grid { dp, pp, cp, tp, cuts: [None; MAX_CUTS] }),
            _ => bail!(
                "dp × pp × cp × tp = {dp} × {pp} × {cp} × {tp} ranks: every rank runs as a thread of this process, at most {MAX_RANKS}; choose smaller degrees"
            ),
        }
    }

    /// The same grid with `cut` of size `n` (which divides dp × cp): made by the lesson that
    /// needs its groups, checked there against its setting.
    pub fn with_cut(mut self, cut: Cut, n: usize, setting: Option<(&'static str, usize)>) -> Result<Grid> {
        let members = self.dp * self.cp;
        if n == 0 || !members.is_multiple_of(n) {
            bail!("the {} groups of {n}: {n} does not divide dp × cp = {members}", cut.name);
        }
        match self.cuts.iter_mut().find(|c| c.is_none_or(|c| c.cut == cut)) {
            Some(free) => *free = Some(GridCut { cut, n, setting }),
            None => bail!("a grid holds at most {MAX_CUTS} cuts of the dp×cp group"),
        }
        Ok(self)
    }

    /// The cuts this grid has.
    pub fn cuts(&self) -> impl Iterator<Item = GridCut> + '_ {
        self.cuts.iter().flatten().copied()
    }

    /// Every axis this grid has a group along: its own, then its cuts.
    pub fn axes(&self) -> Vec<Axis> {
        Axis::MESH.into_iter().chain(self.cuts().map(|m| Axis::Cut(m.cut))).collect()
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
    pub fn group(&self, rank: usize, axis: impl Into<Axis>) -> Vec<usize> {
        let (me, axis) = (self.coords(rank), axis.into());
        let i = |c: Coords| c.dp * self.cp + c.cp; // the place in the dp×cp group
        let same = |c: Coords| match axis {
            Axis::Tp => (c.dp, c.pp, c.cp) == (me.dp, me.pp, me.cp),
            Axis::Cp => (c.dp, c.pp, c.tp) == (me.dp, me.pp, me.tp),
            Axis::Pp => (c.dp, c.cp, c.tp) == (me.dp, me.cp, me.tp),
            Axis::Dp => (c.pp, c.cp, c.tp) == (me.pp, me.cp, me.tp),
            Axis::DpCp => (c.pp, c.tp) == (me.pp, me.tp),
            Axis::World => true,
            Axis::Cut(cut) => {
                let n =
                    self.cuts().find(|m| m.cut == cut).unwrap_or_else(|| panic!("the grid has no {} cut", cut.name)).n;
                let part = |i: usize| match cut.along {
                    Along::Blocks => i / n,
                    Along::Strided => i % n,
                };
                (c.pp, c.tp, part(i(c))) == (me.pp, me.tp, part(i(me)))
            }
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
        for made in self.cuts() {
            let Some((key, value)) = made.setting else { continue };
            let mut groups: Vec<Vec<usize>> =
                (0..self.world_size()).map(|r| self.group(r, Axis::Cut(made.cut))).collect();
            groups.sort();
            groups.dedup();
            let listed: Vec<String> = groups.iter().map(|g| format!("{{{}}}", list(g))).collect();
            let _ = writeln!(out, "{key}={value}: {}: {}", made.cut.what, listed.join(" "));
        }
        out
    }
}
