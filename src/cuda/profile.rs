//! # Where a GPU step's time goes
//!
//! `ferrotron bench --profile` times every kernel launch and cuBLAS call of the measured steps: a
//! CUDA event is recorded on the compute stream just before the work and one just after, and the
//! GPU writes the time it reaches each. The events are read only after the run, so timing never
//! makes the host wait for the GPU; each event still costs the GPU a little, so a profiled step is
//! a bit slower than a plain one. The table adds the times up by kernel name (by shape for the
//! matrix products) and shows each one's share of the step: what to optimise first, before and
//! after each change. Works on the GPU only; the CPU reference runs its ops one after the other,
//! so `train --trace` already shows where its time goes.

use crate::cuda::runtime::cuda_err;
use anyhow::Result;
use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static ON: AtomicBool = AtomicBool::new(false);
static SPANS: Mutex<Vec<(String, CudaEvent, CudaEvent)>> = Mutex::new(Vec::new());

/// From now on, every GPU launch of this process is timed.
pub fn start() {
    ON.store(true, Ordering::Relaxed);
}

/// Queues `work` on `stream`, between two timing events when profiling.
pub fn timed(name: impl FnOnce() -> String, stream: &CudaStream, work: impl FnOnce() -> Result<()>) -> Result<()> {
    if !ON.load(Ordering::Relaxed) {
        return work();
    }
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let begin = stream.record_event(timing).map_err(cuda_err)?;
    work()?;
    let end = stream.record_event(timing).map_err(cuda_err)?;
    SPANS.lock().unwrap_or_else(|e| e.into_inner()).push((name(), begin, end));
    Ok(())
}

/// One line of the profile: a kernel (or GEMM shape), how often it ran and its total GPU time.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Row {
    pub name: String,
    pub calls: usize,
    pub ms: f64,
}

/// Stops profiling and returns the time of everything timed so far, by name, longest first
/// (waits for the GPU to reach the last event).
pub fn finish() -> Result<Vec<Row>> {
    ON.store(false, Ordering::Relaxed);
    let spans = std::mem::take(&mut *SPANS.lock().unwrap_or_else(|e| e.into_inner()));
    let mut by_name: HashMap<String, Row> = HashMap::new();
    for (name, begin, end) in spans {
        let ms = begin.elapsed_ms(&end).map_err(cuda_err)? as f64;
        let row = by_name.entry(name.clone()).or_insert(Row { name, calls: 0, ms: 0.0 });
        row.calls += 1;
        row.ms += ms;
    }
    Ok(longest_first(by_name.into_values().collect()))
}

/// Rows by total time, longest first (ties by name).
pub fn longest_first(mut rows: Vec<Row>) -> Vec<Row> {
    rows.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.name.cmp(&b.name)));
    rows
}

/// The profile of `steps` steps of `step_ms` each (counting every rank's steps, when ranks ran),
/// per step: calls, milliseconds and share of the step; the last line is the part of the step the GPU spent on none of them (waiting for the
/// host, or between launches).
pub fn table(rows: &[Row], steps: usize, step_ms: f64) -> String {
    let per_step = |v: f64| v / steps.max(1) as f64;
    let mut s = format!("{:<44} {:>12} {:>12} {:>7}\n", "kernel (or GEMM m×n×k)", "calls/step", "ms/step", "share");
    for r in rows {
        let ms = per_step(r.ms);
        let share = 100.0 * ms / step_ms;
        s += &format!("{:<44} {:>12.1} {:>12.3} {:>6.1}%\n", r.name, per_step(r.calls as f64), ms, share);
    }
    let busy = per_step(rows.iter().map(|r| r.ms).sum());
    let idle = (step_ms - busy).max(0.0);
    s += &format!("{:<44} {:>12} {:>12.3} {:>6.1}%\n", "(GPU idle: host, launches)", "", idle, 100.0 * idle / step_ms);
    s
}
