//! Collectives on the local backend: exact against a serial reference for 1–8 ranks and both
//! dtypes, deterministic, truly asynchronous, and failing with clear errors instead of hanging.

use anyhow::{bail, Result};
use ferrotron::comm::launcher::{launch, Rank};
use ferrotron::comm::process_grid::{Axis, Grid};
use ferrotron::comm::{Element, ReduceOp};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);

fn world(n: usize) -> Grid {
    Grid::new(n, 1, 1, 1).unwrap()
}

/// Rank `r`'s input: `len` values that are exact in bf16 too.
fn input<T: Element>(r: usize, len: usize) -> Vec<T> {
    let mut rng = ChaCha8Rng::seed_from_u64(r as u64);
    (0..len).map(|_| T::from_f32(bf16::from_f32(rng.gen::<f32>() * 4.0 - 2.0).to_f32())).collect()
}

/// The same reduction, computed serially in rank order.
fn reference<T: Element>(n: usize, len: usize, op: ReduceOp) -> Vec<T> {
    let mut acc: Vec<f32> = input::<T>(0, len).iter().map(|x| x.to_f32()).collect();
    for r in 1..n {
        for (a, x) in acc.iter_mut().zip(input::<T>(r, len)) {
            *a = if op == ReduceOp::Max { a.max(x.to_f32()) } else { *a + x.to_f32() };
        }
    }
    if op == ReduceOp::Avg {
        acc.iter_mut().for_each(|a| *a /= n as f32);
    }
    acc.into_iter().map(T::from_f32).collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Runs every collective on `n` ranks with a random delay before each, checking each result.
fn every_collective<T: Element>(n: usize, jitter_seed: u64) -> Vec<Vec<u32>> {
    let len = 6 * n;
    launch(world(n), LONG, |me: &Rank| {
        let g = me.group(Axis::World);
        let r = me.rank;
        let mut rng = ChaCha8Rng::seed_from_u64(jitter_seed * 100 + r as u64);
        let mut jitter = || std::thread::sleep(Duration::from_micros(rng.gen_range(0..300)));
        let mut seen = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            jitter();
            let mut x = input::<T>(r, len);
            g.all_reduce(&mut x, op)?;
            assert_eq!(bits(&x), bits(&reference::<T>(n, len, op)), "all_reduce {op:?} on {n} ranks");
            seen.extend(bits(&x));
            jitter();
            let chunk = g.reduce_scatter(&input::<T>(r, len), op)?;
            let full = reference::<T>(n, len, op);
            assert_eq!(bits(&chunk), bits(&full[r * 6..(r + 1) * 6]), "reduce_scatter {op:?} on {n} ranks");
        }
        jitter();
        let gathered = g.all_gather(&input::<T>(r, 3))?;
        let want: Vec<T> = (0..n).flat_map(|q| input::<T>(q, 3)).collect();
        assert_eq!(bits(&gathered), bits(&want), "all_gather on {n} ranks");
        for root in 0..n {
            jitter();
            let mut x = input::<T>(r, 5);
            g.broadcast(&mut x, root)?;
            assert_eq!(bits(&x), bits(&input::<T>(root, 5)), "broadcast from {root} on {n} ranks");
        }
        // around the ring: plain send then recv, then the paired form
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        g.send(&input::<T>(r, 4), next)?;
        assert_eq!(bits(&g.recv::<T>(4, prev)?), bits(&input::<T>(prev, 4)), "ring send/recv on {n} ranks");
        let got = g.send_recv(&input::<T>(r, 2), next, 2, prev)?;
        assert_eq!(bits(&got), bits(&input::<T>(prev, 2)), "send_recv on {n} ranks");
        g.barrier()?;
        Ok(seen)
    })
    .unwrap()
}

#[test]
fn collectives_are_exact_for_1_to_8_ranks_f32_and_bf16() {
    for n in 1..=8 {
        every_collective::<f32>(n, 1);
        every_collective::<bf16>(n, 1);
    }
}

#[test]
fn results_do_not_depend_on_thread_timing() {
    for n in [3, 8] {
        assert_eq!(every_collective::<f32>(n, 2), every_collective::<f32>(n, 3));
    }
}

#[test]
fn sub_groups_of_a_4d_grid() {
    for (dp, pp, cp, tp) in [(2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 3, 1), (1, 1, 1, 1)] {
        let grid = Grid::new(dp, pp, cp, tp).unwrap();
        ferrotron::comm::launcher::check_groups(grid).unwrap();
        // a sum over the tp group equals the sum of its members' rank numbers
        launch(grid, LONG, |me| {
            let mut x = [me.rank as f32];
            me.group(Axis::Tp).all_reduce(&mut x, ReduceOp::Sum)?;
            let want: usize = grid.group(me.rank, Axis::Tp).iter().sum();
            assert_eq!(x[0], want as f32);
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn async_collectives_progress_while_the_rank_computes() {
    // Rank 0 issues an async all-reduce, then keeps busy until rank 1's *blocking* all-reduce has
    // returned. That can only happen if rank 0's part was delivered while rank 0 was busy.
    let partner_done = AtomicBool::new(false);
    launch(world(2), Duration::from_secs(10), |me| {
        let g = me.group(Axis::World);
        if me.rank == 0 {
            let handle = g.all_reduce_async(&[1.0f32, 2.0], ReduceOp::Sum);
            let start = Instant::now();
            let mut work = 0u64;
            while !partner_done.load(Ordering::SeqCst) {
                work = work.wrapping_add(1); // the "backward pass" the all-reduce overlaps
                if start.elapsed() > Duration::from_secs(5) {
                    bail!("the async all-reduce did not progress while rank 0 computed");
                }
            }
            assert_eq!(handle.wait()?, [11.0, 22.0]);
            assert!(work > 0);
        } else {
            let mut x = [10.0f32, 20.0];
            g.all_reduce(&mut x, ReduceOp::Sum)?;
            partner_done.store(true, Ordering::SeqCst);
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn async_handles_complete_in_issue_order() {
    launch(world(3), LONG, |me| {
        let g = me.group(Axis::World);
        let handles: Vec<_> = (0..5).map(|i| g.all_reduce_async(&[(me.rank * 10 + i) as f32], ReduceOp::Sum)).collect();
        for (i, h) in handles.into_iter().enumerate().rev() {
            assert_eq!(h.wait()?, [(30 + 3 * i) as f32]);
        }
        Ok(())
    })
    .unwrap();
}

fn failure(grid: Grid, timeout: Duration, f: impl Fn(&Rank) -> Result<()> + Sync) -> (String, Duration) {
    let start = Instant::now();
    let e = launch(grid, timeout, f).expect_err("this run must fail");
    (format!("{e:#}"), start.elapsed())
}

#[test]
fn a_late_rank_times_out_with_names() {
    let (e, _) = failure(world(3), Duration::from_millis(300), |me| {
        if me.rank == 2 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        me.group(Axis::World).barrier()
    });
    assert!(e.contains("barrier on group world[0,1,2]: timed out after 0.3s waiting for rank(s) [2]"), "{e}");
}

#[test]
fn a_rank_that_skips_a_collective_is_named() {
    let (e, elapsed) =
        failure(world(2), LONG, |me| if me.rank == 0 { me.group(Axis::World).barrier() } else { Ok(()) });
    assert!(e.contains("rank(s) [1] returned without taking part"), "{e}");
    assert!(elapsed < Duration::from_secs(5));
}

#[test]
fn mismatched_sizes_and_collectives_are_errors() {
    let (e, _) = failure(world(2), LONG, |me| {
        let mut x = vec![1.0f32; 3 + me.rank];
        me.group(Axis::World).all_reduce(&mut x, ReduceOp::Sum)
    });
    assert!(
        e.contains("all_reduce(sum) on group world[0,1]: members passed different sizes (rank 0: 3, rank 1: 4)"),
        "{e}"
    );
    let (e, _) = failure(world(2), LONG, |me| {
        let g = me.group(Axis::World);
        match me.rank {
            0 => g.all_reduce(&mut [1.0f32], ReduceOp::Max),
            _ => g.all_gather(&[1.0f32]).map(|_| ()),
        }
    });
    assert!(e.contains("at the same point; every member must call the same collective"), "{e}");
    let (e, _) = failure(world(2), LONG, |me| {
        let g = me.group(Axis::World);
        match me.rank {
            0 => g.send(&[1.0f32, 2.0], 1),
            _ => g.recv::<f32>(3, 0).map(|_| ()),
        }
    });
    assert!(e.contains("recv on group world[0,1] from rank 0: expected 3 elements, the sender sent 2"), "{e}");
    let (e, _) =
        failure(world(3), LONG, |me| me.group(Axis::World).reduce_scatter(&[1.0f32; 4], ReduceOp::Sum).map(|_| ()));
    assert!(e.contains("4 elements do not split into 3 equal chunks"), "{e}");
}

#[test]
fn one_failing_rank_stops_the_run_at_once() {
    let (e, elapsed) = failure(world(4), LONG, |me| {
        if me.rank == 2 {
            bail!("out of memory on purpose");
        }
        me.group(Axis::World).barrier()
    });
    assert!(e.contains("rank 2 failed: out of memory on purpose"), "{e}");
    assert!(elapsed < Duration::from_secs(5), "the others waited {elapsed:?}");
    let (e, _) = failure(world(3), LONG, |me| {
        if me.rank == 1 {
            panic!("a bug on purpose");
        }
        me.group(Axis::World).barrier()
    });
    assert!(e.contains("rank 1 failed: panicked: a bug on purpose"), "{e}");
}

#[test]
fn work_one_rank_does_alone_does_not_count_against_the_others_timeout() {
    // rank 0 writes a "checkpoint" for three timeouts' worth; the others wait in the next barrier
    let slow_write = |hold: bool| {
        launch(world(3), Duration::from_millis(200), move |me| {
            if me.rank == 0 {
                let write = || std::thread::sleep(Duration::from_millis(600));
                match hold {
                    true => me.group(Axis::World).while_others_wait(write),
                    false => write(),
                }
            }
            me.group(Axis::World).barrier()
        })
    };
    slow_write(true).expect("the others wait as long as the write takes");
    let e = format!("{:#}", slow_write(false).expect_err("without it, the wait times out"));
    assert!(e.contains("timed out after 0.2s waiting for rank(s) [0]"), "{e}");
}

#[test]
fn the_clock_starts_again_after_a_hold_shorter_than_the_timeout() {
    // the others sleep through the whole hold (0.3 s of a 0.4 s timeout); rank 0 then works
    // 0.2 s more before the barrier: 0.5 s in all, but only 0.2 s since it last worked alone
    launch(world(2), Duration::from_millis(400), |me| {
        if me.rank == 0 {
            me.group(Axis::World).while_others_wait(|| std::thread::sleep(Duration::from_millis(300)));
            std::thread::sleep(Duration::from_millis(200));
        }
        me.group(Axis::World).barrier()
    })
    .expect("the clock restarts when a hold ends, even one the waiting rank never saw");
}

/// What member `from` sends member `to` in the all-to-all tests: a piece of `(from + 2·to) % 4`
/// values (some empty), each naming its sender, receiver and place.
fn piece(from: usize, to: usize) -> Vec<f32> {
    (0..(from + 2 * to) % 4).map(|i| (100 * from + 10 * to + i) as f32).collect()
}

#[test]
fn all_to_all_with_uneven_and_empty_pieces_on_1_to_5_ranks() {
    for n in 1..=5 {
        launch(world(n), LONG, |me: &Rank| {
            let (g, r) = (me.group(Axis::World), me.rank);
            let data: Vec<f32> = (0..n).flat_map(|to| piece(r, to)).collect();
            let send: Vec<usize> = (0..n).map(|to| piece(r, to).len()).collect();
            let recv: Vec<usize> = (0..n).map(|from| piece(from, r).len()).collect();
            let want: Vec<f32> = (0..n).flat_map(|from| piece(from, r)).collect();
            assert_eq!(g.all_to_all(&data, &send, &recv)?, want, "host values, {n} ranks, rank {r}");
            // the tensor form moves rows: each value a row of 2
            let rows: Vec<f32> = data.iter().flat_map(|&x| [x, -x]).collect();
            let t = ferrotron::ops::tensor::Tensor::from_vec(&[data.len(), 2], rows);
            let got = g.all_to_all_tensor(&t, &send, &recv)?;
            let want_rows: Vec<f32> = want.iter().flat_map(|&x| [x, -x]).collect();
            assert_eq!((got.shape(), got.to_vec()), (&[want.len(), 2][..], want_rows), "rows, {n} ranks, rank {r}");
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn all_to_all_counts_that_disagree_are_errors() {
    let (e, _) = failure(world(2), LONG, |me| {
        let g = me.group(Axis::World);
        // rank 1 expects 3 values from rank 0, which sends 2
        let recv = if me.rank == 1 { [3, 1] } else { [1, 1] };
        g.all_to_all(&[1.0f32, 2.0, 3.0], &[1, 2], &recv).map(|_| ())
    });
    assert!(e.contains("recv on group world[0,1] from rank 0: expected 3 elements, the sender sent 2"), "{e}");
    let (e, _) =
        failure(world(2), LONG, |me| me.group(Axis::World).all_to_all(&[1.0f32; 3], &[1, 1], &[1, 1]).map(|_| ()));
    assert!(e.contains("give one send and one receive count per member"), "{e}");
}
