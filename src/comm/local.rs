//! # The hub: where the local backend's rank threads meet
//!
//! The `local` backend runs ranks as threads of one process, and this is their shared memory.
//! For a collective, each member leaves its part in the slot of (group, call number), waits until
//! every part is there, checks that all members called the same collective with the same size,
//! and then computes its own result from the parts *in rank order*: a sum is the same bits
//! whatever order the threads arrived in. Point-to-point messages wait in a mailbox keyed by
//! (group, sender, receiver, message number).
//!
//! Waiting never hangs. A wait gives up after the hub's timeout, naming the group, the
//! collective and the ranks that did not come; it fails at once when a rank it waits for has
//! already returned; and when any rank fails, the launcher calls `abort`, which wakes every
//! waiting rank with `Aborted`. While a rank holds the hub (`hold`: work only it does, such as
//! writing a checkpoint) the clock stops: every wait's timeout starts again when it is released.
//!
//! When the run spans several processes, the hub holds only this process's ranks, and whatever
//! concerns the others (a part of a collective they are in, a message to one of them, an abort, a
//! rank that finished) is handed to `Beyond`, the bridge of `comm/wires/remote.rs`, which brings theirs
//! back in. The rest of this file does not change: a part is a part, wherever it came from.

use crate::ops::types::ReduceOp;
use anyhow::{bail, Result};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Which collective a member is in; all members of one call must agree.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Op {
    AllReduce(ReduceOp),
    AllGather,
    ReduceScatter(ReduceOp),
    Broadcast { root: usize },
    Barrier,
}

/// The meeting point of all rank threads of a run: the local backend's shared memory.
pub struct Hub {
    state: Mutex<HubState>,
    changed: Condvar,
    timeout: Duration,
    /// The ranks of the other processes, when the run spans several.
    beyond: Option<Box<dyn Beyond>>,
}

/// What the hub needs of the ranks that live in other processes (`comm/wires/remote.rs`).
pub(crate) trait Beyond: Send + Sync {
    /// Whether global rank `rank` is a thread of this process.
    fn is_here(&self, rank: usize) -> bool;
    /// Passes `note` to the processes it concerns.
    fn tell(&self, note: Note<'_>);
    /// `rank` as messages name it: "3 (process 1 on host node-b)".
    fn name(&self, rank: usize) -> String;
}

/// What one process's hub tells the others.
pub(crate) enum Note<'a> {
    /// This member's part of call `seq` of `group`: for every process with another member.
    Part {
        group: &'a GroupInfo,
        seq: u64,
        op: Op,
        data: &'a [f32],
    },
    /// A message to global rank `to`.
    Mail {
        key: &'a MailKey,
        to: usize,
        data: &'a [f32],
    },
    Abort(&'a str),
    Finished(usize),
    Hold,
    Release,
}

/// A message's place in the mailbox: (group name, from, to, message number), places in the group.
pub(crate) type MailKey = (String, usize, usize, u64);

#[derive(Default)]
struct HubState {
    /// Parts of collectives in progress, by (group name, call number).
    slots: HashMap<(String, u64), Slot>,
    /// Point-to-point messages in flight, by (group name, from, to, message number).
    mail: HashMap<MailKey, Vec<f32>>,
    /// Ranks whose function has returned.
    finished: Vec<usize>,
    /// Set once, by the first rank that fails.
    aborted: Option<String>,
    /// Ranks doing work alone right now (`hold`): nobody is late while one is.
    holding: usize,
    /// Holds ended so far: a wait that slept through a whole hold still restarts its clock.
    holds_ended: u64,
}

/// The timeout clock of a wait: it runs out `timeout` after it started, or after the last time
/// a rank worked alone (`Hub::hold`); a wait checks it each time it wakes.
pub(crate) struct Clock {
    timeout: Duration,
    deadline: Instant,
    holds_ended: u64,
}

impl Clock {
    fn new(timeout: Duration, holds_ended: u64) -> Clock {
        Clock { timeout, deadline: Instant::now() + timeout, holds_ended }
    }

    /// Whether the wait has run out of time, given the hub's holds now (`Hub::holds`).
    pub(crate) fn ran_out(&mut self, (holding, holds_ended): (bool, u64)) -> bool {
        let now = Instant::now();
        if holding || holds_ended != self.holds_ended {
            self.deadline = now + self.timeout; // a rank worked alone: the clock starts again
            self.holds_ended = holds_ended;
        }
        now >= self.deadline
    }

    /// How long the wait may sleep before looking again.
    pub(crate) fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

/// While alive, waits on the hub do not time out (`Hub::hold`).
pub(crate) struct Held<'a>(&'a Hub);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.release();
        self.0.tell(Note::Release);
    }
}

struct Slot {
    parts: Vec<Option<(Op, Arc<Vec<f32>>)>>,
    unread: usize,
}

/// The error a rank gets when another rank's failure aborted the run.
#[derive(Debug)]
pub struct Aborted(pub String);

impl std::fmt::Display for Aborted {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "aborted because {}", self.0)
    }
}

impl std::error::Error for Aborted {}

impl Hub {
    /// A hub for the ranks of this process; `beyond` reaches those of the others, if any.
    pub(crate) fn new(timeout: Duration, beyond: Option<Box<dyn Beyond>>) -> Hub {
        Hub { state: Mutex::new(HubState::default()), changed: Condvar::new(), timeout, beyond }
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tell(&self, note: Note<'_>) {
        if let Some(beyond) = &self.beyond {
            beyond.tell(note); // never under the lock: the wire may wait for the other side
        }
    }

    /// Stops the run: every wait, now or later, returns `Aborted(reason)`. The first reason
    /// stays. The other processes are told.
    pub fn abort(&self, reason: String) {
        self.tell(Note::Abort(&reason));
        self.abort_here(reason);
    }

    /// `abort`, for this process only (another process told us).
    pub(crate) fn abort_here(&self, reason: String) {
        self.lock().aborted.get_or_insert(reason);
        self.changed.notify_all();
    }

    pub fn aborted(&self) -> Option<String> {
        self.lock().aborted.clone()
    }

    /// Stops the timeout clock of every wait, in every process, until the guard is dropped.
    pub(crate) fn hold(&self) -> Held<'_> {
        self.tell(Note::Hold);
        self.hold_here();
        Held(self)
    }

    pub(crate) fn hold_here(&self) {
        self.lock().holding += 1;
    }

    pub(crate) fn release(&self) {
        let mut st = self.lock();
        st.holding = st.holding.saturating_sub(1); // a garbled release cannot wrap the count
        st.holds_ended += 1;
        self.changed.notify_all(); // every wait restarts its clock
    }

    /// Whether a rank works alone now, and how many holds have ended: what a wait's `Clock` reads.
    pub(crate) fn holds(&self) -> (bool, u64) {
        let st = self.lock();
        (st.holding > 0, st.holds_ended)
    }

    /// A timeout clock (`parallel.timeout_s`) started now.
    pub(crate) fn clock(&self) -> Clock {
        Clock::new(self.timeout, self.lock().holds_ended)
    }

    pub fn finish(&self, rank: usize) {
        self.tell(Note::Finished(rank));
        self.finished_here(rank);
    }

    pub(crate) fn finished_here(&self, rank: usize) {
        self.lock().finished.push(rank);
        self.changed.notify_all();
    }

    /// "rank(s) [2, 3]", with each rank's process and host when the run spans processes.
    fn who(&self, ranks: &[usize]) -> String {
        match &self.beyond {
            None => format!("rank(s) {ranks:?}"),
            Some(b) => format!("rank(s) [{}]", ranks.iter().map(|&r| b.name(r)).collect::<Vec<_>>().join(", ")),
        }
    }

    /// Waits until `ready` holds, failing on abort, on timeout, or when a rank we wait for has
    /// already returned. `missing` names the ranks still awaited.
    fn wait_for<'a>(
        &'a self,
        mut st: MutexGuard<'a, HubState>,
        what: &str,
        ready: impl Fn(&HubState) -> bool,
        missing: impl Fn(&HubState) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, HubState>> {
        let mut clock = Clock::new(self.timeout, st.holds_ended);
        loop {
            if let Some(reason) = &st.aborted {
                return Err(Aborted(reason.clone()).into());
            }
            if ready(&st) {
                return Ok(st);
            }
            let absent = missing(&st);
            let gone: Vec<usize> = absent.iter().copied().filter(|r| st.finished.contains(r)).collect();
            if !gone.is_empty() {
                bail!("{what}: {} returned without taking part", self.who(&gone));
            }
            if clock.ran_out((st.holding > 0, st.holds_ended)) {
                bail!("{what}: timed out after {:.1}s waiting for {}", self.timeout.as_secs_f64(), self.who(&absent));
            }
            st = self.changed.wait_timeout(st, clock.left()).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Leaves part `index` of call `seq` of the group of `ranks` (named `name`) in its slot.
    /// The slot is read by this process's members, and removed when all of them have.
    fn leave(&self, st: &mut HubState, (name, ranks): (&str, &[usize]), seq: u64, index: usize, part: (Op, Vec<f32>)) {
        let here = self.beyond.as_ref().map_or(ranks.len(), |b| ranks.iter().filter(|&&r| b.is_here(r)).count());
        let slot = st
            .slots
            .entry((name.to_string(), seq))
            .or_insert_with(|| Slot { parts: vec![None; ranks.len()], unread: here });
        slot.parts[index] = Some((part.0, Arc::new(part.1)));
        self.changed.notify_all();
    }

    /// A part another process's member left (`comm/wires/remote.rs`), checked against the call's slot:
    /// a member index and a group size that the wire garbled are an error, not a panic.
    pub(crate) fn part_from_afar(
        &self,
        (name, ranks): (&str, &[usize]),
        seq: u64,
        index: usize,
        part: (Op, Vec<f32>),
    ) -> Result<()> {
        let mut st = self.lock();
        let size = st.slots.get(&(name.to_string(), seq)).map_or(ranks.len(), |slot| slot.parts.len());
        if index >= ranks.len() || ranks.len() != size {
            bail!("member {index} of a {}-member call on group {name} (of {size} members here)", ranks.len());
        }
        self.leave(&mut st, (name, ranks), seq, index, part);
        Ok(())
    }

    /// Leaves this member's part of call `seq` of group `g`, waits for all parts, returns them in
    /// rank order after checking that every member called the same collective with the same size.
    pub(crate) fn exchange(&self, g: &GroupInfo, seq: u64, op: Op, data: Vec<f32>) -> Result<Vec<Arc<Vec<f32>>>> {
        let key = (g.name.clone(), seq);
        self.tell(Note::Part { group: g, seq, op, data: &data });
        let mut st = self.lock();
        self.leave(&mut st, (&g.name, &g.ranks), seq, g.index, (op, data));
        let what = format!("{} on group {}", op.name(), g.name);
        let complete = |st: &HubState| st.slots[&key].parts.iter().all(Option::is_some);
        let missing = |st: &HubState| {
            let parts = &st.slots[&key].parts;
            g.ranks.iter().zip(parts).filter(|(_, p)| p.is_none()).map(|(r, _)| *r).collect()
        };
        let mut st = self.wait_for(st, &what, complete, missing)?;
        let slot = st.slots.get_mut(&key).expect("slot present until read");
        let parts: Vec<(Op, Arc<Vec<f32>>)> = slot.parts.iter().map(|p| p.clone().expect("complete")).collect();
        slot.unread -= 1;
        if slot.unread == 0 {
            st.slots.remove(&key);
        }
        drop(st);
        if let Some((r, (other, _))) = g.ranks.iter().zip(&parts).find(|(_, (o, _))| *o != op) {
            bail!(
                "{what}: rank {r} called {} at the same point; every member must call the same collective",
                other.name()
            );
        }
        let sizes: Vec<usize> = parts.iter().map(|(_, d)| d.len()).collect();
        if sizes.iter().any(|&s| s != sizes[0]) {
            let listed: Vec<String> = g.ranks.iter().zip(&sizes).map(|(r, s)| format!("rank {r}: {s}")).collect();
            bail!("{what}: members passed different sizes ({}); they must be equal", listed.join(", "));
        }
        Ok(parts.into_iter().map(|(_, d)| d).collect())
    }

    /// Leaves message `key` for global rank `to`, here or in its process.
    pub(crate) fn post(&self, key: MailKey, to: usize, data: Vec<f32>) {
        match &self.beyond {
            Some(b) if !b.is_here(to) => b.tell(Note::Mail { key: &key, to, data: &data }),
            _ => self.mail_here(key, data),
        }
    }

    pub(crate) fn mail_here(&self, key: MailKey, data: Vec<f32>) {
        self.lock().mail.insert(key, data);
        self.changed.notify_all();
    }

    /// Waits for message `key` (group, from, to, number) from global rank `sender`.
    pub(crate) fn take(&self, key: MailKey, len: usize, sender: usize) -> Result<Vec<f32>> {
        let what = format!("recv on group {} from rank {sender}", key.0);
        let mut st = self.wait_for(self.lock(), &what, |st| st.mail.contains_key(&key), |_| vec![sender])?;
        let data = st.mail.remove(&key).expect("message present");
        if data.len() != len {
            bail!("{what}: expected {len} elements, the sender sent {}", data.len());
        }
        Ok(data)
    }
}

impl Op {
    /// Its row of the cost table (`comm/cost.rs`); a barrier moves no data.
    pub(crate) fn call(&self) -> Option<super::cost::Call> {
        use super::cost::Call;
        match self {
            Op::AllReduce(_) => Some(Call::AllReduce),
            Op::AllGather => Some(Call::AllGather),
            Op::ReduceScatter(_) => Some(Call::ReduceScatter),
            Op::Broadcast { .. } => Some(Call::Broadcast),
            Op::Barrier => None,
        }
    }

    pub(crate) fn name(&self) -> String {
        match self {
            Op::AllReduce(r) => format!("all_reduce({r:?})").to_lowercase(),
            Op::AllGather => "all_gather".into(),
            Op::ReduceScatter(r) => format!("reduce_scatter({r:?})").to_lowercase(),
            Op::Broadcast { root } => format!("broadcast(root {root})"),
            Op::Barrier => "barrier".into(),
        }
    }
}

/// Reduces equal-length parts element by element, in rank order.
pub(crate) fn reduce(parts: &[Arc<Vec<f32>>], op: ReduceOp) -> Vec<f32> {
    let mut out = parts[0].to_vec();
    for p in &parts[1..] {
        for (o, x) in out.iter_mut().zip(p.iter()) {
            *o = if op == ReduceOp::Max { o.max(*x) } else { *o + x };
        }
    }
    if op == ReduceOp::Avg {
        let n = parts.len() as f32;
        out.iter_mut().for_each(|o| *o /= n);
    }
    out
}

/// What a group handle knows about its group.
pub(crate) struct GroupInfo {
    pub name: String,
    pub ranks: Vec<usize>,
    pub index: usize,
}

impl GroupInfo {
    /// The global rank at member `place`, or an error naming the operation.
    pub(crate) fn member(&self, place: usize, what: &str) -> Result<usize> {
        match self.ranks.get(place) {
            Some(&rank) => Ok(rank),
            None => bail!(
                "{what} on group {}: member {place} does not exist (the group has {})",
                self.name,
                self.ranks.len()
            ),
        }
    }
}
