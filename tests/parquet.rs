//! Parquet sources and shards: the documents pyarrow wrote (snappy, zstd, gzip; several row
//! groups; a null row; the text in another column) read back as pyarrow reads them; a glob or a
//! folder of shards in path order, joined by the end-of-text token; training on them; the errors,
//! each naming the file or the column.

use ferrotron::config::Config;
use ferrotron::data::documents::{read, shards, wildcard};
use ferrotron::data::text::Tokenizer;
use ferrotron::data::Dataset;
use ferrotron::train::{train, Options};
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(rel)
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("parquet/expected.json")).unwrap()).unwrap()
}

fn documents_of(shard: &Path, column: &str) -> anyhow::Result<Vec<String>> {
    let mut docs = Vec::new();
    read(shard, column, &mut |d, _| {
        docs.push(d.to_string());
        Ok(())
    })?;
    Ok(docs)
}

#[test]
fn parquet_rows_are_read_as_pyarrow_reads_them() {
    let want = expected();
    for (name, e) in want.as_object().unwrap() {
        let docs = documents_of(&fixture(&format!("parquet/{name}")), e["column"].as_str().unwrap()).unwrap();
        let wanted: Vec<&str> = e["documents"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()).collect();
        assert_eq!(docs, wanted, "{name}");
    }
    assert!(want["stories-0.parquet"]["row_groups"].as_u64().unwrap() >= 3, "the fixture spans row groups");
}

#[test]
fn a_glob_or_a_folder_names_its_shards_in_path_order() {
    let dir = fixture("parquet");
    let names = |files: Vec<PathBuf>| -> Vec<String> {
        files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect()
    };
    let glob = format!("{}/stories-*.parquet", dir.display());
    assert_eq!(names(shards(&glob).unwrap()), ["stories-0.parquet", "stories-1.parquet"]);
    let one = format!("{}/stories-?.parquet", dir.display());
    assert_eq!(names(shards(&one).unwrap()).len(), 2);
    // a folder: its data files only (the card is not data)
    assert_eq!(
        names(shards(dir.to_str().unwrap()).unwrap()),
        ["other.parquet", "stories-0.parquet", "stories-1.parquet"]
    );
    // a glob over folder levels
    let up = format!("{}/par*/other.*", dir.parent().unwrap().display());
    assert_eq!(names(shards(&up).unwrap()), ["other.parquet"]);
    assert!(wildcard(b"a*c?e", b"abbbcde") && !wildcard(b"a*c?e", b"abce") && wildcard(b"*", b""));
    for (spec, named) in [
        (format!("{}/nothing-*.parquet", dir.display()), "no file matches"),
        (fixture("tokenizer").display().to_string(), "holds no .parquet, .jsonl or .txt files"),
        ("/no/such/file.parquet".to_string(), "cannot read /no/such/file.parquet"),
    ] {
        let err = format!("{:#}", shards(&spec).unwrap_err());
        assert!(err.contains(named), "{spec}: {err}");
    }
}

fn parquet_config(source: &str, cache: &Path, extra: &[&str]) -> Config {
    let mut sets: Vec<String> = vec![
        format!("data.source=\"text:{source}\""),
        format!("data.cache_dir=\"{}\"", cache.display()),
        format!("data.tokenizer=\"{}\"", fixture("tokenizer/tokenizer.json").display()),
        "model.vocab_size=320".into(),
        "model.num_hidden_layers=1".into(),
        "train.seq_len=16".into(),
        "train.micro_batch_size=2".into(),
        "train.steps=2".into(),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    Config::load(None, &sets).unwrap()
}

/// Every document of every shard, in order, with the end-of-text token between documents.
#[test]
fn shards_are_tokenised_in_order_and_trained_on() {
    let cache = tempfile::tempdir().unwrap();
    let glob = format!("{}/stories-*.parquet", fixture("parquet").display());
    let cfg = parquet_config(&glob, cache.path(), &[]);
    let tok = Tokenizer::load(&cfg.data.tokenizer).unwrap();
    let want_docs = expected();
    let mut want = Vec::new();
    for name in ["stories-0.parquet", "stories-1.parquet"] {
        for d in want_docs[name]["documents"].as_array().unwrap() {
            if !want.is_empty() {
                want.push(tok.eos().unwrap());
            }
            want.extend(tok.encode(d.as_str().unwrap()).unwrap());
        }
    }
    let data = Dataset::open(&cfg.data, &cfg.model).unwrap();
    let Dataset::Text { tokens, .. } = &data else { panic!("a text source") };
    assert_eq!(tokens.window(0, tokens.len()).unwrap(), want);
    let s = train(&cfg, Options { quiet: true, ..Default::default() }).unwrap();
    assert!(s.losses.iter().all(|l| l.is_finite()));

    // another column is another token file, not the first one's
    let other = parquet_config(
        &fixture("parquet/other.parquet").display().to_string(),
        cache.path(),
        &["data.text_column=\"content\""],
    );
    let Dataset::Text { tokens, .. } = Dataset::open(&other.data, &other.model).unwrap() else { panic!() };
    let first = tok.encode("Column named content, compressed with gzip.").unwrap();
    assert_eq!(tokens.window(0, first.len()).unwrap(), first);
    assert_eq!(std::fs::read_dir(cache.path().join("tokens")).unwrap().count(), 2);
}

#[test]
fn parquet_errors_name_the_file_and_the_column() {
    let cache = tempfile::tempdir().unwrap();
    let other = fixture("parquet/other.parquet").display().to_string();
    let not_parquet = cache.path().join("notes.parquet");
    std::fs::write(&not_parquet, "plain text, not parquet").unwrap();
    for (source, column, named) in [
        (other.as_str(), "text", "no column \"text\" (data.text_column); it has id, content"),
        (other.as_str(), "id", "column \"id\" (data.text_column) does not hold one string a row"),
        (not_parquet.to_str().unwrap(), "text", "notes.parquet: not a parquet file"),
    ] {
        let cfg = parquet_config(source, cache.path(), &[&format!("data.text_column=\"{column}\"")]);
        let err = format!("{:#}", Dataset::open(&cfg.data, &cfg.model).err().expect("refused"));
        assert!(err.contains(named), "{source} {column}: {err}");
    }
    // a list of strings a row, `text` (its leaf `text.list.element`): named as a list, not missing
    let lists = cache.path().join("lists.parquet");
    write_list_column(&lists);
    let cfg = parquet_config(lists.to_str().unwrap(), cache.path(), &[]);
    let err = format!("{:#}", Dataset::open(&cfg.data, &cfg.model).err().expect("refused"));
    assert!(err.contains("column \"text\" (data.text_column) is a list or a group (text.list.element)"), "{err}");
    let err = Config::load(None, &["data.source=\"text:x.txt\"".into(), "data.text_column=\"\"".into()]).unwrap_err();
    assert!(format!("{err:#}").contains("data.text_column"), "{err:#}");
}

/// A parquet file whose `text` column is a list of strings a row (two rows: ["a", "b"], ["c"]).
fn write_list_column(path: &Path) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema =
        "message m { REQUIRED GROUP text (LIST) { REPEATED GROUP list { REQUIRED BYTE_ARRAY element (UTF8); } } }";
    let schema = std::sync::Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, schema, WriterProperties::builder().build().into()).unwrap();
    let mut group = writer.next_row_group().unwrap();
    while let Some(mut column) = group.next_column().unwrap() {
        let values: Vec<ByteArray> = ["a", "b", "c"].map(ByteArray::from).to_vec();
        column.typed::<ByteArrayType>().write_batch(&values, Some(&[1, 1, 1]), Some(&[0, 1, 0])).unwrap();
        column.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
}
