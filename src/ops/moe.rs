//! # The routing ops of a mixture of experts, each beside its backward
//!
//! ```text
//! shapes: T rows (tokens), E experts, k experts per token, d features, n = T·k routed rows
//!
//! route           logits [T, E] → probs = softmax(logits) [T, E]; the k largest per row;
//!                 weights [T, k] = those probs / their sum; experts (host, T·k ids)
//! permute_rows    x [T, d], order [n] → xs [n, d], xs[i] = x[order[i]]   (tokens sorted by expert)
//! weighted_sum    ys [n, d], slot [T·k], w [T, k] → y [T, d], y[t] = Σ_j w[t,j] · ys[slot[t·k+j]]
//! ```
//! DeepSeek-V3's router (`route_sigmoid`) scores each expert with a sigmoid of its own, chooses
//! with a balancing bias added and within the best groups of experts, and weighs by the unbiased
//! scores (`Router::Sigmoid`).
//!
//! The expert each token goes to is decided on the host: how many rows each expert gets sets the
//! sizes of its GEMMs (and, with expert parallelism, of the all-to-all), so the ids are read back
//! once per layer (on a GPU, a CPU–GPU sync point, as in every MoE trainer that sizes its
//! all-to-all). Ties in the top-k go to the lower expert id.
//!
//! Backward: `weighted_sum_backward` hands each routed row its share w · dy and each weight its
//! dy · ys; `route_backward` takes the weights' gradient back through the renormalisation and the
//! softmax (and adds the load-balancing loss's gradient on the probabilities); the backward of
//! `permute_rows` is `weighted_sum` with unit weights (each token sums the gradients of its k
//! copies).

use super::tensor::Tensor;
use super::{fatal, gpu, DType};

/// What the router decided for each row.
pub struct Routing {
    /// softmax(logits) (or σ(logits): `Router::Sigmoid`), `[T, E]` (f32): the backward and the
    /// load-balancing loss read it.
    pub probs: Tensor,
    /// The chosen experts' probabilities renormalised to sum 1 (or as `Router::Sigmoid` says),
    /// `[T, k]` (f32).
    pub weights: Tensor,
    /// The chosen experts, row after row, largest probability first (host: `T·k` ids).
    pub experts: Vec<u32>,
    /// How the probabilities and weights were made from the logits (their backward).
    pub router: Router,
}

/// How a router turns its logits into probabilities and the chosen experts' weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Router {
    /// Mixtral's: softmax, the chosen probabilities renormalised to sum 1.
    Softmax,
    /// DeepSeek-V3's: each expert's score σ(z) on its own; the chosen scores divided by their sum
    /// (+1e-20) when `norm`, times `scale` either way. `dtype`: the logits' (their gradient's).
    Sigmoid { norm: bool, scale: f32, dtype: DType },
}

/// DeepSeek-V3's choice, from the scores plus a per-expert bias that balances the load (added
/// for choosing only): the E experts in `groups` groups of consecutive ids, each group scored by
/// the sum of its two best biased scores; the `kept` best groups stay, and the k best experts
/// among them are chosen. Ties go to the lower group, then the lower expert id.
#[derive(Clone, Copy, Debug)]
pub struct Choice<'a> {
    pub bias: &'a [f32],
    pub groups: usize,
    pub kept: usize,
}

/// The router's decision from its logits `[T, E]`: softmax over the experts, the `k` largest,
/// renormalised.
pub fn route(logits: &Tensor, k: usize) -> Routing {
    let (t, e) = (logits.rows(), logits.cols());
    assert!(k >= 1 && k <= e, "route: top-{k} of {e} experts");
    if let Some(d) = gpu("route", &[logits]) {
        return fatal("route", d.route(logits, k));
    }
    let (mut probs, mut weights, mut experts) = (vec![0.0; t * e], vec![0.0; t * k], vec![0u32; t * k]);
    for r in 0..t {
        route_row(
            &logits.host()[r * e..(r + 1) * e],
            &mut probs[r * e..(r + 1) * e],
            &mut weights[r * k..(r + 1) * k],
            &mut experts[r * k..(r + 1) * k],
        );
    }
    let (probs, weights) = (Tensor::from_vec(&[t, e], probs), Tensor::from_vec(&[t, k], weights));
    Routing { probs, weights, experts, router: Router::Softmax }
}

/// DeepSeek-V3's routing of logits `[T, E]` (f32): scores σ(z); the `k` experts `choice` picks;
/// their weights as `router` (a `Router::Sigmoid`) says. On the host (on a GPU, the logits are
/// read back and the results written: the experts' row counts are needed there anyway).
pub fn route_sigmoid(logits: &Tensor, k: usize, choice: Choice, router: Router) -> Routing {
    let (t, e) = (logits.rows(), logits.cols());
    assert!(k >= 1 && k <= e && choice.bias.len() == e, "route: top-{k} of {e} experts, one bias each");
    let z = logits.to_vec();
    let probs: Vec<f32> = z.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect();
    let (mut weights, mut experts) = (vec![0.0; t * k], vec![0u32; t * k]);
    for r in 0..t {
        let s = &probs[r * e..(r + 1) * e];
        let biased: Vec<f32> = s.iter().zip(choice.bias).map(|(s, b)| s + b).collect();
        let allowed = groups_kept(&biased, choice);
        let masked: Vec<f32> =
            biased.iter().enumerate().map(|(i, &x)| if allowed[i] { x } else { f32::NEG_INFINITY }).collect();
        let ids = &mut experts[r * k..(r + 1) * k];
        top_k(&masked, ids);
        router_shares(router, s, ids, &mut weights[r * k..(r + 1) * k]);
    }
    let place = logits.place();
    Routing {
        probs: Tensor::from_host_in(&[t, e], probs, &place, DType::F32),
        weights: Tensor::from_host_in(&[t, k], weights, &place, DType::F32),
        experts,
        router,
    }
}

/// Which experts a row may choose: those of its `choice.kept` best groups.
fn groups_kept(biased: &[f32], choice: Choice) -> Vec<bool> {
    let per = biased.len() / choice.groups;
    let score = |g: usize| {
        let mut two = [f32::NEG_INFINITY; 2];
        for &x in &biased[g * per..(g + 1) * per] {
            if x > two[0] {
                two = [x, two[0]];
            } else if x > two[1] {
                two[1] = x;
            }
        }
        two[0] + two[1]
    };
    let scores: Vec<f32> = (0..choice.groups).map(score).collect();
    let mut best = vec![0u32; choice.kept];
    top_k(&scores, &mut best);
    (0..biased.len()).map(|i| best.contains(&((i / per) as u32))).collect()
}

/// The weights of a row's chosen `experts` from its probabilities, as `router` makes them.
pub fn router_shares(router: Router, probs: &[f32], experts: &[u32], weights: &mut [f32]) {
    match router {
        Router::Softmax => shares(probs, experts, weights),
        Router::Sigmoid { norm, scale, .. } => {
            experts.iter().zip(weights.iter_mut()).for_each(|(&i, w)| *w = probs[i as usize]);
            if norm {
                let sum = weights.iter().sum::<f32>() + 1e-20;
                weights.iter_mut().for_each(|w| *w /= sum);
            }
            weights.iter_mut().for_each(|w| *w *= scale);
        }
    }
}

/// One row of `route`: softmax, top-k (ties to the lower id), renormalised weights.
fn route_row(logits: &[f32], probs: &mut [f32], weights: &mut [f32], experts: &mut [u32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for (p, &z) in probs.iter_mut().zip(logits) {
        *p = (z - max).exp();
        sum += *p;
    }
    probs.iter_mut().for_each(|p| *p /= sum);
    top_k(probs, experts);
    shares(probs, experts, weights);
}

/// The chosen `experts`' probabilities renormalised to sum 1.
pub fn shares(probs: &[f32], experts: &[u32], weights: &mut [f32]) {
    let mut taken = 0.0;
    for (w, &e) in weights.iter_mut().zip(experts) {
        *w = probs[e as usize];
        taken += *w;
    }
    weights.iter_mut().for_each(|w| *w /= taken);
}

/// The `experts.len()` largest of `probs`, largest first (ties to the lower id).
fn top_k(probs: &[f32], experts: &mut [u32]) {
    for j in 0..experts.len() {
        let mut best: Option<usize> = None;
        for (i, &p) in probs.iter().enumerate() {
            let free = !experts[..j].contains(&(i as u32));
            if free && best.is_none_or(|b| p > probs[b]) {
                best = Some(i);
            }
        }
        experts[j] = best.expect("k <= E") as u32;
    }
}

/// d logits from the gradient of the weights `[T, k]`, through the renormalisation and the
/// softmax; `balance` (one number per expert, or empty) is added to every row's d probs: the
/// load-balancing loss's gradient.
pub fn route_backward(dweights: &Tensor, routing: &Routing, balance: &[f32]) -> Tensor {
    let (t, e, k) = (routing.probs.rows(), routing.probs.cols(), routing.weights.cols());
    assert!(balance.is_empty() || balance.len() == e, "route backward: one balance term per expert");
    if let Router::Sigmoid { norm, scale, dtype } = routing.router {
        return sigmoid_backward(dweights, routing, (norm, scale), dtype);
    }
    if let Some(d) = gpu("route backward", &[dweights, &routing.probs, &routing.weights]) {
        return fatal("route backward", d.route_backward(dweights, routing, balance));
    }
    let (p, w, dw) = (routing.probs.host(), routing.weights.host(), dweights.host());
    let mut dlogits = vec![0.0; t * e];
    let mut dp = vec![0.0f32; e];
    for r in 0..t {
        let (p, w, dw, ids) = (
            &p[r * e..(r + 1) * e],
            &w[r * k..(r + 1) * k],
            &dw[r * k..(r + 1) * k],
            &routing.experts[r * k..(r + 1) * k],
        );
        // w_j = p_j / S with S = Σ_chosen p: dp_j = (dw_j − Σ_i dw_i·w_i) / S
        let taken: f32 = ids.iter().map(|&i| p[i as usize]).sum();
        let through: f32 = dw.iter().zip(w).map(|(a, b)| a * b).sum();
        dp.iter_mut().enumerate().for_each(|(i, v)| *v = balance.get(i).copied().unwrap_or(0.0));
        for (j, &i) in ids.iter().enumerate() {
            dp[i as usize] += (dw[j] - through) / taken;
        }
        // softmax: dz = p ⊙ (dp − Σ p·dp)
        let mean: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        for i in 0..e {
            dlogits[r * e + i] = p[i] * (dp[i] - mean);
        }
    }
    Tensor::from_vec(&[t, e], dlogits)
}

/// `route_backward` of DeepSeek-V3's router (on the host): with S = Σ_chosen s + 1e-20 and
/// w_j = scale · s_j / S, ds_i = scale/S · (dw_i − Σ_j dw_j · s_j/S) (without `norm`,
/// ds_i = scale · dw_i); then dz = ds · s (1 − s). The bias that chose them has no gradient.
fn sigmoid_backward(dweights: &Tensor, routing: &Routing, (norm, scale): (bool, f32), dtype: DType) -> Tensor {
    let (t, e, k) = (routing.probs.rows(), routing.probs.cols(), routing.weights.cols());
    let (p, dw) = (routing.probs.to_vec(), dweights.to_vec());
    let mut dz = vec![0.0; t * e];
    for r in 0..t {
        let (s, dw, ids) = (&p[r * e..(r + 1) * e], &dw[r * k..(r + 1) * k], &routing.experts[r * k..(r + 1) * k]);
        let dz = &mut dz[r * e..(r + 1) * e];
        if norm {
            let sum = ids.iter().map(|&i| s[i as usize]).sum::<f32>() + 1e-20;
            let through: f32 = dw.iter().zip(ids).map(|(d, &i)| d * s[i as usize] / sum).sum();
            ids.iter().zip(dw).for_each(|(&i, d)| dz[i as usize] += scale / sum * (d - through));
        } else {
            ids.iter().zip(dw).for_each(|(&i, d)| dz[i as usize] += scale * d);
        }
        dz.iter_mut().zip(s).for_each(|(g, s)| *g *= s * (1.0 - s));
    }
    Tensor::from_host_in(&[t, e], dz, &dweights.place(), dtype)
}

/// The rows of `x` in `order`: `[order.len(), d]`.
pub fn permute_rows(x: &Tensor, order: &[u32]) -> Tensor {
    super::gather_blocks(x, x.cols(), order)
}

/// y[t] = Σ_j w[t, j] · ys[slot[t·k + j]] for `rows` rows (`weights` `[rows, k]`, or unit weights).
pub fn weighted_sum(ys: &Tensor, slot: &[u32], weights: Option<&Tensor>, rows: usize) -> Tensor {
    let (d, k) = (ys.cols(), slot.len() / rows.max(1));
    assert_eq!(slot.len(), rows * k, "weighted_sum: k slots per row");
    if let Some(dev) = gpu("weighted sum", &[ys]) {
        return fatal("weighted sum", dev.weighted_sum(ys, slot, weights, rows));
    }
    let (src, w) = (ys.host(), weights.map(|w| w.host()));
    let mut y = vec![0.0; rows * d];
    for (i, &s) in slot.iter().enumerate() {
        let scale = w.map_or(1.0, |w| w[i]);
        let (out, row) = (&mut y[i / k * d..(i / k + 1) * d], &src[s as usize * d..(s as usize + 1) * d]);
        out.iter_mut().zip(row).for_each(|(o, x)| *o += scale * x);
    }
    Tensor::from_vec(&[rows, d], y)
}

/// The backward of `weighted_sum` with weights: (d ys `[n, d]`, d weights `[rows, k]`).
pub fn weighted_sum_backward(dy: &Tensor, ys: &Tensor, slot: &[u32], weights: &Tensor) -> (Tensor, Tensor) {
    let (rows, d, k) = (dy.rows(), dy.cols(), weights.cols());
    assert_eq!(slot.len(), rows * k, "weighted sum backward: k slots per row");
    if let Some(dev) = gpu("weighted sum backward", &[dy, ys, weights]) {
        return fatal("weighted sum backward", dev.weighted_sum_backward(dy, ys, slot, weights));
    }
    let (g, src, w) = (dy.host(), ys.host(), weights.host());
    let (mut dys, mut dw) = (vec![0.0; ys.numel()], vec![0.0; rows * k]);
    for (i, &s) in slot.iter().enumerate() {
        let (s, grad) = (s as usize, &g[i / k * d..(i / k + 1) * d]);
        dys[s * d..(s + 1) * d].iter_mut().zip(grad).for_each(|(o, x)| *o = w[i] * x);
        dw[i] = grad.iter().zip(&src[s * d..(s + 1) * d]).map(|(a, b)| a * b).sum();
    }
    (Tensor::from_vec(ys.shape(), dys), Tensor::from_vec(&[rows, k], dw))
}
