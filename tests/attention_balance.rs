//! The FlashAttention grids' balance, played on an H100 without one. Under causal order the blocks
//! of one attention kernel do very different amounts of work: a forward block of the last queries
//! walks every key tile, one of the first queries walks one. A GPU starts blocks in the order of
//! their linear index as slots free up (list scheduling), so the order decides how long the grid
//! takes: a heavy block that starts last ends last, alone. `kernels/flash_attention.cu` lays its
//! grids out (heads, batch, tiles) with the heaviest tiles first (longest first, the classic rule).
//!
//! This test plays each kernel's launch, as `cuda::launch_table` makes it, on 132 SMs holding as
//! many blocks as the kernels' launch bounds give (`tests/kernels_sass.rs` checks those), with a
//! block's time its tile products (a forward or dq block of query tile i: i + 1 key tiles; a dk/dv
//! block of key tile j: every query head of its group × the tiles from j on), and holds the
//! finish within 1.15× of a perfect balance: max(total work / slots, the largest block).

use ferrotron::config::Config;
use ferrotron::cuda::launch_table::attention::{backward, forward};
use ferrotron::cuda::launch_table::Launch;
use ferrotron::ops::{Attn, DType};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::Path;

const SMS: u64 = 132;

/// Blocks an SM holds at once (the kernels' `__launch_bounds__` at head size 64, which ptxas meets:
/// 128 registers for the forward, 168 for dq and dk/dv).
fn blocks_per_sm(kernel: &str) -> u64 {
    if kernel.contains("forward") {
        4
    } else {
        3
    }
}

/// The tile products of each block, in launch order (x fastest, then y, then z), as the kernel
/// maps its block index: the forward and dq take query tile (z count − 1 − z), dk/dv key tile z.
fn work_in_launch_order(l: &Launch, a: Attn) -> Vec<u64> {
    let (x, y, z) = l.grid;
    let name = l.kernel.name();
    let tiles = z as u64;
    let mut work = Vec::new();
    for zi in 0..z as u64 {
        for _ in 0..y * x {
            work.push(if name.contains("dkdv") {
                (a.heads / a.kv_heads) as u64 * (tiles - zi) // queries at or after key tile zi
            } else {
                tiles - zi // query tile tiles − 1 − zi sees key tiles 0..=it
            });
        }
    }
    work
}

/// (finish, perfect): list scheduling of `work` in its order on `slots`.
fn play(work: &[u64], slots: u64) -> (u64, f64) {
    let mut free: BinaryHeap<Reverse<u64>> = (0..slots).map(|_| Reverse(0)).collect();
    let mut finish = 0;
    for &w in work {
        let Reverse(start) = free.pop().unwrap();
        finish = finish.max(start + w);
        free.push(Reverse(start + w));
    }
    let total: u64 = work.iter().sum();
    let perfect = (total as f64 / slots as f64).max(*work.iter().max().unwrap() as f64);
    (finish, perfect)
}

fn attention_of(config: &str, micro_batch: Option<usize>) -> Attn {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(config);
    let cfg = Config::load(Some(&path), &[]).unwrap();
    let (m, t) = (&cfg.model, &cfg.train);
    Attn {
        batch: micro_batch.unwrap_or(t.micro_batch_size),
        seq: t.seq_len,
        kv_seq: t.seq_len,
        heads: m.num_attention_heads,
        kv_heads: m.num_key_value_heads,
        head_dim: m.head_dim(),
    }
}

#[test]
fn attention_grids_finish_within_15_percent_of_a_perfect_balance() {
    let shapes = [
        ("smollm-135m.toml", None),
        ("smollm-360m.toml", None),
        ("llama-1b.toml", None),
        ("llama-1b.toml", Some(2)), // the shape PyTorch's FlashAttention-2 was timed at
    ];
    let mut report = Vec::new();
    for (config, batch) in shapes {
        let a = attention_of(config, batch);
        let f = forward(DType::Bf16, a, (0, 0, 0), (0, 0), 0, 0);
        let [_, dq, dkdv] = backward(DType::Bf16, a, (0, 0, 0), (0, 0), (0, 0, 0), 0, (0, 0, 0));
        for l in [f, dq, dkdv] {
            let name = l.kernel.name().to_string();
            let (finish, perfect) = play(&work_in_launch_order(&l, a), SMS * blocks_per_sm(&name));
            let ratio = finish as f64 / perfect;
            let blocks = l.grid.0 * l.grid.1 * l.grid.2;
            println!(
                "{config} b{}: {name:28} {blocks:6} blocks  finish {finish:5}  perfect {perfect:7.1}  {ratio:.3}×",
                a.batch
            );
            if ratio > 1.15 {
                report.push(format!("{config} b{} {name}: {ratio:.3}× a perfect balance", a.batch));
            }
        }
    }
    assert!(report.is_empty(), "unbalanced grids:\n{}", report.join("\n"));
}

/// The rule the test holds can fail: the same blocks with the tiles varying fastest (the grids
/// before they were laid out heaviest first) leave llama-1b's dk/dv far from a perfect balance.
#[test]
fn a_grid_with_the_tiles_varying_fastest_is_caught() {
    let a = attention_of("llama-1b.toml", None);
    let [_, _, dkdv] = backward(DType::Bf16, a, (0, 0, 0), (0, 0), (0, 0, 0), 0, (0, 0, 0));
    let mut tiles_fastest = Vec::new();
    let per_tile = work_in_launch_order(&dkdv, a);
    let (heads_and_batch, tiles) = ((dkdv.grid.0 * dkdv.grid.1) as usize, dkdv.grid.2 as usize);
    for hb in 0..heads_and_batch {
        for t in 0..tiles {
            tiles_fastest.push(per_tile[t * heads_and_batch + hb]);
        }
    }
    let (finish, perfect) = play(&tiles_fastest, SMS * blocks_per_sm("dkdv"));
    assert!(finish as f64 / perfect > 1.15, "{finish} against {perfect}");
}
