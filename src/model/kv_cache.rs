//! # Generating text: the KV cache
//!
//! Training runs every position of a sequence at once. Generation cannot: token t+1 is chosen
//! from the logits at position t, so the model runs once per new token. Run from scratch each
//! time, the n-th token would cost a whole forward over n positions. But in a causal model
//! nothing at a position changes when later tokens are added, and the only thing later
//! positions read from earlier ones is their keys and values (in attention). So each layer keeps
//! them, and a step runs only the new rows:
//!
//! ```text
//! prompt, n tokens:  x[0..n] ─ q, k, v ─ k, v[0..n] → cache;  q[0..n] attends to k, v[0..n]
//! new token at t:    x[t]    ─ q, k, v ─ k, v[t] appended;    q[t]    attends to k, v[0..=t]
//!                    then the MLP, the norm and the head: one row through every matmul
//! ```
//! Positions matter twice, as in training: RoPE turns q and k by their own position (a cached k
//! keeps the turn it got when it was written), and the causal mask lets a query at position p
//! see the keys at positions ≤ p. That is `ops::attention` with query positions t.. and key
//! positions 0..=t, the same op (CPU loops or GPU kernels) that ring attention uses for its blocks.
//!
//! Shapes, for one sequence: a layer's cache holds k and v, `[len, kv_heads × head_dim]` each,
//! after RoPE; keys that are their own values (latent attention's latent and shared rotated key,
//! `latent_attention.rs`) are held once. It grows by copying into a tensor one step longer
//! (simple; a serving system allocates it once, in pages, and batches many sequences).

use crate::ops::tensor::Tensor;
use crate::ops::{self, Attn};

/// The keys and values of every layer for the positions run so far, one sequence.
pub struct KvCache {
    layers: Vec<Option<Past>>,
    len: usize,
}

/// A layer's keys so far, and its values (`None`: the keys are the values).
type Past = (Tensor, Option<Tensor>);

impl KvCache {
    pub fn new(layers: usize) -> KvCache {
        KvCache { layers: (0..layers).map(|_| None).collect(), len: 0 }
    }

    /// Positions cached: the next token runs at this position.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes it holds, every layer's keys and values.
    pub fn bytes(&self) -> usize {
        let past = |(k, v): &Past| k.bytes() + v.as_ref().map_or(0, Tensor::bytes);
        self.layers.iter().flatten().map(past).sum()
    }

    /// Layer `i`'s part, for a step that starts at position `len()`.
    pub fn layer(&mut self, i: usize) -> KvLayer<'_> {
        KvLayer { kv: &mut self.layers[i], len: self.len }
    }

    /// After every layer has appended the step's `n` rows.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}

/// One layer's keys and values, lent to the layer for one step.
pub struct KvLayer<'c> {
    kv: &'c mut Option<Past>,
    len: usize,
}

impl KvLayer<'_> {
    /// Appends this step's k, v (its rows run at positions `len..`) and attends its queries to
    /// every key so far. Returns (out, lse, score entries computed), like a sequence split. Keys
    /// given as their own values (`v` the same tensor as `k`) are kept once.
    pub fn attend(self, a: Attn, q: &Tensor, k: &Tensor, v: &Tensor, positions: &[u32]) -> (Tensor, Tensor, u64) {
        assert_eq!(a.batch, 1, "the KV cache holds one sequence");
        // the rows so far, then this step's: one tensor a step longer (a copy)
        let rows = |parts: &[&Tensor]| {
            let n = parts.iter().map(|t| t.rows()).sum::<usize>();
            ops::concat(parts).with_shape(&[n, parts[0].cols()])
        };
        let shared = std::ptr::eq(k, v);
        let (k_all, v_all) = match self.kv.take() {
            None => (rows(&[k]), (!shared).then(|| rows(&[v]))),
            Some((k_old, v_old)) => {
                let v_all = v_old.map(|v_old| rows(&[&v_old, v]));
                (rows(&[&k_old, k]), v_all)
            }
        };
        let keys: Vec<u32> = (0..k_all.rows() as u32).collect();
        debug_assert_eq!(keys.len(), self.len + q.rows());
        let a = Attn { kv_seq: keys.len(), ..a };
        let (out, lse) = ops::attention(a, q, &k_all, v_all.as_ref().unwrap_or(&k_all), (positions, &keys));
        *self.kv = Some((k_all, v_all));
        (out, lse, (a.heads * a.seq * a.kv_seq) as u64)
    }
}
