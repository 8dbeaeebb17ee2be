//! # A pipeline's messages: activations forward, gradients back
//!
//! What `pipeline_parallel.rs`'s stages say to each other, under the names Megatron and picotron
//! give them (`recv_forward`, `send_backward`, `send_forward_recv_backward`, …). (The schedules
//! walked as a list of actions send one message at a time, through `pipeline_actions.rs`'s
//! `Mailbox`.)

use crate::comm::Group;
use crate::model::stage::Stage;
use crate::ops::tensor::{Place, Tensor};
use anyhow::Result;
use std::cell::RefCell;

/// A stage's messages to its neighbours in the pp group: activations `[batch × seq, hidden]`
/// forward, their gradients backward.
pub struct Messages<'a> {
    pub pp: &'a Group,
    pub stage: Stage,
    pub shape: [usize; 2],
    pub place: Place,
    /// Messages received so far in the step, per member of the pp group.
    pub received: RefCell<Vec<usize>>,
}

impl Messages<'_> {
    fn prev(&self) -> Option<usize> {
        (!self.stage.is_first()).then(|| self.stage.index - 1)
    }
    fn next(&self) -> Option<usize> {
        (!self.stage.is_last()).then(|| self.stage.index + 1)
    }
    /// A message lands on this rank's device (on GPUs with NCCL it never touches the host).
    pub(crate) fn recv(&self, from: Option<usize>) -> Result<Option<Tensor>> {
        let Some(from) = from else { return Ok(None) };
        self.received.borrow_mut()[from] += 1;
        self.pp.recv_tensor(&self.shape, &self.place, from).map(Some)
    }
    pub(crate) fn send(&self, t: Option<Tensor>, to: Option<usize>) -> Result<()> {
        match (t, to) {
            (Some(t), Some(to)) => self.pp.send_tensor(&t, to),
            _ => Ok(()),
        }
    }
    /// Sends `t` to `peer` and receives from the same `peer` in one step.
    fn exchange(&self, t: Option<Tensor>, peer: Option<usize>) -> Result<Option<Tensor>> {
        match (t, peer) {
            (Some(t), Some(p)) => {
                self.received.borrow_mut()[p] += 1;
                Ok(Some(self.pp.send_recv_tensor(&t, p, &self.shape, p)?))
            }
            _ => self.recv(peer), // nothing to send: a stage end (first or last)
        }
    }

    pub(crate) fn recv_forward(&self) -> Result<Option<Tensor>> {
        self.recv(self.prev())
    }
    pub(crate) fn send_forward(&self, y: Option<Tensor>) -> Result<()> {
        self.send(y, self.next())
    }
    pub(crate) fn recv_backward(&self) -> Result<Option<Tensor>> {
        self.recv(self.next())
    }
    pub(crate) fn send_backward(&self, dx: Option<Tensor>) -> Result<()> {
        self.send(dx, self.prev())
    }
    pub(crate) fn send_forward_recv_backward(&self, y: Option<Tensor>) -> Result<Option<Tensor>> {
        self.exchange(y, self.next())
    }
    pub(crate) fn send_backward_recv_forward(&self, dx: Option<Tensor>) -> Result<Option<Tensor>> {
        self.exchange(dx, self.prev())
    }
}
