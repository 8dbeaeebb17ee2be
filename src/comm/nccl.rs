//! # NCCL: collectives between GPUs on device buffers
//!
//! On the `nccl` backend (one GPU per rank) the launcher plugs an `Nccl` link into every group
//! of every rank; the tensor collectives of `comm/tensors.rs` then call it for GPU tensors:
//!
//! ```text
//! compute: ─[kernels]─(record ready)──────────────────────────────────────(wait done)─[kernels]
//!                           │                                                  ▲
//! comm:                     └─(wait ready)─[ncclAllReduce on the buffer]─(record done)
//! host:    queues all of it and goes on; it never waits for the GPU here
//! ```
//! `ready` orders the collective after the kernels that wrote its buffer; `done` (the `Fence`)
//! orders the kernels that read the result after it. While the collective runs on the comm
//! stream the compute stream goes on with whatever does not need it: a DP bucket's all-reduce
//! under the rest of backward, the TP input-gradient all-reduce under the weight-gradient GEMMs.
//!
//! NCCL needs one *communicator* per process group. Member 0 of the group asks NCCL for a unique
//! id (128 bytes) and broadcasts it over the hub, which every run has (across processes, the
//! hubs' bridge carries it, over MPI or TCP: `comm/wires/remote.rs`); then each member joins with its
//! place in the group. A communicator is used only from its rank's thread.
//! Errors come back as NCCL's own sentence naming the call and the group; dropping a
//! communicator never panics (a run that failed must still end cleanly).

use crate::comm::device_link::{DeviceLink, Fence, Ran};
use crate::comm::{Group, ReduceOp};
use crate::cuda::device::Data;
use crate::cuda::runtime::{cuda_err, Gpu};
use crate::ops::tensor::Tensor;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream, DevicePtr};
use cudarc::nccl::{result, sys};
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// A group's NCCL communicator, bound to its rank's GPU and communication stream.
pub struct Nccl {
    comm: sys::ncclComm_t,
    gpu: Gpu,
    group: String,
    size: usize,
    /// Set when the run is traced: every call is timed (`time_calls`).
    clock: OnceLock<Arc<Clock>>,
}

/// The GPU's clock read against the host's: an event the GPU passed at host time `host`. A call
/// timed by two events ran from `host` + (its first event − `event`) to `host` + (its second − `event`).
struct Clock {
    host: Instant,
    event: CudaEvent,
}

impl Clock {
    /// When the GPU reached `event`, on the host's clock (waits until it has).
    fn at(&self, event: &CudaEvent) -> Option<Instant> {
        event.synchronize().ok()?;
        let ms = self.event.elapsed_ms(event).ok()?;
        Some(self.host + Duration::from_secs_f64(ms.max(0.0) as f64 / 1e3))
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: our communicator, made by `connect`, not used after this. Abort, not destroy:
        // it returns even when a peer is gone. An error here has nobody left to tell.
        let _ = unsafe { result::comm_abort(self.comm) };
    }
}

/// NCCL's sentence for a failed call.
fn nccl_error(what: &str, group: &str, e: result::NcclError) -> anyhow::Error {
    // SAFETY: ncclGetErrorString returns a static string for any result code.
    let text = unsafe { std::ffi::CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
    anyhow!("NCCL {what} on group {group} failed: {}", text.to_string_lossy())
}

/// A GPU tensor's buffer for NCCL: its address, its number of elements and NCCL's name of its
/// type. Both copies of a mixed-precision weight cannot move in one call, so it is refused.
fn buffer(t: &Tensor, stream: &CudaStream) -> Result<(*mut c_void, usize, sys::ncclDataType_t)> {
    let buf = t.gpu().ok_or_else(|| anyhow!("an NCCL collective was given a CPU tensor"))?;
    let (ptr, ty) = match &buf.data {
        Data::F32(s) => (s.device_ptr(stream).0, sys::ncclDataType_t::ncclFloat32),
        Data::Bf16(s) => (s.device_ptr(stream).0, sys::ncclDataType_t::ncclBfloat16),
        Data::Mixed { .. } => bail!("an NCCL collective on a mixed-precision weight: move its master or its copy"),
    };
    Ok((ptr as *mut c_void, t.numel(), ty))
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

impl Nccl {
    /// Every member of `group` calls this at the same point of the program, on its rank's thread.
    pub fn connect(group: &Group, gpu: &Gpu) -> Result<Nccl> {
        crate::cuda::runtime::require("NCCL")?;
        let name = group.name().to_string();
        let mut id = [0f32; 128];
        if group.index() == 0 {
            let fresh = result::get_uniqueid().map_err(|e| nccl_error("unique id", &name, e))?;
            id.iter_mut().zip(fresh.internal).for_each(|(x, b)| *x = b as f32);
        }
        group.broadcast(&mut id, 0)?; // 128 small integers: exact in f32
        let unique = sys::ncclUniqueId { internal: id.map(|x| x as std::ffi::c_char) };
        gpu.ctx.bind_to_thread().map_err(cuda_err)?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: a valid out-pointer; every member passes the same id, the group's size and its place.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), group.size() as i32, unique, group.index() as i32)
                .map_err(|e| nccl_error("communicator init", &name, e))?;
            comm.assume_init()
        };
        Ok(Nccl { comm, gpu: gpu.clone(), group: name, size: group.size(), clock: OnceLock::new() })
    }

    /// Queues `issue` on the communication stream after everything queued so far on the compute
    /// stream; the fence orders the compute stream after it. When timing, two timing events
    /// around the call say when it ran.
    fn ordered(
        &self,
        what: &str,
        issue: impl FnOnce(sys::cudaStream_t) -> Result<(), result::NcclError>,
    ) -> Result<Fence> {
        let (gpu, comm) = (&self.gpu, &self.gpu.comm);
        let ready = gpu.mark(&gpu.compute)?;
        comm.wait(&ready).map_err(cuda_err)?;
        let mark = || comm.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(cuda_err); // timed
        let begin = self.clock.get().map(|clock| mark().map(|begin| (clock.clone(), begin))).transpose()?;
        issue(comm.cu_stream() as sys::cudaStream_t).map_err(|e| nccl_error(what, &self.group, e))?;
        let mut ran: Option<Ran> = None;
        if let Some((clock, begin)) = begin {
            let end = mark()?;
            ran = Some(Box::new(move || Some((clock.at(&begin)?, clock.at(&end)?))));
        }
        let done = gpu.mark(comm)?;
        let compute = gpu.compute.clone();
        Ok(Fence(Box::new(move || compute.wait(&done).map_err(cuda_err)), ran))
    }

    fn check_len(&self, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            bail!("{what} on group {}: a tensor of {got} elements, expected {want}", self.group);
        }
        Ok(())
    }
}

impl DeviceLink for Nccl {
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<Fence> {
        let (p, n, ty) = buffer(t, &self.gpu.comm)?;
        // SAFETY: in place on a live buffer of n elements of type ty, on this rank's comm stream.
        self.ordered("all_reduce", |s| unsafe { result::all_reduce(p, p, n, ty, nccl_op(op), self.comm, s).map(drop) })
    }

    fn all_gather(&self, t: &Tensor, into: &mut Tensor) -> Result<Fence> {
        let ((p, n, ty), (q, m, _)) = (buffer(t, &self.gpu.comm)?, buffer(into, &self.gpu.comm)?);
        self.check_len("all_gather", m, n * self.size)?;
        // SAFETY: `into` holds size × n elements of the same type (`comm/tensors.rs` made it so).
        self.ordered("all_gather", |s| unsafe { result::all_gather(p, q, n, ty, self.comm, s).map(drop) })
    }

    fn reduce_scatter(&self, t: &Tensor, into: &mut Tensor, op: ReduceOp) -> Result<Fence> {
        let ((p, n, ty), (q, m, _)) = (buffer(t, &self.gpu.comm)?, buffer(into, &self.gpu.comm)?);
        self.check_len("reduce_scatter", n, m * self.size)?;
        // SAFETY: `t` holds size × m elements, `into` m, of the same type.
        let op = nccl_op(op);
        self.ordered("reduce_scatter", |s| unsafe { result::reduce_scatter(p, q, m, ty, op, self.comm, s).map(drop) })
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<Fence> {
        let (p, n, ty) = buffer(t, &self.gpu.comm)?;
        // SAFETY: in place on a live buffer of n elements.
        self.ordered("broadcast", |s| unsafe { result::broadcast(p, p, n, ty, root as i32, self.comm, s).map(drop) })
    }

    fn send_recv(&self, send: Option<(&Tensor, usize)>, recv: Option<(&mut Tensor, usize)>) -> Result<Fence> {
        let send = send.map(|(t, to)| buffer(t, &self.gpu.comm).map(|b| (b, to))).transpose()?;
        let recv = recv.map(|(t, from)| buffer(t, &self.gpu.comm).map(|b| (b, from))).transpose()?;
        // SAFETY: live buffers of the given sizes; the peer posts the matching recv/send. Inside
        // one NCCL group the send and the receive progress together, so neither blocks the other.
        self.ordered("send/recv", |s| unsafe {
            result::group_start()?;
            let sent =
                send.map_or(Ok(()), |((p, n, ty), to)| result::send(p, n, ty, to as i32, self.comm, s).map(drop));
            let received =
                recv.map_or(Ok(()), |((q, n, ty), from)| result::recv(q, n, ty, from as i32, self.comm, s).map(drop));
            let ended = result::group_end().map(drop); // the group is closed even when a call failed
            sent.and(received).and(ended)
        })
    }

    fn all_to_all(&self, t: &Tensor, send: &[usize], into: &mut Tensor, recv: &[usize]) -> Result<Fence> {
        let ((p, n, ty), (q, m, _)) = (buffer(t, &self.gpu.comm)?, buffer(into, &self.gpu.comm)?);
        self.check_len("all_to_all", n, send.iter().sum())?;
        self.check_len("all_to_all", m, recv.iter().sum())?;
        let size = t.dtype().size();
        let starts =
            |counts: &[usize]| counts.iter().scan(0, |at, c| Some(std::mem::replace(at, *at + c))).collect::<Vec<_>>();
        let (from, to) = (starts(send), starts(recv));
        // SAFETY: every piece lies inside its live buffer (offsets from the counts checked above);
        // inside one NCCL group every send and receive progresses together (NCCL has no
        // all-to-all of its own: this is how it is done with NCCL). Empty pieces are skipped on
        // both sides, which agree on the counts.
        self.ordered("all_to_all", |s| unsafe {
            result::group_start()?;
            let mut first = Ok(());
            for peer in 0..self.size {
                if send[peer] > 0 {
                    let at = (p as *mut u8).add(from[peer] * size) as *mut c_void;
                    first = first.and(result::send(at, send[peer], ty, peer as i32, self.comm, s).map(drop));
                }
                if recv[peer] > 0 {
                    let at = (q as *mut u8).add(to[peer] * size) as *mut c_void;
                    first = first.and(result::recv(at, recv[peer], ty, peer as i32, self.comm, s).map(drop));
                }
            }
            let ended = result::group_end().map(drop); // closed even when a call failed
            first.and(ended)
        })
    }

    fn time_calls(&self) -> Result<()> {
        if self.clock.get().is_some() {
            return Ok(());
        }
        // an event on the comm stream, waited for: the GPU passed it just before the host's now
        let event = self.gpu.comm.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(cuda_err)?; // timed
        event.synchronize().map_err(cuda_err)?;
        let _ = self.clock.set(Arc::new(Clock { host: Instant::now(), event }));
        Ok(())
    }
}
