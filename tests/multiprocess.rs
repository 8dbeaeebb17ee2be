//! Several processes started torchrun-style (TCP between them; `tests/mpi.rs` does the same
//! under `mpirun`): a layout spread over 2 and over 4 processes gives the one-process loss curve
//! (`converge`), a checkpoint moves between one process and several, a killed or a stalled
//! process ends the run with its rank and host named, and the launcher's environment is read
//! right or refused in one line.

mod common;

use common::processes::{args, losses, process_of, said, torchrun, wait_all, wait_for_steps};
use ferrotron::comm::wires::processes::{from_env, Processes, WireKind};
use std::path::Path;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(240);

fn small(extra: &[&str]) -> Vec<String> {
    common::SMALL.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// `converge` of `variants` over `n` processes: every variant passes, and only process 0 speaks.
fn converge_over(n: usize, variants: &str, extra: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().to_str().unwrap();
    let a = args(&["converge", "--variants", variants, "--steps", "4", "--out", out], &small(extra));
    let outs = wait_all(torchrun(n, &a, &[]), LIMIT);
    for (i, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "process {i}:\n{}", said(o));
    }
    let table = said(&outs[0]);
    for v in variants.split(';') {
        let line = table.lines().find(|l| l.starts_with(&format!("{v} "))).unwrap_or_else(|| panic!("{v}?\n{table}"));
        assert!(line.ends_with("pass"), "{line}");
        let diff: f32 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(diff <= 1e-4, "{line}");
    }
    assert!(outs[1..].iter().all(|o| o.stdout.is_empty()), "only process 0 prints");
    assert!(Path::new(out).join("losses.csv").exists());
}

#[test]
fn a_layout_over_two_processes_gives_the_one_process_curve() {
    // one rank per process (dp, tp, pp, cp), then 4 ranks per process (3D)
    converge_over(2, "dp=2;tp=2;pp=2;cp=2;dp=2,tp=2,pp=2", &[]);
}

#[test]
fn a_layout_over_four_processes_gives_the_one_process_curve() {
    let moe = ["model.num_local_experts=4", "model.num_experts_per_tok=2"];
    converge_over(4, "dp=4;tp=2,pp=2;dp=2,cp=2,tp=2;ep=2,dp=4", &moe);
}

/// 16M parameters: 64 MB of gradients, and a checkpoint that takes about a second to write.
const BIG: &[&str] = &["model.hidden_size=512", "model.intermediate_size=2048", "model.num_hidden_layers=4"];

/// Two processes training dp=2 for long, with rank 0's metrics in `metrics`.
fn long_run(metrics: &Path, extra: &[&str]) -> Vec<std::process::Child> {
    let long = ["parallel.dp=2", "train.steps=100000", "train.micro_batch_size=4"];
    let mut a = args(&["train"], &small(&[&long[..], extra].concat()));
    a.extend(["--metrics".into(), metrics.to_str().unwrap().into()]);
    torchrun(2, &a, &[])
}

#[test]
fn a_killed_process_ends_the_run_at_once_naming_its_ranks_and_host() {
    let tmp = tempfile::tempdir().unwrap();
    let metrics = tmp.path().join("m.jsonl");
    let mut procs = long_run(&metrics, &["parallel.timeout_s=60"]);
    wait_for_steps(&metrics, 2, LIMIT);
    procs[1].kill().unwrap(); // SIGKILL: no goodbye
    let start = Instant::now();
    let outs = wait_all(procs, LIMIT);
    assert!(start.elapsed() < Duration::from_secs(30), "noticed at once, not after parallel.timeout_s = 60");
    let first = said(&outs[0]);
    assert!(!outs[0].status.success());
    assert!(
        first.contains("process 1 on host ") && first.contains("rank(s) 1..2") && first.contains("went away"),
        "{first}"
    );
}

/// Processes of one run started with different settings refuse to train together: the one that
/// differs names the key and both values, the others say that another process differs.
#[test]
fn processes_started_with_other_settings_refuse_to_train_together() {
    let port = common::processes::free_port().to_string();
    let start = |rank, lr: &str| {
        let a = args(&["train"], &small(&["parallel.dp=2", "train.steps=3", &format!("train.lr={lr}")]));
        process_of(rank, 2, &port, &a).spawn().unwrap()
    };
    let outs = wait_all(vec![start(0, "1e-3"), start(1, "5e-3")], LIMIT);
    let (first, second) = (said(&outs[0]), said(&outs[1]));
    assert!(outs.iter().all(|o| o.status.code() == Some(1)), "{first}\n{second}");
    for said in [first, second] {
        assert!(said.contains("train.lr = 0.005 in process 1, 0.001 in process 0"), "{said}");
        assert!(!said.contains("step "), "no step was trained: {said}");
    }
}

/// One `data.source` path holding two texts on two machines (here: two working folders) is
/// caught before step 0: the processes compare the text's content, not its path.
#[test]
fn processes_reading_different_text_under_one_path_refuse_to_train_together() {
    let tmp = tempfile::tempdir().unwrap();
    let port = common::processes::free_port().to_string();
    let text = ["the same path, one text ", "the same path, another text "];
    let start = |rank: usize| {
        let folder = tmp.path().join(format!("machine{rank}"));
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join("d.txt"), text[rank].repeat(200)).unwrap();
        let sets = [
            "parallel.dp=2",
            "train.steps=2",
            "data.source=\"text:d.txt\"",
            "data.tokenizer=\"bytes\"",
            "model.vocab_size=256",
        ];
        let cache = format!("data.cache_dir=\"{}\"", folder.join("cache").display());
        let a = args(&["train"], &small(&[&sets[..], &[cache.as_str()]].concat()));
        process_of(rank, 2, &port, &a).current_dir(&folder).spawn().unwrap()
    };
    let outs = wait_all(vec![start(0), start(1)], LIMIT);
    for out in &outs {
        let said = said(out);
        assert_eq!(out.status.code(), Some(1), "{said}");
        assert!(said.contains("the fingerprint of data.source's files = "), "{said}");
        assert!(!said.contains("step 1 "), "no step was trained: {said}");
    }
}

/// A signal while a process waits for the others to meet ends it at once (exit 128 + signal),
/// not after `parallel.timeout_s`.
#[test]
fn a_signal_while_waiting_for_the_other_processes_stops_at_once() {
    let port = common::processes::free_port().to_string();
    let a = args(&["train"], &small(&["parallel.dp=2", "parallel.timeout_s=120"]));
    for rank in [1, 0] {
        let child = process_of(rank, 2, &port, &a).spawn().unwrap(); // its peer never comes
        std::thread::sleep(Duration::from_millis(1500));
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        let out = wait_all(vec![child], LIMIT).remove(0);
        assert!(start.elapsed() < Duration::from_secs(10), "stopped at once, not after the timeout");
        let said = said(&out);
        assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "process {rank}: {said}");
        assert!(said.contains("stopped by SIGTERM while"), "process {rank}: {said}");
    }
}

/// A signal to one process, or to all, stops every process after the same step, one checkpoint is written,
/// and every process exits 128 + the signal (a launcher or Slurm's requeue sees one truth).
#[test]
fn a_signal_to_one_process_stops_all_alike() {
    // one process, the other, and both at once (as `scancel` signals every task of a job)
    for (signalled, sig) in [(&[1][..], libc::SIGTERM), (&[0], libc::SIGINT), (&[0, 1], libc::SIGTERM)] {
        let tmp = tempfile::tempdir().unwrap();
        let (metrics, dir) = (tmp.path().join("m.jsonl"), tmp.path().join("ck"));
        let procs = long_run(&metrics, &[&format!("checkpoint.dir=\"{}\"", dir.display())]);
        wait_for_steps(&metrics, 2, LIMIT);
        for &p in signalled {
            unsafe { libc::kill(procs[p].id() as i32, sig) };
        }
        let outs = wait_all(procs, LIMIT);
        for (i, out) in outs.iter().enumerate() {
            assert_eq!(out.status.code(), Some(128 + sig), "process {i} (signalled: {signalled:?}): {}", said(out));
        }
        assert_eq!(ferrotron::checkpoint::folder::list(&dir).unwrap().len(), 1, "one checkpoint");
    }
}

#[test]
fn a_stalled_process_ends_the_run_within_the_timeout_naming_its_rank_and_host() {
    let tmp = tempfile::tempdir().unwrap();
    let metrics = tmp.path().join("m.jsonl");
    // a 64 MB part (BIG in one bucket), more than the socket buffers hold: the sender would
    // block in `write` on the silent peer if it wrote from the rank's thread
    let mut procs = long_run(&metrics, &[BIG, &["parallel.bucket_mb=200", "parallel.timeout_s=3"]].concat());
    wait_for_steps(&metrics, 2, LIMIT);
    let stalled = procs[1].id() as i32;
    unsafe { libc::kill(stalled, libc::SIGSTOP) }; // alive, connected, silent
    let start = Instant::now();
    while procs[0].try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(30), "process 0 hangs on a stalled process");
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(stalled, libc::SIGKILL) };
    let outs = wait_all(procs, LIMIT);
    let first = said(&outs[0]);
    assert!(!outs[0].status.success());
    assert!(first.contains("timed out after 3.0s waiting for rank(s) [1 (process 1 on host "), "{first}");
}

/// Trains dp=2 over `processes` (1: threads of one process) into checkpoint folder `dir`,
/// from checkpoint `from` if given; rank 0's metrics go to `metrics`.
fn train(processes: usize, dir: &Path, extra: &[&str], from: Option<&Path>, metrics: &Path) {
    let ck = format!("checkpoint.dir=\"{}\"", dir.display());
    let mut sets = small(&["parallel.dp=2", "train.micro_batch_size=4", "train.warmup_steps=2"]);
    sets.extend(extra.iter().map(|s| s.to_string()).chain([ck]));
    let mut a = args(&["train"], &sets);
    a.extend(["--metrics".into(), metrics.to_str().unwrap().into()]);
    a.extend(from.iter().flat_map(|f| ["--resume".to_string(), f.to_str().unwrap().to_string()]));
    let outs = match processes {
        1 => vec![std::process::Command::new(common::processes::BIN).args(&a).output().unwrap()],
        n => wait_all(torchrun(n, &a, &[]), LIMIT),
    };
    outs.iter().for_each(|o| assert!(o.status.success(), "{}", said(o)));
}

#[test]
fn checkpoints_move_between_one_process_and_several() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |name: &str| tmp.path().join(name);
    train(1, &p("one"), &["train.steps=8", "checkpoint.every=4"], None, &p("full.jsonl"));
    let full = losses(&p("full.jsonl"));
    // two processes save (process 0 writes); one process resumes, with the same losses
    train(2, &p("two"), &["train.steps=8", "checkpoint.every=4"], None, &p("two.jsonl"));
    assert_eq!(losses(&p("two.jsonl")), full, "two processes give the one-process losses, bit for bit");
    train(1, &p("x"), &["train.steps=8"], Some(&p("two/step_000004")), &p("one_from_two.jsonl"));
    assert_eq!(losses(&p("one_from_two.jsonl")), full[4..]);
    // one process saved; two resume
    train(2, &p("y"), &["train.steps=8"], Some(&p("one/step_000004")), &p("two_from_one.jsonl"));
    assert_eq!(losses(&p("two_from_one.jsonl")), full[4..]);
}

#[test]
fn a_last_checkpoint_longer_than_the_timeout_does_not_fail_the_other_process() {
    // process 1 is done and waits for process 0, which writes the last step's checkpoint for
    // about a second: work alone, like a hold in one process, not a stall
    let tmp = tempfile::tempdir().unwrap();
    let extra = [BIG, &["train.steps=2", "checkpoint.every=2", "parallel.timeout_s=1"]].concat();
    train(2, &tmp.path().join("ck"), &extra, None, &tmp.path().join("m.jsonl"));
    assert!(tmp.path().join("ck/step_000002").exists());
}

fn env(pairs: &[(&str, &str)]) -> anyhow::Result<Option<Processes>> {
    from_env(&|name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
}

#[test]
fn the_launchers_environment_is_read() {
    let torch = [("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")];
    let master = [("MASTER_ADDR", "node-a"), ("MASTER_PORT", "29500")];
    let all: Vec<_> = torch.iter().chain(&master).copied().collect();
    let tcp = WireKind::Tcp { addr: "node-a".into(), port: 29500 };
    let want = Processes { index: 3, count: 4, local_index: 1, local_count: 2, wire: tcp.clone() };
    assert_eq!(env(&all).unwrap(), Some(want));
    let e = env(&all[..5]).unwrap_err().to_string();
    assert!(e.contains("MASTER_PORT missing") || e.contains("MASTER_PORT") && e.contains("missing"), "{e}");
    let bad_port: Vec<_> = torch.iter().copied().chain([("MASTER_ADDR", "a"), ("MASTER_PORT", "http")]).collect();
    assert!(env(&bad_port).unwrap_err().to_string().contains("MASTER_PORT = \"http\""));
    let ompi = [
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ];
    assert_eq!(
        env(&ompi).unwrap(),
        Some(Processes { index: 2, count: 4, local_index: 0, local_count: 2, wire: WireKind::Mpi })
    );
    let hydra = [("PMI_SIZE", "2"), ("PMI_RANK", "1"), ("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "2")];
    assert_eq!(env(&hydra).unwrap().unwrap().index, 1);
    // srun: MPI, unless MASTER_ADDR/MASTER_PORT choose TCP
    let srun =
        [("SLURM_PROCID", "9"), ("SLURM_NTASKS", "16"), ("SLURM_LOCALID", "1"), ("SLURM_TASKS_PER_NODE", "8(x2)")];
    let got = env(&srun).unwrap().unwrap();
    assert_eq!((got.index, got.count, got.local_index, got.local_count, got.wire), (9, 16, 1, 8, WireKind::Mpi));
    let srun_tcp: Vec<_> = srun.iter().chain(&master).copied().collect();
    assert_eq!(env(&srun_tcp).unwrap().unwrap().wire, tcp);
    // one process, or no launcher: the run of before
    assert_eq!(env(&[]).unwrap(), None);
    assert_eq!(env(&[("OMPI_COMM_WORLD_SIZE", "1"), ("OMPI_COMM_WORLD_RANK", "0")]).unwrap(), None);
    let e = env(&[("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "2")]).unwrap_err().to_string();
    assert!(e.contains("inconsistent"), "{e}");
    // a meeting point no process can meet at: port 0 (the OS's pick, known to process 0 alone),
    // an IPv6 address (process 0 listens on IPv4): refused, naming the variable
    let with = |k: &'static str, v: &'static str| {
        let mut all: Vec<(&str, &str)> = torch.to_vec();
        all.extend(master.iter().filter(|(m, _)| *m != k).copied());
        all.push((k, v));
        env(&all).unwrap_err().to_string()
    };
    let e = with("MASTER_PORT", "0");
    assert!(e.contains("MASTER_PORT = 0: give the port process 0 listens on"), "{e}");
    for v6 in ["::1", "[::1]", "fe80::1"] {
        let e = with("MASTER_ADDR", v6);
        assert!(e.contains("is an IPv6 address: process 0 listens on IPv4 only"), "{v6}: {e}");
    }
    // a process's share of the ranks
    let two = Processes { index: 1, count: 2, local_index: 1, local_count: 2, wire: WireKind::Mpi };
    assert_eq!(two.share(8).unwrap(), 4..8);
    assert_eq!(two.on_node(8), (8, 4));
    let e = two.share(3).unwrap_err().to_string();
    assert!(e.contains("3 rank(s)") && e.contains("start 1, 3 processes"), "{e}");
}

/// A peer that is process 1 by its hello but then sends what no ferrotron sends: process 0 ends
/// the run in one line naming process 1 and what came, within `parallel.timeout_s`, never an
/// abort. The bytes are the wire's (`comm/wires/tcp.rs`: the hello, then frames of a u64 length and a
/// note; `comm/wires/remote.rs`: a note is its kind, its session, its fields).
#[test]
fn a_peer_that_garbles_cuts_or_stalls_its_frames_ends_the_run_in_one_line() {
    use std::io::{Read, Write};
    let frame = |note: &[u8]| [&(note.len() as u64).to_le_bytes()[..], note].concat();
    let text = |kind: u8, session: u64, s: &str| {
        [&[kind][..], &session.to_le_bytes(), &(s.len() as u64).to_le_bytes(), s.as_bytes()].concat()
    };
    let hello = frame(&text(0, 0, "fake-host")); // the HELLO note: this process's host
    let garbled_part = text(1, 1, "a group nobody has"); // a PART of session 1 that ends there
    let cases: Vec<(&str, Vec<u8>, bool, &str)> = vec![
        ("a length past any frame", u64::MAX.to_le_bytes().to_vec(), false, "over the"),
        ("a frame cut short", [&100u64.to_le_bytes()[..], &[7u8; 10]].concat(), false, "connection closed"),
        ("a note shorter than any", frame(&[1, 2, 3]), false, "shorter than any"),
        ("a garbled note", [hello.clone(), frame(&garbled_part)].concat(), true, "does not read"),
        ("silence after the hello", hello, true, "timed out after 3.0s"),
    ];
    for (what, bytes, keep_open, says) in cases {
        let port = common::processes::free_port();
        let a = args(&["train"], &small(&["parallel.dp=2", "parallel.timeout_s=3", "train.steps=2"]));
        let first = process_of(0, 2, &port.to_string(), &a).spawn().unwrap();
        let peer = std::thread::spawn(move || {
            let start = Instant::now();
            let mut s = loop {
                match std::net::TcpStream::connect(("127.0.0.1", port)) {
                    Ok(s) => break s,
                    Err(_) if start.elapsed() < Duration::from_secs(60) => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => panic!("process 0 never listened: {e}"),
                }
            };
            for word in [u64::from_le_bytes(*b"ferrotrn"), 1, 1] {
                s.write_all(&word.to_le_bytes()).unwrap();
            }
            let mut table = [0u8; 8 + 2 * 24]; // process 0's hello, then where each process listens
            s.read_exact(&mut table).unwrap();
            s.write_all(&bytes).unwrap();
            if keep_open {
                std::thread::sleep(Duration::from_secs(20)); // connected and silent
            }
        });
        let out = &wait_all(vec![first], LIMIT)[0];
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {}", said(out));
        assert!(e.starts_with("error: ") && e.trim_end().lines().count() == 1, "{what}: {e}");
        assert!(e.contains("process 1") || e.contains("rank(s) [1"), "{what}: names the peer: {e}");
        assert!(e.contains(says), "{what}: {e}");
        drop(peer); // the thread ends with its sleep
    }
}

#[test]
fn a_bad_launch_is_one_clear_line() {
    let run = |n: usize, sets: &[&str]| -> Vec<String> {
        let outs = wait_all(torchrun(n, &args(&["train"], &small(sets)), &[]), LIMIT);
        outs.iter()
            .map(|o| {
                assert!(!o.status.success());
                String::from_utf8_lossy(&o.stderr).into_owned()
            })
            .collect()
    };
    // 3 ranks do not split over 2 processes
    let e = run(2, &["parallel.dp=3"]);
    assert!(e.iter().all(|e| e.contains("3 rank(s), which do not split over the 2 processes")), "{e:?}");
    // a process that never comes
    let a = args(&["train"], &small(&["parallel.dp=2", "parallel.timeout_s=2"]));
    let port = common::processes::free_port().to_string();
    let lonely = process_of(0, 2, &port, &a).output().unwrap();
    let e = String::from_utf8_lossy(&lonely.stderr);
    assert!(e.contains("for process(es) 1 (RANK) that never came"), "{e}");
    // a long wait is never silent: every 10 s it says who it waits for and for how long
    let a = args(&["train"], &small(&["parallel.dp=2", "parallel.timeout_s=11"]));
    let port = common::processes::free_port().to_string();
    let lonely = process_of(0, 2, &port, &a).output().unwrap();
    let e = String::from_utf8_lossy(&lonely.stderr);
    assert!(
        e.contains("process 0 has waited 10s of 11s at MASTER_PORT") && e.contains("for process(es) 1 (RANK)"),
        "{e}"
    );
    assert!(e.contains("that never came"), "{e}");
    // MASTER_ADDR at a server that is not ferrotron (it answers like a web server, then talks
    // on): one line naming the address, no abort on a length read from its bytes
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let web = server.local_addr().unwrap().port().to_string();
    std::thread::spawn(move || {
        for mut s in server.incoming().flatten() {
            use std::io::Write;
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
            let _ = s.write_all(&[0xffu8; 4096]);
        }
    });
    let stray = process_of(1, 2, &web, &a).output().unwrap();
    let e = String::from_utf8_lossy(&stray.stderr);
    assert_eq!(stray.status.code(), Some(1), "{e}");
    assert!(e.contains(&format!("127.0.0.1:{web} is not ferrotron's process 0")) && e.contains("HTTP/1."), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    // started by mpirun, built without MPI
    #[cfg(not(feature = "mpi"))]
    {
        let out = std::process::Command::new(common::processes::BIN)
            .args(args(&["train"], &small(&["parallel.dp=2"])))
            .envs([("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "0")])
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains("built without MPI") && e.contains("--features mpi"), "{e}");
    }
}
