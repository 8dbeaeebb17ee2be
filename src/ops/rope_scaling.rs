//! # RoPE for a longer context than the one trained on: linear, YaRN and Llama 3's frequencies
//!
//! RoPE turns pair i of a head by position · ωᵢ, ωᵢ = θ^(−2i/d): pair 0 once per 2π tokens, the
//! last pair (d = 64, θ = 10⁴) about once per 47 000 tokens. A model trained on L tokens has seen
//! every pair's angles only up to L·ωᵢ; a position beyond L turns the slow pairs to angles it
//! never saw. The cure is to slow those pairs down by the context's `factor` s, so that s·L
//! tokens turn them no further than L did — and to leave the fast pairs alone, which already
//! went round many times and carry the fine, local order of tokens.
//!
//! - **linear** (position interpolation): every ωᵢ / s. Simple, but it blurs the fast pairs too.
//! - **YaRN** (Peng et al. 2023; DeepSeek-V3 and Kimi K2 train with it): by how many turns
//!   rᵢ = L·ωᵢ/2π a pair makes over the trained context, pairs with rᵢ > `beta_fast` (32) keep ωᵢ,
//!   pairs with rᵢ < `beta_slow` (1) take ωᵢ / s, and a linear ramp in i joins them. Its
//!   ends are the pairs that make exactly β turns, iᵦ = d·ln(L / 2πβ) / (2 ln θ), rounded
//!   outwards (`truncate`). Slower pairs flatten the softmax at long range, so cos and sin are
//!   both multiplied by an attention factor (0.1·ln s + 1, or the ratio of two such with
//!   `mscale` and `mscale_all_dim`): q·k grows by its square.
//! - **Llama 3** (`llama3`): by wavelength λᵢ = 2π/ωᵢ against L: λ > L/`low_freq_factor` takes
//!   ωᵢ / s, λ < L/`high_freq_factor` keeps ωᵢ, and between the two ω is interpolated
//!   smoothly in L/λ.
//!
//! DeepSeek's latent attention also multiplies its softmax scale by
//! (0.1·`mscale_all_dim`·ln s + 1)² (`softmax_factor`); with V3's `mscale` = `mscale_all_dim` = 1
//! the cos/sin factor is 1 and that is all YaRN changes in its logits' size.
//!
//! Everything here is made once on the host, in f64: the frequencies and the cos/sin factor the
//! rotation (`ops::rope`, its CPU loop and `kernels/rope.cu`'s table) reads. Transformers makes
//! the same numbers in f32 (`modeling_rope_utils.py`, whose rules for absent keys
//! `checkpoint/hf.rs` follows).

use crate::config::{RopeScaling, RopeType};
use crate::ops::types::Rope;
use std::f64::consts::PI;

/// The rotation of heads `head_dim` wide (MLA: its rotated part) with base θ, rescaled as
/// `scaling` says.
pub fn rope_of(theta: f64, scaling: &RopeScaling, head_dim: usize) -> Rope {
    let plain = Rope::plain(theta, head_dim);
    let s = scaling.factor;
    match scaling.rope_type {
        RopeType::Default => plain,
        RopeType::Linear => Rope { inv_freq: plain.inv_freq.iter().map(|w| w / s).collect(), scale: 1.0 },
        RopeType::Yarn => yarn(theta, scaling, plain),
        RopeType::Llama3 => llama3(scaling, plain),
    }
}

/// YaRN's attention factor for a context `s` times longer, with its `mscale` term.
fn yarn_mscale(s: f64, mscale: f64) -> f64 {
    if s <= 1.0 {
        1.0
    } else {
        0.1 * mscale * s.ln() + 1.0
    }
}

fn yarn(theta: f64, c: &RopeScaling, plain: Rope) -> Rope {
    let (s, d) = (c.factor, plain.head_dim() as f64);
    let scale = match (c.attention_factor, c.mscale, c.mscale_all_dim) {
        (given, _, _) if given > 0.0 => given,
        (_, m, all) if m != 0.0 && all != 0.0 => yarn_mscale(s, m) / yarn_mscale(s, all),
        _ => yarn_mscale(s, 1.0),
    };
    // the pair that makes `turns` turns over the trained context
    let pair_of =
        |turns: f64| d * (c.original_max_position_embeddings as f64 / (turns * 2.0 * PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (pair_of(c.beta_fast), pair_of(c.beta_slow));
    if c.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
    if low == high {
        high += 0.001; // one pair: a step, not a division by zero
    }
    let inv_freq = plain
        .inv_freq
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0); // 0: kept, 1: divided by s
            w / s * ramp + w * (1.0 - ramp)
        })
        .collect();
    Rope { inv_freq, scale }
}

fn llama3(c: &RopeScaling, plain: Rope) -> Rope {
    let (s, l) = (c.factor, c.original_max_position_embeddings as f64);
    let (low, high) = (c.low_freq_factor, c.high_freq_factor);
    let inv_freq = plain
        .inv_freq
        .iter()
        .map(|&w| {
            let wavelength = 2.0 * PI / w;
            if wavelength > l / low {
                w / s
            } else if wavelength < l / high {
                w
            } else {
                let smooth = (l / wavelength - low) / (high - low);
                (1.0 - smooth) * w / s + smooth * w
            }
        })
        .collect();
    Rope { inv_freq, scale: 1.0 }
}

/// What DeepSeek's latent attention multiplies its softmax scale by under a rescaled RoPE
/// (transformers' `yarn_apply_mscale`): (0.1·`mscale_all_dim`·ln s + 1)², 1 without it.
pub fn softmax_factor(scaling: &RopeScaling) -> f64 {
    match scaling.rope_type {
        RopeType::Default => 1.0,
        _ if scaling.mscale_all_dim == 0.0 => 1.0,
        _ => yarn_mscale(scaling.factor, scaling.mscale_all_dim).powi(2),
    }
}
