//! The process grid: rank numbering, groups, neighbours and the printed table.

use ferrotron::comm::process_grid::{Axis, Coords, Grid};
use ferrotron::parallel::hybrid_sharding::{self, REPLICATE, SHARD};

#[test]
fn rank_and_coords_round_trip_with_tp_fastest() {
    for (dp, pp, cp, tp) in [(1, 1, 1, 1), (2, 2, 1, 2), (3, 1, 2, 1), (1, 4, 2, 1), (2, 1, 1, 4)] {
        let g = Grid::new(dp, pp, cp, tp).unwrap();
        for r in 0..g.world_size() {
            let c = g.coords(r);
            assert_eq!(r, ((c.dp * pp + c.pp) * cp + c.cp) * tp + c.tp);
            assert_eq!(g.rank(c), r);
        }
        for r in 0..g.world_size() {
            assert_eq!(g.group(r, Axis::Tp).len(), tp);
            assert_eq!(g.group(r, Axis::Cp).len(), cp);
            assert_eq!(g.group(r, Axis::Pp).len(), pp);
            assert_eq!(g.group(r, Axis::Dp).len(), dp);
            assert_eq!(g.group(r, Axis::DpCp).len(), dp * cp);
            assert_eq!(g.group(r, Axis::World).len(), g.world_size());
            for axis in g.axes() {
                assert!(g.group(r, axis).contains(&r));
            }
        }
    }
}

#[test]
fn groups_of_dp2_pp2_tp2() {
    let g = Grid::new(2, 2, 1, 2).unwrap();
    assert_eq!(g.coords(5), Coords { dp: 1, pp: 0, cp: 0, tp: 1 });
    assert_eq!(g.group(5, Axis::Tp), [4, 5]);
    assert_eq!(g.group(5, Axis::Pp), [5, 7]);
    assert_eq!(g.group(5, Axis::Dp), [1, 5]);
    assert_eq!(g.pp_neighbours(5), (None, Some(7)));
    assert_eq!(g.pp_neighbours(7), (Some(5), None));
    let table = g.table();
    assert_eq!(table.lines().count(), 2 + 8);
    assert!(
        table.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
            == ["5", "1", "0", "0", "1", "4,5", "5", "5,7", "1,5", "1,5", "-/7", "5/5"]),
        "{table}"
    );
}

#[test]
fn context_ring_wraps_and_dp_cp_spans_both() {
    let g = Grid::new(2, 1, 4, 1).unwrap();
    assert_eq!(g.cp_ring(0), (3, 1));
    assert_eq!(g.cp_ring(3), (2, 0));
    assert_eq!(g.cp_ring(5), (4, 6));
    assert_eq!(g.group(1, Axis::DpCp), (0..8).collect::<Vec<_>>());
    assert_eq!(g.group(6, Axis::Cp), [4, 5, 6, 7]);
}

#[test]
fn zero_degree_is_an_error() {
    let e = Grid::new(2, 0, 1, 1).unwrap_err().to_string();
    assert!(e.contains("parallel.pp = 0"), "{e}");
}

#[test]
fn hybrid_sharding_cuts_dp_cp_into_shard_and_replicate_groups() {
    // dp 4 × cp 2, shard groups of 2 dp replicas with their cp ranks
    let g = hybrid_sharding::cut_grid(Grid::new(4, 1, 2, 1).unwrap(), 2).unwrap();
    assert!(hybrid_sharding::is_hybrid(&g));
    assert_eq!(g.group(0, SHARD), [0, 1, 2, 3]);
    assert_eq!(g.group(5, SHARD), [4, 5, 6, 7]);
    assert_eq!(g.group(0, REPLICATE), [0, 4]);
    assert_eq!(g.group(3, REPLICATE), [3, 7]);
    // a rank's partition is found once in each replicate group's shard group
    for r in 0..g.world_size() {
        let (shard, replicate) = (g.group(r, SHARD), g.group(r, REPLICATE));
        assert_eq!(shard.len() * replicate.len(), g.group(r, Axis::DpCp).len());
        assert_eq!(shard.iter().filter(|s| replicate.contains(s)).count(), 1);
    }
    let table = g.table();
    assert!(table.contains("shard groups (ZeRO's partitions): {0,1,2,3} {4,5,6,7}"), "{table}");
    assert!(table.contains("replicate groups (same partitions): {0,4} {1,5} {2,6} {3,7}"), "{table}");
    // 0 is all of dp; a size that does not divide dp is named
    assert!(!hybrid_sharding::is_hybrid(&hybrid_sharding::cut_grid(Grid::new(4, 1, 1, 1).unwrap(), 0).unwrap()));
    let e = hybrid_sharding::cut_grid(Grid::new(4, 1, 1, 1).unwrap(), 3).unwrap_err().to_string();
    assert!(e.contains("parallel.dp_shard = 3 does not divide parallel.dp = 4"), "{e}");
    ferrotron::comm::launcher::check_groups(g).unwrap(); // the collectives agree with the grid
}

#[test]
fn a_cut_is_made_by_its_lesson_and_one_as_wide_as_dp_cp_is_that_group() {
    use ferrotron::model::moe::{self, EP, EXPERT_DP};
    use std::time::Duration;
    // ep = 1: the expert-data group is all of dp×cp, the ep group each rank alone
    let g = moe::cut_grid(Grid::new(2, 1, 2, 1).unwrap(), 1).unwrap();
    assert_eq!(g.group(1, EXPERT_DP), g.group(1, Axis::DpCp));
    assert_eq!(g.group(1, EP), [1]);
    assert!(!g.table().contains("ep groups"), "a cut no setting asked for is not listed:\n{}", g.table());
    // the same ranks are the same group: one communicator, not a second one for them
    ferrotron::comm::launcher::launch(g, Duration::from_secs(30), |me| {
        assert!(std::ptr::eq(me.group(EXPERT_DP), me.group(Axis::DpCp)));
        assert!(!std::ptr::eq(me.group(EP), me.group(Axis::DpCp)));
        Ok(())
    })
    .unwrap();
    // a cut a setting asked for is its own group, even as wide as dp×cp: ep = dp = 2 (the comm
    // report then counts the experts' collectives on "ep", not on "dp×cp")
    let g = moe::cut_grid(Grid::new(2, 1, 1, 1).unwrap(), 2).unwrap();
    assert_eq!(g.group(0, EP), g.group(0, Axis::DpCp));
    ferrotron::comm::launcher::launch(g, Duration::from_secs(30), |me| {
        assert!(!std::ptr::eq(me.group(EP), me.group(Axis::DpCp)));
        assert_eq!(me.group(EP).name().split('[').next(), Some("ep"));
        Ok(())
    })
    .unwrap();
    // a size that does not divide dp × cp is refused by the grid itself, naming the cut
    let e = Grid::new(2, 1, 2, 1).unwrap().with_cut(EP, 3, None).unwrap_err().to_string();
    assert!(e.contains("the ep groups of 3: 3 does not divide dp × cp = 4"), "{e}");
}
