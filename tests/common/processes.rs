//! Starting `ferrotron` as several processes, the way a launcher does: torchrun-style (our own
//! environment variables) or under `mpirun`. Every wait is bounded: a run that outlives its limit
//! is killed, whole, and the test fails with what the processes printed.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_ferrotron");

/// A port nobody listens on now (the OS picks it).
pub fn free_port() -> u16 {
    // not the OS's pick (bind to 0): released at once, the same port can come back to a test
    // running beside this one; a counter gives each call of this test binary its own
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let base = (std::process::id() % 500) * 60;
    loop {
        let port = (20_000 + (base + NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)) % 40_000) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
}

/// `ferrotron args…` as process `rank` of `n`, torchrun-style, meeting process 0 on this host's
/// `port`; its output piped.
pub fn process_of(rank: usize, n: usize, port: &str, args: &[String]) -> Command {
    let (rank, n) = (rank.to_string(), n.to_string());
    let mut c = Command::new(BIN);
    c.args(args)
        .envs([("RANK", &rank), ("WORLD_SIZE", &n), ("LOCAL_RANK", &rank), ("LOCAL_WORLD_SIZE", &n)])
        .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// `n` processes of `ferrotron args…` with torchrun's variables (and `env`), all on this host.
pub fn torchrun(n: usize, args: &[String], env: &[(&str, &str)]) -> Vec<Child> {
    let port = free_port().to_string();
    (0..n).map(|r| process_of(r, n, &port, args).envs(env.iter().copied()).spawn().unwrap()).collect()
}

/// `mpirun -np n ferrotron args…` on this host, oversubscribed (more processes than cores).
pub fn mpirun(n: usize, args: &[String]) -> Child {
    Command::new("mpirun")
        .args(["--oversubscribe", "-np", &n.to_string(), BIN])
        .args(args)
        .envs([("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")]) // CI runs as root
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun (Open MPI: apt install openmpi-bin libopenmpi-dev)")
}

/// Waits for every child, at most `limit` in all; kills them all and fails past it.
pub fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<Output> {
    let start = Instant::now();
    let mut children: Vec<Option<Child>> = children.into_iter().map(Some).collect();
    while children.iter_mut().flatten().any(|c| c.try_wait().unwrap().is_none()) {
        if start.elapsed() > limit {
            children.iter_mut().flatten().for_each(|c| drop(c.kill()));
            let outs: Vec<String> =
                children.iter_mut().map(|c| said(&c.take().unwrap().wait_with_output().unwrap())).collect();
            panic!("the processes outlived {limit:?}:\n{}", outs.join("\n---\n"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children.iter_mut().map(|c| c.take().unwrap().wait_with_output().unwrap()).collect()
}

/// stdout and stderr of a process, for assertions and failure messages.
pub fn said(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// `--set` pairs for `sets`.
pub fn args(command: &[&str], sets: &[String]) -> Vec<String> {
    let mut a: Vec<String> = command.iter().map(|s| s.to_string()).collect();
    sets.iter().for_each(|s| a.extend(["--set".to_string(), s.clone()]));
    a
}

/// Waits until the metrics file `path` has `lines` lines (steps) or `limit` passes.
pub fn wait_for_steps(path: &Path, lines: usize, limit: Duration) {
    let start = Instant::now();
    while std::fs::read_to_string(path).map_or(0, |s| s.lines().count()) < lines {
        assert!(start.elapsed() < limit, "no {lines} steps in {} within {limit:?}", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// (step, loss) of every line of a metrics file (`--metrics`).
pub fn losses(path: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|j| (j["step"].as_u64().unwrap(), j["loss"].as_f64().unwrap()))
        .collect()
}
