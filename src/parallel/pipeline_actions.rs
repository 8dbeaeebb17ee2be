//! # Schedules walked as a list of actions: interleaved 1F1B and the zero-bubble pipelines
//!
//! AFAB and 1F1B are short loops with named messages (`pipeline_parallel.rs`,
//! `pipeline_1f1b.rs`). The interleaved schedule (a rank holds V model chunks,
//! `model/stage.rs`) and the zero-bubble ones (ZB-H1, ZBV: a backward cut into B and W) are
//! easier as data: their `Schedule` (`pipeline_schedule.rs`) lists this stage's actions — `F`,
//! `B`, and for zero bubble the input gradient alone and the weight GEMMs `W` — and `Listed` runs
//! them in order. The interleaved order is at the end of this file; the zero-bubble ones
//! (`pipeline_zero_bubble.rs`) plug into the same walk. Each result goes where the next step of its micro-batch runs, which with chunks is not
//! always a neighbour, and a message may arrive before it is needed: the `Mailbox` replays each
//! neighbour's schedule to know in which order its messages come, and keeps the early ones.

use crate::ops::tensor::Tensor;
use crate::parallel::pipeline_messages::Messages;
use crate::parallel::pipeline_parallel::{Runner, Walk};
use crate::parallel::pipeline_schedule::{one_f_one_b, sent_by, Action, Actions, Carries, Schedule, Work};
use anyhow::{bail, Context, Result};
use std::collections::HashMap;

/// A schedule walked as its list of actions, each message through the `Mailbox`.
pub struct Listed(pub &'static dyn Schedule);

impl Walk for Listed {
    fn walk(&self, run: &mut Runner, msg: &Messages) -> Result<Option<usize>> {
        let (schedule, stage, m) = (self.0, run.stage, run.plan.micro_batches);
        let mut mail = Mailbox::new(schedule, msg, m);
        for action in schedule.actions(stage.count, stage.index, m, stage.chunks) {
            let work = action.work();
            match action {
                Action::Forward(_) => {
                    if run.stops_here()? {
                        return Ok(Some(run.forwards));
                    }
                    let x = mail.take(Carries::Activations, work)?;
                    let y = run.forward_chunk((work.micro, work.chunk), x)?;
                    mail.send(Carries::Activations, work, y)?;
                }
                Action::Backward(_) => {
                    let dy = mail.take(Carries::Gradient, work)?;
                    let dx = run.backward_chunk((work.micro, work.chunk), dy)?;
                    mail.send(Carries::Gradient, work, dx)?;
                }
                // B: the weight GEMMs kept for the W (zero bubble: `pipeline_zero_bubble.rs`)
                Action::InputGrad(_) => {
                    let mut kept = schedule.keeps_w().context("pipeline: a B in a schedule that keeps no W")?;
                    let dy = mail.take(Carries::Gradient, work)?;
                    let dx = run.backward_input((work.micro, work.chunk), dy, &mut *kept)?;
                    mail.send(Carries::Gradient, work, dx)?;
                }
                Action::Weights(_) => run.weights((work.micro, work.chunk))?,
            }
        }
        Ok(None)
    }
}

/// The messages of a schedule walked as a list of actions. Activations go to the rank of the next
/// virtual stage and gradients to the previous one's: round the ring with interleaving (rank p − 1's
/// chunk c feeds rank 0's chunk c + 1), down and back up the V (rank p − 1's chunk 0 feeds its own
/// chunk 1, through the stash). With p = 2 both kinds travel between the same two ranks. Messages
/// between two ranks arrive in the order they were sent, so each rank replays its neighbours'
/// schedules to know that order: a message that arrives before it is needed waits in the stash.
struct Mailbox<'a> {
    msg: &'a Messages<'a>,
    /// Per member of the pp group: what it will send us, in its order (walked as it comes).
    expected: Vec<Box<dyn Iterator<Item = (Carries, Work)>>>,
    stash: HashMap<(Carries, Work), Tensor>,
}

impl<'a> Mailbox<'a> {
    /// The mailbox of `msg`'s rank for a step of `schedule` with `m` micro-batches.
    fn new(schedule: &dyn Schedule, msg: &'a Messages<'a>, m: usize) -> Mailbox<'a> {
        let (p, me) = (msg.stage.count, msg.stage.index);
        let stage = msg.stage;
        let expected = (0..p)
            .map(|from| {
                let sends = schedule.actions(p, from, m, stage.chunks).filter_map(move |a| sent_by(stage, from, a));
                // what this rank sends itself (the V's turn) never travels: it waits in the stash
                let to_me = sends.filter(move |&(to, _)| to == me && from != me);
                Box::new(to_me.map(|(_, what)| what)) as Box<dyn Iterator<Item = _>>
            })
            .collect();
        Mailbox { msg, expected, stash: HashMap::new() }
    }

    /// The input of this rank's `what` of `work`, if it has one: the previous virtual stage's
    /// activations (forward) or the next one's gradient (backward), received now or earlier.
    fn take(&mut self, what: Carries, work: Work) -> Result<Option<Tensor>> {
        let (stage, me) = (self.msg.stage, self.msg.stage.index);
        let u = stage.virtual_stage(work.chunk);
        let theirs = match what {
            Carries::Activations if u == 0 => return Ok(None), // tokens
            Carries::Gradient if u + 1 == stage.count * stage.chunks => return Ok(None), // the loss
            Carries::Activations => u - 1,
            Carries::Gradient => u + 1,
        };
        let (from, chunk) = stage.place_of(theirs);
        let key = (what, Work { chunk, ..work });
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

    /// Sends the result of this rank's `what` of `work` where the next step of its micro-batch runs
    /// (into its own stash when that is this rank too).
    fn send(&mut self, what: Carries, work: Work, t: Option<Tensor>) -> Result<()> {
        let action = match what {
            Carries::Activations => Action::Forward(work),
            Carries::Gradient => Action::Backward(work), // or its B: the gradient goes to the same rank
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

/// Interleaved 1F1B (Megatron): each rank holds V model chunks, looped (`model/stage.rs`), and
/// runs 1F1B over its m·V chunk-forwards: groups of p micro-batches per chunk, the chunks in order
/// forward and reversed backward.
pub struct Interleaved;

impl Schedule for Interleaved {
    fn actions(&self, stages: usize, stage: usize, m: usize, chunks: usize) -> Actions {
        // the k-th forward (or backward) of the rank
        let per = stages * chunks;
        let work = move |k: usize, forward: bool| {
            let chunk = k % per / stages;
            let chunk = if forward { chunk } else { chunks - 1 - chunk };
            Work { micro: k / per * stages + k % stages, chunk }
        };
        one_f_one_b(m * chunks, self.warmup(stages, stage, m, chunks), work)
    }
    /// 1F1B's warm-up twice over (the micro-batches come back through chunk 1, …), plus a group
    /// of p per further chunk.
    fn warmup(&self, stages: usize, stage: usize, m: usize, chunks: usize) -> usize {
        ((stages - stage - 1) * 2 + (chunks - 1) * stages).min(m * chunks)
    }
}
