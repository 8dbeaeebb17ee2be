//! The launches of the attention: `kernels/attention.cu` (the readable kernels, f32 and any head
//! size up to `ops::types::WIDE_HEAD_DIM`, its `attention_wide_*` form past 128; the ring blocks' merge) and
//! `kernels/flash_attention.cu` (FlashAttention-2 on tensor cores, bf16 at head sizes 16 to 128),
//! which of the two by dtype, head size and alignment.

use super::{each, int, launch, long, Addr, Arg, Launch, Ptr, F32};
use crate::cuda::kernels::{kernel, Kernel};
use crate::ops::types::{Attn, DType};

/// The kernel `flash_attention_{name}_d{head_dim}`, for each head size of `TENSOR_CORE_HEAD_DIMS`.
macro_rules! tensor_core {
    ($name:literal, $head_dim:expr) => {
        match $head_dim {
            16 => kernel!(concat!("flash_attention_", $name, "_d16")),
            32 => kernel!(concat!("flash_attention_", $name, "_d32")),
            64 => kernel!(concat!("flash_attention_", $name, "_d64")),
            128 => kernel!(concat!("flash_attention_", $name, "_d128")),
            d => unreachable!("no tensor-core attention for head size {d}"),
        }
    };
}

fn query_blocks(a: Attn) -> ((u32, u32, u32), u32) {
    ((a.seq.div_ceil(64) as u32, a.heads as u32, a.batch as u32), 64)
}

/// The head sizes `kernels/flash_attention.cu` is instantiated for.
pub const TENSOR_CORE_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Whether `attention.cu`'s wide form runs this shape (heads up to `WIDE_HEAD_DIM`: a thread's
/// rows in local memory, tiles of 8 rows; the slow road latent attention's heads take on a GPU).
fn wide(a: Attn) -> bool {
    a.head_dim > 128
}

/// Mixed precision with a head size it is built for runs attention on tensor cores
/// (`flash_attention.cu`); f32 mode and other sizes run `attention.cu`, and so do tensors not on
/// 16 bytes (the tensor-core kernels copy rows 16 bytes at a time; every allocation is aligned,
/// so this is a guard, not a path taken).
fn tensor_cores(dt: DType, a: Attn, tensors: &[Addr]) -> bool {
    dt == DType::Bf16 && TENSOR_CORE_HEAD_DIMS.contains(&a.head_dim) && tensors.iter().all(|t| t % 16 == 0)
}

/// `flash_attention.cu`'s forward: a block of 4 warps per 64 query rows of one head. The
/// grid is (heads, batch, tiles), so that blocks start tile by tile, the heaviest first (the
/// kernel maps z to its tile; `tests/attention_balance.rs`).
fn flash_query_blocks(kernel: Kernel, a: Attn, args: Vec<Arg>) -> Launch {
    let blocks = launch(kernel, ((a.heads as u32, a.batch as u32, a.seq.div_ceil(64) as u32), 128), args);
    Launch { shared: forward_shared(a.head_dim), ..blocks }
}

/// The forward's dynamic shared memory (`ForwardTiles::SHARED`): its K and V tiles, two of each
/// (128 keys a tile up to D 64, 64 at D 128), or Q's 64 rows at first, each row D + 8 bf16 (the
/// padding against bank conflicts): 72 KiB at D 64, 68 KiB at D 128, past the 48 KiB a block
/// gets without opting in.
pub fn forward_shared(head_dim: usize) -> u32 {
    let keys = if head_dim <= 64 { 128 } else { 64 };
    let rows = (2 * keys).max(64);
    (2 * rows * (head_dim + 8) * 2) as u32
}

/// An H100's SMs (an H200 has as many): the backward's grid is shaped for them (on another GPU
/// it is as correct, and balanced as its SMs allow).
pub const SMS: usize = 132;

/// Key rows a tile of `flash_attention.cu`'s backward (`KeyTiles`), and the blocks an SM holds
/// (its `__launch_bounds__`).
fn key_tile(a: Attn) -> (usize, usize) {
    if a.head_dim <= 64 {
        (64, 2)
    } else {
        (32, 4)
    }
}

/// The key tiles of split `split` of `splits`, as the backward kernel walks them: the snake
/// (split, 2·splits − 1 − split, then the same in each next run of 2·splits tiles), which pairs a
/// heavy early tile with a light late one.
pub fn split_tiles(tiles: usize, splits: usize, split: usize) -> impl Iterator<Item = usize> {
    (0..tiles.div_ceil(2 * splits))
        .flat_map(move |run| [run * 2 * splits + split, run * 2 * splits + 2 * splits - 1 - split])
        .filter(move |&z| z < tiles)
}

/// How many splits of the key tiles the backward makes (each a block per query head and batch
/// row, with its own fp32 copy of dQ): the count whose grid, played as waves of blocks on an
/// H100's slots with each split's causal work (a key tile: the query tiles from it on), ends
/// first; at most the slots over the blocks of one split (or 4), since every split costs a dQ
/// copy to zero and add. Ties go to fewer splits. The copies' traffic is not priced: at
/// smollm-135m (3 splits) it is about a tenth of the backward's time on an H100 by its measured
/// rates; with few heads and long sequences the count grows (70B at 8k tokens, tp 8, 2 a
/// micro-batch: 33 splits, 2.2 GB of copies a layer), which `ferrotron memory` counts.
pub fn dq_splits(a: Attn) -> usize {
    // played for every layout of a plan's search (`ferrotron memory` counts the copies): once a
    // shape on each thread
    thread_local! {
        static PLAYED: std::cell::RefCell<std::collections::HashMap<[usize; 4], usize>> = Default::default();
    }
    let key = [a.seq, a.kv_seq, a.heads * a.batch, a.head_dim];
    if let Some(n) = PLAYED.with(|p| p.borrow().get(&key).copied()) {
        return n;
    }
    let n = splits_played(a);
    PLAYED.with(|p| p.borrow_mut().insert(key, n));
    n
}

fn splits_played(a: Attn) -> usize {
    let (keys, per_sm) = key_tile(a);
    let (tiles, query_tiles) = (a.kv_seq.div_ceil(keys), a.seq.div_ceil(keys));
    let (blocks, slots) = ((a.heads * a.batch).max(1), SMS * per_sm);
    let most = (slots / blocks).max(4).min(tiles).max(1);
    let finish = |s: usize| {
        let heaviest = (0..s).map(|p| split_tiles(tiles, s, p).map(|z| query_tiles.saturating_sub(z).max(1)).sum());
        (blocks * s).div_ceil(slots) * heaviest.max().unwrap_or(0)
    };
    (1..=most).min_by_key(|&s| finish(s)).unwrap_or(1)
}

/// Where the backward's scratch keeps what (f32 offsets, each region on 256 bytes): δ, and on
/// tensor cores dQ's parts (one per split), dK's and dV's (one per query head).
struct Scratch {
    splits: usize,
    dq_parts: usize,
    dk_parts: usize,
    dv_parts: usize,
    end: usize,
}

fn scratch(dt: DType, a: Attn) -> Scratch {
    let region = |n: usize| n.next_multiple_of(64);
    let delta = region(a.batch * a.heads * a.seq);
    if !(dt == DType::Bf16 && TENSOR_CORE_HEAD_DIMS.contains(&a.head_dim)) {
        return Scratch { splits: 0, dq_parts: delta, dk_parts: delta, dv_parts: delta, end: delta };
    }
    let (q, kv, splits) =
        (a.batch * a.seq * a.heads * a.head_dim, a.batch * a.kv_seq * a.heads * a.head_dim, dq_splits(a));
    let dk_parts = delta + region(splits * q);
    Scratch { splits, dq_parts: delta, dk_parts, dv_parts: dk_parts + region(kv), end: dk_parts + 2 * region(kv) }
}

/// The f32 values of scratch memory `backward` needs (δ, and on tensor cores the parts it adds).
pub fn backward_scratch(dt: DType, a: Attn) -> usize {
    scratch(dt, a).end
}

/// `flash_attention_sum_parts`: y[r, ·] (`width` columns) = factor · Σ over `parts` of x.
fn sum_parts(
    (x, y): (Addr, Addr),
    (rows, width): (usize, usize),
    (row_stride, part_stride, parts): (usize, usize, usize),
    factor: f32,
) -> Launch {
    let args =
        vec![Ptr(x), Ptr(y), long(rows), int(width), long(row_stride), long(part_stride), int(parts), F32(factor)];
    launch(kernel!("flash_attention_sum_parts"), each(rows * width / 4), args)
}

/// (out, lse) of queries q at q_pos against keys and values at k_pos.
pub fn forward(
    dt: DType,
    a: Attn,
    (q, k, v): (Addr, Addr, Addr),
    (q_pos, k_pos): (Addr, Addr),
    out: Addr,
    lse: Addr,
) -> Launch {
    let args = vec![Arg::Shape(a.into()), Ptr(q), Ptr(k), Ptr(v), Ptr(q_pos), Ptr(k_pos), Ptr(out), Ptr(lse)];
    if tensor_cores(dt, a, &[q, k, v, out]) {
        return flash_query_blocks(tensor_core!("forward", a.head_dim), a, args);
    }
    let kernel = if wide(a) { typed!("attention_wide_forward", dt) } else { typed!("attention_forward", dt) };
    launch(kernel, query_blocks(a), args)
}

/// Threads a query row of `attention_delta` (`DELTA_LANES` in `attention.cu`).
const DELTA_LANES: usize = 8;

/// The backward: δ (f32, `[batch, heads, seq]` like lse) into the start of `scratch` (f32,
/// `backward_scratch` values), then dq and dk/dv: on tensor cores one pass making all three into
/// fp32 parts in `scratch` and three launches adding the parts; otherwise `attention.cu`'s dq and
/// dk/dv kernels.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dt: DType,
    a: Attn,
    (q, k, v): (Addr, Addr, Addr),
    (q_pos, k_pos): (Addr, Addr),
    (out, lse, dout): (Addr, Addr, Addr),
    scratch_at: Addr,
    (dq, dk, dv): (Addr, Addr, Addr),
) -> Vec<Launch> {
    let shape = Arg::Shape(a.into());
    let delta = scratch_at;
    let inputs = vec![shape.clone(), Ptr(q), Ptr(k), Ptr(v), Ptr(q_pos), Ptr(k_pos), Ptr(lse), Ptr(delta), Ptr(dout)];
    let delta_launch = launch(
        typed!("attention_delta", dt),
        each(a.batch * a.heads * a.seq * DELTA_LANES),
        vec![shape, Ptr(out), Ptr(dout), Ptr(delta)],
    );
    if tensor_cores(dt, a, &[q, k, v, dout, dq, dk, dv]) {
        let (place, d) = (scratch(dt, a), a.head_dim);
        let splits = place.splits;
        let at = |offset: usize| scratch_at + 4 * offset as Addr;
        let (keys, _) = key_tile(a);
        let parts = vec![Ptr(at(place.dq_parts)), Ptr(at(place.dk_parts)), Ptr(at(place.dv_parts))];
        let grid = ((a.heads as u32, a.batch as u32, splits as u32), keys as u32 * 2);
        let (groups, factor) = (a.heads / a.kv_heads, 1.0 / (d as f32).sqrt());
        let (q_rows, kv_rows) = (a.batch * a.seq, a.batch * a.kv_seq * a.kv_heads);
        return vec![
            delta_launch,
            launch(tensor_core!("backward", d), grid, [inputs, parts].concat()),
            sum_parts(
                (at(place.dq_parts), dq),
                (q_rows, a.heads * d),
                (a.heads * d, q_rows * a.heads * d, splits),
                factor,
            ),
            sum_parts((at(place.dk_parts), dk), (kv_rows, d), (groups * d, d, groups), factor),
            sum_parts((at(place.dv_parts), dv), (kv_rows, d), (groups * d, d, groups), 1.0),
        ];
    }
    let key_blocks = ((a.kv_seq.div_ceil(32) as u32, a.kv_heads as u32, a.batch as u32), 32);
    let (dq_kernel, dkdv_kernel) = if wide(a) {
        (typed!("attention_wide_dq", dt), typed!("attention_wide_dkdv", dt))
    } else {
        (typed!("attention_dq", dt), typed!("attention_dkdv", dt))
    };
    vec![
        delta_launch,
        launch(dq_kernel, query_blocks(a), [&inputs[..], &[Ptr(dq)]].concat()),
        launch(dkdv_kernel, key_blocks, [&inputs[..], &[Ptr(dk), Ptr(dv)]].concat()),
    ]
}

/// Folds a block's (out, lse) into the running (out, lse), one thread per query row.
pub fn merge(dt: DType, a: Attn, (out, lse): (Addr, Addr), (block_out, block_lse): (Addr, Addr)) -> Launch {
    let args = vec![Arg::Shape(a.into()), Ptr(out), Ptr(lse), Ptr(block_out), Ptr(block_lse)];
    launch(typed!("attention_merge", dt), each(a.batch * a.heads * a.seq), args)
}
