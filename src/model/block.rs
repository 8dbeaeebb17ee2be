//! # One transformer block, forward and backward
//!
//! ```text
//! x ─┬─ rmsnorm ─ q,k,v ─ rope ─ attention ─ o ─(+)─ h ─┬─ rmsnorm ─ gate,up ─ swiglu ─ down ─(+)─ out
//!    └──────────────────────────────────────────────┘   └─────────────────────────────────────┘
//! ```
//! `forward` keeps what `backward` needs (the `BlockCache`); `backward` walks the picture right to
//! left, returning dx and adding into each parameter's gradient. The linear layers are cut as
//! Megatron cuts them: q, k, v, gate and up column parallel (each rank its heads and MLP
//! features), o and down row parallel. Where the ranks must talk, the block asks its
//! `TensorSplit` (2 sums forward: after o and after down; 2 backward: the input gradients of
//! q|k|v and of gate|up; with sequence parallelism also `gather_rows`, the rows of the norms
//! and residuals that other ranks hold) and its `SequenceSplit` (attention over the whole
//! sequence). On one rank (`Whole`) every one of those calls is local and this is the plain
//! dense block.
//!
//! The residual adds cost a pass over the rows each, and a kernel launch on a GPU, for almost no
//! arithmetic, so they ride in the ops beside them: the first (+) in the norm after it
//! (`ops::add_rmsnorm`), the gradients that reach x and h around the norms in the norms'
//! backward (`rmsnorm_backward`'s residual), and the input gradients of q, k, v (and gate, up)
//! in one another's GEMM (`linear_input_grad_add`, β = 1). The same numbers on the CPU; on a GPU
//! a bf16 sum rounded once instead of twice.
//!
//! The attention and the MLP are seams (`Attention`, made by the model's `Attentions`; `Mlp`, made
//! by its `Mlps`): Llama's are `Gqa` and `Dense`, below. A later lesson plugs in another kind with
//! the same two calls: a mixture of experts (`moe.rs`), a router and E SwiGLU experts instead of
//! gate, up and down; another attention, from the same normalised rows to the same residual add.
//! What an attention hands on is fixed by the seams around it: its core — out and log-sum-exp of
//! this rank's queries against the whole sequence's keys — is asked of the `attend` it is given
//! (the `SequenceSplit`'s in training: one rank's, a ring's or Ulysses'; the KV cache's `KvLayer`
//! when generating), and what it keeps (`AttentionKept`) can give up that core for recomputation
//! to compute again (`Keeps`, selective recomputation).
//!
//! What a block keeps for its backward is a seam (`Keeps`): everything (`KeepAll`), unless a
//! later lesson trades memory for compute (recomputation, `recompute.rs`) and keeps less; what
//! it kept (`Kept`) gives back the cache at the start of the backward, running the block's
//! forward again if it has to. A cache may leave out the attention core (its output and
//! log-sum-exp): the backward then computes it where it needs it, from what the attention kept
//! (`Gqa`: q, k and v).

use crate::config::ModelConfig;
use crate::model::kv_cache::KvLayer;
use crate::model::param::{Param, ParamKind};
use crate::model::split::{MakeKeys, SequenceSplit, TensorSplit, WeightGrads};
use crate::ops::tensor::Tensor;
use crate::ops::{self, Attn, Rope, TpCut};
use anyhow::{anyhow, Result};
use std::any::Any;
use std::borrow::Cow;
use std::rc::Rc;

pub(crate) struct Block<'g> {
    /// Its layer's number in the whole model.
    pub(super) layer: usize,
    pub(super) attention: Box<dyn Attention + 'g>,
    pub(super) mlp: Box<dyn Mlp + 'g>,
    pub(super) input_layernorm: Param,
    pub(super) post_attention_layernorm: Param,
}

/// A block's attention, from the normalised rows `xn` to what the residual adds: the seam another
/// kind of attention plugs into. `Gqa` is Llama's.
pub trait Attention {
    /// Its parameters, in Hugging Face order.
    fn params(&self) -> Vec<&Param>;
    fn params_mut(&mut self) -> Vec<&mut Param>;
    /// Its output from `xn` (this rank's rows; with sequence parallelism `tp` gathers the others'),
    /// its core asked of `attend`; what its backward needs; the score entries `attend` computed.
    fn forward(
        &self,
        tp: &dyn TensorSplit,
        xn: &Tensor,
        at: (Attn, &[u32]),
        attend: &mut dyn Attend,
    ) -> Result<(Tensor, Box<dyn AttentionKept>, u64)>;
    /// Generating: its output for one step of a sequence whose earlier keys and values `past`
    /// holds, nothing kept. By default `forward`'s, its core the cache's; an attention whose
    /// cache can hold less than its core's keys and values (latent attention's latent) goes its
    /// own way.
    fn generate(&self, tp: &dyn TensorSplit, xn: &Tensor, at: (Attn, &[u32]), past: KvLayer) -> Result<Tensor> {
        Ok(self.forward(tp, xn, at, &mut InCache { past: Some(past), positions: at.1 })?.0)
    }
    /// dxn from dy, given the forward's input `xn` and what it kept (a core given up there is
    /// computed again by `split.seq`). Every weight GEMM goes to `dw`.
    fn backward(
        &mut self,
        split: Splits,
        dy: &Tensor,
        xn_kept: (Tensor, Box<dyn AttentionKept>),
        at: (Attn, &[u32]),
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor>;
}

/// What an attention's forward keeps for its backward.
pub trait AttentionKept: Any {
    fn bytes(&self) -> usize;
    /// Gives up the core (the attention's output and log-sum-exp): the backward computes it again
    /// from what stays (selective recomputation).
    fn drop_core(&mut self);
}

/// How a model makes its blocks' attentions (with `Attention`, the seam another kind plugs into).
pub trait Attentions<'g> {
    /// Layer `layer`'s attention, each parameter asked of `param`.
    fn make(&self, layer: usize, cfg: &ModelConfig, param: &mut MakeParam) -> Result<Box<dyn Attention + 'g>>;
}

/// Llama's attention: grouped-query attention with RoPE. q, k and v are column parallel (each tp
/// rank its heads: its query heads and the KV heads they share, a copy of one when the KV heads
/// are fewer than the ranks), o row parallel.
///
/// ```text
/// xn ─ q, k, v ─ rope(q), rope(k) ─ attend: softmax(q·kᵀ/√hd, causal) · v ─ o ─ out
/// ```
pub struct Gqa {
    q_proj: Param,
    k_proj: Param,
    v_proj: Param,
    o_proj: Param,
    rope: RopeOf,
}

/// RoPE's rotation of heads this wide: made when a forward asks (a few numbers), never for a
/// model that is only counted.
pub type RopeOf = Rc<dyn Fn(usize) -> Rope>;

/// Llama's attentions: every block's `Gqa`, turned by `rope` (the model's family gives it:
/// `Rope::plain(rope_theta, head_dim)`, or rescaled for a longer context).
pub struct GqaAttentions {
    pub rope: RopeOf,
}

impl<'g> Attentions<'g> for GqaAttentions {
    fn make(&self, layer: usize, cfg: &ModelConfig, param: &mut MakeParam) -> Result<Box<dyn Attention + 'g>> {
        // on the tp axis: Megatron's column-parallel layers hold rows of W, its row-parallel ones columns
        let (rows, cols) = (TpCut::Rows, TpCut::Columns);
        let (d, hd) = (cfg.hidden_size, cfg.head_dim());
        let (q_out, kv_out) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let kv_rows = TpCut::HeadRows(cfg.num_key_value_heads); // whole KV heads, copied if too few
        let p = |s: &str| format!("model.layers.{layer}.self_attn.{s}.weight");
        Ok(Box::new(Gqa {
            q_proj: param(p("q_proj"), &[q_out, d], ParamKind::Matrix, rows)?,
            k_proj: param(p("k_proj"), &[kv_out, d], ParamKind::Matrix, kv_rows)?,
            v_proj: param(p("v_proj"), &[kv_out, d], ParamKind::Matrix, kv_rows)?,
            o_proj: param(p("o_proj"), &[d, q_out], ParamKind::Matrix, cols)?,
            rope: Rc::clone(&self.rope),
        }))
    }
}

/// What `Gqa` keeps: q and k after RoPE, v, and the core (`None` once given up).
struct GqaKept {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    core: Option<(Tensor, Tensor)>,
}

impl AttentionKept for GqaKept {
    fn bytes(&self) -> usize {
        let core = self.core.as_ref().map_or(0, |(o, l)| o.bytes() + l.bytes());
        self.q.bytes() + self.k.bytes() + self.v.bytes() + core
    }
    fn drop_core(&mut self) {
        self.core = None; // out and lse go; q, k and v stay for the backward to attend again
    }
}

impl Attention for Gqa {
    fn params(&self) -> Vec<&Param> {
        vec![&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.q_proj, &mut self.k_proj, &mut self.v_proj, &mut self.o_proj]
    }

    fn forward(
        &self,
        tp: &dyn TensorSplit,
        xn: &Tensor,
        (attn, positions): (Attn, &[u32]),
        attend: &mut dyn Attend,
    ) -> Result<(Tensor, Box<dyn AttentionKept>, u64)> {
        let xin = tp.gather_rows(xn)?; // sequence parallel: every row (else xn itself)
        let mut q = self.q_proj.linear(&xin);
        let mut k = self.k_proj.linear(&xin);
        let v = self.v_proj.linear(&xin);
        drop(xin);
        let rope = (self.rope)(attn.head_dim);
        ops::rope(&mut q, positions, &rope);
        ops::rope(&mut k, positions, &rope);
        let (out, lse, work) = attend.attend(attn, &q, &k, &v)?;
        let h = tp.row_forward(&out, &self.o_proj)?; // g: Σ over the tp ranks
        Ok((h, Box::new(GqaKept { q, k, v, core: Some((out, lse)) }), work))
    }

    fn backward(
        &mut self,
        split: Splits,
        dy: &Tensor,
        (xn, kept): (Tensor, Box<dyn AttentionKept>),
        (attn, positions): (Attn, &[u32]),
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let GqaKept { q, k, v, core } = *kept_as::<GqaKept>(kept)?;
        let (tp, pos) = (split.tp, &positions[..attn.seq]);
        let (out, lse) = match core {
            Some(core) => core,
            None => split.seq.attention(attn, &q, &k, &v, pos).map(|(o, l, _)| (o, l))?, // not kept: again
        };
        // right to left; o is row parallel: local (on every row: sequence parallelism gathers them)
        let dy = tp.gather_rows(dy)?;
        let dattn = self.o_proj.linear_input_grad(&dy);
        let (mut dq, mut dk, dv) = split.seq.attention_backward(attn, (&q, &k, &v), pos, (&out, &lse), &dattn)?;
        dw.linear(Cow::Owned(out), vec![(dy, &mut self.o_proj)]);
        let rope = (self.rope)(attn.head_dim);
        ops::rope_backward(&mut dq, positions, &rope);
        ops::rope_backward(&mut dk, positions, &rope);
        // f: one sum over the tp ranks for q, k and v together
        let layers = vec![(dq, &mut self.q_proj), (dk, &mut self.k_proj), (dv, &mut self.v_proj)];
        tp.column_backward(xn, layers, dw)
    }
}

/// A block's MLP, from the normalised rows `xn` to what the residual adds: the seam a mixture of
/// experts plugs into (`moe.rs`). `Dense` is Llama's.
pub trait Mlp {
    /// Its parameters, in Hugging Face order.
    fn params(&self) -> Vec<&Param>;
    fn params_mut(&mut self) -> Vec<&mut Param>;
    /// Its parameters, given up (another kind of MLP is made of them: `Block::with_mlp`).
    fn into_params(self: Box<Self>) -> Vec<Param>;
    /// What it keeps that no optimizer trains (buffers), by name, whole, on the host; none here.
    fn buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
    /// y from `xn` (this rank's rows; with sequence parallelism `tp` gathers the others'), and
    /// what its backward needs.
    fn forward(&self, tp: &dyn TensorSplit, xn: &Tensor) -> Result<(Tensor, Box<dyn MlpKept>)>;
    /// dxn from dy (`xn`: the forward's input). Every weight GEMM goes to `dw`.
    fn backward(
        &mut self,
        tp: &dyn TensorSplit,
        dy: &Tensor,
        xn: Tensor,
        kept: Box<dyn MlpKept>,
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor>;
}

/// What an MLP's forward keeps for its backward.
pub trait MlpKept: Any {
    fn bytes(&self) -> usize;
}

/// `kept` as what a part of kind `K` keeps (its own forward made it): an MLP's (`MlpKept`) or an
/// attention's (`AttentionKept`).
pub fn kept_as<K: Any>(kept: Box<dyn Any>) -> Result<Box<K>> {
    kept.downcast::<K>().map_err(|_| anyhow!("backward: a block's part was given what another kind keeps"))
}

/// A parameter's maker: `param(name, full shape, kind, cut on the tp axis)` keeps this rank's part.
pub type MakeParam<'p> = dyn FnMut(String, &[usize], ParamKind, TpCut) -> Result<Param> + 'p;

/// How a model makes its blocks' MLPs, and what they add to its loss (with `Mlp`, the seam a
/// mixture of experts plugs into).
pub trait Mlps<'g> {
    /// Layer `layer`'s MLP, each parameter asked of `param`.
    fn make(&self, layer: usize, cfg: &ModelConfig, param: &mut MakeParam) -> Result<Box<dyn Mlp + 'g>>;
    /// A term the MLPs add to the model's loss (the experts' load-balancing loss); none here.
    fn loss_term(&self) -> Option<Box<dyn LossTerm + 'g>> {
        None
    }
}

/// A term added to the loss at the output end, from what the MLPs saw in the same forward.
pub trait LossTerm {
    /// Adds the term of the forward that just reached the head into `loss` (a one-number f32
    /// tensor); returns what its backward needs.
    fn add(&self, loss: &mut Tensor) -> Result<Box<dyn TermKept>>;
}

/// What a loss term keeps for its backward.
pub trait TermKept {
    /// Its backward from the loss scaled by `scale`, before the blocks' (which read what it
    /// leaves them: its gradient reaches the MLPs that made it).
    fn backward(self: Box<Self>, scale: f32);
}

/// Llama's MLP: SwiGLU, down · (silu(gate · x) ⊙ up · x). Gate and up are column parallel (each
/// tp rank its MLP features), down row parallel.
pub struct Dense {
    gate_proj: Param,
    up_proj: Param,
    down_proj: Param,
}

/// Llama's MLPs: every block's `Dense`.
pub struct DenseMlps;

impl<'g> Mlps<'g> for DenseMlps {
    fn make(&self, layer: usize, cfg: &ModelConfig, param: &mut MakeParam) -> Result<Box<dyn Mlp + 'g>> {
        let (d, f, p) =
            (cfg.hidden_size, cfg.intermediate_size, |s: &str| format!("model.layers.{layer}.mlp.{s}.weight"));
        Ok(Box::new(Dense {
            gate_proj: param(p("gate_proj"), &[f, d], ParamKind::Matrix, TpCut::Rows)?,
            up_proj: param(p("up_proj"), &[f, d], ParamKind::Matrix, TpCut::Rows)?,
            down_proj: param(p("down_proj"), &[d, f], ParamKind::Matrix, TpCut::Columns)?,
        }))
    }
}

/// What `Dense` keeps: the gate and up products and their SwiGLU.
struct DenseKept {
    gate: Tensor,
    up: Tensor,
    act: Tensor,
}

impl MlpKept for DenseKept {
    fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.act.bytes()
    }
}

impl Mlp for Dense {
    fn params(&self) -> Vec<&Param> {
        vec![&self.gate_proj, &self.up_proj, &self.down_proj]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj]
    }

    fn into_params(self: Box<Self>) -> Vec<Param> {
        vec![self.gate_proj, self.up_proj, self.down_proj]
    }

    fn forward(&self, tp: &dyn TensorSplit, xn: &Tensor) -> Result<(Tensor, Box<dyn MlpKept>)> {
        let xin = tp.gather_rows(xn)?; // sequence parallel: every row
        let gate = self.gate_proj.linear(&xin);
        let up = self.up_proj.linear(&xin);
        drop(xin);
        let act = ops::swiglu(&gate, &up);
        let out = tp.row_forward(&act, &self.down_proj)?; // g: Σ over the tp ranks
        Ok((out, Box::new(DenseKept { gate, up, act })))
    }

    fn backward(
        &mut self,
        tp: &dyn TensorSplit,
        dy: &Tensor,
        xn: Tensor,
        kept: Box<dyn MlpKept>,
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let DenseKept { gate, up, act } = *kept_as::<DenseKept>(kept)?;
        // right to left; down is row parallel: its backward is local (on every row: sequence
        // parallelism gathers them)
        let dy = tp.gather_rows(dy)?;
        let dact = self.down_proj.linear_input_grad(&dy);
        dw.linear(Cow::Owned(act), vec![(dy, &mut self.down_proj)]);
        let (dgate, dup) = ops::swiglu_backward(&dact, &gate, &up);
        // f: one sum over the tp ranks for gate and up together
        tp.column_backward(xn, vec![(dgate, &mut self.gate_proj), (dup, &mut self.up_proj)], dw)
    }
}

/// The activations one block's backward needs.
pub struct BlockCache {
    pub(super) x: Tensor,
    xn1: Tensor,
    rstd1: Tensor,
    /// What the attention keeps (a `Keeps` may have it give up its core: `drop_core`).
    pub(super) attention: Box<dyn AttentionKept>,
    h: Tensor,
    xn2: Tensor,
    rstd2: Tensor,
    mlp: Box<dyn MlpKept>,
}

impl BlockCache {
    /// The bytes these activations occupy.
    fn bytes(&self) -> usize {
        let all = [&self.x, &self.xn1, &self.rstd1, &self.h, &self.xn2, &self.rstd2];
        all.iter().map(|t| t.bytes()).sum::<usize>() + self.attention.bytes() + self.mlp.bytes()
    }
}

/// What a block keeps of its forward's activations for its backward: the seam recomputation
/// plugs into (`recompute.rs`).
pub trait Keeps {
    fn keep(&self, cache: BlockCache) -> Box<dyn Kept>;
}

/// What a block kept from its forward, until its backward.
pub trait Kept {
    /// The bytes it holds.
    fn bytes(&self) -> usize;
    /// The cache for the backward (perhaps without the attention core); `forward` runs the
    /// block's forward again from its input x, keeping everything.
    fn cache(self: Box<Self>, forward: &mut dyn FnMut(Tensor) -> Result<BlockCache>) -> Result<BlockCache>;
}

/// Every activation backward reads: the plain backward of every lesson.
pub struct KeepAll;

impl Keeps for KeepAll {
    fn keep(&self, cache: BlockCache) -> Box<dyn Kept> {
        Box::new(cache)
    }
}

impl Kept for BlockCache {
    fn bytes(&self) -> usize {
        BlockCache::bytes(self)
    }
    fn cache(self: Box<Self>, _: &mut dyn FnMut(Tensor) -> Result<BlockCache>) -> Result<BlockCache> {
        Ok(*self) // nothing to run again
    }
}

/// Who a block talks to: the other tensor-parallel ranks, and the rest of the sequence.
#[derive(Clone, Copy)]
pub struct Splits<'a> {
    pub tp: &'a dyn TensorSplit,
    pub seq: &'a dyn SequenceSplit,
}

/// The attention core of a block's forward: (out, lse, score entries computed) of this rank's
/// rows of q against the keys and values.
pub trait Attend {
    fn attend(&mut self, a: Attn, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor, u64)>;
    /// With keys and values made from `source` by `keys` (`SequenceSplit::attention_from`): by
    /// default made here, then attended.
    fn attend_from(&mut self, a: Attn, q: &Tensor, from: (&Tensor, &dyn MakeKeys)) -> Result<(Tensor, Tensor, u64)> {
        let (k, v) = from.1.keys(from.0);
        self.attend(a, q, &k, &v)
    }
}

/// Causal attention over the sequence, wherever its keys are: the sequence split's (training).
struct InSequence<'a> {
    split: Splits<'a>,
    positions: &'a [u32],
}

impl Attend for InSequence<'_> {
    fn attend(&mut self, a: Attn, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor, u64)> {
        self.split.seq.attention(a, q, k, v, &self.positions[..a.seq])
    }
    fn attend_from(&mut self, a: Attn, q: &Tensor, from: (&Tensor, &dyn MakeKeys)) -> Result<(Tensor, Tensor, u64)> {
        self.split.seq.attention_from(a, q, from, &self.positions[..a.seq])
    }
}

/// Attention to the earlier keys and values of the KV cache's layer and these (generating).
struct InCache<'a> {
    past: Option<KvLayer<'a>>,
    positions: &'a [u32],
}

impl Attend for InCache<'_> {
    fn attend(&mut self, a: Attn, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor, u64)> {
        let past = self.past.take().ok_or_else(|| anyhow!("a layer attends once a step"))?;
        Ok(past.attend(a, q, k, v, self.positions))
    }
}

impl<'g> Block<'g> {
    /// Layer `i`'s parameters in Hugging Face order, each asked of `param` (which keeps this
    /// rank's slice), its attention made by `attentions`, its MLP by `mlps`.
    pub(crate) fn build(
        i: usize,
        cfg: &ModelConfig,
        (attentions, mlps): (&dyn Attentions<'g>, &dyn Mlps<'g>),
        param: &mut MakeParam,
    ) -> Result<Block<'g>> {
        let (d, whole) = (cfg.hidden_size, TpCut::Whole);
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        let attention = attentions.make(i, cfg, param)?;
        let mlp = mlps.make(i, cfg, param)?;
        Ok(Block {
            layer: i,
            attention,
            mlp,
            input_layernorm: param(p("input_layernorm"), &[d], ParamKind::Norm, whole)?,
            post_attention_layernorm: param(p("post_attention_layernorm"), &[d], ParamKind::Norm, whole)?,
        })
    }

    /// In Hugging Face order (the MLP's in its own: a Mixtral block's router, then each expert's
    /// w1, w2, w3).
    pub(crate) fn params(&self) -> Vec<&Param> {
        let mut v = self.attention.params();
        v.extend(self.mlp.params());
        v.extend([&self.input_layernorm, &self.post_attention_layernorm]);
        v
    }

    pub(crate) fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.attention.params_mut();
        v.extend(self.mlp.params_mut());
        v.extend([&mut self.input_layernorm, &mut self.post_attention_layernorm]);
        v
    }

    /// Returns the output, what `keeps` keeps for backward, and the attention score entries
    /// computed.
    pub(crate) fn forward(
        &self,
        split: Splits,
        x: Tensor,
        (cfg, keeps): (&ModelConfig, &dyn Keeps),
        attn: Attn,
        positions: &[u32],
    ) -> Result<(Tensor, Box<dyn Kept>, u64)> {
        let (out, cache, work) = self.run(split, x, cfg, attn, positions, &mut InSequence { split, positions })?;
        Ok((out, keeps.keep(cache), work))
    }

    /// The forward itself, keeping everything; the attention core is `attend`'s (the sequence
    /// split's).
    pub(super) fn run(
        &self,
        split: Splits,
        x: Tensor,
        cfg: &ModelConfig,
        attn: Attn,
        positions: &[u32],
        attend: &mut dyn Attend,
    ) -> Result<(Tensor, BlockCache, u64)> {
        let (eps, tp) = (cfg.rms_norm_eps, split.tp);
        let (xn1, rstd1) = ops::rmsnorm(&x, &self.input_layernorm.value, eps);
        let (mut h, attention, work) = self.attention.forward(tp, &xn1, (attn, positions), attend)?; // attention sub-block
        let (xn2, rstd2) = ops::add_rmsnorm(&mut h, &x, &self.post_attention_layernorm.value, eps); // h += x, normed
        let (mut out, mlp) = self.mlp.forward(tp, &xn2)?; // MLP sub-block
        ops::add_assign(&mut out, &h);
        let cache = BlockCache { x, xn1, rstd1, attention, h, xn2, rstd2, mlp };
        Ok((out, cache, work))
    }

    /// One step of generation (`llama/decode.rs`), nothing kept: the attention with its part of
    /// the KV cache.
    pub(crate) fn generate(
        &self,
        tp: &dyn TensorSplit,
        x: Tensor,
        cfg: &ModelConfig,
        at: (Attn, &[u32]),
        past: KvLayer,
    ) -> Result<Tensor> {
        let eps = cfg.rms_norm_eps;
        let (xn1, _) = ops::rmsnorm(&x, &self.input_layernorm.value, eps);
        let mut h = self.attention.generate(tp, &xn1, at, past)?;
        let (xn2, _) = ops::add_rmsnorm(&mut h, &x, &self.post_attention_layernorm.value, eps);
        let (mut out, _) = self.mlp.forward(tp, &xn2)?;
        ops::add_assign(&mut out, &h);
        Ok(out)
    }

    /// Every weight GEMM goes to `dw` (computed now, or kept for a zero-bubble W:
    /// `deferred_grads.rs`); the norms' weight gradients are computed here with their input
    /// gradients.
    pub(crate) fn backward(
        &mut self,
        split: Splits,
        dout: Tensor,
        kept: Box<dyn Kept>,
        cfg: &ModelConfig,
        (attn, positions): (Attn, &[u32]),
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let c =
            kept.cache(&mut |x| Ok(self.run(split, x, cfg, attn, positions, &mut InSequence { split, positions })?.1))?;
        let dxn2 = self.mlp.backward(split.tp, &dout, c.xn2, c.mlp, dw)?; // MLP sub-block
        let ln2 = &mut self.post_attention_layernorm;
        // the residual carries dout straight through, added as the norm's dx is written
        let dh = ops::rmsnorm_backward(&dxn2, &c.h, &ln2.value, &c.rstd2, &mut ln2.grad, Some(&dout));
        let dxn1 = self.attention.backward(split, &dh, (c.xn1, c.attention), (attn, positions), dw)?; // attention sub-block
        let ln1 = &mut self.input_layernorm;
        Ok(ops::rmsnorm_backward(&dxn1, &c.x, &ln1.value, &c.rstd1, &mut ln1.grad, Some(&dh)))
    }
}
