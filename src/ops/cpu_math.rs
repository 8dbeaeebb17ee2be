//! # The CPU's building blocks, written for speed
//!
//! What the CPU kernels (`ops/cpu.rs`, `ops/cpu_attention.rs`) are made of where the obvious
//! code is several times slower: matrix products through `matrixmultiply` (blocked SIMD
//! kernels), cut into one block per thread of the one rayon pool; `exp` as arithmetic that a loop
//! turns into SIMD instead of a libm call per element; row sums, dot products and maxima in eight
//! lanes instead of one chain of dependent additions. `tests/cpu_math.rs` checks each against the
//! obvious code.

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
///   cut along k into parts of `K_PART`: the first into c, each other into a buffer of its own,
///   then added to c in order;
/// - otherwise blocks of rows of c share (and re-pack) b, or blocks of columns share a,
///   whichever is smaller.
///
/// Neither cut changes a bit: a block of rows or columns sums each element over k exactly as the
/// whole product would, and the parts of a long sum are fixed by the shapes, not by the threads.
pub fn gemm(m: usize, k: usize, n: usize, a: View, b: View, c: &mut [f32], accumulate: bool) {
    assert!(c.len() >= m * n, "gemm output too small");
    gemm_out(m, k, n, a, b, Out { c: c.as_mut_ptr(), row_stride: n }, accumulate);
}

/// The f32 rate this machine's `gemm` reaches on a square product of 1024 (every thread of the
/// pool), in TFLOP/s: the best of three after one to warm up. The CPU's peak for MFU
/// (`devices.rs`), measured once a machine.
pub fn peak_tflops() -> f64 {
    let n = 1024;
    let (a, b) = (vec![0.5f32; n * n], vec![0.25f32; n * n]);
    let mut c = vec![0.0f32; n * n];
    let mut best = f64::MAX;
    for i in 0..4 {
        let start = std::time::Instant::now();
        gemm(n, n, n, View::rows(&a, n), View::rows(&b, n), &mut c, false);
        let s = start.elapsed().as_secs_f64();
        if i > 0 {
            best = best.min(s);
        }
    }
    2.0 * (n * n * n) as f64 / best.max(1e-9) / 1e12
}

/// `a[m, k] · b[k, n]` in a new row-major buffer. The buffer is not zeroed first: with nothing
/// to add to, the product writes every element without reading any (a memset of the output
/// was ~3% of a step).
pub fn product(m: usize, k: usize, n: usize, a: View, b: View) -> Vec<f32> {
    let mut c = Vec::with_capacity(m * n);
    gemm_out(m, k, n, a, b, Out { c: c.spare_capacity_mut().as_mut_ptr().cast(), row_stride: n }, false);
    // SAFETY: not accumulating, `gemm_out` wrote all m·n elements (matrixmultiply with β = 0
    // writes C without reading it, zeros when k = 0).
    unsafe { c.set_len(m * n) };
    c
}

/// `gemm` into `out`, m×n, which holds numbers if `accumulate` and may be uninitialised if not.
fn gemm_out(m: usize, k: usize, n: usize, a: View, b: View, out: Out, accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    a.check(m, k);
    b.check(k, n);
    if k > m.max(n) && k >= 2 * K_PART {
        return gemm_long_sum(m, k, n, a, b, out, accumulate);
    }
    let threads = rayon::current_num_threads();
    let by_rows = m >= n; // re-packing b (k×n) costs less than re-packing a (m×k)
    let long = if by_rows { m } else { n };
    // below ~2 M multiply-adds (or 16 rows/columns a thread) a task costs more than it saves
    if threads == 1 || m * k * n < 2_000_000 || long < 16 * threads {
        return gemm_block(m, k, n, a, b, out, accumulate);
    }
    let band = long.div_ceil(threads).next_multiple_of(8); // whole 8-wide kernel tiles
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
/// The first part goes straight into c, the others into buffers of their own (all at once, one
/// task each), which are then added to c in order.
fn gemm_long_sum(m: usize, k: usize, n: usize, a: View, b: View, c: Out, accumulate: bool) {
    let parts = k.div_ceil(K_PART);
    let mut rest: Vec<f32> = Vec::with_capacity((parts - 1) * m * n);
    let rest_out = Out { c: rest.spare_capacity_mut().as_mut_ptr().cast(), row_stride: n };
    (0..parts).into_par_iter().for_each(|p| {
        let (first, len) = (p * K_PART, K_PART.min(k - p * K_PART));
        let a = View { data: &a.data[first * a.col_stride..], ..a };
        let b = View { data: &b.data[first * b.row_stride..], ..b };
        match p {
            0 => gemm_block(m, len, n, a, b, c, accumulate),
            _ => gemm_block(m, len, n, a, b, rest_out.at((p - 1) * m, 0), false),
        }
    });
    // SAFETY: each part after the first wrote its m·n numbers (β = 0), and the first wrote c's.
    let c = unsafe {
        rest.set_len((parts - 1) * m * n);
        std::slice::from_raw_parts_mut(c.c, m * n)
    };
    // the parts in order, whatever thread computed them: the same bits on any number of threads
    c.par_chunks_mut(4096).enumerate().for_each(|(i, c)| {
        for part in rest.chunks(m * n) {
            c.iter_mut().zip(&part[i * 4096..]).for_each(|(c, p)| *c += p);
        }
    });
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
/// element: the softmaxes, the cross-entropy and SiLU spent ~10% of a CPU step in it).
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
    let two_n = f32::from_bits(t.to_bits().wrapping_sub(SHIFTER.to_bits()).wrapping_add(127) << 23);
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
