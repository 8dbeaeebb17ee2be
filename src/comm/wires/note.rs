//! # A note on the wire: what one process tells another
//!
//! The bridge (`comm/wires/remote.rs`) carries its notes as bytes, over TCP or MPI: a kind, the session
//! it belongs to, then its fields, little-endian:
//!
//! ```text
//! [kind: 1 byte][session: u64][field]…      an int: u64; a text or a list: its length, then it;
//!                                           numbers: their count, then f32s
//! ```
//! A note comes from another program, so reading one trusts nothing in it: every length is
//! checked against the bytes that are really there before anything is taken or allocated, and a
//! note that does not read is an error, never a panic.

use crate::comm::local::Op;
use crate::ops::types::ReduceOp;
use anyhow::{anyhow, bail, Result};

// The kinds of notes on the wire.
pub(super) const HELLO: u8 = 0;
pub(super) const PART: u8 = 1;
pub(super) const MAIL: u8 = 2;
pub(super) const ABORT: u8 = 3;
pub(super) const FINISHED: u8 = 4;
pub(super) const HOLD: u8 = 5;
pub(super) const RELEASE: u8 = 6;
pub(super) const DONE: u8 = 7;

/// A note being written: kind, session, then its fields, little-endian.
pub(super) struct Message(pub(super) Vec<u8>);

impl Message {
    pub(super) fn new(kind: u8, session: u64) -> Message {
        let mut m = Message(vec![kind]);
        m.0.extend(session.to_le_bytes());
        m
    }
    pub(super) fn session(bytes: &[u8]) -> u64 {
        u64::from_le_bytes(bytes[1..9].try_into().expect("8 bytes, as `arrived` checked"))
    }
    pub(super) fn int(mut self, v: impl TryInto<u64>) -> Message {
        self.0.extend(v.try_into().unwrap_or(u64::MAX).to_le_bytes());
        self
    }
    pub(super) fn text(self, s: &str) -> Message {
        let mut m = self.int(s.len());
        m.0.extend(s.as_bytes());
        m
    }
    pub(super) fn list(self, xs: &[usize]) -> Message {
        xs.iter().fold(self.int(xs.len()), |m, &x| m.int(x))
    }
    pub(super) fn numbers(self, xs: &[f32]) -> Message {
        let mut m = self.int(xs.len());
        m.0.reserve(4 * xs.len());
        xs.iter().for_each(|x| m.0.extend(x.to_le_bytes()));
        m
    }
}

/// `op` as three integers: which collective, which reduction, which root.
pub(super) fn op_into(m: Message, op: Op) -> Message {
    let reduce = |r: ReduceOp| r as u64;
    match op {
        Op::AllReduce(r) => m.int(0u64).int(reduce(r)).int(0u64),
        Op::AllGather => m.int(1u64).int(0u64).int(0u64),
        Op::ReduceScatter(r) => m.int(2u64).int(reduce(r)).int(0u64),
        Op::Broadcast { root } => m.int(3u64).int(0u64).int(root),
        Op::Barrier => m.int(4u64).int(0u64).int(0u64),
    }
}

/// A note being read.
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    pub(super) fn after_header(bytes: &[u8]) -> Reader<'_> {
        Reader { bytes, at: 9 }
    }
    pub(super) fn take(&mut self, n: usize) -> Result<&[u8]> {
        let got = self.bytes.get(self.at..self.at.saturating_add(n)).ok_or_else(|| anyhow!("the note ends early"))?;
        self.at += n;
        Ok(got)
    }
    pub(super) fn int(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(super) fn text(&mut self) -> Result<String> {
        let n = self.int()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    pub(super) fn list(&mut self) -> Result<Vec<usize>> {
        let n = self.int()?;
        if n > (self.bytes.len() / 8) as u64 {
            bail!("a list of {n} numbers in a note of {} bytes", self.bytes.len());
        }
        (0..n).map(|_| self.int().map(|x| x as usize)).collect()
    }
    pub(super) fn numbers(&mut self) -> Result<Vec<f32>> {
        let n = self.int()? as usize;
        let bytes = self.take(n.checked_mul(4).ok_or_else(|| anyhow!("too many numbers"))?)?;
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect())
    }
    pub(super) fn op(&mut self) -> Result<Op> {
        let (kind, reduce, root) = (self.int()?, self.int()?, self.int()? as usize);
        let reduce = match reduce {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Avg,
            2 => ReduceOp::Max,
            r => bail!("unknown reduction {r}"),
        };
        Ok(match kind {
            0 => Op::AllReduce(reduce),
            1 => Op::AllGather,
            2 => Op::ReduceScatter(reduce),
            3 => Op::Broadcast { root },
            4 => Op::Barrier,
            k => bail!("unknown collective {k}"),
        })
    }
}
