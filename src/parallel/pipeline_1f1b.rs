//! # 1F1B: one forward, one backward
//!
//! AFAB (`pipeline_parallel.rs`) holds every micro-batch's activations until its backwards
//! start. 1F1B starts a micro-batch's backward as soon as the pipeline allows: each stage runs
//! the forwards that fill the stages below it (the warm-up: p − s − 1 on stage s), then pairs
//! each new forward with the oldest backward (the steady state), then runs the backwards still
//! owed (the cool-down). The bubble is AFAB's; stage s holds at most
//! p − s micro-batches instead of m. In the steady state each exchange is one paired message,
//! `send_forward_recv_backward` and `send_backward_recv_forward` (`pipeline_messages.rs`), so two
//! neighbours that both send never wait on each other.

use crate::parallel::pipeline_messages::Messages;
use crate::parallel::pipeline_parallel::{Runner, Walk};
use crate::parallel::pipeline_schedule::{one_f_one_b, Actions, Schedule, Work};
use anyhow::Result;

/// One forward, one backward: the warm-up forwards that fill the pipeline below this stage, then
/// each forward paired with the oldest backward (each exchange one paired message), then the
/// backwards still owed.
pub struct OneFOneB;

impl Walk for OneFOneB {
    fn walk(&self, run: &mut Runner, msg: &Messages) -> Result<Option<usize>> {
        let (stage, m) = (run.stage, run.plan.micro_batches);
        // warm-up: the forwards that fill the pipeline below this stage
        let warmup = self.warmup(stage.count, stage.index, m, 1);
        if let Some(k) = run.forward_each(msg, 0..warmup)? {
            return Ok(Some(k));
        }
        // steady state: one forward, one backward, each exchange one paired message
        let steady = m - warmup;
        if steady > 0 && run.stops_here()? {
            return Ok(Some(run.forwards));
        }
        let mut x = if steady > 0 { msg.recv_forward()? } else { None };
        for i in 0..steady {
            let y = run.forward(warmup + i, x.take())?;
            let dy = msg.send_forward_recv_backward(y)?;
            let dx = run.backward(i, dy)?;
            match i + 1 < steady {
                // a stop point falls between the gradient out and the next input in
                true if run.hooks.asks_before(run.forwards) => {
                    msg.send_backward(dx)?;
                    if run.stops_here()? {
                        return Ok(Some(run.forwards));
                    }
                    x = msg.recv_forward()?;
                }
                true => x = msg.send_backward_recv_forward(dx)?,
                false => msg.send_backward(dx)?,
            }
        }
        // cool-down: the backwards still owed
        run.backward_each(msg, steady..m)?;
        Ok(None)
    }
}

/// 1F1B as data (`pipeline_schedule.rs`): the same order, for replaying and drawing it.
impl Schedule for OneFOneB {
    fn actions(&self, stages: usize, stage: usize, m: usize, _: usize) -> Actions {
        one_f_one_b(m, self.warmup(stages, stage, m, 1), move |micro, _| Work { micro, chunk: 0 })
    }
    fn warmup(&self, stages: usize, stage: usize, m: usize, _: usize) -> usize {
        (stages - stage - 1).min(m)
    }
}
