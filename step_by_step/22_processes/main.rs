//! Step 22 — beyond one process: what a launcher tells each copy of the program, and two
//! processes training as one.
//! `cargo run --release --example step22`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::{Context, Result};
use ferrotron::comm::wires::processes::{self, from_env};
use ferrotron::train::{train, Options};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// 4 ranks: tp = 2 is the grid's fastest axis, so each process holds a whole tp group and the
/// dp all-reduce is what crosses between the two processes.
const LAYOUT: [&str; 2] = ["parallel.dp=2", "parallel.tp=2"];

fn run(tiny: bool) -> Result<()> {
    if let Ok(out) = std::env::var("STEP17_OUT") {
        return one_of_two(tiny, Path::new(&out)); // a copy started by `start_two` below
    }
    // 1. three launchers, the same process 1 of 2: which ranks of the 4 are its own
    let torchrun = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")];
    let torchrun = [&torchrun[..], &[("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")]].concat();
    let mpirun = [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "0")];
    let srun =
        [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0"), ("SLURM_TASKS_PER_NODE", "1(x2)")];
    for (name, env) in [("torchrun", &torchrun[..]), ("mpirun", &mpirun[..]), ("srun", &srun[..])] {
        let vars = |v: &str| env.iter().find(|(k, _)| *k == v).map(|(_, x)| x.to_string());
        let p = from_env(&vars)?.context("a launch of two processes")?;
        let (on_node, first) = p.on_node(4);
        println!(
            "{name:<8} process {} of {}, {} of {} on its node, over {:?}: ranks {:?}; its first rank is #{first} of its node's {on_node}",
            p.index, p.count, p.local_index, p.local_count, p.wire, p.share(4)?
        );
    }
    // 2. the same program twice, torchrun-style, on this machine: each runs 2 of the 4 ranks
    let cfg = common::config(tiny, &LAYOUT)?;
    let want = common::reference(&cfg)?;
    let dir = std::env::temp_dir().join(format!("ferrotron-step22-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let outs = wait(start_two(&dir, &[])?, Duration::from_secs(600))?;
    for (p, out) in outs.iter().enumerate() {
        anyhow::ensure!(out.status.success(), "process {p} failed: {}", said(out));
        let text = std::fs::read_to_string(dir.join(p.to_string()))?;
        let (ranks, losses) = text.split_once('\n').context("process output")?;
        let got: Vec<f32> = losses.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
        println!("process {p} ran ranks {ranks}");
        common::verdict(&format!("process {p} of 2 follows the single-device curve"), &got, &want, 1e-4)?;
    }
    // 3. one process killed after its first step: the other names it and stops, no hang
    let long = ["train.steps=1000", "parallel.timeout_s=20"];
    let metrics = dir.join("metrics.jsonl");
    std::fs::remove_file(&metrics)?; // the run above's
    let mut children = start_two(&dir, &long)?;
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 1 {
        anyhow::ensure!(start.elapsed() < Duration::from_secs(300), "no step within 300 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    children[1].kill()?; // SIGKILL: nothing of process 1 says goodbye
    let killed = Instant::now();
    let outs = wait(children, Duration::from_secs(60))?;
    let host = format!("process 1 on host {}", processes::host_name());
    let said = said(&outs[0]);
    let line = said.lines().find(|l| l.contains(&host) && l.contains("went away")).unwrap_or_default();
    // from the process's name on (before it: "error: ", or under `cargo test` the panic's words)
    println!("process 0 said: {}", line.find(&host).map_or(line, |at| &line[at..]));
    let ended = !outs[0].status.success() && !line.is_empty();
    let detail = format!("it ended {:.1} s after the kill", killed.elapsed().as_secs_f64());
    common::claim("process 0 stops at once, naming process 1, its ranks and its host", ended, &detail)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Starts this program twice with torchrun's variables (both on this machine, process 0
/// listening on a free port); each writes what it ran to `dir`/its index.
fn start_two(dir: &Path, sets: &[&str]) -> Result<Vec<Child>> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
    let me = std::env::current_exe()?;
    // the same flags (--tiny, --gpu); under `cargo test`, this step's test `tiny` alone (the size
    // it runs at comes with the environment)
    let args: Vec<String> = match cfg!(test) {
        true => ["--exact", "tiny", "--nocapture"].map(String::from).to_vec(),
        false => std::env::args().skip(1).collect(),
    };
    (0..2)
        .map(|p: usize| {
            let (p, out) = (p.to_string(), dir.join(p.to_string()));
            let env = [("RANK", &p[..]), ("WORLD_SIZE", "2"), ("LOCAL_RANK", &p), ("LOCAL_WORLD_SIZE", "2")];
            Command::new(&me)
                .args(&args)
                .envs(env)
                .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port)])
                .env("STEP17_OUT", &out)
                .env("STEP17_SETS", sets.join(" "))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting a copy of this program")
        })
        .collect()
}

/// Waits for both processes, at most `limit`; past it, kills them.
fn wait(mut children: Vec<Child>, limit: Duration) -> Result<Vec<Output>> {
    let start = Instant::now();
    while children.iter_mut().any(|c| c.try_wait().is_ok_and(|s| s.is_none())) {
        if start.elapsed() > limit {
            children.iter_mut().for_each(|c| drop(c.kill()));
            anyhow::bail!("the processes did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    children.into_iter().map(|c| Ok(c.wait_with_output()?)).collect()
}

/// What a process printed (under `cargo test` an error goes to stdout, in the test's report).
fn said(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A copy's work: train its share of the 4 ranks; write them and the loss curve.
fn one_of_two(tiny: bool, out: &Path) -> Result<()> {
    let sets = std::env::var("STEP17_SETS").unwrap_or_default();
    let extra: Vec<&str> = LAYOUT.iter().copied().chain(sets.split_whitespace()).collect();
    let cfg = common::config(tiny, &extra)?;
    let me = processes::current()?.context("started without a launcher's environment")?;
    let metrics: PathBuf = out.with_file_name("metrics.jsonl"); // process 0 has rank 0, which writes it
    let metrics = (me.index == 0).then_some(metrics.as_path());
    let opts = Options { quiet: true, metrics, ..Default::default() };
    let result = train(&cfg, opts);
    ferrotron::comm::wires::remote::end(result.is_ok()); // the link to the other process, closed
    let losses: Vec<String> = result?.losses.iter().map(|l| l.to_string()).collect();
    std::fs::write(out, format!("{:?}\n{}", me.share(4)?, losses.join(" ")))?;
    Ok(())
}

step!(run);
