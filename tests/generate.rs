//! Generating: the KV cache gives the logits of the full forward at every position (dense,
//! grouped-query, multi-query, tied, mixture of experts, latent attention); greedy decoding equals transformers'
//! `generate(do_sample=False)` token for token on a Hugging Face folder with its tokenizer; the
//! sampler draws from the softmax at its temperature over the top k; the end-of-text token stops
//! a generation; the CLI's errors.

use ferrotron::checkpoint::hf;
use ferrotron::commands::eval::shifted_targets;
use ferrotron::commands::generate;
use ferrotron::model::kv_cache::KvCache;
use ferrotron::model::sampling::{self, pick, Sampling};
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}

/// A prompt of 5 tokens, then 7 one at a time, through the cache: each step's logits are the
/// full forward's row at that position. Latent attention's cache holds its latent and shared
/// rotated key, once a token (kv_lora_rank + qk_rope_head_dim values a layer), where GQA's holds
/// every KV head's key and value; YaRN's rescaled rotation is the forward's too.
#[test]
fn the_kv_cache_gives_the_full_forwards_logits() {
    for case in [
        "gqa",
        "tied_odd",
        "mha_v4_config",
        "mqa_sharded",
        "mixtral",
        "mixtral_top3_tied",
        "mla_dense",
        "mla_q_latent",
        "mla_yarn",
        "deepseek_moe",
        "llama_yarn",
    ] {
        let mut model = hf::load_hf(&fixture(case)).unwrap();
        let vocab = model.cfg.vocab_size;
        let seq: Vec<u32> = (0..12).map(|i| ((i * 7 + 3) % vocab) as u32).collect();
        model.forward(&seq, 1, &shifted_targets(&seq)).unwrap();
        let full = model.logits().unwrap().to_vec();
        let mut cache = KvCache::new(model.cfg.num_hidden_layers);
        let mut rows = vec![model.decode(&seq[..5], &mut cache).unwrap()];
        for t in &seq[5..] {
            rows.push(model.decode(&[*t], &mut cache).unwrap());
        }
        assert_eq!(cache.len(), 12);
        let c = &model.cfg;
        let per_token = match c.kv_lora_rank {
            0 => 2 * c.num_key_value_heads * c.head_dim(),
            rank => rank + c.qk_rope_head_dim,
        };
        assert_eq!(cache.bytes(), 12 * c.num_hidden_layers * per_token * 4, "{case}: the cache's size");
        for (i, row) in rows.iter().enumerate() {
            let pos = 4 + i;
            let want = &full[pos * vocab..(pos + 1) * vocab];
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let diff = row.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff <= 1e-5 * scale.max(1.0), "{case}, position {pos}: the cached step differs by {diff:e}");
        }
    }
}

fn greedy(n: usize) -> Sampling {
    Sampling { max_new_tokens: n, temperature: 0.0, top_k: 0, seed: 0 }
}

#[test]
fn the_end_of_text_token_stops_a_generation() {
    let mut model = hf::load_hf(&fixture("gqa")).unwrap();
    let free = sampling::generate(&mut model, &[1, 5, 9], &greedy(12), &[], &mut |_| Ok(())).unwrap();
    assert_eq!(free.len(), 12);
    let eos = free[3];
    let first = free.iter().position(|&t| t == eos).unwrap();
    let mut seen = Vec::new();
    let stopped = sampling::generate(&mut model, &[1, 5, 9], &greedy(12), &[eos], &mut |t| {
        seen.push(t);
        Ok(())
    })
    .unwrap();
    assert_eq!(stopped, free[..=first], "stops after the end-of-text token, which it returns");
    assert_eq!(seen, stopped, "each token is handed on as it is picked");
    // the folder's own: generation_config.json first, then config.json (a number or a list)
    assert_eq!(generate::eos_ids(&fixture("gqa")).unwrap(), [2]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), "{\"eos_token_id\": [7, 9]}").unwrap();
    assert_eq!(generate::eos_ids(dir.path()).unwrap(), [7, 9]);
    std::fs::write(dir.path().join("generation_config.json"), "{\"eos_token_id\": 4}").unwrap();
    assert_eq!(generate::eos_ids(dir.path()).unwrap(), [4]);
    std::fs::write(dir.path().join("generation_config.json"), "{\"eos_token_id\": \"4\"}").unwrap();
    assert!(generate::eos_ids(dir.path()).unwrap_err().to_string().contains("eos_token_id = \"4\" is not a token id"));
    // 2^32 + 88 is no token id: refused, never read as 88
    std::fs::write(dir.path().join("generation_config.json"), "{\"eos_token_id\": 4294967384}").unwrap();
    let e = generate::eos_ids(dir.path()).unwrap_err().to_string();
    assert!(e.contains("eos_token_id = 4294967384 is not a token id (a whole number below 2^32)"), "{e}");
}

#[test]
fn the_sampler_draws_from_the_softmax_at_its_temperature_over_the_top_k() {
    let mut rng = ferrotron::model::init::stream(7, "test");
    // greedy: the largest, ties to the lowest id; top-1 is greedy at any temperature
    assert_eq!(pick(&[0.5, 2.0, 2.0, -1.0], 0.0, 0, &mut rng), 1);
    assert!((0..50).all(|_| pick(&[0.5, 2.0, 1.9, -1.0], 3.0, 1, &mut rng) == 1));
    // frequencies: softmax([0, ln 2, ln 4] / T) is 1:2:4 at T = 1 and 1:√2:2 at T = 2
    let logits = [0.0, 2f32.ln(), 4f32.ln()];
    let share = |t: f32, k: usize, rng: &mut _| {
        let mut counts = [0usize; 3];
        (0..70_000).for_each(|_| counts[pick(&logits, t, k, rng) as usize] += 1);
        counts.map(|c| c as f64 / 70_000.0)
    };
    let close = |got: [f64; 3], want: [f64; 3]| got.iter().zip(want).all(|(g, w)| (g - w).abs() < 0.01);
    let s = share(1.0, 0, &mut rng);
    assert!(close(s, [1.0 / 7.0, 2.0 / 7.0, 4.0 / 7.0]), "{s:?}");
    let z = 1.0 + 2f64.sqrt() + 2.0;
    let s = share(2.0, 0, &mut rng);
    assert!(close(s, [1.0 / z, 2f64.sqrt() / z, 2.0 / z]), "{s:?}");
    // top-2: the least likely is never drawn, the others keep their ratio 2:4
    let s = share(1.0, 2, &mut rng);
    assert!(close(s, [0.0, 1.0 / 3.0, 2.0 / 3.0]), "{s:?}");
    // a seed repeats a generation; another seed gives another
    let mut model = hf::load_hf(&fixture("gqa")).unwrap();
    let sampled = |seed| {
        let s = Sampling { max_new_tokens: 20, temperature: 1.0, top_k: 0, seed };
        sampling::generate(&mut hf::load_hf(&fixture("gqa")).unwrap(), &[1, 5, 9], &s, &[], &mut |_| Ok(())).unwrap()
    };
    assert_eq!(sampled(3), sampled(3));
    assert_ne!(sampled(3), sampled(4));
    let bad = Sampling { temperature: f32::NAN, ..greedy(3) };
    assert!(sampling::generate(&mut model, &[1], &bad, &[], &mut |_| Ok(()))
        .unwrap_err()
        .to_string()
        .contains("--temperature NaN"));
}

/// Greedy decoding against transformers' `generate(do_sample=False)`, recorded by
/// `tests/fixtures/make_generate_fixture.py` on a random Llama with a BPE tokenizer: the prompt's
/// ids and every new token equal, in the library and through `ferrotron generate --prompt`.
#[test]
fn greedy_decoding_equals_transformers() {
    let dir = fixture("generate");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let n = expected["max_new_tokens"].as_u64().unwrap() as usize;
    let tok = generate::tokenizer_for(&dir, None).unwrap().expect("the folder's tokenizer.json");
    let eos = generate::eos_ids(&dir).unwrap();
    let mut model = hf::load_hf(&dir).unwrap();
    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() >= 3);
    for case in cases {
        let prompt = case["prompt"].as_str().unwrap();
        let prompt_ids = tok.encode(prompt).unwrap();
        assert_eq!(prompt_ids, ids(&case["prompt_ids"]), "{prompt:?}: the tokenizer");
        let new = sampling::generate(&mut model, &prompt_ids, &greedy(n), &eos, &mut |_| Ok(())).unwrap();
        assert_eq!(new, ids(&case["new_ids"]), "{prompt:?}: greedy tokens");
        // the binary, from the text
        let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .args(["generate", "--model", dir.to_str().unwrap(), "--prompt", prompt, "--temperature", "0"])
            .args(["--max-new-tokens", &n.to_string()])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let printed = text.lines().find_map(|l| l.strip_prefix("new token ids: ")).unwrap_or_default();
        let want: Vec<String> = ids(&case["new_ids"]).iter().map(|t| t.to_string()).collect();
        assert_eq!(printed, want.join(" "), "{prompt:?}: ferrotron generate printed\n{text}");
    }
}

/// The binary: one error line each, exit 1, no panic.
#[test]
fn generate_errors_are_named() {
    let run =
        |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_ferrotron")).arg("generate").args(args).output().unwrap();
    let gqa = fixture("gqa");
    let model = gqa.to_str().unwrap();
    for (args, named) in [
        (vec!["--model", model, "--prompt", "hello"], "--prompt needs a tokenizer"),
        (vec!["--model", model, "--tokens", "1 48"], "token id 48, but"),
        (vec!["--model", model, "--tokens", "1 x"], "`x` is not a token id"),
        (vec!["--model", model, "--tokens", " , "], "give at least one token id"),
        (vec!["--model", model, "--tokens", "1", "--max-new-tokens", "0"], "--max-new-tokens 0"),
        // sizes checked against the memory the KV cache needs, before anything is reserved (it
        // panicked at 2^62 and aborted at 2^40)
        (vec!["--model", model, "--tokens", "1", "--max-new-tokens", "4611686018427387904"], "give at most"),
        (vec!["--model", model, "--tokens", "1", "--max-new-tokens", "1099511627776"], "of this machine; give at most"),
        (vec!["--model", model, "--tokens", "1", "--temperature", "-1"], "--temperature -1"),
        (vec!["--model", model, "--tokens", "1", "--temperature", "inf"], "--temperature inf"),
        (vec!["--model", "/no/such/model", "--tokens", "1"], "/no/such/model/config.json"),
        (vec!["--model", model, "--tokens", "1", "--tokenizer", "/no/tok.json"], "/no/tok.json"),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(named) && err.trim().lines().count() == 1,
            "{args:?}: {err}"
        );
        assert!(
            out.stdout.is_empty(),
            "{args:?}: nothing is printed before the error: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // both or neither prompt: clap says so
    let out = run(&["--model", model]);
    assert_eq!(out.status.code(), Some(2));
    // a good one prints the prompt, the continuation and the new ids
    let out = run(&["--model", model, "--tokens", "1 5 9", "--temperature", "0", "--max-new-tokens", "4"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("new token ids: ") && text.contains("\n1 5 9 "), "{text}");
}

/// A checkpoint of a run on text remembers its tokenizer: `generate --prompt` on it needs no
/// `--tokenizer` (it did, for a run on bytes); a checkpoint of the synthetic language still asks
/// for token ids.
#[test]
fn a_text_checkpoint_brings_its_own_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("d.txt");
    std::fs::write(&text, "words to train on, and more words. ".repeat(40)).unwrap();
    let bin = env!("CARGO_BIN_EXE_ferrotron");
    let trained_with = |source: &str, ck: &Path, tokenizer: &str, vocab: usize| {
        let sets = [
            "train.steps=1".to_string(),
            "checkpoint.every=1".into(),
            format!("checkpoint.dir=\"{}\"", ck.display()),
            format!("data.source=\"{source}\""),
            format!("data.tokenizer=\"{tokenizer}\""),
            format!("model.vocab_size={vocab}"),
            format!("data.cache_dir=\"{}\"", dir.path().join("cache").display()),
        ];
        let mut args = vec!["train".to_string()];
        sets.iter().for_each(|s| args.extend(["--set".into(), s.clone()]));
        assert!(Command::new(bin).args(&args).output().unwrap().status.success());
        ck.join("step_000001")
    };
    let trained = |source: &str, ck: &Path| trained_with(source, ck, "bytes", 256);
    let generate_with = |model: &Path, extra: &[&str]| {
        let args = ["generate", "--model", model.to_str().unwrap(), "--prompt", "words ", "--max-new-tokens", "3"];
        Command::new(bin).args(args).args(extra).output().unwrap()
    };
    let generate = |model: &Path| generate_with(model, &[]);
    let on_text = generate(&trained(&format!("text:{}", text.display()), &dir.path().join("a")));
    assert!(on_text.status.success(), "{}", String::from_utf8_lossy(&on_text.stderr));
    assert!(String::from_utf8_lossy(&on_text.stdout).contains("new token ids: "));
    let synthetic = generate(&trained("synthetic", &dir.path().join("b")));
    assert!(String::from_utf8_lossy(&synthetic.stderr).contains("--prompt needs a tokenizer"));
    // the checkpoint records what its tokenizer was: the file at that path holding other content
    // since is refused (an explicit --tokenizer of other content is noted)
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/tokenizer.json");
    let (tokenizer, kept) = (dir.path().join("tokenizer.json"), dir.path().join("kept.json"));
    std::fs::copy(&fixture, &tokenizer).unwrap();
    std::fs::copy(&fixture, &kept).unwrap();
    let bpe =
        trained_with(&format!("text:{}", text.display()), &dir.path().join("c"), tokenizer.to_str().unwrap(), 320);
    assert!(generate(&bpe).status.success());
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&fixture).unwrap()).unwrap();
    std::fs::write(&tokenizer, serde_json::to_string_pretty(&json).unwrap()).unwrap(); // other bytes
    let changed = generate(&bpe);
    let err = String::from_utf8_lossy(&changed.stderr);
    assert_eq!(changed.status.code(), Some(1), "{err}");
    assert!(err.contains("holds other content now") && err.contains("give --tokenizer"), "{err}");
    let kept_one = generate_with(&bpe, &["--tokenizer", kept.to_str().unwrap()]);
    assert!(kept_one.status.success() && !String::from_utf8_lossy(&kept_one.stdout).contains("note:"));
    let other = generate_with(&bpe, &["--tokenizer", tokenizer.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&other.stdout).contains("is not the tokenizer"), "{other:?}");
}
