//! Shared by the test files that train.

/// A model small enough to train in seconds (`--set` strings).
pub const SMALL: &[&str] = &[
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "train.seq_len=32",
    "data.copy_lag=8",
];
