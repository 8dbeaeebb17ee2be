//! # FP8 GEMMs on the GPU: each tensor cast once, one cuBLASLt call a GEMM
//!
//! The math is `ops/fp8.rs`'s; this is where it runs. A tensor that a GEMM reads in FP8 is cast
//! by `kernels/fp8.cu` (its amax, then its bytes and 1/scale, both on the GPU: no host wait), and
//! one `cublasLtMatmul` multiplies the bytes in the FP8 tensor cores, summing in f32, multiplying
//! the sums by the two 1/scales it is pointed at (`A_SCALE_POINTER`, `B_SCALE_POINTER`), and
//! writing bf16 (y, dx) or adding into the fp32 gradient (dW, with beta = 1).
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
//! Every one of x, W and dy is read both ways, so the cast writes both at once (`Fp8Copy`: `rows`
//! as it is, `columns` transposed), each padded with zeros to a multiple of 16 along k, as
//! cuBLASLt asks (zeros add nothing to the sums; a micro-batch's or an expert's rows may be any
//! number; the config check asks it of every layer's features).
//!
//! **Cast once, keep the copy.** The copy stays with the tensor (`Buf::derived`) until the tensor
//! is written (`Tensor::written`, which every in-place op and collective calls): a weight is cast
//! at its first GEMM after the optimizer wrote it, then read by every micro-batch's forward and
//! backward; an input x by its forward GEMMs (q, k and v read the same x: one cast) and again by
//! dW; an output gradient dy by dx and then by dW (zero bubble's W pass included). The copy costs
//! 2 bytes a number for as long as the tensor lives: for a saved activation, until its backward.
//! `FERROTRON_CHECK_CASTS=1` casts again at every reuse and stops the run if the bytes differ (a
//! write that did not pass `written`): the fake-GPU tests run with it.
//!
//! **Plan once.** cuBLASLt's heuristic picks an algorithm from the shape and types alone, so it is
//! asked once a shape: each shape's descriptors and algorithm are kept (`LtPlan`), and only the
//! two scale pointers change from call to call (a step of a model meets a handful of shapes).

use crate::cuda::device::{BlasLt, Bytes, Device, LtPlan, LtShape};
use crate::cuda::launch_table::{self, amax_blocks, Addr, AMAX_BLOCKS, NORM_BLOCKS};
use crate::cuda::runtime::cuda_err;
use crate::ops::fp8::Fp8;
use crate::ops::gpu::addr;
use crate::ops::packing::slots;
use crate::ops::precision::Precision;
use crate::ops::tensor::Tensor;
use crate::ops::types::DType;
use anyhow::{anyhow, bail, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::DevicePtr;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// Bytes of workspace cuBLASLt may use per GEMM.
const WORKSPACE: usize = 32 << 20;

/// A tensor `[rows, cols]` cast to FP8 with current scaling: `rows` `[rows, cols16]` (each row's
/// numbers contiguous), `columns` `[cols, rows16]` (each column's), n16 being n rounded up to 16
/// with zeros; its 1/scale. The same numbers seen in another shape (a reshaped tensor shares its
/// buffer) are another copy: `shape` is part of what a reuse matches.
pub(crate) struct Fp8Copy {
    format: Fp8,
    shape: (usize, usize),
    rows: Bytes,
    columns: Bytes,
    inverse_scale: Bytes,
}

/// One operand of a GEMM: FP8 bytes with the summed index contiguous, and their 1/scale.
struct Operand {
    bytes: Addr,
    inverse_scale: Addr,
    format: Fp8,
}

impl Fp8Copy {
    /// The copy as a GEMM reads it: along its rows (k = cols) or along its columns (k = rows).
    fn along(&self, columns: bool) -> Operand {
        let bytes = if columns { &self.columns } else { &self.rows };
        Operand { bytes: bytes.addr(), inverse_scale: self.inverse_scale.addr(), format: self.format }
    }
}

impl Device {
    /// y[rows, out] = x · Wᵀ in FP8 (E4M3 × E4M3), written in bf16.
    pub(crate) fn fp8_linear(self: &Arc<Self>, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (rows, inp, out) = (x.rows(), x.cols(), w.shape()[0]);
        let (a, b) = (self.fp8_copy(w, Fp8::E4M3)?.along(false), self.fp8_copy(x, Fp8::E4M3)?.along(false));
        let y = self.tensor(&[rows, out], DType::Bf16);
        self.fp8_gemm((&a, &b), (rows, out, inp), (addr(&y), DType::Bf16), false)?;
        Ok(y)
    }

    /// dx[rows, in] = dy · W in FP8 (E5M2 × E4M3), written in bf16.
    pub(crate) fn fp8_input_grad(self: &Arc<Self>, dy: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (rows, out, inp) = (dy.rows(), w.shape()[0], w.cols());
        let (a, b) = (self.fp8_copy(w, Fp8::E4M3)?.along(true), self.fp8_copy(dy, Fp8::E5M2)?.along(false));
        let dx = self.tensor(&[rows, inp], DType::Bf16);
        self.fp8_gemm((&a, &b), (rows, inp, out), (addr(&dx), DType::Bf16), false)?;
        Ok(dx)
    }

    /// dW[out, in] += dyᵀ · x in FP8 (E5M2 × E4M3), into the fp32 gradient.
    pub(crate) fn fp8_weight_grad(self: &Arc<Self>, dy: &Tensor, x: &Tensor, dw: &Tensor) -> Result<()> {
        let (rows, out, inp) = (x.rows(), dw.shape()[0], x.cols());
        let (a, b) = (self.fp8_copy(x, Fp8::E4M3)?.along(true), self.fp8_copy(dy, Fp8::E5M2)?.along(true));
        self.fp8_gemm((&a, &b), (out, inp, rows), (dw.gpu().expect("on the GPU").f32_addr(), DType::F32), true)
    }

    /// `t`'s FP8 copy in `format`: the one kept with it, or made now (two launches) and kept.
    fn fp8_copy(self: &Arc<Self>, t: &Tensor, format: Fp8) -> Result<Arc<Fp8Copy>> {
        let buf = t.gpu().expect("on the GPU");
        let shape = (t.rows(), t.cols());
        let same = |c: &Fp8Copy| c.format == format && c.shape == shape;
        let (copy, fresh) = buf.derived(same, || self.new_fp8_copy(t, format))?;
        if !fresh && check_casts() {
            let again = self.new_fp8_copy(t, format)?;
            let bytes = |c: &Fp8Copy| -> Result<_> {
                let (rows, cols) = shape;
                let size = |r: usize, k: usize| r * k.next_multiple_of(16);
                Ok((
                    self.download_bytes(&c.rows, size(rows, cols))?,
                    self.download_bytes(&c.columns, size(cols, rows))?,
                ))
            };
            if bytes(&copy)? != bytes(&again)? {
                bail!("the FP8 copy of a {:?} tensor no longer matches its numbers: a write reached the tensor without Tensor::written (FERROTRON_CHECK_CASTS)", t.shape());
            }
        }
        Ok(copy)
    }

    /// `t` `[rows, cols]` cast to `format` with current scaling, both ways (`Fp8Copy`).
    fn new_fp8_copy(self: &Arc<Self>, t: &Tensor, format: Fp8) -> Result<Fp8Copy> {
        let (n, rows, cols) = (t.numel(), t.rows(), t.cols());
        let copy = Fp8Copy {
            format,
            shape: (rows, cols),
            rows: self.bytes(rows * cols.next_multiple_of(16))?,
            columns: self.bytes(cols * rows.next_multiple_of(16))?,
            inverse_scale: self.bytes(4)?,
        };
        let blocks = amax_blocks(n, AMAX_BLOCKS);
        let partial = self.bytes(4 * blocks)?;
        let (dt, e5m2, maxima) = (t.dtype(), format == Fp8::E5M2, (partial.addr(), blocks));
        self.run(&launch_table::fp8_amax(dt, addr(t), n, maxima))?;
        let out = (copy.rows.addr(), copy.columns.addr(), copy.inverse_scale.addr());
        self.run(&launch_table::fp8_operand(dt, (addr(t), rows, cols), e5m2, maxima, out))?;
        Ok(copy)
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
        let types = [ty(a.format), ty(b.format), out_ty];
        let blas = |e: lt::CublasError| anyhow!("cuBLASLt FP8 GEMM ({r}×{c}, k {k}): {e:?}");
        let mut plans = lt.plans.lock().unwrap_or_else(|e| e.into_inner());
        let shape: LtShape = (r, c, k, types.map(|t| t as u32));
        let plan = match plans.entry(shape) {
            Entry::Occupied(p) => p.into_mut(),
            Entry::Vacant(v) => v.insert(plan(lt, (r, c, k), types).map_err(blas)?),
        };
        let (desc, algo) = (plan.desc.expect("made"), plan.algo.as_ref().expect("chosen"));
        let [la, lb, ld] = [plan.layouts[0], plan.layouts[1], plan.layouts[2]];
        // SAFETY: each attribute's value is the type cuBLASLt documents for it, alive for the call;
        // the buffers hold what the layouts describe.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as A;
            let set = |attr, v: &u64| lt::set_matmul_desc_attribute(desc, attr, (v as *const u64).cast(), 8);
            set(A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a.inverse_scale).map_err(blas)?;
            set(A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b.inverse_scale).map_err(blas)?;
            let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
            let (pa, pb) = (a.bytes as *const c_void, b.bytes as *const c_void);
            let work = lt.workspace.device_ptr(s).0 as *mut c_void;
            let (alpha, beta) = ((&alpha as *const f32).cast(), (&beta as *const f32).cast());
            let stream = s.cu_stream() as sys::cudaStream_t;
            let name = || format!("cublasLt fp8 gemm {c}x{r}x{k}"); // column-major m×n×k, as cuBLAS's
            crate::cuda::profile::timed(name, s, || {
                lt::matmul(
                    lt.handle, desc, alpha, beta, pa, la, pb, lb, y as _, ld, y as _, ld, algo, work, WORKSPACE, stream,
                )
                .map_err(blas)
            })?;
        }
        drop(plans);
        self.gpu.checked(|| "cuBLASLt FP8 GEMM".into())
    }

    /// `n` bytes of `b`, on the host (waits for the GPU).
    fn download_bytes(&self, b: &Bytes, n: usize) -> Result<Vec<u8>> {
        let mut host = vec![0u8; n];
        let s = &self.gpu.compute;
        // SAFETY: `b` holds at least `n` bytes, written in compute-stream order, which this waits for.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host, b.addr(), s.cu_stream()) }.map_err(cuda_err)?;
        s.synchronize().map_err(cuda_err)?;
        Ok(host)
    }

    // The packed formats of a gathered weight (`ops/packing.rs`): f32 slots holding f32, bf16 pairs or
    // FP8 quads.

    /// The largest |x| of each of NORM_BLOCKS slices of `t`.
    pub(crate) fn abs_max(self: &Arc<Self>, t: &Tensor) -> Result<Tensor> {
        let out = Tensor::from_buf(&[NORM_BLOCKS], self.zeros(NORM_BLOCKS, DType::F32)); // fp8_amax may fill fewer
        let blocks = amax_blocks(t.numel(), NORM_BLOCKS);
        self.run(&launch_table::fp8_amax(t.dtype(), addr(t), t.numel(), (addr(&out), blocks)))?;
        Ok(out)
    }

    /// `t` packed into f32 slots in `format` (the bytes of a slot its numbers').
    pub(crate) fn pack(self: &Arc<Self>, t: &Tensor, format: Precision, amax: Option<&Tensor>) -> Result<Tensor> {
        let (n, dt) = (t.numel(), t.dtype());
        let out = self.tensor(&[slots(n, format)], DType::F32);
        let (from, to) = (addr(t), addr(&out));
        match (format, dt) {
            (Precision::Fp8, _) => {
                let amax = addr(amax.ok_or_else(|| anyhow!("an FP8 weight packed without its maxima"))?);
                self.run(&launch_table::fp8_cast(dt, (from, n), amax, to))?
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
        format: Precision,
        amax: Option<&Tensor>,
    ) -> Result<Tensor> {
        let from = addr(packed) + 4 * at as Addr;
        let dt = if format == Precision::F32 { DType::F32 } else { self.dtype };
        let out = self.tensor(&[n], dt);
        match format {
            Precision::F32 => self.copy_bytes(from, addr(&out), 4 * n)?,
            Precision::Bf16 if dt == DType::Bf16 => self.copy_bytes(from, addr(&out), 2 * n)?,
            Precision::Bf16 => bail!("a bf16 packed format on a GPU computing in f32"),
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
        Ok(self.lt.get_or_init(|| BlasLt { handle, workspace, plans: Mutex::new(HashMap::new()) }))
    }
}

/// The descriptors of a GEMM of this shape and the algorithm cuBLASLt's heuristic picks for it.
fn plan(
    lt: &BlasLt,
    (r, c, k): (usize, usize, usize),
    [ta, tb, ty]: [sys::cudaDataType; 3],
) -> std::result::Result<LtPlan, lt::CublasError> {
    let mut p = LtPlan::default(); // destroys what was made if a step fails
    let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
    p.desc = Some(desc);
    for (t, rows, cols) in [(ta, k, c), (tb, k, r), (ty, c, r)] {
        p.layouts.push(lt::create_matrix_layout(t, rows as u64, cols as u64, rows as i64)?);
    }
    let pref = lt::create_matmul_pref()?;
    p.pref = Some(pref);
    let transposed = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
    // SAFETY: each attribute's value is the type cuBLASLt documents for it, alive for the call.
    unsafe {
        use sys::cublasLtMatmulDescAttributes_t as A;
        lt::set_matmul_desc_attribute(
            desc,
            A::CUBLASLT_MATMUL_DESC_TRANSA,
            (&transposed as *const cudarc::cublas::sys::cublasOperation_t).cast(),
            4,
        )?;
        let limit = WORKSPACE as u64;
        let attr = sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES;
        lt::set_matmul_pref_attribute(pref, attr, (&limit as *const u64).cast(), 8)?;
        let [la, lb, ld] = [p.layouts[0], p.layouts[1], p.layouts[2]];
        p.algo = Some(lt::get_matmul_algo_heuristic(lt.handle, desc, la, lb, ld, ld, pref)?.algo);
    }
    Ok(p)
}

/// Whether `FERROTRON_CHECK_CASTS` asks every reused FP8 copy to be checked against a fresh cast.
fn check_casts() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROTRON_CHECK_CASTS").is_ok_and(|v| v == "1"))
}
