//! Placements (`src/comm/placement.rs`): every redistribution of a tensor between Shard(d) on
//! each dimension, Replicate, Partial(sum) and Partial(avg), on 4 ranks, against the dense
//! value, for shapes whose dimensions do not all divide by 4 (padding); the table of moves; the
//! collective each move sends, read from the group's ledger.

use ferrotron::comm::cost::Call;
use ferrotron::comm::launcher::launch;
use ferrotron::comm::placement::{part_of, redistribute, Move, Placement};
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::comm::ReduceOp;
use ferrotron::ops::tensor::Tensor;
use std::borrow::Cow;
use std::time::Duration;

/// Rank r's own numbers of a tensor of `shape` (distinct on every rank and every entry).
fn mine(r: usize, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec(shape, (0..n).map(|i| ((i * 7 + r * 13) % 23) as f32 * 0.25 - 2.0).collect())
}

const PLACEMENTS: [Placement; 6] = [
    Placement::Replicate,
    Placement::Shard(0),
    Placement::Shard(1),
    Placement::Shard(2),
    Placement::Partial(ReduceOp::Sum),
    Placement::Partial(ReduceOp::Avg),
];

/// Every rank's tensor placed as `p`, from `whole`, its value; a Partial is a real one: every
/// rank holds other numbers, and only their sum (mean) is `whole`.
fn placed(whole: &Tensor, p: Placement, (r, n): (usize, usize)) -> Tensor {
    let Placement::Partial(op) = p else { return part_of(whole, p, (r, n)) };
    let shape = whole.shape();
    // rank r: its own numbers; rank 0 also the rest, so that the ranks' sum is the whole
    let others: Vec<f32> = (1..n)
        .map(|j| mine(j, shape).to_vec())
        .fold(vec![0.0; whole.numel()], |a, b| a.iter().zip(&b).map(|(x, y)| x + y).collect());
    let scale = if op == ReduceOp::Avg { n as f32 } else { 1.0 };
    let w = whole.to_vec();
    let values: Vec<f32> = match r {
        0 => w.iter().zip(&others).map(|(x, o)| x * scale - o).collect(),
        _ => mine(r, shape).to_vec(),
    };
    Tensor::from_vec(shape, values)
}

#[test]
fn every_redistribution_of_a_tensor_gives_the_dense_value() {
    for shape in [vec![8, 4, 12], vec![6, 5, 3], vec![3, 2, 7]] {
        let whole = mine(99, &shape);
        launch(Grid::new(1, 1, 1, 4).unwrap(), Duration::from_secs(60), |me| {
            let group = me.group(Axis::Tp);
            let (r, n) = (group.index(), group.size());
            for from in PLACEMENTS {
                for to in PLACEMENTS {
                    let what = format!("{shape:?}: {from:?} → {to:?}");
                    let moved = match redistribute(Cow::Owned(placed(&whole, from, (r, n))), &shape, from, to, group) {
                        Ok(t) => t,
                        Err(_) if matches!((from, to), (Placement::Partial(a), Placement::Partial(b)) if a != b) => {
                            continue
                        }
                        Err(e) => panic!("{what}: {e:#}"),
                    };
                    // a Partial is checked through its sum: every rank's part, all-reduced
                    let got = match to {
                        Placement::Partial(_) => {
                            redistribute(Cow::Owned(moved), &shape, to, Placement::Replicate, group).unwrap()
                        }
                        _ => moved,
                    };
                    let want = match to {
                        Placement::Partial(_) => whole.clone(),
                        _ => part_of(&whole, to, (r, n)),
                    };
                    assert_eq!(got.shape(), want.shape(), "{what}: shape");
                    for (i, (a, b)) in got.to_vec().iter().zip(want.to_vec()).enumerate() {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{what}: [{i}] {a} vs {b}");
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn each_move_is_the_collective_of_the_table() {
    use Placement::*;
    let (sum, avg) = (Partial(ReduceOp::Sum), Partial(ReduceOp::Avg));
    let table = [
        (sum, Replicate, Move::AllReduce(ReduceOp::Sum), Some(Call::AllReduce)),
        (avg, Shard(0), Move::ReduceScatter(ReduceOp::Avg, 0), Some(Call::ReduceScatter)),
        (Shard(1), Replicate, Move::AllGather(1), Some(Call::AllGather)),
        (Shard(0), Shard(1), Move::AllToAll { from: 0, to: 1 }, Some(Call::AllToAll)),
        (Replicate, Shard(1), Move::Slice(1), None),
        (Shard(0), sum, Move::Pad(0), None),
        (Replicate, sum, Move::Split(ReduceOp::Sum), None),
        (Shard(1), Shard(1), Move::Nothing, None),
    ];
    for (from, to, want, _) in table {
        assert_eq!(Move::between(from, to).unwrap(), want, "{from:?} → {to:?}");
    }
    assert!(Move::between(sum, avg).is_err(), "a partial sum is not a partial mean");
    // the ledger sees exactly the collective the table names, and nothing for a local step
    let shape = [8, 4];
    launch(Grid::new(1, 1, 1, 4).unwrap(), Duration::from_secs(60), |me| {
        let group = me.group(Axis::Tp);
        for (from, to, _, call) in table {
            group.ledger().take();
            let t = part_of(&mine(1, &shape), if let Partial(_) = from { Replicate } else { from }, (group.index(), 4));
            redistribute(Cow::Borrowed(&t), &shape, from, to, group)?;
            let tallies = group.ledger().take();
            let calls: Vec<Call> = Call::ALL.into_iter().filter(|c| tallies[*c as usize].calls > 0).collect();
            assert_eq!(calls, call.into_iter().collect::<Vec<_>>(), "{from:?} → {to:?}");
        }
        Ok(())
    })
    .unwrap();
}
