//! # The bridge: one run's hubs in several processes
//!
//! Each process has a hub (`comm/local.rs`) where its rank threads meet. When a run spans
//! processes, each hub tells the others what concerns their ranks, over the wire (MPI or TCP),
//! and puts what they tell it into its own state as if a thread of its own had left it:
//!
//! ```text
//! a part of a collective   → every process with another member of the group; each member
//!                            computes its result from all parts in rank order, as in one
//!                            process: the same bits, whatever the number of processes
//! a message (send/recv)    → the process of its receiver
//! abort, finished, hold    → every process: a failure anywhere stops every rank, a rank that
//!                            returned is not waited for, a checkpoint's writer stops the clocks
//! ```
//! So the checks of the hub hold across processes, and a wait that times out names the missing
//! rank's process and host. A process whose link breaks (it died) aborts the run at once.
//!
//! Each launch is a *session*, numbered in order (every process launches the same runs in the
//! same order). It ends when every process has said it is done, so nothing of it is in flight
//! when the next one starts or the program ends; notes of a session not yet begun here wait.

use super::note::{op_into, Message, Reader, ABORT, DONE, FINISHED, HELLO, HOLD, MAIL, PART, RELEASE};
use super::processes::{self, Deliver, Processes, Wire, WireKind};
use crate::comm::local::{Beyond, Hub, MailKey, Note};
use anyhow::{anyhow, bail, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// This process's link to the others: made at the first launch that spans them.
static BRIDGE: Mutex<Option<Arc<Bridge>>> = Mutex::new(None);

struct Bridge {
    me: Processes,
    wire: Box<dyn Wire>,
    inbox: Arc<Inbox>,
    sessions: AtomicU64,
}

/// What arrived from the other processes.
struct Inbox {
    state: Mutex<InboxState>,
    changed: Condvar,
    /// Every process's host, once they have all said hello (read without the lock: the hub
    /// asks for names under its own).
    hosts: OnceLock<Vec<String>>,
}

struct InboxState {
    /// The session running here: its number, ranks per process, and hub.
    hub: Option<(u64, usize, Weak<Hub>)>,
    /// Notes of sessions not begun here yet: (from, session, bytes).
    early: Vec<(usize, u64, Vec<u8>)>,
    hosts: Vec<Option<String>>,
    /// The last session each process finished.
    done: Vec<u64>,
    /// Why the link to a process broke, if it did.
    lost: Vec<Option<String>>,
}

/// One launch's ranks, spread over the processes: the hub's `Beyond`.
#[derive(Clone)]
pub struct Session {
    bridge: Arc<Bridge>,
    number: u64,
    per_process: usize,
    timeout: Duration,
}

impl Session {
    /// Starts a session of a `world`-rank launch, when this program is one of several processes
    /// (connecting them, the first time).
    pub fn start(world: usize, timeout: Duration) -> Result<Option<Session>> {
        let Some(me) = processes::current()? else {
            return Ok(None);
        };
        let range = me.share(world)?;
        let bridge = Bridge::get(me, timeout)?;
        let number = bridge.sessions.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Some(Session { bridge, number, per_process: range.len(), timeout }))
    }

    /// The ranks this process runs.
    pub fn ranks(&self) -> Range<usize> {
        let me = self.bridge.me.index;
        me * self.per_process..(me + 1) * self.per_process
    }

    /// The hub of this session's ranks here: what the others sent before it existed goes in.
    pub fn attach(&self, hub: &Arc<Hub>) {
        let mut st = self.bridge.inbox.lock();
        st.hub = Some((self.number, self.per_process, Arc::downgrade(hub)));
        for (from, number, bytes) in std::mem::take(&mut st.early) {
            match number == self.number {
                true => self.bridge.inbox.apply(hub, from, &bytes),
                false => st.early.push((from, number, bytes)),
            }
        }
        if let Some((p, why)) = st.lost.iter().enumerate().find_map(|(p, w)| w.clone().map(|w| (p, w))) {
            hub.abort_here(self.bridge.gone(p, self.per_process, &why));
        }
    }

    /// Says this process is done and waits until every other one is (unless the run failed:
    /// then the failure is the run's error).
    pub fn close(&self, hub: &Hub) -> Result<()> {
        self.bridge.everyone(&Message::new(DONE, self.number).0);
        let mut clock = hub.clock(); // a process still writing a checkpoint holds it (`Hub::hold`)
        let mut st = self.bridge.inbox.lock();
        let result = loop {
            let waiting: Vec<usize> =
                (0..st.done.len()).filter(|&p| p != self.bridge.me.index && st.done[p] < self.number).collect();
            if waiting.is_empty() || hub.aborted().is_some() {
                break Ok(());
            }
            if let Some(&p) = waiting.iter().find(|&&p| st.lost[p].is_some()) {
                break Err(anyhow!(
                    "{}",
                    self.bridge.gone(p, self.per_process, st.lost[p].as_deref().unwrap_or_default())
                ));
            }
            if clock.ran_out(hub.holds()) {
                let names: Vec<String> = waiting.iter().map(|&p| self.bridge.process(p)).collect();
                break Err(anyhow!(
                    "the run ended here, but after {:.1}s {} had not ended it",
                    self.timeout.as_secs_f64(),
                    names.join(", ")
                ));
            }
            st = self
                .bridge
                .inbox
                .changed
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        st.hub = None;
        result
    }

    fn process_of(&self, rank: usize) -> usize {
        rank / self.per_process
    }
}

impl Beyond for Session {
    fn is_here(&self, rank: usize) -> bool {
        self.process_of(rank) == self.bridge.me.index
    }

    fn tell(&self, note: Note<'_>) {
        let me = self.bridge.me.index;
        let (bytes, to) = match note {
            Note::Part { group, seq, op, data } => {
                let m = Message::new(PART, self.number).text(&group.name).list(&group.ranks).int(seq).int(group.index);
                let mut to: Vec<usize> = group.ranks.iter().map(|&r| self.process_of(r)).filter(|&p| p != me).collect();
                to.dedup(); // a group's ranks are in order, so are their processes
                (op_into(m, op).numbers(data).0, to)
            }
            Note::Mail { key, to, data } => {
                let (name, from, at, n) = key;
                let m = Message::new(MAIL, self.number).text(name).int(*from).int(*at).int(*n).numbers(data);
                (m.0, vec![self.process_of(to)])
            }
            Note::Abort(reason) => return self.bridge.everyone(&Message::new(ABORT, self.number).text(reason).0),
            Note::Finished(rank) => return self.bridge.everyone(&Message::new(FINISHED, self.number).int(rank).0),
            Note::Hold => return self.bridge.everyone(&Message::new(HOLD, self.number).0),
            Note::Release => return self.bridge.everyone(&Message::new(RELEASE, self.number).0),
        };
        for p in to {
            self.bridge.wire.send(p, bytes.clone());
        }
    }

    fn name(&self, rank: usize) -> String {
        format!("{rank} ({})", self.bridge.process(self.process_of(rank)))
    }
}

impl Bridge {
    /// The bridge, connecting this process to the others the first time: every process says
    /// which host it is on.
    fn get(me: &Processes, timeout: Duration) -> Result<Arc<Bridge>> {
        let mut slot = BRIDGE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = slot.as_ref() {
            return Ok(b.clone());
        }
        let n = me.count;
        let state =
            InboxState { hub: None, early: Vec::new(), hosts: vec![None; n], done: vec![0; n], lost: vec![None; n] };
        let inbox = Arc::new(Inbox { state: Mutex::new(state), changed: Condvar::new(), hosts: OnceLock::new() });
        let deliver: Deliver = {
            let inbox = inbox.clone();
            Arc::new(move |from, got| inbox.arrived(from, got))
        };
        let wire: Box<dyn Wire> = match &me.wire {
            WireKind::Tcp { addr, port } => Box::new(super::tcp::connect(me, (addr, *port), timeout, deliver)?),
            WireKind::Mpi => mpi_wire(me, deliver)?,
        };
        let bridge = Arc::new(Bridge { me: me.clone(), wire, inbox, sessions: AtomicU64::new(0) });
        let host = processes::host_name();
        bridge.everyone(&Message::new(HELLO, 0).text(&host).0);
        let deadline = Instant::now() + timeout;
        let mut st = bridge.inbox.lock();
        st.hosts[me.index] = Some(host);
        while st.hosts.iter().any(Option::is_none) {
            if let Some((p, why)) = st.lost.iter().enumerate().find_map(|(p, w)| w.clone().map(|w| (p, w))) {
                bail!("process {p} went away while the processes met: {why}");
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> = (0..n).filter(|&p| st.hosts[p].is_none()).map(|p| p.to_string()).collect();
                bail!("process(es) {} did not say hello within parallel.timeout_s", missing.join(", "));
            }
            st = bridge.inbox.changed.wait_timeout(st, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
        }
        let _ = bridge.inbox.hosts.set(st.hosts.iter().flatten().cloned().collect());
        drop(st);
        *slot = Some(bridge.clone());
        Ok(bridge)
    }

    fn everyone(&self, bytes: &[u8]) {
        (0..self.me.count).filter(|&p| p != self.me.index).for_each(|p| self.wire.send(p, bytes.to_vec()));
    }

    fn process(&self, p: usize) -> String {
        self.inbox.process(p)
    }

    fn gone(&self, p: usize, per_process: usize, why: &str) -> String {
        self.inbox.gone(p, per_process, why)
    }
}

/// Ends this process's link to the others when the program ends (`Wire::end`): after a clean
/// run, or, after a failure, so that the launcher stops every process. Nothing when there is none.
pub fn end(ok: bool) {
    let bridge = BRIDGE.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(b) = bridge {
        b.wire.end(ok);
    }
}

#[cfg(feature = "mpi")]
fn mpi_wire(me: &Processes, deliver: Deliver) -> Result<Box<dyn Wire>> {
    Ok(Box::new(super::mpi::connect(me, deliver)?))
}

#[cfg(not(feature = "mpi"))]
fn mpi_wire(me: &Processes, _: Deliver) -> Result<Box<dyn Wire>> {
    bail!(
        "{} started {} processes, but this ferrotron was built without MPI: build it with `cargo build --release --features mpi` (Open MPI: `apt install libopenmpi-dev`), or launch it torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
        me.launcher(),
        me.count
    )
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// "process 1 on host node-b".
    fn process(&self, p: usize) -> String {
        let host = self.hosts.get().and_then(|h| h.get(p)).map_or("unknown", String::as_str);
        format!("process {p} on host {host}")
    }

    /// "process 1 on host node-b, with rank(s) 2..4, went away: …".
    fn gone(&self, p: usize, per_process: usize, why: &str) -> String {
        let ranks = p * per_process..(p + 1) * per_process;
        format!("{}, with rank(s) {ranks:?}, went away: {why}", self.process(p))
    }

    /// What the wire brought from process `from`. Notes go into the hub under the inbox's lock,
    /// so those of one process go in in the order they were sent.
    fn arrived(&self, from: usize, got: std::result::Result<Vec<u8>, String>) {
        let got = got.and_then(|bytes| match bytes.len() >= 9 {
            true => Ok(bytes),
            false => {
                Err(format!("it sent a note of {} bytes, shorter than any: is it the same ferrotron?", bytes.len()))
            }
        });
        let mut st = self.lock();
        match got {
            Err(why) => {
                let why = st.lost[from].get_or_insert(why).clone(); // the first thing that went wrong
                if let Some((number, per_process, hub)) = &st.hub {
                    if let (true, Some(hub)) = (st.done[from] < *number, hub.upgrade()) {
                        hub.abort_here(self.gone(from, *per_process, &why));
                    }
                }
            }
            Ok(bytes) => {
                let (kind, number) = (bytes.first().copied(), Message::session(&bytes));
                match kind {
                    Some(HELLO) => st.hosts[from] = Reader::after_header(&bytes).text().ok(),
                    Some(DONE) => st.done[from] = st.done[from].max(number),
                    _ => match &st.hub {
                        Some((n, _, hub)) if *n == number => match hub.upgrade() {
                            Some(hub) => self.apply(&hub, from, &bytes),
                            None => st.early.push((from, number, bytes)),
                        },
                        _ => st.early.push((from, number, bytes)), // a session not begun here yet
                    },
                }
            }
        }
        self.changed.notify_all();
    }

    /// Puts a note of process `from` into `hub`; a note that does not read aborts the run. Every
    /// count and index in it is checked before use: a garbled note is an error, never a panic.
    fn apply(&self, hub: &Hub, from: usize, bytes: &[u8]) {
        let mut r = Reader::after_header(bytes);
        let applied = (|| -> Result<()> {
            match bytes[0] {
                PART => {
                    let (name, ranks, seq, index) = (r.text()?, r.list()?, r.int()?, r.int()? as usize);
                    let op = r.op()?;
                    hub.part_from_afar((&name, &ranks), seq, index, (op, r.numbers()?))?;
                }
                MAIL => {
                    let key: MailKey = (r.text()?, r.int()? as usize, r.int()? as usize, r.int()?);
                    hub.mail_here(key, r.numbers()?);
                }
                ABORT => hub.abort_here(r.text()?),
                FINISHED => hub.finished_here(r.int()? as usize),
                HOLD => hub.hold_here(),
                RELEASE => hub.release(),
                kind => bail!("unknown note kind {kind}"),
            }
            Ok(())
        })();
        if let Err(e) = applied {
            hub.abort_here(format!(
                "a note from process {from} does not read ({e}): are all processes the same ferrotron?"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local::Op;
    use crate::ops::types::ReduceOp;

    /// An inbox of process 0 of two, in session 1 with `hub`.
    fn inbox(hub: &Arc<Hub>) -> Inbox {
        let state = InboxState {
            hub: Some((1, 1, Arc::downgrade(hub))),
            early: Vec::new(),
            hosts: vec![None; 2],
            done: vec![0; 2],
            lost: vec![None; 2],
        };
        Inbox { state: Mutex::new(state), changed: Condvar::new(), hosts: OnceLock::new() }
    }

    /// A part of call 7 on group "dp" of `ranks`, from member `index`, announcing `n` numbers.
    fn part(ranks: &[usize], index: u64, op: Op, n: u64) -> Vec<u8> {
        op_into(Message::new(PART, 1).text("dp").list(ranks).int(7u64).int(index), op).int(n).0
    }

    #[test]
    fn a_garbled_note_ends_the_run_in_words_and_never_panics() {
        let sum = Op::AllReduce(ReduceOp::Sum);
        // collective 0 (all-reduce) with reduction 9, root 0
        let bad_reduce = Message::new(PART, 1).text("dp").list(&[0, 1]).int(7u64).int(1u64);
        let bad_reduce = bad_reduce.int(0u64).int(9u64).int(0u64).int(0u64).0;
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("an empty note", vec![], "shorter than any"),
            ("a kind byte alone", vec![PART], "shorter than any"),
            ("an unknown kind", Message::new(99, 1).0, "unknown note kind 99"),
            ("a member past its group", part(&[0, 1], 2, sum, 0), "member 2 of a 2-member call"),
            ("a list longer than its note", Message::new(PART, 1).text("dp").int(u64::MAX).0, "a list of"),
            ("a text longer than its note", Message::new(ABORT, 1).int(u64::MAX).0, "ends early"),
            ("more numbers than bytes", part(&[0, 1], 1, sum, u64::MAX / 2), "too many numbers"),
            ("a few numbers missing", part(&[0, 1], 1, sum, 3), "ends early"),
            ("an unknown reduction", bad_reduce, "unknown reduction 9"),
        ];
        for (what, bytes, says) in cases {
            let hub = Arc::new(Hub::new(Duration::from_secs(1), None));
            inbox(&hub).arrived(1, Ok(bytes));
            let why = hub.aborted().unwrap_or_else(|| panic!("{what}: not refused"));
            assert!(why.contains(says) && why.contains("process 1"), "{what}: {why}");
        }
        // a group size that disagrees with the parts already here
        let hub = Arc::new(Hub::new(Duration::from_secs(1), None));
        let inbox = inbox(&hub);
        inbox.arrived(1, Ok(part(&[0, 1, 2], 1, sum, 0)));
        assert!(hub.aborted().is_none(), "a good part is taken");
        inbox.arrived(1, Ok(part(&[0, 1], 1, sum, 0)));
        assert!(hub.aborted().is_some_and(|w| w.contains("of 3 members here")), "{:?}", hub.aborted());
        // a release without its hold leaves the clocks running
        let hub = Arc::new(Hub::new(Duration::from_secs(1), None));
        self::inbox(&hub).arrived(1, Ok(Message::new(RELEASE, 1).0));
        assert!(!hub.holds().0, "the clock is not held");
        // noise: every prefix of a good part, and bytes flipped in it, read or refuse, never panic
        let good = part(&[0, 1], 1, sum, 2).into_iter().chain(1f32.to_le_bytes()).chain(2f32.to_le_bytes());
        let good: Vec<u8> = good.collect();
        for cut in 0..good.len() {
            let hub = Arc::new(Hub::new(Duration::from_secs(1), None));
            self::inbox(&hub).arrived(1, Ok(good[..cut].to_vec()));
            assert!(hub.aborted().is_some(), "cut at {cut}");
        }
        for at in 9..good.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut noisy = good.clone();
                noisy[at] ^= flip;
                let hub = Arc::new(Hub::new(Duration::from_secs(1), None));
                self::inbox(&hub).arrived(1, Ok(noisy));
            }
        }
    }
}
