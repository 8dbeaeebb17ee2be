//! # The Llama model, forward and backward by hand
//!
//! ```text
//! tokens ─ embed ─ block 0 ─ … ─ block L-1 ─ norm ─ lm_head ─ cross-entropy ─ loss
//! ```
//! (A block, its attention and its MLP, is in `block.rs`.)
//! There is no autograd: `forward` keeps what the backward will need (the `Cache`), and
//! `backward` walks the same picture right to left, returning each input gradient and
//! accumulating each parameter gradient (`Param::grad`). Every line is one op-layer call, so the
//! model runs on whatever device the op layer supports. Parameter names are Hugging Face's, so a
//! transformers checkpoint loads by name and a gradient can be compared tensor by tensor.
//!
//! On one rank this is the plain dense model, and that is all a first read needs. The model is
//! also the unit every later lesson's parallelism works on, through seams it is handed and never
//! looks into: how its matrices relate to the other tensor-parallel ranks' and its tokens to the
//! rest of each sequence (`TensorSplit`, `SequenceSplit`, `split.rs`), where its weights are
//! between uses (`WeightSplit`, around each unit: `fetch` and `free`, at the end of this file),
//! which layers it holds (`LayerSplit`: `chunks`), what its blocks keep (`Keeps`) and how its
//! loss is made (`LossHead`). On one rank each is `Whole` or the plain kind. Building the
//! parameters and listing them is `llama/parts.rs`; what later lessons call on the model is in
//! their own files beside it (`llama/pipeline.rs`, `llama/zero_bubble.rs`, `llama/experts.rs`).

use crate::config::ModelConfig;
use crate::model::block::{Block, Keeps, Kept, LossTerm, Splits, TermKept};
use crate::model::param::Param;
use crate::model::split::{Deferred, Now, SequenceSplit, TensorSplit, WeightGrads, WeightSplit};
use crate::ops::tensor::Tensor;
use crate::ops::{self, Attn};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::VecDeque;
use std::ops::Range;
use std::rc::Rc;

mod decode; // generating: one step at a time, with the KV cache
pub mod experts; // lesson 20: another kind of MLP over the same weights
mod parts; // building the parameters, listing them, moving them
pub mod pipeline; // lesson 12: one pipeline stage's forward and backward
mod shapes; // what a checkpoint holds: every tensor's name, shape and tp cut
pub mod zero_bubble; // lesson 15: the weight gradients a backward left for later

/// Everything one micro-batch's `forward` keeps for its `backward`.
struct Cache {
    /// The model chunk it went through (0 unless the pipeline is interleaved).
    chunk: usize,
    /// The input tokens, on the first pipeline stage.
    tokens: Option<Vec<u32>>,
    positions: Vec<u32>,
    attn: Attn,
    blocks: Vec<Box<dyn Kept>>,
    /// The output end, on the last pipeline stage.
    head: Option<HeadCache>,
}

/// What the head keeps from forward for backward: the final norm's input and 1/rms, and what
/// the loss keeps.
struct HeadCache {
    x_final: Tensor,
    rstd: Tensor,
    loss: Box<dyn LossKept>,
    /// What the loss term keeps, when the model has one.
    term: Option<Box<dyn TermKept>>,
}

impl HeadCache {
    fn bytes(&self) -> usize {
        self.x_final.bytes() + self.rstd.bytes() + self.loss.bytes()
    }
}

/// The loss at the output end, from the final norm's output `xn` (every row, this rank's share):
/// the seam a loss that never holds the whole logits plugs into (the fused loss,
/// `fused_loss.rs`). `WholeLogits` (below) is the plain one.
pub trait LossHead {
    /// The mean loss (a one-number f32 tensor) of `xn`'s rows against `targets` (negative: no
    /// target), through `out`; and what its backward needs.
    fn forward(&self, xn: Tensor, out: OutputLayer, targets: &[i32]) -> Result<(Tensor, Box<dyn LossKept>)>;
}

/// What a loss head keeps from forward for backward.
pub trait LossKept {
    /// dxn (summed over the tp ranks) from the loss scaled by `scale`; the output layer's weight
    /// gradient goes to `dw`.
    fn backward(self: Box<Self>, scale: f32, out: OutputLayer, dw: &mut dyn WeightGrads) -> Result<Tensor>;
    fn bytes(&self) -> usize;
    /// The logits, if it keeps them whole.
    fn logits(&self) -> Option<&Tensor>;
}

/// The output layer as a loss head sees it: its weight (this rank's vocabulary slice, which
/// starts at id `first`), and the tensor split that joins the slices.
pub struct OutputLayer<'a> {
    pub weight: &'a mut Param,
    pub tp: &'a dyn TensorSplit,
    pub first: usize,
}

/// The plain loss: the whole logits (this rank's vocabulary slice of every row), kept for backward.
pub struct WholeLogits;

/// What `WholeLogits` keeps: the norm's output, the logits, their log-sum-exp, the targets.
struct Logits {
    xn: Tensor,
    logits: Tensor,
    lse: Tensor,
    targets: Vec<i32>,
}

impl LossHead for WholeLogits {
    fn forward(&self, xn: Tensor, out: OutputLayer, targets: &[i32]) -> Result<(Tensor, Box<dyn LossKept>)> {
        // column parallel: this rank's vocabulary slice of every row's logits
        let logits = out.weight.linear(&*out.tp.gather_rows(&xn)?);
        let (loss, _, lse) = out.tp.cross_entropy(&logits, targets, out.first)?;
        Ok((loss, Box::new(Logits { xn, logits, lse, targets: targets.to_vec() })))
    }
}

impl LossKept for Logits {
    fn backward(self: Box<Self>, scale: f32, out: OutputLayer, dw: &mut dyn WeightGrads) -> Result<Tensor> {
        // softmax − one-hot on this rank's vocabulary slice: local, the lse is global
        let count = self.targets.iter().filter(|&&t| t >= 0).count().max(1); // the loss is their mean
        let dlogits =
            ops::cross_entropy_backward(&self.logits, &self.targets, out.first, &self.lse, scale / count as f32);
        drop(self.logits);
        out.tp.column_backward(self.xn, vec![(dlogits, out.weight)], dw)
    }

    fn bytes(&self) -> usize {
        self.xn.bytes() + self.logits.bytes() + self.lse.bytes()
    }

    fn logits(&self) -> Option<&Tensor> {
        Some(&self.logits)
    }
}

/// A piece of the model whose weights are fetched together (`fetch`): the embedding, one block,
/// or the head.
#[derive(Clone, Copy)]
enum Unit {
    Embedding,
    Layer(usize),
    Head,
}

/// The final norm and the output layer, on the last pipeline stage.
struct Head {
    norm: Param,
    /// `None` when the output layer is tied to the embedding.
    lm_head: Option<Param>,
}

pub struct Llama<'g> {
    pub cfg: ModelConfig,
    /// The first vocabulary id of this rank's slice (0 on one rank).
    vocab_first: usize,
    /// The input end (on one rank always here).
    embed_tokens: Option<Param>,
    /// The blocks.
    layers: Vec<Block<'g>>,
    /// The final norm and the output layer (on one rank always here).
    head: Option<Head>,
    /// One per micro-batch whose forward is done and backward is not (the activation memory).
    caches: VecDeque<Cache>,
    /// Attention score entries computed since the last `take_attention_work`.
    attention_work: u64,

    // ── seams later lessons plug into — skip on a first read ──
    /// How this rank's matrices relate to the other tensor-parallel ranks' (`Whole` alone).
    tp: Box<dyn TensorSplit + 'g>,
    /// How this rank's tokens relate to the rest of each sequence (`Whole` unless cp splits it).
    seq: Box<dyn SequenceSplit + 'g>,
    /// Where the weights are between uses (`Whole` unless FSDP shards them over the dp ranks).
    weights: Rc<dyn WeightSplit + 'g>,
    /// Which of `layers` each model chunk holds: one chunk, every layer, unless a pipeline stage
    /// holds several (`LayerSplit`).
    chunks: Vec<Range<usize>>,
    /// What each block keeps for its backward (`KeepAll` unless recomputation keeps less).
    keeps: Box<dyn Keeps + 'g>,
    /// How the output end makes the loss (`WholeLogits` unless another is plugged in).
    loss: Box<dyn LossHead + 'g>,
    /// A term the blocks' MLPs add to the loss (`Mlps::loss_term`; `None` for Llama's).
    term: Option<Box<dyn LossTerm + 'g>>,
    /// What a backward's `WeightGrads` deferred, per model chunk, until its W (empty unless a
    /// zero-bubble pipeline keeps them).
    deferred: VecDeque<(usize, Box<dyn Deferred>)>,
}

impl<'g> Llama<'g> {
    /// Runs `batch` sequences of `tokens.len() / batch` tokens through the whole model; returns
    /// the mean cross-entropy over the rows whose target is not negative. Keeps the activations
    /// for `backward`, dropping those of earlier forwards that had none (as in evaluation).
    pub fn forward(&mut self, tokens: &[u32], batch: usize, targets: &[i32]) -> Result<f32> {
        Ok(self.forward_loss(tokens, batch, targets)?.to_vec()[0]) // on a GPU, a wait for it
    }

    /// `forward`, with the loss left where it was computed: a one-number tensor (on a GPU, the
    /// training loop adds the micro-batches' losses there and reads the step's once).
    pub fn forward_loss(&mut self, tokens: &[u32], batch: usize, targets: &[i32]) -> Result<Tensor> {
        self.caches.clear();
        if self.embed_tokens.is_none() || !self.ends_with_head(0) {
            bail!("forward: this model is one pipeline stage, not the whole model");
        }
        let x = self.embed(tokens)?;
        self.forward_layers(0, x, Some(tokens.to_vec()), batch, targets)
    }

    /// Whether model chunk `chunk` ends the model: the head comes after it.
    fn ends_with_head(&self, chunk: usize) -> bool {
        self.head.is_some() && chunk + 1 == self.chunks.len()
    }

    /// The model's input rows: the embedding of `tokens`.
    fn embed(&mut self, tokens: &[u32]) -> Result<Tensor> {
        self.fetch(Unit::Embedding, true)?;
        let embed = self.embed_tokens.as_ref().context("forward: tokens given to a model without the embedding")?;
        let x = self.tp.embedding_forward(embed, tokens, self.vocab_first)?;
        self.free(Unit::Embedding);
        Ok(x)
    }

    /// `x` (`batch` sequences' rows) through the layers of model chunk `chunk` — every layer, on
    /// one rank — then, where the chunk ends the model, the head: returns the mean loss against
    /// `targets`, or else the last layer's output. `tokens`: those `x` embeds, if it does (their
    /// backward needs them). The activations stay until this micro-batch's backward.
    fn forward_layers(
        &mut self,
        chunk: usize,
        mut x: Tensor,
        tokens: Option<Vec<u32>>,
        batch: usize,
        targets: &[i32],
    ) -> Result<Tensor> {
        let seq = x.rows() * self.tp.row_share() / batch; // this rank's tokens of each sequence
        let ranks = self.tp.part().1;
        let cfg = &self.cfg;
        let attn = Attn {
            batch,
            seq,
            kv_seq: seq,
            heads: cfg.num_attention_heads / ranks, // this rank's heads
            kv_heads: cfg.kv_heads_on(ranks),       // its KV heads, or the one it holds a copy of
            head_dim: cfg.head_dim(),
        };
        let seq_positions = self.seq.positions(seq);
        let positions: Vec<u32> = (0..batch * seq).map(|r| seq_positions[r % seq]).collect();
        let mut blocks = Vec::with_capacity(self.layers.len());
        for i in self.chunks[chunk].clone() {
            self.fetch(Unit::Layer(i), true)?;
            let split = Splits { tp: &*self.tp, seq: &*self.seq };
            let keep = (&self.cfg, &*self.keeps);
            let (out, cache, work) = self.layers[i].forward(split, x, keep, attn, &positions)?;
            self.free(Unit::Layer(i));
            self.attention_work += work;
            blocks.push(cache);
            x = out;
        }
        if !self.ends_with_head(chunk) {
            self.caches.push_back(Cache { chunk, tokens, positions, attn, blocks, head: None });
            return Ok(x);
        }
        let (loss, head) = self.head_forward(x, targets)?;
        self.caches.push_back(Cache { chunk, tokens, positions, attn, blocks, head: Some(head) });
        Ok(loss)
    }

    /// The logits of the last `forward`, `[rows, vocab]` (this rank's vocabulary slice).
    pub fn logits(&self) -> Option<&Tensor> {
        self.caches.back()?.head.as_ref()?.loss.logits() // `None` where the loss never holds them whole
    }

    /// Accumulates into every `Param::grad` the gradient of `scale × loss` of the last forward.
    pub fn backward(&mut self, scale: f32) -> Result<()> {
        self.backward_with(scale, &mut |_| {})
    }

    /// `backward` that calls `ready(param)` as soon as a parameter's gradient is complete, so
    /// that data parallelism can start reducing it while the rest of backward runs.
    pub fn backward_with(&mut self, scale: f32, ready: &mut dyn FnMut(&mut Param)) -> Result<()> {
        self.backward_layers(0, (scale, None), &mut Now, ready).map(drop)
    }

    /// Zeroes every gradient (one freed once handed over, ZeRO-2/3's, stays freed; a trained
    /// part's gradient is freed: the step's reduce makes it again).
    pub fn zero_grads(&mut self) {
        let mut params = self.params_mut();
        for p in params.iter_mut() {
            if let Some(t) = &mut p.trained_part {
                *t.trained().1 = Tensor::zeros(&[0]);
            }
        }
        let mut grads: Vec<&mut Tensor> = params.into_iter().map(|p| &mut p.grad).filter(|g| g.numel() > 0).collect();
        ops::fill_zeros(&mut grads); // on a GPU, a launch per 64 gradients
    }

    /// The backward of the oldest micro-batch whose forward through model chunk `chunk` is done,
    /// from `scale × loss` where the chunk ends with the head, else from `dy` (the gradient of
    /// the chunk's output). Returns the gradient of the chunk's input (`None` where its input was
    /// tokens). Each weight GEMM goes to `dw` (`split.rs`): with `Now` every gradient is made here,
    /// and `ready(param)` hears each parameter as soon as its gradient is complete.
    fn backward_layers(
        &mut self,
        chunk: usize,
        (scale, dy): (f32, Option<Tensor>),
        dw: &mut dyn WeightGrads,
        ready: &mut dyn FnMut(&mut Param),
    ) -> Result<Option<Tensor>> {
        let oldest = self.caches.iter().position(|c| c.chunk == chunk);
        let mut c = oldest
            .and_then(|at| self.caches.remove(at))
            .ok_or_else(|| anyhow!("backward: no forward through chunk {chunk} is waiting for its backward"))?;
        let first = self.vocab_first;
        // each part of the cache is dropped as soon as its backward is done: the activations
        // held shrink while the gradients grow
        let mut dx = match (dy, c.head.take()) {
            (None, Some(hc)) => self.head_backward(hc, scale, dw, ready)?,
            (Some(dy), None) => dy,
            _ => bail!("backward: the loss's gradient starts where the head is, an output's gradient elsewhere"),
        };
        for i in self.chunks[chunk].clone().rev() {
            self.fetch(Unit::Layer(i), false)?;
            let split = Splits { tp: &*self.tp, seq: &*self.seq };
            let cache = c.blocks.pop().expect("one cache per layer");
            let attn = (c.attn, &c.positions[..]);
            dx = self.layers[i].backward(split, dx, cache, &self.cfg, attn, dw)?;
            self.layers[i].params_mut().into_iter().for_each(&mut *ready);
            self.free(Unit::Layer(i));
        }
        match (&c.tokens, &mut self.embed_tokens) {
            (Some(tokens), Some(embed)) => {
                embed.ensure_grad(); // the embedding's backward reads no weight: nothing to gather
                let dx = self.tp.gather_rows(&dx)?; // sequence parallel: every row's gradient
                dw.embedding(embed, dx, tokens, first); // local: this rank's ids
                ready(embed);
                Ok(None)
            }
            _ => Ok(Some(dx)),
        }
    }
}

// ── the output end: final norm, output layer, loss ──
//
// x ─ rmsnorm ─ xn ─ lm_head: logits = xn · Wᵀ [rows, vocab] ─ log-softmax ─ loss = mean(lse − z)
// backward:  dlogits = (softmax − one-hot) · scale / count;  dxn = dlogits · W;  dW += dlogitsᵀ · xn
//
// Vocab-parallel: each tp rank holds a slice of the vocabulary, computes its slice of every row's
// logits, and the row statistics (max, Σexp, the target's logit) are summed over the ranks.
impl Llama<'_> {
    /// The final norm, the output layer and the loss of `x` against `targets`: the mean loss
    /// (a one-number f32 tensor) and what backward needs.
    fn head_forward(&mut self, x: Tensor, targets: &[i32]) -> Result<(Tensor, HeadCache)> {
        self.fetch(Unit::Head, true)?;
        let h = self.head.as_mut().expect("the last stage has the head");
        let (xn, rstd) = ops::rmsnorm(&x, &h.norm.value, self.cfg.rms_norm_eps);
        let weight = h.lm_head.as_mut().or(self.embed_tokens.as_mut()).expect("a tied head has the embedding");
        let out = OutputLayer { weight, tp: &*self.tp, first: self.vocab_first };
        let (mut loss, kept) = self.loss.forward(xn, out, targets)?;
        let term = self.term.as_ref().map(|t| t.add(&mut loss)).transpose()?;
        self.free(Unit::Head);
        Ok((loss, HeadCache { x_final: x, rstd, loss: kept, term }))
    }

    /// The head's backward from the loss scaled by `scale`: returns dx; the output layer's
    /// weight GEMM goes to `dw`.
    fn head_backward(
        &mut self,
        hc: HeadCache,
        scale: f32,
        dw: &mut dyn WeightGrads,
        ready: &mut dyn FnMut(&mut Param),
    ) -> Result<Tensor> {
        self.fetch(Unit::Head, false)?;
        hc.term.into_iter().for_each(|t| t.backward(scale));
        let h = self.head.as_mut().expect("the last stage has the head");
        let weight = h.lm_head.as_mut().or(self.embed_tokens.as_mut()).expect("a tied head has the embedding");
        let dxn = hc.loss.backward(scale, OutputLayer { weight, tp: &*self.tp, first: self.vocab_first }, dw)?;
        h.lm_head.iter_mut().for_each(&mut *ready); // a tied head's gradient is done with the embedding's
        let dx = ops::rmsnorm_backward(&dxn, &hc.x_final, &h.norm.value, &hc.rstd, &mut h.norm.grad, None);
        ready(&mut h.norm);
        self.free(Unit::Head);
        Ok(dx)
    }
}

// ── the weights' units: a seam later lessons plug into — skip on a first read ──
//
// `forward` and `backward` fetch each unit's weights from the `WeightSplit` before it computes
// and free them after. With `Whole` both do nothing but, before a backward, make sure each
// gradient exists; under ZeRO-3 a rank keeps 1/dp of every weight, and FSDP
// (`parallel/fsdp.rs`) gathers a unit's whole weights here and starts the next unit's gather
// (which unit holds what, and which comes next: `unit` and `after`, below).
//
//   forward:   Embedding → Layer(0) → … → Layer(L-1) → Head       (each fetch prefetches the next)
//   backward:  Head → Layer(L-1) → … → Layer(0)                   (the embedding's needs no weight)
impl Llama<'_> {
    /// `u`'s whole weights, here before it computes (and, for a backward, its gradients to add
    /// into); the gather of the unit after it starts now.
    fn fetch(&mut self, u: Unit, forward: bool) -> Result<()> {
        let weights = self.weights.clone();
        weights.gather(&mut self.unit_mut(u))?;
        if !forward {
            self.unit_mut(u).into_iter().for_each(Param::ensure_grad);
        }
        match self.after(u, forward) {
            Some(next) => weights.prefetch(&self.unit(next)),
            None => Ok(()),
        }
    }

    /// After `u` computed: its whole weights may go.
    fn free(&mut self, u: Unit) {
        let weights = self.weights.clone();
        weights.release(&mut self.unit_mut(u));
    }

    /// A unit's parameters: the embedding; a block's; the head's (the final norm and the output
    /// layer, which is the embedding when they are tied).
    fn unit(&self, u: Unit) -> Vec<&Param> {
        match u {
            Unit::Embedding => self.embed_tokens.iter().collect(),
            Unit::Layer(i) => self.layers[i].params(),
            Unit::Head => self
                .head
                .iter()
                .flat_map(|h| [Some(&h.norm), h.lm_head.as_ref().or(self.embed_tokens.as_ref())])
                .flatten()
                .collect(),
        }
    }

    fn unit_mut(&mut self, u: Unit) -> Vec<&mut Param> {
        match u {
            Unit::Embedding => self.embed_tokens.iter_mut().collect(),
            Unit::Layer(i) => self.layers[i].params_mut(),
            Unit::Head => {
                let Some(h) = &mut self.head else { return Vec::new() };
                vec![Some(&mut h.norm), h.lm_head.as_mut().or(self.embed_tokens.as_mut())]
                    .into_iter()
                    .flatten()
                    .collect()
            }
        }
    }

    /// The unit computed after `u` in a forward (`forward` true) or a backward of this stage.
    /// A backward never gathers the embedding: its gradient needs only the tokens.
    /// (With the interleaved pipeline, within the model chunk of `u`: the next chunk's turn
    /// comes later.)
    fn after(&self, u: Unit, forward: bool) -> Option<Unit> {
        let (layers, head) = (self.layers.len(), self.head.is_some());
        let chunk = |i: usize| self.chunks.iter().find(|c| c.contains(&i)).cloned().unwrap_or(0..layers);
        match (u, forward) {
            (Unit::Embedding, true) => Some(Unit::Layer(0)),
            (Unit::Layer(i), true) if i + 1 < chunk(i).end => Some(Unit::Layer(i + 1)),
            (Unit::Layer(i), true) => (head && chunk(i).end == layers).then_some(Unit::Head),
            (Unit::Head, false) => Some(Unit::Layer(layers - 1)),
            (Unit::Layer(i), false) => (i > chunk(i).start).then(|| Unit::Layer(i - 1)),
            _ => None,
        }
    }
}
