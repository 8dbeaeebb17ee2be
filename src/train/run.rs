//! # The bookkeeping around the training loop
//!
//! What the loop (`train/driver.rs`) keeps out of its way: starting a run (the grid, the data,
//! where the weights come from, the printout), each rank's starting weights and resumed optimizer
//! state (which lessons' parts they go into is `train/compose.rs`'s), checkpoints, and the
//! summary a run returns. Watching each step (metrics, trace spans, timing, memory,
//! communication) is `train/watch.rs`.

use crate::checkpoint::folder::{self, Folder};
use crate::checkpoint::hf;
use crate::checkpoint::save::{self, Resumed};
use crate::comm::cost::{self, AxisTally, Link};
use crate::comm::launcher::{Rank, Setup};
use crate::comm::process_grid::{Axis, Grid};
use crate::comm::trace::Trace;
use crate::comm::Group;
use crate::config::{Config, DeviceKind, OptimizerKind};
use crate::data::Dataset;
use crate::model::moe::EP;
use crate::model::optimizer::{Optimizer, StateKinds};
use crate::model::routing_tape::TapeMode;
use crate::model::stage::Stage;
use crate::model::{init, Llama, TensorSplit};
use crate::ops::precision::Precision;
use crate::ops::tensor::Tensor;
use crate::parallel::layout;
use crate::train::memory::{self, Held};
use anyhow::{Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What a run prints and records besides training.
#[derive(Clone, Copy, Default)]
pub struct Options<'a> {
    /// One JSON object per step (written by rank 0).
    pub metrics: Option<&'a Path>,
    /// Collects every rank's compute spans (forward, backward, optimizer) and every collective
    /// and message of its groups (tp, cp, pp, dp) on its comm lane.
    pub trace: Option<&'a Trace>,
    /// No header, no progress.
    pub quiet: bool,
    /// Continue from this checkpoint folder (or `latest` in `checkpoint.dir`).
    pub resume: Option<&'a Path>,
    /// Time every GPU kernel from this step on (`cuda/profile.rs`; `bench --profile`).
    pub profile_from_step: Option<usize>,
    /// Resume even where the run's settings (lr, schedule, batch, data) differ from the
    /// checkpoint's; they are named either way.
    pub allow_changes: bool,
    /// Stop after the step in which SIGINT or SIGTERM arrived, with a checkpoint (`train/stop.rs`;
    /// the handler is the binary's to install).
    pub stop_on_signal: bool,
    /// Print what every axis's communication cost per step, next to the α–β model's time on
    /// this link (`comm/cost.rs`).
    pub comm_report: Option<Link>,
    /// Run every rank in this process even when it is one of several a launcher started
    /// (`converge`'s one-rank baseline, which each process computes for itself).
    pub one_process: bool,
    /// Move every initial weight by one unit in the last place of the compute dtype
    /// (`model::init::nudge`): `converge`'s harmless change, the size of one rounding.
    pub nudge_weights: bool,
    /// Record every MoE layer's routing, or replay a recorded one (`model/routing_tape.rs`).
    pub routing_tape: Option<TapeMode<'a>>,
}

/// How a run that a signal stopped ended.
#[derive(Clone, Debug)]
pub struct Stopped {
    pub signal: i32,
    /// The checkpoint written after the last step, to resume from (`None` in the processes that
    /// did not write it: every process of the run stops, and exits, alike).
    pub checkpoint: Option<PathBuf>,
    /// Within a step: the micro-batches it had done, whose gradients were dropped.
    pub dropped: Option<usize>,
}

/// One rank's view of a finished run.
pub struct Summary {
    /// The step the run started at: 0, or the resumed checkpoint's.
    pub first_step: usize,
    /// The loss of every step trained, averaged over the global batch.
    pub losses: Vec<f32>,
    /// (step, loss on held-out data) after each validation (rank 0; `validation.every`).
    pub val_losses: Vec<(usize, f32)>,
    /// The global gradient norm of every step (before clipping).
    pub grad_norms: Vec<f64>,
    /// A mixture of experts: the rows this rank routed to each expert over the run, summed
    /// over its MoE layers.
    pub expert_tokens: Vec<usize>,
    pub floor: Option<f64>,
    pub wall_s: f64,
    /// A hash of the bits of every weight: replicas that agree have equal checksums.
    pub checksum: u64,
    /// The most micro-batch activations this rank held at once.
    pub peak_activations: usize,
    /// Attention score entries this rank computed per step (the context-parallel balance).
    pub attention_work: u64,
    /// The wall time of every step, in seconds.
    pub step_s: Vec<f64>,
    /// On a GPU: the most memory this rank's tensors held in any step, in MiB.
    pub gpu_peak_mib: Option<f64>,
    /// Model FLOPs utilisation over the run's steps (rank 0, where the devices' peak is known).
    pub mfu: Option<f64>,
    /// The most bytes this rank's tensors held at once in any step (GPU pool or CPU meter).
    pub peak_bytes: usize,
    /// What the model and optimizer held when the last step's gradients were complete.
    pub held: Held,
    /// This rank's communication over the run's steps, per axis and kind of call.
    pub comm: Vec<AxisTally>,
    /// Set when a signal stopped the run early (rank 0's summary says where it saved).
    pub stopped: Option<Stopped>,
    /// Replaying a routing tape: (rows whose recorded experts replaced this run's own choice,
    /// rows replayed), over the run's steps and MoE layers.
    pub routing_replaced: Option<(usize, usize)>,
}

impl Summary {
    pub(super) fn new(first_step: usize) -> Summary {
        Summary {
            first_step,
            losses: Vec::new(),
            val_losses: Vec::new(),
            grad_norms: Vec::new(),
            expert_tokens: Vec::new(),
            floor: None,
            wall_s: 0.0,
            checksum: 0,
            peak_activations: 0,
            attention_work: 0,
            step_s: Vec::new(),
            gpu_peak_mib: None,
            mfu: None,
            peak_bytes: 0,
            held: Held::default(),
            comm: Vec::new(),
            stopped: None,
            routing_replaced: None,
        }
    }

    /// Mean loss of the last tenth of the run (at least one step): less noisy than the last
    /// step. NaN when no step was trained.
    pub fn final_loss(&self) -> f32 {
        if self.losses.is_empty() {
            return f32::NAN;
        }
        let n = self.losses.len().div_ceil(10).max(1);
        self.losses[self.losses.len() - n..].iter().sum::<f32>() / n as f32
    }
}

/// A run being started: its grid and devices, its data, where its weights come from, and the
/// folder its checkpoints go to.
pub(super) struct Run {
    pub grid: Grid,
    pub setup: Setup,
    pub data: Dataset,
    floor: Option<f64>,
    resumed: Option<Resumed>,
    pretrained: Option<HashMap<String, Tensor>>,
    checkpoints: Checkpoints,
    /// The checkpoint is at `train.steps` already: nothing to train.
    pub finished: bool,
    nudge: bool,
    /// The CPU's peak TFLOP/s for MFU, where a CPU run shows it (`devices.rs`).
    cpu_peak: Option<f64>,
}

impl Run {
    /// Checks the layout, the memory the ranks will need, the checkpoint or pretrained weights
    /// and every output before anything big is built; opens the data; prints what will run.
    /// `kinds`: the state the run's optimizer keeps per parameter (what its checkpoints hold).
    pub(super) fn prepare(cfg: &Config, opts: Options, kinds: StateKinds) -> Result<Run> {
        let (t, p) = (&cfg.train, &cfg.parallel);
        let grid = layout::grid_of(p)?;
        let setup = Setup::from_config(cfg, !opts.one_process)?;
        let full_weights = memory::weights_per_rank(&cfg.model, 1, 1) * 4.0;
        let loaded = match (opts.resume, cfg.model.init_from.is_empty()) {
            (Some(_), _) => 3.0 * full_weights, // weights and two AdamW moments, whole, in f32
            (None, false) => full_weights,
            (None, true) => 0.0,
        };
        let need = memory::check(cfg, &setup.capacity, loaded)?; // before anything is allocated
        if let Some(path) = opts.metrics {
            crate::files::check_writable(path).context("--metrics")?;
        }
        let (resumed, mut notes) = match opts.resume {
            Some(arg) => {
                let dir = folder::resolve(arg, cfg)?;
                let latest = arg.as_os_str() == "latest";
                let r = save::load(&dir).map_err(|e| match latest {
                    true => folder::name_newest_good(&dir, e, |older| save::load(older).is_ok()),
                    false => e,
                })?;
                let mut notes = r.check(cfg, &dir, opts.allow_changes, kinds)?;
                if !cfg.model.init_from.is_empty() {
                    notes.push(format!(
                        "model.init_from = {} is not read: the weights come from the checkpoint resumed",
                        cfg.model.init_from
                    ));
                }
                (Some((r, dir)), notes)
            }
            None => (None, Vec::new()),
        };
        let run_id = resumed.as_ref().map_or_else(folder::new_run_id, |(r, _)| r.run_id.clone());
        let resumed_step = resumed.as_ref().map(|(r, _)| r.step);
        let finished = resumed_step == Some(t.steps);
        let mut checkpoints = Checkpoints {
            folder: Mutex::new(None),
            dir: cfg.checkpoint.dir.clone().into(),
            run_id,
            resumed_step,
            trained: None, // known once the data is open, below
            signal_saves: true,
            kinds,
        };
        let writes = setup.spread.then(crate::comm::wires::processes::leads).unwrap_or(true); // rank 0 is here
        if cfg.checkpoint.every > 0 && !finished && writes {
            checkpoints.take()?; // this run owns checkpoint.dir from now on
        } else if opts.stop_on_signal && !finished && writes {
            checkpoints.check_signal_save(opts.quiet); // a signal's save must not fail after hours of training
        }
        let mut data = Dataset::open(&cfg.data, &cfg.model)?;
        if cfg.validation.every > 0 {
            data.hold_out(cfg.validation.split, cfg.train.seq_len + 1)?; // a text's tail: never trained on
        }
        checkpoints.trained = (data.fingerprint().zip(data.tokenizer()))
            .map(|(d, t)| save::Trained { data: d.to_string(), tokenizer: t.fingerprint().to_string() });
        if let Some((r, dir)) = &resumed {
            notes.extend(r.check_data(data.fingerprint(), dir, opts.allow_changes)?);
        }
        let floor = data.entropy_floor(t.seq_len);
        if !opts.quiet {
            crate::say!(
                "model: {:.2}M parameters | global batch {} × {} × {} dp × {} tokens | {} steps on {} in {} ({} rank{})",
                cfg.model.parameter_count() / 1e6,
                t.micro_batch_size,
                t.grad_accum_steps,
                p.dp,
                t.seq_len,
                t.steps,
                format!("{:?}", cfg.device.kind).to_lowercase(),
                match (cfg.device.kind, cfg.device.gemms()) {
                    // the CPU rounds to the format and computes in f32: the numbers, not the speed
                    (DeviceKind::Cpu, p) if p != Precision::F32 => format!("{}, emulated on the CPU", p.name()),
                    (_, p) => p.name().to_string(),
                },
                grid.world_size(),
                if grid.world_size() == 1 { "" } else { "s" },
            );
            let gib = |b: f64| b / (1u64 << 30) as f64;
            crate::say!(
                "memory: about {:.2} GiB of the {:.2} GiB {}",
                gib(need),
                gib(setup.capacity.bytes),
                setup.capacity.what
            );
            match (floor, data.train_tokens()) {
                (Some(f), _) => crate::say!("data: {} | entropy floor {f:.4} nats/token", cfg.data.source),
                (None, Some(n)) => {
                    // windows drawn at random places: on average each token is read this often
                    let read = (t.steps * t.micro_batch_size * t.grad_accum_steps * p.dp * t.seq_len) as f64;
                    crate::say!(
                        "data: {} | {n} tokens to train on; {} steps read about {:.1} times that | entropy floor unknown",
                        cfg.data.source,
                        t.steps,
                        read / n.max(1) as f64
                    )
                }
                (None, None) => crate::say!("data: {} | entropy floor unknown", cfg.data.source),
            }
            if let Some((r, dir)) = &resumed {
                crate::say!("resuming from {} (step {} of {})", dir.display(), r.step, t.steps);
            }
            notes.iter().for_each(|n| crate::say!("note: {n}"));
            // a validation far longer than a step runs silently between two progress lines
            let v = &cfg.validation;
            if v.every > 0 && v.batches > LONG_VALIDATION * t.grad_accum_steps {
                crate::say!(
                    "note: validation.batches = {}: each validation ({} steps apart) runs the forward of about {} training steps, with no progress line of its own (a signal ends it at its next micro-batch)",
                    v.batches,
                    v.every,
                    v.batches / t.grad_accum_steps
                );
            }
        }
        let pretrained = match cfg.model.init_from.is_empty() || resumed.is_some() {
            true => None,
            false => Some(hf::pretrained(&cfg.model)?),
        };
        let resumed = resumed.map(|(r, _)| r);
        // the CPU's peak for MFU: recorded, or measured now (once a machine), before any rank
        // computes beside the measurement; only where a progress line will show it
        let shows_mfu = !opts.quiet && writes && cfg.device.kind == DeviceKind::Cpu;
        let measure = || crate::devices::cpu_peak_tflops(&cfg.data.cache_dir, crate::ops::cpu_math::peak_tflops).ok();
        let cpu_peak = shows_mfu.then(measure).flatten();
        let nudge = opts.nudge_weights;
        Ok(Run { grid, setup, data, floor, resumed, pretrained, checkpoints, finished, nudge, cpu_peak })
    }

    pub(super) fn shared(&self) -> Shared<'_> {
        let (resumed, pretrained) = (self.resumed.as_ref(), self.pretrained.as_ref());
        let (nudge, spread, cpu_peak) = (self.nudge, self.setup.spread, self.cpu_peak);
        Shared { resumed, pretrained, checkpoints: &self.checkpoints, nudge, spread, cpu_peak }
    }

    /// The summary of a run that had nothing left to train.
    pub(super) fn nothing_to_train(&self, cfg: &Config) -> Vec<Summary> {
        vec![Summary::new(cfg.train.steps)]
    }

    /// The ranks' summaries, with the data's floor; prints the cp balance.
    pub(super) fn finish(&self, cfg: &Config, opts: Options, mut summaries: Vec<Summary>) -> Vec<Summary> {
        summaries.iter_mut().for_each(|s| s.floor = self.floor);
        if let Some(link) = opts.comm_report {
            let steps = summaries[0].losses.len();
            let ranks: Vec<Vec<AxisTally>> = summaries.iter().map(|s| s.comm.clone()).collect();
            crate::say!("{}", cost::report(&ranks, steps, link).trim_end());
            let exchanged = ranks.iter().flatten().any(|t| t.call == cost::Call::AllToAll && t.axis != EP.name);
            if cfg.train.optimizer == OptimizerKind::Muon && exchanged {
                // who made the calls: the report counts by axis and kind only
                crate::say!("(all_to_all off the ep axis: Muon's owners gathering each matrix and sending its pieces back, step 23)");
            }
        }
        if cfg.parallel.cp > 1 && !opts.quiet {
            let work: Vec<String> =
                summaries.iter().map(|s| format!("{:.2}M", s.attention_work as f64 / 1e6)).collect();
            crate::say!(
                "attention work per rank and step ({:?} split, score entries): {}",
                cfg.parallel.cp_split,
                work.join(" ")
            );
        }
        summaries
    }
}

/// The run's checkpoint folder: taken at the start when the run saves every few steps, or when a
/// signal first asks for a checkpoint.
/// A validation of more than this many steps' micro-batches is said before the run starts.
const LONG_VALIDATION: usize = 100;

pub(super) struct Checkpoints {
    folder: Mutex<Option<Folder>>,
    /// `checkpoint.dir`, or where a signal's save goes when that folder would refuse it.
    dir: PathBuf,
    run_id: String,
    resumed_step: Option<usize>,
    /// What text the run trains on, by content, recorded in each checkpoint.
    trained: Option<save::Trained>,
    /// False when no folder could take a signal's save (said at the start): the run then stops
    /// without one.
    signal_saves: bool,
    /// The state the run's optimizer keeps per parameter.
    kinds: StateKinds,
}

impl Checkpoints {
    /// The run's id: its checkpoints' folders and its metrics lines carry it.
    pub(super) fn run_id(&self) -> &str {
        &self.run_id
    }

    fn take(&self) -> Result<()> {
        let mut folder = self.folder.lock().unwrap_or_else(|e| e.into_inner());
        if folder.is_none() {
            *folder = Some(Folder::take(&self.dir, &self.run_id, self.resumed_step)?);
        }
        Ok(())
    }

    /// For a run that saves only when a signal comes: if `checkpoint.dir` would refuse that save
    /// (another run's checkpoints, in use, not writable), says so now and saves beside it instead,
    /// in `DIR-<run id>`; if that cannot work either, says that a signal will not save.
    fn check_signal_save(&mut self, quiet: bool) {
        let Err(e) = Folder::check(&self.dir, &self.run_id, self.resumed_step) else { return };
        let mut beside = self.dir.clone().into_os_string();
        beside.push(format!("-{}", self.run_id));
        let beside = PathBuf::from(beside);
        let usable = Folder::check(&beside, &self.run_id, self.resumed_step);
        if !quiet {
            match &usable {
                Ok(()) => crate::say!("note: {e:#}; a signal would save into {} instead", beside.display()),
                Err(e2) => crate::say!(
                    "note: {e:#}; neither can {} ({e2:#}): a signal will stop the run without saving",
                    beside.display()
                ),
            }
        }
        match usable {
            Ok(()) => self.dir = beside,
            Err(_) => self.signal_saves = false,
        }
    }

    /// Saves the model and optimizer after `step` (0-based) when `checkpoint.every` says so, after
    /// the last step, or when `now`; every rank calls it, rank 0 writes (while the others' waits
    /// do not time out). Returns where it wrote, on rank 0 (`None` there: nothing could be saved).
    pub(super) fn save_if_due(
        &self,
        me: &Rank,
        cfg: &Config,
        step: usize,
        (model, opt): (&Llama, &dyn Optimizer),
        now: bool,
    ) -> Result<Option<PathBuf>> {
        let (every, last) = (cfg.checkpoint.every, step + 1 == cfg.train.steps);
        if !(now || every > 0 && ((step + 1).is_multiple_of(every) || last)) {
            return Ok(None);
        }
        let Some(state) = save::gather(me, cfg, model, opt, save::Gather::WeightsAndMoments(self.kinds))? else {
            return Ok(None);
        };
        me.group(Axis::World).while_others_wait(|| {
            if !self.signal_saves {
                return Ok(None); // no folder could take it, as the run said at its start
            }
            self.take()?;
            let folder = self.folder.lock().unwrap_or_else(|e| e.into_inner());
            let folder = folder.as_ref().expect("taken above");
            save::save(folder, step + 1, &state, cfg, opt.steps_taken(), self.trained.as_ref()).map(Some)
        })
    }

    /// After a signal dropped step `step` (0-based) part-way: the checkpoint of the steps before
    /// it, saved now unless that step's end saved it already. `None` where this process does not
    /// write checkpoints, or when the run has not finished a step yet (nothing new to keep).
    pub(super) fn save_before(
        &self,
        me: &Rank,
        cfg: &Config,
        (step, first_step): (usize, usize),
        state: (&Llama, &dyn Optimizer),
    ) -> Result<Option<PathBuf>> {
        let every = cfg.checkpoint.every;
        if step == first_step {
            return Ok(None);
        }
        if every > 0 && step.is_multiple_of(every) {
            let folder = self.folder.lock().unwrap_or_else(|e| e.into_inner());
            return Ok(folder.as_ref().map(|f| f.dir.join(format!("step_{step:06}"))));
        }
        self.save_if_due(me, cfg, step - 1, state, true)
    }
}

/// What every rank uses of the prepared run, all run long: where the weights come from (a
/// checkpoint to resume, pretrained weights, or, neither, the init) and the run's checkpoints.
#[derive(Clone, Copy)]
pub(super) struct Shared<'a> {
    resumed: Option<&'a Resumed>,
    pretrained: Option<&'a HashMap<String, Tensor>>,
    pub checkpoints: &'a Checkpoints,
    nudge: bool,
    /// The ranks are spread over several processes (which must then agree on the settings).
    pub spread: bool,
    /// The CPU's peak TFLOP/s for MFU, measured before the ranks started (`Run::prepare`).
    pub cpu_peak: Option<f64>,
}

impl Shared<'_> {
    /// What the processes of a run must agree on besides the settings (`train/agree.rs`): the
    /// text's content and the checkpoint resumed.
    pub(super) fn facts(&self, data: &Dataset) -> crate::config::Settings {
        let mut facts = crate::config::Settings::new();
        let (data, resumed) = (data.fingerprint().unwrap_or("none"), self.resumed.map(Resumed::point));
        facts.insert("the fingerprint of data.source's files".into(), data.to_string());
        facts.insert("the checkpoint resumed (--resume)".into(), resumed.unwrap_or_else(|| "none".into()));
        facts
    }

    /// This rank's part of the model as it starts (the layers of its pipeline stage `stage`, cut
    /// for tp as `tp` says), from where the run's weights come from: the checkpoint resumed, the
    /// pretrained weights, or the init; and the step to start from. On the host: the
    /// composition root plugs in the rest and moves it to its device.
    pub(super) fn weights<'g>(
        &self,
        cfg: &Config,
        tp: Box<dyn TensorSplit + 'g>,
        stage: Stage,
    ) -> Result<(Llama<'g>, usize)> {
        let (mut model, first_step) = match (self.resumed, self.pretrained) {
            (Some(r), _) => (r.model(&cfg.model, tp, stage)?, r.step),
            (None, Some(w)) => (hf::build_from(w, &cfg.model, tp, stage, &cfg.model.init_from)?, 0),
            (None, None) => (Llama::init(&cfg.model, cfg.train.seed, tp, stage), 0),
        };
        if self.nudge {
            for p in model.params_mut() {
                p.value = Tensor::from_vec(
                    p.value.shape(),
                    init::nudge(&p.name, &p.value.to_vec(), cfg.device.compute_dtype()),
                );
            }
        }
        Ok((model, first_step))
    }

    /// The checkpoint's optimizer state of this tp slice into `o`, when the run resumes.
    pub(super) fn resume_optimizer(&self, o: &mut dyn Optimizer, model: &Llama, tp: &Group) -> Result<()> {
        if let Some(r) = self.resumed {
            r.load_optimizer(o, &model.params(), (tp.index(), tp.size()))?;
            o.to_place(&model.place()); // the state was read into host memory
        }
        Ok(())
    }
}
