//! Foreign keys understood or refused: every key of transformers' own `LlamaConfig`,
//! `MixtralConfig`, `DeepseekV3Config` and `GenerationConfig` (`tests/fixtures/config_keys.json`, written by
//! `tests/fixtures/make_config_keys.py` from transformers' classes) is one that ferrotron reads,
//! refuses away from its default, or knows to be no part of the math (`checkpoint::hf::keys`); a
//! key transformers adds in a later release fails this test until it is placed. The refusals are
//! tried: each math-changing value is one line naming its key, and a "default" RoPE in one place
//! does not hide a "llama3" scaling in another (it was run as plain RoPE before).

use ferrotron::checkpoint::hf::{keys, read_hf_config};
use ferrotron::config::RopeType;
use std::path::Path;

#[test]
fn every_key_of_transformers_config_classes_is_placed() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/config_keys.json");
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture).unwrap()).unwrap();
    let placed: Vec<&str> = [keys::READ, keys::REFUSED_UNLESS_DEFAULT, keys::NOT_MATH].concat();
    let mut unplaced = Vec::new();
    for class in ["llama", "mixtral", "deepseek_v3"] {
        let listed = j[class].as_array().unwrap();
        assert!(listed.len() > 30, "{class}: {} keys", listed.len());
        unplaced.extend(listed.iter().map(|k| k.as_str().unwrap()).filter(|k| !placed.contains(k)));
    }
    assert!(unplaced.is_empty(), "keys of transformers {} ferrotron has not placed: {unplaced:?}", j["transformers"]);
    // and every key of transformers' GenerationConfig: read, noted as not applied, or not decoding
    use ferrotron::commands::generate::decoding_keys;
    let decoding: Vec<&str> = [decoding_keys::READ, decoding_keys::NOT_APPLIED, decoding_keys::NOT_DECODING].concat();
    let listed = j["generation"].as_array().unwrap();
    assert!(listed.len() > 60, "generation: {} keys", listed.len());
    let unplaced: Vec<&str> = listed.iter().map(|k| k.as_str().unwrap()).filter(|k| !decoding.contains(k)).collect();
    assert!(
        unplaced.is_empty(),
        "generation_config keys of transformers {} not placed: {unplaced:?}",
        j["transformers"]
    );
    let mut once = decoding.clone();
    once.sort();
    once.dedup();
    assert_eq!(once.len(), decoding.len(), "a generation key is in two lists");
    // a key placed twice would have two meanings
    let mut all = placed.clone();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), placed.len(), "a key is in two lists");
    // the config.json ferrotron writes holds only keys it reads or knows: a Mixtral's, and a
    // DeepSeek-V3's (latent attention and DeepSeekMoE)
    let deepseek = "model.num_key_value_heads=8 model.kv_lora_rank=32 model.q_lora_rank=24 model.qk_nope_head_dim=16 \
                    model.qk_rope_head_dim=8 model.v_head_dim=16 model.moe_intermediate_size=32 model.n_shared_experts=1 \
                    model.first_k_dense_replace=1 model.n_group=2";
    let experts = "model.num_local_experts=4 model.num_experts_per_tok=2";
    for sets in [experts.to_string(), format!("{experts} {deepseek}")] {
        let sets: Vec<String> = sets.split_whitespace().map(String::from).collect();
        let cfg = ferrotron::config::Config::load(None, &sets).unwrap();
        let written: serde_json::Value =
            serde_json::from_str(&ferrotron::checkpoint::save::hf_config(&cfg.model)).unwrap();
        for k in written.as_object().unwrap().keys() {
            assert!(placed.contains(&k.as_str()), "ferrotron writes {k}, a key it does not place");
        }
    }
}

#[test]
fn keys_that_change_the_math_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let base = serde_json::json!({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    });
    let path = dir.path().join("config.json");
    let read = |extra: serde_json::Value| {
        let mut j = base.clone();
        j.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        std::fs::write(&path, j.to_string()).unwrap();
        read_hf_config(&path)
    };
    read(serde_json::json!({})).unwrap();
    // the defaults pass
    read(serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_scaling": null, "attention_dropout": 0.0, "sliding_window": null, "pretraining_tp": 1})).unwrap();
    // RoPE's rescaling is read where transformers 5 reads it: `rope_scaling` (transformers 4's
    // name) before `rope_parameters`, its kind under "rope_type" or "type"
    let llama3 = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let kind = |extra| read(extra).unwrap().rope_scaling;
    let scaled = kind(serde_json::json!({"rope_parameters": {"rope_type": "default"}, "rope_scaling": llama3}));
    assert_eq!((scaled.rope_type, scaled.original_max_position_embeddings), (RopeType::Llama3, 8192));
    let scaled = kind(serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}));
    assert_eq!((scaled.rope_type, scaled.factor), (RopeType::Linear, 2.0));
    // YaRN without a factor: the ratio of max_position_embeddings to the trained context
    let yarn = serde_json::json!({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 1024}, "max_position_embeddings": 4096});
    assert_eq!(kind(yarn).factor, 4.0);
    let refused = [
        (
            serde_json::json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
            "rope_scaling.rope_type = \"dynamic\"",
        ),
        (serde_json::json!({"rope_parameters": {"rope_type": "longrope"}}), "rope_parameters.rope_type = \"longrope\""),
        (serde_json::json!({"attention_dropout": 0.1}), "attention_dropout = 0.1"),
        (serde_json::json!({"attention_bias": true}), "attention_bias = true"),
        (serde_json::json!({"hidden_act": "gelu"}), "hidden_act = \"gelu\""),
        (serde_json::json!({"quantization_config": {"quant_method": "gptq"}}), "quantization_config"),
        (
            serde_json::json!({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4096}),
            "sliding_window = 4096",
        ),
    ];
    for (extra, want) in refused {
        let e = format!("{:#}", read(extra.clone()).unwrap_err());
        assert!(e.contains(want) && e.contains("config.json"), "{extra}: {e}");
    }
}

/// A generation_config.json's decoding settings that `generate` does not apply are named in a
/// note, with their values; its other keys pass without one.
#[test]
fn decoding_settings_not_applied_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let gen = dir.path().join("generation_config.json");
    std::fs::write(
        &gen,
        r#"{"eos_token_id": 2, "bos_token_id": 1, "top_p": 0.9, "temperature": 0.6, "use_cache": true}"#,
    )
    .unwrap();
    let noted = ferrotron::commands::generate::decoding_not_applied(dir.path()).unwrap();
    assert_eq!(noted, ["temperature = 0.6", "top_p = 0.9"]);
    std::fs::write(&gen, r#"{"eos_token_id": 2, "transformers_version": "5.24.0"}"#).unwrap();
    assert!(ferrotron::commands::generate::decoding_not_applied(dir.path()).unwrap().is_empty());
}
