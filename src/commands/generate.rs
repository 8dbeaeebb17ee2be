//! # Sampling from a model: `ferrotron generate`
//!
//! The command around the decode loop of `model/sampling.rs` (which says how a token is picked):
//! the prompt as text through a tokenizer (`--tokenizer`, else the folder's own, else the one its
//! run trained with), the end-of-text tokens (`eos_token_id` of the folder's
//! `generation_config.json`, else of `config.json`, as transformers reads it), a KV cache checked
//! against the memory before it grows, and the text printed as it grows.

use crate::comm::launcher::Capacity;
use crate::config::ModelConfig;
use crate::data::text::Tokenizer;
use crate::model::sampling::{generate, Sampling};
use crate::ops::DType;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::Path;

/// `ferrotron generate`: the prompt (`--prompt` text, or `--tokens` ids) continued by the model
/// folder `model`, on the CPU or, with `gpu` (its dtype), on GPU 0; the text is printed as it
/// grows, then the new ids and the speed.
pub fn run(
    model: &Path,
    (prompt, tokens): (Option<&str>, Option<&str>),
    sampling: &Sampling,
    tokenizer: Option<&str>,
    gpu: Option<DType>,
) -> Result<()> {
    sampling.check()?;
    let tok = tokenizer_for(model, tokenizer)?;
    let ids = match (prompt, tokens, &tok) {
        (Some(text), _, Some(t)) => t.encode(text)?,
        (Some(_), _, None) => bail!(
            "--prompt needs a tokenizer: {} has no tokenizer.json; give --tokenizer (a tokenizer.json, bytes or hub:ORG/NAME) or the prompt as --tokens",
            model.display()
        ),
        (None, Some(ids), _) => parse_ids(ids)?,
        (None, None, _) => bail!("give --prompt TEXT or --tokens IDS"),
    };
    if ids.is_empty() {
        bail!("--prompt: the text is no tokens; give some text to continue");
    }
    let mut m = crate::checkpoint::hf::load_hf(model)?;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= m.cfg.vocab_size) {
        bail!("the prompt holds token id {bad}, but {}'s vocabulary has {} tokens", model.display(), m.cfg.vocab_size);
    }
    let room = match gpu {
        Some(dtype) => {
            let gpu = crate::cuda::runtime::Gpu::open(0)?;
            m.to_place(&crate::ops::tensor::Place::for_rank(Some(&gpu), dtype)?);
            Capacity::gpu(1)?
        }
        None => Capacity::host(1),
    };
    check_room(&m.cfg, ids.len(), sampling.max_new_tokens, &room, gpu.map_or(4, DType::size))?;
    let eos = eos_ids(model)?;
    if let Some(id) = eos.iter().find(|&&id| id as usize >= m.cfg.vocab_size) {
        bail!("{}: eos_token_id {id} is outside the vocabulary (vocab_size = {}): fix generation_config.json or config.json", model.display(), m.cfg.vocab_size);
    }
    let not_applied = decoding_not_applied(model)?;
    if !not_applied.is_empty() {
        crate::say!("note: {}/generation_config.json sets {}: not applied (generate decodes by its own flags: --temperature, --top-k, --max-new-tokens)", model.display(), not_applied.join(", "));
    }
    let how = match sampling.temperature {
        0.0 => "greedy".to_string(),
        t => format!("temperature {t}, top-k {}, seed {}", sampling.top_k, sampling.seed),
    };
    crate::say!("{}: {} prompt tokens, up to {} new ({how})", model.display(), ids.len(), sampling.max_new_tokens);
    // the text as it grows (a character may need two tokens: shown once it is whole); a closed
    // or full standard output costs the printout, never the run
    let show = |text: &str| {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
    };
    let (mut new, mut shown) = (Vec::new(), String::new());
    show(&match &tok {
        Some(t) => t.decode(&ids)?,
        None => ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" "),
    });
    let start = std::time::Instant::now();
    let out = generate(&mut m, &ids, sampling, &eos, &mut |t| {
        new.push(t);
        let text = match &tok {
            Some(tk) => tk.decode(&new).unwrap_or_default(),
            None => new.iter().map(|i| format!(" {i}")).collect(),
        };
        if let Some(more) = text.strip_prefix(shown.as_str()) {
            show(more);
            shown = text;
        }
        Ok(())
    })?;
    let secs = start.elapsed().as_secs_f64();
    let stop = if out.last().is_some_and(|t| eos.contains(t)) { "; stopped at the end-of-text token" } else { "" };
    crate::say!("\nnew token ids: {}", out.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" "));
    crate::say!("{} tokens in {secs:.2} s ({:.1} tokens/s){stop}", out.len(), out.len() as f64 / secs.max(1e-9));
    Ok(())
}

/// Refuses a generation whose KV cache (`model/kv_cache.rs`: keys and values of every layer, a
/// row a position, `bytes` a number) cannot fit in `room` before anything is reserved: the size a
/// flag asks for is checked against what it costs.
fn check_room(cfg: &ModelConfig, prompt: usize, new: usize, room: &Capacity, bytes: usize) -> Result<()> {
    let row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim() * bytes;
    let fits = (room.bytes / row as f64).min(usize::MAX as f64) as usize;
    if prompt.saturating_add(new) > fits {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        bail!(
            "--max-new-tokens {new}: the KV cache of {prompt} + {new} positions needs {:.1} GiB, more than the {:.1} GiB {}; give at most {}",
            gib(row as f64 * (prompt as f64 + new as f64)),
            gib(room.bytes),
            room.what,
            fits.saturating_sub(prompt).max(1),
        );
    }
    Ok(())
}

/// The keys of a `generation_config.json`, as transformers' `GenerationConfig` has them
/// (`tests/fixtures/config_keys.json`), by what `generate` does with each: none is passed over
/// without a word (`tests/hf_keys.rs`).
pub mod decoding_keys {
    /// Read: the tokens that end the text.
    pub const READ: &[&str] = &["eos_token_id"];
    /// Change what transformers' `generate()` would draw; ferrotron decodes by its flags alone, so
    /// a folder that sets one is told so in a note, naming each with its value.
    pub const NOT_APPLIED: &[&str] = &[
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "top_h",
        "min_p",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "max_length",
        "max_new_tokens",
        "min_length",
        "min_new_tokens",
        "max_time",
        "stop_strings",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "bad_words_ids",
        "force_words_ids",
        "constraints",
        "sequence_bias",
        "suppress_tokens",
        "begin_suppress_tokens",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "exponential_decay_length_penalty",
        "renormalize_logits",
        "remove_invalid_values",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "length_penalty",
        "early_stopping",
        "penalty_alpha",
        "guidance_scale",
        "dola_layers",
        "token_healing",
        "watermarking_config",
        "num_return_sequences",
    ];
    /// Not decoding: other token ids, what transformers returns and caches, how it compiles and
    /// batches, speculative decoding (an assistant proposes, the model decides: the same text),
    /// and the encoder-decoder models' keys (a Llama has no encoder).
    pub const NOT_DECODING: &[&str] = &[
        "_from_model_config",
        "transformers_version",
        "bos_token_id",
        "pad_token_id",
        "decoder_start_token_id",
        "output_attentions",
        "output_hidden_states",
        "output_logits",
        "output_scores",
        "return_dict_in_generate",
        "use_cache",
        "cache_config",
        "cache_implementation",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "prefill_chunk_size",
        "continuous_batching_config",
        "low_memory",
        "assistant_confidence_threshold",
        "assistant_early_exit",
        "assistant_ensemble_weight",
        "assistant_lookbehind",
        "is_assistant",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "prompt_lookup_num_tokens",
        "max_matching_ngram_size",
        "speculation_type",
        "target_lookbehind",
        "use_mtp",
        "encoder_no_repeat_ngram_size",
        "encoder_repetition_penalty",
    ];
}

/// The decoding settings of a folder's `generation_config.json` that `generate` does not apply
/// (`decoding_keys::NOT_APPLIED`), each as `key = value`; none without the file.
pub fn decoding_not_applied(dir: &Path) -> Result<Vec<String>> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = crate::files::read_text(&path, "generation_config.json")?;
    let j: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
    Ok(decoding_keys::NOT_APPLIED.iter().filter(|k| !j[**k].is_null()).map(|k| format!("{k} = {}", j[*k])).collect())
}

/// The end-of-text ids of a Hugging Face folder: `eos_token_id` (a number or a list) of its
/// `generation_config.json`, else of its `config.json`; none if neither gives one.
pub fn eos_ids(dir: &Path) -> Result<Vec<u32>> {
    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let text = crate::files::read_text(&path, name)?;
        let j: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        // a token id is below 2^32: a larger number is refused, never cut to its low bits
        let id = |v: &serde_json::Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        let ids = match &j["eos_token_id"] {
            serde_json::Value::Null => continue,
            serde_json::Value::Array(list) => list.iter().map(id).collect::<Option<Vec<_>>>(),
            v => id(v).map(|id| vec![id]),
        };
        let Some(ids) = ids else {
            bail!(
                "{}: eos_token_id = {} is not a token id (a whole number below 2^32) or a list of them",
                path.display(),
                j["eos_token_id"]
            );
        };
        return Ok(ids);
    }
    Ok(Vec::new())
}

/// The tokenizer for `--tokenizer` (a path, `bytes` or `hub:ORG/NAME`), else the folder's own
/// `tokenizer.json`, else, for a ferrotron checkpoint trained on text, the `data.tokenizer` its
/// run recorded, else none (prompts must then be token ids: the synthetic language has no text).
pub fn tokenizer_for(dir: &Path, choice: Option<&str>) -> Result<Option<Tokenizer>> {
    let recorded = recorded_tokenizer(dir)?;
    // the checkpoint's run trained with a tokenizer of this content (none: not recorded)
    let trained_with = recorded.as_ref().and_then(|(_, print)| print.as_deref());
    match choice {
        Some(spec) => {
            let tok = Tokenizer::load(spec).context("--tokenizer")?;
            if let Some(then) = trained_with.filter(|&then| then != tok.fingerprint()) {
                crate::say!("note: --tokenizer {spec} is not the tokenizer {}'s run trained with (fingerprint {}, the run's: {then}): its ids may stand for other text", dir.display(), tok.fingerprint());
            }
            Ok(Some(tok))
        }
        None if dir.join("tokenizer.json").is_file() => {
            Ok(Some(Tokenizer::load(&dir.join("tokenizer.json").to_string_lossy())?))
        }
        None => match &recorded {
            Some((spec, _)) => {
                let trained =
                    || format!("{}: the tokenizer its run trained with, data.tokenizer = {spec}", dir.display());
                let tok = Tokenizer::load(spec).with_context(|| format!("{}; give --tokenizer", trained()))?;
                if let Some(then) = trained_with.filter(|&then| then != tok.fingerprint()) {
                    bail!("{}, holds other content now (fingerprint {}, the run's: {then}): the text could be encoded with other ids; give --tokenizer with the one the run trained with", trained(), tok.fingerprint());
                }
                Ok(Some(tok))
            }
            None => Ok(None),
        },
    }
}

/// The `data.tokenizer` of the run that wrote a ferrotron checkpoint, if it trained on text, with
/// the fingerprint of that tokenizer's content as the checkpoint records it (`checkpoint/save.rs`).
fn recorded_tokenizer(dir: &Path) -> Result<Option<(String, Option<String>)>> {
    let state = dir.join("trainer_state.json");
    if !state.is_file() {
        return Ok(None);
    }
    let text = crate::files::read_text(&state, "trainer_state.json")?;
    let meta: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", state.display()))?;
    let cfg = meta["config"].as_str().and_then(crate::config::Config::from_recorded);
    let on_text = |c: &crate::config::Config| c.data.source.starts_with("text:") || c.data.source.starts_with("hub:");
    let Some(cfg) = cfg.filter(on_text) else { return Ok(None) };
    Ok(Some((cfg.data.tokenizer, crate::checkpoint::save::tokenizer_fingerprint(&meta, &state)?)))
}

/// Token ids written as `--tokens "5 17 42"` (spaces or commas between them).
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    let words: Vec<&str> = text.split(|c: char| c.is_whitespace() || c == ',').filter(|w| !w.is_empty()).collect();
    if words.is_empty() {
        bail!("--tokens \"{text}\": give at least one token id, e.g. --tokens \"5 17 42\"");
    }
    words.iter().map(|w| w.parse::<u32>().map_err(|_| anyhow::anyhow!("--tokens: `{w}` is not a token id"))).collect()
}
