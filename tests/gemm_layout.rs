//! The cuBLAS calls of the CUDA backend, checked without a GPU: each `Gemm` shape of
//! `src/ops/gpu.rs` (transposes, m/n/k, leading dimensions) is run through a column-major GEMM
//! written here exactly as cuBLAS defines it, on the row-major buffers the backend hands over,
//! and must give the CPU op layer's linear, input gradient and weight gradient.

use ferrotron::ops::gpu::Gemm;
use ferrotron::ops::tensor::Tensor;
use ferrotron::ops::{self, Precision};

/// cuBLAS's GEMM: c[i + j·ldc] = Σ_l op(a)(i, l) · op(b)(l, j) (+ c), column-major, where a
/// stored matrix x has x(i, j) = x[i + j·ld] and op transposes it when asked.
fn cublas_reference(g: Gemm, a: &[f32], b: &[f32], c: &mut [f32], accumulate: bool) {
    let at = |i: usize, l: usize| if g.ta { a[l + i * g.lda] } else { a[i + l * g.lda] };
    let bt = |l: usize, j: usize| if g.tb { b[j + l * g.ldb] } else { b[l + j * g.ldb] };
    for i in 0..g.m {
        for j in 0..g.n {
            let sum: f32 = (0..g.k).map(|l| at(i, l) * bt(l, j)).sum();
            let out = &mut c[i + j * g.ldc];
            *out = sum + if accumulate { *out } else { 0.0 };
        }
    }
}

fn rand(seed: u64, shape: &[usize]) -> Tensor {
    ferrotron::model::init::normal(seed, "gemm layout", shape, 1.0)
}

fn close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
    }
}

#[test]
fn the_three_linear_gemms_give_the_row_major_products() {
    for (rows, inp, out) in [(5, 7, 3), (1, 4, 9), (16, 32, 8), (3, 1, 2)] {
        let (x, w, dy, dw0) =
            (rand(1, &[rows, inp]), rand(2, &[out, inp]), rand(3, &[rows, out]), rand(4, &[out, inp]));
        // y = x · wᵀ: a = w, b = x
        let mut y = vec![0.0; rows * out];
        cublas_reference(Gemm::linear(rows, inp, out), &w.to_vec(), &x.to_vec(), &mut y, false);
        close(&y, &ops::linear(&x, &w, Precision::F32).to_vec());
        // dx = dy · w: a = w, b = dy
        let mut dx = vec![0.0; rows * inp];
        cublas_reference(Gemm::input_grad(rows, inp, out), &w.to_vec(), &dy.to_vec(), &mut dx, false);
        close(&dx, &ops::linear_input_grad(&dy, &w, Precision::F32).to_vec());
        // dw += dyᵀ · x: a = x, b = dy, accumulating into what dw holds
        let mut dw = dw0.to_vec();
        cublas_reference(Gemm::weight_grad(rows, inp, out), &x.to_vec(), &dy.to_vec(), &mut dw, true);
        let mut want = dw0.clone();
        ops::linear_weight_grad(&dy, &x, &mut want, Precision::F32);
        close(&dw, &want.to_vec());
    }
}
