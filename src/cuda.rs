//! # The CUDA backend: device buffers, kernel launches and cuBLAS GEMMs
//!
//! A `Device` is one rank's GPU as the op layer sees it: the kernels of `kernels/*.cu` (compiled
//! by NVRTC for this GPU's architecture, once per process, see `kernels.rs`), a cuBLAS handle, and
//! the dtype the model computes in. Every launch goes on the compute stream and none waits for
//! the GPU: the host only queues work, and the first `to_vec` (the loss, once per micro-batch)
//! is where it waits.
//!
//! Mixed precision (`DType::Bf16`), the picture of one linear layer:
//! ```text
//!   master W (fp32) ──AdamW──▶ W' (fp32) ──written by the same kernel──▶ copy W (bf16)
//!   x (bf16) ─┬─ GEMM, bf16 in, fp32 accumulate ─▶ y (bf16)
//!   dy (bf16)─┴─ GEMM, bf16 in, fp32 accumulate ─▶ dW += … (fp32, straight into the gradient)
//! ```
//! Activations and their gradients are bf16; weights, gradients, AdamW moments and all softmax
//! and normalisation statistics are fp32. `DType::F32` is the same code in f32 throughout with
//! cuBLAS's pedantic f32 GEMM (no TF32), so a GPU run can be compared step by step with the CPU.
//!
//! Each op method allocates its outputs, takes the buffers' device addresses, and queues the
//! launches `launches.rs` describes (kernel, grid, arguments); matrix products go to cuBLAS.

use crate::gpu::{cuda_err, Gpu};
use crate::launches::{self, Addr, Arg, Launch, NORM_BLOCKS};
use crate::ops::{AdamW, Attn};
use crate::tensor::Tensor;
use anyhow::{anyhow, bail, Result};
use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What the kernels compute with.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DType {
    F32,
    Bf16,
}

impl DType {
    /// The suffix of the kernels instantiated for this dtype (`name_f32`, `name_bf16`).
    pub fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }
}

/// A failed CUDA call inside an op stops the rank with this message (the launcher reports it and
/// stops the other ranks): a GPU error leaves nothing to recover.
pub(crate) fn fatal<T>(what: &str, r: Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("CUDA {what}: {e:#}"))
}

/// A GPU buffer: f32, bf16, or a mixed-precision weight (fp32 master + bf16 compute copy).
pub struct Buf {
    data: Data,
    dev: Arc<Device>,
}

enum Data {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
    Mixed { master: CudaSlice<f32>, copy: CudaSlice<bf16> },
}

impl Data {
    fn bytes(&self) -> usize {
        match self {
            Data::F32(s) => s.num_bytes(),
            Data::Bf16(s) => s.num_bytes(),
            Data::Mixed { master, copy } => master.num_bytes() + copy.num_bytes(),
        }
    }
}

impl Buf {
    fn new(dev: &Arc<Device>, data: Data) -> Buf {
        let held = dev.held.fetch_add(data.bytes(), Ordering::Relaxed) + data.bytes();
        dev.peak.fetch_max(held, Ordering::Relaxed);
        Buf { data, dev: dev.clone() }
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The dtype the kernels read: a mixed-precision weight reads as bf16.
    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::Bf16(_) | Data::Mixed { .. } => DType::Bf16,
        }
    }

    /// The address the kernels read and write (a mixed weight's bf16 copy).
    fn addr(&self) -> Addr {
        let s = &self.dev.gpu.compute;
        match &self.data {
            Data::F32(x) => x.device_ptr(s).0,
            Data::Bf16(x) | Data::Mixed { copy: x, .. } => x.device_ptr(s).0,
        }
    }

    /// The fp32 numbers: an f32 buffer, or a mixed weight's master.
    fn f32_addr(&self) -> Addr {
        let s = &self.dev.gpu.compute;
        match &self.data {
            Data::F32(x) | Data::Mixed { master: x, .. } => x.device_ptr(s).0,
            Data::Bf16(_) => panic!("an f32 GPU buffer was expected, this one is bf16"),
        }
    }

    pub fn bytes(&self) -> usize {
        self.data.bytes()
    }

    fn len(&self) -> usize {
        match &self.data {
            Data::F32(x) | Data::Mixed { master: x, .. } => x.len(),
            Data::Bf16(x) => x.len(),
        }
    }

    /// A host copy as f32 (a mixed weight gives its master); waits for the compute stream.
    pub fn to_vec(&self) -> Vec<f32> {
        let d = &self.dev;
        fatal(
            "download",
            (|| match &self.data {
                Data::F32(x) | Data::Mixed { master: x, .. } => d.gpu.download(x),
                Data::Bf16(x) => {
                    let f32s = d.gpu.zeros::<f32>(x.len())?;
                    let s = &d.gpu.compute;
                    d.run(&launches::cast_bf16_to_f32(x.device_ptr(s).0, f32s.device_ptr(s).0, x.len()))?;
                    d.gpu.download(&f32s)
                }
            })(),
        )
    }

    /// Overwrites the buffer with host f32 data (a mixed weight: the master and its copy).
    pub fn write(&mut self, data: &[f32]) {
        let dev = self.dev.clone();
        fatal(
            "upload",
            (|| match &mut self.data {
                Data::F32(x) => dev.gpu.write(data, x),
                Data::Bf16(x) => dev.gpu.write(&data.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(), x),
                Data::Mixed { master, copy } => {
                    dev.gpu.write(data, master)?;
                    dev.cast(master, copy)
                }
            })(),
        )
    }
}

impl Clone for Buf {
    fn clone(&self) -> Buf {
        let s = &self.dev.gpu.compute;
        let data = fatal(
            "copy",
            (|| -> Result<Data> {
                Ok(match &self.data {
                    Data::F32(x) => Data::F32(s.clone_dtod(x).map_err(cuda_err)?),
                    Data::Bf16(x) => Data::Bf16(s.clone_dtod(x).map_err(cuda_err)?),
                    Data::Mixed { master, copy } => Data::Mixed {
                        master: s.clone_dtod(master).map_err(cuda_err)?,
                        copy: s.clone_dtod(copy).map_err(cuda_err)?,
                    },
                })
            })(),
        );
        Buf::new(&self.dev, data)
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.dev.held.fetch_sub(self.data.bytes(), Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "GPU {:?} buffer of {}", self.dtype(), self.len())
    }
}

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

/// An index array and its device copy.
type Indices = (Vec<u32>, Arc<CudaSlice<u32>>);

/// One rank's GPU as the op layer sees it.
pub struct Device {
    pub gpu: Gpu,
    /// The dtype activations are computed in.
    pub dtype: DType,
    arch: &'static str,
    /// Each kernel file's module, loaded once, and the kernels looked up in them.
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    blas: CudaBlas,
    /// Recently uploaded token, target and position arrays, by content: each micro-batch's are
    /// uploaded once and reused by every layer.
    indices: Mutex<VecDeque<Indices>>,
    held: AtomicUsize,
    peak: AtomicUsize,
}

impl Device {
    /// The op layer on `gpu`, computing in `dtype`. Every kernel file is compiled here, before
    /// training starts, so a missing NVRTC or header shows up now and not in the first step.
    pub fn new(gpu: &Gpu, dtype: DType) -> Result<Arc<Device>> {
        crate::gpu::require("cuBLAS")?;
        let (major, minor) = gpu.ctx.compute_capability().map_err(cuda_err)?;
        if major < 8 {
            bail!("GPU compute capability {major}.{minor}: the kernels need bf16, so sm_80 (Ampere) or newer");
        }
        let arch = crate::kernels::arch_name(major, minor);
        for (file, _) in crate::kernels::SOURCES {
            crate::kernels::ptx(file, arch)?;
        }
        let blas = CudaBlas::new(gpu.compute.clone()).map_err(|e| anyhow!("cuBLAS cannot start: {e:?}"))?;
        Ok(Arc::new(Device {
            gpu: gpu.clone(),
            dtype,
            arch,
            modules: Mutex::default(),
            functions: Mutex::default(),
            blas,
            indices: Mutex::default(),
            held: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }))
    }

    /// The most bytes tensors held at once since the last call; starts the next period.
    pub fn take_peak_bytes(&self) -> usize {
        self.peak.swap(self.held.load(Ordering::Relaxed), Ordering::Relaxed)
    }

    fn function(&self, file: &'static str, name: &str) -> Result<CudaFunction> {
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match modules.get(file) {
                Some(m) => m.clone(),
                None => {
                    let ptx = crate::kernels::ptx(file, self.arch)?;
                    let m = self.gpu.ctx.load_module((*ptx).clone()).map_err(|e| load_error(file, e))?;
                    modules.insert(file, m.clone());
                    m
                }
            }
        };
        let f = module.load_function(name).map_err(|e| anyhow!("kernels/{file}.cu has no kernel {name}: {e:?}"))?;
        functions.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Queues a kernel launch (`launches.rs`) on the compute stream.
    fn run(&self, l: &Launch) -> Result<()> {
        if l.grid.0 == 0 || l.grid.1 == 0 || l.grid.2 == 0 {
            return Ok(()); // nothing to compute (an empty tensor)
        }
        let f = self.function(l.file, &l.kernel)?;
        let mut b = self.gpu.compute.launch_builder(&f);
        for a in &l.args {
            match a {
                Arg::Ptr(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::F64(v) => b.arg(v),
                Arg::Shape(v) => b.arg(v),
            };
        }
        let config = LaunchConfig { grid_dim: l.grid, block_dim: (l.block, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `launches.rs` passes the argument list each kernel declares, and the op layer
        // checked that the buffers hold what the launch shape reaches.
        unsafe { b.launch(config) }.map(drop).map_err(|e| anyhow!("kernel {}: {e:?}", l.kernel))
    }

    /// A zero-filled buffer of `n` numbers.
    pub fn zeros(self: &Arc<Self>, n: usize, dtype: DType) -> Buf {
        let s = &self.gpu.compute;
        let data = fatal(
            "alloc",
            match dtype {
                DType::F32 => s.alloc_zeros(n).map(Data::F32),
                DType::Bf16 => s.alloc_zeros(n).map(Data::Bf16),
            }
            .map_err(|e| anyhow!("cannot allocate {n} numbers on the GPU: {e:?}")),
        );
        Buf::new(self, data)
    }

    fn tensor(self: &Arc<Self>, shape: &[usize], dtype: DType) -> Tensor {
        Tensor::from_buf(shape, self.zeros(shape.iter().product(), dtype))
    }

    /// Host f32 data on the GPU as `dtype` (bf16: converted on the GPU by `cast_f32_to_bf16`).
    pub fn upload(self: &Arc<Self>, data: &[f32], dtype: DType) -> Buf {
        let f32s = fatal("upload", self.gpu.upload(data));
        let data = match dtype {
            DType::F32 => Data::F32(f32s),
            DType::Bf16 => Data::Bf16(fatal("cast", self.to_bf16(&f32s))), // f32s is freed in stream order
        };
        Buf::new(self, data)
    }

    /// A weight on the GPU: f32, or in mixed precision an fp32 master with its bf16 copy.
    pub fn upload_param(self: &Arc<Self>, data: &[f32]) -> Buf {
        let master = fatal("upload", self.gpu.upload(data));
        let data = match self.dtype {
            DType::F32 => Data::F32(master),
            DType::Bf16 => Data::Mixed { copy: fatal("cast", self.to_bf16(&master)), master },
        };
        Buf::new(self, data)
    }

    fn to_bf16(&self, from: &CudaSlice<f32>) -> Result<CudaSlice<bf16>> {
        let to = self.gpu.zeros::<bf16>(from.len())?;
        self.cast(from, &to)?;
        Ok(to)
    }

    /// to ← bf16(from), on the GPU.
    fn cast(&self, from: &CudaSlice<f32>, to: &CudaSlice<bf16>) -> Result<()> {
        let s = &self.gpu.compute;
        self.run(&launches::cast_f32_to_bf16(from.device_ptr(s).0, to.device_ptr(s).0, from.len()))
    }

    /// The device copy of an index array (tokens, targets as their bits, positions).
    fn indices(&self, v: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        let mut cache = self.indices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, d)) = cache.iter().find(|(k, _)| k.as_slice() == v) {
            return Ok(d.clone());
        }
        let d = Arc::new(self.gpu.upload(v)?);
        if cache.len() == 16 {
            cache.pop_front();
        }
        cache.push_back((v.to_vec(), d.clone()));
        Ok(d)
    }

    /// The address of an index array's device copy, and the copy (keep it until the launch is
    /// queued).
    fn index_addr(&self, v: &[u32]) -> Result<(Addr, Arc<CudaSlice<u32>>)> {
        let d = self.indices(v)?;
        let addr = d.device_ptr(&self.gpu.compute).0;
        Ok((addr, d))
    }

    // -----------------------------------------------------------------------------------------
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
        if g.m == 0 || g.n == 0 || (g.k == 0 && !accumulate) {
            return Ok(()); // an empty product (k = 0: zeros, which the output already holds)
        }
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        self.gpu.ctx.bind_to_thread().map_err(cuda_err)?; // cuBLAS runs in the thread's current context
        let addr = |b: &Buf| b.addr() as *mut std::ffi::c_void;
        let i = |v: usize| v as i32;
        // SAFETY: the op layer checked the shapes: a, b and c hold the numbers their leading
        // dimensions describe (`Gemm`); alpha and beta are host f32 as the compute type wants.
        unsafe {
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
        }
        .map_err(|e| anyhow!("cuBLAS GEMM {}×{}×{}: {e:?}", g.m, g.n, g.k))
    }

    /// y[m, n] = x[m, k] · w[n, k]ᵀ.
    pub fn linear(self: &Arc<Self>, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let y = self.tensor(&[x.rows(), w.shape()[0]], x.dtype());
        self.gemm(Gemm::linear(x.rows(), x.cols(), w.shape()[0]), buf(w), buf(x), buf(&y), false)?;
        Ok(y)
    }

    /// dx[m, k] = dy[m, n] · w[n, k].
    pub fn linear_input_grad(self: &Arc<Self>, dy: &Tensor, w: &Tensor) -> Result<Tensor> {
        let dx = self.tensor(&[dy.rows(), w.cols()], dy.dtype());
        self.gemm(Gemm::input_grad(dy.rows(), w.cols(), w.shape()[0]), buf(w), buf(dy), buf(&dx), false)?;
        Ok(dx)
    }

    /// dw[n, k] += dy[m, n]ᵀ · x[m, k], accumulated into the fp32 gradient.
    pub fn linear_weight_grad(&self, dy: &Tensor, x: &Tensor, dw: &Tensor) -> Result<()> {
        self.gemm(Gemm::weight_grad(x.rows(), x.cols(), dw.shape()[0]), buf(x), buf(dy), buf(dw), true)
    }

    // -----------------------------------------------------------------------------------------
    // Kernels, one method per op of `ops.rs`, same arguments; the launches are in `launches.rs`.

    pub fn embedding(self: &Arc<Self>, table: &Tensor, tokens: &[u32], first: usize) -> Result<Tensor> {
        let (dt, dim) = (table.dtype(), table.cols());
        let out = self.tensor(&[tokens.len(), dim], dt);
        let (ids, _keep) = self.index_addr(tokens)?;
        self.run(&launches::embedding(dt, (addr(table), table.rows()), (ids, tokens.len()), first, dim, addr(&out)))?;
        Ok(out)
    }

    pub fn embedding_backward(&self, dout: &Tensor, tokens: &[u32], first: usize, dtable: &Tensor) -> Result<()> {
        let (ids, _keep) = self.index_addr(tokens)?;
        let shape = (dtable.rows(), dtable.cols());
        let dt = dout.dtype();
        self.run(&launches::embedding_backward(dt, addr(dout), (ids, tokens.len()), first, shape, f32_addr(dtable)))
    }

    pub fn rmsnorm(self: &Arc<Self>, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        let (y, rstd) = (self.tensor(x.shape(), x.dtype()), self.tensor(&[x.rows()], DType::F32));
        self.run(&launches::rmsnorm(x.dtype(), addr(x), addr(w), eps, (x.rows(), x.cols()), addr(&y), addr(&rstd)))?;
        Ok((y, rstd))
    }

    pub fn rmsnorm_backward(
        self: &Arc<Self>,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        dw: &Tensor,
    ) -> Result<Tensor> {
        let dx = self.tensor(x.shape(), x.dtype());
        let inputs = (addr(dy), addr(x), addr(w), addr(rstd));
        for l in launches::rmsnorm_backward(x.dtype(), inputs, (x.rows(), x.cols()), addr(&dx), f32_addr(dw)) {
            self.run(&l)?;
        }
        Ok(dx)
    }

    pub fn rope(&self, x: &Tensor, positions: &[u32], head_dim: usize, theta: f64, inverse: bool) -> Result<()> {
        let (pos, _keep) = self.index_addr(positions)?;
        let shape = (x.rows(), x.cols() / head_dim, head_dim);
        self.run(&launches::rope(x.dtype(), addr(x), pos, shape, theta, inverse))
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
        self.run(&launches::attention(q.dtype(), a, qkv, (qp, kp), addr(&out), addr(&lse)))?;
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
        let delta = self.tensor(lse.shape(), DType::F32);
        let (dq, dk, dv) =
            (self.tensor(q.shape(), q.dtype()), self.tensor(k.shape(), k.dtype()), self.tensor(v.shape(), v.dtype()));
        let ((qp, _k1), (kp, _k2)) = (self.index_addr(pos.0)?, self.index_addr(pos.1)?);
        let (qkv, grads) = ((addr(q), addr(k), addr(v)), (addr(&dq), addr(&dk), addr(&dv)));
        let saved = (addr(out), addr(lse), addr(dout));
        for l in launches::attention_backward(q.dtype(), a, qkv, (qp, kp), saved, addr(&delta), grads) {
            self.run(&l)?;
        }
        Ok((dq, dk, dv))
    }

    pub fn attention_merge(&self, a: Attn, (out, lse): (&Tensor, &Tensor), block: (&Tensor, &Tensor)) -> Result<()> {
        self.run(&launches::attention_merge(out.dtype(), a, (addr(out), addr(lse)), (addr(block.0), addr(block.1))))
    }

    pub fn swiglu(self: &Arc<Self>, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let h = self.tensor(gate.shape(), gate.dtype());
        self.run(&launches::swiglu(gate.dtype(), (addr(gate), addr(up)), addr(&h), h.numel()))?;
        Ok(h)
    }

    pub fn swiglu_backward(self: &Arc<Self>, dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
        let (dg, du) = (self.tensor(gate.shape(), gate.dtype()), self.tensor(up.shape(), up.dtype()));
        let inputs = (addr(dh), addr(gate), addr(up));
        self.run(&launches::swiglu_backward(gate.dtype(), inputs, (addr(&dg), addr(&du)), dh.numel()))?;
        Ok((dg, du))
    }

    pub fn row_max(self: &Arc<Self>, logits: &Tensor) -> Result<Tensor> {
        let m = self.tensor(&[logits.rows()], DType::F32);
        self.run(&launches::row_max(logits.dtype(), addr(logits), (logits.rows(), logits.cols()), addr(&m)))?;
        Ok(m)
    }

    pub fn row_sum_exp(self: &Arc<Self>, logits: &Tensor, max: &Tensor) -> Result<Tensor> {
        let s = self.tensor(&[logits.rows()], DType::F32);
        let shape = (logits.rows(), logits.cols());
        self.run(&launches::row_sum_exp(logits.dtype(), addr(logits), shape, addr(max), addr(&s)))?;
        Ok(s)
    }

    pub fn log_sum_exp(self: &Arc<Self>, max: &Tensor, sum_exp: &Tensor) -> Result<Tensor> {
        let lse = self.tensor(max.shape(), DType::F32);
        self.run(&launches::log_sum_exp(addr(max), addr(sum_exp), addr(&lse), max.numel()))?;
        Ok(lse)
    }

    pub fn target_logits(self: &Arc<Self>, logits: &Tensor, targets: &[i32], first: usize) -> Result<Tensor> {
        let z = self.tensor(&[targets.len()], DType::F32);
        let (t, _keep) = self.index_addr(&target_bits(targets))?;
        let shape = (logits.rows(), logits.cols());
        self.run(&launches::target_logit(logits.dtype(), addr(logits), shape, t, first, addr(&z)))?;
        Ok(z)
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
        self.run(&launches::cross_entropy_backward(dt, (addr(logits), t), first, (addr(lse), scale), shape, addr(&d)))?;
        Ok(d)
    }

    pub fn add_assign(&self, a: &Tensor, b: &Tensor) -> Result<()> {
        if a.dtype() != b.dtype() {
            bail!("adding a {:?} tensor to a {:?} one", b.dtype(), a.dtype());
        }
        self.run(&launches::add_assign(a.dtype(), addr(a), addr(b), a.numel()))
    }

    pub fn scale(&self, a: &Tensor, s: f32) -> Result<()> {
        self.run(&launches::scale(a.dtype(), addr(a), s, a.numel()))
    }

    /// Σ x² of each f32 tensor: every tensor's partial sums land in one buffer, which is read
    /// back once (one wait for the GPU for the whole gradient norm).
    pub fn sum_squares(self: &Arc<Self>, ts: &[&Tensor]) -> Result<Vec<f64>> {
        let partial = self.zeros(ts.len() * NORM_BLOCKS, DType::F32);
        for (i, t) in ts.iter().enumerate() {
            let at = partial.f32_addr() + (i * NORM_BLOCKS * 4) as u64;
            self.run(&launches::sum_squares(f32_addr(t), t.numel(), at))?;
        }
        let sums = partial.to_vec();
        Ok(sums.chunks(NORM_BLOCKS).map(|c| c.iter().map(|&x| x as f64).sum()).collect())
    }

    /// One AdamW step on the fp32 master weight; in mixed precision the same kernel writes the
    /// new bf16 copy.
    pub fn adamw(&self, o: &AdamW, p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
        let copy = matches!(buf(p).data, Data::Mixed { .. }).then(|| addr(p));
        let f32s = (f32_addr(p), f32_addr(g), f32_addr(m), f32_addr(v));
        self.run(&launches::adamw(o, f32s, p.numel(), copy))
    }
}

/// A module that does not load: most often PTX newer than the driver can read.
fn load_error(file: &str, e: cudarc::driver::DriverError) -> anyhow::Error {
    let mut nvrtc = (0, 0);
    // SAFETY: NVRTC is loaded (the kernels were just compiled with it); two valid out-pointers.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut nvrtc.0, &mut nvrtc.1) };
    let mut driver = 0;
    // SAFETY: the driver is loaded (a context exists); a valid out-pointer.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    anyhow!(
        "kernels/{file}.cu compiled but the GPU driver cannot load it ({e:?}); NVRTC is CUDA {}.{}, the driver \
         supports CUDA {}.{}: use an NVRTC no newer than the driver (FERROTRON_CUDA_INCLUDE and LD_LIBRARY_PATH \
         pick it) or update the driver",
        nvrtc.0,
        nvrtc.1,
        driver / 1000,
        driver % 1000 / 10
    )
}

/// The GPU buffer of a tensor the op layer has already found on the GPU.
fn buf(t: &Tensor) -> &Buf {
    t.gpu().expect("the op layer checked that every tensor of the op is on the GPU")
}

/// The address the kernels read and write.
fn addr(t: &Tensor) -> Addr {
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
    if a.head_dim > 128 {
        bail!("the CUDA attention kernel supports head_dim up to 128, not {}", a.head_dim);
    }
    Ok(())
}
