//! The training loop: warm start, then rollout → reward → advantage → loss → optimizer, with
//! evaluation, checkpoints and metrics.

pub mod advantage;
pub mod eval;
pub mod harness;
pub mod judge;
pub(crate) mod rejection;
pub(crate) mod samples;
pub mod sampling;
mod step;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use turnwise_env::env::Environment;
use turnwise_env::world::Split;
use turnwise_model::checkpoint::{
    ADAPTER_DIR, HfMetadata, LoraAdapters, LoraParts, TrainerState, export_hf_folder_tensors,
    load_checkpoint, save_checkpoint_with_lora, write_hf_metadata,
};
use turnwise_model::device::Placement;
use turnwise_model::loss::KlController;
use turnwise_model::model::lora::{
    init_adapters, is_adapter_folder, load_peft_adapter, merge_adapters, save_peft_adapter,
};
use turnwise_model::model::transformer::varmap_tensors;
use turnwise_model::model::weights::{init_varmap, sorted_vars};
use turnwise_model::optim::{AdamW, AdamWConfig, DecayShape, LrSchedule};
use turnwise_model::rng::TurnRng;
use turnwise_model::tokenizer::TextTokenizer;
use turnwise_model::{Architecture, LoraDropout, ModelConfig, Transformer};

use crate::config::TrainConfig;
pub use crate::model_source::checkpoint_metadata;
pub use crate::rollout::reward_turns;
use crate::rollout::{Decoding, Episode, Policy};
use crate::task::{TaskSet, encode_demo, stop_token_ids};
use crate::update::{Row, sft_step};

/// The model, tokenizer and optimizer of a run, with its task.
pub struct Trainer {
    /// The resolved configuration.
    pub config: TrainConfig,
    /// The task.
    pub task: TaskSet,
    /// The tokenizer.
    pub tokenizer: TextTokenizer,
    /// Model configuration.
    pub model_config: ModelConfig,
    /// The model's weights: all trained, or, with LoRA, the frozen base.
    pub varmap: VarMap,
    /// The LoRA adapters (`model.lora.rank` ≥ 1): then the only trained weights.
    pub lora: Option<LoraState>,
    /// The policy with gradients.
    pub policy: Transformer,
    /// The same weights without a graph, for rollouts.
    pub sampler: Transformer,
    /// The sampler (its tensors) as the rollouts and evaluations run it: batch-invariant
    /// under `rollout.batch_invariant`.
    pub rollout_model: Transformer,
    /// Frozen reference policy for the KL term.
    pub reference: Option<Transformer>,
    /// The critic (PPO family).
    pub critic: Option<crate::update::critic::CriticModel>,
    /// Optimizer of the RL phase (or of SFT while it runs).
    pub optimizer: AdamW,
    /// RL steps done.
    pub step: u64,
    /// Data and sampling randomness.
    pub rng: TurnRng,
    /// The KL-in-reward coefficient controller (`algorithm.use_kl_in_reward`); its β is saved
    /// with checkpoints.
    pub kl_ctrl: Option<KlController>,
    /// The Hugging Face files of the folder the model came from (`model.init_from` or a
    /// checkpoint), which checkpoints and exports carry over; empty for a fresh model.
    pub hf_meta: HfMetadata,
    stop_ids: Vec<u32>,
    /// Closing tags that are not single tokens: turns end when their text contains one.
    stop_strings: Vec<String>,
    consecutive_bad: usize,
    /// Consecutive steps whose critic update skipped every mini-batch (non-finite loss or
    /// gradient); `optim.max_bad_updates` of them stop the run.
    consecutive_bad_critic: usize,
    /// The rollout servers of `rollout.backend = "remote"`.
    remote: Option<crate::rollout::remote::RemoteBackend>,
    /// The agent program and the policy server of `rollout.backend = "harness"`.
    harness: Option<crate::trainer::harness::Harness>,
    /// The LLM judge of `[judge]`.
    judge: Option<judge::TurnJudge>,
    /// Where the models live (`model.device`, `model.dtype`).
    placement: Placement,
}

/// The LoRA adapters of a run with `model.lora.rank` ≥ 1.
pub struct LoraState {
    /// The adapters and their configuration.
    pub adapters: LoraAdapters,
    /// Dropout of the training forwards (its mask counter is saved with checkpoints).
    pub dropout: LoraDropout,
}

/// `trainer_state.json`'s `extra` key of the LoRA dropout's mask counter.
const LORA_DROPOUT_CALLS: &str = "lora_dropout_calls";

/// Mixed into `seed` for the adapters' initialisation and the dropout masks.
const LORA_INIT_SEED: u64 = 0x4c6f_5241;
const LORA_DROPOUT_SEED: u64 = 0x4c6f_5244;

/// What one RL step produced.
pub struct StepOutput {
    /// Metrics of the step.
    pub metrics: BTreeMap<String, f64>,
    /// The episodes.
    pub episodes: Vec<Episode>,
    /// The lines of `samples/step-N.jsonl`: the first `run.samples_per_step` episodes, decoded
    /// and annotated with what the step computed for them.
    pub samples: Vec<crate::run::SampleRecord>,
}

/// Builds the model configuration of a fresh model.
pub fn fresh_model_config(cfg: &TrainConfig, vocab_size: usize) -> ModelConfig {
    let m = &cfg.model;
    ModelConfig {
        architecture: Architecture::Qwen2,
        hidden_size: m.hidden_size,
        intermediate_size: m.intermediate_size,
        num_hidden_layers: m.num_layers,
        num_attention_heads: m.num_heads,
        num_key_value_heads: m.num_kv_heads,
        head_dim: m.hidden_size / m.num_heads,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        vocab_size,
        tie_word_embeddings: true,
        max_position_embeddings: m.max_position_embeddings,
        attention_bias: true,
        qk_norm: false,
        initializer_range: 0.02,
    }
}

/// The RL phase's learning-rate schedule (`optim.lr`, `warmup_steps`, `lr_schedule`,
/// `min_lr_ratio`) over `run.steps` RL steps.
pub fn rl_lr_schedule(cfg: &TrainConfig) -> turnwise_model::optim::LrSchedule {
    let o = &cfg.optim;
    turnwise_model::optim::LrSchedule {
        peak_lr: o.lr,
        warmup_steps: o.warmup_steps,
        total_steps: cfg.run.steps,
        min_lr_ratio: o.min_lr_ratio,
        decay: o.lr_schedule,
    }
}

fn adamw(cfg: &TrainConfig, weight_decay: f64) -> AdamWConfig {
    AdamWConfig {
        beta1: cfg.optim.beta1,
        beta2: cfg.optim.beta2,
        weight_decay,
        ..AdamWConfig::default()
    }
}

/// The warm start's optimizer settings: the run's β1, β2 and a weight decay of 0.1.
fn sft_adamw(cfg: &TrainConfig) -> AdamWConfig {
    adamw(cfg, 0.1)
}

/// Mixed into `seed` for the warm start's data order.
const SFT_DATA_SEED: u64 = 0x5f74;
/// `trainer_state.json`'s RNG of a warm-start checkpoint: the data order's.
const SFT_DATA_RNG: &str = "warm_start_data";
/// `trainer_state.json`'s `extra` key of a warm-start checkpoint's step (updates done).
const WARM_START_STEP: &str = "warm_start_step";

/// Where an interrupted warm start stands, read from its checkpoint
/// ([`Trainer::load_warm_start`]) to continue it ([`Trainer::warm_start_with`]).
#[derive(Debug)]
pub struct WarmStartState {
    step: u64,
    optimizer: AdamW,
    rng: TurnRng,
    /// The rest of the current pass's shuffled order (popped from the back).
    order: Vec<usize>,
}

impl WarmStartState {
    /// The warm-start steps done.
    pub fn step(&self) -> u64 {
        self.step
    }
}

/// One step of the warm start, as [`Trainer::warm_start_with`] reports it.
pub struct WarmStartStep<'a> {
    trainer: &'a Trainer,
    /// The steps done, this one included (1 to `total`).
    pub step: u64,
    /// `sft.steps`.
    pub total: u64,
    /// The step's loss; `None` when it was not finite and the update was skipped.
    pub loss: Option<f64>,
    /// The step's learning rate.
    pub lr: f64,
    optimizer: &'a AdamW,
    rng: &'a TurnRng,
    order: &'a [usize],
}

impl WarmStartStep<'_> {
    /// Writes a checkpoint of the warm start after this step into the folder `dir` (the
    /// weights, the tokenizer, the warm start's optimizer, data RNG and order), with `caller`,
    /// a value of the caller's that [`Trainer::load_warm_start`] hands back (e.g. what its
    /// logging needs to continue exactly). Making it durable and complete is the caller's
    /// part, as for [`Trainer::save`].
    pub fn save(&self, dir: &Path, caller: serde_json::Value) -> Result<()> {
        self.trainer.save_warm_start(dir, self, caller)
    }
}

/// The critic's optimizer settings: the run's β1, β2 and `critic.weight_decay`.
fn critic_adamw(cfg: &TrainConfig) -> AdamWConfig {
    adamw(cfg, cfg.critic.weight_decay)
}

impl Trainer {
    /// A fresh run: builds the task, trains a tokenizer and initialises a model (or loads
    /// `model.init_from`: a Hugging Face folder, a GGUF file or a packaged model's name, see
    /// [`crate::model_source`]).
    pub fn new(config: TrainConfig) -> Result<Self> {
        let mut task = TaskSet::build(&config.task)?;
        let (tokenizer, model_config, varmap, hf_meta) = match &config.model.init_from {
            Some(source) => {
                let m = crate::model_source::load_init_model(source)?;
                task.set_chat_template(chat_template_of(&m.meta, source)?)?;
                (m.tokenizer, m.config, m.varmap, m.meta)
            }
            None => {
                task.set_chat_template(None)?;
                let demos = match &config.sft.demonstrations {
                    Some(path) => read_demonstrations(path)?,
                    None if task.has_oracle() => {
                        task.demonstrations(Split::Train, 0.0, config.seed)?
                    }
                    None => Vec::new(),
                };
                let tok =
                    task.train_tokenizer(config.model.tokenizer, config.model.vocab_size, &demos)?;
                let mc = fresh_model_config(&config, tok.vocab_size());
                let vm = init_varmap(&mc, DType::F32, &Device::Cpu, config.seed)?;
                (tok, mc, vm, HfMetadata::default())
            }
        };
        log_first_prompt(&task)?;
        let lora = match config.model.lora.to_lora_config() {
            Some(lc) => {
                if config.model.init_from.is_none() {
                    tracing::warn!(
                        "LoRA (model.lora.rank = {}) on a freshly initialised model: the random \
                         base weights stay frozen and only the adapters learn; set \
                         model.init_from to adapt a trained model",
                        lc.rank
                    );
                }
                let adapters = init_adapters(
                    &model_config,
                    &lc,
                    DType::F32,
                    &Device::Cpu,
                    config.seed ^ LORA_INIT_SEED,
                )?;
                Some(LoraState {
                    dropout: LoraDropout::new(lc.dropout, config.seed ^ LORA_DROPOUT_SEED),
                    adapters: LoraAdapters {
                        config: lc,
                        adapters,
                    },
                })
            }
            None => None,
        };
        let mut t = Self::assemble(config, task, tokenizer, model_config, varmap, lora, None, 0)?;
        t.hf_meta = hf_meta;
        Ok(t)
    }

    /// The trained variables, sorted by name: the LoRA adapters, or every weight.
    pub fn trainable_vars(&self) -> Vec<(String, Var)> {
        trainable_vars(&self.varmap, self.lora.as_ref())
    }

    /// How many values the optimizer trains (the adapters' with LoRA).
    pub fn num_trainable_parameters(&self) -> usize {
        self.trainable_vars()
            .iter()
            .map(|(_, v)| v.elem_count())
            .sum()
    }

    /// The policy's weights as one model: the base with the LoRA adapters merged in
    /// (`W + alpha/r · B A`), or the weights themselves (detached, not copied).
    pub fn merged_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let base = varmap_tensors(&self.varmap, true);
        Ok(match &self.lora {
            Some(l) => merge_adapters(
                &self.model_config,
                &l.adapters.config,
                &base,
                &varmap_tensors(&l.adapters.adapters, true),
            )?,
            None => base,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        config: TrainConfig,
        mut task: TaskSet,
        tokenizer: TextTokenizer,
        model_config: ModelConfig,
        varmap: VarMap,
        lora: Option<LoraState>,
        optimizer: Option<AdamW>,
        step: u64,
    ) -> Result<Self> {
        // Prompts with no room for a response are left out (or refused) by every loader alike,
        // so a resumed run draws from the same questions.
        let max_positions = model_config.max_position_embeddings;
        let dropped =
            task.drop_overlong_prompts(max_positions, |p| Ok(tokenizer.encode(p)?.len()))?;
        if let Some(note) = overlong_prompts_note(&dropped, max_positions) {
            tracing::warn!("{note}");
        }
        // Every loader builds on the CPU in f32; the models move to `model.device` in
        // `model.dtype` once, here, and everything downstream follows their device.
        let placement = config.placement()?;
        let (varmap, lora, optimizer) = match placement.is_cpu_f32() {
            true => (varmap, lora, optimizer),
            false => {
                let varmap = placement.varmap(&varmap)?;
                let lora = lora
                    .map(|l| -> Result<LoraState> {
                        Ok(LoraState {
                            adapters: LoraAdapters {
                                config: l.adapters.config,
                                adapters: placement.varmap(&l.adapters.adapters)?,
                            },
                            dropout: l.dropout,
                        })
                    })
                    .transpose()?;
                // A restored optimizer was loaded placed ([`Trainer::load`]), over these same
                // variables when they were placed already.
                if optimizer.is_some() && !placement.holds(&varmap) {
                    bail!("internal: a restored optimizer must be loaded on {placement:?}");
                }
                (varmap, lora, optimizer)
            }
        };
        tracing::info!(
            device = ?placement.device,
            dtype = ?placement.dtype,
            "model placement (model.device, model.dtype)"
        );
        // With LoRA, the policy reads the base weights detached (no gradient is computed for
        // them) and the adapters' Vars; the sampler reads both detached. All three share the
        // base's storage, and the sampler sees each optimizer update of the adapters in place,
        // so nothing is copied or synchronised between steps.
        let (policy, sampler) = match &lora {
            Some(l) => (
                Transformer::lora_from_varmaps(
                    &model_config,
                    &varmap,
                    &l.adapters.config,
                    &l.adapters.adapters,
                    Some(l.dropout.clone()),
                )?,
                Transformer::lora_detached_from_varmaps(
                    &model_config,
                    &varmap,
                    &l.adapters.config,
                    &l.adapters.adapters,
                )?,
            ),
            None => (
                Transformer::from_varmap(&model_config, &varmap)?,
                Transformer::detached_from_varmap(&model_config, &varmap)?,
            ),
        };
        let optimizer = match optimizer {
            Some(o) => o,
            None => AdamW::new(
                trainable_vars(&varmap, lora.as_ref()),
                adamw(&config, config.optim.weight_decay),
            )?,
        };
        let stop_ids = stop_token_ids(&tokenizer, config.task.format);
        let stop_strings = crate::task::stop_strings(&tokenizer, config.task.format);
        let rng = TurnRng::seed_from_u64(config.seed ^ 0x7475_726e);
        let remote = match config.rollout.backend {
            crate::config::RolloutBackend::Local | crate::config::RolloutBackend::Harness => None,
            crate::config::RolloutBackend::Remote => Some(
                crate::rollout::remote::RemoteBackend::connect(&config.rollout.remote)
                    .context("rollout.backend = \"remote\"")?,
            ),
        };
        let harness = match config.rollout.backend {
            crate::config::RolloutBackend::Harness => {
                let search = task.game.is_none() && task.openenv.is_none();
                Some(
                    crate::trainer::harness::Harness::new(
                        &config.rollout.harness,
                        search.then(|| task.retriever.clone()),
                    )
                    .context("rollout.backend = \"harness\"")?,
                )
            }
            _ => None,
        };
        let judge = match config.judge.enabled {
            true => Some(judge::TurnJudge::start(&config.judge).context("[judge]")?),
            false => None,
        };
        let rollout_model = sampler
            .clone()
            .with_batch_invariant(config.rollout.batch_invariant);
        let kl_ctrl = match config.algorithm.use_kl_in_reward {
            true => Some(config.algorithm.kl_ctrl.build()?),
            false => None,
        };
        Ok(Self {
            config,
            task,
            tokenizer,
            model_config,
            varmap,
            lora,
            policy,
            rollout_model,
            sampler,
            reference: None,
            critic: None,
            optimizer,
            step,
            rng,
            kl_ctrl,
            hf_meta: HfMetadata::default(),
            stop_ids,
            stop_strings,
            consecutive_bad: 0,
            consecutive_bad_critic: 0,
            remote,
            harness,
            judge,
            placement,
        })
    }

    /// Where the models live: `model.device` and the dtype `model.dtype` resolves to there.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Runs the harness's agent program on `specs` (episodes of `split`) with `decoding`;
    /// `None` unless `rollout.backend = "harness"`.
    pub(crate) fn run_harness(
        &self,
        specs: &[crate::rollout::EpisodeSpec],
        decoding: &crate::rollout::Decoding,
        split: &str,
    ) -> Option<Result<crate::trainer::harness::HarnessRollout>> {
        let harness = self.harness.as_ref()?;
        Some(self.harness_rollout(harness, specs, decoding, split))
    }

    fn harness_rollout(
        &self,
        harness: &crate::trainer::harness::Harness,
        specs: &[crate::rollout::EpisodeSpec],
        decoding: &crate::rollout::Decoding,
        split: &str,
    ) -> Result<crate::trainer::harness::HarnessRollout> {
        // The programs must meet the trainer's current weights. A run's pipeline has synced them
        // into its directory; elsewhere (`turnwise eval`, a test) they go to the harness's own
        // scratch folder.
        if harness.synced_version() != Some(self.step) {
            self.serve_on_harness(harness, &harness.scratch_dir()?)?;
        }
        let env = self.make_env();
        let cx = crate::trainer::harness::HarnessContext {
            tokenizer: &self.tokenizer,
            env: &env,
            decoding,
            // Every turn-end tag as text (the trainer's own stop strings are those of them that
            // are not single tokens).
            stop_strings: crate::task::turn_end_tags(self.config.task.format)
                .iter()
                .map(|t| t.to_string())
                .collect(),
            stop_ids: &self.stop_ids,
            max_turns: self.config.task.max_turns,
            topk: self.config.task.topk,
            format: serde_json::to_value(self.config.task.format)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            split,
            max_positions: self.model_config.max_position_embeddings,
        };
        harness.run(specs, &cx)
    }

    /// Whether rollouts run the harness's agent program (`rollout.backend = "harness"`).
    pub(crate) fn harness_enabled(&self) -> bool {
        self.harness.is_some()
    }

    /// The rollout policy.
    pub fn rollout_policy(&self) -> Policy<'_> {
        Policy {
            model: &self.rollout_model,
            tokenizer: &self.tokenizer,
            stop_ids: &self.stop_ids,
            stop_strings: &self.stop_strings,
            remote: self.remote.as_ref(),
            version: self.step,
        }
    }

    /// Writes the current weights under `weights_dir` and makes the harness's server serve
    /// them (version = the step).
    fn serve_on_harness(
        &self,
        harness: &crate::trainer::harness::Harness,
        weights_dir: &Path,
    ) -> Result<()> {
        let folder = crate::rollout::remote::write_weights_folder(weights_dir, self.step, |d| {
            self.export(d)
        })?;
        harness
            .sync(&folder, self.step)
            .with_context(|| format!("serving the weights of step {}", self.step))
    }

    /// With remote rollouts, makes the servers serve the trainer's current weights (version
    /// = its step) unless they already do: writes them as a Hugging Face folder under
    /// `weights_dir` (see [`crate::rollout::remote::write_weights_folder`]) and asks every
    /// server to load it. Returns the seconds it took, `None` when there was nothing to do.
    pub fn sync_remote(&self, weights_dir: &Path) -> Result<Option<f64>> {
        if let Some(harness) = &self.harness {
            if harness.synced_version() == Some(self.step) {
                return Ok(None);
            }
            let t0 = Instant::now();
            self.serve_on_harness(harness, weights_dir)?;
            return Ok(Some(t0.elapsed().as_secs_f64()));
        }
        let Some(remote) = &self.remote else {
            return Ok(None);
        };
        if !self.config.rollout.remote.sync_weights || remote.synced_version() == Some(self.step) {
            return Ok(None);
        }
        let t0 = Instant::now();
        let folder = crate::rollout::remote::write_weights_folder(weights_dir, self.step, |d| {
            self.export(d)
        })?;
        remote
            .sync(&folder, self.step)
            .with_context(|| format!("syncing the weights of step {}", self.step))?;
        let secs = t0.elapsed().as_secs_f64();
        tracing::debug!(step = self.step, secs, "rollout servers synced");
        Ok(Some(secs))
    }

    /// Supervised warm start on oracle demonstrations of the training split. `on_step` gets
    /// `(step, loss, lr)` after every update whose loss was finite.
    pub fn warm_start(&mut self, on_step: &mut dyn FnMut(u64, f64, f64)) -> Result<()> {
        self.warm_start_with(None, &mut |s| {
            if let Some(loss) = s.loss {
                on_step(s.step, loss, s.lr);
            }
            Ok(())
        })
    }

    /// The training rows of warm-start demonstrations: the prompt, then the response (agent
    /// and observation tokens) with the agent tokens in the loss.
    pub fn demonstration_rows(&self, demos: &[crate::task::Demonstration]) -> Result<Vec<Row>> {
        demos
            .iter()
            .map(|d| {
                let e = encode_demo(&self.tokenizer, d)?;
                let p = self.tokenizer.encode(&d.prompt)?.len();
                let resp = e.ids[p..].to_vec();
                let mask = e.loss_mask[p..].to_vec();
                let turn = mask.iter().map(|&m| if m > 0 { 0 } else { -1 }).collect();
                Ok(Row::new(e.ids[..p].to_vec(), resp, mask, turn))
            })
            .collect()
    }

    /// The warm start of [`Trainer::warm_start`], from its beginning or, with `from`, from a
    /// warm-start checkpoint ([`Trainer::load_warm_start`]): the steps after `from`'s are the
    /// same, bit for bit, as those of a warm start that was never interrupted. `on_step` gets
    /// every step (its loss is `None` when the update was skipped for a non-finite loss), and
    /// can write a warm-start checkpoint with [`WarmStartStep::save`]; an error from it stops
    /// the warm start.
    pub fn warm_start_with(
        &mut self,
        from: Option<WarmStartState>,
        on_step: &mut dyn FnMut(&WarmStartStep<'_>) -> Result<()>,
    ) -> Result<()> {
        let c = self.config.sft.clone();
        if c.steps == 0 {
            return Ok(());
        }
        let demos = match &c.demonstrations {
            Some(path) => read_demonstrations(path)?,
            None => self
                .task
                .demonstrations(Split::Train, c.noise, self.config.seed)?,
        };
        if demos.is_empty() {
            bail!("no demonstrations to warm-start on");
        }
        let rows = self.demonstration_rows(&demos)?;
        let max_positions = self.policy.config().max_position_embeddings;
        if let Some(warning) = demonstrations_cut_off(
            &rows,
            self.config.rollout.max_response_tokens,
            max_positions,
        ) {
            tracing::warn!("{warning}");
        }
        let schedule = LrSchedule {
            peak_lr: c.lr,
            warmup_steps: c.warmup_steps,
            total_steps: c.steps,
            min_lr_ratio: c.min_lr_ratio,
            decay: DecayShape::Cosine,
        };
        schedule.validate()?;
        let (start, mut opt, mut rng, mut order) = match from {
            Some(st) => {
                if let Some(&i) = st.order.iter().find(|&&i| i >= rows.len()) {
                    bail!(
                        "the warm-start checkpoint's data order names demonstration {i}, but \
                         there are {} (were sft.demonstrations or the task changed?)",
                        rows.len()
                    );
                }
                (st.step, st.optimizer, st.rng, st.order)
            }
            None => (
                0,
                AdamW::new(self.trainable_vars(), sft_adamw(&self.config))?,
                TurnRng::seed_from_u64(self.config.seed ^ SFT_DATA_SEED),
                Vec::new(),
            ),
        };
        for s in start..c.steps {
            let mut batch = Vec::with_capacity(c.batch_size);
            while batch.len() < c.batch_size {
                if order.is_empty() {
                    order = (0..rows.len()).collect();
                    shuffle(&mut order, &mut rng);
                }
                batch.push(&rows[order.pop().expect("non-empty")]);
            }
            let lr = schedule.lr_at(s);
            let loss = sft_step(&self.policy, &mut opt, &batch, lr, 1.0)?.map(|(loss, _)| loss);
            if loss.is_none() {
                tracing::warn!(step = s + 1, "non-finite SFT loss: update skipped");
            }
            on_step(&WarmStartStep {
                trainer: self,
                step: s + 1,
                total: c.steps,
                loss,
                lr,
                optimizer: &opt,
                rng: &rng,
                order: &order,
            })?;
        }
        // The RL optimizer's f32 master copies (bf16 weights) must start from the warm-started
        // weights, not from the ones it was built on.
        self.optimizer.sync_masters(Some(&opt))?;
        Ok(())
    }

    /// Writes a warm-start checkpoint of `at` into `dir`: the weights (as [`Trainer::save`]
    /// writes them, tokenizer included), the warm start's optimizer, its data RNG and the rest
    /// of its shuffled data order, and `caller`, a value of the caller's that
    /// [`Trainer::load_warm_start`] hands back.
    fn save_warm_start(
        &self,
        dir: &Path,
        at: &WarmStartStep<'_>,
        caller: serde_json::Value,
    ) -> Result<()> {
        let mut state = TrainerState::for_optimizer(at.optimizer);
        state.rng_states.insert(SFT_DATA_RNG.into(), at.rng.state());
        state.extra = serde_json::json!({
            WARM_START_STEP: at.step,
            "warm_start_steps": at.total,
            "warm_start_order": at.order,
            "warm_start_caller": caller,
        });
        if let Some(l) = &self.lora {
            state.extra[LORA_DROPOUT_CALLS] = l.dropout.calls().into();
        }
        self.write_checkpoint(dir, at.optimizer, &state)
    }

    /// Restores a trainer in the middle of its warm start from a checkpoint written by
    /// [`WarmStartStep::save`]: the trainer (weights, tokenizer, a fresh RL optimizer, as
    /// [`Trainer::new`] left them but for the weights), where the warm start stands (pass it to
    /// [`Trainer::warm_start_with`]), and the caller's value saved with it.
    pub fn load_warm_start(
        config: TrainConfig,
        dir: &Path,
    ) -> Result<(Self, WarmStartState, serde_json::Value)> {
        let state_path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&state_path)
            .with_context(|| format!("reading {}", state_path.display()))?;
        let state: TrainerState = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", state_path.display()))?;
        let bad = |what: &str| anyhow::anyhow!("{} has no {what}", state_path.display());
        let step = state.extra[WARM_START_STEP]
            .as_u64()
            .ok_or_else(|| bad(WARM_START_STEP))?;
        let rng = state
            .rng_states
            .get(SFT_DATA_RNG)
            .map(|s| TurnRng::from_state(*s))
            .ok_or_else(|| bad("warm-start data RNG"))?;
        let order: Vec<usize> = serde_json::from_value(state.extra["warm_start_order"].clone())
            .with_context(|| format!("{}: warm_start_order", state_path.display()))?;
        let saved_total = state.extra["warm_start_steps"].as_u64();
        if saved_total.is_some_and(|t| t != config.sft.steps) {
            tracing::warn!(
                "sft.steps = {} in the config, but the warm start was checkpointed with {}: its                  learning-rate schedule changes, so it does not continue exactly",
                config.sft.steps,
                saved_total.unwrap_or(0)
            );
        }
        let caller = state.extra["warm_start_caller"].clone();
        let mut t = Self::load(config, dir, None)?;
        // What `load` restored as the trainer's optimizer is the warm start's; the RL optimizer
        // is a fresh one, as after `Trainer::new`.
        let rl = AdamW::new(
            t.trainable_vars(),
            adamw(&t.config, t.config.optim.weight_decay),
        )?;
        let optimizer = std::mem::replace(&mut t.optimizer, rl);
        if optimizer.step_count() != state.step {
            bail!(
                "{}: the optimizer state is at step {}, the trainer state at {}",
                dir.display(),
                optimizer.step_count(),
                state.step
            );
        }
        Ok((
            t,
            WarmStartState {
                step,
                optimizer,
                rng,
                order,
            },
            caller,
        ))
    }

    /// Freezes the current weights as the KL reference and, for the PPO family, builds the
    /// critic from them.
    ///
    /// With LoRA the reference shares the frozen base weights and holds a copy of the adapters
    /// only; the critic starts from the merged weights (and is trained in full).
    pub fn freeze_reference(&mut self) -> Result<()> {
        if self.config.critic.enabled && self.critic.is_none() {
            self.critic = Some(crate::update::critic::CriticModel::from_policy(
                &self.model_config,
                &self.merged_tensors()?,
                self.config.seed ^ 0xc41,
                critic_adamw(&self.config),
            )?);
        }
        let copy = |vm: &VarMap| -> Result<HashMap<String, Tensor>> {
            varmap_tensors(vm, true)
                .into_iter()
                .map(|(k, t)| Ok((k, t.copy()?)))
                .collect()
        };
        self.reference = Some(match &self.lora {
            Some(l) => Transformer::from_tensors(
                &self.model_config,
                &varmap_tensors(&self.varmap, true),
                "reference policy",
            )?
            .with_lora(&l.adapters.config, &copy(&l.adapters.adapters)?, None)?,
            None => Transformer::from_tensors(
                &self.model_config,
                &copy(&self.varmap)?,
                "reference policy",
            )?,
        });
        Ok(())
    }

    /// The decoding settings of the run's rollouts at `temperature` (greedy without top-p/top-k).
    pub(crate) fn decoding(&self, temperature: f64) -> Decoding {
        let r = &self.config.rollout;
        Decoding {
            temperature,
            top_p: if temperature == 0.0 { 1.0 } else { r.top_p },
            top_k: if temperature == 0.0 { 0 } else { r.top_k },
            max_turn_tokens: r.max_turn_tokens,
            max_response_tokens: r.max_response_tokens,
        }
    }

    fn make_env(&self) -> impl Fn() -> Result<Box<dyn Environment>> + '_ {
        move || self.task.env()
    }

    /// The learning rate of the current RL step: `optim.lr` after a linear warm-up of
    /// `optim.warmup_steps`, held or decayed to `optim.lr × optim.min_lr_ratio` at `run.steps`
    /// as `optim.lr_schedule` says.
    fn lr(&self) -> f64 {
        rl_lr_schedule(&self.config).lr_at(self.step)
    }

    /// Writes a checkpoint of the RL state into `dir` (weights, optimizer, RNG, step,
    /// tokenizer and, for the PPO family, the critic's weights and optimizer state). The frozen
    /// reference policy is not in it: it is the warm-started model the run exported once
    /// (`pipeline::REFERENCE_DIR`), which [`Trainer::load`] reads back.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut state = TrainerState::for_optimizer(&self.optimizer);
        state.rng_states.insert("data".into(), self.rng.state());
        state.extra = serde_json::json!({
            "rl_step": self.step,
            "consecutive_bad_updates": self.consecutive_bad,
            "consecutive_bad_critic_updates": self.consecutive_bad_critic,
        });
        if let Some(c) = &self.critic {
            state.extra["critic_optimizer_steps"] = c.optimizer_steps().into();
        }
        if let Some(k) = &self.kl_ctrl {
            // The bits make the restored β exact; the number is for reading.
            state.extra["kl_ctrl_value"] = k.value().into();
            state.extra["kl_ctrl_value_bits"] = k.value().to_bits().into();
        }
        if let Some(l) = &self.lora {
            state.extra[LORA_DROPOUT_CALLS] = l.dropout.calls().into();
        }
        self.write_checkpoint(dir, &self.optimizer, &state)
    }

    /// Writes the weights, `optimizer`'s state, `state`, the tokenizer files and the critic
    /// (when there is one) into the checkpoint folder `dir`.
    fn write_checkpoint(&self, dir: &Path, optimizer: &AdamW, state: &TrainerState) -> Result<()> {
        // A LoRA checkpoint's own folder holds the (unmerged) base its adapters apply to.
        let base_name = std::path::absolute(dir).ok();
        let base_name = base_name.as_deref().and_then(Path::to_str);
        // Checkpoints hold CPU f32 weights on every device (the f32 master weights of a bf16
        // run are in the optimizer state, so resuming is exact).
        let cpu = Placement::cpu();
        let varmap = cpu.varmap(&self.varmap)?;
        let adapters = match &self.lora {
            Some(l) => Some(LoraAdapters {
                config: l.adapters.config.clone(),
                adapters: cpu.varmap(&l.adapters.adapters)?,
            }),
            None => None,
        };
        save_checkpoint_with_lora(
            dir,
            &self.model_config,
            &varmap,
            adapters.as_ref().map(|lora| LoraParts {
                lora,
                base_model_name_or_path: base_name,
            }),
            optimizer,
            state,
        )
        .with_context(|| format!("writing the checkpoint {}", dir.display()))?;
        write_hf_metadata(dir, &self.tokenizer, &self.hf_meta)
            .with_context(|| format!("writing the tokenizer files into {}", dir.display()))?;
        if let Some(c) = &self.critic {
            c.save(dir)
                .with_context(|| format!("writing the critic into {}", dir.display()))?;
        }
        Ok(())
    }

    /// Restores a trainer from a checkpoint written by [`Trainer::save`]: policy, optimizer,
    /// RNG, step and, when the run has a critic, the critic with its optimizer. The reference
    /// policy is read from `reference_dir` (the warm-started model) when given. A checkpoint
    /// written before critics were saved rebuilds the critic from `reference_dir`'s weights
    /// (how the run first built it), with a warning: the resumed run is then not exact.
    pub fn load(config: TrainConfig, dir: &Path, reference_dir: Option<&Path>) -> Result<Self> {
        let mut task = TaskSet::build(&config.task)?;
        // Loaded where the run trains: the optimizer's moments and f32 master copies go there
        // with the weights they belong to.
        let placement = config.placement()?;
        let ck = load_checkpoint(dir, placement.dtype, &placement.device)
            .with_context(|| format!("loading the checkpoint {}", dir.display()))?;
        let tokenizer = TextTokenizer::from_file(dir.join("tokenizer.json"))?;
        let hf_meta = checkpoint_metadata(dir, config.model.init_from.as_deref())?;
        task.set_chat_template(chat_template_of(&hf_meta, dir)?)?;
        log_first_prompt(&task)?;
        let step = ck.state.extra["rl_step"].as_u64().unwrap_or(0);
        // A fresh model's shape comes from the config: an edited config.toml must not resume
        // silently with the checkpoint's other shape (a model from `model.init_from` has the
        // source's shape, whatever these keys say).
        if config.model.init_from.is_none() {
            check_resumed_shape(&config, &ck.config, dir)?;
        }
        let lora = resumed_lora(&config, ck.lora, &ck.state, dir)?;
        let mut t = Self::assemble(
            config,
            task,
            tokenizer,
            ck.config,
            ck.varmap,
            lora,
            Some(ck.optimizer),
            step,
        )?;
        t.hf_meta = hf_meta;
        t.restore_counters(&ck.state);
        let mut reference_tensors = None;
        if let Some(rd) = reference_dir {
            let (reference, tensors) = t.load_reference(rd)?;
            t.reference = Some(reference);
            reference_tensors = tensors;
        }
        if t.config.critic.enabled {
            t.restore_critic(dir, &ck.state, reference_dir, reference_tensors)?;
        }
        Ok(t)
    }

    /// Restores what [`Trainer::save`] keeps of the loop's state besides the weights: the data
    /// RNG, the counters of consecutive bad updates and the KL controller's β.
    fn restore_counters(&mut self, state: &TrainerState) {
        if let Some(s) = state.rng_states.get("data") {
            self.rng = TurnRng::from_state(*s);
        }
        if let Some(n) = state.extra["consecutive_bad_critic_updates"].as_u64() {
            self.consecutive_bad_critic = n as usize;
        }
        if let Some(n) = state.extra["consecutive_bad_updates"].as_u64() {
            self.consecutive_bad = n as usize;
        }
        if let (Some(ctrl), Some(bits)) = (
            self.kl_ctrl.as_mut(),
            state.extra["kl_ctrl_value_bits"].as_u64(),
        ) {
            let beta = f64::from_bits(bits);
            match ctrl {
                KlController::Fixed(c) => c.value = beta,
                KlController::Adaptive(c) => c.value = beta,
            }
        }
    }

    /// The reference policy of a resumed run, from the warm-started model `rd`: its adapters on
    /// the shared frozen base (a LoRA run whose warm start has adapters), else its full
    /// weights, which are returned too (placed) for a critic that must be rebuilt from them.
    fn load_reference(&self, rd: &Path) -> Result<(Transformer, Option<HashMap<String, Tensor>>)> {
        let adapter_dir = rd.join(ADAPTER_DIR);
        Ok(match &self.lora {
            // The warm-started adapters on the shared frozen base.
            Some(_) if is_adapter_folder(&adapter_dir) => {
                let (lc, adapters) = load_peft_adapter(&adapter_dir, DType::F32, &Device::Cpu)
                    .with_context(|| {
                        format!("loading the reference adapters {}", adapter_dir.display())
                    })?;
                let adapters = self.placement.tensors(adapters)?;
                let m = Transformer::from_tensors(
                    &self.model_config,
                    &varmap_tensors(&self.varmap, true),
                    "reference",
                )?
                .with_lora(&lc, &adapters, None)?;
                (m, None)
            }
            _ => {
                let (mc, tensors) = load_reference_tensors(rd)?;
                let tensors = self.placement.tensors(tensors)?;
                let m = Transformer::from_tensors(&mc, &tensors, "reference")?;
                (m, Some(tensors))
            }
        })
    }

    /// The critic of a resumed run: the checkpoint's `dir` (with its optimizer's step count
    /// from `state`), or, for a checkpoint written before critics were saved, rebuilt from the
    /// warm-started weights of `reference_dir` (`reference_tensors` when already loaded) with a
    /// warning.
    fn restore_critic(
        &mut self,
        dir: &Path,
        state: &TrainerState,
        reference_dir: Option<&Path>,
        mut reference_tensors: Option<HashMap<String, Tensor>>,
    ) -> Result<()> {
        use crate::update::critic::{CRITIC_WEIGHTS_FILE, CriticModel};
        if dir.join(CRITIC_WEIGHTS_FILE).is_file() {
            let steps = state.extra["critic_optimizer_steps"]
                .as_u64()
                .with_context(|| {
                    format!(
                        "{}/trainer_state.json has a critic but no critic_optimizer_steps",
                        dir.display()
                    )
                })?;
            self.critic = Some(CriticModel::load(
                &self.model_config,
                dir,
                steps,
                critic_adamw(&self.config),
                &self.placement,
            )?);
        } else if let Some(rd) = reference_dir {
            let tensors = match reference_tensors.take() {
                Some(t) => t,
                None => self.placement.tensors(load_reference_tensors(rd)?.1)?,
            };
            tracing::warn!(
                checkpoint = %dir.display(),
                "the checkpoint holds no critic: it restarts from the warm-started weights, \
                 so the resumed run is not exact"
            );
            self.critic = Some(CriticModel::from_policy(
                &self.model_config,
                &tensors,
                self.config.seed ^ 0xc41,
                critic_adamw(&self.config),
            )?);
        }
        Ok(())
    }

    /// Exports the current weights as a complete Hugging Face folder (config.json,
    /// model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json; the
    /// source checkpoint's files when the model came from one) with the run's resolved config
    /// as [`EXPORT_CONFIG_FILE`], which `turnwise eval --checkpoint` reads. With LoRA the
    /// weights are the merged ones (a plain model) and the adapters are also written in PEFT's
    /// layout into [`ADAPTER_DIR`] (`base_model_name_or_path`: `model.init_from`).
    pub fn export(&self, dir: &Path) -> Result<()> {
        export_hf_folder_tensors(
            dir,
            &self.model_config,
            &Placement::cpu().tensors(self.merged_tensors()?)?,
            &self.tokenizer,
            &self.hf_meta,
        )
        .with_context(|| format!("exporting the model to {}", dir.display()))?;
        if let Some(l) = &self.lora {
            write_export_adapter(
                dir,
                &l.adapters.config,
                &Placement::cpu().tensors(varmap_tensors(&l.adapters.adapters, true))?,
                &self.config,
            )?;
        }
        write_export_config(dir, &self.config)
    }
}

/// The trained variables, sorted by name: the LoRA adapters' when there are any (the base
/// weights are frozen), else every weight of `varmap`.
fn trainable_vars(varmap: &VarMap, lora: Option<&LoraState>) -> Vec<(String, Var)> {
    match lora {
        Some(l) => sorted_vars(&l.adapters.adapters),
        None => sorted_vars(varmap),
    }
}

/// Writes the LoRA adapters of an export into its [`ADAPTER_DIR`] in PEFT's layout, with
/// `model.init_from` as the base model's name or path.
pub fn write_export_adapter(
    dir: &Path,
    lora: &turnwise_model::LoraConfig,
    adapters: &HashMap<String, Tensor>,
    config: &TrainConfig,
) -> Result<()> {
    let base = config
        .model
        .init_from
        .as_deref()
        .and_then(Path::to_str)
        .map(String::from);
    let out = dir.join(ADAPTER_DIR);
    save_peft_adapter(&out, lora, adapters, base.as_deref())
        .with_context(|| format!("writing the LoRA adapters into {}", out.display()))
}

/// The file of an exported folder that holds the resolved turnwise config of the run that
/// wrote it (not read by `transformers`).
pub const EXPORT_CONFIG_FILE: &str = "turnwise.toml";

/// Writes `config` into an exported folder as [`EXPORT_CONFIG_FILE`] (mode 0644).
pub fn write_export_config(dir: &Path, config: &TrainConfig) -> Result<()> {
    let path = dir.join(EXPORT_CONFIG_FILE);
    std::fs::write(&path, config.to_toml())
        .with_context(|| format!("writing {}", path.display()))?;
    turnwise_model::model::weights::set_mode_644(&path)?;
    Ok(())
}

/// The chat template of a model folder's metadata, with the folder named on error.
fn chat_template_of(
    meta: &HfMetadata,
    dir: &Path,
) -> Result<Option<turnwise_model::tokenizer::ChatTemplate>> {
    meta.chat_template()
        .with_context(|| format!("reading the chat template of {}", dir.display()))
}

/// Refuses to resume a fresh model (one not from `model.init_from`) whose configured shape is
/// not the checkpoint's `ck`: a run's architecture cannot change on resume (the error names
/// the key).
fn check_resumed_shape(config: &TrainConfig, ck: &ModelConfig, dir: &Path) -> Result<()> {
    let want = fresh_model_config(config, ck.vocab_size);
    let m = &config.model;
    for (key, asked, has) in [
        ("model.hidden_size", m.hidden_size, ck.hidden_size),
        ("model.num_layers", m.num_layers, ck.num_hidden_layers),
        ("model.num_heads", m.num_heads, ck.num_attention_heads),
        ("model.num_kv_heads", m.num_kv_heads, ck.num_key_value_heads),
        (
            "model.intermediate_size",
            m.intermediate_size,
            ck.intermediate_size,
        ),
        (
            "model.max_position_embeddings",
            want.max_position_embeddings,
            ck.max_position_embeddings,
        ),
    ] {
        if asked != has {
            bail!(
                "{key} = {asked} in the config, but the checkpoint {} was trained with \
                 {has}: a run's architecture cannot change on resume (restore {key} = \
                 {has}, or start a new run)",
                dir.display()
            );
        }
    }
    Ok(())
}

/// The LoRA state of a resumed run: the checkpoint's adapters when the config asks for the
/// same LoRA (with the dropout stream where `state` left it); refuses a checkpoint whose
/// adapters the config does not ask for, or the other way round.
fn resumed_lora(
    config: &TrainConfig,
    adapters: Option<LoraAdapters>,
    state: &TrainerState,
    dir: &Path,
) -> Result<Option<LoraState>> {
    Ok(match (config.model.lora.to_lora_config(), adapters) {
        (None, None) => None,
        (Some(want), Some(adapters)) => {
            if want != adapters.config {
                bail!(
                    "the checkpoint {} holds LoRA adapters {:?}, but the config asks for {:?} \
                     (model.lora)",
                    dir.display(),
                    adapters.config,
                    want
                );
            }
            let dropout = LoraDropout::new(want.dropout, config.seed ^ LORA_DROPOUT_SEED);
            dropout.set_calls(state.extra[LORA_DROPOUT_CALLS].as_u64().unwrap_or(0));
            Some(LoraState { adapters, dropout })
        }
        (Some(want), None) => bail!(
            "the config asks for LoRA (model.lora.rank = {}), but the checkpoint {} holds no \
             adapters ({ADAPTER_DIR}/): it is a full fine-tuning checkpoint",
            want.rank,
            dir.display()
        ),
        (None, Some(_)) => bail!(
            "the checkpoint {} holds LoRA adapters ({ADAPTER_DIR}/), but model.lora.rank is 0 \
             in the config",
            dir.display()
        ),
    })
}

/// The warm-started model `rd`'s configuration and full weights (f32, on the CPU).
fn load_reference_tensors(rd: &Path) -> Result<(ModelConfig, HashMap<String, Tensor>)> {
    turnwise_model::model::weights::load_hf(rd, DType::F32, &Device::Cpu)
        .with_context(|| format!("loading the reference model {}", rd.display()))
}

/// Logs how prompts are made and the prompt of the first question.
fn log_first_prompt(task: &TaskSet) -> Result<()> {
    if let Some((how, prompt)) = task.first_prompt()? {
        tracing::info!("prompts: {how}; the first question's prompt:\n{prompt}");
    }
    Ok(())
}

/// What to tell a user whose data files held prompts too long for the model's context
/// ([`TaskSet::drop_overlong_prompts`] dropped them), `None` when none was.
pub fn overlong_prompts_note(
    dropped: &[crate::task::OverlongPrompts; 3],
    max_positions: usize,
) -> Option<String> {
    let parts: Vec<String> = Split::ALL
        .iter()
        .zip(dropped)
        .filter(|(_, d)| d.dropped > 0)
        .map(|(s, d)| {
            format!(
                "{} of {} {} (the longest {} tokens)",
                d.dropped,
                d.total,
                s.name(),
                d.longest
            )
        })
        .collect();
    (!parts.is_empty()).then(|| {
        format!(
            "filtered overlong prompts: {} questions' prompts leave no room for a response in the \
             model's context (model.max_position_embeddings = {max_positions}) and are left out, \
             as verl's data.filter_overlong_prompts does",
            parts.join(", ")
        )
    })
}

/// Fisher-Yates shuffle with the run's generator.
pub fn shuffle<T>(v: &mut [T], rng: &mut TurnRng) {
    for i in (1..v.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// What to tell a user whose warm-start demonstrations are longer than a rollout may grow
/// (`None` when every one fits): a rollout stops when its response reaches
/// `max_response_tokens − 1` tokens or its context `max_positions − 1` (the rollout's
/// `apply_turn_with`), so a question whose demonstration is longer can be imitated in the warm
/// start but never answered in a rollout or an evaluation (a 4-hop question of the search world
/// with the quickstart's 400 response tokens).
pub fn demonstrations_cut_off(
    rows: &[Row],
    max_response_tokens: usize,
    max_positions: usize,
) -> Option<String> {
    let over = |r: &&Row| {
        r.response.len() + 1 >= max_response_tokens
            || r.prompt.len() + r.response.len() + 1 >= max_positions
    };
    let cut: Vec<&Row> = rows.iter().filter(over).collect();
    let longest = cut.iter().map(|r| r.response.len()).max()?;
    Some(format!(
        "{} of {} warm-start demonstrations ({:.1} %) are longer than a rollout may grow \
         (rollout.max_response_tokens = {max_response_tokens}, model.max_position_embeddings = \
         {max_positions}; the longest response is {longest} tokens): a rollout stops before \
         their answer, so the policy cannot answer those questions; raise both limits",
        cut.len(),
        rows.len(),
        100.0 * cut.len() as f64 / rows.len() as f64,
    ))
}

/// Reads demonstrations from a JSON-lines file (`{"prompt", "segments": [[text, is_agent]]}`).
pub fn read_demonstrations(path: &Path) -> Result<Vec<crate::task::Demonstration>> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("reading demonstrations {}", path.display()))?;
    let mut out = Vec::new();
    turnwise_env::corpus::for_each_json_line(std::io::BufReader::new(file), path, |n, line| {
        let d =
            serde_json::from_str(line).map_err(|e| turnwise_env::corpus::CorpusError::Parse {
                path: path.to_path_buf(),
                line: n,
                message: format!("not a demonstration: {e}"),
            })?;
        out.push(d);
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search world's 4-hop demonstrations do not fit the quickstart's rollout limits (400
    /// response tokens, 512 positions), and the warm start says so; with room for them (640 and
    /// 768), and in a world of 1- and 2-hop questions, it says nothing.
    #[test]
    fn demonstrations_longer_than_a_rollout_are_named() {
        let trainer = |hops: &str, limits: [&str; 2]| {
            let mut sets: Vec<String> = [
                "task.world.countries=6",
                "task.world.cities=12",
                "task.world.companies=8",
                "task.world.persons=30",
                "task.world.distractors=20",
                "task.world.questions.train=60",
                "task.world.questions.validation=4",
                "task.world.questions.test=4",
                "model.hidden_size=16",
                "model.num_layers=1",
                "model.num_heads=2",
                "model.num_kv_heads=1",
                "model.intermediate_size=32",
                "task.max_turns=5",
            ]
            .map(String::from)
            .to_vec();
            sets.push(format!("task.world.questions.hop_weights={hops}"));
            sets.extend(limits.map(String::from));
            Trainer::new(TrainConfig::resolve(Some("grpo"), None, &sets).unwrap()).unwrap()
        };
        let check = |t: &Trainer| {
            let demos = t.task.demonstrations(Split::Train, 0.0, 0).unwrap();
            let rows = t.demonstration_rows(&demos).unwrap();
            let c = &t.config;
            let positions = c.model.max_position_embeddings;
            (
                rows.len(),
                demonstrations_cut_off(&rows, c.rollout.max_response_tokens, positions),
            )
        };
        let tight = [
            "rollout.max_response_tokens=400",
            "model.max_position_embeddings=512",
        ];
        let room = [
            "rollout.max_response_tokens=640",
            "model.max_position_embeddings=768",
        ];
        let (n, warning) = check(&trainer("[0.0, 0.0, 0.0, 1.0]", tight));
        let warning = warning.expect("4-hop demonstrations exceed 400 response tokens");
        assert!(
            warning.contains(&format!(" of {n} warm-start demonstrations")),
            "{warning}"
        );
        assert!(
            warning.contains("rollout.max_response_tokens = 400"),
            "{warning}"
        );
        assert_eq!(check(&trainer("[0.0, 0.0, 0.0, 1.0]", room)).1, None);
        assert_eq!(check(&trainer("[0.5, 0.5, 0.0, 0.0]", tight)).1, None);
    }
}
