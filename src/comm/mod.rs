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
//! all_to_all      [a₀ a₁ a₂] [b₀ b₁ b₂] [c₀ c₁ c₂]  →  [a₀ b₀ c₀] [a₁ b₁ c₁] [a₂ b₂ c₂]
//!                 (member j gets every member's j-th piece; pieces may differ in size)
//! send/recv       rank i ──[x]──▶ rank j
//! ```
//! Every collective also has an `_async` form that returns a `Handle`: the call runs on the rank's
//! communication thread (its "comm stream", in issue order) while the rank goes on computing, and
//! `wait()` collects the result. This is the overlap that bucketed data parallelism and the
//! tensor-parallel input-gradient all-reduce rely on.
//!
//! These forms carry host numbers and always run on the `local` backend (ranks as threads,
//! meeting in `comm/local.rs`): results are deterministic, and failures (timeouts, mismatched
//! calls, a failing rank) are errors, never hangs. The training step moves *tensors* with the
//! `_tensor` forms of `comm/tensors.rs`, which take the same road for CPU tensors and, for GPU
//! tensors on the `nccl` backend, stay on the GPU through the group's NCCL link.

pub mod cost;
pub mod device_link;
pub mod launcher;
pub mod local;
pub mod nccl;
pub mod placement;
pub mod process_grid;
pub mod tensors;
pub mod trace;
pub mod wires;

use anyhow::{anyhow, bail, Result};
use half::bf16;
use local::{reduce, GroupInfo, Hub, Op};

/// How a collective combines the members' numbers (defined with the other plain values in
/// `ops/types.rs`, so that every backend reaches it).
pub use crate::ops::types::ReduceOp;

use cost::{Call, Ledger};
use device_link::DeviceLink;
use std::cell::OnceCell;
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::Instant;
use trace::{Lane, Trace};

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
        self.result.recv().map_err(|_| anyhow!("the communication thread stopped"))?
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
    /// Where this member records each call's span, when the run is traced (`trace_to`).
    trace: OnceLock<(Trace, usize)>,
    /// How GPU tensors travel without the host, on the `nccl` backend (`comm/tensors.rs`).
    device: OnceCell<Box<dyn DeviceLink>>,
    /// This member's calls, bytes and their time, per kind of call (`comm/cost.rs`).
    ledger: Arc<Ledger>,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Direction {
    Out,
    In,
}

/// "1 value", "300 values": how a traced call names its size.
fn values(n: usize) -> String {
    format!("{n} value{}", if n == 1 { "" } else { "s" })
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
        let (calls, messages) = (Mutex::new(0), Mutex::new(HashMap::new()));
        let (trace, device, ledger) = (OnceLock::new(), OnceCell::new(), Arc::default());
        Group { info, hub, stream, calls, messages, trace, device, ledger }
    }

    /// Records a span of this member's compute lane from `start` to now, when the run is traced
    /// (FSDP draws each unit's compute with it).
    pub fn trace_compute(&self, name: impl FnOnce() -> String, start: Instant) {
        if let Some((trace, rank)) = self.trace.get() {
            trace.record(*rank, Lane::Compute, name(), start, start, Instant::now());
        }
    }

    /// Records every later call of this member (collective or message) as a span on global
    /// rank `rank`'s comm lane of `trace`, named by the call, its size and the group
    /// ("all_reduce(sum) of 4096 values tp[0,1]"), from when the communication thread starts it
    /// to when it ends (a call on the GPU, `comm/tensors.rs`: when the GPU ran it).
    pub fn trace_to(&self, trace: &Trace, rank: usize) -> Result<()> {
        let _ = self.trace.set((trace.clone(), rank)); // a group is traced once, by one run
        self.time_calls()
    }

    /// From now on, GPU calls are timed too (for the comm report; a traced run times them anyway).
    pub fn time_calls(&self) -> Result<()> {
        self.device.get().map_or(Ok(()), |link| link.time_calls())
    }

    /// What this member's calls have cost so far (`comm/cost.rs`).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
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

    /// Queues `job` on the communication thread; the handle yields its result. `what` names the
    /// call in the trace, and is only made when the run is traced; the time the job takes goes
    /// to the ledger under `call`.
    fn submit<R: Send + 'static>(
        &self,
        call: Option<Call>,
        what: impl FnOnce() -> String,
        job: impl FnOnce(&Hub, &GroupInfo) -> Result<R> + Send + 'static,
    ) -> Handle<R> {
        let (tx, rx) = mpsc::channel();
        let trace = self.trace.get().map(|(trace, rank)| (trace.clone(), *rank, what()));
        let (hub, info, ledger) = (self.hub.clone(), self.info.clone(), self.ledger.clone());
        let issued = Instant::now();
        // if the thread is gone, the handle's wait reports it
        let _ = self.stream.jobs.send(Box::new(move || {
            let start = Instant::now();
            let result = job(&hub, &info);
            let end = Instant::now();
            if let Some(call) = call {
                ledger.took(call, (end - start).as_secs_f64());
            }
            if let Some((trace, rank, what)) = trace {
                trace.record(rank, Lane::Comm, format!("{what} {}", info.name), issued, start, end);
            }
            let _ = tx.send(result);
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
        let (seq, n) = (self.next_call(), data.len());
        self.submit(
            op.call(),
            || format!("{} of {}", op.name(), values(n)),
            move |hub, g| Ok(narrow(&finish(hub.exchange(g, seq, op, data)?, g)?)),
        )
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
        self.submit(
            None,
            || Op::Barrier.name(),
            move |hub, g| hub.exchange(g, seq, Op::Barrier, Vec::new()).map(|_| ()),
        )
    }

    /// Sends `data` to member `to` (a place in the group). Buffered: it does not wait for the recv.
    pub fn send_async<T: Element>(&self, data: &[T], to: usize) -> Handle<()> {
        let key = self.mail_key(Direction::Out, to);
        let data = widen(data);
        let n = data.len();
        self.submit(
            Some(Call::P2p),
            || format!("send of {} to {to}", values(n)),
            move |hub, g| {
                hub.post(key, g.member(to, "send")?, data);
                Ok(())
            },
        )
    }

    /// Receives `len` elements from member `from`.
    pub fn recv_async<T: Element>(&self, len: usize, from: usize) -> Handle<Vec<T>> {
        let key = self.mail_key(Direction::In, from);
        self.submit(
            Some(Call::P2p),
            || format!("recv of {} from {from}", values(len)),
            move |hub, g| Ok(narrow(&hub.take(key, len, g.member(from, "recv")?)?)),
        )
    }

    /// Sends `data` to `to` and receives `len` elements from `from` in one step, as a pipeline
    /// stage or a ring member does; neither side can block the other.
    pub fn send_recv_async<T: Element>(&self, data: &[T], to: usize, len: usize, from: usize) -> Handle<Vec<T>> {
        let (out, inbound) = (self.mail_key(Direction::Out, to), self.mail_key(Direction::In, from));
        let data = widen(data);
        let n = data.len();
        let what = || format!("send_recv of {} to {to}, {} from {from}", values(n), values(len));
        self.submit(Some(Call::P2p), what, move |hub, g| {
            let sender = g.member(from, "send_recv")?;
            hub.post(out, g.member(to, "send_recv")?, data);
            Ok(narrow(&hub.take(inbound, len, sender)?))
        })
    }

    /// Member j gets the `send[j]` values of `data` that follow those for members before it;
    /// returns what every member sent this one, `recv[i]` values from member i, in member order.
    /// Each member must know what it will receive (the expert-parallel dispatch all-gathers its
    /// counts first).
    pub fn all_to_all_async<T: Element>(&self, data: &[T], send: &[usize], recv: &[usize]) -> Handle<Vec<T>> {
        let (n, me) = (self.size(), self.index());
        let (send, recv) = (send.to_vec(), recv.to_vec());
        let sizes_ok = send.len() == n && recv.len() == n && send.iter().sum::<usize>() == data.len();
        let outbound: Vec<_> = (0..n).map(|j| (j != me).then(|| self.mail_key(Direction::Out, j))).collect();
        let inbound: Vec<_> = (0..n).map(|i| (i != me).then(|| self.mail_key(Direction::In, i))).collect();
        let data = widen(data);
        let what = format!("all_to_all of {}", values(data.len()));
        self.submit(Some(Call::AllToAll), || what, move |hub, g| {
            if !sizes_ok {
                bail!("all_to_all on group {}: give one send and one receive count per member (the sends summing to the data's {} values)", g.name, data.len());
            }
            let mut at = 0;
            let mut mine = Vec::new();
            for (j, key) in outbound.into_iter().enumerate() {
                let piece = data[at..at + send[j]].to_vec();
                at += send[j];
                match key {
                    Some(key) => hub.post(key, g.ranks[j], piece), // buffered: every send first, no member waits on another
                    None => mine = piece,
                }
            }
            let mut out = Vec::with_capacity(recv.iter().sum());
            for (i, key) in inbound.into_iter().enumerate() {
                match key {
                    Some(key) => out.extend(hub.take(key, recv[i], g.member(i, "all_to_all")?)?),
                    None if mine.len() == recv[i] => out.append(&mut mine),
                    None => bail!("all_to_all on group {}: member {i} sends itself {} values but expects {}", g.name, mine.len(), recv[i]),
                }
            }
            Ok(narrow(&out))
        })
    }

    // Blocking forms: issue, then wait.

    pub fn all_to_all<T: Element>(&self, data: &[T], send: &[usize], recv: &[usize]) -> Result<Vec<T>> {
        self.all_to_all_async(data, send, recv).wait()
    }

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

    /// Runs `work`, which only this rank does (rank 0 writing a checkpoint): while it runs, the
    /// other ranks' waits do not count towards their timeout, since nobody is late.
    pub fn while_others_wait<R>(&self, work: impl FnOnce() -> R) -> R {
        let _held = self.hub.hold();
        work()
    }
}
