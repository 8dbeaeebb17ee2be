//! Every backward op against central finite differences of its forward.
//!
//! For an op y = f(x₁, x₂, …) and a fixed random R, the scalar L = Σ y·R has ∂L/∂xᵢ given by the
//! op's backward applied to dy = R. We perturb sampled coordinates of each input by ±ε and compare
//! (L(x+ε) − L(x−ε)) / 2ε with that gradient, relative to the gradient's largest entry.

use ferrotron::config::{RopeScaling, RopeType};
use ferrotron::model::{TensorSplit, Whole};
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::{self, rope_scaling, Attn, Precision, Rope};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.gen::<f32>() * 2.0 - 1.0) * scale).collect()
}

/// `f` maps the inputs to the output; `analytic` are the gradients of Σ f(x)·r w.r.t. each input.
fn check(op: &str, inputs: &[Vec<f32>], r: &[f32], f: impl Fn(&[Vec<f32>]) -> Vec<f32>, analytic: &[Vec<f32>]) {
    let loss = |xs: &[Vec<f32>]| -> f64 { f(xs).iter().zip(r).map(|(y, r)| *y as f64 * *r as f64).sum() };
    let eps = 1e-2f32;
    for (i, grad) in analytic.iter().enumerate() {
        assert_eq!(grad.len(), inputs[i].len(), "{op}: gradient {i} has the wrong size");
        let scale = grad.iter().fold(0.0f32, |m, g| m.max(g.abs()));
        assert!(scale > 0.0, "{op}: gradient {i} is all zeros");
        let stride = (grad.len() / 24).max(1);
        for j in (0..grad.len()).step_by(stride) {
            let mut plus = inputs.to_vec();
            plus[i][j] += eps;
            let mut minus = inputs.to_vec();
            minus[i][j] -= eps;
            let numeric = ((loss(&plus) - loss(&minus)) / (2.0 * eps as f64)) as f32;
            let err = (numeric - grad[j]).abs();
            assert!(
                err <= 1e-2 * scale,
                "{op}: d/dx{i}[{j}] numeric {numeric} vs backward {} (scale {scale})",
                grad[j]
            );
        }
    }
}

fn t(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::from_vec(shape, v.to_vec())
}

#[test]
fn linear() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (m, k, n) = (5, 7, 6);
    let (x, w, r) = (randn(&mut rng, m * k, 1.0), randn(&mut rng, n * k, 1.0), randn(&mut rng, m * n, 1.0));
    let f = |xs: &[Vec<f32>]| ops::linear(&t(&[m, k], &xs[0]), &t(&[n, k], &xs[1]), Precision::F32).to_vec();
    let mut dw = Tensor::zeros(&[n, k]);
    let dx = ops::linear_backward(&t(&[m, n], &r), &t(&[m, k], &x), &t(&[n, k], &w), &mut dw, Precision::F32);
    check("linear", &[x, w], &r, f, &[dx.to_vec(), dw.to_vec()]);
}

#[test]
fn embedding() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let tokens = [3u32, 0, 3, 5, 1];
    let (table, r) = (randn(&mut rng, 6 * 4, 1.0), randn(&mut rng, 5 * 4, 1.0));
    let f = |xs: &[Vec<f32>]| ops::embedding(&t(&[6, 4], &xs[0]), &tokens, 0).to_vec();
    let mut dtable = Tensor::zeros(&[6, 4]);
    ops::embedding_backward(&t(&[5, 4], &r), &tokens, 0, &mut dtable);
    check("embedding", &[table], &r, f, &[dtable.to_vec()]);
}

#[test]
fn rmsnorm() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (rows, d) = (4, 9);
    let (x, w, r) = (randn(&mut rng, rows * d, 1.0), randn(&mut rng, d, 1.0), randn(&mut rng, rows * d, 1.0));
    let f = |xs: &[Vec<f32>]| ops::rmsnorm(&t(&[rows, d], &xs[0]), &t(&[d], &xs[1]), 1e-5).0.to_vec();
    let (xt, wt) = (t(&[rows, d], &x), t(&[d], &w));
    let (_, rstd) = ops::rmsnorm(&xt, &wt, 1e-5);
    let mut dw = Tensor::zeros(&[d]);
    let dx = ops::rmsnorm_backward(&t(&[rows, d], &r), &xt, &wt, &rstd, &mut dw, None);
    check("rmsnorm", &[x, w], &r, f, &[dx.to_vec(), dw.to_vec()]);
}

#[test]
fn rope() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (rows, heads, hd) = (6, 3, 8);
    let positions = [0u32, 1, 2, 7, 30, 100];
    let (x, r) = (randn(&mut rng, rows * heads * hd, 1.0), randn(&mut rng, rows * heads * hd, 1.0));
    // plain, and YaRN's (cos and sin times its attention factor: the backward is scale · Rᵀ)
    let yarn = RopeScaling {
        rope_type: RopeType::Yarn,
        factor: 4.0,
        original_max_position_embeddings: 64,
        ..RopeScaling::PLAIN
    };
    for rope in [Rope::plain(10000.0, hd), rope_scaling::rope_of(10000.0, &yarn, hd)] {
        let f = |xs: &[Vec<f32>]| {
            let mut y = t(&[rows, heads * hd], &xs[0]);
            ops::rope(&mut y, &positions, &rope);
            y.to_vec()
        };
        let mut dx = t(&[rows, heads * hd], &r);
        ops::rope_backward(&mut dx, &positions, &rope);
        check("rope", std::slice::from_ref(&x), &r, f, &[dx.to_vec()]);
    }
}

#[test]
fn attention_grouped_query() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let a = Attn { batch: 2, seq: 5, kv_seq: 5, heads: 4, kv_heads: 2, head_dim: 4 };
    let (rows, qw, kw) = (a.batch * a.seq, a.heads * a.head_dim, a.kv_heads * a.head_dim);
    let pos: Vec<u32> = (0..5).collect();
    let pos = (&pos[..], &pos[..]);
    let q = randn(&mut rng, rows * qw, 1.0);
    let k = randn(&mut rng, rows * kw, 1.0);
    let v = randn(&mut rng, rows * kw, 1.0);
    let r = randn(&mut rng, rows * qw, 1.0);
    let f = |xs: &[Vec<f32>]| {
        ops::attention(a, &t(&[rows, qw], &xs[0]), &t(&[rows, kw], &xs[1]), &t(&[rows, kw], &xs[2]), pos).0.to_vec()
    };
    let (qt, kt, vt) = (t(&[rows, qw], &q), t(&[rows, kw], &k), t(&[rows, kw], &v));
    let (out, lse) = ops::attention(a, &qt, &kt, &vt, pos);
    let (dq, dk, dv) = ops::attention_backward(a, (&qt, &kt, &vt), pos, (&out, &lse), &t(&[rows, qw], &r));
    check("attention", &[q, k, v], &r, f, &[dq.to_vec(), dk.to_vec(), dv.to_vec()]);
}

/// Attention written out densely in f64, one (sequence, head) at a time: the output, the lse, and
/// the gradients for an output gradient `r`. Positions as in ring attention: any order.
#[allow(clippy::type_complexity)]
fn dense_attention(a: Attn, (q, k, v): (&[f32], &[f32], &[f32]), pos: (&[u32], &[u32]), r: &[f32]) -> [Vec<f64>; 5] {
    let (t, tk, hd, groups) = (a.seq, a.kv_seq, a.head_dim, a.heads / a.kv_heads);
    let (qi, ki) = (
        |b: usize, i: usize, h: usize| ((b * t + i) * a.heads + h) * hd,
        |b: usize, j: usize, g: usize| ((b * tk + j) * a.kv_heads + g) * hd,
    );
    let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; a.batch * a.heads * t]);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let scale = 1.0 / (hd as f64).sqrt();
    for b in 0..a.batch {
        for h in 0..a.heads {
            let g = h / groups;
            for i in 0..t {
                let seen: Vec<usize> = (0..tk).filter(|&j| pos.1[j] <= pos.0[i]).collect();
                let s: Vec<f64> = seen
                    .iter()
                    .map(|&j| {
                        (0..hd).map(|d| q[qi(b, i, h) + d] as f64 * k[ki(b, j, g) + d] as f64).sum::<f64>() * scale
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l = max + s.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                lse[(b * a.heads + h) * t + i] = l;
                let p: Vec<f64> = s.iter().map(|x| (x - l).exp()).collect();
                for (&j, &pj) in seen.iter().zip(&p) {
                    for d in 0..hd {
                        out[qi(b, i, h) + d] += pj * v[ki(b, j, g) + d] as f64;
                    }
                }
                // dP_j = r·v_j, dS_j = P_j (dP_j − Σ P dP), then the three products
                let dp: Vec<f64> = seen
                    .iter()
                    .map(|&j| (0..hd).map(|d| r[qi(b, i, h) + d] as f64 * v[ki(b, j, g) + d] as f64).sum())
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(p, d)| p * d).sum();
                for ((&j, &pj), &dpj) in seen.iter().zip(&p).zip(&dp) {
                    let ds = pj * (dpj - delta) * scale;
                    for d in 0..hd {
                        dq[qi(b, i, h) + d] += ds * k[ki(b, j, g) + d] as f64;
                        dk[ki(b, j, g) + d] += ds * q[qi(b, i, h) + d] as f64;
                        dv[ki(b, j, g) + d] += pj * r[qi(b, i, h) + d] as f64;
                    }
                }
            }
        }
    }
    [out, lse, dq, dk, dv]
}

#[test]
fn attention_in_query_tiles_matches_the_dense_formula() {
    // 150 queries make three tiles of the CPU kernel (64, 64, 22); the positions are those of a
    // zigzag ring block (two chunks far apart) against keys that are mostly after them, so some
    // tiles see a prefix of the keys, and no query sees the last ones
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let a = Attn { batch: 2, seq: 150, kv_seq: 100, heads: 4, kv_heads: 2, head_dim: 8 };
    let q_pos: Vec<u32> = (0..75).chain(225..300).collect();
    let k_pos: Vec<u32> = (40..90).chain(250..300).map(|p| p + 1).collect();
    let (rows, kv_rows) = (a.batch * a.seq, a.batch * a.kv_seq);
    let (qw, kw) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    let (q, k, v) =
        (randn(&mut rng, rows * qw, 1.0), randn(&mut rng, kv_rows * kw, 1.0), randn(&mut rng, kv_rows * kw, 1.0));
    let r = randn(&mut rng, rows * qw, 1.0);
    let (qt, kt, vt) = (t(&[rows, qw], &q), t(&[kv_rows, kw], &k), t(&[kv_rows, kw], &v));
    let pos = (&q_pos[..], &k_pos[..]);
    let (out, lse) = ops::attention(a, &qt, &kt, &vt, pos);
    let (dq, dk, dv) = ops::attention_backward(a, (&qt, &kt, &vt), pos, (&out, &lse), &t(&[rows, qw], &r));
    let want = dense_attention(a, (&q, &k, &v), pos, &r);
    for (name, got, want) in [
        ("out", out, &want[0]),
        ("lse", lse, &want[1]),
        ("dq", dq, &want[2]),
        ("dk", dk, &want[3]),
        ("dv", dv, &want[4]),
    ] {
        for (i, (g, w)) in got.to_vec().iter().zip(want).enumerate() {
            let ok = if w.is_infinite() { *g as f64 == *w } else { (*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()) };
            assert!(ok, "attention {name}[{i}]: {g} against the dense {w}");
        }
    }
}

#[test]
fn attention_is_causal() {
    // changing the last position's key and value must not change any earlier output
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let a = Attn { batch: 1, seq: 6, kv_seq: 6, heads: 2, kv_heads: 1, head_dim: 4 };
    let pos: Vec<u32> = (0..6).collect();
    let pos = (&pos[..], &pos[..]);
    let q = t(&[6, 8], &randn(&mut rng, 48, 1.0));
    let (k, v) = (randn(&mut rng, 24, 1.0), randn(&mut rng, 24, 1.0));
    let (mut k2, mut v2) = (k.clone(), v.clone());
    k2[20..].iter_mut().for_each(|x| *x += 1.0);
    v2[20..].iter_mut().for_each(|x| *x -= 1.0);
    let o1 = ops::attention(a, &q, &t(&[6, 4], &k), &t(&[6, 4], &v), pos).0.to_vec();
    let o2 = ops::attention(a, &q, &t(&[6, 4], &k2), &t(&[6, 4], &v2), pos).0.to_vec();
    assert_eq!(o1[..40], o2[..40], "earlier positions saw the future");
    assert_ne!(o1[40..], o2[40..], "the last position ignores its own key and value");
}

#[test]
fn swiglu() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (g, u, r) = (randn(&mut rng, 30, 3.0), randn(&mut rng, 30, 1.0), randn(&mut rng, 30, 1.0));
    let f = |xs: &[Vec<f32>]| ops::swiglu(&t(&[5, 6], &xs[0]), &t(&[5, 6], &xs[1])).to_vec();
    let (dg, du) = ops::swiglu_backward(&t(&[5, 6], &r), &t(&[5, 6], &g), &t(&[5, 6], &u));
    check("swiglu", &[g, u], &r, f, &[dg.to_vec(), du.to_vec()]);
}

#[test]
fn cross_entropy_with_ignored_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (rows, vocab) = (5, 7);
    let targets = [2i32, 6, -1, 0, 3];
    let logits = randn(&mut rng, rows * vocab, 3.0);
    // the scalar here is the summed loss (the mean times the counted rows): R = [1]
    let ce = |x: &Tensor| Whole.cross_entropy(x, &targets, 0).unwrap();
    let sum = |(mean, count, _): (Tensor, usize, Tensor)| mean.to_vec()[0] * count as f32;
    let f = |xs: &[Vec<f32>]| vec![sum(ce(&t(&[rows, vocab], &xs[0])))];
    let lt = t(&[rows, vocab], &logits);
    let (_, count, lse) = ce(&lt);
    assert_eq!(count, 4, "the ignored row is not counted");
    let d = ops::cross_entropy_backward(&lt, &targets, 0, &lse, 1.0).to_vec();
    assert!(d[2 * vocab..3 * vocab].iter().all(|&x| x == 0.0), "an ignored row has no gradient");
    check("cross_entropy", &[logits], &[1.0], f, &[d]);
}
