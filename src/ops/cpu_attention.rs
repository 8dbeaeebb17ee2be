//! # Causal attention on the CPU, forward and backward
//!
//! The f32 reference that the GPU's attention kernels are tested against, and that ring attention
//! (context parallelism) calls once per block of keys. Layouts as in `ops/cpu.rs`: q, k, v and
//! the output are `[batch*seq, heads*head_dim]` (head-major inside a row), lse `[batch, heads, seq]`.
//!
//! Grouped-query attention: query head h reads KV head h / (heads / kv_heads). Per (sequence,
//! head): S = Q Kᵀ · scale, masked where the key's position is after the query's, P = softmax(S),
//! O = P V. The forward keeps only the log-sum-exp of each row (lse); the backward rebuilds
//! P = exp(S − lse), as flash attention does, so no T×T matrix is kept between forward and
//! backward. Queries and keys carry their positions in the sequence, so the same kernels compute
//! one block of ring attention (a query chunk against another rank's key chunk): a row that sees
//! no key of the block gets output 0 and lse −∞, and the backward takes the lse and output of the
//! whole row, merged over all blocks.
//!
//! The queries go in tiles of `QUERY_TILE` rows, and a tile stops at the last key that one of its
//! queries can see: in causal attention the keys past the diagonal are skipped, which saves
//! nearly half of the products and exponentials (PyTorch's CPU flash attention does the same).

use crate::ops::cpu_math::{dot8, exp, gemm, max8, product, sum8, View};
use crate::ops::types::Attn;
use rayon::prelude::*;

/// Query rows computed together; each tile reads the keys up to its last query.
pub const QUERY_TILE: usize = 32;

/// The strided views and scale that the attention kernels use.
impl Attn {
    /// Head `h` of sequence `b` from query row `i` on (queries, outputs and their gradients).
    fn q_view<'a>(&self, q: &'a [f32], b: usize, h: usize, i: usize) -> View<'a> {
        let stride = self.heads * self.head_dim;
        View { data: &q[(b * self.seq + i) * stride + h * self.head_dim..], row_stride: stride, col_stride: 1 }
    }
    fn kv_view<'a>(&self, kv: &'a [f32], b: usize, g: usize) -> View<'a> {
        let stride = self.kv_heads * self.head_dim;
        View { data: &kv[b * self.kv_seq * stride + g * self.head_dim..], row_stride: stride, col_stride: 1 }
    }
    fn kv_view_t<'a>(&self, kv: &'a [f32], b: usize, g: usize) -> View<'a> {
        let v = self.kv_view(kv, b, g);
        View { data: v.data, row_stride: 1, col_stride: v.row_stride }
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
    /// The query tiles: (first row, rows, keys the tile sees), the keys being a prefix that ends
    /// at the last key whose position is at most the tile's largest query position.
    fn tiles(&self, (q_pos, k_pos): (&[u32], &[u32])) -> Vec<(usize, usize, usize)> {
        let tile = |i: usize| {
            let rows = QUERY_TILE.min(self.seq - i);
            let last = q_pos[i..i + rows].iter().max().copied().unwrap_or(0);
            (i, rows, k_pos.iter().rposition(|&kp| kp <= last).map_or(0, |j| j + 1))
        };
        (0..self.seq).step_by(QUERY_TILE).map(tile).collect()
    }
    /// Scores `[rows, keys]` of one query tile against the first `keys` keys, for one (sequence,
    /// head) pair: scaled, −∞ where the key comes after the query.
    fn scores(
        &self,
        q: &[f32],
        k: &[f32],
        (b, h): (usize, usize),
        (i, rows, keys): (usize, usize, usize),
        pos: (&[u32], &[u32]),
    ) -> Vec<f32> {
        let g = h / (self.heads / self.kv_heads);
        let mut s = product(rows, self.head_dim, keys, self.q_view(q, b, h, i), self.kv_view_t(k, b, g));
        for (row, &qp) in s.chunks_mut(keys.max(1)).zip(&pos.0[i..i + rows]) {
            for (v, &kp) in row.iter_mut().zip(pos.1) {
                *v = if kp <= qp { *v * self.scale() } else { f32::NEG_INFINITY };
            }
        }
        s
    }
}

/// Writes `out` `[batch*seq, heads*head_dim]` and `lse` `[batch, heads, seq]`; `pos` holds the
/// positions of the queries and of the keys within a sequence.
pub fn attention(
    sh: &Attn,
    (q, k, v): (&[f32], &[f32], &[f32]),
    pos: (&[u32], &[u32]),
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (t, hd) = (sh.seq, sh.head_dim);
    let groups = sh.heads / sh.kv_heads;
    let tiles = sh.tiles(pos);
    let blocks: Vec<(Vec<f32>, Vec<f32>)> = (0..sh.batch * sh.heads)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / sh.heads, bh % sh.heads);
            let (mut o, mut row_lse) = (vec![0.0; t * hd], vec![f32::NEG_INFINITY; t]);
            for &(i, rows, keys) in &tiles {
                let mut p = sh.scores(q, k, (b, h), (i, rows, keys), pos);
                for (row, l) in p.chunks_mut(keys.max(1)).zip(&mut row_lse[i..i + rows]) {
                    let max = max8(row);
                    if max == f32::NEG_INFINITY {
                        row.fill(0.0); // no key of this block is visible to this query: lse stays −∞
                        continue;
                    }
                    row.iter_mut().for_each(|x| *x = exp(*x - max)); // a masked score (−∞) gets 0
                    let sum = sum8(row);
                    row.iter_mut().for_each(|x| *x /= sum);
                    *l = max + sum.ln();
                }
                let o_tile = &mut o[i * hd..(i + rows) * hd];
                gemm(rows, keys, hd, View::rows(&p, keys), sh.kv_view(v, b, h / groups), o_tile, false);
            }
            (o, row_lse)
        })
        .collect();
    for (bh, (o, l)) in blocks.into_iter().enumerate() {
        let (b, h) = (bh / sh.heads, bh % sh.heads);
        for (i, orow) in o.chunks(hd).enumerate() {
            let at = (b * t + i) * sh.heads * hd + h * hd;
            out[at..at + hd].copy_from_slice(orow);
        }
        lse[bh * t..(bh + 1) * t].copy_from_slice(&l);
    }
}

/// Gradients of attention. Per (sequence, KV head): for each query head of its group and each
/// query tile, P = exp(S − lse), dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = dS K · scale,
/// dK += dSᵀ Q · scale, dV += Pᵀ dO. `out` and `lse` are the whole row's (over all blocks).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    sh: &Attn,
    (q, k, v): (&[f32], &[f32], &[f32]),
    pos: (&[u32], &[u32]),
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let (t, tk, hd) = (sh.seq, sh.kv_seq, sh.head_dim);
    let groups = sh.heads / sh.kv_heads;
    let tiles = sh.tiles(pos);
    let row = sh.heads * hd; // the row stride of q, out, dout
    let blocks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..sh.batch * sh.kv_heads)
        .into_par_iter()
        .map(|bg| {
            let (b, g) = (bg / sh.kv_heads, bg % sh.kv_heads);
            let (mut dq_g, mut dk_g, mut dv_g) = (vec![0.0; groups * t * hd], vec![0.0; tk * hd], vec![0.0; tk * hd]);
            for (j, dq_h) in dq_g.chunks_mut(t * hd).enumerate() {
                let h = g * groups + j;
                for &(i, rows, keys) in &tiles {
                    let mut p = sh.scores(q, k, (b, h), (i, rows, keys), pos);
                    let row_lse = &lse[(b * sh.heads + h) * t + i..][..rows];
                    for (p_row, &l) in p.chunks_mut(keys.max(1)).zip(row_lse) {
                        // a masked score is −∞ and its probability 0, also in a row that sees no key
                        // (lse −∞, where x − lse is NaN): exp first, then the choice, so that the
                        // loop has no branch and compiles to SIMD
                        p_row.iter_mut().for_each(|x| {
                            let e = exp(*x - l);
                            *x = if *x == f32::NEG_INFINITY { 0.0 } else { e };
                        });
                    }
                    let (d_o, o, q_tile) = (sh.q_view(dout, b, h, i), sh.q_view(out, b, h, i), sh.q_view(q, b, h, i));
                    let mut ds = product(rows, hd, keys, d_o, sh.kv_view_t(v, b, g));
                    for (r, (ds_row, p_row)) in ds.chunks_mut(keys.max(1)).zip(p.chunks(keys.max(1))).enumerate() {
                        let delta = dot8(&d_o.data[r * row..][..hd], &o.data[r * row..][..hd]);
                        for (x, p) in ds_row.iter_mut().zip(p_row) {
                            *x = p * (*x - delta) * sh.scale();
                        }
                    }
                    gemm(rows, keys, hd, View::rows(&ds, keys), sh.kv_view(k, b, g), &mut dq_h[i * hd..], false);
                    gemm(keys, rows, hd, View::transposed(&ds, keys), q_tile, &mut dk_g, true);
                    gemm(keys, rows, hd, View::transposed(&p, keys), d_o, &mut dv_g, true);
                }
            }
            (dq_g, dk_g, dv_g)
        })
        .collect();
    for (bg, (dq_g, dk_g, dv_g)) in blocks.into_iter().enumerate() {
        let (b, g) = (bg / sh.kv_heads, bg % sh.kv_heads);
        for i in 0..tk {
            let kv_at = (b * tk + i) * sh.kv_heads * hd + g * hd;
            dk[kv_at..kv_at + hd].copy_from_slice(&dk_g[i * hd..(i + 1) * hd]);
            dv[kv_at..kv_at + hd].copy_from_slice(&dv_g[i * hd..(i + 1) * hd]);
        }
        for i in 0..t {
            for j in 0..groups {
                let q_at = (b * t + i) * sh.heads * hd + (g * groups + j) * hd;
                dq[q_at..q_at + hd].copy_from_slice(&dq_g[(j * t + i) * hd..][..hd]);
            }
        }
    }
}
