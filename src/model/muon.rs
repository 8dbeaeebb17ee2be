//! # Muon: momentum made orthogonal, and the optimizer that needs the whole matrix
//!
//! AdamW treats a weight matrix as a bag of numbers: each one gets its own step size from its
//! own history. Muon (Jordan et al., 2024) treats it as what it is, a linear map. It keeps one
//! momentum M per matrix (as SGD does), and instead of stepping along M it steps along the
//! *orthogonal* matrix closest to it: with M = P·Σ·Qᵀ (its singular value decomposition), the
//! update is O = P·Qᵀ — every direction M moves the map in, moved by the same amount. A gradient
//! of a transformer's matrix is nearly low-rank: a few directions dominate and the rare ones
//! hardly move under AdamW or SGD. Orthogonalising gives the rare directions the same step, which
//! is why Muon often reaches AdamW's loss in fewer steps (step 23 measures how many, on its task).
//!
//! ```text
//! one Muon step of a matrix W [rows, cols], gradient G (already clipped):
//!   M ← μ·M + (1 − μ)·G                        momentum (elementwise, like AdamW's first moment)
//!   U ← (1 − μ)·G + μ·M   (Nesterov; else U = M)
//!   O ← NewtonSchulz₅(U)                        ≈ P·Qᵀ of U's SVD: needs the WHOLE matrix
//!   W ← W·(1 − lr·wd) − lr·√max(1, rows/cols)·O   (or 0.2·√max(rows, cols) to match AdamW's RMS)
//! ```
//! **Newton–Schulz.** An SVD per matrix per step would be slow on a GPU. Instead: scale U so its
//! largest singular value is at most 1 (divide by its Frobenius norm, which is ≥ it), then apply
//! the odd polynomial p(x) = a·x + b·x³ + c·x⁵ to its singular values five times. A polynomial in
//! X·Xᵀ acts on the singular values alone (X = PΣQᵀ → X·(XᵀX)ᵏ = P·Σ^(2k+1)·Qᵀ), and needs only
//! matrix products — the GEMMs a GPU is built for:
//!
//! ```text
//!   X ← U / ‖U‖_F;  5 times:  A = X·Xᵀ;  X ← a·X + (b·A + c·A²)·X      (a, b, c) = (3.4445, −4.7750, 2.0315)
//! ```
//! (for a tall U, the same on Uᵀ, so that A is the smaller Gram matrix). The coefficients are
//! chosen for speed, not accuracy: p has a steep slope at 0 (a = 3.4, so small singular values
//! grow fast) and maps [≈0.1, 1] into a band around 1 (about 0.7 to 1.2), not onto 1. So O is
//! *not* P·Qᵀ — its singular values wobble around 1 — and that is fine: the point is that no
//! direction is left out, not that every step is exactly equal (PyTorch's `torch.optim.Muon`,
//! nanochat and Megatron-LM use these same numbers).
//!
//! **What Muon updates.** The blocks' matrices: attention's and the MLP's projections (and each
//! expert's). The embedding, the output layer, the norms and a router stay with AdamW, as every
//! Muon recipe keeps them: an embedding row is a lookup, not a map, and a norm is a vector.
//!
//! **Why this lesson comes last.** Every lesson before relied on AdamW being elementwise: ZeRO
//! cuts the optimizer's state into flat partitions, tensor parallelism keeps a slice of each
//! matrix, and each rank updates what it holds. Newton–Schulz cannot work on a partition or a slice:
//! it needs the whole matrix. Here that is a seam, `WholeMatrices`: on one rank every piece *is*
//! the whole matrix (`Whole`); under data parallelism, ZeRO, FSDP and tensor parallelism
//! each matrix gets one owner that gathers its pieces, orthogonalises, and sends each rank its
//! piece of the result back (`parallel/muon_owners.rs`, where the cost of each layout is counted).
//! The momentum itself stays elementwise, so ZeRO keeps it in partitions as it keeps AdamW's moments.

use super::optimizer::{AdamW, Optimizer};
use super::Param;
use crate::config::{MuonAdjustLr, TrainConfig};
use crate::model::split::Whole;
use crate::ops::tensor::{Place, Tensor};
use crate::ops::{self, DType, Precision};
use anyhow::Result;

/// The quintic's coefficients (a, b, c): PyTorch's, nanochat's, Megatron's.
pub const NS_COEFFICIENTS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);

/// U is divided by max(‖U‖_F, this): a zero update stays zero.
const NS_EPS: f32 = 1e-7;

/// Whether Muon updates the parameter `name` of `shape`: a block's matrix that a linear layer
/// reads (attention's projections, latent attention's `kv_a_proj_with_mqa` among them, the MLP's,
/// an expert's), not the embedding, the output layer, a norm (a vector) or a router (`….gate`).
pub fn updates(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && name.starts_with("model.layers.") && !name.ends_with(".gate.weight")
}

/// The state a checkpoint saves for a parameter: Muon's momentum under PyTorch's name, or AdamW's
/// moments for the parameters AdamW updates.
pub fn state_names(name: &str, shape: &[usize]) -> &'static [&'static str] {
    if updates(name, shape) {
        &MOMENTUM
    } else {
        &AdamW::STATE
    }
}

const MOMENTUM: [&str; 1] = ["momentum_buffer"];

/// Newton–Schulz: `steps` iterations of the quintic on `u` [rows, cols] (f32, on its device),
/// from u/‖u‖_F; the result in f32. For a tall u the Gram matrix is taken the other way (XᵀX,
/// cols × cols), which is the same iteration run on uᵀ. The products run in the place's compute
/// dtype: f32 on the CPU and in an f32 GPU run, bf16 in a bf16 GPU run (cuBLAS GEMMs in bf16 with
/// fp32 accumulation, as PyTorch's Muon casts to bf16).
pub fn newton_schulz(u: &Tensor, steps: usize) -> Tensor {
    let (a, b, c) = NS_COEFFICIENTS;
    let ((rows, cols), place) = ((u.rows(), u.cols()), u.place());
    let dtype = place.dtype();
    let norm = ops::sum_squares_total(&[u], &place).to_vec()[0].sqrt(); // (on a GPU, a wait)
    let mut x = ops::convert(u, dtype); // a copy, in the compute dtype
    ops::scale(&mut x, 1.0 / norm.max(NS_EPS));
    let wide = rows <= cols;
    let f32 = Precision::F32; // (on a GPU the GEMM reads its tensors' dtype)
    for _ in 0..steps {
        // A = X·Xᵀ [rows, rows] (wide), or XᵀX [cols, cols] (tall; the weight-gradient GEMM,
        // which adds into an f32 tensor)
        let gram = if wide {
            ops::linear(&x, &x, f32)
        } else {
            let mut g = Tensor::zeros_on(&[cols, cols], &place, DType::F32);
            ops::linear_weight_grad(&x, &x, &mut g, f32);
            if dtype == DType::F32 {
                g
            } else {
                ops::convert(&g, dtype)
            }
        };
        // P = b·A + c·A·A (A is symmetric: A·A is A·A's GEMM either way)
        let mut poly = ops::linear_input_grad(&gram, &gram, f32);
        ops::scale(&mut poly, c);
        ops::add_scaled(&mut poly, gram, b);
        // X ← a·X + P·X (wide) or a·X + X·P (tall; P symmetric, so X·Pᵀ)
        let moved = if wide { ops::linear_input_grad(&poly, &x, f32) } else { ops::linear(&x, &poly, f32) };
        ops::scale(&mut x, a);
        ops::add_assign(&mut x, &moved);
    }
    if dtype == DType::F32 {
        x
    } else {
        ops::convert(&x, DType::F32)
    }
}

/// The factor Muon's rate is multiplied by for a matrix of `shape` (the whole matrix).
pub fn adjusted(adjust: MuonAdjustLr, shape: &[usize]) -> f32 {
    let (rows, cols) = (shape[0] as f32, shape[1] as f32);
    match adjust {
        MuonAdjustLr::Original => (rows / cols).max(1.0).sqrt(),
        MuonAdjustLr::MatchRmsAdamw => 0.2 * rows.max(cols).sqrt(),
        MuonAdjustLr::SpectralUnclamped => (rows / cols).sqrt(),
    }
}

/// The seam of this lesson: how a layout brings each matrix's update together for Newton–Schulz
/// and hands each rank its piece of the result.
pub trait WholeMatrices {
    /// `pieces[i]` is this rank's piece of the update of `params[i]` (shaped like its trained
    /// part: all of it on one rank, a ZeRO partition, a tp slice); `orthogonalise` turns a whole
    /// update [rows, cols] into what is applied. Returns this rank's piece of each result, shaped
    /// like its piece.
    fn each_whole(
        &mut self,
        params: &[&Param],
        pieces: Vec<Tensor>,
        orthogonalise: &dyn Fn(Tensor) -> Tensor,
    ) -> Result<Vec<Tensor>>;
}

/// One rank (`Whole`, the one-rank answer of every seam): every piece is the whole matrix.
impl WholeMatrices for Whole {
    fn each_whole(
        &mut self,
        params: &[&Param],
        pieces: Vec<Tensor>,
        f: &dyn Fn(Tensor) -> Tensor,
    ) -> Result<Vec<Tensor>> {
        let whole = |(u, p): (Tensor, &&Param)| -> Tensor {
            let piece = u.shape().to_vec();
            f(u.with_shape(p.shape())).with_shape(&piece)
        };
        Ok(pieces.into_iter().zip(params).map(whole).collect())
    }
}

/// Muon for the blocks' matrices, AdamW for every other parameter, both behind the optimizer
/// seam, so the step, ZeRO and checkpoints see one optimizer.
pub struct Muon<'g> {
    /// For each parameter in the model's order: whether Muon updates it (else AdamW).
    muon: Vec<bool>,
    /// One momentum per Muon matrix, shaped like its trained part (under ZeRO, its partition).
    momentum: Vec<Tensor>,
    /// AdamW over the other parameters.
    adamw: AdamW,
    /// What the momentum is kept in (`train.optimizer_dtype`).
    dtype: DType,
    settings: Settings,
    /// How the layout brings each matrix together (`Whole`, or `parallel/muon_owners.rs`).
    wholes: Box<dyn WholeMatrices + 'g>,
}

#[derive(Clone, Copy)]
struct Settings {
    /// `muon_lr / lr`: Muon's rate at a step is this times the schedule's.
    ratio: f32,
    momentum: f32,
    nesterov: bool,
    ns_steps: usize,
    adjust: MuonAdjustLr,
    weight_decay: f32,
}

impl<'g> Muon<'g> {
    /// Muon over `params`' matrices and AdamW over the rest, with `t`'s settings, the momentum
    /// zero next to the gradients; `wholes` as the layout gives it.
    pub fn new(params: &mut [&mut Param], t: &TrainConfig, wholes: Box<dyn WholeMatrices + 'g>) -> Muon<'g> {
        let muon: Vec<bool> = params.iter().map(|p| updates(&p.name, p.shape())).collect();
        let momentum: Vec<Tensor> =
            params.iter().zip(&muon).filter(|(_, &m)| m).map(|(p, _)| Tensor::zeros_like(p.trained_grad())).collect();
        let others: Vec<&mut Param> =
            params.iter_mut().zip(&muon).filter(|(_, &m)| !m).map(|(p, _)| &mut **p).collect();
        let settings = Settings {
            ratio: t.muon_lr / t.lr,
            momentum: t.muon_momentum,
            nesterov: t.muon_nesterov,
            ns_steps: t.muon_ns_steps,
            adjust: t.muon_adjust_lr,
            weight_decay: t.weight_decay,
        };
        let adamw = AdamW::new(&others, t);
        Muon { momentum, muon, adamw, dtype: DType::F32, settings, wholes }
    }

    /// Keeps the momentum (and AdamW's moments) in `dtype` from now on.
    pub fn keep_state_in(&mut self, dtype: DType) {
        self.adamw.keep_moments_in(dtype);
        if dtype != self.dtype {
            self.dtype = dtype;
            self.momentum.iter_mut().for_each(|m| *m = ops::convert(m, dtype));
        }
    }

    /// `params` split into Muon's and AdamW's, each in the model's order.
    fn split<'p>(&self, params: &'p mut [&mut Param]) -> (Vec<&'p mut Param>, Vec<&'p mut Param>) {
        let (mut mats, mut rest) = (Vec::new(), Vec::new());
        for (p, &m) in params.iter_mut().zip(&self.muon) {
            if m {
                mats.push(&mut **p)
            } else {
                rest.push(&mut **p)
            }
        }
        (mats, rest)
    }
}

impl Optimizer for Muon<'_> {
    fn step(&mut self, params: &mut [&mut Param], lr: f32, grad_scale: f32) -> Result<()> {
        let s = self.settings;
        let (mut mats, mut rest) = self.split(params);
        self.adamw.step(&mut rest, lr, grad_scale)?;
        // 1. the momentum and the update, elementwise on this rank's piece of each matrix
        let (mu, dtype) = (s.momentum, self.dtype);
        let mut pieces = Vec::with_capacity(mats.len());
        for (p, kept) in mats.iter().zip(&mut self.momentum) {
            let g = p.trained_grad();
            // M ← μ·M + (1 − μ)·G: in place in f32; a bf16 momentum is read into f32 first
            let mut m = match dtype {
                DType::F32 => std::mem::replace(kept, Tensor::zeros(&[0])),
                _ => ops::convert(kept, DType::F32),
            };
            ops::scale(&mut m, mu);
            ops::add_scaled(&mut m, g.clone(), (1.0 - mu) * grad_scale);
            pieces.push(match s.nesterov {
                true => {
                    let mut u = g.clone(); // U ← (1 − μ)·G + μ·M
                    ops::scale(&mut u, (1.0 - mu) * grad_scale);
                    ops::add_scaled(&mut u, m.clone(), mu);
                    u
                }
                false => m.clone(),
            });
            *kept = if dtype == DType::F32 { m } else { ops::convert(&m, dtype) };
            // bf16: rounded after use
        }
        // 2. each whole update orthogonalised, scaled for its shape (where the layout says)
        let orthogonalise = |u: Tensor| {
            let mut o = newton_schulz(&u, s.ns_steps);
            ops::scale(&mut o, adjusted(s.adjust, u.shape()));
            o
        };
        let refs: Vec<&Param> = mats.iter().map(|p| &**p).collect();
        let results = self.wholes.each_whole(&refs, pieces, &orthogonalise)?;
        // 3. W ← W·(1 − lr·wd) − lr·O, on this rank's piece
        let rate = lr * s.ratio;
        for (p, o) in mats.iter_mut().zip(results) {
            let (w, _) = p.trained();
            apply(w, o, 1.0 - rate * s.weight_decay, rate);
        }
        Ok(())
    }

    fn state(&self) -> Vec<Vec<(&'static str, &Tensor)>> {
        let (mut momentum, mut adamw) = (self.momentum.iter(), self.adamw.state().into_iter());
        let mut each = |m: bool| match m {
            true => vec![(MOMENTUM[0], momentum.next().expect("a momentum per matrix"))],
            false => adamw.next().expect("moments per other parameter"),
        };
        self.muon.iter().map(|&m| each(m)).collect()
    }

    fn state_mut(&mut self) -> Vec<Vec<&mut Tensor>> {
        let (mut momentum, mut adamw) = (self.momentum.iter_mut(), self.adamw.state_mut().into_iter());
        let mut each = |m: bool| match m {
            true => vec![momentum.next().expect("a momentum per matrix")],
            false => adamw.next().expect("moments per other parameter"),
        };
        self.muon.iter().map(|&m| each(m)).collect()
    }

    fn steps_taken(&self) -> u32 {
        self.adamw.steps_taken()
    }

    fn resume_at(&mut self, steps: u32) {
        self.adamw.resume_at(steps);
    }

    fn to_place(&mut self, place: &Place) {
        self.adamw.to_place(place);
        self.momentum.iter_mut().for_each(|m| *m = m.to_dtype(place, self.dtype));
    }
}

/// w ← w·keep − rate·o on a weight's trained values (a mixed-precision weight: its fp32 master,
/// then its bf16 copy written from it).
fn apply(w: &mut Tensor, o: Tensor, keep: f32, rate: f32) {
    let o = o.with_shape(w.shape());
    let step = |w: &mut Tensor| {
        ops::scale(w, keep);
        ops::add_scaled(w, o, -rate);
    };
    match w.master_copy() {
        None => step(w),
        Some(mut master) => {
            step(&mut master);
            w.write(&master.to_vec()); // the master and its bf16 copy (a wait for the GPU)
        }
    }
}
