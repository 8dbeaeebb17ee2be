//! # Collectives on GPU buffers: NCCL, or the local hub through host memory
//!
//! A `DeviceGroup` wraps a rank's `Group` and carries collectives on GPU buffers in two ways:
//!
//! ```text
//! nccl   (one GPU per rank):   compute ─record ev─▶ comm stream: wait ev, ncclAllReduce, record done
//!                              handle.wait(): the compute stream waits for `done`; the host never does
//! local  (ranks share a GPU):  GPU ─copy─▶ host ─hub (rank-order sum)─▶ host ─copy─▶ GPU
//! ```
//! NCCL needs one *communicator* per process group. Member 0 of the group asks NCCL for a unique
//! id (128 bytes) and broadcasts it over the local hub, which every run has; then each member
//! joins with its place in the group. `nccl::safe::Comm` must stay on its rank's thread, so a
//! `DeviceGroup` holding one stays there too.
//!
//! The local path is for several ranks on one GPU: exact and deterministic like the CPU backend,
//! two copies per collective. So far only `doctor`'s self-test uses either path, not the step.

use crate::comm::{Element, Group, Handle, ReduceOp};
use crate::cuda::runtime::{cuda_err, Gpu};
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::safe::{group_end, group_start, Comm, Id, NcclType};
use std::sync::Arc;

/// The number types GPU collectives carry: f32 and bf16.
pub trait DeviceElement: Element + DeviceRepr + NcclType + ValidAsZeroBits + Default {}
impl DeviceElement for f32 {}
impl DeviceElement for half::bf16 {}

/// A group's NCCL communicator, bound to its rank's GPU and communication stream.
pub struct Nccl {
    comm: Comm,
    gpu: Gpu,
}

fn nccl_err<'a>(what: &'a str, group: &'a Group) -> impl FnOnce(cudarc::nccl::result::NcclError) -> anyhow::Error + 'a {
    move |e| anyhow!("NCCL {what} on group {} failed: {e:?}", group.name())
}

impl Nccl {
    /// Every member of `group` calls this at the same point of the program.
    pub fn connect(group: &Group, gpu: &Gpu) -> Result<Nccl> {
        crate::cuda::runtime::require("NCCL")?;
        let mut id = [0f32; 128];
        if group.index() == 0 {
            let fresh = Id::new().map_err(nccl_err("unique id", group))?;
            id.iter_mut().zip(fresh.internal()).for_each(|(x, &b)| *x = b as f32);
        }
        group.broadcast(&mut id, 0)?; // 128 small integers: exact in f32
        let id = Id::uninit(id.map(|x| x as std::ffi::c_char));
        gpu.ctx.bind_to_thread().map_err(cuda_err)?;
        let comm = Comm::from_rank(gpu.comm.clone(), group.index(), group.size(), id)
            .map_err(nccl_err("communicator init", group))?;
        Ok(Nccl { comm, gpu: gpu.clone() })
    }

    /// Runs `issue` on the communication stream after everything queued so far on the compute
    /// stream; the handle marks its end.
    fn ordered<'a, T: DeviceElement>(&self, issue: impl FnOnce(&Comm) -> Result<()>) -> Result<DeviceHandle<'a, T>> {
        let ready = self.gpu.mark(&self.gpu.compute)?;
        self.gpu.comm.wait(&ready).map_err(cuda_err)?;
        issue(&self.comm)?;
        Ok(DeviceHandle::Nccl(Done { event: self.gpu.mark(&self.gpu.comm)?, gpu: self.gpu.clone() }))
    }
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::safe::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::safe::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::safe::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::safe::ReduceOp::Max,
    }
}

/// A GPU collective in flight. `wait` orders the compute stream after it: with NCCL the host
/// does not stop; with the local backend the result is copied back to the GPU.
pub enum DeviceHandle<'a, T: DeviceElement> {
    Nccl(Done),
    Staged { result: Handle<Vec<T>>, into: &'a mut CudaSlice<T>, gpu: Gpu },
    Sent(Handle<()>),
}

impl<T: DeviceElement> DeviceHandle<'_, T> {
    pub fn wait(self) -> Result<()> {
        match self {
            DeviceHandle::Nccl(done) => done.gpu.compute.wait(&done.event).map_err(cuda_err),
            DeviceHandle::Staged { result, into, gpu } => {
                let host = result.wait()?;
                if host.len() != into.len() {
                    bail!("a collective returned {} elements for a GPU buffer of {}", host.len(), into.len());
                }
                gpu.write(&host, into)
            }
            DeviceHandle::Sent(handle) => handle.wait(),
        }
    }
}

/// The end of an NCCL operation on the communication stream. Even a handle dropped without
/// `wait` makes the compute stream wait for it, so its buffers cannot be freed (in compute-stream
/// order) while NCCL still uses them.
pub struct Done {
    event: CudaEvent,
    gpu: Gpu,
}

impl Drop for Done {
    fn drop(&mut self) {
        let _ = self.gpu.compute.wait(&self.event); // after `wait`, a second wait costs nothing
    }
}

/// One rank's handle on a group for collectives on GPU buffers: through the group's NCCL
/// communicator on the `nccl` backend, through host memory and the local hub otherwise. The
/// host collectives (`comm/mod.rs`) know nothing of it: the GPU plugs in beside them.
pub struct DeviceGroup {
    group: Arc<Group>,
    gpu: Gpu,
    nccl: Option<Nccl>,
}

/// Collectives on GPU buffers, with the same meaning as their host forms in `comm/mod.rs`;
/// places (`root`, `to`, `from`) are places in the group.
impl DeviceGroup {
    /// Every member of `group` calls this at the same point; with `nccl` it joins the group's
    /// communicator on `gpu` (the calling rank's GPU).
    pub fn new(group: Arc<Group>, gpu: &Gpu, nccl: bool) -> Result<DeviceGroup> {
        let nccl = if nccl { Some(Nccl::connect(&group, gpu)?) } else { None };
        Ok(DeviceGroup { group, gpu: gpu.clone(), nccl })
    }

    /// The group whose members this handle talks to.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Whether collectives go through NCCL (else through host memory).
    pub fn is_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    pub fn all_reduce<'a, T: DeviceElement>(
        &self,
        buf: &'a mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<DeviceHandle<'a, T>> {
        if let Some(n) = self.nccl.as_ref() {
            return n.ordered(|c| {
                c.all_reduce_in_place(buf, &nccl_op(op)).map(drop).map_err(nccl_err("all_reduce", &self.group))
            });
        }
        let result = self.group.all_reduce_async(&self.gpu.download(buf)?, op);
        Ok(DeviceHandle::Staged { result, into: buf, gpu: self.gpu.clone() })
    }

    /// `recv` holds `size` times `send`'s length: every member's `send`, in rank order.
    pub fn all_gather<'a, T: DeviceElement>(
        &self,
        send: &CudaSlice<T>,
        recv: &'a mut CudaSlice<T>,
    ) -> Result<DeviceHandle<'a, T>> {
        self.check_len("all_gather", recv.len(), send.len() * self.group.size())?;
        if let Some(n) = self.nccl.as_ref() {
            return n.ordered(|c| c.all_gather(send, recv).map(drop).map_err(nccl_err("all_gather", &self.group)));
        }
        let result = self.group.all_gather_async(&self.gpu.download(send)?);
        Ok(DeviceHandle::Staged { result, into: recv, gpu: self.gpu.clone() })
    }

    /// `recv` gets this member's chunk of the reduced `send` (`size` equal chunks).
    pub fn reduce_scatter<'a, T: DeviceElement>(
        &self,
        send: &CudaSlice<T>,
        recv: &'a mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<DeviceHandle<'a, T>> {
        self.check_len("reduce_scatter", send.len(), recv.len() * self.group.size())?;
        if let Some(n) = self.nccl.as_ref() {
            return n.ordered(|c| {
                c.reduce_scatter(send, recv, &nccl_op(op)).map(drop).map_err(nccl_err("reduce_scatter", &self.group))
            });
        }
        let result = self.group.reduce_scatter_async(&self.gpu.download(send)?, op);
        Ok(DeviceHandle::Staged { result, into: recv, gpu: self.gpu.clone() })
    }

    pub fn broadcast<'a, T: DeviceElement>(
        &self,
        buf: &'a mut CudaSlice<T>,
        root: usize,
    ) -> Result<DeviceHandle<'a, T>> {
        if let Some(n) = self.nccl.as_ref() {
            let root = root as i32;
            return n
                .ordered(|c| c.broadcast_in_place(buf, root).map(drop).map_err(nccl_err("broadcast", &self.group)));
        }
        let result = self.group.broadcast_async(&self.gpu.download(buf)?, root);
        Ok(DeviceHandle::Staged { result, into: buf, gpu: self.gpu.clone() })
    }

    pub fn send<'a, T: DeviceElement>(&self, buf: &CudaSlice<T>, to: usize) -> Result<DeviceHandle<'a, T>> {
        if let Some(n) = self.nccl.as_ref() {
            return n.ordered(|c| c.send(buf, to as i32).map_err(nccl_err("send", &self.group)));
        }
        Ok(DeviceHandle::Sent(self.group.send_async(&self.gpu.download(buf)?, to)))
    }

    pub fn recv<'a, T: DeviceElement>(&self, buf: &'a mut CudaSlice<T>, from: usize) -> Result<DeviceHandle<'a, T>> {
        if let Some(n) = self.nccl.as_ref() {
            return n.ordered(|c| c.recv(buf, from as i32).map(drop).map_err(nccl_err("recv", &self.group)));
        }
        let result = self.group.recv_async(buf.len(), from);
        Ok(DeviceHandle::Staged { result, into: buf, gpu: self.gpu.clone() })
    }

    /// Sends `send` to `to` while receiving `recv` from `from`; NCCL runs both as one group so
    /// that neither side can block the other.
    pub fn send_recv<'a, T: DeviceElement>(
        &self,
        send: &CudaSlice<T>,
        to: usize,
        recv: &'a mut CudaSlice<T>,
        from: usize,
    ) -> Result<DeviceHandle<'a, T>> {
        if let Some(n) = self.nccl.as_ref() {
            return n.ordered(|c| {
                group_start().map_err(nccl_err("group start", &self.group))?;
                let sent = c.send(send, to as i32).map_err(nccl_err("send", &self.group));
                let received = c.recv(recv, from as i32).map(drop).map_err(nccl_err("recv", &self.group));
                group_end().map_err(nccl_err("group end", &self.group))?;
                sent.and(received)
            });
        }
        let result = self.group.send_recv_async(&self.gpu.download(send)?, to, recv.len(), from);
        Ok(DeviceHandle::Staged { result, into: recv, gpu: self.gpu.clone() })
    }

    fn check_len(&self, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            bail!("{what} on group {}: buffer of {got} elements, expected {want}", self.group.name());
        }
        Ok(())
    }
}
