//! # The MPI wire (cargo feature `mpi`)
//!
//! Started by `mpirun`/`srun`, the processes already know each other: MPI_COMM_WORLD is the list
//! of them, with this process at its MPI rank. The wire is two threads on top of it:
//!
//! ```text
//! sender     the queue of (process, bytes), in order: MPI_Send, blocking until MPI has the bytes
//! receiver   MPI_Improbe for any process: MPI_Mrecv what came, hand it to the bridge; when
//!            nothing came, sleep a little (a blocking probe would spin a core the ranks need)
//! ```
//! Because every process always receives, a blocking send always completes, and the order of
//! messages from one process to another is kept (MPI never lets them overtake). Two threads
//! calling MPI need MPI_THREAD_MULTIPLE, which Open MPI 4 and MPICH provide.
//!
//! A run that fails calls MPI_Abort after printing why, so that the launcher stops every other
//! process; a clean run ends with MPI_Finalize, on the thread that started MPI.

use super::processes::{Deliver, Processes, Wire};
use anyhow::{bail, Result};
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The one tag of ferrotron's messages.
const TAG: i32 = 17;

/// What the sender thread sends: (process, bytes).
type Outbox = mpsc::Sender<(usize, Vec<u8>)>;

pub struct Mpi {
    queue: Mutex<Option<Outbox>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    stop: Arc<AtomicBool>,
    universe: Mutex<Option<Universe>>,
}

/// Starts MPI on this thread and the wire's two threads.
pub fn connect(me: &Processes, deliver: Deliver) -> Result<Mpi> {
    let Some((universe, level)) = mpi::initialize_with_threading(Threading::Multiple) else {
        bail!("MPI was started twice in this process");
    };
    if level < Threading::Multiple {
        bail!("this MPI offers thread level {level:?}; ferrotron's wire needs MPI_THREAD_MULTIPLE (Open MPI 4 and MPICH have it)");
    }
    let world = universe.world();
    if world.size() as usize != me.count || world.rank() as usize != me.index {
        bail!(
            "MPI says this is process {} of {}, the environment said {} of {}: start ferrotron with the MPI it was built for",
            world.rank(),
            world.size(),
            me.index,
            me.count
        );
    }
    let (tx, rx) = mpsc::channel::<(usize, Vec<u8>)>();
    let sender = std::thread::spawn(move || {
        let world = SimpleCommunicator::world();
        for (to, bytes) in rx {
            world.process_at_rank(to as i32).send_with_tag(&bytes[..], TAG);
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    let receiver = std::thread::spawn(move || {
        let world = SimpleCommunicator::world();
        let mut idle = Duration::from_micros(5);
        while !stopping.load(Ordering::Acquire) {
            match world.any_process().immediate_matched_probe_with_tag(TAG) {
                Some(probed) => {
                    let (bytes, status) = probed.matched_receive_vec::<u8>();
                    deliver(status.source_rank() as usize, Ok(bytes));
                    idle = Duration::from_micros(5);
                }
                None => {
                    std::thread::sleep(idle);
                    idle = (idle * 2).min(Duration::from_micros(500));
                }
            }
        }
    });
    Ok(Mpi {
        queue: Mutex::new(Some(tx)),
        threads: Mutex::new(vec![sender, receiver]),
        stop,
        universe: Mutex::new(Some(universe)),
    })
}

impl Wire for Mpi {
    fn send(&self, to: usize, bytes: Vec<u8>) {
        if let Some(q) = self.queue.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = q.send((to, bytes));
        }
    }

    fn end(&self, ok: bool) {
        if !ok {
            // the launcher stops every process with SIGTERM: here it must not wait for a step's end
            // SAFETY: restoring the default action of a signal is always allowed.
            unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_DFL);
                libc::signal(libc::SIGINT, libc::SIG_DFL);
            }
            SimpleCommunicator::world().abort(1); // the launcher stops the other processes
        }
        drop(self.queue.lock().unwrap_or_else(|e| e.into_inner()).take()); // the sender drains and ends
        self.stop.store(true, Ordering::Release);
        for t in self.threads.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            let _ = t.join();
        }
        drop(self.universe.lock().unwrap_or_else(|e| e.into_inner()).take()); // MPI_Finalize
    }
}
