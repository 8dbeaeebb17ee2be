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
}

#[derive(Default)]
struct HubState {
    /// Parts of collectives in progress, by (group name, call number).
    slots: HashMap<(String, u64), Slot>,
    /// Point-to-point messages in flight, by (group name, from, to, message number).
    mail: HashMap<(String, usize, usize, u64), Vec<f32>>,
    /// Ranks whose function has returned.
    finished: Vec<usize>,
    /// Set once, by the first rank that fails.
    aborted: Option<String>,
    /// Ranks doing work alone right now (`hold`): nobody is late while one is.
    holding: usize,
}

/// While alive, waits on the hub do not time out (`Hub::hold`).
pub(crate) struct Held<'a>(&'a Hub);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.lock().holding -= 1;
        self.0.changed.notify_all(); // every wait restarts its clock
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
    pub fn new(timeout: Duration) -> Hub {
        Hub { state: Mutex::new(HubState::default()), changed: Condvar::new(), timeout }
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the run: every wait, now or later, returns `Aborted(reason)`. The first reason stays.
    pub fn abort(&self, reason: String) {
        self.lock().aborted.get_or_insert(reason);
        self.changed.notify_all();
    }

    pub fn aborted(&self) -> Option<String> {
        self.lock().aborted.clone()
    }

    /// Stops the timeout clock of every wait until the returned guard is dropped.
    pub(crate) fn hold(&self) -> Held<'_> {
        self.lock().holding += 1;
        Held(self)
    }

    pub fn finish(&self, rank: usize) {
        self.lock().finished.push(rank);
        self.changed.notify_all();
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
        let (mut deadline, mut was_held) = (Instant::now() + self.timeout, false);
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
                bail!("{what}: rank(s) {gone:?} returned without taking part");
            }
            let now = Instant::now();
            if st.holding > 0 || was_held {
                deadline = now + self.timeout; // a rank worked alone: the clock starts again
                was_held = st.holding > 0;
            }
            if now >= deadline {
                bail!("{what}: timed out after {:.1}s waiting for rank(s) {absent:?}", self.timeout.as_secs_f64());
            }
            st = self.changed.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Leaves this member's part of call `seq` of group `g`, waits for all parts, returns them in
    /// rank order after checking that every member called the same collective with the same size.
    pub(crate) fn exchange(&self, g: &GroupInfo, seq: u64, op: Op, data: Vec<f32>) -> Result<Vec<Arc<Vec<f32>>>> {
        let key = (g.name.clone(), seq);
        let n = g.ranks.len();
        let mut st = self.lock();
        let slot = st.slots.entry(key.clone()).or_insert_with(|| Slot { parts: vec![None; n], unread: n });
        slot.parts[g.index] = Some((op, Arc::new(data)));
        self.changed.notify_all();
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

    pub(crate) fn post(&self, key: (String, usize, usize, u64), data: Vec<f32>) {
        self.lock().mail.insert(key, data);
        self.changed.notify_all();
    }

    /// Waits for message `key` (group, from, to, number) from global rank `sender`.
    pub(crate) fn take(&self, key: (String, usize, usize, u64), len: usize, sender: usize) -> Result<Vec<f32>> {
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
