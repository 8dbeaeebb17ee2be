//! # A mixture of experts: the MLP of a Mixtral block, forward and backward
//!
//! A dense block sends every token through one MLP. A mixture of experts holds E MLPs (the
//! experts, each a SwiGLU like the dense one) and a router that picks k of them per token; the
//! token's output is the weighted sum of its k experts' outputs. Parameters grow E-fold, the
//! compute per token only k-fold.
//!
//! ```text
//! x [T, d] ─ router: logits = x·Wgᵀ ─ softmax ─ top-k ─ weights [T, k] (renormalised to sum 1)
//!    │                                            │ experts [T·k]
//!    └─ permute_rows: each token once per chosen expert, sorted by expert ─ xs [T·k, d]
//!         ─ dispatch (expert parallel: the all-to-all to the experts' ranks) ─ xe
//!         ─ expert e on its rows: w2 · (silu(w1·x) ⊙ w3·x) ─ ye
//!         ─ combine back (the all-to-all home) ─ ys ─ y[t] = Σ_j weight[t,j] · ys[t's j-th row]
//! ```
//! Backward walks it right to left: the weights' gradient is dy · (each expert's output) and goes
//! back through the top-k renormalisation and the softmax into the router (`ops::route_backward`);
//! the experts' rows travel the same road as in forward. Where the experts are is the
//! `ExpertSplit`'s business (below): `Whole` holds them all, `parallel/expert_parallel.rs`
//! divides them among the ep ranks.
//!
//! It plugs into the block's MLP seam (`block.rs`'s `Mlp`, made by `Mlps`): `Moe` is one layer's,
//! and what the layers share — where the experts are, the balance loss's parts, the load report —
//! is one `Experts`, which also makes the layers. A dense block's code does not change.
//!
//! The router sees every token; an expert only the tokens sent to it, so how many each gets (the
//! load) is a number worth watching: the metrics print it, and the Switch load-balancing loss
//! (`model.router_aux_loss_coef`) pushes it towards even: E · Σ_e f_e · P_e, with f_e the share of
//! routed rows that chose e and P_e the mean router probability of e, over all layers (as
//! transformers computes it). Its gradient reaches the router through P only. The MLPs' seam lets
//! them add it to the loss at the output end (`Mlps::loss_term`: `Balance`).
//!
//! The choice is discrete: where a token's k-th and (k+1)-th probabilities are within a rounding,
//! a run that sums in another order (a layout, on a GPU) sends it elsewhere, and the curves part
//! by far more than a rounding. `routing_tape.rs` records and replays the choices, so that such a
//! parting can be told from a defect; it plugs in at the split's `choose`.

use crate::comm::process_grid::{Along, Cut, Grid};
use crate::comm::Group;
use crate::config::ModelConfig;
use crate::model::block::{kept_as, DenseMlps, LossTerm, MakeParam, Mlp, MlpKept, Mlps, TermKept};
use crate::model::param::{Param, ParamKind};
use crate::model::split::{input_grad, owned, TensorSplit, WeightGrads, Whole};
use crate::ops::moe::{self as route, Choice, Router, Routing};
use crate::ops::tensor::Tensor;
use crate::ops::types::ReduceOp;
use crate::ops::{self, TpCut};
use anyhow::{bail, Result};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ops::Range;
use std::rc::Rc;

/// The expert-parallel groups: consecutive blocks of ep ranks of the dp×cp group, which divide
/// the experts among themselves (and all-to-all their tokens).
pub const EP: Cut = Cut { name: "ep", what: "ep groups (divide the experts)", along: Along::Blocks };
/// The expert-data groups: the dp×cp ranks ep apart, which hold the same experts (and average
/// their gradients). Without expert parallelism, the whole dp×cp group.
pub const EXPERT_DP: Cut = Cut { name: "edp", what: "expert-data groups (same experts)", along: Along::Strided };

/// Is the parameter named `name` an expert's (Hugging Face's Mixtral names: the router is
/// `…block_sparse_moe.gate.weight`, expert e's matrices `…block_sparse_moe.experts.e.w1.weight`;
/// DeepSeek-V3's `…mlp.gate.weight` and `…mlp.experts.e.gate_proj.weight`)?
/// An expert's replicas are the ranks holding the same experts: the expert-data axis, whose ranks
/// average its gradient (`parallel/layout.rs`).
pub fn is_expert(name: &str) -> bool {
    name.contains(".block_sparse_moe.experts.") || name.contains(".mlp.experts.")
}

/// `grid` with the expert-parallel and expert-data groups of `parallel.ep` ranks: expert
/// parallelism adds no ranks, it is carved out of the dp×cp group (as torchtitan and DeepSpeed
/// place it).
pub fn cut_grid(grid: Grid, ep: usize) -> Result<Grid> {
    let members = grid.dp * grid.cp;
    if ep == 0 || !members.is_multiple_of(ep) {
        bail!("parallel.ep = {ep} does not divide dp × cp = {members}: the expert-parallel ranks are carved out of the dp×cp ranks");
    }
    let setting = (ep > 1).then_some(("ep", ep));
    grid.with_cut(EP, ep, setting)?.with_cut(EXPERT_DP, ep, setting)
}

/// Where the experts of each MoE layer are: the seam expert parallelism plugs into. `Whole`: all
/// of them here.
/// Expert parallelism (`parallel/expert_parallel.rs`) gives each of the ep ranks E/ep of them
/// and moves the routed rows with all-to-alls. Rows always go sorted by expert, all E of them.
pub trait ExpertSplit {
    /// The experts (of `total`) this rank holds.
    fn held(&self, total: usize) -> Range<usize>;
    /// Layer `layer`'s routing as the rows will take it: the router's own, except under the
    /// routing tape (`model/routing_tape.rs`), which records it or replays another run's.
    fn choose(&self, _layer: usize, routing: Routing) -> Result<Routing> {
        Ok(routing)
    }
    /// Sends routed rows (sorted by expert, `counts` per expert of all E) to the ranks holding
    /// their experts. Returns the rows this rank's experts compute, expert after expert (each
    /// expert's rows by sender), and who sent how many (for the way back).
    fn dispatch(&self, rows: Tensor, counts: &[usize]) -> Result<(Tensor, Routed)>;
    /// The same journey for other rows of the same layout (backward's output gradients).
    fn dispatch_again(&self, rows: Tensor, routed: &Routed) -> Result<Tensor>;
    /// The way back: rows computed here return to their senders, in the order they were sent.
    fn combine(&self, rows: Tensor, routed: &Routed) -> Result<Tensor>;
}

/// Who sent how many routed rows to which expert, in one MoE layer's dispatch.
pub struct Routed {
    /// `counts[i][e]`: rows member i of the expert-parallel group sends to expert e (all E).
    pub counts: Vec<Vec<usize>>,
    /// This rank's place in that group.
    pub me: usize,
    /// The experts this rank holds.
    pub held: Range<usize>,
}

impl Routed {
    /// Rows each expert held here computes, from every sender.
    pub fn held_counts(&self) -> Vec<usize> {
        self.held.clone().map(|e| self.counts.iter().map(|c| c[e]).sum()).collect()
    }
}

impl ExpertSplit for Whole {
    fn held(&self, total: usize) -> Range<usize> {
        0..total
    }
    fn dispatch(&self, rows: Tensor, counts: &[usize]) -> Result<(Tensor, Routed)> {
        Ok((rows, Routed { counts: vec![counts.to_vec()], me: 0, held: 0..counts.len() }))
    }
    fn dispatch_again(&self, rows: Tensor, _: &Routed) -> Result<Tensor> {
        Ok(rows)
    }
    fn combine(&self, rows: Tensor, _: &Routed) -> Result<Tensor> {
        Ok(rows)
    }
}

/// Which mixture a config describes: Mixtral's (a softmax router, experts `intermediate_size`
/// wide, Hugging Face's `block_sparse_moe` names) or DeepSeekMoE's (`moe_intermediate_size` > 0:
/// many narrow experts, a sigmoid router choosing within groups with a balancing bias, shared
/// experts every token goes through, the first layers dense; the `mlp` names).
#[derive(Clone, Copy)]
enum Kind {
    Mixtral,
    DeepSeek { norm: bool, scale: f32, groups: usize, kept: usize, shared: usize, dense_below: usize },
}

/// One expert: a SwiGLU MLP (w1 the gate, w3 the up projection, w2 the down projection).
pub(crate) struct Expert {
    w1: Param,
    w2: Param,
    w3: Param,
}

/// What every MoE layer of a model shares, and what makes them (`Mlps`): where the experts are
/// (the split, with the routing tape around it when one is asked for), the balance loss's parts,
/// and the load report.
pub struct Experts<'g> {
    split: Box<dyn ExpertSplit + 'g>,
    kind: Kind,
    /// E, k, each expert's width and `router_aux_loss_coef`.
    total: usize,
    top_k: usize,
    width: usize,
    coef: f32,
    /// DeepSeekMoE: each MoE layer's correction bias (a buffer: chosen with, never trained).
    biases: RefCell<BTreeMap<usize, Vec<f32>>>,
    /// With the balance loss on: this forward's routing, by layer (the loss head takes it).
    loads: RefCell<BTreeMap<usize, Load>>,
    /// The balance loss's gradient on each expert's probability for the backward under way, its
    /// scale applied: the loss term's backward sets it, before the layers' backward reads it.
    balance: Rc<RefCell<Vec<f32>>>,
    /// Routed rows per expert of each layer, by the backwards since the last `take_load`.
    seen: RefCell<BTreeMap<usize, Vec<usize>>>,
    /// The same, by this step's backwards (DeepSeekMoE's bias update reads them: `balance`).
    step_loads: RefCell<BTreeMap<usize, Vec<usize>>>,
    /// γ, DeepSeekMoE's bias update speed (`model.bias_update_speed`).
    speed: f32,
    /// DeepSeekMoE's sequence-wise balance loss: α (`model.seq_aux_loss_coef`), the rows of one
    /// training sequence (0: not training, off), each MoE layer's term in this forward, and the
    /// loss scale of the backward under way (its loss term's backward sets it).
    seq_coef: f32,
    seq_len: usize,
    seq_terms: RefCell<BTreeMap<usize, f32>>,
    seq_scale: Rc<Cell<f32>>,
}

impl<'g> Experts<'g> {
    /// A mixture of experts as `cfg` says, its experts where `split` puts them; `seq_len`: the
    /// rows of one training sequence (the unit of DeepSeekMoE's sequence-wise balance loss; 0
    /// where nothing trains).
    pub fn new(cfg: &ModelConfig, split: Box<dyn ExpertSplit + 'g>, seq_len: usize) -> Rc<Experts<'g>> {
        let deepseek = cfg.deepseek_moe();
        let kind = match deepseek {
            None => Kind::Mixtral,
            Some(m) => Kind::DeepSeek {
                norm: m.norm,
                scale: m.scale,
                groups: m.groups,
                kept: m.kept,
                shared: m.shared,
                dense_below: m.dense_below,
            },
        };
        Rc::new(Experts {
            split,
            kind,
            total: cfg.num_local_experts,
            top_k: cfg.num_experts_per_tok,
            width: deepseek.map_or(cfg.intermediate_size, |m| m.width),
            coef: cfg.router_aux_loss_coef,
            biases: RefCell::default(),
            loads: RefCell::default(),
            balance: Rc::default(),
            seen: RefCell::default(),
            step_loads: RefCell::default(),
            speed: deepseek.map_or(0.0, |m| m.speed),
            seq_coef: deepseek.map_or(0.0, |m| m.seq_coef),
            seq_len,
            seq_terms: RefCell::default(),
            seq_scale: Rc::default(),
        })
    }

    /// After a step, DeepSeek-V3's auxiliary-loss-free balancing: each MoE layer's loads of the
    /// step (routed rows per expert), summed over `groups` (the ranks that routed the step's other
    /// tokens: dp×cp, and tp under sequence parallelism), move its bias,
    /// b_e ← b_e + γ · sign(mean load − load_e): an overloaded expert is chosen less next step,
    /// an idle one more. Every rank holding the layer makes the same update from the same sums,
    /// so every layout does. The loads travel as f32 (exact to 2²⁴ rows an expert a step).
    pub fn balance(&self, groups: &[&Group]) -> Result<()> {
        let loads = std::mem::take(&mut *self.step_loads.borrow_mut());
        if self.speed == 0.0 || !matches!(self.kind, Kind::DeepSeek { .. }) {
            return Ok(());
        }
        let mut biases = self.biases.borrow_mut();
        let e = self.total;
        // every MoE layer of this rank at once, in layer order (a layer no row reached: zeros)
        let mut flat: Vec<f32> =
            biases.keys().flat_map(|l| loads.get(l).cloned().unwrap_or_else(|| vec![0; e])).map(|c| c as f32).collect();
        for g in groups {
            g.all_reduce(&mut flat, ReduceOp::Sum)?;
        }
        for (bias, load) in biases.values_mut().zip(flat.chunks(e)) {
            let mean = load.iter().map(|&c| c as f64).sum::<f64>() / e as f64;
            for (b, &c) in bias.iter_mut().zip(load) {
                let c = c as f64;
                *b += if c < mean {
                    self.speed
                } else if c > mean {
                    -self.speed
                } else {
                    0.0
                };
            }
        }
        Ok(())
    }

    /// Whether the forward adds DeepSeekMoE's sequence-wise balance loss.
    fn sequence_wise(&self) -> bool {
        self.seq_coef > 0.0 && self.seq_len > 0 && matches!(self.kind, Kind::DeepSeek { .. })
    }

    /// Each MoE layer's correction bias (DeepSeekMoE), by layer: what `balance` moves.
    pub fn biases(&self) -> BTreeMap<usize, Vec<f32>> {
        self.biases.borrow().clone()
    }

    /// Routed rows to each expert, per MoE layer of this rank's model (by layer), by the
    /// backwards since the last call (the imbalance report).
    pub fn take_load(&self) -> BTreeMap<usize, Vec<usize>> {
        std::mem::take(&mut *self.seen.borrow_mut())
    }
}

impl<'g> Mlps<'g> for Rc<Experts<'g>> {
    /// Layer `layer`'s router and the experts this rank holds, in Hugging Face order (a
    /// DeepSeekMoE's first layers: the dense MLP; its others also the shared experts, and the
    /// router's correction bias, a buffer).
    fn make(&self, layer: usize, cfg: &ModelConfig, param: &mut MakeParam) -> Result<Box<dyn Mlp + 'g>> {
        let (d, f) = (cfg.hidden_size, self.width);
        // Hugging Face's names: (the router's and its bias', expert e's gate, down, up)
        let (module, [w1, w2, w3]) = match self.kind {
            Kind::Mixtral => ("block_sparse_moe", ["w1", "w2", "w3"]),
            Kind::DeepSeek { dense_below, .. } if layer < dense_below => return DenseMlps.make(layer, cfg, param),
            Kind::DeepSeek { .. } => ("mlp", ["gate_proj", "down_proj", "up_proj"]),
        };
        let p = |s: &str| format!("model.layers.{layer}.{module}.{s}.weight");
        // replicated over tp: every tp rank routes and computes the same rows (its own with
        // sequence parallelism), so the router and the experts are whole on each
        let gate = param(p("gate"), &[self.total, d], ParamKind::Matrix, TpCut::Whole)?;
        let mut experts = Vec::new();
        let mut expert = |name: String, shape: &[usize]| param(name, shape, ParamKind::Matrix, TpCut::Whole);
        for e in self.split.held(self.total) {
            let w = |n: &str| p(&format!("experts.{e}.{n}"));
            experts.push(Expert {
                w1: expert(w(w1), &[f, d])?,
                w2: expert(w(w2), &[d, f])?,
                w3: expert(w(w3), &[f, d])?,
            });
        }
        let mut shared_mlp = None;
        if let Kind::DeepSeek { shared, .. } = self.kind {
            let bias = param(bias_name(layer), &[self.total], ParamKind::Buffer, TpCut::Whole)?;
            self.biases.borrow_mut().insert(layer, bias.value.to_vec());
            // the shared experts: one SwiGLU `shared` experts wide, cut over tp as a dense MLP is
            if shared > 0 {
                let wide = ModelConfig { intermediate_size: f * shared, ..cfg.clone() };
                let mut named = |name: String, shape: &[usize], kind, cut| {
                    param(name.replace(".mlp.", ".mlp.shared_experts."), shape, kind, cut)
                };
                shared_mlp = Some(DenseMlps.make(layer, &wide, &mut named)?);
            }
        }
        Ok(Box::new(Moe { gate, experts, shared_mlp, shared: self.clone(), layer }))
    }

    /// The load-balancing loss, when `router_aux_loss_coef` > 0; DeepSeekMoE's sequence-wise
    /// one, when `seq_aux_loss_coef` > 0 in training.
    fn loss_term(&self) -> Option<Box<dyn LossTerm + 'g>> {
        if self.sequence_wise() {
            return Some(Box::new(SequenceBalance(self.clone())));
        }
        (self.coef > 0.0).then(|| Box::new(Balance(self.clone())) as Box<dyn LossTerm + 'g>)
    }
}

/// The name of a DeepSeekMoE layer's correction bias (Hugging Face's).
fn bias_name(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.gate.e_score_correction_bias")
}

/// One MoE layer: its router and the experts this rank holds.
pub(crate) struct Moe<'g> {
    /// The router, `[E, d]`.
    gate: Param,
    /// The experts this rank holds (all E, or its ep share of them).
    experts: Vec<Expert>,
    /// DeepSeekMoE's shared experts (a dense SwiGLU every token goes through), if it has them.
    shared_mlp: Option<Box<dyn Mlp + 'g>>,
    /// What every MoE layer of the model shares.
    shared: Rc<Experts<'g>>,
    /// The layer's number (the routing tape names choices by it).
    layer: usize,
}

/// How the routed rows are laid out (host): sorted by expert, each expert's rows in token order.
struct Sorting {
    /// Routed rows per expert (all E).
    counts: Vec<usize>,
    /// Routed row i is token `order[i]`.
    order: Vec<u32>,
    /// Token t's j-th expert is routed row `slot[t·k + j]`.
    slot: Vec<u32>,
}

impl Sorting {
    /// A stable counting sort of the `T·k` choices by expert.
    fn new(experts: &[u32], total: usize, k: usize) -> Sorting {
        let mut counts = vec![0; total];
        experts.iter().for_each(|&e| counts[e as usize] += 1);
        let mut next: Vec<usize> = counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
        let (mut order, mut slot) = (vec![0; experts.len()], vec![0; experts.len()]);
        for (i, &e) in experts.iter().enumerate() {
            let at = &mut next[e as usize];
            (order[*at], slot[i]) = ((i / k) as u32, *at as u32);
            *at += 1;
        }
        Sorting { counts, order, slot }
    }
}

/// What a MoE layer keeps for its backward.
pub(crate) struct MoeCache {
    routing: Routing,
    sorting: Sorting,
    /// Who sent how many rows to which expert (the all-to-all's counts; one sender without ep).
    routed: Routed,
    /// Per expert of this rank: the rows it got and its SwiGLU's gate, up and activation
    /// (`None` for an expert no row chose).
    experts: Vec<Option<[Tensor; 4]>>,
    /// The experts' outputs back home, in routed-row order.
    ys: Tensor,
    /// What the shared experts keep.
    shared: Option<Box<dyn MlpKept>>,
    /// The sequence-wise balance loss's gradient on each normalised score, per sequence and
    /// expert, α applied (empty when it is off).
    seq_grad: Vec<f32>,
}

/// A layer's routing, for the load-balancing loss (host numbers).
#[derive(Clone, Debug, Default)]
pub struct Load {
    /// Routed rows per expert (this rank's tokens).
    pub counts: Vec<usize>,
    /// Σ over this rank's tokens of each expert's router probability.
    pub prob_sums: Vec<f32>,
}

impl MlpKept for MoeCache {
    fn bytes(&self) -> usize {
        let r = &self.routing;
        let experts: usize = self.experts.iter().flatten().flat_map(|e| e.iter().map(Tensor::bytes)).sum();
        let shared = self.shared.as_ref().map_or(0, |s| s.bytes());
        [&r.probs, &r.weights, &self.ys].iter().map(|t| t.bytes()).sum::<usize>() + experts + shared
    }
}

impl Mlp for Moe<'_> {
    fn params(&self) -> Vec<&Param> {
        let experts = self.experts.iter().flat_map(|e| [&e.w1, &e.w2, &e.w3]);
        let shared = self.shared_mlp.iter().flat_map(|m| m.params());
        std::iter::once(&self.gate).chain(experts).chain(shared).collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let experts = self.experts.iter_mut().flat_map(|e| [&mut e.w1, &mut e.w2, &mut e.w3]);
        let shared = self.shared_mlp.iter_mut().flat_map(|m| m.params_mut());
        std::iter::once(&mut self.gate).chain(experts).chain(shared).collect()
    }

    /// DeepSeekMoE's correction bias, as it stands.
    fn buffers(&self) -> Vec<(String, Tensor)> {
        let biases = self.shared.biases.borrow();
        let bias = biases.get(&self.layer);
        bias.map(|b| (bias_name(self.layer), Tensor::from_vec(&[b.len()], b.clone()))).into_iter().collect()
    }

    /// Its parameters, and (DeepSeekMoE) the correction bias as it stands, for a layer made of
    /// them again.
    fn into_params(self: Box<Self>) -> Vec<Param> {
        let bias = self
            .shared
            .biases
            .borrow()
            .get(&self.layer)
            .map(|b| Param::new(bias_name(self.layer), Tensor::from_vec(&[b.len()], b.clone()), TpCut::Whole));
        let experts = self.experts.into_iter().flat_map(|e| [e.w1, e.w2, e.w3]);
        let shared = self.shared_mlp.into_iter().flat_map(|m| m.into_params());
        std::iter::once(self.gate).chain(experts).chain(shared).chain(bias).collect()
    }

    /// y `[T, d]` from x `[T, d]` (the normalised rows): on this rank's rows, whole (every tp rank
    /// routes its rows itself: no tp call).
    fn forward(&self, tp: &dyn TensorSplit, x: &Tensor) -> Result<(Tensor, Box<dyn MlpKept>)> {
        let (ep, total, k) = (&*self.shared.split, self.shared.total, self.shared.top_k);
        let logits = self.gate.linear(x);
        let routing = match self.shared.kind {
            Kind::Mixtral => route::route(&logits, k), // a sync point on a GPU
            Kind::DeepSeek { norm, scale, groups, kept, .. } => {
                let biases = self.shared.biases.borrow();
                let choice = Choice { bias: &biases[&self.layer], groups, kept };
                route::route_sigmoid(&logits, k, choice, Router::Sigmoid { norm, scale, dtype: logits.dtype() })
            }
        };
        drop(logits);
        let routing = ep.choose(self.layer, routing)?;
        let sorting = Sorting::new(&routing.experts, total, k);
        let xs = route::permute_rows(x, &sorting.order);
        let (xe, routed) = ep.dispatch(xs, &sorting.counts)?;
        let d = xe.cols();
        let mut ye = Tensor::empty_as(xe.shape(), &xe);
        let (mut at, mut experts) = (0, Vec::with_capacity(self.experts.len()));
        for (expert, &n) in self.experts.iter().zip(&routed.held_counts()) {
            // one cuBLAS call per product on the expert's contiguous rows
            experts.push((n > 0).then(|| {
                let x_e = ops::slice(&xe, at * d, &[n, d]);
                let (g, u) = (expert.w1.linear(&x_e), expert.w3.linear(&x_e));
                let a = ops::swiglu(&g, &u);
                ops::copy(&expert.w2.linear(&a), 0, &mut ye, at * d, n * d);
                [x_e, g, u, a]
            }));
            at += n;
        }
        drop(xe);
        let ys = ep.combine(ye, &routed)?;
        let mut y = route::weighted_sum(&ys, &sorting.slot, Some(&routing.weights), x.rows());
        let shared = match &self.shared_mlp {
            Some(m) => {
                let (out, kept) = m.forward(tp, x)?;
                ops::add_assign(&mut y, &out);
                Some(kept)
            }
            None => None,
        };
        if self.shared.coef > 0.0 {
            // for the balance loss, added when the forward reaches the head
            let load = Load { counts: sorting.counts.clone(), prob_sums: column_sums(&routing.probs) };
            self.shared.loads.borrow_mut().insert(self.layer, load);
        }
        let mut seq_grad = Vec::new();
        if self.shared.sequence_wise() {
            // this layer's term, added when the forward reaches the head (host numbers: on a GPU
            // the scores are read back, as the sigmoid router's already are)
            let s = &self.shared;
            let (term, grad) = sequence_balance(&routing.probs.to_vec(), &routing.experts, (total, k, s.seq_len))?;
            s.seq_terms.borrow_mut().insert(self.layer, s.seq_coef * term);
            seq_grad = grad.iter().map(|g| s.seq_coef * g).collect();
        }
        Ok((y, Box::new(MoeCache { routing, sorting, routed, experts, ys, shared, seq_grad })))
    }

    /// dx from dy, both `[T, d]` (x: the forward's input); every weight GEMM goes to `dw` (now,
    /// or kept for a zero-bubble W). The router's gradient takes the balance loss's too, when it
    /// is on.
    fn backward(
        &mut self,
        tp: &dyn TensorSplit,
        dy: &Tensor,
        x: Tensor,
        kept: Box<dyn MlpKept>,
        dw: &mut dyn WeightGrads,
    ) -> Result<Tensor> {
        let mut c = *kept_as::<MoeCache>(kept)?;
        let dx_shared = match (&mut self.shared_mlp, c.shared.take()) {
            (Some(m), Some(kept)) => Some(m.backward(tp, dy, x.clone(), kept, dw)?),
            _ => None,
        };
        let ep = &*self.shared.split;
        count_routed(&mut self.shared.seen.borrow_mut(), self.layer, &c.sorting.counts); // the imbalance report
        count_routed(&mut self.shared.step_loads.borrow_mut(), self.layer, &c.sorting.counts); // the bias update's
        let (dys, dweights) = route::weighted_sum_backward(dy, &c.ys, &c.sorting.slot, &c.routing.weights);
        drop(c.ys);
        let dye = ep.dispatch_again(dys, &c.routed)?;
        let d = dye.cols();
        let mut dxe = Tensor::empty_as(dye.shape(), &dye);
        let mut at = 0;
        for (expert, rows) in self.experts.iter_mut().zip(c.experts) {
            let Some([x_e, gate, up, act]) = rows else { continue }; // no row: no gradient
            let n = x_e.rows();
            let dy_e = ops::slice(&dye, at * d, &[n, d]);
            let dact = expert.w2.linear_input_grad(&dy_e);
            dw.linear(Cow::Owned(act), vec![(Cow::Owned(dy_e), &mut expert.w2)]);
            let (dg, du) = ops::swiglu_backward(&dact, &gate, &up);
            let layers = vec![(dg, &mut expert.w1), (du, &mut expert.w3)];
            ops::copy(&input_grad(&layers), 0, &mut dxe, at * d, n * d);
            dw.linear(Cow::Owned(x_e), owned(layers));
            at += n;
        }
        let dxs = ep.combine(dxe, &c.routed)?;
        let mut dx = route::weighted_sum(&dxs, &c.sorting.slot, None, x.rows()); // each token: the sum of its k copies
        if let Some(d) = dx_shared {
            ops::add_assign(&mut dx, &d);
        }
        let mut dlogits = route::route_backward(&dweights, &c.routing, &self.shared.balance.borrow());
        if !c.seq_grad.is_empty() {
            let scaled: Vec<f32> = c.seq_grad.iter().map(|g| g * self.shared.seq_scale.get()).collect();
            let shape = (self.shared.total, self.shared.seq_len);
            let dz = sequence_balance_backward(&c.routing.probs.to_vec(), &scaled, shape);
            let dz = Tensor::from_host_in(dlogits.shape(), dz, &dlogits.place(), dlogits.dtype());
            ops::add_assign(&mut dlogits, &dz);
        }
        self.gate.linear_input_grad_add(&dlogits, &mut dx);
        dw.linear(Cow::Owned(x), vec![(Cow::Owned(dlogits), &mut self.gate)]);
        Ok(dx)
    }
}

/// Σ over rows of each column of an f32 `[T, E]` tensor, on the host (on a GPU, a read back).
fn column_sums(p: &Tensor) -> Vec<f32> {
    let (e, values) = (p.cols(), p.to_vec());
    let mut sums = vec![0.0f64; e];
    values.chunks(e).for_each(|row| row.iter().zip(&mut sums).for_each(|(x, s)| *s += *x as f64));
    sums.into_iter().map(|s| s as f32).collect()
}

/// Adds a layer's routed rows per expert (`counts`) into its count in `seen`.
fn count_routed(seen: &mut BTreeMap<usize, Vec<usize>>, layer: usize, counts: &[usize]) {
    let seen = seen.entry(layer).or_default();
    seen.resize(counts.len(), 0);
    seen.iter_mut().zip(counts).for_each(|(s, c)| *s += c);
}

/// The load-balancing loss, from the routing of every MoE layer of the forward:
/// + coef · E · Σ_e f_e · P_e.
struct Balance<'g>(Rc<Experts<'g>>);

/// What `Balance` keeps: its gradient on each expert's probability in every row (the same for
/// every layer), per unit of loss scale, and where the MoE layers' backward reads it.
struct BalanceKept {
    grad: Vec<f32>,
    to: Rc<RefCell<Vec<f32>>>,
}

impl LossTerm for Balance<'_> {
    fn add(&self, loss: &mut Tensor) -> Result<Box<dyn TermKept>> {
        let e = &self.0;
        let loads = std::mem::take(&mut *e.loads.borrow_mut()); // this forward's, every layer
        let loads: Vec<&Load> = loads.values().collect();
        let mut grad = Vec::new();
        if !loads.is_empty() {
            let (aux, g) = balance_loss(&loads, e.total, e.top_k);
            let aux = Tensor::from_host_in(&[1], vec![e.coef * aux], &loss.place(), loss.dtype());
            ops::add_assign(loss, &aux);
            grad = g.iter().map(|g| e.coef * g).collect();
        }
        Ok(Box::new(BalanceKept { grad, to: e.balance.clone() }))
    }
}

impl TermKept for BalanceKept {
    fn backward(self: Box<Self>, scale: f32) {
        *self.to.borrow_mut() = self.grad.iter().map(|g| g * scale).collect();
    }
}

/// The load-balancing loss over every layer's `Load` (E · Σ_e f_e · P_e, transformers'
/// `load_balancing_loss_func`), and its gradient on each expert's probability in every row,
/// which is the same for every layer: E · f_e / N (N = rows × layers).
pub fn balance_loss(loads: &[&Load], experts: usize, k: usize) -> (f32, Vec<f32>) {
    let rows: usize = loads.iter().map(|l| l.counts.iter().sum::<usize>() / k).sum();
    let n = rows.max(1) as f64;
    let f: Vec<f64> = (0..experts).map(|e| loads.iter().map(|l| l.counts[e]).sum::<usize>() as f64 / n).collect();
    let p: Vec<f64> = (0..experts).map(|e| loads.iter().map(|l| l.prob_sums[e] as f64).sum::<f64>() / n).collect();
    let loss = experts as f64 * f.iter().zip(&p).map(|(a, b)| a * b).sum::<f64>();
    (loss as f32, f.iter().map(|fe| (experts as f64 * fe / n) as f32).collect())
}

/// DeepSeekMoE's complementary sequence-wise balance loss (DeepSeek-V3 §2.1.2): per MoE layer and
/// training sequence of T rows, α · Σ_e f_e · P_e with f_e = E/(k·T) · (rows that chose e) and
/// P_e = (1/T) · Σ_t s'_{t,e}, s' the sigmoid scores normalised over all E experts; averaged over
/// the sequences. Its gradient reaches the router through P only.
struct SequenceBalance<'g>(Rc<Experts<'g>>);

/// What `SequenceBalance`'s backward sets: the loss scale the MoE layers' backward multiplies
/// their kept gradient by.
struct SequenceBalanceKept(Rc<Cell<f32>>);

impl LossTerm for SequenceBalance<'_> {
    fn add(&self, loss: &mut Tensor) -> Result<Box<dyn TermKept>> {
        let terms = std::mem::take(&mut *self.0.seq_terms.borrow_mut()); // this forward's, every layer
        let sum: f32 = terms.values().sum();
        ops::add_assign(loss, &Tensor::from_host_in(&[1], vec![sum], &loss.place(), loss.dtype()));
        Ok(Box::new(SequenceBalanceKept(self.0.seq_scale.clone())))
    }
}

impl TermKept for SequenceBalanceKept {
    fn backward(self: Box<Self>, scale: f32) {
        self.0.set(scale);
    }
}

/// One layer's sequence-wise balance term (α left out) from its scores `s` `[rows, E]` and its
/// choices (`k` a row), the rows in sequences of `seq_len`: (the term, its gradient on each
/// normalised score s'_{t,e}, the same for every row of a sequence: `[sequences, E]`).
pub fn sequence_balance(
    s: &[f32],
    chosen: &[u32],
    (experts, k, seq_len): (usize, usize, usize),
) -> Result<(f32, Vec<f32>)> {
    let rows = s.len() / experts;
    if seq_len == 0 || !rows.is_multiple_of(seq_len) {
        bail!("the sequence-wise balance loss needs whole sequences of {seq_len} rows, got {rows}");
    }
    let (sequences, t) = (rows / seq_len, seq_len as f64);
    let (mut term, mut grad) = (0.0f64, vec![0.0f32; sequences * experts]);
    for b in 0..sequences {
        let (mut counts, mut p) = (vec![0usize; experts], vec![0.0f64; experts]);
        for r in b * seq_len..(b + 1) * seq_len {
            chosen[r * k..(r + 1) * k].iter().for_each(|&e| counts[e as usize] += 1);
            let row = &s[r * experts..(r + 1) * experts];
            let sum: f64 = row.iter().map(|&x| x as f64).sum();
            row.iter().zip(&mut p).for_each(|(&x, p)| *p += x as f64 / sum / t);
        }
        for e in 0..experts {
            let f = experts as f64 / (k as f64 * t) * counts[e] as f64;
            term += f * p[e] / sequences as f64;
            grad[b * experts + e] = (f / (t * sequences as f64)) as f32; // ∂term/∂s'_{t,e}
        }
    }
    Ok((term as f32, grad))
}

/// The logits' gradient `[rows, E]` of the sequence-wise term from its gradient `g` on the
/// normalised scores (per sequence, scaled): with S = Σ_j s_j and s' = s/S,
/// ∂s_i = (g_i − Σ_j g_j·s'_j) / S, then through the sigmoid, ∂z = ∂s · s(1 − s).
pub fn sequence_balance_backward(s: &[f32], g: &[f32], (experts, seq_len): (usize, usize)) -> Vec<f32> {
    let mut dz = vec![0.0f32; s.len()];
    for (r, (row, dz)) in s.chunks(experts).zip(dz.chunks_mut(experts)).enumerate() {
        let g = &g[r / seq_len * experts..(r / seq_len + 1) * experts];
        let sum: f32 = row.iter().sum();
        let through: f32 = g.iter().zip(row).map(|(g, x)| g * x / sum).sum();
        for ((dz, &x), &g) in dz.iter_mut().zip(row).zip(g) {
            *dz = (g - through) / sum * x * (1.0 - x);
        }
    }
    dz
}
