//! # What a config must satisfy, checked before anything is built
//!
//! Every check names the key and says how to fix it in one line: a model's shapes (also for a
//! Hugging Face `config.json`), the training and parallel settings against each other and the
//! model, the device, and the data source. `Config::load` runs them after the TOML is read.

use super::{table::first_non_finite, MAX_NS_STEPS, MAX_SAMPLE_TOKENS, MAX_TIMEOUT_S};
use super::{
    CommBackend, Config, CpMode, CpSplit, DataConfig, DeviceDtype, DeviceKind, DpMode, ModelConfig, PpSchedule,
    RopeScaling, RopeType,
};
use crate::ops::types::WIDE_HEAD_DIM;
use anyhow::{bail, Context, Result};

impl ModelConfig {
    /// The checks every model needs, whether it comes from a TOML file or a `config.json`.
    pub fn validate(&self, prefix: &str) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ];
        for (key, v) in positive {
            if v == 0 {
                bail!("{prefix}{key} = 0: it must be at least 1");
            }
        }
        let (h, kv) = (self.num_attention_heads, self.num_key_value_heads);
        if self.kv_lora_rank > 0 {
            self.validate_latent(prefix)?;
        } else if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(h) {
            bail!("{prefix}hidden_size = {} is not divisible by {prefix}num_attention_heads = {h}: change one, or set {prefix}head_dim", self.hidden_size);
        }
        if !h.is_multiple_of(kv) {
            bail!("{prefix}num_attention_heads = {h} is not a multiple of {prefix}num_key_value_heads = {kv}: grouped-query attention shares each KV head among a whole number of query heads");
        }
        if self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            bail!("{prefix}head_dim = {} must be even and positive: RoPE rotates pairs of features", self.head_dim());
        }
        let latent = [
            ("q_lora_rank", self.q_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
        ];
        if let Some((key, v)) = latent.iter().find(|(_, v)| self.kv_lora_rank == 0 && *v > 0) {
            bail!("{prefix}{key} = {v} with {prefix}kv_lora_rank = 0: it is a width of latent attention, which kv_lora_rank > 0 turns on; set kv_lora_rank or {key} = 0");
        }
        let (e, k) = (self.num_local_experts, self.num_experts_per_tok);
        match (e, k) {
            (0, 0) => {}
            (0, k) => bail!("{prefix}num_experts_per_tok = {k} with {prefix}num_local_experts = 0: a dense model routes to no expert; set num_local_experts > 0 or num_experts_per_tok = 0"),
            (e, k) if k == 0 || k > e => bail!("{prefix}num_experts_per_tok = {k}: each token goes to between 1 and {prefix}num_local_experts = {e} experts"),
            _ => {}
        }
        self.validate_deepseek_moe(prefix)?;
        self.validate_rope_scaling(prefix)?;
        let coef = self.router_aux_loss_coef;
        if !(coef >= 0.0 && coef.is_finite()) {
            bail!("{prefix}router_aux_loss_coef = {coef}: it must be 0 (off) or a positive finite number");
        }
        for (key, v) in [
            ("rope_theta", self.rope_theta),
            ("rms_norm_eps", self.rms_norm_eps as f64),
            ("initializer_range", self.initializer_range as f64),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                bail!("{prefix}{key} = {v}: it must be a positive finite number");
            }
        }
        Ok(())
    }

    /// DeepSeekMoE's settings (`moe_intermediate_size` > 0), or their defaults without it.
    fn validate_deepseek_moe(&self, prefix: &str) -> Result<()> {
        let (e, k, g, kept) = (self.num_local_experts, self.num_experts_per_tok, self.n_group, self.topk_group);
        if self.moe_intermediate_size == 0 {
            let defaults = [
                ("n_shared_experts", self.n_shared_experts == 0, "0"),
                ("first_k_dense_replace", self.first_k_dense_replace == 0, "0"),
                ("n_group", g == 1, "1"),
                ("topk_group", kept == 1, "1"),
                ("routed_scaling_factor", self.routed_scaling_factor == 1.0, "1.0"),
                ("bias_update_speed", self.bias_update_speed == 0.0, "0.0"),
                ("seq_aux_loss_coef", self.seq_aux_loss_coef == 0.0, "0.0"),
            ];
            if let Some((key, _, default)) = defaults.iter().find(|(_, ok, _)| !ok) {
                bail!("{prefix}{key} is set with {prefix}moe_intermediate_size = 0: it is a setting of DeepSeekMoE, which moe_intermediate_size > 0 turns on; set moe_intermediate_size or {key} = {default}");
            }
            return Ok(());
        }
        if self.kv_lora_rank == 0 {
            bail!("{prefix}moe_intermediate_size > 0 with {prefix}kv_lora_rank = 0: a DeepSeekMoE model is DeepSeek-V3's, whose attention is latent (and whose checkpoints transformers reads as such); set kv_lora_rank and its widths");
        }
        if e == 0 {
            bail!("{prefix}moe_intermediate_size > 0 with {prefix}num_local_experts = 0: DeepSeekMoE routes to num_local_experts experts; set it (and num_experts_per_tok)");
        }
        if g == 0 || !e.is_multiple_of(g) || e / g < 2 {
            bail!("{prefix}n_group = {g}: it must divide {prefix}num_local_experts = {e} into groups of at least 2 experts (a group is scored by its two best)");
        }
        if kept == 0 || kept > g || k > kept * (e / g) {
            bail!("{prefix}topk_group = {kept}: it must be between 1 and n_group = {g}, and its groups must hold at least num_experts_per_tok = {k} experts");
        }
        if self.router_aux_loss_coef > 0.0 {
            bail!("{prefix}router_aux_loss_coef > 0 with DeepSeekMoE: its router balances by a bias (bias_update_speed), not the Switch loss; set router_aux_loss_coef = 0");
        }
        for (key, v) in [
            ("routed_scaling_factor", self.routed_scaling_factor),
            ("bias_update_speed", self.bias_update_speed),
            ("seq_aux_loss_coef", self.seq_aux_loss_coef),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                bail!("{prefix}{key} = {v}: it must be a finite number, 0 or more");
            }
        }
        Ok(())
    }

    /// RoPE's rescaling: the keys its kind reads in range, the others at their defaults (a
    /// `factor` without a `rope_type` would otherwise be ignored without a word).
    fn validate_rope_scaling(&self, prefix: &str) -> Result<()> {
        let s = &self.rope_scaling;
        let kind = s.rope_type;
        let key = |k: &str| format!("{prefix}rope_scaling.{k}");
        let reads = |k: &str| match kind {
            RopeType::Default => false,
            _ if k == "mscale_all_dim" => true, // every kind: latent attention's softmax factor
            RopeType::Linear => k == "factor",
            RopeType::Yarn => !matches!(k, "low_freq_factor" | "high_freq_factor"),
            RopeType::Llama3 => {
                matches!(k, "factor" | "original_max_position_embeddings" | "low_freq_factor" | "high_freq_factor")
            }
        };
        let d = RopeScaling::PLAIN;
        let numbers = [
            ("factor", s.factor, d.factor),
            ("attention_factor", s.attention_factor, d.attention_factor),
            ("beta_fast", s.beta_fast, d.beta_fast),
            ("beta_slow", s.beta_slow, d.beta_slow),
            ("mscale", s.mscale, d.mscale),
            ("mscale_all_dim", s.mscale_all_dim, d.mscale_all_dim),
            ("low_freq_factor", s.low_freq_factor, d.low_freq_factor),
            ("high_freq_factor", s.high_freq_factor, d.high_freq_factor),
        ];
        let name = toml::Value::try_from(kind).map(|v| v.to_string()).unwrap_or_default();
        for (k, v, default) in numbers {
            if !reads(k) && v != default {
                bail!("{} = {v} with {} = {name}: that kind of RoPE does not read it; set {} (\"linear\", \"yarn\" or \"llama3\") or leave {k} at {default}", key(k), key("rope_type"), key("rope_type"));
            }
            if reads(k) && !(v >= 0.0 && v.is_finite()) {
                bail!("{} = {v}: it must be a finite number, 0 or more", key(k));
            }
        }
        let orig = s.original_max_position_embeddings;
        if !reads("original_max_position_embeddings") && orig != 0 {
            bail!(
                "{} = {orig} with {} = {name}: that kind of RoPE does not read it; leave it at 0",
                key("original_max_position_embeddings"),
                key("rope_type")
            );
        }
        if !reads("truncate") && !s.truncate {
            bail!(
                "{} = false with {} = {name}: only yarn reads it; leave it at true",
                key("truncate"),
                key("rope_type")
            );
        }
        if kind == RopeType::Default {
            return Ok(());
        }
        if s.factor <= 0.0 {
            bail!("{} = {}: the context's factor must be positive (1: the trained length)", key("factor"), s.factor);
        }
        if reads("original_max_position_embeddings") && orig == 0 {
            bail!(
                "{} = 0 with {} = {name}: give the context length the model was trained on",
                key("original_max_position_embeddings"),
                key("rope_type")
            );
        }
        if kind == RopeType::Yarn && (s.beta_fast <= 0.0 || s.beta_slow <= 0.0) {
            bail!(
                "{} = {} and {} = {}: YaRN's turn counts must be positive (32 and 1 are usual)",
                key("beta_fast"),
                s.beta_fast,
                key("beta_slow"),
                s.beta_slow
            );
        }
        if kind == RopeType::Llama3 && s.low_freq_factor >= s.high_freq_factor {
            bail!(
                "{} = {} must be less than {} = {} (1 and 4 are Llama 3's)",
                key("low_freq_factor"),
                s.low_freq_factor,
                key("high_freq_factor"),
                s.high_freq_factor
            );
        }
        Ok(())
    }

    /// Multi-head latent attention's widths (`kv_lora_rank` > 0), or none of them without it.
    fn validate_latent(&self, prefix: &str) -> Result<()> {
        let (h, kv) = (self.num_attention_heads, self.num_key_value_heads);
        if kv != h {
            bail!("{prefix}num_key_value_heads = {kv} with {prefix}kv_lora_rank > 0: latent attention gives every head its own key and value; set num_key_value_heads = num_attention_heads = {h}");
        }
        for (key, v) in [
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
        ] {
            if v == 0 {
                bail!("{prefix}{key} = 0 with {prefix}kv_lora_rank > 0: latent attention needs it at least 1");
            }
        }
        if self.num_local_experts > 0 && self.moe_intermediate_size == 0 {
            bail!("{prefix}num_local_experts > 0 with {prefix}kv_lora_rank > 0 and moe_intermediate_size = 0: latent attention is DeepSeek-V3's, whose experts are DeepSeekMoE's (Mixtral's attend by GQA); set moe_intermediate_size, or kv_lora_rank = 0");
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            bail!("{prefix}qk_rope_head_dim = {} must be even: RoPE rotates pairs of features", self.qk_rope_head_dim);
        }
        if let Some(hd) = self.head_dim.filter(|&hd| hd != self.qk_rope_head_dim) {
            bail!("{prefix}head_dim = {hd} with {prefix}kv_lora_rank > 0: latent attention's widths are qk_nope_head_dim, qk_rope_head_dim and v_head_dim; leave head_dim out");
        }
        Ok(())
    }
}

impl Config {
    /// The checks of every section, and of the sections against each other, section by section.
    pub fn validate(&self) -> Result<()> {
        let table = toml::Value::try_from(self).context("the config does not serialise")?;
        if let Some((key, v)) = first_non_finite(&table, "") {
            bail!("{key} = {v}: it must be a finite number");
        }
        self.model.validate("model.")?;
        self.validate_sizes()?;
        self.validate_train()?;
        self.validate_layout()?;
        validate_experts(self)?;
        self.validate_comm()?;
        self.validate_places()?;
        validate_data(&self.data, &self.model, self.train.seq_len)
    }

    /// Counts that must be at least 1, the run's number of sequences, the held-out share.
    fn validate_sizes(&self) -> Result<()> {
        let (t, p) = (&self.train, &self.parallel);
        for (key, v) in [
            ("train.steps", t.steps),
            ("train.micro_batch_size", t.micro_batch_size),
            ("train.grad_accum_steps", t.grad_accum_steps),
            ("train.seq_len", t.seq_len),
            ("parallel.dp", p.dp),
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
            ("parallel.cp", p.cp),
        ] {
            if v == 0 {
                bail!("{key} = 0: it must be at least 1");
            }
        }
        // sequence i of the run is drawn from (data seed, i): every step's must have an index
        // below 2⁶², where the held-out sequences begin (`data/mod.rs`)
        let sequences = [t.micro_batch_size, t.grad_accum_steps, p.dp, t.steps]
            .iter()
            .try_fold(1u64, |n, &x| n.checked_mul(x as u64))
            .filter(|&n| n < 1 << 62);
        if sequences.is_none() {
            bail!("train.steps × train.micro_batch_size × train.grad_accum_steps × parallel.dp = {} × {} × {} × {} sequences: more than the 2⁶² a run can draw; lower them", t.steps, t.micro_batch_size, t.grad_accum_steps, p.dp);
        }
        if t.sample_every > 0 && !(1..=MAX_SAMPLE_TOKENS).contains(&t.sample_tokens) {
            bail!("train.sample_tokens = {} with train.sample_every = {}: give from 1 to {MAX_SAMPLE_TOKENS} tokens a sample (or sample_every = 0 for no samples)", t.sample_tokens, t.sample_every);
        }
        if !t.sample_prompt.is_empty() && self.data.source == "synthetic" {
            bail!("train.sample_prompt = {:?}: the synthetic data has no text to encode it with; leave it empty (a sample then continues the held-out data's first tokens) or train on text", t.sample_prompt);
        }
        let v = &self.validation;
        if v.every > 0 && v.batches == 0 {
            bail!("validation.batches = 0 with validation.every = {}: give 1 or more batches (or every = 0 for no validation)", v.every);
        }
        let held_out = [v.batches, t.micro_batch_size, t.grad_accum_steps, p.dp]
            .iter()
            .try_fold(1u64, |n, &x| n.checked_mul(x as u64))
            .filter(|&n| n < 1 << 62);
        if v.every > 0 && held_out.is_none() {
            bail!("validation.batches × train.micro_batch_size × train.grad_accum_steps × parallel.dp = {} × {} × {} × {} held-out sequences: more than the 2⁶² a run can draw; lower validation.batches", v.batches, t.micro_batch_size, t.grad_accum_steps, p.dp);
        }
        if !(v.split > 0.0 && v.split < 1.0) {
            bail!(
                "validation.split = {}: the held-out share of a text source must lie strictly between 0 and 1",
                v.split
            );
        }
        Ok(())
    }

    /// The optimizer's settings.
    fn validate_train(&self) -> Result<()> {
        let t = &self.train;
        if t.seq_len < 2 {
            bail!("train.seq_len = 1: a sequence of one token has nothing to predict (each token's target is the next one); set train.seq_len to 2 or more");
        }
        if !(t.lr > 0.0 && t.min_lr >= 0.0 && t.min_lr <= t.lr) {
            bail!("train.lr = {} and train.min_lr = {}: need 0 <= min_lr <= lr and lr > 0", t.lr, t.min_lr);
        }
        if !(0.0..1.0).contains(&t.beta1) || !(0.0..1.0).contains(&t.beta2) {
            bail!("train.beta1 and train.beta2 must lie in [0, 1)");
        }
        if t.adam_eps <= 0.0 {
            bail!("train.adam_eps = {}: it must be positive (it keeps AdamW from dividing by zero)", t.adam_eps);
        }
        if !(t.muon_lr > 0.0 && t.muon_lr.is_finite()) {
            bail!("train.muon_lr = {}: Muon's peak learning rate must be positive", t.muon_lr);
        }
        if !(0.0..1.0).contains(&t.muon_momentum) {
            bail!("train.muon_momentum = {}: it must lie in [0, 1) (0.95 is usual)", t.muon_momentum);
        }
        if !(1..=MAX_NS_STEPS).contains(&t.muon_ns_steps) {
            bail!(
                "train.muon_ns_steps = {}: give from 1 to {MAX_NS_STEPS} Newton–Schulz iterations (5 is usual)",
                t.muon_ns_steps
            );
        }
        for (key, v) in [("train.weight_decay", t.weight_decay), ("train.grad_clip", t.grad_clip)] {
            if v < 0.0 {
                bail!("{key} = {v}: it must be 0 (off) or positive");
            }
        }
        Ok(())
    }

    /// The layout against the model and the batch: context, pipeline and tensor parallelism.
    fn validate_layout(&self) -> Result<()> {
        let (t, p) = (&self.train, &self.parallel);
        let chunks = if p.cp_split == CpSplit::Zigzag { 2 * p.cp } else { p.cp };
        if p.cp > 1 && !t.seq_len.is_multiple_of(chunks) {
            bail!("train.seq_len = {} does not split into {chunks} equal chunks for parallel.cp = {} (the {:?} split cuts {chunks} chunks): choose a seq_len divisible by {chunks}", t.seq_len, p.cp, p.cp_split);
        }
        let heads = self.model.num_attention_heads / p.tp.max(1);
        if p.cp > 1 && p.cp_mode == CpMode::Ulysses && !heads.is_multiple_of(p.cp) {
            bail!("parallel.cp_mode = \"ulysses\" with parallel.cp = {}: each tp rank's {heads} attention heads (model.num_attention_heads / parallel.tp) must split evenly over the cp ranks; choose a cp that divides {heads}, or cp_mode = \"ring\"", p.cp);
        }
        if p.pp > self.model.num_hidden_layers {
            bail!(
                "parallel.pp = {} exceeds model.num_hidden_layers = {}: every pipeline stage needs at least one layer",
                p.pp,
                self.model.num_hidden_layers
            );
        }
        let v = p.pp_virtual_stages;
        let kind = p.pp_schedule.name();
        match (p.pp_schedule, v) {
            (_, 0) => bail!("parallel.pp_virtual_stages = 0: it must be at least 1"),
            (PpSchedule::Interleaved, 1) => bail!("parallel.pp_schedule = \"interleaved\" with parallel.pp_virtual_stages = 1: give each rank at least 2 model chunks (or use \"1f1b\")"),
            (PpSchedule::Zbv, v) if v > 2 => bail!("parallel.pp_virtual_stages = {v} with parallel.pp_schedule = \"zbv\": the V shape always gives each rank 2 chunks; leave pp_virtual_stages at 1 or 2"),
            (PpSchedule::Afab | PpSchedule::OneFOneB | PpSchedule::ZbH1, v) if v > 1 => bail!("parallel.pp_virtual_stages = {v} needs parallel.pp_schedule = \"interleaved\" (pp_schedule = \"{kind}\" holds one chunk per rank)"),
            _ => {}
        }
        let (layers, m) = (self.model.num_hidden_layers, t.grad_accum_steps);
        if p.pp_schedule == PpSchedule::Interleaved {
            if p.pp < 2 {
                bail!("parallel.pp_schedule = \"interleaved\" with parallel.pp = {}: the interleaved schedule needs at least 2 pipeline stages", p.pp);
            }
            if p.pp.saturating_mul(v) > layers {
                bail!("parallel.pp × parallel.pp_virtual_stages = {} × {v} exceeds model.num_hidden_layers = {layers}: every model chunk needs at least one layer", p.pp);
            }
            if !m.is_multiple_of(p.pp) {
                bail!("parallel.pp_schedule = \"interleaved\": train.grad_accum_steps = {m} micro-batches must be a multiple of parallel.pp = {} (they go through the pipeline in groups of pp)", p.pp);
            }
        }
        if p.pp_schedule == PpSchedule::Zbv {
            if p.pp < 2 {
                bail!("parallel.pp_schedule = \"zbv\" with parallel.pp = {}: the V shape needs at least 2 pipeline stages (or use \"zb-h1\")", p.pp);
            }
            if p.pp.saturating_mul(2) > layers {
                bail!("parallel.pp_schedule = \"zbv\": 2 × parallel.pp = {} model chunks exceed model.num_hidden_layers = {layers}: every chunk needs at least one layer", 2 * p.pp);
            }
            if m < 2 * p.pp - 1 {
                bail!("parallel.pp_schedule = \"zbv\": train.grad_accum_steps = {m} micro-batches are too few for parallel.pp = {}: the V fills with 2·pp − 1 = {} of them; raise grad_accum_steps or use \"zb-h1\"", p.pp, 2 * p.pp - 1);
            }
        }
        if p.pp_schedule.unpaired() && p.backend == CommBackend::Nccl {
            bail!("parallel.pp_schedule = \"{kind}\" with parallel.backend = \"nccl\": its messages are not yet paired for NCCL (a large NCCL send waits for its receive); use backend \"local\" or \"auto\", or pp_schedule \"1f1b\"");
        }
        let m = &self.model;
        for (key, v) in [
            ("num_attention_heads", m.num_attention_heads),
            ("intermediate_size", m.intermediate_size),
            ("vocab_size", m.vocab_size),
        ] {
            if !v.is_multiple_of(p.tp) {
                bail!("parallel.tp = {} does not divide model.{key} = {v}: tensor parallelism gives each rank whole attention heads and equal slices of the MLP and the vocabulary; choose a tp that divides all three", p.tp);
            }
        }
        let kv = m.num_key_value_heads;
        if !kv.is_multiple_of(p.tp) && !p.tp.is_multiple_of(kv) {
            bail!("parallel.tp = {} with model.num_key_value_heads = {kv}: each tp rank holds whole KV heads, or with more ranks than KV heads an equal number of ranks share each one; choose a tp that divides {kv} or is a multiple of it", p.tp);
        }
        if p.sequence_parallel {
            if p.tp == 1 {
                bail!("parallel.sequence_parallel = true with parallel.tp = 1: sequence parallelism splits the rows between the tensor-parallel layers over the tp ranks; set parallel.tp > 1 or sequence_parallel = false");
            }
            let rows = t.micro_batch_size * t.seq_len / p.cp;
            if !rows.is_multiple_of(p.tp) {
                bail!("parallel.sequence_parallel = true: a micro-batch's {rows} rows per rank (train.micro_batch_size × train.seq_len / parallel.cp) do not split into parallel.tp = {} equal parts; choose sizes whose product divides by tp", p.tp);
            }
        }
        Ok(())
    }

    /// Data-parallel buckets, ZeRO and the collectives' timeout.
    fn validate_comm(&self) -> Result<()> {
        let p = &self.parallel;
        if !(p.bucket_mb > 0.0 && p.bucket_mb <= 1e6) {
            bail!("parallel.bucket_mb = {}: it must be a positive number of MiB, at most 1e6", p.bucket_mb);
        }
        if p.zero_stage > 3 {
            bail!("parallel.zero_stage = {}: it must be 0 (replicas), 1 (optimizer state sharded), 2 (and gradients) or 3 (and weights: FSDP)", p.zero_stage);
        }
        if p.dp_shard > 0 && p.dp_shard != p.dp {
            if !p.dp.is_multiple_of(p.dp_shard) {
                bail!("parallel.dp_shard = {} does not divide parallel.dp = {}: hybrid sharding cuts the dp replicas into equal shard groups; choose a divisor of dp, or 0 (all of dp)", p.dp_shard, p.dp);
            }
            if p.zero_stage == 0 {
                bail!("parallel.dp_shard = {} with parallel.zero_stage = 0: hybrid sharding shards ZeRO's state within groups of dp_shard replicas; set zero_stage = 1, 2 or 3, or dp_shard = 0", p.dp_shard);
            }
            if p.ep > 1 {
                bail!("parallel.dp_shard = {} with parallel.ep = {}: hybrid sharding of a mixture of experts is not built (its experts are sharded over the expert-data ranks); set dp_shard = 0 or ep = 1", p.dp_shard, p.ep);
            }
        }
        if p.zero_stage > 0 && p.dp_mode == DpMode::Naive {
            bail!("parallel.dp_mode = \"naive\" with parallel.zero_stage = {}: ZeRO reduce-scatters gradients in buckets; set dp_mode = \"bucketed\" or zero_stage = 0", p.zero_stage);
        }
        // under a second every healthy collective that waits on a slower rank would time out
        if !(p.timeout_s >= 1.0 && p.timeout_s <= MAX_TIMEOUT_S) {
            bail!(
                "parallel.timeout_s = {}: it must be a number of seconds from 1 to {MAX_TIMEOUT_S} (a week)",
                p.timeout_s
            );
        }
        Ok(())
    }

    /// Where the run writes and computes: the checkpoint folder and the device.
    fn validate_places(&self) -> Result<()> {
        if self.checkpoint.dir.trim().is_empty() {
            bail!("checkpoint.dir is empty: name the folder checkpoints go to (a run also saves there when stopped by a signal)");
        }
        if self.device.kind == DeviceKind::Cuda && self.device.dtype == DeviceDtype::Fp8 {
            let (m, tp) = (&self.model, self.parallel.tp.max(1));
            let features = [
                ("model.hidden_size", m.hidden_size),
                ("model.intermediate_size / parallel.tp", m.intermediate_size / tp),
                ("model.num_attention_heads × head_dim / parallel.tp", m.num_attention_heads * m.head_dim() / tp),
                ("model.num_key_value_heads × head_dim / parallel.tp", m.kv_heads_on(tp) * m.head_dim()),
            ];
            if let Some((name, v)) = features.into_iter().find(|(_, v)| v % 16 != 0) {
                bail!("device.dtype = \"fp8\" on a GPU with {name} = {v}: cuBLASLt's FP8 GEMMs need every linear layer's features a multiple of 16; use device.dtype = \"bf16\" or other sizes");
            }
        }
        let core = self.model.core_head_dim();
        if self.device.kind == DeviceKind::Cuda && core > WIDE_HEAD_DIM {
            bail!("model.head_dim = {core}: the CUDA attention kernels take heads up to {WIDE_HEAD_DIM} values wide (latent attention's: the larger of qk_nope_head_dim + qk_rope_head_dim and v_head_dim); use device.kind = \"cpu\" or a smaller head");
        }
        Ok(())
    }
}

/// Checks the mixture of experts against the layout.
fn validate_experts(c: &Config) -> Result<()> {
    let (m, p) = (&c.model, &c.parallel);
    let e = m.num_local_experts;
    if p.ep == 0 {
        bail!("parallel.ep = 0: it must be at least 1");
    }
    if p.ep > 1 && e == 0 {
        bail!("parallel.ep = {} with model.num_local_experts = 0: expert parallelism divides the experts of a mixture of experts; set num_local_experts or ep = 1", p.ep);
    }
    if !(p.dp * p.cp).is_multiple_of(p.ep) {
        bail!("parallel.ep = {} does not divide parallel.dp × parallel.cp = {}: the expert-parallel ranks are carved out of the dp×cp ranks", p.ep, p.dp * p.cp);
    }
    if e > 0 && !e.is_multiple_of(p.ep) {
        bail!("parallel.ep = {} does not divide model.num_local_experts = {e}: each expert-parallel rank holds an equal share of the experts", p.ep);
    }
    if e > 0 && m.router_aux_loss_coef > 0.0 && (p.pp > 1 || p.cp > 1 || p.sequence_parallel) {
        bail!("model.router_aux_loss_coef > 0 with pp, cp or sequence parallelism: the balance loss counts every layer's routing over whole sequences, which those layouts hold apart; set router_aux_loss_coef = 0 or pp = cp = 1 and sequence_parallel = false");
    }
    if e > 0 && m.seq_aux_loss_coef > 0.0 && (p.pp > 1 || p.cp > 1 || p.sequence_parallel) {
        bail!("model.seq_aux_loss_coef > 0 with pp, cp or sequence parallelism: the sequence-wise balance loss counts each layer's routing over whole sequences and adds it at the output end, which those layouts hold apart; set seq_aux_loss_coef = 0 or pp = cp = 1 and sequence_parallel = false");
    }
    Ok(())
}

/// Checks `[data]` against the model, before anything is read.
fn validate_data(d: &DataConfig, m: &ModelConfig, seq_len: usize) -> Result<()> {
    if d.source.starts_with("text:") || d.source.starts_with("hub:") {
        if d.text_column.trim().is_empty() {
            bail!("data.text_column is empty: name the JSON field or parquet column that holds the text (\"text\")");
        }
        if d.tokenizer == "bytes" && m.vocab_size < 256 {
            bail!(
                "data.source = \"{}\" uses byte tokens: model.vocab_size must be at least 256 (it is {})",
                d.source,
                m.vocab_size
            );
        }
        return Ok(());
    }
    if d.source != "synthetic" {
        bail!("data.source = \"{}\": use \"synthetic\", \"text:PATH\" or \"hub:ORG/NAME/FILE\"", d.source);
    }
    if d.branching == 0 || d.branching + 2 > m.vocab_size {
        bail!(
            "data.branching = {}: it must be at least 1 and at most model.vocab_size - 2 = {}",
            d.branching,
            m.vocab_size.saturating_sub(2)
        );
    }
    if (m.vocab_size as f64 + 1.0).powf(d.markov_order as f64) > (1 << 22) as f64 {
        bail!("data.markov_order = {} with model.vocab_size = {}: the successor table would be too large; lower the order", d.markov_order, m.vocab_size);
    }
    if !(0.0..1.0).contains(&d.copy_prob) {
        bail!("data.copy_prob = {}: it must lie in [0, 1)", d.copy_prob);
    }
    if d.copy_len > seq_len {
        bail!(
            "data.copy_len = {}: a copy span cannot be longer than a sequence (train.seq_len = {seq_len})",
            d.copy_len
        );
    }
    if d.copy_prob > 0.0 && (d.copy_len == 0 || d.copy_lag == 0 || d.copy_lag >= seq_len) {
        bail!("data.copy_len and data.copy_lag must be at least 1, and data.copy_lag below train.seq_len = {seq_len}");
    }
    Ok(())
}
