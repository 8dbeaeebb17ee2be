//! # The model's parameters: building them, listing them, moving them
//!
//! Everything about a `Llama` but its forward and backward (`llama.rs`): building a rank's part
//! of the model from the config (the layers it holds and their chunks, its tp slice of every tensor),
//! the parameters in Hugging Face order, their device, and what the model holds.

use super::{Cache, Head, HeadCache, Llama, LossHead, WholeLogits};
use crate::config::ModelConfig;
use crate::model::block::{Attentions, Block, KeepAll, Keeps, Mlps};
use crate::model::param::{Param, ParamKind};
use crate::model::split::{LayerSplit, SequenceSplit, TensorSplit, WeightSplit, Whole};
use crate::model::{family, init};
use crate::ops::tensor::{Place, Tensor};
use crate::ops::{self, DType, Precision, TpCut};
use anyhow::Result;
use std::collections::VecDeque;
use std::rc::Rc;

impl<'g> Llama<'g> {
    /// A fresh model on one rank: every parameter from its own (seed, name) stream (`init.rs`).
    pub fn new(cfg: &ModelConfig, seed: u64) -> Llama<'static> {
        Llama::init(cfg, seed, Box::new(Whole), Whole)
    }

    /// This rank's part of the same model: the layers `layer_split` says (a pipeline stage's), each
    /// tensor split over the tensor-parallel ranks as `tp` says. Parts are cut from the full
    /// initialised tensors, so every layout starts from the single-rank model.
    pub fn init(
        cfg: &ModelConfig,
        seed: u64,
        tp: Box<dyn TensorSplit + 'g>,
        layer_split: impl LayerSplit,
    ) -> Llama<'g> {
        let std = cfg.initializer_range;
        Llama::build(cfg, tp, layer_split, |name, shape, kind| {
            Ok(match kind {
                ParamKind::Matrix => init::normal(seed, name, shape, std),
                ParamKind::Norm => init::ones(shape),
                ParamKind::Buffer => Tensor::zeros(shape),
            })
        })
        .expect("init cannot fail")
    }

    /// Builds the model the config describes (`family.rs`: Llama's, or with `model.num_local_experts`
    /// Mixtral's, all its experts here), asking `make(name, full shape, kind)` for each parameter
    /// in Hugging Face order, and keeping this tp rank's part of it.
    pub fn build(
        cfg: &ModelConfig,
        tp: Box<dyn TensorSplit + 'g>,
        layer_split: impl LayerSplit,
        mut make: impl FnMut(&str, &[usize], ParamKind) -> Result<Tensor>,
    ) -> Result<Llama<'g>> {
        let (index, count) = tp.part();
        let (attentions, mlps) = (family::attentions(cfg), family::mlps(cfg));
        let makers = (&*attentions, &*mlps);
        let (embed_tokens, layers, head) = Llama::parts(cfg, &layer_split, makers, &mut |name, shape, kind, tp| {
            let value = ops::tp_part(&make(&name, shape, kind)?, tp, (index, count)); // this tp rank's
            Ok(Param::new(name, value, tp))
        })?;
        let vocab_first = index * cfg.vocab_size / count;
        let caches = VecDeque::new();
        let mut at = 0; // chunk c holds the next `len` of this stage's layers
        let chunks = (layer_split.chunk_layers(cfg.num_hidden_layers).iter())
            .map(|r| {
                at += r.len();
                at - r.len()..at
            })
            .collect();
        Ok(Llama {
            cfg: cfg.clone(),
            tp,
            seq: Box::new(Whole),
            weights: Rc::new(Whole),
            vocab_first,
            embed_tokens,
            layers,
            chunks,
            head,
            caches,
            deferred: VecDeque::new(),
            attention_work: 0,
            keeps: Box::new(KeepAll),
            loss: Box::new(WholeLogits),
            term: mlps.loss_term(),
        })
    }

    /// The parameters of the layers `layer_split` says, each made by `param(name, full shape, kind, tp
    /// cut)`; the blocks' attentions and MLPs by `makers`.
    #[allow(clippy::type_complexity)]
    pub(super) fn parts(
        cfg: &ModelConfig,
        layer_split: &dyn LayerSplit,
        makers: (&dyn Attentions<'g>, &dyn Mlps<'g>),
        param: &mut impl FnMut(String, &[usize], ParamKind, TpCut) -> Result<Param>,
    ) -> Result<(Option<Param>, Vec<Block<'g>>, Option<Head>)> {
        let d = cfg.hidden_size;
        let (rows, whole) = (TpCut::Rows, TpCut::Whole); // on the tp axis: vocabulary rows
        let embed = |param: &mut dyn FnMut(String, &[usize], ParamKind, TpCut) -> Result<Param>| {
            param("model.embed_tokens.weight".into(), &[cfg.vocab_size, d], ParamKind::Matrix, rows)
        };
        let embed_tokens = match layer_split.has_embedding() {
            true => Some(embed(param)?),
            false => None,
        };
        let mut layers = Vec::new();
        for i in layer_split.chunk_layers(cfg.num_hidden_layers).into_iter().flatten() {
            layers.push(Block::build(i, cfg, makers, param)?);
        }
        let head = match layer_split.has_head() {
            true => Some(Head {
                norm: param("model.norm.weight".into(), &[d], ParamKind::Norm, whole)?,
                // tied: the embedding itself where it is here; on a stage without it (the last
                // of a pipeline) a copy of it, made as the embedding is — same name, same values —
                // whose gradient the two stages sum before each update, so that the two stay equal
                lm_head: match (cfg.tie_word_embeddings, layer_split.has_embedding()) {
                    (true, true) => None,
                    (true, false) => Some(embed(param)?),
                    (false, _) => Some(param("lm_head.weight".into(), &[cfg.vocab_size, d], ParamKind::Matrix, rows)?),
                },
            }),
            false => None,
        };
        Ok((embed_tokens, layers, head))
    }

    /// Splits every sequence as `seq` says: forward then takes this rank's tokens of each
    /// sequence, and attention reaches the others' (`parallel/context_parallel.rs`).
    pub fn with_sequence_split(mut self, seq: Box<dyn SequenceSplit + 'g>) -> Llama<'g> {
        self.seq = seq;
        self
    }

    /// Keeps 1/dp of every weight here and gathers each unit's whole weights only while it
    /// computes with them (FSDP, `parallel/zero.rs`).
    pub fn with_weight_split(mut self, weights: Rc<dyn WeightSplit + 'g>) -> Llama<'g> {
        self.weights = weights;
        self
    }

    /// Makes the loss with `loss` (the plain `WholeLogits` keeps the whole logits for backward,
    /// and for `logits`).
    pub fn with_loss(mut self, loss: Box<dyn LossHead + 'g>) -> Llama<'g> {
        self.loss = loss;
        self
    }

    /// Its linear layers' GEMMs read what `gemms` says for each weight's name (f32 unless a run
    /// sets it: bf16 on a GPU, or FP8 as its lesson's rule says, `ops/precision.rs`'s `gemms`). The
    /// norms' weights and an untied embedding are no GEMM's operands: f32 (what FSDP sends of
    /// them: `ops/packing.rs`).
    pub fn with_gemms(mut self, gemms: impl Fn(&str) -> Precision) -> Llama<'g> {
        let tied = self.cfg.tie_word_embeddings;
        for param in self.params_mut() {
            let no_gemm = !param.decays() || (!tied && param.name.ends_with("embed_tokens.weight"));
            param.precision = if no_gemm { Precision::F32 } else { gemms(&param.name) };
        }
        self
    }

    /// Keeps what `keeps` says of each block's activations for backward (recomputation:
    /// `model/recompute.rs`).
    pub fn with_keeps(mut self, keeps: Box<dyn Keeps + 'g>) -> Llama<'g> {
        self.keeps = keeps;
        self
    }

    /// The output layer this stage holds as a copy of another stage's embedding (a tied model's
    /// last pipeline stage): the embedding's stage counts it in the gradient norm and writes it
    /// in checkpoints.
    pub fn tied_copy(&self) -> Option<&Param> {
        self.head.as_ref()?.lm_head.as_ref().filter(|_| self.cfg.tie_word_embeddings)
    }

    /// Every parameter, in Hugging Face order.
    pub fn params(&self) -> Vec<&Param> {
        let mut v: Vec<&Param> = self.embed_tokens.iter().collect();
        for b in &self.layers {
            v.extend(b.params());
        }
        if let Some(h) = &self.head {
            v.push(&h.norm);
            v.extend(h.lm_head.as_ref());
        }
        v
    }

    /// The model chunk of each of `params()` (all 0 unless the pipeline is interleaved): the
    /// embedding's is the first, the head's the last.
    pub fn param_chunks(&self) -> Vec<usize> {
        let last = self.chunks.len() - 1;
        let mut v: Vec<usize> = self.embed_tokens.iter().map(|_| 0).collect();
        for (c, range) in self.chunks.iter().enumerate() {
            v.extend(range.clone().flat_map(|i| self.layers[i].params().into_iter().map(move |_| c)));
        }
        if let Some(h) = &self.head {
            v.push(last);
            v.extend(h.lm_head.iter().map(|_| last));
        }
        v
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v: Vec<&mut Param> = self.embed_tokens.iter_mut().collect();
        for b in &mut self.layers {
            v.extend(b.params_mut());
        }
        if let Some(h) = &mut self.head {
            v.push(&mut h.norm);
            v.extend(h.lm_head.as_mut());
        }
        v
    }

    /// The device the model lives on.
    pub fn place(&self) -> Place {
        self.params()[0].place()
    }

    /// Moves every weight and gradient to `place`: on a GPU in mixed precision each weight
    /// becomes an fp32 master with its bf16 copy, and gradients stay fp32.
    pub fn to_place(&mut self, place: &Place) {
        if self.place().is(place) {
            return;
        }
        for p in self.params_mut() {
            p.value = p.value.to_param(place);
            p.grad = p.grad.to_dtype(place, DType::F32);
        }
    }

    /// FNV-1a over the bits of every weight, in model order: replicas that agree have equal
    /// checksums. Of a weight not kept whole (its trained part apart, its value empty: FSDP), over
    /// this rank's trained part.
    pub fn checksum(&self) -> u64 {
        let mut h: u64 = 0xcbf29ce484222325;
        let values = |p: &&Param| match (&p.trained_part, p.value.numel()) {
            (Some(t), 0) => t.values().to_vec(),
            _ => p.value.to_vec(),
        };
        for x in self.params().iter().flat_map(values) {
            for b in x.to_bits().to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x100000001b3);
            }
        }
        h
    }

    /// The bytes of the activations layer_split for backward (all micro-batches in flight), and of the
    /// weight GEMMs' inputs a zero-bubble pipeline's W still has to read.
    pub fn activation_bytes(&self) -> usize {
        let cache =
            |c: &Cache| c.blocks.iter().map(|k| k.bytes()).sum::<usize>() + c.head.as_ref().map_or(0, HeadCache::bytes);
        self.caches.iter().map(cache).sum::<usize>() + self.deferred.iter().map(|(_, kept)| kept.bytes()).sum::<usize>()
    }

    /// Attention score entries (query × key pairs, all heads) computed since the last call.
    pub fn take_attention_work(&mut self) -> u64 {
        std::mem::take(&mut self.attention_work)
    }
}
