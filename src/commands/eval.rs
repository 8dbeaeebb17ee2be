//! # Evaluation: the mean next-token loss of a model on given tokens
//!
//! The token file holds whitespace-separated ids, one sequence per line. Each sequence predicts
//! its tokens 1.. from the ones before; the loss is the mean over every predicted token of every
//! sequence, as Hugging Face computes it with `labels = input_ids`.

use crate::model::Llama;
use anyhow::{bail, Result};
use std::path::Path;

/// Reads token sequences (one per non-empty line), checking each id against the vocabulary.
pub fn read_tokens(path: &Path, vocab_size: usize) -> Result<Vec<Vec<u32>>> {
    let text = crate::files::read_text(path, "--tokens")?;
    let mut seqs = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let mut seq = Vec::new();
        for word in line.split_whitespace() {
            match word.parse::<u32>() {
                Ok(id) if (id as usize) < vocab_size => seq.push(id),
                _ => bail!("{}:{}: `{word}` is not a token id below vocab_size {vocab_size}", path.display(), i + 1),
            }
        }
        seqs.push(seq);
    }
    if !seqs.iter().any(|s| s.len() >= 2) {
        bail!("{}: needs at least one line with two or more token ids", path.display());
    }
    Ok(seqs)
}

/// Next-token targets for a sequence: token t+1 for position t, and nothing (−1) for the last.
pub fn shifted_targets(seq: &[u32]) -> Vec<i32> {
    seq.iter().skip(1).map(|&t| t as i32).chain(std::iter::once(-1)).collect()
}

/// Mean next-token cross-entropy over all sequences, in nats.
pub fn mean_loss(model: &mut Llama, seqs: &[Vec<u32>]) -> Result<f64> {
    // the language model's loss alone: a mixture of experts' balance loss is a training aid
    let term = model.replace_loss_term(None);
    let (mut sum, mut count) = (0.0, 0usize);
    let mut each = || -> Result<()> {
        for seq in seqs.iter().filter(|s| s.len() >= 2) {
            let n = seq.len() - 1;
            sum += model.forward(seq, 1, &shifted_targets(seq))? as f64 * n as f64;
            count += n;
        }
        Ok(())
    };
    let done = each();
    model.replace_loss_term(term);
    done.map(|()| sum / count as f64)
}
