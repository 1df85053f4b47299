//! One RL step, read as the pipeline runs it:
//!
//! rollout → reward (and DAPO's dynamic sampling, [`Trainer::sample_batch`]) → what the
//! estimator reads besides the rewards (the critic's values, KL in the reward) → advantage
//! ([`advantage::compute`]) → loss rows (trajectories, or their step samples) → optimizer (the
//! actor, then the critic) → the step's metrics and samples.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use turnwise_core::metric_keys as mk;
use turnwise_core::trajectory::TurnAction;
use turnwise_model::rng::TurnRng;

use super::samples::{self, TrainedSample};
use super::sampling::StepBatch;
use super::{StepOutput, Trainer, advantage, shuffle};
use crate::config::{OldLogprobs, RolloutStrategy, TrainConfig, TrainSamples};
use crate::rollout::RolloutControl;
use crate::update::critic::CriticUpdate;
use crate::update::{
    ActorUpdate, Row, UpdateStats, actor_update, is_on_policy, logprobs_no_grad_with,
};

/// Behaviour and reference log-probs of the trained trajectory rows (KL in the reward).
type KlLogprobs = (Vec<Vec<f32>>, Vec<Vec<f32>>);

impl Trainer {
    /// One RL step: the batch ([`Trainer::sample_batch`]: rollouts, rewards, DAPO dynamic
    /// sampling), KL in the reward when configured, advantages, then the actor and critic
    /// updates.
    pub fn rl_step(&mut self) -> Result<StepOutput> {
        let t0 = Instant::now();
        let cfg = self.config.clone();

        // Rollout → reward (every generated episode; the informative groups to train on).
        let (all, selected, batch_metrics) = self.sample_batch()?;
        let batch = selected.as_ref().unwrap_or(&all);

        // What the estimator reads besides the rewards.
        let trajectories: Vec<Row> = batch
            .episodes
            .iter()
            .map(|e| Row::from_trajectory(&e.episode.trajectory, cfg.rollout.train_on_forced))
            .collect();
        let values = match &self.critic {
            Some(c) => Some(c.values(&trajectories, 64, cfg.optim.share_prefix)?),
            None => None,
        };
        let (kl_logprobs, old_logprob_seconds) = self.kl_logprobs(&trajectories)?;
        let kl_beta = self.kl_ctrl.as_ref().map(|k| k.value());
        let kl_in_reward = match (&kl_logprobs, kl_beta) {
            (Some((old, reference)), Some(beta)) => Some(advantage::KlInReward {
                old_logp: old,
                ref_logp: reference,
                beta,
                estimator: cfg.algorithm.kl_penalty.estimator,
            }),
            _ => None,
        };

        // Advantage.
        let adv = advantage::compute(
            &cfg,
            &batch.episodes,
            batch.trees.as_ref(),
            values.as_deref(),
            kl_in_reward.as_ref(),
        )?;

        // Loss rows, and what the step's sample episodes were given.
        let n_samples = cfg.run.samples_per_step.min(all.episodes.len());
        let sample_rows = samples::trained_rows(&all.episodes[..n_samples], &batch.episodes);
        let mut trained_samples: Vec<Option<TrainedSample>> = sample_rows
            .iter()
            .map(|j| j.map(|j| TrainedSample::new(&adv.rows[j], &adv.details[j])))
            .collect();
        let trajectory_rows = adv.rows.len();
        let (rows, row_origin) = loss_rows(&cfg, adv.rows);

        // Metrics of the batch and its advantages.
        let mut metrics = BTreeMap::new();
        if let Some(s) = old_logprob_seconds {
            metrics.insert(mk::timing::OLD_LOG_PROB.into(), s);
        }
        if let (Some(kl), Some(beta), Some(ctrl)) = (adv.reward_kl, kl_beta, self.kl_ctrl.as_mut())
        {
            // verl logs the coefficient used for this batch, then updates the controller.
            metrics.insert(mk::actor::REWARD_KL_PENALTY.into(), kl);
            metrics.insert(mk::actor::REWARD_KL_PENALTY_COEFF.into(), beta);
            ctrl.update(kl, rows.len());
        }
        metrics.extend(generated_metrics(&cfg, &all, self.task.scored_by_return()));
        metrics.insert(mk::batch::KEPT_ROLLOUTS.into(), batch.episodes.len() as f64);
        // What the update trains on: trajectory rows, or their step samples.
        metrics.insert(mk::batch::TRAJECTORY_ROWS.into(), trajectory_rows as f64);
        metrics.insert(mk::batch::TRAIN_ROWS.into(), rows.len() as f64);
        metrics.extend(batch_metrics);
        if cfg.rollout.strategy == RolloutStrategy::Chain {
            let control =
                RolloutControl::from_config(&cfg.rollout, cfg.task.format, &self.tokenizer)?;
            metrics.extend(all.stats.metrics(&control));
        }
        if let Some(j) = &all.judge {
            metrics.extend(j.metrics());
        }
        if let Some(h) = &all.harness {
            metrics.extend(h.metrics());
        }
        metrics.extend(
            batch
                .trees
                .as_ref()
                .map(|t| t.metrics())
                .unwrap_or_default(),
        );
        metrics.extend(adv.metrics);

        // Optimizer: the actor, then the critic.
        let t2 = Instant::now();
        if !rows.is_empty() {
            let clips = self.update(&cfg, &rows, values.as_deref(), kl_logprobs, &mut metrics)?;
            // The clip counts of the sample episodes' rows (the rows, or their step samples).
            let sample_of: HashMap<usize, usize> = sample_rows
                .iter()
                .enumerate()
                .filter_map(|(s, j)| j.map(|j| (j, s)))
                .collect();
            for (clips, &(j, offset)) in clips.iter().zip(&row_origin) {
                if let Some(t) = sample_of.get(&j).and_then(|&s| trained_samples[s].as_mut()) {
                    t.add_clips(offset, clips);
                }
            }
        }
        self.step += 1;

        // The step's metrics and samples.
        metrics.insert(mk::timing::GEN.into(), all.gen_seconds);
        metrics.insert(mk::timing::INFO_GAIN.into(), all.ig_seconds);
        metrics.insert(mk::timing::UPDATE.into(), t2.elapsed().as_secs_f64());
        let samples = samples::sample_records(&self.tokenizer, &all, trained_samples)
            .context("the step's samples")?;
        let step_seconds = t0.elapsed().as_secs_f64();
        metrics.insert(mk::timing::STEP.into(), step_seconds);
        // verl's `perf/throughput`: the step's prompt and response tokens (every generated
        // episode, refill rounds included) per second of the whole step, on this process.
        let tokens: usize = all
            .episodes
            .iter()
            .map(|e| e.episode.trajectory.prompt_ids.len() + e.episode.trajectory.response_len())
            .sum();
        if step_seconds > 0.0 {
            metrics.insert(mk::perf::THROUGHPUT.into(), tokens as f64 / step_seconds);
        }
        Ok(StepOutput {
            metrics,
            episodes: all.episodes.into_iter().map(|e| e.episode).collect(),
            samples,
        })
    }

    /// KL in the reward (spec §5.8): the behaviour and reference log-probs of `trajectories`
    /// (`None` when KL is not in the reward), and the seconds the behaviour log-probs' recomputation
    /// took (`None` when they come from the rollout, `optim.old_logprobs`).
    fn kl_logprobs(&self, trajectories: &[Row]) -> Result<(Option<KlLogprobs>, Option<f64>)> {
        let temperature = self.config.rollout.temperature;
        let share = self.config.optim.share_prefix;
        match (&self.kl_ctrl, &self.reference) {
            (None, _) => Ok((None, None)),
            (Some(_), None) => {
                bail!("KL in the reward needs the reference model (call freeze_reference)")
            }
            (Some(_), Some(reference)) => {
                let t = Instant::now();
                let (old, seconds) = match self.config.optim.old_logprobs {
                    OldLogprobs::Recompute => (
                        logprobs_no_grad_with(&self.sampler, trajectories, temperature, 64, share)?,
                        Some(t.elapsed().as_secs_f64()),
                    ),
                    OldLogprobs::Rollout => (rollout_logprobs(trajectories)?, None),
                };
                let reference =
                    logprobs_no_grad_with(reference, trajectories, temperature, 64, share)?;
                Ok((Some((old, reference)), seconds))
            }
        }
    }

    /// Reports a step whose update structure shrank to one on-policy optimizer step (review E,
    /// P3): the configured update splits a full batch (`rollout.prompts_per_step` ×
    /// `rollout.group_size` rows) into several mini-batches, the first on-policy and the rest
    /// off-policy, but this step has at most one mini-batch of rows (DAPO's filter kept few
    /// groups), so it takes a single on-policy step. The step's metrics get
    /// `actor/on_policy_fallback = 1` and a warning names the step and the counts; the metric is
    /// absent from every other step, so the metrics of runs that keep their structure are
    /// unchanged.
    fn report_on_policy_fallback(
        &self,
        cfg: &TrainConfig,
        upd: &ActorUpdate<'_>,
        rows: usize,
        metrics: &mut BTreeMap<String, f64>,
    ) {
        let full = cfg.rollout.prompts_per_step * cfg.rollout.group_size;
        if rows == 0 || is_on_policy(upd, full) || !is_on_policy(upd, rows) {
            return;
        }
        metrics.insert(mk::actor::ON_POLICY_FALLBACK.into(), 1.0);
        tracing::warn!(
            "step {}: {rows} rows to train on, at most one mini-batch of \
             optim.mini_batch_size = {}: this step takes 1 on-policy optimizer step instead of \
             the {} a full batch of {full} rows takes (the group filter kept few groups; \
             rollout.max_num_gen_batches refills more)",
            self.step + 1,
            upd.mini_batch,
            full.div_ceil(upd.mini_batch) * upd.epochs,
        );
    }

    /// The actor update on `rows`, then the critic's (`values`: its values of the trajectory
    /// rows before the update), each after `self.config`'s warm-up; their metrics go into
    /// `metrics`. Returns the clip counts of every row. Stops the run after
    /// `optim.max_bad_updates` steps in a row whose updates were all non-finite.
    fn update(
        &mut self,
        cfg: &TrainConfig,
        rows: &[Row],
        values: Option<&[Vec<f32>]>,
        kl_logprobs: Option<KlLogprobs>,
        metrics: &mut BTreeMap<String, f64>,
    ) -> Result<Vec<crate::update::RowClips>> {
        let temperature = cfg.rollout.temperature;
        // verl's critic warm-up: the first `critic.warmup_updates` steps train the critic only.
        let actor_warm = self.critic.is_none() || self.step >= cfg.critic.warmup_updates;
        let (old_logp, ref_logp) = match kl_logprobs {
            Some((old, reference)) => (Some(old), Some(reference)),
            None => (None, None),
        };
        let reference = self.reference_logprobs(cfg, rows, ref_logp)?;
        let upd = ActorUpdate {
            loss: &cfg.actor,
            temperature,
            epochs: cfg.optim.ppo_epochs,
            mini_batch: cfg.optim.mini_batch_size,
            micro_batch: cfg.optim.micro_batch_size,
            lr: self.lr(),
            grad_clip: cfg.optim.grad_clip,
            rollout_is_cap: (cfg.optim.rollout_is_cap > 0.0).then_some(cfg.optim.rollout_is_cap),
            share_prefix: cfg.optim.share_prefix,
        };
        let from_rollout = cfg.optim.old_logprobs == OldLogprobs::Rollout;
        self.report_on_policy_fallback(cfg, &upd, rows.len(), metrics);
        let old = self.behaviour_logprobs(cfg, &upd, rows, old_logp, metrics)?;
        let mut rng = TurnRng::seed_from_u64(self.rng.next_u64());
        let mut order = |n: usize| {
            let mut v: Vec<usize> = (0..n).collect();
            shuffle(&mut v, &mut rng);
            v
        };
        let actor_start = Instant::now();
        let mut stats = if actor_warm {
            actor_update(
                &self.policy,
                &mut self.optimizer,
                rows,
                old.as_deref(),
                reference.as_deref(),
                &upd,
                &mut order,
            )?
        } else {
            UpdateStats::default()
        };
        if actor_warm {
            // verl's `timing_s/update_actor`: the actor's update alone (the behaviour log-probs'
            // recomputation and the critic's update are timed apart).
            metrics.insert(
                mk::timing::UPDATE_ACTOR.into(),
                actor_start.elapsed().as_secs_f64(),
            );
        }
        metrics.extend(std::mem::take(&mut stats.metrics));
        // The sampler–trainer mismatch: the recorded log-probs against the trainer's, from the
        // recomputation of an off-policy update or the on-policy update's own forward pass.
        // Behaviour log-probs taken from the rollout have no trainer figure to compare with.
        let trainer_logp: Option<Vec<Option<&[f32]>>> = match &old {
            Some(_) if from_rollout => None,
            Some(old) => Some(old.iter().map(|v| Some(v.as_slice())).collect()),
            None => Some(stats.forward_logp.iter().map(Option::as_deref).collect()),
        };
        if let Some(trainer_logp) = trainer_logp {
            metrics.extend(logprob_mismatch_metrics(rows, &trainer_logp)?);
        }
        if let Some(values) = values {
            self.update_critic(cfg, rows, values, &mut order, metrics)?;
        }
        metrics.insert(mk::actor::SKIPPED_UPDATES.into(), stats.skipped as f64);
        metrics.insert(mk::actor::OPTIMIZER_STEPS.into(), stats.applied as f64);
        if stats.skipped > 0 && stats.applied == 0 {
            self.consecutive_bad += 1;
            if self.consecutive_bad >= cfg.optim.max_bad_updates {
                bail!(
                    "{} consecutive steps had only non-finite losses or gradients; stopping \
                     (lower optim.lr or check the reward)",
                    self.consecutive_bad
                );
            }
        } else {
            self.consecutive_bad = 0;
        }
        Ok(stats.row_clips)
    }

    /// The reference log-probs of `rows` for the KL loss (`actor.use_kl_loss`): the ones
    /// computed for KL in the reward (`ref_logp`) when there are some, else the reference
    /// model's; `None` without the KL loss.
    fn reference_logprobs(
        &self,
        cfg: &TrainConfig,
        rows: &[Row],
        ref_logp: Option<Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        Ok(match (&self.reference, cfg.actor.use_kl_loss, ref_logp) {
            (Some(_), true, Some(reference)) => Some(reference),
            (Some(m), true, None) => Some(logprobs_no_grad_with(
                m,
                rows,
                cfg.rollout.temperature,
                64,
                cfg.optim.share_prefix,
            )?),
            (None, true, _) => bail!("the KL term needs a reference model (freeze_reference)"),
            _ => None,
        })
    }

    /// Behaviour log-probs: recomputed by the trainer with the rollout weights, or the ones
    /// the rollout recorded (`optim.old_logprobs`; already there with KL in the reward, as
    /// `old_logp`), or, for an on-policy update, taken from the update's own forward pass
    /// (`None`). A recomputation's time goes into `metrics`.
    fn behaviour_logprobs(
        &self,
        cfg: &TrainConfig,
        upd: &ActorUpdate<'_>,
        rows: &[Row],
        old_logp: Option<Vec<Vec<f32>>>,
        metrics: &mut BTreeMap<String, f64>,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let from_rollout = cfg.optim.old_logprobs == OldLogprobs::Rollout;
        Ok(match old_logp {
            _ if is_on_policy(upd, rows.len()) => None,
            Some(old) => Some(old),
            None if from_rollout => Some(rollout_logprobs(rows)?),
            None => {
                let t = Instant::now();
                let old = logprobs_no_grad_with(
                    &self.sampler,
                    rows,
                    cfg.rollout.temperature,
                    64,
                    cfg.optim.share_prefix,
                )?;
                metrics.insert(mk::timing::OLD_LOG_PROB.into(), t.elapsed().as_secs_f64());
                Some(old)
            }
        })
    }

    /// The critic's update on `rows` (`values`: its values before the update) when the run has
    /// a critic; its metrics go into `metrics`. Stops the run after `optim.max_bad_updates`
    /// steps in a row whose critic updates were all non-finite.
    fn update_critic(
        &mut self,
        cfg: &TrainConfig,
        rows: &[Row],
        values: &[Vec<f32>],
        order: &mut dyn FnMut(usize) -> Vec<usize>,
        metrics: &mut BTreeMap<String, f64>,
    ) -> Result<()> {
        let Some(critic) = self.critic.as_mut() else {
            return Ok(());
        };
        let vcfg = turnwise_model::loss::value::ValueLossConfig {
            cliprange_value: cfg.critic.cliprange_value,
            ..Default::default()
        };
        let cm = critic.update(
            rows,
            values,
            &CriticUpdate {
                loss: &vcfg,
                lr: cfg.critic.lr,
                grad_clip: cfg.optim.grad_clip,
                epochs: cfg.optim.ppo_epochs,
                mini_batch: cfg.optim.mini_batch_size,
                share_prefix: cfg.optim.share_prefix,
            },
            order,
        )?;
        let critic_failed = cm.get(mk::critic::APPLIED_UPDATES) == Some(&0.0)
            && cm
                .get(mk::critic::SKIPPED_UPDATES)
                .is_some_and(|&s| s > 0.0);
        metrics.extend(cm);
        if critic_failed {
            self.consecutive_bad_critic += 1;
            if self.consecutive_bad_critic >= cfg.optim.max_bad_updates {
                bail!(
                    "{} consecutive steps had only non-finite critic losses or \
                     gradients, so the critic stopped learning (and with it the \
                     advantages); stopping (lower critic.lr, or raise \
                     optim.max_bad_updates to tolerate more)",
                    self.consecutive_bad_critic
                );
            }
        } else {
            self.consecutive_bad_critic = 0;
        }
        Ok(())
    }
}

/// The rows the loss trains on, from the trajectory rows `rows`: the rows themselves, or, with
/// `optim.samples = "step"` (verl-agent), every environment step of each on the context it was
/// sampled from (config validation refuses a critic and KL in the reward there). Beside each
/// row, its trajectory row and where it starts in it.
fn loss_rows(cfg: &TrainConfig, rows: Vec<Row>) -> (Vec<Row>, Vec<(usize, usize)>) {
    if cfg.optim.samples != TrainSamples::Step {
        let origin = (0..rows.len()).map(|j| (j, 0)).collect();
        return (rows, origin);
    }
    let mut origin = Vec::new();
    let mut steps = Vec::new();
    for (j, row) in rows.iter().enumerate() {
        let s = row.step_samples(cfg.rollout.memory_window);
        origin.extend(
            samples::step_sample_offsets(&row.turn_id)
                .into_iter()
                .take(s.len())
                .map(|o| (j, o)),
        );
        steps.extend(s);
    }
    (steps, origin)
}

/// Statistics of every generated episode of the step (refill rounds included): scores, EM,
/// format, the reward's parts, DAPO's overlong penalty, lengths, turns, tool calls (or, for a
/// task scored by its return, invalid actions) and information gains.
fn generated_metrics(
    cfg: &TrainConfig,
    all: &StepBatch,
    scored_by_return: bool,
) -> BTreeMap<String, f64> {
    let mut metrics = BTreeMap::new();
    let eps = &all.episodes;
    let n = eps.len() as f64;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let of = |f: &dyn Fn(&super::sampling::ScoredEpisode) -> f64| -> Vec<f64> {
        eps.iter().map(f).collect()
    };
    let scores = of(&|e| e.score);
    metrics.insert(mk::critic::SCORE_MEAN.into(), mean(&scores));
    metrics.insert(
        mk::critic::SCORE_MAX.into(),
        scores.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    metrics.insert(
        mk::critic::SCORE_MIN.into(),
        scores.iter().copied().fold(f64::INFINITY, f64::min),
    );
    metrics.insert(mk::train::EM.into(), mean(&of(&|e| e.em)));
    let format_ok = eps.iter().filter(|e| e.format_ok).count();
    metrics.insert(mk::train::FORMAT_OK.into(), format_ok as f64 / n);
    // The parts of a composite reward (the two-turn rubrics), each a batch mean.
    let mut parts: BTreeMap<&str, f64> = BTreeMap::new();
    for (name, v) in eps.iter().flat_map(|e| &e.reward_parts) {
        *parts.entry(name).or_default() += v / n;
    }
    for (name, v) in parts {
        metrics.insert(format!("reward/{name}"), v);
    }
    if cfg.overlong_buffer.enable {
        let overlong = of(&|e| e.overlong);
        metrics.insert(mk::reward::OVERLONG_PENALTY_MEAN.into(), mean(&overlong));
        let hit = overlong.iter().filter(|&&p| p < 0.0).count();
        metrics.insert(mk::reward::OVERLONG_PENALTY_FRAC.into(), hit as f64 / n);
    }
    let lens = of(&|e| e.episode.trajectory.response_len() as f64);
    metrics.insert(mk::length::RESPONSE_MEAN.into(), mean(&lens));
    // verl's names: the longest and shortest response, and the share that reached the response
    // budget (`rollout.max_response_tokens`); the prompts' lengths.
    let max = |v: &[f64]| v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    metrics.insert(mk::length::RESPONSE_MAX.into(), max(&lens));
    metrics.insert(mk::length::RESPONSE_MIN.into(), min(&lens));
    let budget = cfg.rollout.max_response_tokens as f64;
    let clipped = lens.iter().filter(|&&l| l >= budget).count();
    metrics.insert(mk::length::RESPONSE_CLIP_RATIO.into(), clipped as f64 / n);
    let prompts = of(&|e| e.episode.trajectory.prompt_ids.len() as f64);
    metrics.insert(mk::length::PROMPT_MEAN.into(), mean(&prompts));
    metrics.insert(mk::length::PROMPT_MAX.into(), max(&prompts));
    metrics.insert(mk::length::PROMPT_MIN.into(), min(&prompts));
    let agent = of(&|e| e.episode.trajectory.agent_token_count() as f64);
    metrics.insert(mk::length::RESPONSE_AGENT_MEAN.into(), mean(&agent));
    let turns = of(&|e| e.episode.trajectory.num_turns() as f64);
    metrics.insert(mk::env::TURNS_MEAN.into(), mean(&turns));
    if scored_by_return {
        // A game (or an OpenEnv server) has no searches; its invalid-action rate over the
        // batch's turns instead.
        let (turns, invalid) = eps.iter().fold((0, 0), |(n, bad), e| {
            let t = &e.episode.trajectory.turns;
            let b = t
                .iter()
                .filter(|t| matches!(t.action, TurnAction::Invalid { .. }))
                .count();
            (n + t.len(), bad + b)
        });
        metrics.insert(
            mk::train::INVALID_ACTIONS.into(),
            invalid as f64 / turns.max(1) as f64,
        );
    } else {
        let searches = of(&|e| e.episode.trajectory.search_count() as f64);
        metrics.insert(mk::env::TOOL_CALLS_MEAN.into(), mean(&searches));
    }
    if let Some(p) = &all.probes {
        metrics.insert(mk::info_gain::PROBES.into(), p.probes as f64);
        metrics.insert(mk::info_gain::PROBE_FAILURES.into(), p.failures as f64);
        let gains: Vec<f64> = eps
            .iter()
            .flat_map(|e| e.info_gain.iter().flatten())
            .copied()
            .collect();
        metrics.insert(mk::info_gain::MEAN.into(), mean(&gains));
    }
    metrics
}

/// `rollout/logprob_mismatch/*` ([`turnwise_core::trajectory::mismatch`]): the log-probs the
/// rollout recorded for the loss tokens of `rows` against `trainer_logp`, the trainer's of the
/// same tokens under the same weights (`None` for a row it has none of: a skipped on-policy
/// mini-batch). Nothing when no row has both.
fn logprob_mismatch_metrics(
    rows: &[Row],
    trainer_logp: &[Option<&[f32]>],
) -> Result<BTreeMap<String, f64>> {
    use turnwise_core::trajectory::mismatch::{MismatchRow, logprob_mismatch};
    let pairs: Vec<MismatchRow<'_>> = rows
        .iter()
        .zip(trainer_logp)
        .filter_map(|(r, lp)| {
            let lp = (*lp)?;
            (!r.sampled_logprobs.is_empty()).then_some(MismatchRow {
                sampled: &r.sampled_logprobs,
                recomputed: lp,
                loss_mask: &r.loss_mask,
                turn_id: &r.turn_id,
            })
        })
        .collect();
    let m = logprob_mismatch(&pairs).context("the sampler–trainer log-prob mismatch")?;
    Ok(m.metrics(mk::rollout::LOGPROB_MISMATCH)
        .into_iter()
        .collect())
}

/// The log-probs each of `rows` recorded when the rollout sampled its tokens
/// (`optim.old_logprobs = "rollout"`).
fn rollout_logprobs(rows: &[Row]) -> Result<Vec<Vec<f32>>> {
    rows.iter()
        .enumerate()
        .map(|(i, r)| {
            if r.sampled_logprobs.len() != r.response.len() {
                bail!(
                    "optim.old_logprobs = \"rollout\": row {i} has {} recorded log-probs for {} \
                     response tokens",
                    r.sampled_logprobs.len(),
                    r.response.len()
                );
            }
            Ok(r.sampled_logprobs.clone())
        })
        .collect()
}
