//! DeepSeek-V3's multi-head latent attention (`model/latent_attention.rs`) in training: every
//! layout follows the single-rank curve (tensor parallelism with and without sequence
//! parallelism, context parallelism's ring, zigzag and Ulysses, data parallelism and ZeRO, the
//! pipeline, recomputation), and the settings it cannot take are refused in one line naming the
//! key. Its numbers against transformers are
//! `tests/hf_parity.rs`'s (`mla_dense`, `mla_q_latent`); its KV cache, `tests/generate.rs`'s.

mod common;

use ferrotron::commands::converge::{self, parse_variants};
use ferrotron::config::Config;

/// The small model with latent attention: 4 heads of an 8 + 4 wide query/key and a 6 wide value
/// (narrower: the core pads it), its query through a latent of 12.
const MLA: &[&str] = &[
    "model.num_key_value_heads=4",
    "model.kv_lora_rank=16",
    "model.q_lora_rank=12",
    "model.qk_nope_head_dim=4",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=6",
];

/// Every layout here is within 5e-7 of one rank; a query turned by its rank's own positions
/// instead of the sequence's (a bug only cp shows) parts by 2e-4 to 9e-4 within 30 steps.
const TOLERANCE: f32 = 1e-5;

fn sets(extra: &[&str]) -> Vec<String> {
    let run = ["train.micro_batch_size=4", "train.grad_accum_steps=2", "train.steps=30", "train.warmup_steps=4"];
    common::SMALL.iter().chain(MLA).chain(&run).chain(extra).map(|s| s.to_string()).collect()
}

#[test]
fn every_layout_follows_the_single_rank_curve() {
    let spec = "tp=2;tp=4;tp=2,sequence_parallel=true;cp=2;cp=2,cp_split=contiguous;cp=2,cp_mode=ulysses;\
                dp=2,zero_stage=3;tp=2,dp=2,zero_stage=2;pp=2;dp=2,cp=2,pp=2;tp=2,cp=2;recompute=selective;recompute=full";
    let converge::Report { baseline, outcomes, .. } =
        converge::converge(None, &sets(&[]), &parse_variants(spec).unwrap(), TOLERANCE).unwrap();
    assert!(baseline[29] < baseline[0] - 0.5, "the baseline learns: {baseline:?}");
    for o in &outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

/// The split-half RoPE layout and a value wider than the query/key head (the query and key are
/// padded, the query scaled), under the ring.
#[test]
fn split_half_rope_and_wide_values_follow_too() {
    let base = sets(&["model.rope_interleave=false", "model.v_head_dim=20", "model.q_lora_rank=0"]);
    let report = converge::converge(None, &base, &parse_variants("cp=2;dp=2;tp=2").unwrap(), TOLERANCE).unwrap();
    for o in &report.outcomes {
        assert!(o.pass, "{}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

/// YaRN's rescaled rotation (its frequencies and cos/sin factor, the softmax's mscale²) under the
/// ring, where each rank turns its own positions, and Muon, which now updates
/// `kv_a_proj_with_mqa` too (a replicated matrix under tp, its gradient summed there first).
#[test]
fn yarn_under_the_ring_and_muon_on_the_latent_path_follow_too() {
    let yarn = [
        "model.rope_scaling.rope_type=\"yarn\"",
        "model.rope_scaling.factor=4",
        "model.rope_scaling.original_max_position_embeddings=16",
        "model.rope_scaling.mscale_all_dim=1",
    ];
    let report = converge::converge(None, &sets(&yarn), &parse_variants("cp=2;tp=2").unwrap(), TOLERANCE).unwrap();
    for o in &report.outcomes {
        assert!(o.pass, "YaRN, {}: max |Δloss| {:e}", o.label, o.max_diff);
    }
    let muon = sets(&["train.optimizer=\"muon\"", "train.steps=12"]);
    let report =
        converge::converge(None, &muon, &parse_variants("tp=2;dp=2,zero_stage=2;pp=2").unwrap(), 1e-4).unwrap();
    for o in &report.outcomes {
        assert!(o.pass, "Muon, {}: max |Δloss| {:e}", o.label, o.max_diff);
    }
}

#[test]
fn what_it_cannot_take_is_refused_naming_the_key() {
    let refused = |extra: &[&str], want: &str| {
        let e = format!("{:#}", Config::load(None, &sets(extra)).unwrap_err());
        assert!(e.contains(want), "{extra:?}: {e}");
    };
    refused(&["model.num_key_value_heads=2"], "model.num_key_value_heads = 2 with model.kv_lora_rank > 0");
    refused(&["model.qk_rope_head_dim=3"], "model.qk_rope_head_dim = 3 must be even");
    refused(&["model.v_head_dim=0"], "model.v_head_dim = 0 with model.kv_lora_rank > 0");
    refused(&["model.head_dim=6"], "model.head_dim = 6 with model.kv_lora_rank > 0");
    refused(&["model.kv_lora_rank=0"], "with model.kv_lora_rank = 0: it is a width of latent attention");
}

/// The ring passes each block's latent and shared rotated key (kv_lora_rank + r = 24 values a
/// token here), not the heads' keys and values made from them (2 × 4 heads × D = 12: 96): per
/// layer and micro-batch, cp − 1 hops of blocks forward, cp − 1 again in the backward, which makes
/// each block's heads again where it lands, and cp hops of the blocks' gradients. Passing the
/// expanded heads instead sends 4 times the bytes; one hop too few or too many, another count.
#[test]
fn the_ring_passes_the_latent_not_the_heads() {
    let (cp, seq, batch, accum, layers, token) = (4u64, 64u64, 4u64, 2u64, 2u64, 16 + 8);
    let cfg = Config::load(None, &sets(&["parallel.cp=4", "train.seq_len=64", "train.steps=1"])).unwrap();
    let summary =
        ferrotron::train::train(&cfg, ferrotron::train::Options { quiet: true, ..Default::default() }).unwrap();
    let p2p: u64 = summary
        .comm
        .iter()
        .filter(|t| t.axis == "cp" && t.call == ferrotron::comm::cost::Call::P2p)
        .map(|t| t.tally.bytes)
        .sum();
    let block = batch * (seq / cp) * token * 4; // f32 on the CPU
    assert_eq!(p2p, layers * accum * (3 * cp - 2) * block, "cp p2p bytes");
}
