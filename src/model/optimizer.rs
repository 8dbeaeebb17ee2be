//! # The optimizer: AdamW, global gradient-norm clipping, warmup + cosine schedule
//!
//! ```text
//! lr │   ╱‾‾‾‾‾‾╲_
//!    │  ╱          ‾╲_
//!    │ ╱               ‾‾‾──── min_lr
//!    └─────────────────────────── step
//!     warmup     cosine decay
//! ```
//! One step: measure the global gradient norm (the √ of Σ over *all* parameters of Σ g²; when
//! the model is cut across ranks, its parts add up over their groups first:
//! `train/gradients.rs`), scale every
//! gradient down if the norm exceeds `grad_clip`, then update each parameter with AdamW. Weight
//! decay is decoupled (applied to the weight, not added to the gradient) and skips norm weights.
//! Under ZeRO (`parallel/zero.rs`) all of this runs on this rank's partition of each parameter
//! (`Param::trained`): its master values, its averaged gradient, its moments.
//!
//! The step sees the update only through the `Optimizer` trait (the seam): AdamW is its first
//! implementation, and a later optimizer — or a wrapper, as ZeRO-1 and 2 wrap AdamW with the
//! gather of the updated weights (`parallel/zero.rs`) — plugs in at the composition root
//! (`train/compose.rs`) without the step changing.

use crate::config::TrainConfig;
use crate::model::Param;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::DType;
use crate::ops::{self, AdamWSettings};
use anyhow::Result;

/// Learning rate at `step` (0-based): linear warmup to `lr`, then cosine down to `min_lr` at the
/// last step.
pub fn lr_at(t: &TrainConfig, step: usize) -> f32 {
    if step < t.warmup_steps {
        return t.lr * (step + 1) as f32 / t.warmup_steps as f32;
    }
    let decay_steps = t.steps.saturating_sub(t.warmup_steps).saturating_sub(1).max(1);
    let progress = ((step - t.warmup_steps) as f32 / decay_steps as f32).min(1.0);
    t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + (std::f32::consts::PI * progress).cos())
}

/// What the optimizer updates of a parameter, and with which gradient: its trained part where a
/// later lesson keeps one apart (ZeRO: this rank's partition of the master), else the weight itself
/// (a mixed-precision weight: its fp32 master) and its gradient.
impl Param {
    pub fn trained(&mut self) -> (&mut Tensor, &mut Tensor) {
        match &mut self.trained_part {
            Some(part) => part.trained(),
            None => (&mut self.value, &mut self.grad),
        }
    }

    /// The values `trained` updates.
    pub fn trained_values(&self) -> &Tensor {
        self.trained_part.as_ref().map_or(&self.value, |part| part.values())
    }

    /// The gradient `trained` reads.
    pub fn trained_grad(&self) -> &Tensor {
        self.trained_part.as_ref().map_or(&self.grad, |part| part.grad())
    }
}

/// Σ g² over the given gradients (on a GPU, a wait for it).
pub fn grad_sum_squares(params: &[&mut Param]) -> f64 {
    let grads: Vec<&Tensor> = params.iter().map(|p| p.trained_grad()).collect();
    let place = params.first().map_or(Place::Cpu, |p| p.place());
    ops::sum_squares_total(&grads, &place).to_vec()[0] as f64
}

/// The factor that brings the gradients' global norm `norm` down to `max_norm` (1 when it is
/// within, or clipping is off). It is not applied here: AdamW multiplies each gradient by it as
/// it reads it (`AdamW::grad_scale`), which saves a pass over every gradient.
pub fn clip_factor(norm: f64, max_norm: f32) -> f32 {
    if max_norm <= 0.0 || norm <= max_norm as f64 {
        return 1.0;
    }
    (max_norm as f64 / (norm + 1e-6)) as f32
}

/// The optimizer seam: all the step, ZeRO, checkpoints and `ferrotron memory` ask of an
/// optimizer. AdamW (below) is the first; another plugs in by implementing this in a file of its
/// own and being chosen by the composition root (`train/compose.rs`), and neither the step nor
/// ZeRO's lesson changes. Its state is laid out like the parameters it updates: one list of
/// tensors per parameter, each shaped like the parameter's trained part, so that ZeRO keeps each
/// rank's partition of every one as it keeps the master's (which assumes an update reads a gradient
/// value by value, as AdamW's does).
pub trait Optimizer {
    /// One update of every parameter of `params` (each its trained part: `Param::trained`) at
    /// learning rate `lr`, each gradient multiplied by `grad_scale` (clipping) as it is read.
    fn step(&mut self, params: &mut [&mut Param], lr: f32, grad_scale: f32) -> Result<()>;
    /// What it keeps, per parameter in `params`' order: each tensor with the name a checkpoint
    /// saves it under (`exp_avg.<parameter>`). What `ferrotron memory` counts for it.
    fn state(&self) -> Vec<Vec<(&'static str, &Tensor)>>;
    /// The same tensors, to replace: ZeRO's partitions, a resumed checkpoint's.
    fn state_mut(&mut self) -> Vec<Vec<&mut Tensor>>;
    /// Updates made so far (a checkpoint keeps the count), and resuming at `steps`.
    fn steps_taken(&self) -> u32;
    fn resume_at(&mut self, steps: u32);
    /// Moves the state next to the parameters, to `place` (a resumed one is read on the host).
    fn to_place(&mut self, place: &Place);
}

/// The names of the state an optimizer keeps for the parameter `name` of (whole) `shape`, in
/// `Optimizer::state`'s order: what a checkpoint holds for it, known before any parameter is made
/// (a checkpoint is checked against it before anything is built).
pub type StateKinds = fn(&str, &[usize]) -> &'static [&'static str];

/// AdamW keeps the same two moments for every parameter.
pub fn adamw_kinds(_: &str, _: &[usize]) -> &'static [&'static str] {
    &AdamW::STATE
}

/// AdamW: one pair of moments per parameter, fp32 or bf16 (`keep_moments_in`).
pub struct AdamW {
    moments: Vec<(Tensor, Tensor)>,
    step: u32,
    /// What the moments are kept in (on the CPU: f32 holding bf16 values).
    dtype: DType,
    /// The run's betas, ε and weight decay.
    settings: (f32, f32, f32, f32),
}

impl AdamW {
    /// Its state's names, as a checkpoint's `optimizer.safetensors` holds them (`exp_avg.<name>`).
    pub const STATE: [&'static str; 2] = ["exp_avg", "exp_avg_sq"];

    /// AdamW for `params`, its moments zero next to their gradients, with `t`'s settings.
    pub fn new(params: &[&mut Param], t: &TrainConfig) -> AdamW {
        let moments = params
            .iter()
            .map(|p| (Tensor::zeros_like(p.trained_grad()), Tensor::zeros_like(p.trained_grad())))
            .collect();
        AdamW { moments, step: 0, dtype: DType::F32, settings: (t.beta1, t.beta2, t.adam_eps, t.weight_decay) }
    }

    /// Keeps the moments in `dtype` from now on: bf16 halves the optimizer's memory (on a GPU;
    /// the CPU keeps bf16 values in f32), at the cost of rounding them after every update.
    pub fn keep_moments_in(&mut self, dtype: DType) {
        if dtype == self.dtype {
            return; // they are already
        }
        self.dtype = dtype;
        for (m, v) in &mut self.moments {
            (*m, *v) = (ops::convert(m, dtype), ops::convert(v, dtype));
        }
    }
}

impl Optimizer for AdamW {
    /// One AdamW step of every parameter (on a GPU, a launch per 64 parameters).
    fn step(&mut self, params: &mut [&mut Param], lr: f32, grad_scale: f32) -> Result<()> {
        self.step += 1;
        let (beta1, beta2, eps, decay) = self.settings;
        let mut steps = Vec::with_capacity(params.len());
        for (p, (m, v)) in params.iter_mut().zip(&mut self.moments) {
            let weight_decay = if p.decays() { decay } else { 0.0 };
            let (step, moments) = (self.step, self.dtype);
            let o = AdamWSettings { lr, beta1, beta2, eps, weight_decay, step, grad_scale, moments };
            let (weight, grad) = p.trained();
            steps.push((o, weight, &*grad, m, v));
        }
        ops::adamw(&mut steps);
        Ok(())
    }

    fn state(&self) -> Vec<Vec<(&'static str, &Tensor)>> {
        self.moments.iter().map(|(m, v)| vec![(Self::STATE[0], m), (Self::STATE[1], v)]).collect()
    }

    fn state_mut(&mut self) -> Vec<Vec<&mut Tensor>> {
        self.moments.iter_mut().map(|(m, v)| vec![m, v]).collect()
    }

    fn steps_taken(&self) -> u32 {
        self.step
    }

    fn resume_at(&mut self, steps: u32) {
        self.step = steps;
    }

    fn to_place(&mut self, place: &Place) {
        for (m, v) in &mut self.moments {
            (*m, *v) = (m.to_dtype(place, self.dtype), v.to_dtype(place, self.dtype));
        }
    }
}
