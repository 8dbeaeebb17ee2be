//! # The ops on a GPU: kernel launches and cuBLAS GEMMs
//!
//! One method of `Device` per op of `ops/mod.rs`, with the same arguments. Each allocates its outputs
//! on the GPU, takes the buffers' device addresses, and queues the launches `cuda/launch_table.rs`
//! describes (kernel, grid, arguments), or, for the three matrix products of a linear layer, one
//! cuBLAS `GemmEx` call: bf16 inputs with fp32 accumulation in mixed precision (the weight
//! gradient written straight into its fp32 buffer), f32 without TF32 in f32 mode. Nothing here
//! waits for the GPU.

use crate::cuda::device::{Buf, Data, Device};
use crate::cuda::launch_table::{self, Addr};
use crate::cuda::runtime::cuda_err;
use crate::ops::precision::Precision;
use crate::ops::tensor::Tensor;
use crate::ops::types::{AdamWSettings, Attn, DType, Rope, WIDE_HEAD_DIM};
use anyhow::{anyhow, bail, Result};
use cudarc::cublas::{result as blas, sys as blas_sys};
use std::sync::Arc;

/// One cuBLAS GEMM: column-major c[m, n] = op(a)[m, k] · op(b)[k, n] (op: transposed when `ta`,
/// `tb`), with leading dimensions lda, ldb, ldc.
///
/// cuBLAS is column-major, our matrices row-major. A row-major [r, c] matrix read column-major
/// *is* its transpose, [c, r] with leading dimension c. So each row-major product C = A·B is asked
/// as Cᵀ = Bᵀ·Aᵀ: swap the operands, and transpose where the row-major formula has none.
/// `tests/gemm_layout.rs` runs these shapes through a column-major reference GEMM on the CPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub ta: bool,
    pub tb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

impl Gemm {
    /// y[rows, out] = x[rows, inp] · w[out, inp]ᵀ, asked as yᵀ = w · xᵀ: a = w (transposed), b = x.
    pub fn linear(rows: usize, inp: usize, out: usize) -> Gemm {
        Gemm { ta: true, tb: false, m: out, n: rows, k: inp, lda: inp, ldb: inp, ldc: out }
    }

    /// dx[rows, inp] = dy[rows, out] · w[out, inp], asked as dxᵀ = wᵀ · dyᵀ: a = w, b = dy.
    pub fn input_grad(rows: usize, inp: usize, out: usize) -> Gemm {
        Gemm { ta: false, tb: false, m: inp, n: rows, k: out, lda: inp, ldb: out, ldc: inp }
    }

    /// dw[out, inp] += dy[rows, out]ᵀ · x[rows, inp], asked as dwᵀ = xᵀ · dy: a = x, b = dy
    /// (transposed).
    pub fn weight_grad(rows: usize, inp: usize, out: usize) -> Gemm {
        Gemm { ta: false, tb: true, m: inp, n: out, k: rows, lda: inp, ldb: out, ldc: inp }
    }
}

impl Device {
    /// An op's output of `shape` on this GPU, *not* zeroed: every op here writes each element of
    /// the outputs it makes (a memset per output would be wasted work, and the fake driver fills
    /// new memory with NaN so that a missed element shows in the tests).
    pub(crate) fn tensor(self: &Arc<Self>, shape: &[usize], dtype: DType) -> Tensor {
        Tensor::from_buf(shape, self.uninit(shape.iter().product(), dtype))
    }

    // GEMMs: the three products of a linear layer, each one cuBLAS call (shapes in `Gemm`).

    /// c = op(a) · op(b) (+ c when `accumulate`) as `g` describes, with fp32 accumulation.
    fn gemm(&self, g: Gemm, a: &Buf, b: &Buf, c: &Buf, accumulate: bool) -> Result<()> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let ty = |b: &Buf| if b.dtype() == DType::F32 { CUDA_R_32F } else { CUDA_R_16BF };
        let compute = match a.dtype() {
            DType::F32 => blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC, // no TF32
            DType::Bf16 => blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        if a.dtype() != b.dtype() {
            bail!(
                "GEMM of a {:?} and a {:?} matrix: the op layer multiplies matrices of one dtype",
                a.dtype(),
                b.dtype()
            );
        }
        if g.m == 0 || g.n == 0 {
            return Ok(()); // an empty product
        }
        if g.k == 0 {
            // a sum of nothing: zeros (or, accumulating, nothing to add)
            return match accumulate {
                true => Ok(()),
                // SAFETY: c is a live buffer of c.bytes() bytes, written in compute-stream order.
                false => unsafe {
                    cudarc::driver::result::memset_d8_async(c.addr(), 0, c.bytes(), self.gpu.compute.cu_stream())
                }
                .map_err(cuda_err),
            };
        }
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        self.gpu.ctx.bind_to_thread().map_err(cuda_err)?; // cuBLAS runs in the thread's current context
        let addr = |b: &Buf| b.addr() as *mut std::ffi::c_void;
        let i = |v: usize| v as i32;
        let name = || format!("cublas gemm {}x{}x{}", g.m, g.n, g.k);
        // SAFETY: the op layer checked the shapes: a, b and c hold the numbers their leading
        // dimensions describe (`Gemm`); alpha and beta are host f32 as the compute type wants.
        crate::cuda::profile::timed(name, &self.gpu.compute, || unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                op(g.ta),
                op(g.tb),
                i(g.m),
                i(g.n),
                i(g.k),
                &alpha as *const f32 as *const _,
                addr(a),
                ty(a),
                i(g.lda),
                addr(b),
                ty(b),
                i(g.ldb),
                &beta as *const f32 as *const _,
                addr(c),
                ty(c),
                i(g.ldc),
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
            .map_err(|e| anyhow!("cuBLAS GEMM {}×{}×{}: {e:?}", g.m, g.n, g.k))
        })?;
        self.gpu.checked(|| format!("cuBLAS GEMM {}×{}×{}", g.m, g.n, g.k))
    }

    /// y[m, n] = x[m, k] · w[n, k]ᵀ.
    pub fn linear(self: &Arc<Self>, x: &Tensor, w: &Tensor, p: Precision) -> Result<Tensor> {
        if p == Precision::Fp8 {
            return self.fp8_linear(x, w);
        }
        let y = self.tensor(&[x.rows(), w.shape()[0]], x.dtype());
        self.gemm(Gemm::linear(x.rows(), x.cols(), w.shape()[0]), buf(w), buf(x), buf(&y), false)?;
        Ok(y)
    }

    /// dx[m, k] = dy[m, n] · w[n, k].
    pub fn linear_input_grad(self: &Arc<Self>, dy: &Tensor, w: &Tensor, p: Precision) -> Result<Tensor> {
        if p == Precision::Fp8 {
            return self.fp8_input_grad(dy, w);
        }
        let dx = self.tensor(&[dy.rows(), w.cols()], dy.dtype());
        self.gemm(Gemm::input_grad(dy.rows(), w.cols(), w.shape()[0]), buf(w), buf(dy), buf(&dx), false)?;
        Ok(dx)
    }

    /// dx[m, k] += dy[m, n] · w[n, k]: cuBLAS adds the product to dx (β = 1), in fp32, rounding
    /// once.
    pub fn linear_input_grad_add(&self, dy: &Tensor, w: &Tensor, dx: &Tensor) -> Result<()> {
        self.gemm(Gemm::input_grad(dy.rows(), w.cols(), w.shape()[0]), buf(w), buf(dy), buf(dx), true)
    }

    /// dw[n, k] += dy[m, n]ᵀ · x[m, k], accumulated into the fp32 gradient.
    pub fn linear_weight_grad(self: &Arc<Self>, dy: &Tensor, x: &Tensor, dw: &Tensor, p: Precision) -> Result<()> {
        if p == Precision::Fp8 {
            return self.fp8_weight_grad(dy, x, dw);
        }
        self.gemm(Gemm::weight_grad(x.rows(), x.cols(), dw.shape()[0]), buf(x), buf(dy), buf(dw), true)
    }

    // -----------------------------------------------------------------------------------------
    // Kernels, one method per op of `ops/mod.rs`, same arguments; the launches are in `launch_table.rs`.

    pub fn embedding(self: &Arc<Self>, table: &Tensor, tokens: &[u32], first: usize) -> Result<Tensor> {
        let (dt, dim) = (table.dtype(), table.cols());
        let out = self.tensor(&[tokens.len(), dim], dt);
        let (ids, _keep) = self.index_addr(tokens)?;
        self.run(&launch_table::embedding(
            dt,
            (addr(table), table.rows()),
            (ids, tokens.len()),
            first,
            dim,
            addr(&out),
        ))?;
        Ok(out)
    }

    pub fn embedding_backward(&self, dout: &Tensor, tokens: &[u32], first: usize, dtable: &Tensor) -> Result<()> {
        let grouped = launch_table::tokens_by_id(tokens, first, dtable.rows());
        let (at, _keep) = self.index_addr(&grouped.packed)?;
        let grouped_at = (at, grouped.distinct);
        self.run(&launch_table::embedding_backward(
            dout.dtype(),
            addr(dout),
            grouped_at,
            dtable.cols(),
            f32_addr(dtable),
        ))
    }

    pub fn rmsnorm(self: &Arc<Self>, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        let (y, rstd) = (self.tensor(x.shape(), x.dtype()), self.tensor(&[x.rows()], DType::F32));
        let shape = (x.rows(), x.cols());
        self.run(&launch_table::rmsnorm(x.dtype(), addr(x), addr(w), eps, shape, addr(&y), addr(&rstd)))?;
        Ok((y, rstd))
    }

    /// x += add, then RMSNorm of x: one launch.
    pub fn add_rmsnorm(self: &Arc<Self>, x: &Tensor, add: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        if x.dtype() != add.dtype() {
            bail!("adding a {:?} tensor to a {:?} one", add.dtype(), x.dtype());
        }
        let (y, rstd) = (self.tensor(x.shape(), x.dtype()), self.tensor(&[x.rows()], DType::F32));
        let (shape, outputs) = ((x.rows(), x.cols()), (addr(&y), addr(&rstd)));
        self.run(&launch_table::add_rmsnorm(x.dtype(), (addr(x), addr(add)), addr(w), eps, shape, outputs))?;
        Ok((y, rstd))
    }

    /// dx (+ `residual`), and dw += the weight's gradient.
    pub fn rmsnorm_backward(
        self: &Arc<Self>,
        (dy, x, w, rstd): (&Tensor, &Tensor, &Tensor, &Tensor),
        dw: &Tensor,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (dx, shape) = (self.tensor(x.shape(), x.dtype()), (x.rows(), x.cols()));
        if residual.is_some_and(|r| r.dtype() != x.dtype()) {
            bail!("a {:?} residual gradient for a {:?} norm", residual.map(|r| r.dtype()), x.dtype());
        }
        let partial = self.tensor(&[launch_table::rmsnorm_partial_len(shape)], DType::F32);
        let inputs = (addr(dy), addr(x), addr(w), addr(rstd));
        let outputs = (addr(&dx), residual.map_or(0, addr));
        for l in launch_table::rmsnorm_backward(x.dtype(), inputs, shape, outputs, (f32_addr(dw), addr(&partial))) {
            self.run(&l)?;
        }
        Ok(dx)
    }

    pub fn rope(self: &Arc<Self>, x: &Tensor, positions: &[u32], rope: &Rope, inverse: bool) -> Result<()> {
        let table = self.rope_table(positions, rope)?;
        let shape = (x.rows(), x.cols() / rope.head_dim(), rope.head_dim());
        self.run(&launch_table::rope(x.dtype(), addr(x), (table.cos.f32_addr(), table.sin.f32_addr()), shape, inverse))
    }

    pub fn attention(
        self: &Arc<Self>,
        a: Attn,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        pos: (&[u32], &[u32]),
    ) -> Result<(Tensor, Tensor)> {
        check_head_dim(a)?;
        let (out, lse) = (self.tensor(q.shape(), q.dtype()), self.tensor(&[a.batch, a.heads, a.seq], DType::F32));
        let ((qp, _k1), (kp, _k2)) = (self.index_addr(pos.0)?, self.index_addr(pos.1)?);
        let qkv = (addr(q), addr(k), addr(v));
        self.run(&launch_table::attention::forward(q.dtype(), a, qkv, (qp, kp), addr(&out), addr(&lse)))?;
        Ok((out, lse))
    }

    pub fn attention_backward(
        self: &Arc<Self>,
        a: Attn,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        pos: (&[u32], &[u32]),
        (out, lse): (&Tensor, &Tensor),
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        check_head_dim(a)?;
        // δ and the backward's fp32 parts (`launch_table::attention::backward_scratch`)
        let scratch = self.tensor(&[launch_table::attention::backward_scratch(q.dtype(), a)], DType::F32);
        let (dq, dk, dv) =
            (self.tensor(q.shape(), q.dtype()), self.tensor(k.shape(), k.dtype()), self.tensor(v.shape(), v.dtype()));
        let ((qp, _k1), (kp, _k2)) = (self.index_addr(pos.0)?, self.index_addr(pos.1)?);
        let (qkv, grads) = ((addr(q), addr(k), addr(v)), (addr(&dq), addr(&dk), addr(&dv)));
        let saved = (addr(out), addr(lse), addr(dout));
        for l in launch_table::attention::backward(q.dtype(), a, qkv, (qp, kp), saved, addr(&scratch), grads) {
            self.run(&l)?;
        }
        Ok((dq, dk, dv))
    }

    pub fn attention_merge(&self, a: Attn, (out, lse): (&Tensor, &Tensor), block: (&Tensor, &Tensor)) -> Result<()> {
        self.run(&launch_table::attention::merge(
            out.dtype(),
            a,
            (addr(out), addr(lse)),
            (addr(block.0), addr(block.1)),
        ))
    }

    pub fn swiglu(self: &Arc<Self>, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let h = self.tensor(gate.shape(), gate.dtype());
        self.run(&launch_table::swiglu(gate.dtype(), (addr(gate), addr(up)), addr(&h), h.numel()))?;
        Ok(h)
    }

    pub fn swiglu_backward(self: &Arc<Self>, dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
        let (dg, du) = (self.tensor(gate.shape(), gate.dtype()), self.tensor(up.shape(), up.dtype()));
        let inputs = (addr(dh), addr(gate), addr(up));
        self.run(&launch_table::swiglu_backward(gate.dtype(), inputs, (addr(&dg), addr(&du)), dh.numel()))?;
        Ok((dg, du))
    }

    pub fn row_max(self: &Arc<Self>, logits: &Tensor) -> Result<Tensor> {
        let m = self.tensor(&[logits.rows()], DType::F32);
        self.run(&launch_table::row_max(logits.dtype(), addr(logits), (logits.rows(), logits.cols()), addr(&m)))?;
        Ok(m)
    }

    pub fn row_sum_exp(self: &Arc<Self>, logits: &Tensor, max: &Tensor) -> Result<Tensor> {
        let s = self.tensor(&[logits.rows()], DType::F32);
        let shape = (logits.rows(), logits.cols());
        self.run(&launch_table::row_sum_exp(logits.dtype(), addr(logits), shape, addr(max), addr(&s)))?;
        Ok(s)
    }

    pub fn log_sum_exp(self: &Arc<Self>, max: &Tensor, sum_exp: &Tensor) -> Result<Tensor> {
        let lse = self.tensor(max.shape(), DType::F32);
        self.run(&launch_table::log_sum_exp(addr(max), addr(sum_exp), addr(&lse), max.numel()))?;
        Ok(lse)
    }

    pub fn target_logits(self: &Arc<Self>, logits: &Tensor, targets: &[i32], first: usize) -> Result<Tensor> {
        let z = self.tensor(&[targets.len()], DType::F32);
        let (t, _keep) = self.index_addr(&target_bits(targets))?;
        let shape = (logits.rows(), logits.cols());
        self.run(&launch_table::target_logit(logits.dtype(), addr(logits), shape, t, first, addr(&z)))?;
        Ok(z)
    }

    pub fn add_loss(&self, loss: &Tensor, (lse, z): (&Tensor, &Tensor), targets: &[i32], scale: f32) -> Result<()> {
        let (t, _keep) = self.index_addr(&target_bits(targets))?;
        self.run(&launch_table::add_loss((f32_addr(lse), f32_addr(z), t), targets.len(), scale, f32_addr(loss)))
    }

    pub fn cross_entropy_backward(
        self: &Arc<Self>,
        logits: &Tensor,
        targets: &[i32],
        first: usize,
        lse: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        let d = self.tensor(logits.shape(), logits.dtype());
        let (t, _keep) = self.index_addr(&target_bits(targets))?;
        let (dt, shape) = (logits.dtype(), (logits.rows(), logits.cols()));
        self.run(&launch_table::cross_entropy_backward(
            dt,
            (addr(logits), t),
            first,
            (addr(lse), scale),
            shape,
            addr(&d),
        ))?;
        Ok(d)
    }

    pub fn add_assign(&self, a: &Tensor, b: &Tensor) -> Result<()> {
        if a.dtype() != b.dtype() {
            bail!("adding a {:?} tensor to a {:?} one", b.dtype(), a.dtype());
        }
        self.run(&launch_table::add_assign(a.dtype(), addr(a), addr(b), a.numel()))
    }

    /// dst[to..to + n] = src[from..from + n]: a device-to-device copy on the compute stream.
    pub fn copy(&self, src: &Tensor, from: usize, dst: &Tensor, to: usize, n: usize) -> Result<()> {
        if src.dtype() != dst.dtype() || matches!(buf(dst).data, Data::Mixed { .. }) {
            bail!("copying {:?} values into a {:?} tensor", src.dtype(), dst.dtype());
        }
        let size = if src.dtype() == DType::F32 { 4 } else { 2 };
        // both ranges lie inside live buffers: the op layer checked the bounds
        self.copy_bytes(addr(src) + (from * size) as Addr, addr(dst) + (to * size) as Addr, n * size)
    }

    /// `t` as a plain `dtype` tensor (from a mixed weight's master), converted on the GPU.
    pub fn convert(self: &Arc<Self>, t: &Tensor, dtype: DType) -> Result<Tensor> {
        let out = self.tensor(t.shape(), dtype);
        let n = t.numel();
        match (t.dtype(), dtype) {
            (DType::Bf16, DType::F32) if !matches!(buf(t).data, Data::Mixed { .. }) => {
                self.run(&launch_table::cast_bf16_to_f32(addr(t), addr(&out), n))?
            }
            (_, DType::Bf16) if !matches!(buf(t).data, Data::Bf16(_)) => {
                self.run(&launch_table::cast_f32_to_bf16(f32_addr(t), addr(&out), n))?
            }
            (_, DType::F32) => self.copy_bytes(f32_addr(t), addr(&out), 4 * n)?,
            (_, DType::Bf16) => self.copy_bytes(addr(t), addr(&out), 2 * n)?,
        }
        Ok(out)
    }

    /// `bytes` from `src` to `dst`, on the compute stream.
    pub(crate) fn copy_bytes(&self, src: Addr, dst: Addr, bytes: usize) -> Result<()> {
        // SAFETY: the callers pass ranges inside live buffers.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.gpu.compute.cu_stream()) }
            .map_err(cuda_err)
    }

    pub fn scale(&self, a: &Tensor, s: f32) -> Result<()> {
        self.run(&launch_table::scale(a.dtype(), addr(a), s, a.numel()))
    }

    /// Σ x² over all the f32 tensors, left on the GPU as a one-number tensor: a launch per 64
    /// tensors writes one partial sum per chunk of 4096 numbers into one buffer, then one block
    /// adds them all up in a fixed order.
    pub fn sum_squares_total(self: &Arc<Self>, ts: &[&Tensor]) -> Result<Tensor> {
        let xs: Vec<(Addr, usize)> = ts.iter().map(|t| (f32_addr(t), t.numel())).collect();
        let cols = launch_table::partial_sums(xs.iter().map(|x| x.1));
        let partial = self.tensor(&[cols.max(1)], DType::F32); // every slot is written
        for l in launch_table::sum_squares(&xs, f32_addr(&partial)) {
            self.run(&l)?;
        }
        let total = self.tensor(&[1], DType::F32);
        self.run(&launch_table::sum_rows(f32_addr(&partial), (1, cols), f32_addr(&total)))?;
        Ok(total)
    }

    /// Every f32 tensor of `ts` set to zero, a launch per 64 of them.
    pub fn fill_zeros(&self, ts: &[&Tensor]) -> Result<()> {
        let xs: Vec<(Addr, usize)> = ts.iter().map(|t| (f32_addr(t), t.numel())).collect();
        launch_table::fill_zeros(&xs).iter().try_for_each(|l| self.run(l))
    }

    /// One AdamW step of every parameter (its settings, fp32 master weight, gradient, moments),
    /// a launch per 64 of them; in mixed precision the same kernel writes each new bf16 copy.
    pub fn adamw(&self, steps: &[(AdamWSettings, &Tensor, &Tensor, &Tensor, &Tensor)]) -> Result<()> {
        let mut list = Vec::with_capacity(steps.len());
        for (o, p, g, m, v) in steps {
            if m.dtype() != o.moments || v.dtype() != o.moments {
                bail!("AdamW's moments are {:?} and {:?}, the optimizer keeps {:?}", m.dtype(), v.dtype(), o.moments);
            }
            let copy = matches!(buf(p).data, Data::Mixed { .. }).then(|| addr(p));
            list.push((*o, (f32_addr(p), f32_addr(g), addr(m), addr(v)), copy, p.numel()));
        }
        launch_table::adamw(&list).iter().try_for_each(|l| self.run(l))
    }
}

/// The GPU buffer of a tensor the op layer has already found on the GPU.
fn buf(t: &Tensor) -> &Buf {
    t.gpu().expect("the op layer checked that every tensor of the op is on the GPU")
}

/// The address the kernels read and write.
pub(crate) fn addr(t: &Tensor) -> Addr {
    buf(t).addr()
}

/// The address of the fp32 numbers (a gradient, a moment, a master weight).
fn f32_addr(t: &Tensor) -> Addr {
    buf(t).f32_addr()
}

/// Targets are `int` in the kernels: the same 32 bits.
fn target_bits(targets: &[i32]) -> Vec<u32> {
    targets.iter().map(|&t| t as u32).collect()
}

fn check_head_dim(a: Attn) -> Result<()> {
    let most = WIDE_HEAD_DIM;
    if a.head_dim > most {
        bail!("the CUDA attention kernels take heads up to {most} values wide, not {}: run on the CPU", a.head_dim);
    }
    Ok(())
}
