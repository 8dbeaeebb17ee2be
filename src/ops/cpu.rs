//! # CPU kernels: the f32 reference math
//!
//! Every op of the model, forward and backward side by side, on plain slices. This is the
//! reference that the CUDA kernels are tested against, so it favours clarity: one loop per
//! formula, rows in parallel with rayon, and sums that touch shared parameter gradients done in a
//! fixed order so that every run gives the same bits. Matrix products go through `matrixmultiply`,
//! a blocked, multithreaded SIMD GEMM.
//!
//! Layouts: activations are `[rows, features]` with `rows = batch * seq`; attention inputs keep
//! the Hugging Face layout `[rows, heads * head_dim]` (head-major inside a row).

use crate::ops::types::{AdamW, Attn};
use rayon::prelude::*;

/// A matrix view over a slice: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> View<'a> {
    /// A row-major `[rows, cols]` matrix.
    pub fn rows(data: &'a [f32], cols: usize) -> View<'a> {
        View { data, row_stride: cols, col_stride: 1 }
    }
    /// The transpose of a row-major `[rows, cols]` matrix, seen as `[cols, rows]`.
    pub fn transposed(data: &'a [f32], cols: usize) -> View<'a> {
        View { data, row_stride: 1, col_stride: cols }
    }
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            let last = (rows - 1) * self.row_stride + (cols - 1) * self.col_stride;
            assert!(last < self.data.len(), "matrix view out of bounds");
        }
    }
}

/// `c[m, n] = a[m, k] · b[k, n]`, or `c += a · b` when `accumulate`. `c` is row-major.
///
/// A large product is cut into blocks for the rayon threads, each a single-threaded
/// `matrixmultiply` call, so the whole CPU backend runs on one thread pool (GEMM threads and row
/// loops would otherwise take turns on the same cores). Each block packs its own copy of what it
/// reads, so the cut goes where the least is packed twice:
/// - a long sum (k larger than both sides of c, the weight gradients' sum over every token) is
///   cut along k into parts of `K_PART`, each into a buffer of its own, then added up in order;
/// - otherwise blocks of rows of c share (and re-pack) b, or blocks of columns share a,
///   whichever is smaller.
/// The cut depends on the shapes only, never on the number of threads, so neither do the bits.
pub fn gemm(m: usize, k: usize, n: usize, a: View, b: View, c: &mut [f32], accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    a.check(m, k);
    b.check(k, n);
    assert!(c.len() >= m * n, "gemm output too small");
    if k > m.max(n) && k >= 2 * K_PART {
        return gemm_long_sum(m, k, n, a, b, &mut c[..m * n], accumulate);
    }
    let threads = rayon::current_num_threads();
    let by_rows = m >= n; // re-packing b (k×n) costs less than re-packing a (m×k)
    let long = if by_rows { m } else { n };
    // below ~2 M multiply-adds (or 16 rows/columns a thread) a task costs more than it saves
    if threads == 1 || m * k * n < 2_000_000 || long < 16 * threads {
        return gemm_block(m, k, n, a, b, Out { c: c.as_mut_ptr(), row_stride: n }, accumulate);
    }
    let band = long.div_ceil(threads).next_multiple_of(8); // whole 8-wide kernel tiles
    let out = Out { c: c.as_mut_ptr(), row_stride: n };
    (0..long.div_ceil(band)).into_par_iter().for_each(|i| {
        let (first, len) = (i * band, band.min(long - i * band));
        if by_rows {
            let a = View { data: &a.data[first * a.row_stride..], ..a };
            gemm_block(len, k, n, a, b, out.at(first, 0), accumulate);
        } else {
            let b = View { data: &b.data[first * b.col_stride..], ..b };
            gemm_block(m, k, len, a, b, out.at(0, first), accumulate);
        }
    });
}

/// The length of the parts of a long sum (see `gemm`).
const K_PART: usize = 512;

/// `gemm` for a sum much longer than the output is wide: c (+)= Σ_parts a[:, part] · b[part, :].
fn gemm_long_sum(m: usize, k: usize, n: usize, a: View, b: View, c: &mut [f32], accumulate: bool) {
    let mut partial = vec![0.0; k.div_ceil(K_PART) * m * n];
    partial.par_chunks_mut(m * n).enumerate().for_each(|(p, part)| {
        let (first, len) = (p * K_PART, K_PART.min(k - p * K_PART));
        let a = View { data: &a.data[first * a.col_stride..], ..a };
        let b = View { data: &b.data[first * b.row_stride..], ..b };
        gemm_block(m, len, n, a, b, Out { c: part.as_mut_ptr(), row_stride: n }, false);
    });
    if !accumulate {
        c.fill(0.0);
    }
    for part in partial.chunks(m * n) {
        add_assign(c, part); // in the order of the parts: the same bits on any number of threads
    }
}

/// Where a block of `c` starts, and `c`'s row stride.
#[derive(Clone, Copy)]
struct Out {
    c: *mut f32,
    row_stride: usize,
}
// SAFETY: the blocks that `gemm` hands to its tasks cover disjoint elements of `c`.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    fn at(self, row: usize, col: usize) -> Out {
        // SAFETY: `gemm` asks only for blocks inside the m×n output.
        Out { c: unsafe { self.c.add(row * self.row_stride + col) }, ..self }
    }
}

fn gemm_block(m: usize, k: usize, n: usize, a: View, b: View, c: Out, accumulate: bool) {
    let beta = if accumulate { 1.0 } else { 0.0 };
    // SAFETY: the views were bounds-checked for the whole product, and this block lies inside it.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            a.row_stride as isize,
            a.col_stride as isize,
            b.data.as_ptr(),
            b.row_stride as isize,
            b.col_stride as isize,
            beta,
            c.c,
            c.row_stride as isize,
            1,
        );
    }
}

/// e^x in f32, written so that a loop over a slice compiles to SIMD (glibc's `expf` is a call per
/// element, and the softmaxes, the cross-entropy and SiLU take ~10% of a CPU step in it).
/// x = n·ln2 + r with n an integer and |r| ≤ ln2/2, so e^x = 2ⁿ · e^r: e^r is its Taylor series to
/// r⁶/720 (relative error below 2·10⁻⁷, about one f32 ulp) and 2ⁿ is put straight into the
/// exponent bits. Below −87 the result is 0 (e^−87 is at the edge of normal f32), above 88 it
/// saturates at e^88; −∞ gives 0 as the softmaxes need.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const SHIFTER: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer in the low bits
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * std::f32::consts::LOG2_E + SHIFTER;
    let n = t - SHIFTER;
    // ln2 in two parts, so that n·ln2 is exact enough: r = x − n·ln2 loses no bits
    let r = xc - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let two_n = f32::from_bits((t.to_bits().wrapping_sub(SHIFTER.to_bits()).wrapping_add(127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else {
        p * two_n
    }
}

/// Σ x over a row in eight interleaved partial sums, added together at the end. One running sum
/// is a chain of dependent additions that the compiler may not reorder (that would change the
/// rounding); eight lanes are one SIMD register and a few cycles per eight elements.
pub fn sum8(x: &[f32]) -> f32 {
    sum8_of(x, |v| v)
}

/// Σ f(x) over a row, in eight lanes as `sum8`.
#[inline(always)]
pub fn sum8_of(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for c in chunks {
        lanes.iter_mut().zip(c).for_each(|(l, &v)| *l += f(v));
    }
    lanes.iter().sum::<f32>() + tail
}

/// Σ a·b, in eight lanes as `sum8`.
pub fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(a, b)| a * b).sum();
    for (a, b) in ca.zip(cb) {
        lanes.iter_mut().zip(a.iter().zip(b)).for_each(|(l, (a, b))| *l += a * b);
    }
    lanes.iter().sum::<f32>() + tail
}

/// The largest element (−∞ for an empty row), in eight lanes as `sum8`.
pub fn max8(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for c in chunks {
        lanes.iter_mut().zip(c).for_each(|(l, &v)| *l = if v > *l { v } else { *l });
    }
    lanes.iter().fold(tail, |m, &v| if v > m { v } else { m })
}

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
// (x1·cos − x2·sin, x2·cos + x1·sin) with angle pos · theta^(−2i/head_dim), i < head_dim/2.
// The backward is the rotation by −angle.

pub fn rope(x: &mut [f32], positions: &[u32], heads: usize, head_dim: usize, theta: f64, inverse: bool) {
    let half = head_dim / 2;
    let inv_freq: Vec<f64> = (0..half).map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64)).collect();
    let sign = if inverse { -1.0 } else { 1.0 };
    // (sin, cos) once per distinct position: every sequence of a batch repeats the same ones
    let mut distinct = positions.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let table: Vec<(f32, f32)> = distinct
        .iter()
        .flat_map(|&pos| inv_freq.iter().map(move |f| (pos as f64 * f).sin_cos()))
        .map(|(s, c)| (sign * s as f32, c as f32))
        .collect();
    x.par_chunks_mut(heads * head_dim).zip(positions.par_iter()).for_each(|(row, pos)| {
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

// ---------------------------------------------------------------------------------------------
// Causal attention with grouped-query attention. Query head h reads KV head h / (heads / kv_heads).
// Per (sequence, head): S = Q Kᵀ · scale, masked where the key's position is after the query's,
// P = softmax(S), O = P V. The forward keeps only the log-sum-exp of each row (lse); the backward
// rebuilds P = exp(S − lse), as flash attention does, so no T×T matrix is kept between forward
// and backward. Queries and keys carry their positions in the sequence, so the same kernels
// compute one block of ring attention (a query chunk against another rank's key chunk): a row
// that sees no key of the block gets output 0 and lse −∞, and the backward takes the lse and
// output of the whole row, merged over all blocks.
//
// The queries go in tiles of QUERY_TILE rows, and a tile stops at the last key that one of its
// queries can see: in causal attention the keys past the diagonal are skipped, which saves
// nearly half of the products and exponentials (PyTorch's CPU flash attention does the same).

const QUERY_TILE: usize = 32;

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
    fn scores(&self, q: &[f32], k: &[f32], (b, h): (usize, usize), (i, rows, keys): (usize, usize, usize), pos: (&[u32], &[u32])) -> Vec<f32> {
        let g = h / (self.heads / self.kv_heads);
        let mut s = vec![0.0; rows * keys];
        gemm(rows, self.head_dim, keys, self.q_view(q, b, h, i), self.kv_view_t(k, b, g), &mut s, false);
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
                    let mut ds = vec![0.0; rows * keys];
                    gemm(rows, hd, keys, d_o, sh.kv_view_t(v, b, g), &mut ds, false);
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

/// The log-sum-exp merge of two partial attentions of the same queries (see `ops::attention_merge`).
pub fn attention_merge(sh: &Attn, out: &mut [f32], lse: &mut [f32], block_out: &[f32], block_lse: &[f32]) {
    let (t, hd) = (sh.seq, sh.head_dim);
    for (bh, (l, &bl)) in lse.iter_mut().zip(block_lse).enumerate() {
        if bl == f32::NEG_INFINITY {
            continue; // the block adds nothing to this row
        }
        let (b, h, i) = (bh / (sh.heads * t), bh / t % sh.heads, bh % t);
        let merged = if *l == f32::NEG_INFINITY { bl } else { l.max(bl) + (-(*l - bl).abs()).exp().ln_1p() };
        let (keep, add) = ((*l - merged).exp(), (bl - merged).exp());
        let at = (b * t + i) * sh.heads * hd + h * hd;
        for (o, &x) in out[at..at + hd].iter_mut().zip(&block_out[at..at + hd]) {
            *o = *o * keep + x * add;
        }
        *l = merged;
    }
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
    dgate.par_chunks_mut(CHUNK).zip(dup.par_chunks_mut(CHUNK)).zip(inputs).for_each(|((dgate, dup), (dh, (gate, up)))| {
        for (((dg, du), &d), (&g, &u)) in dgate.iter_mut().zip(dup).zip(dh).zip(gate.iter().zip(up)) {
            let s = sigmoid(g);
            *du = d * g * s;
            *dg = d * u * s * (1.0 + g * (1.0 - s));
        }
    });
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
pub fn adamw(o: &AdamW, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let c1 = 1.0 - o.beta1.powi(o.step as i32);
    let c2 = 1.0 - o.beta2.powi(o.step as i32);
    let state = m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK));
    p.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(state).for_each(|((p, g), (m, v))| {
        for ((p, &g), (m, v)) in p.iter_mut().zip(g).zip(m.iter_mut().zip(v)) {
            *m = o.beta1 * *m + (1.0 - o.beta1) * g;
            *v = o.beta2 * *v + (1.0 - o.beta2) * g * g;
            *p -= o.lr * o.weight_decay * *p;
            *p -= o.lr * (*m / c1) / ((*v / c2).sqrt() + o.eps);
        }
    });
}
