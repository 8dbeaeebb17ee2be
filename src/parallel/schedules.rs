//! # Every pipeline schedule by its config name
//!
//! Each pipeline lesson defines its schedule in its own file: AFAB (`pipeline_parallel.rs`,
//! written down in `pipeline_schedule.rs`), 1F1B (`pipeline_1f1b.rs`), interleaved
//! (`pipeline_actions.rs`), ZB-H1 and ZBV (`pipeline_zero_bubble.rs`). `parallel.pp_schedule`
//! names one; this is the one place, above the lessons, that maps the names to them: how a stage
//! walks its step (`Walk`), and the schedule as data (`Schedule`: the stage's layout, its order,
//! what it holds). The composition root, `ferrotron schedule` and `ferrotron memory` look them
//! up here; and since a stop inside a step (`train/driver.rs`) must know what the other stages
//! sent before it, every walk is wrapped here in one that replays their schedules (`Drained`).

use crate::config::{ParallelConfig, PpSchedule};
use crate::model::stage::Stage;
use crate::parallel::pipeline_1f1b::OneFOneB;
use crate::parallel::pipeline_actions::{Interleaved, Listed};
use crate::parallel::pipeline_messages::Messages;
use crate::parallel::pipeline_parallel::{Afab, Runner, Walk};
use crate::parallel::pipeline_schedule::{sent_by, Action, Schedule};
use crate::parallel::pipeline_zero_bubble::{ZbH1, Zbv};
use anyhow::Result;

/// The schedule `kind` names, as data.
pub fn schedule_of(kind: PpSchedule) -> &'static dyn Schedule {
    match kind {
        PpSchedule::Afab => &Afab,
        PpSchedule::OneFOneB => &OneFOneB,
        PpSchedule::Interleaved => &Interleaved,
        PpSchedule::ZbH1 => &ZbH1,
        PpSchedule::Zbv => &Zbv,
    }
}

/// How a stage walks a step of `kind`: AFAB and 1F1B as loops, the others as lists of actions;
/// each drained after a stop.
pub fn walk_of(kind: PpSchedule) -> &'static dyn Walk {
    match kind {
        PpSchedule::Afab => &Drained(&Afab, &Afab),
        PpSchedule::OneFOneB => &Drained(&OneFOneB, &OneFOneB),
        PpSchedule::Interleaved => &Drained(&Listed(&Interleaved), &Interleaved),
        PpSchedule::ZbH1 => &Drained(&Listed(&ZbH1), &ZbH1),
        PpSchedule::Zbv => &Drained(&Listed(&Zbv), &Zbv),
    }
}

/// A walk that, when the driver's hooks stop it (`train/driver.rs`), takes in what the other
/// stages sent before they stopped too: the schedule (as data) says what that was. Sends are
/// buffered, so a rank waits only on receives; what a rank receives before its k-th forward was
/// sent by its neighbours before their k-th. After a stop each rank takes in what its neighbours
/// sent it before theirs, so that the group's next message (a checkpoint's gather) is not taken
/// for one of them.
pub struct Drained(&'static dyn Walk, &'static dyn Schedule);

impl Walk for Drained {
    fn walk(&self, run: &mut Runner, msg: &Messages) -> Result<Option<usize>> {
        let stopped = self.0.walk(run, msg)?;
        if let Some(k) = stopped {
            drain(msg, (self.1, run.plan.micro_batches), k)?; // what the others sent before k
        }
        Ok(stopped)
    }
}

/// Pipeline stage `index` as `parallel`'s schedule lays out its chunks.
pub fn stage_of(index: usize, parallel: &ParallelConfig) -> Stage {
    schedule_of(parallel.pp_schedule).stage(index, parallel.pp, parallel.pp_virtual_stages)
}

/// After every rank stopped before its k-th forward of a step of `micro_batches` in
/// `schedule`: receives, and drops, what the others sent this rank before their own k-th forward and
/// it did not take (a gradient on its way back). What they sent is known by replaying their
/// schedules.
fn drain(msg: &Messages, (schedule, micro_batches): (&dyn Schedule, usize), k: usize) -> Result<()> {
    let (stage, me) = (msg.stage, msg.stage.index);
    for from in (0..stage.count).filter(|&f| f != me) {
        let mut forwards = 0;
        let sent = schedule
            .actions(stage.count, from, micro_batches, stage.chunks)
            .take_while(|a| {
                forwards += usize::from(matches!(a, Action::Forward(_)));
                forwards <= k
            })
            .filter(|&a| sent_by(stage, from, a).is_some_and(|(to, _)| to == me))
            .count();
        let taken = msg.received.borrow()[from];
        for _ in taken..sent {
            msg.recv(Some(from))?;
        }
    }
    Ok(())
}
