//! # The Llama model, forward and backward by hand
//!
//! ```text
//! tokens ─ embed ─┬─ block 0 ─ … ─ block L-1 ─ norm ─ lm_head ─ cross-entropy ─ loss
//!                 │
//! block:  x ─┬─ rmsnorm ─ q,k,v ─ rope ─ attention ─ o ─(+)─ h ─┬─ rmsnorm ─ gate,up ─ swiglu ─ down ─(+)─ out
//!            └──────────────────────────────────────────────┘   └─────────────────────────────────────┘
//! ```
//! There is no autograd: `forward` keeps what the backward will need (the `Cache`), and
//! `backward` walks the same picture right to left, returning each input gradient and
//! accumulating each parameter gradient (`Param::grad`). Every line is one op-layer call, so the
//! model runs on whatever device the op layer supports. Parameter names are Hugging Face's, so a
//! transformers checkpoint loads by name and a gradient can be compared tensor by tensor.
//!
//! Every linear layer is a tensor-parallel one (`tensor_parallel.rs`): q, k, v, gate, up and the
//! output layer column parallel, o and down row parallel, the embedding vocab parallel. On a
//! single rank (`tp` = None) their collectives vanish and this is the plain dense model.

use crate::comm::Group;
use crate::config::ModelConfig;
use crate::ops::{self, Attn};
use crate::tensor::Tensor;
use crate::tensor_parallel::{self as tp, Split, Tp};
use anyhow::Result;

/// A named weight and its gradient (same shape, accumulated by backward).
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
    /// How it is cut across the tp ranks (`value` is this rank's part).
    pub split: Split,
}

/// What a parameter is, which decides its init: matrices are N(0, std²), norm weights ones.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum ParamKind {
    Matrix,
    Norm,
}

pub struct Block {
    q_proj: Param,
    k_proj: Param,
    v_proj: Param,
    o_proj: Param,
    gate_proj: Param,
    up_proj: Param,
    down_proj: Param,
    input_layernorm: Param,
    post_attention_layernorm: Param,
}

/// The activations one block's backward needs.
struct BlockCache {
    x: Tensor,
    xn1: Tensor,
    rstd1: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn: Tensor,
    lse: Tensor,
    h: Tensor,
    xn2: Tensor,
    rstd2: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Tensor,
}

/// Everything `forward` keeps for `backward`.
struct Cache {
    tokens: Vec<u32>,
    targets: Vec<i32>,
    positions: Vec<u32>,
    attn: Attn,
    blocks: Vec<BlockCache>,
    x_final: Tensor,
    xn: Tensor,
    rstd: Tensor,
    logits: Tensor,
    lse: Tensor,
    count: usize,
}

pub struct Llama<'g> {
    pub cfg: ModelConfig,
    tp: Tp<'g>,
    /// The first vocabulary id of this rank's slice.
    vocab_first: usize,
    embed_tokens: Param,
    layers: Vec<Block>,
    norm: Param,
    /// `None` when the output layer is tied to the embedding.
    lm_head: Option<Param>,
    cache: Option<Cache>,
}

impl<'g> Llama<'g> {
    /// A fresh model on one rank: every parameter from its own (seed, name) stream (`init.rs`).
    pub fn new(cfg: &ModelConfig, seed: u64) -> Llama<'static> {
        Llama::init(cfg, seed, None)
    }

    /// This rank's shard of the same model, split over the tp group `tp`: each part is cut
    /// from the full initialised tensor, so every tp size starts from the single-rank model.
    pub fn init(cfg: &ModelConfig, seed: u64, tp: Tp<'g>) -> Llama<'g> {
        let std = cfg.initializer_range;
        Llama::build(cfg, tp, |name, shape, kind| {
            Ok(match kind {
                ParamKind::Matrix => crate::init::normal(seed, name, shape, std),
                ParamKind::Norm => crate::init::ones(shape),
            })
        })
        .expect("init cannot fail")
    }

    /// Builds the model, asking `make(name, full shape, kind)` for each parameter in Hugging Face
    /// order, and keeping this tp rank's part of it.
    pub fn build(
        cfg: &ModelConfig,
        tp: Tp<'g>,
        mut make: impl FnMut(&str, &[usize], ParamKind) -> Result<Tensor>,
    ) -> Result<Llama<'g>> {
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (q_out, kv_out) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let (index, count) = tp.map_or((0, 1), |g| (g.index(), g.size()));
        let mut param = |name: String, shape: &[usize], kind, split| -> Result<Param> {
            let value = tp::shard(&make(&name, shape, kind)?, split, index, count);
            Ok(Param { grad: Tensor::zeros(value.shape()), name, value, split })
        };
        use Split::{Cols, Replicated, Rows};
        let embed_tokens = param("model.embed_tokens.weight".into(), &[cfg.vocab_size, d], ParamKind::Matrix, Rows)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}.weight");
            layers.push(Block {
                q_proj: param(p("self_attn.q_proj"), &[q_out, d], ParamKind::Matrix, Rows)?,
                k_proj: param(p("self_attn.k_proj"), &[kv_out, d], ParamKind::Matrix, Rows)?,
                v_proj: param(p("self_attn.v_proj"), &[kv_out, d], ParamKind::Matrix, Rows)?,
                o_proj: param(p("self_attn.o_proj"), &[d, q_out], ParamKind::Matrix, Cols)?,
                gate_proj: param(p("mlp.gate_proj"), &[f, d], ParamKind::Matrix, Rows)?,
                up_proj: param(p("mlp.up_proj"), &[f, d], ParamKind::Matrix, Rows)?,
                down_proj: param(p("mlp.down_proj"), &[d, f], ParamKind::Matrix, Cols)?,
                input_layernorm: param(p("input_layernorm"), &[d], ParamKind::Norm, Replicated)?,
                post_attention_layernorm: param(p("post_attention_layernorm"), &[d], ParamKind::Norm, Replicated)?,
            });
        }
        let norm = param("model.norm.weight".into(), &[d], ParamKind::Norm, Replicated)?;
        let lm_head = match cfg.tie_word_embeddings {
            true => None,
            false => Some(param("lm_head.weight".into(), &[cfg.vocab_size, d], ParamKind::Matrix, Rows)?),
        };
        let vocab_first = index * cfg.vocab_size / count;
        Ok(Llama { cfg: cfg.clone(), tp, vocab_first, embed_tokens, layers, norm, lm_head, cache: None })
    }

    /// Every parameter, in Hugging Face order.
    pub fn params(&self) -> Vec<&Param> {
        let mut v = vec![&self.embed_tokens];
        for b in &self.layers {
            v.extend(b.params());
        }
        v.push(&self.norm);
        v.extend(self.lm_head.as_ref());
        v
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = vec![&mut self.embed_tokens];
        for b in &mut self.layers {
            v.extend(b.params_mut());
        }
        v.push(&mut self.norm);
        v.extend(self.lm_head.as_mut());
        v
    }

    pub fn zero_grads(&mut self) {
        for p in self.params_mut() {
            ops::scale(&mut p.grad, 0.0);
        }
    }

    /// Runs `batch` sequences of `tokens.len() / batch` tokens; returns the mean cross-entropy
    /// over the rows whose target is not negative. Keeps the activations for `backward`.
    pub fn forward(&mut self, tokens: &[u32], batch: usize, targets: &[i32]) -> Result<f32> {
        let (cfg, tp) = (&self.cfg, self.tp);
        let seq = tokens.len() / batch;
        let ranks = tp.map_or(1, Group::size);
        let attn = Attn {
            batch,
            seq,
            heads: cfg.num_attention_heads / ranks, // this rank's heads
            kv_heads: cfg.num_key_value_heads / ranks,
            head_dim: cfg.head_dim(),
        };
        let positions: Vec<u32> = (0..tokens.len()).map(|r| (r % seq) as u32).collect();
        let mut x = tp::embedding_forward(tp, &self.embed_tokens, tokens, self.vocab_first)?;
        let mut blocks = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let (out, cache) = layer.forward(tp, x, cfg, attn, &positions)?;
            blocks.push(cache);
            x = out;
        }
        let (xn, rstd) = ops::rmsnorm(&x, &self.norm.value, cfg.rms_norm_eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let logits = tp::column_forward(&xn, head); // this rank's slice of the vocabulary
        let (sum, count, lse) = tp::cross_entropy(tp, &logits, targets, self.vocab_first)?;
        let (tokens, targets) = (tokens.to_vec(), targets.to_vec());
        self.cache = Some(Cache { tokens, targets, positions, attn, blocks, x_final: x, xn, rstd, logits, lse, count });
        Ok((sum / count.max(1) as f64) as f32)
    }

    /// The logits of the last `forward`, `[rows, vocab]` (this rank's vocabulary slice).
    pub fn logits(&self) -> Option<&Tensor> {
        self.cache.as_ref().map(|c| &c.logits)
    }

    /// Accumulates into every `Param::grad` the gradient of `scale × loss` of the last forward.
    pub fn backward(&mut self, scale: f32) -> Result<()> {
        self.backward_with(scale, &mut |_| {})
    }

    /// `backward` that calls `ready(param)` as soon as a parameter's gradient is complete, so
    /// that data parallelism can start reducing it while the rest of backward runs.
    pub fn backward_with(&mut self, scale: f32, ready: &mut dyn FnMut(&Param)) -> Result<()> {
        let (c, tp, first) = (self.cache.take().expect("backward needs a forward first"), self.tp, self.vocab_first);
        let dlogits = tp::cross_entropy_backward(&c.logits, &c.targets, first, &c.lse, scale / c.count.max(1) as f32);
        let head = self.lm_head.as_mut().unwrap_or(&mut self.embed_tokens);
        let dxn = tp::column_backward(tp, &dlogits, &c.xn, head)?;
        self.lm_head.iter().for_each(&mut *ready); // a tied head's gradient is done with the embedding's
        let mut dx = ops::rmsnorm_backward(&dxn, &c.x_final, &self.norm.value, &c.rstd, &mut self.norm.grad);
        ready(&self.norm);
        for (layer, cache) in self.layers.iter_mut().zip(&c.blocks).rev() {
            dx = layer.backward(tp, dx, cache, &self.cfg, c.attn, &c.positions)?;
            layer.params().into_iter().for_each(&mut *ready);
        }
        tp::embedding_backward(&dx, &c.tokens, first, &mut self.embed_tokens);
        ready(&self.embed_tokens);
        Ok(())
    }
}

impl Block {
    fn params(&self) -> [&Param; 9] {
        [
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
            &self.input_layernorm,
            &self.post_attention_layernorm,
        ]
    }

    fn params_mut(&mut self) -> [&mut Param; 9] {
        [
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
            &mut self.gate_proj,
            &mut self.up_proj,
            &mut self.down_proj,
            &mut self.input_layernorm,
            &mut self.post_attention_layernorm,
        ]
    }

    fn forward(
        &self,
        tp: Tp,
        x: Tensor,
        cfg: &ModelConfig,
        attn: Attn,
        positions: &[u32],
    ) -> Result<(Tensor, BlockCache)> {
        let (eps, hd, theta) = (cfg.rms_norm_eps, attn.head_dim, cfg.rope_theta);
        // attention sub-block: q, k, v column parallel (this rank's heads), o row parallel
        let (xn1, rstd1) = ops::rmsnorm(&x, &self.input_layernorm.value, eps);
        let mut q = tp::column_forward(&xn1, &self.q_proj);
        let mut k = tp::column_forward(&xn1, &self.k_proj);
        let v = tp::column_forward(&xn1, &self.v_proj);
        ops::rope(&mut q, positions, hd, theta);
        ops::rope(&mut k, positions, hd, theta);
        let (attn_out, lse) = ops::attention(attn, &q, &k, &v);
        let mut h = tp::row_forward(tp, &attn_out, &self.o_proj)?;
        ops::add_assign(&mut h, &x);
        // MLP sub-block: gate, up column parallel (this rank's features), down row parallel
        let (xn2, rstd2) = ops::rmsnorm(&h, &self.post_attention_layernorm.value, eps);
        let gate = tp::column_forward(&xn2, &self.gate_proj);
        let up = tp::column_forward(&xn2, &self.up_proj);
        let act = ops::swiglu(&gate, &up);
        let mut out = tp::row_forward(tp, &act, &self.down_proj)?;
        ops::add_assign(&mut out, &h);
        let cache = BlockCache { x, xn1, rstd1, q, k, v, attn: attn_out, lse, h, xn2, rstd2, gate, up, act };
        Ok((out, cache))
    }

    fn backward(
        &mut self,
        tp: Tp,
        dout: Tensor,
        c: &BlockCache,
        cfg: &ModelConfig,
        attn: Attn,
        positions: &[u32],
    ) -> Result<Tensor> {
        let (hd, theta) = (attn.head_dim, cfg.rope_theta);
        // MLP sub-block, right to left
        let dact = tp::row_backward(&dout, &c.act, &mut self.down_proj);
        let (dgate, dup) = ops::swiglu_backward(&dact, &c.gate, &c.up);
        let mut dxn2 = tp::column_backward(tp, &dgate, &c.xn2, &mut self.gate_proj)?;
        ops::add_assign(&mut dxn2, &tp::column_backward(tp, &dup, &c.xn2, &mut self.up_proj)?);
        let ln2 = &mut self.post_attention_layernorm;
        let mut dh = ops::rmsnorm_backward(&dxn2, &c.h, &ln2.value, &c.rstd2, &mut ln2.grad);
        ops::add_assign(&mut dh, &dout); // the residual carries dout straight through
                                         // attention sub-block, right to left
        let dattn = tp::row_backward(&dh, &c.attn, &mut self.o_proj);
        let (mut dq, mut dk, dv) = ops::attention_backward(attn, (&c.q, &c.k, &c.v), &c.attn, &c.lse, &dattn);
        ops::rope_backward(&mut dq, positions, hd, theta);
        ops::rope_backward(&mut dk, positions, hd, theta);
        let mut dxn1 = tp::column_backward(tp, &dq, &c.xn1, &mut self.q_proj)?;
        ops::add_assign(&mut dxn1, &tp::column_backward(tp, &dk, &c.xn1, &mut self.k_proj)?);
        ops::add_assign(&mut dxn1, &tp::column_backward(tp, &dv, &c.xn1, &mut self.v_proj)?);
        let ln1 = &mut self.input_layernorm;
        let mut dx = ops::rmsnorm_backward(&dxn1, &c.x, &ln1.value, &c.rstd1, &mut ln1.grad);
        ops::add_assign(&mut dx, &dh);
        Ok(dx)
    }
}
