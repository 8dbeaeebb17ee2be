//! # Signals: noted when they come, acted on where work can stop
//!
//! A scheduler that ends a job sends SIGTERM; a person presses Ctrl-C (SIGINT). `train` installs
//! a handler that only notes the first one (nothing else is safe inside a handler) and exits at
//! once on the second. Everything long that the run does then asks, between two pieces of its
//! work, whether a signal came:
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

use std::sync::atomic::{AtomicI32, Ordering};

/// The first signal received, 0 while none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// Installs the handler for SIGINT and SIGTERM (the `ferrotron` binary does, for `train`).
pub fn install() {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `on_signal` only touches an atomic and calls async-signal-safe functions.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    let first = RECEIVED.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst).is_ok();
    let msg: &[u8] = if first {
        b"\nsignal received: stopping at the next micro-batch, then saving a checkpoint (signal again to stop at once)\n"
    } else {
        b"\nsecond signal: stopping now\n"
    };
    // SAFETY: write(2) and _exit(2) are async-signal-safe.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        if !first {
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
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "stopped by {} while {}: nothing was written", name(self.signal), self.during)
    }
}

impl std::error::Error for Interrupted {}

/// `Err(Interrupted)` once a signal has come: called between two pieces of long work.
pub fn check(during: impl FnOnce() -> String) -> anyhow::Result<()> {
    match received() {
        Some(signal) => Err(Interrupted { signal, during: during() }.into()),
        None => Ok(()),
    }
}

/// The signal that stopped `e`'s work, if `e` is (or wraps) an `Interrupted`.
pub fn interrupted(e: &anyhow::Error) -> Option<i32> {
    e.chain().find_map(|c| c.downcast_ref::<Interrupted>()).map(|i| i.signal)
}
