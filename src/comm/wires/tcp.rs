//! # The TCP wire: processes met at `MASTER_ADDR:MASTER_PORT`
//!
//! A torchrun-style launch names one meeting point. Process 0 listens there; every other process
//! opens a listener of its own, connects, and says who it is and where it listens. When all have
//! come, process 0 sends everyone the table, and each process connects to those before it:
//!
//! ```text
//! 1 ──(index 1, port p₁)──▶ 0        0 ──(table: 1 at ip₁:p₁, 2 at ip₂:p₂ …)──▶ 1, 2, …
//! 2 ──(index 2, port p₂)──▶ 0        2 ──(hello, I am 2)──▶ 1           a link per pair
//! ```
//! Every link opens with (magic, index, listening port), so a stray connection is not taken for
//! a process; a loopback address in the table means "on process 0's host" (`reachable`).
//! A link carries frames (length, bytes). One reader thread per link hands what arrives to the
//! bridge (`comm/wires/remote.rs`) and so always drains; one writer thread per link sends what is
//! queued, so a rank never blocks in `write` on a peer that stopped reading (its wait then times
//! out, naming that peer). A link that breaks is reported: the peer died.
//!
//! On GPUs the tensors go through NCCL and this carries the small numbers (the NCCL ids, the
//! loss); on CPUs, launch with `mpirun` for MPI, or accept these links for the numbers too.

use super::processes::{Deliver, Processes, Wire};
use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct Tcp {
    /// The queue of every other process's writer thread (`None` at this process's own place).
    queues: Mutex<Vec<Option<Sender<Vec<u8>>>>>,
    writers: Mutex<Vec<JoinHandle<()>>>,
}

impl Wire for Tcp {
    /// Never waits: a writer thread per link does (a stalled peer stops reading, and a blocked
    /// `write` must not keep this rank from its own timeout).
    fn send(&self, to: usize, bytes: Vec<u8>) {
        if let Some(queue) = &self.queues.lock().unwrap_or_else(|e| e.into_inner())[to] {
            let _ = queue.send(bytes); // a writer that stopped had a broken link: its reader says so
        }
    }

    /// Closes the queues; the writers send what is left and close their links. Waits for them
    /// a few seconds after a clean run, one after a failure (a peer that stopped reading is not
    /// waited for: the run's error is already said).
    fn end(&self, ok: bool) {
        self.queues.lock().unwrap_or_else(|e| e.into_inner()).iter_mut().for_each(|q| drop(q.take()));
        let deadline = Instant::now() + Duration::from_secs(if ok { 5 } else { 1 });
        let writers = std::mem::take(&mut *self.writers.lock().unwrap_or_else(|e| e.into_inner()));
        while writers.iter().any(|w| !w.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// What a process says first at the meeting point, so that a stray connection is told apart.
const MAGIC: u64 = u64::from_le_bytes(*b"ferrotrn");

/// The largest frame a link carries (a part of a collective is far smaller): 64 GiB.
const MAX_FRAME: u64 = 1 << 36;

/// Connects this process to all others through the meeting point, within `timeout`.
pub fn connect(me: &Processes, (addr, port): (&str, u16), timeout: Duration, deliver: Deliver) -> Result<Tcp> {
    let deadline = Instant::now() + timeout;
    let mut links: Vec<Option<TcpStream>> = (0..me.count).map(|_| None).collect();
    if me.index == 0 {
        let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| {
            format!("process 0 cannot listen on MASTER_PORT = {port} (is another run using it? choose another port)")
        })?;
        let mut table = vec![(IpAddr::from([0, 0, 0, 0]), 0u16); me.count];
        while links.iter().flatten().count() + 1 < me.count {
            let missing = || -> String {
                let missing: Vec<String> = (1..me.count).filter(|&i| table[i].1 == 0).map(|i| i.to_string()).collect();
                missing.join(", ")
            };
            let waited = |s: u64| {
                format!(
                    "process 0 has waited {s}s of {:.0}s at MASTER_PORT = {port} for process(es) {} (RANK)",
                    timeout.as_secs_f64(),
                    missing()
                )
            };
            let mut s = accept_until(&listener, deadline, waited, || {
                format!("process 0 waited {:.0}s at MASTER_PORT = {port} for process(es) {} (RANK) that never came: did they start, with MASTER_ADDR pointing at this host?", timeout.as_secs_f64(), missing())
            })?;
            let Some((index, their_port)) = hello(&mut s) else {
                continue; // not one of ours (a port scanner, a health check): not counted
            };
            if index == 0 || index >= me.count || links[index].is_some() {
                bail!("process 0: a process at {} says it is RANK {index}, which is out of range or taken: check RANK and WORLD_SIZE of every process", s.peer_addr()?);
            }
            table[index] = (s.peer_addr()?.ip().to_canonical(), their_port);
            links[index] = Some(s);
        }
        for s in links.iter_mut().flatten() {
            s.write_all(&MAGIC.to_le_bytes())?; // process 0's own hello: the others check it
            for (ip, p) in &table {
                let octets = match ip {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
                    IpAddr::V6(v6) => v6.octets(),
                };
                s.write_all(&octets)?;
                s.write_all(&(*p as u64).to_le_bytes())?;
            }
        }
    } else {
        let listener =
            TcpListener::bind(("0.0.0.0", 0)).context("cannot open a listening port for the other processes")?;
        let my_port = listener.local_addr()?.port();
        let mut master = connect_until((addr, port), deadline, me.index)?;
        let sent = say_hello(&mut master, me.index, my_port); // a stray server may hang up first

        // process 0 answers once every process has come; anything else is not ferrotron
        master
            .set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))?;
        let answer = read_u64(&mut master);
        if answer.as_ref().ok() != Some(&MAGIC) {
            let what = match answer {
                Ok(word) => format!("it answered {:?}", String::from_utf8_lossy(&word.to_le_bytes())),
                Err(e) => format!("no answer within parallel.timeout_s ({e})"),
            };
            bail!(
                "MASTER_ADDR:MASTER_PORT = {addr}:{port} is not ferrotron's process 0 ({what}): point MASTER_ADDR and MASTER_PORT at the host and port of the process with RANK 0"
            );
        }
        sent.with_context(|| format!("process 0 at {addr}:{port} did not take this process's hello"))?;
        let via = master.peer_addr()?.ip().to_canonical(); // process 0, as this process reaches it
        let mut table = Vec::with_capacity(me.count);
        for _ in 0..me.count {
            let mut octets = [0u8; 16];
            master.read_exact(&mut octets).context("process 0 closed the meeting before sending the table")?;
            let ip = std::net::Ipv6Addr::from(octets).to_canonical();
            table.push(reachable(SocketAddr::new(ip, read_u64(&mut master)? as u16), via));
        }
        links[0] = Some(master);
        for (j, link) in links.iter_mut().enumerate().take(me.index).skip(1) {
            let mut s = connect_until(table[j], deadline, me.index)?;
            say_hello(&mut s, me.index, my_port)?;
            *link = Some(s);
        }
        while links.iter().flatten().count() < me.count - 1 {
            let waited = |s: u64| format!("process {} has waited {s}s for the processes after it to connect", me.index);
            let mut s = accept_until(&listener, deadline, waited, || {
                format!(
                    "process {} waited {:.0}s for the processes after it to connect",
                    me.index,
                    timeout.as_secs_f64()
                )
            })?;
            let Some((index, _)) = hello(&mut s) else {
                continue; // not one of ours
            };
            if index <= me.index || index >= me.count || links[index].is_some() {
                bail!("process {}: a process says it is RANK {index}, out of range or taken", me.index);
            }
            links[index] = Some(s);
        }
    }
    let (mut queues, mut writers) = (Vec::with_capacity(me.count), Vec::new());
    for (peer, link) in links.into_iter().enumerate() {
        let Some(mut stream) = link else {
            queues.push(None);
            continue;
        };
        stream.set_nodelay(true)?;
        stream.set_read_timeout(None)?; // from now on silence is a quiet peer, not a lost one
        let (mut reader, deliver) = (stream.try_clone()?, deliver.clone());
        let (queue, frames) = channel::<Vec<u8>>();
        writers.push(std::thread::spawn(move || {
            for bytes in frames {
                let sent = stream.write_all(&(bytes.len() as u64).to_le_bytes()).and_then(|_| stream.write_all(&bytes));
                if sent.is_err() {
                    return; // the peer is gone; its reader reports why
                }
            }
            let _ = stream.shutdown(std::net::Shutdown::Write); // `end`: the peer reads the end
        }));
        queues.push(Some(queue));
        std::thread::spawn(move || loop {
            // the buffer grows with the bytes that really arrive: a garbled length can never ask
            // for more memory than the peer sent
            let frame = read_u64(&mut reader).and_then(|n| {
                if n > MAX_FRAME {
                    bail!("a frame of {n} bytes, over the {MAX_FRAME} a process ever sends");
                }
                let mut bytes = Vec::new();
                (&mut reader).take(n).read_to_end(&mut bytes)?;
                if bytes.len() as u64 != n {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                }
                Ok(bytes)
            });
            match frame {
                Ok(bytes) => deliver(peer, Ok(bytes)),
                Err(e) => {
                    let why = match e.downcast_ref::<std::io::Error>().map(|e| e.kind()) {
                        // a peer that ends with bytes unread resets the connection instead
                        Some(
                            std::io::ErrorKind::UnexpectedEof
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::ConnectionAborted,
                        ) => "its connection closed (the process ended or died)".into(),
                        _ => format!("its connection broke ({e})"),
                    };
                    return deliver(peer, Err(why));
                }
            }
        });
    }
    Ok(Tcp { queues: Mutex::new(queues), writers: Mutex::new(writers) })
}

fn read_u64(s: &mut TcpStream) -> Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// How often a wait for the other processes says so, on standard error: a wait of minutes
/// (`parallel.timeout_s`, 300 by default) is never silent.
const SAY_WAITING_EVERY: Duration = Duration::from_secs(10);

/// Says `waited(seconds)` on standard error each `SAY_WAITING_EVERY` since `start`.
fn say_waiting(start: Instant, said: &mut u64, waited: &dyn Fn(u64) -> String) {
    let periods = start.elapsed().as_secs() / SAY_WAITING_EVERY.as_secs();
    if periods > *said {
        *said = periods;
        let _ = writeln!(std::io::stderr(), "{}", waited(periods * SAY_WAITING_EVERY.as_secs()));
    }
}

/// Accepts one connection before `deadline`, or fails with `why()`; says how long it has waited
/// (`waited`) every `SAY_WAITING_EVERY`.
fn accept_until(
    listener: &TcpListener,
    deadline: Instant,
    waited: impl Fn(u64) -> String,
    why: impl Fn() -> String,
) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let (start, mut said) = (Instant::now(), 0);
    loop {
        say_waiting(start, &mut said, &waited);
        crate::signals::check(|| "waiting for the other processes to meet".into())?;
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(
                    deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1)),
                ))?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => bail!("{}", why()),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Connects to `to` before `deadline`, trying again while it is not listening yet. Every
/// address the name resolves to is tried (`localhost` may be ::1 first, and process 0 listens
/// on IPv4).
fn connect_until(to: impl ToSocketAddrs + Copy + std::fmt::Debug, deadline: Instant, me: usize) -> Result<TcpStream> {
    let (start, mut said) = (Instant::now(), 0);
    let waited = |s: u64| format!("process {me} has waited {s}s to reach process 0 at {to:?}");
    loop {
        say_waiting(start, &mut said, &waited);
        crate::signals::check(|| format!("process {me} was trying to reach process 0"))?;
        let addrs: Vec<SocketAddr> =
            to.to_socket_addrs().map_err(|e| anyhow!("MASTER_ADDR: cannot resolve {to:?}: {e}"))?.collect();
        if addrs.is_empty() {
            bail!("MASTER_ADDR: {to:?} resolves to no address");
        }
        let mut refused = None;
        for addr in &addrs {
            match TcpStream::connect_timeout(addr, Duration::from_secs(1)) {
                Ok(s) => {
                    s.set_read_timeout(Some(
                        deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1)),
                    ))?;
                    return Ok(s);
                }
                Err(e) => refused = Some(e),
            }
        }
        if Instant::now() >= deadline {
            let e = refused.map(|e| e.to_string()).unwrap_or_default();
            bail!("process {me} could not reach {to:?} before parallel.timeout_s ran out ({e}): is process 0 (RANK=0) running, and MASTER_ADDR/MASTER_PORT right?");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The first words on every link: who this is, and where it listens.
fn say_hello(s: &mut TcpStream, index: usize, port: u16) -> Result<()> {
    [MAGIC, index as u64, port as u64].iter().try_for_each(|x| s.write_all(&x.to_le_bytes()))?;
    Ok(())
}

/// The index and listening port of a process that connected, or `None` for a connection that
/// is not one of ours (silent for 10 s, or saying something else).
fn hello(s: &mut TcpStream) -> Option<(usize, u16)> {
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut words = [0u64; 3];
    for w in &mut words {
        *w = read_u64(s).ok()?;
    }
    let [magic, index, port] = words;
    (magic == MAGIC && port <= u16::MAX as u64).then_some((index as usize, port as u16))
}

/// A process's address as process 0 saw it, made reachable from this process: a loopback
/// address (127.0.0.1, or Debian's 127.0.1.1 for the host's own name) means that process runs
/// on process 0's host, which this process reaches at `via`.
fn reachable(seen: SocketAddr, via: IpAddr) -> SocketAddr {
    match seen.ip().is_loopback() {
        true => SocketAddr::new(via, seen.port()),
        false => seen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_seen_on_loopback_is_reached_where_process_0_is() {
        let node_a: IpAddr = "10.0.0.1".parse().unwrap();
        let seen = |ip: &str| SocketAddr::new(ip.parse().unwrap(), 4000);
        assert_eq!(reachable(seen("127.0.1.1"), node_a), SocketAddr::new(node_a, 4000)); // same host as 0
        assert_eq!(reachable(seen("::1"), node_a), SocketAddr::new(node_a, 4000));
        assert_eq!(reachable(seen("10.0.0.2"), node_a), seen("10.0.0.2")); // another host
        let local: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(reachable(seen("127.0.0.1"), local), seen("127.0.0.1")); // all on one host
    }

    #[test]
    fn every_resolved_address_is_tried() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // dropped: refused
        let addrs = [closed, listener.local_addr().unwrap()];
        let deadline = Instant::now() + Duration::from_secs(2);
        connect_until(&addrs[..], deadline, 1).expect("the second address listens");
    }

    #[test]
    fn a_stray_connection_is_not_taken_for_a_process() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = listener.local_addr().unwrap();
        let talk = |words: Vec<u64>| {
            let mut s = TcpStream::connect(to).unwrap();
            words.iter().for_each(|w| s.write_all(&w.to_le_bytes()).unwrap());
            let (mut got, _) = listener.accept().unwrap();
            hello(&mut got)
        };
        assert_eq!(talk(vec![u64::from_le_bytes(*b"GET / HT"), 1, 2]), None);
        assert_eq!(talk(vec![MAGIC, 3, 4000]), Some((3, 4000)));
    }
}
