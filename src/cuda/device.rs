//! # The CUDA backend: a rank's GPU and the buffers tensors keep on it
//!
//! A `Device` is one rank's GPU as the op layer sees it: the kernels of `kernels/*.cu` (compiled
//! by NVRTC for this GPU's architecture, once per process, see `cuda/nvrtc.rs`), a cuBLAS handle, and
//! the dtype the model computes in. The ops themselves are in `ops/gpu.rs`. Every launch goes on
//! the compute stream and none waits for the GPU: the host only queues work, and a `to_vec` (the
//! loss and the gradient norm, read together once per step) is where it waits.
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
//! Peak memory: every buffer adds its bytes to its device's count when made and takes them back
//! when dropped; the training loop reads the highest count of each step.

use crate::cuda::launch_table::{self, Addr, Arg, Launch};
use crate::cuda::runtime::{cuda_err, Gpu, Staging};
use crate::ops::types::{DType, Rope};
use anyhow::{anyhow, bail, Result};
use cudarc::cublas::CudaBlas;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// A failed CUDA call inside an op stops the rank with this message (the launcher reports it and
/// stops the other ranks): a GPU error leaves nothing to recover.
pub(crate) fn fatal<T>(what: &str, r: Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("{GPU_ERROR}{what}: {e:#}"))
}

/// How the message of a `fatal` GPU error starts (the binary's panic hook leaves these to the
/// launcher, which reports them as the run's one error line).
pub const GPU_ERROR: &str = "CUDA ";

/// `f()`, with a panic inside it made its error: a `fatal` GPU error as its message, any other
/// (a bug, which the panic hook has already reported where it happened) as "panicked: …". The
/// launcher runs each rank so, and `doctor` its kernel self-test.
pub fn catching_panics<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let msg =
            panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
        match msg.unwrap_or_default() {
            gpu_error if gpu_error.starts_with(GPU_ERROR) => Err(anyhow!("{gpu_error}")), // an op's GPU failure
            msg => Err(anyhow!("panicked: {msg}")),
        }
    })
}

/// A GPU buffer: f32, bf16, or a mixed-precision weight (fp32 master + bf16 compute copy).
pub struct Buf {
    pub(crate) data: Data,
    dev: Arc<Device>,
    /// What the op layer made from these numbers to read them faster (a tensor's FP8 copies,
    /// `ops/gpu_fp8.rs`), kept until the numbers change: `written` drops them.
    derived: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
}

pub(crate) enum Data {
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
        dev.hold(data.bytes());
        Buf { data, dev: dev.clone(), derived: Mutex::default() }
    }

    /// The first of this buffer's derived copies of type `T` that `find` accepts, or the one
    /// `make` makes now (then kept), and whether it was just made.
    pub(crate) fn derived<T: Any + Send + Sync>(
        &self,
        find: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<(Arc<T>, bool)> {
        let mut kept = self.derived.lock().unwrap_or_else(|e| e.into_inner());
        let found = kept.iter().find_map(|d| d.clone().downcast::<T>().ok().filter(|d| find(d)));
        if let Some(d) = found {
            return Ok((d, false));
        }
        let made = Arc::new(make()?);
        kept.push(made.clone());
        Ok((made, true))
    }

    /// The numbers are about to change: what was derived from them is dropped. Every write to a
    /// buffer that already exists passes here (the op layer's `&mut Tensor`, `Tensor::written`).
    pub(crate) fn written(&mut self) {
        self.derived.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
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
    pub(crate) fn addr(&self) -> Addr {
        let s = &self.dev.gpu.compute;
        match &self.data {
            Data::F32(x) => x.device_ptr(s).0,
            Data::Bf16(x) | Data::Mixed { copy: x, .. } => x.device_ptr(s).0,
        }
    }

    /// The fp32 numbers: an f32 buffer, or a mixed weight's master.
    pub(crate) fn f32_addr(&self) -> Addr {
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

    /// A mixed weight's master, copied on the GPU into a buffer of its own; `None` for the others.
    pub fn master_copy(&self) -> Option<Buf> {
        let Data::Mixed { master, .. } = &self.data else { return None };
        let copy = self.dev.gpu.compute.clone_dtod(master).map_err(cuda_err);
        Some(Buf::new(&self.dev, Data::F32(fatal("copy", copy))))
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
                    d.run(&launch_table::cast_bf16_to_f32(x.device_ptr(s).0, f32s.device_ptr(s).0, x.len()))?;
                    d.gpu.download(&f32s)
                }
            })(),
        )
    }

    /// Overwrites the buffer with host f32 data (a mixed weight: the master and its copy).
    pub fn write(&mut self, data: &[f32]) {
        self.written();
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

/// An index array and its device copy.
type Indices = (Vec<u32>, Arc<CudaSlice<u32>>);

/// The cos and sin of one micro-batch's RoPE angles (`kernels/rope.cu`), `[rows, head_dim / 2]`.
pub(crate) struct RopeTable {
    pub cos: Buf,
    pub sin: Buf,
}

/// The table's key: the positions and the angles' frequencies.
type RopeKey = (Vec<u32>, Rope);

/// One rank's GPU as the op layer sees it.
pub struct Device {
    pub gpu: Gpu,
    /// The dtype activations are computed in.
    pub dtype: DType,
    /// Every kernel of the table (`cuda/kernels.rs`), in its order, looked up once when the
    /// device opens (modules stay loaded while a function of theirs lives).
    functions: Vec<CudaFunction>,
    pub(crate) blas: ManuallyDrop<CudaBlas>,
    /// Recently uploaded token, target and position arrays, by content: each micro-batch's are
    /// uploaded once (from pinned memory, without stopping the host) and reused by every layer.
    indices: Mutex<VecDeque<Indices>>,
    /// The pinned host buffers those uploads go through.
    staging: Mutex<Staging>,
    /// The RoPE tables of the latest micro-batches: made by the first layer, read by the others.
    rope_tables: Mutex<VecDeque<(RopeKey, Arc<RopeTable>)>>,
    /// cuBLASLt, opened by the first FP8 GEMM (`ops/gpu_fp8.rs`).
    pub(crate) lt: OnceLock<BlasLt>,
    held: AtomicUsize,
    peak: AtomicUsize,
}

/// A cuBLASLt handle, the workspace its GEMMs may use, and a plan for each GEMM shape met.
pub(crate) struct BlasLt {
    pub handle: lt_sys::cublasLtHandle_t,
    pub workspace: CudaSlice<u8>,
    pub plans: Mutex<HashMap<LtShape, LtPlan>>,
}

/// A cuBLASLt GEMM's shape: rows, columns and summed length of the product, and the types of its
/// two operands and its output (`cudaDataType` codes).
pub(crate) type LtShape = (usize, usize, usize, [u32; 3]);

/// The descriptors of one GEMM shape and the algorithm cuBLASLt's heuristic chose for it: asked
/// once a run, not at every call (`ops/gpu_fp8.rs`); destroyed with the device (or when making
/// them failed half-way).
#[derive(Default)]
pub(crate) struct LtPlan {
    pub desc: Option<lt_sys::cublasLtMatmulDesc_t>,
    pub layouts: Vec<lt_sys::cublasLtMatrixLayout_t>,
    pub pref: Option<lt_sys::cublasLtMatmulPreference_t>,
    pub algo: Option<lt_sys::cublasLtMatmulAlgo_t>,
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        use cudarc::cublaslt::result as lt;
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

// SAFETY: cuBLASLt descriptors are plain host structures; each device's are used from its rank's
// thread, under the plans' lock.
unsafe impl Send for LtPlan {}

/// Bytes on the GPU outside any tensor (a tensor's FP8 copies), counted in the device's memory
/// as a tensor's are; written by the kernel that fills them before anything reads them.
pub(crate) struct Bytes {
    slice: CudaSlice<u8>,
    dev: Arc<Device>,
}

impl Bytes {
    pub(crate) fn addr(&self) -> Addr {
        self.slice.device_ptr(&self.dev.gpu.compute).0
    }
}

impl Drop for Bytes {
    fn drop(&mut self) {
        self.dev.held.fetch_sub(self.slice.num_bytes(), Ordering::Relaxed);
    }
}

// SAFETY: a cuBLASLt handle may be used from any thread; ferrotron uses each device's from its
// rank's thread, in the compute stream's order.
unsafe impl Send for BlasLt {}
unsafe impl Sync for BlasLt {}

/// Lets each kernel that launches with dynamic shared memory have what its launches give: past
/// 48 KiB a block, a launch fails unless its function opted in (a GPU of compute capability 8.0
/// or newer allows 99 KiB to 227 KiB).
fn opt_in_shared(functions: &[CudaFunction]) -> Result<()> {
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC;
    for (kernel, bytes) in launch_table::dynamic_shared() {
        functions[kernel.index()].set_attribute(MAX_DYNAMIC, bytes as i32).map_err(|e| {
            anyhow!(
                "kernel {} needs {bytes} bytes of shared memory a block, more than this GPU allows ({e:?})",
                kernel.name()
            )
        })?;
    }
    Ok(())
}

impl Device {
    /// The op layer on `gpu`, computing in `dtype`. Every kernel file is compiled here, before
    /// training starts, so a missing NVRTC or header shows up now and not in the first step.
    pub fn new(gpu: &Gpu, dtype: DType) -> Result<Arc<Device>> {
        crate::cuda::runtime::require("cuBLAS")?;
        let (major, minor) = gpu.ctx.compute_capability().map_err(cuda_err)?;
        if major < 8 {
            bail!("GPU compute capability {major}.{minor}: the kernels need bf16, so sm_80 (Ampere) or newer");
        }
        if gpu.ctx.has_async_alloc() {
            gpu.keep_freed_memory()?;
        }
        let functions = crate::cuda::nvrtc::load_kernels(gpu, crate::cuda::nvrtc::target(major, minor)?)?;
        opt_in_shared(&functions)?;
        let blas = CudaBlas::new(gpu.compute.clone()).map_err(|e| anyhow!("cuBLAS cannot start: {e:?}"))?;
        let blas = ManuallyDrop::new(blas);
        Ok(Arc::new(Device {
            gpu: gpu.clone(),
            dtype,
            functions,
            blas,
            indices: Mutex::default(),
            staging: Mutex::default(),
            rope_tables: Mutex::default(),
            lt: OnceLock::new(),
            held: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }))
    }

    /// The most bytes tensors held at once since the last call; starts the next period.
    pub fn take_peak_bytes(&self) -> usize {
        self.peak.swap(self.held.load(Ordering::Relaxed), Ordering::Relaxed)
    }

    /// Queues a kernel launch (`cuda/launch_table.rs`) on the compute stream.
    pub(crate) fn run(&self, l: &Launch) -> Result<()> {
        if l.grid.0 == 0 || l.grid.1 == 0 || l.grid.2 == 0 {
            return Ok(()); // nothing to compute (an empty tensor)
        }
        let (f, name) = (&self.functions[l.kernel.index()], l.kernel.name()); // no lookup: the table's place
        let mut b = self.gpu.compute.launch_builder(f);
        for a in &l.args {
            match a {
                Arg::Ptr(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::F64(v) => b.arg(v),
                Arg::Shape(v) => b.arg(v),
                Arg::Tensors(v) => b.arg(&**v),
                Arg::AdamW(v) => b.arg(&**v),
            };
        }
        let config = LaunchConfig { grid_dim: l.grid, block_dim: (l.block, 1, 1), shared_mem_bytes: l.shared };
        crate::cuda::profile::timed(
            || name.to_string(),
            &self.gpu.compute,
            // SAFETY: `cuda/launch_table.rs` passes the argument list each kernel declares, and the op
            // layer checked that the buffers hold what the launch shape reaches.
            || unsafe { b.launch(config) }.map(drop).map_err(|e| anyhow!("kernel {name}: {e:?}")),
        )?;
        self.gpu.checked(|| format!("kernel {name}"))
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

    /// A buffer of `n` numbers whose contents are whatever the memory held: for outputs their
    /// kernel writes whole.
    pub fn uninit(self: &Arc<Self>, n: usize, dtype: DType) -> Buf {
        let s = &self.gpu.compute;
        // SAFETY: the caller's kernel writes every element before anything reads one.
        let data = fatal(
            "alloc",
            unsafe {
                match dtype {
                    DType::F32 => s.alloc(n).map(Data::F32),
                    DType::Bf16 => s.alloc(n).map(Data::Bf16),
                }
            }
            .map_err(|e| anyhow!("cannot allocate {n} numbers on the GPU: {e:?}")),
        );
        Buf::new(self, data)
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

    /// `n` bytes, uninitialised (see `Bytes`).
    pub(crate) fn bytes(self: &Arc<Self>, n: usize) -> Result<Bytes> {
        // SAFETY: `Bytes` are written whole by their kernel before anything reads them.
        let slice = unsafe { self.gpu.compute.alloc::<u8>(n.max(1)) }.map_err(cuda_err)?;
        self.hold(slice.num_bytes());
        Ok(Bytes { slice, dev: self.clone() })
    }

    /// `bytes` more held on this GPU (a buffer made): the count `take_peak_bytes` reads.
    fn hold(&self, bytes: usize) {
        let held = self.held.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(held, Ordering::Relaxed);
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
        self.run(&launch_table::cast_f32_to_bf16(from.device_ptr(s).0, to.device_ptr(s).0, from.len()))
    }

    /// The device copy of an index array (tokens, targets as their bits, positions).
    fn indices(&self, v: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        let mut cache = self.indices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, d)) = cache.iter().find(|(k, _)| k.as_slice() == v) {
            return Ok(d.clone());
        }
        let d = Arc::new(self.staging.lock().unwrap_or_else(|e| e.into_inner()).upload(&self.gpu, v)?);
        if cache.len() == 16 {
            cache.pop_front();
        }
        cache.push_back((v.to_vec(), d.clone()));
        Ok(d)
    }

    /// The RoPE cos/sin table of `positions` (computed on the GPU on first use, then reused by
    /// every layer of the micro-batch, forward and backward).
    pub(crate) fn rope_table(self: &Arc<Self>, positions: &[u32], rope: &Rope) -> Result<Arc<RopeTable>> {
        let same = |(p, r): &RopeKey| p.as_slice() == positions && r == rope;
        if let Some((_, t)) = self.rope_tables.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(k, _)| same(k)) {
            return Ok(t.clone()); // every layer after the first: no allocation, no launch
        }
        let half = rope.inv_freq.len();
        let n = positions.len() * half;
        let table = Arc::new(RopeTable { cos: self.uninit(n, DType::F32), sin: self.uninit(n, DType::F32) });
        let (pos, _keep) = self.index_addr(positions)?;
        let inv_freq = self.gpu.upload(&rope.inv_freq)?; // freed in stream order, after the launch
        let freqs = (inv_freq.device_ptr(&self.gpu.compute).0, rope.scale);
        let out = (table.cos.f32_addr(), table.sin.f32_addr());
        self.run(&launch_table::rope_table(pos, (positions.len(), half), freqs, out))?;
        let mut tables = self.rope_tables.lock().unwrap_or_else(|e| e.into_inner());
        if tables.len() == 4 {
            tables.pop_front();
        }
        tables.push_back(((positions.to_vec(), rope.clone()), table.clone()));
        Ok(table)
    }

    /// The address of an index array's device copy, and the copy (keep it until the launch is
    /// queued).
    pub(crate) fn index_addr(&self, v: &[u32]) -> Result<(Addr, Arc<CudaSlice<u32>>)> {
        let d = self.indices(v)?;
        let addr = d.device_ptr(&self.gpu.compute).0;
        Ok((addr, d))
    }
}

impl Drop for Device {
    /// cudarc's cuBLAS handle panics when destroying it fails, as it does after a GPU error; on
    /// top of the error being reported, that would abort the process. After an error we destroy
    /// the handle ourselves, let a failure pass (nothing is left to do about it), and leave the
    /// rest of the handle's struct (a stream reference) to the process's end.
    fn drop(&mut self) {
        let healthy = self.gpu.compute.synchronize().is_ok();
        if let Some(lt) = self.lt.take() {
            // SAFETY: the handle is destroyed once, here, after the stream's work is done.
            let _ = unsafe { cudarc::cublaslt::result::destroy_handle(lt.handle) };
        }
        // SAFETY: `blas` is taken once, here, and not used again.
        let blas = unsafe { ManuallyDrop::take(&mut self.blas) };
        if healthy {
            return drop(blas);
        }
        let handle = *blas.handle();
        std::mem::forget(blas);
        // SAFETY: the handle of a forgotten CudaBlas, destroyed only here.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(handle) };
    }
}
