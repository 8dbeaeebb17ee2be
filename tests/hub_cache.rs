//! `hub:` names resolve through the Hugging Face cache without any network: a model (weights
//! and tokenizer) and a dataset file laid out as `huggingface_hub` lays them out. (Downloads
//! themselves need the internet and are not tested here; without a network or a cached copy,
//! the error says so.) Its own test binary, because it sets HF_HOME and HF_ENDPOINT for the process.

use ferrotron::config::Config;
use ferrotron::train::{train, Options};
use std::path::Path;

/// `hub/<kind>s--org--name/refs/main` → `snapshots/<commit>/<files>`.
fn cache_repo(home: &Path, kind: &str, id: &str, files: &[(&str, &Path)]) {
    let repo = home.join("hub").join(format!("{kind}s--{}", id.replace('/', "--")));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    let snap = repo.join("snapshots/0123abcd");
    for (name, from) in files {
        std::fs::create_dir_all(snap.join(name).parent().unwrap()).unwrap();
        std::fs::copy(from, snap.join(name)).unwrap();
    }
}

#[test]
fn hub_names_resolve_from_the_cache_offline() {
    let home = tempfile::tempdir().unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let gqa = fixtures.join("gqa");
    cache_repo(
        home.path(),
        "model",
        "ferrotron/tiny-gqa",
        &[
            ("config.json", &gqa.join("config.json")),
            ("model.safetensors", &gqa.join("model.safetensors")),
            ("tokenizer.json", &fixtures.join("tokenizer/tokenizer.json")),
        ],
    );
    let corpus = home.path().join("corpus.txt");
    std::fs::write(&corpus, "The lazy fox splits the ring. ".repeat(30)).unwrap();
    cache_repo(home.path(), "dataset", "ferrotron/texts", &[("train.txt", &corpus)]);
    std::env::set_var("HF_HOME", home.path());

    // pretrained weights from the cache, and the same model through eval
    let mut cfg =
        Config::load(None, &["train.steps=1".into(), "train.seq_len=16".into(), "data.copy_lag=4".into()]).unwrap();
    cfg.model = ferrotron::checkpoint::hf::read_hf_config(&gqa.join("config.json")).unwrap();
    cfg.model.init_from = "hub:ferrotron/tiny-gqa".into();
    let quiet = Options { quiet: true, ..Default::default() };
    let from_hub = train(&cfg, quiet).unwrap().losses[0];
    cfg.model.init_from = gqa.display().to_string();
    assert_eq!(from_hub, train(&cfg, quiet).unwrap().losses[0]);

    // a dataset file and a tokenizer from the cache
    cfg.data.source = "hub:ferrotron/texts/train.txt".into();
    cfg.data.tokenizer = "hub:ferrotron/tiny-gqa".into();
    cfg.model.vocab_size = 320;
    cfg.model.init_from.clear();
    let s = train(&cfg, quiet).unwrap();
    assert!(s.losses[0].is_finite());

    // a glob of a dataset's parquet shards, listed from the cached snapshot (offline), in order
    let parquet = fixtures.join("parquet");
    cache_repo(
        home.path(),
        "dataset",
        "ferrotron/stories",
        &[
            ("data/train-1.parquet", &parquet.join("stories-1.parquet")),
            ("data/train-0.parquet", &parquet.join("stories-0.parquet")),
            ("data/test-0.parquet", &parquet.join("other.parquet")),
            ("README.md", &parquet.join("README.md")),
        ],
    );
    let files = ferrotron::data::hf_hub::dataset_files("ferrotron/stories/data/train-*.parquet").unwrap();
    let names: Vec<_> = files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["train-0.parquet", "train-1.parquet"]);
    let err = ferrotron::data::hf_hub::dataset_files("ferrotron/stories/*.csv").unwrap_err();
    assert!(format!("{err:#}").contains("no file of ferrotron/stories matches *.csv"), "{err:#}");
    cfg.data.source = "hub:ferrotron/stories/data/train-*.parquet".into();
    cfg.data.cache_dir = home.path().join("tokens").display().to_string();
    assert!(train(&cfg, quiet).unwrap().losses[0].is_finite());

    // no network and no cached copy: said in those words, with the cache's place and what to do
    std::env::set_var("HF_ENDPOINT", "http://127.0.0.1:9"); // a mirror where nothing listens: refused at once
    use ferrotron::data::hf_hub::{dataset_file, dataset_files, model_dir, tokenizer_file};
    for (what, err) in [
        ("a dataset glob", dataset_files("nobody/nothing/*.parquet").unwrap_err()),
        ("a dataset file", dataset_file("nobody/nothing/a.parquet").unwrap_err()),
        ("a model", model_dir("nobody/nothing").unwrap_err()),
        ("a tokenizer", tokenizer_file("nobody/nothing").unwrap_err()),
    ] {
        let e = format!("{err:#}");
        let cache = home.path().join("hub").display().to_string();
        assert!(
            e.contains("no network (the Hub cannot be reached) and no cached copy of") && e.contains(&cache),
            "{what}: {e}"
        );
        assert!(e.contains("then offline") && !e.contains("os error"), "{what}: {e}");
    }
    // what is cached is still found, whatever the network
    assert_eq!(dataset_files("ferrotron/stories/data/train-*.parquet").unwrap(), files);

    // a name or file that would lead out of the cache is no Hub name: refused before any lookup
    let long = "a".repeat(97);
    for bad in ["../../etc", "..", "", "a/b/c", "-a/b", "a/b.", "a--b/c", "a b/c", "/etc", long.as_str()] {
        let e = format!("{:#}", model_dir(bad).unwrap_err());
        assert!(e.contains("not a Hugging Face repository name"), "{bad:?}: {e}");
        let e = format!("{:#}", tokenizer_file(bad).unwrap_err());
        assert!(e.contains("not a Hugging Face repository name"), "{bad:?}: {e}");
    }
    for bad in ["ferrotron/texts/../../x", "ferrotron/texts//x", "ferrotron/texts/./x"] {
        let e = format!("{:#}", dataset_file(bad).unwrap_err());
        assert!(e.contains("is not a file's path inside a repository"), "{bad}: {e}");
    }
    let e = format!("{:#}", dataset_files("../x/*.parquet").unwrap_err());
    assert!(e.contains("not a Hugging Face repository name"), "{e}");
    // HF_HOME naming a file: said with the variable, not as a missing cached copy
    std::env::set_var("HF_HOME", &corpus);
    let e = format!("{:#}", dataset_file("ferrotron/texts/train.txt").unwrap_err());
    assert!(e.contains("is a file (set by HF_HOME=") && e.contains("point it at a folder"), "{e}");
}
