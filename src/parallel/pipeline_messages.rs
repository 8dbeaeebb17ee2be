//! # A pipeline's messages: activations forward, gradients back
//!
//! What `pipeline_parallel.rs`'s stages say to each other, under the names Megatron and picotron
//! give them (`recv_forward`, `send_backward`, `send_forward_recv_backward`, …), and for the
//! schedules walked as a list of actions (interleaved, ZB-H1, ZBV) the `Mailbox`, which knows
//! in which order a neighbour's messages come by replaying its schedule.

use crate::comm::Group;
use crate::config::PpSchedule;
use crate::model::Stage;
use crate::ops::tensor::{Place, Tensor};
use crate::parallel::pipeline_schedule::{schedule, sent_by, Action, Carries, Work};
use anyhow::{bail, Result};
use std::cell::RefCell;
use std::collections::HashMap;

/// A stage's messages to its neighbours in the pp group: activations `[batch × seq, hidden]`
/// forward, their gradients backward.
pub(crate) struct Messages<'a> {
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

/// The messages of a schedule walked as a list of actions. Activations go to the rank of the next
/// virtual stage and gradients to the previous one's: round the ring with interleaving (rank p − 1's
/// chunk c feeds rank 0's chunk c + 1), down and back up the V (rank p − 1's chunk 0 feeds its own
/// chunk 1, through the stash). With p = 2 both kinds travel between the same two ranks. Messages
/// between two ranks arrive in the order they were sent, so each rank replays its neighbours'
/// schedules to know that order: a message that arrives before it is needed waits in the stash.
pub(crate) struct Mailbox<'a> {
    msg: &'a Messages<'a>,
    /// Per member of the pp group: what it will send us, in its order (walked as it comes).
    expected: Vec<Box<dyn Iterator<Item = (Carries, Work)>>>,
    stash: HashMap<(Carries, Work), Tensor>,
}

impl<'a> Mailbox<'a> {
    /// The mailbox of `msg`'s rank for a step of `kind` with `m` micro-batches.
    pub(crate) fn new(kind: PpSchedule, msg: &'a Messages<'a>, m: usize) -> Mailbox<'a> {
        let (p, me) = (msg.stage.count, msg.stage.index);
        let stage = msg.stage;
        let expected = (0..p)
            .map(|from| {
                let sends = schedule(kind, p, from, m, stage.chunks).filter_map(move |a| sent_by(stage, from, a));
                // what this rank sends itself (the V's turn) never travels: it waits in the stash
                let to_me = sends.filter(move |&(to, _)| to == me && from != me);
                Box::new(to_me.map(|(_, what)| what)) as Box<dyn Iterator<Item = _>>
            })
            .collect();
        Mailbox { msg, expected, stash: HashMap::new() }
    }

    /// The input of this rank's `what` of `w`, if it has one: the previous virtual stage's
    /// activations (forward) or the next one's gradient (backward), received now or earlier.
    pub(crate) fn take(&mut self, what: Carries, w: Work) -> Result<Option<Tensor>> {
        let (stage, me) = (self.msg.stage, self.msg.stage.index);
        let u = stage.virtual_stage(w.chunk);
        let theirs = match what {
            Carries::Activations if u == 0 => return Ok(None), // tokens
            Carries::Gradient if u + 1 == stage.count * stage.chunks => return Ok(None), // the loss
            Carries::Activations => u - 1,
            Carries::Gradient => u + 1,
        };
        let (from, chunk) = stage.place_of(theirs);
        let key = (what, Work { chunk, ..w });
        while !self.stash.contains_key(&key) {
            let next = self.expected[from].next().filter(|_| from != me);
            let Some(next) = next else {
                bail!("pipeline: rank {me} waits for {what:?} of {:?} that rank {from} never sends", key.1);
            };
            let t = self.msg.recv(Some(from))?.expect("a sender was given");
            self.stash.insert(next, t);
        }
        Ok(self.stash.remove(&key))
    }

    /// Sends the result of this rank's `what` of `w` where the next step of its micro-batch runs
    /// (into its own stash when that is this rank too).
    pub(crate) fn send(&mut self, what: Carries, w: Work, t: Option<Tensor>) -> Result<()> {
        let action = match what {
            Carries::Activations => Action::Forward(w),
            Carries::Gradient => Action::Backward(w), // or its B: the gradient goes to the same rank
        };
        match (sent_by(self.msg.stage, self.msg.stage.index, action), t) {
            (Some((to, key)), Some(t)) if to == self.msg.stage.index => {
                self.stash.insert(key, t);
                Ok(())
            }
            (Some((to, _)), t) => self.msg.send(t, Some(to)),
            (None, _) => Ok(()),
        }
    }
}
