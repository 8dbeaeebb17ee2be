//! # Validation: the loss on data the run never trains on
//!
//! Every `validation.every` steps (and after the last), the model is evaluated on held-out
//! sequences: for the synthetic source, stream indices no training step reaches; for text, the
//! last `validation.split` of the token file, which training then never reads (`data/mod.rs`).
//! Beside the training loss it answers the question the training loss cannot: is the model
//! learning the language, or its training sequences? While both fall together it is the first;
//! when the validation loss stops falling, or rises, while the training loss goes on down, the
//! model is overfitting.
//!
//! It is the same number under every layout, so that runs compare: the whole model is gathered
//! onto rank 0 as a checkpoint is (`checkpoint/save.rs`, weights only), and rank 0 alone runs the
//! held-out batches through it, with no tensor, pipeline or context parallelism — what one rank
//! would compute from these weights. The other ranks wait at their next collective, their
//! timeout paused as for a checkpoint. Gathering costs a checkpoint's traffic: validate every
//! hundred steps, not every step. A signal ends it at the next micro-batch (`train/stop.rs`).
//! A sample (`sample.rs`) due after the same step uses the same gathered model.

use super::sample;
use crate::checkpoint::hf::build_from;
use crate::checkpoint::save::{self, Gather};
use crate::comm::launcher::Rank;
use crate::comm::process_grid::Axis;
use crate::config::Config;
use crate::data::Dataset;
use crate::model::optimizer::Optimizer;
use crate::model::stage::Stage;
use crate::model::{Llama, Whole};
use anyhow::Result;
use std::collections::HashMap;

/// Is there a validation after step `step`?
fn due(cfg: &Config, step: usize) -> bool {
    let every = cfg.validation.every;
    every > 0 && ((step + 1).is_multiple_of(every) || step + 1 == cfg.train.steps)
}

/// After step `step`, what is due of the two: the mean loss over the held-out batches, and a
/// sample continuing `prompt` (`sample.rs`), both on rank 0 (`None` on the others) from the whole
/// model, gathered once. Every rank calls it.
pub(super) fn after_step(
    me: &Rank,
    (cfg, data): (&Config, &Dataset),
    step: usize,
    (model, optimizer): (&Llama, &dyn Optimizer),
    prompt: Option<&[u32]>,
) -> Result<(Option<f32>, Option<String>)> {
    let prompt = prompt.filter(|_| sample::due(cfg, step));
    if !due(cfg, step) && prompt.is_none() {
        return Ok((None, None));
    }
    let Some(state) = save::gather(me, cfg, model, optimizer, Gather::Weights)? else {
        return Ok((None, None));
    };
    me.group(Axis::World).while_others_wait(|| {
        let weights: HashMap<_, _> = state.weights.into_iter().collect();
        // the language model's loss alone: a mixture of experts' balance loss is a training aid
        let m = crate::config::ModelConfig { router_aux_loss_coef: 0.0, ..cfg.model.clone() };
        let mut whole = build_from(&weights, &m, Box::new(Whole), Stage::WHOLE, "the gathered weights")?;
        whole.to_place(&model.place()); // rank 0's device, in its dtype
        let loss = match due(cfg, step) {
            true => held_out_loss(cfg, data, &mut whole)?,
            false => None,
        };
        let sample = prompt.map(|p| sample::sample(cfg, data, &mut whole, p)).transpose()?.flatten();
        Ok((loss, sample))
    })
}

/// The mean loss of `whole` over the held-out batches; `None` when a signal cut it short.
fn held_out_loss(cfg: &Config, data: &Dataset, whole: &mut Llama) -> Result<Option<f32>> {
    // batches of the global batch's size, whatever the layout, run micro-batch by micro-batch
    let (t, len) = (&cfg.train, cfg.train.seq_len + 1);
    let runs = cfg.validation.batches * t.grad_accum_steps * cfg.parallel.dp;
    let mut sum = 0.0;
    for r in 0..runs {
        if let Some(sig) = crate::signals::received() {
            // a signal ends validation at the next micro-batch: the run then stops after
            // this step, as it would without one, and this step has no held-out loss
            crate::say!("validation cut short by {} after {r} of {runs} micro-batches", crate::signals::name(sig));
            return Ok(None);
        }
        let (tokens, targets) = data.held_out_rows((r * t.micro_batch_size) as u64, t.micro_batch_size, len)?;
        sum += whole.forward(&tokens, t.micro_batch_size, &targets)? as f64;
        // on a GPU, a wait
    }
    Ok(Some((sum / runs as f64) as f32)) // every micro-batch has as many tokens
}
