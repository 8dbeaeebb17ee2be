//! # The router on tape: is a curve's difference a routing choice, or a defect?
//!
//! A mixture of experts makes a discrete choice per token (`model/moe.rs`): the k largest router
//! probabilities. Two layouts of the same run sum their products in different orders (on a GPU,
//! cuBLAS picks its kernel by the product's shape), so their logits differ by a rounding; where
//! two probabilities were that close, the two runs send the token to different experts, and from
//! there their curves part by far more than a rounding. The same parting is what a defect in
//! dispatch, combine or the experts' gradients would show. The tape tells the two apart:
//!
//! ```text
//! run A (e.g. one rank)   --record-routing DIR   every layer's choice for every row of every step
//! run B (e.g. ep = 2)     --replay-routing DIR   each row takes A's choice; where B's own router
//!                                                chose otherwise it counts as replaced
//! ```
//! B under A's routing computes what A computed, cut differently, so its curve must follow A's as
//! a dense layout's does. If it does, the difference was routing; if it still parts, the defect
//! is in what B computes (its expert path, or whatever else its layout changed). A row is named
//! by what does not depend on the
//! layout: (step, layer, sequence of the data stream, position), so a tape recorded with any dp,
//! cp, tp, ep and grad_accum_steps replays into any other of the same global batch and seq_len.
//! A replaced row keeps B's probabilities and renormalises A's experts' shares of them, so
//! its router still learns from what B computed. The tape rides the MoE layer's `ExpertSplit`
//! seam (`Taped` wraps whichever split the run has); the loop says which rows a micro-batch holds.
//! Not with pipeline parallelism, whose stages run micro-batches out of the loop's order.

use crate::config::Config;
use crate::model::moe::{ExpertSplit, Routed};
use crate::ops::moe::{self as route, Routing};
use crate::ops::tensor::Tensor;
use crate::ops::DType;
use anyhow::{bail, Context, Result};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// What a run does with the router's choices (`train --record-routing` / `--replay-routing`).
#[derive(Clone, Copy, Debug)]
pub enum TapeMode<'a> {
    /// Write every choice into this folder (one file a rank) when the run ends.
    Record(&'a Path),
    /// Take every choice from the files a recording left in this folder.
    Replay(&'a Path),
}

/// (step, layer, sequence of the data stream, position in it).
type Key = (u32, u32, u64, u32);

/// A row of a micro-batch: (sequence of the data stream, position in it).
pub type Row = (u64, u32);

const MAGIC: &[u8; 20] = b"ferrotron routing 1\n";

enum Tape {
    Record { dir: PathBuf, choices: RefCell<BTreeMap<Key, Vec<u32>>> },
    Replay { dir: PathBuf, choices: HashMap<Key, Vec<u32>> },
}

pub struct RoutingTape {
    tape: Tape,
    /// The experts each row takes.
    k: usize,
    /// The step and rows of the micro-batch the model computes now (none outside training's
    /// forward and backward: validation is not taped).
    rows: RefCell<Option<(u32, Vec<Row>)>>,
    /// Replay: rows whose recorded choice replaced their router's, of all rows replayed (a
    /// recomputed forward counts again).
    replaced: Cell<usize>,
    taped: Cell<usize>,
}

impl RoutingTape {
    /// The tape of one rank of a run of `cfg`.
    pub fn open(mode: TapeMode, cfg: &Config) -> Result<Rc<RoutingTape>> {
        let option = match mode {
            TapeMode::Record(_) => "--record-routing",
            TapeMode::Replay(_) => "--replay-routing",
        };
        if cfg.model.num_local_experts == 0 {
            bail!("{option}: the model has no mixture of experts (model.num_local_experts = 0), so nothing is routed");
        }
        if cfg.parallel.pp > 1 {
            bail!("{option}: not with parallel.pp = {} (a pipeline's stages run micro-batches out of the loop's order); tape the run with pp = 1", cfg.parallel.pp);
        }
        let tape = match mode {
            TapeMode::Record(dir) => {
                crate::files::check_folder_writable(dir).map_err(|e| anyhow::anyhow!("{option}: {e:#}"))?;
                // another recording's files would be read back with this one's
                if let Some(old) = tapes(dir)?.first() {
                    bail!("{option} {}: the folder already holds a recording ({}); give an empty folder, or remove its .routing files", dir.display(), old.display());
                }
                Tape::Record { dir: dir.to_path_buf(), choices: RefCell::default() }
            }
            TapeMode::Replay(dir) => Tape::Replay { dir: dir.to_path_buf(), choices: read(dir, cfg)? },
        };
        let (rows, replaced, taped) = (RefCell::default(), Cell::new(0), Cell::new(0));
        Ok(Rc::new(RoutingTape { tape, k: cfg.model.num_experts_per_tok, rows, replaced, taped }))
    }

    /// The model computes `rows` of `step` now (see `batch_rows`).
    pub fn at(&self, step: usize, rows: Vec<Row>) {
        *self.rows.borrow_mut() = Some((step as u32, rows));
    }

    /// The step's micro-batches are done: forwards until the next `at` are not taped.
    pub fn idle(&self) {
        *self.rows.borrow_mut() = None;
    }

    /// Replay: (rows whose recorded choice replaced their router's, rows replayed) so far.
    pub fn replaced(&self) -> Option<(usize, usize)> {
        match self.tape {
            Tape::Record { .. } => None,
            Tape::Replay { .. } => Some((self.replaced.get(), self.taped.get())),
        }
    }

    /// Record: writes this rank's choices to `DIR/rank{rank}.routing` (whole or not at all):
    /// a header (k, seq_len, global batch, count) and a record a choice (step, layer, sequence
    /// as two words, position, the k experts), every number a little-endian u32.
    pub fn save(&self, rank: usize, cfg: &Config) -> Result<()> {
        let Tape::Record { dir, choices } = &self.tape else { return Ok(()) };
        let choices = choices.borrow();
        let mut bytes = MAGIC.to_vec();
        let words = header(cfg).into_iter().chain([choices.len() as u32]);
        words.for_each(|v| bytes.extend(v.to_le_bytes()));
        for ((step, layer, sequence, position), experts) in choices.iter() {
            let key = [*step, *layer, *sequence as u32, (*sequence >> 32) as u32, *position];
            key.iter().chain(experts).for_each(|v| bytes.extend(v.to_le_bytes()));
        }
        crate::files::write_atomically(&dir.join(format!("rank{rank}.routing")), &bytes)
    }

    /// `layer`'s routing of the rows set by `at`: recorded, or replaced by the recording's.
    fn choose(&self, layer: usize, mut routing: Routing) -> Result<Routing> {
        let rows = self.rows.borrow();
        let Some((step, rows)) = rows.as_ref() else { return Ok(routing) };
        let (k, e) = (self.k, routing.probs.cols());
        if rows.len() * k != routing.experts.len() {
            bail!("routing tape: {} rows named for a layer that routed {}", rows.len(), routing.experts.len() / k);
        }
        let key = |r: usize| (*step, layer as u32, rows[r].0, rows[r].1);
        let mut wanted = Vec::with_capacity(rows.len());
        match &self.tape {
            Tape::Record { choices, .. } => {
                let mut choices = choices.borrow_mut();
                for (r, chosen) in routing.experts.chunks(k).enumerate() {
                    choices.insert(key(r), chosen.to_vec()); // a recomputed forward chooses the same
                }
                return Ok(routing);
            }
            Tape::Replay { dir, choices } => {
                for (r, row) in rows.iter().enumerate() {
                    let Some(want) = choices.get(&key(r)) else {
                        bail!(
                            "--replay-routing {}: no choice recorded for step {step}, layer {layer}, sequence {} at position {}; record a run of the same train.steps and model",
                            dir.display(),
                            row.0,
                            row.1
                        );
                    };
                    wanted.push(want.clone());
                }
            }
        }
        let replaced: Vec<usize> =
            (0..rows.len()).filter(|&r| routing.experts[r * k..(r + 1) * k] != wanted[r][..]).collect();
        self.taped.set(self.taped.get() + rows.len());
        self.replaced.set(self.replaced.get() + replaced.len());
        if !replaced.is_empty() {
            // a replaced row takes this run's probabilities of its new experts, renormalised as
            // `route` does (on a GPU, a read back: the tape is a debugging tool)
            let (probs, mut weights) = (routing.probs.to_vec(), routing.weights.to_vec());
            for r in replaced {
                routing.experts[r * k..(r + 1) * k].copy_from_slice(&wanted[r]);
                route::router_shares(
                    routing.router,
                    &probs[r * e..(r + 1) * e],
                    &wanted[r],
                    &mut weights[r * k..(r + 1) * k],
                );
            }
            routing.weights =
                Tensor::from_host_in(routing.weights.shape(), weights, &routing.weights.place(), DType::F32);
        }
        Ok(routing)
    }
}

/// The rows a rank computes in micro-batch `micro` of `step`: the sequences of its slice of the
/// step's global batch (`data::Dataset::micro_batch`) at each of `positions` (its cp positions);
/// with sequence parallelism, its `tp` share of them (`Some((index, size))`), as
/// `parallel/sequence_parallel.rs` cuts the rows.
pub fn batch_rows(
    cfg: &Config,
    step: usize,
    (dp_rank, micro): (usize, usize),
    positions: &[u32],
    sp: Option<(usize, usize)>,
) -> Vec<Row> {
    let t = &cfg.train;
    let first = (step * global_batch(cfg) + (dp_rank * t.grad_accum_steps + micro) * t.micro_batch_size) as u64;
    let sequences = first..first + t.micro_batch_size as u64;
    let rows: Vec<Row> = sequences.flat_map(|s| positions.iter().map(move |&p| (s, p))).collect();
    match sp {
        Some((index, size)) => rows.chunks(rows.len() / size).nth(index).expect("tp divides the rows").to_vec(),
        None => rows,
    }
}

/// Sequences a step trains on.
fn global_batch(cfg: &Config) -> usize {
    let t = &cfg.train;
    t.micro_batch_size * t.grad_accum_steps * cfg.parallel.dp
}

/// What a tape must share with the run that replays it: k, seq_len and the global batch.
fn header(cfg: &Config) -> [u32; 3] {
    [cfg.model.num_experts_per_tok, cfg.train.seq_len, global_batch(cfg)].map(|v| v as u32)
}

/// The `.routing` files of `dir`, in name order.
fn tapes(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("cannot read the folder {}", dir.display()))?;
    let mut files: Vec<PathBuf> =
        entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "routing")).collect();
    files.sort();
    Ok(files)
}

/// Every choice of the `.routing` files in `dir` (the ranks of one recording; a row recorded by
/// several ranks, as tp ranks without sequence parallelism route the same rows, must agree).
fn read(dir: &Path, cfg: &Config) -> Result<HashMap<Key, Vec<u32>>> {
    let what = |p: &Path| format!("--replay-routing: {}", p.display());
    let files = tapes(dir).map_err(|e| anyhow::anyhow!("--replay-routing: {e:#}"))?;
    if files.is_empty() {
        bail!("{}: no .routing files; record a run there first with --record-routing", what(dir));
    }
    let (want, k) = (header(cfg), cfg.model.num_experts_per_tok);
    let mut choices = HashMap::new();
    for file in files {
        let bytes = crate::files::read_bytes(&file, "--replay-routing")?;
        let bad = |why: &str| anyhow::anyhow!("{}: {why}; record it again with --record-routing", what(&file));
        let body = bytes.strip_prefix(&MAGIC[..]).ok_or_else(|| bad("not a routing tape"))?;
        if body.len() % 4 != 0 || body.len() < 16 {
            return Err(bad("cut short"));
        }
        let words: Vec<u32> = body.chunks(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
        if words[..3] != want {
            bail!(
                "{}: recorded with {} experts a token, seq_len {} and a global batch of {} sequences; this run has model.num_experts_per_tok = {}, train.seq_len = {} and {} (micro_batch_size × grad_accum_steps × dp): replay into a run of the same",
                what(&file), words[0], words[1], words[2], want[0], want[1], want[2]
            );
        }
        let record = 5 + k;
        let count = words[3] as usize;
        if words.len() != 4 + record * count {
            return Err(bad("its length does not match its count"));
        }
        for v in words[4..].chunks(record) {
            let key = (v[0], v[1], v[2] as u64 | (v[3] as u64) << 32, v[4]);
            if let Some(was) = choices.insert(key, v[5..].to_vec()) {
                if was != v[5..] {
                    bail!(
                        "{}: step {}, layer {}, sequence {}, position {} recorded with two different choices",
                        what(&file),
                        key.0,
                        key.1,
                        key.2,
                        key.3
                    );
                }
            }
        }
    }
    Ok(choices)
}

/// Whichever split a run has, with its router's choices on the tape.
pub struct Taped<'g> {
    pub inner: Box<dyn ExpertSplit + 'g>,
    pub tape: Rc<RoutingTape>,
}

impl ExpertSplit for Taped<'_> {
    fn held(&self, total: usize) -> Range<usize> {
        self.inner.held(total)
    }
    fn choose(&self, layer: usize, routing: Routing) -> Result<Routing> {
        self.tape.choose(layer, self.inner.choose(layer, routing)?)
    }
    fn dispatch(&self, rows: Tensor, counts: &[usize]) -> Result<(Tensor, Routed)> {
        self.inner.dispatch(rows, counts)
    }
    fn dispatch_again(&self, rows: Tensor, routed: &Routed) -> Result<Tensor> {
        self.inner.dispatch_again(rows, routed)
    }
    fn combine(&self, rows: Tensor, routed: &Routed) -> Result<Tensor> {
        self.inner.combine(rows, routed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_row_takes_its_new_experts_shares_of_its_own_probabilities() {
        // 2 rows, 4 experts, top-2: row 0 keeps its choice, row 1 is sent to experts 3 and 0
        let logits = Tensor::from_vec(&[2, 4], vec![2.0, 1.0, 0.5, -1.0, 0.0, 0.1, 3.0, 2.9]);
        let routing = route::route(&logits, 2);
        let (own, p) = (routing.experts.clone(), routing.probs.to_vec());
        let choices = HashMap::from([((3, 1, 9, 0), own[..2].to_vec()), ((3, 1, 9, 1), vec![3, 0])]);
        let tape = RoutingTape {
            tape: Tape::Replay { dir: PathBuf::from("tape"), choices },
            k: 2,
            rows: RefCell::new(Some((3, vec![(9, 0), (9, 1)]))),
            replaced: Cell::new(0),
            taped: Cell::new(0),
        };
        let weights = routing.weights.to_vec();
        let replayed = tape.choose(1, routing).unwrap();
        assert_eq!(replayed.experts, [own[0], own[1], 3, 0]);
        let taken = p[4 + 3] + p[4];
        assert_eq!(replayed.weights.to_vec(), [weights[0], weights[1], p[4 + 3] / taken, p[4] / taken]);
        assert_eq!(tape.replaced(), Some((1, 2)));
        // a row the recording does not name is an error that says how to record
        let err = tape.choose(2, route::route(&logits, 2)).err().unwrap().to_string();
        assert!(
            err.contains("no choice recorded for step 3, layer 2, sequence 9 at position 0; record a run"),
            "{err}"
        );
    }
}
