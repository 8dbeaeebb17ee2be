//! Under `mpirun` (the `mpi` cargo feature; `.ci/run` installs Open MPI and runs this file with
//! `cargo test --release --features mpi --test mpi`): a layout spread over `-np 2` and `-np 4`
//! processes on this host (oversubscribed) gives the one-process loss curve, and a stalled or a
//! killed process ends the run, its rank and host named, with no process left behind.
#![cfg(feature = "mpi")]

mod common;

use common::processes::{args, mpirun, said, wait_all};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(300);

fn small(extra: &[&str]) -> Vec<String> {
    common::SMALL.iter().chain(extra).map(|s| s.to_string()).collect()
}

fn converge_over(n: usize, variants: &str, extra: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let a = args(
        &["converge", "--variants", variants, "--steps", "4", "--out", tmp.path().to_str().unwrap()],
        &small(extra),
    );
    let out = wait_all(vec![mpirun(n, &a)], LIMIT).remove(0);
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    for v in variants.split(';') {
        let line = text.lines().find(|l| l.starts_with(&format!("{v} "))).unwrap_or_else(|| panic!("{v}?\n{text}"));
        let diff: f32 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(line.ends_with("pass") && diff <= 1e-4, "{line}");
    }
    assert_eq!(text.matches("running baseline").count(), 1, "only process 0 prints:\n{text}");
}

#[test]
fn mpirun_np2_gives_the_one_process_curve() {
    converge_over(2, "dp=2;tp=2;pp=2;cp=2;dp=2,tp=2,pp=2", &[]);
}

#[test]
fn mpirun_np4_gives_the_one_process_curve() {
    converge_over(4, "dp=4;tp=2,pp=2;dp=2,cp=2,tp=2", &[]);
}

/// The pid of the MPI process of rank `rank` started by the mpirun `parent`, once it exists.
fn mpi_process(parent: u32, rank: usize) -> i32 {
    let start = Instant::now();
    loop {
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit(')').next().and_then(|s| s.split_whitespace().nth(1)).unwrap_or("");
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let env = String::from_utf8_lossy(&env);
            if ppid == parent.to_string() && env.split('\0').any(|v| v == format!("OMPI_COMM_WORLD_RANK={rank}")) {
                return pid;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(60), "mpirun started no rank {rank}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Two processes training dp=2 for long; returns mpirun, once rank 0 has logged `steps` steps.
fn long_run(metrics: &std::path::Path, timeout_s: &str) -> std::process::Child {
    let extra = ["parallel.dp=2", "train.steps=100000", "train.micro_batch_size=4", timeout_s];
    let mut a = args(&["train"], &small(&extra));
    a.extend(["--metrics".into(), metrics.to_str().unwrap().into()]);
    let child = mpirun(2, &a);
    common::processes::wait_for_steps(metrics, 2, LIMIT);
    child
}

fn no_process_left(pid: i32) {
    let start = Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z")
    {
        assert!(start.elapsed() < Duration::from_secs(30), "process {pid} was left behind");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_stalled_process_ends_the_mpi_run_within_the_timeout_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let run = long_run(&tmp.path().join("m.jsonl"), "parallel.timeout_s=3");
    let (first, second) = (mpi_process(run.id(), 0), mpi_process(run.id(), 1));
    unsafe { libc::kill(second, libc::SIGSTOP) };
    let out = wait_all(vec![run], Duration::from_secs(60)).remove(0);
    let text = said(&out);
    assert!(!out.status.success());
    assert!(text.contains("timed out after 3.0s waiting for rank(s) [1 (process 1 on host "), "{text}");
    unsafe { libc::kill(second, libc::SIGKILL) };
    no_process_left(first);
}

#[test]
fn a_killed_process_ends_the_mpi_run_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let run = long_run(&tmp.path().join("m.jsonl"), "parallel.timeout_s=60");
    let (first, second) = (mpi_process(run.id(), 0), mpi_process(run.id(), 1));
    unsafe { libc::kill(second, libc::SIGKILL) };
    let start = Instant::now();
    let out = wait_all(vec![run], Duration::from_secs(60)).remove(0);
    assert!(start.elapsed() < Duration::from_secs(30), "ended at once, not after parallel.timeout_s = 60");
    let text = said(&out);
    assert!(!out.status.success());
    // mpirun's own report names the MPI rank (our process index) and the node
    assert!(text.contains("process rank 1") && text.contains("on node ") && text.contains("signal 9"), "{text}");
    no_process_left(first);
}
