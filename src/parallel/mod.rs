//! # Parallelism: the grid, then one lesson per way of splitting the work
//!
//! Read in this order: `process_grid` (which rank is where, and its groups) → `data_parallel`
//! (same model, different data, averaged gradients) → `tensor_parallel` (each matrix split
//! across ranks) → `pipeline_parallel` (layers split into stages) → `context_parallel` (the
//! sequence split, attention as a ring). The model (`model/`) knows none of them: it asks its
//! `TensorSplit` and `SequenceSplit` (`model/split.rs`) at the points where a split model must
//! talk, and `tensor_parallel` and `context_parallel` answer with collectives.

pub mod context_parallel;
pub mod data_parallel;
pub mod pipeline_parallel;
pub mod process_grid;
pub mod tensor_parallel;
