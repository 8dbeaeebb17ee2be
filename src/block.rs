//! # One transformer block, forward and backward
//!
//! ```text
//! x ─┬─ rmsnorm ─ q,k,v ─ rope ─ attention ─ o ─(+)─ h ─┬─ rmsnorm ─ gate,up ─ swiglu ─ down ─(+)─ out
//!    └──────────────────────────────────────────────┘   └─────────────────────────────────────┘
//! ```
//! `forward` keeps what `backward` needs (the `BlockCache`); `backward` walks the picture right to
//! left, returning dx and adding into each parameter's gradient. Every linear layer is a
//! tensor-parallel one (`tensor_parallel.rs`): q, k, v, gate and up column parallel (each rank
//! its heads and MLP features), o and down row parallel; attention runs around the
//! context-parallel ring when the sequence is split (`context_parallel.rs`). With neither, the
//! collectives vanish and this is the plain dense block.

use crate::config::ModelConfig;
use crate::context_parallel::{self as cp, Ring};
use crate::model::{Param, ParamKind};
use crate::ops::{self, Attn};
use crate::tensor::Tensor;
use crate::tensor_parallel::{self as tp, Split, Tp};
use anyhow::Result;

pub(crate) struct Block {
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
pub(crate) struct BlockCache {
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

impl BlockCache {
    /// The bytes these activations occupy.
    pub(crate) fn bytes(&self) -> usize {
        let all = [&self.x, &self.xn1, &self.rstd1, &self.q, &self.k, &self.v, &self.attn, &self.lse];
        let more = [&self.h, &self.xn2, &self.rstd2, &self.gate, &self.up, &self.act];
        all.iter().chain(&more).map(|t| t.bytes()).sum()
    }
}

/// The groups a block talks over: tensor parallel and the context-parallel ring.
#[derive(Clone, Copy)]
pub(crate) struct Groups<'a> {
    pub tp: Tp<'a>,
    pub ring: Option<&'a Ring<'a>>,
}

impl Block {
    /// Layer `i`'s parameters in Hugging Face order, each asked of `param(name, full shape,
    /// kind, split)` (which keeps this rank's slice).
    pub(crate) fn build(
        i: usize,
        cfg: &ModelConfig,
        param: &mut impl FnMut(String, &[usize], ParamKind, Split) -> Result<Param>,
    ) -> Result<Block> {
        use Split::{Cols, Replicated, Rows};
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (q_out, kv_out) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let p = |s: &str| format!("model.layers.{i}.{s}.weight");
        Ok(Block {
            q_proj: param(p("self_attn.q_proj"), &[q_out, d], ParamKind::Matrix, Rows)?,
            k_proj: param(p("self_attn.k_proj"), &[kv_out, d], ParamKind::Matrix, Rows)?,
            v_proj: param(p("self_attn.v_proj"), &[kv_out, d], ParamKind::Matrix, Rows)?,
            o_proj: param(p("self_attn.o_proj"), &[d, q_out], ParamKind::Matrix, Cols)?,
            gate_proj: param(p("mlp.gate_proj"), &[f, d], ParamKind::Matrix, Rows)?,
            up_proj: param(p("mlp.up_proj"), &[f, d], ParamKind::Matrix, Rows)?,
            down_proj: param(p("mlp.down_proj"), &[d, f], ParamKind::Matrix, Cols)?,
            input_layernorm: param(p("input_layernorm"), &[d], ParamKind::Norm, Replicated)?,
            post_attention_layernorm: param(p("post_attention_layernorm"), &[d], ParamKind::Norm, Replicated)?,
        })
    }

    pub(crate) fn params(&self) -> [&Param; 9] {
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

    pub(crate) fn params_mut(&mut self) -> [&mut Param; 9] {
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

    /// Returns the output, the cache and the attention work.
    pub(crate) fn forward(
        &self,
        groups: Groups,
        x: Tensor,
        cfg: &ModelConfig,
        attn: Attn,
        positions: &[u32],
    ) -> Result<(Tensor, BlockCache, u64)> {
        let (eps, hd, theta, tp) = (cfg.rms_norm_eps, attn.head_dim, cfg.rope_theta, groups.tp);
        // attention sub-block: q, k, v column parallel (this rank's heads), o row parallel
        let (xn1, rstd1) = ops::rmsnorm(&x, &self.input_layernorm.value, eps);
        let mut q = tp::column_forward(&xn1, &self.q_proj);
        let mut k = tp::column_forward(&xn1, &self.k_proj);
        let v = tp::column_forward(&xn1, &self.v_proj);
        ops::rope(&mut q, positions, hd, theta);
        ops::rope(&mut k, positions, hd, theta);
        let (attn_out, lse, work) = cp::attention(groups.ring, attn, &q, &k, &v, &positions[..attn.seq])?;
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
        Ok((out, cache, work))
    }

    pub(crate) fn backward(
        &mut self,
        groups: Groups,
        dout: Tensor,
        c: &BlockCache,
        cfg: &ModelConfig,
        attn: Attn,
        positions: &[u32],
    ) -> Result<Tensor> {
        let (hd, theta, tp) = (attn.head_dim, cfg.rope_theta, groups.tp);
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
        let qkv = (&c.q, &c.k, &c.v);
        let (mut dq, mut dk, dv) =
            cp::attention_backward(groups.ring, attn, qkv, &positions[..attn.seq], (&c.attn, &c.lse), &dattn)?;
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
