//! # The GPU runtime: a device, its two streams, and the libraries we load
//!
//! A CUDA *stream* is a queue of work on the GPU; work in one stream runs in order, work in two
//! streams may overlap. Each rank owns one GPU and two streams, `compute` and `comm` (for NCCL):
//! ```text
//! compute: ─[kernel]─(record ev)───────────────────────────────(wait done)─[next kernel]
//!                         │                                         ▲
//! comm:                   └─(wait ev)─[ncclAllReduce]─(record done)─┘
//! ```
//! An *event* marks a point in a stream; another stream can wait for it without stopping the host.
//! On the `nccl` backend every tensor collective of the step runs this way (`comm/nccl.rs`); ranks
//! sharing a GPU go through host memory and the local hub (`comm/local.rs`) instead.
//!
//! cudarc loads the CUDA libraries when they are first used and panics when one is missing, so we
//! look for each library first (`libraries`) and turn "not found" into a sentence.

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::sync::Arc;

/// A CUDA library: is it on this machine (`LD_LIBRARY_PATH` and the loader's usual places)?
pub struct Library {
    pub name: &'static str,
    pub found: bool,
}

/// The libraries the CUDA backend loads, and whether each was found.
pub fn libraries() -> Vec<Library> {
    // SAFETY: these only try to open the shared libraries; no CUDA call is made.
    let found = unsafe {
        [
            ("CUDA driver (libcuda)", cudarc::driver::sys::is_culib_present()),
            ("NVRTC (libnvrtc)", cudarc::nvrtc::sys::is_culib_present()),
            ("cuBLAS (libcublas)", cudarc::cublas::sys::is_culib_present()),
            ("cuBLASLt (libcublasLt)", cudarc::cublaslt::sys::is_culib_present()),
            ("NCCL (libnccl)", cudarc::nccl::sys::is_culib_present()),
        ]
    };
    found.into_iter().map(|(name, found)| Library { name, found }).collect()
}

/// Fails with a sentence unless the library `name` (as in `libraries`) can be loaded.
pub fn require(prefix: &str) -> Result<()> {
    let libs = libraries();
    let lib = libs.iter().find(|l| l.name.starts_with(prefix)).expect("a library we know");
    if !lib.found {
        bail!(
            "{} was not found: install it, or put the folder holding it on LD_LIBRARY_PATH (cudarc looks for \
             names like libX.so and libX.so.12; make a symlink if you only have libX.so.2 or libX.so.13)",
            lib.name
        );
    }
    Ok(())
}

/// How many GPUs the driver sees; an error when there is no driver.
pub fn device_count() -> Result<usize> {
    require("CUDA driver")?;
    let n = CudaContext::device_count().map_err(|e| anyhow!("the CUDA driver cannot count GPUs: {e:?}"))?;
    Ok(n.max(0) as usize)
}

/// The free memory of GPU `ordinal`, in bytes (the primary context is opened, as a rank would).
pub fn free_memory(ordinal: usize) -> Result<usize> {
    let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
    Ok(ctx.mem_get_info().map_err(cuda_err)?.0)
}

/// One rank's GPU: its context, the compute stream and the communication stream.
#[derive(Clone)]
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub compute: Arc<CudaStream>,
    pub comm: Arc<CudaStream>,
    /// Wait for every launch and GEMM to finish and check it (`device.sync_launches`): slow, but
    /// an error is reported by the op that caused it instead of at the next read-back.
    pub sync_launches: bool,
}

impl Gpu {
    /// Opens GPU `ordinal` for the calling thread.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let count = device_count()?;
        if ordinal >= count {
            bail!("GPU {ordinal} asked for, but the driver sees {count} GPU(s)");
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow!("cannot open GPU {ordinal}: {e:?}"))?;
        // We order the two streams ourselves with events, so cudarc's per-buffer tracking is
        // turned off before any buffer exists (it would add an event per buffer use).
        // SAFETY: no allocation has been made on this context yet.
        unsafe { ctx.disable_event_tracking() };
        let compute = ctx.new_stream().map_err(|e| anyhow!("GPU {ordinal}: cannot create a stream: {e:?}"))?;
        let comm = ctx.new_stream().map_err(|e| anyhow!("GPU {ordinal}: cannot create a stream: {e:?}"))?;
        Ok(Gpu { ctx, compute, comm, sync_launches: false })
    }

    /// An event marking all work queued so far on `stream`.
    pub fn mark(&self, stream: &CudaStream) -> Result<CudaEvent> {
        stream.record_event(None).map_err(cuda_err)
    }

    /// Copies host data to a new device buffer (on the compute stream).
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.compute.clone_htod(data).map_err(cuda_err)
    }

    /// Copies a device buffer to the host; waits for the compute stream.
    pub fn download<T: DeviceRepr + Default + Clone>(&self, data: &CudaSlice<T>) -> Result<Vec<T>> {
        let host = self.compute.clone_dtoh(data).map_err(cuda_err)?;
        // an async copy into pageable memory *may* return early: wait until the numbers are there
        self.compute.synchronize().map_err(cuda_err)?;
        Ok(host)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.compute.alloc_zeros(len).map_err(cuda_err)
    }

    /// Overwrites a device buffer with host data (on the compute stream).
    pub fn write<T: DeviceRepr>(&self, data: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
        self.compute.memcpy_htod(data, dst).map_err(cuda_err)
    }
}

impl Gpu {
    /// Buffers are allocated in stream order (`cuMemAllocAsync`) from the device's default memory pool,
    /// which by default hands freed memory back to the driver at every synchronisation (the step's
    /// read of its loss and gradient norm); the next step would then map it again. A release threshold of "all"
    /// keeps it in the pool for reuse, as PyTorch's caching allocator does.
    pub fn keep_freed_memory(&self) -> Result<()> {
        use cudarc::driver::{result, sys};
        self.ctx.bind_to_thread().map_err(cuda_err)?;
        let mut threshold = u64::MAX;
        // SAFETY: the default pool of this context's device; the attribute's value is a cuuint64_t.
        unsafe {
            let pool = result::device::get_default_mem_pool(self.ctx.cu_device()).map_err(cuda_err)?;
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            result::mem_pool::set_attribute(pool, attr, &mut threshold as *mut u64 as *mut std::ffi::c_void)
                .map_err(cuda_err)
        }
    }

    /// With `sync_launches`: waits for the compute stream and names `what` if it failed.
    pub fn checked(&self, what: impl FnOnce() -> String) -> Result<()> {
        if self.sync_launches {
            self.compute.synchronize().map_err(|e| anyhow!("{}: {e:?} (device.sync_launches)", what()))?;
        }
        Ok(())
    }
}

pub fn cuda_err(e: cudarc::driver::DriverError) -> anyhow::Error {
    anyhow!("CUDA error: {e:?}")
}

/// Page-locked ("pinned") host buffers that small uploads go through, used in turn.
///
/// A copy from ordinary (pageable) memory cannot be a plain DMA: the driver first copies the
/// numbers into a pinned buffer of its own, and may make the host wait for that. From pinned
/// memory the copy is queued like a kernel and the host goes on at once. The price is that the
/// host must not overwrite a buffer until the GPU has copied out of it: each buffer keeps the event
/// its copy recorded, and is written again only `STAGING` uploads later, after that event (by
/// then long reached; the host waits only if it is that far ahead of the GPU).
#[derive(Default)]
pub struct Staging {
    slots: Vec<Pinned>,
    next: usize,
}

/// Uploads in flight at once before the host waits for the oldest.
const STAGING: usize = 8;
/// The smallest buffer, in u32: a micro-batch of 16K tokens, without growing.
const MIN_STAGING: usize = 1 << 14;

struct Pinned {
    ptr: *mut u32,
    len: usize,
    copied: Option<CudaEvent>,
}

// SAFETY: the buffer is only touched under the `Staging` owner's lock.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return; // a slot never used
        }
        if let Some(e) = self.copied.as_ref().filter(|e| !e.is_complete()) {
            let _ = e.synchronize(); // the GPU is still reading it
        }
        // SAFETY: allocated by `malloc_host` in `Staging::upload`, freed only here. A failure
        // leaves nothing to do.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

impl Staging {
    /// A new device copy of `data`, queued on `gpu`'s compute stream from pinned memory.
    pub fn upload(&mut self, gpu: &Gpu, data: &[u32]) -> Result<CudaSlice<u32>> {
        use cudarc::driver::{result, DevicePtrMut};
        if data.is_empty() {
            return gpu.upload(data); // nothing to copy (and no buffer to point at)
        }
        if self.slots.len() < STAGING {
            self.slots.push(Pinned { ptr: std::ptr::null_mut(), len: 0, copied: None });
        }
        let slot = &mut self.slots[self.next];
        self.next = (self.next + 1) % STAGING;
        if let Some(e) = &slot.copied {
            if !e.is_complete() {
                e.synchronize().map_err(cuda_err)?; // the host is STAGING uploads ahead of the GPU
            }
        }
        if slot.len < data.len() {
            let len = data.len().next_power_of_two().max(MIN_STAGING); // pinning is slow: rarely
            gpu.ctx.bind_to_thread().map_err(cuda_err)?;
            // SAFETY: a fresh allocation of `len` u32; its old buffer is freed by the replaced slot's drop.
            let ptr = unsafe { result::malloc_host(4 * len, 0) }.map_err(cuda_err)?;
            *slot = Pinned { ptr: ptr as *mut u32, len, copied: None };
        }
        // SAFETY: the slot holds at least data.len() u32 and no copy reads it any more.
        let host = unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), slot.ptr, data.len());
            std::slice::from_raw_parts(slot.ptr, data.len())
        };
        let s = &gpu.compute;
        // SAFETY: written whole by the copy below, before any kernel of this stream reads it.
        let mut dst = unsafe { s.alloc::<u32>(data.len()) }.map_err(cuda_err)?;
        // SAFETY: `host` is pinned and stays untouched until `copied` is reached; `dst` holds as many u32.
        unsafe { result::memcpy_htod_async(dst.device_ptr_mut(s).0, host, s.cu_stream()) }.map_err(cuda_err)?;
        slot.copied = Some(gpu.mark(s)?);
        Ok(dst)
    }
}
