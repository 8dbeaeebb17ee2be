//! # What every axis sends in a step, counted from the shapes
//!
//! The comm report (`comm/cost.rs`) counts what a run's groups did; `ferrotron plan` must know it
//! for layouts no machine here can run. Every collective of a step is one of a few kinds, and its
//! size follows from the model's shapes and the layout, per micro-batch or per step:
//!
//! ```text
//! axis     what                                                     when            bytes (B)
//! tp       g/f all-reduces (each block 2 forward, 2 backward;       each micro-batch rows·d·e
//!          the embedding's and the head's), or with sequence
//!          parallelism all-gathers and reduce-scatters instead
//! cp       ring: K|V blocks round the ring, forward and backward    each micro-batch 2·rows·kv·e
//!          Ulysses: heads ↔ rows all-to-alls around attention
//! pp       activations forward, their gradients back                each micro-batch rows·d·e
//! ep       tokens to their experts and back (all-to-all)            each micro-batch k·rows·d·e
//! dp×cp    the gradients' buckets (all-reduce; ZeRO: reduce-        each step         4·weights
//!          scatter, and the updated weights' all-gather; FSDP:
//!          each unit gathered before its forward and backward)
//! ```
//! plus one-number calls (the loss, the gradient norm, a signal's agreement). rows = the
//! micro-batch's tokens on one cp rank, e = bytes of the compute dtype. `per_step` lists them for
//! one rank of a pipeline stage; a test holds them equal to the ledger of real runs.

use crate::comm::cost::Call;
use crate::config::{partial_over_tp, Config, CpMode, DeviceKind, DpMode, PpSchedule, ZeroReduce};
use crate::model::moe;
use crate::model::stage::Stage;
use crate::ops::{DType, TpCut};
use crate::parallel::data_parallel::{bucket_values, plan_buckets, BucketPlan};
use crate::parallel::pipeline_schedule::sent_by;
use crate::parallel::schedules::schedule_of;
use crate::parallel::ulysses;
use crate::parallel::zero::partition_size;
use std::cell::RefCell;
use std::collections::HashMap;

/// One kind of call on one axis, per step, for one rank.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Flow {
    /// The axis as the comm report names it ("tp", "dp×cp", …).
    pub axis: &'static str,
    /// Ranks in each of its groups.
    pub ranks: usize,
    #[serde(serialize_with = "call_name")]
    pub call: Call,
    pub calls: f64,
    /// B of `comm/cost.rs`'s table, summed over the calls.
    pub bytes: f64,
    /// Whether the step waits for it (false: it runs behind compute, as far as compute lasts).
    pub exposed: bool,
}

fn call_name<S: serde::Serializer>(c: &Call, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(c.name())
}

/// Adds calls into `flows`.
struct Flows(Vec<Flow>);

impl Flows {
    fn add(&mut self, (axis, ranks): (&'static str, usize), call: Call, calls: f64, bytes: f64, exposed: bool) {
        if ranks < 2 || calls == 0.0 {
            return; // a group of one sends nothing
        }
        match self.0.iter_mut().find(|f| f.axis == axis && f.call == call && f.exposed == exposed) {
            Some(f) => (f.calls, f.bytes) = (f.calls + calls, f.bytes + bytes),
            None => self.0.push(Flow { axis, ranks, call, calls, bytes, exposed }),
        }
    }
}

/// A tensor of a stage as one rank holds it.
struct Held {
    name: String,
    /// Values on this rank: 1/tp of a split one (of a copied KV head's, 1/kv_heads), 1/ep of the
    /// experts.
    values: usize,
    /// The tp ranks holding the same slice (1 but for KV heads fewer than the ranks).
    copies: usize,
    /// Its model chunk.
    chunk: usize,
    /// Whole on every tp rank (a norm, the router, an expert).
    whole: bool,
}

/// Each tensor of `stage`, in model order: its one-layer twin's tensors (listed once a model,
/// `memory::one_layer`) repeated for each of its layers, the embedding first and the head last.
fn tensors(cfg: &Config, stage: Stage) -> Vec<Held> {
    let (m, p) = (&cfg.model, &cfg.parallel);
    let cuts = crate::train::memory::one_layer(m);
    let held = |name: String, shape: &[usize], cut: TpCut, chunk: usize| {
        let (whole, copies) = (cut == TpCut::Whole, cut.copies(p.tp));
        let n = shape.iter().product::<usize>() / cut.parts(p.tp);
        let values = if moe::is_expert(&name) { n / p.ep } else { n };
        Held { name, values, chunk, whole, copies }
    };
    let block = |(name, ..): &&(String, Vec<usize>, TpCut)| name.starts_with("model.layers.");
    let mut out = Vec::new();
    if stage.is_first() {
        out.extend(
            cuts.iter().filter(|c| c.0 == "model.embed_tokens.weight").map(|(n, s, c)| held(n.clone(), s, *c, 0)),
        );
    }
    let ranges = stage.chunk_layers(m.num_hidden_layers);
    for (chunk, range) in ranges.iter().enumerate() {
        for layer in range.clone() {
            let twin = format!("model.layers.{}.", crate::train::memory::twin_of(m, layer)); // its twin's layer
            for (name, shape, cut) in cuts.iter().filter(|c| c.0.starts_with(&twin)) {
                let name = name.replacen(&twin, &format!("model.layers.{layer}."), 1);
                out.push(held(name, shape, *cut, chunk));
            }
        }
    }
    if stage.is_last() {
        // the final norm, the output layer (a tied model's last stage: its copy of the embedding)
        let copy = m.tie_word_embeddings && !stage.is_first();
        let head = cuts.iter().filter(|c| !block(c) && (copy || c.0 != "model.embed_tokens.weight"));
        let mut head: Vec<Held> = head.map(|(n, s, c)| held(n.clone(), s, *c, ranges.len() - 1)).collect();
        head.sort_by_key(|h| h.name == "model.embed_tokens.weight"); // the output layer after the norm
        out.extend(head);
    }
    out
}

/// What one rank of pipeline `stage` sends per step of `cfg`, axis by axis.
pub fn per_step(cfg: &Config, stage: Stage) -> Vec<Flow> {
    let (t, p, m) = (&cfg.train, &cfg.parallel, &cfg.model);
    let e = if cfg.device.kind == DeviceKind::Cuda && cfg.device.compute_dtype() == DType::Bf16 { 2.0 } else { 4.0 };
    let mb = t.grad_accum_steps as f64;
    let rows = (t.micro_batch_size * t.seq_len / p.cp) as f64;
    let d = m.hidden_size as f64;
    let layers = stage.layer_count(m.num_hidden_layers) as f64;
    let (first, last) = (stage.is_first() as u8 as f64, stage.is_last() as u8 as f64);
    let mut f = Flows(Vec::new());
    let x = rows * d * e; // one micro-batch's activations on this rank
    let experts = m.num_local_experts > 0;

    // tensor parallelism: the g and f of every block, the embedding's and the head's
    let tp = ("tp", p.tp);
    let list = tensors(cfg, stage);
    let z = p.dp * p.cp;
    let shard = if p.dp_shard == 0 { z } else { p.dp_shard * p.cp };
    let edp = (z / p.ep.max(1)).max(1);
    // a gradient summed over tp once a step: under ZeRO each rank's partitions of it
    let trained = |h: &Held| match (p.zero_stage, moe::is_expert(&h.name)) {
        (0, _) => h.values,
        (_, true) if edp > 1 => partition_size(h.values, edp),
        (_, false) if shard > 1 => partition_size(h.values, shard),
        _ => h.values,
    };
    if p.sequence_parallel {
        let gathers = 6.0 * layers + 2.0 * last + first;
        let scatters = 4.0 * layers + first + last;
        f.add(tp, Call::AllGather, mb * gathers, mb * gathers * x, true);
        f.add(tp, Call::ReduceScatter, mb * scatters, mb * scatters * x, true);
        // the gradients of what every tp rank holds whole (the norms), summed over the rows each
        // tp rank saw
        let norms: usize = list.iter().filter(|h| h.whole).map(trained).sum();
        f.add(tp, Call::AllReduce, 1.0, 4.0 * norms as f64, true);
    } else {
        let sums = 4.0 * layers + first + last;
        f.add(tp, Call::AllReduce, mb * sums, mb * sums * x, true);
        // latent attention's replicated latent path: each rank's gradient reached it from its own
        // heads only, a partial sum (`parallel/latent_tensor_parallel.rs`)
        let latent: usize = list.iter().filter(|h| partial_over_tp(&h.name)).map(trained).sum();
        if latent > 0 {
            f.add(tp, Call::AllReduce, 1.0, 4.0 * latent as f64, true);
        }
    }
    // KV heads fewer than the tp ranks: the copies' gradients added up, in a buffer of every slot
    // (`parallel/shared_kv_heads.rs`)
    let copied: usize = list.iter().filter(|h| h.copies > 1).map(|h| trained(h) * p.tp / h.copies).sum();
    if copied > 0 {
        f.add(tp, Call::AllReduce, 1.0, 4.0 * copied as f64, true);
    }
    // the cross-entropy's three row statistics over the vocabulary's slices, the norm's sum
    f.add(tp, Call::AllReduce, mb * 3.0 * last, mb * 3.0 * last * rows * 4.0, true);
    f.add(tp, Call::AllReduce, 1.0, 4.0, true);

    // context parallelism
    let cp = ("cp", p.cp);
    let kv = (m.kv_heads_on(p.tp) * m.core_head_dim()) as f64;
    let q = (m.num_attention_heads / p.tp * m.core_head_dim()) as f64;
    match p.cp_mode {
        CpMode::Ring => {
            // forward: K|V handed on cp − 1 times while attention computes; backward: the same
            // walk, and each of its cp steps hands the block's dK|dV on with it (and waits).
            // Latent attention's blocks are the keys' source, [c | rope(k_rot)], whole on every
            // tp rank: its heads are made where a block lands
            let per_row = match m.latent() {
                None => 2.0 * kv,
                Some(l) => (l.kv_rank + l.rope) as f64,
            };
            let block = rows * per_row * e;
            let hops = (p.cp - 1) as f64;
            f.add(cp, Call::P2p, mb * layers * 2.0 * hops, mb * layers * 2.0 * hops * block, false);
            f.add(cp, Call::P2p, mb * layers * p.cp as f64, mb * layers * p.cp as f64 * block, true);
        }
        CpMode::Ulysses => {
            // rows → heads before attention, heads → rows after: forward q, k, v, then the output
            // and lse back; backward q, k, v, out, dout, lse, then dq, dk, dv back (k and v
            // repeated where cp does not divide the KV heads)
            let kv = kv * ulysses::repeats(m.kv_heads_on(p.tp), p.cp) as f64;
            let lse = rows * (m.num_attention_heads / p.tp) as f64 * 4.0;
            let forward = rows * (2.0 * q + 2.0 * kv) * e + lse;
            let backward = rows * (4.0 * q + 4.0 * kv) * e + lse;
            f.add(cp, Call::AllToAll, mb * layers * 14.0, mb * layers * (forward + backward), true);
        }
    }

    // pipeline parallelism: each message one micro-batch's activations or their gradient
    let pp = ("pp", p.pp);
    if p.pp > 1 {
        let msg = rows / if p.sequence_parallel { p.tp as f64 } else { 1.0 } * d * e;
        let calls = pipeline_calls(cfg, stage) as f64;
        f.add(pp, Call::P2p, calls, calls * msg, false);
        f.add(pp, Call::Broadcast, 1.0, 4.0, true); // the loss, from the last stage
        f.add(pp, Call::AllReduce, 1.0, 4.0, true); // the gradient norm's sum
                                                    // a tied embedding's two halves of its gradient swapped between the first and the last
                                                    // stage, once a step (under ZeRO this rank's partition of it)
        if m.tie_word_embeddings && stage.is_first() != stage.is_last() {
            let embedding = list.iter().find(|h| h.name == "model.embed_tokens.weight");
            f.add(pp, Call::P2p, 1.0, 4.0 * embedding.map_or(0, trained) as f64, true);
        }
    }

    // experts: each routed row to its expert's rank and back, forward and backward (what a rank
    // sends depends on the routing: the mean over the ep ranks), the norm's experts' part
    if experts && p.ep > 1 {
        let ep = ("ep", p.ep);
        let split = rows / if p.sequence_parallel { p.tp as f64 } else { 1.0 };
        let routed = split * m.num_experts_per_tok as f64 * d * e;
        f.add(ep, Call::AllToAll, mb * layers * 4.0, mb * layers * 4.0 * routed, true);
        f.add(ep, Call::AllReduce, 1.0, 4.0, true);
    }

    // data parallelism and ZeRO over dp×cp (or a shard group), the experts' over their own group
    let (dense, expert): (Vec<&Held>, Vec<&Held>) = list.iter().partition(|h| !moe::is_expert(&h.name));
    let (sync_axis, replicate) = if p.dp_shard == 0 || shard == z { ("dp×cp", 1) } else { ("shard", z / shard) };
    gradients(&mut f, cfg, (sync_axis, shard), &dense, e);
    if replicate > 1 && p.zero_stage > 0 {
        // hybrid sharding: each shard's averaged partitions, across the replicas
        let partitions: f64 = dense.iter().map(|h| partition_size(h.values, shard) as f64).sum();
        let buckets = zero_buckets(cfg, &dense, shard).len() as f64;
        f.add(("replicate", replicate), Call::AllReduce, buckets, 4.0 * partitions, false);
    }
    if experts {
        let ranks = if edp == z { (sync_axis, shard) } else { ("edp", edp) };
        gradients(&mut f, cfg, ranks, &expert, e);
    }
    f.add(("dp×cp", z), Call::AllReduce, 1.0, 4.0, true); // the loss's mean

    // one number on the whole world: has any rank seen a signal? After each step, and before
    // each round of forwards but the first (a round: p·V of them in a pipeline), where a step
    // may stop part-way (not a pipeline on NCCL)
    let round = if p.pp == 1 { 1 } else { p.pp * stage.chunks };
    let asks = 1 + if may_stop(cfg) { (t.grad_accum_steps * stage.chunks - 1) / round } else { 0 };
    f.add(("world", p.world_size()), Call::AllReduce, asks as f64, 4.0 * asks as f64, true);
    f.0
}

/// Buckets of ZeRO's reduce-scatter for `list` sharded over `ranks`.
fn zero_buckets(cfg: &Config, list: &[&Held], ranks: usize) -> Vec<BucketPlan> {
    let widths: Vec<usize> = list.iter().map(|h| partition_size(h.values, ranks)).collect();
    let chunks: Vec<usize> = list.iter().map(|h| h.chunk).collect();
    plan_buckets((&widths, &chunks), (bucket_values(cfg.parallel.bucket_mb) / ranks).max(1))
}

/// The gradients of `list` averaged over `(axis, ranks)`: data parallelism's buckets, or ZeRO's
/// reduce-scatters, its weights' gather and the norm's parts.
fn gradients(f: &mut Flows, cfg: &Config, (axis, ranks): (&'static str, usize), list: &[&Held], e: f64) {
    let (t, p) = (&cfg.train, &cfg.parallel);
    if ranks < 2 || list.is_empty() {
        return;
    }
    let group = (axis, ranks);
    let mb = t.grad_accum_steps as f64;
    let zero = p.zero_stage;
    let wire = p.reduce_dtype.dtype().size() as f64; // a gradient's bytes on the wire (bf16: 2)
    if zero == 0 {
        let values: usize = list.iter().map(|h| h.values).sum();
        let calls = match p.dp_mode {
            DpMode::Naive => list.len(),
            DpMode::Bucketed => {
                let widths: Vec<usize> = list.iter().map(|h| h.values).collect();
                let chunks: Vec<usize> = list.iter().map(|h| h.chunk).collect();
                plan_buckets((&widths, &chunks), bucket_values(p.bucket_mb)).len()
            }
        };
        f.add(group, Call::AllReduce, calls as f64, wire * values as f64, p.dp_mode == DpMode::Naive);
        return;
    }
    // ZeRO: each bucket reduce-scattered (ZeRO-1 on the last micro-batch, 2 and 3 on every one,
    // or on the last with zero_reduce = "once")
    let buckets = zero_buckets(cfg, list, ranks);
    let padded: usize = buckets.iter().map(|b| b.len * ranks).sum();
    let times = if zero == 1 || p.zero_reduce == ZeroReduce::Once { 1.0 } else { mb };
    f.add(group, Call::ReduceScatter, times * buckets.len() as f64, times * wire * padded as f64, false);
    // the norm's parts: the tp-split parameters' and the whole ones', each summed over the partitions
    let parts = list.iter().any(|h| !h.whole) as u8 + list.iter().any(|h| h.whole) as u8;
    f.add(group, Call::AllReduce, parts as f64, 4.0 * parts as f64, true);
    let gathered = |n: usize| (partition_size(n, ranks) * ranks) as f64;
    if zero == 3 {
        // FSDP: each unit (embedding, block, head) before its forward, and before its backward
        // but the last one's (still whole from its forward)
        let mut units: Vec<f64> = Vec::new();
        let mut key = String::new();
        for (i, Held { name, values: n, .. }) in list.iter().enumerate() {
            let unit = match name.starts_with("model.layers.") {
                true => name.split('.').take(3).collect::<Vec<_>>().join("."),
                false if i == 0 => "embedding".into(),
                false => "head".into(), // the final norm and the output layer (or a tied copy)
            };
            if unit != key || units.is_empty() {
                units.push(0.0);
                key = unit;
            }
            *units.last_mut().expect("pushed") += gathered(*n);
        }
        // (the embedding's backward reads no weight: it is not gathered again)
        let embedding = list.first().is_some_and(|h| h.name == "model.embed_tokens.weight") as usize;
        let calls = (2 * units.len() - embedding) as f64;
        let bytes = 2.0 * units.iter().sum::<f64>() - if embedding == 1 { units[0] } else { 0.0 };
        f.add(group, Call::AllGather, mb * calls, mb * bytes * e, false);
    } else {
        // ZeRO-1/2: the updated weights gathered in groups of about a bucket's values
        let bucket = bucket_values(p.bucket_mb);
        let (mut groups, mut size, mut values) = (0usize, 0usize, 0.0);
        for h in list {
            let c = partition_size(h.values, ranks) * ranks;
            if groups == 0 || size + c > bucket {
                (groups, size) = (groups + 1, 0);
            }
            size += c;
            values += c as f64;
        }
        f.add(group, Call::AllGather, groups as f64, values * e, true);
    }
}

/// Whether a step of `cfg` may stop part-way at a signal (as `train/driver.rs` decides): not a
/// pipeline on NCCL, whose sends wait for their receives.
fn may_stop(cfg: &Config) -> bool {
    cfg.parallel.pp == 1 || cfg.device.kind != DeviceKind::Cuda
}

/// A pipeline's key: (schedule, stages, this stage, micro-batches, chunks).
type Pipeline = (&'static str, usize, usize, usize, usize);

/// Point-to-point calls of pipeline `stage` in a step: the 1F1B loop pairs a send with the next
/// receive from the same neighbour (one call); AFAB and the listed schedules send and receive
/// each message on its own.
fn pipeline_calls(cfg: &Config, stage: Stage) -> usize {
    let p = &cfg.parallel;
    let (m, s) = (cfg.train.grad_accum_steps, stage.index);
    let (prev, next) = ((s > 0) as usize, (s + 1 < p.pp) as usize);
    let schedule = schedule_of(p.pp_schedule);
    match p.pp_schedule {
        PpSchedule::Afab => 2 * m * (prev + next),
        PpSchedule::OneFOneB => {
            let warmup = schedule.warmup(p.pp, s, m, 1);
            // where a step may stop, the gradient out and the next input in go apart at a round
            let apart = match may_stop(cfg) {
                true => (warmup + 1..m).filter(|k| k.is_multiple_of(p.pp)).count(),
                false => 0,
            };
            ((m + warmup) * (prev + next) + usize::from(m > warmup) * prev) + apart * prev
        }
        _ => {
            // walking every stage's action list is the costliest count of a plan's search, which
            // meets the same pipeline under many layouts: counted once a pipeline on each thread
            thread_local! {
                static COUNTED: RefCell<HashMap<Pipeline, usize>> =
                    RefCell::new(HashMap::new());
            }
            let v = stage.chunks;
            let key = (p.pp_schedule.name(), p.pp, s, m, v);
            if let Some(n) = COUNTED.with(|c| c.borrow().get(&key).copied()) {
                return n;
            }
            let sent = schedule.actions(p.pp, s, m, v).filter(|&a| sent_by(stage, s, a).is_some_and(|(to, _)| to != s));
            let received = (0..p.pp).filter(|&from| from != s).map(|from| {
                schedule
                    .actions(p.pp, from, m, v)
                    .filter(|&a| sent_by(stage, from, a).is_some_and(|(to, _)| to == s))
                    .count()
            });
            let n = sent.count() + received.sum::<usize>();
            COUNTED.with(|c| c.borrow_mut().insert(key, n));
            n
        }
    }
}
