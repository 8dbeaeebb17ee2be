//! # Traces: what every rank did, and when
//!
//! `train --trace OUT.json` writes Chrome trace events (open the file in <https://ui.perfetto.dev>
//! or chrome://tracing). Each rank is a process with two lanes: compute (the loop's spans) and
//! comm, where every call of every group of the rank, collective or message, is a span named by
//! the call, its size and its group ("all_reduce(sum) of 4096 values tp[0,1]", "send of … pp[0,2]"):
//! ```text
//! rank 0  compute │ forward 0 ─────││ backward 0 ─────────────────────────││ wait for gradients ││ optimizer │
//!         comm    │ [g tp] [send pp] [recv pp] [f tp] [bucket 0 dp×cp] [f tp] [bucket 1 dp×cp]
//! ```
//! A comm span drawn under a compute span is communication hidden behind computation.

use super::device_link::Ran;
use anyhow::{Context, Result};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The two lanes of a rank: its computing thread and its communication thread.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Lane {
    Compute,
    Comm,
}

#[derive(Clone, Debug)]
pub struct Span {
    pub rank: usize,
    pub lane: Lane,
    pub name: String,
    /// When the call was made: for a communication span, when the computing thread handed it to
    /// the communication thread (it starts once that thread is free and the peers have arrived);
    /// for a compute span, its start.
    pub issued_us: f64,
    pub start_us: f64,
    pub end_us: f64,
}

/// A GPU call's span before its times are known: rank, name, when it was issued, when it ran.
type Later = (usize, String, Instant, Ran);

/// Spans from every rank of a run, on one clock. Clones are handles on the same record (each
/// group of a traced run keeps one, to record its calls).
#[derive(Clone)]
pub struct Trace {
    origin: Instant,
    spans: Arc<Mutex<Vec<Span>>>,
    /// Spans of calls queued on a GPU, whose times the GPU gives later.
    later: Arc<Mutex<Vec<Later>>>,
}

impl Default for Trace {
    fn default() -> Trace {
        Trace { origin: Instant::now(), spans: Arc::default(), later: Arc::default() }
    }
}

impl Trace {
    /// Records a span of `lane` issued at `issued` that ran from `start` to `end`.
    pub fn record(
        &self,
        rank: usize,
        lane: Lane,
        name: impl Into<String>,
        issued: Instant,
        start: Instant,
        end: Instant,
    ) {
        let us = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        let span = Span { rank, lane, name: name.into(), issued_us: us(issued), start_us: us(start), end_us: us(end) };
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).push(span);
    }

    /// Records a communication span of rank `rank` issued at `issued` and run on a GPU: `ran`
    /// gives its times when the spans are read.
    pub fn record_later(&self, rank: usize, name: String, issued: Instant, ran: Ran) {
        self.later.lock().unwrap_or_else(|e| e.into_inner()).push((rank, name, issued, ran));
    }

    /// Every span so far (a call still queued on a GPU is waited for).
    pub fn spans(&self) -> Vec<Span> {
        let later = std::mem::take(&mut *self.later.lock().unwrap_or_else(|e| e.into_inner()));
        for (rank, name, issued, ran) in later {
            if let Some((start, end)) = ran() {
                self.record(rank, Lane::Comm, name, issued, start, end);
            }
        }
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The communication spans whose name `keep` accepts.
    pub fn comm_spans(&self, keep: impl Fn(&str) -> bool) -> Vec<Span> {
        self.spans().into_iter().filter(|s| s.lane == Lane::Comm && keep(&s.name)).collect()
    }

    /// Of all time spent in the communication spans `keep` accepts, the fraction that ran while
    /// the same rank was inside a compute span whose name starts with `during` ("backward").
    pub fn hidden_fraction(&self, keep: impl Fn(&str) -> bool, during: &str) -> f64 {
        let spans = self.spans();
        let (mut total, mut hidden) = (0.0, 0.0);
        for c in self.comm_spans(keep) {
            total += c.end_us - c.start_us;
            for b in spans.iter().filter(|s| s.rank == c.rank && s.lane == Lane::Compute && s.name.starts_with(during))
            {
                hidden += (c.end_us.min(b.end_us) - c.start_us.max(b.start_us)).max(0.0);
            }
        }
        if total > 0.0 {
            hidden / total
        } else {
            0.0
        }
    }

    /// Writes the trace-event JSON (`"ph": "X"` complete events; process = rank, thread = lane).
    pub fn write(&self, path: &Path) -> Result<()> {
        let spans = self.spans();
        let mut events: Vec<serde_json::Value> = Vec::new();
        let mut ranks: Vec<usize> = spans.iter().map(|s| s.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        for r in ranks {
            events.push(
                serde_json::json!({"ph": "M", "name": "process_name", "pid": r, "args": {"name": format!("rank {r}")}}),
            );
            for (tid, lane) in [(0, "compute"), (1, "comm")] {
                events.push(
                    serde_json::json!({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": lane}}),
                );
            }
        }
        for s in spans {
            let tid = if s.lane == Lane::Compute { 0 } else { 1 };
            events.push(serde_json::json!({
                "ph": "X", "name": s.name, "pid": s.rank, "tid": tid, "ts": s.start_us, "dur": s.end_us - s.start_us,
                "args": {"issued_us": s.issued_us}
            }));
        }
        let text = serde_json::to_string(&serde_json::json!({ "traceEvents": events }))?;
        crate::files::write_atomically(path, text.as_bytes()).context("the trace")
    }
}
