//! # Multi-head latent attention (MLA): DeepSeek-V2/V3's attention, forward and backward
//!
//! Grouped-query attention saves KV-cache memory by sharing a key and a value among several
//! query heads. MLA saves more and keeps a key and a value per head: each token writes one small
//! *latent* vector c (`kv_lora_rank` values, 512 in V3) and one rotated key k_rot shared by every
//! head (`qk_rope_head_dim`, 64); every head's key and value are linear images of c. A token's
//! cache is c and k_rot, 576 numbers in V3, where its 128 heads of GQA-free keys and values would
//! be 128 × (192 + 128) = 40,960.
//!
//! ```text
//!             ┌ q_proj ───────────────────────────────┐            (q_lora_rank = 0)
//! xn [T, d] ──┤ q_a_proj ─ rmsnorm ─ q_b_proj ────────┴─ q [T, H·(n+r)]: per head [q_nope | q_rot]
//!             └ kv_a_proj_with_mqa ─ [c | k_rot]  (c: kv_lora_rank values, k_rot: r, one for all heads)
//!                  c ─ rmsnorm ─ kv_b_proj ─ per head [k_nope (n) | v (v)]
//! rope(q_rot), rope(k_rot) (interleaved pairs or split halves: `rope_interleave`)
//! per head h:  Q_h = [q_nope_h | rope(q_rot_h)],  K_h = [k_nope_h | rope(k_rot)],  V_h = v_h
//! out = softmax(Q·Kᵀ · (n+r)^-½, causal) · V ─ o_proj ─ [T, d]
//! ```
//! n = `qk_nope_head_dim`, r = `qk_rope_head_dim`, v = `v_head_dim`, H heads (as many KV heads).
//! Why the rotated part is separate: RoPE turns a key by its position, so a key that must stay a
//! fixed linear image of c cannot carry it; the r rotated dimensions ride beside, one copy shared.
//! The two latent norms use their own epsilon (1e-6, as transformers builds them).
//!
//! What it costs in training: little is saved there. The core attends over expanded per-head keys
//! and values as any attention does (the big saving is the cache's, when generating), and the
//! latent path adds two GEMMs and two norms per layer. Here the core is the same op every
//! attention uses, through the same seam (`block.rs`'s `Attend`, the `SequenceSplit`: one rank,
//! ring, zigzag, Ulysses): the query and key heads are n+r wide and the value heads v, so each is
//! padded with zeros to D = max(n+r, v) and the query scaled so that the op's 1/√D is (n+r)^-½
//! (zeros add nothing to a dot product; the padded output columns are zero and dropped). That is
//! the plain, slower road: a kernel taught a value width of its own would skip the padding. On a
//! GPU, V3's D = 192 (and generate's absorbed 576) is past the tensor-core kernels' 128, so it
//! runs `kernels/attention.cu`'s wide form, slower still: FlashAttention-2 at 192 is not built.
//!
//! What the core is handed is not the heads' keys and values but what they are made of, the
//! *source* [c normed | rope(k_rot)] (`HeadsFromLatent`, a `MakeKeys`): one rank makes the heads
//! once; the cp ring passes the source, kv_lora_rank + r values a token where the heads are
//! 2·H·D (V3: 576 against 49,152), and every rank makes a block's heads where it lands — the
//! kv_b_proj GEMM once per block it attends to, forward and backward, for 85× less traffic.
//! The block's gradient travels home as the source's, kv_b_proj's weight gradient made on the
//! way. The forward keeps the source, not the heads: the backward makes them again.
//!
//! Tensor parallelism splits the heads (q_proj or q_b_proj, kv_b_proj and o_proj, as Megatron
//! cuts them) and replicates the latent path (q_a_proj, kv_a_proj_with_mqa and the two latent
//! norms): every rank computes the same latents, but its backward reaches them from its own
//! heads only, so their gradients are partial sums, added over the tp ranks once a step
//! (`config::partial_over_tp`; `parallel/latent_tensor_parallel.rs`). The rotated key's gradient is the
//! sum over the heads of this rank, and so partial too: it flows into kv_a_proj_with_mqa's.

use crate::config::{ModelConfig, RopeScaling};
use crate::model::block::{kept_as, Attend, Attention, AttentionKept, Attentions, MakeParam, Splits};
use crate::model::kv_cache::KvLayer;
use crate::model::param::{Param, ParamKind};
use crate::model::split::{MakeKeys, MakeKeysBackward, TensorSplit, WeightGrads};
use crate::ops::tensor::Tensor;
use crate::ops::{self, moe as route, rope_scaling, Attn, Rope, TpCut};
use anyhow::{anyhow, Result};
use std::borrow::Cow;

/// The epsilon of the two latent norms (transformers' `DeepseekV3RMSNorm` default; the
/// config's `rms_norm_eps` is the block norms').
pub const LATENT_EPS: f32 = 1e-6;

/// The widths of one MLA layer's heads (how many this rank holds: its `Attn`'s).
#[derive(Clone, Copy, Debug)]
struct Dims {
    /// n, r, v: the query/key part without position, the rotated part, the value.
    nope: usize,
    rope: usize,
    v: usize,
    /// The latent c's width.
    kv_rank: usize,
}

impl Dims {
    /// n + r: a query or key head.
    fn qk(&self) -> usize {
        self.nope + self.rope
    }
    /// D: the head width the core attends in (query, key and value padded to it).
    fn core(&self) -> usize {
        self.qk().max(self.v)
    }
}

/// The query's own latent (`q_lora_rank` > 0): down to its width, then normed.
struct QueryLatent {
    q_a_proj: Param,
    q_a_layernorm: Param,
}

/// One layer's multi-head latent attention.
pub struct Mla {
    /// With `q_lora_rank` > 0, what the query heads are made from; else they come from xn.
    q_latent: Option<Box<QueryLatent>>,
    /// What makes the query heads: `q_proj` from xn, or `q_b_proj` from the query's latent.
    q_heads: Param,
    kv_a_proj_with_mqa: Param,
    kv_a_layernorm: Param,
    kv_b_proj: Param,
    o_proj: Param,
    dims: Dims,
    /// RoPE's base and rescaling (YaRN, for V3: `rope` makes the rotation of the r rotated
    /// columns), and whether its pairs are (x₂ᵢ, x₂ᵢ₊₁) (DeepSeek's) or (xᵢ, xᵢ₊ᵣ/₂).
    theta: f64,
    scaling: RopeScaling,
    interleave: bool,
    /// The factor on the query that turns the core op's 1/√D into the softmax scale.
    query_scale: f32,
}

/// The factor on the query that turns the core op's 1/√D into the softmax scale (n+r)^-½ times
/// `softmax_factor` (YaRN's mscale², 1 without it).
fn query_scale(dims: Dims, softmax_factor: f64) -> f32 {
    ((dims.core() as f64 / dims.qk() as f64).sqrt() * softmax_factor) as f32
}

/// DeepSeek-V3's attentions: every block's `Mla`.
pub struct MlaAttentions;

impl<'g> Attentions<'g> for MlaAttentions {
    fn make(&self, layer: usize, cfg: &ModelConfig, param: &mut MakeParam) -> Result<Box<dyn Attention + 'g>> {
        let dims = Dims {
            nope: cfg.qk_nope_head_dim,
            rope: cfg.qk_rope_head_dim,
            v: cfg.v_head_dim,
            kv_rank: cfg.kv_lora_rank,
        };
        let (d, h, whole) = (cfg.hidden_size, cfg.num_attention_heads, TpCut::Whole);
        let p = |s: &str| format!("model.layers.{layer}.self_attn.{s}.weight");
        let (matrix, norm) = (ParamKind::Matrix, ParamKind::Norm);
        let (q_latent, q_heads) = match cfg.q_lora_rank {
            0 => (None, param(p("q_proj"), &[h * dims.qk(), d], matrix, TpCut::Rows)?),
            rank => (
                Some(Box::new(QueryLatent {
                    q_a_proj: param(p("q_a_proj"), &[rank, d], matrix, whole)?,
                    q_a_layernorm: param(p("q_a_layernorm"), &[rank], norm, whole)?,
                })),
                param(p("q_b_proj"), &[h * dims.qk(), rank], matrix, TpCut::Rows)?,
            ),
        };
        Ok(Box::new(Mla {
            q_latent,
            q_heads,
            kv_a_proj_with_mqa: param(p("kv_a_proj_with_mqa"), &[dims.kv_rank + dims.rope, d], matrix, whole)?,
            kv_a_layernorm: param(p("kv_a_layernorm"), &[dims.kv_rank], norm, whole)?,
            kv_b_proj: param(p("kv_b_proj"), &[h * (dims.nope + dims.v), dims.kv_rank], matrix, TpCut::Rows)?,
            o_proj: param(p("o_proj"), &[d, h * dims.v], matrix, TpCut::Columns)?,
            dims,
            theta: cfg.rope_theta,
            scaling: cfg.rope_scaling,
            interleave: cfg.rope_interleave,
            query_scale: query_scale(dims, rope_scaling::softmax_factor(&cfg.rope_scaling)),
        }))
    }
}

/// What `Mla` keeps: the latents and their norms' 1/rms, the core's padded q, the keys' and
/// values' source, and the core (`None` once given up).
struct MlaKept {
    /// The query's latent before and after its norm, and the norm's 1/rms (`q_lora_rank` > 0).
    q_latent: Option<(Tensor, Tensor, Tensor)>,
    /// c before its norm, and the norm's 1/rms.
    c: Tensor,
    c_rstd: Tensor,
    q: Tensor,
    /// [c normed | k_rot turned]: what the keys and values are made of (`HeadsFromLatent`).
    source: Tensor,
    core: Option<(Tensor, Tensor)>,
}

impl AttentionKept for MlaKept {
    fn bytes(&self) -> usize {
        let q_latent = self.q_latent.as_ref().map_or(0, |(a, b, c)| a.bytes() + b.bytes() + c.bytes());
        let core = self.core.as_ref().map_or(0, |(o, l)| o.bytes() + l.bytes());
        let rest = [&self.c, &self.c_rstd, &self.q, &self.source];
        q_latent + core + rest.iter().map(|t| t.bytes()).sum::<usize>()
    }
    fn drop_core(&mut self) {
        self.core = None; // out and lse go; q and the source stay for the backward to attend again
    }
}

/// Every head's key and value (padded to the core's D) made from a block's rows of the source
/// [c normed | k_rot turned]: k_nope and v through kv_b_proj, the one rotated key copied to every
/// head. What a ring passes is the source, kv_lora_rank + r values a token, where the heads it
/// makes are 2·H·D (V3: 576 against 49,152); each rank makes a block's heads where it lands.
struct HeadsFromLatent<'a> {
    kv_b_proj: &'a Param,
    dims: Dims,
    heads: usize,
}

/// `HeadsFromLatent` with its backward: kv_b_proj's weight gradients go to `dw`.
struct HeadsFromLatentBackward<'a> {
    kv_b_proj: &'a mut Param,
    dw: &'a mut dyn WeightGrads,
    dims: Dims,
    heads: usize,
}

/// The source's first kv_lora_rank columns: c normed.
fn latent_of(source: &Tensor, kv_rank: usize) -> Tensor {
    pick_columns(&[source], &(0..kv_rank).map(|i| Some((0, i))).collect::<Vec<_>>())
}

fn heads_from_latent(kv_b_proj: &Param, dims: Dims, heads: usize, source: &Tensor) -> (Tensor, Tensor) {
    let Dims { nope, v: vd, kv_rank, .. } = dims;
    let (qk, dd, kv_w) = (dims.qk(), dims.core(), nope + vd);
    // kv: per head [k_nope | v]; the core's heads, D wide: [k_nope | k_rot | 0], [v | 0]
    let kv = kv_b_proj.linear(&latent_of(source, kv_rank));
    let k = pick_columns(
        &[&kv, source],
        &per_head(heads, dd, |h, i| match i {
            i if i < nope => Some((0, h * kv_w + i)),
            i if i < qk => Some((1, kv_rank + i - nope)),
            _ => None,
        }),
    );
    let v = pick_columns(&[&kv], &per_head(heads, dd, |h, i| (i < vd).then_some((0, h * kv_w + nope + i))));
    (k, v)
}

impl MakeKeys for HeadsFromLatent<'_> {
    fn keys(&self, source: &Tensor) -> (Tensor, Tensor) {
        heads_from_latent(self.kv_b_proj, self.dims, self.heads, source)
    }
}

impl MakeKeys for HeadsFromLatentBackward<'_> {
    fn keys(&self, source: &Tensor) -> (Tensor, Tensor) {
        heads_from_latent(self.kv_b_proj, self.dims, self.heads, source)
    }
}

impl MakeKeysBackward for HeadsFromLatentBackward<'_> {
    /// [dc normed | dk_rot]: the rotated key's gradient summed over the heads, c's through
    /// kv_b_proj (whose weight gradient reads this block's c).
    fn keys_backward(&mut self, source: &Tensor, dk: &Tensor, dv: &Tensor) -> Tensor {
        let (Dims { nope, rope, v: vd, kv_rank }, heads) = (self.dims, self.heads);
        let (dd, kv_w) = (self.dims.core(), nope + vd);
        let dk_rot_heads = pick_columns(&[dk], &per_head(heads, rope, |h, i| Some((0, h * dd + nope + i))));
        let rows = dk_rot_heads.rows();
        let each: Vec<u32> = (0..(rows * heads) as u32).collect();
        let dk_rot = route::weighted_sum(&dk_rot_heads.with_shape(&[rows * heads, rope]), &each, None, rows);
        // kv_b_proj's layout: per head [k_nope | v]
        let dkv = pick_columns(
            &[dk, dv],
            &per_head(heads, kv_w, |h, j| match j {
                j if j < nope => Some((0, h * dd + j)),
                j => Some((1, h * dd + j - nope)),
            }),
        );
        let dc_normed = self.kv_b_proj.linear_input_grad(&dkv);
        self.dw.linear(Cow::Owned(latent_of(source, kv_rank)), vec![(Cow::Owned(dkv), &mut *self.kv_b_proj)]);
        let width = kv_rank + rope;
        let picks: Vec<Pick> = (0..width).map(|j| Some(if j < kv_rank { (0, j) } else { (1, j - kv_rank) })).collect();
        pick_columns(&[&dc_normed, &dk_rot], &picks)
    }
}

/// Where an output column comes from: column `1` of source `0`, or a zero.
type Pick = Option<(usize, usize)>;

/// `[rows, picks.len()]`: each column copied from a column of one of `sources` (each
/// `[rows, width]`), or zero. One gather of blocks as wide as the runs allow (`ops::gather_blocks`,
/// on the device the tensors are on).
fn pick_columns(sources: &[&Tensor], picks: &[Pick]) -> Tensor {
    let rows = sources[0].rows();
    // the block width: every run of consecutive source columns, every source, cut in whole blocks
    let mut g = picks.len();
    for s in sources {
        g = gcd(g, s.cols());
    }
    for (j, pick) in picks.iter().enumerate() {
        let follows = j > 0
            && match (picks[j - 1], *pick) {
                (Some((a, i)), Some((b, k))) => a == b && i + 1 == k,
                (None, None) => true,
                _ => false,
            };
        if !follows {
            g = gcd(g, j);
            if let Some((_, c)) = pick {
                g = gcd(g, *c);
            }
        }
    }
    let starts: Vec<usize> = sources.iter().scan(0, |at, s| Some(std::mem::replace(at, *at + s.numel()))).collect();
    let zeros_asked = picks.iter().any(Option::is_none);
    let zero = (starts.last().unwrap_or(&0) + sources.last().map_or(0, |s| s.numel())) / g; // the appended zeros
    let starts = &starts;
    let order: Vec<u32> = (0..rows)
        .flat_map(|r| {
            picks.chunks(g).map(move |block| match block[0] {
                Some((s, c)) => ((starts[s] + r * sources[s].cols() + c) / g) as u32,
                None => zero as u32,
            })
        })
        .collect();
    // one source and no zeros: gathered where it is; else the sources (and a block of zeros) in one
    if let ([one], false) = (sources, zeros_asked) {
        return ops::gather_blocks(one, g, &order).with_shape(&[rows, picks.len()]);
    }
    let mut all: Vec<&Tensor> = sources.to_vec();
    let zeros = Tensor::zeros_as(&[g], sources[0]);
    all.push(&zeros);
    ops::gather_blocks(&ops::concat(&all), g, &order).with_shape(&[rows, picks.len()])
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Mla {
    /// Column i of a rotated part as the rotation sees it: with interleaved pairs the evens
    /// first, then the odds (transformers' output layout); else as stored.
    fn rotated(&self, i: usize) -> usize {
        let r = self.dims.rope;
        match self.interleave {
            true if i < r / 2 => 2 * i,
            true => 2 * (i - r / 2) + 1,
            false => i,
        }
    }

    /// Where column `i` of the rotated layout sits in the stored layout, inverted: stored column
    /// j → its place in the rotated layout.
    fn stored(&self, j: usize) -> usize {
        let r = self.dims.rope;
        match self.interleave {
            true if j.is_multiple_of(2) => j / 2,
            true => r / 2 + j / 2,
            false => j,
        }
    }

    /// RoPE's rotation of the rotated columns (made when a forward asks: a few numbers).
    fn rope(&self) -> Rope {
        rope_scaling::rope_of(self.theta, &self.scaling, self.dims.rope)
    }

    /// The core's shape: this rank's heads, D wide, one KV head per query head.
    fn core_attn(&self, a: Attn) -> Attn {
        Attn { kv_heads: a.heads, head_dim: self.dims.core(), ..a }
    }
}

/// What a forward makes before the heads' keys and values: the query heads (and the query's
/// latent: a, normed, rstd), the latent c (its norm's rstd), the rotated parts of the query
/// heads, turned by their positions (in the rotation's layout), and the source every head's key
/// and value are made of, [c normed | k_rot turned] (generating: the one shared key).
struct Latents {
    q: Tensor,
    q_latent: Option<(Tensor, Tensor, Tensor)>,
    c: Tensor,
    c_rstd: Tensor,
    q_rot: Tensor,
    source: Tensor,
}

impl Mla {
    fn latents(&self, tp: &dyn TensorSplit, xn: &Tensor, heads: usize, positions: &[u32]) -> Result<Latents> {
        let Dims { nope, rope, kv_rank, .. } = self.dims;
        let qk = self.dims.qk();
        let xin = tp.gather_rows(xn)?;
        let (q, q_latent) = match &self.q_latent {
            None => (self.q_heads.linear(&xin), None),
            Some(l) => {
                let a = l.q_a_proj.linear(&xin);
                let (a_normed, rstd) = ops::rmsnorm(&a, &l.q_a_layernorm.value, LATENT_EPS);
                (self.q_heads.linear(&a_normed), Some((a, a_normed, rstd)))
            }
        };
        let ckv = self.kv_a_proj_with_mqa.linear(&xin);
        drop(xin);
        let c = pick_columns(&[&ckv], &(0..kv_rank).map(|i| Some((0, i))).collect::<Vec<_>>());
        let (c_normed, c_rstd) = ops::rmsnorm(&c, &self.kv_a_layernorm.value, LATENT_EPS);
        let mut q_rot = pick_columns(&[&q], &per_head(heads, rope, |h, i| Some((0, h * qk + nope + self.rotated(i)))));
        let mut k_rot =
            pick_columns(&[&ckv], &(0..rope).map(|i| Some((0, kv_rank + self.rotated(i)))).collect::<Vec<_>>());
        drop(ckv);
        let turn = self.rope();
        ops::rope(&mut q_rot, positions, &turn);
        ops::rope(&mut k_rot, positions, &turn);
        let picks: Vec<Pick> =
            (0..kv_rank + rope).map(|i| Some(if i < kv_rank { (0, i) } else { (1, i - kv_rank) })).collect();
        let source = pick_columns(&[&c_normed, &k_rot], &picks);
        Ok(Latents { q, q_latent, c, c_rstd, q_rot, source })
    }

    /// What makes this rank's `heads` keys and values from the source.
    fn heads_from_latent(&self, heads: usize) -> HeadsFromLatent<'_> {
        HeadsFromLatent { kv_b_proj: &self.kv_b_proj, dims: self.dims, heads }
    }
}

impl Attention for Mla {
    fn params(&self) -> Vec<&Param> {
        let mut v: Vec<&Param> = self.q_latent.iter().flat_map(|l| [&l.q_a_proj, &l.q_a_layernorm]).collect();
        v.extend([&self.q_heads, &self.kv_a_proj_with_mqa, &self.kv_a_layernorm, &self.kv_b_proj, &self.o_proj]);
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v: Vec<&mut Param> =
            self.q_latent.iter_mut().flat_map(|l| [&mut l.q_a_proj, &mut l.q_a_layernorm]).collect();
        v.extend([
            &mut self.q_heads,
            &mut self.kv_a_proj_with_mqa,
            &mut self.kv_a_layernorm,
            &mut self.kv_b_proj,
            &mut self.o_proj,
        ]);
        v
    }

    fn forward(
        &self,
        tp: &dyn TensorSplit,
        xn: &Tensor,
        (attn, positions): (Attn, &[u32]),
        attend: &mut dyn Attend,
    ) -> Result<(Tensor, Box<dyn AttentionKept>, u64)> {
        let (Dims { nope, rope, v: vd, .. }, heads) = (self.dims, attn.heads);
        let (qk, dd) = (self.dims.qk(), self.dims.core());
        let Latents { q, q_latent, c, c_rstd, q_rot, source } = self.latents(tp, xn, heads, positions)?;
        // the core's query heads, D wide: [q_nope | q_rot | 0]
        let mut qc = pick_columns(
            &[&q, &q_rot],
            &per_head(heads, dd, |h, i| match i {
                i if i < nope => Some((0, h * qk + i)),
                i if i < qk => Some((1, h * rope + i - nope)),
                _ => None,
            }),
        );
        drop((q, q_rot));
        if self.query_scale != 1.0 {
            ops::scale(&mut qc, self.query_scale);
        }
        let core = self.core_attn(attn);
        let (out, lse, work) = attend.attend_from(core, &qc, (&source, &self.heads_from_latent(heads)))?;
        let out_v = pick_columns(&[&out], &per_head(heads, vd, |h, i| Some((0, h * dd + i))));
        let h = tp.row_forward(&out_v, &self.o_proj)?;
        let kept = MlaKept { q_latent, c, c_rstd, q: qc, source, core: Some((out, lse)) };
        Ok((h, Box::new(kept), work))
    }

    /// Generating with the latent in the cache (DeepSeek's inference form). Head h's key is
    /// W_UK·c and its value W_UV·c (W_UK, W_UV: its rows of kv_b_proj), so
    /// q_nope·k_nope = (q_nope·W_UK)·c and o = W_UV·Σⱼ pⱼcⱼ: with the query moved into the latent
    /// space, every head attends to one shared key [c | k_rot] (kv_lora_rank + r wide: 576
    /// values a token in V3) which is also its value (the output's rotated columns are dropped),
    /// and W_UV applies after the core. The cache keeps that one key a token (`KvLayer::attend`
    /// holds a key that is its own value once), where the training form expands every head.
    fn generate(
        &self,
        tp: &dyn TensorSplit,
        xn: &Tensor,
        (attn, positions): (Attn, &[u32]),
        past: KvLayer,
    ) -> Result<Tensor> {
        let (Dims { nope, rope, v: vd, kv_rank }, heads) = (self.dims, attn.heads);
        let (qk, wide) = (self.dims.qk(), kv_rank + rope);
        let Latents { q, q_rot, source: key, .. } = self.latents(tp, xn, heads, positions)?;
        let (kv_b, precision) = (&self.kv_b_proj.value, self.kv_b_proj.precision);
        let rows_of =
            |h: usize, from: usize, n: usize| ops::slice(kv_b, (h * (nope + vd) + from) * kv_rank, &[n, kv_rank]);
        // each head's query in the latent space: q_nope · W_UK, [rows, kv_lora_rank]
        let absorbed: Vec<Tensor> = (0..heads)
            .map(|h| {
                let q_nope = pick_columns(&[&q], &(0..nope).map(|i| Some((0, h * qk + i))).collect::<Vec<_>>());
                ops::linear_input_grad(&q_nope, &rows_of(h, 0, nope), precision)
            })
            .collect();
        let mut sources: Vec<&Tensor> = absorbed.iter().collect();
        sources.push(&q_rot);
        let mut q_wide = pick_columns(
            &sources,
            &per_head(heads, wide, |h, i| Some(if i < kv_rank { (h, i) } else { (heads, h * rope + i - kv_rank) })),
        );
        // the op's 1/√(kv_lora_rank + r) made the softmax scale
        ops::scale(&mut q_wide, self.query_scale * (self.dims.core() as f32 / wide as f32).sqrt().recip());
        let core = Attn { kv_heads: 1, head_dim: wide, ..attn };
        let (out, _, _) = past.attend(core, &q_wide, &key, &key, positions);
        let heads_v: Vec<Tensor> = (0..heads)
            .map(|h| {
                let o_latent =
                    pick_columns(&[&out], &(0..kv_rank).map(|i| Some((0, h * wide + i))).collect::<Vec<_>>());
                ops::linear(&o_latent, &rows_of(h, nope, vd), precision) // W_UV after the core
            })
            .collect();
        let out_v = pick_columns(&heads_v.iter().collect::<Vec<_>>(), &per_head(heads, vd, |h, i| Some((h, i))));
        tp.row_forward(&out_v, &self.o_proj)
    }

    fn backward(
        &mut self,
        split: Splits,
        dy: &Tensor,
        (xn, kept): (Tensor, Box<dyn AttentionKept>),
        (attn, positions): (Attn, &[u32]),
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let MlaKept { q_latent, c, c_rstd, q, source, core } = *kept_as::<MlaKept>(kept)?;
        let (Dims { nope, rope, v: vd, kv_rank }, heads) = (self.dims, attn.heads);
        let (qk, dd) = (self.dims.qk(), self.dims.core());
        let (tp, pos, a) = (split.tp, &positions[..attn.seq], self.core_attn(attn));
        let (out, lse) = match core {
            Some(core) => core,
            None => {
                // not kept: made again
                let from = (&source, &self.heads_from_latent(heads) as &dyn MakeKeys);
                split.seq.attention_from(a, &q, from, pos).map(|(o, l, _)| (o, l))?
            }
        };
        // o_proj is row parallel: local
        let dy = tp.gather_rows(dy)?;
        let dout_v = self.o_proj.linear_input_grad(&dy);
        let out_v = pick_columns(&[&out], &per_head(heads, vd, |h, i| Some((0, h * dd + i))));
        dw.linear(Cow::Owned(out_v), vec![(dy, &mut self.o_proj)]);
        let dout = pick_columns(&[&dout_v], &per_head(heads, dd, |h, i| (i < vd).then_some((0, h * vd + i))));
        drop(dout_v);
        // the core's backward: kv_b_proj's weight gradient made on the way, block by block
        let mut keys = HeadsFromLatentBackward { kv_b_proj: &mut self.kv_b_proj, dw: &mut *dw, dims: self.dims, heads };
        let (mut dq_c, dsource) =
            split.seq.attention_from_backward(a, &q, (&source, &mut keys), pos, (&out, &lse), &dout)?;
        drop((keys, q, source, out, lse, dout));
        if self.query_scale != 1.0 {
            ops::scale(&mut dq_c, self.query_scale);
        }
        // the rotated parts' gradients, each turned back by its position: the query's per head,
        // the shared key's (summed over heads) from the source's
        let mut dq_rot = pick_columns(&[&dq_c], &per_head(heads, rope, |h, i| Some((0, h * dd + nope + i))));
        let mut dk_rot = pick_columns(&[&dsource], &(0..rope).map(|i| Some((0, kv_rank + i))).collect::<Vec<_>>());
        let turn = self.rope();
        ops::rope_backward(&mut dq_rot, positions, &turn);
        ops::rope_backward(&mut dk_rot, positions, &turn);
        // back to the query projection's layout: per head [nope | rot as stored]
        let dq = pick_columns(
            &[&dq_c, &dq_rot],
            &per_head(heads, qk, |h, j| match j {
                j if j < nope => Some((0, h * dd + j)),
                j => Some((1, h * rope + self.stored(j - nope))),
            }),
        );
        drop((dq_c, dq_rot));
        // the latent c's norm
        let dc_normed = latent_of(&dsource, kv_rank);
        let ln = &mut self.kv_a_layernorm;
        let dc = ops::rmsnorm_backward(&dc_normed, &c, &ln.value, &c_rstd, &mut ln.grad, None);
        let dckv = pick_columns(
            &[&dc, &dk_rot],
            &(0..kv_rank + rope)
                .map(|j| if j < kv_rank { Some((0, j)) } else { Some((1, self.stored(j - kv_rank))) })
                .collect::<Vec<_>>(),
        );
        // the two projections that read xn: one sum of their input gradients
        match (&mut self.q_latent, q_latent) {
            (None, _) => {
                tp.column_backward(xn, vec![(dq, &mut self.q_heads), (dckv, &mut self.kv_a_proj_with_mqa)], dw)
            }
            (Some(l), Some((qa, qa_normed, qa_rstd))) => {
                let dqa_normed = self.q_heads.linear_input_grad(&dq);
                dw.linear(Cow::Owned(qa_normed), vec![(Cow::Owned(dq), &mut self.q_heads)]);
                let ln = &mut l.q_a_layernorm;
                let dqa = ops::rmsnorm_backward(&dqa_normed, &qa, &ln.value, &qa_rstd, &mut ln.grad, None);
                tp.column_backward(xn, vec![(dqa, &mut l.q_a_proj), (dckv, &mut self.kv_a_proj_with_mqa)], dw)
            }
            (Some(_), None) => Err(anyhow!("backward: a latent query's forward kept no latent")),
        }
    }
}

/// `heads` runs of `width` picks, `pick(head, column)` each.
fn per_head(heads: usize, width: usize, pick: impl Fn(usize, usize) -> Pick) -> Vec<Pick> {
    (0..heads).flat_map(|h| (0..width).map(move |i| (h, i))).map(|(h, i)| pick(h, i)).collect()
}
