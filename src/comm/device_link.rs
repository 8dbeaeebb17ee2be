//! # The device link: how a group moves GPU tensors without the host
//!
//! A trait, so that the collective API (`comm/tensors.rs`) can call NCCL without naming it: the
//! launcher plugs `comm/nccl.rs`'s implementation into every group on the `nccl` backend.

use crate::ops::tensor::Tensor;
use crate::ops::types::ReduceOp;
use anyhow::Result;
use std::time::Instant;

/// The end of a call queued on a GPU: running the first part makes the rank's compute stream
/// wait for the call; dropping it unrun does the same (so nothing the call uses is freed too
/// early). The second, when the link times its calls, says when the GPU ran it.
pub struct Fence(pub Box<dyn FnOnce() -> Result<()>>, pub Option<Ran>);

/// When a call ran on the GPU, on the host's clock: asked for once the run is over (it waits for
/// the GPU to get there); `None` if the GPU cannot say.
pub type Ran = Box<dyn FnOnce() -> Option<(Instant, Instant)> + Send>;

/// Collectives on GPU tensors without the host (NCCL). Every call is queued and returns at once;
/// places (`root`, `to`, `from`) are places in the group.
pub trait DeviceLink {
    fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<Fence>;
    /// `into` holds every member's `t`, in rank order.
    fn all_gather(&self, t: &Tensor, into: &mut Tensor) -> Result<Fence>;
    /// `into` gets this member's chunk of the reduced `t` (`size` equal chunks).
    fn reduce_scatter(&self, t: &Tensor, into: &mut Tensor, op: ReduceOp) -> Result<Fence>;
    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<Fence>;
    /// A send and a receive as one call, so that two members sending to each other never wait
    /// on each other; either may be absent.
    fn send_recv(&self, send: Option<(&Tensor, usize)>, recv: Option<(&mut Tensor, usize)>) -> Result<Fence>;
    /// Member j gets the `send[j]` elements of `t` after those for the members before it; `into`
    /// gets `recv[i]` elements from each member i, in member order (grouped sends and receives).
    fn all_to_all(&self, t: &Tensor, send: &[usize], into: &mut Tensor, recv: &[usize]) -> Result<Fence>;
    /// From now on, time every call on the GPU (a traced run draws them on the comm lane).
    fn time_calls(&self) -> Result<()>;
}
