//! # What each collective costs: calls, bytes, time, and the α–β model
//!
//! A message of B bytes over a link takes about `α + B/β`: α is the latency of one hop (setting
//! up the transfer, the wire, the peer noticing it), β the link's bandwidth. A collective over n
//! ranks is a sequence of such hops. With the ring algorithms NCCL uses for large messages, each
//! rank sends and receives pieces of size B/n, one neighbour at a time:
//!
//! ```text
//! call (B = the tensor's bytes)         hops          bytes each rank moves       time
//! all_reduce                            2(n−1)        2(n−1)/n · B               2(n−1)·α + 2(n−1)/n · B/β
//! all_gather (B = the gathered tensor)  n−1           (n−1)/n · B                (n−1)·α + (n−1)/n · B/β
//! reduce_scatter (B = its input)        n−1           (n−1)/n · B                (n−1)·α + (n−1)/n · B/β
//! broadcast (pipelined ring)            n−1           B                          (n−1)·α + B/β
//! send / recv / send_recv (P2P)         1             B (the larger direction)   α + B/β
//! all_to_all (B = what this rank sends) n−1           (n−1)/n · B (balanced)     (n−1)·α + (n−1)/n · B/β
//! ```
//! So an all-reduce costs twice a reduce-scatter (it *is* a reduce-scatter then an all-gather:
//! that is why sequence parallelism and ZeRO can trade one for the other at no extra bytes), and
//! the bandwidth term hardly depends on n: what decides the cost is β. Tensor parallelism sends
//! every block's activations 4 times per micro-batch, data parallelism each gradient once per
//! step: over NVLink (hundreds of GB/s) the first is cheap, over InfiniBand or PCIe (tens) it
//! dominates the step. That is why tp stays inside a node and dp goes across nodes.
//!
//! Every group counts, per kind of call, its calls, the bytes B and the time the calls took (a
//! `Ledger`); `ferrotron train --comm-report [--link nvlink|pcie|ib]` prints them per axis and
//! per step next to the model's prediction for the chosen link (`report`).

use super::device_link::Ran;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The kinds of call, each with its row of the table above.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Call {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    P2p,
    AllToAll,
}

impl Call {
    pub const ALL: [Call; 6] =
        [Call::AllReduce, Call::AllGather, Call::ReduceScatter, Call::Broadcast, Call::P2p, Call::AllToAll];

    pub fn name(self) -> &'static str {
        match self {
            Call::AllReduce => "all_reduce",
            Call::AllGather => "all_gather",
            Call::ReduceScatter => "reduce_scatter",
            Call::Broadcast => "broadcast",
            Call::P2p => "send/recv",
            Call::AllToAll => "all_to_all",
        }
    }

    /// (hops per call, bytes moved per byte of B) over `n` ranks: the α and β factors.
    fn factors(self, n: usize) -> (f64, f64) {
        let n = n as f64;
        match self {
            Call::AllReduce => (2.0 * (n - 1.0), 2.0 * (n - 1.0) / n),
            Call::AllGather | Call::ReduceScatter | Call::AllToAll => (n - 1.0, (n - 1.0) / n),
            Call::Broadcast => (n - 1.0, 1.0),
            Call::P2p => (1.0, 1.0),
        }
    }
}

/// A link between two GPUs, with round published numbers (per direction, per GPU), not
/// measurements: what the model is for is the ratio between them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Link {
    /// NVLink 4 inside an H100 node: 450 GB/s, about 3 µs a hop.
    Nvlink,
    /// PCIe 4.0 ×16 between GPUs without NVLink: 25 GB/s achievable, about 10 µs.
    Pcie,
    /// InfiniBand NDR (400 Gb/s) between nodes, one adapter per GPU: 50 GB/s, about 5 µs.
    Ib,
}

impl Link {
    pub fn parse(s: &str) -> Option<Link> {
        match s {
            "nvlink" => Some(Link::Nvlink),
            "pcie" => Some(Link::Pcie),
            "ib" => Some(Link::Ib),
            _ => None,
        }
    }

    /// (α in seconds, β in bytes per second).
    pub fn alpha_beta(self) -> (f64, f64) {
        match self {
            Link::Nvlink => (3e-6, 450e9),
            Link::Pcie => (10e-6, 25e9),
            Link::Ib => (5e-6, 50e9),
        }
    }

    pub fn describe(self) -> String {
        let (a, b) = self.alpha_beta();
        let name = format!("{self:?}").to_lowercase();
        format!("{name}: α = {:.0} µs, β = {:.0} GB/s", a * 1e6, b / 1e9)
    }
}

/// Calls of one kind: how many, their bytes B (see the table), the seconds they took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Tally {
    pub calls: u64,
    pub bytes: u64,
    pub seconds: f64,
}

impl Tally {
    /// The bytes these calls send through each rank's link over `n` ranks (the table's fourth
    /// column): what the bandwidth term counts.
    pub fn moved_bytes(&self, call: Call, n: usize) -> f64 {
        call.factors(n).1 * self.bytes as f64
    }

    /// What the α–β model predicts for these calls over `n` ranks on `link`.
    pub fn predicted_seconds(&self, call: Call, n: usize, link: Link) -> f64 {
        let (alpha, beta) = link.alpha_beta();
        self.calls as f64 * call.factors(n).0 * alpha + self.moved_bytes(call, n) / beta
    }
}

/// `ran`, readable by more than one reader (the trace and the ledger): the first asks the GPU.
pub fn shared(ran: Ran) -> impl Fn() -> Option<(Instant, Instant)> + Clone + Send + 'static {
    let cell = Arc::new(Mutex::new((Some(ran), None)));
    move || {
        let mut c = cell.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ran) = c.0.take() {
            c.1 = ran();
        }
        c.1
    }
}

type Timed = Box<dyn Fn() -> Option<(Instant, Instant)> + Send>;

/// One member's count of its group's calls, kept always (a lock per call, next to the call's own
/// locks) and read by the comm report.
#[derive(Default)]
pub struct Ledger {
    tallies: Mutex<[Tally; 6]>,
    /// Calls queued on a GPU: their time is known once the GPU ran them.
    later: Mutex<Vec<(Call, Timed)>>,
}

impl Ledger {
    /// A call of `bytes` (B of the table) was issued.
    pub fn count(&self, call: Call, bytes: usize) {
        let mut t = self.tallies.lock().unwrap_or_else(|e| e.into_inner());
        t[call as usize].calls += 1;
        t[call as usize].bytes += bytes as u64;
    }

    /// A call on the host took `seconds` on the communication thread.
    pub fn took(&self, call: Call, seconds: f64) {
        self.tallies.lock().unwrap_or_else(|e| e.into_inner())[call as usize].seconds += seconds;
    }

    /// A call queued on a GPU: `ran` says when it ran.
    pub fn took_later(&self, call: Call, ran: Timed) {
        self.later.lock().unwrap_or_else(|e| e.into_inner()).push((call, ran));
    }

    /// Everything counted since the last `take`, and a fresh count from now (calls still queued
    /// on a GPU are waited for).
    pub fn take(&self) -> [Tally; 6] {
        let later = std::mem::take(&mut *self.later.lock().unwrap_or_else(|e| e.into_inner()));
        for (call, ran) in later {
            if let Some((start, end)) = ran() {
                self.took(call, end.saturating_duration_since(start).as_secs_f64());
            }
        }
        std::mem::take(&mut *self.tallies.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// One rank's calls on one axis over a run.
#[derive(Clone, Debug)]
pub struct AxisTally {
    /// The axis ("tp", "dp×cp", …) and how many ranks its groups have.
    pub axis: &'static str,
    pub ranks: usize,
    pub call: Call,
    pub tally: Tally,
}

/// Adds `more` into `into`, a row per axis and kind of call.
pub fn merge(into: &mut Vec<AxisTally>, more: Vec<AxisTally>) {
    for t in more {
        match into.iter_mut().find(|r| r.axis == t.axis && r.call == t.call) {
            Some(r) => {
                r.tally.calls += t.tally.calls;
                r.tally.bytes += t.tally.bytes;
                r.tally.seconds += t.tally.seconds;
            }
            None => into.push(t),
        }
    }
}

/// The comm report: per axis and kind of call, per step and per rank (the mean over the run's
/// `ranks`, each a list of `AxisTally`), calls, MB (B of the table), MB through the rank's link,
/// measured ms (on the host backend, waiting for late peers included) and the model's ms on `link`.
pub fn report(ranks: &[Vec<AxisTally>], steps: usize, link: Link) -> String {
    let mut rows: Vec<AxisTally> = Vec::new();
    ranks.iter().for_each(|r| merge(&mut rows, r.clone()));
    let per = (steps.max(1) * ranks.len().max(1)) as f64; // per step, per rank
    let mut s = format!("communication per step and per rank (mean over {} ranks, {steps} steps)\n", ranks.len());
    s += &format!("α–β model on {}\n", link.describe());
    s += &format!(
        "{:<7} {:>5}  {:<14} {:>9} {:>10} {:>10} {:>12} {:>10}\n",
        "axis", "ranks", "call", "calls", "MB", "moved MB", "measured ms", "model ms"
    );
    let mut total = [0.0; 4];
    for AxisTally { axis, ranks: n, call, tally: t } in rows.iter().filter(|r| r.tally.calls > 0) {
        let (calls, mb, moved) =
            (t.calls as f64 / per, t.bytes as f64 / per / 1e6, t.moved_bytes(*call, *n) / per / 1e6);
        let (measured, model) = (t.seconds / per * 1e3, t.predicted_seconds(*call, *n, link) / per * 1e3);
        total = [total[0] + mb, total[1] + moved, total[2] + measured, total[3] + model];
        let name = call.name();
        s += &format!(
            "{axis:<7} {n:>5}  {name:<14} {calls:>9.1} {mb:>10.3} {moved:>10.3} {measured:>12.3} {model:>10.3}\n"
        );
    }
    let [mb, moved, measured, model] = total;
    s += &format!("{:<38} {mb:>10.3} {moved:>10.3} {measured:>12.3} {model:>10.3}\n", "total");
    s
}
