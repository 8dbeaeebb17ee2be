//! # Mixed precision: what a linear layer's GEMMs read
//!
//! A GEMM may read its operands as they are (f32), rounded to bf16 (mixed precision: on a GPU its
//! bf16 tensors, emulated on the CPU by rounding the operands and the output), or scaled and cast
//! to FP8 (`ops/fp8.rs`, tutorial step 21: E4M3 values, E5M2 gradients, bf16 output). The ops
//! (`ops::linear` and its two backward halves) ask a `Precision` how to read each operand and how
//! to write the output; the model asks each weight's (`Param::precision`), which the run sets
//! (`Llama::with_gemms`). Master weights, gradients and the optimizer stay f32 in every one.
//!
//! ```text
//!              x, W read as     dy read as     output     the products
//! F32          f32              f32            f32        summed as they come
//! Bf16         bf16             bf16           bf16       summed as they come (f32 sums)
//! Fp8          E4M3 · s         E5M2 · s       bf16       multiplied back by 1/(s_a·s_b)
//! ```

use crate::ops::fp8::{scale_for, Fp8};
use rayon::prelude::*;
use std::borrow::Cow;

/// What a linear layer's GEMMs read (`device.dtype`): f32 as it is; bf16; or FP8 with per-tensor
/// current scaling.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Precision {
    F32,
    Bf16,
    Fp8,
}

/// How one operand enters a GEMM of a linear layer: as it is, rounded to bf16, or scaled and
/// cast to an FP8 format.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Cast {
    None,
    Bf16,
    Fp8(Fp8),
}

impl Precision {
    /// How a run names it: "f32", "bf16" (on the CPU: its GEMMs' rounding, emulated) or "bf16
    /// with FP8 GEMMs".
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "bf16 with FP8 GEMMs",
        }
    }

    /// How this precision reads x and W (forward, and W again in backward).
    pub fn values(self) -> Cast {
        match self {
            Precision::F32 => Cast::None,
            Precision::Bf16 => Cast::Bf16,
            Precision::Fp8 => Cast::Fp8(Fp8::E4M3),
        }
    }

    /// How this precision reads output gradients dy.
    pub fn gradients(self) -> Cast {
        match self {
            Precision::Fp8 => Cast::Fp8(Fp8::E5M2),
            other => other.values(),
        }
    }

    /// A GEMM output as a GPU of this precision writes it (bf16 in both mixed precisions), from
    /// the f32 sums of the cast operands, multiplied back by `descale`.
    pub fn output(self, mut y: Vec<f32>, descale: f32) -> Vec<f32> {
        if self != Precision::F32 {
            y.iter_mut().for_each(|v| *v = half::bf16::from_f32(*v * descale).to_f32());
        }
        y
    }

    /// Are its GEMMs' products multiplied back by the operands' scales (FP8), rather than
    /// summed as they come (accumulated in place, on a GPU by the GEMM itself)?
    pub fn scaled(self) -> bool {
        self == Precision::Fp8
    }
}

/// What each weight's GEMMs read (by its name) in a run whose GEMMs read `run` (`device.dtype`;
/// `Llama::with_gemms` takes it): under FP8 the output layer (and the embedding when it is tied
/// to it) and a mixture of experts' router stay in bf16 — the logits feed the softmax and the
/// router's scores a discrete top-k, where an FP8 rounding costs most; every other weight reads
/// `run`.
pub fn gemms(run: Precision) -> impl Fn(&str) -> Precision {
    move |name| {
        let bf16 = ["lm_head.weight", "embed_tokens.weight", "block_sparse_moe.gate.weight", "mlp.gate.weight"];
        match run {
            Precision::Fp8 if bf16.iter().any(|s| name.ends_with(s)) => Precision::Bf16,
            _ => run,
        }
    }
}

/// `values` as a GEMM reads them under `cast`: (the numbers, the factor that multiplies their
/// products back: 1/s for an FP8 cast with scale s, else 1).
pub fn cast(values: &[f32], cast: Cast) -> (Cow<'_, [f32]>, f32) {
    match cast {
        Cast::None => (Cow::Borrowed(values), 1.0),
        Cast::Bf16 => (Cow::Owned(values.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect()), 1.0),
        Cast::Fp8(f) => {
            // a pass over the tensor for its amax (∞ if any is not finite), then the cast; on
            // the rayon threads, as a GPU runs both as kernels
            let amax = values.par_iter().map(|v| if v.is_finite() { v.abs() } else { f32::INFINITY });
            let s = scale_for(amax.reduce(|| 0.0, f32::max), f);
            (Cow::Owned(values.par_iter().map(|&v| f.round(v * s)).collect()), 1.0 / s)
        }
    }
}
