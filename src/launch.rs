//! # The rank launcher: one program, `world_size` threads
//!
//! ```text
//! launch(grid, f) ──┬── thread rank 0: f(&Rank { coords, tp, cp, pp, dp, dp×cp, world groups })
//!                   ├── thread rank 1: f(&Rank { … })
//!                   └── …                 each with its own communication thread
//! ```
//! SPMD: every rank runs the same function; only its `Rank` differs. Ranks share nothing but the
//! communication hub. If one rank fails (an error or a panic), the launcher aborts the hub, so
//! every other rank's pending collective returns at once, and the run ends with the first
//! failure's message. Nobody hangs.

use crate::comm::{Group, Stream};
use crate::hub::Hub;
use crate::process_grid::{Axis, Coords, Grid};
use anyhow::{anyhow, bail, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

/// What a rank function receives: who it is and its process groups.
pub struct Rank {
    pub rank: usize,
    pub coords: Coords,
    pub grid: Grid,
    groups: Vec<(Axis, Group)>,
}

impl Rank {
    /// This rank's group along `axis`.
    pub fn group(&self, axis: Axis) -> &Group {
        &self.groups.iter().find(|(a, _)| *a == axis).expect("every axis has a group").1
    }
}

/// Runs `f` on every rank of `grid`, each in its own thread, over the local backend; returns the
/// results in rank order, or the first failure. `timeout` bounds every wait for other ranks.
pub fn launch<R: Send>(grid: Grid, timeout: Duration, f: impl Fn(&Rank) -> Result<R> + Sync) -> Result<Vec<R>> {
    let hub = Arc::new(Hub::new(timeout));
    let results: Vec<Option<R>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..grid.world_size())
            .map(|rank| {
                let (hub, f) = (hub.clone(), &f);
                s.spawn(move || run_rank(grid, rank, hub, f))
            })
            .collect();
        threads.into_iter().map(|t| t.join().ok().flatten()).collect()
    });
    if let Some(reason) = hub.aborted() {
        bail!("{reason}");
    }
    results.into_iter().enumerate().map(|(r, x)| x.ok_or_else(|| anyhow!("rank {r} stopped"))).collect()
}

/// One rank's thread: its groups, its communication thread, and `f`, with failures reported to
/// the hub. Returns `None` when it failed.
fn run_rank<R>(grid: Grid, rank: usize, hub: Arc<Hub>, f: &(impl Fn(&Rank) -> Result<R> + Sync)) -> Option<R> {
    let (stream, comm_thread) = Stream::start();
    let groups = Axis::ALL
        .iter()
        .map(|&axis| {
            let members = grid.group(rank, axis);
            let list: Vec<String> = members.iter().map(|r| r.to_string()).collect();
            let name = format!("{}[{}]", axis.name(), list.join(","));
            (axis, Group::new(name, members, rank, hub.clone(), stream.clone()))
        })
        .collect();
    drop(stream);
    let me = Rank { rank, coords: grid.coords(rank), grid, groups };
    let result = catch_unwind(AssertUnwindSafe(|| f(&me))).unwrap_or_else(|panic| {
        let msg =
            panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
        Err(anyhow!("panicked: {}", msg.unwrap_or_default()))
    });
    if let Err(e) = &result {
        hub.abort(format!("rank {rank} failed: {e:#}")); // only the first failure's reason is kept
    }
    drop(me); // closes this rank's stream: the communication thread drains its queue and ends
    let _ = comm_thread.join();
    hub.finish(rank);
    result.ok()
}

/// Each rank all-gathers its rank number over each of its groups and checks that it gets the
/// members `process_grid` says: the grid and the collectives agree. Used by `ferrotron grid`.
pub fn check_groups(grid: Grid) -> Result<()> {
    launch(grid, Duration::from_secs(30), |me| {
        for axis in Axis::ALL {
            let got = me.group(axis).all_gather(&[me.rank as f32])?;
            let want: Vec<f32> = grid.group(me.rank, axis).iter().map(|&r| r as f32).collect();
            if got != want {
                bail!("rank {}: {} group gathered {got:?}, expected {want:?}", me.rank, axis.name());
            }
        }
        Ok(())
    })
    .map(|_| ())
}
