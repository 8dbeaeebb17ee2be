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
//! A link carries frames (length, bytes). One reader thread per link hands what arrives to the
//! bridge (`comm/remote.rs`) and so always drains, so a sender may simply block in `write`. A
//! link that breaks is reported: the peer died.
//!
//! On GPUs the tensors go through NCCL and this carries the small numbers (the NCCL ids, the
//! loss); on CPUs, launch with `mpirun` for MPI, or accept these links for the numbers too.

use super::processes::{Deliver, Processes, Wire};
use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct Tcp {
    /// The link to every other process (`None` at this process's own place).
    links: Vec<Option<Mutex<TcpStream>>>,
}

impl Wire for Tcp {
    fn send(&self, to: usize, bytes: Vec<u8>) {
        if let Some(link) = &self.links[to] {
            let mut s = link.lock().unwrap_or_else(|e| e.into_inner());
            // a broken link is reported by its reader; the message is lost with the peer
            let _ = s.write_all(&(bytes.len() as u64).to_le_bytes()).and_then(|_| s.write_all(&bytes));
        }
    }

    fn end(&self, _ok: bool) {
        for link in self.links.iter().flatten() {
            let _ = link.lock().unwrap_or_else(|e| e.into_inner()).shutdown(std::net::Shutdown::Write);
        }
    }
}

/// Connects this process to all others through the meeting point, within `timeout`.
pub fn connect(me: &Processes, (addr, port): (&str, u16), timeout: Duration, deliver: Deliver) -> Result<Tcp> {
    let deadline = Instant::now() + timeout;
    let mut links: Vec<Option<TcpStream>> = (0..me.count).map(|_| None).collect();
    if me.index == 0 {
        let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| {
            format!("process 0 cannot listen on MASTER_PORT = {port} (is another run using it? choose another port)")
        })?;
        let mut table = vec![(IpAddr::from([0, 0, 0, 0]), 0u16); me.count];
        for _ in 1..me.count {
            let mut s = accept_until(&listener, deadline, || {
                let missing: Vec<String> = (1..me.count).filter(|&i| table[i].1 == 0).map(|i| i.to_string()).collect();
                format!("process 0 waited {:.0}s at MASTER_PORT = {port} for process(es) {} (RANK) that never came: did they start, with MASTER_ADDR pointing at this host?", timeout.as_secs_f64(), missing.join(", "))
            })?;
            let (index, their_port) = (read_u64(&mut s)? as usize, read_u64(&mut s)? as u16);
            if index == 0 || index >= me.count || links[index].is_some() {
                bail!("process 0: a process at {} says it is RANK {index}, which is out of range or taken: check RANK and WORLD_SIZE of every process", s.peer_addr()?);
            }
            table[index] = (s.peer_addr()?.ip(), their_port);
            links[index] = Some(s);
        }
        for s in links.iter_mut().flatten() {
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
        let mut master = connect_until((addr, port), deadline, me.index)?;
        master.write_all(&(me.index as u64).to_le_bytes())?;
        master.write_all(&(listener.local_addr()?.port() as u64).to_le_bytes())?;
        let mut table = Vec::with_capacity(me.count);
        for _ in 0..me.count {
            let mut octets = [0u8; 16];
            master.read_exact(&mut octets).context("process 0 closed the meeting before sending the table")?;
            let v6 = std::net::Ipv6Addr::from(octets);
            let ip = v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6));
            table.push(SocketAddr::new(ip, read_u64(&mut master)? as u16));
        }
        links[0] = Some(master);
        for (j, link) in links.iter_mut().enumerate().take(me.index).skip(1) {
            let mut s = connect_until(table[j], deadline, me.index)?;
            s.write_all(&(me.index as u64).to_le_bytes())?;
            *link = Some(s);
        }
        for _ in me.index + 1..me.count {
            let mut s = accept_until(&listener, deadline, || {
                format!(
                    "process {} waited {:.0}s for the processes after it to connect",
                    me.index,
                    timeout.as_secs_f64()
                )
            })?;
            let index = read_u64(&mut s)? as usize;
            if index <= me.index || index >= me.count || links[index].is_some() {
                bail!("process {}: a process says it is RANK {index}, out of range or taken", me.index);
            }
            links[index] = Some(s);
        }
    }
    let mut writers = Vec::with_capacity(me.count);
    for (peer, link) in links.into_iter().enumerate() {
        let Some(stream) = link else {
            writers.push(None);
            continue;
        };
        stream.set_nodelay(true)?;
        stream.set_read_timeout(None)?; // from now on silence is a quiet peer, not a lost one
        let (mut reader, deliver) = (stream.try_clone()?, deliver.clone());
        std::thread::spawn(move || loop {
            let frame = read_u64(&mut reader).and_then(|n| {
                let mut bytes = vec![0u8; n as usize];
                reader.read_exact(&mut bytes)?;
                Ok(bytes)
            });
            match frame {
                Ok(bytes) => deliver(peer, Ok(bytes)),
                Err(e) => {
                    let why = match e.downcast_ref::<std::io::Error>().map(|e| e.kind()) {
                        Some(std::io::ErrorKind::UnexpectedEof) => {
                            "its connection closed (the process ended or died)".into()
                        }
                        _ => format!("its connection broke ({e})"),
                    };
                    return deliver(peer, Err(why));
                }
            }
        });
        writers.push(Some(Mutex::new(stream)));
    }
    Ok(Tcp { links: writers })
}

fn read_u64(s: &mut TcpStream) -> Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Accepts one connection before `deadline`, or fails with `why()`.
fn accept_until(listener: &TcpListener, deadline: Instant, why: impl Fn() -> String) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    loop {
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

/// Connects to `to` before `deadline`, trying again while it is not listening yet.
fn connect_until(to: impl ToSocketAddrs + Copy + std::fmt::Debug, deadline: Instant, me: usize) -> Result<TcpStream> {
    loop {
        let tried = to.to_socket_addrs().map_err(|e| anyhow!("MASTER_ADDR: cannot resolve {to:?}: {e}"))?.next();
        let addr = tried.ok_or_else(|| anyhow!("MASTER_ADDR: {to:?} resolves to no address"))?;
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => {
                s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1))))?;
                return Ok(s);
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => bail!("process {me} could not reach {to:?} before parallel.timeout_s ran out ({e}): is process 0 (RANK=0) running, and MASTER_ADDR/MASTER_PORT right?"),
        }
    }
}
