//! # CPU kernels: the f32 reference math
//!
//! Every op of the model, forward and backward side by side, on plain slices. This is the
//! reference that the CUDA kernels are tested against, so it favours clarity: one loop per
//! formula, rows in parallel with rayon, and sums that touch shared parameter gradients done in a
//! fixed order so that every run gives the same bits. Attention has a file of its own
//! (`ops/cpu_attention.rs`); matrix products, `exp` and row reductions come from
//! `ops/cpu_math.rs`, written for speed.
//!
//! Layouts: activations are `[rows, features]` with `rows = batch * seq`; attention inputs keep
//! the Hugging Face layout `[rows, heads * head_dim]` (head-major inside a row).

use crate::ops::cpu_math::{dot8, exp, max8, sum8_of};
use crate::ops::types::{AdamWSettings, DType, Rope};
use half::bf16;
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// Embedding: out[r] = table[token[r]]; backward scatters rows back, in row order.

/// The table holds ids `first..first + rows`; other tokens get zero rows.
pub fn embedding(table: &[f32], tokens: &[u32], first: usize, dim: usize, out: &mut [f32]) {
    let rows = table.len() / dim;
    out.par_chunks_mut(dim).zip(tokens.par_iter()).for_each(|(row, &t)| match (t as usize).checked_sub(first) {
        Some(t) if t < rows => row.copy_from_slice(&table[t * dim..(t + 1) * dim]),
        _ => row.fill(0.0),
    });
}

pub fn embedding_backward(dout: &[f32], tokens: &[u32], first: usize, dim: usize, dtable: &mut [f32]) {
    let rows = dtable.len() / dim;
    for (row, &t) in dout.chunks(dim).zip(tokens) {
        let Some(t) = (t as usize).checked_sub(first).filter(|&t| t < rows) else { continue };
        for (g, d) in dtable[t * dim..(t + 1) * dim].iter_mut().zip(row) {
            *g += d;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = x * rstd * w with rstd = 1 / sqrt(mean(x²) + eps).

pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32], rstd: &mut [f32]) {
    let dim = w.len();
    y.par_chunks_mut(dim).zip(x.par_chunks(dim)).zip(rstd.par_iter_mut()).for_each(|((y, x), rstd)| {
        let ms = dot8(x, x) / dim as f32;
        *rstd = 1.0 / (ms + eps).sqrt();
        for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
            *y = x * *rstd * w;
        }
    });
}

/// With x̂ = x·rstd: dw += Σ_rows dy·x̂ and dx = rstd · (dy·w − x̂ · mean(dy·w·x̂)).
pub fn rmsnorm_backward(dy: &[f32], x: &[f32], w: &[f32], rstd: &[f32], dx: &mut [f32], dw: &mut [f32]) {
    let dim = w.len();
    dx.par_chunks_mut(dim).zip(dy.par_chunks(dim)).zip(x.par_chunks(dim)).zip(rstd.par_iter()).for_each(
        |(((dx, dy), x), &r)| {
            dx.iter_mut().zip(dy).zip(w).for_each(|((dx, g), w)| *dx = g * w); // dy·w, then
            let dot = dot8(dx, x) * r / dim as f32; // mean(dy·w·x̂)
            dx.iter_mut().zip(x).for_each(|(dx, x)| *dx = r * (*dx - x * r * dot));
        },
    );
    for ((dy, x), &r) in dy.chunks(dim).zip(x.chunks(dim)).zip(rstd) {
        for ((dw, g), x) in dw.iter_mut().zip(dy).zip(x) {
            *dw += g * x * r;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE, Hugging Face convention: the head vector is split in halves (x1, x2) and rotated as
// (x1·cos − x2·sin, x2·cos + x1·sin) with angle pos · inv_freq[i], i < head_dim/2 (cos and sin
// times the rope's scale). The backward is the rotation by −angle.

/// cos and sin `[positions, head_dim / 2]` of `rope`'s angles (sin negated when `inverse`): in
/// f64, rounded to f32, as `kernels/rope.cu`'s table.
pub fn rope_table(positions: &[u32], rope: &Rope, inverse: bool) -> Vec<(f32, f32)> {
    let sign = if inverse { -1.0 } else { 1.0 };
    let angles = positions.iter().flat_map(|&pos| rope.inv_freq.iter().map(move |f| (pos as f64 * f).sin_cos()));
    angles.map(|(s, c)| ((sign * s * rope.scale) as f32, (c * rope.scale) as f32)).collect()
}

pub fn rope(x: &mut [f32], positions: &[u32], rope: &Rope, inverse: bool) {
    let (head_dim, half) = (rope.head_dim(), rope.inv_freq.len());
    // (sin, cos) once per distinct position: every sequence of a batch repeats the same ones
    let mut distinct = positions.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let table = rope_table(&distinct, rope, inverse);
    let row_len = x.len() / positions.len().max(1);
    x.par_chunks_mut(row_len.max(1)).zip(positions.par_iter()).for_each(|(row, pos)| {
        let at = distinct.binary_search(pos).expect("every position is in the table") * half;
        let angles = &table[at..at + half];
        for head in row.chunks_mut(head_dim) {
            let (x1, x2) = head.split_at_mut(half);
            for ((a, b), &(sin, cos)) in x1.iter_mut().zip(x2).zip(angles) {
                (*a, *b) = (*a * cos - *b * sin, *b * cos + *a * sin);
            }
        }
    });
}

/// Elementwise ops go over chunks of this many elements, a rayon task each: the plain loop inside
/// a chunk compiles to SIMD, where a task per element would cost more than its arithmetic.
const CHUNK: usize = 8 * 1024;

// ---------------------------------------------------------------------------------------------
// SwiGLU: h = silu(gate) · up, silu(g) = g·σ(g), silu'(g) = σ(g)·(1 + g·(1 − σ(g))).

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

pub fn swiglu(gate: &[f32], up: &[f32], h: &mut [f32]) {
    h.par_chunks_mut(CHUNK).zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK))).for_each(|(h, (gate, up))| {
        for ((h, &g), &u) in h.iter_mut().zip(gate).zip(up) {
            *h = g * sigmoid(g) * u;
        }
    });
}

pub fn swiglu_backward(dh: &[f32], gate: &[f32], up: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    let inputs = dh.par_chunks(CHUNK).zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)));
    dgate.par_chunks_mut(CHUNK).zip(dup.par_chunks_mut(CHUNK)).zip(inputs).for_each(
        |((dgate, dup), (dh, (gate, up)))| {
            for (((dg, du), &d), (&g, &u)) in dgate.iter_mut().zip(dup).zip(dh).zip(gate.iter().zip(up)) {
                let s = sigmoid(g);
                *du = d * g * s;
                *dg = d * u * s * (1.0 + g * (1.0 - s));
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy over the vocabulary: loss_r = lse(logits_r) − logits_r[target_r]; rows whose target
// is negative are ignored. The gradient is (softmax − onehot) · scale, rebuilt from the saved lse.

/// Writes each row's largest logit (of this slice of the vocabulary).
pub fn row_max(logits: &[f32], vocab: usize, max: &mut [f32]) {
    max.par_iter_mut().zip(logits.par_chunks(vocab)).for_each(|(m, row)| {
        *m = max8(row);
    });
}

pub fn row_sum_exp(logits: &[f32], vocab: usize, max: &[f32], sum: &mut [f32]) {
    sum.par_iter_mut().zip(logits.par_chunks(vocab)).zip(max.par_iter()).for_each(|((s, row), &m)| {
        *s = sum8_of(row, |x| exp(x - m));
    });
}

pub fn log_sum_exp(max: &[f32], sum_exp: &[f32], lse: &mut [f32]) {
    for ((l, m), s) in lse.iter_mut().zip(max).zip(sum_exp) {
        *l = m + s.ln();
    }
}

/// Σ (lse − z) over the rows whose target is not negative, accumulated in f64.
pub fn row_loss_sum(lse: &[f32], z: &[f32], targets: &[i32]) -> f32 {
    let rows = lse.iter().zip(z).zip(targets).filter(|(_, &t)| t >= 0);
    rows.map(|((&l, &z), _)| (l - z) as f64).sum::<f64>() as f32
}

/// The logit of each row's target when it lies in this slice of the vocabulary, else 0.
pub fn target_logits(logits: &[f32], vocab: usize, targets: &[i32], first: usize, z: &mut [f32]) {
    for ((z, row), &t) in z.iter_mut().zip(logits.chunks(vocab)).zip(targets) {
        *z = local_target(t, first, vocab).map_or(0.0, |t| row[t]);
    }
}

/// Column of target `t` in a slice of `vocab` ids starting at `first`, if it is there.
fn local_target(t: i32, first: usize, vocab: usize) -> Option<usize> {
    usize::try_from(t).ok()?.checked_sub(first).filter(|&c| c < vocab)
}

pub fn cross_entropy_backward(
    logits: &[f32],
    targets: &[i32],
    first: usize,
    lse: &[f32],
    scale: f32,
    dlogits: &mut [f32],
) {
    let vocab = logits.len() / targets.len();
    dlogits.par_chunks_mut(vocab).zip(logits.par_chunks(vocab)).zip(targets.par_iter().zip(lse.par_iter())).for_each(
        |((d, row), (&t, &l))| {
            if t < 0 {
                d.fill(0.0);
                return;
            }
            for (d, x) in d.iter_mut().zip(row) {
                *d = exp(x - l) * scale;
            }
            if let Some(c) = local_target(t, first, vocab) {
                d[c] -= scale;
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Small elementwise ops and the AdamW update.

pub fn add_assign(a: &mut [f32], b: &[f32]) {
    a.par_chunks_mut(CHUNK).zip(b.par_chunks(CHUNK)).for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

pub fn scale(a: &mut [f32], s: f32) {
    a.par_chunks_mut(CHUNK).for_each(|a| a.iter_mut().for_each(|a| *a *= s));
}

/// Σ x², accumulated in f64 in a fixed order.
pub fn sum_squares(a: &[f32]) -> f64 {
    a.chunks(4096).map(|c| c.iter().map(|&x| x as f64 * x as f64).sum::<f64>()).sum()
}

/// p ← p − lr·wd·p (decoupled decay), then p ← p − lr · m̂ / (√v̂ + eps).
pub fn adamw(o: &AdamWSettings, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let c1 = 1.0 - o.beta1.powi(o.step as i32);
    let c2 = 1.0 - o.beta2.powi(o.step as i32);
    let state = m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK));
    p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(state).for_each(|((p, g), (m, v))| {
        for ((p, &g), (m, v)) in p.iter_mut().zip(g).zip(m.iter_mut().zip(v)) {
            let g = g * o.grad_scale;
            *m = o.beta1 * *m + (1.0 - o.beta1) * g;
            *v = o.beta2 * *v + (1.0 - o.beta2) * g * g;
            *p -= o.lr * o.weight_decay * *p;
            *p -= o.lr * (*m / c1) / ((*v / c2).sqrt() + o.eps);
            if o.moments == DType::Bf16 {
                // kept as bf16 would keep them (round to nearest even), after the update used them
                (*m, *v) = (bf16::from_f32(*m).to_f32(), bf16::from_f32(*v).to_f32());
            }
        }
    });
}
