//! # Checkpoints: Hugging Face weights in, and our own runs saved and resumed
//!
//! `hf` reads a Hugging Face Llama folder (`config.json`, `*.safetensors`) into any layout;
//! `save` writes a run's checkpoint in the same format (plus the optimizer state and the step)
//! and resumes it, in any layout.

pub mod folder;
pub mod hf;
pub mod save;
