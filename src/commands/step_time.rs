//! # A step's time from first principles: compute, communication, what hides behind what
//!
//! A step is micro-batches of forward and backward on every pipeline stage, the collectives of
//! `traffic.rs` between and beside them, and the optimizer. Each part's time is its work over
//! the rate the device reaches on that kind of work — a *calibrated* rate, not the datasheet's:
//!
//! ```text
//! GEMMs       2·m·k·n FLOPs a call (backward: two of the same size) / (peak × efficiency(FLOPs of the call)),
//!             or (m·k + k·n + m·n)·e bytes / bandwidth where that is longer (the roofline of the shape)
//! attention   4·b·h·s²·d/2 FLOPs forward (causal; the busiest cp rank's share), 2.5× that backward
//!             / (peak × attention efficiency)
//! small ops   the bytes the norms, RoPE, SwiGLU, residual adds and the loss read and write
//!             / the bandwidth they reach, + a fixed cost a launch
//! optimizer   ~36 bytes a trained value (AdamW: master, gradient, two moments, the copy) / bandwidth
//! a call      hops·α + moved bytes/β (comm/cost.rs), on NVLink inside a node, the network across
//! ```
//! Then the pipeline: the schedule's own clock (`commands/schedule.rs`, forward 1, backward 2)
//! played with this stage's times gives the bubble. And the overlap, call by call, against only
//! the work that runs beside that call in the step (`exposed`):
//!
//! ```text
//! call                          hides behind                                       the rest shows
//! a ring's K|V hop              one block's attention in one layer (the one in hand) per hop
//! FSDP's gather of a unit       the unit before it, computing (the first: nothing)  per unit
//! a gradient bucket's reduce    the backward of the earlier layers (the last: none) per step
//! tp's backward all-reduces     the weight-gradient GEMMs they are started before   per step
//! Ulysses, experts, pipeline    nothing: the next op waits for them                 all of it
//! ```
//! and a call hidden is not free: while it runs it takes a share of the device from the compute
//! beside it (NCCL's kernels occupy SMs), so its hidden part costs `Rates::overlap_slowdown` of
//! itself. What the calibration holds for a GPU, and where it comes from, is in `Rates`;
//! `ferrotron bench --calibrate` measures this machine's.
//!
//! The GEMMs are the model's own, layer by layer: latent attention's five projections, kv_b_proj
//! where its heads are made (once, or once per ring block, and again in the backward, which
//! makes them from the kept latent), its core at the padded head width; DeepSeekMoE's router,
//! experts of their own width and shared experts, its first layers dense. The core's rate is
//! the calibration's: at heads past 128 a GPU runs the slower wide kernels, which only a
//! calibration at those shapes has timed.

use crate::comm::cost::Call;
use crate::commands::traffic::Flow;
use crate::config::{Config, CpMode, CpSplit, Recompute, ZeroReduce};
use crate::devices::Gpu;
use crate::model::stage::Stage;

/// What a device reaches, measured: the basis of every time the plan predicts.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Rates {
    /// Where these come from (a measurement and its date, or the figures it was derived from).
    pub source: String,
    /// The dense peak of the compute dtype, TFLOP/s.
    pub peak_tflops: f64,
    /// GEMM efficiency (fraction of the peak) by FLOPs a call: points (FLOPs, efficiency),
    /// rising; between them interpolated on log FLOPs, outside them the nearest.
    pub gemm: Vec<(f64, f64)>,
    /// Attention forward + backward, fraction of the peak (causal FLOPs).
    pub attention: f64,
    /// The bandwidth small ops reach, GB/s.
    pub small_gb_s: f64,
    /// The fixed cost of one small op (a kernel launch, a thread pool's dispatch), µs.
    pub op_us: f64,
    /// The compute lost while a collective runs beside it, as a fraction of the collective's
    /// hidden time: the share of the device its kernels take (0: none, as on a CPU, whose local
    /// backend's copies the calibration's own steps already include).
    #[serde(default)]
    pub overlap_slowdown: f64,
}

impl Rates {
    /// The GEMM efficiency at `flops` a call.
    pub fn gemm_efficiency(&self, flops: f64) -> f64 {
        let g = &self.gemm;
        let (first, last) = (g[0], g[g.len() - 1]);
        if flops <= first.0 {
            return first.1;
        }
        if flops >= last.0 {
            return last.1;
        }
        let i = g.iter().position(|p| p.0 >= flops).expect("inside the points");
        let (a, b) = (g[i - 1], g[i]);
        let f = (flops.ln() - a.0.ln()) / (b.0.ln() - a.0.ln());
        a.1 + f * (b.1 - a.1)
    }

    /// Seconds of one GEMM of (rows, k, n) in elements of `e` bytes, at the roofline of its
    /// shape: its FLOPs at the calibrated efficiency of their count, or — where the operands are
    /// large against the work, as an expert's GEMM over a few rows — the time to read both and
    /// write the product at the bandwidth the small ops reach, whichever is longer.
    pub fn gemm_seconds(&self, (rows, k, n): (f64, f64, f64), e: f64) -> f64 {
        let flops = 2.0 * rows * k * n;
        let compute = flops / (self.peak_tflops * 1e12 * self.gemm_efficiency(flops));
        let memory = (rows * k + k * n + rows * n) * e / (self.small_gb_s * 1e9);
        compute.max(memory)
    }

    /// What an H100 SXM reached with ferrotron's kernels (`BENCHMARKS.md`, 2026-11-24, 26 and 27),
    /// cuBLAS 13.1, bf16. GEMM efficiencies from `bench --profile`'s time per shape on 2026-11-24
    /// (BENCHMARKS.md lists them; the GEMMs have not changed since): 576×192×16384, 3.6 GFLOP in
    /// 21.9 µs = 0.17 of 989.4; 576×16384×576, 10.9 in 22.9 µs = 0.48; 576×16384×1536, 29.0 in
    /// 44.2 µs = 0.66; 2048×8192×2048, 68.7 in 95.7 µs = 0.73; 5632×8192×2048, 189 in 246 µs = 0.78.
    /// Attention: 0.745 ms a layer, forward + backward, at smollm-135m b 8 (2026-11-27): 135
    /// GFLOP causal, 0.18. The small ops, from the 135M step's profile (2026-11-27, 75 ms): less
    /// attention (21.8), the GEMMs (≈ 25), the optimizer's lists (2.0) and the GPU's idle time
    /// (2.4) leaves 23.8 ms for the 53 GB `small_bytes` and the loss's passes count there: 2.23
    /// TB/s (0.67 of the HBM's 3.35); the idle 2.4 ms over its ~1,270 small launches: 1.9 µs a
    /// launch. smollm-360m and llama-1b are then predictions (BENCHMARKS.md sets them beside
    /// their measured steps). The overlap's slowdown is not measured here: DeepSeek-V3's report
    /// (arXiv:2412.19437, §3.2.2) gives its communication kernels 20 of an H800's 132 SMs to
    /// fill InfiniBand and NVLink, so compute beside a collective keeps about 112/132 of the
    /// device: 0.15 of the hidden time is lost.
    pub fn h100() -> Rates {
        Rates {
            source: "H100 SXM, ferrotron's kernels, measured 2026-11-26/27 (BENCHMARKS.md)".into(),
            peak_tflops: 989.4,
            gemm: vec![(3.6e9, 0.17), (1.09e10, 0.48), (2.9e10, 0.66), (6.87e10, 0.73), (1.89e11, 0.78)],
            attention: 0.18,
            small_gb_s: 2230.0,
            op_us: 1.9,
            overlap_slowdown: 20.0 / 132.0,
        }
    }

    /// Another GPU of the table: the H100's measured efficiencies and small-op share of its HBM
    /// bandwidth, on its own peak and bandwidth (an assumption, said in every answer).
    pub fn scaled(gpu: &Gpu, peak_tflops: f64) -> Rates {
        let h = Rates::h100();
        Rates {
            source: format!(
                "{}: the H100's measured efficiencies on its peak and bandwidth ({}; assumed)",
                gpu.name, gpu.source
            ),
            peak_tflops,
            small_gb_s: h.small_gb_s / 3.35 * gpu.hbm_tb_s,
            ..h
        }
    }
}

/// A link's latency (s) and bandwidth (bytes/s) a direction.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct Wire {
    pub alpha_s: f64,
    pub beta_b_s: f64,
}

/// The cluster's wires: inside a node, across nodes, and how many GPUs (ranks) a node holds.
#[derive(Clone, Copy, Debug)]
pub struct Wires {
    pub node: Wire,
    pub net: Wire,
    pub per_node: usize,
}

/// How many consecutive ranks one group of `axis` spans (tp fastest, then cp, pp, dp: the grid's
/// order): a group inside that many ranks stays inside a node when they fit in one.
pub fn span(cfg: &Config, axis: &str) -> usize {
    let p = &cfg.parallel;
    let z = p.dp * p.cp;
    // a cut of the dp×cp ranks in blocks of k (cp fastest, then dp, pp apart)
    let blocks = |k: usize| if k <= p.cp { k * p.tp } else { k.div_ceil(p.cp) * p.tp * p.cp * p.pp };
    match axis {
        "tp" => p.tp,
        "cp" => p.tp * p.cp,
        "pp" => p.tp * p.cp * p.pp,
        "ep" => blocks(p.ep),
        "shard" => blocks(p.dp_shard * p.cp),
        "dp×cp" => blocks(z),
        _ => p.world_size(), // world, replicate, edp: strided over all of dp×cp
    }
}

/// Seconds of `flow` on `wires`: latency by hops (an all-reduce by a tree, ⌈log₂ n⌉ up and down,
/// as NCCL does for small messages; every other call by the ring's n − 1), bandwidth by the
/// bytes each rank moves (`comm/cost.rs`). An all-to-all across nodes is two wires at once: of
/// its n − 1 destinations, the g − 1 in this rank's node take their share over NVLink while the
/// n − g others take theirs over the network, and the slower of the two sets its time.
pub fn flow_seconds(cfg: &Config, flow: &Flow, wires: &Wires) -> f64 {
    let n = flow.ranks as f64;
    let spans = span(cfg, flow.axis);
    let wire = if spans <= wires.per_node { wires.node } else { wires.net };
    if flow.call == Call::AllToAll && spans > wires.per_node {
        // the group's ranks are spread evenly over its span: this many share a node
        let g = (wires.per_node as f64 * n / spans as f64).floor().clamp(1.0, n);
        let inside = flow.bytes * (g - 1.0) / n / wires.node.beta_b_s;
        let across = flow.bytes * (n - g) / n / wires.net.beta_b_s;
        return flow.calls * (n - 1.0) * wires.net.alpha_s + inside.max(across);
    }
    let (hops, moved) = match flow.call {
        Call::AllReduce => (2.0 * n.log2().ceil(), 2.0 * (n - 1.0) / n),
        Call::AllGather | Call::ReduceScatter | Call::AllToAll => (n - 1.0, (n - 1.0) / n),
        Call::Broadcast => (n.log2().ceil(), 1.0),
        Call::P2p => (1.0, 1.0),
    };
    flow.calls * hops * wire.alpha_s + flow.bytes * moved / wire.beta_b_s
}

/// One micro-batch on one pipeline stage, in seconds.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct MicroBatch {
    pub forward: f64,
    pub backward: f64,
    /// Of them, attention's (forward + backward).
    pub attention: f64,
    /// One K|V block's attention in one layer, forward and backward: what one ring hop hides
    /// behind (the block in hand computes while the next travels).
    pub ring_block: (f64, f64),
    /// Of the backward, the weight-gradient GEMMs: what tensor parallelism's backward all-reduce
    /// runs beside.
    pub weight_grads: f64,
}

/// Bytes a row's small ops read and write in one block's forward (the backward: twice that),
/// elements of `e` bytes: two RMSNorms (x in, y out) and two residual adds (two in, one out) on
/// d, RoPE on q and k, SwiGLU (gate, up in, product out), the casts around each GEMM's input.
pub fn small_bytes(cfg: &Config, e: f64) -> f64 {
    let (m, tp) = (&cfg.model, cfg.parallel.tp as f64);
    let d = m.hidden_size as f64;
    // latent attention: its heads padded to the core's width, and its latents (replicated), normed
    let (q, kv) = match m.latent() {
        None => {
            ((m.num_attention_heads * m.head_dim()) as f64 / tp, (m.kv_heads_on(cfg.parallel.tp) * m.head_dim()) as f64)
        }
        Some(l) => {
            let heads = (m.num_attention_heads * m.core_head_dim()) as f64 / tp;
            (heads, heads + (l.kv_rank + l.rope + l.q_rank) as f64)
        }
    };
    let f = match (m.num_local_experts, m.deepseek_moe()) {
        (0, _) => m.intermediate_size as f64 / tp,
        (_, Some(ds)) => ((m.num_experts_per_tok + ds.shared) * ds.width) as f64,
        (_, None) => (m.num_experts_per_tok * m.intermediate_size) as f64,
    };
    e * (2.0 * 2.0 * d + 2.0 * 3.0 * d + 2.0 * (q + kv) + 3.0 * f + 2.0 * d + q)
}

/// One micro-batch's forward and backward on `stage` at `rates`, with `ranks_sharing` ranks on
/// each device (threads sharing a CPU's cores: each gets its share of the rate).
pub fn micro_batch(cfg: &Config, stage: Stage, rates: &Rates, share: f64) -> MicroBatch {
    let (m, t, p) = (&cfg.model, &cfg.train, &cfg.parallel);
    let e = if cfg.device.compute_dtype() == crate::ops::DType::Bf16 { 2.0 } else { 4.0 };
    let rows = (t.micro_batch_size * t.seq_len / p.cp) as f64;
    let (d, tp) = (m.hidden_size as f64, p.tp as f64);
    let heads = m.num_attention_heads as f64 / tp;
    let layers = stage.layer_count(m.num_hidden_layers) as f64;
    let gemm = |g: &[Gemm]| g.iter().map(|&shape| rates.gemm_seconds(shape, e)).sum::<f64>() / share;
    // each GEMM of a block: (rows, k, n) forward; backward two of the same FLOPs. The MLP's differ
    // by layer where DeepSeekMoE's first layers are dense: their mean over this stage's layers
    let (attention, heads_made) = attention_gemms(cfg, rows);
    let heads_made = gemm(&heads_made);
    let dense = match m.deepseek_moe() {
        Some(ds) => stage
            .chunk_layers(m.num_hidden_layers)
            .iter()
            .map(|r| r.end.min(ds.dense_below).saturating_sub(r.start))
            .sum(),
        None if m.num_local_experts == 0 => stage.layer_count(m.num_hidden_layers),
        None => 0,
    } as f64;
    let (dense_mlp, moe_mlp) = (gemm(&mlp_gemms(cfg, rows, false)), gemm(&mlp_gemms(cfg, rows, true)));
    let mlp = if layers > 0.0 { (dense * dense_mlp + (layers - dense) * moe_mlp) / layers } else { 0.0 };
    let layer_gemms = gemm(&attention) + mlp;
    // attention: this rank's heads over its 1/cp of the causal square, in the core's head width;
    // a ring cut in contiguous chunks gives its last rank the most (its queries see every key
    // before them: (2cp − 1)/cp of the mean), which the others wait for; zigzag's pairs of
    // chunks balance it
    let s = t.seq_len as f64;
    let core = m.core_head_dim() as f64;
    let cp = p.cp as f64;
    let busiest = match (p.cp_mode, p.cp_split) {
        (CpMode::Ring, CpSplit::Contiguous) => (2.0 * cp - 1.0) / cp,
        _ => 1.0,
    };
    let attention_forward = 4.0 * t.micro_batch_size as f64 * heads * s * s * core / 2.0 / cp * busiest;
    let att = attention_forward * 3.5 / (rates.peak_tflops * 1e12 * rates.attention) / share;
    let (att_f, att_b) = (att / 3.5, att * 2.5 / 3.5);
    let small = |bytes: f64, ops: f64| (bytes / (rates.small_gb_s * 1e9) + ops * rates.op_us * 1e-6) / share;
    let small_f = small(rows * small_bytes(cfg, e), 14.0);
    let (ring_f, ring_b) = ring_small_ops(cfg, rows, e);
    let (ring_f, ring_b) = (small(ring_f.0, ring_f.1), small(ring_b.0, ring_b.1));
    let layer_f = layer_gemms + heads_made + att_f + small_f + ring_f;
    // latent attention's backward makes the heads again from the kept source, then their backward
    let layer_b = 2.0 * layer_gemms + 3.0 * heads_made + att_b + 2.0 * small_f + ring_b;
    let again = match t.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => att_f,
        Recompute::Full => layer_f,
    };
    // the head: the output layer's GEMM and the loss's passes over the logits
    let (head_f, head_b) = match stage.is_last() {
        true => {
            let v = m.vocab_size as f64 / tp;
            let g = gemm(&[(rows, d, v)]);
            let passes = small(rows * v * 4.0 * 2.0, 4.0);
            (g + passes, 2.0 * g + passes)
        }
        false => (0.0, 0.0),
    };
    MicroBatch {
        forward: layers * layer_f + head_f,
        backward: layers * (layer_b + again) + head_b,
        attention: layers * (att_f + att_b),
        ring_block: (att_f / p.cp as f64, att_b / p.cp as f64),
        weight_grads: layers * (layer_gemms + heads_made),
    }
}

/// The ring's own small ops in one layer, (bytes, ops) forward and backward, as
/// `parallel/context_parallel.rs` runs them on each of the cp blocks the busiest rank sees:
/// forward, the block copied to send and split into its keys and values (4 × its bytes), the
/// block's partial output merged into the running one (`ops/ring_merge.rs`: read both, write
/// one); backward, the same copies, dq's partial added in, the block's dK|dV joined, added to
/// the travelling gradient and copied to send. None without a ring.
fn ring_small_ops(cfg: &Config, rows: f64, e: f64) -> ((f64, f64), (f64, f64)) {
    let (m, p) = (&cfg.model, &cfg.parallel);
    if p.cp == 1 || p.cp_mode != CpMode::Ring {
        return ((0.0, 0.0), (0.0, 0.0));
    }
    let per_row = match m.latent() {
        None => 2.0 * (m.kv_heads_on(p.tp) * m.core_head_dim()) as f64,
        Some(l) => (l.kv_rank + l.rope) as f64,
    };
    let (block, q) = (rows * per_row * e, rows * (m.num_attention_heads / p.tp * m.core_head_dim()) as f64 * e);
    let cp = p.cp as f64;
    ((cp * (4.0 * block + 3.0 * q), cp * 4.0), (cp * (11.0 * block + 3.0 * q), cp * 6.0))
}

/// One GEMM's forward shape: (rows, k, n).
type Gemm = (f64, f64, f64);

/// A block's MLP GEMMs, (rows, k, n) forward, on one rank: a dense SwiGLU (its columns split
/// over tp), or a mixture of experts, balanced (this rank's experts compute k rows for each of its
/// rows, in E/ep GEMMs), with DeepSeekMoE's router over its experts, its experts' own width and
/// its shared experts (one SwiGLU, `n_shared_experts` × that width, over every row).
fn mlp_gemms(cfg: &Config, rows: f64, moe: bool) -> Vec<Gemm> {
    let (m, p) = (&cfg.model, &cfg.parallel);
    let (d, tp) = (m.hidden_size as f64, p.tp as f64);
    if !moe {
        let f = m.intermediate_size as f64 / tp;
        return vec![(rows, d, 2.0 * f), (rows, f, d)];
    }
    let experts = m.num_local_experts;
    let (k, mine) = (m.num_experts_per_tok as f64, (experts / p.ep) as f64);
    let (width, shared) = m.deepseek_moe().map_or((m.intermediate_size, 0), |ds| (ds.width, ds.shared));
    let (per, f) = (rows * k / mine, width as f64);
    let mut gemms = vec![(rows, d, experts as f64)];
    for _ in 0..mine as usize {
        gemms.extend([(per, d, 2.0 * f), (per, f, d)]);
    }
    if shared > 0 {
        let s = (shared * width) as f64;
        gemms.extend([(rows, d, 2.0 * s), (rows, s, d)]);
    }
    gemms
}

/// A block's attention GEMMs, (rows, k, n) forward, on one rank: those run once a micro-batch,
/// and those that make the heads' keys and values where the core asks for them. GQA: q, k, v and
/// o; nothing made later. Latent attention (`model/latent_attention.rs`): the query (plain, or
/// through its latent), the replicated kv_a_proj_with_mqa, o_proj; and kv_b_proj, which makes the
/// heads from the latent once, or under the ring once per block of keys that passes by (the
/// busiest rank attends to all cp of them, contiguous or zigzag).
fn attention_gemms(cfg: &Config, rows: f64) -> (Vec<Gemm>, Vec<Gemm>) {
    let (m, p) = (&cfg.model, &cfg.parallel);
    let (d, tp) = (m.hidden_size as f64, p.tp as f64);
    let (hd, heads, kvh) = (m.head_dim() as f64, m.num_attention_heads as f64 / tp, m.kv_heads_on(p.tp) as f64);
    let Some(l) = m.latent() else {
        return (vec![(rows, d, (heads + 2.0 * kvh) * hd), (rows, heads * hd, d)], Vec::new());
    };
    let (rank, rope, nope, v) = (l.kv_rank as f64, l.rope as f64, l.nope as f64, l.v as f64);
    let mut once = match l.q_rank {
        0 => vec![(rows, d, heads * hd)],
        q_rank => vec![(rows, d, q_rank as f64), (rows, q_rank as f64, heads * hd)],
    };
    once.extend([(rows, d, rank + rope), (rows, heads * v, d)]);
    let blocks = if p.cp > 1 && p.cp_mode == CpMode::Ring { p.cp } else { 1 };
    (once, vec![(rows, rank, heads * (nope + v)); blocks])
}

/// Seconds of the optimizer on `values` trained values (AdamW reads the master, the gradient
/// and two moments and writes three of them and the compute copy: ~36 bytes) and of the
/// gradient norm's pass (4 bytes).
pub fn optimizer_seconds(values: f64, rates: &Rates, share: f64) -> f64 {
    values * 40.0 / (rates.small_gb_s * 1e9) / share
}

/// The exposed communication of a step: each flow's (wire time, time it adds to the step), by
/// the rules of the module's table (`m`: the micro-batch's times on this stage; `micro_batches`:
/// of a step). The second numbers add up to the step's communication: nothing is hidden
/// elsewhere.
pub fn exposed(
    cfg: &Config,
    flows: &[Flow],
    (wires, rates): (&Wires, &Rates),
    m: &MicroBatch,
    micro_batches: usize,
) -> Vec<(Flow, f64, f64)> {
    let p = &cfg.parallel;
    let mb = micro_batches as f64;
    // a call of `t` s beside `cover` s of compute: what outlasts the cover, and what it took
    let beside = |t: f64, cover: f64| {
        let hidden = t.min(cover.max(0.0));
        t - hidden + hidden * rates.overlap_slowdown
    };
    let times: Vec<f64> = flows.iter().map(|f| flow_seconds(cfg, f, wires)).collect();
    // tensor parallelism's backward all-reduces (half its calls) run beside the weight-gradient
    // GEMMs: that much of every tp call hides
    let tp: f64 = flows.iter().zip(&times).filter(|(f, _)| f.axis == "tp").map(|(_, t)| t).sum();
    let tp_hidden = if tp > 0.0 { (tp / 2.0).min(mb * m.weight_grads) / tp } else { 0.0 };
    flows
        .iter()
        .zip(times)
        .map(|(f, t)| {
            let per = t / f.calls.max(1.0);
            let shown = match (f.axis, f.call, f.exposed) {
                ("tp", ..) => t * (1.0 - tp_hidden) + t * tp_hidden * rates.overlap_slowdown,
                (_, _, true) | ("pp", ..) => t,
                // ring attention: each hop behind one block's attention, forward and backward
                ("cp", Call::P2p, false) => f.calls / 2.0 * (beside(per, m.ring_block.0) + beside(per, m.ring_block.1)),
                // the gradients' buckets: during the backward of the earlier layers (ZeRO-2/3
                // reducing each micro-batch: of every one; else of the last), all but the last
                (_, Call::AllReduce | Call::ReduceScatter, false) => {
                    let every = p.zero_stage >= 2 && p.zero_reduce == ZeroReduce::EveryMicroBatch;
                    let window = if every { mb * m.backward } else { m.backward };
                    per + beside(t - per, window)
                }
                // FSDP: each unit's gather (before its forward, and its backward) while the unit
                // before it computes; the step's first waits
                (_, Call::AllGather, false) => {
                    let (units, half) = ((f.calls / (2.0 * mb)).max(1.0), f.calls / 2.0);
                    per + (half - 1.0).max(0.0) * beside(per, m.forward / units)
                        + half * beside(per, m.backward / units)
                }
                _ => t,
            };
            (f.clone(), t, shown)
        })
        .collect()
}
