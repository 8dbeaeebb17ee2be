//! # The plain values every backend agrees on
//!
//! The dtype numbers are computed in, the shape of an attention call, AdamW's settings and how a
//! collective reduces: the op layer (`ops/mod.rs`), its CPU kernels (`cpu.rs`), the GPU's launch
//! table (`cuda/launch_table.rs`) and both collective backends (`comm/local.rs`, `comm/nccl.rs`)
//! read them, so they live below all of those and import nothing.

/// What the kernels compute with.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DType {
    F32,
    Bf16,
}

impl DType {
    /// Bytes per number.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

/// The shape of one attention call: `seq` queries and `kv_seq` keys per sequence.
#[derive(Clone, Copy, Debug)]
pub struct Attn {
    pub batch: usize,
    pub seq: usize,
    pub kv_seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The widest head the CUDA attention kernels take (`kernels/attention.cu`'s wide form, past the
/// tensor cores' 128): latent attention's 192 a head in training and 576 in generate's absorbed
/// form fit. The config refuses wider heads on a GPU before a run starts.
pub const WIDE_HEAD_DIM: usize = 640;

/// AdamW's settings for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWSettings {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step, for the bias corrections.
    pub step: u32,
    /// The gradient is multiplied by this as it is read: the clipping factor (1 when the norm is
    /// within the limit), folded in so that no separate pass over the gradients scales them.
    pub grad_scale: f32,
    /// The dtype the moments are kept in (`train.optimizer_dtype`): f32, or bf16 (on the CPU
    /// stored in f32 but rounded to bf16 after each update: the same numbers).
    pub moments: DType,
}

/// How tensor parallelism (step 09) cuts a weight W `[out, in]` over its ranks: rank r of n holds
/// the r-th of n slices of its rows (Megatron's column-parallel layers: q, gate, up, the
/// embedding and the output layer) or of its columns (row-parallel: o, down); norms and routers
/// stay whole on every rank. k and v are rows of whole KV heads (`HeadRows(kv_heads)`): cut as
/// rows while n divides the heads; with more ranks than KV heads, n / kv_heads neighbouring ranks
/// hold the same head (copies). On one rank every cut is the whole weight. (Step 11 names these
/// `Shard(0)`, `Shard(1)` and `Replicate`: placements on the tp axis.)
///
/// ```text
/// HeadRows(2), n = 4:   rank 0 1 │ 2 3      rank r holds head ⌊r · 2 / 4⌋: two copies of each
///                       head   0 │   1
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpCut {
    Rows,
    HeadRows(usize),
    Columns,
    Whole,
}

impl TpCut {
    /// The dimension it cuts (`None`: whole).
    pub fn dim(self) -> Option<usize> {
        match self {
            TpCut::Rows | TpCut::HeadRows(_) => Some(0),
            TpCut::Columns => Some(1),
            TpCut::Whole => None,
        }
    }

    /// How many different slices n ranks hold (1: whole).
    pub fn parts(self, n: usize) -> usize {
        match self {
            TpCut::Rows | TpCut::Columns => n,
            TpCut::HeadRows(heads) => n.min(heads),
            TpCut::Whole => 1,
        }
    }

    /// Rank r of n's slice: (its index, of how many) — r's own, or the one it holds a copy of.
    pub fn part_of(self, (r, n): (usize, usize)) -> (usize, usize) {
        let parts = self.parts(n);
        (r * parts / n, parts)
    }

    /// How many of n ranks hold each slice of a cut weight (more than 1: copies, whose gradients
    /// add up); a whole weight is not cut: 1.
    pub fn copies(self, n: usize) -> usize {
        match self {
            TpCut::Whole => 1,
            cut => n / cut.parts(n),
        }
    }
}

/// How a collective combines the members' numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
}

/// RoPE's angles for heads `2 · inv_freq.len()` wide: pair i of a head turns by
/// position · `inv_freq[i]`, and its cos and sin are multiplied by `scale`. Plain RoPE
/// (`Rope::plain`) has inv_freq[i] = θ^(−2i/head_dim) and scale 1; a context longer than the one
/// trained on rescales both (the model's family asks `rope_scaling.rs`).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub inv_freq: Vec<f64>,
    pub scale: f64,
}

impl Rope {
    pub fn plain(theta: f64, head_dim: usize) -> Rope {
        let inv_freq = (0..head_dim / 2).map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64)).collect();
        Rope { inv_freq, scale: 1.0 }
    }

    /// The width of the heads it turns.
    pub fn head_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }
}
