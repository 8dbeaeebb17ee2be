//! # Memory: what a rank holds, estimated before anything is allocated
//!
//! A config that cannot fit should fail in a second with numbers, not after minutes with an
//! allocator abort. Before a run builds anything, it adds up what its busiest rank will hold:
//!
//! ```text
//! weights   Σ over the stage's tensors: matrices / tp (split), norms whole (replicated)
//!           × bytes per weight: value, gradient, two AdamW moments (+ the bf16 copy on a GPU)
//! activations  what one micro-batch keeps for backward × the micro-batches a stage holds at once
//! attention    on the CPU, per core one query tile's scores and their gradient (2 × 32 × seq/cp);
//!              on a GPU, the backward's scratch (δ; on tensor cores the fp32 parts of dQ, dK, dV)
//! loaded       a checkpoint or pretrained weights, kept in host memory for the ranks to slice
//! ```
//! and compares it with what the machine has (`MemAvailable` for CPU ranks, which share one
//! process; the free memory of a GPU for the ranks sharing it). Everything is computed in f64:
//! absurd sizes give absurd numbers, never an overflow. At the end, how the process keeps the
//! host memory it frees (`keep_freed_memory`).

use crate::comm::launcher::Capacity;
use crate::config::{Config, DpMode, ModelConfig, OptimizerKind, PpSchedule, Recompute, ZeroReduce};
use crate::cuda::launch_table::attention::backward_scratch;
use crate::model::optimizer::Optimizer;
use crate::model::stage::Stage;
use crate::model::Llama;
use crate::model::{moe, muon};
use crate::ops::cpu_attention::QUERY_TILE;
use crate::ops::precision::{self, Precision};
use crate::ops::{Attn, DType, TpCut};
use crate::parallel::data_parallel::bucket_values;
use crate::parallel::layout::grid_of;
use crate::parallel::pipeline_schedule::Action;
use crate::parallel::schedules;
use anyhow::{bail, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Which tensors `sizes` counts, by name and whole shape.
type Counted = dyn Fn(&str, &[usize]) -> bool;

fn every(_: &str, _: &[usize]) -> bool {
    true
}

/// Bytes per weight kept for training: in mixed precision an fp32 master, its bf16 copy, an fp32
/// gradient and two fp32 AdamW moments (18); in f32 the weight, its gradient and the moments (16).
pub fn bytes_per_weight(dtype: DType) -> f64 {
    match dtype {
        DType::Bf16 => 4.0 + 2.0 + 4.0 + 8.0,
        DType::F32 => 4.0 + 4.0 + 8.0,
    }
}

/// How a rank cuts and keeps its activations: its tp ranks, whether sequence parallelism splits
/// the rows between the tp layers over them too, what backward recomputes, and whether backward
/// keeps the weight GEMMs' inputs for a later W (the zero-bubble pipelines).
#[derive(Clone, Copy, Debug)]
pub struct Keep {
    pub tp: usize,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
    pub defers_weights: bool,
    /// `train.loss_stripe_rows`: > 0, the last stage keeps dxn instead of the logits.
    pub loss_rows: usize,
    /// FP8 GEMMs on a GPU: a kept GEMM input keeps its FP8 copy too (`ops/gpu_fp8.rs`: both
    /// layouts, a byte each, cast once and read again by the weight gradient).
    pub fp8_copies: bool,
}

impl Keep {
    /// One rank, everything kept.
    pub const WHOLE: Keep = Keep {
        tp: 1,
        sequence_parallel: false,
        recompute: Recompute::None,
        defers_weights: false,
        loss_rows: 0,
        fp8_copies: false,
    };

    pub fn of(cfg: &Config) -> Keep {
        let p = &cfg.parallel;
        let defers_weights = p.pp > 1 && p.pp_schedule.splits_backward();
        let (tp, sequence_parallel, recompute) = (p.tp, p.sequence_parallel, cfg.train.recompute);
        let fp8_copies = cfg.device.kind == crate::config::DeviceKind::Cuda && cfg.device.gemms() == Precision::Fp8;
        Keep { tp, sequence_parallel, recompute, defers_weights, loss_rows: cfg.train.loss_stripe_rows, fp8_copies }
    }
}

/// Bytes one block keeps for backward from a micro-batch of `batch` sequences of `seq` tokens,
/// as `keep` says, and (second) what its backward computes again on top of that. Everything:
/// the block input, two norms' outputs and the residual (`4d` per row: split by tp under
/// sequence parallelism, like the two 1/rms rows in f32), q, k, v, the attention output and the
/// MLP's (`mlp_bytes`) in the compute dtype, and the attention's lse in f32; with FP8 GEMMs on a
/// GPU, the FP8 copies (2 bytes a value: both layouts) of the inputs of the projections (the two
/// norms' outputs, the attention output and, dense, the SwiGLU product). Selective keeps all but
/// the attention output and lse; full keeps the input alone. (Latent attention keeps its q padded to
/// one head width, its latents and what its keys and values are made of: `attention_bytes`.)
/// `layer`: which layer (a DeepSeekMoE's first layers are dense).
fn layer_bytes(m: &ModelConfig, layer: usize, batch: f64, seq: f64, keep: Keep, e: f64) -> (f64, f64) {
    let tp = keep.tp;
    let (rows, split) = (batch * seq, batch * seq / if keep.sequence_parallel { tp as f64 } else { 1.0 });
    let d = m.hidden_size as f64;
    let fp8 = if keep.fp8_copies { 2.0 } else { 0.0 };
    let dense_f = if m.num_local_experts == 0 { (m.intermediate_size / tp) as f64 } else { 0.0 };
    let (qkv, core) = attention_bytes(m, (batch, seq), tp, e, fp8);
    let all = split * 4.0 * d * e
        + rows * (2.0 * d + dense_f) * fp8
        + qkv
        + mlp_bytes(m, layer, (rows, split), keep, e).0
        + 2.0 * split * 4.0
        + core;
    match keep.recompute {
        Recompute::None => (all, 0.0),
        Recompute::Selective => (all - core, core),
        Recompute::Full => (split * d * e, all - split * d * e),
    }
}

/// (What a block's attention keeps besides its core, its core: the output and lse) for `batch`
/// sequences of `seq` tokens on one of `tp` ranks. Grouped-query: q, k and v. Latent: q padded to
/// D = max(n + r, v) a head, the latent c before its norm and the keys' source [c normed | k_rot]
/// (the query's latent before and after its norm, with `q_lora_rank`), their 1/rms in f32; its
/// core is D wide a head too. (The heads' keys and values are made again where they are used.)
fn attention_bytes(m: &ModelConfig, (batch, seq): (f64, f64), tp: usize, e: f64, fp8: f64) -> (f64, f64) {
    let (rows, heads) = (batch * seq, (m.num_attention_heads / tp) as f64);
    let lse = batch * heads * seq * 4.0;
    if m.kv_lora_rank == 0 {
        let hd = m.head_dim() as f64;
        let (q, kv) = (heads * hd, m.kv_heads_on(tp) as f64 * hd); // a copied KV head counts on each rank
        return (rows * (q + 2.0 * kv) * e, rows * q * (e + fp8) + lse);
    }
    let wide = heads * m.head_dim().max(m.v_head_dim) as f64; // H·D
    let (c, q_latent, r) = (m.kv_lora_rank as f64, m.q_lora_rank as f64, m.qk_rope_head_dim as f64);
    let norms = if m.q_lora_rank > 0 { 2.0 } else { 1.0 };
    (rows * (wide + 2.0 * c + r + 2.0 * q_latent) * e + rows * norms * 4.0, rows * wide * (e + fp8) + lse)
}

/// (What the MLP of a block keeps for backward, the most its backward adds on top) for `rows`
/// rows (`split` of them on this rank under sequence parallelism). Dense: gate, up and their
/// product (1/tp of the features each); backward adds their gradients and the input's, less the
/// product, which goes as soon as down's weight gradient has read it (unless a zero-bubble W
/// keeps it: `model/deferred_grads.rs`). A mixture
/// of experts routes this rank's rows (all of them without sequence parallelism: every tp rank
/// routes the same) k times: the routed rows and the experts' outputs (d each), gate, up and
/// product (the whole intermediate size: experts are not tp-split; with balanced experts each
/// rank computes about k rows per row, whatever ep is), the router's probabilities (E) and
/// weights (k) in f32; backward adds the same three gradients and three row gradients.
/// DeepSeekMoE: its experts are their own width, its shared experts a dense MLP beside them, and
/// its first layers (`layer` below them) dense.
fn mlp_bytes(m: &ModelConfig, layer: usize, (rows, split): (f64, f64), keep: Keep, e: f64) -> (f64, f64) {
    let d = m.hidden_size as f64;
    let dense = |width: usize| {
        let f = (width / keep.tp) as f64;
        let adds = if keep.defers_weights { 3.0 * f } else { 2.0 * f } + 2.0 * d;
        (rows * 3.0 * f * e, rows * adds * e)
    };
    let deepseek = m.deepseek_moe();
    if m.num_local_experts == 0 || deepseek.is_some_and(|s| layer < s.dense_below) {
        return dense(m.intermediate_size);
    }
    let (experts, k) = (m.num_local_experts as f64, m.num_experts_per_tok as f64);
    let (f, routed) = (deepseek.map_or(m.intermediate_size, |s| s.width) as f64, split * k);
    let shared = deepseek.filter(|s| s.shared > 0).map_or((0.0, 0.0), |s| dense(s.width * s.shared));
    let kept = routed * (2.0 * d + 3.0 * f) * e + split * (experts + k) * 4.0;
    (kept + shared.0, routed * (3.0 * f + 3.0 * d) * e + shared.1)
}

/// Bytes of the activations one micro-batch of `batch` sequences of `seq` tokens keeps for its
/// backward on one rank of pipeline `stage` (what `model/block.rs`'s `Kept` and the model's
/// head cache hold): per layer `layer_bytes`; on the last stage also the final norm's input and
/// output (split like the residual), its 1/rms, the logits and their lse (with the fused loss,
/// `train.loss_stripe_rows`, the norm's input, its 1/rms and dxn instead).
pub fn activation_bytes(m: &ModelConfig, batch: usize, seq: usize, keep: Keep, stage: Stage, dtype: DType) -> f64 {
    let e = if dtype == DType::Bf16 { 2.0 } else { 4.0 };
    let (batch, seq) = (batch as f64, seq as f64);
    let rows = batch * seq;
    let split = rows / if keep.sequence_parallel { keep.tp as f64 } else { 1.0 };
    let (d, vocab) = (m.hidden_size as f64, (m.vocab_size / keep.tp) as f64);
    let head = match (stage.is_last(), keep.loss_rows) {
        (false, _) => 0.0,
        (true, 0) => split * 2.0 * d * e + rows * vocab * e + (split + rows) * 4.0,
        (true, _) => split * d * e + rows * d * e + split * 4.0, // the norm's input, 1/rms and dxn
    };
    let counts = twin_counts(m, stage);
    (0..2).map(|j| counts[j] as f64 * layer_bytes(m, stands_for(m, j), batch, seq, keep, e).0).sum::<f64>() + head
}

/// The most activation bytes a rank holds at once for micro-batches of `batch` sequences: a
/// pipeline stage keeps those of every micro-batch it has in flight (all of a step's with AFAB,
/// at most pp − stage with 1F1B); the busiest stage counts.
pub fn activations_held(cfg: &Config, batch: usize, dtype: DType) -> f64 {
    let (t, p) = (&cfg.train, &cfg.parallel);
    (0..p.pp)
        .map(|s| {
            let stage = schedules::stage_of(s, p);
            activation_bytes(&cfg.model, batch, t.seq_len / p.cp, Keep::of(cfg), stage, dtype)
                * in_flight(cfg, stage, dtype)
        })
        .fold(0.0, f64::max)
}

/// Weights of the busiest stage on one tp rank: matrices are split over tp, norms are whole.
/// Counted from one layer's tensors times the stage's layers, so any depth costs nothing.
pub fn weights_per_rank(m: &ModelConfig, tp: usize, pp: usize) -> f64 {
    let cuts = one_layer(m);
    (0..pp).map(|index| sizes((m, &cuts), (tp, 1), Stage::new(index, pp), 1, &every).0).fold(0.0, f64::max)
}

/// One rank's memory by what holds it, in bytes (`ferrotron memory`).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RankMemory {
    pub rank: usize,
    /// What the forward reads (the compute copies, whole or a gathered unit) and the fp32 masters.
    pub weights_bytes: f64,
    /// Full gradients (under ZeRO-2/3 a unit's), and under ZeRO the averaged partitions' sums.
    pub grads_bytes: f64,
    /// AdamW's two moments.
    pub optimizer_bytes: f64,
    /// What the schedule keeps for backward at its peak, and the head's gradients then.
    pub activations_bytes: f64,
    /// Gradient buckets being filled or reduced, weight gathers in flight.
    pub comm_bytes: f64,
    pub total_bytes: f64,
    /// `--measure`: the most bytes the rank's tensors held at once in a training step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured_peak_bytes: Option<f64>,
}

/// Every rank's memory for `cfg`, estimated from the shapes (nothing is allocated), at the
/// busiest moment of a step: the first block backward (every activation still held); under ZeRO
/// also the second block backward (with the bucket the first filled), the end of a backward (the
/// partition sums and the buckets in flight) and, at ZeRO-1 and 2, the all-gather of the updated
/// weights after the optimizer — whichever holds most. Ranks that differ only in dp, cp or tp index hold the same; the
/// pipeline stage decides.
pub fn per_rank(cfg: &Config) -> Result<Vec<RankMemory>> {
    let grid = grid_of(&cfg.parallel)?;
    let stages = per_stage(cfg);
    Ok((0..grid.world_size()).map(|rank| RankMemory { rank, ..stages[grid.coords(rank).pp].clone() }).collect())
}

/// What a rank of each pipeline stage holds (`per_rank` without the grid: any number of ranks,
/// for `ferrotron plan`).
pub fn per_stage(cfg: &Config) -> Vec<RankMemory> {
    let (p, cuts) = (&cfg.parallel, one_layer(&cfg.model));
    (0..p.pp).map(|index| stage_memory(cfg, &cuts, schedules::stage_of(index, p))).collect()
}

/// Values of a rank of `stage` with `tp` tensor-parallel ranks: (whole, in ZeRO partitions over `z`
/// ranks, the largest FSDP unit a block backward may hold beside every activation (not the
/// embedding), the largest unit). Counted from one layer's tensors times the stage's layers, in
/// f64: any depth and any absurd size cost nothing and never overflow. Experts: 1/ep of them,
/// partitioned over z/ep ranks (the expert-data group).
fn sizes(
    (m, cuts): (&ModelConfig, &Cuts),
    (tp, ep): (usize, usize),
    stage: Stage,
    z: usize,
    counted: &Counted,
) -> (f64, f64, f64, f64) {
    // (values, values in partitions) of the embedding, of each block of the twin, of the head
    let (mut embed, mut layer, mut head) = ((0.0, 0.0), [(0.0, 0.0); 2], (0.0, 0.0));
    for (name, shape, on_tp) in cuts {
        if !counted(name, shape) {
            continue;
        }
        let on_tp = *on_tp;
        let n = shape.iter().map(|&x| x as f64).product::<f64>() / on_tp.parts(tp) as f64; // a copied KV head: whole on its rank
        let expert = moe::is_expert(name);
        let (n, z) = if expert { (n / ep as f64, (z / ep).max(1)) } else { (n, z) };
        let part = match name.as_str() {
            n if n.starts_with("model.layers.1.") => &mut layer[1],
            n if n.starts_with("model.layers.") => &mut layer[0],
            "model.embed_tokens.weight" => &mut embed,
            _ => &mut head, // the final norm and the output layer
        };
        *part = (part.0 + n, part.1 + (n / z as f64).ceil());
    }
    let counts = twin_counts(m, stage).map(|c| c as f64);
    let (first, last) = (stage.is_first() as u8 as f64, stage.is_last() as u8 as f64);
    // a tied model's last stage holds a copy of the first's embedding as its output layer
    let copy = if m.tie_word_embeddings && !stage.is_first() { last } else { 0.0 };
    let embeds = first + copy;
    let whole = counts[0] * layer[0].0 + counts[1] * layer[1].0 + embeds * embed.0 + last * head.0;
    let partitions = counts[0] * layer[0].1 + counts[1] * layer[1].1 + embeds * embed.1 + last * head.1;
    // the head gathers the embedding it shares when they are tied
    let head_unit = last * (head.0 + if m.tie_word_embeddings { embed.0 } else { 0.0 });
    let unit = (0..2).filter(|&j| counts[j] > 0.0).map(|j| layer[j].0).fold(head_unit, f64::max);
    (whole, partitions, unit, unit.max(first * embed.0))
}

/// A model's tensors as its one-layer twin's (name, whole shape, tp cut), which `sizes`
/// multiplies by a stage's layers. (A DeepSeekMoE with dense first layers has a two-layer twin:
/// a dense layer, then a MoE one: `twin_of`.)
pub type Cuts = Vec<(String, Vec<usize>, TpCut)>;

/// The model whose layers stand for every layer of `m`: one layer, or a dense and a MoE one.
fn twin(m: &ModelConfig) -> ModelConfig {
    let dense = m.deepseek_moe().map_or(0, |d| d.dense_below);
    let two = dense > 0 && dense < m.num_hidden_layers;
    let layers = if two { 2 } else { 1 };
    ModelConfig { num_hidden_layers: layers, first_k_dense_replace: dense.min(1), ..m.clone() }
}

/// Which layer of `m`'s twin stands for its layer `layer`.
pub fn twin_of(m: &ModelConfig, layer: usize) -> usize {
    usize::from(layer >= twin_boundary(m))
}

/// The first layer of `m` the twin's second layer stands for (`usize::MAX`: the twin has one).
fn twin_boundary(m: &ModelConfig) -> usize {
    let dense = m.deepseek_moe().map_or(0, |d| d.dense_below);
    if dense > 0 && dense < m.num_hidden_layers {
        dense
    } else {
        usize::MAX
    }
}

/// A layer of `m` that the twin's layer `j` stands for (its first).
fn stands_for(m: &ModelConfig, j: usize) -> usize {
    if j == 0 {
        0
    } else {
        twin_boundary(m).min(m.num_hidden_layers)
    }
}

/// How many of `stage`'s layers each layer of the twin stands for, counted by ranges: any depth
/// costs nothing.
fn twin_counts(m: &ModelConfig, stage: Stage) -> [usize; 2] {
    let boundary = twin_boundary(m);
    let mut counts = [0, 0];
    for r in stage.chunk_layers(m.num_hidden_layers) {
        let below = r.end.min(boundary).saturating_sub(r.start);
        counts[0] += below;
        counts[1] += r.len() - below;
    }
    counts
}

/// `m`'s one-layer twin's tensors, listed once a model on each thread (`ferrotron plan` asks for
/// the same model's under thousands of layouts; listing them builds a block).
pub fn one_layer(m: &ModelConfig) -> Rc<Cuts> {
    thread_local! {
        static LISTED: RefCell<Option<(ModelConfig, Rc<Cuts>)>> = const { RefCell::new(None) };
    }
    LISTED.with(|cell| {
        let mut cell = cell.borrow_mut();
        match &*cell {
            Some((model, cuts)) if model == m => cuts.clone(),
            _ => {
                let cuts = Rc::new(Llama::tensor_cuts(&twin(m), Stage::WHOLE));
                *cell = Some((m.clone(), cuts.clone()));
                cuts
            }
        }
    })
}

fn stage_memory(cfg: &Config, cuts: &Cuts, stage: Stage) -> RankMemory {
    let (t, p, dtype) = (&cfg.train, &cfg.parallel, cfg.device.compute_dtype());
    let e = if dtype == DType::Bf16 { 2.0 } else { 4.0 }; // bytes of a compute copy

    // the ranks that share the replicated state: all of dp×cp, or a shard group's (hybrid)
    let z = if p.dp_shard == 0 { p.dp } else { p.dp_shard } * p.cp;
    let zero = if z > 1 { p.zero_stage } else { 0 };
    let (whole, partitions, unit, any_unit) = sizes((&cfg.model, cuts), (p.tp, p.ep), stage, z, &every);
    // Muon keeps one momentum for each value of the blocks' matrices, where AdamW keeps two moments
    let muon: &Counted = &muon::updates;
    let (matrices, matrix_chunks, ..) = match t.optimizer {
        OptimizerKind::Adamw => (0.0, 0.0, 0.0, 0.0),
        OptimizerKind::Muon => sizes((&cfg.model, cuts), (p.tp, p.ep), stage, z, muon),
    };
    // the values of one bucket
    let bucket = (bucket_values(p.bucket_mb) as f64).min(z as f64 * partitions);
    // held all the time: fp32 masters (whole in mixed precision, or ZeRO's partitions), AdamW's two
    // moments (of 4 B, or 2 B in bf16 on a GPU: the CPU keeps bf16 values in f32), the compute
    // copies between uses (none under FSDP)
    let on_gpu = cfg.device.kind == crate::config::DeviceKind::Cuda;
    let moments = if on_gpu && t.optimizer_dtype.dtype() == DType::Bf16 { 4.0 } else { 8.0 };
    let (master, optimizer) = match zero {
        0 => (if dtype == DType::Bf16 { 4.0 * whole } else { 0.0 }, moments * (whole - matrices / 2.0)),
        _ => (4.0 * partitions, moments * (partitions - matrix_chunks / 2.0)),
    };
    let compute = if zero == 3 { e * unit } else { e * whole }; // FSDP: the unit gathered now
                                                                // FP8 GEMMs on a GPU: each FP8 weight's copy (2 bytes a value, both layouts), cast at its
                                                                // first GEMM after the optimizer wrote it and kept until the next write
    let fp8: &Counted = &|name, shape| shape.len() == 2 && precision::gemms(Precision::Fp8)(name) == Precision::Fp8;
    let fp8_weights = match Keep::of(cfg).fp8_copies {
        false => 0.0,
        true => {
            let (fp8_whole, _, fp8_unit, _) = sizes((&cfg.model, cuts), (p.tp, p.ep), stage, z, fp8);
            2.0 * if zero == 3 { fp8_unit } else { fp8_whole }
        }
    };

    // backward: what the schedule keeps, and the first block backward's gradients on top of it:
    // the MLP's (`mlp_bytes`), or after the MLP's cache went, the attention's (measured: rows ×
    // (3 attention widths per tp rank + 5 hidden widths)), with what that block recomputes; the
    // gradients being written, and the bucket filling (ZeRO-0 keeps a bucket per gradient); FSDP: the next
    // unit's gather in flight
    let rows = (t.micro_batch_size * t.seq_len / p.cp) as f64;
    let (d, v) = (cfg.model.hidden_size as f64, (cfg.model.vocab_size / p.tp) as f64);
    let (batch, seq, keep) = (t.micro_batch_size, t.seq_len / p.cp, Keep::of(cfg));
    let one = activation_bytes(&cfg.model, batch, seq, keep, stage, dtype);
    let counts = twin_counts(&cfg.model, stage);
    let (batch_f, seq_f) = (batch as f64, seq as f64);
    let kept_by = |i: usize| layer_bytes(&cfg.model, i, batch_f, seq_f, keep, e);
    // the backward of the micro-batch at hand frees its cache part by part: its peak is in the
    // head's backward (the logits' gradient beside the logits) or in the first block's (the
    // stage's last layer), after the head's cache went (what `activation_bytes` counts for the head)
    let head = one - (0..2).map(|j| counts[j] as f64 * kept_by(stands_for(&cfg.model, j)).0).sum::<f64>();
    let last = stage.chunk_layers(cfg.model.num_hidden_layers).last().map_or(0, |r| r.end.saturating_sub(1));
    let layer_again = kept_by(last).1;
    let split = rows / if p.sequence_parallel { p.tp as f64 } else { 1.0 };
    let (mlp_kept, mlp_backward) = mlp_bytes(&cfg.model, last, (rows, split), keep, e);
    // (on a GPU the attention's backward has scratch besides: δ, and on tensor cores the fp32
    // parts of dQ, dK and dV it adds up, `backward_scratch`)
    let m = &cfg.model;
    let heads = (m.num_attention_heads / p.tp, m.kv_heads_on(p.tp));
    let attn = Attn { batch, seq, kv_seq: seq, heads: heads.0, kv_heads: heads.1, head_dim: m.head_dim() };
    let scratch = if on_gpu { 4.0 * backward_scratch(dtype, attn) as f64 } else { 0.0 };
    let block = mlp_backward.max(rows * (3.0 * d / p.tp as f64 + 5.0 * d) * e - mlp_kept + scratch) + layer_again;
    // the head: backward's logits gradient beside the logits, or the fused loss's stripe of
    // logits and its gradient (in forward)
    let logits = if keep.loss_rows > 0 { 2.0 * (keep.loss_rows as f64).min(rows) } else { rows } * v * e;
    let now = (one + logits).max(one - head + block);
    let activations = one * (in_flight(cfg, stage, dtype) - 1.0) + now;
    // (ZeRO-2/3 with accumulation: the partition sums of the earlier micro-batches as well)
    // (a pipeline stage holding several micro-batches peaks in its first backward, before any)
    // ZeRO-2/3 reducing once a step hold every gradient whole until the last micro-batch, as ZeRO-1
    let each = zero >= 2 && p.zero_reduce == ZeroReduce::EveryMicroBatch;
    let sums =
        if each && t.grad_accum_steps > 1 && in_flight(cfg, stage, dtype) == 1.0 { 4.0 * partitions } else { 0.0 };
    let grads = sums + if each { 4.0 * unit } else { 4.0 * whole };
    // (ZeRO makes a bucket when its first gradient arrives: by then, on the last stage, the head's)
    let filling = if stage.is_last() { 4.0 * bucket } else { 0.0 };
    // FSDP: while the first unit of the backward computes, the next one's gather is in flight
    // (packed in fp32, arriving in the compute dtype), unless that unit is the stage's only one
    let has_next = stage.is_last() || stage.layer_count(cfg.model.num_hidden_layers) > 1;
    let prefetch = if has_next { e * unit + 4.0 * unit / z as f64 } else { 0.0 };
    let comm = match (p.dp_mode == DpMode::Bucketed && z > 1, zero) {
        (false, _) => 0.0,
        (true, 0) => 4.0 * whole,
        (true, 3) => filling + prefetch,
        (true, _) => filling,
    };
    let backward = RankMemory {
        weights_bytes: master + compute + fp8_weights,
        grads_bytes: grads,
        optimizer_bytes: optimizer,
        activations_bytes: activations,
        comm_bytes: comm,
        ..Default::default()
    };
    // ZeRO, a stage without the head: its second block backward has one block's cache less, but
    // the bucket its first block's gradients went into
    let second = RankMemory {
        activations_bytes: activations - (one - head) / (counts[0] + counts[1]).max(1) as f64,
        comm_bytes: comm + if stage.is_last() { 0.0 } else { 4.0 * bucket },
        ..backward.clone()
    };
    // ZeRO-1/2 after the optimizer: ZeRO-1's full gradients, and two groups of updated partitions
    // being gathered (packed in fp32, then in the compute dtype from every rank); the FP8 copies
    // went with the optimizer's writes
    let group = (bucket / z as f64).min(partitions);
    let groups_in_flight = if group < partitions { 2.0 } else { 1.0 };
    let gather = RankMemory {
        weights_bytes: master + compute,
        grads_bytes: if zero == 1 { 4.0 * whole } else { 0.0 },
        optimizer_bytes: optimizer,
        comm_bytes: groups_in_flight * group * (4.0 + e * z as f64),
        ..Default::default()
    };
    let total =
        |m: &RankMemory| m.weights_bytes + m.grads_bytes + m.optimizer_bytes + m.activations_bytes + m.comm_bytes;
    // ZeRO at the end of a backward: its activations gone (a pipeline stage still holds its other
    // micro-batches'), the last unit's gradients (the embedding's on the first stage), the partition
    // sums and the buckets still in flight
    let wire = p.reduce_dtype.dtype().size() as f64;
    let end = RankMemory {
        weights_bytes: master + compute + fp8_weights,
        grads_bytes: 4.0 * if zero >= 2 { any_unit } else { whole } + 4.0 * partitions,
        optimizer_bytes: optimizer,
        activations_bytes: one * (in_flight(cfg, stage, dtype) - 1.0),
        // (a bucket filling in f32, two in flight as `parallel.reduce_dtype` moves them)
        comm_bytes: (4.0 + 2.0 * wire) / 3.0 * (3.0 * bucket).min(z as f64 * partitions),
        ..Default::default()
    };
    let candidates = match zero {
        0 => vec![backward],
        3 => vec![backward, second, end],
        _ => vec![backward, second, end, gather],
    };
    let busiest = candidates.into_iter().max_by(|a, b| total(a).total_cmp(&total(b))).expect("one moment at least");
    RankMemory { total_bytes: total(&busiest), ..busiest }
}

/// What a rank's model and optimizer hold, counted from their tensors (`measured`, not estimated).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Held {
    /// Compute copies (whole or gathered) and fp32 masters (whole or ZeRO partitions).
    pub weights: usize,
    /// Full gradients and ZeRO's averaged partitions.
    pub grads: usize,
    /// AdamW's moments.
    pub optimizer: usize,
}

/// The bytes `model` and `optimizer` hold now.
pub fn held(model: &Llama, optimizer: &dyn Optimizer) -> Held {
    let params = model.params();
    let shards = params.iter().filter_map(|p| p.trained_part.as_ref());
    Held {
        weights: params.iter().map(|p| p.value.bytes()).sum::<usize>()
            + shards.clone().map(|s| s.values().bytes()).sum::<usize>(),
        grads: params.iter().map(|p| p.grad.bytes()).sum::<usize>() + shards.map(|s| s.grad().bytes()).sum::<usize>(),
        optimizer: optimizer.state().iter().flatten().map(|(_, t)| t.bytes()).sum(),
    }
}

/// Micro-batches pipeline stage `stage` holds activations for at once: the forwards before its
/// first backward, and the one that backward needs; with a zero-bubble schedule also those whose
/// W is still to come (what W reads, each GEMM's input and output gradient, is about what the
/// forward kept: counted as much). Without a pipeline, each micro-batch's backward follows its
/// forward: one. With model chunks, in micro-batches' worth of bytes: the chunks may differ (the
/// head's, a remainder layer) and which of them are held at the peak matters, so the schedule's
/// first rounds are walked, each chunk weighed by its bytes (after them the counts repeat).
fn in_flight(cfg: &Config, stage: Stage, dtype: DType) -> f64 {
    let (t, p) = (&cfg.train, &cfg.parallel);
    let (schedule, m, v) = (schedules::schedule_of(p.pp_schedule), t.grad_accum_steps, stage.chunks);
    if p.pp == 1 {
        return 1.0;
    }
    if v == 1 {
        return schedule.held(p.pp, stage.index, m, 1) as f64;
    }
    let (batch, seq, keep) = (t.micro_batch_size, t.seq_len / p.cp, Keep::of(cfg));
    let bytes: Vec<f64> =
        (0..v).map(|c| activation_bytes(&cfg.model, batch, seq, keep, stage.chunk(c), dtype)).collect();
    let held = |counts: &Vec<u32>| counts.iter().zip(&bytes).map(|(&n, b)| n as f64 * b).sum::<f64>();
    let peak = held_counts(p.pp_schedule, (p.pp, stage.index, m, v)).iter().map(held).fold(0.0, f64::max);
    peak / bytes.iter().sum::<f64>()
}

/// Micro-batches held, by chunk: each state a walk passes through; and which walk: (schedule,
/// [stages, this stage, micro-batches, chunks]).
type Counts = Vec<Vec<u32>>;
type Walk = (&'static str, [usize; 4]);

/// Every count of micro-batches held by chunk that stage `s` of a `pp`-stage pipeline of `m`
/// micro-batches and `v` chunks passes through in its schedule's first rounds (after them the
/// counts repeat), each once. A plan's search weighs the same pipeline's counts under many
/// layouts: walked once a pipeline on each thread.
fn held_counts(kind: PpSchedule, (pp, s, m, v): (usize, usize, usize, usize)) -> Rc<Counts> {
    thread_local! {
        static WALKED: RefCell<HashMap<Walk, Rc<Counts>>> =
            RefCell::new(HashMap::new());
    }
    let key = (kind.name(), [pp, s, m, v]);
    if let Some(known) = WALKED.with(|w| w.borrow().get(&key).cloned()) {
        return known;
    }
    let schedule = schedules::schedule_of(kind);
    let enough = schedule.warmup(pp, s, m, v) + 2 * pp * v; // forwards
    let (mut now, mut seen, mut forwards) = (vec![0u32; v], Vec::new(), 0);
    for a in schedule.actions(pp, s, m, v) {
        let c = a.work().chunk;
        match a {
            Action::Forward(_) if forwards == enough => break,
            Action::Forward(_) => (forwards, now[c]) = (forwards + 1, now[c] + 1),
            Action::InputGrad(_) => continue, // what it read stays for its W
            Action::Backward(_) | Action::Weights(_) => now[c] -= 1,
        }
        if !seen.contains(&now) {
            seen.push(now.clone());
        }
    }
    let seen = Rc::new(seen);
    WALKED.with(|w| w.borrow_mut().insert(key, seen.clone()));
    seen
}

/// What the busiest rank of `cfg` will hold, in bytes: (total, one line saying of what).
pub fn estimate(cfg: &Config) -> Result<(f64, String)> {
    let (t, p) = (&cfg.train, &cfg.parallel);
    let ranks = per_rank(cfg)?;
    let busiest = ranks.iter().max_by(|a, b| a.total_bytes.total_cmp(&b.total_bytes)).expect("a rank at least");
    let on_cpu = cfg.device.kind == crate::config::DeviceKind::Cpu;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    // each core's attention task holds one query tile's probabilities and their gradient
    let (rows, keys) = (QUERY_TILE.min(t.seq_len / p.cp) as f64, (t.seq_len / p.cp) as f64);
    let scores = if on_cpu { cores * 2.0 * rows * keys * 4.0 } else { 0.0 };
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let b = busiest;
    let what = format!(
        "{:.2} GiB weights, gradients and AdamW state + {:.2} GiB activations + {:.2} GiB buffers + {:.2} GiB attention scores",
        gib(b.weights_bytes + b.grads_bytes + b.optimizer_bytes),
        gib(b.activations_bytes),
        gib(b.comm_bytes),
        gib(scores)
    );
    Ok((b.total_bytes + scores, what))
}

/// Refuses `cfg` when its ranks cannot fit in `capacity`, with the numbers. `loaded` counts
/// weights read from a checkpoint or a pretrained model and kept in host memory.
pub fn check(cfg: &Config, capacity: &Capacity, loaded: f64) -> Result<f64> {
    let (per_rank, what) = estimate(cfg)?;
    let on_cpu = cfg.device.kind == crate::config::DeviceKind::Cpu;
    let need = per_rank * capacity.ranks as f64 + if on_cpu { loaded } else { 0.0 };
    if need > capacity.bytes || need.is_nan() {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        let loaded_note =
            if on_cpu && loaded > 0.0 { format!(" + {:.2} GiB loaded weights", gib(loaded)) } else { String::new() };
        bail!(
            "this run needs about {:.2} GiB but the {} is {:.2} GiB: per rank {what}, × {} rank(s){loaded_note}; make the model, micro_batch_size or seq_len smaller, or spread it over more tp/pp/cp ranks",
            gib(need),
            capacity.what,
            gib(capacity.bytes),
            capacity.ranks
        );
    }
    Ok(need)
}

/// glibc hands large freed blocks back to the kernel, and the next allocation maps fresh pages
/// that the kernel zero-fills one page fault at a time: every op output of a training step paid
/// that (about a quarter of the step on the tiny config). Freed memory is kept for reuse instead,
/// as PyTorch's CPU allocator does. Every thread allocates from the main heap (one arena): the
/// rank threads and rayon's workers would otherwise each get a heap of their own, which glibc
/// unmaps whole when it empties, trim threshold or not (37 MB of fresh pages a tiny step).
/// The binary and the tutorial steps call this once at start.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets three of glibc's allocator parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20); // blocks up to 32 MiB (glibc's maximum) from the heap
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX); // and the heap never shrinks
        libc::mallopt(libc::M_ARENA_MAX, 1); // one heap for every thread
    }
}
