//! # The op layer: what the model may ask of a device
//!
//! Each op takes and returns `Tensor`s and has its backward next to it. The model (`model/`)
//! is written only in these calls, so it never knows which device it runs on: this file looks at
//! where the tensors live and calls that device's kernels, one arm per op: the GPU's launches
//! (`ops/gpu.rs`, results stay on the GPU) or the CPU reference (`ops/cpu.rs`). Shapes are checked
//! here, once, for every backend.
//!
//! Conventions: a linear weight is `[out, in]` as in PyTorch, so `y = x · Wᵀ`; activations are
//! `[rows, features]`; parameter gradients are *accumulated* (`+=`), activation gradients are
//! returned fresh.

pub mod cpu;
pub mod cpu_attention;
pub mod cpu_math;
pub mod fp8;
pub mod gpu;
pub mod gpu_fp8;
pub mod gpu_moe;
pub mod meter;
pub mod moe;
pub mod packing;
pub mod precision;
pub mod ring_merge;
pub mod rope_scaling;
pub mod tensor;
pub mod types;

pub use precision::Precision;
pub use types::{AdamWSettings, Attn, DType, Rope, TpCut};

use crate::cuda::device::{fatal, Device};
use cpu_math::View;
use std::sync::Arc;
use tensor::{Place, Tensor};

/// The GPU that every tensor of `op` lives on, or `None` when they are all on the CPU.
fn gpu<'a>(op: &str, ts: &[&'a Tensor]) -> Option<&'a Arc<Device>> {
    let dev = ts[0].gpu().map(|b| b.device());
    let same = ts.iter().all(|t| t.gpu().map(|b| Arc::as_ptr(b.device())) == dev.map(Arc::as_ptr));
    assert!(same, "{op}: its tensors are on different devices");
    dev
}

/// y[m, n] = x[m, k] · w[n, k]ᵀ, the GEMM reading its operands in precision `p` (`precision.rs`).
pub fn linear(x: &Tensor, w: &Tensor, p: Precision) -> Tensor {
    let (m, k, n) = (x.rows(), x.cols(), w.shape()[0]);
    assert_eq!(w.cols(), k, "linear: input has {k} features, weight expects {}", w.cols());
    if let Some(d) = gpu("linear", &[x, w]) {
        return fatal("linear", d.linear(x, w, p));
    }
    let ((x, sx), (w, sw)) = (precision::cast(x.host(), p.values()), precision::cast(w.host(), p.values()));
    let y = cpu_math::product(m, k, n, View::rows(&x, k), View::transposed(&w, k));
    Tensor::from_vec(&[m, n], p.output(y, sx * sw))
}

/// Returns dx = dy · w and accumulates dw += dyᵀ · x.
pub fn linear_backward(dy: &Tensor, x: &Tensor, w: &Tensor, dw: &mut Tensor, p: Precision) -> Tensor {
    let dx = linear_input_grad(dy, w, p);
    linear_weight_grad(dy, x, dw, p);
    dx
}

/// The input half of `linear_backward`: dx = dy · w.
pub fn linear_input_grad(dy: &Tensor, w: &Tensor, p: Precision) -> Tensor {
    let (m, n, k) = (dy.rows(), w.shape()[0], w.cols());
    assert_eq!(dy.cols(), n, "linear backward: output gradient has {} features, weight has {n} rows", dy.cols());
    if let Some(d) = gpu("linear backward", &[dy, w]) {
        return fatal("linear backward", d.linear_input_grad(dy, w, p));
    }
    let ((dy, sg), (w, sw)) = (precision::cast(dy.host(), p.gradients()), precision::cast(w.host(), p.values()));
    let dx = cpu_math::product(m, n, k, View::rows(&dy, n), View::rows(&w, k));
    Tensor::from_vec(&[m, k], p.output(dx, sg * sw))
}

/// dx += dy · w: a layer's input gradient added to the others' (the q, k and v projections read
/// the same input); on a GPU the GEMM adds it as it writes (β = 1), where the precision allows.
pub fn linear_input_grad_add(dy: &Tensor, w: &Tensor, p: Precision, dx: &mut Tensor) {
    dx.written();
    assert_eq!((dx.rows(), dx.cols()), (dy.rows(), w.cols()), "linear input gradient: shapes");
    match gpu("linear backward", &[dy, w, dx]) {
        Some(d) if !p.scaled() => fatal("linear backward", d.linear_input_grad_add(dy, w, dx)),
        _ => add_assign(dx, &linear_input_grad(dy, w, p)),
    }
}

/// The weight half of `linear_backward`: dw += dyᵀ · x (dw is f32 on every device).
pub fn linear_weight_grad(dy: &Tensor, x: &Tensor, dw: &mut Tensor, p: Precision) {
    dw.written();
    let (m, k, n) = (x.rows(), x.cols(), dw.shape()[0]);
    assert_eq!((dy.rows(), dy.cols(), dw.cols()), (m, n, k), "linear weight gradient: shapes");
    if let Some(d) = gpu("linear weight gradient", &[dy, x, dw]) {
        return fatal("linear weight gradient", d.linear_weight_grad(dy, x, dw, p));
    }
    let ((dy, sg), (x, sx)) = (precision::cast(dy.host(), p.gradients()), precision::cast(x.host(), p.values()));
    let (dy, x) = (View::transposed(&dy, n), View::rows(&x, k));
    if !p.scaled() {
        return cpu_math::gemm(n, m, k, dy, x, dw.host_mut(), true);
    }
    // the fp32 gradient adds the product multiplied back by 1/(sg·sx), as cuBLASLt's scales do
    let part = cpu_math::product(n, m, k, dy, x);
    dw.host_mut().iter_mut().zip(part).for_each(|(g, v)| *g += v * (sg * sx));
}

/// Rows of `table` picked by token id. The table may be a slice of the vocabulary starting at
/// id `first`: tokens outside it get zero rows (vocab-parallel embedding).
pub fn embedding(table: &Tensor, tokens: &[u32], first: usize) -> Tensor {
    if let Some(d) = gpu("embedding", &[table]) {
        return fatal("embedding", d.embedding(table, tokens, first));
    }
    let dim = table.cols();
    let mut out = Tensor::zeros(&[tokens.len(), dim]);
    cpu::embedding(table.host(), tokens, first, dim, out.host_mut());
    out
}

/// Accumulates the rows of `dout` into the table rows of their tokens (those in the slice).
pub fn embedding_backward(dout: &Tensor, tokens: &[u32], first: usize, dtable: &mut Tensor) {
    dtable.written();
    assert_eq!((dout.rows(), dout.cols()), (tokens.len(), dtable.cols()), "embedding backward: shapes");
    if let Some(d) = gpu("embedding backward", &[dout, dtable]) {
        return fatal("embedding backward", d.embedding_backward(dout, tokens, first, dtable));
    }
    let dim = dtable.cols();
    cpu::embedding_backward(dout.host(), tokens, first, dim, dtable.host_mut());
}

/// Returns (y, rstd): the normalised rows and the per-row 1/rms the backward needs.
pub fn rmsnorm(x: &Tensor, w: &Tensor, eps: f32) -> (Tensor, Tensor) {
    assert_eq!(x.cols(), w.numel(), "rmsnorm: {} features, weight of {}", x.cols(), w.numel());
    if let Some(d) = gpu("rmsnorm", &[x, w]) {
        return fatal("rmsnorm", d.rmsnorm(x, w, eps));
    }
    let mut y = Tensor::zeros(x.shape());
    let mut rstd = Tensor::zeros(&[x.rows()]);
    cpu::rmsnorm(x.host(), w.host(), eps, y.host_mut(), rstd.host_mut());
    (y, rstd)
}

/// x += add, then `rmsnorm(x)`: the residual add fused into the norm that follows it (one pass
/// over the rows on a GPU instead of two).
pub fn add_rmsnorm(x: &mut Tensor, add: &Tensor, w: &Tensor, eps: f32) -> (Tensor, Tensor) {
    x.written();
    assert_eq!(x.shape(), add.shape(), "add_rmsnorm: shapes differ");
    if let Some(d) = gpu("add and rmsnorm", &[x, add, w]) {
        return fatal("add and rmsnorm", d.add_rmsnorm(x, add, w, eps));
    }
    cpu::add_assign(x.host_mut(), add.host());
    rmsnorm(x, w, eps)
}

/// dx of RMSNorm (plus `residual`, the gradient that reached x around the norm: one pass on a
/// GPU instead of a norm and an add), and dw += its weight's gradient.
pub fn rmsnorm_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    dw: &mut Tensor,
    residual: Option<&Tensor>,
) -> Tensor {
    dw.written();
    if let Some(d) = gpu("rmsnorm backward", &[dy, x, w, rstd, dw]) {
        return fatal("rmsnorm backward", d.rmsnorm_backward((dy, x, w, rstd), dw, residual));
    }
    let mut dx = Tensor::zeros(x.shape());
    cpu::rmsnorm_backward(dy.host(), x.host(), w.host(), rstd.host(), dx.host_mut(), dw.host_mut());
    if let Some(r) = residual {
        assert_eq!(r.shape(), x.shape(), "rmsnorm backward: residual gradient shape");
        cpu::add_assign(dx.host_mut(), r.host());
    }
    dx
}

/// Rotates each head of `x` `[rows, heads*head_dim]` in place by its row's position.
pub fn rope(x: &mut Tensor, positions: &[u32], rope: &Rope) {
    rotate(x, positions, rope, false);
}

/// The backward of a rotation is the inverse rotation, applied to the gradient in place (times
/// the same scale: the map is scale · R(angle), its transpose scale · R(−angle)).
pub fn rope_backward(dx: &mut Tensor, positions: &[u32], rope: &Rope) {
    rotate(dx, positions, rope, true);
}

fn rotate(x: &mut Tensor, positions: &[u32], rope: &Rope, inverse: bool) {
    x.written();
    assert_eq!(positions.len(), x.rows(), "rope: one position per row");
    assert!(x.cols().is_multiple_of(rope.head_dim()), "rope: whole heads");
    if let Some(d) = gpu("rope", &[x]) {
        return fatal("rope", d.rope(x, positions, rope, inverse));
    }
    cpu::rope(x.host_mut(), positions, rope, inverse);
}
/// Causal grouped-query attention of queries at positions `pos.0` against keys at positions
/// `pos.1` (positions within a sequence, the same for every sequence of the batch; a key is seen
/// by the queries at or after it). Returns (out, lse) with lse `[batch, heads, seq]`; a row that
/// sees no key gets out 0 and lse −∞.
pub fn attention(a: Attn, q: &Tensor, k: &Tensor, v: &Tensor, pos: (&[u32], &[u32])) -> (Tensor, Tensor) {
    assert_eq!(q.shape(), [a.batch * a.seq, a.heads * a.head_dim], "attention: q shape");
    assert_eq!(k.shape(), [a.batch * a.kv_seq, a.kv_heads * a.head_dim], "attention: k shape");
    assert!(a.heads.is_multiple_of(a.kv_heads), "attention: heads must be a multiple of kv_heads");
    assert_eq!((pos.0.len(), pos.1.len()), (a.seq, a.kv_seq), "attention: one position per query and per key");
    if let Some(d) = gpu("attention", &[q, k, v]) {
        return fatal("attention", d.attention(a, (q, k, v), pos));
    }
    let mut out = Tensor::zeros(q.shape());
    let mut lse = Tensor::zeros(&[a.batch, a.heads, a.seq]);
    cpu_attention::attention(&a, (q.host(), k.host(), v.host()), pos, out.host_mut(), lse.host_mut());
    (out, lse)
}

/// Returns (dq, dk, dv), recomputing the probabilities from `lse`. `out` and `lse` are the whole
/// attention's, also when (q, k, v) is one block of it.
pub fn attention_backward(
    a: Attn,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    pos: (&[u32], &[u32]),
    (out, lse): (&Tensor, &Tensor),
    dout: &Tensor,
) -> (Tensor, Tensor, Tensor) {
    if let Some(d) = gpu("attention backward", &[q, k, v, out, lse, dout]) {
        return fatal("attention backward", d.attention_backward(a, (q, k, v), pos, (out, lse), dout));
    }
    let (mut dq, mut dk, mut dv) = (Tensor::zeros(q.shape()), Tensor::zeros(k.shape()), Tensor::zeros(v.shape()));
    cpu_attention::attention_backward(
        &a,
        (q.host(), k.host(), v.host()),
        pos,
        out.host(),
        lse.host(),
        dout.host(),
        dq.host_mut(),
        dk.host_mut(),
        dv.host_mut(),
    );
    (dq, dk, dv)
}

pub fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    assert_eq!(gate.shape(), up.shape(), "swiglu: gate and up shapes differ");
    if let Some(d) = gpu("swiglu", &[gate, up]) {
        return fatal("swiglu", d.swiglu(gate, up));
    }
    let mut h = Tensor::zeros(gate.shape());
    cpu::swiglu(gate.host(), up.host(), h.host_mut());
    h
}

/// Returns (dgate, dup).
pub fn swiglu_backward(dh: &Tensor, gate: &Tensor, up: &Tensor) -> (Tensor, Tensor) {
    if let Some(d) = gpu("swiglu backward", &[dh, gate, up]) {
        return fatal("swiglu backward", d.swiglu_backward(dh, gate, up));
    }
    let (mut dg, mut du) = (Tensor::zeros(gate.shape()), Tensor::zeros(up.shape()));
    cpu::swiglu_backward(dh.host(), gate.host(), up.host(), dg.host_mut(), du.host_mut());
    (dg, du)
}

/// Per-row maximum of `logits`, `[rows]`: the first statistic of a (vocab-parallel) softmax.
pub fn row_max(logits: &Tensor) -> Tensor {
    if let Some(d) = gpu("row max", &[logits]) {
        return fatal("row max", d.row_max(logits));
    }
    let mut m = Tensor::zeros(&[logits.rows()]);
    cpu::row_max(logits.host(), logits.cols(), m.host_mut());
    m
}

/// Per-row Σ exp(logit − max), `[rows]`.
pub fn row_sum_exp(logits: &Tensor, max: &Tensor) -> Tensor {
    if let Some(d) = gpu("row sum of exponentials", &[logits, max]) {
        return fatal("row sum of exponentials", d.row_sum_exp(logits, max));
    }
    let mut s = Tensor::zeros(&[logits.rows()]);
    cpu::row_sum_exp(logits.host(), logits.cols(), max.host(), s.host_mut());
    s
}

/// Per-row logit of the target, for targets in this vocabulary slice (ids `first..`); 0 otherwise.
pub fn target_logits(logits: &Tensor, targets: &[i32], first: usize) -> Tensor {
    assert_eq!(logits.rows(), targets.len(), "cross-entropy: one target per row");
    if let Some(d) = gpu("target logits", &[logits]) {
        return fatal("target logits", d.target_logits(logits, targets, first));
    }
    let mut z = Tensor::zeros(&[targets.len()]);
    cpu::target_logits(logits.host(), logits.cols(), targets, first, z.host_mut());
    z
}

/// loss[0] += scale · Σ (lse − z) over the rows whose target is not negative: the loss summed
/// where it was computed (on a GPU, no wait for it; f32 tensors).
pub fn add_loss(loss: &mut Tensor, (lse, z): (&Tensor, &Tensor), targets: &[i32], scale: f32) {
    loss.written();
    assert!(lse.numel() == targets.len() && z.numel() == targets.len() && loss.numel() == 1, "add_loss: sizes");
    if let Some(d) = gpu("add loss", &[loss, lse, z]) {
        return fatal("add loss", d.add_loss(loss, (lse, z), targets, scale));
    }
    loss.host_mut()[0] += scale * cpu::row_loss_sum(lse.host(), z.host(), targets);
}

/// d(scale · Σ row losses)/d logits for a vocabulary slice starting at id `first`:
/// softmax − one-hot(target), with softmax = exp(logit − lse); zero rows where the target is
/// negative (ignored).
pub fn cross_entropy_backward(logits: &Tensor, targets: &[i32], first: usize, lse: &Tensor, scale: f32) -> Tensor {
    assert_eq!(logits.rows(), targets.len(), "cross-entropy backward: one target per row");
    if let Some(d) = gpu("cross-entropy backward", &[logits, lse]) {
        return fatal("cross-entropy backward", d.cross_entropy_backward(logits, targets, first, lse, scale));
    }
    let mut d = Tensor::zeros(logits.shape());
    cpu::cross_entropy_backward(logits.host(), targets, first, lse.host(), scale, d.host_mut());
    d
}

/// Elementwise max, then logarithm of the exponential sum: lse = max + ln(sum), `[rows]`.
pub fn log_sum_exp(max: &Tensor, sum_exp: &Tensor) -> Tensor {
    if let Some(d) = gpu("log-sum-exp", &[max, sum_exp]) {
        return fatal("log-sum-exp", d.log_sum_exp(max, sum_exp));
    }
    let mut lse = Tensor::zeros(max.shape());
    cpu::log_sum_exp(max.host(), sum_exp.host(), lse.host_mut());
    lse
}

pub fn add_assign(a: &mut Tensor, b: &Tensor) {
    a.written();
    assert_eq!(a.shape(), b.shape(), "add_assign: shapes differ");
    if let Some(d) = gpu("add", &[a, b]) {
        return fatal("add", d.add_assign(a, b));
    }
    cpu::add_assign(a.host_mut(), b.host());
}

/// dst[to..to + n] = src[from..from + n], over the flat row-major values (same dtype).
pub fn copy(src: &Tensor, from: usize, dst: &mut Tensor, to: usize, n: usize) {
    dst.written();
    assert!(from + n <= src.numel() && to + n <= dst.numel(), "copy: {n} values out of bounds");
    if let Some(d) = gpu("copy", &[src, dst]) {
        return fatal("copy", d.copy(src, from, dst, to, n));
    }
    dst.host_mut()[to..to + n].copy_from_slice(&src.host()[from..from + n]);
}

/// `t` as a plain tensor of `dtype` on its device, written on the device (a mixed-precision
/// weight converts from its fp32 master). On the CPU every tensor is f32: a copy, whose values
/// are rounded to bf16 for `DType::Bf16`.
pub fn convert(t: &Tensor, dtype: DType) -> Tensor {
    if let Some(d) = gpu("convert", &[t]) {
        return fatal("convert", d.convert(t, dtype));
    }
    let round = |x: f32| if dtype == DType::Bf16 { half::bf16::from_f32(x).to_f32() } else { x };
    Tensor::from_vec(t.shape(), t.host().iter().map(|&x| round(x)).collect())
}

/// `parts`, one after another, as one flat tensor (to send them in one message).
pub fn concat(parts: &[&Tensor]) -> Tensor {
    let total = parts.iter().map(|t| t.numel()).sum();
    let mut flat = Tensor::empty_as(&[total], parts[0]); // every value is copied in
    let mut at = 0;
    for t in parts {
        copy(t, 0, &mut flat, at, t.numel());
        at += t.numel();
    }
    flat
}

/// The values of `t` from `offset` on, as a tensor of `shape` (a copy).
pub fn slice(t: &Tensor, offset: usize, shape: &[usize]) -> Tensor {
    let mut part = Tensor::empty_as(shape, t);
    let n = part.numel();
    copy(t, offset, &mut part, 0, n);
    part
}

/// A tensor of `shape` seen around its dimension d: (a, S[d], b), with a the product of the
/// dimensions before d and b of those after. One of n slices along d is then a block of
/// `S[d]/n · b` values in each of the a rows.
pub fn around(shape: &[usize], d: usize) -> (usize, usize, usize) {
    (shape[..d].iter().product(), shape[d], shape[d + 1..].iter().product())
}

/// Rank `r`'s slice (of `n`) along dimension `d` of `whole`, whose shape is `shape`: ⌈S[d]/n⌉
/// entries along d, the last slices ending in zeros where S[d] does not divide by n.
pub fn slice_along(whole: &Tensor, shape: &[usize], d: usize, (r, n): (usize, usize)) -> Tensor {
    let (a, s, b) = around(shape, d);
    let ld = s.div_ceil(n);
    let real = s.saturating_sub(r * ld).min(ld); // this slice's entries that are not padding
    let mut local = shape.to_vec();
    local[d] = ld;
    if a == 1 {
        // one contiguous run of values
        let mut part = if real < ld { Tensor::zeros_as(&local, whole) } else { Tensor::empty_as(&local, whole) };
        if real > 0 {
            copy(whole, r * ld * b, &mut part, 0, real * b);
        }
        return part;
    }
    if s == n * ld {
        // no padding: the whole is a rows of n blocks of ld·b values; mine is block r of each
        let order: Vec<u32> = (0..a).map(|i| (i * n + r) as u32).collect();
        return gather_blocks(whole, ld * b, &order).with_shape(&local);
    }
    // padded: entry by entry (rows of b values), a zero row appended to gather under the padding
    let zero_row = (a * s) as u32;
    let order: Vec<u32> = (0..a)
        .flat_map(|i| (0..ld).map(move |k| if k < real { (i * s + r * ld + k) as u32 } else { zero_row }))
        .collect();
    let rows = concat(&[whole, &Tensor::zeros_as(&[b], whole)]);
    gather_blocks(&rows, b, &order).with_shape(&local)
}

/// Tensor-parallel rank `r`'s part (of `n`) of a whole weight, cut as `cut` says.
pub fn tp_part(whole: &Tensor, cut: TpCut, rank: (usize, usize)) -> Tensor {
    match cut.dim() {
        Some(d) => slice_along(whole, whole.shape(), d, cut.part_of(rank)),
        None => whole.clone(),
    }
}

/// `x`'s values seen as rows of `d` (whatever its shape), those rows in `order`:
/// `[order.len(), d]` (placements cut a tensor into such blocks, `comm/placement.rs`; a mixture of
/// experts sorts its tokens by expert with it, `ops/moe.rs`).
pub fn gather_blocks(x: &Tensor, d: usize, order: &[u32]) -> Tensor {
    if let Some(dev) = gpu("gather rows", &[x]) {
        return fatal("gather rows", dev.permute_rows(x, d, order));
    }
    let src = x.host();
    let mut out = Vec::with_capacity(order.len() * d);
    for &r in order {
        out.extend_from_slice(&src[r as usize * d..(r as usize + 1) * d]);
    }
    Tensor::from_vec(&[order.len(), d], out)
}

/// a += s · b (b is scaled in place first).
pub fn add_scaled(a: &mut Tensor, mut b: Tensor, s: f32) {
    scale(&mut b, s);
    add_assign(a, &b);
}

pub fn scale(a: &mut Tensor, s: f32) {
    a.written();
    if let Some(d) = gpu("scale", &[a]) {
        return fatal("scale", d.scale(a, s));
    }
    cpu::scale(a.host_mut(), s);
}

/// Σ x² over all of `ts` (f32 tensors: gradients) as a one-number f32 tensor on `place`, where
/// they live: on a GPU nobody waits for it here.
pub fn sum_squares_total(ts: &[&Tensor], place: &Place) -> Tensor {
    if let Place::Cuda(d) = place {
        return fatal("sum of squares", d.sum_squares_total(ts));
    }
    let total: f64 = ts.iter().map(|t| cpu::sum_squares(t.host())).sum();
    Tensor::from_vec(&[1], vec![total as f32])
}

/// One AdamW step of each parameter: (its settings, its weight, gradient and moments; a
/// mixed-precision weight on its fp32 master, rewriting the bf16 copy). On a GPU, a launch per 64
/// parameters.
pub fn adamw(steps: &mut [(AdamWSettings, &mut Tensor, &Tensor, &mut Tensor, &mut Tensor)]) {
    for (_, p, g, m, v) in steps.iter() {
        assert!(p.numel() == g.numel() && g.numel() == m.numel() && m.numel() == v.numel(), "adamw: sizes differ");
    }
    for (_, p, _, m, v) in steps.iter_mut() {
        // (a weight's FP8 copies are made again from its new numbers)
        p.written();
        m.written();
        v.written();
    }
    let all: Vec<&Tensor> = steps.iter().flat_map(|(_, p, g, m, v)| [&**p, *g, &**m, &**v]).collect();
    if all.is_empty() {
        return;
    }
    if let Some(d) = gpu("adamw", &all) {
        let steps: Vec<_> = steps.iter().map(|(o, p, g, m, v)| (*o, &**p, *g, &**m, &**v)).collect();
        return fatal("adamw", d.adamw(&steps));
    }
    for (o, p, g, m, v) in steps.iter_mut() {
        cpu::adamw(o, p.host_mut(), g.host(), m.host_mut(), v.host_mut());
    }
}

/// Every tensor of `ts` (f32: gradients) set to zero; on a GPU, a launch per 64 of them.
pub fn fill_zeros(ts: &mut [&mut Tensor]) {
    ts.iter_mut().for_each(|t| _ = t.written());
    let all: Vec<&Tensor> = ts.iter().map(|t| &**t).collect();
    if all.is_empty() {
        return;
    }
    if let Some(d) = gpu("fill zeros", &all) {
        return fatal("fill zeros", d.fill_zeros(&all));
    }
    ts.iter_mut().for_each(|t| t.host_mut().fill(0.0));
}
