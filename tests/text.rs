//! Real text: a tokenizer.json tokenises as transformers does; JSON-lines documents joined by the
//! end-of-text token into a cached token file; training on it; the errors.

use ferrotron::config::Config;
use ferrotron::data::text::Tokenizer;
use ferrotron::data::Dataset;
use ferrotron::train::{train, Options};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

#[test]
fn tokenizer_json_matches_transformers() {
    let tok = Tokenizer::load(fixture().join("tokenizer.json").to_str().unwrap()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap()).unwrap();
    assert_eq!(tok.vocab_size() as u64, expected["vocab_size"].as_u64().unwrap());
    assert_eq!(tok.eos().map(u64::from), expected["eos"].as_u64());
    for (text, ids) in expected["texts"].as_array().unwrap().iter().zip(expected["ids"].as_array().unwrap()) {
        let want: Vec<u32> = ids.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tok.encode(text.as_str().unwrap()).unwrap(), want, "{text}");
    }
}

/// The cache folder of a test's source: beside it, in the test's temporary folder.
fn cache_of(source: &Path) -> PathBuf {
    source.parent().unwrap().join("cache")
}

/// The token files in the cache folder of `source`.
fn token_files(source: &Path) -> Vec<PathBuf> {
    let dir = cache_of(source).join("tokens");
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect()
}

fn text_config(source: &Path, extra: &[&str]) -> Config {
    let mut sets: Vec<String> = [
        format!("data.source=\"text:{}\"", source.display()),
        format!("data.tokenizer=\"{}\"", fixture().join("tokenizer.json").display()),
        format!("data.cache_dir=\"{}\"", cache_of(source).display()),
        "model.vocab_size=320".into(),
        "model.num_hidden_layers=1".into(),
        "train.seq_len=16".into(),
        "train.micro_batch_size=4".into(),
    ]
    .to_vec();
    sets.extend(extra.iter().map(|s| s.to_string()));
    Config::load(None, &sets).unwrap()
}

#[test]
fn jsonl_documents_are_tokenised_once_with_eos_between() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("docs.jsonl");
    let docs = ["The quick brown fox.", "Ring attention passes keys around.", "Données naïves 🚀"];
    let lines: Vec<String> = docs.iter().map(|d| serde_json::json!({ "text": d, "id": 1 }).to_string()).collect();
    std::fs::write(&source, lines.join("\n")).unwrap();
    let cfg = text_config(&source, &[]);
    let data = Dataset::open(&cfg.data, &cfg.model).unwrap();
    let tok = Tokenizer::load(&cfg.data.tokenizer).unwrap();
    let mut want = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            want.push(tok.eos().unwrap());
        }
        want.extend(tok.encode(d).unwrap());
    }
    let Dataset::Text { tokens, .. } = &data else { panic!("a text source") };
    assert_eq!(tokens.window(0, tokens.len()).unwrap(), want);
    // the token file goes to the cache folder, not beside the source, and is reused
    let cached = token_files(&source);
    assert_eq!(cached.len(), 1);
    assert!(
        cached[0].file_name().unwrap().to_str().unwrap().starts_with("docs.jsonl.")
            && cached[0].extension().unwrap() == "tokens"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        2,
        "the source folder holds the source and the test's cache"
    );
    Dataset::open(&cfg.data, &cfg.model).unwrap();
    assert_eq!(token_files(&source), cached);
    // a token file cut short is tokenised again
    let bytes = std::fs::read(&cached[0]).unwrap();
    std::fs::write(&cached[0], &bytes[..bytes.len() - 3]).unwrap();
    let Dataset::Text { tokens, .. } = Dataset::open(&cfg.data, &cfg.model).unwrap() else { panic!("text") };
    assert_eq!((tokens.window(0, tokens.len()).unwrap(), std::fs::read(&cached[0]).unwrap()), (want, bytes));
}

/// The header's checksum over `bytes`' ids, written into it: a token file as a run writes one.
fn sealed(mut bytes: Vec<u8>) -> Vec<u8> {
    let mut sum = ferrotron::files::Fingerprint::default();
    sum.add(&bytes[32..]);
    let words: Vec<u8> = sum.value().iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes[16..32].copy_from_slice(&words);
    bytes
}

/// A token file damaged in the cache (a block zeroed, one id changed, its checksum zeroed) or of
/// the first version (no checksum) is found in the pass that reads every id and written again
/// from the source: the run trains on the source's ids, never on the damage.
#[test]
fn a_damaged_or_first_version_token_file_is_tokenised_again() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("long.txt");
    std::fs::write(&source, "a text whose cached ids will be damaged in several ways. ".repeat(200)).unwrap();
    let cfg = text_config(&source, &["model.vocab_size=256", "data.tokenizer=\"bytes\""]);
    let ids = |cfg: &Config| {
        let Dataset::Text { tokens, .. } = Dataset::open(&cfg.data, &cfg.model).unwrap() else { panic!("text") };
        tokens.window(0, tokens.len()).unwrap()
    };
    let want = ids(&cfg);
    let file = token_files(&source)[0].clone();
    let good = std::fs::read(&file).unwrap();
    assert_eq!((&good[..8], good.len()), (&b"FTOK\x02\0\0\0"[..], 32 + 4 * want.len()));
    assert_eq!(sealed(good.clone()), good, "the header holds the ids' checksum");
    let mut zeroed = good.clone();
    zeroed[4000..8000].fill(0); // 4,000 bytes: ids 0, inside the vocabulary
    let mut one_id = good.clone();
    one_id[32 + 4 * 100] ^= 1;
    let mut no_sum = good.clone();
    no_sum[16..32].fill(0);
    // version 1: "FTOK" | 1 | count | ids, without a checksum
    let v1 = [&b"FTOK\x01\0\0\0"[..], &good[8..16], &good[32..]].concat();
    for (what, damaged) in [("zeroed", zeroed), ("one id", one_id), ("no checksum", no_sum), ("version 1", v1)] {
        std::fs::write(&file, &damaged).unwrap();
        assert!(ids(&cfg) == want, "{what}: the source's ids"); // (not assert_eq: no 40 kB dump)
        assert!(std::fs::read(&file).unwrap() == good, "{what}: written again as it was");
    }
}

#[test]
fn trains_on_tokenised_text() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("corpus.txt");
    std::fs::write(&source, "Pipeline parallelism splits layers; tensor parallelism splits matrices. ".repeat(40))
        .unwrap();
    let s = train(
        &text_config(&source, &["train.steps=30", "train.warmup_steps=3"]),
        Options { quiet: true, ..Default::default() },
    )
    .unwrap();
    assert!((s.losses[0] - 320f32.ln()).abs() < 0.2, "first loss {} is about ln(vocab)", s.losses[0]);
    assert!(s.final_loss() < s.losses[0] - 1.0, "a repeated sentence is learnt: {} → {}", s.losses[0], s.final_loss());
}

#[test]
fn text_errors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("bad.jsonl");
    std::fs::write(&source, "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n").unwrap();
    let cfg = text_config(&source, &[]);
    let err = format!("{:#}", Dataset::open(&cfg.data, &cfg.model).err().unwrap());
    assert!(err.contains("bad.jsonl line 2: no \"text\" string field"), "{err}");
    let small = text_config(&source, &["model.vocab_size=256"]);
    let err = format!("{:#}", Dataset::open(&small.data, &small.model).err().unwrap());
    assert!(err.contains("300 tokens, more than model.vocab_size = 256"), "{err}");
    assert!(
        format!("{:#}", Tokenizer::load("/nowhere/tokenizer.json").err().unwrap()).contains("/nowhere/tokenizer.json")
    );
}

#[test]
fn runs_tokenising_one_new_source_at_once_both_succeed_and_ids_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("story.txt");
    std::fs::write(&source, "Once upon a time, two runs read the same story at once. ".repeat(400)).unwrap();
    let cfg = text_config(&source, &[]);
    let opened: Vec<bool> = std::thread::scope(|s| {
        let both: Vec<_> = (0..2).map(|_| s.spawn(|| Dataset::open(&cfg.data, &cfg.model).is_ok())).collect();
        both.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_eq!(opened, [true, true]);
    let names = |d: &Path| -> Vec<String> {
        std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect()
    };
    let tokens = cache_of(&source).join("tokens");
    assert_eq!(names(&tokens).iter().filter(|n| n.ends_with(".tokens")).count(), 1, "{:?}", names(&tokens));
    assert!(!names(&tokens).iter().any(|n| n.ends_with(".tmp")), "no temporary file left");
    // a token file whose ids do not fit the model's vocabulary is refused, naming it
    let small = text_config(&source, &["model.vocab_size=320"]);
    let mut narrower = small.clone();
    narrower.model.vocab_size = 256;
    narrower.data.tokenizer = "bytes".into();
    let cache = tokens.join(names(&tokens).into_iter().find(|n| n.ends_with(".tokens")).unwrap());
    let bytes_cache = {
        Dataset::open(&narrower.data, &narrower.model).unwrap();
        let all = names(&tokens);
        tokens.join(all.into_iter().find(|n| n.ends_with(".tokens") && tokens.join(n) != cache).unwrap())
    };
    let mut b = std::fs::read(&bytes_cache).unwrap();
    b[32..36].copy_from_slice(&300u32.to_le_bytes()); // an id past the byte vocabulary, checksum and all
    std::fs::write(&bytes_cache, sealed(b)).unwrap();
    let e = format!("{:#}", Dataset::open(&narrower.data, &narrower.model).err().unwrap());
    assert!(e.contains("holds token id 300, but model.vocab_size = 256") && e.contains(".tokens"), "{e}");
}

/// An edited source is tokenised again even when its size and modification time stayed the same
/// (an editor that restores the time, a copy with `cp -p`): the token file is keyed by content.
#[test]
fn an_edit_that_keeps_size_and_time_is_seen() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("same.txt");
    let cfg = text_config(&source, &["model.vocab_size=256", "data.tokenizer=\"bytes\""]);
    let ids = |cfg: &Config| {
        let Dataset::Text { tokens, .. } = Dataset::open(&cfg.data, &cfg.model).unwrap() else { panic!("text") };
        tokens.window(0, tokens.len()).unwrap()
    };
    std::fs::write(&source, "the first version of the text").unwrap();
    let time = std::fs::metadata(&source).unwrap().modified().unwrap();
    assert_eq!(ids(&cfg), b"the first version of the text".map(u32::from));
    std::fs::write(&source, "the other version of this txt").unwrap();
    std::fs::File::options().write(true).open(&source).unwrap().set_modified(time).unwrap();
    assert_eq!(std::fs::metadata(&source).unwrap().modified().unwrap(), time);
    assert_eq!(ids(&cfg), b"the other version of this txt".map(u32::from));
    assert_eq!(token_files(&source).len(), 2);
}

/// A token file cut short under a live run (another program truncating the cache) is an error
/// naming the file at the next read, never a SIGBUS: the file is read, not mapped.
#[test]
fn a_token_file_cut_short_under_the_run_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("cut.txt");
    std::fs::write(&source, "a text long enough to be cut in half. ".repeat(50)).unwrap();
    let cfg = text_config(&source, &["model.vocab_size=256", "data.tokenizer=\"bytes\""]);
    let data = Dataset::open(&cfg.data, &cfg.model).unwrap();
    assert!(data.fingerprint().is_some_and(|f| f.len() == 32));
    let file = &token_files(&source)[0];
    std::fs::File::options().write(true).open(file).unwrap().set_len(100).unwrap();
    let Dataset::Text { tokens, .. } = &data else { panic!("a text source") };
    let e = format!("{:#}", tokens.window(tokens.len() - 10, 10).unwrap_err());
    assert!(e.contains(&file.display().to_string()) && e.contains("changed under this run"), "{e}");
    // a fresh open sees the damaged file and tokenises the source again
    let Dataset::Text { tokens: again, .. } = Dataset::open(&cfg.data, &cfg.model).unwrap() else { panic!("text") };
    assert_eq!((again.len(), again.window(0, 10).unwrap()), (tokens.len(), tokens.window(0, 10).unwrap()));
}

/// `ferrotron tokenizer` learns a byte-level BPE from a source's documents (`data/bpe.rs`): on
/// the fixture corpus it writes the tokenizer.json of the fixture, with which transformers'
/// fast tokenizer gives the ids of expected.json (tests/fixtures/make_learned_tokenizer.py, which
/// also checks the Python trainer learns the same merges); `data.tokenizer` takes it; a
/// vocabulary below the bytes and a source with no text are refused in a line.
#[test]
fn a_learned_tokenizer_is_the_one_transformers_reads() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/learned_tokenizer");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tok.json");
    let corpus = format!("text:{}", here.join("corpus.jsonl").display());
    let run = |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(args).output().unwrap();
    let made = run(&["tokenizer", "--vocab-size", "300", &corpus, "--out", out.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&made.stdout);
    assert!(made.status.success(), "{said}{}", String::from_utf8_lossy(&made.stderr));
    // what docs/cli.md quotes
    assert!(said.contains("learned 300 tokens (256 bytes, <|endoftext|>, 43 merges) from 72 documents, 6.0 kB, in "));
    assert!(said.contains("1.69 bytes a token (on the first 6.0 kB; bytes as tokens: 1.00)"), "{said}");
    let json = |p: &Path| serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(p).unwrap()).unwrap();
    assert_eq!(json(&out), json(&here.join("tokenizer.json")), "the fixture's tokenizer, learned again");
    let expected = json(&here.join("expected.json"));
    let tok = Tokenizer::load(out.to_str().unwrap()).unwrap();
    assert_eq!((tok.vocab_size() as u64, tok.eos().map(u64::from)), (300, expected["eos"].as_u64()));
    for (text, ids) in expected["texts"].as_array().unwrap().iter().zip(expected["ids"].as_array().unwrap()) {
        let want: Vec<u32> = ids.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let text = text.as_str().unwrap();
        assert_eq!(tok.encode(text).unwrap(), want, "{text}: transformers' ids");
        assert_eq!(tok.decode(&want).unwrap(), text);
    }
    // data.tokenizer takes it: the corpus is tokenised with it and trained on
    let mut sets = text_config(&tmp.path().join("unused.txt"), &[]);
    sets.data.source = corpus.clone();
    sets.data.tokenizer = out.display().to_string();
    sets.model.vocab_size = 300;
    sets.train.steps = 2;
    let data = Dataset::open(&sets.data, &sets.model).unwrap();
    assert!(data.train_tokens().unwrap() > 2000, "about 6900 bytes at 1.7 bytes a token");
    assert_eq!(train(&sets, Options { quiet: true, ..Default::default() }).unwrap().losses.len(), 2);
    // refused in a line, nothing written
    let refused = |args: &[&str], words: &[&str]| {
        let o = run(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(words.iter().all(|w| err.contains(w)) && err.lines().count() == 1, "{args:?}: {err}");
    };
    let other = tmp.path().join("other.json");
    let o = other.to_str().unwrap();
    refused(&["tokenizer", "--vocab-size", "100", &corpus, "--out", o], &["--vocab-size 100", "257"]);
    // sizes the trainer of `tokenizers` would allocate tables for (10⁹ aborted it), refused first
    for huge in ["1000000000", "18446744073709551615"] {
        refused(
            &["tokenizer", "--vocab-size", huge, &corpus, "--out", o],
            &[&format!("--vocab-size {huge}"), "at most 2097152"],
        );
    }
    refused(&["tokenizer", "--vocab-size", "300", "synthetic", "--out", o], &["SOURCE", "text:PATH"]);
    refused(&["tokenizer", "--vocab-size", "300", "text:/no/such/file.txt", "--out", o], &["/no/such/file.txt"]);
    let empty = tmp.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    refused(&["tokenizer", "--vocab-size", "300", empty.to_str().unwrap(), "--out", o], &["no text to learn from"]);
    assert!(!other.exists());
}
