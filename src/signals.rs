//! # Signals: noted when they come, acted on where work can stop
//!
//! A scheduler that ends a job sends SIGTERM; a person presses Ctrl-C (SIGINT). `train` installs
//! a handler that only notes the first one (nothing else is safe inside a handler) and exits at
//! once on a later one. One signal often arrives twice: `timeout` and job runners pass it to the
//! process and then to its whole group, and a terminal's Ctrl-C reaches both the wrapper and the
//! process, which the wrapper then forwards. So any signal within [`COPIES_WITHIN`] of the first
//! is taken as a copy of it (it says so on stderr): two deliberate presses of Ctrl-C inside that
//! second are one request to stop cleanly, and only a signal after it stops at once. (Telling
//! copies by their sender, `SA_SIGINFO`'s `si_pid`, cannot work: the terminal's copy comes from
//! the kernel and the forwarded one from the wrapper, and `timeout`'s two copies from one pid.)
//! Everything long that the run does then asks, between two pieces of its work, whether a signal
//! came:
//!
//! ```text
//! the training step     between micro-batches, all ranks at once    train/stop.rs (a checkpoint)
//! validation            between micro-batches                        train/validate.rs
//! reading a file        between chunks of CHUNK bytes                files::read_bytes
//! preparing data        between documents, between chunks of tokens  data/text.rs
//! waiting for peers     between tries to meet                        comm/wires/tcp.rs
//! ```
//! Outside the training step nothing is half done: the work stops with `Interrupted`, an error
//! the readers pass up unchanged, and the command exits 128 + the signal's number, as shells
//! expect. Where no handler is installed (every command but `train`), a signal ends the process
//! as it always does, and `check` never fires.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

/// Signals this soon after the first are copies of it; a later one stops the process at once.
pub const COPIES_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// The first signal received, 0 while none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);
/// When the first signal came, in nanoseconds of the monotonic clock.
static FIRST_AT: AtomicU64 = AtomicU64::new(0);

/// Installs the handler for SIGINT and SIGTERM (the `ferrotron` binary does, for `train`).
pub fn install() {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `on_signal` only touches atomics and calls async-signal-safe functions.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

/// The monotonic clock in nanoseconds (clock_gettime is async-signal-safe).
#[cfg(unix)]
fn now_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    let now = now_ns();
    let first = RECEIVED.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst).is_ok();
    if first {
        FIRST_AT.store(now, Ordering::SeqCst);
    }
    // a copy also when the first's time is not stored yet (0): it came within nanoseconds
    let at = FIRST_AT.load(Ordering::SeqCst);
    let copy = !first && (at == 0 || now.saturating_sub(at) < COPIES_WITHIN.as_nanos() as u64);
    let msg: &[u8] = if first {
        b"\nsignal received: stopping at the next micro-batch, then saving a checkpoint (signal again, a second from now, to stop at once)\n"
    } else if copy {
        b"another signal within a second of the first: taken as a copy of it (wrappers such as `timeout` pass one on twice)\n"
    } else {
        b"\nsecond signal: stopping now\n"
    };
    // SAFETY: write(2) and _exit(2) are async-signal-safe.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        if !first && !copy {
            libc::_exit(128 + sig);
        }
    }
}

/// The signal received so far, if any.
pub fn received() -> Option<i32> {
    Some(RECEIVED.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// The signal's name, for messages.
pub fn name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// Work outside the training step stopped by a signal: the command exits 128 + `signal`.
#[derive(Debug)]
pub struct Interrupted {
    pub signal: i32,
    /// What was being done, as "reading model.safetensors".
    pub during: String,
    /// What the work leaves behind, where it is more than nothing.
    pub left: Option<String>,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let left = self.left.as_deref().unwrap_or("nothing was written");
        write!(f, "stopped by {} while {}: {left}", name(self.signal), self.during)
    }
}

impl std::error::Error for Interrupted {}

/// `Err(Interrupted)` once a signal has come: called between two pieces of long work.
pub fn check(during: impl FnOnce() -> String) -> anyhow::Result<()> {
    match received() {
        Some(signal) => Err(Interrupted { signal, during: during(), left: None }.into()),
        None => Ok(()),
    }
}

/// `check`, for work that leaves something behind when it stops: `left` says what.
pub fn check_leaving(during: impl FnOnce() -> (String, String)) -> anyhow::Result<()> {
    match received() {
        Some(signal) => {
            let (during, left) = during();
            Err(Interrupted { signal, during, left: Some(left) }.into())
        }
        None => Ok(()),
    }
}

/// The signal that stopped `e`'s work, if `e` is (or wraps) an `Interrupted`.
pub fn interrupted(e: &anyhow::Error) -> Option<i32> {
    e.chain().find_map(|c| c.downcast_ref::<Interrupted>()).map(|i| i.signal)
}
