//! The launches of the attention: `kernels/attention.cu` (the readable kernels, f32 and any head
//! size; the ring blocks' merge) and `kernels/flash_attention.cu` (FlashAttention-2 on tensor
//! cores, bf16 at head sizes 16 to 128), which of the two by dtype, head size and alignment.

use super::{each, launch, Addr, Arg, Launch, Ptr};
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

/// Mixed precision with a head size it is built for runs attention on tensor cores
/// (`flash_attention.cu`); f32 mode and other sizes run `attention.cu`, and so do tensors not on
/// 16 bytes (the tensor-core kernels copy rows 16 bytes at a time; every allocation is aligned,
/// so this is a guard, not a path taken).
fn tensor_cores(dt: DType, a: Attn, tensors: &[Addr]) -> bool {
    dt == DType::Bf16 && TENSOR_CORE_HEAD_DIMS.contains(&a.head_dim) && tensors.iter().all(|t| t % 16 == 0)
}

/// `flash_attention.cu`'s forward and dq: a block of 4 warps per 64 query rows of one head. The
/// grid is (heads, batch, tiles), so that blocks start tile by tile, the heaviest first (the
/// kernel maps z to its tile; `tests/attention_balance.rs`).
fn flash_query_blocks(kernel: Kernel, a: Attn, args: Vec<Arg>) -> Launch {
    launch(kernel, ((a.heads as u32, a.batch as u32, a.seq.div_ceil(64) as u32), 128), args)
}

/// `flash_attention.cu`'s dk/dv: a warp per 16 key rows of one KV head, 64 keys a block (32 at
/// head size 128, where shared memory holds fewer rows; `KeyTiles` in the kernel).
/// The grid is (KV heads, batch, key tiles), as the forward's.
fn flash_key_blocks(kernel: Kernel, a: Attn, args: Vec<Arg>) -> Launch {
    let keys = if a.head_dim <= 64 { 64 } else { 32 };
    launch(kernel, ((a.kv_heads as u32, a.batch as u32, a.kv_seq.div_ceil(keys) as u32), keys as u32 * 2), args)
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
    launch(typed!("attention_forward", dt), query_blocks(a), args)
}

/// Threads a query row of `attention_delta` (`DELTA_LANES` in `attention.cu`).
const DELTA_LANES: usize = 8;

/// The backward in three launches: delta (f32, `[batch, heads, seq]` like lse), dq, then dk and dv.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dt: DType,
    a: Attn,
    (q, k, v): (Addr, Addr, Addr),
    (q_pos, k_pos): (Addr, Addr),
    (out, lse, dout): (Addr, Addr, Addr),
    delta: Addr,
    (dq, dk, dv): (Addr, Addr, Addr),
) -> [Launch; 3] {
    let shape = Arg::Shape(a.into());
    let inputs = vec![shape.clone(), Ptr(q), Ptr(k), Ptr(v), Ptr(q_pos), Ptr(k_pos), Ptr(lse), Ptr(delta), Ptr(dout)];
    let delta_launch = launch(
        typed!("attention_delta", dt),
        each(a.batch * a.heads * a.seq * DELTA_LANES),
        vec![shape, Ptr(out), Ptr(dout), Ptr(delta)],
    );
    let (dq_args, dkdv_args) = ([&inputs[..], &[Ptr(dq)]].concat(), [&inputs[..], &[Ptr(dk), Ptr(dv)]].concat());
    if tensor_cores(dt, a, &[q, k, v, dout, dq, dk, dv]) {
        return [
            delta_launch,
            flash_query_blocks(tensor_core!("dq", a.head_dim), a, dq_args),
            flash_key_blocks(tensor_core!("dkdv", a.head_dim), a, dkdv_args),
        ];
    }
    let key_blocks = ((a.kv_seq.div_ceil(32) as u32, a.kv_heads as u32, a.batch as u32), 32);
    [
        delta_launch,
        launch(typed!("attention_dq", dt), query_blocks(a), dq_args),
        launch(typed!("attention_dkdv", dt), key_blocks, dkdv_args),
    ]
}

/// Folds a block's (out, lse) into the running (out, lse), one thread per query row.
pub fn merge(dt: DType, a: Attn, (out, lse): (Addr, Addr), (block_out, block_lse): (Addr, Addr)) -> Launch {
    let args = vec![Arg::Shape(a.into()), Ptr(out), Ptr(lse), Ptr(block_out), Ptr(block_lse)];
    launch(typed!("attention_merge", dt), each(a.batch * a.heads * a.seq), args)
}
