//! Step 25 — multi-head latent attention (DeepSeek-V3's): every head's key and value from one
//! small latent per token. `cargo run --release --example step25`

#[macro_use]
#[path = "../common.rs"]
mod common;

use anyhow::Result;
use ferrotron::config::Config;
use ferrotron::train::{train, train_all, Options, Summary};

/// What one token leaves in one layer's KV cache, in values, where each of `kv_heads` keeps a
/// key `qk` wide and a value `v` wide.
fn cache_values(kv_heads: usize, (qk, v): (usize, usize)) -> usize {
    kv_heads * (qk + v)
}

/// The mean of a run's step times after its first.
fn step_ms(s: &Summary) -> f64 {
    1e3 * s.step_s.iter().skip(1).sum::<f64>() / (s.step_s.len().max(2) - 1) as f64
}

fn run(tiny: bool) -> Result<()> {
    // a token's cache, per layer: DeepSeek-V3 (128 heads of a 192-wide key and a 128-wide value,
    // made from a latent of 512 and one rotated key of 64) against the same heads without the
    // latent, and against Llama 3 70B's grouped-query attention (8 KV heads of 128)
    let (mha, mla, gqa) = (cache_values(128, (192, 128)), 512 + 64, cache_values(8, (128, 128)));
    println!("a token's KV cache per layer: DeepSeek-V3's latent {mla} values, its 128 heads' keys and values {mha} ({:.0}×), Llama 3 70B's 8 KV heads {gqa}", mha as f64 / mla as f64);
    // the tiny model with latent attention: 8 heads (each its own key and value), a query/key
    // head of 16 + 8 rotated, a value of 16, the keys and values from a latent of 32
    let mla = [
        "model.num_key_value_heads=8",
        "model.kv_lora_rank=32",
        "model.qk_nope_head_dim=16",
        "model.qk_rope_head_dim=8",
        "model.v_head_dim=16",
        "train.micro_batch_size=8",
    ];
    let quiet = Options { quiet: true, ..Default::default() };
    let gqa_cfg = common::config(tiny, &["train.micro_batch_size=8"])?;
    let mla_cfg = common::config(tiny, &mla)?;
    let (a, b) = (train(&gqa_cfg, quiet)?, train(&mla_cfg, quiet)?);
    for (name, cfg, s) in [("GQA (4 KV heads of 16)", &gqa_cfg, &a), ("MLA (latent 32 + 8)", &mla_cfg, &b)] {
        println!(
            "{name:<24} {:>7} weights, step {:>6.1} ms, final loss {:.4}",
            cfg.model.parameter_count(),
            step_ms(s),
            s.losses.last().copied().unwrap_or(f32::NAN)
        );
    }
    // the same model cut over ranks: the heads over tp (the latent path replicated, its gradients
    // summed), the sequence over cp (a ring of the expanded keys and values)
    for layout in [&["parallel.tp=2"][..], &["parallel.tp=2", "parallel.sequence_parallel=true"], &["parallel.cp=2"]] {
        let cfg: Config = common::config(tiny, &[&mla[..], layout].concat())?;
        let ranks = train_all(&cfg, quiet)?;
        common::follows(
            &format!("{} follows the single-device curve", layout.join(" ")),
            &ranks[0].losses,
            &cfg,
            1e-4,
        )?;
    }
    Ok(())
}

step!(run);
