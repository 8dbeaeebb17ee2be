//! # Counting a rank's host memory
//!
//! `ferrotron memory --measure` and every run's summary report the most bytes a rank's tensors
//! held at once. On a GPU the device's pool counts them; on the CPU each tensor's host buffer
//! counts itself in the meter of the thread that made it (the launcher starts one per rank
//! thread), in when made and out when freed, wherever that happens.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// What one rank's CPU tensors hold: the bytes now, and the most at once since the last look
/// (`ferrotron memory --measure`; on a GPU the device's pool counts the same way).
#[derive(Default, Debug)]
pub struct Meter {
    held: AtomicUsize,
    peak: AtomicUsize,
}

thread_local! {
    static METER: RefCell<Option<Arc<Meter>>> = const { RefCell::new(None) };
}

/// From now on the CPU tensors made on this thread count in a fresh meter (the launcher starts
/// one on each rank's thread). A tensor remembers its meter, so it counts out wherever it is freed.
pub fn start_meter() {
    METER.with(|m| *m.borrow_mut() = Some(Arc::new(Meter::default())));
}

/// The host memory of a CPU tensor, counted in the meter of the thread that made it.
#[derive(Debug)]
pub struct HostBuf {
    data: Vec<f32>,
    meter: Option<Arc<Meter>>,
}

impl HostBuf {
    pub(crate) fn new(data: Vec<f32>) -> HostBuf {
        let meter = METER.with(|m| m.borrow().clone());
        if let Some(m) = &meter {
            let held = m.held.fetch_add(4 * data.len(), Ordering::Relaxed) + 4 * data.len();
            m.peak.fetch_max(held, Ordering::Relaxed);
        }
        HostBuf { data, meter }
    }
}

impl Clone for HostBuf {
    fn clone(&self) -> HostBuf {
        HostBuf::new(self.data.clone())
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if let Some(m) = &self.meter {
            m.held.fetch_sub(4 * self.data.len(), Ordering::Relaxed);
        }
    }
}

impl Deref for HostBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.data
    }
}

impl DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
}

/// The most bytes this thread's meter counted at once since the last call (0 without a meter).
pub fn take_peak_bytes() -> usize {
    METER.with(|m| m.borrow().as_ref().map_or(0, |m| m.peak.swap(m.held.load(Ordering::Relaxed), Ordering::Relaxed)))
}
