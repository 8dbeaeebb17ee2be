//! The launches of `kernels/moe.cu`: the router's top-k and the rows' journey by expert.

use super::{each, int, launch, long, rows, Launch, Ptr};
use crate::cuda::kernels::kernel;
use crate::ops::types::DType;

/// Top-k of `rows` router rows of `experts` logits: probs `[rows, experts]`, weights and ids
/// (as floats) `[rows, k]`, all f32. One thread per row.
pub fn route(
    dt: DType,
    logits: u64,
    (n, experts, k): (usize, usize, usize),
    (probs, weights, ids): (u64, u64, u64),
) -> Launch {
    let args = vec![Ptr(logits), long(n), int(experts), int(k), Ptr(probs), Ptr(weights), Ptr(ids)];
    launch(typed!("route", dt), each(n), args)
}

/// d logits `[rows, experts]` from d weights; `balance` one f32 per expert, or 0 (none).
pub fn route_backward(
    dt: DType,
    (dweights, probs, weights, ids): (u64, u64, u64, u64),
    balance: u64,
    (n, experts, k): (usize, usize, usize),
    dlogits: u64,
) -> Launch {
    let args = vec![
        Ptr(dweights),
        Ptr(probs),
        Ptr(weights),
        Ptr(ids),
        Ptr(balance),
        long(n),
        int(experts),
        int(k),
        Ptr(dlogits),
    ];
    launch(typed!("route_backward", dt), each(n), args)
}

/// out[i] = x[order[i]] for `n` rows of `dim`. One block per row.
pub fn permute_rows(dt: DType, x: u64, (order, n): (u64, usize), dim: usize, out: u64) -> Launch {
    launch(typed!("permute_rows", dt), rows(n), vec![Ptr(x), Ptr(order), int(dim), Ptr(out)])
}

/// y[t] = Σ_j w[t, j] · ys[slot[t·k + j]] for `n` rows; `weights` 0 for unit weights.
pub fn weighted_sum(
    dt: DType,
    (ys, slot, weights): (u64, u64, u64),
    (n, k, dim): (usize, usize, usize),
    y: u64,
) -> Launch {
    launch(typed!("weighted_sum", dt), rows(n), vec![Ptr(ys), Ptr(slot), Ptr(weights), int(k), int(dim), Ptr(y)])
}

/// d ys and d weights (f32) of `weighted_sum`, one block per routed pair of `n` rows × `k`.
pub fn weighted_sum_backward(
    dt: DType,
    (dy, ys, slot, weights): (u64, u64, u64, u64),
    (n, k, dim): (usize, usize, usize),
    (dys, dweights): (u64, u64),
) -> Launch {
    let args = vec![Ptr(dy), Ptr(ys), Ptr(slot), Ptr(weights), int(k), int(dim), Ptr(dys), Ptr(dweights)];
    launch(typed!("weighted_sum_backward", dt), rows(n * k), args)
}

/// One launch of each, for the catalogue.
pub fn catalogue(dt: DType) -> Vec<Launch> {
    vec![
        route(dt, 0, (1, 2, 1), (0, 0, 0)),
        route_backward(dt, (0, 0, 0, 0), 0, (1, 2, 1), 0),
        permute_rows(dt, 0, (0, 1), 1, 0),
        weighted_sum(dt, (0, 0, 0), (1, 1, 1), 0),
        weighted_sum_backward(dt, (0, 0, 0, 0), (1, 1, 1), (0, 0)),
    ]
}
