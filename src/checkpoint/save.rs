//! # Checkpoints: saving a run, and resuming it exactly
//!
//! A checkpoint is a folder `dir/step_NNNNNN/`:
//!
//! ```text
//! config.json          the architecture, in Hugging Face's words
//! model.safetensors    every weight, full size, Hugging Face names (transformers loads it as is)
//! optimizer.safetensors  AdamW's moments: exp_avg.<name>, exp_avg_sq.<name>
//! trainer_state.json   the step, AdamW's step count, the run's config
//! ```
//! Tensors are saved whole, whatever the topology: every tensor goes from its placements
//! (`comm/placement.rs`) to `Replicate` (ZeRO partitions and tp slices all-gathered), the
//! pipeline stages send theirs to rank 0, which writes (with the lessons' collective calls: over
//! NCCL between GPUs, and only rank 0 copies to the host). Loading slices them again for the new
//! topology (`Llama::build`), so a checkpoint moves between layouts. Data order and the learning
//! rate depend only on the step, and there is no other randomness in a step, so a resumed run
//! repeats the uninterrupted run's losses exactly.
//!
//! Writing is atomic: files go into `step_NNNNNN.<run id>.tmp/`, are flushed to disk, and the
//! folder is renamed when complete; only then are this run's checkpoints beyond the newest `keep`
//! deleted (`folder.rs`: a run owns its folder). A run killed while saving leaves the previous
//! checkpoint as the latest complete one; no checkpoint ever holds a NaN or an infinity.
//!
//! Resuming checks before anything is built: the step is within `train.steps`, every tensor of
//! the checkpoint is finite and is one the configured model has (no more, no fewer, same
//! shapes), and the settings that change the run's curve (learning rate and schedule, global
//! batch, data) are the ones the checkpoint recorded, or the differences are named.

use crate::checkpoint::folder::{self, Folder};
use crate::checkpoint::hf::{build_from, check_tensors, expected_tensors, full_tensor, read_safetensors};
use crate::comm::launcher::Rank;
use crate::comm::placement::{redistribute, Placement};
use crate::comm::process_grid::Axis;
use crate::config::{Config, ModelConfig, RopeType};
use crate::model::moe::{self, EP};
use crate::model::optimizer::{Optimizer, StateKinds};
use crate::model::stage::Stage;
use crate::model::{Llama, Param, TensorSplit};
use crate::ops;
use crate::ops::tensor::Tensor;
use crate::ops::types::{DType, TpCut};
use crate::parallel::zero;
use crate::parallel::{layout, schedules};
use anyhow::{bail, Context, Result};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Full tensors by name: the weights and the optimizer's state (AdamW's moments).
#[derive(Default)]
pub struct State {
    pub weights: Vec<(String, Tensor)>,
    pub moments: Vec<(String, Tensor)>,
}

impl State {
    /// The weight of `name` (`kind` None), or its optimizer state `kind` (`exp_avg.<name>`), full
    /// size on the host.
    fn push(&mut self, name: &str, kind: Option<&str>, full: Tensor) {
        match kind {
            None => self.weights.push((name.to_string(), full)),
            Some(kind) => self.moments.push((format!("{kind}.{name}"), full)),
        }
    }
}

/// What `gather` collects: the weights, or with them the optimizer's state, each parameter's
/// named as the run's optimizer names it (`StateKinds`: what another pipeline stage sends).
#[derive(Clone, Copy)]
pub enum Gather {
    Weights,
    WeightsAndMoments(StateKinds),
}

/// Gathers the whole model and optimizer onto rank 0 (`Some` there, `None` elsewhere). Every rank
/// calls it; past the ZeRO partitions (all-gathered over dp×cp first), only the ranks of the first
/// dp and cp replica take part.
///
/// One tensor at a time, with the collective calls of the lessons, so on GPUs with NCCL nothing
/// but rank 0's final copy touches the host: the tp slices of a weight (or of its moments) are
/// redistributed to Replicate (an all-gather), the tp-rank 0 of every other pipeline stage sends
/// the whole to rank 0, and rank 0 takes it to the host. Everything travels in fp32: a mixed-precision weight as its master, a
/// bf16 moment converted. With expert parallelism the first replica's ep group all-gathers each
/// expert tensor (member j holds experts j·E/ep…), and a layer's experts go out in the
/// checkpoint's order once the layer's last expert is in. `Gather::Weights` leaves the moments
/// out (validation needs only the model).
pub fn gather(
    me: &Rank,
    cfg: &Config,
    model: &Llama,
    optimizer: &dyn Optimizer,
    what: Gather,
) -> Result<Option<State>> {
    // each parameter's weight, and (every parameter alike) its optimizer state by name
    let kept = optimizer.state();
    // how many of each parameter's tensors go: its weight, then its state (if asked)
    let count = |state: usize| if matches!(what, Gather::WeightsAndMoments(_)) { 1 + state } else { 1 };
    let (tp, pp, ep) = (me.group(Axis::Tp), me.group(Axis::Pp), me.group(EP));
    let first_replica = me.coords.dp == 0 && me.coords.cp == 0;
    // expert parallelism: the first replica's ep group holds every expert between its members
    let first_ep_group = me.coords.dp * cfg.parallel.cp + me.coords.cp < ep.size();
    let mut state = (first_replica && me.coords.tp == 0 && me.coords.pp == 0).then(State::default);
    let mut emit = |name: &str, kind: Option<&str>, whole: &Tensor| -> Result<()> {
        match (&mut state, me.coords.tp) {
            (Some(state), _) => state.push(name, kind, Tensor::from_vec(whole.shape(), whole.to_vec())), // to the host
            (None, 0) => pp.send_tensor(whole, 0)?,
            (None, _) => {} // tp-rank 0 of the stage speaks for it
        }
        Ok(())
    };
    // a layer's experts, gathered from the ep ranks, sent in the checkpoint's order (expert by
    // expert) once the layer's last one is in: (expert, matrix, which, its kind, name, tensor)
    type Expert = (usize, String, usize, Option<&'static str>, String, Tensor);
    type Emit<'e> = dyn FnMut(&str, Option<&str>, &Tensor) -> Result<()> + 'e;
    let mut experts: Vec<Expert> = Vec::new();
    let flush = |experts: &mut Vec<Expert>, emit: &mut Emit| {
        experts.sort_by(|a, b| (a.0, &a.1, a.2).cmp(&(b.0, &b.1, b.2)));
        experts.drain(..).try_for_each(|(_, _, _, kind, name, t)| emit(&name, kind, &t))
    };
    let copy = model.tied_copy().map(|c| c.name.clone()); // the first stage writes it
    for (p, kept) in model.params().iter().zip(&kept) {
        if copy.as_ref() == Some(&p.name) {
            continue;
        }
        let value = p.trained_values();
        let spread = moe::is_expert(&p.name) && ep.size() > 1;
        if !spread && first_replica {
            flush(&mut experts, &mut emit)?;
        }
        let tensors = std::iter::once((None, value)).chain(kept.iter().map(|(kind, t)| (Some(*kind), *t)));
        for (which, (kind, t)) in tensors.enumerate().take(count(kept.len())) {
            // under ZeRO every rank of its partition's axis holds a partition (dp×cp, or the shard group
            // under hybrid sharding; an expert's, edp)
            let axis = zero::partition_of(p).map_or_else(|| layout::replicas(p), |z| z.axis);
            let unsharded = zero::whole(me.group(axis), p, t)?;
            if !(first_replica || spread && first_ep_group) {
                continue;
            }
            let t = unsharded.as_ref().unwrap_or(t);
            // in fp32: a mixed-precision weight's master, a bf16 moment converted
            let t = &t.master_copy().unwrap_or_else(|| ops::convert(t, DType::F32));
            if spread {
                // expert k of each member: member j's is expert j·E/ep + k (the layer's experts are
                // Shard(0) on the ep axis; this gathers the k-th of each member's share)
                let shape: Vec<usize> = [ep.size()].iter().chain(t.shape()).copied().collect();
                let stacked = redistribute(Cow::Borrowed(t), &shape, Placement::Shard(0), Placement::Replicate, ep)?;
                let (e, matrix) = expert_of(&p.name);
                let per = cfg.model.num_local_experts / ep.size();
                let members = if first_replica { ep.size() } else { 0 }; // the others only took part
                for j in 0..members {
                    let name = p.name.replace(&format!("experts.{e}."), &format!("experts.{}.", j * per + e));
                    experts.push((
                        j * per + e,
                        matrix.clone(),
                        which,
                        kind,
                        name,
                        ops::slice(&stacked, j * t.numel(), t.shape()),
                    ));
                }
                continue;
            }
            let gathered = redistribute(
                Cow::Borrowed(t),
                &side_by_side(t.shape(), p.tp, tp.size()),
                p.tp.into(),
                Placement::Replicate,
                tp,
            )?;
            emit(&p.name, kind, &one_of_each(gathered, p.tp, tp.size()))?;
        }
    }
    flush(&mut experts, &mut emit)?;
    // the buffers (whole on every rank holding their layer), after the parameters
    let place = model.place();
    for (name, t) in model.buffers() {
        if first_replica {
            emit(&name, None, &Tensor::from_host_in(t.shape(), t.to_vec(), &place, DType::F32))?;
        }
    }
    let Some(mut state) = state else { return Ok(None) };
    for stage in 1..pp.size() {
        let stage = schedules::stage_of(stage, &cfg.parallel);
        for (name, shape, ..) in Llama::tensor_shapes(&cfg.model, stage) {
            let kept = match what {
                Gather::WeightsAndMoments(kinds) => kinds(&name, &shape),
                Gather::Weights => &[],
            };
            for kind in std::iter::once(None).chain(kept.iter().map(|k| Some(*k))).take(count(kept.len())) {
                let mut whole = Tensor::empty_on(&shape, &place, DType::F32); // written whole
                pp.recv_tensor_into(&mut whole, stage.index)?;
                state.push(&name, kind, Tensor::from_vec(&shape, whole.to_vec()));
            }
        }
        for (name, shape) in Llama::buffer_shapes(&cfg.model, stage) {
            let mut whole = Tensor::empty_on(&shape, &place, DType::F32); // written whole
            pp.recv_tensor_into(&mut whole, stage.index)?;
            state.push(&name, None, Tensor::from_vec(&shape, whole.to_vec()));
        }
    }
    Ok(Some(state))
}

/// (expert index, matrix name) of an expert's parameter name (`…experts.E.w1.weight`).
fn expert_of(name: &str) -> (usize, String) {
    let rest = name.split(".experts.").nth(1).unwrap_or("");
    let mut parts = rest.split('.');
    let e = parts.next().and_then(|e| e.parse().ok()).unwrap_or(0);
    (e, parts.next().unwrap_or("").to_string())
}

/// The shape of `k` tp parts `local` side by side along the dimension `cut` cuts: the `n` ranks'
/// parts gathered with k = n, the whole tensor with k = `cut.parts(n)`.
fn side_by_side(local: &[usize], cut: TpCut, k: usize) -> Vec<usize> {
    let mut whole = local.to_vec();
    if let Some(d) = cut.dim() {
        whole[d] *= k;
    }
    whole
}

/// The whole tensor from the tp ranks' parts side by side: where ranks hold copies of a slice
/// (KV heads fewer than the ranks, `TpCut::HeadRows`), the first rank's of each.
fn one_of_each(gathered: Tensor, cut: TpCut, n: usize) -> Tensor {
    let copies = cut.copies(n);
    if copies == 1 {
        return gathered;
    }
    let mut whole = gathered.shape().to_vec();
    whole[0] /= copies;
    let block = gathered.numel() / n; // one rank's part: rows of dimension 0
    let firsts: Vec<Tensor> = (0..n / copies).map(|j| ops::slice(&gathered, j * copies * block, &[block])).collect();
    ops::concat(&firsts.iter().collect::<Vec<_>>()).with_shape(&whole)
}

/// What a run on text trained on, by content, as each checkpoint records it: the fingerprint of
/// its tokens' making (every shard, the text column, the tokenizer: `Dataset::fingerprint`),
/// which a resumed run compares, and of its tokenizer alone, which `generate` compares.
#[derive(Clone)]
pub struct Trained {
    pub data: String,
    pub tokenizer: String,
}

/// Writes checkpoint `step` (steps done) into `folder`, atomically; keeps this run's newest `keep`.
/// `trained` says what text it trained on (none: the synthetic source).
pub fn save(
    folder: &Folder,
    step: usize,
    state: &State,
    cfg: &Config,
    adam_steps: u32,
    trained: Option<&Trained>,
) -> Result<PathBuf> {
    let final_dir = folder.dir.join(format!("step_{step:06}"));
    if final_dir.exists() {
        bail!("{} already exists: a checkpoint is never overwritten", final_dir.display());
    }
    // no non-finite number is ever saved: a checkpoint is a state to go back to
    if let Some((name, x)) = state
        .weights
        .iter()
        .chain(&state.moments)
        .find_map(|(n, t)| t.host_view().iter().find(|x| !x.is_finite()).map(|&x| (n, x)))
    {
        bail!(
            "step {step}: {name} holds {x}, so no checkpoint is written (the newest one kept is still good): the run diverged at this step; lower train.lr or train.weight_decay, or resume from that checkpoint"
        );
    }
    // the temporary folder is named by the run (`folder::is_half_written` recognises it)
    let tmp = folder.dir.join(format!("step_{step:06}.{}.tmp", folder.run_id));
    let _ = std::fs::remove_dir_all(&tmp); // a previous attempt of this run that failed
    let written = (|| -> Result<()> {
        std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create checkpoint folder {}", tmp.display()))?;
        write_file(&tmp.join("config.json"), hf_config(&cfg.model).as_bytes())?;
        write_file(&tmp.join("model.safetensors"), &safetensors_bytes(&state.weights)?)?;
        write_file(&tmp.join("optimizer.safetensors"), &safetensors_bytes(&state.moments)?)?;
        let meta = serde_json::json!({
            "step": step,
            "adam_steps": adam_steps,
            "run_id": folder.run_id,
            "data_fingerprint": trained.map(|t| &t.data),
            "tokenizer_fingerprint": trained.map(|t| &t.tokenizer),
            "config": toml::to_string(cfg).context("the config does not serialise")?,
        });
        write_file(&tmp.join("trainer_state.json"), serde_json::to_string_pretty(&meta)?.as_bytes())?;
        std::fs::rename(&tmp, &final_dir).with_context(|| format!("cannot rename {} into place", tmp.display()))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp); // a full disk leaves nothing half-written behind
        return Err(e);
    }
    crate::files::sync_folder(&folder.dir); // the rename itself reaches the disk
    folder.prune(cfg.checkpoint.keep)?;
    Ok(final_dir)
}

/// A config value as the config file writes it (`adamw`, `muon`).
fn toml_word<T: serde::Serialize>(v: &T) -> String {
    toml::Value::try_from(v).map_or_else(|_| "?".into(), |v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
}

/// Whether `f` is a fingerprint as `files::Fingerprint::hex` writes one.
fn is_fingerprint(f: &str) -> bool {
    f.len() == 32 && f.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// A value read from a file, for a message: at most 80 characters of it.
fn shown(v: &serde_json::Value) -> String {
    let all = v.to_string();
    match all.chars().count() > 80 {
        true => format!("{}… ({} characters)", all.chars().take(80).collect::<String>(), all.chars().count()),
        false => all,
    }
}

/// The `tokenizer_fingerprint` of a checkpoint's `trainer_state.json` (`meta`, at `path`): the
/// fingerprint of the tokenizer its run trained with, `bytes`, or none (the synthetic source, or
/// a checkpoint written before it was recorded); anything else is damage.
pub fn tokenizer_fingerprint(meta: &serde_json::Value, path: &Path) -> Result<Option<String>> {
    match meta.get("tokenizer_fingerprint") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => match v.as_str().filter(|f| *f == "bytes" || is_fingerprint(f)) {
            Some(f) => Ok(Some(f.to_string())),
            None => bail!("{}: \"tokenizer_fingerprint\" is {}, not one ferrotron makes (32 hex digits, or bytes): the file is damaged", path.display(), shown(v)),
        },
    }
}

/// A checkpoint read back, ready to be checked and sliced for this rank.
pub struct Resumed {
    pub step: usize,
    pub adam_steps: u32,
    /// The run the checkpoint belongs to; the resumed run carries it on.
    pub run_id: String,
    /// The config the checkpoint's run trained with.
    recorded: Config,
    /// The fingerprint of the text it trained on (`None` inside: the synthetic source); `None`
    /// where the checkpoint was written before ferrotron recorded it.
    recorded_data: Option<Option<String>>,
    weights: HashMap<String, Tensor>,
    moments: HashMap<String, Tensor>,
}

pub fn load(dir: &Path) -> Result<Resumed> {
    let meta_path = dir.join("trainer_state.json");
    let text = crate::files::read_text(&meta_path, "trainer_state.json")
        .with_context(|| format!("{}: not a ferrotron checkpoint folder", dir.display()))?;
    let meta: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", meta_path.display()))?;
    let whole = |key: &str, max: u64| {
        let v = &meta[key];
        v.as_u64().filter(|&n| n <= max).with_context(|| {
            format!("{}: \"{key}\" is {v}, not a whole number up to {max}: the file is damaged", meta_path.display())
        })
    };
    let (step, adam_steps) = (whole("step", u64::MAX)? as usize, whole("adam_steps", u32::MAX as u64)? as u32);
    // one optimizer update a step, none skipped: a count apart from the step would resume the
    // optimizer's bias corrections (and Muon's) onto another curve
    if adam_steps as usize != step {
        bail!("{}: \"adam_steps\" is {adam_steps} but \"step\" is {step}; a run makes one optimizer update a step, so the file is damaged or was edited: resume from another checkpoint", meta_path.display());
    }
    let Some(run_id) = meta["run_id"].as_str().map(str::to_string) else {
        bail!("{}: no run_id (written by an older ferrotron): start a new run", meta_path.display());
    };
    // it names the folders this run saves into: only the form a run makes
    if !folder::is_run_id(&run_id) {
        bail!("{}: \"run_id\" is {:?}, not a run id ferrotron makes (two hex numbers joined by -): the file is damaged or was edited; start a new run", meta_path.display(), run_id.chars().take(80).collect::<String>());
    }
    let recorded: Config = meta["config"]
        .as_str()
        .and_then(Config::from_recorded)
        .with_context(|| format!("{}: its \"config\" is missing or unreadable", meta_path.display()))?;
    let recorded_data = match meta.get("data_fingerprint") {
        None => None,
        Some(serde_json::Value::Null) => Some(None),
        Some(v) => match v.as_str().filter(|f| is_fingerprint(f)) {
            Some(f) => Some(Some(f.to_string())),
            None => bail!("{}: \"data_fingerprint\" is {}, not a fingerprint ferrotron makes (32 hex digits, or null for the synthetic source): the file is damaged", meta_path.display(), shown(v)),
        },
    };
    tokenizer_fingerprint(&meta, &meta_path)?; // checked here, compared by generate
    let weights = read_safetensors(&dir.join("model.safetensors"))?;
    let moments = read_safetensors(&dir.join("optimizer.safetensors"))?;
    Ok(Resumed { step, adam_steps, run_id, recorded, recorded_data, weights, moments })
}

impl Resumed {
    /// Checks the checkpoint against the configured run before anything is built; returns notes
    /// to print. `allow_changes` turns differences in the run's settings into notes.
    /// `kinds` names each tensor's optimizer state (the run's optimizer's `StateKinds`).
    pub fn check(&self, cfg: &Config, dir: &Path, allow_changes: bool, kinds: StateKinds) -> Result<Vec<String>> {
        let t = &cfg.train;
        if self.step > t.steps {
            bail!(
                "{} is at step {}, past train.steps = {}: raise train.steps to continue from it (--set train.steps=N)",
                dir.display(),
                self.step,
                t.steps
            );
        }
        // another optimizer keeps other state: said in the run's words before any tensor is missed
        if self.recorded.train.optimizer != t.optimizer {
            bail!(
                "{} was trained with train.optimizer = {}, and this run sets {}: its optimizer state does not carry over to another optimizer; set train.optimizer back (or start from its weights alone with model.init_from)",
                dir.display(),
                toml_word(&self.recorded.train.optimizer),
                toml_word(&t.optimizer)
            );
        }
        let expected = Llama::tensor_shapes(&cfg.model, Stage::WHOLE);
        check_tensors(&self.weights, &expected_tensors(&cfg.model), &dir.join("model.safetensors"), &cfg.model)?;
        let moments: Vec<(String, Vec<usize>)> = (expected.iter())
            .flat_map(|(n, s)| kinds(n, s).iter().map(move |kind| (format!("{kind}.{n}"), s.clone())))
            .collect();
        check_tensors(&self.moments, &moments, &dir.join("optimizer.safetensors"), &cfg.model)?;
        // AdamW's second moments are running means of squares: one below zero is damage (its
        // square root would turn the update into NaN, steps later, blamed on the learning rate)
        let mut second = self.moments.iter().filter(|(n, _)| n.starts_with("exp_avg_sq."));
        if let Some((name, x)) = second.find_map(|(n, t)| t.host_view().iter().find(|x| **x < 0.0).map(|&x| (n, x))) {
            bail!("{}: {name} holds {x}, but a second moment is a mean of squares, never below zero: the file is damaged; resume from another checkpoint", dir.join("optimizer.safetensors").display());
        }
        let differences = run_differences(&self.recorded, cfg);
        let mut notes = Vec::new();
        if !differences.is_empty() && !allow_changes {
            bail!("resuming {} with settings that change the run: {}; set them back (--set), or add --allow-changes to continue with the new values", dir.display(), differences.join(", "));
        }
        if !differences.is_empty() {
            notes.push(format!("continuing with changed settings: {}", differences.join(", ")));
        }
        if self.recorded.train.steps != t.steps {
            notes.push(format!(
                "train.steps = {} (the checkpoint's run had {}): the learning-rate decay is stretched to the new end",
                t.steps, self.recorded.train.steps
            ));
        }
        Ok(notes)
    }

    /// Checks that the text the run trains on is, by content, the text the checkpoint's run
    /// trained on (`data` its fingerprint now): a file of `data.source` rewritten under the same
    /// path would otherwise go unnoticed. Returns notes; `allow_changes` turns a change into one.
    pub fn check_data(&self, data: Option<&str>, dir: &Path, allow_changes: bool) -> Result<Vec<String>> {
        let then = match &self.recorded_data {
            None => {
                return Ok(vec![format!(
                    "{} predates data fingerprints: whether data.source's files changed since could not be checked",
                    dir.display()
                )])
            }
            Some(then) => then.as_deref(),
        };
        // recorded with the run's config: text leaves a fingerprint, the synthetic source none
        let on_text = self.recorded.data.source != "synthetic";
        if on_text != then.is_some() {
            bail!(
                "{}: its run trained on {}, but its trainer_state.json records {}: the file is damaged or was edited; resume from another checkpoint",
                dir.display(),
                self.recorded.data.source,
                if on_text { "no data fingerprint (null)" } else { "a data fingerprint" }
            );
        }
        match (then, data) {
            (Some(then), Some(now)) if then != now && !allow_changes => bail!(
                "resuming {}: the files of data.source (or data.tokenizer) changed since the checkpoint was written (content fingerprint {now}, checkpoint: {then}); put the old files back, or add --allow-changes to continue on the new text",
                dir.display()
            ),
            (Some(then), Some(now)) if then != now => {
                Ok(vec![format!("continuing on changed data: the files of data.source differ from the checkpoint's (fingerprint {now}, checkpoint: {then})")])
            }
            _ => Ok(Vec::new()), // the same text, or another source (named with the settings)
        }
    }

    /// Where this checkpoint stands, for the processes of a run to compare: its run and step.
    pub fn point(&self) -> String {
        format!("step {} of run {}", self.step, self.run_id)
    }

    /// This rank's model: the checkpoint's tensors, sliced for `tp` and `stage`.
    pub fn model<'g>(&self, cfg: &ModelConfig, tp: Box<dyn TensorSplit + 'g>, stage: Stage) -> Result<Llama<'g>> {
        build_from(&self.weights, cfg, tp, stage, "model.safetensors")
    }

    /// The optimizer's state for `params` (this rank's slices) from the checkpoint, into host
    /// memory, and its step count.
    pub fn load_optimizer(
        &self,
        o: &mut dyn Optimizer,
        params: &[&Param],
        (index, count): (usize, usize),
    ) -> Result<()> {
        let kinds: Vec<Vec<&str>> = o.state().iter().map(|s| s.iter().map(|(kind, _)| *kind).collect()).collect();
        for ((p, kinds), tensors) in params.iter().zip(kinds).zip(o.state_mut()) {
            let full_shape = side_by_side(p.value.shape(), p.tp, p.tp.parts(count));
            for (kind, t) in kinds.iter().zip(tensors) {
                let full =
                    full_tensor(&self.moments, &format!("{kind}.{}", p.name), &full_shape, "optimizer.safetensors")?;
                *t = ops::tp_part(&full, p.tp, (index, count)); // this tp rank's
            }
        }
        o.resume_at(self.adam_steps);
        Ok(())
    }
}

/// The architecture as a Hugging Face `config.json`.
pub fn hf_config(m: &ModelConfig) -> String {
    let mut j = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim(),
        "rope_theta": m.rope_theta,
        "rms_norm_eps": shortest(m.rms_norm_eps),
        "tie_word_embeddings": m.tie_word_embeddings,
        "initializer_range": shortest(m.initializer_range),
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    });
    if m.num_local_experts > 0 && m.moe_intermediate_size == 0 {
        // a Mixtral: its experts replace the MLP; the balance loss counts when training asks
        // for the router logits
        let moe = serde_json::json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": m.num_local_experts,
            "num_experts_per_tok": m.num_experts_per_tok,
            "router_aux_loss_coef": shortest(m.router_aux_loss_coef),
            "output_router_logits": m.router_aux_loss_coef > 0.0,
            "router_jitter_noise": 0.0,
            "sliding_window": null,
        });
        if let (Some(all), Some(more)) = (j.as_object_mut(), moe.as_object()) {
            all.extend(more.clone());
            all.remove("mlp_bias");
        }
    }
    if m.kv_lora_rank > 0 {
        // a DeepSeek-V3: latent attention, and DeepSeekMoE's experts (or every MLP dense)
        let moe = m.moe_intermediate_size > 0;
        let mla = serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "kv_lora_rank": m.kv_lora_rank,
            "q_lora_rank": (m.q_lora_rank > 0).then_some(m.q_lora_rank),
            "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim,
            "qk_head_dim": m.qk_nope_head_dim + m.qk_rope_head_dim,
            "head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim,
            "rope_interleave": m.rope_interleave,
            "first_k_dense_replace": if moe { m.first_k_dense_replace } else { m.num_hidden_layers },
            "n_routed_experts": m.num_local_experts,
            "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_intermediate_size,
            "n_shared_experts": m.n_shared_experts,
            "n_group": m.n_group,
            "topk_group": m.topk_group,
            "norm_topk_prob": m.norm_topk_prob,
            "routed_scaling_factor": shortest(m.routed_scaling_factor),
            "num_nextn_predict_layers": 0,
        });
        if let (Some(all), Some(more)) = (j.as_object_mut(), mla.as_object()) {
            all.extend(more.clone());
            all.remove("mlp_bias");
        }
    }
    if let Some((all, (scaling, trained))) = j.as_object_mut().zip(rope_scaling(m)) {
        all.insert("rope_scaling".into(), scaling);
        if trained > 0 {
            all.insert(
                "max_position_embeddings".into(),
                ((m.rope_scaling.factor * trained as f64).round() as u64).into(),
            );
        }
    }
    serde_json::to_string_pretty(&j).expect("JSON")
}

/// RoPE's rescaling as transformers reads it (`rope_scaling`, with the keys its kind reads), and
/// the context trained on (0: not a key of the kind); `None` for plain RoPE.
fn rope_scaling(m: &ModelConfig) -> Option<(serde_json::Value, usize)> {
    let s = &m.rope_scaling;
    let kind = toml::Value::try_from(s.rope_type).ok()?.as_str()?.to_string();
    if s.rope_type == RopeType::Default {
        return None;
    }
    let mut j = serde_json::json!({ "rope_type": kind, "rope_theta": m.rope_theta, "factor": s.factor });
    let trained = match s.rope_type {
        RopeType::Yarn | RopeType::Llama3 => s.original_max_position_embeddings,
        _ => 0,
    };
    let extra = match s.rope_type {
        RopeType::Yarn => serde_json::json!({
            "original_max_position_embeddings": trained,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "truncate": s.truncate,
            "attention_factor": (s.attention_factor > 0.0).then_some(s.attention_factor),
            "mscale": (s.mscale != 0.0).then_some(s.mscale),
        }),
        RopeType::Llama3 => serde_json::json!({
            "original_max_position_embeddings": trained,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
        }),
        _ => serde_json::json!({}),
    };
    let all = j.as_object_mut()?;
    all.extend(extra.as_object()?.clone());
    if s.mscale_all_dim != 0.0 {
        all.insert("mscale_all_dim".into(), s.mscale_all_dim.into()); // DeepSeek's softmax factor
    }
    all.retain(|_, v| !v.is_null());
    Some((j, trained))
}

/// The shortest decimal that reads back as the same f32 (1e-5, not the f64 widening
/// 9.999999747378752e-6), as transformers writes it.
fn shortest(x: f32) -> f64 {
    x.to_string().parse().expect("an f32 prints as a decimal")
}

fn safetensors_bytes(tensors: &[(String, Tensor)]) -> Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shape().to_vec(), t.host_view().iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, shape, b)| {
            Ok((n.as_str(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| anyhow::anyhow!("cannot build safetensors views: {e:?}"))?;
    safetensors::tensor::serialize(views, &None).map_err(|e| anyhow::anyhow!("cannot serialise safetensors: {e:?}"))
}

/// Writes and flushes to disk.
fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).with_context(|| format!("cannot write {}", path.display()))
}

/// The settings that shape the loss curve and differ between `then` and `now`, named with both
/// values. The layout (tp, pp, cp, how the global batch is cut), the device and the checkpointing
/// may change: a checkpoint moves between them.
fn run_differences(then: &Config, now: &Config) -> Vec<String> {
    // what the curve does not depend on, or what is compared as the global batch
    const SAME_CURVE: [&str; 8] = [
        "model.init_from",
        "model.initializer_range",
        "train.steps",
        "train.seed",
        "train.micro_batch_size",
        "train.grad_accum_steps",
        "train.recompute",
        "data.cache_dir",
    ];
    let settings = |c: &Config| {
        let mut keys = c.settings();
        keys.retain(|k, _| {
            ["model.", "train.", "data."].iter().any(|s| k.starts_with(s)) && !SAME_CURVE.contains(&k.as_str())
        });
        let global = c.train.micro_batch_size * c.train.grad_accum_steps * c.parallel.dp;
        keys.insert("the global batch (micro_batch_size × grad_accum_steps × dp)".into(), global.to_string());
        keys
    };
    let (then, now) = (settings(then), settings(now));
    crate::config::differing(&now, &then)
        .into_iter()
        .map(|(k, now, then)| format!("{k} = {now} (checkpoint: {then})"))
        .collect()
}
