//! # Communication: process groups and collectives between ranks
//!
//! A *process group* is a list of ranks that talk together (a tp group, a dp group, …). Every
//! member calls the same collectives in the same order; the k-th call of each member meets the
//! k-th call of the others:
//!
//! ```text
//! all_reduce      [a] [b] [c]   →  [a+b+c] [a+b+c] [a+b+c]       (sum, avg or max)
//! all_gather      [a] [b] [c]   →  [a b c] [a b c] [a b c]
//! reduce_scatter  [a₀ a₁ a₂] …  →  [Σ·₀]   [Σ·₁]   [Σ·₂]          (each keeps one reduced chunk)
//! broadcast       [a] [·] [·]   →  [a]     [a]     [a]
//! send/recv       rank i ──[x]──▶ rank j
//! ```
//! This file is the `local` backend: ranks are threads, and a shared `Hub` is the meeting point.
//! Each member leaves its part in the slot of (group, call number), waits until every part is
//! there, then computes its result from the parts *in rank order*, so a sum is the same bits
//! whatever order the threads arrived in. Every collective also has an `_async` form that returns
//! a `Handle`: the call runs on the rank's communication thread (its "comm stream", in issue
//! order) while the rank goes on computing, and `wait()` collects the result.
//!
//! Failures never hang: a wait gives up after the hub's timeout naming the group, the collective
//! and the ranks that did not come; members that disagree on the collective or its size all get
//! the same error; and when any rank fails, the launcher aborts the hub and every waiting rank
//! returns at once.

use anyhow::{anyhow, bail, Result};
use half::bf16;
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The number types collectives carry. Reductions accumulate in f32 and round once at the end.
pub trait Element: Copy + Send + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl Element for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
}

/// Which collective a member is in; all members of one call must agree.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
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
        let deadline = Instant::now() + self.timeout;
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
            if now >= deadline {
                bail!("{what}: timed out after {:.1}s waiting for rank(s) {absent:?}", self.timeout.as_secs_f64());
            }
            st = self.changed.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Leaves this member's part of call `seq` of group `g`, waits for all parts, returns them in
    /// rank order after checking that every member called the same collective with the same size.
    fn exchange(&self, g: &GroupInfo, seq: u64, op: Op, data: Vec<f32>) -> Result<Vec<Arc<Vec<f32>>>> {
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

    fn post(&self, key: (String, usize, usize, u64), data: Vec<f32>) {
        self.lock().mail.insert(key, data);
        self.changed.notify_all();
    }

    /// Waits for message `key` (group, from, to, number) from global rank `sender`.
    fn take(&self, key: (String, usize, usize, u64), len: usize, sender: usize) -> Result<Vec<f32>> {
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
    fn name(&self) -> String {
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
fn reduce(parts: &[Arc<Vec<f32>>], op: ReduceOp) -> Vec<f32> {
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
struct GroupInfo {
    name: String,
    ranks: Vec<usize>,
    index: usize,
}

impl GroupInfo {
    /// The global rank at member `place`, or an error naming the operation.
    fn member(&self, place: usize, what: &str) -> Result<usize> {
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

/// A rank's communication thread: jobs run one after another, in the order they were issued.
#[derive(Clone)]
pub struct Stream {
    jobs: mpsc::Sender<Box<dyn FnOnce() + Send>>,
}

impl Stream {
    /// Starts the thread; it ends when every `Stream` clone is dropped and its queue is empty.
    pub fn start() -> (Stream, std::thread::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let worker = std::thread::spawn(move || rx.into_iter().for_each(|job| job()));
        (Stream { jobs: tx }, worker)
    }
}

/// The result of an asynchronous collective, to `wait` on.
pub struct Handle<R> {
    result: mpsc::Receiver<Result<R>>,
}

impl<R> Handle<R> {
    pub fn wait(self) -> Result<R> {
        self.result.recv().unwrap_or_else(|_| Err(anyhow!("the communication thread stopped")))
    }
}

/// One rank's handle on one process group.
pub struct Group {
    info: Arc<GroupInfo>,
    hub: Arc<Hub>,
    stream: Stream,
    calls: Mutex<u64>,
    /// Message counters per (direction, peer): the n-th send to j meets j's n-th recv from us.
    messages: Mutex<HashMap<(Direction, usize), u64>>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Direction {
    Out,
    In,
}

fn widen<T: Element>(data: &[T]) -> Vec<f32> {
    data.iter().map(|x| x.to_f32()).collect()
}

fn narrow<T: Element>(data: &[f32]) -> Vec<T> {
    data.iter().map(|&x| T::from_f32(x)).collect()
}

impl Group {
    /// `name` must be the same on every member and unique in the run (e.g. "tp[0,1]").
    pub fn new(name: String, ranks: Vec<usize>, rank: usize, hub: Arc<Hub>, stream: Stream) -> Group {
        let index = ranks.iter().position(|&r| r == rank).expect("a rank belongs to its own groups");
        let info = Arc::new(GroupInfo { name, ranks, index });
        Group { info, hub, stream, calls: Mutex::new(0), messages: Mutex::new(HashMap::new()) }
    }

    pub fn name(&self) -> &str {
        &self.info.name
    }
    /// Global ranks of the members, in order.
    pub fn ranks(&self) -> &[usize] {
        &self.info.ranks
    }
    pub fn size(&self) -> usize {
        self.info.ranks.len()
    }
    /// This rank's place in the group.
    pub fn index(&self) -> usize {
        self.info.index
    }

    /// Queues `job` on the communication thread; the handle yields its result.
    fn submit<R: Send + 'static>(&self, job: impl FnOnce(&Hub, &GroupInfo) -> Result<R> + Send + 'static) -> Handle<R> {
        let (tx, rx) = mpsc::channel();
        let (hub, info) = (self.hub.clone(), self.info.clone());
        // if the thread is gone, the handle's wait reports it
        let _ = self.stream.jobs.send(Box::new(move || {
            let _ = tx.send(job(&hub, &info));
        }));
        Handle { result: rx }
    }

    fn next_call(&self) -> u64 {
        let mut c = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        *c += 1;
        *c
    }

    /// The mail key of the next message between this member and `peer`.
    fn mail_key(&self, direction: Direction, peer: usize) -> (String, usize, usize, u64) {
        let mut m = self.messages.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry((direction, peer)).or_insert(0);
        *n += 1;
        let (me, name) = (self.info.index, self.info.name.clone());
        match direction {
            Direction::Out => (name, me, peer, *n),
            Direction::In => (name, peer, me, *n),
        }
    }

    /// Issues collective `op` with this member's part; `finish` turns all parts into its result.
    fn collective<T: Element>(
        &self,
        op: Op,
        data: Vec<f32>,
        finish: impl FnOnce(Vec<Arc<Vec<f32>>>, &GroupInfo) -> Result<Vec<f32>> + Send + 'static,
    ) -> Handle<Vec<T>> {
        let seq = self.next_call();
        self.submit(move |hub, g| Ok(narrow(&finish(hub.exchange(g, seq, op, data)?, g)?)))
    }

    pub fn all_reduce_async<T: Element>(&self, data: &[T], op: ReduceOp) -> Handle<Vec<T>> {
        self.collective(Op::AllReduce(op), widen(data), move |parts, _| Ok(reduce(&parts, op)))
    }

    /// Every member's `data`, concatenated in rank order.
    pub fn all_gather_async<T: Element>(&self, data: &[T]) -> Handle<Vec<T>> {
        self.collective(Op::AllGather, widen(data), |parts, _| {
            Ok(parts.iter().flat_map(|d| d.iter().copied()).collect())
        })
    }

    /// Reduces the members' `data` and keeps this member's chunk of `size` equal chunks.
    pub fn reduce_scatter_async<T: Element>(&self, data: &[T], op: ReduceOp) -> Handle<Vec<T>> {
        self.collective(Op::ReduceScatter(op), widen(data), move |parts, g| {
            let (n, len) = (g.ranks.len(), parts[0].len());
            if len % n != 0 {
                bail!("reduce_scatter on group {}: {len} elements do not split into {n} equal chunks", g.name);
            }
            let chunk = len / n;
            Ok(reduce(&parts, op)[g.index * chunk..(g.index + 1) * chunk].to_vec())
        })
    }

    /// Every member receives the `data` of member `root` (a place in the group).
    pub fn broadcast_async<T: Element>(&self, data: &[T], root: usize) -> Handle<Vec<T>> {
        self.collective(Op::Broadcast { root }, widen(data), move |parts, g| {
            g.member(root, "broadcast")?;
            Ok(parts[root].to_vec())
        })
    }

    pub fn barrier_async(&self) -> Handle<()> {
        let seq = self.next_call();
        self.submit(move |hub, g| hub.exchange(g, seq, Op::Barrier, Vec::new()).map(|_| ()))
    }

    /// Sends `data` to member `to` (a place in the group). Buffered: it does not wait for the recv.
    pub fn send_async<T: Element>(&self, data: &[T], to: usize) -> Handle<()> {
        let key = self.mail_key(Direction::Out, to);
        let data = widen(data);
        self.submit(move |hub, g| {
            g.member(to, "send")?;
            hub.post(key, data);
            Ok(())
        })
    }

    /// Receives `len` elements from member `from`.
    pub fn recv_async<T: Element>(&self, len: usize, from: usize) -> Handle<Vec<T>> {
        let key = self.mail_key(Direction::In, from);
        self.submit(move |hub, g| Ok(narrow(&hub.take(key, len, g.member(from, "recv")?)?)))
    }

    /// Sends `data` to `to` and receives `len` elements from `from` in one step, as a pipeline
    /// stage or a ring member does; neither side can block the other.
    pub fn send_recv_async<T: Element>(&self, data: &[T], to: usize, len: usize, from: usize) -> Handle<Vec<T>> {
        let (out, inbound) = (self.mail_key(Direction::Out, to), self.mail_key(Direction::In, from));
        let data = widen(data);
        self.submit(move |hub, g| {
            let sender = g.member(from, "send_recv")?;
            g.member(to, "send_recv")?;
            hub.post(out, data);
            Ok(narrow(&hub.take(inbound, len, sender)?))
        })
    }

    // Blocking forms: issue, then wait.

    pub fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        data.copy_from_slice(&self.all_reduce_async(data, op).wait()?);
        Ok(())
    }
    pub fn all_gather<T: Element>(&self, data: &[T]) -> Result<Vec<T>> {
        self.all_gather_async(data).wait()
    }
    pub fn reduce_scatter<T: Element>(&self, data: &[T], op: ReduceOp) -> Result<Vec<T>> {
        self.reduce_scatter_async(data, op).wait()
    }
    pub fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<()> {
        data.copy_from_slice(&self.broadcast_async(data, root).wait()?);
        Ok(())
    }
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async().wait()
    }
    pub fn send<T: Element>(&self, data: &[T], to: usize) -> Result<()> {
        self.send_async(data, to).wait()
    }
    pub fn recv<T: Element>(&self, len: usize, from: usize) -> Result<Vec<T>> {
        self.recv_async(len, from).wait()
    }
    pub fn send_recv<T: Element>(&self, data: &[T], to: usize, len: usize, from: usize) -> Result<Vec<T>> {
        self.send_recv_async(data, to, len, from).wait()
    }
}
