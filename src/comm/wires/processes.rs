//! # Beyond one machine: which ranks this process runs
//!
//! So far one process ran every rank as a thread, so a run ended at one machine's GPUs. On a
//! cluster a launcher starts the same program many times, and each copy must find out which
//! ranks are its own. Two launchers are understood, by the environment they leave:
//!
//! ```text
//! mpirun / mpiexec / srun      OMPI_COMM_WORLD_RANK …, PMI_RANK …, SLURM_PROCID …   → MPI
//! torchrun (or set by hand)    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//!                              MASTER_ADDR, MASTER_PORT                              → TCP
//! ```
//! (`srun` with `MASTER_ADDR`/`MASTER_PORT` set is read like torchrun.) Without either, or with
//! one process, the run is the one process of before.
//!
//! Each process takes a contiguous block of world/processes ranks (`share`) and runs them as
//! threads that meet in its hub (`comm/local.rs`); the hubs of the processes are joined by a
//! wire (`comm/wires/remote.rs`) — MPI or TCP on the host, and NCCL for GPU tensors.
//!
//! ```text
//! mpirun -np 2 ferrotron train --set parallel.dp=2 --set parallel.tp=2      world = 4 ranks
//!   process 0 (node A): ranks 0 1  ─┐  tp is the grid's fastest axis: a tp group stays
//!   process 1 (node B): ranks 2 3  ─┘  inside a process while tp divides world/processes
//! ```
//! **One process per GPU** is how to launch on GPUs (`torchrun --nproc-per-node=8`, `srun
//! --ntasks-per-node=8`): it is what every launcher gives, each process opens the GPU its local
//! rank names and one NCCL communicator per group (NCCL's own model), and a crash takes one rank
//! with it, which the others then report. Several ranks per process still work (world = k ×
//! processes), GPU ranks then sharing the host path or one GPU each: that is how the CPU tests
//! run an 8-rank 3D layout on 2 processes, and how a node's ranks can stay threads.

use anyhow::{anyhow, bail, Context, Result};
use std::ops::Range;
use std::sync::OnceLock;

/// One process of a multi-process run, as its launcher described it.
#[derive(Clone, Debug, PartialEq)]
pub struct Processes {
    /// This process's place among all of them (MPI rank, torchrun `RANK`).
    pub index: usize,
    pub count: usize,
    /// Its place among the processes of its node, and how many the node has.
    pub local_index: usize,
    pub local_count: usize,
    /// How the processes reach each other.
    pub wire: WireKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum WireKind {
    /// MPI messages (`comm/wires/mpi.rs`, the `mpi` cargo feature).
    Mpi,
    /// TCP links, met through process 0 listening at `MASTER_ADDR:MASTER_PORT` (`comm/wires/tcp.rs`).
    Tcp { addr: String, port: u16 },
}

/// This process's place, read once from the environment; `None` when it is the only one.
pub fn current() -> Result<Option<&'static Processes>> {
    static FOUND: OnceLock<Result<Option<Processes>, String>> = OnceLock::new();
    let vars = |name: &str| std::env::var(name).ok();
    match FOUND.get_or_init(|| from_env(&vars).map_err(|e| format!("{e:#}"))) {
        Ok(found) => Ok(found.as_ref()),
        Err(e) => Err(anyhow!("{e}")),
    }
}

/// Whether this process speaks for the run (prints, writes its files): process 0, or the only one.
pub fn leads() -> bool {
    !matches!(current(), Ok(Some(p)) if p.index > 0)
}

/// Reads the launcher's variables (`vars` looks one up). torchrun's win over MPI's: a script may
/// set them under `srun` to choose TCP.
pub fn from_env(vars: &dyn Fn(&str) -> Option<String>) -> Result<Option<Processes>> {
    let number = |name: &str| -> Result<Option<usize>> {
        vars(name)
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .with_context(|| format!("environment variable {name} = {v:?} is not a number"))
            })
            .transpose()
    };
    let torchrun = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"];
    let slurm = vars("SLURM_PROCID").is_some() && vars("SLURM_NTASKS").is_some();
    let found = if torchrun.iter().any(|v| vars(v).is_some()) && !(slurm && vars("RANK").is_none()) {
        let missing: Vec<&str> = torchrun.iter().copied().filter(|v| vars(v).is_none()).collect();
        if !missing.is_empty() {
            bail!("a torchrun-style launch sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; {} missing (unset them all to run as one process)", missing.join(", "));
        }
        let port = vars("MASTER_PORT").unwrap_or_default();
        let port = port
            .trim()
            .parse::<u16>()
            .map_err(|_| anyhow!("environment variable MASTER_PORT = {port:?} is not a port number (1–65535)"))?;
        let wire = WireKind::Tcp { addr: vars("MASTER_ADDR").unwrap_or_default(), port };
        let n = |v| Ok::<_, anyhow::Error>(number(v)?.unwrap_or(0));
        Processes {
            index: n("RANK")?,
            count: n("WORLD_SIZE")?,
            local_index: n("LOCAL_RANK")?,
            local_count: n("LOCAL_WORLD_SIZE")?,
            wire,
        }
    } else if let Some(count) = number("OMPI_COMM_WORLD_SIZE")? {
        let n = |v| Ok::<_, anyhow::Error>(number(v)?.unwrap_or(0));
        let local_count = number("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(1);
        Processes {
            index: n("OMPI_COMM_WORLD_RANK")?,
            count,
            local_index: n("OMPI_COMM_WORLD_LOCAL_RANK")?,
            local_count,
            wire: WireKind::Mpi,
        }
    } else if let Some(count) = number("PMI_SIZE")? {
        let (index, local_index) = (number("PMI_RANK")?.unwrap_or(0), number("MPI_LOCALRANKID")?.unwrap_or(0));
        let local_count = number("MPI_LOCALNRANKS")?.unwrap_or(1);
        Processes { index, count, local_index, local_count, wire: WireKind::Mpi }
    } else if slurm {
        // srun: SLURM_TASKS_PER_NODE reads like "8(x2)"; the first number is this node's share
        let per_node = vars("SLURM_NTASKS_PER_NODE").or_else(|| vars("SLURM_TASKS_PER_NODE")).unwrap_or_default();
        let local_count = per_node.split(['(', ',']).next().and_then(|n| n.trim().parse().ok()).unwrap_or(1);
        let (index, count) = (number("SLURM_PROCID")?.unwrap_or(0), number("SLURM_NTASKS")?.unwrap_or(1));
        let wire = match (vars("MASTER_ADDR"), number("MASTER_PORT")?) {
            (Some(addr), Some(port)) if port <= u16::MAX as usize => WireKind::Tcp { addr, port: port as u16 },
            _ => WireKind::Mpi,
        };
        Processes { index, count, local_index: number("SLURM_LOCALID")?.unwrap_or(0), local_count, wire }
    } else {
        return Ok(None);
    };
    if let WireKind::Tcp { addr, port } = &found.wire {
        // port 0 would have the OS pick one process 0 alone knows; process 0 listens on IPv4
        if *port == 0 {
            bail!("environment variable MASTER_PORT = 0: give the port process 0 listens on (1–65535), the same for every process");
        }
        if addr.trim_matches(['[', ']']).parse::<std::net::Ipv6Addr>().is_ok() {
            bail!("environment variable MASTER_ADDR = {addr} is an IPv6 address: process 0 listens on IPv4 only; give its IPv4 address or a host name that resolves to one");
        }
    }
    if found.count == 0
        || found.index >= found.count
        || found.local_count == 0
        || found.local_index >= found.local_count
    {
        bail!("the launcher's environment is inconsistent: process {} of {}, local {} of {} (each index must be below its count)", found.index, found.count, found.local_index, found.local_count);
    }
    Ok((found.count > 1).then_some(found))
}

impl Processes {
    /// The ranks this process runs: its contiguous block of `world / count`.
    pub fn share(&self, world: usize) -> Result<Range<usize>> {
        if world < self.count || !world.is_multiple_of(self.count) {
            let divisors: Vec<String> =
                (1..=world).filter(|d| world.is_multiple_of(*d)).map(|d| d.to_string()).collect();
            bail!(
                "parallel: the layout has {world} rank(s), which do not split over the {} processes the launcher started; start {} processes (each runs world / processes ranks as threads)",
                self.count,
                divisors.join(", ")
            );
        }
        let k = world / self.count;
        Ok(self.index * k..(self.index + 1) * k)
    }

    /// How many ranks run on this process's node, and where its first rank sits among them (a
    /// rank's GPU is its place on the node).
    pub fn on_node(&self, world: usize) -> (usize, usize) {
        let k = world / self.count;
        (k * self.local_count, k * self.local_index)
    }

    /// How the launcher is named in messages.
    pub fn launcher(&self) -> &'static str {
        match self.wire {
            WireKind::Mpi => "mpirun/srun",
            WireKind::Tcp { .. } => "the torchrun-style environment",
        }
    }
}

/// A wire between processes: carries bytes from this process to another, in order per pair.
pub trait Wire: Send + Sync {
    /// Queues `bytes` for process `to`; they arrive after everything sent to `to` before.
    fn send(&self, to: usize, bytes: Vec<u8>);
    /// Ends the wire when the program ends: `ok` after a clean run; otherwise MPI aborts the job,
    /// so that the launcher stops every process (this call then does not return).
    fn end(&self, ok: bool);
}

/// What a wire does with what arrives: the bytes from process `from`, or why the link to it
/// broke (the process died or closed it).
pub type Deliver = std::sync::Arc<dyn Fn(usize, std::result::Result<Vec<u8>, String>) + Send + Sync>;

/// This machine's name, for messages that say where a rank ran.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match ok && end > 0 {
        true => String::from_utf8_lossy(&buf[..end]).into_owned(),
        false => "unknown host".into(),
    }
}
