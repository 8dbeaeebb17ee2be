//! # The composition root: which lessons' parts this rank's step is made of
//!
//! The step (`train/step.rs`) calls a model, gradient reducers and an optimizer through seams
//! that earlier lessons define; which part fills each seam is decided here, once, from the
//! config — the one place that names every lesson's part. Each seam, what picks its part, and
//! the lesson that teaches it:
//!
//! ```text
//! seam (where it is)                             config key → the part plugged in                  lesson
//! TensorSplit (src/model/split.rs:49)            parallel.tp → TensorParallel                      09
//!                                                parallel.sequence_parallel → SequenceParallel     10
//! SequenceSplit (src/model/split.rs:91)          parallel.cp, cp_mode → Ring | Ulysses             16, 17
//! WeightSplit (src/model/split.rs:158)           parallel.zero_stage = 3 → Fsdp                    07
//! LayerSplit (src/model/split.rs:171)            parallel.pp → a pipeline Stage                    12
//! Keeps (src/model/block.rs:394)                 train.recompute → Recompute                       19
//! LossHead (src/model/llama.rs:73)               train.loss_stripe_rows → FusedLoss                19
//! Attentions (src/model/block.rs:104)             the model's family (model/family.rs) → Gqa        01
//! Mlps (src/model/block.rs:269)                  model.num_local_experts, parallel.ep → Experts    20
//! MicroBatches (src/train/feed.rs:15)            --record/--replay-routing → TellTape              20
//! Optimizer (src/model/optimizer.rs:87)          train.optimizer → AdamW | Muon                    01, 23
//!                                                parallel.zero_stage = 1, 2 → GatherAfterUpdate    06
//! GradReduce (src/parallel/data_parallel.rs:62)  parallel.dp_mode, bucket_mb → DataParallel        04, 05
//!                                                parallel.zero_stage ≥ 2 → ZeroBuckets             06
//!                                                parallel.reduce_dtype → the buckets' wire format  06
//!                                                parallel.tp > KV heads → SharedKvGrads            09
//!                                                parallel.dp_shard → within SHARD, then REPLICATE  08
//!                                                parallel.ep → ExpertGrads                         20
//!                                                tied embeddings, parallel.pp → TiedEmbedding      12
//! Walk (src/parallel/pipeline_parallel.rs:130)   parallel.pp_schedule → Afab | OneFOneB | Listed   12–15
//! WholeMatrices (src/model/muon.rs:137)          train.optimizer = muon, sharded → Owners          23
//! Precision (src/ops/precision.rs:24)            device.dtype → f32 | bf16 | fp8                   21
//! ```
//! Where the weights come from (a checkpoint resumed, pretrained weights, the init) is
//! `train/run.rs`'s, with the run's checkpoints; the loop around the step is `train/driver.rs`'s.
//! Whether a gradient belongs to the experts or the dense model is decided here, once, as the
//! reducers are made (`Gradients::replicated_over`): the step hands each gradient to its reducer.

use super::agree;
use super::feed::{Feed, MicroBatches};
use super::gradients::{AxisOf, Gradients, NormAxis, NormGroups, Which};
use super::run::Shared;
use super::run::Summary;
use super::step::Trainer;
use crate::comm::launcher::Rank;
use crate::comm::process_grid::Axis;
use crate::config::{Config, CpMode, OptimizerKind};
use crate::data::Dataset;
use crate::model::fused_loss::FusedLoss;
use crate::model::moe::{ExpertSplit, Experts, EP, EXPERT_DP};
use crate::model::muon::{self, Muon, WholeMatrices};
use crate::model::optimizer::{self, AdamW, Optimizer, StateKinds};
use crate::model::routing_tape::{self, RoutingTape, TapeMode, Taped};
use crate::model::split::LayerSplit;
use crate::model::{Llama, Param, TensorSplit, Whole};
use crate::ops::tensor::Place;
use crate::parallel::context_parallel::{self, Ring};
use crate::parallel::data_parallel::{bucket_values, DataParallel, GradReduce};
use crate::parallel::expert_parallel::{ExpertGrads, ExpertParallel};
use crate::parallel::fsdp::Fsdp;
use crate::parallel::gather_formats;
use crate::parallel::hybrid_sharding::{self, REPLICATE, SHARD};
use crate::parallel::latent_tensor_parallel::LatentGradsOverTp;
use crate::parallel::layout;
use crate::parallel::muon_owners::Owners;
use crate::parallel::pipeline_parallel::StepPlan;
use crate::parallel::pipeline_tied::TiedEmbedding;
use crate::parallel::schedules;
use crate::parallel::sequence_parallel::{NormGradsOverTp, SequenceParallel};
use crate::parallel::shared_kv_heads::{self, SharedKvGrads};
use crate::parallel::tensor_parallel::TensorParallel;
use crate::parallel::ulysses::Ulysses;
use crate::parallel::zero::{self, GatherAfterUpdate, Sharding, ZeroBuckets};
use anyhow::Result;
use std::rc::Rc;

/// What a run keeps of the lessons' parts beside the trainer: a mixture of experts' shared
/// parts (whose rows the watch counts) and, debugging one, its routing tape (told when a step's
/// micro-batches are over, saved at the end). Nothing for a dense model.
pub(super) struct Beside<'g> {
    experts: Option<Rc<Experts<'g>>>,
    tape: Option<Rc<RoutingTape>>,
}

impl<'g> Beside<'g> {
    /// The experts' shared parts, for the rows each routed.
    pub fn experts(&self) -> Option<&Experts<'g>> {
        self.experts.as_deref()
    }

    /// The step's micro-batches are done: forwards until the next one (validation's) are not taped.
    pub fn step_done(&self) {
        self.tape.iter().for_each(|t| t.idle());
    }

    /// After a finished step: DeepSeekMoE's bias balancing (`Experts::balance`) over the loads of
    /// every rank that routed the step's other tokens.
    pub fn balance(&self, me: &Rank, cfg: &Config) -> Result<()> {
        let Some(experts) = &self.experts else { return Ok(()) };
        let mut groups = vec![me.group(Axis::DpCp)];
        if cfg.parallel.sequence_parallel {
            groups.push(me.group(Axis::Tp)); // each tp rank routed its own rows
        }
        experts.balance(&groups)
    }

    /// At the run's end: a recorded tape saved, a replayed one's count in `summary`.
    pub fn finish(&self, me: &Rank, cfg: &Config, summary: &mut Summary) -> Result<()> {
        if let Some(tape) = &self.tape {
            tape.save(me.rank, cfg)?;
            summary.routing_replaced = tape.replaced();
        }
        Ok(())
    }
}

/// Rank `me`'s trainer for `cfg`, from where `shared` says, and what the run keeps beside it.
pub(super) fn assemble<'g>(
    me: &'g Rank,
    cfg: &'g Config,
    data: &'g Dataset,
    routing_tape: Option<TapeMode>,
    shared: &Shared,
) -> Result<(Trainer<'g>, Beside<'g>)> {
    let (p, t, tp) = (&cfg.parallel, &cfg.train, me.group(Axis::Tp));
    if shared.spread {
        agree::settings(me.group(Axis::World), cfg, shared.facts(data))?; // processes started differently never train
    }
    // debugging a mixture of experts: its routing recorded, or replayed from another run
    let tape = routing_tape.map(|mode| RoutingTape::open(mode, cfg)).transpose()?;
    let experts = experts(me, cfg, tape.clone()); // a mixture of experts' shared parts
    let (mut model, first_step) = model(me, cfg, experts.as_ref(), shared)?; // this rank's part, on its device
                                                                             // ZeRO: each dp rank keeps 1/dp of the optimizer state (ZeRO-1), of the gradients (2), of
                                                                             // the weights (3); an expert, 1/(its expert-data ranks). Under hybrid sharding
                                                                             // (`parallel.dp_shard`) ZeRO works within the shard groups, replicated across them.
    let dense = if hybrid_sharding::is_hybrid(&me.grid) { SHARD.into() } else { Axis::DpCp };
    let sharding = Sharding::new(p.zero_stage, layout::replicas)
        .with(Axis::DpCp, (dense, me.group(dense)))
        .with(EXPERT_DP.into(), (EXPERT_DP.into(), me.group(EXPERT_DP)));
    // Muon's matrices whole for Newton–Schulz: each at one owner of the ranks holding its pieces
    let alone = [Axis::DpCp, Axis::Tp, EXPERT_DP.into()].iter().all(|&a| me.group(a).size() == 1);
    let wholes: Box<dyn WholeMatrices> = match alone {
        true => Box::new(Whole), // every matrix is whole here
        false => Box::new(Owners::new(me, &sharding, layout::replicas, &model.params())),
    };
    let mut optimizer = optimizer(&mut model, cfg, wholes);
    shared.resume_optimizer(&mut *optimizer, &model, tp)?;
    if sharding.any() {
        model = zero::shard(model, &mut *optimizer, &sharding, p.zero_stage);
        // each weight gathered as its GEMMs read it: bf16 on a bf16 GPU, FP8 where they read FP8
        let formats = gather_formats::for_model(&model);
        optimizer = match p.zero_stage {
            3 => {
                model = model.with_weight_split(Rc::new(Fsdp::new(sharding.clone(), formats))); // FSDP: unit by unit
                optimizer
            }
            // ZeRO-1, 2: after each update the whole weights are gathered back
            _ => {
                let bucket = bucket_values(p.bucket_mb);
                Box::new(GatherAfterUpdate { inner: optimizer, sharding: sharding.clone(), formats, bucket })
            }
        };
    }
    // each parameter's replicas' axis, once: dp×cp, or an expert's expert-data axis
    let axes_of = AxisOf::new(&model.params(), layout::replicas);
    let grads = gradients(me, cfg, &sharding, axes_of.clone(), (&model.params()[..], &model.param_chunks()[..]));
    let (pp, ep) = (me.group(Axis::Pp), me.group(EP));
    // the norm's parts: the dense weights', then the experts' (each ep rank holds other experts)
    let axes = vec![
        NormAxis { axis: Axis::DpCp, parts: sharding.on(Axis::DpCp), others: None },
        NormAxis { axis: EXPERT_DP.into(), parts: sharding.on(EXPERT_DP.into()), others: Some(ep) },
    ];
    // a tied model's last stage holds a copy of the embedding: the first stage counts it; a KV
    // head copied over tp ranks is counted at the first of them
    let mut copies: Vec<String> = model.tied_copy().map(|c| c.name.clone()).into_iter().collect();
    copies.extend(shared_kv_heads::later_copies(&model.params(), tp));
    let norm = NormGroups { axes_of, tp, pp, axes, copies };
    // what travels between pipeline stages: this rank's rows (of them, 1/tp with sequence
    // parallelism)
    let rows = t.micro_batch_size * t.seq_len / p.cp / if p.sequence_parallel { p.tp } else { 1 };
    let (kind, micro_batches, batch, stage) =
        (p.pp_schedule, t.grad_accum_steps, t.micro_batch_size, schedules::stage_of(pp.index(), p));
    // how a stage walks its schedule: AFAB and 1F1B as loops, the others as lists of actions
    let walk = schedules::walk_of(kind);
    let hidden = [rows, cfg.model.hidden_size];
    let pipeline = StepPlan { pp, walk, micro_batches, batch, stage, hidden };
    // what a rank reads of each sequence: with context parallelism, its cp positions
    let cp = me.group(Axis::Cp);
    let positions = context_parallel::positions(p.cp_split, cp.size(), cp.index(), t.seq_len);
    let feed = Feed::new(me, cfg, data, positions);
    // the routing tape is told each micro-batch's rows (this rank's of them with sequence
    // parallelism) before the micro-batch runs
    let feed: Box<dyn MicroBatches + 'g> = match &tape {
        Some(tape) => Box::new(TellTape { feed, tape: tape.clone(), cfg, me }),
        None => Box::new(feed),
    };
    let trainer = Trainer { cfg, me, model, optimizer, grads, norm, feed, pipeline, first_step };
    Ok((trainer, Beside { experts, tape }))
}

/// This rank's part of the model (its pipeline stage, its tp slices, its cp tokens, a mixture of
/// experts' layers as `experts` says), on its device, and the step to start from.
fn model<'g>(
    me: &'g Rank,
    cfg: &Config,
    experts: Option<&Rc<Experts<'g>>>,
    shared: &Shared,
) -> Result<(Llama<'g>, usize)> {
    let (t, p) = (&cfg.train, &cfg.parallel);
    let tp: Box<dyn TensorSplit> = match p.sequence_parallel {
        true => Box::new(SequenceParallel::new(me.group(Axis::Tp))),
        false => Box::new(TensorParallel::new(me.group(Axis::Tp))),
    };
    let (mut model, first_step) = shared.weights(cfg, tp, schedules::stage_of(me.coords.pp, p))?;
    model = model.with_recompute(t.recompute);
    if t.loss_stripe_rows > 0 {
        // the fused loss makes its gradient in forward, for the step's scale 1/m
        let scale = 1.0 / t.grad_accum_steps as f32;
        model = model.with_loss(Box::new(FusedLoss { rows: t.loss_stripe_rows, scale }));
    }
    model = model.with_gemms(crate::ops::precision::gemms(cfg.device.gemms()));
    if let Some(experts) = experts {
        // a mixture of experts: its layers made again of the same weights, where the run puts
        // the experts
        model = model.with_mlps(experts)?;
    }
    let cp = me.group(Axis::Cp);
    if cp.size() > 1 {
        let split = p.cp_split;
        model = match p.cp_mode {
            CpMode::Ring => model.with_sequence_split(Box::new(Ring { group: cp, split })),
            CpMode::Ulysses => model.with_sequence_split(Box::new(Ulysses { group: cp, split })),
        };
    }
    // on a GPU, the weights move there once; the training step is the same code
    model.to_place(&Place::for_rank(me.gpu.as_ref(), cfg.device.compute_dtype())?);
    Ok((model, first_step))
}

/// The optimizer over the model's parameters, fresh: AdamW, or Muon for the blocks' matrices with
/// AdamW for the rest (`wholes`: how the layout brings a matrix together).
fn optimizer<'g>(model: &mut Llama, cfg: &Config, wholes: Box<dyn WholeMatrices + 'g>) -> Box<dyn Optimizer + 'g> {
    let (t, dtype) = (&cfg.train, cfg.train.optimizer_dtype.dtype());
    match t.optimizer {
        OptimizerKind::Adamw => {
            let mut o = AdamW::new(&model.params_mut(), t); // moments made next to the gradients
            o.keep_moments_in(dtype);
            Box::new(o)
        }
        OptimizerKind::Muon => {
            let mut o = Muon::new(&mut model.params_mut(), t, wholes);
            o.keep_state_in(dtype);
            Box::new(o)
        }
    }
}

/// The names of the state the run's optimizer keeps per parameter (what its checkpoints hold).
pub(super) fn state_kinds(cfg: &Config) -> StateKinds {
    match cfg.train.optimizer {
        OptimizerKind::Adamw => optimizer::adamw_kinds,
        OptimizerKind::Muon => muon::state_names,
    }
}

/// The feed, with the routing tape told each micro-batch's rows before it runs.
struct TellTape<'g> {
    feed: Feed<'g>,
    tape: Rc<RoutingTape>,
    cfg: &'g Config,
    me: &'g Rank,
}

impl MicroBatches for TellTape<'_> {
    fn micro_batch(&self, step: usize, micro: usize) -> Result<(Vec<u32>, Vec<i32>)> {
        let (p, me) = (&self.cfg.parallel, self.me);
        let tp = me.group(Axis::Tp);
        let sp = p.sequence_parallel.then(|| (tp.index(), tp.size()));
        let rows = routing_tape::batch_rows(self.cfg, step, (me.coords.dp, micro), self.feed.positions(), sp);
        self.tape.at(step, rows);
        self.feed.micro_batch(step, micro)
    }
}

/// A mixture of experts' shared parts on this rank (`None` for a dense model): its experts
/// divided over the ep group (expert parallelism) or all here, and, debugging it, its routing
/// recorded or replayed from another run (the routing tape around the split).
fn experts<'g>(me: &'g Rank, cfg: &Config, tape: Option<Rc<RoutingTape>>) -> Option<Rc<Experts<'g>>> {
    if cfg.model.num_local_experts == 0 {
        return None;
    }
    let split: Box<dyn ExpertSplit + 'g> = match cfg.parallel.ep {
        1 => Box::new(Whole),
        _ => Box::new(ExpertParallel::new(me.group(EP))),
    };
    let split = match tape {
        Some(tape) => Box::new(Taped { inner: split, tape }),
        None => split,
    };
    Some(Experts::new(&cfg.model, split, cfg.train.seq_len)) // a training sequence: the sequence-wise loss's unit
}

/// Each gradient's way (`train/gradients.rs`): a reducer per axis that replicates parameters —
/// data parallelism's all-reduce, or where ZeRO shards that axis its reduce-scatter (under hybrid
/// sharding, within a shard group, then averaged across the replicate group); the experts' then
/// divided by ep — and with sequence parallelism the norms' sum over tp after them (without it,
/// latent attention's latent path's).
fn gradients<'g>(
    me: &'g Rank,
    cfg: &Config,
    sharding: &Sharding<'g>,
    axes_of: AxisOf,
    all: (&[&Param], &[usize]),
) -> Gradients<'g> {
    let (p, mut grads) = (&cfg.parallel, Gradients::new(axes_of));
    for axis in [Axis::DpCp, EXPERT_DP.into()] {
        let (params, chunks) = grads.replicated_over(all, axis);
        let list = (&params[..], &chunks[..]);
        let reducer: Box<dyn GradReduce> = match sharding.on(axis) {
            Some(group) => {
                let hybrid = axis == Axis::DpCp && hybrid_sharding::is_hybrid(&me.grid);
                let then = hybrid.then(|| hybrid_sharding::average_across(me.group(REPLICATE)));
                let zero = ZeroBuckets::new((group, then), list, p.bucket_mb, (p.zero_stage, p.zero_reduce));
                Box::new(zero.moving(p.reduce_dtype.dtype()))
            }
            None => {
                Box::new(DataParallel::new(me.group(axis), list, p.dp_mode, p.bucket_mb).moving(p.reduce_dtype.dtype()))
            }
        };
        let reducer = match axis {
            Axis::Cut(EXPERT_DP) => Box::new(ExpertGrads { inner: reducer, ep: me.group(EP).size() }),
            _ => reducer,
        };
        grads.add(Which::Replicas(axis), reducer);
    }
    if p.sequence_parallel {
        grads.add(Which::Every, Box::new(NormGradsOverTp(me.group(Axis::Tp))));
    } else if cfg.model.kv_lora_rank > 0 && p.tp > 1 {
        // latent attention's replicated latent path: partial gradients, summed over tp
        grads.add(Which::Every, Box::new(LatentGradsOverTp(me.group(Axis::Tp))));
    }
    // KV heads fewer than the tp ranks: each copy's gradient is its ranks' part, added up over tp
    let tp = me.group(Axis::Tp);
    if all.0.iter().any(|p| p.tp.copies(tp.size()) > 1) {
        grads.add(Which::Every, Box::new(SharedKvGrads(tp)));
    }
    // a tied embedding on two stages (the first's embedding, the last's output layer): their
    // gradients swapped and summed; a stage holding both, or neither, has nothing to swap
    let pp = me.group(Axis::Pp);
    let ends = |i| (schedules::stage_of(i, p).has_embedding(), schedules::stage_of(i, p).has_head());
    let (embedding, head) = ends(pp.index());
    if cfg.model.tie_word_embeddings && embedding != head {
        let peer = (0..pp.size()).find(|&i| ends(i) == (head, embedding)).expect("a pipeline has both ends");
        grads.add(Which::Every, Box::new(TiedEmbedding { pp, peer }));
    }
    grads
}
