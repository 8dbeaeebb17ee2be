//! Bad input gets one clear line naming the field or file, never a panic.

use ferrotron::checkpoint::hf as checkpoint;
use ferrotron::config::Config;
use std::path::Path;
use std::process::Command;

/// The one-line message of an error that must happen.
fn err<T>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.err().expect("this input must be rejected"))
}

fn config_error(sets: &[&str]) -> String {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    err(Config::load(None, &sets))
}

#[test]
fn unknown_key_is_named() {
    let e = config_error(&["model.hiden_size=64"]);
    assert!(e.contains("hiden_size") && e.contains("model"), "{e}");
    let e = config_error(&["trian.steps=3"]);
    assert!(e.contains("trian"), "{e}");
}

/// A key renamed since configs and checkpoints could first say it (`train.loss_chunk_rows`, now
/// `train.loss_stripe_rows`) still means the new one, from a file, a `--set` or a checkpoint's
/// recorded config; a file that gives both names is refused in one line.
#[test]
fn an_old_key_name_still_reads() {
    let set = Config::load(None, &["train.loss_chunk_rows=16".to_string()]).unwrap();
    assert_eq!(set.train.loss_stripe_rows, 16);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("old.toml");
    std::fs::write(&file, "[train]\nloss_chunk_rows = 8\n").unwrap();
    assert_eq!(Config::load(Some(&file), &[]).unwrap().train.loss_stripe_rows, 8);
    let recorded = Config::from_recorded("[model]\n[data]\n[train]\nloss_chunk_rows = 24\n")
        .expect("an older checkpoint's config");
    assert_eq!(recorded.train.loss_stripe_rows, 24);
    std::fs::write(&file, "[train]\nloss_chunk_rows = 8\nloss_stripe_rows = 4\n").unwrap();
    let e = err(Config::load(Some(&file), &[]));
    assert!(e.contains("old.toml") && e.contains("`train.loss_chunk_rows` is the old name of"), "{e}");
}

#[test]
fn wrong_type_is_named() {
    let e = config_error(&["train.steps=\"many\""]);
    assert!(
        e.contains("train.steps = \"many\"") || e.contains("train.steps`: is \"many\"; expected a whole number"),
        "{e}"
    );
    let e = config_error(&["model.tie_word_embeddings=3"]);
    assert!(e.contains("model.tie_word_embeddings"), "{e}");
}

#[test]
fn impossible_model_shapes() {
    let e = config_error(&["model.hidden_size=100", "model.num_attention_heads=8"]);
    assert!(e.contains("model.hidden_size = 100 is not divisible by model.num_attention_heads = 8"), "{e}");
    let e = config_error(&["model.num_key_value_heads=3"]);
    assert!(e.contains("not a multiple of model.num_key_value_heads = 3"), "{e}");
    let e = config_error(&["model.head_dim=7"]);
    assert!(e.contains("head_dim = 7 must be even"), "{e}");
}

#[test]
fn bad_values_are_named() {
    assert!(config_error(&["train.steps=0"]).contains("train.steps = 0"));
    assert!(config_error(&["parallel.cp=0"]).contains("parallel.cp = 0"));
    // one token has no next token: refused, not a division by zero in the loss (issue 40)
    let e = config_error(&["train.seq_len=1", "data.copy_prob=0"]);
    assert!(e.contains("train.seq_len = 1") && e.contains("2 or more"), "{e}");
    assert!(config_error(&["parallel.tp=3"]).contains("parallel.tp = 3 does not divide model.num_attention_heads = 8"));
    // more ranks than KV heads share them (tp a multiple of the KV heads); neither is refused
    let kv = ["model.num_attention_heads=12", "model.num_key_value_heads=3", "model.head_dim=16", "parallel.tp=4"];
    assert!(config_error(&kv).contains("parallel.tp = 4 with model.num_key_value_heads = 3"));
    assert!(Config::load(None, &["parallel.tp=8".to_string()]).is_ok(), "tp 8 over 4 KV heads: two copies each");
    assert!(config_error(&["parallel.tp=2", "model.intermediate_size=383"]).contains("model.intermediate_size = 383"));
    assert!(config_error(&["parallel.tp=0"]).contains("parallel.tp = 0"));
    assert!(config_error(&["parallel.pp_schedule=\"gpipe\""]).contains("parallel.pp_schedule"));
    assert!(config_error(&["device.kind=\"tpu\""]).contains("device.kind"));
    assert!(config_error(&["data.source=\"wiki\""]).contains("data.source = \"wiki\""));
    assert!(config_error(&["data.source=\"text:x.txt\""]).contains("model.vocab_size must be at least 256"));
    assert!(config_error(&["train.lr=-1.0"]).contains("train.lr"));
    assert!(config_error(&["train.steps"]).contains("expected section.key=value"));
    assert!(config_error(&["parallel.timeout_s=0"]).contains("parallel.timeout_s = 0"));
    assert!(config_error(&["parallel.timeout_s=1e-9"]).contains("from 1 to"), "a nanosecond is no timeout");
    // a --set holding a second line: refused, not half-read (the second key was dropped)
    let e = config_error(&["train.steps=2\ntrain.lr=5"]);
    assert!(e.contains("--set") && e.contains("holds more"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
    assert!(config_error(&["parallel.backend=\"mpi\""]).contains("parallel.backend"));
    assert!(config_error(&["device.dtype=\"f16\""]).contains("device.dtype"));
    for dtype in ["bf16", "fp8"] {
        // the CPU emulates both (the GEMMs' rounding): settings, not errors
        assert!(Config::load(None, &[format!("device.dtype=\"{dtype}\"")]).is_ok(), "{dtype} on the CPU");
    }
    let e = config_error(&["device.kind=\"cuda\"", "device.dtype=\"fp8\"", "model.intermediate_size=200"]);
    assert!(e.contains("model.intermediate_size / parallel.tp = 200: cuBLASLt's FP8 GEMMs need"), "{e}");
    let e = config_error(&["device.kind=\"cuda\"", "model.head_dim=768"]);
    assert!(e.contains("model.head_dim = 768: the CUDA attention kernels take heads up to 640"), "{e}");
    assert!(Config::load(None, &["device.kind=\"cuda\"".into(), "model.head_dim=256".into()]).is_ok(), "a 256 head");
    // latent attention's core is as wide as the wider of its query/key and value heads
    let mla =
        ["device.kind=\"cuda\"", "model.num_key_value_heads=8", "model.kv_lora_rank=8", "model.qk_nope_head_dim=16"];
    let e = config_error(&[&mla[..], &["model.qk_rope_head_dim=8", "model.v_head_dim=700"]].concat());
    assert!(e.contains("model.head_dim = 700"), "{e}");
}

#[test]
fn bad_mixtures_of_experts_are_named() {
    let moe = ["model.num_local_experts=4", "model.num_experts_per_tok=2"];
    let with = |more: &[&str]| config_error(&moe.iter().chain(more).copied().collect::<Vec<_>>());
    assert!(config_error(&["model.num_experts_per_tok=2"]).contains("with model.num_local_experts = 0"));
    assert!(config_error(&["model.num_local_experts=4", "model.num_experts_per_tok=5"])
        .contains("between 1 and model.num_local_experts = 4"));
    assert!(config_error(&["model.num_local_experts=4"]).contains("model.num_experts_per_tok = 0"));
    assert!(
        config_error(&["parallel.ep=2", "parallel.dp=2"]).contains("parallel.ep = 2 with model.num_local_experts = 0")
    );
    assert!(with(&["parallel.ep=2"]).contains("parallel.ep = 2 does not divide parallel.dp × parallel.cp = 1"));
    assert!(with(&["parallel.ep=3", "parallel.dp=3"]).contains("does not divide model.num_local_experts = 4"));
    assert!(with(&["parallel.ep=0"]).contains("parallel.ep = 0"));
    assert!(with(&["model.router_aux_loss_coef=-1.0"]).contains("model.router_aux_loss_coef = -1"));
    assert!(
        with(&["model.router_aux_loss_coef=0.01", "parallel.pp=2"]).contains("router_aux_loss_coef > 0 with pp, cp")
    );
}

#[test]
fn a_cuda_run_without_a_gpu_says_so() {
    if ferrotron::cuda::runtime::device_count().is_ok_and(|n| n > 0) {
        return; // there is a GPU: tests/training_gpu.rs trains on it
    }
    let cfg = Config::load(None, &["device.kind=\"cuda\"".to_string()]).unwrap();
    let e = err(ferrotron::train::train(&cfg, Default::default()));
    assert!(e.contains("CUDA driver") || e.contains("no GPU"), "{e}");
}

#[test]
fn missing_files_are_named() {
    let e = err(Config::load(Some(Path::new("no/such.toml")), &[]));
    assert!(e.contains("no/such.toml"), "{e}");
    let e = err(checkpoint::load_hf(Path::new("no/such/model")));
    assert!(e.contains("no/such/model/config.json"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("gqa/config.json"), dir.path().join("config.json")).unwrap();
    let e = err(checkpoint::load_hf(dir.path()));
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn corrupt_safetensors_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("gqa/config.json"), dir.path().join("config.json")).unwrap();
    let good = std::fs::read(fixture("gqa/model.safetensors")).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), &good[..good.len() / 2]).unwrap();
    let e = err(checkpoint::load_hf(dir.path()));
    assert!(e.contains("model.safetensors: not a valid safetensors file"), "{e}");
    // two intact tensors sharing their bytes (aliased offsets): said so, not "outside the file"
    let header = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let file = [&(header.len() as u64).to_le_bytes()[..], header.as_bytes(), &[0u8; 16]].concat();
    std::fs::write(dir.path().join("aliased.safetensors"), file).unwrap();
    let e = err(checkpoint::read_safetensors(&dir.path().join("aliased.safetensors")));
    assert!(e.contains("do not start where the tensor before it ends") && !e.contains("outside the file"), "{e}");
}

#[test]
fn checkpoint_shape_mismatch_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = std::fs::read_to_string(fixture("gqa/config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("\"intermediate_size\": 40", "\"intermediate_size\": 44"),
    )
    .unwrap();
    std::fs::copy(fixture("gqa/model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let e = err(checkpoint::load_hf(dir.path()));
    assert!(e.contains("gate_proj.weight has shape [40, 32], but the config needs [44, 32]"), "{e}");
}

#[test]
fn config_json_values_of_the_wrong_type_are_named() {
    let gqa = std::fs::read_to_string(fixture("gqa/config.json")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    // every kind of key: a number as a string (as some exported configs have), a size as a float,
    // a flag as a string, a nested number, a name as a number
    for (from, to, named) in [
        ("\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": \"1e-05\"", "rms_norm_eps = \"1e-05\" is not a number"),
        (
            "\"rope_theta\": 10000.0",
            "\"rope_theta\": \"500000.0\"",
            "rope_parameters.rope_theta = \"500000.0\" is not a number",
        ),
        ("\"hidden_size\": 32", "\"hidden_size\": 32.5", "hidden_size = 32.5 is not a whole number"),
        (
            "\"num_key_value_heads\": 2",
            "\"num_key_value_heads\": \"2\"",
            "num_key_value_heads = \"2\" is not a whole number",
        ),
        (
            "\"tie_word_embeddings\": false",
            "\"tie_word_embeddings\": \"false\"",
            "tie_word_embeddings = \"false\" is not true or false",
        ),
        ("\"model_type\": \"llama\"", "\"model_type\": 7", "model_type = 7 is not a string"),
        ("\"hidden_size\": 32", "\"hidden_size\": -32", "hidden_size = -32 is not a whole number"),
    ] {
        assert!(gqa.contains(from), "the fixture has {from}");
        std::fs::write(&path, gqa.replace(from, to)).unwrap();
        let e = err(checkpoint::read_hf_config(&path));
        assert!(e.contains(named) && e.contains("config.json"), "{to}: {e}");
    }
    // null is absent: the default
    std::fs::write(&path, gqa.replace("\"head_dim\": 8", "\"head_dim\": null")).unwrap();
    assert_eq!(checkpoint::read_hf_config(&path).unwrap().head_dim, None);
}

/// The binary prints exactly one `error:` line and exits with status 1.
fn cli_error(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron")).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: not one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

#[test]
fn cli_errors_are_one_line() {
    assert!(cli_error(&["train", "--set", "model.num_attention_heads=5"]).contains("num_attention_heads"));
    assert!(cli_error(&["train", "--config", "missing.toml"]).contains("missing.toml"));
    assert!(cli_error(&["eval", "--model", "nowhere", "--tokens", "t.txt"]).contains("nowhere/config.json"));
    let e = cli_error(&[
        "eval",
        "--model",
        fixture("gqa").to_str().unwrap(),
        "--tokens",
        fixture("gqa/config.json").to_str().unwrap(),
    ]);
    assert!(e.contains("config.json:1") && e.contains("is not a token id"), "{e}");
}

/// A UTF-8 byte-order mark at the start of a text file (a Windows editor's) is no part of it: a
/// config and a `config.json` with one read as without (both failed at line 1, column 1 before).
#[test]
fn a_byte_order_mark_is_read_past() {
    let dir = tempfile::tempdir().unwrap();
    let bom = |text: &[u8]| [&b"\xef\xbb\xbf"[..], text].concat();
    let toml = dir.path().join("c.toml");
    std::fs::write(&toml, bom(b"[train]\nsteps = 7\n")).unwrap();
    assert_eq!(Config::load(Some(&toml), &[]).unwrap().train.steps, 7);
    let json = dir.path().join("config.json");
    std::fs::write(&json, bom(&std::fs::read(fixture("gqa/config.json")).unwrap())).unwrap();
    let plain = checkpoint::read_hf_config(&fixture("gqa/config.json")).unwrap();
    assert_eq!(checkpoint::read_hf_config(&json).unwrap().hidden_size, plain.hidden_size);
}

/// The operating system's own phrases never reach the user bare: "No such file or directory
/// (os error 2)", "Not a directory (os error 20)", "File exists (os error 17)" are said plainly.
#[test]
fn os_errors_are_said_in_plain_words() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let f = file.display();
    for (args, want) in [
        (vec!["train".to_string(), "--resume".into(), format!("{f}-missing")], "no such file or folder"),
        (vec!["train".into(), "--config".into(), format!("{f}/c.toml")], "a part of the path is a file, not a folder"),
        (vec!["train".into(), "--metrics".into(), format!("{f}/m.jsonl")], "cannot create folder"),
        (
            vec![
                "train".into(),
                "--set".into(),
                format!("checkpoint.dir=\"{f}\""),
                "--set".into(),
                "checkpoint.every=1".into(),
            ],
            "a file is already there",
        ),
    ] {
        let e = cli_error(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(e.contains(want) && !e.contains("os error"), "{args:?}: {e}");
    }
}

fn fixture(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}

/// `[model.rope_scaling]` is a table inside a section: its built-in values are plain RoPE
/// (`RopeScaling::PLAIN`), a `--set` reaches its keys (`model.rope_scaling.factor`), and a key
/// the chosen kind does not read, or a kind without what it needs, is refused naming the key.
#[test]
fn rope_scaling_is_set_by_its_keys_and_checked_by_its_kind() {
    use ferrotron::config::{RopeScaling, RopeType};
    let plain = Config::load(None, &[]).unwrap();
    assert_eq!(plain.model.rope_scaling, RopeScaling::PLAIN);
    let sets: Vec<String> = [
        "model.rope_scaling.rope_type=\"yarn\"",
        "model.rope_scaling.factor=4",
        "model.rope_scaling.original_max_position_embeddings=64",
    ]
    .map(String::from)
    .to_vec();
    let yarn = Config::load(None, &sets).unwrap().model.rope_scaling;
    assert_eq!((yarn.rope_type, yarn.factor, yarn.original_max_position_embeddings), (RopeType::Yarn, 4.0, 64));
    let e = config_error(&["model.rope_scaling.factor=4"]);
    assert!(e.contains("model.rope_scaling.factor = 4") && e.contains("does not read it"), "{e}");
    let e = config_error(&["model.rope_scaling.rope_type=\"llama3\"", "model.rope_scaling.factor=8"]);
    assert!(e.contains("model.rope_scaling.original_max_position_embeddings = 0"), "{e}");
    let e = config_error(&["model.rope_scaling.rope_type=\"ntk\""]);
    assert!(e.contains("rope_scaling.rope_type") && e.contains("`yarn`"), "{e}");
    let e = config_error(&["model.rope_scaling.fctor=2"]);
    assert!(e.contains("fctor"), "{e}");
    let e = config_error(&["model.rope_theta.x=2"]);
    assert!(e.contains("model.rope_theta") && e.contains("not a table"), "{e}");
}

/// What each numeric flag of every command says to a negative number, parsed by `table`: `-1`
/// given to a flag must be read as its value (refused naming the flag where the flag is a count),
/// never as a flag of its own (clap's "unexpected argument '-1'", which names no flag).
fn negative_number_errors(table: clap::Command) -> Vec<String> {
    use std::any::TypeId;
    let counts = [TypeId::of::<usize>(), TypeId::of::<u64>(), TypeId::of::<u32>()];
    let numbers = [&counts[..], &[TypeId::of::<f32>(), TypeId::of::<f64>()]].concat();
    let mut problems = Vec::new();
    for sub in table.get_subcommands() {
        let of = |a: &clap::Arg, types: &[TypeId]| types.iter().any(|t| a.get_value_parser().type_id() == *t);
        for arg in sub.get_arguments().filter(|a| of(a, &numbers)) {
            let flag = format!("--{}", arg.get_long().unwrap());
            let said = match table.clone().try_get_matches_from(["ferrotron", sub.get_name(), &flag, "-1"]) {
                Err(e) => e.render().to_string(),
                Ok(_) => String::new(),
            };
            let count = of(arg, &counts);
            if said.contains("unexpected argument '-1'") || count && !said.contains(&flag) {
                problems.push(format!("{} {flag} -1: {}", sub.get_name(), said.lines().next().unwrap_or("")));
            }
        }
    }
    problems
}

#[test]
fn a_negative_number_to_any_numeric_flag_is_refused_naming_the_flag() {
    let table = ferrotron::commands::cli::command();
    let flags = table.get_subcommands().flat_map(|s| s.get_arguments()).filter(|a| a.get_long() == Some("steps"));
    assert!(flags.count() >= 2, "the walk sees the numeric flags");
    assert_eq!(negative_number_errors(table), Vec::<String>::new());
    // planted: the table as clap makes it, which reads `-1` as a flag
    let planted = negative_number_errors(<ferrotron::commands::cli::Cli as clap::CommandFactory>::command());
    assert!(planted.iter().any(|p| p.starts_with("bench --steps -1")), "{planted:?}");
}
