//! # FP8 GEMMs on the GPU: two cast kernels per operand and one cuBLASLt call
//!
//! The math is `ops/fp8.rs`'s; this is where it runs. Each operand is cast by `kernels/fp8.cu`
//! (its amax, then its bytes and 1/scale, both on the GPU: no host wait), and one
//! `cublasLtMatmul` multiplies the bytes in the FP8 tensor cores, summing in f32, multiplying the
//! sums by the two 1/scales it is pointed at (`A_SCALE_POINTER`, `B_SCALE_POINTER`), and writing
//! bf16 (y, dx) or adding into the fp32 gradient (dW, with beta = 1).
//!
//! Hopper's FP8 GEMMs take one layout only, "TN": both operands with the summed index k
//! contiguous. In our row-major terms: y[r, c] = Σ_k b[r, k] · a[c, k].
//!
//! ```text
//! GEMM                       r      c     k      a (row-major [c, k])   b (row-major [r, k])
//! y  = x · Wᵀ               rows   out   in      W          as it is    x          as it is
//! dx = dy · W               rows   in    out     Wᵀ         transposed  dy         as it is
//! dW += dyᵀ · x             out    in    rows    xᵀ         transposed  dyᵀ        transposed
//! ```
//! so the cast kernel writes W, x or dy transposed where the table says. cuBLASLt also asks the
//! summed length k and c to be multiples of 16: the cast pads each operand's rows with zeros to a
//! multiple of 16 (which adds nothing to the sums: a micro-batch's or an expert's rows may be any
//! number), and the config check asks it of every layer's features. Not yet done here, as
//! TransformerEngine does: casting x once for forward and keeping its FP8 bytes (half of bf16's)
//! for backward; fusing the transposed cast into one pass.

use crate::cuda::device::{BlasLt, Device};
use crate::cuda::launch_table::{self, Addr, NORM_BLOCKS};
use crate::cuda::runtime::cuda_err;
use crate::ops::fp8::Fp8;
use crate::ops::gpu::addr;
use crate::ops::tensor::Tensor;
use crate::ops::types::{DType, Precision};
use crate::ops::wire::slots;
use anyhow::{anyhow, bail, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::ffi::c_void;
use std::sync::Arc;

/// Bytes of workspace cuBLASLt may use per GEMM.
const WORKSPACE: usize = 32 << 20;

/// One operand cast to FP8 on the GPU: `[rows, k16]` bytes, k contiguous and zero-padded to a
/// multiple of 16, and its 1/scale.
struct Operand {
    bytes: CudaSlice<u8>,
    inverse_scale: CudaSlice<f32>,
    format: Fp8,
}

impl Device {
    /// y[rows, out] = x · Wᵀ in FP8 (E4M3 × E4M3), written in bf16.
    pub(crate) fn fp8_linear(self: &Arc<Self>, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (rows, inp, out) = (x.rows(), x.cols(), w.shape()[0]);
        let (a, b) = (self.fp8_operand(w, false, Fp8::E4M3, inp)?, self.fp8_operand(x, false, Fp8::E4M3, inp)?);
        let y = self.tensor(&[rows, out], DType::Bf16);
        self.fp8_gemm((&a, &b), (rows, out, inp), (addr(&y), DType::Bf16), false)?;
        Ok(y)
    }

    /// dx[rows, in] = dy · W in FP8 (E5M2 × E4M3), written in bf16.
    pub(crate) fn fp8_input_grad(self: &Arc<Self>, dy: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (rows, out, inp) = (dy.rows(), w.shape()[0], w.cols());
        let (a, b) = (self.fp8_operand(w, true, Fp8::E4M3, out)?, self.fp8_operand(dy, false, Fp8::E5M2, out)?);
        let dx = self.tensor(&[rows, inp], DType::Bf16);
        self.fp8_gemm((&a, &b), (rows, inp, out), (addr(&dx), DType::Bf16), false)?;
        Ok(dx)
    }

    /// dW[out, in] += dyᵀ · x in FP8 (E5M2 × E4M3), into the fp32 gradient.
    pub(crate) fn fp8_weight_grad(self: &Arc<Self>, dy: &Tensor, x: &Tensor, dw: &Tensor) -> Result<()> {
        let (rows, out, inp) = (x.rows(), dw.shape()[0], x.cols());
        let (a, b) = (self.fp8_operand(x, true, Fp8::E4M3, rows)?, self.fp8_operand(dy, true, Fp8::E5M2, rows)?);
        self.fp8_gemm((&a, &b), (out, inp, rows), (dw.gpu().expect("on the GPU").f32_addr(), DType::F32), true)
    }

    /// `t` cast to `format` with current scaling (transposed: `[cols, rows]`), its rows (k long)
    /// padded with zeros to a multiple of 16: two launches, and a memset where padded.
    fn fp8_operand(self: &Arc<Self>, t: &Tensor, transposed: bool, format: Fp8, k: usize) -> Result<Operand> {
        let s = &self.gpu.compute;
        let (n, ld) = (t.numel(), k.next_multiple_of(16));
        let size = n / k.max(1) * ld;
        // SAFETY: the kernels write every byte and the scale before anything reads them.
        let (partial, bytes, inverse_scale) = unsafe {
            (
                s.alloc_zeros::<f32>(NORM_BLOCKS).map_err(cuda_err)?, // fp8_amax may fill fewer
                s.alloc::<u8>(size.max(1)).map_err(cuda_err)?,
                s.alloc::<f32>(1).map_err(cuda_err)?,
            )
        };
        let (partial_at, bytes_at, scale_at) =
            (partial.device_ptr(s).0, bytes.device_ptr(s).0, inverse_scale.device_ptr(s).0);
        if ld != k {
            // SAFETY: the buffer holds `size` bytes, written in compute-stream order.
            unsafe { cudarc::driver::result::memset_d8_async(bytes_at, 0, size, s.cu_stream()) }.map_err(cuda_err)?;
        }
        let dt = t.dtype();
        self.run(&launch_table::fp8_amax(dt, addr(t), n, partial_at))?;
        let (x, e5m2) = ((addr(t), t.rows(), t.cols(), ld), format == Fp8::E5M2);
        self.run(&launch_table::fp8_cast(dt, x, transposed, e5m2, partial_at, (bytes_at, scale_at)))?;
        Ok(Operand { bytes, inverse_scale, format })
    }

    /// Row-major y[r, c] = Σ_k b[r, k] · a[c, k] / (s_a · s_b) (+ y when `accumulate`): cuBLASLt's
    /// column-major D[c, r] = op(A)ᵀ[c, k] · B[k, r] with A = a and B = b read as they lie.
    fn fp8_gemm(
        &self,
        (a, b): (&Operand, &Operand),
        (r, c, k): (usize, usize, usize),
        (y, y_dt): (Addr, DType),
        accumulate: bool,
    ) -> Result<()> {
        if r == 0 || c == 0 {
            return Ok(());
        }
        if c % 16 != 0 {
            bail!("FP8 GEMM of {c} output features: cuBLASLt's FP8 GEMMs need a multiple of 16 (the config check asks it of every linear layer); use device.dtype = \"bf16\"");
        }
        let s = &self.gpu.compute;
        if k == 0 {
            // a sum of nothing (an expert no row was routed to): zeros, or nothing to add
            let bytes = r * c * if y_dt == DType::F32 { 4 } else { 2 };
            // SAFETY: y holds r × c numbers of y_dt, written in compute-stream order.
            let zero = || unsafe { cudarc::driver::result::memset_d8_async(y, 0, bytes, s.cu_stream()) };
            return if accumulate { Ok(()) } else { zero().map_err(cuda_err) };
        }
        let k = k.next_multiple_of(16); // the operands' padded rows
        let lt = self.blas_lt()?;
        let ty = |f: Fp8| match f {
            Fp8::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
            Fp8::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
        };
        let out_ty = if y_dt == DType::F32 { sys::cudaDataType::CUDA_R_32F } else { sys::cudaDataType::CUDA_R_16BF };
        let blas = |e: lt::CublasError| anyhow!("cuBLASLt FP8 GEMM ({r}×{c}, k {k}): {e:?}");
        let mut d = Descriptors { desc: None, layouts: Vec::new(), pref: None };
        d.desc = Some(
            lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
                .map_err(blas)?,
        );
        for (t, rows, cols) in [(ty(a.format), k, c), (ty(b.format), k, r), (out_ty, c, r)] {
            d.layouts.push(lt::create_matrix_layout(t, rows as u64, cols as u64, rows as i64).map_err(blas)?);
        }
        d.pref = Some(lt::create_matmul_pref().map_err(blas)?);
        let (desc, pref, [la, lb, ld]) = (d.desc.unwrap(), d.pref.unwrap(), [d.layouts[0], d.layouts[1], d.layouts[2]]);
        let (scale_a, scale_b) = (a.inverse_scale.device_ptr(s).0, b.inverse_scale.device_ptr(s).0);
        let transposed = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        // SAFETY: each attribute's value is the type cuBLASLt documents for it, alive for the call;
        // the buffers hold what the layouts describe.
        unsafe {
            let set = |attr, v: *const c_void, size| lt::set_matmul_desc_attribute(desc, attr, v, size).map_err(blas);
            use sys::cublasLtMatmulDescAttributes_t as A;
            set(A::CUBLASLT_MATMUL_DESC_TRANSA, &transposed as *const _ as *const c_void, 4)?;
            set(A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, (&scale_a as *const u64).cast(), 8)?;
            set(A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, (&scale_b as *const u64).cast(), 8)?;
            let limit = WORKSPACE as u64;
            let attr = sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES;
            lt::set_matmul_pref_attribute(pref, attr, (&limit as *const u64).cast(), 8).map_err(blas)?;
            let heuristic = lt::get_matmul_algo_heuristic(lt.handle, desc, la, lb, ld, ld, pref).map_err(blas)?;
            let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
            let (pa, pb) = (a.bytes.device_ptr(s).0 as *const c_void, b.bytes.device_ptr(s).0 as *const c_void);
            let work = lt.workspace.device_ptr(s).0 as *mut c_void;
            let (alpha, beta) = ((&alpha as *const f32).cast(), (&beta as *const f32).cast());
            let stream = s.cu_stream() as sys::cudaStream_t;
            lt::matmul(
                lt.handle,
                desc,
                alpha,
                beta,
                pa,
                la,
                pb,
                lb,
                y as _,
                ld,
                y as _,
                ld,
                &heuristic.algo,
                work,
                WORKSPACE,
                stream,
            )
            .map_err(blas)?;
        }
        self.gpu.checked(|| "cuBLASLt FP8 GEMM".into())
    }

    // The wire formats of a gathered weight (`ops/wire.rs`): f32 slots holding f32, bf16 pairs or
    // FP8 quads.

    /// The largest |x| of each of NORM_BLOCKS slices of `t`.
    pub(crate) fn abs_max(self: &Arc<Self>, t: &Tensor) -> Result<Tensor> {
        let out = Tensor::from_buf(&[NORM_BLOCKS], self.zeros(NORM_BLOCKS, DType::F32)); // fp8_amax may fill fewer
        self.run(&launch_table::fp8_amax(t.dtype(), addr(t), t.numel(), addr(&out)))?;
        Ok(out)
    }

    /// `t` packed into f32 slots in `wire` format (the bytes of a slot its numbers').
    pub(crate) fn pack(self: &Arc<Self>, t: &Tensor, wire: Precision, amax: Option<&Tensor>) -> Result<Tensor> {
        let (n, dt) = (t.numel(), t.dtype());
        let out = self.tensor(&[slots(n, wire)], DType::F32);
        let (from, to) = (addr(t), addr(&out));
        match (wire, dt) {
            (Precision::Fp8, _) => {
                let amax = addr(amax.ok_or_else(|| anyhow!("an FP8 weight packed without its maxima"))?);
                self.run(&launch_table::fp8_cast(dt, (from, 1, n, n), false, false, amax, (to, 0)))?
            }
            (Precision::F32, DType::F32) => self.copy_bytes(from, to, 4 * n)?,
            (Precision::F32, DType::Bf16) => self.run(&launch_table::cast_bf16_to_f32(from, to, n))?,
            (Precision::Bf16, DType::F32) => self.run(&launch_table::cast_f32_to_bf16(from, to, n))?,
            (Precision::Bf16, DType::Bf16) => self.copy_bytes(from, to, 2 * n)?,
        }
        Ok(out)
    }

    /// The `n` numbers packed from slot `at` of `packed`, in the compute dtype (f32 for f32).
    pub(crate) fn unpack(
        self: &Arc<Self>,
        packed: &Tensor,
        at: usize,
        n: usize,
        wire: Precision,
        amax: Option<&Tensor>,
    ) -> Result<Tensor> {
        let from = addr(packed) + 4 * at as Addr;
        let dt = if wire == Precision::F32 { DType::F32 } else { self.dtype };
        let out = self.tensor(&[n], dt);
        match wire {
            Precision::F32 => self.copy_bytes(from, addr(&out), 4 * n)?,
            Precision::Bf16 if dt == DType::Bf16 => self.copy_bytes(from, addr(&out), 2 * n)?,
            Precision::Bf16 => bail!("a bf16 wire format on a GPU computing in f32"),
            Precision::Fp8 => {
                let amax = addr(amax.ok_or_else(|| anyhow!("an FP8 weight unpacked without its maxima"))?);
                self.run(&launch_table::fp8_decode(dt, (from, n), amax, addr(&out)))?
            }
        }
        Ok(out)
    }

    /// The device's cuBLASLt handle and workspace, opened at the first FP8 GEMM; FP8 tensor
    /// cores need compute capability 8.9 (Ada) or 9.0 (Hopper) and newer.
    fn blas_lt(&self) -> Result<&BlasLt> {
        if let Some(lt) = self.lt.get() {
            return Ok(lt);
        }
        let (major, minor) = self.gpu.ctx.compute_capability().map_err(cuda_err)?;
        if (major, minor) < (8, 9) {
            bail!("device.dtype = \"fp8\" on a GPU of compute capability {major}.{minor}: FP8 tensor cores need 8.9 (Ada) or newer; use device.dtype = \"bf16\"");
        }
        crate::cuda::runtime::require("cuBLASLt")?;
        let handle = lt::create_handle().map_err(|e| anyhow!("cuBLASLt cannot start: {e:?}"))?;
        // SAFETY: cuBLASLt only writes scratch into the workspace.
        let workspace = unsafe { self.gpu.compute.alloc::<u8>(WORKSPACE) }.map_err(cuda_err)?;
        Ok(self.lt.get_or_init(|| BlasLt { handle, workspace }))
    }
}

/// The descriptors of one cuBLASLt call, destroyed when it is done (or fails).
struct Descriptors {
    desc: Option<sys::cublasLtMatmulDesc_t>,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: Option<sys::cublasLtMatmulPreference_t>,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was made by cuBLASLt and is destroyed once, here.
        unsafe {
            if let Some(d) = self.desc {
                let _ = lt::destroy_matmul_desc(d);
            }
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
        }
    }
}
