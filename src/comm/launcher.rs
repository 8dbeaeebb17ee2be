//! # The rank launcher: one program, `world_size` threads
//!
//! ```text
//! launch(grid, f) ──┬── thread rank 0: f(&Rank { coords, tp, cp, pp, dp, dp×cp, world groups })
//!                   ├── thread rank 1: f(&Rank { … })
//!                   └── …                 each with its own communication thread
//! ```
//! SPMD: every rank runs the same function; only its `Rank` differs. Ranks share nothing but the
//! communication hub. On GPUs, rank r opens GPU r (modulo the GPUs there are) with its compute
//! and communication streams, and on the `nccl` backend every group also gets its NCCL
//! communicator. If one rank fails (an error or a panic), the launcher aborts the hub, so every
//! other rank's pending collective returns at once, and the run ends with the first failure's
//! message. Nobody hangs.
//!
//! Started as one of several processes (`comm/wires/processes.rs`), the launcher runs this process's
//! block of ranks only; their hub is joined to the other processes' (`comm/wires/remote.rs`), and the
//! results returned are this process's ranks'.

use crate::comm::cost::{AxisTally, Call};
use crate::comm::local::{Beyond, Hub};
use crate::comm::nccl::Nccl;
use crate::comm::process_grid::{Axis, Coords, Grid};
use crate::comm::trace::Trace;
use crate::comm::wires::processes;
use crate::comm::wires::remote::Session;
use crate::comm::{Group, Stream};
use crate::config::{CommBackend, Config, DeviceKind};
use crate::cuda::device::catching_panics;
use crate::cuda::runtime::Gpu;
use anyhow::{anyhow, bail, Result};
use std::sync::Arc;
use std::time::Duration;

/// What a rank function receives: who it is and its process groups.
pub struct Rank {
    pub rank: usize,
    pub coords: Coords,
    pub grid: Grid,
    /// This rank's GPU, when the run is on CUDA.
    pub gpu: Option<Gpu>,
    groups: Vec<(Axis, Group)>,
    /// The cuts no setting asked for whose groups are this rank's dp×cp group (no second
    /// communicator for them).
    same_as_dp_cp: Vec<Axis>,
}

/// How GPU tensors travel between ranks (host numbers always go through the hub).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Backend {
    Local,
    Nccl,
}

/// Where the ranks of a run compute and how they talk.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The longest any rank waits for the others.
    pub timeout: Duration,
    /// Each rank opens a GPU.
    pub cuda: bool,
    /// Every GPU launch is waited for and checked (`device.sync_launches`).
    pub sync_launches: bool,
    pub backend: Backend,
    /// The memory the ranks keep their tensors in.
    pub capacity: Capacity,
    /// The ranks are spread over the processes a launcher started (`comm/wires/processes.rs`).
    pub spread: bool,
    /// The GPU of this process's first rank; the next ranks take the next GPUs.
    pub first_gpu: usize,
}

/// The memory a run's ranks keep their tensors in, and how much of it is free.
#[derive(Clone, Debug)]
pub struct Capacity {
    /// Free bytes of the memory the ranks share (host RAM, or the fullest GPU).
    pub bytes: f64,
    /// How many ranks share it.
    pub ranks: usize,
    /// What it is, for messages: "available memory of this machine", "free memory of GPU 0".
    pub what: String,
}

impl Setup {
    pub fn cpu(timeout: Duration) -> Setup {
        let capacity = Capacity::host(1);
        let (spread, first_gpu) = (false, 0);
        Setup { timeout, cuda: false, sync_launches: false, backend: Backend::Local, capacity, spread, first_gpu }
    }

    /// The setup a config asks for, checked against the GPUs this machine has. `spread`: when
    /// this program is one of several processes, the ranks are spread over them (else this
    /// process runs them all, as `converge` does its one-rank baseline).
    pub fn from_config(cfg: &Config, spread: bool) -> Result<Setup> {
        let timeout = Duration::from_secs_f64(cfg.parallel.timeout_s.min(crate::config::MAX_TIMEOUT_S));
        let cuda = cfg.device.kind == DeviceKind::Cuda;
        let processes = if spread { processes::current()? } else { None };
        let (all, gpus) = (cfg.parallel.world_size(), if cuda { crate::cuda::runtime::device_count()? } else { 0 });
        // the ranks whose GPUs this process sees: all of them in one process; spread, the node's
        // when it sees the node's GPUs, else its own (a launcher that gives each its GPUs)
        let (world, first_gpu) = match processes {
            None => (all, 0),
            Some(p) => {
                let (mine, (node, first)) = (p.share(all)?.len(), p.on_node(all));
                if gpus >= node {
                    (node, first)
                } else {
                    (mine, 0)
                }
            }
        };
        let backend = choose_backend(cfg.parallel.backend_asked(), cuda, world, gpus)?;
        let capacity = match cuda {
            // ranks share GPUs round-robin: GPU 0 holds the most
            true => Capacity::gpu(world.div_ceil(gpus))?,
            false => Capacity::host(world),
        };
        let (sync_launches, spread) = (cfg.device.sync_launches, processes.is_some());
        Ok(Setup { timeout, cuda, sync_launches, backend, capacity, spread, first_gpu })
    }
}

impl Capacity {
    /// GPU 0's free memory, shared by `ranks` rank threads (ranks share GPUs round-robin: GPU 0
    /// holds the most).
    pub fn gpu(ranks: usize) -> Result<Capacity> {
        let bytes = crate::cuda::runtime::free_memory(0)? as f64;
        Ok(Capacity { bytes, ranks, what: "free memory of GPU 0".into() })
    }

    /// This machine's available memory (`MemAvailable` of /proc/meminfo), shared by `ranks`
    /// rank threads; unlimited where it cannot be read.
    pub fn host(ranks: usize) -> Capacity {
        let available = crate::files::read_text(std::path::Path::new("/proc/meminfo"), "/proc").ok().and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<f64>().ok().map(|kib| kib * 1024.0)
        });
        Capacity { bytes: available.unwrap_or(f64::INFINITY), ranks, what: "available memory of this machine".into() }
    }
}

/// `auto` picks NCCL when every rank has a GPU of its own, else the local hub.
pub fn choose_backend(choice: CommBackend, cuda: bool, world: usize, gpus: usize) -> Result<Backend> {
    match (choice, cuda) {
        (CommBackend::Nccl, false) => bail!(
            "parallel.backend = \"nccl\" needs device.kind = \"cuda\" (NCCL moves GPU buffers); use \"local\" or \"auto\""
        ),
        (_, true) if gpus == 0 => bail!("device.kind = \"cuda\" but the driver sees no GPU; use device.kind = \"cpu\""),
        (CommBackend::Nccl, true) if gpus < world => bail!(
            "parallel.backend = \"nccl\" needs one GPU per rank: {world} ranks, {gpus} GPU(s); use \"local\" to share GPUs, or fewer ranks"
        ),
        (CommBackend::Nccl, true) => Ok(Backend::Nccl),
        (CommBackend::Auto, true) if world > 1 && gpus >= world => Ok(Backend::Nccl), // one rank: no one to talk to
        _ => Ok(Backend::Local),
    }
}

impl Rank {
    /// This rank's group along `axis`. A cut no setting asked for, with the same ranks as the
    /// dp×cp group (the expert-data group without expert parallelism), is the dp×cp group itself;
    /// a cut a setting asked for is its own group (and its own line in the comm report), even
    /// when it spans dp×cp (the ep group at ep = dp).
    pub fn group(&self, axis: impl Into<Axis>) -> &Group {
        let axis = axis.into();
        let axis = if self.same_as_dp_cp.contains(&axis) { Axis::DpCp } else { axis };
        let found = self.groups.iter().find(|(a, _)| *a == axis);
        &found.unwrap_or_else(|| panic!("the grid has no {} group (`Grid::with_cut`)", axis.name())).1
    }

    /// Records every collective and message of this rank's groups on its comm lane of `trace`.
    pub fn trace_to(&self, trace: &Trace) -> Result<()> {
        self.groups.iter().try_for_each(|(_, g)| g.trace_to(trace, self.rank))
    }

    /// Times this rank's GPU calls from now on (the comm report).
    pub fn time_calls(&self) -> Result<()> {
        self.groups.iter().try_for_each(|(_, g)| g.time_calls())
    }

    /// What this rank's groups counted since the last call, per axis and kind of call.
    pub fn comm_tallies(&self) -> Vec<AxisTally> {
        let mut all = Vec::new();
        for (axis, g) in &self.groups {
            let tallies = g.ledger().take();
            for call in Call::ALL {
                let tally = tallies[call as usize];
                if tally.calls > 0 {
                    all.push(AxisTally { axis: axis.name(), ranks: g.size(), call, tally });
                }
            }
        }
        all
    }
}

/// Runs `f` on every rank of `grid`, each in its own thread, on the CPU; returns the results in
/// rank order, or the first failure. `timeout` bounds every wait for other ranks.
pub fn launch<R: Send>(grid: Grid, timeout: Duration, f: impl Fn(&Rank) -> Result<R> + Sync) -> Result<Vec<R>> {
    launch_on(grid, Setup::cpu(timeout), f)
}

/// `launch` on the devices and backend of `setup`. Spread over processes, it runs and returns
/// this process's ranks only.
pub fn launch_on<R: Send>(grid: Grid, setup: Setup, f: impl Fn(&Rank) -> Result<R> + Sync) -> Result<Vec<R>> {
    let session = match setup.spread {
        true => Session::start(grid.world_size(), setup.timeout)?,
        false => None,
    };
    let here = session.as_ref().map_or(0..grid.world_size(), Session::ranks);
    let beyond = session.clone().map(|s| Box::new(s) as Box<dyn Beyond>);
    let hub = Arc::new(Hub::new(setup.timeout, beyond));
    if let Some(s) = &session {
        s.attach(&hub); // what the other processes sent before this one got here
    }
    let alone = here.len() == 1;
    let results: Vec<Option<R>> = std::thread::scope(|s| {
        let threads: Vec<_> = here
            .clone()
            .map(|rank| {
                let (hub, f, setup) = (hub.clone(), &f, &setup);
                s.spawn(move || {
                    // One rank runs on a rayon worker, so that its ops' parallel loops start where
                    // they are called instead of waking a worker and sleeping until it is done
                    // (a third of the context switches of a tiny step). Several ranks must not:
                    // a worker waiting inside one rank's loop may pick up another rank's whole
                    // run, which then waits in a collective for the first: a deadlock.
                    if alone {
                        rayon::scope(|_| run_rank(grid, setup, rank, hub, f))
                    } else {
                        run_rank(grid, setup, rank, hub, f)
                    }
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().ok().flatten()).collect()
    });
    let closed = session.map_or(Ok(()), |s| s.close(&hub)); // every process is done with this launch
    if let Some(reason) = hub.aborted() {
        bail!("{reason}");
    }
    closed?;
    results.into_iter().zip(here).map(|(x, r)| x.ok_or_else(|| anyhow!("rank {r} stopped"))).collect()
}

/// One rank's thread: its groups, its communication thread, and `f`, with failures reported to
/// the hub. Returns `None` when it failed.
fn run_rank<R>(
    grid: Grid,
    setup: &Setup,
    rank: usize,
    hub: Arc<Hub>,
    f: &(impl Fn(&Rank) -> Result<R> + Sync),
) -> Option<R> {
    crate::ops::meter::start_meter(); // this rank's CPU tensors count in a meter of their own
    let (stream, comm_thread) = Stream::start();
    let dp_cp = grid.group(rank, Axis::DpCp);
    let same_as_dp_cp: Vec<Axis> = (grid.cuts())
        .filter(|c| c.setting.is_none() && grid.group(rank, c.cut) == dp_cp)
        .map(|c| c.cut.into())
        .collect();
    let groups = (grid.axes().into_iter())
        .filter(|axis| !same_as_dp_cp.contains(axis))
        .map(|axis| {
            let members = grid.group(rank, axis);
            let list: Vec<String> = members.iter().map(|r| r.to_string()).collect();
            let name = format!("{}[{}]", axis.name(), list.join(","));
            (axis, Group::new(name, members, rank, hub.clone(), stream.clone()))
        })
        .collect();
    drop(stream);
    let mut me = Rank { rank, coords: grid.coords(rank), grid, gpu: None, groups, same_as_dp_cp };
    let result = catching_panics(|| {
        open_devices(&mut me, setup)?;
        f(&me)
    });
    if let Err(e) = &result {
        hub.abort(format!("rank {rank} failed: {e:#}")); // only the first failure's reason is kept
    }
    drop(me); // closes this rank's stream: the communication thread drains its queue and ends
    let _ = comm_thread.join();
    hub.finish(rank);
    result.ok()
}

/// Opens the rank's GPU and, on NCCL, connects every group (all ranks in the same group
/// order): from then on the group's tensor collectives move GPU tensors through NCCL.
fn open_devices(me: &mut Rank, setup: &Setup) -> Result<()> {
    if !setup.cuda {
        return Ok(());
    }
    // a rank's GPU: its place among this process's ranks, after the process's first GPU
    let per_process = match processes::current()? {
        Some(p) if setup.spread => me.grid.world_size() / p.count,
        _ => me.grid.world_size(),
    };
    let mut gpu = Gpu::open((setup.first_gpu + me.rank % per_process) % crate::cuda::runtime::device_count()?)?;
    gpu.sync_launches = setup.sync_launches;
    if setup.backend == Backend::Nccl {
        for (_, group) in &me.groups {
            group.attach_device_link(Box::new(Nccl::connect(group, &gpu)?));
        }
    }
    me.gpu = Some(gpu);
    Ok(())
}

/// Each rank all-gathers its rank number over each of its groups and checks that it gets the
/// members `process_grid` says: the grid and the collectives agree. Used by `ferrotron grid`.
pub fn check_groups(grid: Grid) -> Result<()> {
    launch(grid, Duration::from_secs(30), |me| {
        for axis in grid.axes() {
            let got = me.group(axis).all_gather(&[me.rank as f32])?;
            let want: Vec<f32> = grid.group(me.rank, axis).iter().map(|&r| r as f32).collect();
            if got != want {
                bail!("rank {}: {} group gathered {got:?}, expected {want:?}", me.rank, axis.name());
            }
        }
        Ok(())
    })
    .map(|_| ())
}
