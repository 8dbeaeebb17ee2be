//! Hugging Face parity: for each fixture written by `tests/fixtures/make_hf_fixtures.py`, the
//! model loaded through the same path as `ferrotron eval` must give transformers' loss (1e-5
//! relative), logits (1e-4) and every parameter gradient (1e-4 relative to the tensor's norm).
//! The DeepSeek-V3 fixtures hold latent attention (`model/latent_attention.rs`) in both layouts,
//! and DeepSeekMoE (`model/moe.rs`: grouped sigmoid routing with a non-zero correction bias,
//! shared experts, dense first layers).
//! The Mixtral fixtures add the router and every expert's gradient; with the load-balancing loss
//! on, transformers' loss includes it, which `eval` (the language-model loss) leaves out.

use ferrotron::checkpoint::hf as checkpoint;
use ferrotron::commands::eval;
use std::path::Path;

fn check_case(name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let mut model = checkpoint::load_hf(&dir).unwrap();
    let seqs = eval::read_tokens(&dir.join("tokens.txt"), model.cfg.vocab_size).unwrap();
    let expected = checkpoint::read_safetensors(&dir.join("expected.safetensors")).unwrap();
    let want_loss = expected["loss"].to_vec()[0] as f64;

    // the loss exactly as `ferrotron eval` computes it (without a balance loss)
    if model.cfg.router_aux_loss_coef == 0.0 {
        let loss = eval::mean_loss(&mut model, &seqs).unwrap();
        assert!((loss - want_loss).abs() <= 1e-5 * want_loss, "{name}: eval loss {loss} vs transformers {want_loss}");
    }

    // the whole batch at once: logits and gradients
    let tokens: Vec<u32> = seqs.concat();
    let targets: Vec<i32> = seqs.iter().flat_map(|s| eval::shifted_targets(s)).collect();
    let batch_loss = model.forward(&tokens, seqs.len(), &targets).unwrap() as f64;
    assert!((batch_loss - want_loss).abs() <= 1e-5 * want_loss, "{name}: batch loss {batch_loss} vs {want_loss}");
    let logits = model.logits().unwrap().to_vec();
    let want_logits = expected["logits"].to_vec();
    assert_eq!(logits.len(), want_logits.len(), "{name}: logits size");
    let max_diff = logits.iter().zip(&want_logits).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_diff <= 1e-4, "{name}: logits differ by up to {max_diff}");

    model.zero_grads();
    model.backward(1.0).unwrap();
    let params = model.params();
    assert_eq!(params.len(), expected.len() - 2, "{name}: one expected gradient per parameter");
    for p in params {
        let want = expected[&format!("grad.{}", p.name)].to_vec();
        let got = p.grad.to_vec();
        let norm = want.iter().map(|x| x * x).sum::<f32>().sqrt();
        let err = got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum::<f32>().sqrt();
        assert!(norm > 0.0, "{name}: {} has a zero reference gradient", p.name);
        assert!(err <= 1e-4 * norm, "{name}: gradient of {} off by {err} (norm {norm})", p.name);
    }
}

#[test]
fn grouped_query_attention() {
    check_case("gqa");
}

#[test]
fn tied_embeddings_odd_sizes_explicit_head_dim() {
    check_case("tied_odd");
}

#[test]
fn multi_head_with_transformers4_config() {
    check_case("mha_v4_config");
}

#[test]
fn multi_query_sharded_checkpoint() {
    check_case("mqa_sharded");
}

#[test]
fn mixtral_top2_of_4_experts() {
    check_case("mixtral");
}

#[test]
fn mixtral_top1_of_3_with_the_balance_loss() {
    check_case("mixtral_top1_balance");
}

#[test]
fn mixtral_top3_of_5_tied_with_the_balance_loss() {
    check_case("mixtral_top3_tied");
}

#[test]
fn latent_attention_plain_query_interleaved_rope() {
    check_case("mla_dense");
}

#[test]
fn latent_attention_query_latent_split_half_rope_wide_values_tied() {
    check_case("mla_q_latent");
}

#[test]
fn deepseek_moe_grouped_top2_of_8_with_a_shared_expert_and_a_dense_first_layer() {
    check_case("deepseek_moe");
}

#[test]
fn deepseek_moe_top3_unnormalised_two_shared_experts_tied() {
    check_case("deepseek_moe_unnormed");
}

/// RoPE rescaled for a longer context (`ops/rope_scaling.rs`), as transformers computes it: YaRN
/// on a Llama (the cos/sin factor derived, an unrounded ramp) and on DeepSeek-V3's latent
/// attention as V3 configures it (the softmax scale times mscale², `rope_scaling` with "type"),
/// and Llama 3's (a Llama 3.x folder's `rope_scaling`).
#[test]
fn yarn_on_a_llama_unrounded_ramp_derived_attention_factor() {
    check_case("llama_yarn");
}

#[test]
fn yarn_on_latent_attention_as_deepseek_v3_configures_it() {
    check_case("mla_yarn");
}

#[test]
fn llama3_rope_scaling() {
    check_case("llama3_rope");
}

/// A rescaled RoPE leaves in a checkpoint as transformers reads it: `hf_config` written and read
/// again gives the same config, for each kind; kinds ferrotron does not compute are refused in
/// one line naming the key.
#[test]
fn rope_scaling_round_trips_through_config_json_and_unknown_kinds_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama_yarn", "mla_yarn", "llama3_rope"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
        let cfg = checkpoint::read_hf_config(&dir.join("config.json")).unwrap();
        assert_ne!(cfg.rope_scaling.rope_type, ferrotron::config::RopeType::Default, "{name}");
        let path = tmp.path().join("config.json");
        std::fs::write(&path, ferrotron::checkpoint::save::hf_config(&cfg)).unwrap();
        assert_eq!(checkpoint::read_hf_config(&path).unwrap(), cfg, "{name}");
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_yarn");
    let mut j: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let path = tmp.path().join("config.json");
    for (key, value, says) in [
        ("rope_type", serde_json::json!("longrope"), "rope_parameters.rope_type = \"longrope\" is not supported"),
        ("partial_rotary_factor", serde_json::json!(0.5), "rope_parameters.partial_rotary_factor = 0.5"),
        ("factor", serde_json::json!("4"), "rope_parameters.factor = \"4\" is not a number"),
    ] {
        let mut bad = j.clone();
        bad["rope_parameters"][key] = value;
        std::fs::write(&path, bad.to_string()).unwrap();
        let e = format!("{:#}", checkpoint::read_hf_config(&path).unwrap_err());
        assert!(e.contains(says), "{key}: {e}");
    }
    j["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4});
    std::fs::write(&path, j.to_string()).unwrap();
    let e = format!("{:#}", checkpoint::read_hf_config(&path).unwrap_err());
    assert!(e.contains("rope_parameters.low_freq_factor is missing"), "{e}");
}

/// With `model.init_from` a Hugging Face folder, every `[model]` key the run does not give comes
/// from its config.json (the built-in defaults are not "given"), for Llama, Mixtral and DeepSeek-V3
/// folders; a key the run gives and the folder contradicts is refused naming it.
#[test]
fn a_folder_gives_the_model_keys_a_run_leaves_out() {
    for name in ["tied_odd", "mixtral", "deepseek_moe", "mla_q_latent", "mla_yarn"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
        let init = format!("model.init_from=\"{}\"", dir.display());
        let cfg = ferrotron::commands::load_config(None, std::slice::from_ref(&init)).unwrap();
        let theirs = checkpoint::read_hf_config(&dir.join("config.json")).unwrap();
        let plain = |m: &ferrotron::config::ModelConfig| ferrotron::config::ModelConfig {
            initializer_range: 0.02,
            init_from: String::new(),
            head_dim: Some(m.head_dim()),
            ..m.clone()
        };
        assert_eq!(plain(&cfg.model), plain(&theirs), "{name}");
        checkpoint::pretrained(&cfg.model).unwrap(); // and the weights load
        let wrong = [init, "model.num_hidden_layers=5".into()];
        let cfg = ferrotron::commands::load_config(None, &wrong).unwrap();
        let e = format!("{:#}", checkpoint::pretrained(&cfg.model).unwrap_err());
        assert!(e.contains("num_hidden_layers") && e.contains("model.num_hidden_layers = 5"), "{name}: {e}");
    }
}

/// A DeepSeek-V3 folder's multi-token-prediction layers (stored after the last layer, as
/// DeepSeek's own checkpoints hold them) are dropped as transformers drops them, saying so; the
/// same tensors without `num_nextn_predict_layers` are refused as layers the config lacks.
#[test]
fn deepseek_multi_token_prediction_layers_are_dropped() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mla_dense");
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokens.txt"] {
        std::fs::copy(fixture.join(f), tmp.path().join(f)).unwrap();
    }
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> =
        checkpoint::read_safetensors(&fixture.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.shape().to_vec(), t.to_vec().iter().flat_map(|x| x.to_le_bytes()).collect()))
            .collect();
    for name in ["model.layers.2.eh_proj.weight", "model.layers.2.self_attn.q_proj.weight"] {
        tensors.push((name.into(), vec![4, 6], vec![0; 4 * 24]));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    std::fs::write(tmp.path().join("model.safetensors"), safetensors::serialize(views, &None).unwrap()).unwrap();
    let config = |mtp: usize| {
        let mut j: serde_json::Value =
            serde_json::from_slice(&std::fs::read(fixture.join("config.json")).unwrap()).unwrap();
        j["num_nextn_predict_layers"] = mtp.into();
        std::fs::write(tmp.path().join("config.json"), j.to_string()).unwrap();
    };
    config(1);
    let mut model = checkpoint::load_hf(tmp.path()).unwrap();
    let seqs = eval::read_tokens(&tmp.path().join("tokens.txt"), model.cfg.vocab_size).unwrap();
    let want = checkpoint::read_safetensors(&fixture.join("expected.safetensors")).unwrap()["loss"].to_vec()[0] as f64;
    let loss = eval::mean_loss(&mut model, &seqs).unwrap();
    assert!((loss - want).abs() <= 1e-5 * want, "with the MTP layer dropped: {loss} vs {want}");
    config(0);
    let e = format!("{:#}", checkpoint::load_hf(tmp.path()).err().unwrap());
    assert!(e.contains("model.layers.2.") && e.contains("more layers than model.num_hidden_layers = 2"), "{e}");
}
