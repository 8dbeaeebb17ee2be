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
//! In a Mixtral block (`model.num_local_experts` > 0) the MLP is a mixture of experts
//! (`moe.rs`): a router and E SwiGLU experts instead of gate, up and down. Its experts may be on
//! other ranks (`Splits::ep`); it needs no tensor-parallel calls (every tp rank routes its rows
//! itself).
//!
//! What a block keeps for its backward is a seam (`Keeps`): everything (`KeepAll`), unless a
//! later lesson trades memory for compute (recomputation, `recompute.rs`) and keeps less: a cache
//! without the attention core's output, or only the block's input (`Kept`). The backward
//! computes again whatever was not kept.

use crate::config::ModelConfig;
use crate::model::kv_cache::KvLayer;
use crate::model::moe::ExpertSplit;
use crate::model::moe::{Load, Moe, MoeCache};
use crate::model::param::{Param, ParamKind};
use crate::model::split::{SequenceSplit, TensorSplit, WeightGrads};
use crate::ops::tensor::Tensor;
use crate::ops::{self, Attn, TpCut};
use anyhow::Result;
use std::borrow::Cow;

pub(crate) struct Block {
    q_proj: Param,
    k_proj: Param,
    v_proj: Param,
    o_proj: Param,
    mlp: Mlp,
    input_layernorm: Param,
    post_attention_layernorm: Param,
}

/// The block's MLP: Llama's dense SwiGLU, or Mixtral's mixture of experts.
#[allow(clippy::large_enum_variant)] // one per block
enum Mlp {
    Dense { gate_proj: Param, up_proj: Param, down_proj: Param },
    Moe(Moe),
}

/// What the MLP's backward needs.
#[allow(clippy::large_enum_variant)] // one per block and micro-batch in flight
enum MlpCache {
    Dense { gate: Tensor, up: Tensor, act: Tensor },
    Moe(MoeCache),
}

/// The activations one block's backward needs.
pub struct BlockCache {
    pub(crate) x: Tensor,
    xn1: Tensor,
    rstd1: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// The attention's output and log-sum-exp; `None` when backward computes them again.
    pub(crate) core: Option<(Tensor, Tensor)>,
    h: Tensor,
    xn2: Tensor,
    rstd2: Tensor,
    mlp: MlpCache,
}

impl BlockCache {
    /// The bytes these activations occupy.
    fn bytes(&self) -> usize {
        let all = [&self.x, &self.xn1, &self.rstd1, &self.q, &self.k, &self.v];
        let more = [&self.h, &self.xn2, &self.rstd2];
        let core = self.core.as_ref().map_or(0, |(o, l)| o.bytes() + l.bytes());
        let mlp = match &self.mlp {
            MlpCache::Dense { gate, up, act } => gate.bytes() + up.bytes() + act.bytes(),
            MlpCache::Moe(c) => c.bytes(),
        };
        all.iter().chain(&more).map(|t| t.bytes()).sum::<usize>() + core + mlp
    }
}

/// What a block keeps from its forward for its backward.
pub enum Kept {
    /// Every activation backward reads, or all but the attention core's (`core` is `None`).
    Cache(Box<BlockCache>),
    /// The block's input alone: backward runs the forward again first.
    Input(Tensor),
}

/// What a block keeps of its forward's activations for its backward: the seam recomputation
/// plugs into (`recompute.rs`).
pub trait Keeps {
    fn keep(&self, cache: BlockCache) -> Kept;
}

/// Every activation backward reads: the plain backward of every lesson.
pub struct KeepAll;

impl Keeps for KeepAll {
    fn keep(&self, cache: BlockCache) -> Kept {
        Kept::Cache(Box::new(cache))
    }
}

impl Kept {
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Kept::Cache(c) => c.bytes(),
            Kept::Input(x) => x.bytes(),
        }
    }
}

/// Who a block talks to: the other tensor-parallel ranks, the rest of the sequence, and the
/// ranks holding the other experts.
#[derive(Clone, Copy)]
pub(crate) struct Splits<'a> {
    pub tp: &'a dyn TensorSplit,
    pub seq: &'a dyn SequenceSplit,
    pub ep: &'a dyn ExpertSplit,
}

/// What a block's forward did besides its output: attention score entries computed, and the
/// MoE layer's routing (a dense block has none).
pub(crate) struct Work {
    pub attention: u64,
    pub load: Option<Load>,
}

impl Block {
    /// Layer `i`'s parameters in Hugging Face order, each asked of `param(name, full shape,
    /// kind, placement on tp)` (which keeps this rank's slice); of a mixture of experts, the experts `held`.
    pub(crate) fn build(
        i: usize,
        cfg: &ModelConfig,
        held: std::ops::Range<usize>,
        param: &mut impl FnMut(String, &[usize], ParamKind, TpCut) -> Result<Param>,
    ) -> Result<Block> {
        // on the tp axis: Megatron's column-parallel layers hold rows of W, its row-parallel ones columns
        let (rows, cols, whole) = (TpCut::Rows, TpCut::Columns, TpCut::Whole);
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (q_out, kv_out) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        let (q_proj, k_proj, v_proj, o_proj) = (
            param(p("self_attn.q_proj"), &[q_out, d], ParamKind::Matrix, rows)?,
            param(p("self_attn.k_proj"), &[kv_out, d], ParamKind::Matrix, rows)?,
            param(p("self_attn.v_proj"), &[kv_out, d], ParamKind::Matrix, rows)?,
            param(p("self_attn.o_proj"), &[d, q_out], ParamKind::Matrix, cols)?,
        );
        let mlp = match cfg.num_local_experts {
            0 => Mlp::Dense {
                gate_proj: param(p("mlp.gate_proj"), &[f, d], ParamKind::Matrix, rows)?,
                up_proj: param(p("mlp.up_proj"), &[f, d], ParamKind::Matrix, rows)?,
                down_proj: param(p("mlp.down_proj"), &[d, f], ParamKind::Matrix, cols)?,
            },
            _ => Mlp::Moe(Moe::build(i, cfg, held, param)?),
        };
        Ok(Block {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            mlp,
            input_layernorm: param(p("input_layernorm"), &[d], ParamKind::Norm, whole)?,
            post_attention_layernorm: param(p("post_attention_layernorm"), &[d], ParamKind::Norm, whole)?,
        })
    }

    /// Of a mixture of experts, keeps only the experts `held` (expert parallelism).
    pub(crate) fn keep_experts(&mut self, held: std::ops::Range<usize>) {
        if let Mlp::Moe(m) = &mut self.mlp {
            m.keep(held);
        }
    }

    /// In Hugging Face order (a Mixtral block: the router, then each expert's w1, w2, w3).
    pub(crate) fn params(&self) -> Vec<&Param> {
        let mut v = vec![&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj];
        match &self.mlp {
            Mlp::Dense { gate_proj, up_proj, down_proj } => v.extend([gate_proj, up_proj, down_proj]),
            Mlp::Moe(m) => v.extend(m.params()),
        }
        v.extend([&self.input_layernorm, &self.post_attention_layernorm]);
        v
    }

    pub(crate) fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = vec![&mut self.q_proj, &mut self.k_proj, &mut self.v_proj, &mut self.o_proj];
        match &mut self.mlp {
            Mlp::Dense { gate_proj, up_proj, down_proj } => v.extend([gate_proj, up_proj, down_proj]),
            Mlp::Moe(m) => v.extend(m.params_mut()),
        }
        v.extend([&mut self.input_layernorm, &mut self.post_attention_layernorm]);
        v
    }

    /// Returns the output, what `keeps` keeps for backward, and the work done.
    pub(crate) fn forward(
        &self,
        split: Splits,
        x: Tensor,
        (cfg, keeps): (&ModelConfig, &dyn Keeps),
        attn: Attn,
        positions: &[u32],
    ) -> Result<(Tensor, Kept, Work)> {
        let (out, cache, work) = self.run(split, x, cfg, attn, positions, None)?;
        Ok((out, keeps.keep(cache), work))
    }

    /// One step of generation (`model/kv_cache.rs`): the rows of `x`, at `positions` after the
    /// cached ones, attend to the cached keys and values and to their own, which join the cache.
    /// Nothing is kept for a backward.
    pub(crate) fn decode(
        &self,
        split: Splits,
        x: Tensor,
        cfg: &ModelConfig,
        attn: Attn,
        positions: &[u32],
        past: KvLayer,
    ) -> Result<Tensor> {
        Ok(self.run(split, x, cfg, attn, positions, Some(past))?.0)
    }

    /// The forward itself, keeping everything; with `past`, attending to the cached keys too.
    fn run(
        &self,
        split: Splits,
        x: Tensor,
        cfg: &ModelConfig,
        attn: Attn,
        positions: &[u32],
        past: Option<KvLayer>,
    ) -> Result<(Tensor, BlockCache, Work)> {
        let (eps, hd, theta, tp) = (cfg.rms_norm_eps, attn.head_dim, cfg.rope_theta, split.tp);
        // attention sub-block: q, k, v column parallel (this rank's heads), o row parallel
        let (xn1, rstd1) = ops::rmsnorm(&x, &self.input_layernorm.value, eps);
        let xin = tp.gather_rows(&xn1)?; // sequence parallel: every row (else xn1 itself)
        let mut q = self.q_proj.linear(&xin);
        let mut k = self.k_proj.linear(&xin);
        let v = self.v_proj.linear(&xin);
        drop(xin);
        ops::rope(&mut q, positions, hd, theta);
        ops::rope(&mut k, positions, hd, theta);
        let (attn_out, lse, work) = match past {
            None => split.seq.attention(attn, &q, &k, &v, &positions[..attn.seq])?,
            Some(past) => past.attend(attn, &q, &k, &v, positions),
        };
        let mut h = tp.row_forward(&attn_out, &self.o_proj)?; // g: Σ over the tp ranks
        let (xn2, rstd2) = ops::add_rmsnorm(&mut h, &x, &self.post_attention_layernorm.value, eps); // h += x, normed
        let (mut out, mlp, load) = match &self.mlp {
            // MLP sub-block: gate, up column parallel (this rank's features), down row parallel
            Mlp::Dense { gate_proj, up_proj, down_proj } => {
                let xin = tp.gather_rows(&xn2)?;
                let gate = gate_proj.linear(&xin);
                let up = up_proj.linear(&xin);
                drop(xin);
                let act = ops::swiglu(&gate, &up);
                let out = tp.row_forward(&act, down_proj)?; // g
                (out, MlpCache::Dense { gate, up, act }, None)
            }
            // mixture of experts: on this rank's rows, whole (no tp call)
            Mlp::Moe(moe) => {
                let (out, cache, load) = moe.forward(split.ep, &xn2, cfg.router_aux_loss_coef > 0.0)?;
                (out, MlpCache::Moe(cache), Some(load))
            }
        };
        ops::add_assign(&mut out, &h);
        let core = Some((attn_out, lse));
        let cache = BlockCache { x, xn1, rstd1, q, k, v, core, h, xn2, rstd2, mlp };
        Ok((out, cache, Work { attention: work, load }))
    }

    /// `balance`: the load-balancing loss's gradient on each expert's router probability (a
    /// mixture of experts with `router_aux_loss_coef` > 0; else empty). Every weight GEMM goes to
    /// `w` (computed now, or kept for a zero-bubble W: `deferred_grads.rs`); the norms' weight
    /// gradients are computed here with their input gradients.
    pub(crate) fn backward(
        &mut self,
        split: Splits,
        dout: Tensor,
        kept: Kept,
        (cfg, balance): (&ModelConfig, &[f32]),
        (attn, positions): (Attn, &[u32]),
        w: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let (hd, theta, tp) = (attn.head_dim, cfg.rope_theta, split.tp);
        let c = match kept {
            Kept::Cache(c) => *c,
            Kept::Input(x) => self.run(split, x, cfg, attn, positions, None)?.1, // full recomputation
        };
        let dxn2 = match (&mut self.mlp, c.mlp) {
            // MLP sub-block, right to left; down is row parallel: its backward is local (on every
            // row: sequence parallelism gathers them)
            (Mlp::Dense { gate_proj, up_proj, down_proj }, MlpCache::Dense { gate, up, act }) => {
                let dy = tp.gather_rows(&dout)?;
                let dact = down_proj.linear_input_grad(&dy);
                w.linear(Cow::Owned(act), vec![(dy, down_proj)]);
                let (dgate, dup) = ops::swiglu_backward(&dact, &gate, &up);
                // f: one sum over the tp ranks for gate and up together
                tp.column_backward(c.xn2, vec![(dgate, gate_proj), (dup, up_proj)], w)?
            }
            (Mlp::Moe(moe), MlpCache::Moe(cache)) => moe.backward(split.ep, &dout, c.xn2, cache, balance, w)?,
            _ => anyhow::bail!("backward: a block was given the cache of another kind of MLP"),
        };
        let ln2 = &mut self.post_attention_layernorm;
        // the residual carries dout straight through, added as the norm's dx is written
        let dh = ops::rmsnorm_backward(&dxn2, &c.h, &ln2.value, &c.rstd2, &mut ln2.grad, Some(&dout));

        // attention sub-block, right to left; o is row parallel: local
        let (qkv, pos) = ((&c.q, &c.k, &c.v), &positions[..attn.seq]);
        let (out, lse) = match c.core {
            Some(core) => core,
            None => split.seq.attention(attn, qkv.0, qkv.1, qkv.2, pos).map(|(o, l, _)| (o, l))?, // selective
        };
        let dy = tp.gather_rows(&dh)?;
        let dattn = self.o_proj.linear_input_grad(&dy);
        let (mut dq, mut dk, dv) = split.seq.attention_backward(attn, qkv, pos, (&out, &lse), &dattn)?;
        w.linear(Cow::Owned(out), vec![(dy, &mut self.o_proj)]);
        ops::rope_backward(&mut dq, positions, hd, theta);
        ops::rope_backward(&mut dk, positions, hd, theta);
        // f: one sum over the tp ranks for q, k and v together
        let layers = vec![(dq, &mut self.q_proj), (dk, &mut self.k_proj), (dv, &mut self.v_proj)];
        let dxn1 = tp.column_backward(c.xn1, layers, w)?;
        let ln1 = &mut self.input_layernorm;
        Ok(ops::rmsnorm_backward(&dxn1, &c.x, &ln1.value, &c.rstd1, &mut ln1.grad, Some(&dh)))
    }
}
