//! Step 02 — ranks, the process grid and collectives.
//! `cargo run --release --example step02`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::{bail, Result};
use ferrotron::comm::launcher::launch;
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::comm::ReduceOp;
use std::time::Duration;

fn run(_tiny: bool) -> Result<()> {
    // 8 ranks: dp = 2 outermost, then pp = 2, cp = 1, tp = 2 fastest
    let grid = Grid::new(2, 2, 1, 2)?;
    print!("{}", grid.table());
    let results = launch(grid, Duration::from_secs(30), |me| {
        // the same program on every rank; only `me` differs
        let tp = me.group(Axis::Tp);
        let mut x = [me.rank as f32];
        tp.all_reduce(&mut x, ReduceOp::Sum)?; // the sum over my tp group
        let gathered = me.group(Axis::Dp).all_gather(&[me.rank as f32])?; // my dp group's ranks, in order
        let pp = me.group(Axis::Pp);
        let (next, prev) = ((pp.index() + 1) % pp.size(), (pp.index() + pp.size() - 1) % pp.size());
        let from_prev = pp.send_recv(&[me.rank as f32], next, 1, prev)?; // a ring step
        Ok((x[0], gathered, from_prev[0]))
    })?;
    // the same answers computed serially, from the grid alone
    for (rank, (sum, gathered, from_prev)) in results.iter().enumerate() {
        let want_sum: usize = grid.group(rank, Axis::Tp).iter().sum();
        let want_gathered: Vec<f32> = grid.group(rank, Axis::Dp).iter().map(|&r| r as f32).collect();
        let (prev, _) = grid.pp_neighbours(rank);
        let want_prev = prev.unwrap_or_else(|| *grid.group(rank, Axis::Pp).last().expect("a group")) as f32;
        println!("rank {rank}: tp sum {sum}, dp all-gather {gathered:?}, received {from_prev} from the previous stage");
        if *sum != want_sum as f32 || *gathered != want_gathered || *from_prev != want_prev {
            bail!("rank {rank} got a wrong answer");
        }
    }
    println!(
        "verdict: PASS — every rank's all-reduce, all-gather and send/recv equal the serial computation from the grid"
    );
    Ok(())
}

step!(run);
