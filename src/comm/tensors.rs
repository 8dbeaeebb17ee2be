//! # Collectives on tensors: one call, whatever the device and the backend
//!
//! The lessons (`parallel/`, `model/optimizer.rs`, `train/step.rs`, `train/gradients.rs`) move
//! tensors with these calls: `tp.all_reduce_tensor(&mut y, Sum)`, `pp.send_recv_tensor(&y, next, shape, next)`,
//! … Where the tensors live decides how they travel, not the lesson:
//!
//! ```text
//! CPU tensor                         host memory ──── hub (comm/local.rs) ──── host memory
//! GPU tensor, ranks sharing a GPU    GPU ─copy─▶ host ──── hub ──── host ─copy─▶ GPU
//! GPU tensor, one GPU per rank       GPU ════ NCCL on the rank's comm stream ════ GPU
//!   (the `nccl` backend)             no host copy, and the host never waits: the call is queued
//!                                    after the compute stream's work so far, and `wait` makes the
//!                                    compute stream (not the host) wait for it
//! ```
//! The third way is a `DeviceLink` that the launcher plugs into each group on the `nccl` backend
//! (`comm/nccl.rs`); this file knows it only as a trait (`comm/device_link.rs`), so the
//! collective API names no CUDA. The hub sums in rank order (the same bits every run); NCCL sums in its own order, equal
//! up to rounding, and a bf16 tensor is summed in bf16 by NCCL and in f32 by the hub.
//!
//! The asynchronous forms take their tensor *by value* and give it back from `wait`: a buffer
//! NCCL reads or writes on the comm stream cannot be dropped (and its memory reused by the
//! compute stream) while the call is in flight.

use super::cost::{self, Call};
use super::device_link::{DeviceLink, Fence};
use super::local::Op;
use super::{values, Group, Handle, ReduceOp};
use crate::ops;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::types::DType;
use anyhow::{bail, Result};
use std::time::Instant;

/// A collective on a tensor in flight; `wait` gives the tensor back, holding the result.
pub struct Pending {
    tensor: Tensor,
    how: How,
    /// A tensor a queued send still reads: kept alive until the call is over.
    _sent: Option<Tensor>,
    /// Values that travelled in another format: (the wire's, the caller's), converted back on
    /// arrival (`all_reduce_tensor_async_as`).
    arrives: Option<(DType, DType)>,
}

/// The compute stream's wait for a call queued on the GPU (`Fence`).
type Wait = Box<dyn FnOnce() -> Result<()>>;

enum How {
    Device(Wait),
    Host(Handle<Vec<f32>>),
    Done,
}

impl Pending {
    pub fn wait(self) -> Result<Tensor> {
        let mut tensor = self.tensor;
        match self.how {
            How::Device(wait) => wait()?,
            How::Host(handle) => {
                let values = handle.wait()?;
                if values.len() != tensor.numel() {
                    bail!("a collective returned {} values for a tensor of {}", values.len(), tensor.numel());
                }
                tensor.write(&values);
            }
            How::Done => {}
        }
        Ok(match self.arrives {
            // a GPU's buffer in the wire's format converts back; the CPU's f32 numbers are rounded
            // to it, as they would have arrived
            Some((_, back)) if tensor.dtype() != back => ops::convert(&tensor, back),
            Some((wire, _)) => ops::convert(&tensor, wire),
            None => tensor,
        })
    }
}

impl Group {
    /// Plugs in how this group moves GPU tensors without the host (the launcher, on `nccl`).
    pub fn attach_device_link(&self, link: Box<dyn DeviceLink>) {
        let _ = self.device.set(link); // a group gets its link once, when its rank opens its GPU
    }

    /// The device link, for tensors on `place` when it is a GPU and the group has one.
    fn link_on(&self, place: &Place) -> Option<&dyn DeviceLink> {
        matches!(place, Place::Cuda(_)).then(|| self.device.get().map(|l| l.as_ref())).flatten()
    }

    /// Whether tensors on `place` travel through the group's device link (NCCL), not the host.
    pub fn moves_on_device(&self, place: &Place) -> bool {
        self.link_on(place).is_some()
    }

    fn link_for(&self, t: &Tensor) -> Option<&dyn DeviceLink> {
        self.link_on(&t.place())
    }

    /// The fence's wait. In a traced run the call also goes on the comm lane, named like the
    /// hub's calls and "(NCCL)", with the times the GPU ran it; when the link times its calls,
    /// that time also goes to the ledger.
    fn traced(&self, call: Call, what: impl FnOnce() -> String, fence: Fence) -> Wait {
        if let Some(ran) = fence.1 {
            let ran = cost::shared(ran);
            if let Some((trace, rank)) = self.trace.get() {
                let ran = ran.clone();
                trace.record_later(*rank, format!("{} {} (NCCL)", what(), self.name()), Instant::now(), Box::new(ran));
            }
            self.ledger.took_later(call, Box::new(ran));
        }
        fence.0
    }

    /// Counts a call of `bytes` (B in `comm/cost.rs`) in the ledger; a group of one moves nothing.
    fn count(&self, call: Call, bytes: usize) {
        if self.size() > 1 {
            self.ledger.count(call, bytes);
        }
    }

    /// Starts an in-place all-reduce of `t` over the group.
    pub fn all_reduce_tensor_async(&self, t: Tensor, op: ReduceOp) -> Result<Pending> {
        self.start_all_reduce(t, op, None)
    }

    /// Starts an all-reduce of `t` whose values travel as `wire` (bf16: half the bytes of f32):
    /// converted for the wire, and back when they land, so `wait` gives `t`'s format. On the CPU,
    /// whose tensors hold f32, they are rounded to `wire` before and after (the hub sums in f32,
    /// as it does a GPU's bf16 tensors), and the ledger counts the wire's bytes.
    pub fn all_reduce_tensor_async_as(&self, t: Tensor, op: ReduceOp, wire: DType) -> Result<Pending> {
        match t.dtype() == wire {
            true => self.all_reduce_tensor_async(t, op),
            false => self.start_all_reduce(ops::convert(&t, wire), op, Some((wire, t.dtype()))),
        }
    }

    fn start_all_reduce(&self, mut t: Tensor, op: ReduceOp, arrives: Option<(DType, DType)>) -> Result<Pending> {
        t.written();
        self.count(Call::AllReduce, sent_as(&t, arrives));
        let how = match self.link_for(&t) {
            _ if self.size() == 1 => How::Done,
            Some(link) => {
                let n = t.numel();
                let what = || format!("{} of {}", Op::AllReduce(op).name(), values(n));
                How::Device(self.traced(Call::AllReduce, what, link.all_reduce(&mut t, op)?))
            }
            None => How::Host(self.all_reduce_async(&t.host_view(), op)),
        };
        Ok(Pending { tensor: t, how, _sent: None, arrives })
    }

    /// `t` becomes the reduction of every member's `t`.
    pub fn all_reduce_tensor(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        t.written();
        self.count(Call::AllReduce, sent(t));
        match self.link_for(t) {
            _ if self.size() == 1 => Ok(()),
            Some(link) => {
                let n = t.numel();
                let what = || format!("{} of {}", Op::AllReduce(op).name(), values(n));
                self.traced(Call::AllReduce, what, link.all_reduce(t, op)?)()
            }
            None => t.update_host(|v| self.all_reduce(v, op)), // in place on the CPU
        }
    }

    /// Every member's `t`, concatenated in rank order along the first dimension.
    pub fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        let (into, how) = self.start_all_gather(t)?;
        Pending { tensor: into, how, _sent: None, arrives: None }.wait() // `t` outlives the wait
    }

    /// Starts `all_gather_tensor` (FSDP gathers the next unit's weights with it while the
    /// current one computes).
    pub fn all_gather_tensor_async(&self, t: Tensor) -> Result<Pending> {
        let (into, how) = self.start_all_gather(&t)?;
        Ok(Pending { tensor: into, how, _sent: Some(t), arrives: None })
    }

    fn start_all_gather(&self, t: &Tensor) -> Result<(Tensor, How)> {
        let mut shape = t.shape().to_vec();
        shape[0] *= self.size();
        let mut into = Tensor::empty_as(&shape, t); // written whole
        self.count(Call::AllGather, sent(&into));
        let how = match self.link_for(t) {
            Some(link) => {
                let what = || format!("all_gather of {}", values(t.numel()));
                How::Device(self.traced(Call::AllGather, what, link.all_gather(t, &mut into)?))
            }
            None => How::Host(self.all_gather_async(&t.host_view())),
        };
        Ok((into, how))
    }

    /// This member's chunk (along the first dimension) of the reduction of every member's `t`.
    pub fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (into, how) = self.start_reduce_scatter(t, op, None)?;
        Pending { tensor: into, how, _sent: None, arrives: None }.wait() // `t` outlives the wait
    }

    /// Starts `reduce_scatter_tensor` (ZeRO reduce-scatters a bucket of gradients with it while
    /// backward goes on).
    pub fn reduce_scatter_tensor_async(&self, t: Tensor, op: ReduceOp) -> Result<Pending> {
        let (into, how) = self.start_reduce_scatter(&t, op, None)?;
        Ok(Pending { tensor: into, how, _sent: Some(t), arrives: None })
    }

    /// Starts `reduce_scatter_tensor` with the values travelling as `wire`, as
    /// `all_reduce_tensor_async_as` does.
    pub fn reduce_scatter_tensor_async_as(&self, t: Tensor, op: ReduceOp, wire: DType) -> Result<Pending> {
        if t.dtype() == wire {
            return self.reduce_scatter_tensor_async(t, op);
        }
        let (arrives, t) = (Some((wire, t.dtype())), ops::convert(&t, wire));
        let (into, how) = self.start_reduce_scatter(&t, op, arrives)?;
        Ok(Pending { tensor: into, how, _sent: Some(t), arrives })
    }

    fn start_reduce_scatter(&self, t: &Tensor, op: ReduceOp, arrives: Option<(DType, DType)>) -> Result<(Tensor, How)> {
        let (mut shape, n) = (t.shape().to_vec(), self.size());
        if shape[0] % n != 0 {
            bail!("reduce_scatter on group {}: {} rows do not split into {n} equal chunks", self.name(), shape[0]);
        }
        shape[0] /= n;
        let mut into = Tensor::empty_as(&shape, t); // written whole
        self.count(Call::ReduceScatter, sent_as(t, arrives));
        let how = match self.link_for(t) {
            Some(link) => {
                let what = || format!("{} of {}", Op::ReduceScatter(op).name(), values(t.numel()));
                How::Device(self.traced(Call::ReduceScatter, what, link.reduce_scatter(t, &mut into, op)?))
            }
            None => How::Host(self.reduce_scatter_async(&t.host_view(), op)),
        };
        Ok((into, how))
    }

    /// Every member's `t` becomes member `root`'s.
    pub fn broadcast_tensor(&self, t: &mut Tensor, root: usize) -> Result<()> {
        t.written();
        if self.size() == 1 {
            return Ok(()); // alone: nothing to move (and on a GPU, no wait for it)
        }
        self.count(Call::Broadcast, sent(t));
        match self.link_for(t) {
            Some(link) => {
                let n = t.numel();
                let what = || format!("{} of {}", Op::Broadcast { root }.name(), values(n));
                self.traced(Call::Broadcast, what, link.broadcast(t, root)?)()
            }
            None => {
                let values = self.broadcast_async(&t.host_view(), root).wait()?;
                t.write(&values);
                Ok(())
            }
        }
    }

    /// Sends `t` to member `to`.
    pub fn send_tensor(&self, t: &Tensor, to: usize) -> Result<()> {
        self.count(Call::P2p, sent(t));
        match self.link_for(t) {
            Some(link) => {
                let what = || format!("send of {} to {to}", values(t.numel()));
                self.traced(Call::P2p, what, link.send_recv(Some((t, to)), None)?)()
            }
            None => self.send(&t.host_view(), to),
        }
    }

    /// Receives a tensor of `shape` from member `from`, onto `place` (in its compute dtype).
    pub fn recv_tensor(&self, shape: &[usize], place: &Place, from: usize) -> Result<Tensor> {
        let mut t = Tensor::empty_on(shape, place, place.dtype());
        self.recv_tensor_into(&mut t, from)?;
        Ok(t)
    }

    /// Receives member `from`'s tensor into `t` (its shape, place and dtype are the sender's).
    pub fn recv_tensor_into(&self, t: &mut Tensor, from: usize) -> Result<()> {
        t.written();
        self.count(Call::P2p, sent(t));
        match self.link_for(t) {
            Some(link) => {
                let n = t.numel();
                self.traced(
                    Call::P2p,
                    || format!("recv of {} from {from}", values(n)),
                    link.send_recv(None, Some((t, from)))?,
                )()
            }
            None => {
                t.write(&self.recv(t.numel(), from)?);
                Ok(())
            }
        }
    }

    /// Starts sending `send` to member `to` while receiving a tensor of `shape` from member
    /// `from` (onto the same place, in its compute dtype), as a pipeline stage or a ring member
    /// does.
    pub fn send_recv_tensor_async(&self, send: Tensor, to: usize, shape: &[usize], from: usize) -> Result<Pending> {
        let place = send.place();
        self.count_send_recv(&send, shape);
        let Some(link) = self.link_on(&place) else {
            let values = self.send_recv_async(&send.host_view(), to, shape.iter().product(), from);
            let landing = Tensor::empty_on(shape, &place, place.dtype());
            return Ok(Pending { tensor: landing, how: How::Host(values), _sent: None, arrives: None });
        };
        let mut recv = Tensor::empty_on(shape, &place, place.dtype());
        let what = send_recv_name((send.numel(), to), (recv.numel(), from));
        let wait = self.traced(Call::P2p, what, link.send_recv(Some((&send, to)), Some((&mut recv, from)))?);
        Ok(Pending { tensor: recv, how: How::Device(wait), _sent: Some(send), arrives: None })
    }

    /// `send_recv_tensor_async`, waited for.
    pub fn send_recv_tensor(&self, send: &Tensor, to: usize, shape: &[usize], from: usize) -> Result<Tensor> {
        let place = send.place();
        self.count_send_recv(send, shape);
        let Some(link) = self.link_on(&place) else {
            let values = self.send_recv(&send.host_view(), to, shape.iter().product(), from)?;
            return Ok(Tensor::from_host(shape, values, &place));
        };
        let mut recv = Tensor::empty_on(shape, &place, place.dtype());
        let what = send_recv_name((send.numel(), to), (recv.numel(), from));
        self.traced(Call::P2p, what, link.send_recv(Some((send, to)), Some((&mut recv, from)))?)()?;
        Ok(recv)
    }

    /// The rows of `t` `[rows, cols]` to the members: `send[j]` rows to member j, in member
    /// order; returns the rows received, `recv[i]` from member i, in member order (the expert
    /// parallel dispatch and its way back).
    pub fn all_to_all_tensor(&self, t: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        let (cols, place) = (t.cols(), t.place());
        let shape = [recv.iter().sum::<usize>(), cols];
        if send.iter().sum::<usize>() != t.rows() || send.len() != self.size() || recv.len() != self.size() {
            bail!(
                "all_to_all on group {}: {} rows with send counts {send:?} and receive counts {recv:?} for {} members",
                self.name(),
                t.rows(),
                self.size()
            );
        }
        self.count(Call::AllToAll, sent(t));
        if self.size() == 1 {
            return Ok(t.clone());
        }
        let values = |rows: &[usize]| rows.iter().map(|r| r * cols).collect::<Vec<_>>();
        let Some(link) = self.link_on(&place) else {
            let got = self.all_to_all(&t.host_view(), &values(send), &values(recv))?;
            return Ok(Tensor::from_host(&shape, got, &place));
        };
        let mut into = Tensor::empty_on(&shape, &place, t.dtype());
        let what = || format!("all_to_all of {}", super::values(t.numel()));
        self.traced(Call::AllToAll, what, link.all_to_all(t, &values(send), &mut into, &values(recv))?)()?;
        Ok(into)
    }

    /// A send_recv moves both ways at once: its B is the larger direction (in the sent dtype).
    fn count_send_recv(&self, send: &Tensor, shape: &[usize]) {
        let received = shape.iter().product::<usize>() * send.place().dtype().size();
        self.count(Call::P2p, sent(send).max(received));
    }
}

/// The bytes a tensor is as a message: its numbers in the dtype the kernels read.
fn sent(t: &Tensor) -> usize {
    t.numel() * t.dtype().size()
}

/// The bytes `t` puts on the wire when its values travel as `arrives` says (its wire format).
fn sent_as(t: &Tensor, arrives: Option<(DType, DType)>) -> usize {
    arrives.map_or_else(|| sent(t), |(wire, _)| t.numel() * wire.size())
}

/// A traced send_recv's name, made only when the run is traced.
fn send_recv_name((sent, to): (usize, usize), (received, from): (usize, usize)) -> impl FnOnce() -> String {
    move || format!("send_recv of {} to {to}, {} from {from}", values(sent), values(received))
}
