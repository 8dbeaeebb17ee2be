//! Every long phase outside the training step stops on a signal (`src/signals.rs`): with the
//! handler installed and a SIGTERM received, a file read of more than one chunk, the data's
//! preparation (hashing the source, tokenising it, checking a token file), a checkpoint's and a
//! Hugging Face folder's weights each end with `Interrupted` at their next chunk, and nothing is
//! written; a file of one chunk is still read whole; validation and a sample while training end
//! without their result. (The training
//! step, validation and the wait for peers are signalled on the real binary: `tests/faults.rs`,
//! `tests/multiprocess.rs`.) Its own test binary: the signal, once noted, stays for the process.

use ferrotron::config::Config;
use ferrotron::data::Dataset;
use ferrotron::signals::interrupted;

fn text_config(source: &std::path::Path, cache: &std::path::Path) -> Config {
    let sets = [
        format!("data.source=\"text:{}\"", source.display()),
        "data.tokenizer=\"bytes\"".into(),
        format!("data.cache_dir=\"{}\"", cache.display()),
        "model.vocab_size=256".into(),
    ];
    Config::load(None, &sets).unwrap()
}

#[test]
fn after_a_signal_every_read_and_the_data_preparation_stop_with_interrupted() {
    let tmp = tempfile::tempdir().unwrap();
    let (text, other, cache) = (tmp.path().join("a.txt"), tmp.path().join("b.txt"), tmp.path().join("cache"));
    std::fs::write(&text, "some text to read. ".repeat(100)).unwrap();
    std::fs::write(&other, "a text never tokenised. ".repeat(100)).unwrap();
    // before any signal: all is read (the token file of a.txt is made)
    let cfg = text_config(&text, &cache);
    Dataset::open(&cfg.data, &cfg.model).unwrap();
    assert_eq!(ferrotron::files::read_bytes(&text, "a file").unwrap().len(), 1900);

    ferrotron::signals::install();
    unsafe { libc::raise(libc::SIGTERM) }; // noted by the handler, as a scheduler's would be
    assert_eq!(ferrotron::signals::received(), Some(libc::SIGTERM));
    let stopped = |e: anyhow::Error, during: &str| {
        let said = format!("{e:#}");
        assert_eq!(interrupted(&e), Some(libc::SIGTERM), "{said}");
        assert!(said.contains("stopped by SIGTERM while") && said.contains(during), "{said}");
    };
    // a file of more than one 64 MiB chunk stops after its first (sparse: no disk is used); one
    // of a single chunk is read whole, as the small reads of a signal's own save must be
    let big = tmp.path().join("big.bin");
    std::fs::File::create(&big).unwrap().set_len((64 << 20) + 1).unwrap();
    stopped(ferrotron::files::read_bytes(&big, "a file").unwrap_err(), "reading a file");
    stopped(ferrotron::files::read_text(&big, "a text").unwrap_err(), "reading a text");
    assert_eq!(ferrotron::files::read_bytes(&text, "a small file").unwrap().len(), 1900);
    // the data: a source already tokenised, and one that is not (no token file is left behind)
    let tokens_before = std::fs::read_dir(cache.join("tokens")).unwrap().count();
    stopped(Dataset::open(&cfg.data, &cfg.model).err().unwrap(), "data.source");
    let fresh = text_config(&other, &cache);
    stopped(Dataset::open(&fresh.data, &fresh.model).err().unwrap(), "data.source");
    assert_eq!(std::fs::read_dir(cache.join("tokens")).unwrap().count(), tokens_before, "nothing written");
    // a checkpoint folder and a Hugging Face folder: their large safetensors file stops
    let folder = tmp.path().join("model");
    std::fs::create_dir_all(&folder).unwrap();
    let gqa = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gqa/config.json");
    std::fs::copy(gqa, folder.join("config.json")).unwrap();
    let state = r#"{"step": 1, "adam_steps": 1, "run_id": "0-0", "config": ""}"#;
    std::fs::write(folder.join("trainer_state.json"), state).unwrap();
    std::fs::hard_link(&big, folder.join("model.safetensors")).unwrap();
    stopped(ferrotron::checkpoint::save::load(&folder).err().unwrap(), "model.safetensors");
    stopped(ferrotron::checkpoint::hf::load_hf(&folder).err().unwrap(), "model.safetensors");
    // a sample while training ends at its next token, as validation at its next micro-batch:
    // the step is kept, without a sample or a held-out loss
    let metrics = tmp.path().join("m.jsonl");
    let sets: Vec<String> =
        ["train.steps=1", "train.sample_every=1", "validation.every=1", "model.num_hidden_layers=1"]
            .map(String::from)
            .into();
    let cfg = Config::load(None, &sets).unwrap();
    let opts = ferrotron::train::Options { quiet: true, metrics: Some(&metrics), ..Default::default() };
    assert_eq!(ferrotron::train::train(&cfg, opts).unwrap().losses.len(), 1);
    let line = std::fs::read_to_string(&metrics).unwrap();
    assert!(line.contains("\"loss\"") && !line.contains("sample") && !line.contains("val_loss"), "{line}");
}
