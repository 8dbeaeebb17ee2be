//! # The composition root: which lessons' parts this rank's step is made of
//!
//! The step (`train.rs`) calls a model, gradient reducers and an optimizer; what they are is
//! decided here, once, from the config — the one place that names every lesson's part:
//!
//! ```text
//! the model        this rank's part, on its device; tp, sp, cp and the experts' splits are
//!                  plugged in where the weights are made (`train/run.rs`, `model/split.rs`;
//!                  the experts, where expert parallelism and the routing tape put them: `experts`)
//! ZeRO             1/dp of the optimizer state (stage 1), of the gradients (2), of the weights
//!                  (3, FSDP: a `WeightSplit` gathering whole weights unit by unit)
//! gradients        one reducer per axis that replicates parameters (`train/gradients.rs`)
//! the norm         the groups the gradient norm sums over
//! Muon's owners    where each matrix is whole for Newton–Schulz (`parallel/muon_owners.rs`)
//! ```

use super::agree;
use super::feed::{Feed, Told};
use super::gradients::{Gradients, NormAxis, NormGroups, Which};
use super::run::Shared;
use super::step::Trainer;
use crate::comm::launcher::Rank;
use crate::comm::process_grid::Axis;
use crate::config::{Config, ParallelConfig};
use crate::data::Dataset;
use crate::model::moe::{ExpertSplit, Experts, EP, EXPERT_DP};
use crate::model::muon::{OneRank, WholeMatrices};
use crate::model::routing_tape::{self, RoutingTape, Taped};
use crate::model::{Param, Whole};
use crate::parallel::context_parallel;
use crate::parallel::data_parallel::{bucket_values, DataParallel, GradReduce};
use crate::parallel::expert_parallel::{ExpertGrads, ExpertParallel};
use crate::parallel::fsdp::Fsdp;
use crate::parallel::gather_formats;
use crate::parallel::hybrid_sharding::{self, REPLICATE, SHARD};
use crate::parallel::layout;
use crate::parallel::muon_owners::Owners;
use crate::parallel::pipeline_parallel::StepPlan;
use crate::parallel::schedules;
use crate::parallel::sequence_parallel::NormGradsOverTp;
use crate::parallel::zero::{self, GatherAfterUpdate, Sharding, ZeroBuckets};
use anyhow::Result;
use std::rc::Rc;

impl<'g> Trainer<'g> {
    /// Rank `me`'s model, optimizer and reducers for `cfg`, from where `shared` says.
    pub(super) fn assemble(
        me: &'g Rank,
        cfg: &'g Config,
        data: &'g Dataset,
        (tape, experts): (Option<Rc<RoutingTape>>, Option<&Rc<Experts<'g>>>),
        shared: &Shared,
    ) -> Result<Trainer<'g>> {
        let (p, t, tp) = (&cfg.parallel, &cfg.train, me.group(Axis::Tp));
        if shared.spread {
            agree::settings(me.group(Axis::World), cfg, shared.facts(data))?; // processes started differently never train
        }
        let (mut model, first_step) = shared.model(me, cfg, experts)?; // this rank's part, on its device
                                                                       // ZeRO: each dp rank keeps 1/dp of the optimizer state (stage 1), of the gradients (2), of
                                                                       // the weights (3); an expert, 1/(its expert-data ranks). Under hybrid sharding
                                                                       // (`parallel.dp_shard`) ZeRO works within the shard groups, replicated across them.
        let dense = if hybrid_sharding::is_hybrid(&me.grid) { SHARD.into() } else { Axis::DpCp };
        let sharding = Sharding::new(p.zero_stage, layout::replicas)
            .with(Axis::DpCp, (dense, me.group(dense)))
            .with(EXPERT_DP.into(), (EXPERT_DP.into(), me.group(EXPERT_DP)));
        // Muon's matrices whole for Newton–Schulz: each at one owner of the ranks holding its pieces
        let alone = [Axis::DpCp, Axis::Tp, EXPERT_DP.into()].iter().all(|&a| me.group(a).size() == 1);
        let wholes: Box<dyn WholeMatrices> = match alone {
            true => Box::new(OneRank), // every matrix is whole here
            false => Box::new(Owners::new(me, &sharding, layout::replicas, &model.params())),
        };
        let mut optimizer = shared.optimizer(&mut model, tp, cfg, wholes)?;
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
        let grads = gradients(me, p, &sharding, (&model.params()[..], &model.param_chunks()[..]));
        let (pp, ep) = (me.group(Axis::Pp), me.group(EP));
        // the norm's parts: the dense weights', then the experts' (each ep rank holds other experts)
        let axes = vec![
            NormAxis { axis: Axis::DpCp, parts: sharding.on(Axis::DpCp), others: None },
            NormAxis { axis: EXPERT_DP.into(), parts: sharding.on(EXPERT_DP.into()), others: Some(ep) },
        ];
        let norm = NormGroups { replicas: layout::replicas, tp, pp, axes };
        // what travels between pipeline stages: this rank's rows (of them, 1/tp with sequence
        // parallelism)
        let rows = t.micro_batch_size * t.seq_len / p.cp / if p.sequence_parallel { p.tp } else { 1 };
        let (kind, micro_batches, batch, stage) =
            (p.pp_schedule, t.grad_accum_steps, t.micro_batch_size, schedules::stage_of(pp.index(), p));
        // how a stage walks its schedule: AFAB and 1F1B as loops, the others as lists of actions
        let walk = schedules::walk_of(kind);
        let hidden = [rows, cfg.model.hidden_size];
        let pipeline = StepPlan { pp, walk, micro_batches, batch, stage, hidden };
        // the routing tape is told each micro-batch's rows (this rank's of them with sequence
        // parallelism) before the micro-batch runs
        let told = tape.map(|tape| -> Told<'g> {
            let sp = p.sequence_parallel.then(|| (tp.index(), tp.size()));
            Box::new(move |step, micro, pos| {
                tape.at(step, routing_tape::batch_rows(cfg, step, (me.coords.dp, micro), pos, sp))
            })
        });
        // what a rank reads of each sequence: with context parallelism, its cp positions
        let cp = me.group(Axis::Cp);
        let positions = context_parallel::positions(p.cp_split, cp.size(), cp.index(), t.seq_len);
        let feed = Feed::new(me, cfg, data, positions, told);
        Ok(Trainer { cfg, model, optimizer, grads, norm, feed, pipeline, first_step })
    }
}

/// A mixture of experts' shared parts on this rank (`None` for a dense model): its experts
/// divided over the ep group (expert parallelism) or all here, and, debugging it, its routing
/// recorded or replayed from another run (the routing tape around the split).
pub(super) fn experts<'g>(me: &'g Rank, cfg: &Config, tape: Option<Rc<RoutingTape>>) -> Option<Rc<Experts<'g>>> {
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
    Some(Experts::new(&cfg.model, split))
}

/// Each gradient's way (`train/gradients.rs`): a reducer per axis that replicates parameters —
/// data parallelism's all-reduce, or where ZeRO shards that axis its reduce-scatter (under hybrid
/// sharding, within a shard group, then averaged across the replicate group); the experts' then
/// divided by ep — and with sequence parallelism the norms' sum over tp after them.
fn gradients<'g>(
    me: &'g Rank,
    p: &ParallelConfig,
    sharding: &Sharding<'g>,
    all: (&[&Param], &[usize]),
) -> Gradients<'g> {
    let mut grads = Gradients::new(layout::replicas);
    for axis in [Axis::DpCp, EXPERT_DP.into()] {
        let (params, chunks) = grads.replicated_over(all, axis);
        let list = (&params[..], &chunks[..]);
        let reducer: Box<dyn GradReduce> = match sharding.on(axis) {
            Some(group) => {
                let hybrid = axis == Axis::DpCp && hybrid_sharding::is_hybrid(&me.grid);
                let then = hybrid.then(|| hybrid_sharding::average_across(me.group(REPLICATE)));
                Box::new(ZeroBuckets::new((group, then), list, p.bucket_mb, p.zero_stage))
            }
            None => Box::new(DataParallel::new(me.group(axis), list, p.dp_mode, p.bucket_mb)),
        };
        let reducer = match axis {
            Axis::Cut(EXPERT_DP) => Box::new(ExpertGrads { inner: reducer, ep: me.group(EP).size() }),
            _ => reducer,
        };
        grads.add(Which::Replicas(axis), reducer);
    }
    if p.sequence_parallel {
        grads.add(Which::Every, Box::new(NormGradsOverTp(me.group(Axis::Tp))));
    }
    grads
}
