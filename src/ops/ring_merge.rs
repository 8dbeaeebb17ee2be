//! # Merging partial attentions (lesson 16, the ring)
//!
//! Context parallelism computes a query block's attention one key block at a time, as the key
//! blocks come round the ring (`parallel/context_parallel.rs`). Each block gives a partial
//! output and the log-sum-exp of its scores; two partials of the same queries merge exactly:
//!
//! ```text
//! lse = log(e^lse_a + e^lse_b)
//! out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b
//! ```
//! so the ring's result is the one attention over every key would give (up to rounding). A row
//! that saw no key of a block (lse_b = −∞) is left as it was.

use super::tensor::Tensor;
use super::types::Attn;
use super::{fatal, gpu};

/// Folds one block's attention (`block_out`, `block_lse`) into the running (`out`, `lse`).
pub fn attention_merge(a: Attn, (out, lse): (&mut Tensor, &mut Tensor), block_out: &Tensor, block_lse: &Tensor) {
    out.written();
    lse.written();
    if let Some(d) = gpu("attention merge", &[out, lse, block_out, block_lse]) {
        return fatal("attention merge", d.attention_merge(a, (out, lse), (block_out, block_lse)));
    }
    merge_on_cpu(&a, out.host_mut(), lse.host_mut(), block_out.host(), block_lse.host());
}

/// The merge on the CPU: one (batch, head, query) row at a time, the numerically stable
/// log(e^a + e^b) = max + log1p(e^−|a − b|).
fn merge_on_cpu(sh: &Attn, out: &mut [f32], lse: &mut [f32], block_out: &[f32], block_lse: &[f32]) {
    let (t, hd) = (sh.seq, sh.head_dim);
    for (bh, (l, &bl)) in lse.iter_mut().zip(block_lse).enumerate() {
        if bl == f32::NEG_INFINITY {
            continue; // the block adds nothing to this row
        }
        let (b, h, i) = (bh / (sh.heads * t), bh / t % sh.heads, bh % t);
        let merged = if *l == f32::NEG_INFINITY { bl } else { l.max(bl) + (-(*l - bl).abs()).exp().ln_1p() };
        let (keep, add) = ((*l - merged).exp(), (bl - merged).exp());
        let at = (b * t + i) * sh.heads * hd + h * hd;
        for (o, &x) in out[at..at + hd].iter_mut().zip(&block_out[at..at + hd]) {
            *o = *o * keep + x * add;
        }
        *l = merged;
    }
}
